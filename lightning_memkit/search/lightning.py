"""The batch-size search wired to a Lightning Trainer: real trials through the fit loop, state put back.

Trials run Lightning's own fit loop (precision plugin, strategy, accumulation as configured) with
callbacks and loggers set aside; everything a trial changes is restored afterwards, bit for bit.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from lightning_memkit import _lightning_compat as compat
from lightning_memkit.estimate.batches import batch_size_of, preserved_rng
from lightning_memkit.errors import MemkitError
from lightning_memkit.estimate.allocator import CUDA_CONTEXT_BYTES
from lightning_memkit.oom import is_out_of_memory
from lightning_memkit.search.budget import MemoryBudget
from lightning_memkit.search.core import SearchError, SearchResult, Trial
from lightning_memkit.search.limits import BoundedSearch, TrialLimits, TrialTooSlow
from lightning_memkit.search.worst_trials import BatchRecorder, worst_loader, worst_of_fit
from lightning_memkit.units import format_bytes

__all__ = ["SearchConfig", "search_in_fit", "BatchSizeSearchError", "cuda_capacity_bytes"]


class BatchSizeSearchError(MemkitError, ValueError):
    """The search cannot run on this setup; the message says what to change."""


@dataclass
class SearchConfig:
    """The search's settings (see :class:`~lightning_memkit.callbacks.max_batch_size.MaxBatchSize`)."""

    margin: float = 0.05
    init_val: int | None = None
    max_val: int = 8192
    steps_per_trial: int = 3
    max_trials: int = 25
    budget: int | None = None
    batch_arg_name: str = "batch_size"
    keep_effective_batch_size: bool = False
    use_estimate: bool = True
    verbose: bool = True
    max_seconds: float | None = None
    #: the activation-checkpointing policy the trials train with (the caller finds it: the search never
    #: looks at callbacks)
    checkpoint_policy: Any = None


def _lightning_getattr(module: Any, name: str) -> Any:
    from lightning.pytorch.utilities.parsing import lightning_getattr

    return lightning_getattr(module, name)


def _lightning_setattr(module: Any, name: str, value: Any) -> None:
    from lightning.pytorch.utilities.parsing import lightning_setattr

    lightning_setattr(module, name, value)


def check_searchable(trainer: Any, module: Any, config: SearchConfig) -> None:
    """Raise :class:`BatchSizeSearchError` (saying what to do) when the search cannot run."""
    from lightning.pytorch.utilities.parsing import lightning_hasattr

    if not compat.fit_data_from_module(trainer):
        raise BatchSizeSearchError(
            "the batch-size search cannot resize dataloaders passed straight to trainer.fit(...): move them into "
            "the LightningModule's or a LightningDataModule's train_dataloader(), built with self.batch_size"
        )
    if not lightning_hasattr(module, config.batch_arg_name):
        raise BatchSizeSearchError(
            f"no '{config.batch_arg_name}' found on {type(module).__name__}, its hparams or the datamodule: add "
            f"self.{config.batch_arg_name} = <int> (or a hyperparameter of that name) and build train_dataloader() with it, "
            "or give batch_arg_name= the attribute you use"
        )
    # the search sets the size for each trial where Lightning's finder does: a read-only one must stop it here
    for holder, where in _batch_size_holders(module, config.batch_arg_name):
        try:
            setattr(holder, config.batch_arg_name, getattr(holder, config.batch_arg_name))
        except AttributeError as error:
            raise BatchSizeSearchError(
                f"the batch-size search sets {where}.{config.batch_arg_name} for each trial, and it cannot be set ({error}): "
                f"make it a plain attribute (self.{config.batch_arg_name} = <int> in __init__) or give its property a setter "
                f"(@{config.batch_arg_name}.setter), or give batch_arg_name= an attribute that can be set"
            ) from None
    if any(torch.nn.parameter.is_lazy(p) for p in module.parameters()):
        raise BatchSizeSearchError(
            f"{type(module).__name__} has lazy modules (nn.LazyLinear, ...) whose parameters do not exist before the first "
            "forward, so a trial cannot be undone: run one forward with an example batch before trainer.fit (e.g. in "
            "__init__), or leave MaxBatchSize out"
        )


