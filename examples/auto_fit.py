"""AutoFit: a batch that does not fit the memory budget trains anyway, planned and applied at fit start.

On CPU the budget is a budget of live tensor bytes (the accountant's), set here below what the batch as is needs,
so AutoFit must change something: a smaller micro-batch with gradient accumulation (the effective batch stays the
same) or activation checkpointing. On a GPU leave ``device_memory`` out: the device's memory is the budget, and
``modes="micro_batch,checkpoint,offload"`` lets it offload saved activations to pinned host memory as well
(``ActivationOffload``, CUDA only).

    python examples/auto_fit.py
    python examples/auto_fit.py --fraction 0.8   # a budget of 80% of the batch's estimated peak
"""

from __future__ import annotations

import argparse
import warnings

import lightning.pytorch as pl
import torch

from lightning_memkit import ActivationOffload, AutoFit, estimate_memory
from lightning_memkit.units import format_bytes
from lightning_memkit.zoo import DemoTransformer

warnings.filterwarnings("ignore", ".*does not have many workers.*")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--fraction",
        type=float,
        default=0.7,
        help="the budget as a fraction of the batch's estimated peak (default: 0.7)",
    )
    parser.add_argument("--steps", type=int, default=3, help="training steps (default: 3)")
    args = parser.parse_args()
    pl.seed_everything(0, verbose=False)
    model = DemoTransformer(
        vocab_size=256, d_model=64, nhead=4, layers=2, dim_feedforward=256, seq_len=32, dropout=0.0, batch_size=16
    )
    on_gpu = torch.cuda.is_available()
    budget = None
    if not on_gpu:
        needed = estimate_memory(model, device="cpu").peak_bytes
        budget = int(needed * args.fraction)
        print(f"batch {model.batch_size} needs {format_bytes(needed)}; budget {format_bytes(budget)}")

    auto = AutoFit(
        device_memory=budget,
        modes="micro_batch,checkpoint,offload" if on_gpu else "micro_batch,checkpoint",
        trials=2,
        verbose=False,
    )
    trainer = pl.Trainer(
        max_steps=args.steps,
        accelerator="gpu" if on_gpu else "cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[auto],
    )
    trainer.fit(model)

    applied = auto.applied
    print(
        f"AutoFit applied: micro-batch {applied['micro_batch']} x accumulate_grad_batches "
        f"{applied['accumulate_grad_batches']}, checkpointing {applied['checkpoint']}, offload {applied['offload']}"
    )
    offloading = [c for c in trainer.callbacks if isinstance(c, ActivationOffload)]
    print(f"ActivationOffload in the Trainer's callbacks: {bool(offloading)} (CUDA only)")
    print(
        f"trained {trainer.global_step} steps of {applied['micro_batch'] * applied['accumulate_grad_batches']} samples "
        f"({len(auto.plan.rows)} candidates estimated, the best of the real trials applied)"
    )


if __name__ == "__main__":
    main()
