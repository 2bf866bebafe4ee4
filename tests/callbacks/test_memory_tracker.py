"""MemoryTracker in real CPU Trainer runs: exact peaks, every tag at every step, every logger."""

from __future__ import annotations

import csv
import itertools
import json
import os
import re

import lightning.pytorch as pl
import numpy
import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils._python_dispatch import _get_current_dispatch_mode

from lightning_memkit import MemoryTracker
from lightning_memkit.probes.base import MemoryProbe
from lightning_memkit.records import MEMORY_FIELDS, RECORDS_FILENAME, read_records
from lightning_memkit.tensorboard.tags import is_frame_tag, step_tag
from lightning_memkit.units import MiB
from tests.helpers.event_files import read_scalars
from tests.helpers.live_tensors import live_tensors, storage_bytes
from tests.helpers.models import FLOAT32, LinearStack
from tests.helpers.trainers import make_trainer

SCALAR = FLOAT32


class _ProcessBytes(Callback):
    """Placed before the tracker: the process's live tensor bytes at each batch start, counted
    independently of memkit with gc (tests/helpers/live_tensors.py), plus the parameters' gradients,
    which have no Python object for gc to find until someone reads them."""

    def __init__(self) -> None:
        self.at_batch_start: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.at_batch_start.append(storage_bytes(live_tensors("cpu") + grads))  # each storage once


def _rest_of_process(
    counter: _ProcessBytes, model: LinearStack, batch_size: int, steps_with_grads=lambda step: step > 0
) -> list[int]:
    """What ``tensor_MiB`` counts besides the step's own tensors, now that it covers the whole
    process: at each batch start, everything alive minus the parameters P, the batch X and the
    gradients G of the last step. For these runs that is the model's dataset tensor
    (``model.data``) plus whatever else this pytest process holds; the tests check it is the
    same at every step and includes the dataset."""
    P = model.parameter_bytes()
    X = batch_size * model.dims[0] * FLOAT32
    return [total - P - X - (P if steps_with_grads(step) else 0) for step, total in enumerate(counter.at_batch_start)]


#: the fields a CPU run logs: host RSS and the accountant (no CUDA, no NVML)
CPU_FIELDS = [f for f, meaning in MEMORY_FIELDS.items() if meaning.startswith(("host:", "accountant:"))]


def _forward_moments(model: LinearStack) -> list[int]:
    """Activation bytes at each high point of the forward, on top of what the step started with.

    Linear k allocates its output h_k, ReLU allocates r_k (saved for backward, and the next
    Linear's saved input), then h_k dies: right after ReLU k, r_0..r_{k-1}, h_k and r_k are
    live. At the head the last Linear's ``out`` (saved by ``pow``), ``out**2`` and the 4-byte
    sum are live on top of every r.
    """
    hidden = len(model.dims) - 2
    r = [model.activation_bytes(j) for j in range(hidden)]
    after_relu = [sum(r[:k]) + 2 * r[k] for k in range(hidden)]
    out = model.activation_bytes(hidden)
    return after_relu + [sum(r) + 2 * out + SCALAR]


def _backward_moments(model: LinearStack, accumulating: bool = False) -> list[int]:
    """Bytes at each Linear's high point in backward (besides P and X), the moment its bias
    gradient is allocated: every gradient of this and later layers, the saved inputs of
    earlier layers (r_0..r_{k-1}, this layer's input included), the gradient flowing into this layer's output, the one
    it passes down (not for the first layer: the batch needs none), and three float32 scalars
    (Lightning's closure loss ``loss / 1``, its detached clone, autograd's seed gradient).
    ``zero_grad`` (set_to_none) ran before backward, so no older gradient is live.

    ``accumulating``: a later micro-batch's backward. Every gradient G already exists; each
    layer's new gradients are temporaries that AccumulateGrad adds in place and frees, so only
    this layer's are live on top of G (G itself is added by the caller)."""
    d, B = model.dims, model.batch_size
    layers = len(d) - 1
    grads = [(d[k] * d[k + 1] + d[k + 1]) * FLOAT32 for k in range(layers)]
    r = [model.activation_bytes(j) for j in range(layers - 1)]
    moments = []
    for k in range(layers):
        grad_in = B * d[k] * FLOAT32 if k > 0 else 0
        new_grads = grads[k] if accumulating else sum(grads[k:])
        moments.append(new_grads + sum(r[:k]) + model.activation_bytes(k) + grad_in + 3 * SCALAR)
    # ReLU k's backward (threshold_backward) allocates the gradient w.r.t. h_k while the one
    # w.r.t. r_k and the saved r_0..r_k are live; later layers' gradients exist by then.
    for k in range(layers - 1):
        new_grads = 0 if accumulating else sum(grads[k + 1 :])
        moments.append(new_grads + sum(r[: k + 1]) + 2 * r[k] + 3 * SCALAR)
    return moments


