"""The worst batch the data can produce: found without the model, used by the estimate and MaxBatchSize.

Run:  python examples/worst_batch.py            (about a minute on a laptop CPU)
      python examples/worst_batch.py --steps 20 (fewer training steps)
"""

from __future__ import annotations

import argparse
import tempfile

import lightning.pytorch as pl

from lightning_memkit import MaxBatchSize, WorstBatch, estimate_memory, find_worst_batch, predict_max_batch_size
from lightning_memkit.zoo_variable import PaddedTextClassifier, PaddedTextDataModule, VaryingImageDataModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=40, help="training steps after the search")
    parser.add_argument("--budget", default="24MiB", help="MaxBatchSize's CPU memory budget")
    args = parser.parse_args()

    # 1. the worst batch of three kinds of data, with what it holds for
    for name, data in (
        ("padded text", PaddedTextDataModule(batch_size=16)),
        ("bucketed text", PaddedTextDataModule(batch_size=16, bucketed=True)),
        ("images of varying size", VaryingImageDataModule(batch_size=8)),
    ):
        worst: WorstBatch = find_worst_batch(data.train_dataloader())
        print(f"{name}: {worst.describe()} ({worst.nbytes} bytes, found in {worst.seconds:.2f}s)")
        if worst.sampler_iterable:  # a bucketing sampler memkit can iterate: the largest batch it really yields
            print(f"{name} at 64: {worst.at_size(64).describe()}")

    # 2. the estimate and the prediction use it, and say so
    model = PaddedTextClassifier(d_model=32, dim_feedforward=64)
    estimate = estimate_memory(model, device="cpu")
    print(f"estimate: peak {estimate.peak_bytes} bytes on {estimate.batch_shapes} ({estimate.batch_note})")
    print(predict_max_batch_size(model, args.budget, device="cpu", margin=0.0))

    # 3. MaxBatchSize's trials train on the worst batch of each size; the run then trains within the budget
    search = MaxBatchSize(budget=args.budget, verbose=False)
    with tempfile.TemporaryDirectory() as root:
        pl.Trainer(
            max_steps=args.steps,
            callbacks=[search],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
        ).fit(model)
    print(search.result.table())
    print(f"trained {args.steps} steps with batch size {model.batch_size}")


if __name__ == "__main__":
    main()
