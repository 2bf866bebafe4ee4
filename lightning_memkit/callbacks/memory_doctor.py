"""MemoryDoctor: find tensors that survive training steps (leaks), tensors held past their last use,
and who made them. Thin wiring of :class:`~lightning_memkit.doctor.verdict.DoctorSession` to Lightning's hooks.
"""

from __future__ import annotations

import os
import sys
import weakref
from typing import Any, Literal

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_memkit._lightning_compat import (
    forget_model_logging,
    logging_step,
    optimizer_steps_after_batch,
    prefetched_batches,
)
from lightning_memkit.callbacks import _checks as checks
from lightning_memkit.callbacks._files import run_files_dir
from lightning_memkit.compiled import COMPILED_CHOICES, NOT_SEEN_COMPILED, compiled_parts
from lightning_memkit.doctor.holders import HolderSearch, user_roots
from lightning_memkit.doctor.leaks import LeakReport, rising_floor
from lightning_memkit.doctor.verdict import DoctorReport, DoctorSession
from lightning_memkit.tensorboard.dashboard import markdown_code, tensorboard_experiment
from lightning_memkit.units import format_bytes

__all__ = ["MemoryDoctor"]

#: the doctor's report, written at fit end beside the logs
REPORT_FILENAME = "memkit_doctor.json"
#: the TensorBoard text tag of the doctor's verdict
DOCTOR_TEXT_TAG = "memory/doctor/verdict"


