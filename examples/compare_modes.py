"""Compare memory modes on one LightningModule: baseline, AMP, activation checkpointing, both.

    .venv/bin/python examples/compare_modes.py            # CPU: a few steps, about a minute
    tensorboard --logdir memkit_compare                   # the runs overlay; figures under "compare"

The same in one command:
    memkit compare lightning_memkit/zoo.py:DemoTransformer --modes baseline,amp,checkpoint,amp+checkpoint --steps 10
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_memkit import apply_checkpointing, compare_modes, parse_mode
from lightning_memkit.zoo import DemoTransformer


def plain_pytorch() -> None:
    """Modes without a Trainer: autocast and checkpointing on a plain module, undone afterwards."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.TransformerEncoderLayer(64, 4, 256, batch_first=True) for _ in range(4)])
    tokens = torch.randn(8, 32, 64)
    mode = parse_mode("amp+checkpoint")
    with apply_checkpointing(model, mode.checkpoint, sample=(tokens,)) as handle:
        print(handle.plan.summary())
        with mode.autocast("cpu"):
            loss = model(tokens).float().pow(2).mean()
        loss.backward()
    print("restored:", not any("forward" in m.__dict__ for m in model.modules()))


def main() -> None:
    plain_pytorch()
    result = compare_modes(
        lambda: DemoTransformer(layers=4, seq_len=64, batch_size=16),
        modes="baseline,amp,checkpoint,amp+checkpoint",
        max_steps=8,
        accelerator="auto",
        root_dir="memkit_compare",
    )
    best = min((r for r in result.results if r.status == "ok"), key=lambda r: r.peak_allocated_bytes)
    print(f"\nlowest peak: {best.mode} ({best.peak_ratio:.2f}x of baseline, {best.step_time_ratio:.2f}x step time)")


if __name__ == "__main__":
    main()
