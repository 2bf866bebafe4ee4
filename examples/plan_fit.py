"""My batch does not fit: the fastest way to train it anyway, with plan_fit, then a fit with the plan.

Runs on CPU in well under a minute on an idle machine: the memory budget is a CPU budget of live tensors (the
accountant's bytes), set below what the baseline (the batch as is) needs, so the planner must change something: a
smaller micro-batch with gradient accumulation (the effective batch stays the same), or activation checkpointing. On a
GPU leave ``--budget`` out and the device's memory is the budget.

    python examples/plan_fit.py
    python examples/plan_fit.py --fraction 0.8   # a budget of 80% of the baseline's peak
"""

from __future__ import annotations

import argparse
import warnings

import lightning.pytorch as pl

from lightning_memkit import Candidate, Plan, PlanError, PlanRow, estimate_memory, plan_fit
from lightning_memkit.units import format_bytes
from lightning_memkit.zoo import DemoTransformer

warnings.filterwarnings("ignore", ".*does not have many workers.*")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--fraction",
        type=float,
        default=0.7,
        help="the budget as a fraction of the baseline's estimated peak (default: 0.7)",
    )
    parser.add_argument("--steps", type=int, default=4, help="steps of the fit with the plan (default: 4)")
    args = parser.parse_args()
    pl.seed_everything(0, verbose=False)
    model = DemoTransformer(
        vocab_size=256, d_model=64, nhead=4, layers=2, dim_feedforward=256, seq_len=32, dropout=0.0, batch_size=16
    )

    # 1. What the batch as is needs (fake tensors, exact on CPU), and a budget below it.
    baseline = estimate_memory(model, device="cpu").peak_bytes
    budget = int(baseline * args.fraction)
    print(f"baseline: batch {model.batch_size} needs {format_bytes(baseline)}; budget {format_bytes(budget)}")

    # 2. The plan: every candidate estimated, the top ones trained for real (at most 3 trials, on a copy of the model).
    try:
        plan: Plan = plan_fit(model, device_memory=budget, device="cpu")
    except (
        PlanError
    ) as error:  # input it cannot plan for (a budget below the parameters...): the message says what to give
        raise SystemExit(f"cannot plan: {error}") from None
    print(plan.table())
    ran: list[PlanRow] = [row for row in plan.rows if row.ran]
    print(f"{len(ran)} of {len(plan.rows)} candidates trained for real")
    best: Candidate = plan.best
    print(plan.yaml())

    # 3. Train with it: the micro-batch is the dataloader's batch size, the rest are Trainer arguments.
    model.batch_size = best.micro_batch
    trainer = pl.Trainer(
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **plan.trainer_arguments(),
    )
    trainer.fit(model)
    print(f"trained {trainer.global_step} steps of {best.effective_batch} samples with {best.describe()}")


if __name__ == "__main__":
    main()
