"""PrefixTree and the prompt text it keys requests by."""

from __future__ import annotations

from llmgw.router.prefixtree import PrefixTree, path_hashes, prompt_text


def test_prompt_text_chat_grows_with_the_conversation() -> None:
    first = prompt_text({"messages": [{"role": "system", "content": "S" * 300}, {"role": "user", "content": "hi"}]})
    second = prompt_text({"messages": [{"role": "system", "content": "S" * 300}, {"role": "user", "content": "hi"},
                                       {"role": "assistant", "content": "yo"}]})
    assert second.startswith(first)
    assert prompt_text({"prompt": "abc"}) == "abc"
    assert prompt_text({}) == ""
    parts = prompt_text({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]})
    assert '"text":"x"' in parts


def test_path_hashes_share_prefix_and_salt_separates() -> None:
    a = path_hashes("x" * 256 + "a" * 128, chunk=128)
    b = path_hashes("x" * 256 + "b" * 128, chunk=128)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert path_hashes("x" * 127, chunk=128) == []
    assert path_hashes("x" * 256, salt="t1", chunk=128)[0] != path_hashes("x" * 256, salt="t2", chunk=128)[0]


def test_match_and_lru_eviction_keeps_roots() -> None:
    tree = PrefixTree(max_nodes_per_replica=4)
    shared = path_hashes("s" * 256 + "one" * 100, chunk=128)  # 4 nodes
    tree.insert("r", shared)
    assert tree.match("r", shared) == 4 and tree.match("other", shared) == 0
    second = path_hashes("s" * 256 + "two" * 50, chunk=128)  # shares 2 nodes, adds 1
    tree.insert("r", second)
    assert tree.size("r") == 4
    assert tree.match("r", second) == 3  # the new path is whole
    assert tree.match("r", shared) == 3  # the old path lost its deepest node, not its root
    tree.forget("r")
    assert tree.size() == 0