def _adam_step_moments(model: LinearStack) -> list[int]:
    """Bytes of Adam's temporaries (besides P, G, state and X) while it updates parameter i
    (torch.optim.adam's single-tensor loop): ``exp_avg_sq.sqrt()`` and its division by the
    bias correction (each the size of p_i) while the previous parameter's ``denom`` is still
    bound in the loop; plus Lightning's closure loss and its clone."""
    sizes = [p.numel() * FLOAT32 for p in model.parameters()]
    return [(sizes[i - 1] if i else 0) + 2 * sizes[i] + 2 * SCALAR for i in range(len(sizes))]


@pytest.mark.parametrize("batch_size", [8, 24])
def test_cpu_per_step_peak_equals_hand_computed_bytes_sgd(tmp_path, batch_size):
    """Lightning's automatic optimization runs forward, then ``zero_grad`` (set_to_none), then
    backward, then the step. So from step 1 on, last step's gradients G are still live during
    the forward, while at step 0 there are none; backward always starts without them.
    The optimizer (plain SGD) updates in place. The peak is the highest of the moments
    worked out by hand above, on top of the rest of the process (``_rest_of_process``: the
    dataset tensor and whatever else the process holds, which the whole-process reading counts).
    """
    dims = (32, 64, 48, 16)
    model = LinearStack(dims, batch_size)
    counter = _ProcessBytes()
    tracker = MemoryTracker(verbose=False, tensor_peak_every_n_steps=1)
    make_trainer(tmp_path, max_steps=4, callbacks=[counter, tracker]).fit(model)

    P = model.parameter_bytes()
    G = P
    X = batch_size * dims[0] * FLOAT32
    rest = _rest_of_process(counter, model, batch_size)
    assert len(set(rest)) == 1 and rest[0] >= model.data.nbytes, rest
    rest = rest[0]
    step0 = rest + P + X + max(max(_forward_moments(model)), max(_backward_moments(model)))
    later = rest + P + X + max(G + max(_forward_moments(model)), max(_backward_moments(model)))
    assert [r.step for r in tracker.history] == [0, 1, 2, 3]
    assert [r.peak_tensor_bytes for r in tracker.history] == [step0, later, later, later]
    # at step end: P, G, X and Lightning's detached loss clone, and the rest of the process
    assert [r.tensor_bytes for r in tracker.history] == [rest + P + G + X + SCALAR] * 4
    assert tracker.summary.peak_bytes == max(step0, later)
    assert tracker.summary.peak_source == "peak_tensor_bytes"


def test_cpu_per_step_peak_counts_adam_state(tmp_path):
    """Adam adds exp_avg and exp_avg_sq (each the size of its parameter) and a float32 ``step``
    per parameter tensor, created at step 0; from step 1 they are live through the forward."""
    dims, batch_size = (32, 64, 48, 16), 32
    model = LinearStack(dims, batch_size, optimizer="adam")
    counter = _ProcessBytes()
    tracker = MemoryTracker(verbose=False, tensor_peak_every_n_steps=1)
    make_trainer(tmp_path, max_steps=3, callbacks=[counter, tracker]).fit(model)

    P = model.parameter_bytes()
    G = P
    parameter_tensors = 2 * (len(dims) - 1)
    S = 2 * P + parameter_tensors * SCALAR
    X = batch_size * dims[0] * FLOAT32
    # the rest of the process (dataset and others); Adam's state S is in the gc count from step 1
    rest = [r - S for r in _rest_of_process(counter, model, batch_size)[1:]]
    assert len(set(rest)) == 1 and rest[0] >= model.data.nbytes, rest
    expected = (
        rest[0]
        + P
        + S
        + X
        + max(G + max(_forward_moments(model)), max(_backward_moments(model)), G + max(_adam_step_moments(model)))
    )
    assert [r.peak_tensor_bytes for r in tracker.history][1:] == [expected, expected]
    # at this batch size Adam's temporaries, not the activations, make the peak
    assert max(_adam_step_moments(model)) > max(_forward_moments(model))


