"""Running one estimate (:func:`run`): the request checked, the batch found, a fake (or real) copy of the module
stepped under the accountant in Lightning's order, and the counts turned into a :class:`MemoryEstimate`.
"""

from __future__ import annotations

import contextlib
import copy
import time
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_memkit._lightning_compat import copy_module
from lightning_memkit._torch_compat import tree_flatten, tree_map
from lightning_memkit.compiled._torch_compat import force_eager
from lightning_memkit.estimate.cuda.caching_allocator import (
    CUBLAS_WORKSPACE_BYTES,
    CUDA_CONTEXT_BYTES,
    CUDNN_WORKSPACE_BYTES,
    CudaAllocatorModel,
)
from lightning_memkit.estimate.cuda.kernels import CudaKernels, cuda_target
from lightning_memkit.estimate.data.batches import NoBatchError, batch_size_of, converted_floats, preserved_rng, rebatch
from lightning_memkit.estimate.data.worst_batch import BatchSource, WorstBatch, batch_shapes, worst_batch_and_length
from lightning_memkit.estimate.fake.copies import ReuseCache, cpu_fake, dismantle, fake_module, rebatched
from lightning_memkit.estimate.fake.session import FakeSession
from lightning_memkit.estimate.fake.step_ops import FakeStepMode, FakeStepOps
from lightning_memkit.estimate.fake.tensors import keeps_real_values
from lightning_memkit.estimate.step.hook_errors import HookFailed, failure
from lightning_memkit.estimate.step.lightning_step import (
    StepLoop,
    default_loss,
    optimizer_factory,
    run_automatic_steps,
    step_autocast,
)
from lightning_memkit.estimate.step.manual_step import run_manual_steps
from lightning_memkit.estimate.step.memory_estimate import EstimateError, MemoryEstimate
from lightning_memkit.estimate.step.offload_model import OffloadModel
from lightning_memkit.estimate.step.settings import EstimateSettings
from lightning_memkit.estimate.step.step_accountant import StepAccountant
from lightning_memkit.estimate.step.trainer_stand_in import attach_trainer, is_lightning_module
from lightning_memkit.modes.checkpoint_policy import CheckpointBudget, normalize_policy
from lightning_memkit.modes.checkpointing import apply_checkpointing
from lightning_memkit.modes.mode import parse_mode
from lightning_memkit.modes.offload import OFFLOAD_ON_CPU, offload_suspended

if TYPE_CHECKING:
    from lightning.pytorch import LightningDataModule, Trainer

    from lightning_memkit.estimate.cuda.gpu_target import GpuLike
    from lightning_memkit.modes.mode import ModeLike

__all__ = ["StepRequest", "run", "prepare_batch", "PreparedBatch", "GIVEN_BATCH_NOTE"]

#: the note on an estimate of a batch the caller gave
GIVEN_BATCH_NOTE = "the batch given: the answer holds for batches no larger than it"


@dataclass(frozen=True, eq=False)
class StepRequest:
    """One estimate's question: the arguments of :func:`~lightning_memkit.estimate.estimate_memory` (``fake=True``)
    or :func:`~lightning_memkit.estimate.measure_training_step` (``fake=False``), which describe each."""

    module: nn.Module
    batch: Any = None
    batch_size: int | None = None
    mode: ModeLike = None
    device: str | torch.device = "cuda"
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None
    datamodule: LightningDataModule | None = None
    trainer: Trainer | None = None
    gpu: GpuLike = None
    fake: bool = True
    steps: int = 2


@dataclass(frozen=True)
class _MemoKey:
    """What makes two estimates inside one ``reusing_fake_copies()`` block the same question: the objects by
    identity (the block promises they do not change), the rest by value."""

    module: int
    batch: int
    batch_size: int | None
    mode: Any
    device: str
    optimizer: int
    loss_fn: int
    datamodule: int
    trainer: int
    gpu: str
    micro_batches: int


@dataclass
class _Resolved:
    """The request's arguments resolved for the step: the mode object, the target device, the batch and what
    optimizes the copy."""

    mode: Any  # a Mode, or None for the baseline
    target: torch.device
    batch: Any
    batches: int | None  # the loader's length in batches
    batch_note: str
    sized: bool  # the batch is the one of the asked size already (a batch sampler's): not re-sized
    manual: bool  # Lightning's manual optimization: training_step steps its optimizers itself
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None
    optimizer_hook: str  # what made the optimizer, as an error names it
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]


