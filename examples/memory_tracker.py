"""MemoryTracker on a small LightningModule: per-step memory in TensorBoard and CSV, on CPU or GPU.

python examples/memory_tracker.py            # then: tensorboard --logdir memkit_example_logs
python examples/memory_tracker.py --steps 4 --logdir /tmp/logs   # fewer steps, logs elsewhere
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_memkit import MemoryTracker
from lightning_memkit.zoo import DemoMLP


def main(logdir: str = "memkit_example_logs", steps: int = 20) -> MemoryTracker:
    pl.seed_everything(0, verbose=False)
    # On CPU the exact tensor accountant is on ("auto"): tensor_MiB is every live tensor of the
    # process at each step; the per-op peak (peak_tensor_MiB) runs on one logged step in 10
    # (tensor_peak_every_n_steps=1 for every step, at ~1.1x step time).
    tracker = MemoryTracker(every_n_steps=1)
    trainer = pl.Trainer(
        max_steps=steps,
        callbacks=[tracker],
        log_every_n_steps=1,
        logger=[TensorBoardLogger(logdir, name="mlp"), CSVLogger(logdir, name="mlp-csv")],
        val_check_interval=10,
        check_val_every_n_epoch=None,
        limit_val_batches=2,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(DemoMLP(batch_size=64))
    last = tracker.history[-1]
    print(f"last reading: step {last.step} ({last.stage}), peak {last.peak_bytes} bytes")
    print(f"run peak: {tracker.summary.peak_bytes} bytes at step {tracker.summary.peak_step}")
    print(f"tensorboard --logdir {logdir}")
    return tracker


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", default="memkit_example_logs", help="log directory (default: memkit_example_logs)")
    parser.add_argument("--steps", type=int, default=20, help="training steps (default: 20)")
    arguments = parser.parse_args()
    main(arguments.logdir, arguments.steps)
