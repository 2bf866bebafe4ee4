"""DeepSpeed ZeRO stage 3 on one rank: the parameters partitioned, gathered around each module's forward and backward,
an event model written from DeepSpeed 0.19's source (deepspeed/runtime/zero/stage3.py and
partition_parameters.py), as :mod:`deepspeed_zero` models stages 1 and 2.

What the model allocates, with Lightning's DeepSpeedStrategy settings:

- Each parameter's partition (``ds_tensor``: ``ceil(numel / world size)`` elements in the half dtype); the full
  parameter is freed. A parameter of at most ``stage3_param_persistence_threshold`` (1e5) elements stays gathered.
- The fp32 master partitions, stepped by the user's optimizer (``optimizer_state``, as stages 1 and 2), the flat
  gradient partition buffer (``grad_partitions_flat_buffer``, allocated at set-up) and the gradient bucket
  (``reduce_bucket_size`` elements, one, at set-up).
- Around each module that holds parameters, in forward and in backward: its parameters gathered before (one flat
  all-gather buffer, then a full tensor each), freed after; from the second step, a module's parameters fetched
  again within ``stage3_max_reuse_distance`` (1e9) elements of fetches stay gathered after its forward. Each
  gradient is copied into the bucket (autograd's own freed); a full bucket is reduce-scattered and this rank's part
  copied into its gradient partition.
- The step: the gradient partition converted to fp32 as the master's gradient, the optimizer's step, freed.

Not modelled: the prefetching of the next modules' parameters (``stage3_prefetch_bucket_size``) and
``stage3_max_live_parameters``, parameter offload.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_memkit._torch_compat import tree_flatten
from lightning_memkit.estimate.distributed.deepspeed_zero import (
    DEEPSPEED_BUCKETS,
    DEEPSPEED_GRADIENT_PARTITION,
    DeepSpeedSetup,
    _wrap_optimizer_factory,
    zero_settings,
)
from lightning_memkit.estimate.distributed.rank_step import padded_shard_numel, trainable_parameters
from lightning_memkit.estimate.distributed.strategy_options import StrategyOptions
from lightning_memkit.estimate.step.step_accountant import StepAccountant

__all__ = ["Stage3Setup", "DEEPSPEED_GATHERED"]

#: the buffer name of stage 3's gathered parameters in a rank's breakdown
DEEPSPEED_GATHERED = "deepspeed_gathered_parameters"

#: DeepSpeed's default ``stage3_param_persistence_threshold`` (elements): smaller parameters stay gathered
PERSISTENCE_THRESHOLD = 100_000
#: DeepSpeed's default ``stage3_max_reuse_distance`` (elements): a parameter fetched again within it stays gathered
MAX_REUSE_DISTANCE = 1_000_000_000


class FetchTrace:
    """The order in which modules fetched their parameters in the first step (DeepSpeed's parameter coordinator
    records it, and from the second step on releases a module's parameters after its forward only when they are not
    fetched again within ``stage3_max_reuse_distance`` elements of fetches: ``__params_to_release``)."""

    def __init__(self) -> None:
        self.order: list[nn.Module] = []
        self.numel: list[int] = []
        self.position = 0
        self.step = 0

    def fetched(self, module: nn.Module, step: int) -> None:
        if step != self.step:  # a new step: the trace is complete after the first
            self.step, self.position = step, 0
        if step <= 1:
            self.order.append(module)
            self.numel.append(sum(p.numel() for p in module.parameters(recurse=False)))
        self.position += 1

    def reused_soon(self, module: nn.Module, reuse_numel: int) -> bool:
        """Whether, in a complete trace, ``module`` is fetched again within ``reuse_numel`` elements of fetches."""
        if self.step <= 1:
            return False
        traversed = 0
        for index in range(self.position, len(self.order)):
            if traversed >= reuse_numel:
                return False
            if self.order[index] is module:
                return True
            traversed += self.numel[index]
        return False


class Stage3Setup(DeepSpeedSetup):
    """A rank under Lightning's DeepSpeedStrategy, ZeRO stage 3 (see the module's docstring)."""

    gathered = DEEPSPEED_GATHERED

    def __init__(self, world_size: int, half: torch.dtype | None, options: StrategyOptions) -> None:
        super().__init__(3, world_size, half, options)
        settings = zero_settings(options)
        self.persistence = int(settings.get("stage3_param_persistence_threshold", PERSISTENCE_THRESHOLD))
        self.bucket_count = 1
        self.reuse_numel = int(settings.get("stage3_max_reuse_distance", MAX_REUSE_DISTANCE))
        self.partitions: dict[int, torch.Tensor] = {}
        self.released: set[int] = set()  # the parameters whose full memory is freed now
        self.trace = FetchTrace()

    def wrap(self, module_copy: nn.Module, acc: StepAccountant) -> None:
        """Partitions, the fp32 master, the gradient buffers, the gather hooks and the gradient hooks."""
        self.acc = acc
        parameters = self.parameters = trainable_parameters(module_copy)
        every = list({id(p): p for p in module_copy.parameters()}.values())
        trainable = {id(p) for p in parameters}
        self.frozen = [p for p in every if id(p) not in trainable]
        for parameter in every:
            self.partitions[id(parameter)] = torch.empty(
                padded_shard_numel(parameter.numel(), self.world_size), dtype=parameter.dtype
            )
        acc.attributor.assign(list(self.partitions.values()), "parameters")
        for parameter in every:
            if parameter.numel() > self.persistence:
                self._free(parameter)
        self.partition_numel = sum(self.partitions[id(p)].numel() for p in parameters)
        self.master = torch.empty(self.partition_numel, dtype=torch.float32) if not self.offload else None
        if self.offload:
            self.host = 3 * 4 * self.partition_numel
        self.partition_grads = torch.zeros(self.partition_numel, dtype=self.dtype)
        self.claim(acc, DEEPSPEED_GRADIENT_PARTITION, [self.partition_grads])
        self.buckets = [torch.empty(self.bucket_numel, dtype=self.dtype)]
        self.claim(acc, DEEPSPEED_BUCKETS, self.buckets)
        for module in module_copy.modules():
            if any(True for _ in module.parameters(recurse=False)):
                self._hook_gathers(module)
        for parameter in parameters:
            parameter.register_post_accumulate_grad_hook(self._gradient_ready)
        _wrap_optimizer_factory(module_copy, self)

    def _hook_gathers(self, module: nn.Module) -> None:
        """The module's own parameters gathered before its forward and freed after it; gathered again when the
        gradient of its output arrives (before its backward) and each freed when its gradient is ready."""

        def after_forward(m: nn.Module, args: Any, output: Any) -> None:
            if not self.trace.reused_soon(m, self.reuse_numel):
                self._release(m)
            for tensor in tree_flatten(output)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(lambda grad: self._gather(m))

        module.register_forward_pre_hook(lambda m, args: self._gather(m))
        module.register_forward_hook(after_forward)

    def _gather(self, module: nn.Module) -> None:
        """``fetch_sub_module``: the module's partitioned parameters all-gathered into one flat buffer (their padded
        partitions of every rank), each copied out into its own full tensor, the flat buffer freed."""
        self.trace.fetched(module, self.acc.step)
        missing = [p for p in module.parameters(recurse=False) if id(p) in self.released]
        if not missing:
            return
        flat = torch.empty(sum(self.partitions[id(p)].numel() for p in missing) * self.world_size, dtype=self.dtype)
        for parameter in missing:
            self.released.discard(id(parameter))
            parameter.untyped_storage().resize_(parameter.numel() * parameter.element_size())
        del flat

    def _release(self, module: nn.Module) -> None:
        for parameter in module.parameters(recurse=False):
            if parameter.numel() > self.persistence:
                self._free(parameter)

    def _free(self, parameter: nn.Parameter) -> None:
        """``free_param``: the full parameter's memory freed (DeepSpeed swaps ``param.data`` for an empty tensor; its
        autograd functions save the parameter itself, so nothing else holds the memory: here the storage is
        resized to 0 bytes in place, which frees it under any alias too)."""
        if id(parameter) not in self.released:
            self.released.add(id(parameter))
            parameter.untyped_storage().resize_(0)

    def _gradient_ready(self, parameter: nn.Parameter) -> None:
        """The gradient into the bucket (autograd's freed); a full bucket reduce-scattered into the partition."""
        if parameter.grad is None:
            return
        numel = parameter.numel()
        if self.bucket_used + numel > self.bucket_numel:
            self.bucket_members, self.bucket_used = [], 0  # reduce-scattered into the gradient partition, in place
        if numel <= self.bucket_numel:
            self.buckets[0][self.bucket_used : self.bucket_used + numel].copy_(parameter.grad.view(-1))
        self.bucket_used += numel
        parameter.grad = None
        if numel > self.persistence:
            self._free(parameter)  # its module's backward is done with it

    def epilogue(self) -> None:
        """The end of backward: the last bucket reduced; parameters still gathered (frozen ones) freed."""
        self.bucket_members, self.bucket_used = [], 0
        for parameter in self.frozen:
            if parameter.numel() > self.persistence:
                self._free(parameter)

    def before_step(self) -> None:
        self.epilogue()

    def fp32_gradient(self) -> torch.Tensor | None:
        """The master's gradient: the gradient partition buffer converted to fp32 (the buffer stays for the next step);
        ``None`` with the optimizer offloaded (the host's)."""
        grads = self.partition_grads  # made in set-up, so never None here
        return None if self.offload or grads is None else grads.to(torch.float32)
