"""Unit tests for llmgw.config: defaults, overrides, and every error message path."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from llmgw.config import (
    Address,
    AgentConfig,
    AgentTLS,
    ConfigError,
    ServerConfig,
    StoreConfig,
    load_agent_config,
    load_server_config,
    parse_address,
    parse_duration,
)
from llmgw.labels import RULE


#: Seconds a fresh interpreter may take to import llmgw.config (generous: CI machines are slow).
SUBPROCESS_TIMEOUT = 60


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def server_error(tmp_path: Path, text: str, overrides: dict | None = None) -> str:
    path = write(tmp_path, "server.yaml", text)
    with pytest.raises(ConfigError) as info:
        load_server_config(path, overrides or {})
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    return message[len(f"{path}: "):]


def agent_error(tmp_path: Path, text: str, overrides: dict | None = None) -> str:
    path = write(tmp_path, "agent.yaml", text)
    with pytest.raises(ConfigError) as info:
        load_agent_config(path, overrides or {})
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    return message[len(f"{path}: "):]


# --- defaults -----------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "# nothing here\n", "{}\n"])
def test_empty_server_file_gives_defaults(tmp_path: Path, text: str) -> None:
    config = load_server_config(write(tmp_path, "server.yaml", text), {})
    assert config == load_server_config(None, {}) == ServerConfig()
    assert config.state_dir == Path("/var/lib/llmgw")
    assert config.rpc_listen == Address("127.0.0.1", 7070)
    assert config.http_listen == Address("127.0.0.1", 8080)
    assert config.advertise_hosts == ()
    assert config.store == StoreConfig("sqlite", path=Path("/var/lib/llmgw/llmgw.db"))
    assert config.store.url == "sqlite:////var/lib/llmgw/llmgw.db"
    assert (config.heartbeat_interval, config.node_lost_after, config.replace_grace) == (2, 10, 30)
    assert dict(config.engines) == {}
    assert config.log_level == "info"
    assert config.ca_dir == Path("/var/lib/llmgw/ca")


def test_empty_agent_file_gives_defaults(tmp_path: Path) -> None:
    config = load_agent_config(write(tmp_path, "agent.yaml", ""), {})
    assert config.node_id == socket.gethostname()
    assert config.control_planes == (Address("127.0.0.1", 7070),)
    assert config.state_dir == Path("/var/lib/llmgw-agent")
    assert config.tls == AgentTLS(
        ca=Path("/var/lib/llmgw-agent/tls/ca.pem"),
        cert=Path("/var/lib/llmgw-agent/tls/cert.pem"),
        key=Path("/var/lib/llmgw-agent/tls/key.pem"),
    )
    assert config.engine_host is None
    assert (config.heartbeat_interval, config.reconnect_backoff_max) == (2, 1)
    assert config.log_level == "info"
    assert config == AgentConfig()


def test_loading_config_loads_no_other_part_of_llmgw() -> None:
    # A fresh interpreter: this one has imported the whole program long ago.
    code = ("import sys; from llmgw.config import load_agent_config, load_server_config; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('llmgw.'))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            timeout=SUBPROCESS_TIMEOUT).stdout.split()
    others = [m for m in loaded if not m.startswith(("llmgw.config", "llmgw.credentials", "llmgw.lazy", "llmgw.labels"))]
    assert not others, f"importing llmgw.config loaded {others}"


def test_configs_are_frozen() -> None:
    config = load_server_config(None, {})
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.state_dir = Path("/x")  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.engines["vllm"] = "1"  # type: ignore[index]


# --- full files ---------------------------------------------------------------------------


def test_full_server_file(tmp_path: Path) -> None:
    config = load_server_config(write(tmp_path, "server.yaml", """
state_dir: state
rpc_listen: "[::]:7443"
http_listen: 0.0.0.0:80
advertise_hosts: [cp1.example.org, 10.0.0.5, "[fd00::5]"]
store:
  url: postgresql://llmgw@db1/llmgw
heartbeat_interval: 500ms
node_lost_after: 1m30s
replace_grace: 0
engines:
  vllm: "0.10.2"
  llama.cpp: b6000
