"""Where the estimate's batch comes from: the module's (or datamodule's) train loader, re-batched to any size.

One real sample batch is drawn with every random-number generator saved and put back, so taking it
changes nothing the user's training will see.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lightning_memkit._torch_compat import tree_flatten, tree_map
from lightning_memkit.errors import MemkitError
from lightning_memkit.estimate import _torch_compat

__all__ = [
    "preserved_rng",
    "sample_batch",
    "batch_size_of",
    "rebatch",
    "converted_floats",
    "NoBatchError",
    "sample_batch_and_length",
    "train_loader_and_length",
]


class NoBatchError(MemkitError, ValueError):
    """No batch can be found for the estimate; the message says what to pass."""


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Put torch's CPU generator, ``random`` and numpy's state back afterwards, and the CUDA generators' (their
    states where CUDA is initialised, else the seeds ``torch.manual_seed`` queued for them: memkit's own seeding in
    the block must not replace the seed the user's run gets when CUDA starts)."""
    torch_state = torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    queued_cuda = _torch_compat.queued_cuda_seeds() if cuda_states is None else None
    python_state = random.getstate()
    numpy_state = None
    with contextlib.suppress(ImportError):  # numpy is optional: torch runs without it
        import numpy

        numpy_state = numpy.random.get_state()
    try:
        yield
    finally:
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        else:
            _torch_compat.requeue_cuda_seeds(queued_cuda)
        random.setstate(python_state)
        if numpy_state is not None:
            numpy.random.set_state(numpy_state)


def batch_size_of(batch: Any) -> int | None:
    """The leading dimension of the batch's first tensor with at least one dimension, or ``None``."""
    for leaf in tree_flatten(batch)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return None


def _call_hook(owner: Any, hook: str, *arguments: Any) -> Any:
    """``owner.hook(*arguments)``; a failure becomes a :class:`NoBatchError` that names the hook."""
    try:
        return getattr(owner, hook)(*arguments)
    except NoBatchError:
        raise
    except Exception as error:  # the user's hook may raise anything: a NoBatchError names the hook
        shown = ", ".join(repr(a) for a in arguments)
        raise NoBatchError(
            f"{type(owner).__name__}.{hook}({shown}) failed while memkit took a sample batch: "
            f"{type(error).__name__}: {error}"
        ) from error


def _is_running(datamodule: Any) -> bool:
    """Whether a Trainer has this datamodule in a fit now (it is then set up already)."""
    trainer = getattr(datamodule, "trainer", None)
    return trainer is not None and getattr(trainer, "datamodule", None) is datamodule


def _train_loader(module: Any, datamodule: Any) -> Any:
    """The train dataloader of ``datamodule``, the module's trainer's datamodule, or the module itself.

    A datamodule that no running fit owns is prepared and set up first, as ``Trainer.fit`` does
    (``prepare_data()``, then ``setup("fit")``), since its datasets are usually made in ``setup``.
    """
    candidates = []
    if datamodule is not None:
        candidates.append(datamodule)
    trainer = getattr(module, "_trainer", None)
    if (
        trainer is not None
        and getattr(trainer, "datamodule", None) is not None
        and trainer.datamodule is not datamodule
    ):
        candidates.append(trainer.datamodule)
    candidates.append(module)
    for owner in candidates:
        method = getattr(owner, "train_dataloader", None)
        if method is None:
            continue
        if owner is datamodule and not _is_running(datamodule):
            for hook, arguments in (("prepare_data", ()), ("setup", ("fit",))):
                if callable(getattr(owner, hook, None)):
                    _call_hook(owner, hook, *arguments)
        try:
            return method()
        except Exception as error:  # Lightning's default hook raises when it is not implemented
            if "must be implemented" in str(error) or isinstance(error, NotImplementedError):
                continue
            raise NoBatchError(
                f"{type(owner).__name__}.train_dataloader() failed while memkit took a sample batch: "
                f"{type(error).__name__}: {error}"
            ) from error
    return None


