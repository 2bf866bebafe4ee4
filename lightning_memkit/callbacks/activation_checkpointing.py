"""ActivationCheckpointing: non-reentrant activation checkpointing for any LightningModule, as a callback.

Wiring only: the policies, the measuring and the wrapping live in lightning_memkit.modes (checkpoint_policy,
checkpoint_measure, checkpoint_wrap; applied by checkpointing).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.nn as nn
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_memkit._lightning_compat import forget_model_logging, fsdp_activation_checkpointing_configured
from lightning_memkit.callbacks import _checks as checks
from lightning_memkit.modes.checkpoint_plan import CheckpointPlan
from lightning_memkit.modes.checkpoint_policy import CheckpointBudget, describe_policy, normalize_policy, parse_budget
from lightning_memkit.modes.checkpoint_wrap import CheckpointHandle
from lightning_memkit.modes.checkpointing import apply_checkpointing, plan_checkpointing
from lightning_memkit.trace._torch_compat import is_checkpoint_wrapper, user_name
from lightning_memkit.units import MiB, format_bytes

__all__ = ["ActivationCheckpointing"]

#: the accepted forms of ActivationCheckpointing's ``policy`` and ``budget`` (also in docs/arguments.md)
POLICY_ACCEPTED = (
    "'auto', 'budget=0.5', a set of nn.Module subclasses or their class paths "
    "(['torch.nn.TransformerEncoderLayer']), a CheckpointBudget, or a callable (name, module) -> bool"
)
BUDGET_ACCEPTED = "a fraction in (0, 1] (0.5), a size with a unit ('512MiB'), a CheckpointBudget, or None"


class ActivationCheckpointing(Callback):
    """Checkpoint a LightningModule's blocks during training: less activation memory, one more forward.

    Usage::

        from lightning_memkit import ActivationCheckpointing
        trainer = Trainer(callbacks=[ActivationCheckpointing(policy="auto")])
        trainer.fit(model)        # model's code is untouched; it is restored at the end of fit

    Before the first training batch the chosen submodules are wrapped with torch's non-reentrant
    ``torch.utils.checkpoint`` (every parameter gets its gradient; dropout masks replay exactly;
    BatchNorm running statistics are updated once, not again on recompute). Works on one device, under
    DDP and under ``ModelParallelStrategy`` (FSDP2: the blocks ``fully_shard`` made are wrapped inside FSDP's
    hooks, so a recompute finds the parameters gathered). Under ``FSDPStrategy`` it wraps nothing and
    defers, with a warning, to the strategy's own ``activation_checkpointing_policy``; a model that already
    holds torch's ``checkpoint_wrapper`` (applied in ``configure_model``, say) is not wrapped twice: it warns
    once and steps aside.

    Args:
        policy: ``"auto"`` (repeated blocks: same-class children of a ModuleList/ModuleDict/Sequential), a set of
            module classes (or their class paths, ``["torch.nn.TransformerEncoderLayer"]``, imported: what a YAML
            config gives), a callable ``(qualified_name, module) -> bool``, or a budget:
            ``CheckpointBudget(fraction=0.5)`` / ``"budget=0.5"`` (of the baseline activation memory) or
            ``CheckpointBudget(bytes="512MiB")`` / ``"budget=512MiB"``. See docs/modes.md.
        budget: a budget for the activation memory: a fraction in ``(0, 1]`` of the baseline (``0.5``)
            or a size with a unit (``"512MiB"``); a bare number above 1 is refused as ambiguous. With a
            class or callable ``policy`` the budget chooses only among the modules it matches
            (``ActivationCheckpointing({MLP}, budget=0.5)``); with ``"auto"``, among the repeated blocks.
        measure: measure on the first training batch what each region saves (bytes) and costs
            (FLOPs): two extra forward passes that keep no activation (a ``saved_tensors_hooks``
            placeholder replaces every saved tensor, so their peak is about a ``no_grad`` forward's),
            no backward, RNG and running statistics restored. Budgets always measure (one more forward
            per added block when the prediction falls short). A plan measured to save no activation
            bytes (a model that already calls ``torch.utils.checkpoint`` in its forward: wrapping it again
            only recomputes twice) is undone with a warning: nothing stays wrapped.
        sample_fn: ``(pl_module, batch) -> output`` running the forward to measure; default
            ``pl_module.training_step(batch, 0)`` with ``self.log`` muted (required for manual
            optimization, whose training_step also steps the optimizer).
        verbose: print the plan (names, count, predicted and measured saving) on global rank 0.

    Its one-off measuring forwards run before any memkit step window opens (MemoryTracker, LayerTrace),
    whatever order the callbacks are listed in: at set-up it moves itself ahead of them.

    Logged once, at the first training step, to every logger: ``memory/checkpoint/regions`` (count)
    and, when measured, ``memory/checkpoint/predicted_saving_MiB`` and
    ``memory/checkpoint/activation_MiB`` (activation memory with checkpointing, exact).

    Attributes:
        plan: the :class:`~lightning_memkit.modes.checkpoint_plan.CheckpointPlan` once applied: names and
            numbers only, so a callback kept after the fit holds no tensor of the model's.
    """

    def __init__(
        self,
        policy: str
        | Sequence[str | type[nn.Module]]
        | type[nn.Module]
        | CheckpointBudget
        | Callable[[str, nn.Module], bool] = "auto",
        *,
        budget: float | str | CheckpointBudget | None = None,
        measure: bool = True,
        sample_fn: Callable[[LightningModule, Any], Any] | None = None,
        verbose: bool = True,
    ) -> None:
        owner = "ActivationCheckpointing"
        checks.boolean(owner, "measure", measure)
        checks.boolean(owner, "verbose", verbose)
        if sample_fn is not None and not callable(sample_fn):
            raise checks.refuse(owner, "sample_fn", sample_fn, "a callable (pl_module, batch) -> output, or None")
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, (int, float, str, CheckpointBudget))
        ):
            raise checks.refuse(owner, "budget", budget, BUDGET_ACCEPTED)
        try:
            policy = normalize_policy(policy)
        except ValueError as error:
            raise MisconfigurationException(f"{owner}(policy={policy!r}): {error}; give {POLICY_ACCEPTED}") from None
        if budget is not None:
            if isinstance(policy, CheckpointBudget):
                raise MisconfigurationException(
                    f"{owner}: the policy is already a budget ({describe_policy(policy)}); give budget= once"
                )
            try:
                policy = parse_budget(budget, within=None if policy == "auto" else policy)
            except ValueError as error:
                raise MisconfigurationException(
                    f"{owner}(budget={budget!r}): {error}; give {BUDGET_ACCEPTED}"
                ) from None
        self.policy = policy
        self.measure = measure
        self.sample_fn = sample_fn
        self.verbose = verbose
        self.plan: CheckpointPlan | None = None
        self._handle: CheckpointHandle | None = None
        self._pending = False

    @property
    def state_key(self) -> str:
        return f"ActivationCheckpointing[{describe_policy(self.policy)}]"

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit" or self._handle is not None:
            return
        configured = fsdp_activation_checkpointing_configured(trainer.strategy)
        if configured is not None:
            rank_zero_warn(
                "ActivationCheckpointing: the FSDPStrategy wraps its own modules, so this callback does nothing. "
                + (
                    "The strategy's activation_checkpointing_policy is used."
                    if configured
                    else "Pass FSDPStrategy(activation_checkpointing_policy={YourBlock}) to checkpoint under FSDP."
                )
            )
            return
        _run_before_step_windows(trainer, self)
        policy = self.policy
        needs_sample = isinstance(policy, CheckpointBudget)
        if needs_sample and not pl_module.automatic_optimization and self.sample_fn is None:
            raise MisconfigurationException(
                "ActivationCheckpointing(budget=...) with manual optimization: pass "
                "sample_fn=lambda module, batch: module(batch[0]) so the measuring forward does not step"
            )
        within = policy.within if isinstance(policy, CheckpointBudget) else policy
        if within is not None:
            try:
                plan_checkpointing(pl_module, within)  # fail before training when the policy matches nothing
            except ValueError as error:
                raise MisconfigurationException(f"ActivationCheckpointing: {error}") from error
        self._pending = True

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if not self._pending:
            return
        self._pending = False
        wrapped = [name for name, module in pl_module.named_modules() if is_checkpoint_wrapper(module)]
        if wrapped:
            # The model checkpoints itself (torch's checkpoint_wrapper, e.g. applied in configure_model under
            # ModelParallelStrategy): wrapping it again would recompute each block twice for no saving.
            rank_zero_warn(
                f"ActivationCheckpointing: the model already checkpoints {len(wrapped)} module(s) with torch's "
                "checkpoint_wrapper "
                f"({', '.join(user_name(n) for n in wrapped[:3])}{', ...' if len(wrapped) > 3 else ''}), so this "
                "callback wraps nothing; drop one of the two."
            )
            return
        measure = self.measure or isinstance(self.policy, CheckpointBudget)
        if measure and not pl_module.automatic_optimization and self.sample_fn is None:
            measure = False
        sample = self._sample(trainer, pl_module, batch) if measure else None
        try:
            handle = apply_checkpointing(pl_module, self.policy, sample=sample)
        except ValueError as error:
            raise MisconfigurationException(f"ActivationCheckpointing: {error}") from None
        self._handle = handle
        if isinstance(self.policy, CheckpointBudget) and trainer.world_size > 1:
            handle = self._handle = self._agree_across_ranks(trainer, pl_module, handle)
        self.plan = handle.plan
        if self._saves_nothing(trainer, self.plan):
            handle.remove()
            self._handle = None
            rank_zero_warn(
                f"ActivationCheckpointing: checkpointing {self.plan.count} region(s) ({', '.join(self.plan.names[:3])}"
                f"{', ...' if self.plan.count > 3 else ''}) saved no activation memory when measured "
                f"({format_bytes(self.plan.baseline_activation_bytes)} -> "
                f"{format_bytes(self.plan.measured_activation_bytes)}): the model may checkpoint them itself "
                "(torch.utils.checkpoint in forward), or what autograd saves there is their inputs anyway. Nothing is "
                "wrapped, so backward recomputes nothing; drop this callback, or give a policy naming other modules."
            )
            self.plan.note = (
                self.plan.note + ". " if self.plan.note else ""
            ) + "unwrapped: it saved nothing when measured"
        if self.verbose:
            rank_zero_info(self.plan.summary())
        metrics = {"memory/checkpoint/regions": float(self.plan.count)}
        if self.plan.predicted_saving_bytes is not None:
            metrics["memory/checkpoint/predicted_saving_MiB"] = self.plan.predicted_saving_bytes / MiB
        if self.plan.measured_activation_bytes is not None:
            metrics["memory/checkpoint/activation_MiB"] = self.plan.measured_activation_bytes / MiB
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    @staticmethod
    def _saves_nothing(trainer: Trainer, plan: CheckpointPlan) -> bool:
        """Whether the measured plan saves no activation bytes (every rank takes rank 0's answer)."""
        saving = plan.measured_saving_bytes
        nothing = plan.count > 0 and saving is not None and saving <= 0
        if trainer.world_size > 1:
            nothing = bool(trainer.strategy.broadcast(nothing, src=0))
        return nothing

    @staticmethod
    def _agree_across_ranks(trainer: Trainer, pl_module: LightningModule, handle: CheckpointHandle) -> CheckpointHandle:
        """The checkpointing every rank applies: rank 0's choice (each rank measured its own batch; all take rank 0's
        so every replica does the same work)."""
        names = trainer.strategy.broadcast(sorted(handle.plan.names), src=0)
        if sorted(handle.plan.names) == names or any("[" in n for n in names):
            return handle
        plan = handle.plan
        handle.remove()
        chosen = set(names)
        agreed = apply_checkpointing(pl_module, lambda name, module: name in chosen)
        agreed.plan.policy, agreed.plan.budget_bytes = plan.policy, plan.budget_bytes
        agreed.plan.note = "rank 0's choice, broadcast"
        return agreed

    def _sample(self, trainer: Trainer, pl_module: LightningModule, batch: Any) -> Callable[[], Any]:
        def run() -> Any:
            # Mute self.log for the measuring forward: the real step logs as usual.
            muted = {name: pl_module.__dict__.get(name) for name in ("log", "log_dict")}
            pl_module.__dict__["log"] = lambda *args, **kwargs: None
            pl_module.__dict__["log_dict"] = lambda *args, **kwargs: None
            try:
                with trainer.precision_plugin.train_step_context():
                    if self.sample_fn is not None:
                        return self.sample_fn(pl_module, batch)
                    return pl_module.training_step(batch, 0)
            finally:
                for name, previous in muted.items():
                    if previous is None:
                        pl_module.__dict__.pop(name, None)
                    else:
                        pl_module.__dict__[name] = previous

        return run

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._pending = False
        forget_model_logging(self)  # a callback kept after the fit must not keep the model


def _run_before_step_windows(trainer: Trainer, callback: Callback) -> None:
    """Move ``callback`` ahead of the first callback that opens a memkit step window
    (``memkit_opens_step_window``), so the measuring forwards never land in step 0's reading."""
    callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's connector, not declared
    first = next((i for i, cb in enumerate(callbacks) if getattr(cb, "memkit_opens_step_window", False)), None)
    mine = callbacks.index(callback)
    if first is not None and first < mine:
        callbacks.insert(first, callbacks.pop(mine))
