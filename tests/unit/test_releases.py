"""Release files in transit and the release root's links (llmgw/releasefiles.py,
llmgw/releases.py); the install itself is proven end to end in tests/system/test_upgrade.py."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from llmgw import __version__
from llmgw.releases import find_root, install_release, lay_out, rollback_release
from llmgw.releasefiles import MAX_RELEASE_BYTES, ReleaseError, ReleaseInbox, sha256_file, wheel_version


def test_only_llmgw_wheel_names_are_taken() -> None:
    assert wheel_version("llmgw-0.2.0-py3-none-any.whl") == "0.2.0"
    assert wheel_version("llmgw-0.1.0.post1-py3-none-any.whl") == "0.1.0.post1"
    for bad in ("llmgw-0.2.0.tar.gz", "other-0.2.0-py3-none-any.whl", "../llmgw-0.2.0-py3-none-any.whl",
                "llmgw-0.2.0-cp311-cp311-linux_x86_64.whl", "llmgw-/x-py3-none-any.whl"):
        with pytest.raises(ReleaseError):
            wheel_version(bad)


def test_pieces_are_written_in_order_and_a_gap_is_refused(tmp_path: Path) -> None:
    inbox = ReleaseInbox(tmp_path / "in")
    name = "llmgw-1.0-py3-none-any.whl"
    assert inbox.write(name, 0, b"abc") == 3
    assert inbox.write(name, 3, b"def") == 6
    with pytest.raises(ReleaseError, match="send from 6"):
        inbox.write(name, 9, b"x")
    assert inbox.write(name, 0, b"new") == 3  # offset 0 starts afresh
    assert inbox.path(name).read_bytes() == b"new"
    assert sha256_file(inbox.path(name)) == hashlib.sha256(b"new").hexdigest()
    with pytest.raises(ReleaseError, match="over"):
        inbox.write(name, 3, b"x" * (MAX_RELEASE_BYTES - 2))
    with pytest.raises(ReleaseError, match="not an llmgw wheel"):
        inbox.write("../../etc/passwd", 0, b"x")


def layout(tmp_path: Path, *versions: str) -> Path:
    root = tmp_path / "root"
    for v in versions:
        (root / "releases" / v / "bin").mkdir(parents=True)
    os.symlink(f"releases/{versions[-1]}", root / "current")
    return root


def test_the_release_root_is_found_only_through_current(tmp_path: Path) -> None:
    root = layout(tmp_path, "1.0", "2.0")
    assert find_root(str(root / "releases" / "2.0")) == root
    assert find_root(str(root / "current")) == root  # a prefix reached through the link
    assert find_root(str(root / "releases" / "1.0")) is None  # not the current one
    assert find_root(str(tmp_path)) is None


def test_rollback_swaps_current_and_previous(tmp_path: Path) -> None:
    root = layout(tmp_path, "1.0", "2.0")
    with pytest.raises(ReleaseError, match="no previous release"):
        rollback_release(root)
    os.symlink("releases/1.0", root / "previous")
    assert rollback_release(root) == ("1.0", "2.0")
    assert (os.readlink(root / "current"), os.readlink(root / "previous")) == ("releases/1.0", "releases/2.0")
    assert rollback_release(root) == ("2.0", "1.0")


def test_a_damaged_or_running_release_is_refused_before_anything_changes(tmp_path: Path) -> None:
    root = layout(tmp_path, "1.0")
    wheel = tmp_path / "llmgw-2.0-py3-none-any.whl"
    wheel.write_bytes(b"not really a wheel")
    with pytest.raises(ReleaseError, match="damaged on the way"):
        install_release(root, wheel, "0" * 64)
    same = tmp_path / "llmgw-1.0-py3-none-any.whl"
    same.write_bytes(b"x")
    with pytest.raises(ReleaseError, match="already runs llmgw 1.0"):
        install_release(root, same, sha256_file(same))
    with pytest.raises(ReleaseError, match="pip install"):  # a file pip cannot install
        install_release(root, wheel, sha256_file(wheel))
    assert os.readlink(root / "current") == "releases/1.0"
    assert not (root / "releases" / "2.0").exists() and not (root / "previous").exists()


def test_a_machine_is_laid_out_once_and_not_over_another_release(tmp_path: Path) -> None:
    env = tmp_path / "venv"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "tool").write_text("x")
    root = tmp_path / "opt-llmgw"
    release = lay_out(root, str(env))
    assert release == root / "releases" / __version__ and (release / "bin" / "tool").read_text() == "x"
    assert os.readlink(root / "current") == f"releases/{__version__}"
    assert lay_out(root, str(env)) == release  # twice is safe
    os.symlink("releases/9.9", root / "other")
    os.replace(root / "other", root / "current")
    with pytest.raises(ReleaseError, match="points at release 9.9"):
        lay_out(root, str(env))