def test_every_documented_tag_at_every_step_train_and_val(tmp_path):
    model = LinearStack(batch_size=8, log_loss=True, val_batches=2)
    tracker = MemoryTracker(verbose=False, tensor_peak_every_n_steps=1)
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    trainer = make_trainer(
        tmp_path,
        max_steps=6,
        logger=logger,
        callbacks=[tracker],
        val_check_interval=3,
        limit_val_batches=2,
        check_val_every_n_epoch=None,
    )
    trainer.fit(model)
    scalars = read_scalars(logger.log_dir)

    for field in CPU_FIELDS:
        assert [s for s, _ in scalars[step_tag(field, "train")]] == list(range(6)), field
        # validation ran after the 3rd and 6th training step: on the training-step axis,
        # at the very steps Lightning wrote its own val_loss
        assert [s for s, _ in scalars[step_tag(field, "validate")]] == [s for s, _ in scalars["val_loss"]] == [2, 5], (
            field
        )
    assert [s for s, _ in scalars["train_loss"]] == list(range(6))
    for tag in ("run_peak_MiB", "run_peak_step", "capacity_MiB", "run_peak_fraction"):
        assert [s for s, _ in scalars[f"memory/summary/{tag}"]] == [6], tag

    # TensorBoard holds float32; these byte counts are exact in it
    logged_peaks = [round(v * MiB) for _, v in scalars["memory/train/peak_tensor_MiB"]]
    train_history = [r for r in tracker.history if r.stage == "train"]
    assert logged_peaks == [r.peak_tensor_bytes for r in train_history]
    val_history = [r for r in tracker.history if r.stage == "validate"]
    assert [r.step for r in val_history] == [2, 5]
    # validation keeps no graph: its peak is below training's, and it is not zero
    assert 0 < val_history[0].peak_tensor_bytes < train_history[1].peak_tensor_bytes
    run_peak = scalars["memory/summary/run_peak_MiB"][0][1]
    assert round(run_peak * MiB) == tracker.summary.peak_bytes == max(r.peak_tensor_bytes for r in tracker.history)
    # nothing but memkit's documented tags under memory/
    documented = {step_tag(f, stage) for f in CPU_FIELDS for stage in ("train", "validate")}
    documented |= {
        f"memory/summary/{t}" for t in ("run_peak_MiB", "run_peak_step", "capacity_MiB", "run_peak_fraction")
    }
    # ... and the dashboard's rebased copies of them (docs/dashboard.md: lines drawn above a base the
    # chart's title names, written at fit end where TensorBoard's tick labels would repeat)
    rebased = {t for t in scalars if t.startswith("memory/dashboard/")}
    # frame lines: tests/tensorboard/test_dashboard_rules.py
    for tag in rebased - {t for t in rebased if is_frame_tag(t)}:
        source = re.fullmatch(
            r"memory/dashboard/(.+?)_(B|KiB|MiB|GiB)(_above_[0-9.]+_\2)?", tag
        )  # GiB alone: values of 1,000 MiB and more
        assert source and f"memory/{source.group(1)}_MiB" in documented, tag
    assert {t for t in scalars if t.startswith("memory/")} - rebased == documented
    # the offline record
    summary, history = read_records(os.path.join(logger.log_dir, RECORDS_FILENAME))
    assert summary.peak_bytes == tracker.summary.peak_bytes and len(history) == 8


def test_every_n_steps_is_respected(tmp_path):
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    tracker = MemoryTracker(every_n_steps=3, log_validation=False, verbose=False)
    make_trainer(tmp_path, max_steps=7, logger=logger, callbacks=[tracker]).fit(LinearStack())
    scalars = read_scalars(logger.log_dir)
    for field in CPU_FIELDS:
        # the accountant's per-op peak runs on the first two measured steps, then every 10th (tensor_peak_every_n_steps)
        assert [s for s, _ in scalars[step_tag(field)]] == ([0, 3] if field == "peak_tensor_bytes" else [0, 3, 6]), (
            field
        )
    assert [r.step for r in tracker.history] == [0, 3, 6]
    assert [r.peak_tensor_bytes is not None for r in tracker.history] == [True, True, False]
    # memkit's own rows (every_n_steps > 1), each with the epoch
    assert [s for s, _ in scalars["epoch"]] == [0, 3, 6] and all(v == 0 for _, v in scalars["epoch"])
    # an unmeasured step leaves no window open and adopts nothing
    assert _get_current_dispatch_mode() is None


def test_gradient_accumulation_gives_one_reading_per_optimizer_step(tmp_path):
    """With accumulate_grad_batches=2 one window spans both micro-batches, so there is one
    reading per optimizer step and its peak is the higher micro-batch's. Lightning zeroes the
    gradients only before the first micro-batch's backward; the second runs its forward and
    backward with every gradient G live and accumulates into it."""
    dims, batch_size = (32, 64, 48, 16), 8
    model = LinearStack(dims, batch_size)
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    counter = _ProcessBytes()
    tracker = MemoryTracker(verbose=False, tensor_peak_every_n_steps=1)
    trainer = make_trainer(
        tmp_path, max_steps=3, accumulate_grad_batches=2, logger=logger, callbacks=[counter, tracker]
    )
    trainer.fit(model)
    assert trainer.fit_loop.epoch_loop.batch_progress.total.completed == 6  # six micro-batches
    scalars = read_scalars(logger.log_dir)
    assert [s for s, _ in scalars["memory/train/peak_tensor_MiB"]] == [0, 1, 2]
    assert [r.step for r in tracker.history] == [0, 1, 2]
    P = model.parameter_bytes()
    G = P
    X = batch_size * dims[0] * FLOAT32  # the loop lets go of micro-batch 1 before micro-batch 2
    first = max(_backward_moments(model))
    second = G + max(max(_forward_moments(model)), max(_backward_moments(model, accumulating=True)))
    assert second > first
    # the rest of the process at each optimizer step's first micro-batch (gradients of the
    # previous optimizer step are still there then, except at step 0)
    rest = [counter.at_batch_start[2 * k] - P - X - (P if k else 0) for k in range(3)]
    assert rest[0] >= model.data.nbytes and rest[1] == rest[2] == rest[0], rest
    assert [r.peak_tensor_bytes for r in tracker.history] == [rest[k] + P + X + second for k in range(3)]


