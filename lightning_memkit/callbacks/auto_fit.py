"""AutoFit: plan the fastest way to train the user's batch within a memory budget, and apply it before the fit.

Wiring only: the plan is lightning_memkit.plan (``plan_fit``); what it applies is done by the callbacks that own
each knob (ActivationCheckpointing, ActivationOffload) and by the batch-size setter MaxBatchSize uses.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.parsing import lightning_hasattr
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_memkit import _lightning_compat as compat
from lightning_memkit.callbacks import _checks as checks
from lightning_memkit.callbacks.activation_checkpointing import ActivationCheckpointing
from lightning_memkit.callbacks.activation_offload import ActivationOffload
from lightning_memkit.estimate.cuda.gpu_target import GpuTarget
from lightning_memkit.estimate.data.batches import preserved_rng
from lightning_memkit.modes.checkpoint_policy import CheckpointBudget, describe_policy, normalize_policy
from lightning_memkit.plan.planner import plan_fit
from lightning_memkit.plan.result import PlanError
from lightning_memkit.plan.space import parse_plan_modes
from lightning_memkit.search.batch_guard import BatchGuard
from lightning_memkit.search.searchable import _lightning_getattr, _lightning_setattr
from lightning_memkit.units import format_bytes, parse_bytes

__all__ = ["AutoFit"]

#: the accepted forms of AutoFit's arguments (also in docs/arguments.md)
DEVICE_MEMORY_ACCEPTED = "a positive number of bytes (int) or a size with a unit ('4GiB'), or None"
GPU_ACCEPTED = "a GPU name or generation ('h100', 'a100', 'sm90'), or None"
MODES_ACCEPTED = (
    "a comma-separated str or a list of: baseline, micro_batch, checkpoint, bf16, fp16, amp, offload "
    "(e.g. 'micro_batch,checkpoint'), or None"
)
TRIALS_ACCEPTED = "an integer from 1 to 3 (real trials at most)"
MAX_SECONDS_ACCEPTED = "a positive number of seconds, or None"


class AutoFit(Callback):
    """Fit the user's batch into a memory budget the fastest way, before training starts.

    Usage::

        trainer = Trainer(callbacks=[AutoFit(device_memory="20GiB")])
        trainer.fit(model)     # trains model.batch_size * accumulate_grad_batches samples per step, within 20 GiB

    At fit start it calls :func:`~lightning_memkit.plan.planner.plan_fit` for the module's effective batch
    (``batch_size`` times the Trainer's ``accumulate_grad_batches``) and applies ``plan.best`` (the fastest
    configuration that fit in a real trial): the micro-batch (set where ``batch_size`` lives: module, hparams or
    datamodule, as :class:`~lightning_memkit.callbacks.max_batch_size.MaxBatchSize` sets it) and
    ``trainer.accumulate_grad_batches``, so micro-batch x accumulation is the user's effective batch exactly;
    activation checkpointing (an :class:`~lightning_memkit.callbacks.activation_checkpointing.ActivationCheckpointing`
    it adds to the Trainer's callbacks); on CUDA, activation offload (an
    :class:`~lightning_memkit.callbacks.activation_offload.ActivationOffload`). When the batch fits as is it changes
    nothing. A precision is the Trainer's to set, not a callback's: when the best plan changes precision (only if
    ``modes`` allows one) it prints the ``Trainer(precision=...)`` argument to add and trains this fit with the
    plan's rule's first that ran at the Trainer's own precision.
    Under ``fast_dev_run`` (a smoke test) it plans nothing and warns, as ``MaxBatchSize`` does.

    Args:
        device_memory: the memory budget, bytes or a size (``"20GiB"``); default: the GPU's memory (free, with
            what this process caches), on CPU half the host memory available now.
        gpu: the GPU to plan for (``"h100"``, ``"a100"``, ``"sm90"``): its kernels and roofline; default: this one.
        modes: what the plan may change: ``"micro_batch,checkpoint"`` (default: memory-only changes), plus
            ``bf16``/``fp16``/``amp`` (a precision change) and ``offload`` (CUDA only).
        trials: the most real trials the plan runs (1 to 3); each trains a few steps on a copy of the module.
        verbose: print the plan's table and what was applied, on global rank 0.
        max_seconds: the plan's time budget, seconds; default: the estimate plus 20 steps of the user's batch (at
            least 30 s more). The estimate and trials until one fits always run, the other trials and the
            side-by-side rounds only where they fit.

    Attributes:
        plan: the :class:`~lightning_memkit.plan.result.Plan` (``None`` before fit, and on a resumed fit).
        applied: what this fit trains with: ``{"micro_batch": samples, "accumulate_grad_batches": n,
            "checkpoint": policy text ("auto", "budget=0.5", class paths) or None, "offload": bool, "precision": str}``
            (plain values only); kept in checkpoints, so a fit
            resumed from one (``ckpt_path=``) applies the same without planning again.
    """

    def __init__(
        self,
        device_memory: int | str | None = None,
        gpu: str | None = None,
        modes: str | Sequence[str] | None = None,
        trials: int = 3,
        verbose: bool = True,
        max_seconds: float | None = None,
    ) -> None:
        owner = "AutoFit"
        if isinstance(device_memory, bool) or not (device_memory is None or isinstance(device_memory, (int, str))):
            raise checks.refuse(owner, "device_memory", device_memory, DEVICE_MEMORY_ACCEPTED)
        try:
            budget = None if device_memory is None else parse_bytes(device_memory)
        except ValueError as error:
            raise MisconfigurationException(
                f"{owner}(device_memory={device_memory!r}): {error}; give {DEVICE_MEMORY_ACCEPTED}"
            ) from None
        if budget is not None and budget <= 0:
            raise checks.refuse(owner, "device_memory", device_memory, DEVICE_MEMORY_ACCEPTED)
        if gpu is not None:
            checks.text(owner, "gpu", gpu, GPU_ACCEPTED)
            try:
                GpuTarget.parse(gpu)
            except (ValueError, KeyError) as error:
                raise MisconfigurationException(f"{owner}(gpu={gpu!r}): {error}; give {GPU_ACCEPTED}") from None
        if modes is not None:
            if not isinstance(modes, (str, list, tuple)) or not all(
                isinstance(m, str) for m in ([modes] if isinstance(modes, str) else modes)
            ):
                raise checks.refuse(owner, "modes", modes, MODES_ACCEPTED)
            try:
                modes = parse_plan_modes(modes)
            except ValueError as error:
                raise MisconfigurationException(f"{owner}(modes={modes!r}): {error}; give {MODES_ACCEPTED}") from None
        checks.integer(owner, "trials", trials, 1, TRIALS_ACCEPTED)
        if trials > 3:
            raise checks.refuse(owner, "trials", trials, TRIALS_ACCEPTED)
        checks.boolean(owner, "verbose", verbose)
        checks.number(owner, "max_seconds", max_seconds, MAX_SECONDS_ACCEPTED, low=0, optional=True)
        self.max_seconds = max_seconds
        self.device_memory = budget
        self.gpu = gpu
        self.modes = modes
        self.trials = trials
        self.verbose = verbose
        self.plan: Any = None
        self.applied: dict[str, Any] | None = None
        self._added: list[Callback] = []
        self._guard: BatchGuard | None = None

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not compat.fit_data_from_module(trainer):
            raise MisconfigurationException(
                "AutoFit sets the micro-batch where batch_size lives, so it cannot resize dataloaders passed straight "
                "to trainer.fit(...): build them in the LightningModule's or a LightningDataModule's "
                "train_dataloader() with self.batch_size"
            )
        if not lightning_hasattr(pl_module, "batch_size"):
            raise MisconfigurationException(
                f"AutoFit: no 'batch_size' on {type(pl_module).__name__}, its hparams or the datamodule: add "
                "self.batch_size = <int> and build train_dataloader() with it, so the plan's micro-batch can be set"
            )

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # on_fit_start, not setup: a resumed fit's callback state (``applied``) is loaded between the two, and the
        # dataloaders (the micro-batch) and the accumulation are read only after it, when the fit loop starts.
        if trainer.ckpt_path is not None and self.applied is not None:
            if self.verbose and trainer.is_global_zero:
                print(
                    f"memkit AutoFit: resumed from {trainer.ckpt_path}: applying the checkpointed run's plan "
                    f"({_describe(self.applied)}), no planning",
                    flush=True,
                )
            self._apply(trainer, pl_module, self.applied)
            return
        if trainer.fast_dev_run:  # type: ignore[attr-defined]  # set by Lightning's connectors, not declared on Trainer
            # as MaxBatchSize and Lightning's BatchSizeFinder: a smoke test of a few batches runs no trial
            rank_zero_warn(
                "AutoFit: no planning under fast_dev_run (a smoke test of a few batches); training uses the batch "
                "size and accumulation as set. Run without fast_dev_run to plan."
            )
            return
        if trainer.world_size > 1:
            # a plan for several devices chooses the strategy, which the Trainer has set before any callback runs
            raise MisconfigurationException(
                f"AutoFit plans one device; this fit runs on {trainer.world_size}. Plan the strategy before the fit: "
                f"`memkit plan FILE.py:Module --world-size {trainer.world_size}` (or plan_fit(module, "
                f"world_size={trainer.world_size})) gives the Trainer's strategy and arguments"
            )
        size = int(_getattr(pl_module, "batch_size"))
        effective = size * int(trainer.accumulate_grad_batches)
        try:
            with preserved_rng():  # the plan's trials and timings must not change the fit's random stream
                self.plan = plan_fit(
                    pl_module,
                    batch_size=effective,
                    device_memory=self.device_memory,
                    gpu=self.gpu,
                    device=trainer.strategy.root_device,
                    modes=self.modes,
                    datamodule=trainer.datamodule,  # type: ignore[attr-defined]  # set by Lightning's connectors, not declared on Trainer
                    trials=self.trials,
                    verbose=self.verbose and trainer.is_global_zero,
                    max_seconds=self.max_seconds,
                )
        except PlanError as error:
            raise MisconfigurationException(f"AutoFit: {error}") from None
        plan = self.plan
        if self.verbose and trainer.is_global_zero:
            print(plan.table(), flush=True)
        if plan.proved_micro_batch is not None and (plan.fits_as_is or self._choose_quietly(trainer, plan)):
            self._guard = BatchGuard(plan.proved_micro_batch)  # a larger training batch than the trial's is reported
        if plan.fits_as_is:
            self.applied = {
                "micro_batch": size,
                "accumulate_grad_batches": int(trainer.accumulate_grad_batches),
                "checkpoint": None,
                "offload": False,
                "precision": str(trainer.precision),
            }
            self._say(
                trainer,
                f"memkit AutoFit: batch {effective} fits in {format_bytes(plan.budget_bytes)} as is; nothing changed",
            )
            return
        chosen = self._choose(trainer, plan)
        if chosen is None:
            raise MisconfigurationException(
                f"AutoFit: no configuration of batch {effective} fit in {format_bytes(plan.budget_bytes)} in a real "
                "trial (see the table above): give more memory (device_memory=), allow more modes "
                "(modes='micro_batch,checkpoint,bf16'), or train a smaller batch"
            )
        self.applied = {
            "micro_batch": chosen.micro_batch,
            "accumulate_grad_batches": chosen.accumulation,
            "checkpoint": _policy_text(chosen.checkpoint),
            "offload": bool(chosen.offload),
            "precision": chosen.precision,
        }
        self._apply(trainer, pl_module, self.applied)
        self._say(
            trainer,
            f"memkit AutoFit: training {_describe(self.applied)} (effective batch {effective}, "
            f"budget {format_bytes(plan.budget_bytes)})",
        )

    def _choose(self, trainer: Trainer, plan: Any) -> Any:
        """``plan.best``, or, when it changes precision, the plan's first (rows in the rule's order) that ran at the
        Trainer's precision (the argument to add is printed: a callback cannot change a Trainer's precision)."""
        best = plan.best
        precision = str(trainer.precision)
        if best is None or best.precision == precision:
            return best
        arguments = plan.trainer_arguments()
        self._say(
            trainer,
            f"memkit AutoFit: the fastest plan trains in {best.precision}, which a callback cannot set: add "
            f"Trainer(precision={best.precision!r}) (the plan's Trainer arguments: {arguments}); this fit uses "
            f"the plan's first that ran at {precision}",
        )
        ran = [
            row for row in plan.rows if row.measured_samples_per_s is not None and row.candidate.precision == precision
        ]
        if not ran:
            rank_zero_warn(
                f"AutoFit: no plan at the Trainer's precision {precision} ran; training with the plan's micro-batch, "
                f"accumulation and checkpointing at {precision}, which may not fit: add "
                f"Trainer(precision={best.precision!r})"
            )
            return dataclasses.replace(best, precision=precision)
        return ran[0].candidate

    @staticmethod
    def _choose_quietly(trainer: Trainer, plan: Any) -> bool:
        """Whether the fit will train the plan's best as its trial ran it (same precision)."""
        return plan.best is not None and plan.best.precision == str(trainer.precision)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._guard is not None:
            message = self._guard.check(batch, trainer.global_step)
            if message is not None:  # every rank checks its own batch
                warnings.warn(message, RuntimeWarning, stacklevel=2)

    def _apply(self, trainer: Trainer, pl_module: LightningModule, applied: dict[str, Any]) -> None:
        _setattr(pl_module, "batch_size", applied["micro_batch"])
        trainer.accumulate_grad_batches = applied["accumulate_grad_batches"]
        added: list[Callback] = []
        if applied.get("checkpoint") is not None:
            added.append(ActivationCheckpointing(policy=applied["checkpoint"], verbose=self.verbose))
        if applied.get("offload"):
            added.append(ActivationOffload(verbose=self.verbose))
        # after this one, so the fit's later hooks (on_train_batch_start, teardown) reach them; their setup is run here
        callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's connectors, not declared on Trainer
        position = callbacks.index(self) + 1
        for offset, callback in enumerate(added):
            callbacks.insert(position + offset, callback)
            callback.setup(trainer, pl_module, "fit")
        self._added = added
        if applied.get("precision") not in (None, str(trainer.precision)):
            self._say(
                trainer,
                f"memkit AutoFit: the plan was made for precision {applied['precision']!r}; this Trainer runs "
                f"{str(trainer.precision)!r}: add Trainer(precision={applied['precision']!r})",
            )

    def _say(self, trainer: Trainer, text: str) -> None:
        if self.verbose and trainer.is_global_zero:
            print(text, flush=True)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's connectors, not declared on Trainer
        for callback in self._added:
            callback.teardown(trainer, pl_module, stage)
            if callback in callbacks:
                callbacks.remove(callback)
        self._added = []
        compat.forget_model_logging(self)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"applied": self.applied}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.applied = state_dict.get("applied")


