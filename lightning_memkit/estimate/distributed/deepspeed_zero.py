"""DeepSpeed ZeRO (Lightning's DeepSpeedStrategy) on one rank: ZeRO's layout and buffers allocated on the rank's fake
step as DeepSpeed 0.19's optimizer allocates them, an event model written from its source
(deepspeed/runtime/zero/stage_1_and_2.py; stage 3 in deepspeed_stage3.py), not DeepSpeed itself (the estimate
needs no DeepSpeed installed, and DeepSpeed's engine builds ops and its own process group).

What the model allocates, with Lightning's DeepSpeedStrategy settings (``contiguous_gradients``, ``overlap_comm``,
``reduce_bucket_size=2e8`` elements; a DeepSpeedStrategy object's ``zero_optimization`` config, or
``deepspeed_config=``, overrides them):

- The weights in the half dtype (the engine converts the module for ``bf16``/``fp16``; Lightning's precision runs
  the forward without autocast), flattened into one buffer per rank padded to a multiple of ``2 x world size``
  elements (``bit16_groups_flat``); the parameters become views of it.
- The fp32 master weights of this rank's partition (``partition = padded / world size`` elements), which the
  optimizer steps (DeepSpeed hands the user's optimizer the partition as its only parameter): with its state, counted
  as ``optimizer_state`` (the ZeRO paper's 12 bytes per parameter for Adam, sharded).
- In backward, at the first gradient: the gradient buckets (``reduce_bucket_size`` elements in the half dtype, two
  with ``overlap_comm``); each gradient is copied into the bucket and becomes a view of it (autograd's own is freed);
  when a bucket is full it is all-reduced through a flat copy of its gradients (``allreduce_bucket``), copied back,
  and the gradients of parameters in this rank's partition are copied into
  ``grads_in_partition`` (their whole size, allocated once), the others dropped (stage 1 drops them at the end of
  backward). After backward the buckets are freed.
- The step: the partition's gradients flattened (half), converted to fp32 and set as the master's gradient, the
  flat half copy and ``grads_in_partition`` freed, the optimizer steps, the fp32 gradient freed, and the updated
  partition all-gathered into the flat weights (in place).
- ``offload_optimizer``: the master weights, their state and the fp32 gradient live in host memory (``host_bytes``),
  and a half-precision copy of the partition stays on the device.

Not modelled: the norm and overflow scalars, gradient clipping, DeepSpeed's own activation checkpointing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_memkit.estimate.distributed.rank_step import RankSetup, padded_shard_numel, trainable_parameters
from lightning_memkit.estimate.distributed.strategy_options import StrategyOptions
from lightning_memkit.estimate.distributed.user_model import convert_to_half, has_configure_model, run_configure_model
from lightning_memkit.estimate.step.step_accountant import StepAccountant
from lightning_memkit.estimate.step.trainer_stand_in import is_lightning_module

__all__ = ["DeepSpeedSetup", "ZeroOptimizer", "DEEPSPEED_BUCKETS", "DEEPSPEED_GRADIENT_PARTITION", "zero_settings"]

#: buffer names in a rank's breakdown
DEEPSPEED_BUCKETS = "deepspeed_gradient_buckets"
DEEPSPEED_GRADIENT_PARTITION = "deepspeed_gradient_partition"

#: Lightning's DeepSpeedStrategy defaults for what the model sizes (elements; booleans)
LIGHTNING_ZERO_DEFAULTS = {"reduce_bucket_size": 200_000_000, "overlap_comm": True, "contiguous_gradients": True}


def zero_settings(options: StrategyOptions) -> dict[str, Any]:
    """Lightning's ZeRO defaults with the caller's (or the strategy object's) ``zero_optimization`` settings."""
    return {**LIGHTNING_ZERO_DEFAULTS, **options.deepspeed_config}


class ZeroOptimizer(torch.optim.Optimizer):
    """The optimizer a LightningModule steps under ZeRO: the user's optimizer stepping this rank's fp32 master
    partition (its only parameter), with ZeRO's step around it (see the module's docstring). An ``Optimizer`` to
    Lightning's hooks, as DeepSpeed's is; it keeps no state of its own (no ``Optimizer.__init__``).

    ``state`` holds the master weights with the inner optimizer's state (both ``optimizer_state`` in the breakdown);
    ``param_groups`` are the inner optimizer's.
    """

    def __init__(self, inner: torch.optim.Optimizer, master: torch.Tensor, setup: DeepSpeedSetup) -> None:  # noqa: D107
        self.inner = inner
        self.master = master
        self.setup = setup
        for group in inner.param_groups:
            group["params"] = []
        inner.param_groups[0]["params"] = [master]
        inner.state.clear()

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]  # the inner optimizer's, read through
        return self.inner.param_groups

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]  # the inner optimizer's, read through
        return self.inner.defaults

    @property
    def state(self) -> dict[Any, dict[str, Any]]:  # type: ignore[override]  # ZeRO's state: the master and its moments
        held = {"master_weights": self.master} if not self.setup.offload else {}
        state = {} if self.setup.offload else dict(self.inner.state.get(self.master, {}))
        return {self.master: {**held, **state}}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for parameter in self.setup.parameters:
            parameter.grad = None

    def step(self, closure: Any = None) -> Any:
        self.setup.before_step()
        fp32_gradient = self.setup.fp32_gradient()
        if fp32_gradient is None:  # the optimizer offloaded: its gradient and its step on the host
            return None
        self.master.grad = fp32_gradient
        del fp32_gradient
        result = self.inner.step(closure)
        self.master.grad = None
        return result


