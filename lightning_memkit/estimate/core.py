"""One training step's memory: predicted on fake tensors, or measured on a real copy, categorised the same way.

Both paths run the same step code (forward, zero_grad, backward, optimizer step, in Lightning's
order) on a *copy* of the module under the tensor accountant, so the two numbers are comparable.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
import contextvars
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from lightning_memkit.accounting.accountant import StorageRecord, TensorAccountant
from lightning_memkit.accounting.categories import CATEGORIES, CategoryAttributor
from lightning_memkit.errors import MemkitError
from lightning_memkit.estimate.allocator import (
    CUBLAS_WORKSPACE_BYTES,
    CUDA_CONTEXT_BYTES,
    CUDNN_WORKSPACE_BYTES,
    AllocatorView,
    CudaAllocatorModel,
)
from lightning_memkit.estimate.batches import NoBatchError, batch_size_of, preserved_rng, rebatch
from lightning_memkit.estimate.worst_batch import WorstBatch, batch_shapes, worst_batch_and_length
from lightning_memkit.estimate.cuda_kernels import cuda_target
from lightning_memkit.estimate.fake_session import FakeSession
from lightning_memkit.estimate.fake_step import FakeStepMode, FakeStepOps
from lightning_memkit.estimate.fake_tensors import NOT_ANSWERED, REAL_VALUES_NUMEL, fake_parameter, is_fake, keeps_real_values
from lightning_memkit.modes.offload import offload_suspended
from lightning_memkit.summary_table import format_table
from lightning_memkit.units import format_bytes

__all__ = ["MemoryEstimate", "EstimateError", "estimate_memory", "measure_training_step", "reusing_fake_copies", "CATEGORIES"]



class EstimateError(MemkitError, RuntimeError):
    """The step could not be estimated; the message says why and what to do."""


@dataclass
class MemoryEstimate:
    """The memory of one training step, at its peak (all sizes in bytes).

    Attributes:
        peak_bytes: peak of live tensor bytes over the first two steps (the second is the steady
            state: optimizer state exists, last step's gradients live until ``zero_grad``), exactly
            as :class:`~lightning_memkit.TensorAccountant` counts them (no allocator rounding).
        by_category: ``peak_bytes`` split into the accountant's categories
            (:data:`lightning_memkit.accounting.categories.CATEGORIES`: parameters, buffers,
            gradients, optimizer_state, activations = saved for backward at the peak, recomputed,
            inputs, temporaries...), attributed by
            :class:`~lightning_memkit.accounting.categories.CategoryAttributor`.
        batch_size: the batch size the step ran with (``None`` when the batch has no batch dimension).
        mode: the mode's name (``"baseline"``, ``"bf16"``, ``"checkpoint"``...).
        device: the target device type (``"cuda"``, ``"cpu"``...).
        peak_phase: where the peak happened: ``forward``, ``zero_grad``, ``backward`` or ``optimizer``.
        peak_step: which of the two steps (1 or 2) reached the peak.
        cuda: for a CUDA target, the caching-allocator view (:class:`AllocatorView`), else ``None``.
        source: ``"fake"`` (estimated, no real memory used) or ``"measured"`` (a real step on a copy).
        elapsed_s: wall time of the estimate, seconds.
        notes: caveats that apply to this estimate.
        host_bytes: with offload (``mode="offload"``, CUDA target), the peak of pinned host memory the offloaded
            saved tensors occupy, in bytes: ``numel * element_size`` of every tensor saved in one step's forward
            (torch's ``save_on_cpu`` copies each save: a tensor saved twice counts twice, parameters too), before
            the caching host allocator rounds each block up. ``0`` without offload. Not part of ``peak_bytes``,
            which counts the device.
        batch_shapes: the shapes of the batch the step ran on, e.g. ``input_ids (817, 256), labels (817,)``.
        batch_note: which batch that is and what the answer holds for: the data's worst batch (every sample sized,
            see :func:`~lightning_memkit.estimate.worst_batch.find_worst_batch`), a subset's, the batch given, or
            the batch seen where the data cannot be enumerated (an iterable dataset).
    """

    peak_bytes: int
    by_category: dict[str, int]
    batch_size: int | None
    mode: str = "baseline"
    device: str = "cpu"
    peak_phase: str = ""
    peak_step: int = 0
    cuda: AllocatorView | None = None
    source: str = "fake"
    elapsed_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    host_bytes: int = 0
    batch_shapes: str = ""
    batch_note: str = ""

    @property
    def required_bytes(self) -> int:
        """Bytes the target device must have: the allocator view's ``device_bytes`` on CUDA, else ``peak_bytes``."""
        return self.cuda.device_bytes if self.cuda is not None else self.peak_bytes

    def __getattr__(self, name: str) -> int:
        # parameters_bytes, gradients_bytes, ... as attributes
        if name.endswith("_bytes") and name[:-6] in CATEGORIES:
            return self.by_category.get(name[:-6], 0)
        raise AttributeError(name)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``required_bytes`` included)."""
        data = asdict(self)
        data["cuda"] = self.cuda.to_dict() if self.cuda is not None else None
        data["required_bytes"] = self.required_bytes
        return data

    def summary(self) -> str:
        """A plain-text table of the peak and its categories."""
        rows = [(name, format_bytes(self.by_category.get(name, 0))) for name in CATEGORIES]
        rows.append(("peak (tensors)", format_bytes(self.peak_bytes)))
        if self.host_bytes:
            rows.append(("offloaded to host (pinned)", format_bytes(self.host_bytes)))
        if self.cuda is not None:
            rows += [
                ("CUDA allocated peak", format_bytes(self.cuda.peak_allocated_bytes)),
                ("CUDA reserved peak", format_bytes(self.cuda.peak_reserved_bytes)),
                ("context + workspaces", format_bytes(self.cuda.context_bytes + self.cuda.workspace_bytes)),
                ("device needs", format_bytes(self.cuda.device_bytes)),
            ]
        title = f"memkit estimate: batch {self.batch_size}, mode {self.mode}, device {self.device} ({self.source}, peak in {self.peak_phase} of step {self.peak_step})"
        batch_line = f"\nbatch: {self.batch_shapes} ({self.batch_note})" if self.batch_shapes else ""
        return title + batch_line + "\n" + format_table(("", "bytes"), rows)


_ITEM = torch.ops.aten._local_scalar_dense.default

#: What ``.item()`` of a fake floating-point tensor answers inside the optimizer's step (elsewhere it is 1.0,
#: see :class:`~lightning_memkit.estimate.fake_outputs.ScalarPlaceholders`). An optimizer reads its scalars there (step
#: counts, NAdam's running product of momentum factors) and divides by ``x`` and ``1 - x``: 1.0 makes NAdam's
#: ``1 - mu_product`` zero, 0.5 keeps both non-zero. Memory does not depend on the value.
OPTIMIZER_FLOAT_PLACEHOLDER = 0.5


class _StepAccountant(TensorAccountant):
    """The accountant plus what the estimate needs: the live records at each new peak, the phase
    of the peak, and (for the CUDA model) the allocation/free events in order.

    On a fake step it also does :class:`~lightning_memkit.estimate.fake_step.FakeStepOps`' work (placeholder
    scalars, kept loss buffers, fake tensors' devices) in the same dispatch call: one Python mode layer
    per op instead of three, with the same results (the step runs inside ``FakeSession.fake_mode_only``).
    """

    def __init__(self, record_events: bool, fake_ops: FakeStepOps | None = None) -> None:
        super().__init__()
        self.fake_ops = fake_ops
        self.events: list[tuple[str, int, int]] | None = [] if record_events else None
        if record_events:
            self.add_storage_listener(lambda record: self.events.append(("alloc", record.sequence, record.nbytes)),
                                      lambda record: self.events.append(("free", record.sequence, 0)))
        self.peak_records: list[StorageRecord] = []
        self.peak_tick = 0
        self.attributor = CategoryAttributor(self)
        self.peak_phase = ""
        self.peak_step = 0
        self.step = 0
        self.add_peak_listener(self._on_peak)
        self.optimizer_phase = False  # inside optimizer.step(): a fake float read answers OPTIMIZER_FLOAT_PLACEHOLDER
        self.micro_batch = 0  # which micro-batch of the step (gradient accumulation, see accumulating())
        self.op_listener = _OP_LISTENER.get() if fake_ops is not None else None
        self.host_copy = False  # inside offload's pack: the copy lives in host memory, not on the device counted here

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        ops = self.fake_ops
        if ops is None:
            if self.host_copy:
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)
        answer = ops.answer(func, args, kwargs)
        if answer is not NOT_ANSWERED:  # no kernel, no tensor made: nothing to count
            if func is _ITEM and self.optimizer_phase and type(answer) is float:
                return OPTIMIZER_FLOAT_PLACEHOLDER
            return answer
        # masks, token ids and positions keep their real values; a data-dependent shape is sized (DataDependentOps)
        result = ops.run(func, args, kwargs)
        if self.host_copy:
            return result
        try:
            self._account(func, args, kwargs, result)
        except BaseException as error:  # never raise here (see TensorAccountant)
            self._record_error(f"{func}: {type(error).__name__}: {error}")
        listener = self.op_listener
        if listener is not None:
            try:
                listener(func, args, kwargs, result, self)
            except BaseException as error:  # never raise here: the listener only observes
                self._record_error(f"op listener on {func}: {type(error).__name__}: {error}")
        return result

    def _on_peak(self, _peak: int) -> None:
        self.peak_records = self.live_records()
        self.peak_tick = self.attributor.tick
        self.peak_phase = self.label
        self.peak_step = self.step


class _HostCopy:
    """One offloaded saved tensor: its host copy, counted in :class:`_OffloadModel` while it lives."""

    __slots__ = ("tensor", "nbytes", "owner")

    def __init__(self, tensor: torch.Tensor, nbytes: int, owner: "_OffloadModel") -> None:
        self.tensor, self.nbytes, self.owner = tensor, nbytes, owner

    def __del__(self) -> None:
        self.owner.current_bytes -= self.nbytes


class _OffloadModel:
    """torch's ``save_on_cpu(pin_memory=True)`` as the step's accountant must see it: each saved tensor is copied to
    a host buffer of ``numel * element_size`` bytes that the device ledger does not count (the host ledger here
    does), so the device tensor is freed when the forward drops it; each unpack in backward allocates a
    device copy (counted), as ``packed.to(device)`` does."""

    def __init__(self, acc: _StepAccountant) -> None:
        self.acc = acc
        self.current_bytes = 0
        self.peak_bytes = 0

    def pack(self, tensor: torch.Tensor) -> _HostCopy:
        nbytes = tensor.numel() * tensor.element_size()
        self.acc.host_copy = True
        try:
            host = tensor.detach().clone(memory_format=torch.contiguous_format)
        finally:
            self.acc.host_copy = False
        self.current_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        return _HostCopy(host, nbytes, self)

    @staticmethod
    def unpack(packed: _HostCopy) -> torch.Tensor:
        return packed.tensor.clone()

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


# ------------------------------------------------------------------------------------------ the step
def _is_lightning_module(module: nn.Module) -> bool:
    try:
        from lightning.pytorch import LightningModule
    except ImportError:  # pragma: no cover
        return False
    return isinstance(module, LightningModule)


def _first_optimizer(configured: Any) -> torch.optim.Optimizer:
    """The optimizer from whatever ``configure_optimizers`` returned (optimizer, list, tuple, dict)."""
    if isinstance(configured, torch.optim.Optimizer):
        return configured
    if isinstance(configured, dict) and "optimizer" in configured:
        return _first_optimizer(configured["optimizer"])
    if isinstance(configured, (list, tuple)) and configured:
        optimizers = [c for c in tree_flatten(configured[0] if isinstance(configured[0], (list, tuple)) else list(configured))[0] if isinstance(c, torch.optim.Optimizer)]
        optimizers += [c["optimizer"] for c in configured if isinstance(c, dict) and "optimizer" in c]
        if len(optimizers) == 1:
            return optimizers[0]
        if len(optimizers) > 1:
            raise EstimateError("configure_optimizers returned several optimizers; estimate_memory models automatic optimization with one optimizer: pass optimizer=lambda params: ... for the one to model")
    raise EstimateError(f"configure_optimizers returned {type(configured).__name__}, not an optimizer; return a torch.optim.Optimizer or pass optimizer=lambda params: torch.optim.AdamW(params)")


def _loss_of(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and "loss" in output:
        return output["loss"]
    return None


def _default_loss(module: nn.Module, batch: Any) -> torch.Tensor:
    if _is_lightning_module(module):
        with _hook(f"{type(module).__name__}.training_step"):
            output = module.training_step(batch, 0)
        loss = _loss_of(output)
        if loss is None:
            raise EstimateError(f"{type(module).__name__}.training_step returned {type(output).__name__}; return the loss tensor (or a dict with 'loss'), or pass loss_fn=")
        return loss
    with _hook(f"{type(module).__name__}.forward"):
        output = module(batch)
    if not isinstance(output, torch.Tensor):
        raise EstimateError(f"{type(module).__name__}(batch) returned {type(output).__name__}; pass loss_fn=lambda module, batch: <scalar loss>")
    return output.float().sum()


def _step_context(module_copy: nn.Module, mode: Any, device_type: str, target_device_type: str):
    """The autocast context for the step (Lightning applies it around training_step only)."""
    if mode is None:
        return contextlib.nullcontext
    dtype = mode.autocast_dtype(target_device_type)
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device_type, dtype=dtype)


class _HookFailed(MemkitError):
    """A user hook (or a phase of the step) raised: carries which one, and the original error."""

    def __init__(self, hook: str, error: BaseException) -> None:
        super().__init__(hook)
        self.hook = hook
        self.error = error


@contextlib.contextmanager
def _hook(name: str) -> Iterator[None]:
    """Name the hook (or step phase) any error in the block came from; the innermost name wins."""
    try:
        yield
    except (_HookFailed, EstimateError, NoBatchError):
        raise
    except Exception as error:
        raise _HookFailed(name, error) from error


def _run_steps(module_copy: nn.Module, batch: Any, make_optimizer: Callable[[nn.Module], torch.optim.Optimizer], loss_fn: Callable, autocast, acc: _StepAccountant, steps: int,
               optimizer_hook: str = "the optimizer", foreach: bool = False, lightning_hooks: bool = False) -> None:
    """Two automatic-optimization steps. With ``lightning_hooks`` (a LightningModule stepped by its own
    ``training_step``) the module's hooks run where Lightning's closure and precision plugin call them:
    ``on_before_zero_grad`` and ``optimizer_zero_grad``; ``on_before_backward``, ``backward`` and
    ``on_after_backward``; ``on_before_optimizer_step`` and ``configure_gradient_clipping`` (the trainer's
    ``gradient_clip_val``); then the optimizer's step."""
    with _hook(optimizer_hook):
        optimizer = make_optimizer(module_copy)
    if foreach:
        _use_foreach(optimizer)
    optimizer_name = type(optimizer).__name__
    attributor = acc.attributor
    name = type(module_copy).__name__
    trainer = getattr(module_copy, "_trainer", None) if lightning_hooks else None
    micro_batches = max(1, int(_MICRO_BATCHES.get()))
    for step in range(1, steps + 1):
        acc.step = step
        for micro in range(micro_batches):
            acc.micro_batch = micro
            with acc.labelled("forward"), autocast(), _hook("the loss (loss_fn)"):
                loss = loss_fn(module_copy, batch)
            # Lightning's automatic optimization: zero_grad after the forward, before backward (with gradient
            # accumulation only on the first micro-batch of a step: the later ones add to the gradients)
            if micro == 0:
                with acc.labelled("zero_grad"):
                    if lightning_hooks:
                        with _hook(f"{name}.on_before_zero_grad"):
                            module_copy.on_before_zero_grad(optimizer)
                        with _hook(f"{name}.optimizer_zero_grad"):
                            module_copy.optimizer_zero_grad(0, step - 1, optimizer)
                    else:
                        optimizer.zero_grad(set_to_none=True)
            with acc.labelled("backward"), _hook("the backward of the loss"):
                if lightning_hooks:
                    with _hook(f"{name}.on_before_backward"):
                        module_copy.on_before_backward(loss)
                    module_copy.backward(loss)
                    with _hook(f"{name}.on_after_backward"):
                        module_copy.on_after_backward()
                else:
                    loss.backward()
            del loss
        attributor.assign_module(module_copy)  # the new gradients
        if lightning_hooks:
            with acc.labelled("optimizer"):
                with _hook(f"{name}.on_before_optimizer_step"):
                    module_copy.on_before_optimizer_step(optimizer)
                with _hook(f"{name}.configure_gradient_clipping"):
                    module_copy.configure_gradient_clipping(optimizer, gradient_clip_val=getattr(trainer, "gradient_clip_val", None),
                                                            gradient_clip_algorithm=getattr(trainer, "gradient_clip_algorithm", None))
        with acc.labelled("optimizer"), _hook(f"the optimizer step ({optimizer_name}.step)"):
            acc.optimizer_phase = True
            try:
                optimizer.step()
            finally:
                acc.optimizer_phase = False
        attributor.assign_optimizers([optimizer])  # state made lazily by the first step
        if trainer is not None and hasattr(trainer, "global_step"):
            trainer.global_step += 1  # as the fit loop counts optimizer steps


