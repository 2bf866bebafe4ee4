"""One exception root: every exception class lightning_memkit defines is a ``MemkitError``, and keeps its builtin base.

The classes are found by importing every module of the package (``pkgutil``) and reading what each defines
(``inspect``), so a new error class cannot be forgotten. Warnings (``CheckpointWarning``) are not errors and
stay outside the root.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest
import torch

import lightning_memkit
import lightning_memkit.errors
from lightning_memkit import MemkitError

#: Every exception class in the package and the builtin base it had before MemkitError, which it keeps so that
#: users' ``except ValueError`` / ``except RuntimeError`` clauses still catch it. A new error class goes here too.
BUILTIN_BASES: dict[str, type[BaseException]] = {
    "lightning_memkit.accounting.process._AccountantError": Exception,
    "lightning_memkit.cli.common.CliError": Exception,
    "lightning_memkit.estimate.data.batches.NoBatchError": ValueError,
    "lightning_memkit.estimate.largest_batch.DoesNotFitError": ValueError,
    "lightning_memkit.estimate.step.memory_estimate.EstimateError": RuntimeError,
    "lightning_memkit.estimate.step.hook_errors.HookFailed": Exception,
    "lightning_memkit.modes.checkpoint_measure.MeasureError": RuntimeError,
    "lightning_memkit.plan.result.PlanError": ValueError,
    "lightning_memkit.probes.base.ProbeUnavailable": RuntimeError,
    "lightning_memkit.report.sources.ReportInputError": Exception,
    "lightning_memkit.search.budget.BudgetExceededError": torch.OutOfMemoryError,
    "lightning_memkit.search.batch_search.SearchError": RuntimeError,
    "lightning_memkit.search.searchable.BatchSizeSearchError": ValueError,
    "lightning_memkit.search.limits.TrialTooSlow": RuntimeError,
}


def _package_exceptions() -> dict[str, type[BaseException]]:
    """``module.Class`` -> class, for every exception class (warnings aside) a module of the package defines."""
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(lightning_memkit.__path__, prefix="lightning_memkit."):
        if info.name.rsplit(".", 1)[-1] == "__main__":  # runs the command line when imported
            continue
        module = importlib.import_module(info.name)
        pending = [obj for obj in vars(module).values() if inspect.isclass(obj)]
        while pending:  # classes nested in classes too
            cls = pending.pop()
            if cls.__module__ != module.__name__:
                continue  # imported here, defined elsewhere
            pending.extend(obj for obj in vars(cls).values() if inspect.isclass(obj) and obj is not cls)
            if issubclass(cls, BaseException) and not issubclass(cls, Warning) and cls is not MemkitError:
                found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return found


def test_the_walk_finds_every_known_error_class():
    found = _package_exceptions()
    assert set(BUILTIN_BASES) <= set(found), f"gone or renamed: {sorted(set(BUILTIN_BASES) - set(found))}"
    new = sorted(set(found) - set(BUILTIN_BASES))
    assert not new, (
        f"new exception classes {new}: subclass MemkitError (from lightning_memkit.errors) and the "
        f"builtin they extend, and add them to BUILTIN_BASES in tests/core/test_errors.py"
    )


@pytest.mark.parametrize("name", sorted(BUILTIN_BASES))
def test_every_error_is_a_memkit_error_and_keeps_its_builtin_base(name):
    cls = _package_exceptions()[name]
    assert issubclass(cls, MemkitError), f"{name} does not subclass lightning_memkit.MemkitError"
    assert issubclass(cls, BUILTIN_BASES[name]), f"{name} lost its builtin base {BUILTIN_BASES[name].__name__}"


def test_memkit_error_is_public_and_an_exception():
    assert "MemkitError" in lightning_memkit.__all__
    assert issubclass(MemkitError, Exception) and MemkitError.__module__ == "lightning_memkit.errors"


def test_except_clauses_written_for_the_builtin_bases_still_catch():
    from lightning_memkit import BudgetExceededError, PlanError, is_out_of_memory
    from lightning_memkit.estimate.step.memory_estimate import EstimateError

    with pytest.raises(ValueError, match="give a budget"):
        raise PlanError("give a budget")
    with pytest.raises(MemkitError):
        raise PlanError("give a budget")
    with pytest.raises(RuntimeError):
        raise EstimateError("the step failed")
    error = BudgetExceededError(requested_bytes=2048, budget_bytes=1024)
    # still an out-of-memory error for memkit, torch and Lightning, and a memkit error besides
    assert isinstance(error, torch.OutOfMemoryError) and isinstance(error, MemkitError) and is_out_of_memory(error)
    from lightning.pytorch.utilities.memory import is_oom_error  # Lightning's own check

    assert is_oom_error(error)


def test_a_memkit_error_is_an_out_of_memory_error_only_when_it_is_one_or_was_raised_from_one():
    from lightning_memkit import is_out_of_memory
    from lightning_memkit.modes.checkpoint_measure import MeasureError
    from lightning_memkit.search.batch_search import SearchError

    # the search's verdict names memory in words; no allocation failed (MemoryTracker wrote an OOM report for it)
    assert not is_out_of_memory(SearchError("no batch size ran: the smallest tried, 1, ran out of memory"))

    def measuring_forward() -> None:
        try:
            torch.empty(2**60, dtype=torch.uint8)  # 1 EiB: the CPU allocator refuses it
        except RuntimeError as error:
            raise MeasureError(f"the measuring forward failed: {error}") from error

    with pytest.raises(MeasureError) as wrapped:
        measuring_forward()
    assert is_out_of_memory(wrapped.value) and is_out_of_memory(wrapped.value.__cause__)


def test_the_homes_errors_py_names_are_where_the_errors_live():
    """errors.py tells a reader where errors live (``PlanError`` in ``plan/result.py``): each pair it names holds."""
    named = re.findall(r"``(\w+Error)`` in\s+``([\w/]+)\.py``", lightning_memkit.errors.__doc__)
    assert named, "errors.py names no error's home"
    found = {name.rsplit(".", 1)[-1]: cls for name, cls in _package_exceptions().items()}
    for error, path in named:
        module = found[error].__module__
        assert module == "lightning_memkit." + path.replace("/", "."), f"{error} lives in {module}, not {path}.py"
        assert Path(lightning_memkit.__file__).parent.joinpath(f"{path}.py").is_file()
