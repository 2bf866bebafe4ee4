"""MaxBatchSize: the largest batch that trains, found before fit in a few real trials guided by the estimate."""

from __future__ import annotations

import warnings
from typing import Any

from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_memkit import _lightning_compat as compat
from lightning_memkit.callbacks import _checks as checks
from lightning_memkit.callbacks.activation_checkpointing import ActivationCheckpointing
from lightning_memkit.modes.checkpoint_policy import CheckpointBudget
from lightning_memkit.search.batch_guard import BatchGuard, ProvedBatch
from lightning_memkit.search.batch_search import SearchError, SearchResult
from lightning_memkit.search.lightning import search_in_fit
from lightning_memkit.search.searchable import (
    BatchSizeSearchError,
    SearchConfig,
    _lightning_getattr,
    _lightning_setattr,
    check_searchable,
)
from lightning_memkit.units import format_bytes, parse_bytes

__all__ = ["MaxBatchSize", "find_max_batch_size"]

#: the accepted form of MaxBatchSize's ``budget`` (also in docs/arguments.md)
BUDGET_ACCEPTED = "a positive number of bytes (int) or a size with a unit ('256MiB'), or None"


class MaxBatchSize(Callback):
    """Set the largest batch size that trains, before fit starts (like Lightning's ``BatchSizeFinder``).

    Usage::

        trainer = Trainer(callbacks=[MaxBatchSize()])
        trainer.fit(model)            # model.batch_size is now the largest size that ran

    The fake-tensor estimate predicts the answer; real trials (``steps_per_trial`` steps each,
    through the Trainer's own fit loop, precision and strategy) confirm it, bisecting only between
    a size that ran and one that ran out of memory. The size returned always ran. Weights,
    optimizer state, loop counters, RNG states, callbacks and loggers are as before the search.
    Under ``fast_dev_run`` (a smoke test) there is no search, as with Lightning's finder, and a
    warning says so (``result`` stays ``None``). Its trials' side gloo group under DDP is destroyed
    after the search.

    Args:
        margin: the search stops when the largest size that ran is within this fraction of the
            smallest that ran out of memory (the answer is then within ``margin`` of the true maximum).
        init_val: the first size tried, in samples per batch (default: just below the estimate's prediction).
        max_val: never try more than this many samples per batch (also capped at the dataset's length).
        steps_per_trial: training steps per trial (the peak comes in step 2 at the latest).
        max_trials: at most this many trials.
        budget: on CPU, a memory budget (bytes or ``"256MiB"``) for live tensors, counted by the
            tensor accountant; crossing it raises an out-of-memory error, so the search is
            testable without a GPU. Without one, a CPU search uses half the host memory available
            at its start (exhausting RAM would summon the OOM killer, not an exception) and bounds
            every trial before it runs, the first included: at most 20 s each and ``max_seconds``
            (default 60 s) in all, a first trial of at most 4 samples that times a step
            (see ``lightning_memkit.search.limits``). On CUDA the memory free on the
            device (other processes' memory excluded) plus what this process caches is the budget,
            capped by ``torch.cuda.set_per_process_memory_fraction``.
        batch_arg_name: the attribute (module, hparams or datamodule) that holds the batch size.
        keep_effective_batch_size: keep ``batch_size * accumulate_grad_batches`` as before by
            choosing the largest divisor of it that fits and raising ``accumulate_grad_batches``.
        use_estimate: jump near the answer with the estimate (``False``: double, then bisect).
        verbose: print each trial as it starts (size, time limit, expected peak) and as it ends
            (outcome, peak in bytes, seconds), on rank zero.
        max_seconds: stop before a trial projected to end past this many seconds of trials (the
            answer is then the largest size that ran). Default: no limit, except 60 s on CPU without
            ``budget=``, where time, not memory, usually bounds the batch.
        search_on_resume: a fit resumed from a checkpoint (``ckpt_path=``) that holds this callback's
            state trains with the checkpointed run's batch size (and ``accumulate_grad_batches``)
            without a trial; ``True`` searches again.

    Attributes:
        result: the :class:`~lightning_memkit.search.batch_search.SearchResult` (trials, timings).
        optimal_batch_size: the size found (before ``keep_effective_batch_size``), as Lightning names it.

    Under DDP every rank runs the same trials in lockstep; each trial's outcome is agreed over the
    ranks (the size must fit on all of them), and inside a trial nothing waits for another rank, so
    a rank that alone runs out of memory cannot deadlock the others. Under FSDP, ``ModelParallelStrategy``
    (FSDP2), DeepSpeed or with SyncBatchNorm the step itself communicates, so no rank may stop in the
    middle of it: the budget (``budget=``, on CPU half the host's free memory, on CUDA the device's free
    memory) is then checked against each trial's measured peak after every rank finished its steps, and a
    failed trial names the ranks that were over. A real out-of-memory error inside such a step (CUDA,
    beyond the budget) ends the search with an error saying so: the other ranks wait in a collective that
    rank will never join: under gloo their collective fails as that rank's process ends (a few seconds),
    and Lightning's launcher ends every rank when one of its child ranks fails; under NCCL a rank left
    waiting may hold on until the strategy's ``timeout``.
    """

    def __init__(
        self,
        margin: float = 0.05,
        init_val: int | None = None,
        max_val: int = 8192,
        steps_per_trial: int = 3,
        max_trials: int = 25,
        budget: int | str | None = None,
        batch_arg_name: str = "batch_size",
        keep_effective_batch_size: bool = False,
        use_estimate: bool = True,
        verbose: bool = True,
        max_seconds: float | None = None,
        search_on_resume: bool = False,
    ) -> None:
        owner = "MaxBatchSize"
        checks.number(owner, "margin", margin, "a fraction in (0, 1), e.g. 0.05", low=0, high=1)
        checks.integer(owner, "init_val", init_val, 1, "a positive integer (samples per batch), or None", optional=True)
        checks.integer(owner, "max_val", max_val, 1, "a positive integer (samples per batch)")
        checks.integer(owner, "steps_per_trial", steps_per_trial, 1, "a positive integer (training steps per trial)")
        checks.integer(owner, "max_trials", max_trials, 1, "a positive integer (trials at most)")
        checks.number(owner, "max_seconds", max_seconds, "a positive number of seconds, or None", low=0, optional=True)
        checks.text(
            owner,
            "batch_arg_name",
            batch_arg_name,
            "the name (a non-empty str) of the attribute that holds the batch size",
        )
        for name, value in (
            ("keep_effective_batch_size", keep_effective_batch_size),
            ("use_estimate", use_estimate),
            ("verbose", verbose),
            ("search_on_resume", search_on_resume),
        ):
            checks.boolean(owner, name, value)
        if init_val is not None and init_val > max_val:
            raise MisconfigurationException(
                f"MaxBatchSize(init_val={init_val}, max_val={max_val}): init_val must not exceed max_val"
            )
        if isinstance(budget, bool) or not (budget is None or isinstance(budget, (int, str))):
            raise checks.refuse(owner, "budget", budget, BUDGET_ACCEPTED)
        try:
            budget_bytes = None if budget is None else parse_bytes(budget)
        except ValueError as error:
            raise MisconfigurationException(
                f"MaxBatchSize(budget={budget!r}): {error}; give {BUDGET_ACCEPTED}"
            ) from None
        if budget_bytes is not None and budget_bytes <= 0:
            raise checks.refuse(owner, "budget", budget, BUDGET_ACCEPTED)
        self.search_on_resume = search_on_resume
        self.config = SearchConfig(
            margin,
            init_val,
            max_val,
            steps_per_trial,
            max_trials,
            budget_bytes,
            batch_arg_name,
            keep_effective_batch_size,
            use_estimate,
            verbose,
            max_seconds,
        )
        self.result: SearchResult | None = None
        self.optimal_batch_size: int | None = None
        #: what the fit trained with after the search: ``{"batch_size": samples, "accumulate_grad_batches": n}``,
        #: kept in checkpoints so a resumed fit trains with it again
        self.trained_with: dict[str, int] | None = None
        self._exit_after_search = False
        self._guard: BatchGuard | None = None

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        try:
            check_searchable(trainer, pl_module, self.config)
        except BatchSizeSearchError as error:
            raise MisconfigurationException(str(error)) from None

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.ckpt_path is not None and self.trained_with is not None and not self.search_on_resume:
            self._reuse(trainer, pl_module, self.trained_with)  # resumed: the checkpointed run's batch, no trial
            return
        self.find(trainer, pl_module)

    def find(self, trainer: Trainer, pl_module: LightningModule) -> int:
        """Run the search now (also from ``on_train_epoch_start`` mid-training) for ``trainer``'s fit of
        ``pl_module``; returns the size found (samples per batch), also kept as ``optimal_batch_size``."""
        if trainer.fast_dev_run:  # type: ignore[attr-defined]  # set by Lightning's connectors, not declared on Trainer
            size = int(getattr(pl_module, self.config.batch_arg_name, 0) or 0)
            # as Lightning's BatchSizeFinder: no search in a smoke test, and it says so (it was silent: result None)
            rank_zero_warn(
                f"MaxBatchSize: no batch-size search under fast_dev_run (a smoke test of a few batches); training "
                f"uses the batch size as set{f' ({size})' if size else ''}. Run without fast_dev_run to search."
            )
            return size
        self.config.checkpoint_policy = _checkpoint_policy(trainer)
        try:
            self.result = search_in_fit(trainer, pl_module, self.config)
        except BatchSizeSearchError as error:
            raise MisconfigurationException(str(error)) from None
        self.optimal_batch_size = self.result.batch_size
        self._guard = _guard_of(self.result)
        self._peak_counts = (
            "tensors" if self.config.budget is not None or trainer.strategy.root_device.type != "cuda" else "reserved"
        )
        self.trained_with = {
            "batch_size": int(_lightning_getattr(pl_module, self.config.batch_arg_name)),
            "accumulate_grad_batches": int(trainer.accumulate_grad_batches),
        }
        if self._exit_after_search:
            raise compat.tuner_exit_exception()()
        return self.result.batch_size

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._guard is not None:
            message = self._guard.check(batch, trainer.global_step)
            if message is not None:  # every rank checks its own batch: a larger one on any rank is reported
                warnings.warn(message, RuntimeWarning, stacklevel=2)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        compat.forget_model_logging(self)  # a callback kept to read its result must not keep the model

    def summary_note(self) -> str | None:
        """One line for MemoryTracker's summary: the chosen batch's trial peak against the search's budget,
        and what that peak counts beside the tracker's run peak (they measure different things); ``None``
        before a search."""
        result = self.result
        if result is None:
            return None
        peaks = [
            t.peak_bytes
            for t in result.trials
            if t.fits and t.batch_size == result.batch_size and t.peak_bytes is not None
        ]
        of = f" of the {format_bytes(result.capacity_bytes)} budget" if result.capacity_bytes else ""
        peak = f"trial peak {format_bytes(peaks[-1])}{of}" if peaks else f"trials within{of or ' memory'}"
        if getattr(self, "_peak_counts", "tensors") == "tensors":
            counts = (
                "counts one step's tensors (model state, batch, step); the run peak, every live tensor of the process"
            )
        else:
            counts = "is the allocator's reserved bytes in one trial; the run peak, allocated bytes over the run"
        return f"batch {result.batch_size}: {peak}; {counts}"

    def _reuse(self, trainer: Trainer, pl_module: LightningModule, trained_with: dict[str, int]) -> int:
        """A resumed fit: the checkpointed run's batch size (and accumulation, ``trained_with``), no trial."""
        size = trained_with["batch_size"]
        _lightning_setattr(pl_module, self.config.batch_arg_name, size)
        trainer.accumulate_grad_batches = trained_with.get("accumulate_grad_batches", trainer.accumulate_grad_batches)
        if self.config.verbose and trainer.is_global_zero:
            print(
                f"memkit: resumed from {trainer.ckpt_path}: batch size {size} from the checkpoint (the search found "
                f"{self.optimal_batch_size}); no search (MaxBatchSize(search_on_resume=True) searches again)",
                flush=True,
            )
        return size

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"optimal_batch_size": self.optimal_batch_size, "trained_with": self.trained_with}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimal_batch_size = state_dict.get("optimal_batch_size")
        self.trained_with = state_dict.get("trained_with")


