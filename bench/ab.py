"""A/B of the gateway's hot path: ``bench.relaycost`` alternated between a git revision and this tree.

``python -m bench.ab REV [--pairs 6] [-- RELAYCOST_ARGS...]`` checks ``REV`` out into a
temporary git worktree, then runs this tree's ``python -m bench.relaycost RELAYCOST_ARGS``
``--pairs`` times with the gateway of each tree (``--gateway-tree``: the same harness for
both, so that a change to the harness is not measured as one to the gateway), alternating
(and swapping which goes first every pair, so neither always runs on a machine warmed by
the other), and prints one JSON object: per figure of
relaycost's report, the base and current values in run order, their medians, the ratio
current / base of each pair and the median of those ratios. The worktree is removed at
the end, however the run ends.

Why pairs: on a shared machine the same code's CPU per request moves by a third between
runs minutes apart (bench/README.md), far more than most changes to the hot path; a
ratio within a pair, run back to back, cancels most of that drift, and the spread of the
ratios says whether what is left is a change or noise. Each side's gateway runs that
tree's ``llmgw`` and ``bench.gateway`` (relaycost starts it with the tree on its path); the
engines, the clients and the figures are this tree's relaycost's for both. For streams, read
``added_ttft_p50_ms`` (TTFT over the engines' own in the same run) rather than the absolute
``ttft_p50_ms``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

#: Seconds one relaycost run may take before the A/B gives up (its own default run is ~10 s).
RUN_TIMEOUT_S = 600

ROOT = Path(__file__).resolve().parent.parent


def relaycost(tree: Path, args: Sequence[str]) -> dict[str, float]:
    """Run this tree's ``python -m bench.relaycost args`` with the gateway of ``tree``; return the
    numbers of its report.

    Raises RuntimeError with relaycost's last output lines when it fails.
    """
    done = subprocess.run([sys.executable, "-m", "bench.relaycost", *args, "--gateway-tree", str(tree)], cwd=ROOT,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if done.returncode != 0:
        tail = " | ".join((done.stdout + done.stderr).strip().splitlines()[-5:])
        raise RuntimeError(f"bench.relaycost failed in {tree} (status {done.returncode}): {tail}")
    report = json.loads(done.stdout)
    return {key: float(value) for key, value in report.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)}


def compare(base: list[dict[str, float]], current: list[dict[str, float]]) -> dict[str, Any]:
    """Return, per figure both sides report, the values, medians and pairwise ratios."""
    figures: dict[str, Any] = {}
    for key in base[0]:
        if not all(key in run for run in base + current):
            continue
        before = [run[key] for run in base]
        after = [run[key] for run in current]
        ratios = [a / b for a, b in zip(after, before) if b]
        figures[key] = {
            "base": before, "current": after,
            "base_median": statistics.median(before), "current_median": statistics.median(after),
            "ratios": [round(r, 3) for r in ratios],
            "median_ratio": round(statistics.median(ratios), 3) if ratios else None,
        }
    return figures


def run(rev: str, pairs: int, args: Sequence[str]) -> dict[str, Any]:
    """Check ``rev`` out, run the pairs, remove the checkout; return the report.

    Raises RuntimeError when ``rev`` is not a commit or a relaycost run fails.
    """
    found = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], cwd=ROOT,
                           capture_output=True, text=True)
    if found.returncode != 0:
        raise RuntimeError(f"{rev!r} is not a commit of {ROOT} (try HEAD, main~3 or a commit id)")
    commit = found.stdout.strip()
    checkout = Path(tempfile.mkdtemp(prefix="llmgw-ab-")) / "base"
    subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(checkout), commit], cwd=ROOT, check=True)
    try:
        base: list[dict[str, float]] = []
        current: list[dict[str, float]] = []
        for pair in range(pairs):
            order = [(checkout, base), (ROOT, current)]
            for tree, runs in order if pair % 2 == 0 else reversed(order):
                runs.append(relaycost(tree, args))
                print(f"[bench.ab] pair {pair + 1}/{pairs} {'base' if tree == checkout else 'current'}: "
                      + " ".join(f"{k}={v:.4g}" for k, v in runs[-1].items()), file=sys.stderr, flush=True)
        return {"base": rev, "base_commit": commit, "pairs": pairs, "relaycost_args": list(args),
                "figures": compare(base, current)}
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(checkout)], cwd=ROOT, check=False)
        shutil.rmtree(checkout.parent, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    # What follows "--" is bench.relaycost's (e.g. -- --requests 16 --seconds 5).
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m bench.ab", usage="%(prog)s REV [--pairs N] [-- RELAYCOST_ARGS...]",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("rev", help="the git revision to compare this tree against (e.g. HEAD, main~3)")
    parser.add_argument("--pairs", type=int, default=6, help="runs in each tree, alternating (default 6)")
    args = parser.parse_args(own)
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    try:
        report = run(args.rev, args.pairs, rest)
    except RuntimeError as error:
        raise SystemExit(f"bench.ab: {error}") from None
    print(json.dumps(report))


if __name__ == "__main__":
    main()