def test_validation_inside_an_accumulation_window_does_not_split_the_step(tmp_path):
    """Validation after micro-batch 3 falls inside optimizer step 1's window: that step must
    still give exactly one training reading; the validation run there is measured too (the
    training window is set aside meanwhile), at the step Lightning logs it at."""
    tracker = MemoryTracker(verbose=False)
    make_trainer(
        tmp_path,
        max_steps=3,
        accumulate_grad_batches=2,
        callbacks=[tracker],
        val_check_interval=3,
        limit_val_batches=1,
        check_val_every_n_epoch=None,
    ).fit(LinearStack(val_batches=1))
    train = [r.step for r in tracker.history if r.stage == "train"]
    validate = [r.step for r in tracker.history if r.stage == "validate"]
    assert train == [0, 1, 2]
    assert validate == [1, 2]  # after micro-batch 3 (inside step 1's window) and micro-batch 6


def test_csv_logger_has_the_columns(tmp_path):
    logger = CSVLogger(str(tmp_path), name="csv")
    tracker = MemoryTracker(verbose=False)
    make_trainer(tmp_path, max_steps=3, logger=logger, callbacks=[tracker]).fit(LinearStack())
    with open(os.path.join(logger.log_dir, "metrics.csv")) as file:
        rows = list(csv.DictReader(file))
    columns = set(rows[0])
    for field in CPU_FIELDS:
        assert step_tag(field) in columns
    assert "memory/summary/run_peak_MiB" in columns
    train_rows = [r for r in rows if r["memory/train/tensor_MiB"]]
    assert [int(r["step"]) for r in train_rows] == [0, 1, 2]
    # float64 all the way: the CSV holds the exact bytes / 2**20
    assert [float(r["memory/train/tensor_MiB"]) * MiB for r in train_rows] == [r.tensor_bytes for r in tracker.history]
    # the peak on the first two steps only (then one in tensor_peak_every_n_steps=10), and no stale value after it
    assert [r["memory/train/peak_tensor_MiB"] != "" for r in train_rows] == [True, True, False]
    assert float(train_rows[0]["memory/train/peak_tensor_MiB"]) * MiB == tracker.history[0].peak_tensor_bytes


def test_csv_memory_is_in_lightnings_rows_with_the_epoch(tmp_path):
    """Memory is logged through Lightning's own logging: one row per logged step holds the
    user's train_loss, the epoch and memkit's values; validation's in the val_loss row; Lightning's
    log_every_n_steps decides which steps are written."""
    logger = CSVLogger(str(tmp_path), name="csv")
    tracker = MemoryTracker(verbose=False, tensor_peak_every_n_steps=1)
    make_trainer(
        tmp_path,
        max_steps=8,
        logger=logger,
        callbacks=[tracker],
        log_every_n_steps=2,
        val_check_interval=4,
        limit_val_batches=1,
        check_val_every_n_epoch=None,
    ).fit(LinearStack(log_loss=True, val_batches=1))
    with open(os.path.join(logger.log_dir, "metrics.csv")) as file:
        rows = list(csv.DictReader(file))
    train_rows = [r for r in rows if r["train_loss"]]
    assert [int(r["step"]) for r in train_rows] == [1, 3, 5, 7]  # Lightning's log_every_n_steps=2
    for row in train_rows:
        assert row["epoch"] == "0"
        for field in CPU_FIELDS:
            assert row[step_tag(field)] != "", (field, row)
    # every row that has memory has the user's metric too (the summary row at fit end aside)
    memory_rows = [r for r in rows if any(r[step_tag(f)] for f in CPU_FIELDS)]
    assert memory_rows == train_rows
    val_rows = [r for r in rows if r["val_loss"]]
    assert [int(r["step"]) for r in val_rows] == [3, 7]
    assert all(r[step_tag("tensor_bytes", "validate")] and r["epoch"] == "0" for r in val_rows)
    by_step = {r.step: r for r in tracker.history if r.stage == "train"}
    assert [float(r["memory/train/peak_tensor_MiB"]) * MiB for r in train_rows] == [
        by_step[s].peak_tensor_bytes for s in (1, 3, 5, 7)
    ]
    assert tracker.summary.train_steps_measured == 8 and tracker.summary.validation_runs_measured == 2