@dataclass
class _StepCopy:
    """The copy the step runs on, its batch, the context the step runs in (the fake world, or nothing), and the
    precision's autocast around each forward."""

    module: nn.Module
    batch: Any
    context: Callable[[], AbstractContextManager[Any]]
    session: FakeSession | None = None
    autocast: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext


def run(request: StepRequest, settings: EstimateSettings | None = None) -> MemoryEstimate:
    """The estimate (or measurement) ``request`` asks for, under ``settings`` (default: the caller's blocks').
    Inside ``reusing_fake_copies()`` the same fake question gets the same answer without running again."""
    settings = settings if settings is not None else EstimateSettings.current()
    cache = settings.reuse
    key = _memo_key(request, settings) if request.fake and cache is not None else None
    if cache is None or key is None:
        return _run_once(request, settings)
    if key in cache.estimates:
        return copy.deepcopy(cache.estimates[key])
    estimate = _run_once(request, settings)
    cache.estimates[key] = copy.deepcopy(estimate)
    return estimate


def _memo_key(request: StepRequest, settings: EstimateSettings) -> _MemoKey | None:
    """The memo key of a fake ``request`` inside ``reusing_fake_copies()``; ``None`` when it must run (an observed
    step) or cannot be memoised (an unhashable mode object)."""
    if settings.op_listener is not None:
        return None  # an observed step must run
    size = request.batch_size
    if size is None:
        size = batch_size_of(_prepare_batch(request, settings.reuse).batch)
    key = _MemoKey(
        id(request.module),
        id(request.batch),
        size,
        request.mode,
        str(request.device),
        id(request.optimizer),
        id(request.loss_fn),
        id(request.datamodule),
        id(request.trainer),
        repr(request.gpu),
        settings.micro_batches,
    )
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _prepare_batch(request: StepRequest, cache: ReuseCache | None) -> PreparedBatch:
    return prepare_batch(request.module, request.batch, request.batch_size, request.datamodule, cache)


@dataclass
class PreparedBatch:
    """The batch a step runs on, the loader's length in batches (``None``: unknown), a note saying which batch it is
    and what the answer holds for, and whether it is the batch of the asked size already (``sized``: the largest
    batch a custom batch sampler yields at that size, which re-sizing another batch cannot give)."""

    batch: Any
    batches: int | None
    note: str
    sized: bool = False


def _at_size(worst: WorstBatch, batches: int | None, batch_size: int | None) -> PreparedBatch:
    """``worst`` at the asked size: a batch sampler's largest batch there where it can be iterated, else ``worst``
    (re-sized by the step), with the note at that size."""
    size = batch_size or worst.batch_size
    found = worst.at_size(size) if size is not None else worst
    if found.source is BatchSource.SAMPLER:
        return PreparedBatch(found.batch, batches, found.note, sized=True)
    return PreparedBatch(worst.batch, batches, worst.note_at(size))


def prepare_batch(
    module: nn.Module, batch: Any, batch_size: int | None, datamodule: Any, cache: ReuseCache | None
) -> PreparedBatch:
    """Check the arguments; returns the batch (the data's worst batch at the asked size if not given, see
    estimate/data/worst_batch.py) as a :class:`PreparedBatch`. With ``cache`` (a ``reusing_fake_copies()`` block's) the
    worst batch of a module and datamodule is found once."""
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"estimate_memory needs an nn.Module (a LightningModule or a plain module), not {type(module).__name__}"
        )
    if any(torch.nn.parameter.is_lazy(p) for p in module.parameters()):
        raise EstimateError(
            f"{type(module).__name__} has lazy modules (nn.LazyLinear, ...) whose parameters do not "
            "exist before the first forward: run one forward with an example batch first, then "
            "estimate"
        )
    if batch_size is not None and (not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1):
        raise ValueError(f"batch_size must be a positive integer, not {batch_size!r}")
    if isinstance(batch, WorstBatch):  # found by find_worst_batch (e.g. with size_of=): it says what it holds for
        return _at_size(batch, None, batch_size)
    if batch is not None:
        return PreparedBatch(batch, None, GIVEN_BATCH_NOTE)
    key = (id(module), id(datamodule))
    if cache is not None and key in cache.batches:
        return _at_size(*cache.batches[key], batch_size)
    try:
        worst, batches = worst_batch_and_length(module, datamodule)
    except NoBatchError as error:
        if batch_size is None and "failed" not in str(error):
            raise NoBatchError(f"{error}; or give batch_size= together with one of them") from None
        raise
    if cache is not None:
        cache.batches[key] = (worst, batches)
    return _at_size(worst, batches, batch_size)


