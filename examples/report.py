"""The offline memory report from Python: train briefly with MemoryTracker, then write report.html.

    python examples/report.py [OUTPUT_DIR]

Writes OUTPUT_DIR/logs (TensorBoard run with memkit's dashboard), OUTPUT_DIR/report.html and
OUTPUT_DIR/figures/*.png. The same as `memkit report OUTPUT_DIR/logs -o OUTPUT_DIR/report.html --png ...`.
"""

from __future__ import annotations

import os
import sys
import tempfile

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_memkit import MemoryTracker
from lightning_memkit.report import write_report
from lightning_memkit.zoo import DemoMLP


def main(output_dir: str) -> None:
    logs = os.path.join(output_dir, "logs")
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=8,
        logger=TensorBoardLogger(logs, name="mlp"),
        callbacks=[MemoryTracker(verbose=False)],
        limit_val_batches=1,
        val_check_interval=4,
        check_val_every_n_epoch=None,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    trainer.fit(DemoMLP(batch_size=32))

    sources, written = write_report(
        logs, os.path.join(output_dir, "report.html"), png_dir=os.path.join(output_dir, "figures")
    )
    for run in sources.runs:
        print(
            f"run {run.name}: peak {run.summary.peak_bytes} bytes at step {run.summary.peak_step} "
            f"({run.summary.peak_source}), {len(run.history)} readings"
        )
    for line in sources.missing:
        print("not found:", line)
    for path in written:
        print("wrote", path)
    print(f"TensorBoard dashboard: tensorboard --logdir {logs}  (Custom Scalars tab)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="memkit-report-"))
