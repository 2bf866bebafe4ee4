"""Issue 36's acceptance on CPU: a plan in the time of a few steps, on a BERT-like classifier of 5.0M parameters.

    python benchmarks/plan_padded_text.py plan [--max-seconds S]   # plan_fit as memkit plan runs it
    python benchmarks/plan_padded_text.py autofit                  # AutoFit's planning inside trainer.fit
    python benchmarks/plan_padded_text.py brute --rounds 3 --timed 3
    python benchmarks/plan_padded_text.py pair 8x4:auto 4x8 --rounds 6

The model is ``lightning_memkit.zoo_variable.PaddedTextClassifier(d_model=256, layers=6, dim_feedforward=1024,
batch_size=32)`` (text padded per batch, lengths 16 to 256, torchmetrics on argmax; a plan runs on the data's worst
batch, padded to 255) at a 512 MiB budget, which its batch of 32 does not fit (1.78 GiB predicted).

- ``plan``: ``plan_fit`` with the progress lines ``memkit plan`` prints, then the table and one summary line (wall
  time, the choice, the phases).
- ``autofit``: a Trainer with ``AutoFit(device_memory="512MiB")`` trains ``--steps`` steps; prints the plan's seconds
  and the wall time from ``trainer.fit`` to the first training batch.
- ``brute``: every configuration a trial could choose (those the estimate predicts to fit, one per program, and no
  checkpointing of a micro-batch that fits without it: the same step plus the recompute), each a real trial under
  the 512 MiB budget (its peak proved; 1 warm-up step, ``--timed`` timed ones, the median), in ``--rounds`` rounds
  of rotated order; the median of the rounds, sorted.
- ``pair``: two configurations (``MICROxACCUMULATION[:auto|:budget=FRACTION]``) side by side, each round timing both
  (the order alternating) the way ``brute`` does: the first's samples/s over the second's, the median of the
  per-round ratios and their geometric mean with a 95% interval.

A step of the batch of 32 takes seconds on a 2-core CPU: ``brute`` with 3 rounds of 3 timed steps over 6
configurations takes about 5 minutes on an idle one, ``pair`` about 30 s a round.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
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
    from lightning_memkit.estimate.worst_batch import worst_batch_and_length

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


def _trial_step(module, batch, budget, candidate, timed: int) -> float:
    from lightning_memkit.plan.trials import trial as _trial

    fits, peak, samples, note = _trial(module, candidate, batch, budget, "cpu", 1, timed)
    if not fits or samples is None:
        raise SystemExit(f"{candidate.describe()} did not run within {BUDGET}: {note}")
    return candidate.effective_batch / samples


def brute(args: argparse.Namespace) -> None:
    from lightning_memkit.estimate.core import reusing_fake_copies
    from lightning_memkit.modes.checkpoint_policy import find_repeated_blocks
    from lightning_memkit.plan.inputs import PlanInputs
    from lightning_memkit.plan.rows import contenders, estimate_families
    from lightning_memkit.plan.space import candidate_space
    from lightning_memkit.plan.time_model import TimeModel, calibrate_cpu
    from lightning_memkit.units import parse_bytes

    module, budget = _make(), parse_bytes(BUDGET)
    batch = _worst(module).batch
    space = candidate_space(MODEL["batch_size"], device_type="cpu", can_checkpoint=bool(find_repeated_blocks(module)))
    rows = []
    with reusing_fake_copies():
        inputs = PlanInputs(module, batch, MODEL["batch_size"], budget, "cpu", space)
        estimate_families(inputs, rows, TimeModel(calibrate_cpu()))
    configurations = [row.candidate for row in contenders(rows)]
    print(
        f"# brute force over {len(configurations)} configurations: " + "; ".join(c.describe() for c in configurations),
        flush=True,
    )
    _trial_step(module, batch, budget, configurations[0], 1)  # discarded: the process's first steps run slower
    steps: dict = {c: [] for c in configurations}
    started = time.perf_counter()
    for round_ in range(args.rounds):
        shift = round_ * len(configurations) // args.rounds
        order = configurations[shift:] + configurations[:shift]
        for candidate in order[::-1] if round_ % 2 else order:
            steps[candidate].append(_trial_step(module, batch, budget, candidate, args.timed))
        print(
            f"# round {round_ + 1}: " + ", ".join(f"{c.describe()} {steps[c][-1]:.2f} s" for c in configurations),
            flush=True,
        )
    ranked = sorted(configurations, key=lambda c: statistics.median(steps[c]))
    best = statistics.median(steps[ranked[0]])
    print(f"# {time.perf_counter() - started:.0f} s; {args.rounds} rounds of {args.timed} timed steps each")
    print("| configuration | samples/s (median of the rounds) | % of the best | rounds (s per step) |")
    print("|---|---:|---:|---|")
    for candidate in ranked:
        median = statistics.median(steps[candidate])
        print(
            f"| {candidate.describe()} | {MODEL['batch_size'] / median:.2f} | {best / median:.0%} | "
            + ", ".join(f"{s:.2f}" for s in steps[candidate])
            + " |"
        )


def pair(args: argparse.Namespace) -> None:
    from lightning_memkit.units import parse_bytes
    from plan_side_by_side import parse_candidate

    first, second = parse_candidate(args.first), parse_candidate(args.second)
    module, budget = _make(), parse_bytes(BUDGET)
    batch = _worst(module).batch
    _trial_step(module, batch, budget, first, 1)  # discarded: the process's first steps run slower
    ratios = []
    for round_ in range(args.rounds):
        step = {}
        for candidate in (first, second) if round_ % 2 == 0 else (second, first):
            step[candidate] = _trial_step(module, batch, budget, candidate, args.timed)
        ratios.append(step[second] / step[first])  # samples/s of the first over the second's
        print(f"# round {round_ + 1}: {ratios[-1]:.3f}", flush=True)
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    error = statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else float("nan")
    print(
        f"samples/s of {first.describe()} over {second.describe()}, {args.rounds} rounds side by side: median "
        f"{statistics.median(ratios):.3f}, geometric mean {math.exp(mean):.3f} (95% interval "
        f"{math.exp(mean - 2 * error):.3f} to {math.exp(mean + 2 * error):.3f}); rounds: "
        + ", ".join(f"{r:.2f}" for r in ratios)
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
    command = commands.add_parser("brute")
    command.add_argument("--rounds", type=int, default=3)
    command.add_argument("--timed", type=int, default=3)
    command.set_defaults(run=brute)
    command = commands.add_parser("pair")
    command.add_argument("first")
    command.add_argument("second")
    command.add_argument("--rounds", type=int, default=6)
    command.add_argument("--timed", type=int, default=3)
    command.set_defaults(run=pair)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    args.run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
