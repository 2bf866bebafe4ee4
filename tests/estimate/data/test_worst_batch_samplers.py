"""A custom batch sampler that buckets samples by length: at a batch size, the worst batch a run meets is the largest
batch the sampler really yields there, which the largest samples put together (an upper bound) can exceed many times
over. Where the sampler can be iterated without training (a ``batch_size`` to set on a copy, the same batches whatever
the random state and the epoch), every answer at a size (the estimate, its max batch, MaxBatchSize's trials) is
computed on that batch, and a real CPU step on it agrees with the estimate to the byte; otherwise the answer is the
upper bound, and its note says so at the size asked."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler

from lightning_memkit import estimate_memory, measure_training_step, predict_max_batch_size
from lightning_memkit.estimate.data.worst_batch import BatchSource, batch_shapes, find_worst_batch
from lightning_memkit.zoo_variable import pad_collate

#: (length, samples): a short-text dataset whose longest bucket holds few samples (as in a user's, 69 at 512)
LENGTHS = [(200, 20), (100, 150), (60, 100), (20, 50)]
#: the bucket edges: a sample of length L goes to the first bucket whose edge is at least L
EDGES = (32, 64, 128, 256)
VOCAB, WIDTH, CLASSES = 50, 16, 3


class _Texts(torch.utils.data.Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.lengths = [length for length, count in LENGTHS for _ in range(count)]
        self.tokens = [torch.randint(1, VOCAB, (length,), generator=generator) for length in self.lengths]

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = self.tokens[index]
        return {"input_ids": tokens, "label": tokens[0] % CLASSES}


class LengthBuckets(Sampler[list[int]]):
    """Batches of ``batch_size`` from buckets of lengths up to each of EDGES; the batches shuffled with a seeded
    generator every epoch (each bucket's batches are the same every epoch). ``reshuffled``: each bucket's samples are
    shuffled with the global random state first, so its batches change from epoch to epoch."""

    def __init__(self, lengths: list[int], batch_size: int, seed: int = 0, reshuffled: bool = False) -> None:
        self.lengths, self.batch_size, self.seed, self.reshuffled = lengths, batch_size, seed, reshuffled
        self.epoch = 0

    def _batches(self) -> list[list[int]]:
        buckets: list[list[int]] = [[] for _ in EDGES]
        for index, length in enumerate(self.lengths):
            buckets[next(i for i, edge in enumerate(EDGES) if length <= edge)].append(index)
        batches = []
        for bucket in buckets:
            if self.reshuffled:
                bucket = [bucket[i] for i in torch.randperm(len(bucket)).tolist()]
            batches += [bucket[start : start + self.batch_size] for start in range(0, len(bucket), self.batch_size)]
        return batches

    def __iter__(self):
        batches = self._batches()
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        self.epoch += 1
        for index in torch.randperm(len(batches), generator=generator).tolist():
            yield batches[index]

    def __len__(self) -> int:
        return len(self._batches())


class _Classifier(pl.LightningModule):
    """Token embeddings (padding's at zero), their mean, a linear head; its train loader is bucketed by
    LengthBuckets."""

    def __init__(self, batch_size: int = 8, reshuffled: bool = False) -> None:
        super().__init__()
        self.batch_size, self.reshuffled = batch_size, reshuffled
        self.embedding = nn.Embedding(VOCAB, WIDTH, padding_idx=0)
        self.head = nn.Linear(WIDTH, CLASSES)
        self.texts = _Texts()

    def training_step(self, batch, batch_idx):
        pooled = self.embedding(batch["input_ids"]).mean(1)
        return nn.functional.cross_entropy(self.head(pooled), batch["labels"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        sampler = LengthBuckets(self.texts.lengths, self.batch_size, reshuffled=self.reshuffled)
        return DataLoader(self.texts, batch_sampler=sampler, collate_fn=pad_collate)


def _shapes(rows: int, length: int) -> str:
    return f"input_ids ({rows}, {length}), attention_mask ({rows}, {length}), labels ({rows},)"


def test_at_a_size_the_worst_batch_is_the_largest_the_bucketing_sampler_yields():
    module = _Classifier(batch_size=64)
    worst = find_worst_batch(module.train_dataloader())
    assert worst.sampler_iterable and worst.source is BatchSource.DATASET
    # the 64 largest samples together: 20 of length 200 and 44 of 100, padded to 200; no batch of the sampler's
    assert worst.shapes() == _shapes(64, 200) and "an upper bound for any batch of 64" in worst.note
    found = worst.at_size(64)
    # at 64: the longest bucket's 20 samples make (20, 200), the next bucket's 64 make (64, 100), the larger
    assert found.source is BatchSource.SAMPLER and found.shapes() == _shapes(64, 100)
    yielded = {tuple(sorted(batch)) for batch in module.train_dataloader().batch_sampler}
    assert found.note == (
        f"the largest batch LengthBuckets yields at batch size 64 (of its {len(yielded)} batches of 320 samples, "
        "every sample sized)"
    )
    assert tuple(sorted(found.indices(64))) in yielded
    assert found.nbytes == max(
        (len(batch) * max(module.texts.lengths[i] for i in batch) * 8 * 2 + len(batch) * 8) for batch in yielded
    )
    # at 16 the longest bucket's batches of 16 at 200 are the largest; the upper bound at 16 is the same batch
    assert worst.at_size(16).shapes() == _shapes(16, 200)


def test_the_estimate_at_a_size_runs_on_the_samplers_batch_and_a_real_step_on_it_agrees_to_the_byte():
    module = _Classifier(batch_size=8)
    estimate = estimate_memory(module, 64, device="cpu")
    assert estimate.batch_shapes == _shapes(64, 100)
    assert estimate.batch_note.startswith("the largest batch LengthBuckets yields at batch size 64")
    batch = find_worst_batch(module.train_dataloader()).at_size(64).batch
    measured = measure_training_step(module, batch=batch)
    assert estimate.peak_bytes == measured.peak_bytes and estimate.by_category == measured.by_category
    upper = estimate_memory(module, batch=find_worst_batch(module.train_dataloader()).at(64), device="cpu")
    assert upper.peak_bytes > estimate.peak_bytes  # the (64, 200) upper bound: the largest samples put together


def test_the_max_batch_is_predicted_on_a_batch_the_sampler_yields():
    module = _Classifier(batch_size=8)
    budget = 2**20  # between the sampler's largest batches at 100 and at 150 samples
    prediction = predict_max_batch_size(module, budget, device="cpu", margin=0.0)
    size = prediction.batch_size
    found = find_worst_batch(module.train_dataloader()).at_size(size)
    yielded = {tuple(sorted(batch)) for batch in LengthBuckets(module.texts.lengths, size)}
    assert tuple(sorted(found.indices(size))) in yielded and prediction.batch_shapes == found.shapes()
    assert prediction.batch_note.startswith(f"the largest batch LengthBuckets yields at batch size {size}")
    assert measure_training_step(module, batch=found.batch).peak_bytes <= budget
    larger = find_worst_batch(module.train_dataloader()).at_size(size + 1).batch
    assert measure_training_step(module, batch=larger).peak_bytes > budget


@pytest.mark.parametrize("size", [8, 64])
def test_a_sampler_that_cannot_be_iterated_gets_the_upper_bound_and_says_so_at_the_size_asked(size):
    module = _Classifier(batch_size=32, reshuffled=True)
    estimate = estimate_memory(module, size, device="cpu")
    longest = max(module.texts.lengths)
    assert estimate.batch_shapes == _shapes(size, longest)
    assert estimate.batch_note == (
        f"the worst batch of all 320 samples; custom batch sampler LengthBuckets: the {size} largest samples together, "
        f"an upper bound for any batch of {size} (LengthBuckets's batches change with the random state or the epoch)"
    )
    assert batch_shapes(find_worst_batch(module.train_dataloader()).at(size)) == estimate.batch_shapes


@pytest.mark.timeout(300)
def test_max_batch_size_trials_train_on_the_samplers_largest_batch_at_their_size(tmp_path):
    from lightning_memkit.callbacks.max_batch_size import find_max_batch_size

    module = _Classifier(batch_size=8)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    result = find_max_batch_size(trainer, module, budget=2**20, max_val=256, verbose=False)
    assert (
        result.batch_note
        == "each trial trained on the largest batch LengthBuckets yields at that size (320 samples sized)"
    )
    worst = find_worst_batch(_Classifier(batch_size=8).train_dataloader())
    for trial in result.trials:
        if trial.fits:
            assert trial.batch_shapes == worst.at_size(trial.batch_size).shapes(), trial
    proved = result.proved_trial()
    assert proved.batch_size == result.batch_size and proved.peak_bytes <= 2**20


def test_memkit_estimate_names_the_batch_at_the_batch_size_asked(capsys):
    from lightning_memkit.cli import main

    args = [
        "estimate",
        "tests/estimate/data/test_worst_batch_samplers.py:_Classifier",
        "--device",
        "cpu",
        "--device-memory",
        "1GiB",
    ]
    assert main([*args, "--init-args", '{"batch_size": 32, "reshuffled": true}', "--batch-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "the 8 largest samples together, an upper bound for any batch of 8" in out, out
    assert main([*args, "--init-args", '{"batch_size": 32}', "--batch-size", "64"]) == 0
    out = capsys.readouterr().out
    assert (
        f"estimated on {_shapes(64, 100)}" in out and "the largest batch LengthBuckets yields at batch size 64" in out
    )