class _ManualStrategy:
    """What a LightningModule under manual optimization reaches through ``self.trainer.strategy`` in its own
    ``training_step``: ``manual_backward`` calls :meth:`backward` (Lightning's ``Strategy.backward``: the
    module's ``backward`` hook, i.e. ``loss.backward()``) and each ``self.optimizers()`` wrapper's ``step``
    calls :meth:`optimizer_step` (``optimizer.step(closure=...)``, the closure run inside the step as torch's
    optimizers do). The phases are labelled and attributed as the automatic step's are."""

    def __init__(self, acc: _StepAccountant, module_copy: nn.Module) -> None:
        self.acc, self.module = acc, module_copy
        self._lightning_optimizers: list[Any] = []

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        with self.acc.labelled("backward"), _hook(f"the backward of the loss ({type(self.module).__name__}.manual_backward)"):
            self.module.backward(closure_loss, *args, **kwargs)
        self.acc.attributor.assign_module(self.module)  # the new gradients
        return closure_loss

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        acc = self.acc
        with acc.labelled("optimizer"), _hook(f"the optimizer step ({type(optimizer).__name__}.step)"):
            acc.optimizer_phase = True
            try:
                result = optimizer.step(closure=closure, **kwargs)
            finally:
                acc.optimizer_phase = False
        acc.attributor.assign_optimizers([optimizer])  # state made lazily by the first step
        return result


