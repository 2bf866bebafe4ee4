"""Memory modes side by side on CPU: per-step peak (exact tensor bytes) and step time of each mode.

    .venv/bin/python benchmarks/modes.py                 # transformer encoder and a ResNet-style CNN
    .venv/bin/python benchmarks/modes.py --markdown      # the table for docs/modes.md

Each model is built once per mode from the same seed. Memory: two training steps per mode under
memkit's MemoryMeter (the TensorAccountant counts every live tensor storage exactly); the figure is the
peak of the second step, when Adam's state exists. Time: without the accountant, the modes take turns
(round robin, order rotated every round), and the median step time is reported. The step is what the
Trainer runs: zero_grad, ``training_step`` inside Lightning's own precision plugin's forward context
(``MixedPrecision("bf16-mixed", "cpu")`` for bf16), backward, optimizer step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from lightning.pytorch.plugins.precision import MixedPrecision, Precision  # noqa: E402

from lightning_memkit import MemoryMeter, Mode, apply_checkpointing, parse_mode, training_state_tensors  # noqa: E402
from lightning_memkit.summary_table import format_table  # noqa: E402
from lightning_memkit.units import MiB  # noqa: E402
from lightning_memkit.zoo import DemoResNet, DemoTransformer, _BasicBlock  # noqa: E402

MODES = ("baseline", "checkpoint", "bf16", "bf16+checkpoint")

MODELS = {
    # A transformer encoder at a batch where activations dominate the step's memory.
    "transformer": lambda: DemoTransformer(
        vocab_size=1000, d_model=128, nhead=4, layers=8, dim_feedforward=512, seq_len=128, batch_size=16
    ),
    # The same encoder without dropout (as many current recipes train): on CPU, drawing dropout masks
    # (bernoulli) is a large share of the forward, and checkpointing draws them again.
    "transformer-nodropout": lambda: DemoTransformer(
        vocab_size=1000, d_model=128, nhead=4, layers=8, dim_feedforward=512, seq_len=128, batch_size=16, dropout=0.0
    ),
    # A ResNet-style CNN (BatchNorm, residual blocks in stages).
    "cnn": lambda: DemoResNet(channels=16, stages=(2, 2, 2), image_size=64, batch_size=32),
}


#: more modes for one model. The CNN's repeated blocks are its 3 stages (a ModuleList of Sequentials), so
#: "checkpoint" (auto) checkpoints whole stages; naming the block class checkpoints each residual block.
EXTRA_MODES = {
    "cnn": [
        Mode(checkpoint={_BasicBlock}, name="checkpoint:{BasicBlock}"),
        Mode(precision="bf16-mixed", checkpoint={_BasicBlock}, name="bf16+checkpoint:{BasicBlock}"),
    ],
}


class Variant:
    """One mode of one model: its own copy of the model and optimizer, ready to step."""

    def __init__(self, factory, mode_text: str | Mode, seed: int) -> None:
        self.mode = parse_mode(mode_text)
        torch.manual_seed(seed)
        self.model = factory()
        self.model.train()
        # Outside a Trainer, self.log has nowhere to go: mute it.
        self.model.__dict__["log"] = lambda *args, **kwargs: None
        self.optimizer = self.model.configure_optimizers()
        precision = self.mode.precision_for("cpu")
        self.plugin = MixedPrecision(precision, "cpu") if precision else Precision()
        self.handle = apply_checkpointing(self.model, self.mode.checkpoint) if self.mode.checkpoint else None
        self.times: list[float] = []
        self.peaks: list[int] = []
        self.start_bytes: int | None = None

    def step(self, batch) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        with self.plugin.forward_context():
            output = self.model.training_step(batch, 0)
        loss = output["loss"] if isinstance(output, dict) else output
        loss.backward()
        self.optimizer.step()


def run_model(
    name: str, factory, modes, rounds: int, steps_per_round: int, seed: int = 0, clock=time.perf_counter
) -> list[dict]:
    torch.manual_seed(seed)
    batch = next(iter(factory().train_dataloader()))
    variants = [Variant(factory, m, seed) for m in modes]
    for v in variants:  # memory: exact, two steps each, the second one counts
        meter = MemoryMeter(
            "cpu", tensor_accounting=True, tensor_scope="step", nvml=False, host=False
        )  # each variant alone, not the others held beside it
        for step in range(2):
            with meter.measure(step, existing=training_state_tensors(v.model, [v.optimizer], batch)):
                v.step(batch)
            v.peaks.append(meter.last.peak_tensor_bytes)
        meter.shutdown()
        v.start_bytes = sum(
            t.untyped_storage().nbytes()
            for t in {
                id(t.untyped_storage()): t for t in training_state_tensors(v.model, [v.optimizer], batch)
            }.values()
        )
        if v.handle is not None:
            v.regions = v.handle.plan.count
    for v in variants:  # warm-up, untimed
        v.step(batch)
    for r in range(rounds):  # time: round robin, rotated order
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for v in order:
            for _ in range(steps_per_round):
                t0 = clock()
                v.step(batch)
                v.times.append(clock() - t0)
    base = variants[0]
    rows = []
    for v in variants:
        rows.append(
            {
                "model": name,
                "mode": v.mode.name,
                "peak_bytes": v.peaks[-1],
                "peak_ratio": v.peaks[-1] / base.peaks[-1],
                "median_step_s": statistics.median(v.times),
                "time_ratio": statistics.median(v.times) / statistics.median(base.times),
                "regions": v.handle.plan.count if v.handle else 0,
                "batch": tuple(batch[0].shape),
                "activation_share": (v.peaks[-1] - v.start_bytes) / v.peaks[-1],
            }
        )
    return rows


def _keep_freed_memory() -> None:
    """Re-run this script with glibc keeping freed memory, as CUDA's caching allocator does.

    By default glibc hands large freed blocks back to the OS, so every step faults its activation
    pages in again; in a VM that costs more than the arithmetic and, since checkpointing allocates
    differently, it skews the time ratios. The memory figures do not depend on it (exact tensor bytes).
    """
    if os.environ.get("MALLOC_TRIM_THRESHOLD_"):
        return
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(32 * MiB), MALLOC_TRIM_THRESHOLD_=str(64 * 1024 * MiB))
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps-per-round", type=int, default=1)
    parser.add_argument(
        "--glibc-default",
        action="store_true",
        help="keep glibc's default of returning freed memory to the OS (see _keep_freed_memory)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: time.perf_counter; cpu: this process's CPU time (time.process_time), which other "
        "jobs on a shared machine disturb less; use it with --threads 1",
    )
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = parser.parse_args(argv)
    if not args.glibc_default:
        _keep_freed_memory()
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = args.modes.split(",")
    rows = []
    for name in args.models.split(","):
        rows += run_model(
            name,
            MODELS[name],
            modes + EXTRA_MODES.get(name, []),
            args.rounds,
            args.steps_per_round,
            clock=time.process_time if args.clock == "cpu" else time.perf_counter,
        )
    headers = (
        "model",
        "mode",
        "batch",
        "regions",
        "per-step peak",
        "peak vs baseline",
        "saving",
        "median step",
        "time vs baseline",
        "step memory beyond state",
    )
    table = [
        (
            r["model"],
            r["mode"],
            "x".join(map(str, r["batch"])),
            r["regions"],
            f"{r['peak_bytes'] / MiB:.1f} MiB",
            f"{r['peak_ratio']:.2f}x",
            f"{1 - r['peak_ratio']:.0%}",
            f"{r['median_step_s'] * 1000:.0f} ms",
            f"{r['time_ratio']:.2f}x",
            f"{r['activation_share']:.0%}",
        )
        for r in rows
    ]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU, {args.clock} clock; "
        f"{args.rounds} rounds x {args.steps_per_round} timed steps per mode"
    )
    if args.markdown:
        print("| " + " | ".join(headers) + " |")
        print("|" + "---|" * len(headers))
        for row in table:
            print("| " + " | ".join(map(str, row)) + " |")
    else:
        print(format_table(headers, table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
