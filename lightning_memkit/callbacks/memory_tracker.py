"""MemoryTracker: per-step memory in every Lightning logger, wired from MemoryMeter.

The callback decides *when* (which steps, which hooks, which ranks) and *where* (loggers,
history, checkpoints, OOM report); measuring is MemoryMeter's job.
"""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import Sequence
from typing import Any, Literal

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_memkit._lightning_compat import forget_model_logging
from lightning_memkit.callbacks import _checks as checks
from lightning_memkit.callbacks import _tracker_arguments as arguments
from lightning_memkit.callbacks._files import file_target, log_dir, logging_loggers
from lightning_memkit.callbacks._step_windows import StepWindows
from lightning_memkit.compiled import compiled_parts
from lightning_memkit.doctor.confirmed_leaks import LeakConfirmer, leak_warning
from lightning_memkit.doctor.leaks import LeakReport
from lightning_memkit.logging_merge import ReadingRows, log_summary
from lightning_memkit.meter import MemoryMeter
from lightning_memkit.oom import is_out_of_memory, write_fit_oom_report
from lightning_memkit.peak_steps import PeakSchedule
from lightning_memkit.probes._torch_compat import start_memory_history, stop_memory_history
from lightning_memkit.probes.base import MemoryProbe
from lightning_memkit.rank_reduction import ReadingReducer
from lightning_memkit.records import RecordsWriter, RunSummary, StepReading, ended_by, records_filename
from lightning_memkit.summary_table import fit_ended, where_readings_went
from lightning_memkit.tensorboard.dashboard import log_memory_summary, register_dashboard
from lightning_memkit.tensorboard.tags import DEFAULT_PREFIX

__all__ = ["MemoryTracker"]


def _batch_search_note(trainer: Any) -> str | None:
    """The note a batch-size search (MaxBatchSize) gives for the summary: its trial peak beside the run peak, with
    what each counts; the last callback's that gives one, else ``None``."""
    found = None
    for callback in trainer.callbacks:
        note = getattr(callback, "summary_note", None)
        text = note() if callable(note) else None
        if isinstance(text, str):
            found = text
    return found


