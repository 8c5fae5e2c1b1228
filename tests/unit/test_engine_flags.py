"""The engine option allowlist (llmgw/catalog/engine_flags): tables, how arguments are read, the node's check."""

from __future__ import annotations

import pytest

from llmgw.catalog.engine_flags import TABLE_MODULES, table_for
from llmgw.cli.engine_flags import installed, parse_llama_help, read_parser, unclassified
from llmgw.catalog.engine_options import violations
from llmgw.node.engines import EngineRefused, check_refused
from llmgw.spec import ShardSpec

#: (engine, args, env, the refused subjects with a word of each reason): every gap issue 12 named.
REFUSED = [
    ("llama.cpp", ["--chat-template-file", "/t.jinja"], {}, {"--chat-template-file": "reads a file"}),
    ("llama.cpp", ["--mmproj-url", "http://h/p.gguf"], {}, {"--mmproj-url": "downloads"}),
    ("llama.cpp", ["--model-draft", "/d.gguf"], {}, {"--model-draft": "draft model"}),
    ("llama.cpp", ["-md", "/d.gguf"], {}, {"-md": "draft model"}),
    ("llama.cpp", ["--hf-repo-draft", "org/repo"], {}, {"--hf-repo-draft": "weights"}),
    ("llama.cpp", ["--rpc", "10.0.0.1:50052"], {}, {"--rpc": "RPC servers"}),
    ("llama.cpp", ["--json-schema-file", "/s.json"], {}, {"--json-schema-file": "reads a file"}),
    ("llama.cpp", [], {"LLAMA_ARG_CHAT_TEMPLATE_FILE": "/t"}, {"LLAMA_ARG_CHAT_TEMPLATE_FILE": "--chat-template-file"}),
    ("llama.cpp", [], {"LLAMA_ARG_MMPROJ_URL": "http://h"}, {"LLAMA_ARG_MMPROJ_URL": "--mmproj-url"}),
    ("llama.cpp", [], {"LLAMA_ARG_SPEC_DRAFT_MODEL": "/d"}, {"LLAMA_ARG_SPEC_DRAFT_MODEL": "draft model"}),
    ("llama.cpp", [], {"LLAMA_ARG_SPEC_DRAFT_HF_REPO": "o/r"}, {"LLAMA_ARG_SPEC_DRAFT_HF_REPO": "weights"}),
    ("llama.cpp", [], {"LLAMA_ARG_RPC": "h:1"}, {"LLAMA_ARG_RPC": "--rpc"}),
    ("llama.cpp", [], {"LLAMA_ARG_NOT_AN_OPTION": "1"}, {"LLAMA_ARG_NOT_AN_OPTION": "not an option variable"}),
    ("vllm", ["--scheduler-cls", "my.Scheduler"], {}, {"--scheduler-cls": "imports"}),
    ("vllm", ["--speculative-config", '{"method": "eagle", "model": "/draft"}'], {}, {"--speculative-config": "draft model"}),
    ("vllm", ["--speculative-config.model", "/draft"], {}, {"--speculative-config.model": "draft model"}),
    ("vllm", ["-sc.model=/draft"], {}, {"-sc.model": "draft model"}),
    ("vllm", ["--hf-config-path", "/cfg"], {}, {"--hf-config-path": "reads a file"}),
    ("vllm", ["--load-format", "tensorizer", "--model-loader-extra-config", '{"tensorizer_uri": "s3://b/m"}'], {},
     {"--load-format": "'tensorizer' is not one of the safe ones", "--model-loader-extra-config": "tensorizer"}),
    ("vllm", ["--ec-transfer-config", '{"ec_connector": "X"}'], {}, {"--ec-transfer-config": "connector"}),
    ("vllm", ["--tool-server", "localhost:8001"], {}, {"--tool-server": "tool servers"}),
    ("vllm", ["--compilation-config.cache_dir", "/tmp/x"], {}, {"--compilation-config.cache_dir": "directories"}),
    ("vllm", ["--distributed-executor-backend", "ray"], {}, {"--distributed-executor-backend": "not one of"}),
    ("vllm", [], {"OMP_TOOL_LIBRARIES": "/t.so"}, {"OMP_TOOL_LIBRARIES": "libraries"}),
    ("vllm", [], {"VLLM_ASSETS_CACHE": "/c"}, {"VLLM_ASSETS_CACHE": "cache directory"}),
    ("vllm", [], {"VLLM_TUNED_CONFIG_FOLDER": "/c"}, {"VLLM_TUNED_CONFIG_FOLDER": "directory"}),
    # One argument with a space is not the option to argparse: it is a positional (the model).
    ("vllm", ["--log-file /etc/x"], {}, {"--log-file /etc/x": "one argument with a space"}),
    ("vllm", ["--max-model-len", "64", "--log-file /etc/x"], {}, {"--log-file /etc/x": "one argument with a space"}),
    ("llama.cpp", ["--log-file /etc/x"], {}, {"--log-file /etc/x": "not classified"}),
    ("sim", ["--lora /x"], {}, {"--lora /x": "one argument with a space"}),
    # Spellings argparse reads as another option, or that can mean another one in another version.
    ("vllm", ["--trust_remote_code"], {}, {"--trust-remote-code": "runs Python code"}),
    ("vllm", ["--trust-remote"], {}, {"--trust-remote": "an abbreviation of --trust-remote-code"}),
    ("vllm", ["--max-model", "64"], {}, {"--max-model": "write the option in full"}),
    ("vllm", ["--sched", "x"], {}, {"--sched": "abbreviates several options"}),
    ("vllm", ["-tp2"], {}, {"-tp2": "not classified"}),  # argparse: no -t, so not -tp with "2"
    ("vllm", ["-t", "2"], {}, {"-t": "an abbreviation of -tp"}),
    ("vllm", ["-qfp8"], {}, {"-qfp8": "-q fp8"}),
    ("sim", ["--fail", "2"], {}, {"--fail": "an abbreviation of --fail-after"}),
    # Flags take no value, so what follows one is read on its own.
    ("vllm", ["--enable-prefix-caching", "/etc/x"], {}, {"/etc/x": "no option before it"}),
    ("vllm", ["--enforce-eager=true"], {}, {"--enforce-eager": "takes no value"}),
    ("vllm", ["--max-model-len", "--trust-remote-code"], {},
     {"--max-model-len": "needs a value", "--trust-remote-code": "runs Python code"}),
    ("llama.cpp", ["--swa-full", "-m", "/other.gguf"], {}, {"-m": "the agent sets the model"}),
    ("llama.cpp", ["-c=4096"], {}, {"-c": "separate arguments"}),
    ("llama.cpp", ["--ctx-size=4096"], {}, {"--ctx-size": "separate arguments"}),
    ("vllm", ["--", "x"], {}, {"--": "ends the options", "'x'": "no option before it"}),
    ("vllm", ["--not-an-option", "1"], {}, {"--not-an-option": "not classified for vllm 0.32.0"}),
]