def _policy_text(policy: Any) -> Any:
    """A checkpoint policy as plain values ActivationCheckpointing(policy=...) reads back: ``"auto"``, ``"budget=0.5"``,
    ``"budget=512MiB"``-style text, or a list of class paths; ``None`` stays ``None``."""
    if policy is None:
        return None
    policy = normalize_policy(policy)
    if policy == "auto":
        return "auto"
    if isinstance(policy, CheckpointBudget):
        return "budget=" + (repr(policy.fraction) if policy.fraction is not None else f"{policy.bytes}B")
    if isinstance(policy, frozenset):
        return sorted(f"{c.__module__}.{c.__qualname__}" for c in policy)
    raise MisconfigurationException(
        f"AutoFit: cannot keep the checkpoint policy {policy!r} in a checkpoint; the plan's "
        "policies are 'auto', a budget or module classes"
    )


def _describe(applied: dict[str, Any]) -> str:
    parts = [f"micro-batch {applied['micro_batch']} x accumulate_grad_batches {applied['accumulate_grad_batches']}"]
    if applied.get("checkpoint") is not None:
        parts.append(f"checkpointing {describe_policy(applied['checkpoint'])}")
    if applied.get("offload"):
        parts.append("offload")
    return ", ".join(parts)


def _getattr(module: Any, name: str) -> Any:
    return _lightning_getattr(module, name)


def _setattr(module: Any, name: str, value: Any) -> None:
    _lightning_setattr(module, name, value)
