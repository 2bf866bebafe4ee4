"""The estimated training step in Lightning's order under automatic optimization: the optimizer from
``configure_optimizers``, the loss from ``training_step``, and forward, zero_grad, backward and the optimizer step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from lightning_memkit._torch_compat import tree_flatten
from lightning_memkit.estimate.step.hook_errors import hook
from lightning_memkit.estimate.step.memory_estimate import EstimateError
from lightning_memkit.estimate.step.step_accountant import StepAccountant
from lightning_memkit.estimate.step.trainer_stand_in import give_trainer_optimizers, is_lightning_module

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule

__all__ = [
    "StepLoop",
    "run_automatic_steps",
    "default_loss",
    "optimizer_factory",
    "step_autocast",
    "default_dtype",
    "use_foreach",
    "labelled_optimizer_step",
]


@dataclass
class StepLoop:
    """What the estimated steps run on and how many there are.

    Attributes:
        module: the step's copy of the module (never the user's module).
        batch: the batch each micro-batch's forward takes.
        autocast: makes the precision's autocast context (or a null context) around each forward.
        acc: the accountant counting the steps.
        steps: optimizer steps to run (the second is the steady state).
        micro_batches: forward/backward passes per optimizer step (gradient accumulation).
        foreach: run the optimizers' multi-tensor implementation, as torch does for CUDA parameters.
    """

    module: nn.Module
    batch: Any
    autocast: Callable[[], AbstractContextManager[Any]]
    acc: StepAccountant
    steps: int
    micro_batches: int = 1
    foreach: bool = False


def first_optimizer(configured: Any) -> torch.optim.Optimizer:
    """The optimizer from whatever ``configure_optimizers`` returned (optimizer, list, tuple, dict)."""
    if isinstance(configured, torch.optim.Optimizer):
        return configured
    if isinstance(configured, dict) and "optimizer" in configured:
        return first_optimizer(configured["optimizer"])
    if isinstance(configured, (list, tuple)) and configured:
        nested = configured[0] if isinstance(configured[0], (list, tuple)) else list(configured)
        optimizers = [c for c in tree_flatten(nested)[0] if isinstance(c, torch.optim.Optimizer)]
        optimizers += [c["optimizer"] for c in configured if isinstance(c, dict) and "optimizer" in c]
        if len(optimizers) == 1:
            return optimizers[0]
        if len(optimizers) > 1:
            raise EstimateError(
                "configure_optimizers returned several optimizers; estimate_memory models automatic "
                "optimization with one optimizer: pass optimizer=lambda params: ... for the one to "
                "model"
            )
    raise EstimateError(
        f"configure_optimizers returned {type(configured).__name__}, not an optimizer; return a "
        "torch.optim.Optimizer or pass optimizer=lambda params: torch.optim.AdamW(params)"
    )


def optimizer_factory(module: nn.Module, optimizer: Callable | None) -> Callable[[nn.Module], torch.optim.Optimizer]:
    """``copy -> optimizer`` for the step: ``optimizer=`` over the copy's parameters, else the copy's own
    ``configure_optimizers`` (whose optimizers and schedulers the stand-in trainer then answers)."""
    if optimizer is not None:
        return lambda copy_: optimizer(copy_.parameters())
    if is_lightning_module(module):

        def configured(copy_: nn.Module) -> torch.optim.Optimizer:
            lightning = cast("LightningModule", copy_)  # a copy of the LightningModule
            with hook(f"{type(module).__name__}.configure_optimizers"):
                returned = lightning.configure_optimizers()
            chosen = first_optimizer(returned)
            give_trainer_optimizers(copy_, returned)
            return chosen

        return configured
    raise EstimateError(
        f"{type(module).__name__} is a plain nn.Module: pass optimizer=lambda params: "
        "torch.optim.AdamW(params) (and loss_fn= if module(batch).sum() is not the loss)"
    )


def _loss_of(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and "loss" in output:
        return output["loss"]
    return None


def default_loss(module: nn.Module, batch: Any) -> torch.Tensor:
    """The loss when no ``loss_fn=`` is given: ``training_step(batch, 0)``'s for a LightningModule, else
    ``module(batch)`` summed."""
    if is_lightning_module(module):
        with hook(f"{type(module).__name__}.training_step"):
            output = module.training_step(batch, 0)
        loss = _loss_of(output)
        if loss is None:
            raise EstimateError(
                f"{type(module).__name__}.training_step returned {type(output).__name__}; return the "
                "loss tensor (or a dict with 'loss'), or pass loss_fn="
            )
        return loss
    with hook(f"{type(module).__name__}.forward"):
        output = module(batch)
    if not isinstance(output, torch.Tensor):
        raise EstimateError(
            f"{type(module).__name__}(batch) returned {type(output).__name__}; pass "
            "loss_fn=lambda module, batch: <scalar loss>"
        )
    return output.float().sum()


def step_autocast(mode: Any, device_type: str, target_device_type: str) -> Callable[[], AbstractContextManager[Any]]:
    """The precision's context for the step's forward, as Lightning's precision plugin applies it around
    training_step only (its ``forward_context``): autocast under a mixed precision; under a true half precision the
    half dtype as torch's default dtype (tensors the forward creates without a dtype are half), no autocast."""
    if mode is None:
        return contextlib.nullcontext
    half = mode.true_half_dtype()
    if half is not None:
        return lambda: default_dtype(half)
    dtype = mode.autocast_dtype(target_device_type)
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device_type, dtype=dtype)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """``dtype`` as torch's default floating-point dtype inside the block (``HalfPrecision.forward_context``)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def use_foreach(optimizer: torch.optim.Optimizer) -> None:
    """Run the optimizer's multi-tensor (``foreach``) implementation, as torch does by default for
    parameters on CUDA: its temporaries are the ones a CUDA step allocates (and it dispatches a few
    ops per parameter *list*, not per parameter). Groups that chose ``foreach``/``fused`` keep it.
    ``capturable=True`` (CUDA graphs) asserts that parameters are on CUDA, which the CPU fakes are not: those
    groups run the non-capturable update (its step counters on the host: a few scalars fewer per parameter)."""
    for group in optimizer.param_groups:
        if group.get("capturable"):
            group["capturable"] = False
        chose = group.get("foreach") is not None or group.get("fused") or group.get("differentiable")
        if "foreach" in group and not chose:
            if isinstance(optimizer, torch.optim.Adam) and torch.is_tensor(group.get("lr")):
                continue  # torch keeps Adam/AdamW single-tensor for a tensor lr without capturable (adam.py)
            group["foreach"] = True


def run_automatic_steps(
    loop: StepLoop,
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    loss_fn: Callable,
    optimizer_hook: str = "the optimizer",
    lightning_hooks: bool = False,
) -> None:
    """The steps of automatic optimization. With ``lightning_hooks`` (a LightningModule stepped by its own
    ``training_step``) the module's hooks run where Lightning's closure and precision plugin call them:
    ``on_before_zero_grad`` and ``optimizer_zero_grad``; ``on_before_backward``, ``backward`` and
    ``on_after_backward``; ``on_before_optimizer_step`` and ``configure_gradient_clipping`` (the trainer's
    ``gradient_clip_val``); then the optimizer's step."""
    with hook(optimizer_hook):
        optimizer = make_optimizer(loop.module)
    if loop.foreach:
        use_foreach(optimizer)
    acc = loop.acc
    lightning = loop.module if lightning_hooks and is_lightning_module(loop.module) else None
    trainer = getattr(lightning, "_trainer", None)
    for step in range(1, loop.steps + 1):
        acc.step = step
        for micro in range(max(1, int(loop.micro_batches))):
            acc.micro_batch = micro
            with acc.labelled("forward"), loop.autocast(), hook("the loss (loss_fn)"):
                loss = loss_fn(loop.module, loop.batch)
            # Lightning's automatic optimization: zero_grad after the forward, before backward (with gradient
            # accumulation only on the first micro-batch of a step: the later ones add to the gradients)
            if micro == 0:
                _zero_grad(loop, optimizer, step, lightning)
            _backward(loop, loss, lightning)
            del loss
        acc.attributor.assign_module(loop.module)  # the new gradients
        if lightning is not None:
            _before_optimizer_step(loop, lightning, optimizer, trainer)
        labelled_optimizer_step(acc, optimizer)
        if trainer is not None and hasattr(trainer, "global_step"):
            trainer.global_step += 1  # as the fit loop counts optimizer steps


