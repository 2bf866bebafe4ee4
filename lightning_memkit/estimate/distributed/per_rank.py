"""Per-rank memory under Lightning's multi-device strategies (DDP, FSDP, FSDP2, DeepSpeed ZeRO 1/2/3), estimated
without the cluster: one fake step of one rank, set up as the strategy sets up a rank (the module's own
``configure_model``, then FSDP and FSDP2 by their own code over a fake process group, DDP and DeepSpeed by event
models written from their source), so the rank's peak, categories and CUDA allocator come from its own events.

Every rank of a data-parallel strategy plays the same role (same model replica or same-sized shard, the same
per-rank batch), so one fake step answers for all of them.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_memkit.estimate import _torch_compat
from lightning_memkit.estimate.api import estimate_memory
from lightning_memkit.estimate.cuda.caching_allocator import AllocatorView
from lightning_memkit.estimate.distributed.ddp import DdpSetup
from lightning_memkit.estimate.distributed.deepspeed_stage3 import Stage3Setup
from lightning_memkit.estimate.distributed.deepspeed_zero import DeepSpeedSetup, wrapped_factory
from lightning_memkit.estimate.distributed.fake_group import fake_process_group
from lightning_memkit.estimate.distributed.fsdp1 import Fsdp1Setup
from lightning_memkit.estimate.distributed.fsdp2 import Fsdp2Setup
from lightning_memkit.estimate.distributed.rank_step import STRATEGY_BUFFERS, RankSetup, RankStep, run_rank_step
from lightning_memkit.estimate.distributed.sharding import Sharding, sharding_of
from lightning_memkit.estimate.distributed.strategy_options import StrategyOptions, options_of
from lightning_memkit.estimate.distributed.user_model import has_configure_model, run_configure_model
from lightning_memkit.estimate.step.settings import EstimateSettings
from lightning_memkit.estimate.step.step_accountant import StepAccountant
from lightning_memkit.modes.mode import parse_mode
from lightning_memkit.summary_table import format_table
from lightning_memkit.units import format_bytes

__all__ = ["DistributedEstimate", "estimate_distributed_memory"]


@dataclass
class DistributedEstimate:
    """One rank's memory in one training step under a multi-device strategy (all sizes in bytes).

    Attributes:
        strategy: the canonical strategy name; world_size: ranks; shard_size: ranks the states are sharded over.
        peak_bytes: the rank's peak of live tensor bytes, from the rank's own fake step.
        by_category: ``peak_bytes`` by category: the accountant's categories of the rank's step
            (:class:`~lightning_memkit.estimate.MemoryEstimate`: ``parameters``, ``gradients`` and
            ``optimizer_state`` are this rank's, shards where sharded), and ``strategy_buffers``.
        buffers: the strategy's buffers at the peak by name (``ddp_gradient_buckets``, ``fsdp_gathered_parameters``,
            ``fsdp2_gathered_parameters``, DeepSpeed's ``deepspeed_*``); they sum to ``strategy_buffers``.
        single: the :class:`~lightning_memkit.estimate.MemoryEstimate` of the rank's own fake step.
        rank_roles: how many distinct rank roles were stepped (1 for every data-parallel strategy).
        elapsed_s: wall time, seconds. notes: caveats.
        cuda: on a CUDA target, the rank's caching-allocator view (:class:`AllocatorView`), replayed from the rank's
            own allocations, resizes and frees (``single.cuda``); ``None`` elsewhere.
        host_bytes: what the rank keeps in host memory beside its device (DeepSpeed's optimizer offloaded to CPU:
            the fp32 master weights, the optimizer state and the fp32 gradient partition), not in ``peak_bytes``.
    """

    strategy: str
    world_size: int
    shard_size: int
    peak_bytes: int
    by_category: dict[str, int]
    buffers: dict[str, int]
    single: Any
    rank_roles: int = 1
    elapsed_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    cuda: AllocatorView | None = None
    host_bytes: int = 0

    @property
    def mode(self) -> str:
        """The mode's name (``"baseline"``, ``"bf16"``...)."""
        return self.single.mode

    @property
    def batch_shapes(self) -> str:
        """The shapes of the per-rank batch the step ran on."""
        return self.single.batch_shapes

    @property
    def batch_note(self) -> str:
        """Which batch that is and what the answer holds for."""
        return self.single.batch_note

    @property
    def required_bytes(self) -> int:
        """Bytes one rank's device must have: on a CUDA target the rank's own allocator view's ``device_bytes``
        (its reserved peak, the CUDA context), else ``peak_bytes``. What a planner compares with a GPU's memory."""
        return self.cuda.device_bytes if self.cuda is not None else self.peak_bytes

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``required_bytes`` included)."""
        data = asdict(self)
        data["single"] = self.single.to_dict()
        data["cuda"] = self.cuda.to_dict() if self.cuda is not None else None
        data["required_bytes"] = self.required_bytes
        return data

    def summary(self) -> str:
        """A plain-text table of the rank's peak and its categories."""
        rows = [(name, format_bytes(value)) for name, value in self.by_category.items() if value]
        rows += [(f"  {name}", format_bytes(value)) for name, value in self.buffers.items()]
        rows.append(("peak per rank (tensors)", format_bytes(self.peak_bytes)))
        if self.cuda is not None:
            rows += [
                ("CUDA allocated peak per rank", format_bytes(self.cuda.peak_allocated_bytes)),
                ("CUDA reserved peak per rank", format_bytes(self.cuda.peak_reserved_bytes)),
                ("device needs per rank", format_bytes(self.cuda.device_bytes)),
            ]
        if self.host_bytes:
            rows.append(("host memory per rank (offloaded optimizer)", format_bytes(self.host_bytes)))
        title = (
            f"memkit estimate: {self.strategy} on {self.world_size} ranks, batch {self.single.batch_size} "
            f"per rank, mode {self.single.mode}"
        )
        return title + "\n" + format_table(("", "bytes"), rows)


