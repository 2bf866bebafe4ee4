"""The root of memkit's exceptions: every exception class memkit defines is a :class:`MemkitError`.

This module owns only that root. Each error lives beside the code that raises it (``PlanError`` in
``plan/result.py``, ``EstimateError`` in ``estimate/step/memory_estimate.py``, ...) and subclasses ``MemkitError``
*and* the builtin it always had (``ValueError``, ``RuntimeError``, ``torch.OutOfMemoryError``), so ``except ValueError``
keeps working and ``except MemkitError`` catches memkit's own errors (a bad argument to a function is still a
plain ``ValueError`` or ``TypeError``, as Python's own are). It imports nothing, so every layer of the package
can use it without an import cycle. ``tests/core/test_errors.py`` finds every exception class in the package and holds
it under this root.
"""

from __future__ import annotations

__all__ = ["MemkitError"]


class MemkitError(Exception):
    """The base of every exception class memkit defines: ``except MemkitError`` catches them all.

    Each subclass also keeps its builtin base (``PlanError`` and ``NoBatchError``: ``ValueError``;
    ``EstimateError`` and ``SearchError``: ``RuntimeError``; ``BudgetExceededError``:
    ``torch.OutOfMemoryError``), so ``except ValueError`` still catches what it caught before. The message
    always says what went wrong and what to do.
    """
