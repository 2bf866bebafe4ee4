"""Per-step cost of MemoryTracker vs no callback vs Lightning's DeviceStatsMonitor, on CPU.

Every variant trains the same model with the same logger and logs every step; the variants
are interleaved (a fresh Trainer per run, order rotated each repeat), and the per-step time
is the median over all measured steps of the time between consecutive ``on_train_batch_start``
calls (so every callback's and the logger's work is inside it). Ratios are to "none".
Time is the process's CPU time by default (``--clock wall`` for wall time): on a shared
machine other processes' load stretches wall time at random, while the CPU time a step
costs this process does not change with it.
A second figure is the time spent inside the callback's own per-step hooks (its probes, its
dict building and its ``logger.log_metrics`` calls), timed directly. A third, "paired", runs
each callback on every other step of one run and compares neighbouring steps (divided by
the same ratio of a run without any callback), so slow drifts in the machine's load cancel.

torch runs on one thread: on a small shared machine, OpenMP threads that wait for a
descheduled sibling make step times jump by tens of milliseconds, which would drown a 3% effect.

    python benchmarks/tracker_overhead.py            # about 2 minutes on 2 cores
    python benchmarks/tracker_overhead.py --quick    # a smoke run

Variants (every one logs at the same interval: log_every_n_steps=1, MemoryTracker every step):
    none          no memory callback
    memkit        MemoryTracker(tensor_accounting=False): host RSS + per-step peak RSS on CPU
                  (the allocator path: on CUDA it reads allocator counters instead)
    memkit        MemoryTracker(): the default on CPU: host RSS, the whole process's live tensor
     default      bytes every step (tensor_MiB), the accountant's per-op peak on one logged step in 10
    memkit+peak   MemoryTracker(tensor_peak_every_n_steps=1): the accountant's exact peak on every
                  step as well (what tensor_accounting=True gave before the default sampled it)
    devicestats   lightning.pytorch.callbacks.DeviceStatsMonitor(cpu_stats=True)

Models: "100ms" a 2-block transformer encoder (lightning_memkit.zoo.DemoTransformer, many small
ops, like a small GPT), "20ms" a wide MLP, "1ms" a tiny MLP (almost nothing but per-op overhead).
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import DeviceStatsMonitor
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memkit import MemoryTracker
from lightning_memkit.zoo import DemoTransformer


class BenchMLP(pl.LightningModule):
    """A Linear+ReLU stack on a fixed random tensor; SGD; the loss logged every step."""

    def __init__(self, width: int, depth: int, batch_size: int, in_features: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        features = in_features
        for _ in range(depth):
            layers += [nn.Linear(features, width), nn.ReLU()]
            features = width
        layers.append(nn.Linear(features, 10))
        self.net = nn.Sequential(*layers)
        self.batch_size = batch_size
        self.data = torch.randn(batch_size * 64, in_features)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = self.net(x).pow(2).mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-4)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.data), batch_size=self.batch_size)


class BenchTransformer(DemoTransformer):
    """DemoTransformer with 2 blocks (its loss logged every step); enough data for any run here."""

    def __init__(self) -> None:
        super().__init__(layers=2, batch_size=16)

    def train_dataloader(self):
        tokens = torch.randint(0, self.hparams.vocab_size, (16 * 200, self.hparams.seq_len))
        labels = torch.randint(0, self.hparams.num_classes, (16 * 200,))
        return DataLoader(TensorDataset(tokens, labels), batch_size=16)


MODELS = {
    # name: (constructor kwargs, measured steps per run)
    "100ms": ({}, 20),
    "20ms": ({"width": 1024, "depth": 3, "batch_size": 128, "in_features": 512}, 40),
    "1ms": ({"width": 32, "depth": 1, "batch_size": 8, "in_features": 16}, 150),
}


def _model(name: str) -> pl.LightningModule:
    kwargs, _ = MODELS[name]
    return BenchTransformer() if name == "100ms" else BenchMLP(**kwargs)


class _StepClock(pl.Callback):
    """Placed first, so its on_train_batch_start runs before every other callback's."""

    def __init__(self, clock) -> None:
        self.clock = clock
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.starts.append(self.clock())

    def on_train_end(self, trainer, pl_module):
        self.starts.append(self.clock())


_STEP_HOOKS = (
    "on_train_batch_start",
    "on_train_batch_end",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
)