def estimate_distributed_memory(
    module: nn.Module,
    batch_size: int | None = None,
    *,
    strategy: Any = "ddp",
    world_size: int = 1,
    shard_size: int | None = None,
    bucket_cap_mb: float | None = None,
    gradient_as_bucket_view: bool = False,
    wrap: Any = None,
    prefetch: int = 1,
    fully_shard_kwargs: dict[str, Any] | None = None,
    fsdp_kwargs: dict[str, Any] | None = None,
    find_unused_parameters: bool = False,
    offload_optimizer: bool = False,
    deepspeed_config: dict[str, Any] | None = None,
    **estimate_kwargs: Any,
) -> DistributedEstimate:
    """Predict one rank's training-step memory under a multi-device strategy, without the cluster.

    One fake step of one rank (every data-parallel rank plays the same role), its copy of the module set up as the
    strategy sets up a rank, so the rank's peak, categories and (CUDA target) caching allocator are its own:

    - the module's own ``configure_model`` runs first, as Lightning runs it (under ``model_parallel`` with
      ``self.device_mesh``, the fake world's ``("data_parallel", "tensor_parallel")`` mesh); ``wrap=`` stands in
      for a module that has none;
    - ``ddp``: the reducer's gradient buckets, allocated when and as DDP allocates them (docs/distributed.md;
      ``bucket_cap_mb``, ``gradient_as_bucket_view``, ``find_unused_parameters``); one rank: no DDP;
    - ``fsdp*`` (FSDP1): torch's ``FullyShardedDataParallel`` itself over a fake process group, with the
      ``MixedPrecision`` Lightning derives from the precision (or ``fsdp_kwargs["mixed_precision"]``) and
      ``auto_wrap_policy=ModuleWrapPolicy(wrap)``; ``fsdp_kwargs`` are more of its arguments;
    - ``model_parallel`` (FSDP2): torch's ``fully_shard`` itself over a fake process group (``configure_model``'s,
      or ``wrap=``'s stand-in with ``fully_shard_kwargs``);
    - ``deepspeed_stage_*``: ZeRO's layout as DeepSpeedStrategy configures it (half-precision weights, fp32 master
      weights and optimizer state partitioned in the optimizer, its gradient buckets), an event model written
      from DeepSpeed's source; ``offload_optimizer=True`` keeps the optimizer on the host (``host_bytes``).

    Args:
        module, batch_size: as :func:`~lightning_memkit.estimate.estimate_memory`; ``batch_size`` is per rank.
        strategy: a name from :data:`~lightning_memkit.estimate.distributed.sharding.STRATEGIES` or a Lightning
            strategy object (its own settings are read: FSDPStrategy's ``mixed_precision``, ``sharding_strategy``
            and keyword arguments; DeepSpeedStrategy's ``config``; DDPStrategy's keyword arguments).
        world_size: the number of ranks (data-parallel degree).
        shard_size: HYBRID_SHARD's shard group (ranks of a node); default ``world_size``.
        bucket_cap_mb, gradient_as_bucket_view, find_unused_parameters: DDP's arguments (``bucket_cap_mb=None``:
            torch's default, 25 MiB buckets after a 1 MiB first one).
        wrap: module classes: FSDP's ``auto_wrap_policy`` units, or the classes ``fully_shard`` goes on when the
            module has no ``configure_model``.
        prefetch: accepted for compatibility; FSDP's own prefetching runs (``fsdp_kwargs["backward_prefetch"]``...).
        fully_shard_kwargs: FSDP2's ``fully_shard`` arguments other than ``mesh``, for ``wrap=``'s stand-in.
        fsdp_kwargs: FSDP1's ``FullyShardedDataParallel`` arguments (``mixed_precision``, ``limit_all_gathers``...).
        offload_optimizer: DeepSpeed's ``offload_optimizer`` to the CPU.
        deepspeed_config: more of DeepSpeed's ``zero_optimization`` settings (``reduce_bucket_size``...).
        estimate_kwargs: ``mode=``, ``device=``, ``optimizer=``, ``loss_fn=``, ``batch=``, ``datamodule=``,
            ``trainer=``, ``gpu=`` of :func:`~lightning_memkit.estimate.estimate_memory` (``device`` defaults to
            ``"cuda"``).

    Returns:
        a :class:`DistributedEstimate` (bytes per rank); its ``required_bytes`` is what one rank's device must have.
    """
    started = time.perf_counter()
    sharding = sharding_of(strategy, world_size, shard_size)
    options = options_of(
        strategy,
        bucket_cap_mb=bucket_cap_mb,
        gradient_as_bucket_view=gradient_as_bucket_view,
        find_unused_parameters=find_unused_parameters,
        wrap=wrap,
        fully_shard_kwargs=fully_shard_kwargs,
        fsdp_kwargs=fsdp_kwargs,
        offload_optimizer=offload_optimizer,
        deepspeed_config=deepspeed_config,
    )
    rank = _memoised_rank_step(module, batch_size, sharding, world_size, options, estimate_kwargs)
    notes = list(rank.notes)
    if prefetch != 1:
        notes.append(f"prefetch={prefetch} is not used: FSDP's own prefetching runs (fsdp_kwargs['backward_prefetch'])")
    return DistributedEstimate(
        strategy=sharding.strategy,
        world_size=world_size,
        shard_size=sharding.shard_size,
        peak_bytes=rank.peak_bytes,
        by_category=rank.categories,
        buffers=rank.buffers,
        single=rank.single,
        rank_roles=1,
        elapsed_s=time.perf_counter() - started,
        notes=notes,
        cuda=rank.single.cuda,
        host_bytes=rank.host_bytes,
    )


