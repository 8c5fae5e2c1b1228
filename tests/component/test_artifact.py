"""llmgw.node.install.artifact: downloads from a server on 127.0.0.1, archives made here, lock files.

The server is the fake hub of test_fetch (Range support, a request log, a stall switch);
archives are written with tarfile/zipfile so every refused member kind is exercised.
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import trio

from llmgw.node.install import artifact
from llmgw.node.install.artifact import ArtifactError, Meter, download, exclusive, new_client, safe_extract
from tests.component.test_fetch import COMMIT, Hub, hub  # noqa: F401  (hub is a fixture)


def _url(hub: Hub, name: str) -> str:
    return f"{hub.url}/org/tiny/resolve/{COMMIT}/{name}"


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


async def _get(hub: Hub, name: str, dest: Path, **checks: object) -> Path:
    said: list[str] = []
    async with new_client() as client:
        return await download(client, _url(hub, name), dest, Meter(said.append), **checks)  # type: ignore[arg-type]


async def test_bad_checksum_leaves_nothing_and_says_so(tmp_path: Path, hub: Hub) -> None:
    hub.files = {"a.bin": b"a" * 10_000}
    with pytest.raises(ArtifactError, match=r"a\.bin has sha256 [0-9a-f]{64}, but the mirror says 0{64}; .*deleted"):
        await _get(hub, "a.bin", tmp_path / "a.bin", sha256="0" * 64, origin="the mirror")
    assert _leftovers(tmp_path) == []


async def test_size_mismatch_leaves_nothing(tmp_path: Path, hub: Hub) -> None:
    hub.files = {"a.bin": b"a" * 100}
    with pytest.raises(ArtifactError, match="received 100 bytes but the source says 99"):
        await _get(hub, "a.bin", tmp_path / "a.bin", size=99)
    assert _leftovers(tmp_path) == []


async def test_checked_partial_is_resumed_and_unchecked_one_started_over(tmp_path: Path, hub: Hub) -> None:
    data = bytes(range(256)) * 100
    hub.files = {"a.bin": data, "b.bin": data}
    (tmp_path / "a.bin.partial").write_bytes(data[:1000])
    await _get(hub, "a.bin", tmp_path / "a.bin", sha256=hashlib.sha256(data).hexdigest())
    (tmp_path / "b.bin.partial").write_bytes(b"stale bytes of another file")
    await _get(hub, "b.bin", tmp_path / "b.bin")
    assert hub.ranges == [("a.bin", "bytes=1000-"), ("b.bin", "")]
    assert (tmp_path / "a.bin").read_bytes() == data and (tmp_path / "b.bin").read_bytes() == data
    assert _leftovers(tmp_path) == ["a.bin", "b.bin"]


async def test_http_error_and_unreachable_server_are_named(tmp_path: Path, hub: Hub) -> None:
    with pytest.raises(ArtifactError, match=r"missing\.bin answered HTTP 404"):
        await _get(hub, "missing.bin", tmp_path / "missing.bin")
    async with new_client() as client:
        with pytest.raises(ArtifactError, match=r"cannot download http://127\.0\.0\.1:9/x .*the next try starts again"):
            await download(client, "http://127.0.0.1:9/x", tmp_path / "x", Meter(lambda _: None))


def _tar(path: Path, *members: tarfile.TarInfo) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        tf.addfile(_file("pkg/ok.txt"), io.BytesIO(b"ok"))
        for member in members:
            tf.addfile(member, io.BytesIO(b"x" * member.size) if member.isfile() else None)
    return path


def _file(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = 2
    return info


def _link(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


def _special(name: str, kind: bytes) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    return info


@pytest.mark.parametrize(
    "member, match",
    [
        (_file("../escape.txt"), "would be written outside"),
        (_file("/abs.txt"), "would be written outside"),
        (_link("pkg/evil", "../../etc/passwd"), "points outside"),
        (_link("pkg/evil", "/etc/passwd"), "points outside"),
        (_link("pkg/hard", "../outside", tarfile.LNKTYPE), "points outside"),
        (_special("pkg/fifo", tarfile.FIFOTYPE), "device file or FIFO"),
        (_special("pkg/dev", tarfile.CHRTYPE), "device file or FIFO"),
    ],
)
def test_escaping_or_special_members_refuse_the_whole_archive(tmp_path: Path, member: tarfile.TarInfo, match: str) -> None:
    archive = _tar(tmp_path / "a.tar.gz", member)
    dest = tmp_path / "out" / "dest"
    with pytest.raises(ArtifactError, match=match):
        safe_extract(archive, dest)
    assert _leftovers(dest) == [], "nothing is written before every member is checked"
    assert _leftovers(tmp_path / "out") == ["dest"]


def test_links_inside_and_a_prefix_are_unpacked(tmp_path: Path) -> None:
    archive = _tar(tmp_path / "a.tar.gz", _link("pkg/same", "ok.txt"), _file("other/skip.txt"))
    safe_extract(archive, tmp_path / "out", prefix="pkg/")
    assert (tmp_path / "out" / "pkg" / "same").read_bytes() == b"ok"
    assert not (tmp_path / "out" / "other").exists()


@pytest.mark.parametrize("filters", [True, False], ids=["tarfile-filters", "python-before-3.11.4"])
def test_unpacked_files_lose_setuid_and_the_archives_owners(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            filters: bool) -> None:
    if not filters:  # Debian 12's Python 3.11.2 has no extraction filters: the same must hold
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    elif not hasattr(tarfile, "data_filter"):
        pytest.skip("this Python has no tarfile extraction filters")
    member = _file("pkg/tool")
    member.mode, member.uid, member.gid, member.uname, member.gname = 0o4777, 4242, 4242, "mallory", "mallory"
    safe_extract(_tar(tmp_path / "a.tar.gz", member), tmp_path / "out")
    unpacked = (tmp_path / "out" / "pkg" / "tool").stat()
    assert unpacked.st_mode & 0o7777 == 0o755
    assert (unpacked.st_uid, unpacked.st_gid) == (os.getuid(), os.getgid())


def test_zip_symlink_and_traversal_are_refused(tmp_path: Path) -> None:
    link = zipfile.ZipInfo("pkg/link")
    link.external_attr = (0o120777 << 16)
    for info, match in ((link, "symbolic link inside a zip"), (zipfile.ZipInfo("../up.txt"), "would be written outside")):
        archive = tmp_path / "a.zip"
        with zipfile.ZipFile(archive, "w") as zf:
            zf.writestr(info, b"/etc/passwd")
        with pytest.raises(ArtifactError, match=match):
            safe_extract(archive, tmp_path / "out")
        assert _leftovers(tmp_path / "out") == []


async def test_second_holder_waits_and_the_lock_file_goes_away(tmp_path: Path) -> None:
    lock = artifact.lock_file_for(tmp_path / "target")
    assert lock == tmp_path / ".target.lock"
    order: list[str] = []
    waiting = trio.Event()

    async def second() -> None:
        async with exclusive(lock, waiting.set):
            order.append("second")

    async with trio.open_nursery() as nursery:
        async with exclusive(lock):
            nursery.start_soon(second)
            await waiting.wait()  # the second one found the lock taken
            order.append("first")
    assert order == ["first", "second"]
    assert not lock.exists()


async def test_lock_held_by_another_process_is_waited_for(tmp_path: Path) -> None:
    lock = tmp_path / "x.lock"
    holder = (
        "import sys; from pathlib import Path; from llmgw.node.install.artifact import exclusive_blocking\n"
        f"with exclusive_blocking(Path({str(lock)!r})):\n"
        "    print('held', flush=True); sys.stdin.read()\n"
    )
    process = await trio.lowlevel.open_process(
        [sys.executable, "-c", holder], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert process.stdin is not None and process.stdout is not None
    try:
        assert (await process.stdout.receive_some(100)).startswith(b"held")
        waited = trio.Event()
        acquired = trio.Event()

        async def take() -> None:
            async with exclusive(lock, waited.set):
                acquired.set()

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(take)
                await waited.wait()
                assert not acquired.is_set()
                await process.stdin.aclose()  # the holder exits, its lock with it
    finally:
        process.kill()
        await process.wait()
    assert acquired.is_set()