def test_no_logger_fills_history(tmp_path, capsys):
    tracker = MemoryTracker()
    make_trainer(tmp_path, max_steps=3, logger=False, callbacks=[tracker]).fit(LinearStack())
    assert [r.step for r in tracker.history] == [0, 1, 2]
    assert all(r.tensor_bytes and r.host_rss_bytes for r in tracker.history)
    assert tracker.history[0].peak_tensor_bytes  # step 0: the accountant's peak (every 10th step)
    assert tracker.summary.steps_measured == tracker.summary.train_steps_measured == 3
    out = capsys.readouterr().out
    assert "memkit memory summary" in out and "run peak" in out and "(peak_tensor_bytes)" in out
    assert [line.split()[-1] for line in out.splitlines() if line.startswith("training steps measured")] == ["3"]
    # no logger: nothing written (not in default_root_dir, not in the working directory)
    assert tracker.records_path is None
    assert not os.path.exists(os.path.join(str(tmp_path), RECORDS_FILENAME)) and not os.path.exists(RECORDS_FILENAME)
    # unless asked, and never over another run's file
    path = tracker.save_records(str(tmp_path))
    assert path == os.path.join(str(tmp_path), RECORDS_FILENAME)
    assert [r.step for r in read_records(path)[1]] == [0, 1, 2]
    again = MemoryTracker(verbose=False, records_file=str(tmp_path / RECORDS_FILENAME))
    make_trainer(tmp_path, max_steps=2, logger=False, callbacks=[again]).fit(LinearStack())
    assert again.records_path == os.path.join(str(tmp_path), "memkit_memory-v1.json")
    assert [r.step for r in read_records(path)[1]] == [0, 1, 2]  # the first run's file is untouched
    assert [r.step for r in read_records(again.records_path)[1]] == [0, 1]


def test_two_loggers_both_written(tmp_path):
    tb = TensorBoardLogger(str(tmp_path), name="tb")
    csv_logger = CSVLogger(str(tmp_path), name="csv")
    tracker = MemoryTracker(verbose=False)
    make_trainer(tmp_path, max_steps=3, logger=[tb, csv_logger], callbacks=[tracker]).fit(LinearStack())
    scalars = read_scalars(tb.log_dir)
    with open(os.path.join(csv_logger.log_dir, "metrics.csv")) as file:
        rows = [r for r in csv.DictReader(file) if r["memory/train/tensor_MiB"]]
    tb_values = [v for _, v in scalars["memory/train/tensor_MiB"]]
    csv_values = [float(r["memory/train/tensor_MiB"]) for r in rows]
    assert [s for s, _ in scalars["memory/train/tensor_MiB"]] == [int(r["step"]) for r in rows] == [0, 1, 2]
    assert tb_values == [float(numpy.float32(v)) for v in csv_values]  # TensorBoard keeps float32


def test_allocator_path_without_accountant(tmp_path):
    tracker = MemoryTracker(tensor_accounting=False, verbose=False)
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    make_trainer(tmp_path, max_steps=2, logger=logger, callbacks=[tracker]).fit(LinearStack())
    scalars = read_scalars(logger.log_dir)
    assert "memory/train/peak_tensor_MiB" not in scalars
    assert [s for s, _ in scalars["memory/train/host_peak_rss_MiB"]] == [0, 1]
    assert tracker.summary.peak_source == "host_peak_rss_bytes"


class _FailingProbe(MemoryProbe):
    """A memory source that fails on read, like NVML losing its driver mid-run."""

    name = "flaky-nvml"

    def read(self):
        raise RuntimeError("NVML_ERROR_DRIVER_NOT_LOADED")


def test_a_failing_probe_warns_once_and_the_run_finishes(tmp_path, recwarn):
    tracker = MemoryTracker(extra_probes=[_FailingProbe()], verbose=False)
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    trainer = make_trainer(tmp_path, max_steps=4, logger=logger, callbacks=[tracker])
    trainer.fit(LinearStack())
    assert trainer.global_step == 4
    warnings = [w for w in recwarn.list if "flaky-nvml" in str(w.message)]
    assert len(warnings) == 1
    assert "switched off" in str(warnings[0].message) and "NVML_ERROR_DRIVER_NOT_LOADED" in str(warnings[0].message)
    scalars = read_scalars(logger.log_dir)
    assert [s for s, _ in scalars["memory/train/tensor_MiB"]] == [0, 1, 2, 3]


