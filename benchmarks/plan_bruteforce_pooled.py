"""Several runs of ``plan_bruteforce.py`` pooled: how far brute force agrees with itself, and the time model's ranking
against the pooled brute force.

One brute-force run ranks configurations a few percent apart differently from the next on a machine whose speed
drifts by tens of percent (benchmarks/README.md), so a Spearman below 0.8 in one run can be the reference's noise
as much as the time model's error. This script reads the stderr logs of several runs (``plan_bruteforce.py`` prints each
configuration's brute-force samples/s and each plan row's prediction there) and prints, per case (model x budget):

- brute force against itself: Spearman's rank correlation between every two runs' brute-force samples/s, over the
  rows the plan estimated as fitting (the rows the time model's Spearman is taken over);
- the plan's ranking (on CPU with its trials' measurements) and the time model's alone (before any trial; logs since
  that column) against the pooled brute force (per row, the median of the runs' samples/s): each run's Spearman.

Usage: ``python benchmarks/plan_bruteforce_pooled.py run1.err run2.err ...`` (at least two logs, each of a whole run:
``PLAN_BRUTE_TIMED=30 PLAN_BRUTE_ROUNDS=7 python benchmarks/plan_bruteforce.py > runN.out 2> runN.err``).
"""

from __future__ import annotations

import itertools
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from plan_bruteforce import spearman  # noqa: E402  (the same rank correlation as the benchmark's table)

_BRUTE = re.compile(r"#   (micro .*?): peak ([\d,]+) B, ([\d.]+) samples/s")
_MODEL_DONE = re.compile(r"# (.*): brute force \d+ configurations in")
_PREDICTED = re.compile(r"#     (micro .*?): predicted ([\d.]+) samples/s(?: \(model alone ([\d.]+)\))? \(fits\)")
_PLANNED = re.compile(r"# (.*) (\w+): planned in")


def read_brute(path: Path) -> dict[str, dict[str, tuple[int, float]]]:
    """``{model: {configuration: (real peak bytes, brute-force samples/s)}}`` of one log."""
    brute: dict[str, dict[str, tuple[int, float]]] = {}
    current: dict[str, tuple[int, float]] = {}
    for line in path.read_text().splitlines():
        if match := _BRUTE.match(line):
            current[match.group(1)] = (int(match.group(2).replace(",", "")), float(match.group(3)))
        elif match := _MODEL_DONE.match(line):
            brute[match.group(1)], current = current, {}
    return brute


def read_run(path: Path) -> dict[tuple[str, str], tuple[dict[str, float], dict[str, float]]]:
    """``{(model, budget): ({configuration: brute-force samples/s}, {fitting row: (the plan's predicted samples/s, the
    model's alone before any trial or None in a log older than that column)})}`` of one log."""
    cases: dict = {}
    brute: dict[str, dict[str, float]] = {}
    current: dict[str, float] = {}
    predicted: dict[str, tuple[float, float | None]] = {}
    for line in path.read_text().splitlines():
        if match := _BRUTE.match(line):
            current[match.group(1)] = float(match.group(3))
        elif match := _MODEL_DONE.match(line):
            brute[match.group(1)], current = current, {}
        elif match := _PREDICTED.match(line):
            predicted[match.group(1)] = (float(match.group(2)), float(match.group(3)) if match.group(3) else None)
        elif match := _PLANNED.match(line):
            model = match.group(1)
            if model not in brute:
                raise SystemExit(
                    f"{path}: a plan of {model!r} before its brute force: not a log of a brute-force run "
                    "of plan_bruteforce.py (a PLAN_BRUTE_REFERENCE run's log is not one)"
                )
            cases[(model, match.group(2))] = (brute[model], predicted)
            predicted = {}
    return cases


def main(paths: list[str]) -> int:
    if len(paths) < 2:
        print(
            "usage: python benchmarks/plan_bruteforce_pooled.py RUN1.err RUN2.err [...]: the stderr logs of at least "
            "two "
            "runs of benchmarks/plan_bruteforce.py",
            file=sys.stderr,
        )
        return 2
    runs = {path: read_run(Path(path)) for path in paths}
    keys = [key for key in next(iter(runs.values())) if all(key in run for run in runs.values())]
    if not keys:
        print("no case is in every log: give whole runs of plan_bruteforce.py", file=sys.stderr)
        return 2
    print(f"{len(runs)} runs: {', '.join(paths)}\n")
    print(
        "| case | fitting rows | brute force vs itself: Spearman min / median, >= 0.8 in | plan vs pooled brute force, "
        "per run "
        "| model alone vs pooled brute force, per run |"
    )
    print("|---|---:|---|---|---|")
    for key in keys:
        rows = sorted(runs[paths[0]][key][1])  # the plan's fitting rows (the estimate is deterministic)
        if any(sorted(run[key][1]) != rows for run in runs.values()):
            print(f"| {key[0]} {key[1]} | the plans estimated different rows as fitting: not pooled | | | |")
            continue
        brute = {path: [run[key][0][row] for row in rows] for path, run in runs.items()}
        pairs = [spearman(brute[a], brute[b]) for a, b in itertools.combinations(paths, 2)]
        pooled = [statistics.median(brute[path][i] for path in paths) for i in range(len(rows))]
        plan = [spearman([runs[path][key][1][row][0] for row in rows], pooled) for path in paths]
        alone = [
            spearman([runs[path][key][1][row][1] for row in rows], pooled)
            if all(runs[path][key][1][row][1] is not None for row in rows)
            else None
            for path in paths
        ]
        print(
            f"| {key[0]} {key[1]} | {len(rows)} | {min(pairs):.2f} / {statistics.median(pairs):.2f}, "
            f"{sum(p >= 0.8 for p in pairs)} of {len(pairs)} pairs | {', '.join(f'{m:.2f}' for m in plan)} | "
            f"{', '.join('-' if m is None else f'{m:.2f}' for m in alone)} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
