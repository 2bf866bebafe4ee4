"""The few private Lightning internals memkit reads, wrapped in one place and pinned by tests.

If a Lightning release renames one of them, the fallback keeps training going and
tests/compat/test_lightning_compat.py says which one moved.

Lightning is imported inside the functions: the core (the estimate) imports this module, and the core has no
Lightning import (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import copy
import types
from typing import Any

__all__ = [
    "logging_step",
    "optimizer_steps_after_batch",
    "fsdp_activation_checkpointing_configured",
    "forget_model_logging",
    "fit_data_from_module",
    "reload_train_dataloader",
    "train_loader",
    "use_train_loader",
    "train_dataset_length",
    "reset_fit_progress",
    "manual_optimizers_and_schedulers",
    "automatic_optimizers_and_schedulers",
    "lightning_optimizers",
    "tuner_exit_exception",
    "clear_logged_results",
    "no_per_step_sigterm_broadcast",
    "loop_flags",
    "set_loop_flags",
    "attach_stand_in_trainer",
    "attached_trainer",
    "copy_module",
    "drop_train_data_fetcher",
    "prefetched_batches",
    "logged_metrics_state",
    "restore_logged_metrics",
    "give_device_mesh",
    "fsdp_mixed_precision",
    "ddp_kwargs",
]


def logging_step(trainer: Any) -> int:
    """The step that Lightning's own ``self.log`` metrics are written at.

    Lightning logs at ``fit_loop.epoch_loop._batches_that_stepped`` (optimizer steps,
    counted once per batch even with several optimizers); memkit uses the same axis so memory
    lines up with the loss curve. Falls back to ``trainer.global_step``.
    """
    try:
        return int(trainer.fit_loop.epoch_loop._batches_that_stepped)
    except AttributeError:
        return int(trainer.global_step)


def optimizer_steps_after_batch(trainer: Any) -> bool:
    """Whether the batch now ending is the last of its optimizer step (no more accumulation).

    Reads ``fit_loop.epoch_loop._should_accumulate()``; falls back to ``True`` so a memory
    window never stays open across the whole epoch.
    """
    try:
        return not trainer.fit_loop.epoch_loop._should_accumulate()
    except AttributeError:
        return True


def fsdp_activation_checkpointing_configured(strategy: Any) -> bool | None:
    """``None`` when ``strategy`` is not Lightning's FSDPStrategy; else whether it was given an
    ``activation_checkpointing_policy`` (read from the private ``_activation_checkpointing_kwargs``)."""
    try:
        from lightning.pytorch.strategies import FSDPStrategy  # deferred: the core imports this module
    except ImportError:
        return None
    if not isinstance(strategy, FSDPStrategy):
        return None
    return bool(getattr(strategy, "_activation_checkpointing_kwargs", None))


def forget_model_logging(callback: Any) -> None:
    """Drop ``callback.log`` / ``callback.log_dict``: Lightning binds them to the LightningModule on every
    callback when a fit starts (``_CallbackConnector._attach_model_logging_functions``) and never removes
    them, so a callback kept after the fit (to read its records) would keep the model, its gradients
    and its optimizer state alive. Lightning binds them again at the next fit, validate or test.
    Pinned by tests/compat/test_lightning_compat.py."""
    for name in ("log", "log_dict"):
        vars(callback).pop(name, None)


# ---------------------------------------------------------------------------- batch-size search
def fit_data_from_module(trainer: Any) -> bool:
    """Whether the fit's train data comes from the LightningModule or a DataModule (not loaders given to ``fit``).

    Reads ``fit_loop._data_source.is_module()``; falls back to ``True``.
    """
    try:
        return bool(trainer.fit_loop._data_source.is_module())
    except AttributeError:
        return True


def reload_train_dataloader(trainer: Any) -> None:
    """Make the fit loop build its train dataloader again (after the batch size changed).

    Sets ``fit_loop._combined_loader = None`` and calls ``fit_loop.setup_data()``, as Lightning's
    own batch-size finder does.
    """
    trainer.fit_loop._combined_loader = None
    trainer.fit_loop.setup_data()


def train_loader(trainer: Any) -> Any:
    """The fit's (first) train dataloader as the fit loop holds it (``fit_loop._combined_loader.flattened[0]``), or
    ``None`` before it is set up."""
    try:
        return trainer.fit_loop._combined_loader.flattened[0]
    except (AttributeError, IndexError, TypeError):
        return None


def use_train_loader(trainer: Any, loader: Any) -> None:
    """Make the fit loop's next run iterate ``loader`` in place of its (first) train dataloader, through
    ``CombinedLoader.flattened`` (public) on ``fit_loop._combined_loader`` (private), and the data fetcher's iterator
    (``fit_loop._data_fetcher``, private) made anew over it. Call after :func:`reload_train_dataloader`; the next
    reload puts the module's own loader back."""
    fit_loop = trainer.fit_loop
    combined = fit_loop._combined_loader
    combined.flattened = [loader, *combined.flattened[1:]]
    fetcher = getattr(fit_loop, "_data_fetcher", None)
    if fetcher is not None:  # setup_data made its iterator over the old loader already: make it anew
        fetcher.setup(combined)
        iter(fetcher)


