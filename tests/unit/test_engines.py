"""Engine adapters: what an engine inherits from the agent."""

from llmgw.node.engines import base_environment


def test_engines_inherit_only_allowlisted_variables() -> None:
    env = base_environment({"PATH": "/bin", "LC_ALL": "C", "AWS_SECRET_ACCESS_KEY": "x", "LD_PRELOAD": "/evil.so",
                            "HTTPS_PROXY": "http://p", "HOME": "/root"})
    assert env == {"PATH": "/bin", "LC_ALL": "C", "HOME": "/root"}


def test_node_engines_apply_the_llamacpp_thread_setting() -> None:
    from llmgw.node.engines import ENGINES, node_engines

    assert node_engines() == ENGINES
    assert node_engines(3)["llama.cpp"].threads == 3
    assert ENGINES["llama.cpp"].threads is None  # the shared table is not changed