class DeepSpeedSetup(RankSetup):
    """A rank under Lightning's DeepSpeedStrategy, ZeRO stage 1 or 2 (stage 3: :mod:`deepspeed_stage3`).

    Args:
        stage: ZeRO's stage (1 or 2).
        world_size: ranks the optimizer state (and stage 2's gradients) are partitioned over.
        precision: Lightning's precision (``bf16-mixed``, ``bf16-true``, ``16-*``: half weights; ``32-true``: fp32).
        half: the half dtype the rank's step runs in (``None`` for fp32).
        options: the strategy's options (``offload_optimizer``, ``deepspeed_config``).
    """

    def __init__(self, stage: int, world_size: int, half: torch.dtype | None, options: StrategyOptions) -> None:
        super().__init__()
        settings = zero_settings(options)
        self.stage = stage
        self.world_size = world_size
        self.half = half
        self.dtype = half or torch.float32
        self.offload = options.offload_optimizer
        self.bucket_numel = int(settings["reduce_bucket_size"])
        self.bucket_count = 2 if settings["overlap_comm"] else 1
        self.parameters: list[nn.Parameter] = []
        self.partition_numel = 0
        self.host = 0
        self.buckets: list[torch.Tensor] = []
        self.bucket_members: list[nn.Parameter] = []
        self.bucket_used = 0
        self.bucket_index = 0
        self.in_partition: set[int] = set()
        self.partition_grads: torch.Tensor | None = None
        self.partition_used = 0
        self.kept: list[torch.Tensor] = []

    def build(self, module_copy: nn.Module, acc: StepAccountant) -> None:
        """The user's ``configure_model``, then the weights in the half dtype (the engine's conversion)."""
        if has_configure_model(module_copy):
            run_configure_model(module_copy, self.half)
        convert_to_half(module_copy, self.half)

    def wrap(self, module_copy: nn.Module, acc: StepAccountant) -> None:
        """The flat weights, the fp32 master partition under the user's optimizer, the gradient hooks."""
        self.acc = acc
        parameters = self.parameters = trainable_parameters(module_copy)
        total = sum(p.numel() for p in parameters)
        alignment = 2 * self.world_size
        padded = -(-total // alignment) * alignment
        flat = torch.empty(padded, dtype=self.dtype)
        offset = 0
        for parameter in parameters:
            parameter.data = flat[offset : offset + parameter.numel()].view_as(parameter)
            offset += parameter.numel()
        self.partition_numel = padded_shard_numel(padded, self.world_size)
        self._partition_members(parameters)
        self.master = torch.empty(self.partition_numel, dtype=torch.float32) if not self.offload else None
        if self.offload:
            self.host = 3 * 4 * self.partition_numel  # fp32 master, two Adam moments (host), fp32 gradient
            self.kept.append(torch.empty(self.partition_numel, dtype=self.dtype))  # the half partition's staging
        for parameter in parameters:
            parameter.register_post_accumulate_grad_hook(self._gradient_ready)
        _wrap_optimizer_factory(module_copy, self)
        if is_lightning_module(module_copy):
            backward = module_copy.backward

            def engine_backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
                backward(loss, *args, **kwargs)
                self.epilogue()

            module_copy.backward = engine_backward  # type: ignore[method-assign]  # the engine's backward, as DeepSpeed's

    def host_bytes(self) -> int:
        return self.host

    def make_optimizer(self, inner: torch.optim.Optimizer) -> ZeroOptimizer:
        """The user's optimizer, stepping this rank's fp32 master partition."""
        master = self.master if self.master is not None else torch.empty(0, dtype=torch.float32)
        return ZeroOptimizer(inner, master, self)

    def _partition_members(self, parameters: list[nn.Parameter]) -> None:
        """The parameters that overlap this rank's (rank 0's) partition: their gradients are kept."""
        offset = 0
        for parameter in parameters:
            if offset < self.partition_numel:
                self.in_partition.add(id(parameter))
            offset += parameter.numel()

    def _gradient_ready(self, parameter: nn.Parameter) -> None:
        """``reduce_independent_p_g_buckets_and_remove_grads``: the gradient into the bucket, a full bucket reduced."""
        if parameter.grad is None:
            return
        if not self.buckets:
            self.buckets = [torch.empty(self.bucket_numel, dtype=self.dtype) for _ in range(self.bucket_count)]
            self.claim(self.acc, DEEPSPEED_BUCKETS, self.buckets)
        numel = parameter.numel()
        if self.bucket_used + numel > self.bucket_numel:
            self._reduce_bucket()
            self.bucket_index = (self.bucket_index + 1) % len(self.buckets)
        if numel <= self.bucket_numel:
            view = self.buckets[self.bucket_index][self.bucket_used : self.bucket_used + numel].view_as(parameter)
            view.copy_(parameter.grad)
            parameter.grad = view
        self.bucket_used += numel
        self.bucket_members.append(parameter)

    def _reduce_bucket(self) -> None:
        """``reduce_ipg_grads``: the bucket's gradients all-reduced through a flat copy of them (``average_tensor`` ->
        ``allreduce_bucket``'s ``flatten``, freed once copied back), then the partition's gradients copied into
        ``grads_in_partition``."""
        flat = torch.empty(self.bucket_used, dtype=self.dtype)
        del flat
        for parameter in self.bucket_members:
            if id(parameter) in self.in_partition and parameter.grad is not None:
                if self.partition_grads is None:
                    total = sum(p.numel() for p in self.parameters if id(p) in self.in_partition)
                    self.partition_grads = torch.empty(total, dtype=self.dtype)
                    self.claim(self.acc, DEEPSPEED_GRADIENT_PARTITION, [self.partition_grads])
                numel = parameter.numel()
                view = self.partition_grads[self.partition_used : self.partition_used + numel].view_as(parameter)
                view.copy_(parameter.grad)
                parameter.grad = view
                self.partition_used += numel
            elif self.stage >= 2:
                parameter.grad = None
        self.bucket_members, self.bucket_used = [], 0

    def epilogue(self) -> None:
        """``independent_gradient_partition_epilogue``: the last bucket reduced, the buckets freed, every ``.grad``
        dropped (the partition's gradients stay in ``grads_in_partition`` for the step). The next backward of an
        accumulated step copies into the same places (DeepSpeed accumulates there), not after them."""
        if self.bucket_members:
            self._reduce_bucket()
        self.buckets, self.bucket_index = [], 0
        self.partition_used = 0
        for parameter in self.parameters:
            parameter.grad = None

    def before_step(self) -> None:
        """A backward whose epilogue the step did not see (a plain module's ``loss.backward()``) ends here."""
        if self.buckets or self.bucket_members:
            self.epilogue()

    def fp32_gradient(self) -> torch.Tensor | None:
        """The master's gradient for the step: the partition's gradients flattened (half), converted to fp32, the
        flat copy and ``grads_in_partition`` freed; ``None`` with the optimizer offloaded (DeepSpeed copies each
        gradient into the host's fp32 buffer as it is reduced)."""
        if self.offload:
            self.partition_grads = None
            return None
        flat = torch.empty(self.partition_numel, dtype=self.dtype)
        fp32_gradient = flat.to(torch.float32)
        del flat
        self.partition_grads = None
        self.partition_used = 0
        return fp32_gradient


def _wrap_optimizer_factory(module_copy: nn.Module, setup: DeepSpeedSetup) -> None:
    """The LightningModule's ``configure_optimizers`` returns ZeRO's optimizer around the user's."""
    if not is_lightning_module(module_copy):
        return
    configure = module_copy.configure_optimizers

    def configure_optimizers() -> Any:
        from lightning_memkit.estimate.step.lightning_step import first_optimizer

        return setup.make_optimizer(first_optimizer(configure()))

    module_copy.configure_optimizers = configure_optimizers  # type: ignore[method-assign]  # ZeRO's optimizer around the user's


def wrapped_factory(optimizer: Any, setups: list[Any]) -> Any:
    """``optimizer=`` (``params -> optimizer``) made to return ZeRO's optimizer around it, for the setup that
    ``setups[0]`` will hold when the estimate makes the optimizer (after the wrap)."""

    def factory(params: Any) -> ZeroOptimizer:
        return setups[0].make_optimizer(optimizer(params))

    return factory
