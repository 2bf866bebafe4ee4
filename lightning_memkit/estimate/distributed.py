"""Per-rank memory under Lightning's multi-device strategies (DDP, FSDP, FSDP2, DeepSpeed ZeRO 1/2/3),
estimated without the cluster: FSDP2 by running torch's ``fully_shard`` on the fake copy over a fake process
group; the others by the ZeRO paper's sharding of the model states, the strategy's buffers, and one fake step.

Every rank of a data-parallel strategy plays the same role (same model replica or same-sized shard, the
same per-rank batch), so one fake step answers for all of them: world size 64 costs what world size 2 costs.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from lightning_memkit.summary_table import format_table
from lightning_memkit.units import format_bytes

__all__ = [
    "STRATEGIES",
    "DistributedEstimate",
    "ModelStates",
    "Sharding",
    "estimate_distributed_memory",
    "model_state_bytes",
    "optimizer_state_bytes_per_parameter",
    "sharding_of",
]

# What each strategy shards: (parameters, gradients, optimizer state) sharded over the data-parallel group?
# and whose precision layout it uses ("torch": autocast over fp32 parameters, as Lightning's DDP/FSDP
# mixed precision runs; "deepspeed": half-precision weights and gradients, fp32 master weights in the optimizer).
_SHARDED = {
    "ddp": (False, False, False, "torch"),
    "fsdp_no_shard": (False, False, False, "torch"),
    "deepspeed_stage_1": (False, False, True, "deepspeed"),
    "deepspeed_stage_2": (False, True, True, "deepspeed"),
    "fsdp_shard_grad_op": (False, True, True, "torch"),
    "deepspeed_stage_3": (True, True, True, "deepspeed"),
    "fsdp": (True, True, True, "torch"),  # Lightning's default sharding_strategy is FULL_SHARD
    "fsdp_full_shard": (True, True, True, "torch"),
    "fsdp_hybrid_shard": (True, True, True, "torch"),
    "model_parallel": (True, True, True, "torch"),  # ModelParallelStrategy: FSDP2 fully_shard over the data-parallel mesh
}
_ALIASES = {
    "ddp_spawn": "ddp", "ddp_fork": "ddp", "ddp_notebook": "ddp", "deepspeed": "deepspeed_stage_2",
    "fsdp_full": "fsdp_full_shard", "fsdp2": "model_parallel", "fully_shard": "model_parallel",
}
STRATEGIES: tuple[str, ...] = tuple(_SHARDED)
"""The strategy names :func:`estimate_distributed_memory` understands (Lightning's registry names, FSDP's
``sharding_strategy`` as ``fsdp_<name>``; aliases: ``ddp_spawn``, ``deepspeed`` = stage 2, ``fsdp2``)."""


@dataclass(frozen=True)
class Sharding:
    """How one strategy lays out the model states on a rank.

    Attributes:
        strategy: the canonical strategy name (one of :data:`STRATEGIES`).
        parameters, gradients, optimizer_state: whether each is sharded over the ``shard_size`` ranks.
        layout: ``"torch"`` (fp32 parameters and gradients; autocast makes half-precision copies in the
            step) or ``"deepspeed"`` (under a half precision: half-precision parameters and gradients,
            the fp32 master weights counted in the optimizer state, as the ZeRO paper does).
        shard_size: ranks one copy of the states is sharded over (the world size; HYBRID_SHARD: the ranks of a node).
    """

    strategy: str
    parameters: bool
    gradients: bool
    optimizer_state: bool
    layout: str
    shard_size: int


def sharding_of(strategy: Any, world_size: int, shard_size: int | None = None) -> Sharding:
    """The :class:`Sharding` of ``strategy`` (a name, or a Lightning strategy object) on ``world_size`` ranks.

    ``shard_size`` is HYBRID_SHARD's group (default: ``world_size``, one node); other strategies ignore it.
    Raises ``ValueError`` naming the known strategies when ``strategy`` is not one of them.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer (the number of ranks), not {world_size!r}")
    name = _strategy_name(strategy)
    if name not in _SHARDED:
        raise ValueError(f"unknown strategy {strategy!r}; choose from: {', '.join(STRATEGIES)} (or a Lightning DDPStrategy, "
                         "FSDPStrategy, DeepSpeedStrategy, ModelParallelStrategy object)")
    params, grads, optim, layout = _SHARDED[name]
    group = world_size
    if name == "fsdp_hybrid_shard" and shard_size is not None:
        if shard_size < 1 or world_size % shard_size:
            raise ValueError(f"shard_size must divide world_size ({world_size}), not {shard_size!r}")
        group = shard_size
    return Sharding(name, params, grads, optim, layout, group)


