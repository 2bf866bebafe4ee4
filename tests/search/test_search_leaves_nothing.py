"""The search, compare and the estimate leave nothing alive, reference cycles included.

Each check runs with the garbage collector switched off (switched on again in ``finally``), so a
tensor kept only by a reference cycle still counts: what the process would hold until the collector
next runs (for a large model, a copy of its weights). The counts are the process's own
(``tests/helpers/live_tensors.py``), never memkit's accountant, except where the tracker's readings are what
is compared.
"""

from __future__ import annotations

import gc

import lightning.pytorch as pl
import torch

from lightning_memkit import MemoryTracker, compare_modes
from lightning_memkit.callbacks.max_batch_size import MaxBatchSize, find_max_batch_size
from lightning_memkit.estimate import estimate_memory, measure_training_step
from lightning_memkit.zoo import DemoMLP, SyntheticDataModule
from tests.helpers.live_tensors import describe, live_tensor_bytes, live_tensors

FEATURES = 64
SIZE = 16


def _trainer(tmp_path, callbacks=(), max_steps=3):
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=str(tmp_path),
        callbacks=list(callbacks),
    )


def _model_and_data(batch_size):
    torch.manual_seed(0)
    module = DemoMLP(in_features=FEATURES, hidden=96, depth=2)
    del module.batch_size  # the batch size lives on the datamodule
    return module, SyntheticDataModule(batch_size=batch_size, train_size=256, val_size=16, input_shape=(FEATURES,))


def _tracked_fit(tmp_path, search: bool) -> list[int]:
    """The tracker's live tensor bytes at each step of a 3-step fit at batch SIZE, with the collector off."""
    module, data = _model_and_data(SIZE if not search else 4)
    tracker = MemoryTracker(verbose=False, detect_leaks=False)
    callbacks = [tracker]
    if search:  # the search tries 4, 8, 16 and must end at SIZE (max_val), as the fit without it trains
        callbacks.insert(0, MaxBatchSize(budget="512MiB", init_val=4, max_val=SIZE, use_estimate=False, verbose=False))
    gc.collect()
    gc.disable()
    try:
        _trainer(tmp_path, callbacks).fit(module, datamodule=data)
    finally:
        gc.enable()
    assert data.batch_size == SIZE
    return [r.tensor_bytes for r in tracker.history if r.stage == "train"]


def test_the_trackers_bytes_at_each_step_are_the_same_with_the_search_as_without(tmp_path):
    _tracked_fit(tmp_path / "warm", search=True)  # imports and first-use caches, in both arms alike
    without = _tracked_fit(tmp_path / "a", search=False)
    with_search = _tracked_fit(tmp_path / "b", search=True)
    assert len(without) == 3 and all(without)
    assert with_search == without, (with_search, without)


def _uncollected_growth(run) -> tuple[int, int, str]:
    """(bytes the process's tensors grew by over ``run()`` with no collection, bytes after a full
    collection, what the uncollected extra tensors are), the collector off during ``run``."""
    gc.collect()
    gc.disable()
    try:
        before = live_tensor_bytes(collect=False)
        before_ids = {id(t) for t in live_tensors("cpu", collect=False)}
        kept = run()
        after = live_tensor_bytes(collect=False)
        extra = [t for t in live_tensors("cpu", collect=False) if id(t) not in before_ids]
        text = describe(extra)
        del extra
    finally:
        gc.enable()
    collected = live_tensor_bytes()
    del kept
    return after - before, collected - before, text


def test_find_max_batch_size_leaves_no_tensor_in_a_cycle(tmp_path):
    module, data = _model_and_data(4)
    trainer = _trainer(tmp_path)

    def run():
        return find_max_batch_size(
            trainer, module, data, budget="512MiB", init_val=4, max_val=SIZE, use_estimate=True, verbose=False
        )

    run()  # warm-up: imports, caches
    data.batch_size = 4
    grown, collected, extra = _uncollected_growth(run)
    assert data.batch_size == SIZE
    assert grown == collected == 0, extra


def test_the_estimate_and_a_measured_step_leave_no_tensor_in_a_cycle():
    module, _ = _model_and_data(SIZE)  # DemoMLP holds a torchmetrics metric: its copy sits in a cycle
    batch = (torch.randn(SIZE, FEATURES), torch.zeros(SIZE, dtype=torch.int64))

    def estimate():
        return estimate_memory(module, batch=batch).peak_bytes

    def measure():
        return measure_training_step(module, batch=batch).peak_bytes

    for run in (estimate, measure):
        run()  # warm-up
        grown, collected, extra = _uncollected_growth(run)
        assert grown == collected == 0, (run.__name__, extra)


def test_compare_leaves_no_tensor_in_a_cycle(tmp_path):
    def run():
        return (
            compare_modes(
                lambda: _model_and_data(SIZE)[0],
                lambda: _model_and_data(SIZE)[1],
                modes="baseline,checkpoint",
                max_steps=2,
                accelerator="cpu",
                root_dir=str(tmp_path),
                write=False,
                figures=False,
                verbose=False,
                warmup_steps=1,
                val_batches=1,
            )
            .results[0]
            .peak_allocated_bytes
        )

    run()  # warm-up
    grown, collected, extra = _uncollected_growth(run)
    assert grown == collected == 0, extra


def test_memkits_callbacks_leave_no_tensor_only_a_cycle_keeps(tmp_path):
    """A fit with every memkit callback, the collector off: of what it leaves (the model, trainer and data
    kept), a full collection finds no tensor that only a reference cycle held."""
    from lightning_memkit import ActivationCheckpointing, LayerTrace, MemoryDoctor
    from lightning_memkit.zoo import DemoTransformer

    def fit(root):
        torch.manual_seed(0)
        module = DemoTransformer(
            vocab_size=50, d_model=32, nhead=2, layers=2, dim_feedforward=64, seq_len=16, dropout=0.0
        )
        data = SyntheticDataModule(batch_size=4, train_size=32, val_size=8, input_shape=(16,), vocab_size=50)
        callbacks = [
            MemoryTracker(verbose=False),
            LayerTrace(verbose=False),
            ActivationCheckpointing(verbose=False),
            MemoryDoctor(verbose=False),
        ]
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=3,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            limit_val_batches=1,
            num_sanity_val_steps=0,
            default_root_dir=str(root),
            callbacks=callbacks,
        )
        trainer.fit(module, datamodule=data)
        return module, data, trainer

    fit(tmp_path / "warm")
    gc.collect()
    gc.disable()
    try:
        kept = fit(tmp_path / "run")
    finally:
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        gc.set_debug(0)
        gc.enable()
    cyclic = []
    for obj in gc.garbage:
        try:
            if isinstance(obj, torch.Tensor) and type(obj).__name__ != "FakeTensor":
                cyclic.append(obj)
        except ReferenceError:  # a dead weakref proxy
            continue
    gc.garbage.clear()
    assert cyclic == [], describe(cyclic)
    del kept