def _memoised_rank_step(
    module: nn.Module,
    batch_size: int | None,
    sharding: Sharding,
    world_size: int,
    options: StrategyOptions,
    estimate_kwargs: dict[str, Any],
) -> RankStep:
    """The rank's step, once per question inside a ``reusing_fake_copies()`` block: DDP's rank is the same on every
    world size above one, so a search over world sizes steps it once."""
    cache = EstimateSettings.current().reuse
    roles = min(world_size, 2) if sharding.strategy == "ddp" else world_size
    key = _rank_key(module, batch_size, sharding, roles, options, estimate_kwargs)
    if cache is not None and key is not None and key in cache.estimates:
        return cache.estimates[key]
    rank = _rank_step(module, batch_size, sharding, world_size, options, estimate_kwargs)
    if cache is not None and key is not None:
        cache.estimates[key] = rank
    return rank


def _rank_key(
    module: nn.Module,
    batch_size: int | None,
    sharding: Sharding,
    roles: int,
    options: StrategyOptions,
    estimate_kwargs: dict[str, Any],
) -> tuple[Any, ...] | None:
    """The memo key of a rank's question (objects by identity, as ``reusing_fake_copies`` promises they do not
    change), or ``None`` when it cannot be hashed."""
    kwargs = tuple(sorted((name, _by_value_or_identity(value)) for name, value in estimate_kwargs.items()))
    key = ("rank", _Identity(module), batch_size, sharding.strategy, sharding.shard_size, roles, repr(options), kwargs)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _by_value_or_identity(value: Any) -> Any:
    """A memo key's part for ``value``: the value itself where it compares by value (plain values, frozen dataclasses
    such as a ``Mode``), else the object by identity, held by the key: an id alone could be a freed object's, reused
    by the next (a plan's candidates make a new ``Mode`` each)."""
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    params = getattr(type(value), "__dataclass_params__", None)
    if params is not None and params.frozen:
        try:
            hash(value)
        except TypeError:
            return _Identity(value)
        return value
    return _Identity(value)


