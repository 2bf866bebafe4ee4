"""What a trial changes and how it is put back: the snapshot of the fit's state, the memory a search may fill,
and the tensors a trial starts from."""

from __future__ import annotations

import contextlib
import copy
import gc
from collections.abc import Iterator
from typing import Any

import psutil
import torch

from lightning_memkit import _lightning_compat as compat
from lightning_memkit._torch_compat import tree_map
from lightning_memkit.estimate.data.batches import preserved_rng
from lightning_memkit.meter import training_state_tensors
from lightning_memkit.modes.mode import TRUE_HALF_PRECISIONS, Mode
from lightning_memkit.search._torch_compat import reset_scaler_optimizer_stages
from lightning_memkit.search.real_steps import RealSteps
from lightning_memkit.search.searchable import _lightning_getattr, _lightning_setattr

__all__ = [
    "Snapshot",
    "real_steps_gate",
    "reset_scaler",
    "trainer_mode",
    "release_memory",
    "local_shard",
    "state_tensors",
    "cuda_capacity_bytes",
    "host_search_budget_bytes",
    "HOST_BUDGET_FRACTION",
    "CPU_MAX_SECONDS",
]


def _to_host(tree: Any) -> Any:
    """A deep copy of ``tree`` with every tensor copied to the CPU (bit for bit)."""
    copied = tree_map(lambda leaf: leaf.detach().to("cpu", copy=True) if isinstance(leaf, torch.Tensor) else leaf, tree)
    return copy.deepcopy(copied)


class Snapshot:
    """Everything a trial changes, copied in memory: weights, optimizer/scheduler/precision state,
    loop counters, RNG states, and the trainer settings the trials override."""

    def __init__(self, trainer: Any, module: Any, batch_arg_name: str) -> None:
        # on the host, so that nothing of the search holds device memory during a trial
        self.module_state = {k: _to_host(v) for k, v in module.state_dict().items()}
        # the gradients the module holds now (None before fit; the last step's mid-training): the trials'
        # last gradients must not stay alive on the device after the search
        self.gradients = [(p, None if p.grad is None else _to_host(p.grad)) for p in module.parameters()]
        # which parameters train: a trial that runs out of memory between toggle_optimizer and untoggle_optimizer
        # (manual optimization) leaves the other optimizers' parameters frozen, and the next toggle would keep them so
        self.requires_grad = [(p, p.requires_grad) for p in module.parameters()]
        self.optimizers = [_to_host(o.state_dict()) for o in trainer.optimizers]
        self.schedulers = [_to_host(c.scheduler.state_dict()) for c in trainer.lr_scheduler_configs]
        self.precision = _to_host(trainer.precision_plugin.state_dict())
        self.loop_state = copy.deepcopy(trainer.fit_loop.state_dict())
        self.loop_flags = compat.loop_flags(trainer.fit_loop)
        self.metrics = compat.logged_metrics_state(trainer)
        self.callbacks = trainer.callbacks
        self.loggers = trainer.loggers
        self.max_steps = trainer.fit_loop.epoch_loop.max_steps
        self.max_epochs = trainer.fit_loop.max_epochs
        self.limit_train_batches = trainer.limit_train_batches
        self.limit_val_batches = trainer.limit_val_batches
        self.should_stop = trainer.should_stop
        self.training = module.training
        self.batch_size = _lightning_getattr(module, batch_arg_name)
        self.rng = preserved_rng()
        self.rng.__enter__()

    def restore_requires_grad(self) -> None:
        """Every parameter trains or is frozen as it was when the search began."""
        for parameter, requires_grad in self.requires_grad:
            if parameter.requires_grad != requires_grad:
                parameter.requires_grad_(requires_grad)

    def restore_precision(self, trainer: Any) -> None:
        """The precision plugin's state as when the search began: a GradScaler's scale and growth tracker, so each
        trial starts from the fit's scale, not from where the last trial's skipped steps left it."""
        trainer.precision_plugin.load_state_dict(copy.deepcopy(self.precision))
        reset_scaler(trainer)  # load_state_dict keeps an optimizer "unscaled" by a trial that ran out of memory

    def restore(self, trainer: Any, module: Any, batch_arg_name: str) -> None:
        self.restore_requires_grad()
        with torch.no_grad():
            module.load_state_dict(self.module_state)
            for parameter, gradient in self.gradients:
                parameter.grad = None if gradient is None else gradient.to(parameter.device)
        for optimizer, state in zip(trainer.optimizers, self.optimizers, strict=True):
            optimizer.load_state_dict(copy.deepcopy(state))  # torch casts the state back to each parameter's device
        for config, state in zip(trainer.lr_scheduler_configs, self.schedulers, strict=True):
            config.scheduler.load_state_dict(copy.deepcopy(state))
        self.restore_precision(trainer)
        trainer.callbacks = self.callbacks
        trainer.loggers = self.loggers
        trainer.fit_loop.epoch_loop.max_steps = self.max_steps
        trainer.fit_loop.max_epochs = self.max_epochs
        trainer.limit_train_batches = self.limit_train_batches
        trainer.limit_val_batches = self.limit_val_batches
        trainer.should_stop = self.should_stop
        trainer.fit_loop.load_state_dict(copy.deepcopy(self.loop_state))
        compat.set_loop_flags(trainer.fit_loop, self.loop_flags)
        compat.clear_logged_results(trainer)
        compat.restore_logged_metrics(trainer, self.metrics)
        module.train(self.training)
        _lightning_setattr(module, batch_arg_name, self.batch_size)
        self.rng.__exit__(None, None, None)


