"""bench/ scripts run as documented: ``python bench/x.py`` puts bench/ first on ``sys.path``,
so a benchmark named like a standard-library module would replace it for the whole process
(bench/tokenize.py did, and ``python bench/placement.py`` failed inside ``linecache``)."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_no_benchmark_shadows_a_standard_library_module() -> None:
    names = {p.stem for p in BENCH.glob("*.py")} | {p.name for p in BENCH.iterdir() if (p / "__init__.py").is_file()}
    assert names, "bench/ has no modules"
    shadowing = sorted(names & sys.stdlib_module_names)
    assert not shadowing, f"bench/ shadows the standard library: {shadowing}"
