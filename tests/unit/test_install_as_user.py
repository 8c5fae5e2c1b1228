"""Engine installs as the engines' user (llmgw/node/install/as_user.py): the request, the child's
environment and protocol, which installers are wrapped. The install run as another user, end to
end, is tests/system/test_least_privilege.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw.node.install import InstallError, InstallSettings, SimInstaller
from llmgw.node.engines import PACKAGE_ROOT
from llmgw.node.install import as_user
from llmgw.node.install.llamacpp import LlamaCppInstaller

SETTINGS = InstallSettings(install_dir=Path("/srv/engines"), cache_dir=Path("/srv/cache"),
                           url_templates={"llama.cpp": "https://mirror.example/{tag}/{asset}"},
                           pypi_index="https://pypi.example/simple", has_nvidia_gpu=True,
                           engine_paths={"vllm": Path("/opt/vllm/bin/python")})


def test_settings_cross_to_the_child_unchanged() -> None:
    assert as_user.settings_from_json(json.loads(json.dumps(as_user.settings_to_json(SETTINGS)))) == SETTINGS


def test_the_child_gets_what_installs_need_and_none_of_the_agents_secrets(tmp_path: Path) -> None:
    agent = {"PATH": "/usr/bin", "HTTPS_PROXY": "http://proxy:3128", "no_proxy": "localhost",
             "PIP_INDEX_URL": "https://pypi.example/simple", "SSL_CERT_FILE": "/etc/ssl/ca.pem",
             "HF_TOKEN": "hf_secret", "AWS_SECRET_ACCESS_KEY": "secret", "LLMGW_ADMIN_KEY": "secret",
             "PYTHONPATH": "/site", "HOME": "/root"}
    env = as_user.child_environment(tmp_path, agent)
    assert {k: env[k] for k in ("PATH", "HTTPS_PROXY", "no_proxy", "PIP_INDEX_URL", "SSL_CERT_FILE")} == {
        k: agent[k] for k in ("PATH", "HTTPS_PROXY", "no_proxy", "PIP_INDEX_URL", "SSL_CERT_FILE")}
    assert not {"HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "LLMGW_ADMIN_KEY"} & set(env)
    assert env["HOME"] == str(tmp_path) and env["TMPDIR"] == str(tmp_path / "tmp")
    assert env["PYTHONPATH"].split(":") == [PACKAGE_ROOT, "/site"]


def test_only_installers_that_write_are_wrapped(tmp_path: Path) -> None:
    installers = {"sim": SimInstaller(), "llama.cpp": LlamaCppInstaller(tmp_path), "vllm": object()}
    wrapped = as_user.as_engine_user(installers, SETTINGS, "llmgw-engine", tmp_path / "home")  # type: ignore[arg-type]
    assert wrapped["sim"] is installers["sim"]  # built in: nothing to install
    assert wrapped["vllm"] is installers["vllm"]  # agent.yaml names its path: never installed
    assert isinstance(wrapped["llama.cpp"], as_user.UserInstaller)
    assert wrapped["llama.cpp"].name == "llama.cpp" and wrapped["llama.cpp"].default_version
    assert as_user.as_engine_user(installers, SETTINGS, "", tmp_path) == installers  # "": the agent's own user


async def test_a_missing_engines_user_fails_the_install_and_hands_nothing_over(tmp_path: Path) -> None:
    installer = as_user.UserInstaller(LlamaCppInstaller(tmp_path), SETTINGS, "llmgw-no-such-user", tmp_path / "home")
    with pytest.raises(InstallError, match="installing llama.cpp b1 as the engines' user: the engines' user "
                                           "'llmgw-no-such-user' does not exist"):
        await installer.install("b1", lambda _: None)
    assert not (tmp_path / "home").exists()


def _child(request: object, home: Path) -> tuple[int, list[dict]]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": PACKAGE_ROOT, as_user.REQUEST_ENV: json.dumps(request),
           "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache")}  # no engine of this machine's is found
    done = subprocess.run([sys.executable, "-m", "llmgw.node.install.as_user"], capture_output=True, text=True,
                          env=env, timeout=60)
    return done.returncode, [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_the_child_reports_an_error_in_words(tmp_path: Path) -> None:
    settings = as_user.settings_to_json(InstallSettings(install_dir=tmp_path / "e", cache_dir=tmp_path / "c"))
    code, lines = _child({"action": "check", "engine": "nosuch", "version": "", "settings": settings}, tmp_path)
    assert code == 1 and lines == [{"error": "this llmgw has no installer for 'nosuch'"}]
    code, lines = _child({"action": "check", "engine": "llama.cpp", "version": "", "settings": settings}, tmp_path)
    assert code == 1 and lines == [{"error": "llama.cpp is not installed on this node"}]
    code, lines = _child({"action": "format-disk"}, tmp_path)
    assert code == 2 and "unknown action 'format-disk'" in lines[0]["error"]


def test_the_child_reports_its_result(tmp_path: Path) -> None:
    code, lines = _child({"action": "install", "engine": "sim", "version": "1",
                          "settings": as_user.settings_to_json(InstallSettings(tmp_path, tmp_path))}, tmp_path)
    assert code == 0 and lines == [{"result": "sim 1 installed"}]
