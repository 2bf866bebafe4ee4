"""The batch-size search wired to a Lightning Trainer: real trials through the fit loop, state put back.

Trials run Lightning's own fit loop (precision plugin, strategy, accumulation as configured) with
callbacks and loggers set aside; everything a trial changes is restored afterwards, bit for bit.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from lightning_memkit import _lightning_compat as compat
from lightning_memkit.compiled import compiled_parts
from lightning_memkit.compiled._torch_compat import reset_compiled
from lightning_memkit.estimate.cuda.caching_allocator import CUDA_CONTEXT_BYTES
from lightning_memkit.estimate.data.batches import preserved_rng
from lightning_memkit.estimate.largest_batch import predict_max_batch_size
from lightning_memkit.estimate.step.memory_estimate import EstimateError
from lightning_memkit.modes.checkpoint_wrap import is_checkpointed
from lightning_memkit.modes.checkpointing import apply_checkpointing
from lightning_memkit.search.batch_search import SearchResult, Trial, TrialOutcome
from lightning_memkit.search.budget import MemoryBudget
from lightning_memkit.search.limits import BoundedSearch, TrialLimits
from lightning_memkit.search.ranks import Outcomes, step_communicates
from lightning_memkit.search.searchable import BatchSizeSearchError, SearchConfig, _lightning_setattr, check_searchable
from lightning_memkit.search.trainer_state import (
    CPU_MAX_SECONDS,
    HOST_BUDGET_FRACTION,
    Snapshot,
    cuda_capacity_bytes,
    host_search_budget_bytes,
    local_shard,
    release_memory,
    trainer_mode,
)
from lightning_memkit.search.trial_steps import ran_every_step, trial_steps
from lightning_memkit.search.worst_trials import BatchRecorder, trained_on, worst_of_fit
from lightning_memkit.units import format_bytes

# the search's settings and errors are imported from here by the callbacks and users' code
__all__ = ["search_in_fit"]


def _say(trainer: Any, text: str, verbose: bool) -> None:
    if verbose and trainer.is_global_zero:
        print(text, flush=True)


@dataclass
class _Setup:
    """What a search decided before its first trial: where it runs, against what memory, within what time."""

    device: torch.device
    outcomes: Outcomes
    communicates: bool
    snapshot: Snapshot
    budget: MemoryBudget | None
    capacity: int | None
    limits: TrialLimits | None
    max_seconds: float | None
    compiled: bool


def _set_up(trainer: Any, module: Any, config: SearchConfig) -> _Setup:
    device = trainer.strategy.root_device
    outcomes = Outcomes()
    # Under FSDP / model parallel a trial's step cannot be made rank-local: no rank may stop mid-step, so a
    # trial is judged by its measured peak against the budget after its steps end, on every rank.
    communicates = step_communicates(trainer, module)
    snapshot = Snapshot(trainer, module, config.batch_arg_name)
    stop = not communicates
    budget = MemoryBudget(int(config.budget), stop_at_crossing=stop) if config.budget is not None else None
    max_seconds = config.max_seconds
    limits: TrialLimits | None = None
    if budget is None and device.type == "cpu":
        # Exhausting host RAM rarely raises: Linux's OOM killer ends the process instead. So a CPU search
        # without a budget counts live tensors against most of the RAM that is free now, and fails cleanly.
        # On CPU memory seldom bounds the batch, time does: the trials also stop at CPU_MAX_SECONDS.
        budget = MemoryBudget(host_search_budget_bytes(), stop_at_crossing=stop)
        if max_seconds is None:
            max_seconds = CPU_MAX_SECONDS
        # Every trial is bounded before it runs, the first one included (search/limits.py).
        limits = TrialLimits.for_cpu(budget.budget_bytes, max_seconds)
        _say(
            trainer,
            f"memkit: no budget= on CPU: tensors are counted against {format_bytes(budget.budget_bytes)} "
            f"({HOST_BUDGET_FRACTION:.0%} of the host memory available now); {limits.announcement()}; "
            "give budget= (e.g. budget='2GiB') for a memory limit of your own",
            config.verbose,
        )
    capacity: int | None = None
    if budget is not None:
        capacity = budget.budget_bytes
    elif device.type == "cuda":
        capacity = cuda_capacity_bytes(device)
    if capacity is not None:
        capacity = outcomes.min(capacity)  # every rank must search the same way: the tightest memory decides
    if communicates and budget is None and capacity is not None:
        # CUDA under FSDP / model parallel: the device's memory as a budget judged after each trial, so a trial
        # near the limit is refused by its measured peak on every rank, not by an OOM on one rank mid-step.
        budget = MemoryBudget(capacity, stop_at_crossing=False)
    compiled = bool(compiled_parts(module))
    return _Setup(device, outcomes, communicates, snapshot, budget, capacity, limits, max_seconds, compiled)


def search_in_fit(trainer: Any, module: Any, config: SearchConfig) -> SearchResult:
    """Run the search inside a fit that has started (from ``on_fit_start`` or ``on_train_epoch_start``).

    Sets the found size where Lightning's finder does (``lightning_setattr``: module attribute,
    hparams or datamodule) and, with ``keep_effective_batch_size``, ``trainer.accumulate_grad_batches``.
    """
    started = time.perf_counter()
    check_searchable(trainer, module, config)
    setup = _set_up(trainer, module, config)
    original = (setup.snapshot.batch_size, trainer.accumulate_grad_batches)
    checkpointing = None
    try:
        checkpointing = _checkpoint_for_trials(module, config)
        result = _search(trainer, module, config, setup)
    except BaseException:
        # the search failed: putting the state back must not replace its error with one of its own
        try:
            _clean_up(trainer, module, config, setup.outcomes, checkpointing, setup.snapshot, setup.device)
        except Exception as cleanup_error:  # noqa: BLE001 - reported, the search's own error goes on
            warnings.warn(
                f"memkit: after the failed batch-size search, putting the trainer's state back failed too "
                f"({type(cleanup_error).__name__}: {cleanup_error}); the search's error follows",
                RuntimeWarning,
                stacklevel=2,
            )
        raise
    _clean_up(trainer, module, config, setup.outcomes, checkpointing, setup.snapshot, setup.device)
    used = _use_found(trainer, module, config, result, original)
    result.seconds = time.perf_counter() - started
    _say_found(trainer, config, setup, result, used)
    return result


def _checkpoint_for_trials(module: Any, config: SearchConfig) -> Any:
    """The trials' checkpointing handle (``None`` without a policy, or where the module is wrapped already: a
    search started mid-training)."""
    if config.checkpoint_policy is None:
        return None
    if any(is_checkpointed(m) for m in module.modules()):
        return None
    return apply_checkpointing(module, config.checkpoint_policy)


def _search(trainer: Any, module: Any, config: SearchConfig, setup: _Setup) -> SearchResult:
    """The trials, from the estimate's prediction; the Trainer's callbacks and loggers are set aside meanwhile."""
    trainer.callbacks = []
    trainer.loggers = []
    trainer.limit_train_batches = 1.0
    trainer.limit_val_batches = 0
    module.train()
    compat.reload_train_dataloader(trainer)
    # every trial trains on the data's worst batch at its size, the same samples on every rank
    worst = worst_of_fit(trainer, setup.outcomes.largest)
    if worst is not None:
        _say(trainer, f"memkit: trials train on {trained_on(worst)} ({worst.seconds:.2f}s to find)", config.verbose)
    max_val = config.max_val
    dataset_length = compat.train_dataset_length(trainer)
    if dataset_length is not None and dataset_length < max_val:
        max_val = dataset_length
    _check_state_fits(module, setup.budget)
    growth, predicted, unavailable, estimate_seconds = _prediction(trainer, module, config, setup, worst)
    search: BoundedSearch | None = None  # made below: the trials read its deadline

    def run_trial(size: int) -> Trial:
        setup.snapshot.restore_requires_grad()  # the last trial may have stopped inside toggle_optimizer's window
        # no deadline where a step communicates: a rank stopped after its step would leave the others waiting
        deadline = search.deadline if search is not None else None
        trainer.callbacks = [deadline] if deadline is not None and not setup.communicates else []
        try:
            return _trial(trainer, module, size, config, setup, worst)
        finally:
            trainer.callbacks = []

    search = BoundedSearch(
        run_trial,
        limits=setup.limits,
        say=lambda text: _say(trainer, text, config.verbose),
        capacity_bytes=setup.capacity,
        growth=growth,
        predicted=predicted,
        init_val=min(config.init_val, max_val) if config.init_val else None,
        max_val=max_val,
        margin=config.margin,
        max_trials=config.max_trials,
        max_seconds=setup.max_seconds,
    )
    try:
        result = search.run()
    finally:
        # run_trial's closure holds `search`, which holds run_trial (and through it the snapshot): a reference
        # cycle that kept a copy of the weights alive until the next full collection. Clearing the cell breaks it.
        search = None
    result.batch_note = (
        f"each trial trained on {trained_on(worst)}" + ("" if worst.sampler_iterable else " at its size")
        if worst is not None and worst.indices(1) is not None
        else "the trials trained on the loader's own batches: the answer holds for the batches they drew"
    )
    result.estimate_unavailable = unavailable if predicted is None else None
    if dataset_length is not None and result.batch_size >= dataset_length:
        result.reason = "dataset"
    result.dataset_length = dataset_length
    result.estimate_seconds = estimate_seconds
    return result


def _check_state_fits(module: Any, budget: MemoryBudget | None) -> None:
    if budget is None:
        return
    # this rank's share: a sharded parameter (FSDP2's DTensor) holds only its local shard here
    state_bytes = sum(local_shard(t).numel() * t.element_size() for t in module.parameters())
    if state_bytes > budget.budget_bytes:
        raise BatchSizeSearchError(
            f"the budget of {format_bytes(budget.budget_bytes)} is smaller than the model's parameters alone "
            f"({format_bytes(state_bytes)}): give a larger budget= (bytes), or a smaller model"
        )


def _prediction(trainer: Any, module: Any, config: SearchConfig, setup: _Setup, worst: Any):
    """``(growth, predicted, why it is unavailable, seconds)``: the estimate's largest batch, agreed over ranks."""
    if not config.use_estimate:
        unavailable = "use_estimate=False"
    elif setup.capacity is None:
        unavailable = "no memory capacity to predict against"
    else:
        _say(trainer, "memkit: estimating the step on fake tensors ...", config.verbose)
        started = time.perf_counter()
        growth, predicted, unavailable = _predict(trainer, module, setup.capacity, setup.device, config, worst)
        seconds = time.perf_counter() - started
        growth, predicted = setup.outcomes.prediction(growth, predicted)  # every rank must search the same sizes
        if predicted is not None:
            _say(
                trainer,
                f"memkit: the estimate predicts a largest batch of {predicted} in "
                f"{format_bytes(setup.capacity)} ({seconds:.2f}s)",
                config.verbose,
            )
            return growth, predicted, None, seconds
        unavailable = unavailable or "another rank's estimate failed"
        _say(
            trainer,
            f"memkit: the estimate was unavailable ({unavailable}): the search goes by trials alone",
            config.verbose,
        )
        return None, None, unavailable, seconds
    _say(
        trainer,
        f"memkit: the estimate was unavailable ({unavailable}): the search goes by trials alone",
        config.verbose,
    )
    return None, None, unavailable, 0.0


