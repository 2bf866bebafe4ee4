"""A byte budget on live tensors that fails like an out-of-memory error: the batch-size search, testable on CPU.

The tensor accountant counts every storage; when an op leaves more than the budget alive, the op's
result is dropped and :class:`BudgetExceededError` (a ``torch.OutOfMemoryError``) is raised.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lightning_memkit._torch_compat import TorchDispatchMode
from lightning_memkit.accounting.accountant import TensorAccountant
from lightning_memkit.compiled._torch_compat import force_eager
from lightning_memkit.errors import MemkitError
from lightning_memkit.units import format_bytes

__all__ = ["BudgetExceededError", "MemoryBudget"]


class BudgetExceededError(MemkitError, torch.OutOfMemoryError):
    """Live tensor bytes crossed a :class:`MemoryBudget`: an out-of-memory error, on any device.

    Attributes:
        requested_bytes: live tensor bytes after the op that crossed the budget.
        budget_bytes: the budget.
    """

    def __init__(self, requested_bytes: int, budget_bytes: int) -> None:
        # The CPU allocator's own wording, so every OOM check (memkit's, Lightning's is_oom_error) knows it.
        super().__init__(
            f"DefaultCPUAllocator: can't allocate memory: memkit budget: {format_bytes(requested_bytes)} of live "
            f"tensors would exceed the budget of {format_bytes(budget_bytes)} "
            f"({requested_bytes} > {budget_bytes} bytes)"
        )
        self.requested_bytes = requested_bytes
        self.budget_bytes = budget_bytes


class _Guard(TorchDispatchMode):
    def __init__(self, budget: MemoryBudget) -> None:
        super().__init__()
        self.budget = budget

    def __torch_dispatch__(  # noqa: D105
        self, func: Any, types: tuple[type, ...], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        result = func(*args, **(kwargs or {}))
        accountant = self.budget.accountant
        # Views allocate nothing; raising while a view is being set up can abort the interpreter.
        if accountant.current_bytes > self.budget.budget_bytes and not func.is_view:
            requested = accountant.current_bytes
            del result
            self.budget.exceeded += 1
            raise BudgetExceededError(requested, self.budget.budget_bytes)
        return result


class MemoryBudget:
    """Fail any op that leaves more than ``budget_bytes`` of tensors alive, like a device running out.

    Counts what the accountant counts: tensors allocated while the budget is active, plus those
    :meth:`adopt`-ed (parameters, optimizer state). Works on every device, fake tensors included.
    Compiled code runs eagerly inside the budget (``torch.compiler.set_stance("force_eager")``): the accountant
    is a dispatch mode, and dynamo would otherwise never compile a frame first met under it.

    Usage::

        budget = MemoryBudget(256 * 2**20)
        budget.adopt(model.parameters())
        with budget:
            train_step()                    # raises BudgetExceededError past 256 MiB
        budget.accountant.peak_bytes        # the peak reached (bytes)

    ``stop_at_crossing=False`` raises nothing: the step runs to its end and :attr:`peak_exceeded` says
    whether it crossed the budget. The batch-size search judges trials so under a strategy whose step
    itself communicates (FSDP, model parallel): a rank that stopped mid-step would leave the others
    waiting in the step's next collective.

    Attributes:
        accountant: the :class:`~lightning_memkit.TensorAccountant` that counts.
        exceeded: how many times the budget was crossed (and an op failed; 0 with ``stop_at_crossing=False``).
        stop_at_crossing: whether an op that crosses the budget fails (``BudgetExceededError``).
    """

    def __init__(self, budget_bytes: int, *, stop_at_crossing: bool = True) -> None:
        if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes <= 0:
            raise ValueError(
                f"budget must be a positive number of bytes, not {budget_bytes!r}; e.g. budget=256 * 2**20"
            )
        self.budget_bytes = budget_bytes
        self.stop_at_crossing = stop_at_crossing
        self.accountant = TensorAccountant()
        self.exceeded = 0
        self._guard = _Guard(self)
        self._depth = 0
        self._eager: Any = None

    def adopt(self, tensors: Iterable[Any], label: str = "adopted") -> int:
        """Count tensors that already exist (idempotent); returns the bytes newly counted. ``label``: the
        accountant's label for them
        (see :meth:`TensorAccountant.labelled <lightning_memkit.TensorAccountant.labelled>`)."""
        return self.accountant.adopt(tensors, label)

    @property
    def live_bytes(self) -> int:
        """Bytes of counted tensors alive now."""
        return self.accountant.current_bytes

    @property
    def peak_exceeded(self) -> bool:
        """Whether the accountant's peak (bytes, since its last ``reset_peak``) is over the budget."""
        return self.accountant.peak_bytes > self.budget_bytes

    def __enter__(self) -> MemoryBudget:
        if self._depth == 0:
            # a dispatch mode: dynamo would skip a compiled frame first met under it for the rest of the process, so
            # a compiled model runs its budgeted trials eagerly (the eager program's memory) and trains compiled after
            self._eager = force_eager()
            self._eager.__enter__()
            self.accountant.__enter__()
            if self.stop_at_crossing:
                self._guard.__enter__()
        self._depth += 1
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            if self.stop_at_crossing:
                self._guard.__exit__(None, None, None)
            self.accountant.__exit__(None, None, None)
            eager, self._eager = self._eager, None
            if eager is not None:
                eager.__exit__(None, None, None)