def _run_manual_steps(module_copy: nn.Module, batch: Any, optimizer: Callable | None, autocast, acc: _StepAccountant, steps: int,
                      foreach: bool = False) -> None:
    """Lightning's manual optimization: ``configure_optimizers`` (or ``optimizer=``) gives the optimizers and
    schedulers, the stand-in trainer answers ``self.optimizers()`` (Lightning's ``LightningOptimizer`` wrappers
    over :class:`_ManualStrategy`), ``self.lr_schedulers()`` and ``toggle_optimizer``, and ``training_step``
    runs the forward, backward and steps itself, under the precision's autocast as Lightning runs it."""
    from lightning_memkit._lightning_compat import lightning_optimizers, manual_optimizers_and_schedulers

    name = type(module_copy).__name__
    with _hook(f"{name}.configure_optimizers" if optimizer is None else "optimizer="):
        if optimizer is None:
            optimizers, configs = manual_optimizers_and_schedulers(module_copy.configure_optimizers())
        else:
            optimizers, configs = [optimizer(module_copy.parameters())], []
    if not optimizers:
        raise EstimateError(f"{name}.configure_optimizers returned no optimizer; a manually optimized module steps its own optimizers")
    if foreach:
        for each in optimizers:
            _use_foreach(each)
    strategy = _ManualStrategy(acc, module_copy)
    strategy._lightning_optimizers = lightning_optimizers(optimizers, strategy)
    trainer = module_copy.trainer
    trainer.optimizers, trainer.lr_scheduler_configs = optimizers, configs
    trainer.strategy = strategy  # its precision_plugin is _attach_trainer's (what clip_gradients calls)
    for step in range(1, steps + 1):
        acc.step = step
        with acc.labelled("forward"), autocast(), _hook(f"{name}.training_step"):
            module_copy.training_step(batch, step - 1)
        trainer.global_step += 1
        acc.attributor.assign_optimizers(optimizers)