def _use_found(
    trainer: Any, module: Any, config: SearchConfig, result: SearchResult, original: tuple[int, int]
) -> tuple[int, int]:
    """Set the size found (and, keeping the effective batch, the accumulation) where the fit reads them; returns
    ``(batch size, accumulate_grad_batches)`` as set."""
    size, accumulate = result.batch_size, original[1]
    if config.keep_effective_batch_size:
        effective = original[0] * original[1]
        size = max(d for d in range(1, min(result.batch_size, effective) + 1) if effective % d == 0)
        accumulate = effective // size
        trainer.accumulate_grad_batches = accumulate
    _lightning_setattr(module, config.batch_arg_name, size)
    compat.reload_train_dataloader(trainer)
    return size, accumulate


def _say_found(trainer: Any, config: SearchConfig, setup: _Setup, result: SearchResult, used: tuple[int, int]) -> None:
    size, accumulate = used
    tail = (
        f" (accumulate_grad_batches={accumulate}, effective batch {size * accumulate})"
        if config.keep_effective_batch_size
        else ""
    )
    limits, max_seconds = setup.limits, setup.max_seconds
    bound = (
        f"{max_seconds or 0:g}s of trials"
        if limits is None or limits.trial_seconds is None
        else f"{max_seconds or 0:g}s of trials or {limits.trial_seconds:g}s for one trial"
    )
    limit = {
        "dataset": f"; no larger batch: the train dataset has {result.dataset_length} samples (the dataset, not "
        "memory, bounds it)",
        "time": f"; stopped before the next, larger trial would run past {bound} (time, not memory, "
        "bounds it: give max_seconds= or budget=)",
        "max_val": f"; no larger batch tried: max_val={config.max_val}",
        "max_trials": f"; stopped after max_trials={config.max_trials}",
    }.get(result.reason, "")
    proved = result.proved_trial()
    ran = (
        f"fits on {proved.batch_shapes or 'its batches'}"
        if proved is not None
        else "ran its steps too slowly for a larger one"
    )
    _say(
        trainer,
        f"memkit: batch size {result.batch_size} {ran} ({result.trial_count} trials, {result.seconds:.2f}s)"
        f"{limit}; using {size}{tail}",
        config.verbose,
    )