def _strategy_name(strategy: Any) -> str:
    if isinstance(strategy, str):
        name = strategy.lower().replace("-", "_")
        return _ALIASES.get(name, name)
    kind = type(strategy).__name__
    if kind in ("DDPStrategy",):
        return "ddp"
    if kind == "DeepSpeedStrategy":
        stage = int(getattr(strategy, "config", {}).get("zero_optimization", {}).get("stage", 2))
        return f"deepspeed_stage_{stage}" if stage else "ddp"
    if kind == "FSDPStrategy":
        sharding = getattr(strategy, "sharding_strategy", None)
        sharding_name = getattr(sharding, "name", str(sharding or "FULL_SHARD")).lower()
        return f"fsdp_{sharding_name}"
    if kind == "ModelParallelStrategy":
        return "model_parallel"
    return kind


@dataclass(frozen=True)
class ModelStates:
    """Per-rank bytes of the model states (parameters, gradients, optimizer state) under one strategy.

    Attributes:
        parameters_bytes, gradients_bytes, optimizer_state_bytes: bytes each rank holds (shards where sharded).
    """

    parameters_bytes: int
    gradients_bytes: int
    optimizer_state_bytes: int

    @property
    def total_bytes(self) -> int:
        """Sum of the three, bytes."""
        return self.parameters_bytes + self.gradients_bytes + self.optimizer_state_bytes


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def optimizer_state_bytes_per_parameter(optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | type = torch.optim.Adam,
                                        dtype: torch.dtype = torch.float32) -> tuple[float, int]:
    """Bytes of optimizer state per parameter element and per parameter tensor, learnt from the real optimizer.

    The optimizer's ``step`` runs twice on fake parameters of two sizes (no memory is used) and its state
    is counted: ``(bytes per element, bytes per tensor)`` — Adam in fp32: ``(8.0, 4)`` (``exp_avg`` and
    ``exp_avg_sq``; ``step`` is a 4-byte scalar per tensor); SGD without momentum: ``(0.0, 0)``.

    Args:
        optimizer: an optimizer class or ``params -> optimizer``.
        dtype: the parameters' dtype.
    """
    from lightning_memkit.estimate.fake_session import FakeSession

    session = FakeSession()
    totals = []
    sizes = (1024, 4096)
    for size in sizes:
        with session.active():
            parameter = nn.Parameter(torch.empty(size, dtype=dtype))
            instance = optimizer([parameter])
            for _ in range(2):
                parameter.grad = torch.empty(size, dtype=dtype)
                instance.step()
        seen: set[int] = set()
        nbytes = 0
        for state in instance.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and id(value) not in seen:
                    seen.add(id(value))
                    nbytes += value.numel() * value.element_size()
        totals.append(nbytes)
    per_element = (totals[1] - totals[0]) / (sizes[1] - sizes[0])
    per_tensor = int(round(totals[0] - per_element * sizes[0]))
    return per_element, per_tensor


