"""Issue 25's device table, read back from a GPU lease's logs (benchmarks/results/h200_2026-11-27/).

    python benchmarks/plan_gpu_table.py [benchmarks/results/h200_2026-11-27]

The first lease ran ``benchmarks/gpu_lease.sh``: per model and budget the planner (``plan_fit``, its own trials), then
brute force over the rows it estimated, until the rows with a checkpoint budget and offload stopped it (the bug fixed
in the same change: ActivationCheckpointing measured its blocks through the offloading step and found none holding
activations). The second lease (``benchmarks/gpu_lease2.sh``) timed the rows the first did not reach, each case led by
the planner's choice timed again. A row measured only in the second lease is scaled by that choice's ratio between
the leases (first / second) so that the two leases' speeds compare; the planner's choice and the rows of the first
lease are as measured (one re-timed row per case: the scaling carries that row's own noise, a few percent; the
ranking holds unscaled too). Predictions of the second lease's rows come from ``predictions_h200_roofline.txt``
(``python benchmarks/plan_gpu.py --predict h200 --budgets 16GiB,8GiB`` on a CPU machine: the roofline and the
estimate need no GPU; within 0.2% of the device's own). The two baselines are replayed on the rows that ran; a plain
micro-batch that did not run counts as fitting when a larger one fit, and as out of memory when it is larger than
every one that fit (the halving's first trial, BERT-base's 32 x 1 for instance: predicted far over the budget).
"""

from __future__ import annotations

import os
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from plan_choice import baselines, spearman  # noqa: E402
from plan_gpu import parse_candidate, plain_fits  # noqa: E402
from provenance import provenance_line  # noqa: E402

GiB = 1 << 30
_SIZE = r"([\d.]+ [KMG]?i?B|-)"


def _bytes(text: str) -> int | None:
    if text == "-":
        return None
    from lightning_memkit.units import parse_bytes

    return parse_bytes(text.replace(" ", ""))


def read(folder: Path) -> dict:
    """``{(model, budget bytes): case}`` with the plan's choice, trials and every measured row."""
    cases: dict = {}
    unread = []  # a "#   micro" line no pattern took: the table would silently miss a row
    for path in sorted(folder.glob("lease1_*.err")):
        case = None
        for line in path.read_text().splitlines():
            head = re.match(r"# (.+) ([\d.]+ GiB): planned in (\d+) s, (\d+) trials, best (micro .+)$", line)
            if head:
                case = cases.setdefault(
                    (head.group(1), _bytes(head.group(2))), {"rows": {}, "predicted": {}, "second": {}}
                )
                case.update(plan_s=int(head.group(3)), trials=int(head.group(4)), choice=head.group(5))
                continue
            row = re.match(
                rf"#   (micro [^:]+): predicted {_SIZE}, ([\d.]+) samples/s( \(fits\))?; brute force (.*), "
                rf"peak {_SIZE}, ([\d.]+) samples/s; plan's trial: (.*)$",
                line,
            )
            if line.startswith("#   micro") and (not row or case is None):
                unread.append(line)
            if row and case is not None:
                ran = row.group(5).startswith("ran")
                case["predicted"][row.group(1)] = (_bytes(row.group(2)), float(row.group(3)), bool(row.group(4)))
                case["rows"][row.group(1)] = (ran, _bytes(row.group(6)), float(row.group(7)) if ran else None)
    for path in sorted(folder.glob("lease2_*.err")):
        for line in path.read_text().splitlines():
            row = re.match(
                rf"# (.+) ([\d.]+ GiB): (micro [^:]+): brute force (.*), peak {_SIZE}, ([\d.]+) samples/s$", line
            )
            if line.startswith("# ") and ": micro" in line and not row:
                unread.append(line)
            if row:
                ran = row.group(4).startswith("ran")
                cases[(row.group(1), _bytes(row.group(2)))]["second"][row.group(3)] = (
                    ran,
                    _bytes(row.group(5)),
                    float(row.group(6)) if ran else None,
                )
    if unread:
        raise SystemExit(f"{len(unread)} log lines not read (a format this script does not know), e.g. {unread[0]!r}")
    predictions = (folder / "predictions_h200_roofline.txt").read_text()
    for block in re.split(r"^## ", predictions, flags=re.M)[1:]:
        title, _, table = block.partition("\n")
        name, _, budget = title.rpartition(" ")
        for line in table.splitlines():
            cells = re.match(r"  (micro .+?)\s{2,}([\d.]+ [KMG]?i?B)\s+([\d.]+) ms\s+([\d.]+)\s+(yes|no)", line)
            if cells and (name, _bytes(budget)) in cases:
                cases[(name, _bytes(budget))]["predicted"].setdefault(
                    cells.group(1), (_bytes(cells.group(2)), float(cells.group(4)), cells.group(5) == "yes")
                )
    return cases