def _batch_size_holders(module: Any, name: str) -> list[tuple[Any, str]]:
    """The objects ``lightning_setattr`` sets ``name`` on (the module, the datamodule; a hparams dict is
    always settable), each with the class name a message gives it."""
    holders = [(module, type(module).__name__)] if hasattr(module, name) else []
    trainer = getattr(module, "_trainer", None)
    datamodule = getattr(trainer, "datamodule", None)
    if datamodule is not None and hasattr(datamodule, name):
        holders.append((datamodule, type(datamodule).__name__))
    return holders


# ------------------------------------------------------------------------------------------ DDP
class _Outcomes:
    """Each trial's outcome agreed over ranks on a side gloo group with a timeout (lockstep, no deadlock).

    The group is memkit's own, never the one training communicates on, so its calls cannot interleave
    with the strategy's collectives; its timeout turns a rank that never arrives into an error.
    """

    def __init__(self, timeout_s: float = 300.0) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.enabled = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.group = None
        #: the ranks whose trial failed, at the last :meth:`agree`
        self.failed_ranks: list[int] = []
        #: the slowest rank's ``seconds`` at the last :meth:`agree`
        self.slowest_seconds = 0.0
        if self.enabled:
            from lightning_memkit.distributed import side_group

            self.group = side_group(timeout_s)

    def close(self) -> None:
        """Destroy the side group (after the search): a job of many searches must not accumulate groups."""
        from lightning_memkit.distributed import release_group

        group, self.group = self.group, None
        release_group(group)

    def agree(self, fits: bool, peak: int | None, extra: int = 0, seconds: float = 0.0) -> tuple[bool, int | None, int]:
        """(all ranks fit, max peak over ranks, min of ``extra`` over ranks); :attr:`failed_ranks` names
        the ranks that did not fit, :attr:`slowest_seconds` is the largest ``seconds`` (a trial's time: the
        search's time limit must decide the same on every rank)."""
        if not self.enabled:
            self.failed_ranks = [] if fits else [0]
            self.slowest_seconds = seconds
            return fits, peak, extra
        vector = torch.tensor([0 if fits else 1, -1 if peak is None else int(peak), int(extra), int(seconds * 1e6)], dtype=torch.int64)
        rows = self._gather(vector)
        self.failed_ranks = [rank for rank, failed in enumerate(rows[:, 0].tolist()) if failed]
        peak_max = int(rows[:, 1].max())
        self.slowest_seconds = int(rows[:, 3].max()) / 1e6
        return not self.failed_ranks, (None if peak_max < 0 else peak_max), int(rows[:, 2].min())

    def min(self, value: int) -> int:
        return self.agree(True, None, value)[2]

    def prediction(self, growth: Any, predicted: int | None) -> tuple[Any, int | None]:
        """One prediction for every rank (each estimated its own batch, and an estimate may fail on one rank
        only): none if any rank has none, else the smallest predicted size with the growth it came with."""
        if not self.enabled:
            return growth, predicted
        vector = torch.tensor([-1.0 if predicted is None or growth is None else float(predicted),
                               0.0 if growth is None else float(growth.fixed_bytes),
                               0.0 if growth is None else float(growth.per_sample_bytes)], dtype=torch.float64)
        rows = self._gather(vector)
        if bool((rows[:, 0] < 0).any()):
            return None, None
        chosen = int(rows[:, 0].argmin())
        if growth is not None:
            growth = type(growth)(float(rows[chosen, 1]), float(rows[chosen, 2]))
        return growth, int(rows[chosen, 0])

    def _gather(self, vector: torch.Tensor) -> torch.Tensor:
        gathered = [torch.empty_like(vector) for _ in range(self.dist.get_world_size())]
        self.dist.all_gather(gathered, vector, group=self.group)
        return torch.stack(gathered)