def train_dataset_length(trainer: Any) -> int | None:
    """The length of the fit's (first) train dataset, or ``None`` for iterable datasets or when unknown."""
    try:
        loaders = trainer.fit_loop._combined_loader.flattened
        return int(len(loaders[0].dataset))
    except (AttributeError, IndexError, TypeError):
        return None


def reset_fit_progress(trainer: Any) -> None:
    """Zero the fit loop's progress counters (epochs, batches, optimizer steps) so a trial starts at step 0."""
    fit_loop = trainer.fit_loop
    epoch_loop = fit_loop.epoch_loop
    fit_loop.epoch_progress.reset()
    epoch_loop.batch_progress.reset()
    epoch_loop.scheduler_progress.reset()
    epoch_loop.automatic_optimization.optim_progress.reset()
    epoch_loop.manual_optimization.optim_step_progress.reset()
    epoch_loop._batches_that_stepped = 0
    fit_loop.restarting = False


def manual_optimizers_and_schedulers(configured: Any) -> tuple[list[Any], list[Any]]:
    """The optimizers and the scheduler configs of a manually optimized module, from what its
    ``configure_optimizers`` returned: Lightning's private ``_configure_optimizers`` (every accepted return
    shape) then ``_configure_schedulers_manual_opt`` (``lightning.pytorch.core.optimizer``), as
    ``Trainer.fit`` sets them up."""
    # deferred: the core imports this module
    from lightning.pytorch.core.optimizer import _configure_optimizers, _configure_schedulers_manual_opt

    optimizers, schedulers, _ = _configure_optimizers(configured)
    return optimizers, _configure_schedulers_manual_opt(schedulers)


def automatic_optimizers_and_schedulers(configured: Any) -> tuple[list[Any], list[Any]]:
    """The optimizers and the scheduler configs of an automatically optimized module, from what its
    ``configure_optimizers`` returned: Lightning's private ``_configure_optimizers`` then
    ``_configure_schedulers_automatic_opt`` (``lightning.pytorch.core.optimizer``), as ``Trainer.fit`` sets them up
    (what ``self.trainer.optimizers`` and ``self.lr_schedulers()`` answer during fit)."""
    # deferred: the core imports this module
    from lightning.pytorch.core.optimizer import _configure_optimizers, _configure_schedulers_automatic_opt

    optimizers, schedulers, monitor = _configure_optimizers(configured)
    return optimizers, _configure_schedulers_automatic_opt(schedulers, monitor)


def lightning_optimizers(optimizers: list[Any], strategy: Any) -> list[Any]:
    """Lightning's ``LightningOptimizer`` wrappers of ``optimizers`` for ``strategy`` (its private
    ``_to_lightning_optimizer``), what ``self.optimizers()`` returns in a manually optimized module."""
    from lightning.pytorch.core.optimizer import LightningOptimizer  # deferred: the core imports this module

    return [LightningOptimizer._to_lightning_optimizer(each, strategy) for each in optimizers]


def tuner_exit_exception() -> type:
    """Lightning's exception that ends ``fit`` quietly after a tuner callback (``_TunerExitException``)."""
    from lightning.pytorch.utilities.exceptions import _TunerExitException  # deferred: the core imports this module

    return _TunerExitException


def clear_logged_results(trainer: Any) -> None:
    """Forget what ``self.log`` collected in the fit loop (``fit_loop.epoch_loop._results``) and the batch
    it keeps, so values logged during batch-size trials neither leak into training nor clash with its
    logging, and no trial's batch stays alive."""
    results = getattr(getattr(trainer.fit_loop, "epoch_loop", None), "_results", None)
    if results is not None:
        results.clear()
        # the collection also keeps the last batch it saw (``_ResultCollection.batch``, for batch-size
        # inference): after a trial, that batch must not stay alive
        if hasattr(results, "batch"):
            results.batch = None
        if hasattr(results, "batch_size"):
            results.batch_size = None


