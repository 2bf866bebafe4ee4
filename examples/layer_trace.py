"""Where does training memory go? A layer trace of a CNN, with Lightning and with plain PyTorch.

Run::

    python examples/layer_trace.py                    # both, output in ./memkit_layer_trace/
    python examples/layer_trace.py --out docs/images  # (how the docs figure was made)

1. Lightning: ``Trainer(callbacks=[LayerTrace()])`` traces training step 1 of the built-in
   DemoCNN; it prints the bytes per category and where everything went, the table, the figure
   and per-category scalars go to TensorBoard and ``memkit_trace_step1.json`` to the log dir.
2. Plain PyTorch: ``trace_step`` around one hand-written step, here with the middle of the
   network under activation checkpointing, to see the recomputation in backward.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def lightning_trace(out: str, batch_size: int) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_memkit import LayerTrace
    from lightning_memkit.zoo import DemoCNN

    pl.seed_everything(0, verbose=False)
    model = DemoCNN(batch_size=batch_size)
    trace = (
        LayerTrace()
    )  # step 1: after warm-up, so Adam's state is there; prints the categories (verbose=False: nothing)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=2,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[trace],
        logger=TensorBoardLogger(out, name="layer_trace"),
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    trainer.fit(model)
    result = trace.results[-1]  # the callback printed the categories; here the module-by-module table
    print(f"Ψ = {result.parameter_count} parameters")
    print(result.format_table())
    figure_path = os.path.join(out, "layer_trace_cnn.png")
    result.figure().savefig(figure_path)
    print(f"\nfigure: {figure_path}")


class Checkpointed(nn.Module):
    """Runs ``inner`` under non-reentrant activation checkpointing."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=False)


def plain_pytorch_trace(out: str, batch_size: int) -> None:
    from lightning_memkit import trace_step

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(inplace=True),
        Checkpointed(
            nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())
        ),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )
    optimizer = torch.optim.Adam(model.parameters())
    x, y = torch.randn(batch_size, 3, 32, 32), torch.randint(0, 10, (batch_size,))

    def step():
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    step()  # warm-up
    with trace_step(model, optimizer, inputs=(x, y), step=1) as tracer:
        step()
    result = tracer.result
    print(result.format_table())
    print(result.format_categories())
    result.to_csv(os.path.join(out, "plain_pytorch_trace.csv"))
    result.figure(title="plain PyTorch step, checkpointed middle block").savefig(
        os.path.join(out, "layer_trace_checkpointed.png")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="memkit_layer_trace", help="output directory (default: memkit_layer_trace)")
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    print("=== 1. Lightning: LayerTrace on DemoCNN ===")
    lightning_trace(args.out, args.batch_size)
    print("\n=== 2. plain PyTorch: trace_step, with a checkpointed block ===")
    plain_pytorch_trace(args.out, args.batch_size)


if __name__ == "__main__":
    main()