def summarize(name: str, budget: int, case: dict) -> dict:
    rows = dict(case["rows"])
    choice = case["choice"]
    again = case["second"].get(choice)
    scale = rows[choice][2] / again[2] if again and again[0] and rows.get(choice, (False,))[0] else 1.0
    for text, (ran, peak, samples) in case["second"].items():
        if text not in rows:
            rows[text] = (ran, peak, samples * scale if ran else None)
    fitting = {t: r for t, r in rows.items() if r[0]}
    best = max(fitting, key=lambda t: fitting[t][2])
    pairs = [(case["predicted"][t][1], r[2]) for t, r in fitting.items() if t in case["predicted"]]
    errors = [m / p for p, m in pairs]  # predicted step / measured step
    missed = [t for t, r in fitting.items() if t in case["predicted"] and not case["predicted"][t][2]]
    candidates = {t: parse_candidate(t) for t in rows}
    plain = sorted(
        {c for c in candidates.values() if c.checkpoint is None and not c.offload}
        | {
            parse_candidate(f"micro {m} x {c.effective_batch // m}, 32-true")
            for c in candidates.values()
            for m in (1, 2, 4, 8, 16, 32, 64, 128, 256)
            if c.effective_batch % m == 0
        },
        key=lambda c: -c.micro_batch,
    )
    fits = plain_fits({c.micro_batch: rows[t][0] for t, c in candidates.items() if c in plain})
    batch = next(iter(candidates.values())).effective_batch
    composer, composer_trials, finder, finder_trials = baselines(plain, fits, batch)

    def speed(candidate) -> float | None:
        text = candidate.describe() if candidate is not None else None
        return fitting[text][2] if text in fitting else None

    return {
        "name": name,
        "budget": budget,
        "fitting": len(fitting),
        "run": len(rows),
        "best": best,
        "best_speed": fitting[best][2],
        "choice": choice,
        "choice_speed": fitting[choice][2],
        "trials": case["trials"],
        "peak": rows[choice][1],
        "rho": spearman([p for p, _ in pairs], [m for _, m in pairs]),
        "pairs": len(pairs),
        "error": (min(errors), statistics.median(errors), max(errors)),
        "missed": missed,
        "scale": scale,
        "composer": composer,
        "composer_speed": speed(composer),
        "composer_trials": composer_trials,
        "finder": finder,
        "finder_speed": speed(finder),
        "finder_trials": finder_trials,
        "plan_s": case["plan_s"],
    }


def main(folder: str) -> None:
    from lightning_memkit.units import format_bytes

    def short(text) -> str:
        if text is None:
            return "-"
        return (text.describe() if hasattr(text, "describe") else text).replace(", 32-true", "")

    gpu = (Path(folder) / "gpu.txt").read_text().strip().splitlines()
    recorded = [line for line in gpu if line.startswith("{") and '"commit"' in line]
    # where the logs came from (a lease's gpu.txt names it, from benchmarks/provenance.py), and this table
    print(
        f"# logs' provenance: {recorded[-1]}"
        if recorded
        else "# logs' provenance: not recorded (these logs predate benchmarks/provenance.py; gpu.txt has the sources' "
        "sha256 and the versions)"
    )
    print(provenance_line().replace("# provenance:", "# table's provenance:"))
    print(next((line for line in reversed(gpu) if " torch " in line), gpu[-1]))
    print()
    print(
        "| model | budget | fit / run | brute-force best (samples/s) | planner's choice | % of best | within 5% | "
        "trials | "
        "real peak <= budget | Spearman | measured / predicted samples/s (min, median, max) | "
        "choice, lease 2 / lease 1 | halve until it fits | largest batch, then accumulate |"
    )
    print("|---|---|---:|---|---|---:|---|---:|---|---:|---|---:|---|---|")
    for (name, budget), case in sorted(read(Path(folder)).items(), key=lambda kv: (kv[0][0], -kv[0][1])):
        r = summarize(name, budget, case)

        def pct(speed, best_speed=r["best_speed"]) -> str:
            return f"{speed / best_speed:.0%}" if speed else "none fit"

        share = r["choice_speed"] / r["best_speed"]
        print(
            f"| {name} | {format_bytes(budget)} | {r['fitting']} / {r['run']} | {short(r['best'])} "
            f"({r['best_speed']:.1f}) | "
            f"{short(r['choice'])} | {share:.0%} | {'yes' if share >= 0.95 else 'no'} | {r['trials']} | "
            f"{'yes' if r['peak'] <= budget else 'NO'} ({format_bytes(r['peak'])} allocated) | {r['rho']:.2f} "
            f"(n={r['pairs']}) | "
            f"{r['error'][0]:.2f}, {r['error'][1]:.2f}, {r['error'][2]:.2f} | {1 / r['scale']:.1%} | "
            f"{short(r['composer'])}: {pct(r['composer_speed'])}, {r['composer_trials']} trials | "
            f"{short(r['finder'])}: {pct(r['finder_speed'])}, {r['finder_trials']} trials |"
        )
        if r["missed"]:
            print(f"|  | predicted over the budget but fit: {'; '.join(short(t) for t in r['missed'])} |||||||||||||")


if __name__ == "__main__":
    main(
        sys.argv[1]
        if len(sys.argv) > 1
        else os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "h200_2026-11-27")
    )
