"""Will it fit? Estimate a step's memory on fake tensors, predict the largest batch, then find it for real.

Runs on CPU in under a minute: the search uses a CPU memory budget (``budget=``) so that running out
of memory can happen without a GPU. On a GPU drop ``budget=`` and the device's memory is the limit.

    python examples/find_batch_size.py
    python examples/find_batch_size.py --budget 24MiB   # a smaller CPU budget: smaller batches, quicker trials
"""

from __future__ import annotations

import argparse
import warnings

import lightning.pytorch as pl

from lightning_memkit import MaxBatchSize, estimate_memory, predict_max_batch_size
from lightning_memkit.units import format_bytes, parse_bytes
from lightning_memkit.zoo import DemoCNN, SyntheticDataModule

warnings.filterwarnings("ignore", ".*does not have many workers.*")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--budget", type=parse_bytes, default="96MiB", help="the CPU memory budget of step 3 (default: 96MiB)"
    )
    budget = parser.parse_args().budget
    pl.seed_everything(0, verbose=False)
    model = DemoCNN()

    # 1. One training step's memory at batch 64, for a GPU, without a GPU (fake tensors).
    estimate = estimate_memory(model, batch_size=64, mode="bf16", device="cuda")
    print(estimate.summary(), end="\n\n")

    # 2. The largest batch that fits a 16 GiB GPU, per mode.
    for mode in ("baseline", "bf16"):
        print(predict_max_batch_size(model, "16GiB", mode=mode))
    print()

    # 3. The largest batch that really trains, under a budget of live tensors on CPU (96 MiB by default).
    data = SyntheticDataModule(batch_size=8, train_size=2048, val_size=64, input_shape=(3, 32, 32))
    del model.batch_size  # the datamodule holds the batch size here
    finder = MaxBatchSize(budget=budget, max_val=2048)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=3,
        callbacks=[finder],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, data)
    print()
    print(finder.result.table())
    print(f"\ntrained with batch size {data.batch_size} (budget {format_bytes(budget)})")


if __name__ == "__main__":
    main()
