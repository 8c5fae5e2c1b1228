"""The install framework: Converger with a fake installer, and apt-get lock waiting with a real process."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import trio
import trio.testing

from llmgw.node.install import (DISABLED_DETAIL, PROBE_INTERVAL, Converger, InstallError, Progress, SimInstaller, build_installers,
                                InstallSettings)
from llmgw.node.install.apt import apt_install
from llmgw.spec import EngineInfo


class FakeInstaller:
    """An engine that "installs" by setting a flag; fails ``failures`` times first."""

    name = "fake"
    default_version = "1.0"

    def __init__(self, failures: int = 0, installable: bool = True) -> None:
        self.failures = failures
        self.installable = installable
        self.installed_version = ""
        self.installs: list[str] = []
        self.gate: trio.Event | None = None  # when set, install waits on it
        self.cancelled = False

    async def probe(self) -> EngineInfo:
        return EngineInfo(
            self.name,
            installed=bool(self.installed_version),
            version=self.installed_version,
            installable=self.installable,
            detail="" if self.installable else "needs a GPU",
        )

    async def install(self, version: str, progress: Progress) -> None:
        self.installs.append(version)
        progress(f"downloading fake-{version}.tar.gz (16 MB)")
        if self.gate is not None:
            try:
                await self.gate.wait()
            except trio.Cancelled:
                self.cancelled = True
                raise
        if self.failures:
            self.failures -= 1
            raise InstallError("the mirror answered HTTP 503")
        self.installed_version = version

    async def check(self) -> str:
        return f"fake {self.installed_version}"


async def _states_until(converger: Converger, done, deadline: float = 30) -> list[str]:
    """Collects the fake engine's successive states until ``done(info)`` holds (at most ``deadline`` s)."""
    seen: list[str] = []
    version = -1
    with trio.fail_after(deadline):
        while True:
            version = await converger.wait_changed(version)
            info = {e.name: e for e in converger.engines()}.get("fake")
            if info is not None and (not seen or seen[-1] != info.state):
                seen.append(info.state)
            if info is not None and done(info):
                return seen


async def test_converges_on_the_default_version_with_progress() -> None:
    fake = FakeInstaller()
    fake.gate = trio.Event()
    converger = Converger({"fake": fake, "sim": SimInstaller()})
    async with trio.open_nursery() as nursery:
        await nursery.start(converger.run)
        assert {e.name: e.installed for e in converger.engines()} == {"fake": False, "sim": True}
        converger.want({"fake": ""})
        states = await _states_until(converger, lambda e: e.state.startswith("installing: downloading"))
        fake.gate.set()
        await _states_until(converger, lambda e: e.installed and e.state == "")
        nursery.cancel_scope.cancel()
    assert fake.installs == ["1.0"]
    assert states[-1] == "installing: downloading fake-1.0.tar.gz (16 MB)"
    assert await converger.check("fake") == "fake 1.0"