def model_state_bytes(num_parameters: int, strategy: Any = "ddp", world_size: int = 1, *, precision: str = "16-mixed",
                      optimizer: Callable | type = torch.optim.Adam, shard_size: int | None = None) -> ModelStates:
    """Per-rank model-state bytes of ``num_parameters`` trainable parameters (the ZeRO paper's section 3 arithmetic).

    The optimizer's state per parameter is learnt from the real optimizer
    (:func:`optimizer_state_bytes_per_parameter`, fp32 state: Adam 8 bytes). Under a half ``precision``
    (``"16-mixed"``, ``"bf16-mixed"``, ``"16-true"``...) with the DeepSpeed layout, parameters and gradients are
    2 bytes and the optimizer holds a 4-byte fp32 master copy besides its state: mixed-precision Adam is
    2 + 2 + 12 = 16 bytes per parameter, sharded as ZeRO does: DDP 16Ψ, stage 1 4Ψ + 12Ψ/N, stage 2
    2Ψ + 14Ψ/N, stage 3 16Ψ/N. The torch layout (DDP, FSDP, FSDP2 under autocast) keeps fp32 parameters
    and gradients: 4 + 4 + 8 = 16 bytes for Adam. ``"32-true"``: 4 + 4 + state. Shards are rounded up
    (rank 0 holds the largest). Per-tensor state (Adam's ``step``) is left out: it is bytes per tensor, not per parameter.

    Args:
        num_parameters: trainable parameters (elements, Ψ).
        strategy: a name of :data:`STRATEGIES` (``"ddp"``, ``"fsdp"``, ``"model_parallel"`` for FSDP2, ``"deepspeed_stage_3"``...) or a Lightning strategy.
        world_size: ranks (N).
        precision: Lightning's precision string.
        optimizer: the optimizer class or factory whose state per parameter is learnt (default Adam).
        shard_size: ranks the states are sharded over (default ``world_size``; smaller for hybrid sharding).
    """
    if not isinstance(num_parameters, int) or num_parameters < 0:
        raise ValueError(f"num_parameters must be a non-negative integer, not {num_parameters!r}")
    sharding = sharding_of(strategy, world_size, shard_size)
    half = precision.startswith(("16", "bf16"))
    state_per_element, _ = optimizer_state_bytes_per_parameter(optimizer)
    if half and sharding.layout == "deepspeed":
        param_bytes, grad_bytes, optim_bytes = 2, 2, 4 + state_per_element
    elif precision in ("16-true", "bf16-true"):
        param_bytes, grad_bytes, optim_bytes = 2, 2, state_per_element / 2
    else:
        param_bytes, grad_bytes, optim_bytes = 4, 4, state_per_element
    n = sharding.shard_size

    def share(nbytes: float, sharded: bool) -> int:
        total = nbytes * num_parameters
        return int(math.ceil(total / n)) if sharded else int(math.ceil(total))

    return ModelStates(share(param_bytes, sharding.parameters), share(grad_bytes, sharding.gradients), share(optim_bytes, sharding.optimizer_state))


@dataclass
class DistributedEstimate:
    """One rank's memory in one training step under a multi-device strategy (all sizes in bytes).

    Attributes:
        strategy: the canonical strategy name; world_size: ranks; shard_size: ranks the states are sharded over.
        peak_bytes: the rank's peak of live tensor bytes (the single-process peak with the model states
            replaced by this rank's shards, plus the strategy's buffers).
        by_category: ``peak_bytes`` by category: the accountant's categories of the single-process step
            (:class:`~lightning_memkit.estimate.MemoryEstimate`) with ``parameters``, ``gradients`` and
            ``optimizer_state`` scaled to this rank's shards, plus ``strategy_buffers``.
        buffers: the strategy buffers by name (``ddp_gradient_buckets``, ``fsdp_all_gather``, ``fsdp_reduce_scatter``).
        single: the one-process :class:`~lightning_memkit.estimate.MemoryEstimate` it derives from (one fake step).
        rank_roles: how many distinct rank roles were stepped (1 for every data-parallel strategy).
        elapsed_s: wall time, seconds. notes: caveats.
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

    @property
    def mode(self) -> str:
        """The mode's name (``"baseline"``, ``"bf16"``...)."""
        return self.single.mode

    @property
    def required_bytes(self) -> int:
        """Bytes one rank's device must have: ``peak_bytes`` plus what the one-process estimate's allocator view
        adds on top of its tensors (CUDA: rounding, reserved segments, context; elsewhere nothing). FSDP2's
        estimate is the sharded step itself, so its view is the rank's own."""
        return self.peak_bytes + self.single.required_bytes - self.single.peak_bytes

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        data = asdict(self)
        data["single"] = self.single.to_dict()
        return data

    def summary(self) -> str:
        """A plain-text table of the rank's peak and its categories."""
        rows = [(name, format_bytes(value)) for name, value in self.by_category.items() if value]
        rows += [(f"  {name}", format_bytes(value)) for name, value in self.buffers.items()]
        rows.append(("peak per rank (tensors)", format_bytes(self.peak_bytes)))
        title = f"memkit estimate: {self.strategy} on {self.world_size} ranks, batch {self.single.batch_size} per rank, mode {self.single.mode}"
        return title + "\n" + format_table(("", "bytes"), rows)


def _units(module: nn.Module, wrap: Any) -> list[nn.Module]:
    """FSDP's units: the modules whose class is in ``wrap`` (a set of classes), the root holding the rest."""
    if not wrap:
        return [module]
    classes = tuple(wrap)
    return [m for m in module.modules() if isinstance(m, classes) and m is not module] + [module]