def test_resume_continues_the_step_axis(tmp_path):
    """Checkpoint mid-epoch after step 2, resume to step 6: history 0..5 once each, and the
    resumed run's event file starts at step 3."""
    first_logger = TensorBoardLogger(str(tmp_path), name="tb", version="first")
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=3, save_top_k=-1)
    first = MemoryTracker(verbose=False)
    make_trainer(
        tmp_path, max_steps=4, logger=first_logger, callbacks=[first, checkpoint], enable_checkpointing=True
    ).fit(LinearStack(log_loss=True))
    path = os.path.join(str(tmp_path / "ckpt"), "epoch=0-step=3.ckpt")
    assert os.path.exists(path), os.listdir(str(tmp_path / "ckpt"))
    assert [r["step"] for r in _tracker_state(path)["history"]] == [0, 1, 2]

    second_logger = TensorBoardLogger(str(tmp_path), name="tb", version="second")
    second = MemoryTracker(verbose=False)
    make_trainer(tmp_path, max_steps=6, logger=second_logger, callbacks=[second]).fit(
        LinearStack(log_loss=True), ckpt_path=path
    )
    assert [r.step for r in second.history] == [0, 1, 2, 3, 4, 5]
    assert second.summary.steps_measured == 6
    scalars = read_scalars(second_logger.log_dir)
    assert [s for s, _ in scalars["memory/train/tensor_MiB"]] == [3, 4, 5]
    assert [s for s, _ in scalars["train_loss"]] == [3, 4, 5]  # the same axis as Lightning's


def _tracker_state(path: str) -> dict:
    callbacks = torch.load(path, weights_only=False)["callbacks"]
    (state,) = [v for k, v in callbacks.items() if k.startswith("MemoryTracker")]
    return state


class _HugeAllocation(LinearStack):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step == 2:
            torch.empty(2**60, dtype=torch.uint8)  # 1 EiB: the CPU allocator refuses it
        return loss


def test_out_of_memory_leaves_a_report_flushes_loggers_and_reraises(tmp_path):
    logger = CSVLogger(str(tmp_path), name="csv")
    tracker = MemoryTracker(verbose=False)
    trainer = make_trainer(tmp_path, max_steps=5, logger=logger, callbacks=[tracker])
    with pytest.raises(RuntimeError, match="DefaultCPUAllocator: can't allocate memory"):
        trainer.fit(_HugeAllocation())
    assert _get_current_dispatch_mode() is None  # the accountant is off the mode stack
    report_path = os.path.join(logger.log_dir, "memkit_oom_rank0.json")
    assert tracker.oom_report_path == report_path
    with open(report_path) as file:
        report = json.load(file)
    assert report["step"] == 2 and report["rank"] == 0 and report["device"] == "cpu"
    assert report["error_type"] == "RuntimeError" and "can't allocate memory" in report["error"]
    assert [r["step"] for r in report["last_readings"]] == [0, 1]
    failing = report["failing_step_reading"]
    assert failing["step"] == 2 and failing["tensor_bytes"] > 0 and failing["host_rss_bytes"] > 0
    assert report["summary"]["steps_measured"] == 2
    with open(os.path.join(logger.log_dir, "metrics.csv")) as file:
        rows = [r for r in csv.DictReader(file) if r.get("memory/train/tensor_MiB")]
    assert [int(r["step"]) for r in rows] == [0, 1]


def test_a_failed_batch_size_search_is_not_an_out_of_memory_error_and_leaves_no_report(tmp_path, monkeypatch):
    """The search's verdict "batch size 1 ran out of memory" (a SearchError) read as an out-of-memory error: the tracker
    wrote memkit_oom_rank0.json into log_dir(trainer), without a logger the working directory (a test left one in the
    repository's root). A memkit error is an out-of-memory error only when it is one or was raised from one."""
    from lightning_memkit import MaxBatchSize, MemkitError

    monkeypatch.chdir(tmp_path)  # where the report went: the Trainer's default_root_dir is the working directory
    tracker = MemoryTracker(verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[tracker, MaxBatchSize(budget=30_000, max_val=8, use_estimate=False, verbose=False)],
    )
    with pytest.raises(MemkitError, match="out of memory"):
        trainer.fit(LinearStack())
    assert tracker.oom_report_path is None and os.listdir(tmp_path) == []


def test_misuse_is_refused_with_a_clear_message():
    with pytest.raises(MisconfigurationException, match="every_n_steps=0.*positive integer"):
        MemoryTracker(every_n_steps=0)
    with pytest.raises(MisconfigurationException, match="True, False or 'auto'"):
        MemoryTracker(tensor_accounting="on")
    with pytest.raises(MisconfigurationException, match="cuda_memory_history"):
        MemoryTracker(cuda_memory_history=-1)


# ---------------------------------------------------------------------------- the whole process
@pytest.mark.parametrize(("steps", "every", "expected"), [(12, 5, [4, 9]), (5, 1, [0, 1]), (25, 2, [1, 3, 13, 23])])
def test_the_first_two_logged_steps_get_the_peak(tmp_path, steps, every, expected):
    """A short or sparsely logged run still gets a step-peak line of two points or more: the first two steps Lightning
    logs always get the accountant's peak (with log_every_n_steps=5 the run's always-peaked steps 0 and 1 are not
    logged), then one logged step in tensor_peak_every_n_steps (10)."""
    tracker = MemoryTracker(verbose=False)
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    make_trainer(tmp_path, max_steps=steps, callbacks=[tracker], logger=logger, log_every_n_steps=every).fit(
        LinearStack()
    )
    scalars = read_scalars(logger.log_dir)
    assert [s for s, _ in scalars["memory/train/peak_tensor_MiB"]] == expected
    assert [s for s, _ in scalars["memory/train/tensor_MiB"]] == [s for s in range(steps) if (s + 1) % every == 0]