class _HookTimer:
    """Times every per-step hook of one callback instance (seconds per step, summed)."""

    def __init__(self, callback: pl.Callback, clock) -> None:
        self.clock = clock
        self.per_step: list[float] = []
        self._current = 0.0
        for name in _STEP_HOOKS:
            hook = getattr(callback, name)
            setattr(callback, name, self._wrap(name, hook))

    def _wrap(self, name, hook):
        def timed(*args, **kwargs):
            start = self.clock()
            try:
                return hook(*args, **kwargs)
            finally:
                self._current += self.clock() - start
                if name == "on_train_batch_end":
                    self.per_step.append(self._current)
                    self._current = 0.0

        return timed


def _callbacks(variant: str) -> list[pl.Callback]:
    if variant == "none":
        return []
    if variant == "memkit":
        return [MemoryTracker(tensor_accounting=False, verbose=False)]
    if variant == "memkit-default":
        return [MemoryTracker(verbose=False)]
    if variant == "memkit+peak":
        return [MemoryTracker(tensor_accounting=True, tensor_peak_every_n_steps=1, verbose=False)]
    if variant == "devicestats":
        return [DeviceStatsMonitor(cpu_stats=True)]
    raise ValueError(f"unknown variant {variant!r}")


class _EveryOtherStep(pl.Callback):
    """Runs ``inner``'s per-step hooks on even batches only (its other hooks always), so one
    run alternates measured and unmeasured steps: neighbouring steps share the machine's load."""

    def __init__(self, inner: pl.Callback) -> None:
        self.inner = inner

    def setup(self, *args, **kwargs):
        self.inner.setup(*args, **kwargs)

    def teardown(self, *args, **kwargs):
        self.inner.teardown(*args, **kwargs)

    def on_fit_start(self, *args, **kwargs):
        self.inner.on_fit_start(*args, **kwargs)

    def on_fit_end(self, *args, **kwargs):
        self.inner.on_fit_end(*args, **kwargs)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx % 2 == 0:
            self.inner.on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx % 2 == 0:
            self.inner.on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


def run_paired(model_name: str, variant: str, root: str, warmup: int = 6, clock=time.process_time) -> float:
    """One run whose even steps run the variant's callback and odd steps do not; returns
    median(even step times) / median(odd step times)."""
    kwargs, steps = MODELS[model_name]
    torch.manual_seed(0)
    model = _model(model_name)
    step_clock = _StepClock(clock)
    callbacks = [_EveryOtherStep(c) for c in _callbacks(variant)]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2 * steps + warmup,
        logger=TensorBoardLogger(root, name=f"paired-{model_name}-{variant}"),
        callbacks=[step_clock, *callbacks],
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    if isinstance(model, BenchMLP):
        model.data = torch.randn(model.batch_size * (2 * steps + warmup + 1), model.data.shape[1])
    trainer.fit(model)
    times = [b - a for a, b in itertools.pairwise(step_clock.starts)]
    even = [t for i, t in enumerate(times) if i >= warmup and i % 2 == 0]
    odd = [t for i, t in enumerate(times) if i >= warmup and i % 2 == 1]
    return statistics.median(even) / statistics.median(odd)


def run_once(
    model_name: str, variant: str, root: str, warmup: int = 5, clock=time.process_time
) -> tuple[list[float], list[float]]:
    """Train one fresh model; return the per-step times and the per-step time inside the
    variant's callback hooks (seconds, by ``clock``), after ``warmup`` steps."""
    kwargs, steps = MODELS[model_name]
    torch.manual_seed(0)
    model = _model(model_name)
    step_clock = _StepClock(clock)
    callbacks = _callbacks(variant)
    timers = [_HookTimer(c, clock) for c in callbacks]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps + warmup,
        logger=TensorBoardLogger(root, name=f"{model_name}-{variant}"),
        callbacks=[step_clock, *callbacks],
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(model)
    step_times = [b - a for a, b in itertools.pairwise(step_clock.starts[warmup:])]
    hook_times = (
        [sum(t) for t in zip(*(timer.per_step for timer in timers), strict=True)][warmup:]
        if timers
        else [0.0] * len(step_times)
    )
    return step_times, hook_times