@pytest.mark.parametrize(("engine", "args", "env", "expected"), REFUSED)
def test_refused_with_the_reason(engine: str, args: list[str], env: dict[str, str], expected: dict[str, str]) -> None:
    found = {v.subject: v.reason for v in violations(engine, args, env)}
    found = {(repr(k) if repr(k) in expected else k): r for k, r in found.items()}
    assert set(found) == set(expected), found
    for subject, word in expected.items():
        assert word in found[subject], (subject, found[subject])


#: (engine, args, env): still accepted.
ACCEPTED = [
    ("vllm", ["--max-model-len", "4096", "--max-num-seqs=8", "--block-size", "128", "--enable-prefix-caching"], {}),
    ("vllm", ["--no-enable-prefix-caching", "--enforce-eager", "--dtype", "bfloat16", "--seed", "-1"], {}),
    ("vllm", ["--max_num_batched_tokens", "2048", "-O3", "--load-format", "safetensors", "-q", "fp8"], {}),
    ("vllm", ["--spec-method", "ngram", "--spec-tokens", "4", "--attention-config.backend", "FLASH_ATTN"], {}),
    ("vllm", ["--cudagraph-capture-sizes", "1", "2", "4", "--enable-lora"], {}),
    ("vllm", ["--default-chat-template-kwargs", '{"enable_thinking": false}'], {"VLLM_CPU_KVCACHE_SPACE": "4"}),
    ("llama.cpp", ["-c", "4096", "-np", "2", "-t", "1", "--temp", "0.7"], {}),
    ("llama.cpp", ["--ctx_size", "4096", "-fa", "on", "--no-warmup", "-ngl", "10", "--chat-template", "chatml"], {}),
    ("llama.cpp", ["--control-vector-layer-range", "1", "4", "--seed", "-1"], {"LLAMA_ARG_CTX_SIZE": "4096"}),
    ("sim", ["--max-model-len", "4096", "--decode-us-per-token=100", "--enable-lora", "--fail-after", "3"], {}),
    ("sglang", ["--context-length", "4096", "--mem-fraction-static", "0.8", "--disable-radix-cache"], {}),
]


