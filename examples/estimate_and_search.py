"""An estimate against a real step, one rank's memory under DDP and ZeRO-3, and the batch-size search from Python.

    python examples/estimate_and_search.py                 # CPU, under a minute
    python examples/estimate_and_search.py --budget 4MiB   # a larger budget: a larger batch

1. ``estimate_memory`` runs two training steps on fake tensors (no real memory) and returns a
   ``MemoryEstimate``; ``measure_training_step`` runs the same two steps for real on a copy. For a CPU
   target the two peaks are the same bytes.
2. ``estimate_distributed_memory`` gives one rank's ``DistributedEstimate``: under DDP every rank holds
   the whole model; under ZeRO stage 3 the parameters, gradients and Adam's state are sharded, but a
   module's parameters are gathered whole while it runs, and DeepSpeed's gradient bucket
   (``reduce_bucket_size``: 2e8 elements under Lightning's DeepSpeedStrategy) is allocated whole: on a
   model this small the bucket, not the model, sets the rank's peak.
3. ``find_max_batch_size`` finds the largest batch that trains under a CPU memory budget (bytes of live
   tensors), before ``fit``, and sets it on the module: the following ``fit`` trains with it.

Every size printed is in bytes (B); MiB = 2**20 bytes.
"""

from __future__ import annotations

import argparse
import warnings

import lightning.pytorch as pl

from lightning_memkit import (
    DistributedEstimate,
    MemkitError,
    MemoryEstimate,
    estimate_distributed_memory,
    estimate_memory,
    find_max_batch_size,
    measure_training_step,
    parse_bytes,
)
from lightning_memkit.zoo import DemoMLP

warnings.filterwarnings("ignore", ".*does not have many workers.*")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--budget",
        type=parse_bytes,
        default="3MiB",
        help="the search's CPU budget of live tensor bytes (default: 3MiB)",
    )
    budget = parser.parse_args().budget
    pl.seed_everything(0, verbose=False)
    model = DemoMLP(batch_size=32)
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"DemoMLP: {parameter_bytes} B of parameters")

    # 1. fake against real, on a CPU target
    estimate: MemoryEstimate = estimate_memory(model, device="cpu")
    measured: MemoryEstimate = measure_training_step(model, device="cpu")
    print(
        f"estimate: peak {estimate.peak_bytes} B ({estimate.source}, {estimate.peak_phase} of step "
        f"{estimate.peak_step}); measured: peak {measured.peak_bytes} B ({measured.source}); optimizer state "
        f"{estimate.by_category['optimizer_state']} B"
    )

    # 2. one rank of four
    for strategy in ("ddp", "deepspeed_stage_3"):
        rank: DistributedEstimate = estimate_distributed_memory(
            model, batch_size=32, strategy=strategy, world_size=4, device="cpu"
        )
        print(
            f"{rank.strategy} on {rank.world_size} ranks: parameters {rank.by_category['parameters']} B, "
            f"optimizer state {rank.by_category['optimizer_state']} B, peak {rank.peak_bytes} B per rank"
        )
        for name, size in rank.buffers.items():  # the strategy's own buffers: DDP's buckets, ZeRO's partitions
            print(f"{rank.strategy} buffer {name}: {size} B")

    # 3. the largest batch that trains under the budget, then a fit with it
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        limit_val_batches=0,
    )
    try:
        result = find_max_batch_size(trainer, model, budget=budget, max_val=4096, verbose=False)
    except MemkitError as error:  # any memkit error (here SearchError, BatchSizeSearchError) says what to do
        raise SystemExit(f"search: {error}") from error
    for trial in result.trials:
        peak = f"peak {trial.peak_bytes} B" if trial.fits else "stopped at the budget"
        print(f"trial: batch {trial.batch_size}: {'fits' if trial.fits else 'out of memory'}, {peak}")
    print(
        f"search: batch size {result.batch_size} under {budget} B ({result.reason}); "
        f"module's batch_size {model.batch_size}"
    )
    trainer.fit(model)
    print(f"trained {trainer.global_step} steps with batch size {model.batch_size}")


if __name__ == "__main__":
    main()
