"""Real Lightning runs of a candidate, timed: a quiet ``Trainer`` fit of a few optimizer steps on the same batch
(:func:`fit_steps`), a callback that times each step and stops a CPU timing once its steps add up to the seconds
asked (:class:`StepClock`), a timing on a deep copy of the module (:func:`timed_step`), and Lightning's own cost per
micro-batch, per step and per run (:func:`loop_overheads`)."""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning_utilities.core import rank_zero

from lightning_memkit._lightning_compat import attached_trainer, copy_module
from lightning_memkit.estimate.batches import preserved_rng, rebatch
from lightning_memkit.meter import training_state_tensors
from lightning_memkit.plan.cuda_trial import cuda_device, release
from lightning_memkit.plan.real_steps import MAX_SKIPPED_STEPS, RealSteps
from lightning_memkit.plan.result import trainer_kwargs
from lightning_memkit.plan.space import Candidate
from lightning_memkit.plan.time_budget import MIN_TIMED_STEPS

__all__ = [
    "GIVE_UP_FACTOR",
    "MAX_TIMED_STEPS",
    "TIMED_SECONDS",
    "TIMED_STEPS",
    "WARMUP_STEPS",
    "Runs",
    "StepClock",
    "copy_of",
    "fit_steps",
    "loop_overheads",
    "quiet_lightning",
    "recording_steps",
    "timed_step",
    "timing_fit",
]

#: optimizer steps run before the timed ones in a real trial
WARMUP_STEPS = 1
#: optimizer steps timed in a real trial (their median), at least
TIMED_STEPS = 4
#: CPU: a trial's timing goes on past TIMED_STEPS until its timed steps add up to this many seconds (at most
#: MAX_TIMED_STEPS): a CPU's speed drifts by tens of percent over fractions of a second, and a few 15 ms steps
#: measured one phase of it, not the configuration
TIMED_SECONDS = 1.0
#: the most optimizer steps a trial times
MAX_TIMED_STEPS = 200
#: CPU: a trial's timing stops after its first :data:`MIN_TIMED_STEPS` timed steps when their median is more than this
#: many times the fastest trial's step so far: it cannot be chosen (nor be a tie: the machine's noise is a few
#: percent to tens of percent), and its remaining steps would only spend the time budget
GIVE_UP_FACTOR = 1.5


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """Lightning's per-Trainer info lines and the trials' expected warnings (a bare iterable, few steps) are not
    shown."""
    names = ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric")
    loggers = [logging.getLogger(name) for name in names]
    # the logger Lightning's rank_zero_info writes to (whichever Lightning package was imported last named it)
    loggers.append(rank_zero.log)
    levels = [each.level for each in loggers]
    for each in loggers:
        each.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module="lightning")
            warnings.filterwarnings(
                "ignore", message=".*(num_workers|log_every_n_steps|does not have many workers|val_dataloader).*"
            )
            yield
    finally:
        for each, level in zip(loggers, levels):
            each.setLevel(level)


class _Batches:
    """The same batch ``count`` times: the trial's training data (no loader time in the timing)."""

    def __init__(self, batch: Any, count: int) -> None:
        self.batch, self.count = batch, count

    def __iter__(self) -> Iterator[Any]:
        for _ in range(self.count):
            yield self.batch

    def __len__(self) -> int:
        return self.count


