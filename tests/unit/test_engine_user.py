"""Who engines run as (llmgw/node/engine_user.py): the default, the checks, the GPU devices' group."""

from __future__ import annotations

import importlib.util
import os
import pwd
from pathlib import Path

import pytest

from llmgw.node import engine_user
from llmgw.node.engines import ENGINE_PATH


def test_the_default_is_llmgw_engine_for_root_and_the_agents_own_user_otherwise() -> None:
    assert engine_user.wanted_user(None, euid=0) == "llmgw-engine"
    assert engine_user.wanted_user(None, euid=1000) == ""
    assert engine_user.wanted_user("", euid=0) == ""
    assert engine_user.wanted_user("ml", euid=1000) == "ml"


def test_no_name_means_the_agent_itself() -> None:
    assert engine_user.resolve("") is None
    assert engine_user.describe(None) == "the agent's own user"


def test_a_missing_user_is_refused_with_how_to_create_it() -> None:
    with pytest.raises(engine_user.EngineUserError, match=r"'llmgw-nobody-here' does not exist on this node: "
                                                          r"create it \(`useradd --system"):
        engine_user.resolve("llmgw-nobody-here")


def test_root_is_never_the_engines_user() -> None:
    with pytest.raises(engine_user.EngineUserError, match="is root"):
        engine_user.resolve("root")


@pytest.mark.skipif(os.geteuid() != 0, reason="an agent that is not root cannot switch to another user at all")
def test_a_user_resolves_with_its_own_groups_and_the_gpu_devices_group(tmp_path: Path) -> None:
    nobody = pwd.getpwnam("nobody")
    dev = tmp_path / "dev"
    dev.mkdir()
    for name, gid in (("nvidiactl", 44), ("nvidia0", 44), ("nvidia-uvm", 0), ("null", 7)):
        (dev / name).touch()
        os.chown(dev / name, 0, gid)
    user = engine_user.resolve("nobody", dev=dev)
    assert user is not None and (user.uid, user.gid) == (nobody.pw_uid, nobody.pw_gid)
    assert 44 in user.groups and 0 not in user.groups and 7 not in user.groups
    assert engine_user.describe(user).startswith(f"nobody (uid {nobody.pw_uid}, groups ")


def test_the_engines_home_belongs_to_the_engines_user(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("handing a directory to another user needs root")
    nobody = pwd.getpwnam("nobody")
    user = engine_user.EngineUser("nobody", nobody.pw_uid, nobody.pw_gid, ())
    home = tmp_path / "engine-home"
    (home / ".cache").mkdir(parents=True)
    assert engine_user.prepare_home(home, user) == home
    for path in (home, home / ".cache", home / "tmp"):
        assert (path.stat().st_uid, path.stat().st_gid) == (nobody.pw_uid, nobody.pw_gid)
    assert home.stat().st_mode & 0o777 == 0o700
    env = engine_user.home_env(home)
    assert env["HOME"] == str(home) and env["TMPDIR"] == str(home / "tmp") and env[engine_user.UNDUMPABLE_ENV] == "1"


def test_the_engine_paths_flag_is_the_agents() -> None:
    spec = importlib.util.spec_from_file_location("llmgw_undumpable", Path(ENGINE_PATH) / "llmgw_undumpable.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.FLAG_ENV == engine_user.UNDUMPABLE_ENV
    assert module.apply() is False  # not asked for here: this test process stays dumpable


def test_created_users_are_read_back_once_each(tmp_path: Path) -> None:
    record = tmp_path / "created-users"
    assert engine_user.created_users(record) == []
    record.write_text("llmgw-engine\n\nllmgw-engine\nml\n")
    assert engine_user.created_users(record) == ["llmgw-engine", "ml"]