def _resolve(request: StepRequest, cache: ReuseCache | None) -> _Resolved:
    """The request's mode, target and batch, and what optimizes the copy; raises what cannot be estimated."""
    mode = _resolve_mode(request.mode)
    target = request.device if isinstance(request.device, torch.device) else torch.device(request.device)
    if mode is not None and mode.offload and target.type != "cuda":
        raise EstimateError(
            f"mode {mode.name!r}: {OFFLOAD_ON_CPU}; estimate it for device='cuda' (the estimate runs on CPU fakes)"
        )
    prepared = _prepare_batch(request, cache)
    module = request.module
    manual = is_lightning_module(module) and not module.automatic_optimization
    if manual and request.loss_fn is not None:
        raise EstimateError(
            f"{type(module).__name__} uses manual optimization: its training_step runs the backward "
            "and the optimizer steps itself, so loss_fn= does not apply; leave it out"
        )
    configured = request.optimizer is None and is_lightning_module(module)
    return _Resolved(
        mode=mode,
        target=target,
        batch=prepared.batch,
        batches=prepared.batches,
        batch_note=prepared.note,
        sized=prepared.sized,
        manual=manual,
        make_optimizer=None if manual else optimizer_factory(module, request.optimizer),
        optimizer_hook=f"{type(module).__name__}.configure_optimizers" if configured else "optimizer=",
        loss_fn=request.loss_fn or default_loss,
    )


def _resolve_mode(mode: Any) -> Any:
    return None if mode is None else parse_mode(mode)


def _run_once(request: StepRequest, settings: EstimateSettings) -> MemoryEstimate:
    started = time.perf_counter()
    resolved = _resolve(request, settings.reuse)
    fake, target, mode = request.fake, resolved.target, resolved.mode
    notes: list[str] = []
    acc = StepAccountant(
        record_events=target.type == "cuda",
        fake_ops=FakeStepOps(cuda=target.type == "cuda") if fake else None,
        op_listener=settings.op_listener,
    )
    offload = OffloadModel(acc) if mode is not None and mode.offload else None
    kernels = cuda_target(target, fake, mode, request.gpu)  # the CUDA target's kernels and allocator
    # compiled code runs eagerly in the step (the eager program's figure): dynamo, meeting a compiled frame first under
    # the accountant's dispatch mode, would otherwise skip it for the rest of the process, and the user's fit after
    # the estimate would run uncompiled
    with preserved_rng(), warnings.catch_warnings(), force_eager():
        warnings.filterwarnings("ignore", message=".*self.log.*")
        warnings.filterwarnings("ignore", message=".*self.trainer.*")
        module_copy = handle = None
        try:
            session, module_copy = _copy_of(request, settings.reuse, _true_half_dtype(mode))
            step_copy = _ready_for_step(request, resolved, session, module_copy, notes)
            prepared = settings.prepare_copy is not None or settings.wrap_copy is not None
            _prepare_copy(step_copy, settings.prepare_copy, acc)
            handle = _apply_checkpointing(step_copy, resolved, acc, prepared)
            _prepare_copy(step_copy, settings.wrap_copy, acc)
            _run_steps(request, resolved, settings, step_copy, acc, offload, kernels)
        except (EstimateError, NoBatchError):
            raise
        except Exception as error:  # noqa: BLE001 - the user's step may raise anything: an EstimateError names it
            raise failure(request.module, fake, error) from (error.error if isinstance(error, HookFailed) else error)
        finally:
            if handle is not None:
                handle.remove()
            if not (fake and settings.reuse is not None):  # a cached fake copy is dismantled when its block ends
                dismantle(module_copy)
    return _estimate_of(acc, request, resolved, step_copy.batch, offload, kernels, notes, started)


def _true_half_dtype(mode: Any) -> torch.dtype | None:
    """The dtype a true half precision mode converts the module and batch to (``None`` for the others)."""
    return None if mode is None else mode.true_half_dtype()


def _copy_of(
    request: StepRequest, cache: ReuseCache | None, dtype: torch.dtype | None = None
) -> tuple[FakeSession | None, nn.Module]:
    """The copy the step runs on: a fake copy (with its session), or a real deep copy (``None`` for the session),
    the module's trainer left out of it; with ``dtype`` (a true half precision's), its floating-point parameters and
    buffers converted to it, as Lightning's ``HalfPrecision.convert_module`` does before the fit's first step."""
    module = request.module
    attached = getattr(module, "_trainer", None)
    if request.fake:
        return fake_module(module, attached, cache, dtype)
    if next((p.device.type for p in module.parameters()), "cpu") == "meta":
        raise EstimateError(
            f"{type(module).__name__}'s parameters are on the meta device (no data): a real step "
            "cannot run; estimate_memory() estimates it on fake tensors"
        )
    module_copy = copy_module(module, {id(attached): None} if attached is not None else {}, compiled=False)
    return None, module_copy if dtype is None else module_copy.to(dtype=dtype)