def reset_scaler(trainer: Any) -> None:
    """Every optimizer ready for ``unscale_`` again in the precision plugin's GradScaler (``16-mixed``)."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is not None:
        reset_scaler_optimizer_stages(scaler)


def real_steps_gate(trainer: Any, wanted: int) -> RealSteps | None:
    """The callback that tells a trial's real optimizer steps from those the precision plugin's GradScaler skipped,
    and stops the fit at the ``wanted``-th real one; ``None`` without an enabled GradScaler (no step is skipped)."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return RealSteps(wanted) if scaler is not None and scaler.is_enabled() else None


def trainer_mode(trainer: Any) -> Any:
    """The Mode of the Trainer's precision (checkpointing, if any, is already on the module)."""
    precision = str(trainer.precision)
    if precision in TRUE_HALF_PRECISIONS:
        return Mode(precision=precision)
    if "bf16" in precision and "mixed" in precision:
        return Mode(precision="bf16-mixed")
    if precision.startswith("16") and "mixed" in precision:
        return Mode(precision="16-mixed")
    return None


def release_memory(device: torch.device) -> None:
    """Free what the last trial left (its tensors live only in reference cycles after an out-of-memory
    error) and give the caching allocator's free blocks back, so each trial starts like a fresh fit."""
    gc.collect()
    if device.type == "cuda" and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def cuda_capacity_bytes(device: torch.device) -> int:
    """The bytes a search on ``device`` may fill: what is free on the device (other processes' memory
    is not) plus what this process's allocator holds, capped by ``set_per_process_memory_fraction``."""
    release_memory(device)
    free, total = torch.cuda.mem_get_info(device)
    capacity = int(free + torch.cuda.memory_reserved(device))
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if fraction is not None:
        with contextlib.suppress(RuntimeError, TypeError):  # pragma: no cover - older torch
            capacity = min(capacity, int(fraction(device) * total))
    return capacity


#: the share of the host's available memory a CPU search without ``budget=`` may fill with tensors.
HOST_BUDGET_FRACTION = 0.5

#: seconds of trials a CPU search without ``budget=`` may spend (CPU steps at large batches are slow, and
#: host memory seldom bounds them): the search stops before a trial projected to end past it.
CPU_MAX_SECONDS = 60.0


def host_search_budget_bytes() -> int:
    """The default CPU search budget: :data:`HOST_BUDGET_FRACTION` of the host memory available now, in bytes."""
    return int(psutil.virtual_memory().available * HOST_BUDGET_FRACTION)


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a DTensor's local shard (``to_local()``), else the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def state_tensors(trainer: Any, module: Any) -> Iterator[torch.Tensor]:
    return training_state_tensors(module, trainer.optimizers)
