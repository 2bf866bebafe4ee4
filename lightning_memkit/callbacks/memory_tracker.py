"""MemoryTracker: per-step memory in every Lightning logger, wired from MemoryMeter.

The callback decides *when* (which steps, which hooks, which ranks) and *where* (loggers,
history, checkpoints, OOM report); measuring is MemoryMeter's job.
"""

from __future__ import annotations

import collections
import gc
import os
import weakref
from typing import Any, Literal, Sequence

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_memkit._lightning_compat import forget_model_logging, log_dir, logging_step, optimizer_steps_after_batch
from lightning_memkit.callbacks import _checks as checks
from lightning_memkit.callbacks._files import logging_loggers, run_files_dir
from lightning_memkit.compiled import COMPILED_CHOICES, NOT_SEEN_COMPILED, compiled_parts
from lightning_memkit.distributed import ReadingReducer
from lightning_memkit.doctor.leaks import LeakReport, LeakWatcher
from lightning_memkit.estimate.worst_batch import batch_nbytes
from lightning_memkit.meter import MemoryMeter
from lightning_memkit.oom import is_out_of_memory, write_oom_report
from lightning_memkit.probes.base import MemoryProbe
from lightning_memkit.probes.cuda import dump_memory_snapshot, start_memory_history, stop_memory_history
from lightning_memkit.records import RECORDS_FILENAME, RunSummary, StepReading, write_records
from lightning_memkit.summary_table import format_summary
from lightning_memkit.tensorboard.tags import DEFAULT_PREFIX, step_metrics, summary_metrics
from lightning_memkit.units import format_bytes

#: how many measured training steps at the start of a run always get the accountant's exact peak
_ALWAYS_PEAKED_STEPS = 2
# fits a MemoryTracker saw end in this process, and whether the note on an earlier fit's tensors was printed (once)
_PROCESS = {"fits_ended": 0, "earlier_fit_said": False}
#: the note printed (once per process, with the summary) when an earlier fit ran in the same process (a notebook)
EARLIER_FIT_NOTE = ("memkit MemoryTracker: an earlier fit ran in this process. The readings count every live tensor of the "
                    "process (on CUDA, everything allocated on the device), so tensors an earlier fit left alive (a model, "
                    "trainer or outputs still referenced, e.g. in a notebook) are in them; delete those references (and run "
                    "gc.collect()) before fit to read this run's memory alone.")

__all__ = ["MemoryTracker"]