def step_communicates(trainer: Any, module: Any) -> bool:
    """Whether a training step itself waits for the other ranks, beyond what a trial can switch off.

    DDP's gradient all-reduce and buffer broadcast can be switched off for a trial (each rank then steps
    alone); FSDP's and FSDP2's all-gathers and reduce-scatters, DeepSpeed's and SyncBatchNorm's cannot:
    a rank that stops mid-step leaves the others waiting in the step's next collective.
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    if not isinstance(getattr(trainer.strategy, "model", None), DistributedDataParallel):
        return True
    return any(isinstance(m, torch.nn.SyncBatchNorm) for m in module.modules())


def _no_barrier(*args: Any, **kwargs: Any) -> None:
    return None


def _first_argument(value: Any, *args: Any, **kwargs: Any) -> Any:
    return value


@contextlib.contextmanager
def _rank_local(trainer: Any) -> Iterator[None]:
    """Inside a trial no rank waits for another: gradient sync, buffer broadcast and Lightning's
    barriers/reductions are turned off, so a rank that alone runs out of memory cannot deadlock."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        yield
        return
    strategy = trainer.strategy
    wrapped = getattr(strategy, "model", None)
    saved_sync = getattr(wrapped, "require_backward_grad_sync", None)
    saved_broadcast = getattr(wrapped, "broadcast_buffers", None)
    stubs = {"barrier": _no_barrier, "reduce": _first_argument, "reduce_boolean_decision": _first_argument, "broadcast": _first_argument}
    for name, stub in stubs.items():
        setattr(strategy, name, stub)
    if saved_sync is not None:
        wrapped.require_backward_grad_sync = False
    if saved_broadcast is not None:
        wrapped.broadcast_buffers = False
    try:
        with compat.no_per_step_sigterm_broadcast(trainer):
            yield
    finally:
        for name in stubs:
            delattr(strategy, name)  # the class's methods show through again
        if saved_sync is not None:
            wrapped.require_backward_grad_sync = saved_sync
        if saved_broadcast is not None:
            wrapped.broadcast_buffers = saved_broadcast


# ------------------------------------------------------------------------------------------ state
def _to_host(tree: Any) -> Any:
    """A deep copy of ``tree`` with every tensor copied to the CPU (bit for bit)."""
    from torch.utils._pytree import tree_map

    copied = tree_map(lambda leaf: leaf.detach().to("cpu", copy=True) if isinstance(leaf, torch.Tensor) else leaf, tree)
    return copy.deepcopy(copied)


class _Snapshot:
    """Everything a trial changes, copied in memory: weights, optimizer/scheduler/precision state,
    loop counters, RNG states, and the trainer settings the trials override."""

    def __init__(self, trainer: Any, module: Any, batch_arg_name: str) -> None:
        # on the host, so that nothing of the search holds device memory during a trial
        self.module_state = {k: _to_host(v) for k, v in module.state_dict().items()}
        # the gradients the module holds now (None before fit; the last step's mid-training): the trials'
        # last gradients must not stay alive on the device after the search
        self.gradients = [(p, None if p.grad is None else _to_host(p.grad)) for p in module.parameters()]
        # which parameters train: a trial that runs out of memory between toggle_optimizer and untoggle_optimizer
        # (manual optimization) leaves the other optimizers' parameters frozen, and the next toggle would keep them so
        self.requires_grad = [(p, p.requires_grad) for p in module.parameters()]
        self.optimizers = [_to_host(o.state_dict()) for o in trainer.optimizers]
        self.schedulers = [_to_host(c.scheduler.state_dict()) for c in trainer.lr_scheduler_configs]
        self.precision = _to_host(trainer.precision_plugin.state_dict())
        self.loop_state = copy.deepcopy(trainer.fit_loop.state_dict())
        self.loop_flags = compat.loop_flags(trainer.fit_loop)
        self.metrics = compat.logged_metrics_state(trainer)
        self.callbacks = trainer.callbacks
        self.loggers = trainer.loggers
        self.max_steps = trainer.fit_loop.epoch_loop.max_steps
        self.max_epochs = trainer.fit_loop.max_epochs
        self.limit_train_batches = trainer.limit_train_batches
        self.limit_val_batches = trainer.limit_val_batches
        self.should_stop = trainer.should_stop
        self.training = module.training
        self.batch_size = _lightning_getattr(module, batch_arg_name)
        self.rng = preserved_rng()
        self.rng.__enter__()

    def restore_requires_grad(self) -> None:
        """Every parameter trains or is frozen as it was when the search began."""
        for parameter, requires_grad in self.requires_grad:
            if parameter.requires_grad != requires_grad:
                parameter.requires_grad_(requires_grad)

    def restore(self, trainer: Any, module: Any, batch_arg_name: str) -> None:
        self.restore_requires_grad()
        with torch.no_grad():
            module.load_state_dict(self.module_state)
            for parameter, gradient in self.gradients:
                parameter.grad = None if gradient is None else gradient.to(parameter.device)
        for optimizer, state in zip(trainer.optimizers, self.optimizers):
            optimizer.load_state_dict(copy.deepcopy(state))  # torch casts the state back to each parameter's device
        for config, state in zip(trainer.lr_scheduler_configs, self.schedulers):
            config.scheduler.load_state_dict(copy.deepcopy(state))
        trainer.precision_plugin.load_state_dict(copy.deepcopy(self.precision))
        _reset_scaler(trainer)  # load_state_dict keeps an optimizer "unscaled" by a trial that ran out of memory
        trainer.callbacks = self.callbacks
        trainer.loggers = self.loggers
        trainer.fit_loop.epoch_loop.max_steps = self.max_steps
        trainer.fit_loop.max_epochs = self.max_epochs
        trainer.limit_train_batches = self.limit_train_batches
        trainer.limit_val_batches = self.limit_val_batches
        trainer.should_stop = self.should_stop
        trainer.fit_loop.load_state_dict(copy.deepcopy(self.loop_state))
        compat.set_loop_flags(trainer.fit_loop, self.loop_flags)
        compat.clear_logged_results(trainer)
        compat.restore_logged_metrics(trainer, self.metrics)
        module.train(self.training)
        _lightning_setattr(module, batch_arg_name, self.batch_size)
        self.rng.__exit__(None, None, None)