class MemoryTracker(Callback):
    r"""Log each training step's memory to every logger: allocated, reserved, peaks, fragmentation.

    Usage::

        from lightning_memkit import MemoryTracker
        trainer = Trainer(callbacks=[MemoryTracker()])
        trainer.fit(model)              # then: tensorboard --logdir lightning_logs

    Logged keys (training steps under ``memory/train/``, validation runs under ``memory/val/``,
    at the same step axis as your own ``self.log`` metrics; every ``_MiB`` value is bytes/2**20;
    a key appears only where its source exists): CUDA's ``allocated_MiB``, ``peak_allocated_MiB``
    (highest during the step, reset each step), ``reserved_MiB``, ``peak_reserved_MiB``,
    ``active_MiB``, ``fragmentation_MiB``, ``alloc_retries`` and ``ooms``; NVML's
    ``device_used_MiB``, ``device_total_MiB`` and ``process_device_MiB``; the host's
    ``host_rss_MiB`` and ``host_peak_rss_MiB``; the accountant's ``tensor_MiB`` (every live tensor
    storage of the process on the measured device at step end, whoever made it, as CUDA's
    ``allocated`` counts, exact) and ``peak_tensor_MiB`` (its highest during the step, on the steps
    the accountant measured: ``tensor_peak_every_n_steps``, and each step whose batch is the largest
    yet). docs/memory_tracker.md explains each (and :data:`lightning_memkit.records.MEMORY_FIELDS`).

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
            on at most one step in this many (default 10) of the steps the loggers get (1 = every
            such step), on a fit's first steps, and on each step whose batch is the largest of the
            fit so far (the rule: :class:`~lightning_memkit.peak_steps.PeakSchedule`). The summary
            says on how many training steps the peak was read. ``tensor_MiB`` (live bytes at step
            end) is read every measured step at a cost of tens of microseconds. Validation runs
            always get their peak. See docs/memory_tracker.md.
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
            writes them). A path (a file, or an existing directory) writes there. An existing file is
            never overwritten: the name gets ``-v1``, ``-v2``... as Lightning's checkpoints do.
        prefix: the first part of every logged key. Several MemoryTrackers in one Trainer (say,
            one measuring every step and one with ``every_n_steps=100``) need different prefixes:
            the prefix also names the tracker's checkpoint state.
        extra_probes: your own :class:`~lightning_memkit.probes.base.MemoryProbe` instances, read
            with the built-in ones every measured step (a failing probe warns once and is
            switched off; training continues).
        verbose: print the summary table at fit end (global rank zero only).
        detect_leaks: watch the live bytes at the end of each measured training step (CUDA's
            allocated bytes, or the CPU reading); when their floor rose ``leak_window`` times, is
            still rising and the rise is confirmed (after a full collection, not freed at an epoch's
            end: :class:`~lightning_memkit.doctor.confirmed_leaks.LeakConfirmer`), warn once with the
            bytes per measured step, and keep it in :attr:`leak_report` and the summary.
            ``MemoryDoctor`` / ``memkit doctor`` then name who made the memory and who holds it.
        leak_window: how many rises of the floor make a leak (>= 2).
        compiled: what to do when the model (or a submodule, or its ``training_step``) is
            ``torch.compile``d. ``"keep"`` (default): the steps stay compiled; ``peak_tensor_MiB`` is then
            read from the CPU allocator's own events (torch's profiler with ``profile_memory``).
            ``"eager"``: the peak-measured steps run eagerly under the accountant (the eager program's
            peak). CUDA's counters are the compiled program's either way. See docs/compile.md.

    Attributes:
        history: the logged readings, oldest first (under DDP the max over ranks, ``rank=-1``).
        summary: the run's :class:`~lightning_memkit.records.RunSummary`.
        oom_report_path: the path of the OOM report, if one was written.
        leak_report: the :class:`~lightning_memkit.doctor.leaks.LeakReport` of steady growth, once
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
        self.every_n_steps = arguments.every_n_steps(every_n_steps)
        self.log_validation = checks.boolean(arguments.OWNER, "log_validation", log_validation)
        self.tensor_accounting = arguments.tensor_accounting(tensor_accounting)
        self.nvml = checks.boolean(arguments.OWNER, "nvml", nvml)
        self.host = checks.boolean(arguments.OWNER, "host", host)
        self.per_rank = checks.boolean(arguments.OWNER, "per_rank", per_rank)
        self.cuda_memory_history = arguments.cuda_memory_history(cuda_memory_history)
        self.cuda_memory_stacks = arguments.cuda_memory_stacks(cuda_memory_stacks)
        self.oom_dir = arguments.oom_dir(oom_dir)
        self.max_history = arguments.max_history(max_history)
        self.prefix = arguments.prefix(prefix)
        self.verbose = checks.boolean(arguments.OWNER, "verbose", verbose)
        self.extra_probes = arguments.extra_probes(extra_probes)
        self.compiled = arguments.compiled(compiled)
        self.tensor_peak_every_n_steps = arguments.tensor_peak_every_n_steps(tensor_peak_every_n_steps)
        self.records_file = arguments.records_file(records_file)
        self.detect_leaks = checks.boolean(arguments.OWNER, "detect_leaks", detect_leaks)
        leak_window = arguments.leak_window(leak_window)
        self.history: collections.deque[StepReading] = collections.deque(maxlen=max_history)
        self.summary = RunSummary()
        self.oom_report_path: str | None = None
        self.records_path: str | None = None
        self._meter: MemoryMeter | None = None
        self._reducer: ReadingReducer | None = None
        self._history_recording = False
        self._windows: StepWindows | None = None  # when the meter's windows open and close
        self._rows = ReadingRows()  # a reading waits for Lightning's own row at its step
        self._records = RecordsWriter()
        self.leak_report: LeakReport | None = None
        self._leaks = LeakConfirmer(window=leak_window, warmup_steps=2)

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
        self.summary.extra.pop("ended_by", None)  # a fit resumed after a failure goes on
        self._rows.wrap(trainer.loggers)
        device = trainer.strategy.root_device
        self._meter = MemoryMeter(
            device,
            tensor_accounting=self.tensor_accounting,
            nvml=self.nvml,
            host=self.host,
            extra_probes=self.extra_probes,
        )
        # the first steps' peaks, and "larger than every batch before", are per fit
        peaks = PeakSchedule(self.every_n_steps, self.tensor_peak_every_n_steps)
        self._windows = StepWindows(self._meter, peaks, self.every_n_steps, self.log_validation)
        self._reducer = ReadingReducer()
        self.summary.device = str(device)
        try:
            self.summary.capacity_bytes = self._meter.capacity_bytes()
        except Exception:  # noqa: BLE001 - the capacity labels the summary: unknown (None) rather than a failed fit
            self.summary.capacity_bytes = None
        if self.cuda_memory_history and device.type == "cuda":
            self._history_recording = start_memory_history(self.cuda_memory_history, stacks=self.cuda_memory_stacks)
            if not self._history_recording:
                rank_zero_warn(
                    "memkit: this torch cannot record CUDA memory history; OOM reports will have no snapshot."
                )

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
        self._windows = None
        if self._reducer is not None:
            self._reducer.close()  # its gloo group: a job of many fits must not accumulate them
        self._reducer = None
        self._rows.unwrap()
        if self._history_recording:
            stop_memory_history()
            self._history_recording = False

    # ------------------------------------------------------------------ training steps and validation runs
    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._windows is None:
            return
        if not self._windows.meter.is_open:
            self._flush_pending(trainer)  # a new optimizer step: the last one's reading was logged or not by now
        self._windows.train_batch_start(trainer, pl_module, batch)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        reading = self._windows.train_batch_end(trainer) if self._windows is not None else None
        if reading is not None:
            self._log(trainer, reading, pl_module)

    @override
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._windows is not None:
            self._windows.validation_start(trainer)

    @override
    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self._windows is not None:
            self._windows.validation_batch_start(pl_module)

    @override
    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self._windows is not None:
            self._windows.validation_batch_end()

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._windows is None:
            return
        reading = self._windows.validation_close()
        if reading is not None:
            self._log(trainer, reading, pl_module)
            if self.records_path is not None and trainer.is_global_zero and trainer.state.fn == "validate":
                # trainer.validate() after fit: the records written at fit end get this reading too, as .history has
                self.records_path = self.save_records(self.records_path)
        self._windows.validation_done()

    # ------------------------------------------------------------------ logging
    def _log(self, trainer: Trainer, reading: StepReading, pl_module: LightningModule) -> None:
        logged, ranks = self._reducer.reduce(reading, self.per_rank) if self._reducer else (reading, [])
        self.history.append(logged)
        self.summary.update(logged)
        meter = self._meter  # made at setup, before any step
        if self.detect_leaks and logged.stage == "train" and self.leak_report is None and meter is not None:
            found = self._leaks.observe(logged, trainer.current_epoch, meter.live_bytes_like, self._distributed)
            if found is not None:
                self._report_leak(found)
        if trainer.loggers:
            self._rows.hold(trainer, logged, ranks, self.prefix, self.every_n_steps)

    def _flush_pending(self, trainer: Trainer) -> None:
        """Write the held reading if Lightning's own logging did not take it (see ReadingRows.flush)."""
        self._rows.flush(trainer, self.every_n_steps)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._flush_pending(trainer)  # after Lightning's own validation logging

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._flush_pending(trainer)
        self._note_epoch_end(trainer)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        register_dashboard(trainer)  # memkit's TensorBoard dashboard, once per run
        self._note_compiled(pl_module)

    def _note_compiled(self, pl_module: LightningModule) -> None:
        """A compiled model (found after ``configure_model``): measure it without switching compile off, and say so
        once."""
        self.summary.extra.pop("compiled", None)
        parts = compiled_parts(pl_module)
        if not parts or self._meter is None:
            return
        self._meter.compiled = self.compiled
        how = self._meter.compiled_note()
        self.summary.extra["compiled"] = {"parts": parts, "measured": how}
        rank_zero_info(f"memkit MemoryTracker: compiled model ({', '.join(parts)}): {how}")

    @property
    def _distributed(self) -> bool:
        """Under DDP the readings are the maximum over ranks: this rank's bytes now are not comparable to them."""
        return self._reducer is not None and self._reducer.enabled

    def _note_epoch_end(self, trainer: Trainer) -> None:
        """The live bytes when the epoch's steps are done, before the epoch-end hooks of the module."""
        if self.detect_leaks and self.leak_report is None and self._meter is not None:
            self._leaks.note_epoch_end(self._meter.live_bytes_like, trainer.lightning_module)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # The run ended, after the last epoch's end: judge every measured step (see LeakConfirmer.finish).
        if not self.detect_leaks or self.leak_report is not None or self._meter is None:
            self._leaks.forget_run_end()
            return
        found = self._leaks.finish(self._meter.live_bytes_like, pl_module, self._distributed)
        if found is not None:
            self._report_leak(found)

    def _report_leak(self, found: LeakReport) -> None:
        self.leak_report = found
        self.summary.extra["leak"] = {
            "bytes_per_measured_step": found.bytes_per_step,
            "first_step": found.first_step,
            "last_step": found.last_step,
            "every_n_steps": self.every_n_steps,
        }
        rank_zero_warn(leak_warning(found, self.every_n_steps))

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._flush_pending(trainer)
        if self.summary.peak_bytes is None:
            return
        note = _batch_search_note(trainer)
        if note is not None:
            self.summary.extra["batch_search"] = note
        step = log_summary(trainer, self.summary, self.prefix)
        if trainer.is_global_zero:
            target = file_target(trainer, self.records_file, self._records_name())
            if target is not None:
                self.records_path = self.save_records(target)
            loggers = [type(logger).__name__ for logger in logging_loggers(trainer)]
            # Lightning sets Trainer.log_every_n_steps in a connector; the class does not declare it
            log_every = trainer.log_every_n_steps  # type: ignore[attr-defined]
            where = where_readings_went(loggers, self.every_n_steps, log_every, self.records_path)
            fit_ended(self.summary, list(self.history), where if self.verbose else None)
            # the summary table and the memory figure in TensorBoard
            log_memory_summary(trainer, self.summary, list(self.history), step, self.prefix)

    # ------------------------------------------------------------------ records
    def _records_name(self) -> str:
        # a second tracker (its own prefix) writes beside the default one instead of over it
        return records_filename(None if self.prefix == DEFAULT_PREFIX else self.prefix)

    def save_records(self, path: str) -> str:
        """Write :attr:`summary` and :attr:`history` as JSON (what ``memkit report`` reads) to
        ``path`` (a file, or an existing directory: ``memkit_memory.json`` in it); returns the path
        written. An existing file this tracker did not write in this run is kept: the new name gets
        ``-v1``, ``-v2``... (as Lightning's ModelCheckpoint does)."""
        return self._records.write(path, self._records_name(), self.summary, list(self.history))

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
            written = write_fit_oom_report(
                trainer,
                self.oom_dir or log_dir(trainer),
                self.summary,
                self.history,
                reading,
                exception,
                self._history_recording,
            )
            if written is not None:
                self.oom_report_path = written
        with contextlib.suppress(Exception):  # never mask the user's exception
            self._flush_pending(trainer)
        for logger in trainer.loggers:
            with contextlib.suppress(Exception):  # never mask the user's exception
                logger.save()
        self._save_records_after_failure(trainer, exception)
        self._release()
        forget_model_logging(self)  # kept to read its records, it must not keep the model

    def _save_records_after_failure(self, trainer: Trainer, exception: BaseException) -> None:
        """Nothing is lost: the readings up to the failure go where fit end would have put them
        (``memkit report`` reads exact bytes, not the float32 MiB of the event files, and a CSV-only
        run has no event files), with ``summary.extra["ended_by"]`` saying how the fit ended."""
        if not trainer.is_global_zero or self.summary.peak_bytes is None:
            return
        self.summary.extra["ended_by"] = ended_by(exception)
        try:
            target = file_target(trainer, self.records_file, self._records_name())
            if target is not None:
                self.records_path = self.save_records(target)
        except Exception as error:  # noqa: BLE001 - never mask the user's exception
            rank_zero_warn(
                f"memkit MemoryTracker: the readings could not be written after the failure "
                f"({type(error).__name__}: {error}); they are on this tracker's .history"
            )

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