@contextlib.contextmanager
def no_per_step_sigterm_broadcast(trainer: Any):
    """Inside the block, skip the ``torch.distributed.broadcast`` Lightning (>= 2.5) makes every training
    batch to share SIGTERM (``epoch_loop._broadcast_sigterm_tensor``), so a rank that runs out of memory
    alone cannot leave the others waiting in it. A no-op where the method does not exist."""
    epoch_loop = trainer.fit_loop.epoch_loop
    if not hasattr(epoch_loop, "_broadcast_sigterm_tensor"):
        yield
        return
    epoch_loop._broadcast_sigterm_tensor = lambda: None
    try:
        yield
    finally:
        del epoch_loop._broadcast_sigterm_tensor


_LOOP_FLAGS = ("_restarting", "_loaded_from_state_dict", "_resuming_from_checkpoint", "_restart_stage")


def _loops(loop: Any) -> list[Any]:
    from lightning.pytorch.loops.loop import _Loop  # deferred: the core imports this module

    found = [loop]
    for value in vars(loop).values():
        if isinstance(value, _Loop):
            found += _loops(value)
    return found


def loop_flags(loop: Any) -> list[dict[str, Any]]:
    """The restart flags of ``loop`` and every loop inside it (``loop.load_state_dict`` sets them as if
    resuming from a checkpoint; the batch-size search puts them back with :func:`set_loop_flags`)."""
    return [{name: getattr(each, name) for name in _LOOP_FLAGS if hasattr(each, name)} for each in _loops(loop)]


def set_loop_flags(loop: Any, flags: list[dict[str, Any]]) -> None:
    """Put back flags saved by :func:`loop_flags` (same loop tree)."""
    for each, saved in zip(_loops(loop), flags, strict=True):
        for name, value in saved.items():
            setattr(each, name, value)


def attach_stand_in_trainer(module: Any, stand_in: Any) -> None:
    """Give ``module`` (memkit's copy) and every LightningModule inside it ``stand_in`` as trainer, and
    mute ``self.log`` / ``self.log_dict`` on them (logging needs a Trainer's result collection)."""
    try:
        from lightning.pytorch import LightningModule  # deferred: the core imports this module
    except ImportError:  # pragma: no cover
        return
    stand_in.lightning_module = module
    for each in module.modules():
        if isinstance(each, LightningModule):
            each._trainer = stand_in  # the property's setter would also do this; _trainer is what every read uses
            # instance attributes that shadow the methods, on memkit's copy only
            each.log = _no_log  # type: ignore[method-assign]
            each.log_dict = _no_log  # type: ignore[method-assign]


def attached_trainer(module: Any) -> Any:
    """The Trainer ``module`` is attached to, or ``None``: ``LightningModule._trainer``, which the public ``trainer``
    property reads but raises on when there is none."""
    return getattr(module, "_trainer", None)


def _no_log(*args: Any, **kwargs: Any) -> None:
    return None


#: the step methods Lightning's ``from_compiled`` compiles on the instance (lightning/pytorch/utilities/compile.py)
_COMPILED_METHODS = ("forward", "training_step", "validation_step", "test_step", "predict_step")


def copy_module(module: Any, memo: dict[int, Any] | None = None, *, compiled: bool = True) -> Any:
    """``copy.deepcopy(module, memo)`` whose step methods run the copy, not ``module``.

    ``trainer.fit(torch.compile(model))`` makes Lightning's ``from_compiled`` put compiled wrappers of the module's
    bound methods on the instance (``forward``, ``training_step``...), and keep the originals and the dynamo context
    in the private ``_compiler_ctx``. A deep copy keeps those wrappers, which call the original module: a step of the
    copy would train the original's parameters. Here each is the copy's own method: compiled again with the same
    dynamo context (``compiled=True``: a trial, which runs as the fit will), or plain (``compiled=False``: a step
    under a dispatch mode, which runs the eager program). Without ``_compiler_ctx`` the copy is ``copy.deepcopy``'s.
    """
    memo = dict(memo or {})
    context = vars(module).get("_compiler_ctx")
    if not isinstance(context, dict) or "dynamo_ctx" not in context:
        return copy.deepcopy(module, memo)
    dynamo = context["dynamo_ctx"]
    memo.setdefault(id(dynamo), dynamo)  # the compile settings are shared, not copied
    copied = copy.deepcopy(module, memo)
    own = dict(context)
    for name in _COMPILED_METHODS:
        original = context.get(f"original_{name}")
        if name not in vars(module) or original is None or getattr(original, "__self__", None) is not module:
            continue
        method = types.MethodType(original.__func__, copied)
        own[f"original_{name}"] = method
        if compiled:
            setattr(copied, name, dynamo(method))
        else:
            vars(copied).pop(name, None)  # the class's method shows through
    copied._compiler_ctx = own if compiled else None
    return copied