def _reset_scaler(trainer: Any) -> None:
    """Every optimizer ready for ``unscale_`` again in the precision plugin's GradScaler (``16-mixed``)."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is not None:
        from lightning_memkit.search._torch_compat import reset_scaler_optimizer_stages

        reset_scaler_optimizer_stages(scaler)


def _trainer_mode(trainer: Any) -> Any:
    """The Mode of the Trainer's precision (checkpointing, if any, is already on the module)."""
    from lightning_memkit.modes.mode import Mode

    precision = str(trainer.precision)
    if "bf16" in precision and "mixed" in precision:
        precision = "bf16-mixed"
    elif precision.startswith("16") and "mixed" in precision:
        precision = "16-mixed"
    else:
        precision = None
    return None if precision is None else Mode(precision=precision)


def _release_memory(device: torch.device) -> None:
    """Free what the last trial left (its tensors live only in reference cycles after an out-of-memory
    error) and give the caching allocator's free blocks back, so each trial starts like a fresh fit."""
    gc.collect()
    if device.type == "cuda" and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def cuda_capacity_bytes(device: torch.device) -> int:
    """The bytes a search on ``device`` may fill: what is free on the device (other processes' memory
    is not) plus what this process's allocator holds, capped by ``set_per_process_memory_fraction``."""
    _release_memory(device)
    free, total = torch.cuda.mem_get_info(device)
    capacity = int(free + torch.cuda.memory_reserved(device))
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if fraction is not None:
        try:
            capacity = min(capacity, int(fraction(device) * total))
        except (RuntimeError, TypeError):  # pragma: no cover - older torch
            pass
    return capacity


def _say(trainer: Any, text: str, verbose: bool) -> None:
    if verbose and trainer.is_global_zero:
        print(text, flush=True)


# ------------------------------------------------------------------------------------------ the search
#: the share of the host's available memory a CPU search without ``budget=`` may fill with tensors.
HOST_BUDGET_FRACTION = 0.5

#: seconds of trials a CPU search without ``budget=`` may spend (CPU steps at large batches are slow, and
#: host memory seldom bounds them): the search stops before a trial projected to end past it.
CPU_MAX_SECONDS = 60.0


def host_search_budget_bytes() -> int:
    """The default CPU search budget: :data:`HOST_BUDGET_FRACTION` of the host memory available now, in bytes."""
    import psutil

    return int(psutil.virtual_memory().available * HOST_BUDGET_FRACTION)


