"""MaxBatchSize across a resume (its answer in the checkpoint, no trial again) and its requirements
said before any trial (a batch size that cannot be set), with clean-up never hiding the search's error."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_memkit import MaxBatchSize
from lightning_memkit.zoo import DemoMLP, SyntheticClassification, SyntheticDataModule

FEATURES = 32


class CountingMLP(DemoMLP):
    """DemoMLP that counts its training steps and the batch sizes it saw."""

    def __init__(self):
        super().__init__(in_features=FEATURES, hidden=32, depth=1)
        del self.batch_size  # on the datamodule
        self.sizes: list[int] = []

    def training_step(self, batch, batch_idx):
        self.sizes.append(int(batch[0].shape[0]))
        return super().training_step(batch, batch_idx)


def _data(batch_size=4):
    return SyntheticDataModule(batch_size=batch_size, train_size=256, val_size=8, input_shape=(FEATURES,))


def _trainer(tmp_path, callbacks, max_steps, **kwargs):
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=str(tmp_path),
        callbacks=callbacks,
        **kwargs,
    )


def _search(**kwargs):
    return MaxBatchSize(budget="256MiB", init_val=4, max_val=16, use_estimate=False, verbose=False, **kwargs)


def test_a_resumed_fit_trains_with_the_checkpointed_batch_and_runs_no_trial(tmp_path):
    torch.manual_seed(0)
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)
    first = _search()
    data = _data()
    _trainer(tmp_path, [first, checkpoint], max_steps=2).fit(CountingMLP(), datamodule=data)
    assert first.result is not None and data.batch_size == 16 == first.trained_with["batch_size"]

    resumed, model, data = _search(), CountingMLP(), _data(batch_size=2)  # built with another size
    _trainer(tmp_path, [resumed], max_steps=4).fit(model, datamodule=data, ckpt_path=checkpoint.last_model_path)
    assert resumed.result is None  # no search
    assert model.sizes == [16, 16]  # steps 3 and 4 only, at the checkpointed size: no trial step ran
    assert data.batch_size == 16 and resumed.optimal_batch_size == 16

    again, model, data = _search(search_on_resume=True), CountingMLP(), _data(batch_size=2)
    _trainer(tmp_path, [again], max_steps=4).fit(model, datamodule=data, ckpt_path=checkpoint.last_model_path)
    assert again.result is not None and again.result.trial_count >= 1
    assert len(model.sizes) > 2  # the trials' steps and the two resumed steps


class ReadOnlyDataModule(pl.LightningDataModule):
    def __init__(self):
        super().__init__()
        self.train_set = SyntheticClassification(64, (FEATURES,))
        self._size = 4

    @property
    def batch_size(self):
        return self._size

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.train_set, batch_size=self._size)


def test_a_read_only_batch_size_is_refused_before_any_trial(tmp_path):
    model = CountingMLP()
    with pytest.raises(MisconfigurationException) as caught:
        _trainer(tmp_path, [_search()], max_steps=2).fit(model, datamodule=ReadOnlyDataModule())
    message = str(caught.value)
    assert "ReadOnlyDataModule.batch_size" in message and "setter" in message and "plain attribute" in message, message
    assert model.sizes == []  # no trial ran


class FailingStepMLP(CountingMLP):
    def training_step(self, batch, batch_idx):
        if batch[0].shape[0] > 4:
            raise ValueError("the step's own error")
        return super().training_step(batch, batch_idx)


class SetOnceDataModule(pl.LightningDataModule):
    """A batch size whose setter fails when set back after a trial (so the search's clean-up fails too)."""

    def __init__(self):
        super().__init__()
        self.train_set = SyntheticClassification(64, (FEATURES,))
        self._size, self.sets = 4, 0

    @property
    def batch_size(self):
        return self._size

    @batch_size.setter
    def batch_size(self, value):
        self.sets += 1
        if value == 4 and self._size != 4:  # the requirement check (same value) and the trial's size succeed
            raise AttributeError("batch_size cannot be set back")
        self._size = value

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.train_set, batch_size=self._size)


def test_a_failing_clean_up_never_hides_the_searchs_own_error(tmp_path):
    with (
        pytest.warns(RuntimeWarning, match="putting the trainer's state back failed too"),
        pytest.raises(ValueError, match="the step's own error"),
    ):
        _trainer(
            tmp_path,
            [MaxBatchSize(budget="256MiB", init_val=8, max_val=16, use_estimate=False, verbose=False)],
            max_steps=2,
        ).fit(FailingStepMLP(), datamodule=SetOnceDataModule())


def test_the_summary_says_once_what_the_search_peak_and_the_run_peak_count(tmp_path, capsys):
    from lightning_memkit import MemoryTracker
    from lightning_memkit.units import format_bytes

    search, tracker = _search(), MemoryTracker()
    _trainer(tmp_path, [search, tracker], max_steps=2).fit(CountingMLP(), datamodule=_data())
    chosen = [t for t in search.result.trials if t.fits and t.batch_size == search.result.batch_size][-1]
    printed = capsys.readouterr().out
    line = (
        f"batch 16: trial peak {format_bytes(chosen.peak_bytes)} of the {format_bytes(2**28)} budget; "
        "counts one step's tensors (model state, batch, step); the run peak, every live tensor of the process"
    )
    assert printed.count("batch-size search") == 1 and line in printed, printed
    assert tracker.summary.extra["batch_search"].startswith("batch 16: ")


def test_layer_trace_on_a_resumed_run_says_a_step_before_the_checkpoint_belongs_to_the_run_before(tmp_path):
    from lightning_memkit import LayerTrace

    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)
    _trainer(tmp_path, [checkpoint], max_steps=3).fit(CountingMLP(), datamodule=_data())
    trace = LayerTrace(at_steps=(1,), verbose=False)
    with pytest.warns(UserWarning, match="LayerTrace") as caught:
        _trainer(tmp_path, [trace], max_steps=5).fit(
            CountingMLP(), datamodule=_data(), ckpt_path=checkpoint.last_model_path
        )
    said = " ".join(str(w.message) for w in caught if "LayerTrace" in str(w.message))
    assert "step 1 of at_steps came before this run's first step 3" in said, said
    assert "give a step this resumed run reaches, from 3 to 4, e.g. LayerTrace(at_steps=(3,))" in said, said
    assert "train longer" not in said, said
