"""The planner's time model against real timings on CPU: every configuration plan_fit estimated as fitting, timed.

    .venv/bin/python benchmarks/plan_time_model.py            # a transformer LM and a CNN, one budget each
    .venv/bin/python benchmarks/plan_time_model.py --quick    # smaller models

For each model the budget is halfway between the baseline's estimated peak (the user's batch as is) and the smallest
micro-batch's, so the baseline does not fit. ``plan_fit`` runs (its own <= 3 trials and calibration); then every row it
estimated as fitting is timed the same way a trial is (a real Trainer on a copy, 1 warm-up step, median of the timed
steps, no accountant), in one run, rows in turn. Printed per row: predicted step (the calibrated time model),
measured step, relative error; per model: the Spearman correlation of the predicted and measured samples/s, and
whether plan.best is within 5% of the fastest measured.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from lightning_memkit.estimate import estimate_memory  # noqa: E402
from lightning_memkit.plan import plan_fit  # noqa: E402
from lightning_memkit.plan.timing import timed_step as _timed_step  # noqa: E402
from lightning_memkit.summary_table import format_table  # noqa: E402
from lightning_memkit.zoo import DemoCNN, DemoTransformer  # noqa: E402


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    for rank, index in enumerate(order):
        ranks[index] = float(rank)
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (no ties expected among timings)."""
    n = len(a)
    if n < 2:
        return float("nan")
    ra, rb = _ranks(a), _ranks(b)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--timed-steps", type=int, default=4)
    args = parser.parse_args()
    if args.quick:
        models = {
            "transformer LM": lambda: DemoTransformer(
                vocab_size=256,
                d_model=64,
                nhead=4,
                layers=2,
                dim_feedforward=256,
                seq_len=32,
                dropout=0.0,
                batch_size=16,
            ),
            "CNN": lambda: DemoCNN(batch_size=16),
        }
    else:
        models = {
            "transformer LM": lambda: DemoTransformer(
                vocab_size=1000,
                d_model=128,
                nhead=4,
                layers=4,
                dim_feedforward=512,
                seq_len=64,
                dropout=0.0,
                batch_size=32,
            ),
            "CNN": lambda: DemoCNN(batch_size=32),
        }
    for name, build in models.items():
        module = build()
        batch = module.batch_size
        top = estimate_memory(module, device="cpu").peak_bytes
        low = estimate_memory(module, max(1, batch // 8), device="cpu").peak_bytes
        budget = (top + low) // 2
        plan = plan_fit(module, device_memory=budget, device="cpu", verbose=False, timed_steps=args.timed_steps)
        sample = next(iter(module.train_dataloader()))
        rows, predicted, measured = [], [], []
        for row in plan.rows:
            if not row.fits or row.predicted_step_s is None:
                continue
            seconds = _timed_step(module, row.candidate, sample, "cpu", 1, args.timed_steps)
            predicted.append(row.predicted_samples_per_s)
            measured.append(row.candidate.effective_batch / seconds)
            rows.append(
                (
                    row.candidate.describe(),
                    f"{row.predicted_step_s * 1e3:.1f}",
                    f"{seconds * 1e3:.1f}",
                    f"{(row.predicted_step_s - seconds) / seconds:+.0%}",
                    "yes" if row.ran else "",
                )
            )
        fastest = max(measured)
        best_measured = next(
            m
            for row, m in zip([r for r in plan.rows if r.fits and r.predicted_step_s is not None], measured)
            if row.candidate == plan.best
        )
        print(
            f"\n{name}: effective batch {batch}, budget {budget} B, {plan.trials} trials; best {plan.best.describe()}"
        )
        print(format_table(("configuration", "predicted ms", "measured ms", "error", "trial"), rows))
        print(
            f"Spearman(predicted, measured samples/s) = {spearman(predicted, measured):.2f}; best at "
            f"{best_measured / fastest:.1%} of the fastest measured"
        )
        for note in plan.notes:
            print("note:", note)


if __name__ == "__main__":
    main()