def search_in_fit(trainer: Any, module: Any, config: SearchConfig) -> SearchResult:
    """Run the search inside a fit that has started (from ``on_fit_start`` or ``on_train_epoch_start``).

    Sets the found size where Lightning's finder does (``lightning_setattr``: module attribute,
    hparams or datamodule) and, with ``keep_effective_batch_size``, ``trainer.accumulate_grad_batches``.
    """
    started = time.perf_counter()
    check_searchable(trainer, module, config)
    device = trainer.strategy.root_device
    outcomes = _Outcomes()
    # Under FSDP / model parallel a trial's step cannot be made rank-local: no rank may stop mid-step, so a
    # trial is judged by its measured peak against the budget after its steps end, on every rank.
    communicates = step_communicates(trainer, module)
    snapshot = _Snapshot(trainer, module, config.batch_arg_name)
    original_size = snapshot.batch_size
    original_accumulate = trainer.accumulate_grad_batches
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
        _say(trainer, f"memkit: no budget= on CPU: tensors are counted against {format_bytes(budget.budget_bytes)} "
                      f"({HOST_BUDGET_FRACTION:.0%} of the host memory available now); {limits.announcement()}; "
                      "give budget= (e.g. budget='2GiB') for a memory limit of your own", config.verbose)
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
    result: SearchResult | None = None
    checkpoint_policy = config.checkpoint_policy
    if checkpoint_policy is not None:
        from lightning_memkit.modes.checkpointing import is_checkpointed

        if any(is_checkpointed(m) for m in module.modules()):
            checkpoint_policy = None  # already wrapped (a search started mid-training)
    checkpointing = None
    try:
        if checkpoint_policy is not None:
            from lightning_memkit.modes.checkpointing import apply_checkpointing

            checkpointing = apply_checkpointing(module, checkpoint_policy)
        trainer.callbacks = []
        trainer.loggers = []
        trainer.limit_train_batches = 1.0
        trainer.limit_val_batches = 0
        module.train()
        compat.reload_train_dataloader(trainer)
        worst = worst_of_fit(trainer)  # every trial trains on the data's worst batch at its size
        if worst is not None:
            _say(trainer, f"memkit: trials train on {worst.note} ({worst.seconds:.2f}s to find)", config.verbose)
        max_val = config.max_val
        dataset_length = compat.train_dataset_length(trainer)
        if dataset_length is not None and dataset_length < max_val:
            max_val = dataset_length
        if budget is not None:
            # this rank's share: a sharded parameter (FSDP2's DTensor) holds only its local shard here
            state_bytes = sum(_local(t).numel() * t.element_size() for t in module.parameters())
            if state_bytes > budget.budget_bytes:
                raise BatchSizeSearchError(
                    f"the budget of {format_bytes(budget.budget_bytes)} is smaller than the model's parameters alone "
                    f"({format_bytes(state_bytes)}): give a larger budget= (bytes), or a smaller model"
                )
        growth = predicted = None
        estimate_seconds = 0.0
        unavailable = None if config.use_estimate else "use_estimate=False"
        if capacity is None and config.use_estimate:
            unavailable = "no memory capacity to predict against"
        if config.use_estimate and capacity is not None:
            _say(trainer, "memkit: estimating the step on fake tensors ...", config.verbose)
            estimate_started = time.perf_counter()
            growth, predicted, unavailable = _predict(trainer, module, capacity, device, config, worst)  # the module is wrapped already
            estimate_seconds = time.perf_counter() - estimate_started
            growth, predicted = outcomes.prediction(growth, predicted)  # every rank must search the same sizes
            if predicted is not None:
                _say(trainer, f"memkit: the estimate predicts a largest batch of {predicted} in {format_bytes(capacity)} "
                              f"({estimate_seconds:.2f}s)", config.verbose)
            else:
                unavailable = unavailable or "another rank's estimate failed"
        if predicted is None:
            _say(trainer, f"memkit: the estimate was unavailable ({unavailable}): the search goes by trials alone", config.verbose)

        def run_trial(size: int) -> Trial:
            snapshot.restore_requires_grad()  # the last trial may have stopped inside toggle_optimizer's window
            # no deadline where a step communicates: a rank stopped after its step would leave the others waiting
            trainer.callbacks = [search.deadline] if search.deadline is not None and not communicates else []
            try:
                return _trial(trainer, module, size, config, budget, device, outcomes, communicates, worst)
            finally:
                trainer.callbacks = []

        search = BoundedSearch(run_trial, limits=limits, say=lambda text: _say(trainer, text, config.verbose),
                               capacity_bytes=capacity, growth=growth, predicted=predicted,
                               init_val=min(config.init_val, max_val) if config.init_val else None, max_val=max_val,
                               margin=config.margin, max_trials=config.max_trials, max_seconds=max_seconds)
        result = search.run()
        result.batch_note = (f"each trial trained on {worst.note} at its size" if worst is not None and worst.holds_for_the_run
                             else "the trials trained on the loader's own batches: the answer holds for the batches they drew")
        result.estimate_unavailable = unavailable if predicted is None else None
        if dataset_length is not None and result.batch_size >= dataset_length:
            result.reason = "dataset"
        result.estimate_seconds = estimate_seconds
    except BaseException:
        # the search failed: putting the state back must not replace its error with one of its own
        search = None
        try:
            _clean_up(trainer, module, config, outcomes, checkpointing, snapshot, device)
        except Exception as cleanup_error:  # noqa: BLE001 - reported, the search's own error goes on
            warnings.warn(f"memkit: after the failed batch-size search, putting the trainer's state back failed too "
                          f"({type(cleanup_error).__name__}: {cleanup_error}); the search's error follows", RuntimeWarning, stacklevel=2)
        raise
    else:
        # progress's closure holds `search`, which holds progress (and run_trial, which holds the snapshot): a
        # reference cycle that kept a copy of the weights alive until the next full collection. Clearing the
        # shared cell breaks it, so the copies go as soon as the snapshot is restored.
        search = None
        _clean_up(trainer, module, config, outcomes, checkpointing, snapshot, device)
    found = result.batch_size
    size, accumulate = found, original_accumulate
    if config.keep_effective_batch_size:
        effective = original_size * original_accumulate
        size = max(d for d in range(1, min(found, effective) + 1) if effective % d == 0)
        accumulate = effective // size
        trainer.accumulate_grad_batches = accumulate
    _lightning_setattr(module, config.batch_arg_name, size)
    compat.reload_train_dataloader(trainer)
    result.seconds = time.perf_counter() - started
    tail = f" (accumulate_grad_batches={accumulate}, effective batch {size * accumulate})" if config.keep_effective_batch_size else ""
    bound = (f"{max_seconds or 0:g}s of trials" if limits is None or limits.trial_seconds is None else
             f"{max_seconds or 0:g}s of trials or {limits.trial_seconds:g}s for one trial")
    limit = {"dataset": f"; no larger batch: the train dataset has {dataset_length} samples (the dataset, not memory, bounds it)",
             "time": f"; stopped before the next, larger trial would run past {bound} (time, not memory, "
                     "bounds it: give max_seconds= or budget=)",
             "max_val": f"; no larger batch tried: max_val={config.max_val}",
             "max_trials": f"; stopped after max_trials={config.max_trials}"}.get(result.reason, "")
    proved = result.proved_trial()
    ran = (f"fits on {proved.batch_shapes or 'its batches'}" if proved is not None
           else "ran its steps too slowly for a larger one")
    _say(trainer, f"memkit: batch size {found} {ran} ({result.trial_count} trials, {result.seconds:.2f}s){limit}; using {size}{tail}",
         config.verbose)
    return result