class StepClock(Callback):
    """Times every optimizer step: marks the start of the first micro-batch and the end of every optimizer step (CUDA
    events on CUDA, ``perf_counter`` on CPU). On CPU, when ``seconds`` is given, it stops the fit once ``timed`` steps
    after ``warmup`` have run and add up to ``seconds`` (the fit's ``max_steps`` is the cap); when ``give_up`` is
    given, also once :data:`~lightning_memkit.plan.time_budget.MIN_TIMED_STEPS` timed steps (``timed`` when fewer)
    have a median above it (seconds), and ``gave_up`` then says so."""

    def __init__(
        self,
        accumulation: int,
        cuda: bool,
        warmup: int = 0,
        timed: int = 0,
        seconds: float = 0.0,
        give_up: float = 0.0,
    ) -> None:
        self.accumulation, self.cuda, self.warmup, self.timed = accumulation, cuda, warmup, timed
        self.seconds, self.give_up = seconds, give_up
        self.marks: list[Any] = []
        self.gave_up = False

    def _enough(self) -> bool:
        warmup = self.warmup
        done = len(self.marks) - 1 - warmup  # timed steps ended
        if self.give_up > 0 and done >= min(self.timed, MIN_TIMED_STEPS):
            steps = [b - a for a, b in zip(self.marks[warmup:], self.marks[warmup + 1 :])]
            if statistics.median(steps) > self.give_up:
                self.gave_up = True
                return True
        return done >= self.timed and self.marks[-1] - self.marks[warmup] >= self.seconds

    def _mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            self._mark()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if (batch_idx + 1) % self.accumulation == 0:
            self._mark()
            if (self.seconds > 0 or self.give_up > 0) and not self.cuda and self._enough():
                trainer.should_stop = True  # at an optimizer step's end: the loop stops before the next batch

    def step_seconds(self) -> list[float]:
        """Seconds of each optimizer step marked (the first from the first micro-batch's start)."""
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def fit_steps(
    module: Any,
    candidate: Candidate,
    batch: Any,
    device_type: str,
    steps: int,
    accumulation: int,
    clock: Any,
    guard: Any,
) -> list[bool]:
    """``steps`` optimizer steps of ``accumulation`` micro-batches of ``batch`` with a real Trainer in the candidate's
    precision and checkpointing (under ``guard``, a MemoryBudget, when given), on the plan's CUDA device
    (:func:`cuda_device`) or the CPU. In ``16-mixed`` the fit goes on until ``steps`` optimizer steps were real, at
    most :data:`~lightning_memkit.plan.real_steps.MAX_SKIPPED_STEPS` more (the GradScaler skips a step whose gradients
    overflow: it allocates no optimizer state); returns whether each optimizer step was skipped (empty in the other
    precisions)."""
    cuda = device_type == "cuda"
    kwargs = trainer_kwargs(candidate, "gpu" if cuda else "cpu")
    gate = RealSteps(steps) if kwargs["precision"] == "16-mixed" else None
    most = steps + (MAX_SKIPPED_STEPS if gate is not None else 0)
    callbacks = ([clock] if clock is not None else []) + kwargs["callbacks"] + ([gate] if gate is not None else [])
    trainer = Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=[cuda_device().index] if cuda else 1,
        max_steps=most,
        accumulate_grad_batches=accumulation,
        precision=kwargs["precision"],
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
    )
    data = _Batches(batch, most * accumulation)
    try:
        if guard is not None:
            guard.adopt(training_state_tensors(module, (), batch), "state")
            with guard:
                trainer.fit(module, train_dataloaders=data)
        else:
            trainer.fit(module, train_dataloaders=data)
    finally:
        module.trainer = None  # the trainer (and its optimizers' state) goes with this call
        del trainer, data
    return gate.skipped if gate is not None else []


def copy_of(module: Any) -> Any:
    """A deep copy of ``module`` without its Trainer (the Trainer, its loops and optimizers are not copied), whose
    compiled step methods (``trainer.fit(torch.compile(model))``) run the copy, compiled as the original's
    (:func:`~lightning_memkit._lightning_compat.copy_module`)."""
    attached = attached_trainer(module)
    copied = copy_module(module, {id(attached): None} if attached is not None else {})
    copied.trainer = None
    return copied