def sample_batch(module: Any, datamodule: Any = None) -> Any:
    """One batch from the train dataloader (see :func:`sample_batch_and_length`)."""
    return sample_batch_and_length(module, datamodule)[0]


def _is_loader(candidate: Any) -> bool:
    """Whether ``candidate`` is a loader in a collection of loaders (not a batch in a list of ready batches)."""
    return hasattr(candidate, "__iter__") and not isinstance(candidate, (torch.Tensor, tuple, list, dict, str))


def train_loader_and_length(module: Any, datamodule: Any = None) -> tuple[Any, int | None]:
    """The train dataloader of ``datamodule`` or ``module`` (the first of several) and its length in batches
    (``None`` when it has none); see :func:`_train_loader` for which hooks run.

    Raises:
        NoBatchError: when neither has a ``train_dataloader()`` (the message says what to pass), or a hook fails.
    """
    loader = _train_loader(module, datamodule)
    if loader is None:
        raise NoBatchError(
            f"{type(module).__name__} has no train_dataloader() and no datamodule was given: pass an example "
            "batch (batch=...), or a datamodule (datamodule=...), or implement train_dataloader() on the module"
        )
    if isinstance(loader, (list, tuple)) and loader and _is_loader(loader[0]):
        loader = loader[0]
    if isinstance(loader, dict):
        loader = next(iter(loader.values()))
    try:
        batches = int(len(loader))
    except Exception:  # noqa: BLE001 - an iterable dataset has no length
        batches = None
    return loader, batches


def sample_batch_and_length(module: Any, datamodule: Any = None) -> tuple[Any, int | None]:
    """One batch from the train dataloader of ``datamodule`` or ``module``, RNG state untouched.

    A ``datamodule`` that no running fit owns gets ``prepare_data()`` and ``setup("fit")`` first, as
    ``Trainer.fit`` would call them.

    Returns:
        ``(batch, batches)``: the batch and the loader's length in batches (``None`` when it has none).

    Raises:
        NoBatchError: when neither has a ``train_dataloader()``, it is empty, or one of these hooks (or
            the loader's first batch) fails: the message names the hook.
    """
    with preserved_rng():
        loader, batches = train_loader_and_length(module, datamodule)
        try:
            return next(iter(loader)), batches
        except StopIteration:
            raise NoBatchError(
                f"the train dataloader of {type(module).__name__} is empty; pass an example batch (batch=...)"
            ) from None
        except Exception as error:  # the user's loader may raise anything: a NoBatchError says where
            raise NoBatchError(
                f"the first batch of the train dataloader failed while memkit took a sample batch: "
                f"{type(error).__name__}: {error}"
            ) from error


def rebatch(batch: Any, new_size: int, make: Callable[[torch.Tensor, int], torch.Tensor] | None = None) -> Any:
    """``batch`` with every tensor whose leading dimension is the batch size grown or cut to ``new_size``.

    ``make(tensor, new_size)`` builds each new tensor; by default rows are repeated cyclically,
    so values stay plausible (valid token ids, valid labels).
    """
    old_size = batch_size_of(batch)
    if old_size is None:
        raise NoBatchError(
            "the batch has no tensor with a batch dimension; pass an example batch of the size to estimate (batch=...)"
        )
    if new_size < 1:
        raise ValueError(f"batch_size must be a positive integer, not {new_size!r}")

    def default(tensor: torch.Tensor, size: int) -> torch.Tensor:
        index = torch.arange(size, device=tensor.device) % old_size
        return tensor.index_select(0, index)

    make = make or default

    def convert(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == old_size:
            return leaf if new_size == old_size and make is default else make(leaf, new_size)
        return leaf

    return tree_map(convert, batch)


def converted_floats(batch: Any, dtype: torch.dtype | None) -> Any:
    """``batch`` with each floating-point tensor leaf converted to ``dtype`` (what Lightning's ``HalfPrecision``
    plugin does to every batch, ``convert_input``); ``batch`` itself when ``dtype`` is ``None``."""
    if dtype is None:
        return batch
    return tree_map(
        lambda leaf: leaf.to(dtype) if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() else leaf, batch
    )
