"""llama.cpp installer against a real HTTP server on 127.0.0.1 serving archives made here.

The "llama-server" in each archive is a tiny C program (gcc) that prints a llama.cpp-style
version line, so ``ldd`` and ``--version`` run for real. Each refusal must leave nothing
that probes as installed.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import os
import shutil
import subprocess
import tarfile
import threading
from pathlib import Path
from typing import Iterator

import pytest
import trio

from llmgw.node.install import InstallError
from llmgw.node.install import llamacpp as inst

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build the stand-in binaries")

GOOD_C = r"""
#include <stdio.h>
#include <string.h>
int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--version") == 0) {
        fprintf(stderr, "version: 9.9.9-test (build 11312, commit 0c1e570)\nbuilt with test\n");
        return 0;
    }
    if (argc > 1 && strcmp(argv[1], "--list-devices") == 0) { printf("Available devices:\n  (none)\n"); return 0; }
    return 0;
}
"""
CRASH_C = r"""
#include <stdio.h>
int main(void) { fprintf(stderr, "this binary cannot start: illegal instruction\n"); return 132; }
"""
LIB_C = "int helper(void) { return 42; }\n"
USES_LIB_C = r"""
#include <stdio.h>
int helper(void);
int main(void) { fprintf(stderr, "version: %d\n", helper()); return 0; }
"""


def _gcc(out: Path, source: str, *extra: str) -> Path:
    src = out.with_suffix(".c")
    src.write_text(source)
    subprocess.run(["gcc", "-o", str(out), str(src), *extra], check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def binaries(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Builds: good, crash, and uses-lib (linked against libllmgwtestgone.so, then deleted)."""
    d = tmp_path_factory.mktemp("bins")
    good = _gcc(d / "good", GOOD_C)
    crash = _gcc(d / "crash", CRASH_C)
    lib = d / "libllmgwtestgone.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), "-x", "c", "-"], input=LIB_C.encode(), check=True)
    uses = _gcc(d / "uses", USES_LIB_C, f"-L{d}", "-lllmgwtestgone")
    lib.unlink()  # the library the binary needs is gone: ldd says "not found"
    return {"good": good, "crash": crash, "uses": uses}


class Served:
    """A directory served over HTTP on 127.0.0.1 (a thread; closed by the fixture)."""

    def __init__(self, directory: Path) -> None:
        handler = functools.partial(_QuietHandler, directory=str(directory))
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.dir = directory
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Served]:
    served = Served(tmp_path / "www")
    (tmp_path / "www").mkdir()
    try:
        yield served
    finally:
        served.close()


def _tar(path: Path, members: list[tuple[str, bytes | None, str | None, int]]) -> Path:
    """Writes a .tar.gz: (name, data, symlink target, mode) per member."""
    with tarfile.open(path, "w:gz") as tf:
        for name, data, link, mode in members:
            info = tarfile.TarInfo(name)
            info.mode = mode
            if link is not None:
                info.type = tarfile.SYMTYPE
                info.linkname = link
                tf.addfile(info)
            else:
                info.size = len(data or b"")
                tf.addfile(info, io.BytesIO(data or b""))
    return path


def _publish(server: Served, asset: str, members: list, *, checksum: str | None = None) -> tuple[str, str]:
    """Puts an archive and its .sha256 file on the server; returns (url, checksums url)."""
    archive = _tar(server.dir / asset, members)
    digest = checksum or hashlib.sha256(archive.read_bytes()).hexdigest()
    (server.dir / (asset + ".sha256")).write_text(f"{digest}  {asset}\n")
    url = f"{server.base}/{asset}"
    return url, url + ".sha256"


ASSET = "llama-b11312-bin-ubuntu-x64.tar.gz"


def _bin(path: Path) -> bytes:
    return path.read_bytes()


def _nothing_installed(root: Path) -> None:
    assert inst.find_installed([root]) is None
    assert not list(root.glob("*/" + inst.MARKER))
    assert not list(root.glob(".scratch-*"))


async def test_good_archive_installs_and_probes(server: Served, tmp_path: Path, binaries: dict[str, Path]) -> None:
    url, sums = _publish(server, ASSET, [("build/bin/llama-server", _bin(binaries["good"]), None, 0o755),
                                          ("build/bin/LICENSE", b"MIT\n", None, 0o644)])
    root = tmp_path / "root"
    said: list[str] = []
    result = await inst.install_from_archive(url, sums, root, said.append)
    assert result.version == "b11312"
    assert result.version_line == "version: 9.9.9-test (build 11312, commit 0c1e570)"
    assert (result.directory / inst.MARKER).is_file()
    assert inst.find_installed([root]) == result
    assert any(s.startswith(f"downloading {ASSET}") for s in said)
    installer = inst.LlamaCppInstaller(root)
    info = await installer.probe()
    assert info.installed and info.version == "b11312"
    assert "Available devices" in await installer.check()


async def test_wrong_checksum_is_refused(server: Served, tmp_path: Path, binaries: dict[str, Path]) -> None:
    url, sums = _publish(server, ASSET, [("bin/llama-server", _bin(binaries["good"]), None, 0o755)], checksum="0" * 64)
    root = tmp_path / "root"
    with pytest.raises(InstallError, match=r"has sha256 [0-9a-f]{64}, but .* says 0{64}"):
        await inst.install_from_archive(url, sums, root)
    _nothing_installed(root)