def _use_foreach(optimizer: torch.optim.Optimizer) -> None:
    """Run the optimizer's multi-tensor (``foreach``) implementation, as torch does by default for
    parameters on CUDA: its temporaries are the ones a CUDA step allocates (and it dispatches a few
    ops per parameter *list*, not per parameter). Groups that chose ``foreach``/``fused`` keep it.
    ``capturable=True`` (CUDA graphs) asserts that parameters are on CUDA, which the CPU fakes are not: those
    groups run the non-capturable update (its step counters on the host: a few scalars fewer per parameter)."""
    for group in optimizer.param_groups:
        if group.get("capturable"):
            group["capturable"] = False
        if "foreach" in group and group.get("foreach") is None and not group.get("fused") and not group.get("differentiable"):
            if isinstance(optimizer, torch.optim.Adam) and torch.is_tensor(group.get("lr")):
                continue  # torch keeps Adam/AdamW single-tensor for a tensor lr without capturable (adam.py)
            group["foreach"] = True


def _categorise(acc: _StepAccountant) -> dict[str, int]:
    return acc.attributor.breakdown_of(acc.peak_records, acc.peak_tick).bytes_by_category


def _resolve_mode(mode: Any):
    if mode is None:
        return None
    from lightning_memkit.modes.mode import parse_mode

    return parse_mode(mode)