class _KeepsPerStep(LinearStack):
    """Keeps 65,536 bytes per training step (a float32 tensor of 16,384 elements in a list)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.kept = []

    def training_step(self, batch, batch_idx):
        self.kept.append(torch.zeros(16384))
        return super().training_step(batch, batch_idx)


class _CachesAtBatchStart(Callback):
    """Another callback: caches 4,000 bytes (1,000 float32) at every batch start, measured or not."""

    def __init__(self):
        self.cache = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.cache.append(torch.ones(1000))


@pytest.mark.parametrize("cache_first", [True, False])
def test_memory_kept_outside_the_window_shows_by_its_exact_bytes(tmp_path, cache_first):
    """every_n_steps=2: between two measured steps the module keeps 2 x 65,536 bytes (one of them
    in the unmeasured step) and the other callback 2 x 4,000 (one at the unmeasured step's
    start, one at the measured step's start, before or after the tracker's window opens): the
    process grows by 2 * 65,536 + 2 * 4,000 = 139,072 bytes per measured step, and so does
    tensor_MiB, read back from TensorBoard. Nothing else in these steps outlives them."""
    per_measured_step = 2 * 65_536 + 2 * 4_000
    assert per_measured_step == 139_072
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    tracker, cache = MemoryTracker(every_n_steps=2, log_validation=False, verbose=False), _CachesAtBatchStart()
    callbacks = [cache, tracker] if cache_first else [tracker, cache]
    model = _KeepsPerStep(samples=128)  # 16 batches: no epoch boundary in 10 steps
    make_trainer(tmp_path, max_steps=10, logger=logger, callbacks=callbacks).fit(model)
    assert [r.step for r in tracker.history] == [0, 2, 4, 6, 8]
    growth = [b.tensor_bytes - a.tensor_bytes for a, b in itertools.pairwise(tracker.history)]
    assert growth == [per_measured_step] * 4
    logged = read_scalars(logger.log_dir)["memory/train/tensor_MiB"]
    assert [s for s, _ in logged] == [0, 2, 4, 6, 8]
    # TensorBoard stores float32: the logged values are the readings as float32 holds them
    assert [v for _, v in logged] == [float(numpy.float32(r.tensor_bytes / MiB)) for r in tracker.history]
    assert len(model.kept) == 10 and len(cache.cache) == 10


def test_a_tracker_kept_after_the_fit_holds_no_tensor(tmp_path):
    """The user keeps the tracker (to read tracker.history) and drops the model and the Trainer:
    no tensor of the model's is alive (counted with gc), after a normal fit and after a failed one."""
    import gc
    import weakref

    from lightning_memkit.zoo import DemoTransformer
    from tests.helpers.live_tensors import describe

    for failing in (False, True):
        tracker = MemoryTracker(verbose=False)
        model = _HugeAllocation() if failing else DemoTransformer()
        logger = TensorBoardLogger(str(tmp_path), name=f"tb{failing}")
        trainer = make_trainer(tmp_path, max_steps=3, logger=logger, callbacks=[tracker], limit_val_batches=1)
        if failing:
            with pytest.raises(RuntimeError, match="can't allocate memory"):
                trainer.fit(model)
        else:
            trainer.fit(model)
        model_tensors = [weakref.ref(p) for p in model.parameters()]
        del model, trainer, logger
        gc.collect()
        alive = [r() for r in model_tensors if r() is not None]
        assert alive == [], describe(alive)
        assert tracker.history and tracker._meter is None
        assert not any(isinstance(t, torch.Tensor) for t in gc.get_referents(*gc.get_referents(tracker)))


def test_new_arguments_refuse_misuse_with_a_clear_message():
    with pytest.raises(MisconfigurationException, match="tensor_peak_every_n_steps=0.*positive integer"):
        MemoryTracker(tensor_peak_every_n_steps=0)
    with pytest.raises(MisconfigurationException, match="records_file=3.*path"):
        MemoryTracker(records_file=3)


def test_default_sampling_reads_the_peak_of_the_first_two_training_steps(tmp_path):
    """A short run that Lightning never logs (log_every_n_steps=50 by default) still gets its run peak
    from training steps, not only from validation runs: steps 0 and 1 always get the accountant's
    exact peak, and the summary says on how many training steps the peak was read."""
    model = LinearStack((32, 64, 48, 16), batch_size=8, val_batches=1)
    tracker = MemoryTracker(verbose=False)  # the default tensor_peak_every_n_steps=10
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    make_trainer(
        tmp_path,
        max_steps=6,
        callbacks=[tracker],
        logger=logger,
        log_every_n_steps=50,
        limit_val_batches=1,
        val_check_interval=3,
    ).fit(model)

    train = [r for r in tracker.history if r.stage == "train"]
    assert [r.step for r in train] == list(range(6))
    peaked = [r.step for r in train if r.peak_tensor_bytes is not None]
    assert peaked[:2] == [0, 1], peaked
    summary = tracker.summary
    assert summary.train_steps_with_peak == len(peaked)
    assert summary.peak_stage == "train", (summary.peak_stage, summary.peak_step)
    assert summary.peak_bytes == max(r.peak_tensor_bytes for r in tracker.history if r.peak_tensor_bytes is not None)
    assert summary.peak_bytes > max(r.peak_tensor_bytes for r in tracker.history if r.stage == "validate")