log_level: DEBUG
"""), {})
    assert config.state_dir == tmp_path / "state"  # relative to the file's directory
    assert config.rpc_listen == Address("::", 7443) and str(config.rpc_listen) == "[::]:7443"
    assert str(config.http_listen) == "0.0.0.0:80"
    assert config.advertise_hosts == ("cp1.example.org", "10.0.0.5", "fd00::5")
    assert config.store == StoreConfig("postgresql", dsn="postgresql://llmgw@db1/llmgw")
    assert config.store.url == "postgresql://llmgw@db1/llmgw"
    assert (config.heartbeat_interval, config.node_lost_after, config.replace_grace) == (0.5, 90, 0)
    assert dict(config.engines) == {"vllm": "0.10.2", "llama.cpp": "b6000"}
    assert config.log_level == "debug"


@pytest.mark.parametrize(
    ("store", "expected"),
    [
        ("url: /srv/llmgw.db", StoreConfig.sqlite(Path("/srv/llmgw.db"))),
        ("url: sqlite:///srv/llmgw.db", StoreConfig.sqlite(Path("/srv/llmgw.db"))),
        ("url: sub/x.db", StoreConfig.sqlite(Path("/st/sub/x.db"))),  # relative to state_dir
        ("dsn: host=db1 dbname=llmgw", StoreConfig("postgresql", dsn="host=db1 dbname=llmgw")),
        ("url: postgres://db1/llmgw", StoreConfig("postgresql", dsn="postgres://db1/llmgw")),
        ("url: host=db1 dbname=llmgw", StoreConfig("postgresql", dsn="host=db1 dbname=llmgw")),
        ("url: sqlite:////srv/a=b.db", StoreConfig.sqlite(Path("/srv/a=b.db"))),
        ("{}", StoreConfig.sqlite(Path("/st/llmgw.db"))),
    ],
)
def test_store_forms(tmp_path: Path, store: str, expected: StoreConfig) -> None:
    text = f"state_dir: /st\nstore: {store}\n" if store == "{}" else f"state_dir: /st\nstore:\n  {store}\n"
    assert load_server_config(write(tmp_path, "server.yaml", text), {}).store == expected


def test_full_agent_file(tmp_path: Path) -> None:
    config = load_agent_config(write(tmp_path, "agent.yaml", """
node_id: gpu-07
control_planes: ["cp1.example.org:7070", "10.0.0.6:7070", "[::1]:7071"]
state_dir: /srv/agent
tls:
  ca: /etc/llmgw/ca.pem
  key: keys/key.pem