class _Identity:
    """An object compared by identity in a memo key, kept alive by it (so its id is never another object's)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __hash__(self) -> int:
        return id(self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.value is self.value


def _rank_step(
    module: nn.Module,
    batch_size: int | None,
    sharding: Sharding,
    world_size: int,
    options: StrategyOptions,
    estimate_kwargs: dict[str, Any],
) -> RankStep:
    """One rank's fake step under ``sharding``'s strategy, in a fake world where the strategy runs its own code."""
    mode = estimate_kwargs.get("mode")
    parsed = parse_mode(mode) if mode is not None else None
    half = parsed.true_half_dtype() if parsed is not None else None
    name = sharding.strategy
    device = estimate_kwargs.get("device", "cuda")
    precision = (parsed.precision_for(device) if parsed is not None else None) or "32-true"
    if name == "model_parallel":
        with fake_process_group(world_size) as mesh:
            fsdp2 = Fsdp2Setup(mesh, options.wrap, dict(options.fully_shard_kwargs), half)
            return run_rank_step(module, batch_size, fsdp2, estimate_kwargs)
    if name.startswith("fsdp"):
        with fake_process_group(world_size) as mesh, _torch_compat.fsdp1_storage_checks_on_fakes():
            fsdp1 = _fsdp1_setup(name, sharding, world_size, options, precision, half, mesh)
            return run_rank_step(module, batch_size, fsdp1, estimate_kwargs)
    if name.startswith("deepspeed"):
        return _deepspeed_rank_step(module, batch_size, int(name[-1]), sharding, options, parsed, estimate_kwargs)
    if world_size == 1:  # one process: no reducer is modelled, the module's own step (shared with plain estimates)
        if has_configure_model(module):
            return run_rank_step(module, batch_size, _OneDevice(half), estimate_kwargs)
        single = estimate_memory(module, batch_size, **estimate_kwargs)
        categories = {**single.by_category, STRATEGY_BUFFERS: 0}
        return RankStep(single, categories, {}, single.peak_bytes, list(single.notes))
    ddp = DdpSetup(options.bucket_cap_mb, options.gradient_as_bucket_view, options.find_unused_parameters, half)
    return run_rank_step(module, batch_size, ddp, estimate_kwargs)


def _deepspeed_rank_step(
    module: nn.Module,
    batch_size: int | None,
    stage: int,
    sharding: Sharding,
    options: StrategyOptions,
    mode: Any,
    estimate_kwargs: dict[str, Any],
) -> RankStep:
    """ZeRO's rank: the step in DeepSpeed's compute layout (a mixed precision runs as its true half: the engine
    converts the weights, Lightning's DeepSpeed precision runs no autocast), the optimizer ZeRO's around the user's."""
    kwargs = dict(estimate_kwargs)
    notes = []
    half = None
    if mode is not None:
        device = kwargs.get("device", "cuda")
        precision = mode.precision_for(device)
        half = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision, mode.true_half_dtype())
        if precision in ("bf16-mixed", "16-mixed"):
            true_half = "bf16-true" if half is torch.bfloat16 else "16-true"
            kwargs["mode"] = dataclasses.replace(mode, precision=true_half)
            notes.append(
                f"DeepSpeed runs {precision} as half-precision weights without autocast (its engine converts the "
                f"module; fp32 master weights in the optimizer): the rank's step ran as {true_half}"
            )
    holder: list[DeepSpeedSetup] = []
    if kwargs.get("optimizer") is not None:
        kwargs["optimizer"] = wrapped_factory(kwargs["optimizer"], holder)
    setup = (
        Stage3Setup(sharding.shard_size, half, options)
        if stage == 3
        else DeepSpeedSetup(stage, sharding.shard_size, half, options)
    )
    holder.append(setup)
    rank = run_rank_step(module, batch_size, setup, kwargs)
    rank.notes[:0] = notes
    return rank


def _fsdp1_setup(
    name: str,
    sharding: Sharding,
    world_size: int,
    options: StrategyOptions,
    precision: str,
    half: torch.dtype | None,
    mesh: Any,
) -> Fsdp1Setup:
    """FSDP1's set-up: Lightning's MixedPrecision for ``precision`` unless the user gave one; HYBRID_SHARD over a
    (replicas, shard group) mesh."""
    from lightning_memkit._lightning_compat import fsdp_mixed_precision

    kwargs = dict(options.fsdp_kwargs)
    mixed_precision = kwargs.pop("mixed_precision", None) or fsdp_mixed_precision(precision)
    hybrid = None
    if name == "fsdp_hybrid_shard":
        from torch.distributed.device_mesh import init_device_mesh  # inside the fake world, outside the fake step

        shape = (world_size // sharding.shard_size, sharding.shard_size)
        hybrid = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    return Fsdp1Setup(name, options.wrap, mixed_precision, half, kwargs, hybrid)


class _OneDevice(RankSetup):
    """One rank alone: the module's ``configure_model`` and the precision's conversion, no strategy."""

    def __init__(self, half: torch.dtype | None) -> None:
        super().__init__()
        self.half = half

    def build(self, module_copy: nn.Module, acc: StepAccountant) -> None:
        if has_configure_model(module_copy):
            run_configure_model(module_copy, self.half)

    def wrap(self, module_copy: nn.Module, acc: StepAccountant) -> None:
        return None
