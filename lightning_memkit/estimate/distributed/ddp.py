"""DDP (Lightning's DDPStrategy) on one rank: the reducer's gradient buckets allocated when and as torch's
``DistributedDataParallel`` allocates them, on the rank's fake step.

An event model written from the reducer's source (torch/nn/parallel/distributed.py and
torch/csrc/distributed/c10d/reducer.cpp), not DDP itself: DDP's C++ reducer reads data pointers and runs its hooks
where a fake step cannot follow. What it allocates, and when:

- At wrap, one flat bucket per parameter dtype holding every trainable parameter's gradient: torch's
  ``_compute_bucket_assignment_by_size`` with no size limit, which is DDP's initial assignment when
  ``find_unused_parameters`` is off (Lightning's ``"ddp"``), else the ``bucket_cap_mb`` buckets (the first 1 MiB
  at the default cap) over the parameters in order.
- In the second step's forward (DDP's ``_pre_forward``, once), the reducer rebuilds its buckets in the order the
  gradients became ready in the first backward (``Reducer::rebuild_buckets``): the old buckets are dropped, then
  ``bucket_cap_mb`` buckets allocated (the first 1 MiB at the default cap), by the same torch function. With
  ``gradient_as_bucket_view=True`` the gradients still alive (Lightning zeroes them after the forward) are views
  of the old buckets: each is copied into its new view as its bucket is made, so the old storage goes only when
  the last gradient has moved.
- In backward, each gradient is copied into its bucket (the all-reduce and the averaging are in place in it) and
  copied back: no allocation. With ``gradient_as_bucket_view=True`` the gradient becomes its bucket view, and the
  one autograd allocated is freed.

Not modelled: ``broadcast_buffers``' per-forward flat copy of the buffers (freed before the forward computes),
``find_unused_parameters``' bookkeeping, comm hooks.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from lightning_memkit.estimate import _torch_compat
from lightning_memkit.estimate.distributed.rank_step import RankSetup, trainable_parameters
from lightning_memkit.estimate.distributed.user_model import convert_to_half, has_configure_model, run_configure_model
from lightning_memkit.estimate.step.step_accountant import StepAccountant
from lightning_memkit.estimate.step.trainer_stand_in import is_lightning_module
from lightning_memkit.units import MiB

__all__ = ["DdpSetup", "DDP_BUCKETS"]

#: the buffer name of DDP's gradient buckets in a rank's breakdown
DDP_BUCKETS = "ddp_gradient_buckets"


class DdpSetup(RankSetup):
    """A rank under Lightning's DDPStrategy (see the module's docstring).

    Args:
        bucket_cap_mb: DDP's ``bucket_cap_mb`` (``None``: torch's default, 25 MiB with a 1 MiB first bucket).
        gradient_as_bucket_view: DDP's argument of that name.
        find_unused_parameters: DDP's argument of that name (it decides the initial bucket assignment).
        half: a true half precision's dtype, else ``None``.
    """

    def __init__(
        self,
        bucket_cap_mb: float | None,
        gradient_as_bucket_view: bool,
        find_unused_parameters: bool,
        half: torch.dtype | None,
    ) -> None:
        super().__init__()
        self.cap_bytes = int((25 if bucket_cap_mb is None else bucket_cap_mb) * MiB)
        # torch's BucketCapacityConfig: a 1 MiB first bucket only at the default cap
        self.first_bytes = _torch_compat.ddp_first_bucket_bytes() if bucket_cap_mb is None else self.cap_bytes
        self.as_view = gradient_as_bucket_view
        self.find_unused = find_unused_parameters
        self.half = half
        self.buckets: list[torch.Tensor] = []
        self.views: dict[int, torch.Tensor] = {}
        self.parameters: list[nn.Parameter] = []
        self.ready: list[nn.Parameter] = []
        self.rebuilt = False

    def build(self, module_copy: nn.Module, acc: StepAccountant) -> None:
        """The user's ``configure_model`` (it builds the model), then the precision plugin's ``convert_module``."""
        if has_configure_model(module_copy):
            run_configure_model(module_copy, self.half)
        convert_to_half(module_copy, self.half)

    def wrap(self, module_copy: nn.Module, acc: StepAccountant) -> None:
        """The reducer's initial buckets, its gradient hooks, and its rebuild in the second step's forward."""
        parameters = self.parameters = trainable_parameters(module_copy)
        limits = [self.first_bytes, self.cap_bytes] if self.find_unused else [sys.maxsize]
        self._allocate(acc, parameters, limits)
        for parameter in parameters:
            parameter.register_post_accumulate_grad_hook(self._gradient_ready)
        step = "training_step" if is_lightning_module(module_copy) else "forward"
        original = getattr(module_copy, step)

        def pre_forward(*args: Any, **kwargs: Any) -> Any:
            # Reducer::should_rebuild_buckets: once, unless find_unused_parameters (without a static graph)
            if not (self.rebuilt or self.find_unused) and acc.step >= 2 and torch.is_grad_enabled():
                self._rebuild(acc)
            return original(*args, **kwargs)

        setattr(module_copy, step, pre_forward)

    def _allocate(self, acc: StepAccountant, parameters: list[nn.Parameter], limits: list[int]) -> None:
        """Buckets for ``parameters`` as torch assigns them under ``limits`` (bytes), each a flat tensor of its
        parameters' dtype; each parameter's view into its bucket."""
        self.buckets, self.views = [], {}
        assignment = _torch_compat.ddp_bucket_assignment(parameters, limits)
        for indices in assignment:
            members = [parameters[i] for i in indices]
            bucket = torch.empty(sum(p.numel() for p in members), dtype=members[0].dtype)
            self.claim(acc, DDP_BUCKETS, [bucket])
            self.buckets.append(bucket)
            offset = 0
            for member in members:
                view = self.views[id(member)] = bucket[offset : offset + member.numel()].view_as(member)
                offset += member.numel()
                if self.as_view and member.grad is not None:  # initialize_bucket_views, at a rebuild
                    view.copy_(member.grad)
                    member.grad = view

    def _gradient_ready(self, parameter: nn.Parameter) -> None:
        """The reducer's autograd hook: the gradient copied into its bucket view (``gradient_as_bucket_view``: the
        gradient becomes the view, and autograd's own is freed); the first backward's order is kept."""
        if not self.rebuilt:
            self.ready.append(parameter)
        view = self.views.get(id(parameter))
        if view is None or parameter.grad is None:
            return
        view.copy_(parameter.grad)
        if self.as_view:
            parameter.grad = view

    def _rebuild(self, acc: StepAccountant) -> None:
        """``Reducer::rebuild_buckets``: the buckets dropped, then new ones in the first backward's gradient order
        (parameters whose gradient never became ready last, in their order)."""
        self.rebuilt = True
        ready = {id(p): p for p in self.ready}  # each once, in the order they became ready
        order = list(ready.values()) + [p for p in self.parameters if id(p) not in ready]
        self.buckets, self.views = [], {}
        self._allocate(acc, order, [self.first_bytes, self.cap_bytes])