engine_host: 10.1.2.3
heartbeat_interval: 1
reconnect_backoff_max: 2m
log_level: warning
"""), {})
    assert config.node_id == "gpu-07"
    assert [str(a) for a in config.control_planes] == [
        "cp1.example.org:7070", "10.0.0.6:7070", "[::1]:7071"
    ]
    assert config.tls == AgentTLS(
        ca=Path("/etc/llmgw/ca.pem"),
        cert=Path("/srv/agent/tls/cert.pem"),  # unset: default under state_dir
        key=tmp_path / "keys" / "key.pem",
    )
    assert config.engine_host == "10.1.2.3"
    assert (config.heartbeat_interval, config.reconnect_backoff_max) == (1, 120)
    assert config.log_level == "warning"


# --- overrides ------------------------------------------------------------------------------


def test_overrides_replace_file_values_and_derived_defaults_follow(tmp_path: Path) -> None:
    path = write(tmp_path, "server.yaml", "state_dir: /from/file\nlog_level: error\n")
    config = load_server_config(path, {"state_dir": "/from/up", "http_listen": "127.0.0.1:0"})
    assert config.state_dir == Path("/from/up")
    assert config.store.path == Path("/from/up/llmgw.db")  # follows the overridden state_dir
    assert config.http_listen == Address("127.0.0.1", 0)
    assert config.log_level == "error"  # untouched file value stays


def test_overrides_dotted_and_nested_keys(tmp_path: Path) -> None:
    path = write(tmp_path, "server.yaml", "store:\n  url: /a.db\n")
    assert load_server_config(path, {"store.url": "/b.db"}).store.path == Path("/b.db")
    assert load_server_config(path, {"store": {"url": "/c.db"}}).store.path == Path("/c.db")
    agent = load_agent_config(None, {"tls.cert": "/x/c.pem", "node_id": "n9",
                                     "state_dir": Path("/agent")})
    assert agent.tls.cert == Path("/x/c.pem") and agent.tls.key == Path("/agent/tls/key.pem")
    assert agent.node_id == "n9"


def test_relative_override_path_is_relative_to_the_current_directory(tmp_path: Path) -> None:
    path = write(tmp_path, "server.yaml", "")
    assert load_server_config(path, {"state_dir": "rel"}).state_dir == Path.cwd() / "rel"


def test_override_errors_say_so(tmp_path: Path) -> None:
    message = server_error(tmp_path, "", {"heartbeat_interval": "soon"})
    assert message == ('heartbeat_interval: expected a duration like 10, "10s", "2m" or "500ms", '
                       'got "soon" (from an override)')
    with pytest.raises(ConfigError) as info:
        load_server_config(None, {"store.nope": 1})
    assert str(info.value).startswith("server.yaml: store: unknown key 'nope'")


# --- error messages ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("store:\n  dns: x\n", "store: unknown key 'dns' (did you mean 'dsn'?)"),
        ("rpc_lisen: 1.2.3.4:1\n", "unknown key 'rpc_lisen' (did you mean 'rpc_listen'?)"),
        ("rpc_listen: 7070\n", 'rpc_listen: expected "host:port", got 7070'),
        ("rpc_listen: localhost\n", 'rpc_listen: expected "host:port", got "localhost"'),
        ("rpc_listen: '::1:7070'\n",
         'rpc_listen: IPv6 addresses go in brackets, e.g. "[::1]:7070"; got "::1:7070"'),
        ("rpc_listen: '[::g]:1'\n", 'rpc_listen: "::g" in brackets is not an IPv6 address'),
        ("rpc_listen: ':7070'\n",
         'rpc_listen: missing host in ":7070" (use "0.0.0.0:PORT" to listen on every address)'),
        ("http_listen: 'a:b'\n", 'http_listen: port "b" is not a number, in "a:b"'),
        ("http_listen: 'a:70000'\n", 'http_listen: port 70000 is out of range 0-65535, in "a:70000"'),
        ("http_listen: 'bad_host!:80'\n",
         'http_listen: "bad_host!" is neither an IP address nor a host name'),
        ("advertise_hosts: cp1\n", 'advertise_hosts: expected a list, got "cp1"'),
        ("advertise_hosts: [cp1, 'a b']\n",
         'advertise_hosts[1]: "a b" is neither an IP address nor a host name'),
        ("heartbeat_interval: 0\n", "heartbeat_interval: must be more than 0 seconds, got 0"),
        ("heartbeat_interval: true\n",
         'heartbeat_interval: expected a duration like 10, "10s", "2m" or "500ms", got true'),
        ("replace_grace: -1\n", "replace_grace: expected a duration of 0 seconds or more, got -1"),
        ("heartbeat_interval: 5s\nnode_lost_after: 5s\n",
         "node_lost_after: must be longer than heartbeat_interval (5s <= 5s), "
         "or every node is lost between two heartbeats"),
        ("log_level: loud\n",
         'log_level: expected one of debug, info, warning, error, critical, got "loud"'),
        ("store: sqlite.db\n", 'store: expected a mapping of keys, got "sqlite.db"'),
        ("store:\n  url: mysql://db/x\n",
         "store.url: unsupported scheme 'mysql': use a SQLite file path, sqlite:///PATH, "
         "a postgresql:// URL or a libpq key=value DSN"),
        ("store:\n  dsn: /srv/llmgw.db\n",
         "store.dsn: is for PostgreSQL (a postgresql:// URL or libpq key=value, e.g. host=db1 dbname=llmgw): "
         "a SQLite file goes in store.url as sqlite:///PATH or a path"),
        ("store:\n  dsn: \"host=db1 password='s3cret\"\n",
         "store.dsn: looks like a libpq key=value DSN but is not one: key=value pair 2 has an unterminated "
         "quoted value (for a SQLite file whose name holds '=', write sqlite:///PATH)"),
        ("store:\n  url: /a.db\n  dsn: host=x\n", "store: give url or dsn, not both"),
        ("store:\n  url: ''\n", 'store.url: expected a non-empty string, got ""'),
        ("store:\n  url: 'sqlite://'\n",
         "store.url: the SQLite URL names no file: use sqlite:///path/to/llmgw.db"),
        ("engines:\n  vllm: 0.10\n",
         "engines.vllm: expected a version string, got the number 0.1 (YAML reads an unquoted "
         'version as a number, 0.10 as 0.1): quote it, e.g. vllm: "0.10.2"'),
        ("engines:\n  VLLM: '1'\n",
         "engines.VLLM: engine names are lower-case letters, digits, '.', '_' and '-'"),
        ("engines:\n  vllm:\n", "engines.vllm: version: expected a non-empty string, got null (empty)"),
        ("state_dir: [a]\n", "state_dir: expected a non-empty string, got a list"),
        ("1: x\n", "keys must be strings, got 1"),
        ("- a\n", "expected a mapping of keys at the top, got a list"),
        ("log_level: info\nlog_level: debug\n",
         "line 2, column 1: invalid YAML: key 'log_level' is given twice"),
        ("store: [\n", "line 2, column 1: invalid YAML: expected the node content, "
                       "but found '<stream end>'"),
    ],
)
def test_server_errors(tmp_path: Path, text: str, message: str) -> None:
    assert server_error(tmp_path, text) == message


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('control_planes: ["a:1", "x"]\n', 'control_planes[1]: expected "host:port", got "x"'),
        ("control_planes: []\n", 'control_planes: at least one "host:port" is needed'),
        ("control_planes: ['a:0']\n", 'control_planes[0]: port 0 is out of range 1-65535, in "a:0"'),
        ("node_id: 'my node'\n", "node_id: invalid name 'my node': use 1-128 letters, digits, "
                                 "'.', '_', '-' or '@', starting with a letter or digit "
                                 "(node ids name the node's certificate)"),
        ("tls:\n  certificate: /x\n",
         "tls: unknown key 'certificate' (did you mean 'cert'?)"),
        ("tls:\n  cert: 5\n", "tls.cert: expected a non-empty string, got 5"),
        ("engine_host: 'a b'\n", 'engine_host: "a b" is neither an IP address nor a host name'),
        ("reconnect_backoff_max: 0s\n", 'reconnect_backoff_max: must be more than 0 seconds, got "0s"'),
        ("engine_urls:\n  Vllm: https://mirror/x\n",
         "engine_urls.Vllm: engine names are lower-case letters, digits, '.', '_' and '-'"),
        ("engine_urls:\n  vllm: ftp://mirror/x\n", 'engine_urls.vllm: expected an http(s) URL, got "ftp://mirror/x"'),
        ("labels:\n  rack: r 1\n", "labels: label rack: 'r 1' cannot be a label value: " + RULE),
        ("labels: [rack=r1]\n", "labels: expected a mapping of label: value, got ['rack=r1']"),
        ("engine_user: Root\n", 'engine_user: "Root" is not a user name (lower-case letters, digits, \'_\' and '
                                 "'-'), or \"\" for the agent's own user"),
        ("disabled_engines: [vllm, trtllm]\n",
         'disabled_engines[1]: "trtllm" is not an engine llmgw runs (one of: llama.cpp, sglang, sim, vllm)'),
        ("servers: [a:1]\n",
         "unknown key 'servers' (known keys: cache_dir, control_planes, disabled_engines, engine_host, engine_urls, "
         "engine_user, engines, firewall, heartbeat_interval, hf_endpoint, install_dir, labels, llamacpp, log_level, node_id, "
         "pypi_index, "
         "reconnect_backoff_max, state_dir, tls, weights_dir)"),
    ],
)
def test_agent_errors(tmp_path: Path, text: str, message: str) -> None:
    assert agent_error(tmp_path, text) == message


def test_agent_labels_and_disabled_engines(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("labels:\n  rack: r1\n  tier: 2\ndisabled_engines: [llamacpp, vllm]\n")
    config = load_agent_config(path)
    assert dict(config.labels) == {"rack": "r1", "tier": "2"}
    assert config.disabled_engines == frozenset({"llama.cpp", "vllm"})
    assert not load_agent_config(None).labels and not load_agent_config(None).disabled_engines
    assert load_agent_config(None).engine_user is None


def test_agent_engine_user(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("engine_user: ml-engines\n")
    assert load_agent_config(path).engine_user == "ml-engines"
    path.write_text('engine_user: ""\n')
    assert load_agent_config(path).engine_user == ""


def test_default_node_id_from_an_unusable_hostname(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "bad host")
    message = agent_error(tmp_path, "")
    assert message.startswith("node_id: the host name cannot be the default: invalid name 'bad host'")
    assert message.endswith("set node_id")
    assert load_agent_config(write(tmp_path, "agent.yaml", "node_id: ok\n"), {}).node_id == "ok"


def test_file_problems(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=f"^{missing}: file not found$"):
        load_server_config(missing, {})
    with pytest.raises(ConfigError, match="is a directory"):
        load_agent_config(tmp_path, {})
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_server_config(tmp_path / "bin.yaml", {})


# --- the value parsers ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(10, 10.0), (2.5, 2.5), ("10", 10.0), ("10s", 10.0), ("2m", 120.0), ("500ms", 0.5),
     ("1h", 3600.0), ("1m30s", 90.0), (" 1m 30s ", 90.0), ("0", 0.0), ("1.5s", 1.5)],
)
def test_parse_duration(value: object, seconds: float) -> None:
    assert parse_duration(value) == seconds


@pytest.mark.parametrize("value", ["10 seconds", "s", "1x", "", "m5", None, [1], float("inf"),
                                   "nan", False])
def test_parse_duration_refuses(value: object) -> None:
    with pytest.raises(ValueError):
        parse_duration(value)


@pytest.mark.parametrize(
    ("text", "address"),
    [("127.0.0.1:7070", Address("127.0.0.1", 7070)), ("[::1]:7070", Address("::1", 7070)),
     ("cp1.example.org:1", Address("cp1.example.org", 1)), ("[::]:0", Address("::", 0))],
)
def test_parse_address_round_trip(text: str, address: Address) -> None:
    parsed = parse_address(text, listen=True)
    assert parsed == address
    assert str(parsed) == text


def test_docs_list_every_key() -> None:
    docs = (Path(__file__).parents[2] / "docs" / "config.md").read_text()
    keys = [f.name for f in attrs.fields(ServerConfig)] + ["store.url", "store.dsn"]
    # The attribute llamacpp_threads is the file's llamacpp.threads; engine_paths is engines.<engine>.<key>.
    keys += [f.name for f in attrs.fields(AgentConfig) if f.name not in ("tls", "llamacpp_threads", "engine_paths")]
    keys += ["llamacpp.threads", "engines.vllm.python", "engines.sglang.python", "engines.llama.cpp.server"]
    keys += [f"tls.{f.name}" for f in attrs.fields(AgentTLS)]
    missing = [key for key in keys if f"| `{key}` |" not in docs]
    assert not missing, f"docs/config.md does not document {missing}"


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.9.9.9", True), ("::1", True), ("[::1]", True), ("::ffff:127.0.0.1", True),
    ("localhost", True), ("0.0.0.0", False), ("::", False), ("10.0.0.5", False), ("fe80::1%eth0", False),
    ("gateway.example", False),
])
def test_loopback_hosts(host: str, loopback: bool) -> None:
    """One rule for 'loopback only' (the auth warning of the control plane, /metrics access)."""
    from llmgw.config.values import is_loopback_host

    assert is_loopback_host(host) is loopback