def _guard_of(result: SearchResult) -> BatchGuard | None:
    """A guard for the batch the search's fitting trial ran (``None`` when no trial recorded one)."""
    proved = result.proved_trial()
    if proved is None or proved.batch_bytes is None:
        return None
    return BatchGuard(
        ProvedBatch(proved.batch_bytes, proved.batch_shapes, f"MaxBatchSize's trial at batch size {proved.batch_size}")
    )


def _checkpoint_policy(trainer: Trainer) -> Any:
    """The ActivationCheckpointing policy the trials must train with, or ``None``.

    That callback wraps the module only at the first training batch, after the search; the trials
    (which run with no callbacks) wrap it themselves so they measure the mode that will train. A
    budget policy needs a measured batch: the trials then run unwrapped, a conservative answer.
    """
    callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's connectors, not declared on Trainer
    for callback in callbacks:
        if isinstance(callback, ActivationCheckpointing):
            if isinstance(callback.policy, CheckpointBudget):
                warnings.warn(
                    "memkit: the batch-size search runs without the budget checkpointing policy "
                    "(it needs a measured batch), so its answer is on the safe side",
                    RuntimeWarning,
                    stacklevel=3,
                )
                return None
            return callback.policy
    return None


def find_max_batch_size(
    trainer: Trainer, module: LightningModule, datamodule: LightningDataModule | None = None, **options: Any
) -> SearchResult:
    """Find the largest batch size that trains, before ``fit``: the search runs in a short ``fit``
    that stops after it (as Lightning's ``Tuner.scale_batch_size`` does).

    ``options`` are :class:`MaxBatchSize`'s arguments (``margin`` a fraction, ``budget`` bytes,
    ``max_val`` samples, ``max_seconds`` seconds, ...). The size found (samples per batch, always one
    whose trial ran) is set on the module, its hparams or the datamodule, so a following
    ``trainer.fit(module, datamodule)`` trains with it. Returns the ``SearchResult``: ``batch_size``
    (samples), ``trials`` (each with its ``peak_bytes`` in bytes), ``reason`` and ``seconds`` (wall time).
    """
    finder = MaxBatchSize(**options)
    finder._exit_after_search = True
    callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's connectors, not declared on Trainer
    trainer.callbacks = [*callbacks, finder]  # type: ignore[attr-defined]
    try:
        trainer.fit(module, datamodule=datamodule)
    finally:
        trainer.callbacks = [c for c in trainer.callbacks if c is not finder]  # type: ignore[attr-defined]
    if finder.result is None:
        raise SearchError(
            "the batch-size search did not run: fit ended before on_fit_start (fast_dev_run? an exception?)"
        )
    return finder.result
