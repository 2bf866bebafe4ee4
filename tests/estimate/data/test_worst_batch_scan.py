"""How many samples the worst-batch scan sizes: a dataset over ``max_samples`` is sized on a fixed subset of that many,
and still on one of ``SAMPLED_COUNT`` when sizing those would take too long; under DDP every rank sizes the same
samples (the ranks agree on the projected time, the slowest rank's), so the batches trained in trials are the same."""

from __future__ import annotations

import textwrap

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_memkit.estimate.data import sample_sizes
from lightning_memkit.estimate.data.sample_sizes import SAMPLED_COUNT, sized_indices
from lightning_memkit.estimate.data.worst_batch import BatchSource, agreed_worst_batch, find_worst_batch
from tests.helpers.processes import run_script

PROBED = 32  # samples loaded to project the sizing time
BATCH = 8


class _Counted(Dataset):
    """``length`` samples of 4 floats; counts the samples loaded."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.loaded = 0

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        self.loaded += 1
        return torch.zeros(4)


def test_a_dataset_over_max_samples_is_sized_on_max_samples_when_that_is_quick():
    data = _Counted(150_000)
    worst = find_worst_batch(DataLoader(data, batch_size=BATCH))
    assert worst.source is BatchSource.DATASET_SUBSET and worst.sized == 100_000
    assert data.loaded == PROBED + 100_000 + BATCH  # the probe, the sizing, the worst batch collated
    assert "100,000 of 150,000 samples" in worst.note


def test_a_dataset_over_max_samples_whose_sizing_would_be_slow_is_sized_on_a_small_fixed_subset(monkeypatch):
    # the scan's time bound lowered to a millisecond: 100,000 samples of any dataset project past it
    monkeypatch.setattr(sample_sizes, "SCAN_SECONDS", 1e-3)
    data = _Counted(150_000)
    worst = find_worst_batch(DataLoader(data, batch_size=BATCH))
    assert worst.source is BatchSource.DATASET_SUBSET and worst.sized == SAMPLED_COUNT
    assert data.loaded == PROBED + SAMPLED_COUNT + BATCH
    assert f"{SAMPLED_COUNT:,} of 150,000 samples" in worst.note
    again = _Counted(150_000)
    assert find_worst_batch(DataLoader(again, batch_size=BATCH)).indices(BATCH) == worst.indices(BATCH)


def test_which_samples_are_sized_follows_the_projection_the_ranks_agree_on():
    total = SAMPLED_COUNT + 100
    everything = list(range(total))
    # rank 0's projection is quick, rank 1's slow: by their own each would size other samples
    quick, slow = (
        sized_indices(total, everything, 0.1),
        sized_indices(total, everything, 10 * sample_sizes.SCAN_SECONDS),
    )
    assert quick == (everything, True) and slow[1] is False and len(slow[0]) == SAMPLED_COUNT
    # agreed on the slowest projection, a quick rank sizes what the slow one does
    data = _Counted(total)
    agreed = agreed_worst_batch(DataLoader(data, batch_size=BATCH), lambda seconds: max(seconds, 60.0))
    assert agreed.sized == SAMPLED_COUNT and data.loaded == PROBED + SAMPLED_COUNT + BATCH
    assert agreed.indices(BATCH) == slow[0][:BATCH]  # the samples are alike: the first of the subset are the worst


DDP_SCRIPT = textwrap.dedent(
    """
    import os, sys, time, warnings
    warnings.filterwarnings("ignore")
    import torch, lightning.pytorch as pl
    from torch.utils.data import DataLoader, Dataset
    from lightning_memkit.callbacks.max_batch_size import find_max_batch_size
    from lightning_memkit.estimate.data.sample_sizes import SAMPLED_COUNT

    RANK = int(os.environ.get("LOCAL_RANK", 0))

    class ColdOnRankOne(Dataset):
        # rank 1's first 32 loads are slow (a cold cache on its node): its own projection of the sizing time
        # passes the scan's bound, rank 0's does not
        def __init__(self):
            self.loaded = 0
        def __len__(self):
            return SAMPLED_COUNT + 100
        def __getitem__(self, index):
            self.loaded += 1
            if RANK == 1 and self.loaded <= 32:
                time.sleep(0.05)
            return torch.full((16,), float(index % 7)), index % 4

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(16, 4)
            self.batch_size = 8
        def training_step(self, batch, batch_idx):
            return torch.nn.functional.cross_entropy(self.layer(batch[0]), batch[1])
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)
        def train_dataloader(self):
            return DataLoader(ColdOnRankOne(), batch_size=self.batch_size)

    torch.manual_seed(0)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         default_root_dir=sys.argv[1])
    result = find_max_batch_size(trainer, Model(), budget=2**24, max_val=32, use_estimate=False, verbose=False)
    with open(os.path.join(sys.argv[1], f"rank{trainer.global_rank}.txt"), "w") as f:
        f.write(f"{result.batch_size}\\n{result.batch_note}")
    """
)


@pytest.mark.timeout(300)
def test_ddp_ranks_size_the_same_samples_when_one_rank_loads_slowly(tmp_path):
    script = tmp_path / "ddp_worst.py"
    script.write_text(DDP_SCRIPT)
    run_script([str(script), str(tmp_path)], cwd=str(tmp_path), timeout=240, ranks=2)  # kills both ranks on timeout
    answers = [(tmp_path / f"rank{rank}.txt").read_text().splitlines() for rank in (0, 1)]
    assert answers[0] == answers[1], answers
    total = SAMPLED_COUNT + 100
    assert f"each trial trained on the worst batch of {SAMPLED_COUNT:,} of {total:,} samples" in answers[0][1], answers
