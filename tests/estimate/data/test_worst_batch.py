"""The worst batch the data can produce: found without the model, used by every estimate, search and plan, named in
their outputs, the same in every run; a training batch larger than the one a search proved is reported."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from lightning_memkit import MaxBatchSize, estimate_memory, measure_training_step, predict_max_batch_size
from lightning_memkit.estimate.data.worst_batch import BatchSource, batch_nbytes, find_worst_batch
from lightning_memkit.zoo_variable import (
    PaddedTextClassifier,
    PaddedTextDataModule,
    VaryingImageDataModule,
    pad_collate,
)
from tests.helpers.independent_count import PeakCounter, _key


class PaddedText(PaddedTextClassifier):
    """The padded-text classifier without its metrics (their data-dependent ops are tested apart)."""

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self(batch["input_ids"], batch["attention_mask"]), batch["labels"])


def test_the_worst_batch_is_the_largest_samples_collated_by_the_loaders_own_collate():
    data = PaddedTextDataModule(batch_size=16, train_size=300)
    lengths = data.train_set.lengths
    worst = find_worst_batch(data.train_dataloader())
    longest = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))[:16]
    assert worst.source is BatchSource.DATASET and worst.holds_for_the_run
    assert worst.batch["input_ids"].shape == (16, max(lengths))
    assert worst.indices(16) == longest  # the 16 longest, longest first
    assert torch.equal(worst.batch["input_ids"], pad_collate([data.train_set[i] for i in longest])["input_ids"])
    assert worst.nbytes == batch_nbytes(worst.batch) == 16 * max(lengths) * 8 * 2 + 16 * 8
    assert worst.shapes() == f"input_ids (16, {max(lengths)}), attention_mask (16, {max(lengths)}), labels (16,)"
    assert worst.note == "the worst batch of all 300 samples"
    again = find_worst_batch(data.train_dataloader())  # deterministic: the same batch every time
    assert again.indices(16) == worst.indices(16) and torch.equal(again.batch["input_ids"], worst.batch["input_ids"])
    # at another size: that many largest samples, collated afresh
    assert worst.at(40)["input_ids"].shape == (40, max(lengths))


def test_a_bucketing_batch_sampler_gets_the_largest_samples_together_and_says_it_is_an_upper_bound():
    data = PaddedTextDataModule(batch_size=8, train_size=200, bucketed=True)
    worst = find_worst_batch(data.train_dataloader())
    assert worst.batch["input_ids"].shape == (8, max(data.train_set.lengths))
    assert "custom batch sampler BucketBatchSampler: the 8 largest samples together" in worst.note
    # the sampler's own largest batch is no larger: its last bucket holds the 8 longest
    biggest = max(batch_nbytes(batch) for batch in data.train_dataloader())
    assert biggest == worst.nbytes


class _TallAndWide(torch.utils.data.Dataset):
    """Images of three shapes: tall (3, 64, 8), wide (3, 8, 64) and square (3, 40, 40, the most bytes alone)."""

    shapes = [(3, 64, 8), (3, 8, 64), (3, 40, 40)] * 4

    def __len__(self):
        return len(self.shapes)

    def __getitem__(self, index):
        return torch.zeros(self.shapes[index])


def _pad_images(images):
    height = max(image.shape[1] for image in images)
    width = max(image.shape[2] for image in images)
    return torch.stack(
        [nn.functional.pad(image, (0, width - image.shape[2], 0, height - image.shape[1])) for image in images]
    )


def test_images_padded_to_the_tallest_and_the_widest_make_the_worst_batch_from_both():
    # by bytes alone the squares win (3*40*40 > 3*64*8), but a batch of a tall and a wide image is padded to
    # 64 x 64: the search tries each varying dimension too and keeps the largest collated batch
    worst = find_worst_batch(DataLoader(_TallAndWide(), batch_size=2, collate_fn=_pad_images))
    assert worst.batch.shape == (2, 3, 64, 64)
    assert worst.nbytes == 2 * 3 * 64 * 64 * 4


def test_varying_image_sizes_give_the_largest_side():
    data = VaryingImageDataModule(batch_size=4, train_size=64)
    worst = find_worst_batch(data.train_dataloader())
    side = max(data.train_set.sides)
    assert worst.batch[0].shape == (4, 3, side, side)
    assert worst.shapes() == f"batch[0] (4, 3, {side}, {side}), batch[1] (4,)"


def test_a_large_dataset_is_sized_on_a_fixed_subset_and_says_its_coverage_or_by_a_named_size():
    data = PaddedTextDataModule(batch_size=8, train_size=5000)
    subset = find_worst_batch(data.train_dataloader(), max_samples=1000)
    assert subset.source is BatchSource.DATASET_SUBSET and not subset.holds_for_the_run
    assert subset.sized == 1000 and "1,000 of 5,000 samples (20%" in subset.note and "size_of=" in subset.note
    assert find_worst_batch(data.train_dataloader(), max_samples=1000).indices(8) == subset.indices(8)
    named = find_worst_batch(data.train_dataloader(), size_of="lengths")
    full = find_worst_batch(data.train_dataloader())
    assert named.source is BatchSource.SIZE_FIELD and named.batch["input_ids"].shape == full.batch["input_ids"].shape
    with pytest.raises(ValueError, match="has no attribute 'length'"):
        find_worst_batch(data.train_dataloader(), size_of="length")


class _Stream(IterableDataset):
    def __iter__(self):
        generator = torch.Generator().manual_seed(0)
        for _ in range(20):
            yield {
                "input_ids": torch.randint(
                    1, 100, (int(torch.randint(4, 30, (), generator=generator)),), generator=generator
                ),
                "label": torch.tensor(0),
            }


def test_an_iterable_dataset_answers_for_the_batch_seen_and_says_so():
    worst = find_worst_batch(DataLoader(_Stream(), batch_size=4, collate_fn=pad_collate))
    assert worst.source is BatchSource.SEEN and not worst.holds_for_the_run
    assert "the answer holds for this batch only; pass the worst batch (batch=...)" in worst.note
    assert "_Stream cannot be enumerated" in worst.note


def test_the_estimate_runs_on_the_worst_batch_names_its_shapes_and_is_exact_for_it():
    module = PaddedText(train_size=256)
    longest = max(module.datamodule().train_set.lengths)
    estimate = estimate_memory(module, device="cpu")
    assert estimate.batch_shapes == f"input_ids (16, {longest}), attention_mask (16, {longest}), labels (16,)"
    assert estimate.batch_note == "the worst batch of all 256 samples"
    assert f"batch: {estimate.batch_shapes} (the worst batch of all 256 samples)" in estimate.summary()
    worst = find_worst_batch(module.train_dataloader())
    given = estimate_memory(module, batch=worst.batch, device="cpu")
    assert given.peak_bytes == estimate.peak_bytes and given.batch_note.startswith("the batch given")
    measured = measure_training_step(module, batch=worst.batch)
    assert abs(estimate.peak_bytes - measured.peak_bytes) <= 1024  # the CPU estimate is exact to a few scalars
    # the same every time, whatever the shuffled loader would draw first
    assert estimate_memory(module, device="cpu").peak_bytes == estimate.peak_bytes


def test_the_largest_batch_is_the_largest_whose_worst_length_step_fits():
    module = PaddedText(train_size=256, d_model=32, dim_feedforward=64)
    budget = 48 * 2**20
    prediction = predict_max_batch_size(module, budget, device="cpu", margin=0.0)
    answers = {predict_max_batch_size(module, budget, device="cpu", margin=0.0).batch_size for _ in range(2)}
    assert answers == {prediction.batch_size}
    size = prediction.batch_size
    longest = max(module.datamodule().train_set.lengths)
    assert prediction.batch_shapes.startswith(f"input_ids ({size}, {longest})")
    worst = find_worst_batch(module.train_dataloader())
    # estimated directly on the worst batch of that size and one more, collated from the data's largest samples
    assert estimate_memory(module, batch=worst.at(size), device="cpu").peak_bytes <= budget
    assert estimate_memory(module, batch=worst.at(size + 1), device="cpu").peak_bytes > budget
    # and a real CPU step on it
    assert measure_training_step(module, batch=worst.at(size)).peak_bytes <= budget


class _StepPeaks(pl.Callback):
    """Every training step's peak of CPU tensor bytes, counted independently of memkit: the storages of the
    parameters, buffers, gradients, optimizer state and batch at the step's start, plus what the step's ops make."""

    def __init__(self) -> None:
        self.peaks: list[tuple[int, tuple]] = []
        self.counter: PeakCounter | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        state = [
            *pl_module.parameters(),
            *pl_module.buffers(),
            *(p.grad for p in pl_module.parameters() if p.grad is not None),
            *(
                t
                for optimizer in trainer.optimizers
                for s in optimizer.state.values()
                for t in s.values()
                if isinstance(t, torch.Tensor)
            ),
            *(t for t in torch.utils._pytree.tree_flatten(batch)[0] if isinstance(t, torch.Tensor)),
        ]
        held = dict(key for key in map(_key, state) if key is not None)
        self.held = sum(held.values())
        self.shape = tuple(batch["input_ids"].shape)
        self.counter = PeakCounter(held)
        self.counter.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.counter.__exit__(None, None, None)
        self.peaks.append((self.held + self.counter.peak, self.shape))


def test_max_batch_size_trains_100_shuffled_steps_within_its_budget(tmp_path):
    module = PaddedText(train_size=512, d_model=32, dim_feedforward=64)
    search, peaks = MaxBatchSize(budget="24MiB", verbose=False), _StepPeaks()
    trainer = pl.Trainer(
        max_steps=100,
        callbacks=[search, peaks],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the guard would warn of a batch larger than the trial's
        trainer.fit(module)
    assert len(peaks.peaks) == 100
    assert max(peak for peak, _ in peaks.peaks) <= 24 * 2**20
    assert "each trial trained on the worst batch of all 512 samples at its size" in search.result.table()
    proved = search.result.proved_trial()
    assert proved.batch_shapes.startswith(
        f"input_ids ({search.result.batch_size}, {max(module.datamodule().train_set.lengths)})"
    )


class _LongerAfterTheSearch(PaddedText):
    """Texts of 8 to 64 tokens, four times longer once training starts (the search saw only the short ones)."""

    grown = False

    def datamodule(self):
        hp = self.hparams
        data = PaddedTextDataModule(self.batch_size, hp.train_size, 8, 64, hp.vocab_size, hp.num_classes)
        if self.grown:
            data.train_set.tokens = [tokens.repeat(4) for tokens in data.train_set.tokens]
        return data


class _Grow(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        pl_module.grown = True
        trainer.fit_loop._combined_loader = None
        trainer.fit_loop.setup_data()


def test_a_training_batch_larger_than_the_proved_one_is_reported_once_with_its_shape(tmp_path):
    module = _LongerAfterTheSearch(train_size=64, d_model=32, dim_feedforward=64)
    longest = max(module.datamodule().train_set.lengths)
    search = MaxBatchSize(budget="16MiB", verbose=False, max_val=8)
    trainer = pl.Trainer(
        max_steps=4,
        callbacks=[search, _Grow()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module)
    reports = [str(w.message) for w in caught if "proved" in str(w.message)]
    assert len(reports) == 1, reports
    assert reports[0].startswith("memkit: the batch of step 0 (input_ids (8, ")
    assert f"than the largest batch MaxBatchSize's trial at batch size 8 proved (input_ids (8, {longest})" in reports[0]


class _StreamedText(PaddedText):
    """The classifier fed by an iterable dataset: nothing to enumerate."""

    def train_dataloader(self):
        return DataLoader(_Stream(), batch_size=4, collate_fn=pad_collate)


def test_an_estimate_on_an_iterable_dataset_says_it_holds_for_the_batch_seen():
    estimate = estimate_memory(_StreamedText(), device="cpu")
    assert estimate.batch_note.startswith(
        "the batch seen (_Stream cannot be enumerated): the answer holds for this batch only"
    )
    first = next(iter(_StreamedText().train_dataloader()))
    assert estimate.batch_shapes.startswith(f"input_ids {tuple(first['input_ids'].shape)}")


def test_images_of_varying_size_are_predicted_at_the_largest_side():
    from lightning_memkit.zoo_variable import VaryingImageClassifier

    module = VaryingImageClassifier(train_size=64, channels=8, blocks=2)
    side = max(module.datamodule().train_set.sides)
    prediction = predict_max_batch_size(module, 64 * 2**20, device="cpu", margin=0.0)
    assert (
        prediction.batch_shapes == f"batch[0] ({prediction.batch_size}, 3, {side}, {side}), "
        f"batch[1] ({prediction.batch_size},)"
    )
    worst = find_worst_batch(module.train_dataloader())
    assert estimate_memory(module, batch=worst.at(prediction.batch_size), device="cpu").peak_bytes <= 64 * 2**20
    assert estimate_memory(module, batch=worst.at(prediction.batch_size + 1), device="cpu").peak_bytes > 64 * 2**20


def test_autofit_plans_a_padded_text_classifier_with_argmax_metrics_on_its_worst_batch(tmp_path, capsys):
    from lightning_memkit import AutoFit

    # torchmetrics on argmax predictions in every training step: torch.unique on fakes, which failed every estimate
    module = PaddedTextClassifier(train_size=96, d_model=32, dim_feedforward=64, batch_size=16)
    longest = max(module.datamodule().train_set.lengths)
    full = estimate_memory(module, device="cpu").peak_bytes
    auto = AutoFit(device_memory=int(full * 0.6), modes="micro_batch", trials=1, verbose=True)
    trainer = pl.Trainer(
        max_steps=3,
        callbacks=[auto],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module)
    plan = auto.plan
    assert plan.best is not None and plan.best.micro_batch < 16 and plan.best.micro_batch * plan.best.accumulation == 16
    assert plan.notes[0] == (
        f"batch: input_ids (16, {longest}), attention_mask (16, {longest}), labels (16,): the "
        "worst batch of all 96 samples; micro-batches are its largest samples"
    )
    proved = plan.proved_micro_batch
    assert proved.shapes.startswith(f"input_ids ({plan.best.micro_batch}, {longest})")
    assert f"note: {plan.notes[0]}" in capsys.readouterr().out
    assert module.batch_size == plan.best.micro_batch and trainer.global_step == 3