def _clean_up(
    trainer: Any,
    module: Any,
    config: SearchConfig,
    outcomes: Outcomes,
    checkpointing: Any,
    snapshot: Snapshot,
    device: torch.device,
) -> None:
    """After the search: its side group gone, the trials' checkpointing removed, every state put back."""
    outcomes.close()
    if checkpointing is not None:
        checkpointing.remove()
    snapshot.restore(trainer, module, config.batch_arg_name)
    release_memory(device)


def _predict(trainer: Any, module: Any, capacity: int, device: torch.device, config: SearchConfig, worst: Any):
    try:
        if worst is not None:
            batch = worst
        else:
            with preserved_rng():
                batch = next(iter(trainer.train_dataloader))
        target = "cuda" if device.type == "cuda" else "cpu"
        # on CUDA the context already lives outside `capacity` (free + reserved), so add its allowance back
        memory = capacity + (CUDA_CONTEXT_BYTES if target == "cuda" else 0)
        # Trials confirm the answer, so the prediction need only be as fine as the search's margin. (Two
        # estimates are not enough: at small batches the peak is often in the optimizer step, flat in batch.)
        prediction = predict_max_batch_size(
            module,
            memory,
            mode=trainer_mode(trainer),
            margin=0.0,
            device=target,
            batch=batch,
            max_val=config.max_val,
            tolerance=config.margin,
        )
        return prediction.growth, prediction.batch_size, None
    except Exception as error:  # noqa: BLE001 - the estimate only speeds the search up; trials decide
        why = f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else 'no message'}"
        # one warning per search, saying the step itself could not be estimated (not that memory is short)
        what = "failed" if isinstance(error, EstimateError) else "was unavailable"
        warnings.warn(f"memkit: the estimate {what} ({why}); searching by trials only", RuntimeWarning, stacklevel=2)
        return None, None, why