def _prepare(module: nn.Module, batch: Any, batch_size: int | None, datamodule: Any) -> tuple[Any, int | None, str]:
    """Check the arguments; returns the batch (the data's worst batch if not given, see estimate/worst_batch.py),
    the loader's length in batches, and a note saying which batch it is and what the answer holds for."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"estimate_memory needs an nn.Module (a LightningModule or a plain module), not {type(module).__name__}")
    if any(torch.nn.parameter.is_lazy(p) for p in module.parameters()):
        raise EstimateError(f"{type(module).__name__} has lazy modules (nn.LazyLinear, ...) whose parameters do not exist before "
                            "the first forward: run one forward with an example batch first, then estimate")
    if batch_size is not None and (not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1):
        raise ValueError(f"batch_size must be a positive integer, not {batch_size!r}")
    if isinstance(batch, WorstBatch):  # found by find_worst_batch (e.g. with size_of=): it says what it holds for
        return batch.batch, None, batch.note
    if batch is not None:
        return batch, None, GIVEN_BATCH_NOTE
    cache = _CACHE.get()
    key = (id(module), id(datamodule))
    if cache is not None and key in cache.batches:
        return cache.batches[key]
    try:
        worst, batches = worst_batch_and_length(module, datamodule)
    except NoBatchError as error:
        if batch_size is None and "failed" not in str(error):
            raise NoBatchError(f"{error}; or give batch_size= together with one of them") from None
        raise
    prepared = (worst.batch, batches, worst.note)
    if cache is not None:
        cache.batches[key] = prepared
    return prepared


#: the note on an estimate of a batch the caller gave
GIVEN_BATCH_NOTE = "the batch given: the answer holds for batches no larger than it"


def _optimizer_factory(module: nn.Module, optimizer: Callable | None) -> Callable[[nn.Module], torch.optim.Optimizer]:
    if optimizer is not None:
        return lambda copy_: optimizer(copy_.parameters())
    if _is_lightning_module(module):
        def configured(copy_: nn.Module) -> torch.optim.Optimizer:
            with _hook(f"{type(module).__name__}.configure_optimizers"):
                returned = copy_.configure_optimizers()
            optimizer = _first_optimizer(returned)
            _give_trainer_optimizers(copy_, returned)
            return optimizer

        return configured
    raise EstimateError(f"{type(module).__name__} is a plain nn.Module: pass optimizer=lambda params: torch.optim.AdamW(params) (and loss_fn= if module(batch).sum() is not the loss)")


def _give_trainer_optimizers(module_copy: nn.Module, returned: Any) -> None:
    """What ``self.trainer.optimizers`` and ``self.lr_schedulers()`` answer during fit: the optimizers and
    scheduler configs of what the copy's ``configure_optimizers`` returned, read by Lightning's own parser."""
    trainer = getattr(module_copy, "_trainer", None)
    if trainer is None or not hasattr(trainer, "lr_scheduler_configs"):
        return
    from lightning.pytorch.core.optimizer import _configure_optimizers, _configure_schedulers_automatic_opt

    optimizers, schedulers, monitor = _configure_optimizers(returned)
    trainer.optimizers = optimizers
    trainer.lr_scheduler_configs = _configure_schedulers_automatic_opt(schedulers, monitor)


def _cuda_allowances(module: nn.Module) -> tuple[int, int]:
    convolutional = any(isinstance(m, nn.modules.conv._ConvNd) for m in module.modules())
    return CUDA_CONTEXT_BYTES, CUBLAS_WORKSPACE_BYTES + (CUDNN_WORKSPACE_BYTES if convolutional else 0)


class _Reuse:
    """What estimates of the same module inside one :func:`reusing_fake_copies` block share: the fake
    copy of each module (made once, its gradients reset between estimates) and each sampled batch."""

    def __init__(self) -> None:
        self.copies: dict[int, tuple[nn.Module, FakeSession, nn.Module]] = {}
        self.batches: dict[tuple[int, int], tuple[Any, int | None]] = {}
        self.estimates: dict[tuple, MemoryEstimate] = {}  # the same estimate asked twice (a table, then a prediction)


_CACHE: contextvars.ContextVar[_Reuse | None] = contextvars.ContextVar("memkit_fake_copies", default=None)

#: Set (for a block) by an estimate that must change the step's copy of the module before the steps,
#: inside the accountant: the distributed estimate shards it as a strategy's ``configure_model`` would.
#: Called as ``prepare(module_copy, accountant)``; a context variable, so concurrent estimates don't see it.
_PREPARE_COPY: contextvars.ContextVar[Callable[[nn.Module, Any], None] | None] = contextvars.ContextVar("memkit_prepare_copy", default=None)


#: Micro-batches per optimizer step in the estimated step (gradient accumulation, as Lightning's
#: ``accumulate_grad_batches``: ``zero_grad`` after the first micro-batch's forward only, the later backwards add to
#: the gradients). Set for a block by :func:`accumulating`; 1 (no accumulation) by default.
_MICRO_BATCHES: contextvars.ContextVar[int] = contextvars.ContextVar("memkit_micro_batches", default=1)

#: Set for a block by :func:`observing_ops`: called as ``listener(func, args, kwargs, result, accountant)`` for every
#: op of a fake step that runs a kernel (the accountant's ``step``, ``micro_batch`` and ``label`` say where it is).
_OP_LISTENER: contextvars.ContextVar[Callable[..., None] | None] = contextvars.ContextVar("memkit_op_listener", default=None)


@contextlib.contextmanager
def accumulating(micro_batches: int) -> Iterator[None]:
    """Inside the block, every automatic-optimization step :func:`estimate_memory` runs has ``micro_batches``
    forward/backward passes before its optimizer step (gradient accumulation; ``micro_batches`` >= 1). Two are
    enough for the peak of any accumulation >= 2: the third and later micro-batches repeat the second."""
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches!r}: give a positive integer")
    token = _MICRO_BATCHES.set(micro_batches)
    try:
        yield
    finally:
        _MICRO_BATCHES.reset(token)


@contextlib.contextmanager
def observing_ops(listener: Callable[..., None]) -> Iterator[None]:
    """Inside the block, :func:`estimate_memory`'s fake steps call ``listener(func, args, kwargs, result, accountant)``
    for every op that runs a kernel (the op's fake inputs and outputs: shapes, dtypes; no values). Estimates are
    not memoised inside the block (a memoised answer runs no op)."""
    token = _OP_LISTENER.set(listener)
    try:
        yield
    finally:
        _OP_LISTENER.reset(token)


@contextlib.contextmanager
def reusing_fake_copies() -> Iterator[None]:
    """Inside the block, :func:`estimate_memory` makes one fake copy per module (and takes one sample
    batch per module and datamodule) and reuses them for every mode and batch size: the module must not
    change inside the block. Used by :func:`~lightning_memkit.estimate.predict_max_batch_size` and
    ``memkit estimate``; everything is dropped when the block ends."""
    if _CACHE.get() is not None:  # nested: the outer block's cache serves
        yield
        return
    cache = _Reuse()
    token = _CACHE.set(cache)
    try:
        yield
    finally:
        _CACHE.reset(token)
        for _, _, module_copy in cache.copies.values():
            _dismantle(module_copy)
        cache.copies.clear()


def _dismantle(module_copy: nn.Module | None) -> None:
    """Empty every submodule of a copy the estimate made and is done with.

    A copy sits in reference cycles that are not memkit's to change (a torchmetrics ``Metric``'s wrapped
    ``update`` holds the metric; the step's trainer stub holds the copy), so dropping it freed its tensors
    (a metric's real state tensors, the fakes) only at the next full ``gc.collect()``. With every module's
    attributes gone, the cycles hold nothing and the tensors go at once.
    """
    if module_copy is None:
        return
    for each in list(module_copy.modules()):
        each.__dict__.clear()


def _rebatched(session: FakeSession, tensor: torch.Tensor, size: int) -> torch.Tensor:
    """``tensor`` grown or cut to ``size`` rows for the fake step: rows repeated for real when the result keeps real
    values (:func:`keeps_real_values`: token ids, masks, labels), else an empty fake of the new shape."""
    shape = (size, *tensor.shape[1:])
    if keeps_real_values(tensor) and math.prod(shape) <= REAL_VALUES_NUMEL:
        return tensor.index_select(0, torch.arange(size) % tensor.shape[0])
    return session.empty(shape, tensor.dtype, "cpu")


def _cpu_fake(session: FakeSession, tensor: torch.Tensor) -> torch.Tensor:
    """A fake CPU tensor with ``tensor``'s shape, strides and dtype, wherever ``tensor`` lives (CPU, CUDA,
    meta): the fake step runs on CPU fakes only, so parameters and batch always share one device and a
    CPU-only torch never makes a fake CUDA tensor."""
    if is_fake(tensor) and tensor.device.type == "cpu":
        return tensor
    if tensor.device.type == "cpu" and not is_fake(tensor):
        return session.tensor(tensor)
    with session.mode:
        fake = torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=tensor.dtype, device="cpu")
    if tensor.requires_grad and (fake.is_floating_point() or fake.is_complex()):
        fake.requires_grad_(True)
    return fake


def _fake_copy(session: FakeSession, module: nn.Module, detach: tuple[Any, ...]) -> nn.Module:
    """A deep copy of ``module`` whose parameters, buffers and plain tensor attributes are CPU fakes
    (no weight is read or copied, nothing is allocated where the module lives); ``detach`` objects
    (its Trainer) become ``None``."""
    memo: dict[int, Any] = {id(obj): None for obj in detach if obj is not None}
    for parameter in module.parameters():
        if id(parameter) not in memo:
            # a new fake (or, for a parameter already fake, its new detached alias): flagged, not detached again
            memo[id(parameter)] = fake_parameter(_cpu_fake(session, parameter.detach()), requires_grad=parameter.requires_grad)
    for buffer in module.buffers():
        if id(buffer) not in memo:
            memo[id(buffer)] = _cpu_fake(session, buffer)
    for each in module.modules():  # a mask or a dataset held as a plain attribute: fake, not copied for real
        for value in vars(each).values():
            if isinstance(value, torch.Tensor) and id(value) not in memo:
                memo[id(value)] = _cpu_fake(session, value)
    return copy.deepcopy(module, memo)


def _fake_module(module: nn.Module, trainer: Any) -> tuple[FakeSession, nn.Module]:
    cache = _CACHE.get()
    if cache is not None and id(module) in cache.copies:
        original, session, module_copy = cache.copies[id(module)]
        if original is module:
            for parameter in module_copy.parameters():  # last estimate's gradients
                parameter.grad = None
            return session, module_copy
    session = FakeSession()
    module_copy = _fake_copy(session, module, (trainer,))
    if cache is not None:
        cache.copies[id(module)] = (module, session, module_copy)
    return session, module_copy


def _move(batch: Any, device: torch.device) -> Any:
    """The batch on ``device``, as Lightning moves it before ``training_step``."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda leaf: leaf.to(device) if isinstance(leaf, torch.Tensor) and leaf.device != device else leaf, batch)


def _attach_trainer(module_copy: nn.Module, trainer: Any, batches: int | None, mode: Any, datamodule: Any, target_type: str) -> None:
    """Give the copy (never ``module``) a stand-in trainer that answers as ``trainer`` (or a default
    ``Trainer()``) would at the start of fit, so ``configure_optimizers`` may read ``self.trainer``."""
    if not _is_lightning_module(module_copy):
        return
    from lightning_memkit._lightning_compat import StandInTrainer, attach_stand_in_trainer

    defaults: dict[str, Any] = {}
    if batches:
        defaults["num_training_batches"] = batches
    stand_in = StandInTrainer.like(trainer, **defaults)
    if mode is not None:  # the mode being estimated is the precision the step runs in
        amp = "16-mixed" if target_type == "cuda" else "bf16-mixed"  # what "amp" resolves to on the target
        stand_in.precision = {None: "32-true", "amp": amp}.get(mode.precision, mode.precision)
    if datamodule is not None:
        stand_in.datamodule = datamodule
    for setting in ("gradient_clip_val", "gradient_clip_algorithm"):  # Trainer(gradient_clip_val=...) clips every step
        value = getattr(trainer, setting, None)
        if value is not None:
            setattr(stand_in, setting, value)
    from lightning.pytorch.plugins.precision import Precision

    stand_in.precision_plugin = Precision()  # what LightningModule.clip_gradients calls (torch's clip_grad_norm_/value_)
    attach_stand_in_trainer(module_copy, stand_in)


def _library_directories() -> tuple[str, ...]:
    """Directories whose files are not the user's: memkit, torch, Lightning, the standard library, installed packages."""
    import site
    import sysconfig

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # lightning_memkit/, not imported: a cycle
    places = [package, os.path.dirname(torch.__file__), sysconfig.get_paths()["stdlib"]]
    places += list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    try:
        import lightning

        places.append(os.path.dirname(lightning.__file__))
    except ImportError:  # pragma: no cover
        pass
    return tuple(os.path.realpath(place) + os.sep for place in places if place)


def _user_line(error: BaseException) -> str:
    """``file:line`` of the innermost frame of ``error``'s traceback in the user's own code (not memkit, torch,
    Lightning, the standard library or an installed package), or ``""``."""
    libraries = _library_directories()
    found = ""
    for frame in traceback.extract_tb(error.__traceback__):
        path = os.path.realpath(frame.filename)
        if not frame.filename.startswith("<") and not path.startswith(libraries):
            found = f"{frame.filename}:{frame.lineno}"
    return found


def _failure(module: nn.Module, fake: bool, error: BaseException) -> EstimateError:
    where = "on fake tensors" if fake else "on a real copy"
    if isinstance(error, _HookFailed):
        hook, cause = error.hook, error.error
    else:
        hook, cause = f"the training step of {type(module).__name__}", error
    text = f"{type(cause).__name__}: {cause}"
    where_in_user_code = _user_line(cause)
    hint = ""
    if fake and _is_data_dependent(cause):
        hint = DATA_DEPENDENT_HINT
    at = f" (at {where_in_user_code})" if where_in_user_code else ""
    error = EstimateError(f"{hook} failed {where}: {text}{at}.{hint}")
    error.data_dependent = bool(hint)  # the CLI swaps DATA_DEPENDENT_ADVICE (Python) for its own command
    return error


#: the part of :data:`DATA_DEPENDENT_HINT` that says what to do, in Python's terms (the CLI says it in its own)
DATA_DEPENDENT_ADVICE = "use measure_training_step() on a small batch, or express it without the data-dependent shape."

#: what an EstimateError adds when an op's output shape or a value depended on data the fakes do not have
DATA_DEPENDENT_HINT = (" An op's output shape or a value read from a tensor depends on data the fake tensors do not hold"
                       " and memkit has no bound for it (see docs/will_it_fit.md, data-dependent ops); "
                       + DATA_DEPENDENT_ADVICE)


def _is_data_dependent(error: BaseException) -> bool:
    """Whether ``error`` is FakeTensorMode refusing a data-dependent op (an output shape or a value from data)."""
    return "data-dependent" in str(error).lower() or type(error).__name__ in ("DynamicOutputShapeException",
                                                                               "DataDependentOutputException")


def _run(module, batch, batch_size, mode, device, optimizer, loss_fn, datamodule, fake: bool, steps: int, trainer: Any = None, gpu: Any = None) -> MemoryEstimate:
    cache = _CACHE.get()
    key = None
    if fake and cache is not None:  # inside reusing_fake_copies(): the same question gets the same answer
        size = batch_size if batch_size is not None else batch_size_of(_prepare(module, batch, batch_size, datamodule)[0])
        key = (id(module), id(batch), size, mode, str(device), id(optimizer), id(loss_fn), id(datamodule), id(trainer), repr(gpu),
               _MICRO_BATCHES.get())
        if _OP_LISTENER.get() is not None:
            key = None  # an observed step must run
        try:
            hash(key) if key is not None else None
        except TypeError:  # an unhashable mode object: no memo
            key = None
        if key is not None and key in cache.estimates:
            return copy.deepcopy(cache.estimates[key])
    estimate = _run_once(module, batch, batch_size, mode, device, optimizer, loss_fn, datamodule, fake, steps, trainer, gpu)
    if key is not None:
        cache.estimates[key] = copy.deepcopy(estimate)
    return estimate


def _run_once(module, batch, batch_size, mode, device, optimizer, loss_fn, datamodule, fake: bool, steps: int, trainer: Any = None, gpu: Any = None) -> MemoryEstimate:
    started = time.perf_counter()
    mode = _resolve_mode(mode)
    target = torch.device(device) if not isinstance(device, torch.device) else device
    if mode is not None and mode.offload and target.type != "cuda":
        from lightning_memkit.modes.offload import OFFLOAD_ON_CPU

        raise EstimateError(f"mode {mode.name!r}: {OFFLOAD_ON_CPU}; estimate it for device='cuda' (the estimate runs on CPU fakes)")
    batch, batches, batch_note = _prepare(module, batch, batch_size, datamodule)
    manual = _is_lightning_module(module) and not module.automatic_optimization
    if manual and loss_fn is not None:
        raise EstimateError(f"{type(module).__name__} uses manual optimization: its training_step runs the backward and the "
                            "optimizer steps itself, so loss_fn= does not apply; leave it out")
    make_optimizer = None if manual else _optimizer_factory(module, optimizer)
    optimizer_hook = f"{type(module).__name__}.configure_optimizers" if optimizer is None and _is_lightning_module(module) else "optimizer="
    loss_fn = loss_fn or _default_loss
    notes: list[str] = []
    acc = _StepAccountant(record_events=target.type == "cuda", fake_ops=FakeStepOps() if fake else None)
    offload = _OffloadModel(acc) if mode is not None and mode.offload else None
    kernels = cuda_target(target, fake, mode, gpu)  # the CUDA target's kernels and allocator (estimate/cuda_kernels.py)
    attached = getattr(module, "_trainer", None)
    handle = None
    with preserved_rng(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*self.log.*")
        warnings.filterwarnings("ignore", message=".*self.trainer.*")
        try:
            if fake:
                session, module_copy = _fake_module(module, attached)
                if batch_size is not None:
                    batch = rebatch(batch, batch_size, lambda t, n: _rebatched(session, t, n))
                batch = tree_map(lambda leaf: _cpu_fake(session, leaf) if isinstance(leaf, torch.Tensor) and not keeps_real_values(leaf)
                                 else leaf, batch)
                step_context = session.fake_mode_only  # the accountant does the rest (FakeStepOps)
                if target.type != "cuda" and any(isinstance(m, nn.LSTM) for m in module.modules()) and torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled:
                    notes.append("nn.LSTM on CPU runs oneDNN, whose workspace fake tensors do not see (torch's meta kernel "
                                 "gives it no size): this peak is low; measure_training_step() gives the real CPU figure")
            else:
                where = next((p.device for p in module.parameters()), torch.device("cpu"))
                if where.type == "meta":
                    raise EstimateError(f"{type(module).__name__}'s parameters are on the meta device (no data): a real step cannot "
                                        "run; estimate_memory() estimates it on fake tensors")
                module_copy = copy.deepcopy(module, {id(attached): None} if attached is not None else {})
                if batch_size is not None:
                    batch = rebatch(batch, batch_size)
                batch = _move(batch, where)
                step_context = contextlib.nullcontext
            _attach_trainer(module_copy, trainer if trainer is not None else attached, batches, mode, datamodule, target.type)
            module_copy.train()
            autocast = _step_context(module_copy, mode, _device_type_of(module_copy, batch), target.type)
            if mode is not None and mode.checkpoint is not None:
                from lightning_memkit.modes.checkpointing import apply_checkpointing

                def sample() -> Any:  # a budget policy measures the step's forward on the same (fake) batch
                    if not fake:
                        with autocast():
                            return loss_fn(module_copy, batch)
                    # the step's own answers (real values, sized data-dependent ops), outside the accountant
                    with session.fake_mode_only(), FakeStepMode(acc.fake_ops), autocast():
                        return loss_fn(module_copy, batch)

                try:
                    # a manually optimized training_step also steps its optimizers: no measuring forward through it
                    handle = apply_checkpointing(module_copy, mode.checkpoint, sample=None if manual else sample)
                except ValueError as error:
                    raise EstimateError(f"mode {mode.name!r}: {error}") from None
            acc.attributor.assign_module(module_copy)
            acc.attributor.assign(batch, "inputs")
            # offload is what mode.offload models (its own hooks, the host bytes); a step apply_offload already wrapped
            # must not run torch's save_on_cpu on the fake step too: it would take every saved tensor from the counting
            with step_context(), acc, offload_suspended(), acc.attributor.watch_saved_tensors(), \
                    (kernels.active() if kernels else contextlib.nullcontext()), \
                    (offload.hooks() if offload is not None else contextlib.nullcontext()):
                prepare = _PREPARE_COPY.get()
                if prepare is not None:
                    prepare(module_copy, acc)
                if manual:
                    _run_manual_steps(module_copy, batch, optimizer, autocast, acc, steps, foreach=fake and target.type == "cuda")
                else:
                    _run_steps(module_copy, batch, make_optimizer, loss_fn, autocast, acc, steps, optimizer_hook,
                               foreach=fake and target.type == "cuda",
                               lightning_hooks=loss_fn is _default_loss and _is_lightning_module(module_copy))
        except (EstimateError, NoBatchError):
            raise
        except Exception as error:
            raise _failure(module, fake, error) from (error.error if isinstance(error, _HookFailed) else error)
        finally:
            if handle is not None:
                handle.remove()
            if not (fake and _CACHE.get() is not None):  # a cached fake copy is dismantled when its block ends
                _dismantle(locals().get("module_copy"))
    if acc.errors:
        notes.append("accountant errors: " + "; ".join(acc.errors[:3]))
    data_dependent = acc.fake_ops.data_dependent.note() if acc.fake_ops is not None else None
    if data_dependent:
        notes.append(data_dependent)
    view = None
    if kernels is not None:
        view = kernels.view(acc.events or ())
        notes.append("CUDA kernels assumed: " + "; ".join(kernels.assumed()))
    elif target.type == "cuda":
        context_bytes, workspace_bytes = _cuda_allowances(module)
        view = CudaAllocatorModel().replay(acc.events or ()).view(context_bytes, workspace_bytes)
    return MemoryEstimate(
        peak_bytes=acc.peak_bytes,
        by_category=_categorise(acc),
        batch_size=batch_size_of(batch),
        mode=mode.name if mode is not None else "baseline",
        device=target.type,
        peak_phase=acc.peak_phase,
        peak_step=acc.peak_step,
        cuda=view,
        source="fake" if fake else "measured",
        elapsed_s=time.perf_counter() - started,
        notes=notes,
        host_bytes=offload.peak_bytes if offload is not None else 0,
        batch_shapes=batch_shapes(batch),
        batch_note=batch_note,
    )


def _device_type_of(module: nn.Module, batch: Any) -> str:
    """Where the step's kernels run (the parameters' device; the batch's for parameter-free modules)."""
    for parameter in module.parameters():
        return parameter.device.type
    for leaf in tree_flatten(batch)[0]:
        if isinstance(leaf, torch.Tensor):
            return leaf.device.type
    return "cpu"


def estimate_memory(
    module: nn.Module,
    batch_size: int | None = None,
    *,
    batch: Any = None,
    mode: Any = None,
    device: str | torch.device = "cuda",
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    datamodule: Any = None,
    trainer: Any = None,
    gpu: Any = None,
) -> MemoryEstimate:
    """Predict a training step's memory without running it: fake tensors, no real memory, no GPU needed.

    Runs two full training steps (forward via ``training_step``, ``zero_grad``, backward, the
    optimizer's step, in Lightning's order) on a fake-tensor copy of ``module`` and counts every
    tensor with the accountant. ``module``, its optimizer and every RNG state are left untouched.

    Args:
        module: a LightningModule (optimizer from ``configure_optimizers``) or a plain ``nn.Module``
            (give ``optimizer=`` and, unless ``module(batch).sum()`` is the loss, ``loss_fn=``).
        batch_size: the batch size to estimate. The batch is the worst one the ``train_dataloader()`` of
            ``datamodule`` or the module can produce, re-shaped to this size (its rows repeated or cut, largest
            first); ``None`` keeps the loader's size.
        batch: an example batch instead of the data's worst batch (re-shaped if ``batch_size`` is given), or a
            :class:`~lightning_memkit.estimate.worst_batch.WorstBatch` from ``find_worst_batch`` (e.g. found with
            ``size_of=`` on a large dataset). Without it the batch is the worst the train dataloader can produce: its
            dataset's largest samples, collated by its own ``collate_fn`` (see ``find_worst_batch``), so the answer
            holds for every batch of the run; :attr:`MemoryEstimate.batch_note` says which batch it was.
        mode: a mode string or :class:`~lightning_memkit.modes.mode.Mode` (``"bf16"``, ``"checkpoint"``...).
        device: the target device. For ``"cuda"`` the caching-allocator view is added
            (:attr:`MemoryEstimate.cuda`); the step itself always runs on CPU fakes, so a CPU-only
            torch can estimate for a GPU.
        optimizer: ``params -> optimizer`` for plain modules, or to override ``configure_optimizers``.
        loss_fn: ``(module, batch) -> loss``; default ``training_step(batch, 0)`` for a LightningModule.
        gpu: for a CUDA target, the GPU whose kernels to model: ``"h100"``, ``"a100"``, ``"sm90"``, ``(8, 0)``...
            (default: this machine's GPU, else an H100); see :mod:`lightning_memkit.estimate.cuda_kernels`.
        datamodule: a LightningDataModule to take the sample batch from: it is prepared and set up as
            ``Trainer.fit`` does (``prepare_data()``, ``setup("fit")``) before its ``train_dataloader()`` is read.
        trainer: the (unattached) ``Trainer`` the module will be fit with: ``self.trainer`` in the copy's
            ``configure_optimizers`` / ``training_step`` answers with its ``max_steps``, ``max_epochs``,
            ``accumulate_grad_batches``, ``num_devices``... Default: the module's own trainer if it is
            attached to one, else what a default ``Trainer()`` would answer at the start of fit (see
            :class:`~lightning_memkit._lightning_compat.StandInTrainer`).

    The module may live anywhere (CPU, CUDA, the meta device): the fake copy's parameters and the
    batch are CPU fakes of the same shapes and dtypes, so nothing is read from or allocated on the
    module's device. Inside :func:`reusing_fake_copies` the fake copy and sample batch are reused.

    Returns:
        a :class:`MemoryEstimate` (bytes): the peak, its categories, and the CUDA allocator view.

    Raises:
        NoBatchError: no batch anywhere (the message says what to pass).
        EstimateError: the step cannot run on fake tensors; the message names the hook that failed
            (``configure_optimizers``, ``training_step``, the backward, the optimizer step) and the error.

    A ``torch.compile``'d module (``OptimizedModule``, as ``Trainer.fit`` takes it) is estimated as the eager
    program of the module it wraps, and every such estimate carries a note saying so.
    """
    original = compiled_original(module)
    if original is None:
        return _run(module, batch, batch_size, mode, device, optimizer, loss_fn, datamodule, fake=True, steps=2, trainer=trainer, gpu=gpu)
    estimate = _run(original, batch, batch_size, mode, device, optimizer, loss_fn, datamodule, fake=True, steps=2, trainer=trainer, gpu=gpu)
    estimate.notes.append(COMPILED_NOTE)
    return estimate


#: the note on an estimate of a ``torch.compile``'d module
COMPILED_NOTE = ("torch.compile: this is the eager program's figure (the module torch.compile wraps, run without "
                 "compiling); the compiled program's memory differs (fused kernels, other saved tensors)")


def compiled_original(module: Any) -> nn.Module | None:
    """The module a ``torch.compile``'d ``module`` wraps (``OptimizedModule._orig_mod``), or ``None`` when ``module``
    is not one. Reads torch's private ``torch._dynamo.eval_frame.OptimizedModule``, pinned by tests/test_fake_values.py."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except Exception:  # noqa: BLE001 - a torch without dynamo compiles nothing
        return None
    if isinstance(module, OptimizedModule):
        return getattr(module, "_orig_mod", None)
    return None


def measure_training_step(
    module: nn.Module,
    batch_size: int | None = None,
    *,
    batch: Any = None,
    mode: Any = None,
    device: str | torch.device = "cpu",
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    datamodule: Any = None,
    trainer: Any = None,
) -> MemoryEstimate:
    """Measure what :func:`estimate_memory` predicts: the same two steps on a real deep copy of ``module``.

    Same arguments (``batch_size`` in samples, ``batch``, ``mode``, ``device``, ``optimizer``, ``loss_fn``,
    ``datamodule``, ``trainer``) and result as :func:`estimate_memory` (``source="measured"``); it allocates real
    memory and takes real compute time. The step runs where the module's parameters are (the batch is
    moved there, as Lightning does); ``device`` only decides whether the CUDA allocator view is added.
    ``module`` and RNG states are untouched. A module on the meta device cannot be measured.
    """
    return _run(module, batch, batch_size, mode, device, optimizer, loss_fn, datamodule, fake=False, steps=2, trainer=trainer)
