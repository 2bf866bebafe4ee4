"""A plan in the time of a few steps, on CPU, on a BERT-like classifier of 5.0M parameters.

    python benchmarks/plan_padded_text.py plan [--max-seconds S]   # plan_fit as memkit plan runs it
    python benchmarks/plan_padded_text.py autofit                  # AutoFit's planning inside trainer.fit

The model is ``lightning_memkit.zoo_variable.PaddedTextClassifier(d_model=256, layers=6, dim_feedforward=1024,
batch_size=32)`` (text padded per batch, lengths 16 to 256, torchmetrics on argmax; a plan runs on the data's worst
batch, padded to 255) at a 512 MiB budget, which its batch of 32 does not fit (1.78 GiB predicted).

- ``plan``: ``plan_fit`` with the progress lines ``memkit plan`` prints, then the table and one summary line (wall
  time, the choice, the phases).
- ``autofit``: a Trainer with ``AutoFit(device_memory="512MiB")`` trains ``--steps`` steps; prints the plan's seconds
  and the wall time from ``trainer.fit`` to the first training batch.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MODEL = {"d_model": 256, "layers": 6, "dim_feedforward": 1024, "batch_size": 32}
BUDGET = "512MiB"


def _make():
    import torch

    from lightning_memkit.zoo_variable import PaddedTextClassifier

    torch.manual_seed(0)
    return PaddedTextClassifier(**MODEL)


def _worst(module):
    from lightning_memkit.estimate.data.worst_batch import worst_batch_and_length

    worst, _ = worst_batch_and_length(module, None)
    return worst


def plan(args: argparse.Namespace) -> None:
    from lightning_memkit.plan import plan_fit

    started = time.perf_counter()
    result = plan_fit(_make(), device_memory=BUDGET, device="cpu", verbose=True, max_seconds=args.max_seconds)
    wall = time.perf_counter() - started
    print(result.table())
    print(
        f"# plan: {wall:.1f} s wall ({result.seconds:.1f} s in plan_fit, budget {result.max_seconds:.0f} s); best "
        f"{result.best.describe() if result.best else None}; phases: "
        + ", ".join(p.describe() + (f" ({p.detail})" if p.detail else "") for p in result.phases)
    )


def autofit(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl

    from lightning_memkit.callbacks.auto_fit import AutoFit

    class FirstBatch(pl.Callback):
        at: float | None = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if self.at is None:
                self.at = time.perf_counter()

    first, auto = FirstBatch(), AutoFit(device_memory=BUDGET)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[auto, first],
    )
    started = time.perf_counter()
    trainer.fit(_make())
    print(
        f"# autofit: plan {auto.plan.seconds:.1f} s (budget {auto.plan.max_seconds:.0f} s), "
        f"{first.at - started:.1f} s from trainer.fit to the first batch, {time.perf_counter() - started:.1f} s in "
        f"all; trains {auto.applied}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("plan")
    command.add_argument("--max-seconds", type=float, default=None)
    command.set_defaults(run=plan)
    command = commands.add_parser("autofit")
    command.add_argument("--steps", type=int, default=2)
    command.set_defaults(run=autofit)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    args.run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