def _trial(trainer: Any, module: Any, size: int, config: SearchConfig, setup: _Setup, worst: Any = None) -> Trial:
    _lightning_setattr(module, config.batch_arg_name, size)
    device, budget, outcomes = setup.device, setup.budget, setup.outcomes
    if setup.compiled:
        # each trial compiles at its own size, as the fit will: the last trial's code (and the estimate's fake step,
        # which makes dynamo skip a frame it first meets) must not count against the recompile limit, nor its
        # CUDA-graph pools stay on the device
        reset_compiled()
    if device.type == "cuda":
        release_memory(device)  # the last trial's cached blocks go back: each trial starts like a fresh fit
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    recorder = BatchRecorder()
    trainer.callbacks = [*trainer.callbacks, recorder]
    try:
        ran = trial_steps(trainer, module, size, config, setup, worst)
    finally:
        if setup.compiled:
            reset_compiled()  # the fit after the search compiles afresh, at the size found
    error_text, slow = ran.error_text, ran.too_slow
    if error_text is not None:  # the failed step's tensors are only reachable through cycles now
        release_memory(device)
    fits = error_text is None and ran_every_step(ran, size, config)
    if budget is not None:
        peak = budget.accountant.peak_bytes
        if fits and not budget.stop_at_crossing and budget.peak_exceeded:
            fits = False
            error_text = (
                f"peak {format_bytes(peak)} over the budget of {format_bytes(budget.budget_bytes)} "
                f"({peak} > {budget.budget_bytes} bytes; judged after the step, which every rank finished)"
            )
    elif device.type == "cuda":
        peak = int(torch.cuda.max_memory_reserved(device))
    else:
        peak = None
    fits, peak, _ = outcomes.agree(fits, peak if fits else None, seconds=time.perf_counter() - started)
    seconds = outcomes.slowest_seconds  # the same on every rank, so the time limit stops every rank's search alike
    if fits:
        return Trial(size, True, peak, seconds, None, recorder.nbytes, recorder.shapes)
    if not outcomes.enabled:
        return Trial(
            size,
            False,
            # a trial stopped as too slow ran its steps within memory: their peak is known
            budget.accountant.peak_bytes if slow and budget is not None else None,
            seconds,
            error_text or "out of memory",
            outcome=TrialOutcome.TOO_SLOW if slow else TrialOutcome.OUT_OF_MEMORY,
        )
    failed = outcomes.failed_ranks  # every rank names the ranks that ran out; this rank's own message if it did
    where = f"out of memory on rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))}"
    return Trial(size, False, None, seconds, f"{where}: {error_text}" if error_text else where)