async def test_an_engine_installed_beside_the_agent_is_reported_within_a_probe_interval(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = FakeInstaller()
    converger = Converger({"fake": fake, "sim": SimInstaller()})
    async with trio.open_nursery() as nursery:
        await nursery.start(converger.run)
        assert not {e.name: e for e in converger.engines()}["fake"].installed
        started = trio.current_time()
        fake.installed_version = "1.0"  # installed by hand: nobody asked this node for it
        await _states_until(converger, lambda e: e.installed and e.version == "1.0", deadline=2 * PROBE_INTERVAL)
        assert trio.current_time() - started <= PROBE_INTERVAL
        nursery.cancel_scope.cancel()
    assert fake.installs == []


async def test_a_disabled_engine_is_reported_as_such_and_never_installed() -> None:
    fake = FakeInstaller()
    converger = Converger({"fake": fake, "sim": SimInstaller()}, disabled=["fake"])
    async with trio.open_nursery() as nursery:
        await nursery.start(converger.run)
        converger.want({"fake": "", "sim": ""})
        info = {e.name: e for e in converger.engines()}["fake"]
        assert (info.installed, info.installable, info.detail) == (False, False, DISABLED_DETAIL)
        with pytest.raises(InstallError, match="not known to this node"):
            await converger.check("fake")
        nursery.cancel_scope.cancel()
    assert fake.installs == []


async def test_failed_install_retried_with_backoff(autojump_clock: trio.testing.MockClock) -> None:
    fake = FakeInstaller(failures=2)
    converger = Converger({"fake": fake}, backoff_min=10, backoff_max=15)
    async with trio.open_nursery() as nursery:
        await nursery.start(converger.run)
        converger.want({"fake": "2.0"})
        start = trio.current_time()
        states = await _states_until(converger, lambda e: e.installed, deadline=3600)
        elapsed = trio.current_time() - start
        nursery.cancel_scope.cancel()
    failed = [s for s in states if s.startswith("install failed")]
    assert failed == [
        "install failed: the mirror answered HTTP 503; retrying in 10s",
        "install failed: the mirror answered HTTP 503; retrying in 15s",  # doubled, capped at backoff_max
    ]
    assert fake.installs == ["2.0", "2.0", "2.0"]
    assert elapsed == pytest.approx(25)  # virtual time: exactly the two backoffs


async def test_installed_engine_is_rechecked_and_reinstalled(autojump_clock: trio.testing.MockClock) -> None:
    fake = FakeInstaller()
    converger = Converger({"fake": fake}, recheck_interval=600)
    async with trio.open_nursery() as nursery:
        await nursery.start(converger.run)
        converger.want({"fake": ""})
        await _states_until(converger, lambda e: e.installed)
        fake.installed_version = ""  # someone deleted it
        start = trio.current_time()
        await _states_until(converger, lambda e: e.installed and len(fake.installs) == 2, deadline=3600)
        elapsed = trio.current_time() - start
        nursery.cancel_scope.cancel()
    assert fake.installs == ["1.0", "1.0"]
    assert elapsed == pytest.approx(600)  # noticed at the next re-check, not before


async def test_unwanting_cancels_an_install_in_flight() -> None:
    fake = FakeInstaller()
    fake.gate = trio.Event()
    converger = Converger({"fake": fake})
    async with trio.open_nursery() as nursery:
        await nursery.start(converger.run)
        converger.want({"fake": ""})
        await _states_until(converger, lambda e: e.state.startswith("installing: downloading"))
        converger.want({})
        await _states_until(converger, lambda e: e.state == "")
        nursery.cancel_scope.cancel()
    assert fake.cancelled and not fake.installed_version


async def test_not_installable_and_unknown_engines_say_why() -> None:
    converger = Converger({"fake": FakeInstaller(installable=False)})
    async with trio.open_nursery() as nursery:
        await nursery.start(converger.run)
        converger.want({"fake": "", "mystery": "1"})
        await _states_until(converger, lambda e: e.state.startswith("cannot install"))
        engines = {e.name: e for e in converger.engines()}
        nursery.cancel_scope.cancel()
    assert engines["fake"].state == "cannot install here: needs a GPU"
    assert engines["mystery"].detail == "this llmgw has no installer for it"
    with pytest.raises(InstallError, match="not known to this node"):
        await converger.check("mystery")


def test_build_installers_always_has_the_simulator(tmp_path: Path) -> None:
    installers = build_installers(InstallSettings(install_dir=tmp_path / "i", cache_dir=tmp_path / "c"))
    assert installers["sim"].name == "sim"
    for name, installer in installers.items():
        assert installer.name == name and installer.default_version


def _fake_apt(tmp_path: Path) -> tuple[Path, Path]:
    """An apt-get that fails with dpkg's lock message while LOCK exists, else logs its args."""
    lock = tmp_path / "lock"
    script = tmp_path / "apt-get"
    script.write_text(
        "#!/bin/sh\n"
        f'if [ -e "{lock}" ]; then\n'
        '  echo "E: Could not get lock /var/lib/dpkg/lock-frontend. It is held by process 4242 (unattended-upgr)"\n'
        "  exit 100\n"
        "fi\n"
        'if [ "$4" = "missing-pkg" ]; then echo "E: Unable to locate package missing-pkg"; exit 100; fi\n'
        f'echo "$DEBIAN_FRONTEND $*" > "{tmp_path / "ran"}"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script, lock


async def test_apt_waits_for_a_held_lock(tmp_path: Path) -> None:
    script, lock = _fake_apt(tmp_path)
    lock.write_text("")
    messages: list[str] = []

    def progress(message: str) -> None:
        messages.append(message)
        if message.startswith("waiting") and lock.exists():
            os.unlink(lock)  # the other process finishes while we wait

    await apt_install(["libgomp1"], progress, apt_get_command=str(script), poll=0.01)
    assert messages[:2] == [
        "apt-get install libgomp1",
        "waiting for the apt lock (held by process 4242 (unattended-upgr)), up to 10 minutes",
    ]
    assert (tmp_path / "ran").read_text().strip() == "noninteractive install -y --no-install-recommends libgomp1"


async def test_apt_gives_up_on_a_lock_that_stays_held(tmp_path: Path) -> None:
    script, lock = _fake_apt(tmp_path)
    lock.write_text("")
    with pytest.raises(InstallError, match=r"held by process 4242 \(unattended-upgr\)"):
        await apt_install(["libgomp1"], lambda _m: None, apt_get_command=str(script), lock_wait=0.05, poll=0.01)


async def test_apt_other_errors_name_apts_line(tmp_path: Path) -> None:
    script, _ = _fake_apt(tmp_path)
    with pytest.raises(InstallError, match="Unable to locate package missing-pkg"):
        await apt_install(["missing-pkg"], lambda _m: None, apt_get_command=str(script))