@pytest.mark.parametrize(("engine", "args", "env"), ACCEPTED)
def test_safe_settings_are_accepted(engine: str, args: list[str], env: dict[str, str]) -> None:
    assert violations(engine, args, env) == []


def test_every_problem_is_listed_in_argument_order() -> None:
    found = violations("vllm", ["--rpc", "x", "--max-model-len", "64", "--tool-server", "h", "--uds", "/s"], {})
    assert [v.where for v in found] == ["engine_args[0]", "engine_args[4]", "engine_args[6]"]
    assert "not classified" in found[0].reason, "--rpc is llama.cpp's; vLLM has none (its value goes with it)"


def test_the_node_names_its_engine_version_for_an_unclassified_option() -> None:
    spec = ShardSpec(id="m-1", model="m", engine="vllm", source="/w", args=("--brand-new-option", "1"), gpus=(0,))
    with pytest.raises(EngineRefused) as err:
        check_refused(spec, version="0.99.0")
    message = str(err.value)
    assert "--brand-new-option is not allowed: it is not classified for vllm 0.99.0" in message
    assert "llmgw's table was made from vllm 0.32.0" in message and "docs/engine-options.md" in message


def test_tables_are_consistent() -> None:
    for engine in TABLE_MODULES:
        table = table_for(engine)
        assert table is not None and table.engine == engine and table.version
        for option in table.options:
            assert option.refused is None or option.refused[0].islower(), option
            assert option.allowed_values is None or option.refused is None, option


HELP = """----- common params -----

-h,    --help, --usage                  print usage and exit
-c,    --ctx-size N                     size of the prompt context (default: 0, 0 = loaded from model)
                                        (env: LLAMA_ARG_CTX_SIZE)
-kvo,  --kv-offload, -nkvo, --no-kv-offload
                                        whether to enable KV cache offloading (default: enabled)
                                        (env: LLAMA_ARG_KV_OFFLOAD)
--control-vector-layer-range START END
                                        layer range to apply the control vector(s) to
-ot,   --override-tensor <tensor name pattern>=<buffer type>,...
                                        override tensor buffer type
"""


def test_llama_help_is_read_into_options() -> None:
    found = {f.names: (f.values, f.env) for f in parse_llama_help(HELP)}
    assert found == {
        ("-h", "--help", "--usage"): (0, None),
        ("-c", "--ctx-size"): (1, "LLAMA_ARG_CTX_SIZE"),
        ("-kvo", "--kv-offload", "-nkvo", "--no-kv-offload"): (0, "LLAMA_ARG_KV_OFFLOAD"),
        ("--control-vector-layer-range",): (2, None),
        ("-ot", "--override-tensor"): (1, None),
    }


@pytest.mark.parametrize("engine", sorted(TABLE_MODULES))
def test_every_option_of_the_installed_engine_is_classified(engine: str) -> None:
    """Where the engine is installed (llmgw's engine cache), its parser has no option the table lacks."""
    table = table_for(engine)
    assert table is not None
    found_install = installed(engine)
    if found_install is None:
        pytest.skip(f"{engine} is not installed in llmgw's engine cache")
    version, program = found_install
    if not getattr(__import__(TABLE_MODULES[engine], fromlist=["TABLE"]), "COMPLETE", True):
        pytest.skip(f"{engine}'s table is a hand-made subset (its module docstring says how to complete it)")
    if version != table.version:
        pytest.skip(f"{engine} {version} is installed, the table is for {table.version}: "
                    f"run python -m llmgw.cli.engine_flags {engine}")
    missing, gone = unclassified(table, read_parser(engine, program))
    assert not missing, f"not classified: {[f.names for f in missing]}"
    assert not gone, f"classified but unknown to {engine} {version}: {gone}"


def test_refresh_lists_what_a_table_lacks_as_lines_refused_until_classified(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from llmgw.catalog.engine_flags import Table, UNCLASSIFIED, opt
    from llmgw.cli import engine_flags as refresh

    full = table_for("sim")
    assert full is not None and refresh.main(["sim"]) == 0
    shorter = Table("sim", full.version, full.style, tuple(o for o in full.options if o.name != "--fail-after")
                    + (opt("--retired-option"),))
    monkeypatch.setattr(refresh, "table_for", lambda engine: shorter)
    assert refresh.main(["sim"]) == 1
    out = capsys.readouterr().out
    assert "1 not classified, 1 no longer known" in out
    assert "opt('--fail-after', values=1, refused=UNCLASSIFIED)," in out and "# --retired-option:" in out
    assert UNCLASSIFIED.startswith("it is not classified")
