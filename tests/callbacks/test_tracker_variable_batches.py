"""MemoryTracker on batches that change shape: a step whose batch is the largest yet (bytes of its tensors) gets the
accountant's exact peak beside the every-n schedule, so the run peak is the step of the longest padded batch.

The truth is an independent count of the whole process's live CPU tensor storages during each (micro-)batch, made
with ``gc`` and a dispatch mode of the test's own (no memkit code), by two callbacks around the tracker.
"""

from __future__ import annotations

import weakref

import numpy
import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
from torch.utils._pytree import tree_flatten

from lightning_memkit import MemoryTracker
from lightning_memkit.units import MiB
from lightning_memkit.zoo_variable import PaddedTextClassifier
from tests.helpers.event_files import read_scalars
from tests.helpers.live_tensors import live_tensors
from tests.helpers.trainers import make_trainer

#: the every-n rule of ``MemoryTracker()`` (tensor_peak_every_n_steps=10) with log_every_n_steps=1, for 30 steps:
#: the first two steps, then the logged step ten after the last scheduled one (a batch-peaked step does not count)
SCHEDULED_STEPS = {0, 1, 11, 21}


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: on a shared 2-core machine torch's two threads wait on each other, about 3x the wall
    time of these fits (what the tests count, live bytes, does not depend on it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class _ProcessPeak(TorchDispatchMode):
    """Live bytes of every CPU tensor storage of the process while active, and their highest (``peak``), in bytes.

    Starts from ``tensors`` (the process's, found with ``gc``); adds each storage an op returns that it does not
    count yet, follows a counted storage whose size an op changed (``out=`` resizes), and subtracts a storage when
    torch frees it (a ``weakref.finalize`` on it).
    """

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}  # storage's C pointer -> bytes
        self.current = 0
        for tensor in tensors:
            self._count(tensor)
        self.start = self.peak = self.current

    def _count(self, tensor: torch.Tensor) -> None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        if storage.device.type != "cpu":
            return
        key, size = storage._cdata, storage.nbytes()
        if key not in self.sizes:
            weakref.finalize(storage, self._freed, key)
        self.current += size - self.sizes.get(key, 0)
        self.sizes[key] = size

    def _freed(self, key: int) -> None:
        self.current -= self.sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        out = func(*args, **(kwargs or {}))
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                self._count(leaf)
        self.peak = max(self.peak, self.current)
        return out


def _nbytes(batch) -> int:
    """Bytes of the batch's tensors: elements times element size."""
    return sum(t.numel() * t.element_size() for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor))


class _CountFrom(Callback):
    """Before the tracker: at each batch start, a full collection, then every live tensor of the process (``gc``,
    plus the parameters' gradients, which have no Python object until read) and the count's dispatch mode entered
    under the tracker's (so the tracker can leave its own first)."""

    def __init__(self) -> None:
        self.micro_batches: list[tuple[int, int, int]] = []  # (optimizer step, batch bytes, peak bytes) per batch
        self.counting: _ProcessPeak | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.counting = _ProcessPeak(live_tensors("cpu") + grads)
        self.batch = (trainer.global_step, _nbytes(batch))  # the optimizer step it belongs to, its bytes
        self.counting.__enter__()


class _CountTo(Callback):
    """After the tracker: leave the count's dispatch mode once the tracker has left its own, keep the peak."""

    def __init__(self, start: _CountFrom) -> None:
        self.start = start

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        counting, self.start.counting = self.start.counting, None
        assert _get_current_dispatch_mode() is counting  # the tracker's accountant is off the stack
        counting.__exit__(None, None, None)
        self.start.micro_batches.append((*self.start.batch, counting.peak))


def _fit(tmp_path, model, tracker, **trainer_options) -> tuple[_CountFrom, TensorBoardLogger]:
    start = _CountFrom()
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    trainer = make_trainer(tmp_path, logger=logger, callbacks=[start, tracker, _CountTo(start)], **trainer_options)
    trainer.fit(model)
    assert _get_current_dispatch_mode() is None
    return start, logger


def _records(sizes: list[int]) -> set[int]:
    """The indices of the sizes larger than every one before them."""
    found, largest = set(), None
    for index, size in enumerate(sizes):
        if largest is None or size > largest:
            found.add(index)
            largest = size
    return found