@pytest.mark.parametrize(
    "member, link, match",
    [
        ("../escape/llama-server", None, "would be written outside the install directory"),
        ("/abs/llama-server", None, "would be written outside the install directory"),
        ("bin/evil", "../../../etc/passwd", "points outside the install directory"),
        ("bin/evil", "/etc/passwd", "points outside the install directory"),
    ],
)
async def test_escaping_paths_and_links_are_refused(
    server: Served, tmp_path: Path, binaries: dict[str, Path], member: str, link: str | None, match: str
) -> None:
    members = [("bin/llama-server", _bin(binaries["good"]), None, 0o755), (member, b"x", link, 0o644)]
    url, sums = _publish(server, ASSET, members)
    root = tmp_path / "root"
    with pytest.raises(InstallError, match=match):
        await inst.install_from_archive(url, sums, root)
    _nothing_installed(root)
    assert not (tmp_path / "escape").exists()


async def test_missing_library_is_named(server: Served, tmp_path: Path, binaries: dict[str, Path]) -> None:
    url, sums = _publish(server, ASSET, [("bin/llama-server", _bin(binaries["uses"]), None, 0o755)])
    root = tmp_path / "root"
    with pytest.raises(InstallError, match=r"needs libllmgwtestgone\.so.*not found"):
        await inst.install_from_archive(url, sums, root)
    _nothing_installed(root)


async def test_binary_that_cannot_start_is_refused(server: Served, tmp_path: Path, binaries: dict[str, Path]) -> None:
    url, sums = _publish(server, ASSET, [("bin/llama-server", _bin(binaries["crash"]), None, 0o755)])
    root = tmp_path / "root"
    with pytest.raises(InstallError, match=r"--version failed \(exit status 132\): this binary cannot start"):
        await inst.install_from_archive(url, sums, root)
    _nothing_installed(root)


async def test_archive_without_checksum_entry_is_refused(server: Served, tmp_path: Path, binaries: dict[str, Path]) -> None:
    url, sums = _publish(server, ASSET, [("bin/llama-server", _bin(binaries["good"]), None, 0o755)])
    (server.dir / (ASSET + ".sha256")).write_text(f"{'a' * 64}  some-other-file.tar.gz\n")
    root = tmp_path / "root"
    with pytest.raises(InstallError, match="has no sha256 for"):
        await inst.install_from_archive(url, sums, root)
    _nothing_installed(root)


async def test_recheck_unmarks_a_broken_install(server: Served, tmp_path: Path, binaries: dict[str, Path]) -> None:
    url, sums = _publish(server, ASSET, [("bin/llama-server", _bin(binaries["good"]), None, 0o755)])
    root = tmp_path / "root"
    result = await inst.install_from_archive(url, sums, root)
    shutil.copy(binaries["crash"], result.binary)  # the binary broke after install
    installer = inst.LlamaCppInstaller(root)
    with pytest.raises(InstallError, match="no longer works"):
        await installer.check()
    assert not (await installer.probe()).installed


async def test_unreachable_archive_falls_back_to_the_source_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, binaries: dict[str, Path]
) -> None:
    calls: list[Path] = []

    async def fake_build(root: Path, cache: Path | None = None, progress=None, **_: object) -> inst.Installed:
        calls.append(root)
        raise InstallError("cmake is missing (test)")

    monkeypatch.setattr(inst, "build_from_sdist", fake_build)
    monkeypatch.setattr(inst, "_asset_name", lambda tag: ASSET)
    said: list[str] = []
    dead = "http://127.0.0.1:9/{tag}/{asset}"  # discard port: connection refused at once
    with pytest.raises(InstallError) as caught:
        await inst.install(tmp_path / "root", said.append, url_template=dead)
    text = str(caught.value)
    assert "release archive: cannot download http://127.0.0.1:9/b11312/" in text
    assert "source build: cmake is missing (test)" in text
    assert calls == [tmp_path / "root"]
    assert any("building from source instead" in s for s in said)


def test_parse_checksums_formats() -> None:
    digest = "ab" * 32
    assert inst.parse_checksums(f"{digest}  {ASSET}\n{'cd' * 32}  other\n", ASSET) == digest
    assert inst.parse_checksums(f"{digest} *build/{ASSET}\n", ASSET) == digest
    assert inst.parse_checksums(f"{digest}\n", ASSET) == digest
    assert inst.parse_checksums("not a checksum\n", ASSET) is None


def test_build_key_depends_on_flags() -> None:
    assert inst.build_key().startswith("b11312-cpu-")
    assert inst.build_key(inst.CMAKE_FLAGS) != inst.build_key((*inst.CMAKE_FLAGS, "-DGGML_CUDA=ON"))
    assert "-DGGML_NATIVE=OFF" in inst.CMAKE_FLAGS


async def test_sdist_with_wrong_sha256_is_refused(server: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (server.dir / inst.SDIST_NAME).write_bytes(b"not the real sdist")
    root = tmp_path / "root"
    with pytest.raises(InstallError, match=f"expected {inst.SDIST_SHA256}"):
        await inst.build_from_sdist(root, sdist_url=f"{server.base}/{inst.SDIST_NAME}")
    assert not (root / "downloads" / inst.SDIST_NAME).exists()
    _nothing_installed(root)


async def test_pip_download_that_hangs_is_killed_at_its_deadline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hanging = tmp_path / "python"
    hanging.write_text("#!/bin/sh\nexec sleep 60\n")
    hanging.chmod(0o755)
    monkeypatch.setattr(inst.sys, "executable", str(hanging))
    monkeypatch.setattr(inst, "SDIST_DOWNLOAD_TIMEOUT", 0.2)
    (tmp_path / "downloads").mkdir()
    with trio.fail_after(20):
        with pytest.raises(InstallError, match="took over 0 minutes; check the package index"):
            await inst._pip_download_sdist(tmp_path / "downloads" / inst.SDIST_NAME, lambda _: None)
    assert list((tmp_path / "downloads").iterdir()) == []