def _unit_bytes(module: nn.Module, units: list[nn.Module]) -> list[int]:
    """Each unit's own trainable parameter bytes (a parameter belongs to the innermost unit holding it)."""
    owner: dict[int, int] = {}
    for index, unit in enumerate(units[:-1]):
        for parameter in unit.parameters():
            owner.setdefault(id(parameter), index)
    sizes = [0] * len(units)
    seen: set[int] = set()
    for parameter in module.parameters():
        if parameter.requires_grad and id(parameter) not in seen:
            seen.add(id(parameter))
            sizes[owner.get(id(parameter), len(units) - 1)] += parameter.numel() * parameter.element_size()
    return sizes


@contextlib.contextmanager
def _fake_process_group(world_size: int) -> Iterator[Any]:
    """A fake default process group of ``world_size`` ranks (this process is rank 0; collectives move no
    data) and a 1-D CPU device mesh over it, for the length of the block.

    torch's ``FakeProcessGroup`` backend is registered by the private ``torch.testing._internal.distributed.fake_pg``
    (what TorchTitan's memory estimation uses), through estimate/_torch_compat.py; tests/test_torch_compat.py pins it.
    """
    import torch.distributed as dist

    if not dist.is_available():
        raise ValueError("this torch has no torch.distributed: FSDP2's estimate runs FSDP2 itself and needs it")
    if dist.is_initialized():
        raise ValueError("a process group is already initialized in this process: estimate FSDP2 (strategy='model_parallel') "
                         "before init_process_group, or in a separate process (its fake process group is the default group)")
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_memkit.estimate import _torch_compat

    _torch_compat.register_fake_process_group()

    excepthook = sys.excepthook  # init_process_group prefixes every later traceback with "[rank0]:" and never undoes it
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))  # outside fake mode: the mesh reads its ranks' values
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook


@contextlib.contextmanager
def _sharded_step_copy(shard: Callable[[nn.Module], None]) -> Iterator[None]:
    """Inside the block, :func:`~lightning_memkit.estimate.estimate_memory` shards its fake copy of the module
    with ``shard`` before the steps (and before the optimizer is made, as Lightning's ``configure_model`` runs
    before ``configure_optimizers``), and starts the peak after the sharding (set-up is not the step).

    Through :func:`~lightning_memkit.estimate.settings.preparing_copies` (a context variable: concurrent
    estimates don't see it), which turns the reuse of fake copies off for the block (a sharded copy must not
    serve an unsharded estimate).
    """
    from lightning_memkit.estimate.settings import preparing_copies

    def prepare(module_copy: nn.Module, acc: Any) -> None:
        with acc.labelled("setup"):
            shard(module_copy)
        acc.attributor.assign_module(module_copy)  # the shards are the parameters now
        acc.reset_peak()

    with preparing_copies(prepare):
        yield


def _fully_shard_units(module: nn.Module, wrap: Any, mesh: Any, fully_shard_kwargs: dict[str, Any]) -> None:
    """``fully_shard`` each module whose class is in ``wrap``, innermost first, then the root: what a
    ``configure_model`` under Lightning's ModelParallelStrategy does.

    Sharded on the meta device, then materialised with ``to_empty`` in the caller's (fake) modes, as FSDP2's
    meta-device initialisation does: ``fully_shard`` cuts every parameter into world-size chunks, which on
    fake tensors costs a fake tensor per chunk (23 s for a 1B model on 64 ranks, against 5 s on 2); on meta it
    is cheap. The parameters' values are not needed, only their shapes; tied parameters stay tied.
    """
    from lightning_memkit.estimate import _torch_compat

    fully_shard = _torch_compat.fully_shard()

    with _torch_compat.no_dispatch_modes():  # no fake mode, no accountant: meta tensors only
        metas: dict[int, nn.Parameter] = {}
        for submodule in module.modules():
            for name, parameter in list(submodule._parameters.items()):
                if parameter is not None:
                    if id(parameter) not in metas:
                        metas[id(parameter)] = nn.Parameter(torch.empty(parameter.shape, dtype=parameter.dtype, device="meta"),
                                                            requires_grad=parameter.requires_grad)
                    submodule._parameters[name] = metas[id(parameter)]
        if wrap:
            classes = tuple(wrap)
            units = [m for m in module.modules() if isinstance(m, classes) and m is not module]
            for unit in reversed(units):  # post-order: an inner unit is sharded before the unit holding it
                fully_shard(unit, mesh=mesh, **fully_shard_kwargs)
        fully_shard(module, mesh=mesh, **fully_shard_kwargs)
    module.to_empty(device="cpu")  # the shards, as fake CPU tensors the accountant counts (FSDP2 re-reads them)