def _ready_for_step(
    request: StepRequest, resolved: _Resolved, session: FakeSession | None, module_copy: nn.Module, notes: list[str]
) -> _StepCopy:
    """The copy with its batch (re-sized to the request's batch size: fakes on a fake step, on the parameters'
    device on a real one) and the stand-in trainer, in training mode; a fake step's caveats appended to ``notes``."""
    module, batch = request.module, resolved.batch
    batch_size = None if resolved.sized else request.batch_size
    attached = getattr(module, "_trainer", None)
    half = _true_half_dtype(resolved.mode)  # Lightning's HalfPrecision.convert_input, before the batch's transfer
    if session is not None:
        if batch_size is not None:
            batch = rebatch(batch, batch_size, lambda t, n: rebatched(session, t, n))
        batch = tree_map(
            lambda leaf: (
                cpu_fake(session, leaf, half)
                if isinstance(leaf, torch.Tensor) and not keeps_real_values(leaf)
                else leaf
            ),
            batch,
        )
        if resolved.target.type != "cuda" and _runs_onednn_lstm(module):
            notes.append(
                "nn.LSTM on CPU runs oneDNN, whose workspace fake tensors do not see (torch's meta kernel "
                "gives it no size): this peak is low; measure_training_step() gives the real CPU figure"
            )
        # the accountant does the rest of the fake step's work (FakeStepOps)
        step_copy = _StepCopy(module_copy, batch, session.fake_mode_only, session)
    else:
        where = next((p.device for p in module.parameters()), torch.device("cpu"))
        if batch_size is not None:
            batch = rebatch(batch, batch_size)
        step_copy = _StepCopy(module_copy, _move(converted_floats(batch, half), where), contextlib.nullcontext)
    trainer = request.trainer if request.trainer is not None else attached
    attach_trainer(step_copy.module, trainer, resolved.batches, resolved.mode, request.datamodule, resolved.target.type)
    step_copy.module.train()
    step_copy.autocast = step_autocast(
        resolved.mode, _device_type_of(step_copy.module, step_copy.batch), resolved.target.type
    )
    return step_copy


def _runs_onednn_lstm(module: nn.Module) -> bool:
    return (
        any(isinstance(m, nn.LSTM) for m in module.modules())
        and torch.backends.mkldnn.is_available()
        and bool(torch.backends.mkldnn.enabled)
    )


def _run_steps(
    request: StepRequest,
    resolved: _Resolved,
    settings: EstimateSettings,
    step_copy: _StepCopy,
    acc: StepAccountant,
    offload: OffloadModel | None,
    kernels: CudaKernels | None,
) -> None:
    """The steps on ``step_copy`` under the accountant, with the offload and the CUDA kernels the mode and target
    ask for."""
    module_copy, batch = step_copy.module, step_copy.batch
    acc.attributor.assign_module(module_copy)
    acc.attributor.assign(batch, "inputs")
    loop = StepLoop(
        module_copy,
        batch,
        step_copy.autocast,
        acc,
        request.steps,
        micro_batches=settings.micro_batches,
        foreach=request.fake and resolved.target.type == "cuda",
    )
    # offload is what mode.offload models (its own hooks, the host bytes); a step apply_offload already wrapped
    # must not run torch's save_on_cpu on the fake step too: it would take every saved tensor from the counting
    with (
        step_copy.context(),
        acc,
        offload_suspended(),
        acc.attributor.watch_saved_tensors(),
        kernels.active() if kernels else contextlib.nullcontext(),
        offload.hooks() if offload is not None else contextlib.nullcontext(),
    ):
        if resolved.make_optimizer is None:  # manual optimization: training_step steps its optimizers itself
            run_manual_steps(loop, request.optimizer)
        else:
            run_automatic_steps(
                loop,
                resolved.make_optimizer,
                resolved.loss_fn,
                resolved.optimizer_hook,
                lightning_hooks=resolved.loss_fn is default_loss and is_lightning_module(module_copy),
            )


def _prepare_copy(step_copy: _StepCopy, prepare: Callable[[nn.Module, Any], None] | None, acc: StepAccountant) -> None:
    """The settings' ``prepare_copy`` or ``wrap_copy`` (a strategy's set-up: ``configure_model``, sharding, its
    buffers) on the step's copy, in the step's world and under the accountant."""
    if prepare is not None:
        with step_copy.context(), acc, offload_suspended():
            prepare(step_copy.module, acc)