def _print_table(results: dict, in_hooks: dict, variants: list[str]) -> None:
    """The interleaved runs' table: each variant's median step time, its ratio to no callback, and its time in hooks."""
    rows = []
    for model_name, by_variant in results.items():
        base = statistics.median(by_variant["none"])
        for variant in variants:
            median = statistics.median(by_variant[variant])
            hooks = statistics.median(in_hooks[model_name][variant])
            rows.append((model_name, variant, len(by_variant[variant]), median * 1e3, median / base, hooks * 1e3))
    print(
        f"{'model':<6} {'variant':<15} {'steps':>5} {'median ms/step':>15} "
        f"{'ratio to none':>14} {'in-hook ms/step':>16}"
    )
    for model_name, variant, n, ms, ratio, hooks in rows:
        print(f"{model_name:<6} {variant:<15} {n:>5} {ms:>15.3f} {ratio:>14.3f} {hooks:>16.3f}")
    print()
    for model_name in MODELS:
        r = {v: ratio for m, v, _, _, ratio, _ in rows if m == model_name}
        h = {v: hooks for m, v, _, _, _, hooks in rows if m == model_name}
        base_ms = next(ms for m, v, _, ms, _, _ in rows if m == model_name and v == "none")
        print(
            f"{model_name} (none: {base_ms:.2f} ms/step): memkit/none = {r['memkit']:.3f}, "
            f"in-hook {h['memkit']:.3f} ms = {h['memkit'] / base_ms:.1%} of a step; "
            f"devicestats/none = {r['devicestats']:.3f}, in-hook {h['devicestats']:.3f} ms "
            f"(memkit {'cheaper' if h['memkit'] < h['devicestats'] else 'NOT cheaper'} per logged step, "
            f"{h['devicestats'] / max(h['memkit'], 1e-9):.1f}x); "
            f"default: memkit-default/none = {r['memkit-default']:.3f} "
            f"({'cheaper' if r['memkit-default'] <= r['devicestats'] else 'NOT cheaper'} than devicestats); "
            f"peak every step: memkit+peak/none = {r['memkit+peak']:.3f}"
        )


def _print_paired(variants: list[str], repeats: int, root: str, clock: Callable[[], float]) -> None:
    """The paired runs (one run alternates steps with and without the callback) and their table."""
    paired = {m: {v: [] for v in variants} for m in MODELS}
    for repeat in range(repeats):
        for model_name in MODELS:
            order = variants[repeat % len(variants) :] + variants[: repeat % len(variants)]
            for variant in order:
                paired[model_name][variant].append(run_paired(model_name, variant, root, clock=clock))
    print("\npaired (one run alternates steps with and without the callback; median of runs):")
    print(f"{'model':<6} {'variant':<15} {'with/without':>13} {'over control':>13}")
    for model_name in MODELS:
        control = statistics.median(paired[model_name]["none"])
        for variant in variants:
            ratio = statistics.median(paired[model_name][variant])
            print(f"{model_name:<6} {variant:<15} {ratio:>13.3f} {ratio / control:>13.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs per variant and model (interleaved)")
    parser.add_argument("--quick", action="store_true", help="2 repeats, fewer steps: a smoke run")
    parser.add_argument("--models", default="", help="comma-separated subset of: " + ", ".join(MODELS))
    parser.add_argument("--no-paired", action="store_true", help="skip the paired (alternating-step) runs")
    parser.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="cpu (default): process CPU time, all threads (the logger's writer thread included), "
        "robust to other processes competing for the cores; wall: time.perf_counter",
    )
    args = parser.parse_args()
    repeats = 2 if args.quick else args.repeats
    if args.quick:
        for name, (kwargs, steps) in MODELS.items():
            MODELS[name] = (kwargs, max(10, steps // 4))
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    parser_models = args.models.split(",") if args.models else list(MODELS)
    for name in list(MODELS):
        if name not in parser_models:
            del MODELS[name]
    variants = ["none", "memkit", "memkit-default", "memkit+peak", "devicestats"]
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    root = tempfile.mkdtemp(prefix="memkit-bench-")
    print(
        f"torch {torch.__version__}, lightning {pl.__version__}, {torch.get_num_threads()} threads, "
        f"{os.cpu_count()} cpus; {repeats} interleaved repeats; clock: {args.clock} "
        f"({'process CPU time' if args.clock == 'cpu' else 'wall time'}); load average {os.getloadavg()[0]:.1f}\n"
    )
    try:
        results = {m: {v: [] for v in variants} for m in MODELS}
        in_hooks = {m: {v: [] for v in variants} for m in MODELS}
        for repeat in range(repeats):
            for model_name in MODELS:
                order = variants[repeat % len(variants) :] + variants[: repeat % len(variants)]
                for variant in order:
                    step_times, hook_times = run_once(model_name, variant, root, clock=clock)
                    results[model_name][variant] += step_times
                    in_hooks[model_name][variant] += hook_times
        _print_table(results, in_hooks, variants)
        # Paired: one run alternates steps with and without the callback; the ratio
        # even/odd, divided by the same ratio of a run with no callback (the control),
        # is the callback's cost per logged step with the load shared by both sides.
        if not args.no_paired:
            _print_paired(variants, repeats, root, clock)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