def _fsdp2_estimate(module: nn.Module, batch_size: int | None, sharding: Sharding, wrap: Any,
                    fully_shard_kwargs: dict[str, Any], estimate_kwargs: dict[str, Any]) -> tuple[Any, dict[str, int], dict[str, int]]:
    """FSDP2 run on fake tensors: the fake copy is sharded by torch's own ``fully_shard`` over a fake process
    group of the world size, and two steps run as Lightning does. Rank 0's view (FSDP2 pads every rank's shard
    to the same size, so every rank plays this role). Returns the estimate, its categories and the buffers."""
    from lightning_memkit.estimate.core import estimate_memory

    with _fake_process_group(sharding.shard_size) as mesh, \
            _sharded_step_copy(lambda copy_: _fully_shard_units(copy_, wrap, mesh, fully_shard_kwargs)):
        single = estimate_memory(module, batch_size, **estimate_kwargs)
    # FSDP2 frees each unit's gathered (unsharded) parameters with resize_(0) after use; their records read 0
    # bytes by the time the categories are taken, so what the peak holds beyond the categories is exactly them.
    # Its flat all-gather / reduce-scatter buffers are ordinary allocations, counted under temporaries.
    categories = dict(single.by_category)
    gathered = single.peak_bytes - sum(categories.values())
    buffers = {"fsdp2_gathered_parameters": gathered}
    categories["strategy_buffers"] = gathered
    return single, categories, buffers