class MemoryDoctor(Callback):
    r"""Diagnose what survives a training step and should not, and who made it.

    Usage::

        from lightning_memkit import MemoryDoctor
        trainer = Trainer(max_steps=20, callbacks=[MemoryDoctor()])
        trainer.fit(model)          # a leak is warned about once; the verdict is printed at the end

    From the first training batch on, every storage torch makes is recorded with who made it (aten op,
    module path, forward/backward, shape, dtype and the line of your code), from one step's
    ``on_train_batch_start`` to the next's, so whatever runs between steps (your hooks, other callbacks,
    validation) is seen too. The live tensor bytes at each step's start (less the tensors that fed the
    run before it began: a dataset, pre-built batches; less the step's batch and the batch Lightning fetched
    ahead, whose sizes change from step to step when batches are padded per batch) make a series whose
    floor (the least bytes from that step on) must rise ``window`` times and still be rising to be a leak,
    judged when an epoch ends and when training ends, after the epoch-end hooks: a list cleared at each
    epoch's end is no leak, a list that validation fills every few steps is. A leak is reported once (a warning, and
    :attr:`report`) with the bytes per step, the tensors kept from earlier steps grouped by creator, the
    line of your code that stored them (``self.kept.append(logits)``, ``self.cache[k] = v``), and who
    holds them as code you can paste (``model.outputs[17]``, ``trainer.callbacks[1].saved[3]``,
    ``model.encoder[1]._forward_hooks``): the place to delete them. Step ``analyse_step`` is also
    analysed op by op: its peak, what the peak is made of, and the bytes *held too long* there (live
    although last read before the peak). Gradient accumulation: one step per optimizer step.

    The doctor is a diagnosis tool: recording costs a Python call per aten op (and a frame walk per
    new tensor), and naming the keeping lines a Python call per Python call (``sys.settrace`` on your own
    store statements; left off when a debugger or coverage already traces, and on a model kept compiled),
    so use it for a few dozen steps, as ``memkit doctor`` does, not for whole runs.

    Args:
        window: rises of the floor of the live bytes at step start that make a leak (>= 2).
        warmup_steps: first steps not compared (gradients and optimizer state appear in them).
        analyse_step: the training step whose liveness is analysed (``None``: no analysis).
        verbose: print the verdict at the end of fit (or at a failure, when a leak was found). A leak is
            also warned about once when found; the warning carries the verdict only without ``verbose``,
            so that each verdict is shown once.
        progress: print one line on stderr every ``window`` steps (the step, the live tensor bytes, the
            verdict so far), global rank zero only; ``memkit doctor`` turns it on.
        holders_time_limit_s: the most seconds, per report, spent searching who holds a leak (0: no
            search; the walk over ``gc`` referrers runs only when a leak is reported).
        compiled: what to do when the model (or a submodule, or its ``training_step``) is ``torch.compile``d.
            ``"keep"`` (default): training stays compiled; the live bytes between steps are the CPU allocator's
            (its events, read through torch's profiler), who made a kept tensor is what a walk of the collector's
            objects finds between steps (its shape and ``grad_fn``; no module, no line), and no step is analysed
            op by op. ``"eager"``: the recorded steps run eagerly (every step from the first), for the full
            op-by-op record of the eager program. See docs/compile.md.

    Attributes:
        report: the :class:`~lightning_memkit.doctor.verdict.DoctorReport` (``None`` before the first step).
        report_path: ``<log_dir>/memkit_doctor.json`` written at fit end in the first logger's log dir;
            ``None`` without a logger (``logger=False``, ``fast_dev_run``): nothing lands in the working
            directory unasked, :attr:`report` has the verdict (``report.to_json(path)`` writes it).
            A fit that raises writes the verdict up to the failure too.
        holder_search: the :class:`~lightning_memkit.doctor.holders.HolderSearch` of the leak reported (what
            it found, its ``seconds`` and why it stopped), or ``None``.
    """

    def __init__(
        self,
        window: int = 5,
        warmup_steps: int = 2,
        analyse_step: int | None = 1,
        verbose: bool = True,
        progress: bool = False,
        holders_time_limit_s: float = 1.0,
        compiled: Literal["keep", "eager"] = "keep",
    ) -> None:
        owner = "MemoryDoctor"
        checks.integer(owner, "window", window, 2, "an integer >= 2, e.g. 5 rises of the memory's floor")
        checks.integer(owner, "warmup_steps", warmup_steps, 0, "an integer >= 0 (steps before watching)")
        checks.integer(owner, "analyse_step", analyse_step, 0, "a step (an integer >= 0), or None", optional=True)
        checks.boolean(owner, "verbose", verbose)
        self.progress = checks.boolean(owner, "progress", progress)
        self.holders_time_limit_s = float(
            checks.number(
                owner,
                "holders_time_limit_s",
                holders_time_limit_s,
                "seconds >= 0, e.g. 1.0 (0: no holder search)",
                low=0,
                low_open=False,
            )
        )
        self.compiled = checks.choice(
            owner,
            "compiled",
            compiled,
            COMPILED_CHOICES,
            "'keep' (training stays compiled) or 'eager' (the recorded steps run eagerly, for the op-by-op record)",
        )
        self.window = window
        self.warmup_steps = warmup_steps
        self.analyse_step = analyse_step
        self.verbose = verbose
        self.report: DoctorReport | None = None
        self.report_path: str | None = None
        self._session: DoctorSession | None = None
        self._step: int | None = None
        self._warned = False
        self._first_step: int | None = None
        self.holder_search: HolderSearch | None = None

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close()
        self.report = None
        self.report_path = None
        self.holder_search = None
        reference = weakref.ref(trainer)

        def roots() -> dict:
            return user_roots(reference(), pl_module)

        self._session = DoctorSession(
            pl_module,
            trainer.optimizers,
            window=self.window,
            warmup_steps=self.warmup_steps,
            analyse_step=self.analyse_step,
            roots=roots,
            holders_time_limit_s=self.holders_time_limit_s,
        )
        self._warned = False
        self._first_step = None
        try:  # what feeds the run exists before it: a pre-built batch is never memory a step added
            self._session.recorder.know_existing(
                # Lightning sets Trainer.datamodule in its data connector; the class does not declare it
                [trainer.train_dataloader, trainer.datamodule],  # type: ignore[attr-defined]
                stop_at=[trainer, pl_module],
            )
        except Exception as error:  # noqa: BLE001 - a loader that cannot be walked: its batches may look new
            self._session.recorder.errors.append(f"noting the data's tensors: {type(error).__name__}: {error}")
        parts = compiled_parts(pl_module)
        if parts:
            self._session.recorder.compiled = self.compiled
            how = (
                f"live bytes from the CPU allocator's events, training kept compiled; {NOT_SEEN_COMPILED}"
                if self.compiled == "keep"
                else "the recorded steps run EAGERLY (compiled='eager')"
            )
            self._session.compiled_note = f"compiled model ({', '.join(parts)}): {how}"
            rank_zero_info(f"memkit doctor: {self._session.compiled_note}")

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        session = self._session
        if session is None:
            return
        try:
            if self._step is None:
                self._step = logging_step(trainer)
                # the batch in flight and the one Lightning fetched ahead are left out of the bytes measured:
                # padded per batch, their sizes change from step to step and would move the floor
                found = session.step_start(
                    self._step,
                    batch,
                    prefetched=prefetched_batches(trainer),
                    module=pl_module,
                    optimizers=trainer.optimizers,
                    epoch=trainer.current_epoch,
                )
                if found is not None:
                    self._warn(found)
                self._show_progress(trainer, session)
            else:  # another micro-batch of the same optimizer step
                session.recorder.assign_roles(batch=batch)
        except Exception as error:  # noqa: BLE001 - never break training: step aside
            self._give_up(error)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        session = self._session
        if session is None or self._step is None or not optimizer_steps_after_batch(trainer):
            return
        try:
            session.step_end(self._step, module=pl_module, optimizers=trainer.optimizers)
        except Exception as error:  # noqa: BLE001 - never break training: step aside
            self._give_up(error)
        self._step = None

    def _warn(self, found: Any) -> None:
        """Warn once that a leak was found. The verdict itself is shown once: printed at fit end with
        ``verbose`` (the warning then only says what was found), else in the warning."""
        if self._warned:
            return
        self._warned = True
        if not self.verbose:
            rank_zero_warn("memkit doctor: " + found.format())
            return
        what = "memory leak" if isinstance(found, LeakReport) else "autograd graphs kept across steps"
        rank_zero_warn(
            f"memkit doctor: {what} found; the verdict (bytes per step, the lines that made and keep the "
            f"tensors, who holds them) is printed when fit ends"
        )

    def _show_progress(self, trainer: Trainer, session: DoctorSession) -> None:
        """One line per window of steps on stderr (``progress=True``), global rank zero only."""
        if not self.progress or not trainer.is_global_zero:
            return
        if self._first_step is None:
            self._first_step = self._step
        done = session.steps
        if done % self.window and done != 1:
            return
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        of = f"/{total}" if total else ""
        watcher = session.watcher
        if watcher.report is not None:
            verdict = f"leak: {watcher.report.bytes_per_step} B per step"
        elif not watcher.enough_steps:
            verdict = "too few steps to judge yet"
        else:
            rising = rising_floor(watcher.points, watcher.window, watcher.min_bytes_per_step)
            verdict = (
                f"floor rising by {rising[0]} B per step so far; judged when the epoch or training ends"
                if rising
                else "floor steady"
            )
        print(
            f"memkit doctor: step {self._step}{of}, steps watched: {done}, live tensors "
            f"{format_bytes(session.watched_bytes())} ({verdict})",
            file=sys.stderr,
            flush=True,
        )

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # callbacks' epoch-end hooks run before the LightningModule's, which may free what the epoch kept
        if self._session is not None:
            try:
                self._session.epoch_end()
            except Exception as error:  # noqa: BLE001 - never break training
                self._give_up(error)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._session is None:
            return
        try:
            found = self._session.finish()  # after the last epoch's end: memory freed there is no leak
            if found is not None:
                self._warn(found)
        except Exception as error:  # noqa: BLE001 - never break training
            self._give_up(error)
            return
        self._close()
        if self.report is None:
            return
        self._write_report(trainer, self.report)
        experiment = tensorboard_experiment(trainer)
        if experiment is not None:  # the verdict in TensorBoard's Text tab
            experiment.add_text(DOCTOR_TEXT_TAG, markdown_code(self.report.format()), global_step=trainer.global_step)
            experiment.flush()
        if self.verbose and trainer.is_global_zero:
            print(self.report.format())

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        watching = self._session is not None
        self._close()
        if watching and self.report is not None:
            # nothing is lost: the verdict up to the failure (a leak that ended in an out-of-memory error, say)
            try:
                self._write_report(trainer, self.report)
                if self.verbose and self._warned and trainer.is_global_zero:
                    print(self.report.format())  # the warning said the verdict would follow
            except Exception:  # noqa: BLE001 - never mask the user's exception
                pass
        forget_model_logging(self)  # kept to read its records, it must not keep the model

    def _write_report(self, trainer: Trainer, report: DoctorReport) -> None:
        directory = run_files_dir(trainer)  # no logger (or fast_dev_run): no file in the working directory
        if trainer.is_global_zero and directory:
            try:
                os.makedirs(directory, exist_ok=True)
                self.report_path = report.to_json(os.path.join(directory, REPORT_FILENAME))
            except OSError as error:
                rank_zero_warn(f"memkit doctor: could not write {REPORT_FILENAME} to {directory}: {error}")

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._close()
        forget_model_logging(self)  # kept to read its records, it must not keep the model

    def _close(self) -> None:
        session = self._session
        if session is not None:
            session.close()
            self.report = session.report()
            self.holder_search = session.holder_search
            self._session = None
        self._step = None

    def _give_up(self, error: BaseException) -> None:
        rank_zero_warn(
            f"memkit doctor: stepping aside after an error ({type(error).__name__}: {error}); training goes on"
        )
        self._close()