class MemoryTracker(Callback):
    r"""Log each training step's memory to every logger: allocated, reserved, peaks, fragmentation.

    Usage::

        from lightning_memkit import MemoryTracker
        trainer = Trainer(callbacks=[MemoryTracker()])
        trainer.fit(model)              # then: tensorboard --logdir lightning_logs

    Logged keys (training steps under ``memory/train/``, validation runs under ``memory/val/``,
    at the same step axis as your own ``self.log`` metrics). Every ``_MiB`` value is bytes/2**20.
    A key appears only where its source exists (CUDA keys on CUDA, ``tensor`` keys when the
    accountant is on):

    ============================  =====  ==================================================
    key (after ``memory/train/``)  unit   meaning
    ============================  =====  ==================================================
    ``allocated_MiB``             MiB    CUDA: live tensor memory at step end
    ``peak_allocated_MiB``        MiB    CUDA: highest allocated during the step (reset each step)
    ``reserved_MiB``              MiB    CUDA: memory the caching allocator holds at step end
    ``peak_reserved_MiB``         MiB    CUDA: highest reserved during the step
    ``active_MiB``                MiB    CUDA: active blocks (allocated + rounding)
    ``fragmentation_MiB``         MiB    CUDA: inactive split blocks (reserved, free, unusable for big requests)
    ``alloc_retries``             count  CUDA: cumulative cudaMalloc retries after flushing the cache
    ``ooms``                      count  CUDA: cumulative out-of-memory errors
    ``device_used_MiB``           MiB    NVML: device memory used by all processes
    ``device_total_MiB``          MiB    NVML: device capacity
    ``process_device_MiB``        MiB    NVML: this process's device memory (context, libraries included)
    ``host_rss_MiB``              MiB    host: process resident set size at step end
    ``host_peak_rss_MiB``         MiB    host: peak RSS during the step (Linux; see docs for fallback)
    ``tensor_MiB``                MiB    accountant: every live tensor of the process at step end (exact)
    ``peak_tensor_MiB``           MiB    accountant: its highest during the step (exact; sampled steps)
    ============================  =====  ==================================================

    ``tensor_MiB`` / ``peak_tensor_MiB`` count every live tensor storage of the process on the
    measured device, whoever made it (a callback, the steps between measured ones, set-up), as
    CUDA's ``allocated`` does; ``peak_tensor_MiB`` appears on the steps the accountant measured (the
    sampled steps: ``tensor_peak_every_n_steps``, and each step whose batch is the largest yet).

    Where the readings go: into Lightning's own ``log_metrics`` call for the same step (the one
    that writes your ``self.log`` metrics and ``epoch``), so a CSV row holds both; validation
    readings go in the validation row. With ``every_n_steps=1`` the loggers get the steps
    Lightning logs (``log_every_n_steps``; memkit writes its own row, with ``epoch``, at such a
    step when you log nothing); with ``every_n_steps > 1`` every measured step, in its own row
    when Lightning writes none then. Every reading is in :attr:`history`.
    At fit end ``memory/summary/run_peak_MiB``, ``run_peak_step``, ``capacity_MiB`` and
    ``run_peak_fraction`` are logged and a summary table is printed.

    Args:
        every_n_steps: measure every n-th optimizer step (1 = every step). Steps in
            between run with no probe active. With gradient accumulation one reading covers
            all micro-batches of an optimizer step.
        log_validation: also measure each validation run (one reading per run, ``memory/val/``).
        tensor_accounting: read the exact tensor accountant. ``"auto"`` (default) turns it on
            where there are no allocator counters (CPU and other non-CUDA devices).
        tensor_peak_every_n_steps: the accountant's exact per-step peak (``peak_tensor_MiB``)
            costs a Python call per aten op during the step (1.10x on a 20 ms CPU step); it runs
            on the run's first two measured training steps (no optimizer state yet, then all of
            it) and, with ``every_n_steps=1``, on the first two steps Lightning logs, then on at
            most one step in this many (default 10), only on steps whose readings
            the loggers will get: with ``every_n_steps=1``, steps Lightning writes
            (``log_every_n_steps``); else every n-th measured step. 1 = every such step.
            Besides these, a measured step whose batch is larger, in bytes of its tensors, than
            every batch of the measured steps before it in this fit gets the peak too, logged by
            Lightning or not, so the run peak is the longest padded batch's step (batches that
            change shape); with gradient accumulation a larger later micro-batch switches the
            accountant on for the rest of its optimizer step. A step whose peak is higher for
            another reason than its batch's bytes can still be missed. The
            summary says on how many training steps the peak was read.
            ``tensor_MiB`` (live bytes at step end) is read every measured step at a cost of
            tens of microseconds. Validation runs always get their peak. See docs/memory_tracker.md.
        nvml: read NVML on CUDA devices.
        host: read host RSS and per-step peak RSS.
        per_rank: under DDP also log each rank's values (``memory/train/rank{r}/...``);
            the unprefixed keys are always the maximum over ranks.
        cuda_memory_history: on CUDA, record allocator history with this many entries so an
            out-of-memory error leaves a ``torch.cuda.memory._dump_snapshot`` file (0 = off).
        cuda_memory_stacks: the stacks that history records: ``"python"`` (default: Python frames,
            so writing the snapshot after an out-of-memory error takes seconds) or ``"all"`` (C++
            frames too, torch's own default: symbolizing them can take minutes on a large job, long
            enough for other DDP ranks to time out).
        oom_dir: where the OOM report goes; default: the first logger's log dir, else the
            trainer's ``default_root_dir``.
        max_history: readings kept in :attr:`history` (and checkpoints); older ones are
            dropped, the run summary is unaffected.
        records_file: where the readings are written at fit end for ``memkit report``. ``None``
            (default): ``<log_dir>/memkit_memory.json`` in the first logger's directory when the
            Trainer has a logger, and no file without a logger (``logger=False``, or ``fast_dev_run``,
            which switches the loggers off; the readings stay on :attr:`history`; :meth:`save_records`
            writes them). A path (a file, or an existing
            directory) writes there. An existing file is never overwritten: the name gets
            ``-v1``, ``-v2``... as Lightning's checkpoints do.
        prefix: the first part of every logged key. Several MemoryTrackers in one Trainer (say,
            one measuring every step and one with ``every_n_steps=100``) need different prefixes:
            the prefix also names the tracker's checkpoint state.
        extra_probes: your own :class:`~lightning_memkit.probes.MemoryProbe` instances, read
            with the built-in ones every measured step (a failing probe warns once and is
            switched off; training continues).
        verbose: print the summary table at fit end (global rank zero only).
        detect_leaks: watch the live bytes at the end of each measured training step (every live
            tensor of the process: CUDA's allocated bytes, or the CPU reading); when their floor (the
            least bytes from a step on) rose ``leak_window`` times and is still rising, judged when an
            epoch ends and when training ends (after the epoch-end hooks, so a list cleared at each
            epoch's end is never a leak, and growth every few steps is one), and still after one full
            ``gc.collect()`` (so garbage the collector has not reached yet is never called a leak),
            warn once with the bytes per measured step, and keep it in :attr:`leak_report` and the
            summary. The rule is the doctor's (:func:`lightning_memkit.doctor.leaks.rising_floor`).
            ``MemoryDoctor`` / ``memkit doctor`` then name who made the memory and who holds it.
        leak_window: how many rises of the floor make a leak (>= 2).
        compiled: what to do when the model (or a submodule, or its ``training_step``) is ``torch.compile``d.
            ``"keep"`` (default): the steps stay compiled; ``peak_tensor_MiB`` is then read from the CPU
            allocator's own events (torch's profiler with ``profile_memory``; it keeps compile on), and
            ``tensor_MiB`` as always. ``"eager"``: the peak-measured steps run eagerly under the accountant
            (the eager program's peak, not the compiled one's). CUDA's counters are the compiled program's
            either way. The summary says which. See docs/compile.md.

    Attributes:
        history: the logged readings, oldest first (under DDP the max over ranks, ``rank=-1``).
        summary: the run's :class:`~lightning_memkit.records.RunSummary`.
        oom_report_path: the path of the OOM report, if one was written.
        leak_report: the :class:`~lightning_memkit.doctor.LeakReport` of steady growth, once
            found (``detect_leaks``), else ``None``.
        records_path: the ``memkit_memory.json`` written at fit end (summary and history),
            which ``memkit report`` reads (``memkit_memory_<prefix>.json`` for a prefix other
            than the default), or ``None`` when none was written. A fit that raises (an error in
            your step, an out-of-memory error, Ctrl-C) writes it too, with the readings up to the
            failure and ``summary.extra["ended_by"]`` naming the exception.
    """

    #: ActivationCheckpointing moves itself ahead of callbacks that open a step window.
    memkit_opens_step_window = True

    def __init__(
        self,
        every_n_steps: int = 1,
        log_validation: bool = True,
        tensor_accounting: bool | Literal["auto"] = "auto",
        nvml: bool = True,
        host: bool = True,
        per_rank: bool = False,
        cuda_memory_history: int = 0,
        oom_dir: str | os.PathLike | None = None,
        max_history: int = 10_000,
        prefix: str = DEFAULT_PREFIX,
        verbose: bool = True,
        extra_probes: Sequence[MemoryProbe] = (),
        tensor_peak_every_n_steps: int = 10,
        records_file: str | os.PathLike | None = None,
        detect_leaks: bool = True,
        leak_window: int = 5,
        cuda_memory_stacks: Literal["python", "all"] = "python",
        compiled: Literal["keep", "eager"] = "keep",
    ) -> None:
        owner = "MemoryTracker"
        self.every_n_steps = checks.integer(owner, "every_n_steps", every_n_steps, 1, "a positive integer, e.g. 1 to log every step")
        self.log_validation = checks.boolean(owner, "log_validation", log_validation)
        self.tensor_accounting = checks.choice(owner, "tensor_accounting", tensor_accounting, (True, False, "auto"), "True, False or 'auto'")
        self.nvml = checks.boolean(owner, "nvml", nvml)
        self.host = checks.boolean(owner, "host", host)
        self.per_rank = checks.boolean(owner, "per_rank", per_rank)
        self.cuda_memory_history = checks.integer(owner, "cuda_memory_history", cuda_memory_history, 0,
                                                  "0 (off) or a number of entries, e.g. 100000")
        self.cuda_memory_stacks = checks.choice(owner, "cuda_memory_stacks", cuda_memory_stacks, ("python", "all"),
                                                "'python' (Python frames only: a fast snapshot) or 'all' (C++ frames too)")
        self.oom_dir = checks.path(owner, "oom_dir", oom_dir, "a directory path (str), or None for the logger's log dir")
        self.max_history = checks.integer(owner, "max_history", max_history, 1, "a positive integer (readings kept)")
        self.prefix = checks.text(owner, "prefix", prefix, "a non-empty str, e.g. 'memory'")
        self.verbose = checks.boolean(owner, "verbose", verbose)
        if isinstance(extra_probes, (str, bytes)) or not hasattr(extra_probes, "__iter__") or not all(isinstance(p, MemoryProbe) for p in extra_probes):
            raise checks.refuse(owner, "extra_probes", extra_probes, "a list of MemoryProbe instances")
        self.compiled = checks.choice(owner, "compiled", compiled, COMPILED_CHOICES,
                                      "'keep' (measure the compiled steps as they run) or 'eager' (run the peak-measured steps eagerly for the accountant's breakdown)")
        self.extra_probes = list(extra_probes)
        self.tensor_peak_every_n_steps = checks.integer(owner, "tensor_peak_every_n_steps", tensor_peak_every_n_steps, 1,
                                                        "a positive integer, e.g. 1 for the exact peak of every logged step")
        self.records_file = checks.path(owner, "records_file", records_file, "a path (str), or None for the logger's log dir")
        self.detect_leaks = checks.boolean(owner, "detect_leaks", detect_leaks)
        leak_window = checks.integer(owner, "leak_window", leak_window, 2,
                                     "an integer >= 2 (rises of the memory's floor that make a leak)")
        self.history: collections.deque[StepReading] = collections.deque(maxlen=max_history)
        self.summary = RunSummary()
        self.oom_report_path: str | None = None
        self.records_path: str | None = None
        self._meter: MemoryMeter | None = None
        self._reducer: ReadingReducer | None = None
        self._history_recording = False
        self._validation_window = False
        self._last_peak_step: int | None = None
        self._peak_steps_taken = 0
        self._logged_peak_steps = 0  # peaked steps whose readings the loggers got (every_n_steps=1)
        # the largest batch (bytes of its tensors) of the measured steps so far in this fit: a larger one gets the peak
        self._largest_batch_bytes: int | None = None
        # whether the open training window reads the accountant's peak, and whether it was switched on at a
        # later micro-batch of the window (then this callback, not the meter, activates it at each micro-batch)
        self._window_peaked = False
        self._peaked_from_micro_batch = False
        # a reading waiting for Lightning's own log_metrics call at its step: (step, metrics, loggers still to get it)
        self._pending: tuple[int, dict[str, float], list, str] | None = None
        self._wrapped_loggers: list[tuple[Any, Any]] = []
        self._records_written: set[str] = set()
        self.leak_report: LeakReport | None = None
        self._leaks = LeakWatcher(window=leak_window, warmup_steps=2)
        self._last_train_reading: StepReading | None = None
        self._gradient_bytes_at_last = 0
        self._epoch_end_bytes: int | None = None

    # ------------------------------------------------------------------ set-up
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._meter is not None:
            return
        if stage == "fit" and trainer.global_step == 0:
            # A new run (the same tracker given to a second Trainer): its readings and summary start
            # empty. A resumed run gets its history back from the checkpoint right after set-up.
            self.history.clear()
            self.summary = RunSummary()
            self.records_path = self.oom_report_path = None
            self.leak_report = None
            self._leaks.reset()
            self._last_train_reading = self._epoch_end_bytes = None
        self.summary.extra.pop("ended_by", None)  # a fit resumed after a failure goes on
        self._last_peak_step = None
        self._peak_steps_taken = 0
        self._logged_peak_steps = 0
        self._largest_batch_bytes = None  # "larger than every batch before" is per fit
        self._window_peaked = self._peaked_from_micro_batch = False
        self._pending = None
        self._wrap_loggers(trainer)
        device = trainer.strategy.root_device
        self._meter = MemoryMeter(
            device, tensor_accounting=self.tensor_accounting, nvml=self.nvml, host=self.host, extra_probes=self.extra_probes
        )
        self._reducer = ReadingReducer()
        self.summary.device = str(device)
        try:
            self.summary.capacity_bytes = self._meter.capacity_bytes()
        except Exception:
            self.summary.capacity_bytes = None
        if self.cuda_memory_history and device.type == "cuda":
            self._history_recording = start_memory_history(self.cuda_memory_history, stacks=self.cuda_memory_stacks)
            if not self._history_recording:
                rank_zero_warn("memkit: this torch cannot record CUDA memory history; OOM reports will have no snapshot.")

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._release()
        forget_model_logging(self)  # kept to read its records, it must not keep the model

    def _release(self) -> None:
        """Drop everything the run needed (probes, the accountant, the process hook): a tracker
        kept after the fit holds its readings, never a tensor."""
        if self._meter is not None:
            self._meter.shutdown()
            self._meter = None
        if self._reducer is not None:
            self._reducer.close()  # its gloo group: a job of many fits must not accumulate them
        self._reducer = None
        self._pending = None
        self._unwrap_loggers()
        if self._history_recording:
            stop_memory_history()
            self._history_recording = False

    # ------------------------------------------------------------------ training steps
    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        meter = self._meter
        if meter is None:
            return
        if not meter.is_open:
            self._flush_pending(trainer)
            step = logging_step(trainer)
            if step % self.every_n_steps:
                return
            peak = self._peak_this_step(trainer, step)
            if peak:
                # the every-n schedule counts only its own steps: a step peaked for its batch does not move it
                self._last_peak_step = step
                self._peak_steps_taken += 1
                every = trainer.log_every_n_steps if trainer.loggers else 0
                self._logged_peak_steps += bool(every) and (step + 1) % every == 0
            # a batch larger than any before is where the run peak most likely is: its step pays the accountant
            # too, logged by Lightning or not (the run summary reads every measured step)
            larger = self._largest_batch_yet(meter, batch)
            self._window_peaked = peak or larger
            self._peaked_from_micro_batch = False
            meter.open(step, "train", trainer.global_rank, tensor_peak=self._window_peaked)
        elif self._largest_batch_yet(meter, batch) and not self._window_peaked:
            # gradient accumulation: a later micro-batch of an optimizer step that read no peak is the largest
            # batch yet. The accountant is switched on from here to the window's close, after a sweep (a window
            # opened without the peak did not sweep; this micro-batch's tensors were made since): the step's
            # peak is then exact from this micro-batch on, the earlier micro-batches' part of it not counted
            # op by op.
            self._window_peaked = self._peaked_from_micro_batch = True
            meter.tensor_probe.sweep()
        if self._peaked_from_micro_batch:
            # the meter opened this window without the peak, so its resume() would only adopt the gradients
            meter.tensor_probe.start(_gradients(pl_module))
        else:
            meter.resume(_gradients(pl_module))

    def _largest_batch_yet(self, meter: MemoryMeter, batch: Any) -> bool:
        """Whether ``batch`` (a measured step's batch or micro-batch) is larger, in bytes of its tensors, than every
        one measured before in this fit; it becomes the one to beat. Only where the accountant measures: CUDA's peak
        is read every step anyway."""
        if meter.tensor_probe is None:
            return False
        size = batch_nbytes(batch)
        if self._largest_batch_bytes is not None and size <= self._largest_batch_bytes:
            return False
        self._largest_batch_bytes = size
        return True

    def _peak_this_step(self, trainer: Trainer, step: int) -> bool:
        """Whether the accountant runs during this step (see ``tensor_peak_every_n_steps``)."""
        n = self.tensor_peak_every_n_steps
        if self._peak_steps_taken < _ALWAYS_PEAKED_STEPS:
            # A run's first measured steps always get the peak, logged or not: step 0 (no optimizer
            # state yet) and the first step with all of it, so the run peak covers training even when
            # Lightning logs no step of a short run (log_every_n_steps defaults to 50).
            return True
        if self.every_n_steps == 1 and trainer.loggers:
            # only steps Lightning writes, at most one in n
            every = trainer.log_every_n_steps
            if not every or (step + 1) % every:
                return False
            # the first two logged steps always get it, so the step-peak line has two points even in a
            # short or sparsely logged run (12 steps, log_every_n_steps=5: steps 4 and 9)
            return self._logged_peak_steps < _ALWAYS_PEAKED_STEPS or self._last_peak_step is None \
                or step - self._last_peak_step >= n or step < self._last_peak_step
        return step % (self.every_n_steps * n) == 0

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        meter = self._meter
        if meter is None or not meter.is_open:
            return
        meter.pause()
        if optimizer_steps_after_batch(trainer):
            self._window_peaked = self._peaked_from_micro_batch = False
            self._log(trainer, meter.close(), pl_module)

    # ------------------------------------------------------------------ validation runs
    def _validating(self, trainer: Trainer) -> bool:
        return self.log_validation and self._meter is not None and not trainer.sanity_checking

    @override
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._validation_window = self._validating(trainer)
        if self._validation_window:
            if self._meter.is_open:
                # a validation run inside an accumulation window (val_check_interval inside an optimizer
                # step): the training window is set aside, not closed (that would log a partial step),
                # and taken back after the run, its peak without the validation's memory
                self._meter.set_aside()
            self._meter.open(logging_step(trainer), "validate", trainer.global_rank, tensor_peak=True)

    @override
    def on_validation_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if self._validation_window and self._meter is not None:
            self._meter.resume(_gradients(pl_module))

    @override
    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if self._validation_window and self._meter is not None:
            self._meter.pause()

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._validation_window and self._meter is not None and self._meter.is_open:
            self._log(trainer, self._meter.close(), pl_module)
            if self.records_path is not None and trainer.is_global_zero and trainer.state.fn == "validate":
                # trainer.validate() after fit: the records written at fit end get this reading too, as .history has
                self.records_path = self.save_records(self.records_path)
        if self._meter is not None and self._meter.has_window_aside:
            self._meter.take_back()
        self._validation_window = False

    # ------------------------------------------------------------------ logging
    def _log(self, trainer: Trainer, reading: StepReading, pl_module: LightningModule) -> None:
        logged, ranks = self._reducer.reduce(reading, self.per_rank) if self._reducer else (reading, [])
        self.history.append(logged)
        self.summary.update(logged)
        if self.detect_leaks and logged.stage == "train" and self.leak_report is None:
            self._watch_for_leaks(trainer, logged)
        if not trainer.loggers:
            return
        metrics = step_metrics(logged, self.prefix)
        for rank_reading in ranks:
            metrics.update(step_metrics(rank_reading, self.prefix, rank=rank_reading.rank))
        # Lightning's own log_metrics call for this step (its logger connector's, which carries the
        # epoch) gets these values too, so they land in the same row as the user's metrics; if
        # Lightning writes nothing at this step, _flush_pending decides at the next hook.
        self._flush_pending(trainer)
        self._pending = (logged.step, metrics, list(trainer.loggers), logged.stage)

    def _flush_pending(self, trainer: Trainer) -> None:
        """Write a reading Lightning's own logging did not take: always for a validation run or
        with ``every_n_steps > 1``; with ``every_n_steps=1`` only at Lightning's logging steps
        (``log_every_n_steps``), where it wrote nothing itself because nothing else was logged."""
        pending, self._pending = self._pending, None
        if pending is None or not pending[2]:
            return
        step, metrics, loggers, stage = pending
        if stage == "train" and self.every_n_steps == 1:
            every = trainer.log_every_n_steps
            if not every or (step + 1) % every:
                return  # Lightning does not log this step: the reading stays in history only
        row = dict(metrics, epoch=trainer.current_epoch)  # an int, as in the rows Lightning writes itself
        for logger in loggers:
            logger.log_metrics(row, step=step)

    def _wrap_loggers(self, trainer: Trainer) -> None:
        """Let each logger's ``log_metrics`` add the pending reading to Lightning's own call for
        the same step (the one with ``epoch`` in it, from Lightning's logger connector)."""
        self._unwrap_loggers()
        reference = weakref.ref(self)
        for logger in trainer.loggers:
            original = logger.log_metrics

            def log_metrics(metrics, step=None, *args, _original=original, _logger=logger, **kwargs):
                tracker = reference()
                pending = tracker._pending if tracker is not None else None
                if pending is not None and step == pending[0] and "epoch" in metrics and _logger in pending[2]:
                    pending[2].remove(_logger)
                    metrics = {**metrics, **pending[1]}
                    if not pending[2]:
                        tracker._pending = None
                return _original(metrics, step, *args, **kwargs)

            logger.log_metrics = log_metrics
            self._wrapped_loggers.append((logger, log_metrics))

    def _unwrap_loggers(self) -> None:
        for logger, wrapper in self._wrapped_loggers:
            if vars(logger).get("log_metrics") is wrapper:
                del logger.log_metrics  # the class's own method again
        self._wrapped_loggers = []

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._flush_pending(trainer)  # after Lightning's own validation logging

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._flush_pending(trainer)
        self._note_epoch_end(trainer)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from lightning_memkit.tensorboard.dashboard import register_dashboard  # memkit's TensorBoard dashboard, once per run

        register_dashboard(trainer)
        self._note_compiled(pl_module)

    def _note_compiled(self, pl_module: LightningModule) -> None:
        """A compiled model (found after ``configure_model``): measure it without switching compile off, and say so once."""
        self.summary.extra.pop("compiled", None)
        parts = compiled_parts(pl_module)
        if not parts or self._meter is None:
            return
        self._meter.compiled = self.compiled
        if self._meter.tensor_probe is None:
            how = "CUDA allocator counters (the compiled program's)"
        elif self.compiled == "keep":
            how = f"peak_tensor from the allocator's events, steps kept compiled; {NOT_SEEN_COMPILED}"
        else:
            how = "peak_tensor by the accountant: the peak-measured steps run EAGERLY (compiled='eager'), so their peak is the eager program's"
        self.summary.extra["compiled"] = {"parts": parts, "measured": how}
        rank_zero_info(f"memkit MemoryTracker: compiled model ({', '.join(parts)}): {how}")

    def _watch_for_leaks(self, trainer: Trainer, reading: StepReading) -> None:
        live = reading.allocated_bytes if reading.allocated_bytes is not None else reading.tensor_bytes
        if live is None:
            return
        self._last_train_reading = reading
        found = self._leaks.observe(reading.step, live, epoch=trainer.current_epoch)
        if found is None:
            return
        # Confirm before warning: tensors in reference cycles stay alive until the collector reaches
        # them, which can look like growth for a few steps. One full collection (rare: only here).
        gc.collect()
        now = self._live_bytes_now(reading)
        # Under DDP the readings are the maximum over ranks and `now` is this rank's: not comparable.
        if not (self._reducer is not None and self._reducer.enabled) and now is not None and not _still_grown(found, now):
            self._leaks.reset()  # it was garbage; keep watching
            self._leaks.warmup_steps = 0
            return
        self._report_leak(found)

    def _note_epoch_end(self, trainer: Trainer) -> None:
        """The live bytes when the epoch's steps are done, before the epoch-end hooks of the module."""
        reading = self._last_train_reading
        if self.detect_leaks and self.leak_report is None and reading is not None and self._meter is not None:
            self._epoch_end_bytes = self._live_bytes_now(reading)
            self._gradient_bytes_at_last = _gradient_bytes(trainer.lightning_module)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # The run ended, after the last epoch's end: judge every measured step; what the epoch-end
        # hooks and the end of training freed (after one full collection) must not undo the growth,
        # so memory freed at each epoch's end (a list of the epoch's losses) is never called a leak.
        reading, ended = self._last_train_reading, self._epoch_end_bytes
        self._last_train_reading = self._epoch_end_bytes = None
        if not self.detect_leaks or self.leak_report is not None or reading is None or self._meter is None:
            return
        gc.collect()
        now = self._live_bytes_now(reading)
        freed = None
        if now is not None and ended is not None:
            # both this rank's own measures (comparable under DDP too); gradients Lightning dropped
            # after the last step are not memory the run let go of
            freed = ended - now - max(0, self._gradient_bytes_at_last - _gradient_bytes(pl_module))
        # under DDP the readings are the maximum over ranks: `now` (this rank's) is not comparable to them
        distributed = self._reducer is not None and self._reducer.enabled
        found = self._leaks.finish(None if distributed else now, step=reading.step, freed_at_end=freed)
        if found is not None:
            self._report_leak(found)

    def _report_leak(self, found: LeakReport) -> None:
        self.leak_report = found
        self.summary.extra["leak"] = {"bytes_per_measured_step": found.bytes_per_step, "first_step": found.first_step,
                                      "last_step": found.last_step, "every_n_steps": self.every_n_steps}
        every = "" if self.every_n_steps == 1 else f" (a measured step is every {self.every_n_steps} steps)"
        rank_zero_warn(f"memkit MemoryTracker: memory leak? the floor of live tensor memory at the end of the measured steps grows by "
                       f"{format_bytes(found.bytes_per_step)} ({found.bytes_per_step} bytes) per measured step, steps "
                       f"{found.first_step}..{found.last_step}{every}, and was not freed at the epoch's end: a "
                       "leak that ends in an out-of-memory error. MemoryDoctor() or `memkit doctor` names the code that keeps it, and who holds it.")

    def _live_bytes_now(self, reading: StepReading) -> int | None:
        """The live bytes now, measured as ``reading`` was (CUDA's allocated bytes, or the CPU accountant)."""
        if reading.allocated_bytes is not None:
            return torch.cuda.memory_allocated(self._meter.device) if self._meter is not None else None
        probe = self._meter.tensor_probe if self._meter is not None else None
        if probe is None:
            return None
        probe.sweep()
        return probe.accountant.current_bytes

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._flush_pending(trainer)
        if self.summary.peak_bytes is None:
            return
        for callback in trainer.callbacks:  # MaxBatchSize: its trial peak beside the run peak, with what each counts
            note = getattr(callback, "summary_note", None)
            text = note() if callable(note) else None
            if isinstance(text, str):
                self.summary.extra["batch_search"] = text
        metrics = summary_metrics(self.summary, self.prefix)
        step = logging_step(trainer)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
            logger.save()
        if trainer.is_global_zero:
            target = self._records_target(trainer)
            if target is not None:
                self.records_path = self.save_records(target)
            if self.verbose:
                print(format_summary(self.summary, list(self.history)))
                print(self._where_readings_went(trainer))
                if _PROCESS["fits_ended"] and not _PROCESS["earlier_fit_said"]:
                    _PROCESS["earlier_fit_said"] = True
                    print(EARLIER_FIT_NOTE)
            _PROCESS["fits_ended"] += 1
            from lightning_memkit.tensorboard.dashboard import log_memory_summary  # summary table + figure in TensorBoard

            log_memory_summary(trainer, self.summary, list(self.history), step, self.prefix)

    def _where_readings_went(self, trainer: Trainer) -> str:
        """One line under the printed summary: where a user finds the per-step readings of this run."""
        places = [type(logger).__name__ for logger in logging_loggers(trainer)]
        if not places:
            where = "no logger, so nothing was logged"
        elif self.every_n_steps == 1 and not trainer.log_every_n_steps:
            where = f"{', '.join(places)}: the summary only (log_every_n_steps=0: Lightning logs no step)"
        elif self.every_n_steps == 1:
            where = f"{', '.join(places)} at the steps Lightning logs (log_every_n_steps={trainer.log_every_n_steps})"
        else:
            where = ", ".join(places)
        file = self.records_path or "no file (MemoryTracker(records_file=...) or .save_records(path) writes one)"
        return f"memkit readings: {where}; every measured step on this tracker's .history; records: {file}"

    # ------------------------------------------------------------------ records
    def _records_name(self) -> str:
        # a second tracker (its own prefix) writes beside the default one instead of over it
        return RECORDS_FILENAME if self.prefix == DEFAULT_PREFIX else RECORDS_FILENAME.replace(".json", f"_{_file_safe(self.prefix)}.json")

    def _records_target(self, trainer: Trainer) -> str | None:
        if self.records_file is not None:
            return self.records_file
        directory = run_files_dir(trainer)
        if directory is None:
            return None  # no logger (or fast_dev_run's stand-in): nothing written into the working directory unless asked
        return os.path.join(directory, self._records_name())

    def save_records(self, path: str) -> str:
        """Write :attr:`summary` and :attr:`history` as JSON (what ``memkit report`` reads) to
        ``path`` (a file, or an existing directory: ``memkit_memory.json`` in it); returns the path
        written. An existing file this tracker did not write in this run is kept: the new name gets
        ``-v1``, ``-v2``... (as Lightning's ModelCheckpoint does)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, self._records_name())
        stem, extension = os.path.splitext(path)
        candidate, version = path, 0
        while os.path.exists(candidate) and candidate not in self._records_written:
            version += 1
            candidate = f"{stem}-v{version}{extension}"
        written = write_records(candidate, self.summary, list(self.history))
        self._records_written.add(written)
        return written

    # ------------------------------------------------------------------ failures
    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        meter = self._meter
        reading = None
        if meter is not None:
            meter.pause()  # never leave the dispatch mode on the stack after a failure
            if meter.is_open:
                reading = meter.close()
        if is_out_of_memory(exception):
            self._write_oom_report(trainer, exception, reading)
        try:
            self._flush_pending(trainer)
        except Exception:
            pass
        for logger in trainer.loggers:
            try:
                logger.save()
            except Exception:
                pass
        self._save_records_after_failure(trainer, exception)
        self._release()
        forget_model_logging(self)  # kept to read its records, it must not keep the model

    def _save_records_after_failure(self, trainer: Trainer, exception: BaseException) -> None:
        """Nothing is lost: the readings up to the failure go where fit end would have put them
        (``memkit report`` reads exact bytes, not the float32 MiB of the event files, and a CSV-only
        run has no event files), with ``summary.extra["ended_by"]`` saying how the fit ended."""
        if not trainer.is_global_zero or self.summary.peak_bytes is None:
            return
        message = str(exception)
        self.summary.extra["ended_by"] = (f"{type(exception).__name__}: {message}" if message else type(exception).__name__)[:500]
        try:
            target = self._records_target(trainer)
            if target is not None:
                self.records_path = self.save_records(target)
        except Exception as error:  # never mask the user's exception
            rank_zero_warn(f"memkit MemoryTracker: the readings could not be written after the failure ({type(error).__name__}: {error}); "
                           "they are on this tracker's .history")

    def _write_oom_report(self, trainer: Trainer, exception: BaseException, reading: StepReading | None) -> None:
        directory = self.oom_dir or log_dir(trainer)
        stem = os.path.join(directory, f"memkit_oom_rank{trainer.global_rank}")
        snapshot = None
        if self._history_recording and dump_memory_snapshot(stem + ".pickle"):
            snapshot = stem + ".pickle"
        payload = {
            "step": logging_step(trainer),
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "rank": trainer.global_rank,
            "device": self.summary.device,
            "capacity_bytes": self.summary.capacity_bytes,
            "failing_step_reading": reading.to_dict() if reading else None,
            "last_readings": [r.to_dict() for r in list(self.history)[-10:]],
            "summary": self.summary.to_dict(),
            "cuda_snapshot": snapshot,
        }
        try:
            self.oom_report_path = write_oom_report(stem + ".json", payload, exception)
            rank_zero_warn(f"memkit: out of memory at step {payload['step']}; report written to {self.oom_report_path}")
        except OSError as error:
            rank_zero_warn(f"memkit: out of memory, and the report could not be written to {directory}: {error}")

    # ------------------------------------------------------------------ checkpoints
    @property
    @override
    def state_key(self) -> str:
        # One state per prefix, so several trackers (different prefixes) can share a Trainer and its
        # checkpoints; Lightning falls back to the class name for checkpoints written before.
        return self._generate_state_key(prefix=self.prefix)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"history": [r.to_dict() for r in self.history], "summary": self.summary.to_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history.clear()
        self.history.extend(StepReading.from_dict(r) for r in state_dict.get("history", []))
        if "summary" in state_dict:
            self.summary = RunSummary.from_dict(state_dict["summary"])


def _file_safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def _gradients(pl_module: LightningModule) -> list[torch.Tensor]:
    """The parameters' gradients: the one part of the training state that the meter's
    whole-process sweeps cannot find, for a gradient has no Python object until it is read
    (parameters, buffers, optimizer state and the batch are found by the sweeps)."""
    return [p.grad for p in pl_module.parameters() if p.grad is not None]


def _still_grown(found: LeakReport, now: int) -> bool:
    """Whether at least half of the growth ``found`` saw is still there ``now`` (not garbage the collector freed)."""
    base = min(b for _, b in found.live_bytes_at_start) if found.live_bytes_at_start else now
    return now - base >= found.bytes_per_step * (found.last_step - found.first_step) // 2


def _gradient_bytes(module: Any) -> int:
    """Bytes of the distinct storages of ``module``'s parameters' ``.grad`` (0 for none)."""
    seen, total = set(), 0
    for parameter in module.parameters() if module is not None else ():
        grad = parameter.grad
        if grad is None or grad.layout is not torch.strided:
            continue
        storage = grad.untyped_storage()
        if id(storage) not in seen:
            seen.add(id(storage))
            total += int(storage.nbytes())
    return total