class _KeepsPerStep(LinearStack):
    """Keeps ``kept_elements`` float32 (bytes: 4 each) from every training step in a list: a leak."""

    def __init__(self, kept_elements: int = 16384, **kwargs) -> None:
        super().__init__(**kwargs)
        self.kept_elements = kept_elements
        self.kept: list = []

    def training_step(self, batch, batch_idx):
        self.kept.append(torch.zeros(self.kept_elements))
        return super().training_step(batch, batch_idx)


class _CyclicGarbagePerStep(LinearStack):
    """Drops, every step, a reference cycle holding 64 KiB: garbage, not a leak, alive until collected."""

    def training_step(self, batch, batch_idx):
        cycle: dict = {"tensor": torch.zeros(16384)}
        cycle["self"] = cycle
        return super().training_step(batch, batch_idx)


def test_steady_growth_is_reported_once_with_its_exact_bytes_per_step(tmp_path, recwarn):
    model = _KeepsPerStep(batch_size=8, samples=8 * 12)
    tracker = MemoryTracker(verbose=False)
    make_trainer(tmp_path, max_steps=12, callbacks=[tracker]).fit(model)
    report = tracker.leak_report
    assert report is not None and report.bytes_per_step == 16384 * FLOAT32
    leak_warnings = [w for w in recwarn if "memkit MemoryTracker: memory leak?" in str(w.message)]
    # one epoch: judged when training ends; the floor rose at the end of steps 3..10 (the last
    # step's own reading is not yet a floor), and the end of the epoch freed none of it
    assert len(leak_warnings) == 1 and "(65536 bytes) per measured step, steps 3..10" in str(leak_warnings[0].message)
    assert tracker.summary.extra["leak"]["bytes_per_measured_step"] == 65536
    assert "memory growth" in __import__("lightning_memkit.summary_table", fromlist=["x"]).format_summary(
        tracker.summary
    )


def test_no_leak_is_reported_for_a_steady_model_or_for_garbage_the_collector_has_not_reached(tmp_path):
    steady = MemoryTracker(verbose=False)
    make_trainer(tmp_path, max_steps=12, callbacks=[steady]).fit(LinearStack(batch_size=8, samples=8 * 12))
    assert steady.leak_report is None and "leak" not in steady.summary.extra

    import gc

    garbage = MemoryTracker(verbose=False)
    gc.disable()  # the cycles then stay until the tracker's own confirming collection
    try:
        make_trainer(tmp_path, max_steps=12, callbacks=[garbage]).fit(
            _CyclicGarbagePerStep(batch_size=8, samples=8 * 12)
        )
    finally:
        gc.enable()
    train = [r.tensor_bytes for r in garbage.history if r.stage == "train"]
    assert train[6] - train[2] >= 4 * 65536, train  # it did grow, uncollected, until the tracker looked
    assert garbage.leak_report is None


def test_a_fit_after_an_earlier_one_in_the_same_process_says_once_that_its_readings_count_it(
    tmp_path, capsys, monkeypatch
):
    """A notebook: the second fit's readings count every live tensor of the process, the first model's (still
    referenced) included. The summary says so once per process, not at the first fit, not again at the third."""
    from lightning_memkit import summary_table

    monkeypatch.setattr(summary_table, "_PROCESS", {"fits_ended": 0, "earlier_fit_said": False})
    kept, outputs, trackers = [], [], []
    import gc

    for _ in range(3):
        gc.collect()  # an earlier test's cyclic garbage, freed mid-loop, would move the step-0 readings compared below
        kept.append(LinearStack())  # the notebook keeps each model
        trackers.append(MemoryTracker())
        make_trainer(tmp_path, max_steps=2, callbacks=[trackers[-1]]).fit(kept[-1])
        outputs.append(capsys.readouterr().out)
    assert all("memkit memory summary" in out for out in outputs)
    assert [out.count(summary_table.EARLIER_FIT_NOTE) for out in outputs] == [0, 1, 0]
    # and it is true: the second fit's live tensors at step 0 hold the first model's parameters too
    first_model = sum(p.numel() * p.element_size() for p in kept[0].parameters())
    assert trackers[1].history[0].tensor_bytes - trackers[0].history[0].tensor_bytes >= first_model > 0
