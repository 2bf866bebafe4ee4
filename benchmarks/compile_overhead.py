"""What memkit costs on a compiled model, and proof that it stays compiled: one compiled model, fit side by side.

Each variant is a fresh Trainer on the same compiled model (compiled once, in a warm-up fit, so no variant pays
compilation); the per-step time is the median, over the measured steps after ``--warmup`` steps of every round,
of the process's CPU time between consecutive ``on_train_batch_start`` calls (every callback's hooks are inside
it; CPU time, not wall time, because other processes' load on a shared machine stretches wall time at random).
The variants run side by side: ``--rounds`` rounds, each running every variant once, in an order rotated from
round to round, so a change in the machine's load hits every variant alike; each round's ratio is printed too,
and the load average before and after. Variants:

    compiled        the compiled fit, no memkit (the reference: ratio 1.00)
    tracker         MemoryTracker(): default sampling (the allocator's events on 2 + 1-in-10 logged steps)
    tracker-exact   MemoryTracker(tensor_peak_every_n_steps=1): the compiled step's peak on every step
    traced          LayerTrace(every_n_steps=1): every step traced (rows per compiled region)
    doctor          MemoryDoctor(): the allocator's live bytes between steps, a walk for kept tensors
    eager           the same model uncompiled, no memkit (what switching compile off would cost)
    eager+tracker   the uncompiled model with MemoryTracker() (memkit's own per-step cost on an eager model,
                    with dynamo's compiled code alive in the process; its ratio is to "eager")

For each: graph calls per step (a counting backend wraps the real one: > 0 on every measured step means compiled
code ran at every step), and the tracker's step peak.

    python benchmarks/compile_overhead.py --model gpt2 --rounds 3     # HF GPT-2, small config, inductor
    python benchmarks/compile_overhead.py --model cnn --backend aot_eager --steps 12 --warmup 3 --rounds 3
    python benchmarks/compile_overhead.py --model gpt2 --variants compiled tracker eager eager+tracker
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import warnings

import lightning.pytorch as pl
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lightning_memkit import LayerTrace, MemoryDoctor, MemoryTracker  # noqa: E402
from tests.helpers.compile_models import CompiledCNN, CompiledGPT2, CountingBackend  # noqa: E402


class StepClock(pl.Callback):
    """CPU time between consecutive training batch starts, and compiled-graph calls per step."""

    def __init__(self, backend: CountingBackend | None) -> None:
        self.backend = backend
        self.times: list[float] = []
        self.calls: list[int] = []
        self._last: float | None = None
        self._calls = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        now = time.process_time()
        calls = self.backend.calls if self.backend is not None else 0
        if self._last is not None:
            self.times.append(now - self._last)
            self.calls.append(calls - self._calls)
        self._last, self._calls = now, calls


def build(args: argparse.Namespace, compiled: bool, backend: CountingBackend | None):
    torch.manual_seed(0)
    samples = args.batch_size * (args.steps + 2)
    if args.model == "gpt2":
        return CompiledGPT2(
            compile=compiled,
            backend=backend,
            layers=args.layers,
            width=args.width,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            samples=samples,
        )
    return CompiledCNN(compile=compiled, backend=backend, batch_size=args.batch_size, samples=samples)


def fit(model, callbacks, steps: int, root: str) -> None:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        log_every_n_steps=1,
        callbacks=callbacks,
    )
    trainer.fit(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("gpt2", "cnn"), default="gpt2")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every variant, side by side (order rotated)")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["compiled", "tracker", "tracker-exact", "traced", "doctor", "eager", "eager+tracker"],
        choices=["compiled", "tracker", "tracker-exact", "traced", "doctor", "eager", "eager+tracker"],
        help="which variants to run (ratios need 'compiled', and 'eager' for eager+tracker)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    root = os.path.join("/tmp", f"memkit_compile_overhead_{os.getpid()}")

    backend = CountingBackend(args.backend)
    model = build(args, True, backend)
    start = time.perf_counter()
    fit(model, [], args.warmup + 2, root)  # compiles
    print(
        f"{args.model} ({args.backend}): compiled in a warm-up fit of {args.warmup + 2} steps, "
        f"{time.perf_counter() - start:.1f} s wall; {backend.compiled} graphs"
    )

    variants = {
        "compiled": (True, lambda: []),
        "tracker": (True, lambda: [MemoryTracker(verbose=False)]),
        "tracker-exact": (True, lambda: [MemoryTracker(tensor_peak_every_n_steps=1, verbose=False)]),
        "traced": (True, lambda: [LayerTrace(every_n_steps=1, verbose=False, figure=False)]),
        "doctor": (True, lambda: [MemoryDoctor(verbose=False)]),
        "eager": (False, lambda: []),
        "eager+tracker": (False, lambda: [MemoryTracker(verbose=False)]),
    }
    names = [name for name in variants if name in args.variants]
    eager = build(args, False, None) if any(not variants[name][0] for name in names) else None
    times: dict[str, list[float]] = {name: [] for name in names}
    per_round: dict[str, list[float]] = {name: [] for name in names}
    calls: dict[str, list[int]] = {name: [] for name in names}
    peaks: dict[str, int | None] = dict.fromkeys(names)
    load_before = os.getloadavg()
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:  # rotated: no variant always runs first or last
            compiled, make = variants[name]
            clock = StepClock(backend if compiled else None)
            callbacks = make()
            fit(model if compiled else eager, callbacks + [clock], args.steps, root)
            measured = clock.times[args.warmup :]
            times[name] += measured
            per_round[name].append(statistics.median(measured))
            calls[name] += clock.calls[args.warmup :]
            if callbacks and isinstance(callbacks[0], MemoryTracker):
                found = [r.peak_tensor_bytes for r in callbacks[0].history if r.peak_tensor_bytes is not None]
                peaks[name] = max(found) if found else None
            del callbacks
            gc.collect()
    load_after = os.getloadavg()

    def base_of(name: str) -> str:
        return "compiled" if variants[name][0] else "eager"

    print(
        f"{args.rounds} rounds x {args.steps - args.warmup} measured steps per variant; load average (1, 5, 15 min) "
        f"before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, after {load_after[0]:.2f} "
        f"{load_after[1]:.2f} {load_after[2]:.2f} ({os.cpu_count()} CPUs)"
    )
    print(
        f"{'variant':<15}{'ms/step (CPU)':>14}{'ratio':>8}  "
        f"{'ratio per round':<22}{'graph calls/step (min)':>24}{'tracker peak bytes':>20}"
    )
    for name in names:
        base = base_of(name)
        if base not in times:
            continue
        ratio = statistics.median(times[name]) / statistics.median(times[base])
        rounds = " ".join(f"{a / b:.2f}" for a, b in zip(per_round[name], per_round[base], strict=True))
        peak = peaks[name]
        print(
            f"{name:<15}{statistics.median(times[name]) * 1e3:>14.2f}{ratio:>8.2f}  {rounds:<22}"
            f"{(min(calls[name]) if variants[name][0] else 0):>24}{'' if peak is None else peak:>20}"
        )
    print('ratios: to "compiled" for the compiled variants, to "eager" for eager+tracker')


if __name__ == "__main__":
    main()