def _clean_up(trainer: Any, module: Any, config: SearchConfig, outcomes: _Outcomes, checkpointing: Any, snapshot: _Snapshot,
              device: torch.device) -> None:
    """After the search: its side group gone, the trials' checkpointing removed, every state put back."""
    outcomes.close()
    if checkpointing is not None:
        checkpointing.remove()
    snapshot.restore(trainer, module, config.batch_arg_name)
    _release_memory(device)


def _predict(trainer: Any, module: Any, capacity: int, device: torch.device, config: SearchConfig, worst: Any):
    from lightning_memkit.estimate.predict import predict_max_batch_size

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
        prediction = predict_max_batch_size(module, memory, mode=_trainer_mode(trainer), margin=0.0, device=target,
                                            batch=batch, max_val=config.max_val, tolerance=config.margin)
        return prediction.growth, prediction.batch_size, None
    except Exception as error:  # the estimate only speeds the search up; trials decide
        from lightning_memkit.estimate.core import EstimateError

        why = f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else 'no message'}"
        # one warning per search, saying the step itself could not be estimated (not that memory is short)
        what = "failed" if isinstance(error, EstimateError) else "was unavailable"
        warnings.warn(f"memkit: the estimate {what} ({why}); searching by trials only", RuntimeWarning, stacklevel=2)
        return None, None, why