def timing_fit(
    copied: Any, candidate: Candidate, micro: Any, device_type: str, warmup: int, timed: int, seconds: float
) -> list[float]:
    """``warmup`` optimizer steps, then at least ``timed`` timed ones (on CPU, until they add up to ``seconds``, at
    most :data:`MAX_TIMED_STEPS`) of ``candidate`` on ``copied``: the timed steps' seconds."""
    cuda = device_type == "cuda"
    timing = 0.0 if cuda else seconds
    steps = warmup + (max(timed, MAX_TIMED_STEPS) if timing > 0 else timed)
    give_up = _RECORDED_STEPS[-1].give_up if _RECORDED_STEPS and not cuda else 0.0
    clock = StepClock(candidate.accumulation, cuda, warmup, timed, timing, give_up)
    fit_steps(copied, candidate, micro, device_type, steps, candidate.accumulation, clock, None)
    timed_seconds = clock.step_seconds()[warmup:]
    if _RECORDED_STEPS:
        _RECORDED_STEPS[-1].append(timed_seconds)
        _RECORDED_STEPS[-1].gave_up = _RECORDED_STEPS[-1].gave_up or clock.gave_up
    return timed_seconds


class Runs(list):
    """The timed steps of each timing run inside :func:`recording_steps` (a list per run), whether one gave up."""

    give_up: float = 0.0
    gave_up: bool = False


#: the timed steps of every timing run, while :func:`recording_steps` records them (a trial's own steps, which the
#: trial's ``(fits, peak, samples/s, note)`` leaves out: the tie rule reads the machine's noise from their spread)
_RECORDED_STEPS: list[Runs] = []


@contextlib.contextmanager
def recording_steps(give_up: float = 0.0) -> Iterator[Runs]:
    """The timed steps of each timing run inside the block (a list per run, in order). ``give_up`` (seconds, CPU):
    a timing run stops once :data:`MIN_TIMED_STEPS` of its timed steps have a median above it (a trial that cannot
    be chosen: :data:`GIVE_UP_FACTOR`); ``gave_up`` then says so."""
    runs = Runs()
    runs.give_up = give_up
    _RECORDED_STEPS.append(runs)
    try:
        yield runs
    finally:
        del _RECORDED_STEPS[next(i for i, each in enumerate(_RECORDED_STEPS) if each is runs)]


def timed_step(
    module: Any, candidate: Candidate, batch: Any, device_type: str, warmup: int, timed: int, seconds: float = 0.0
) -> list[float]:
    """The seconds of the timed optimizer steps of ``candidate`` (see :func:`timing_fit`) on a deep copy of
    ``module``, no budget: the CPU time model's calibration, and the interleaved rounds that time the trials again."""
    cuda = device_type == "cuda"
    with preserved_rng(), quiet_lightning():
        copied = copy_of(module)
        micro = rebatch(batch, candidate.micro_batch)
        timed_seconds = timing_fit(copied, candidate, micro, device_type, warmup, timed, seconds)
        del copied, micro
    release(cuda)
    return timed_seconds


class _Nothing(LightningModule):
    """One ``Linear(1, 1)`` and SGD at lr 0: a step of Lightning's loop and almost nothing else."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self.layer(batch).sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def loop_overheads(accumulation: int = 8, warmup: int = 1, timed: int = 10) -> tuple[float, float, float]:
    """Lightning's own cost on this CPU, seconds: ``(per micro-batch, per optimizer step, per run)``, from a module
    with one ``Linear(1, 1)`` trained with accumulation 1 and ``accumulation`` (the medians' difference is the
    micro-batches' cost, the rest the step's; a run's wall time beyond its steps is what building, setting up and
    tearing down a Trainer costs, which the time budget prices every real run at). The fake step sees the model's
    ops, not the loop around them (hooks, the closure, the batch's transfer, ``zero_grad``), which is what makes many
    small micro-batches slow on a CPU."""
    medians, runs = [], []
    with quiet_lightning():
        for each in (1, accumulation):
            started = time.perf_counter()
            steps = timing_fit(_Nothing(), Candidate(1, each), torch.zeros(1, 1), "cpu", warmup, timed, 0.0)
            medians.append(statistics.median(steps))
            runs.append(time.perf_counter() - started - sum(steps) - warmup * medians[-1])
    per_batch = max(medians[1] - medians[0], 0.0) / (accumulation - 1)
    return per_batch, max(medians[0] - per_batch, 0.0), max(min(runs), 0.0)