def _apply_checkpointing(step_copy: _StepCopy, resolved: _Resolved, acc: StepAccountant, prepared: bool) -> Any:
    """Wrap the copy's blocks as the mode's checkpointing policy chooses; returns the handle to remove when the
    estimate ends (``None`` without checkpointing). A ``prepared`` copy (sharded by a strategy's set-up) runs no
    measuring forward: its first forward, outside the accountant, would be the strategy's lazy set-up, unseen."""
    mode = resolved.mode
    if mode is None or mode.checkpoint is None:
        return None
    if prepared and isinstance(normalize_policy(mode.checkpoint), CheckpointBudget):
        raise EstimateError(
            f"mode {mode.name!r}: a checkpointing budget measures a forward of the whole model, which one rank "
            "does not run; per rank, give the classes to checkpoint (e.g. checkpoint={MyBlock}) or 'auto'"
        )
    module_copy, batch, session, autocast = step_copy.module, step_copy.batch, step_copy.session, step_copy.autocast

    def sample() -> Any:  # a budget policy measures the step's forward on the same (fake) batch
        if session is None:
            with autocast():
                return resolved.loss_fn(module_copy, batch)
        # the step's own answers (real values, sized data-dependent ops), outside the accountant
        with session.fake_mode_only(), FakeStepMode(acc.fake_ops), autocast():
            return resolved.loss_fn(module_copy, batch)

    try:
        # a manually optimized training_step also steps its optimizers: no measuring forward through it
        measure = not (resolved.manual or prepared)
        return apply_checkpointing(module_copy, mode.checkpoint, sample=sample if measure else None)
    except ValueError as error:
        raise EstimateError(f"mode {mode.name!r}: {error}") from None


def _estimate_of(
    acc: StepAccountant,
    request: StepRequest,
    resolved: _Resolved,
    batch: Any,
    offload: OffloadModel | None,
    kernels: CudaKernels | None,
    notes: list[str],
    started: float,
) -> MemoryEstimate:
    """The :class:`MemoryEstimate` of the steps ``acc`` counted (with the CUDA allocator view on a CUDA target)."""
    if acc.errors:
        notes.append("accountant errors: " + "; ".join(acc.errors[:3]))
    data_dependent = acc.fake_ops.data_dependent.note() if acc.fake_ops is not None else None
    if data_dependent:
        notes.append(data_dependent)
    view = None
    if kernels is not None:
        view = kernels.view(acc.events or ())
        notes.append("CUDA kernels assumed: " + "; ".join(kernels.assumed()))
    elif resolved.target.type == "cuda":
        context_bytes, workspace_bytes = _cuda_allowances(request.module)
        view = CudaAllocatorModel().replay(acc.events or ()).view(context_bytes, workspace_bytes)
    mode = resolved.mode
    return MemoryEstimate(
        peak_bytes=acc.peak_bytes,
        by_category=acc.peak_breakdown(),
        batch_size=batch_size_of(batch),
        mode=mode.name if mode is not None else "baseline",
        device=resolved.target.type,
        peak_phase=acc.peak_phase,
        peak_step=acc.peak_step,
        cuda=view,
        source="fake" if request.fake else "measured",
        elapsed_s=time.perf_counter() - started,
        notes=notes,
        host_bytes=offload.peak_bytes if offload is not None else 0,
        batch_shapes=batch_shapes(batch),
        batch_note=resolved.batch_note,
    )


def _cuda_allowances(module: nn.Module) -> tuple[int, int]:
    """The CUDA context and library workspaces a measured step's allocator view adds on top of its tensors."""
    convolutional = any(isinstance(m, nn.modules.conv._ConvNd) for m in module.modules())
    return CUDA_CONTEXT_BYTES, CUBLAS_WORKSPACE_BYTES + (CUDNN_WORKSPACE_BYTES if convolutional else 0)


def _device_type_of(module: nn.Module, batch: Any) -> str:
    """Where the step's kernels run (the parameters' device; the batch's for parameter-free modules)."""
    for parameter in module.parameters():
        return parameter.device.type
    for leaf in tree_flatten(batch)[0]:
        if isinstance(leaf, torch.Tensor):
            return leaf.device.type
    return "cpu"


def _move(batch: Any, device: torch.device) -> Any:
    """The batch on ``device``, as Lightning moves it before ``training_step``."""
    return tree_map(
        lambda leaf: leaf.to(device) if isinstance(leaf, torch.Tensor) and leaf.device != device else leaf, batch
    )
