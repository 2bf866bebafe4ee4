"""Compare memory modes on one LightningModule: baseline, AMP, activation checkpointing, both.

    .venv/bin/python examples/compare_modes.py            # CPU: 12 steps per mode, a few minutes
    .venv/bin/python examples/compare_modes.py --steps 2 --modes baseline,checkpoint   # seconds: too few steps to time
    tensorboard --logdir memkit_compare                   # the runs overlay; figures under "compare"

The same in one command:
    memkit compare lightning_memkit/zoo.py:DemoTransformer --modes baseline,amp,checkpoint,amp+checkpoint --steps 12
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from lightning_memkit import apply_checkpointing, compare_modes, parse_mode
from lightning_memkit.timing import StepTimer, time_spread
from lightning_memkit.zoo import DemoTransformer


def plain_pytorch() -> None:
    """Modes without a Trainer: autocast and checkpointing on a plain module, undone afterwards."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.TransformerEncoderLayer(64, 4, 256, batch_first=True) for _ in range(4)])
    tokens = torch.randn(8, 32, 64)
    mode = parse_mode("amp+checkpoint")
    timer = StepTimer(tokens.device)  # CUDA events on a GPU (no waiting per step), time.perf_counter on CPU
    with apply_checkpointing(model, mode.checkpoint, sample=(tokens,)) as handle:
        print(handle.plan.summary())
        for _ in range(5):
            timer.start()
            with mode.autocast(tokens.device.type):
                loss = model(tokens).float().pow(2).mean()
            loss.backward()
            timer.stop()
    spread = time_spread(timer.times_s()[1:])  # the first step left out as warm-up
    print(
        f"step {spread.median_s * 1000:.1f} ms median, IQR "
        f"{spread.q1_s * 1000:.1f}-{spread.q3_s * 1000:.1f} ms ({timer.source})"
    )
    print("restored:", not any("forward" in m.__dict__ for m in model.modules()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="training steps per mode (default: 12)")
    parser.add_argument(
        "--modes",
        default="baseline,amp,checkpoint,amp+checkpoint",
        help="comma-separated modes (default: baseline,amp,checkpoint,amp+checkpoint)",
    )
    arguments = parser.parse_args()
    plain_pytorch()
    result = compare_modes(
        lambda: DemoTransformer(layers=4, seq_len=64, batch_size=16),
        modes=arguments.modes,
        max_steps=arguments.steps,
        accelerator="auto",
        root_dir="memkit_compare",
    )
    best = min((r for r in result.results if r.status == "ok"), key=lambda r: r.peak_allocated_bytes)
    noise = " (within noise)" if best.step_time_within_noise else ""
    print(
        f"\nlowest peak: {best.mode} ({best.peak_ratio:.2f}x of baseline, {best.step_time_ratio:.2f}x step time{noise})"
    )
    for r in result.results:
        if r.checkpoint_helped is False:  # checkpointing did not lower the peak against the same precision
            print(r.checkpoint_warning())


if __name__ == "__main__":
    main()