def _trial(trainer: Any, module: Any, size: int, config: SearchConfig, budget: MemoryBudget | None, device: torch.device,
           outcomes: _Outcomes, communicates: bool = False, worst: Any = None) -> Trial:
    _lightning_setattr(module, config.batch_arg_name, size)
    error_text: str | None = None
    steps = 0
    if device.type == "cuda":
        _release_memory(device)  # the last trial's cached blocks go back: each trial starts like a fresh fit
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    recorder = BatchRecorder()
    trainer.callbacks = [*trainer.callbacks, recorder]
    with _rank_local(trainer):
        compat.reload_train_dataloader(trainer)
        loader = worst_loader(worst, size, compat.train_loader(trainer), config.steps_per_trial + 1) if worst else None
        if loader is not None:
            compat.use_train_loader(trainer, loader)
        compat.reset_fit_progress(trainer)
        compat.clear_logged_results(trainer)
        trainer.fit_loop.epoch_loop.max_steps = config.steps_per_trial
        trainer.fit_loop.max_epochs = max(1000, trainer.fit_loop.max_epochs or 0)
        trainer.should_stop = False
        try:
            if budget is not None:
                budget.accountant.reset_peak()
                budget.adopt(_state_tensors(trainer, module), "state")
                budget.accountant.reset_peak()
                with budget:
                    trainer.fit_loop.run()
            else:
                trainer.fit_loop.run()
        except BaseException as error:  # noqa: BLE001 - only out-of-memory (and a trial past its time limit) is caught
            if isinstance(error, TrialTooSlow):  # its next step would end past its time limit (search/limits.py)
                error_text = f"too slow: {error} ({trainer.fit_loop.epoch_loop.global_step} of {config.steps_per_trial} steps ran)"
            elif not is_out_of_memory(error):
                raise
            elif communicates:
                # The other ranks wait in this step's next collective, which this rank will never join.
                raise BatchSizeSearchError(
                    f"rank {trainer.global_rank} ran out of memory at batch size {size} inside a step of "
                    f"{type(trainer.strategy).__name__}, whose collectives the other ranks are waiting in: the search "
                    "cannot go on. Give MaxBatchSize(budget=...) below this device's memory (trials are then judged by "
                    f"their measured peak after the step, on every rank) or a smaller max_val= ({str(error).splitlines()[0][:200]})"
                ) from None
            else:
                error_text = str(error).splitlines()[0][:300]
            _reset_scaler(trainer)  # stopped between the scaler's unscale_ and update: the next trial unscales again
            traceback.clear_frames(error.__traceback__)
            del error
        steps = trainer.fit_loop.epoch_loop.global_step
        compat.drop_train_data_fetcher(trainer)  # it holds the batch it prefetched
        compat.clear_logged_results(trainer)
    if error_text is not None:  # the failed step's tensors are only reachable through cycles now
        _release_memory(device)
    fits = error_text is None and steps >= config.steps_per_trial
    if error_text is None and not fits:
        raise SearchError(f"a trial at batch size {size} ran {steps} of {config.steps_per_trial} steps: the train dataloader "
                          "ends too early; give a larger dataset or a smaller steps_per_trial")
    if budget is not None:
        peak = budget.accountant.peak_bytes
        if fits and not budget.stop_at_crossing and budget.peak_exceeded:
            fits = False
            error_text = (f"peak {format_bytes(peak)} over the budget of {format_bytes(budget.budget_bytes)} "
                          f"({peak} > {budget.budget_bytes} bytes; judged after the step, which every rank finished)")
    elif device.type == "cuda":
        peak = int(torch.cuda.max_memory_reserved(device))
    else:
        peak = None
    fits, peak, _ = outcomes.agree(fits, peak if fits else None, seconds=time.perf_counter() - started)
    seconds = outcomes.slowest_seconds  # the same on every rank, so the time limit stops every rank's search alike
    if fits:
        return Trial(size, True, peak, seconds, None, recorder.nbytes, recorder.shapes)
    if not outcomes.enabled:
        slow = (error_text or "").startswith("too slow")  # its steps ran within memory: their peak is known
        return Trial(size, False, budget.accountant.peak_bytes if slow and budget is not None else None, seconds, error_text or "out of memory")
    failed = outcomes.failed_ranks  # every rank names the ranks that ran out; this rank's own message if it did
    where = f"out of memory on rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))}"
    return Trial(size, False, None, seconds, f"{where}: {error_text}" if error_text else where)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a DTensor's local shard (``to_local()``), else the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _state_tensors(trainer: Any, module: Any) -> Iterator[torch.Tensor]:
    from lightning_memkit.meter import training_state_tensors

    return training_state_tensors(module, trainer.optimizers)