def drop_train_data_fetcher(trainer: Any) -> None:
    """Tear down the fit loop's data fetcher (``fit_loop._data_fetcher``), which keeps the batch it
    prefetched: after a batch-size trial, above all one that ran out of memory, that batch must not stay
    alive. The next ``fit_loop.run()`` makes a new fetcher."""
    fit_loop = trainer.fit_loop
    fetcher = getattr(fit_loop, "_data_fetcher", None)
    if fetcher is not None:
        fetcher.teardown()
        fit_loop._data_fetcher = None


def prefetched_batches(trainer: Any) -> list[Any]:
    """The batches the fit loop's data fetcher already fetched for the steps after the one running now, as it
    keeps them (``(batch, batch_idx, dataloader_idx)``): ``fit_loop._data_fetcher.batches`` of Lightning's
    ``_PrefetchDataFetcher``, which fetches one batch ahead when the train loader has no length (an iterable
    dataset) and none when it has one. Falls back to ``[]`` (a fetcher without ``batches``, no fit running).
    Pinned by tests/compat/test_lightning_compat.py."""
    fetcher = getattr(getattr(trainer, "fit_loop", None), "_data_fetcher", None)
    batches = getattr(fetcher, "batches", None)
    return list(batches) if isinstance(batches, list) else []


_METRIC_DICTS = ("_callback_metrics", "_logged_metrics", "_progress_bar_metrics")


def logged_metrics_state(trainer: Any) -> dict[str, dict]:
    """Shallow copies of ``trainer.callback_metrics``, ``logged_metrics`` and ``progress_bar_metrics``
    (the logger connector's private dicts), for :func:`restore_logged_metrics`."""
    connector = getattr(trainer, "_logger_connector", None)
    return {
        name: dict(getattr(connector, name))
        for name in _METRIC_DICTS
        if isinstance(getattr(connector, name, None), dict)
    }


def restore_logged_metrics(trainer: Any, saved: dict[str, dict]) -> None:
    """Put back what :func:`logged_metrics_state` saved: a batch-size trial's ``self.log`` values (a loss
    tensor of the trial's graph) neither stay alive nor show as the run's metrics."""
    connector = getattr(trainer, "_logger_connector", None)
    for name, values in saved.items():
        setattr(connector, name, dict(values))


def give_device_mesh(module: Any, mesh: Any) -> None:
    """Set the LightningModule's ``device_mesh`` (its private ``_device_mesh``, which the property returns) as
    ModelParallelStrategy's ``setup_environment`` does before ``configure_model``. Pinned by
    tests/test_lightning_compat.py."""
    module._device_mesh = mesh


def fsdp_mixed_precision(precision: str) -> Any:
    """The ``torch.distributed.fsdp.MixedPrecision`` Lightning's FSDPStrategy gives FSDP for ``precision`` (its
    ``FSDPPrecision.mixed_precision_config``: ``bf16-mixed`` and ``bf16-true`` gather parameters and reduce gradients
    in bf16, ``16-*`` in fp16, ``32-true`` in fp32), read from Lightning's own plugin (the warning it gives for a
    true half precision is left out)."""
    import warnings

    from lightning.pytorch.plugins.precision.fsdp import FSDPPrecision

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return FSDPPrecision(precision).mixed_precision_config  # type: ignore[arg-type]  # validated by the caller


def ddp_kwargs(strategy: Any) -> dict[str, Any]:
    """The keyword arguments Lightning's DDPStrategy passes to ``DistributedDataParallel`` (its private
    ``_ddp_kwargs``: ``bucket_cap_mb``, ``gradient_as_bucket_view``, ``find_unused_parameters``...); ``{}`` when
    it has none. Pinned by tests/test_lightning_compat.py."""
    return dict(getattr(strategy, "_ddp_kwargs", None) or {})
