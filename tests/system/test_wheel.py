"""llmgw as a user installs it: the wheel and the sdist built from the checkout, the wheel
installed in a fresh environment outside the checkout, serving a request with `llmgw up`.

Everything runs offline: setuptools' build backend from this test environment (no build
isolation), and the fresh environment takes llmgw's dependencies from this interpreter's
site-packages through a ``.pth`` file, never llmgw itself (checked). The copy of the
checkout that is built leaves the checkout untouched (no build/ or egg-info written there).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import httpx
import pytest

from llmgw.node.install.artifact import safe_extract
from tests.system.harness import engines_under, Proc

pytestmark = pytest.mark.system

REPO = Path(__file__).resolve().parents[2]
#: Top-level entries of a checkout that are not sources: what git ignores, and git itself.
NOT_SOURCES = frozenset({".git", ".venv", "build", "dist", "state", ".cache", ".pytest_cache", ".hypothesis"})
#: A build on a loaded 2-core machine takes seconds; minutes means it is stuck.
BUILD_TIMEOUT = 300.0
#: Creating a venv and installing one wheel without dependencies.
INSTALL_TIMEOUT = 120.0
#: What a file left out of the wheel looks like in a log, even where the program goes on
#: (a task that logs its failure): pycapnp's message for a missing schema, and Python's.
PACKAGING_FAILURES = ("File not found", "FileNotFoundError", "ModuleNotFoundError", "ImportError")


def _runtime_data() -> dict[str, str]:
    """Returns every non-Python file llmgw reads at run time: repository path -> path in the wheel."""
    files = {f"schema/{f.name}": f"llmgw/schema/{f.name}" for f in sorted((REPO / "schema").glob("*.capnp"))}
    files.update({f"systemd/{f.name}": f"llmgw/systemd/{f.name}" for f in sorted((REPO / "systemd").glob("*.service"))})
    for lock in sorted((REPO / "llmgw/node/install/locks").glob("*.txt")):
        path = lock.relative_to(REPO).as_posix()
        files[path] = path
    return files


def _modules() -> set[str]:
    """Returns the checkout's Python files under llmgw/, as wheel paths."""
    return {p.relative_to(REPO).as_posix() for p in (REPO / "llmgw").rglob("*.py") if "__pycache__" not in p.parts}


def _copy_sources(dest: Path) -> Path:
    """Copies the checkout's sources to ``dest`` (no VCS, environments or build output); returns ``dest``."""
    def ignore(directory: str, names: list[str]) -> set[str]:
        skipped = {n for n in names if n == "__pycache__" or n.endswith((".egg-info", ".pyc"))}
        if Path(directory).resolve() == REPO:
            skipped |= NOT_SOURCES.intersection(names)
        return skipped

    shutil.copytree(REPO, dest, ignore=ignore)
    return dest


def _build(hook: str, source: Path, out: Path) -> Path:
    """Runs setuptools' PEP 517 ``hook`` (``build_wheel`` or ``build_sdist``) in ``source``.

    Returns the file it wrote in ``out``; fails the test with the backend's output if it fails.
    """
    code = f"import sys; from setuptools import build_meta; print(build_meta.{hook}(sys.argv[1]))"
    done = subprocess.run([sys.executable, "-c", code, str(out)], cwd=source, capture_output=True, text=True,
                          timeout=BUILD_TIMEOUT)
    assert done.returncode == 0, f"{hook} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return out / done.stdout.strip().splitlines()[-1]


def _wheel_names(wheel: Path) -> set[str]:
    """Returns the wheel's file names, less its .dist-info metadata."""
    with zipfile.ZipFile(wheel) as z:
        return {n for n in z.namelist() if ".dist-info/" not in n}


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Builds the wheel and the sdist from a copy of the checkout, and a wheel from that sdist."""
    root = tmp_path_factory.mktemp("dists")
    source = _copy_sources(root / "source")
    out = root / "dist"
    wheel = _build("build_wheel", source, out)
    sdist = _build("build_sdist", source, out)
    safe_extract(sdist, root / "unpacked")
    [unpacked] = (root / "unpacked").iterdir()
    return {"wheel": wheel, "sdist": sdist, "sdist_wheel": _build("build_wheel", unpacked, root / "from-sdist")}


def test_the_wheel_holds_every_module_and_run_time_file(dists: dict[str, Path]) -> None:
    names = _wheel_names(dists["wheel"])
    assert set(_runtime_data().values()) <= names, "run-time data missing from the wheel"
    assert not _modules() - names, "modules missing from the wheel"
    assert {n.split("/")[0] for n in names} == {"llmgw"}, "only the llmgw package is installed"


def test_the_sdist_builds_the_same_wheel(dists: dict[str, Path]) -> None:
    with tarfile.open(dists["sdist"]) as tar:
        names = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
    assert {"pyproject.toml", "setup.py", "README.md", *_runtime_data()} <= names
    assert _wheel_names(dists["sdist_wheel"]) == _wheel_names(dists["wheel"])


def _fresh_env(root: Path, wheel: Path) -> Path:
    """Creates a venv in ``root`` with ``wheel`` installed and this interpreter's dependencies.

    Returns the venv's ``bin`` directory. The dependencies come through a ``.pth`` naming
    this interpreter's site-packages: a path line only, so the ``.pth`` files there (the
    editable install of llmgw among them) are not run.
    """
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=INSTALL_TIMEOUT)
    python = root / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
                    "--no-index", str(wheel)], check=True, timeout=INSTALL_TIMEOUT)
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    ours = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (Path(site) / "llmgw-test-deps.pth").write_text("".join(f"{p}\n" for p in ours))
    return root / "bin"


async def test_the_installed_wheel_serves_a_request(dists: dict[str, Path], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    assert not tmp_path.resolve().is_relative_to(REPO)
    bin_dir = _fresh_env(tmp_path / "venv", dists["wheel"])
    elsewhere, state = tmp_path / "elsewhere", tmp_path / "state"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    where = subprocess.run([bin_dir / "python", "-c", "import llmgw; print(llmgw.__file__)"],
                           capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    assert Path(where).is_relative_to(tmp_path / "venv"), f"llmgw imported from {where}, not the fresh venv"

    up = Proc([str(bin_dir / "llmgw"), "up", "--engine", "sim", "--state-dir", str(state),
               "--http-port", "0", "--rpc-port", "0"],
              tmp_path / "up.log", env={"XDG_DATA_HOME": str(tmp_path / "xdg")})
    try:
        m = await up.wait_for_line(r"OpenAI endpoint : (\S+)/v1 .*1 ready replica")
        async with httpx.AsyncClient(timeout=10) as http:
            r = await http.post(f"{m.group(1)}/v1/chat/completions",
                                json={"model": "demo", "messages": [{"role": "user", "content": "Hello!"}]})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
        # SIGTERM, as a service manager stops it: `up` stops its engine and exits 0.
        up.signal(signal.SIGTERM)
        assert await up.wait_exit() == 0, up.output()[-3000:]
        assert engines_under(state) == []
        missing = [marker for marker in PACKAGING_FAILURES if marker in up.output()]
        assert not missing, f"{missing}:\n{up.output()[-3000:]}"
    finally:
        up.kill()
        for engine in engines_under(state):
            engine.kill()