def test_run_peak_is_the_step_of_the_largest_batch(tmp_path):
    """Text padded per batch (lengths 16..256, shuffled), 22 steps of batch 4, default ``MemoryTracker()``: the run
    peak is the step of the independent count's highest per-step peak, to the byte, and the accountant ran on the
    every-n steps and the steps of a new largest batch, no other."""
    torch.manual_seed(0)
    model = PaddedTextClassifier(batch_size=4, train_size=120)
    tracker = MemoryTracker(verbose=False)
    count, logger = _fit(tmp_path, model, tracker, max_steps=22)

    steps = [step for step, _, _ in count.micro_batches]
    assert steps == list(range(22))
    sizes = [size for _, size, _ in count.micro_batches]
    truth = {step: peak for step, _, peak in count.micro_batches}
    # the first step of the highest peak, as the run summary keeps it (batches padded to the same length tie)
    top = max(truth, key=truth.get)
    # the case this is about: the every-n rule alone reads less than the highest step, whose batch is the largest yet
    assert max(truth[step] for step in SCHEDULED_STEPS) < truth[top] and top in _records(sizes), (top, sizes)

    # the run peak: the same step, the same bytes, in the summary and in the event file
    assert (tracker.summary.peak_step, tracker.summary.peak_bytes) == (top, truth[top])
    assert tracker.summary.peak_source == "peak_tensor_bytes"
    scalars = read_scalars(logger.log_dir)
    assert scalars["memory/summary/run_peak_step"][-1][1] == top
    assert scalars["memory/summary/run_peak_MiB"][-1][1] == numpy.float32(truth[top] / MiB)  # as the file keeps it

    # the accountant ran on exactly the scheduled steps and those of a new largest batch, each reading exact
    peaked = SCHEDULED_STEPS | _records(sizes)
    assert dict(scalars["memory/train/peak_tensor_MiB"]) == {step: numpy.float32(truth[step] / MiB) for step in peaked}
    assert {r.step: r.peak_tensor_bytes for r in tracker.history if r.peak_tensor_bytes is not None} == {
        step: truth[step] for step in peaked
    }
    assert tracker.summary.train_steps_with_peak == len(peaked)


def test_a_larger_later_micro_batch_switches_the_peak_on_for_the_rest_of_its_step(tmp_path, rerun_in_own_process):
    """``accumulate_grad_batches=2``, the every-n rule reduced to the first two steps: an optimizer step whose
    window opened without the peak gets it when a later micro-batch is the largest batch yet. Its reading is the
    exact peak from that micro-batch to the optimizer step's end; the earlier micro-batch is not counted op by op.
    Both readings are the whole process's: in a fresh process, as a user's run has it (after some earlier tests in
    the same worker the two counts differed by one 4-byte tensor those tests left)."""
    if rerun_in_own_process():
        return
    torch.manual_seed(0)
    model = PaddedTextClassifier(batch_size=4, train_size=120)
    tracker = MemoryTracker(verbose=False, tensor_peak_every_n_steps=1000)
    count, logger = _fit(tmp_path, model, tracker, max_steps=5, accumulate_grad_batches=2)

    micro = count.micro_batches
    assert [step for step, _, _ in micro] == [index // 2 for index in range(10)]
    records = _records([size for _, size, _ in micro])
    # from which micro-batch each peaked step was counted: the first, for a step opened with the peak (one of the
    # first two, or its first micro-batch the largest yet); else its first micro-batch that is the largest yet
    counted_from: dict[int, int] = {}
    for index, (step, _, _) in enumerate(micro):
        if step not in counted_from and (step < 2 or index in records):
            counted_from[step] = index
    switched_later = {step for step, index in counted_from.items() if index % 2}
    assert switched_later - {0, 1}, records  # the case this is about happens in this run
    expected = {
        step: max(peak for index, (s, _, peak) in enumerate(micro) if s == step and index >= start)
        for step, start in counted_from.items()
    }
    assert {r.step: r.peak_tensor_bytes for r in tracker.history if r.peak_tensor_bytes is not None} == expected
    scalars = read_scalars(logger.log_dir)
    assert {step for step, _ in scalars["memory/train/peak_tensor_MiB"]} == set(expected)
    # the run peak: the highest step of the independent count (its larger micro-batch being the counted one)
    truth = {}
    for step, _, peak in micro:
        truth[step] = max(truth.get(step, 0), peak)
    top = max(truth, key=truth.get)
    assert (tracker.summary.peak_step, tracker.summary.peak_bytes) == (top, truth[top])