def _zero_grad(loop: StepLoop, optimizer: torch.optim.Optimizer, step: int, lightning: LightningModule | None) -> None:
    """Zero the gradients; through ``lightning``'s hooks where it is given (the module, a LightningModule)."""
    name = type(loop.module).__name__
    with loop.acc.labelled("zero_grad"):
        if lightning is not None:
            with hook(f"{name}.on_before_zero_grad"):
                lightning.on_before_zero_grad(optimizer)
            with hook(f"{name}.optimizer_zero_grad"):
                lightning.optimizer_zero_grad(0, step - 1, optimizer)
        else:
            optimizer.zero_grad(set_to_none=True)


def _backward(loop: StepLoop, loss: torch.Tensor, lightning: LightningModule | None) -> None:
    """The loss's backward; through ``lightning``'s hooks where it is given (the module, a LightningModule)."""
    name = type(loop.module).__name__
    with loop.acc.labelled("backward"), hook("the backward of the loss"):
        if lightning is not None:
            with hook(f"{name}.on_before_backward"):
                lightning.on_before_backward(loss)
            lightning.backward(loss)
            with hook(f"{name}.on_after_backward"):
                lightning.on_after_backward()
        else:
            loss.backward()


def _before_optimizer_step(
    loop: StepLoop, lightning: LightningModule, optimizer: torch.optim.Optimizer, trainer: Any
) -> None:
    name = type(lightning).__name__
    with loop.acc.labelled("optimizer"):
        with hook(f"{name}.on_before_optimizer_step"):
            lightning.on_before_optimizer_step(optimizer)
        with hook(f"{name}.configure_gradient_clipping"):
            lightning.configure_gradient_clipping(
                optimizer,
                gradient_clip_val=getattr(trainer, "gradient_clip_val", None),
                gradient_clip_algorithm=getattr(trainer, "gradient_clip_algorithm", None),
            )


def labelled_optimizer_step(acc: StepAccountant, optimizer: torch.optim.Optimizer, **kwargs: Any) -> Any:
    """``optimizer.step(**kwargs)`` labelled ``optimizer``, with a fake float read answering the optimizer's
    placeholder; the state it made lazily is attributed to the optimizer."""
    with acc.labelled("optimizer"), hook(f"the optimizer step ({type(optimizer).__name__}.step)"):
        acc.optimizer_phase = True
        try:
            result = optimizer.step(**kwargs)
        finally:
            acc.optimizer_phase = False
    acc.attributor.assign_optimizers([optimizer])  # state made lazily by the first step
    return result
