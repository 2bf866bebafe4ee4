"""Errors of the estimated step: which user hook or phase of the step an error came from (:func:`hook`), and the
:class:`EstimateError` that names it, the user's own line and, for a data-dependent op, what to do (:func:`failure`).
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator

from torch import nn

from lightning_memkit._user_code import is_user_file
from lightning_memkit.errors import MemkitError
from lightning_memkit.estimate.data.batches import NoBatchError
from lightning_memkit.estimate.step.memory_estimate import EstimateError

__all__ = ["HookFailed", "hook", "failure", "DATA_DEPENDENT_ADVICE", "DATA_DEPENDENT_HINT"]


class HookFailed(MemkitError):
    """A user hook (or a phase of the step) raised: carries which one, and the original error."""

    def __init__(self, hook: str, error: BaseException) -> None:
        super().__init__(hook)
        self.hook = hook
        self.error = error


@contextlib.contextmanager
def hook(name: str) -> Iterator[None]:
    """Name the hook (or step phase) any error in the block came from; the innermost name wins."""
    try:
        yield
    except (HookFailed, EstimateError, NoBatchError):
        raise
    except Exception as error:  # the user's hook may raise anything: HookFailed names the hook
        raise HookFailed(name, error) from error


def _user_line(error: BaseException) -> str:
    """``file:line`` of the innermost frame of ``error``'s traceback in the user's own code (not memkit, torch,
    Lightning, the standard library or an installed package: :func:`~lightning_memkit._user_code.is_user_file`),
    or ``""``."""
    found = ""
    for frame in traceback.extract_tb(error.__traceback__):
        if is_user_file(frame.filename):
            found = f"{frame.filename}:{frame.lineno}"
    return found


def failure(module: nn.Module, fake: bool, error: BaseException) -> EstimateError:
    """The :class:`EstimateError` for ``error`` raised by the step of ``module`` (fake or real): the hook it came
    from, the error, the user's own line, and for a data-dependent op what to do instead."""
    where = "on fake tensors" if fake else "on a real copy"
    if isinstance(error, HookFailed):
        name, cause = error.hook, error.error
    else:
        name, cause = f"the training step of {type(module).__name__}", error
    text = f"{type(cause).__name__}: {cause}"
    where_in_user_code = _user_line(cause)
    hint = ""
    if fake and _is_data_dependent(cause):
        hint = DATA_DEPENDENT_HINT
    at = f" (at {where_in_user_code})" if where_in_user_code else ""
    error = EstimateError(f"{name} failed {where}: {text}{at}.{hint}")
    error.data_dependent = bool(hint)  # the CLI swaps DATA_DEPENDENT_ADVICE (Python) for its own command
    return error


#: the part of :data:`DATA_DEPENDENT_HINT` that says what to do, in Python's terms (the CLI says it in its own)
DATA_DEPENDENT_ADVICE = "use measure_training_step() on a small batch, or express it without the data-dependent shape."

#: what an EstimateError adds when an op's output shape or a value depended on data the fakes do not have
DATA_DEPENDENT_HINT = (
    " An op's output shape or a value read from a tensor depends on data the fake tensors do not"
    " hold and memkit has no bound for it (see docs/will_it_fit.md, data-dependent ops); " + DATA_DEPENDENT_ADVICE
)


def _is_data_dependent(error: BaseException) -> bool:
    """Whether ``error`` is FakeTensorMode refusing a data-dependent op (an output shape or a value from data)."""
    return "data-dependent" in str(error).lower() or type(error).__name__ in (
        "DynamicOutputShapeException",
        "DataDependentOutputException",
    )