def estimate_distributed_memory(
    module: nn.Module,
    batch_size: int | None = None,
    *,
    strategy: Any = "ddp",
    world_size: int = 1,
    shard_size: int | None = None,
    bucket_cap_mb: float = 25.0,
    gradient_as_bucket_view: bool = False,
    wrap: Any = None,
    prefetch: int = 1,
    fully_shard_kwargs: dict[str, Any] | None = None,
    **estimate_kwargs: Any,
) -> DistributedEstimate:
    """Predict one rank's training-step memory under a multi-device strategy, without the cluster.

    Runs :func:`~lightning_memkit.estimate.estimate_memory` once (one fake step at the per-rank
    ``batch_size``: every data-parallel rank plays the same role, so world size 64 costs what 2 costs),
    then replaces the model states it measured at the peak by this rank's shards and adds the strategy's buffers:

    - ``ddp`` (``gradient_as_bucket_view=False``, torch's default): the reducer's gradient buckets, one flat
      copy of every trainable gradient (``bucket_cap_mb`` splits it into buckets, it does not shrink it);
      with ``gradient_as_bucket_view=True`` the gradients *are* the buckets: only the part of the buckets
      the peak's gradients do not already cover is added.
    - ``model_parallel`` (FSDP2, Lightning's ModelParallelStrategy): no arithmetic. The fake copy is sharded by
      torch's own ``fully_shard`` (each module of a class in ``wrap``, then the root, with ``fully_shard_kwargs``:
      ``reshard_after_forward``, ``mp_policy``...) over a fake process group of ``world_size`` ranks, and the two
      steps run through FSDP2's real hooks: its shards, gathered parameters, all-gather and reduce-scatter
      buffers and prefetching are what it allocates (checked within 0.01% of real 2- and 4-process CPU runs).
      ``buffers["fsdp2_gathered_parameters"]`` (= ``strategy_buffers``) is the units' gathered parameters at the
      peak; its flat all-gather and reduce-scatter buffers are under ``temporaries``. Needs no process group
      initialised in this process (the fake one is the default group while it runs).
    - ``fsdp*`` (FSDP1, arithmetic, not yet checked against real runs): the all-gathered parameters of the largest unit in flight plus
      ``prefetch`` more units, and the reduce-scatter input of the largest unit's gradients. Units are the
      modules whose class is in ``wrap`` (the auto-wrap policy's layer classes, as Lightning's
      ``auto_wrap_policy={Block}``); without ``wrap`` the whole model is one unit (FSDP gathers all of it).
    - ``deepspeed_stage_*``: the ZeRO sharding of the model states; DeepSpeed's own buckets are not modelled yet.

    Args:
        module, batch_size: as :func:`~lightning_memkit.estimate.estimate_memory`; ``batch_size`` is per rank.
        strategy: a name from :data:`STRATEGIES` or a Lightning strategy object.
        world_size: the number of ranks (data-parallel degree).
        shard_size: HYBRID_SHARD's shard group (ranks of a node); default ``world_size``.
        bucket_cap_mb, gradient_as_bucket_view: DDP's arguments.
        wrap: FSDP's wrapped layer classes (a set of ``nn.Module`` subclasses): the auto-wrap policy, or the
            classes ``configure_model`` calls ``fully_shard`` on.
        prefetch: FSDP1 units gathered ahead of the one computing (FSDP's forward/backward prefetch: 1).
        fully_shard_kwargs: FSDP2's ``fully_shard`` keyword arguments other than ``mesh`` (``model_parallel`` only).
        estimate_kwargs: ``mode=``, ``device=``, ``optimizer=``, ``loss_fn=``, ``batch=``, ``datamodule=``,
            ``trainer=``, ``gpu=`` of :func:`~lightning_memkit.estimate.estimate_memory` (``device`` defaults to ``"cuda"``).

    Returns:
        a :class:`DistributedEstimate` (bytes per rank).
    """
    from lightning_memkit.estimate.core import estimate_memory

    started = time.perf_counter()
    sharding = sharding_of(strategy, world_size, shard_size)
    if bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb must be positive (DDP's default is 25), not {bucket_cap_mb!r}")
    if not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be a non-negative integer (FSDP prefetches 1 unit), not {prefetch!r}")
    n = sharding.shard_size
    if sharding.strategy == "model_parallel":
        single, categories, buffers = _fsdp2_estimate(module, batch_size, sharding, wrap, dict(fully_shard_kwargs or {}), estimate_kwargs)
        return DistributedEstimate(strategy=sharding.strategy, world_size=world_size, shard_size=n, peak_bytes=single.peak_bytes,
                                   by_category=categories, buffers=buffers, single=single, rank_roles=1,
                                   elapsed_s=time.perf_counter() - started, notes=list(single.notes))
    single = estimate_memory(module, batch_size, **estimate_kwargs)
    categories = dict(single.by_category)
    notes = list(single.notes)

    def shard(nbytes: int, sharded: bool) -> int:
        return int(math.ceil(nbytes / n)) if sharded else nbytes

    if sharding.layout == "deepspeed" and single.mode != "baseline":
        notes.append("DeepSpeed keeps half-precision weights and fp32 master weights in the optimizer; this estimate "
                     "keeps the fake step's autocast layout (fp32 weights, same 16 bytes per parameter for Adam)")
    categories["parameters"] = shard(categories.get("parameters", 0), sharding.parameters)
    categories["gradients"] = shard(categories.get("gradients", 0), sharding.gradients)
    categories["optimizer_state"] = shard(categories.get("optimizer_state", 0), sharding.optimizer_state)
    trainable = [p for p in module.parameters() if p.requires_grad]
    gradient_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in trainable}.values())
    buffers: dict[str, int] = {}
    if sharding.strategy in ("ddp", "fsdp_no_shard") and world_size > 1:
        buckets = gradient_bytes if not gradient_as_bucket_view else max(0, gradient_bytes - single.by_category.get("gradients", 0))
        buffers["ddp_gradient_buckets"] = buckets
    elif sharding.strategy.startswith("fsdp") or sharding.strategy == "model_parallel":
        if world_size > 1 or sharding.parameters:
            units = _unit_bytes(module, _units(module, wrap))
            largest = sorted(units, reverse=True)
            # the unsharded parameters of the unit computing and the ones prefetched; its own shard is already counted
            gathered = sum(largest[: 1 + prefetch]) if sharding.parameters else 0
            buffers["fsdp_all_gather"] = max(0, gathered - int(math.ceil(gathered / n))) if n > 1 else 0
            buffers["fsdp_reduce_scatter"] = largest[0] if (sharding.gradients and n > 1) else 0
    categories["strategy_buffers"] = sum(buffers.values())
    model_states_then = sum(single.by_category.get(k, 0) for k in ("parameters", "gradients", "optimizer_state"))
    model_states_now = categories["parameters"] + categories["gradients"] + categories["optimizer_state"]
    peak = single.peak_bytes - model_states_then + model_states_now + categories["strategy_buffers"]
    return DistributedEstimate(strategy=sharding.strategy, world_size=world_size, shard_size=n, peak_bytes=peak,
                               by_category=categories, buffers=buffers, single=single, rank_roles=1,
                               elapsed_s=time.perf_counter() - started, notes=notes)
