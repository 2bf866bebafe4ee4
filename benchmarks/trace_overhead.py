"""What tracing a step costs: a traced step vs a plain step, and the steps between traced ones.

Three variants of the same CNN training step (forward, backward, Adam step) run interleaved in
one process, ``--repeats`` rounds, and the medians are compared:

* ``plain``:   the step alone;
* ``traced``:  the step inside a fresh ``LayerTracer`` (accountant, hooks, saved-tensor hooks);
* ``accountant``: the step inside the bare ``TensorAccountant`` (the floor the tracer builds on:
  one Python call per aten op), for reference;
* ``between``: the step on a model that has been traced before, plus LayerTrace's per-batch
  callback hooks on a step it does not trace (what every non-traced step of a run pays).

Usage::

    python benchmarks/trace_overhead.py               # prints a table of medians and ratios
    python benchmarks/trace_overhead.py --batch-size 64 --repeats 30

Targets: traced / plain <= 1.5, between / plain <= 1.01.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch import nn


def make_model(channels: int, blocks: int, image: int) -> nn.Module:
    layers: list[nn.Module] = []
    in_channels = 3
    for index in range(blocks):
        out_channels = channels * 2**index
        layers += [
            nn.Conv2d(in_channels, out_channels, 3, padding=1),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        ]
        in_channels = out_channels
    side = image // 2**blocks
    layers += [nn.Flatten(), nn.Linear(in_channels * side * side, 10)]
    return nn.Sequential(*layers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image", type=int, default=64)
    parser.add_argument("--channels", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (default 1: less sensitive to other processes)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    import lightning.pytorch as pl

    from lightning_memkit import LayerTrace, LayerTracer, TensorAccountant, training_state_tensors

    torch.manual_seed(0)
    model = make_model(args.channels, args.blocks, args.image)
    optimizer = torch.optim.Adam(model.parameters())
    x = torch.randn(args.batch_size, 3, args.image, args.image)
    y = torch.randint(0, 10, (args.batch_size,))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    # the callback's per-batch cost on a step it does not trace, with a real (unfitted) Trainer
    callback = LayerTrace(at_steps=(10**9,))
    trainer = pl.Trainer(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )

    def plain() -> None:
        step()

    def traced() -> None:
        with LayerTracer(model, optimizer, step=1):
            step()

    def accountant() -> None:
        counter = TensorAccountant()
        counter.adopt(training_state_tensors(model, [optimizer], (x, y)))
        with counter:
            step()

    def between() -> None:
        callback.on_train_batch_start(trainer, model, (x, y), 0)
        step()
        callback.on_train_batch_end(trainer, model, None, (x, y), 0)

    variants = {"plain": plain, "traced": traced, "accountant": accountant, "between": between}
    for function in variants.values():  # warm-up: Adam state, allocator, one-time imports
        function()
        function()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(args.repeats):
        order = list(variants.items())
        if round_index % 2:
            order.reverse()  # alternate the order so drift hits every variant alike
        for name, function in order:
            start = time.perf_counter()
            function()
            times[name].append(time.perf_counter() - start)

    medians = {name: statistics.median(values) for name, values in times.items()}
    print(
        f"trace overhead: CNN {args.blocks} blocks x {args.channels} ch, {args.image}x{args.image}, batch "
        f"{args.batch_size}, Adam, CPU, {torch.get_num_threads()} threads, {args.repeats} interleaved rounds"
    )
    print("ratio of medians, median of per-round ratios (each round runs the variants back to back),")
    print("and ratio of minimums (the least disturbed run of each)")
    print(
        f"{'variant':<10} {'median ms':>10} {'min ms':>8} {'max ms':>8} {'med/med':>8} "
        f"{'per-round':>9} {'min/min':>8}  target"
    )
    targets = {"plain": "", "traced": "<= 1.50", "accountant": "(reference)", "between": "<= 1.01"}
    for name in variants:
        values = times[name]
        paired = statistics.median(v / p for v, p in zip(values, times["plain"], strict=True))
        print(
            f"{name:<10} {medians[name] * 1e3:10.2f} {min(values) * 1e3:8.2f} {max(values) * 1e3:8.2f} "
            f"{medians[name] / medians['plain']:8.3f} {paired:9.3f} "
            f"{min(values) / min(times['plain']):8.3f}  {targets[name]}"
        )
    # the callback's own cost on a non-traced step, timed alone (the step itself is unchanged code)
    calls = 20000
    start = time.perf_counter()
    for _ in range(calls):
        callback.on_train_batch_start(trainer, model, (x, y), 0)
        callback.on_train_batch_end(trainer, model, None, (x, y), 0)
    hook_seconds = (time.perf_counter() - start) / calls
    print(
        f"LayerTrace hooks on a non-traced step: {hook_seconds * 1e6:.2f} us = {hook_seconds / medians['plain']:.2e} "
        f"of a plain step -> between/plain = {1 + hook_seconds / medians['plain']:.5f}"
    )
    with LayerTracer(model, optimizer, step=1) as tracer:
        step()
    result = tracer.result
    print(f"one traced step: {len(result.events)} events, peak {result.peak_bytes} bytes, errors: {len(result.errors)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
