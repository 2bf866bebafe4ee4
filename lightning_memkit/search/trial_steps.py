"""One trial's steps through the fit's own loop: rank-local, on the worst batch of its size, under its memory budget,
from the scale the fit's GradScaler had when the search began, until its optimizer really stepped ``steps_per_trial``
times; and what stopped it (out of memory, its time limit) in one line."""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Any

from lightning_memkit import _lightning_compat as compat
from lightning_memkit.oom import is_out_of_memory
from lightning_memkit.search.batch_search import SearchError
from lightning_memkit.search.limits import TrialTooSlow
from lightning_memkit.search.ranks import rank_local
from lightning_memkit.search.real_steps import MAX_SKIPPED_STEPS
from lightning_memkit.search.searchable import BatchSizeSearchError, SearchConfig
from lightning_memkit.search.trainer_state import real_steps_gate, reset_scaler, state_tensors
from lightning_memkit.search.worst_trials import worst_loader

__all__ = ["Ran", "ran_every_step", "stopped_by", "trial_steps"]


@dataclass
class Ran:
    """What a trial's fit ran: its optimizer steps, those that were real (not skipped by a GradScaler), why it stopped
    early (``None``: nothing stopped it) and whether its time limit did."""

    steps: int
    real_steps: int
    error_text: str | None
    too_slow: bool


def ran_every_step(ran: Ran, size: int, config: SearchConfig) -> bool:
    """Whether a trial that nothing stopped stepped its optimizer ``steps_per_trial`` times; raises SearchError when
    it could not: the data ended, or the GradScaler skipped every step it was given room for."""
    if ran.real_steps >= config.steps_per_trial:
        return True
    if ran.steps > ran.real_steps:
        raise SearchError(
            f"a trial at batch size {size} ran {ran.steps} optimizer steps and the GradScaler skipped "
            f"{ran.steps - ran.real_steps} of them (inf or NaN gradients at every scale): the optimizer stepped "
            f"{ran.real_steps} of {config.steps_per_trial} times; check the model's numerics in 16-mixed"
        )
    raise SearchError(
        f"a trial at batch size {size} ran {ran.steps} of {config.steps_per_trial} steps: the train "
        "dataloader ends too early; give a larger dataset or a smaller steps_per_trial"
    )


def trial_steps(trainer: Any, module: Any, size: int, config: SearchConfig, setup: Any, worst: Any) -> Ran:
    """Run the trial's steps through the fit loop, from the scale the fit's GradScaler had when the search began. In
    ``16-mixed`` it runs until ``steps_per_trial`` steps were real (at most
    :data:`~lightning_memkit.search.real_steps.MAX_SKIPPED_STEPS` more: a skipped step allocates no optimizer state).
    Only out-of-memory and a trial past its time limit are caught."""
    error_text: str | None = None
    too_slow = False
    budget = setup.budget
    gate = real_steps_gate(trainer, config.steps_per_trial)
    most = config.steps_per_trial + (MAX_SKIPPED_STEPS if gate is not None else 0)
    with rank_local(trainer):
        compat.reload_train_dataloader(trainer)
        loader = worst_loader(worst, size, compat.train_loader(trainer), most + 1) if worst else None
        if loader is not None:
            compat.use_train_loader(trainer, loader)
        compat.reset_fit_progress(trainer)
        compat.clear_logged_results(trainer)
        setup.snapshot.restore_precision(trainer)
        if gate is not None:
            trainer.callbacks = [*trainer.callbacks, gate]
        trainer.fit_loop.epoch_loop.max_steps = most
        trainer.fit_loop.max_epochs = max(1000, trainer.fit_loop.max_epochs or 0)
        trainer.should_stop = False
        try:
            if budget is not None:
                budget.accountant.reset_peak()
                budget.adopt(state_tensors(trainer, module), "state")
                budget.accountant.reset_peak()
                with budget:
                    trainer.fit_loop.run()
            else:
                trainer.fit_loop.run()
        except BaseException as error:  # noqa: BLE001 - only out-of-memory (and a trial past its time limit) is caught
            error_text = stopped_by(trainer, error, size, config, setup.communicates)
            too_slow = isinstance(error, TrialTooSlow)
            reset_scaler(trainer)  # stopped between the scaler's unscale_ and update: the next trial unscales again
            traceback.clear_frames(error.__traceback__)
            del error
        steps = trainer.fit_loop.epoch_loop.global_step
        compat.drop_train_data_fetcher(trainer)  # it holds the batch it prefetched
        compat.clear_logged_results(trainer)
    return Ran(steps, gate.real if gate is not None else steps, error_text, too_slow)


def stopped_by(trainer: Any, error: BaseException, size: int, config: SearchConfig, communicates: bool) -> str:
    """What stopped a trial, in one line; any error but out-of-memory or the time limit is raised again."""
    if isinstance(error, TrialTooSlow):  # its next step would end past its time limit (search/limits.py)
        return f"too slow: {error} ({trainer.fit_loop.epoch_loop.global_step} of {config.steps_per_trial} steps ran)"
    if not is_out_of_memory(error):
        raise error
    if communicates:
        # The other ranks wait in this step's next collective, which this rank will never join.
        raise BatchSizeSearchError(
            f"rank {trainer.global_rank} ran out of memory at batch size {size} inside a step of "
            f"{type(trainer.strategy).__name__}, whose collectives the other ranks are waiting in: the search "
            "cannot go on. Give MaxBatchSize(budget=...) below this device's memory (trials are then judged by "
            f"their measured peak after the step, on every rank) or a smaller max_val= "
            f"({str(error).splitlines()[0][:200]})"
        ) from None
    return str(error).splitlines()[0][:300]
