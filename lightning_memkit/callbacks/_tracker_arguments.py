"""MemoryTracker's arguments that need more than a bool check: each one checked, and refused in the words users read.

The accepted forms are the ones docs/arguments.md lists (tests/callbacks/test_callback_arguments.py builds each wrong
case from that table); one function per argument, named as the argument, returns the value to keep.
"""

from __future__ import annotations

from typing import Any, Literal

from lightning_memkit.callbacks import _checks as checks
from lightning_memkit.compiled import COMPILED_CHOICES
from lightning_memkit.probes.base import MemoryProbe

__all__ = [
    "OWNER",
    "every_n_steps",
    "tensor_accounting",
    "cuda_memory_history",
    "cuda_memory_stacks",
    "oom_dir",
    "max_history",
    "prefix",
    "extra_probes",
    "compiled",
    "tensor_peak_every_n_steps",
    "records_file",
    "leak_window",
]

#: the name the errors give the callback
OWNER = "MemoryTracker"


def every_n_steps(value: Any) -> int:
    return checks.integer(OWNER, "every_n_steps", value, 1, "a positive integer, e.g. 1 to log every step")


def tensor_accounting(value: Any) -> bool | Literal["auto"]:
    return checks.choice(OWNER, "tensor_accounting", value, (True, False, "auto"), "True, False or 'auto'")


def cuda_memory_history(value: Any) -> int:
    return checks.integer(OWNER, "cuda_memory_history", value, 0, "0 (off) or a number of entries, e.g. 100000")


def cuda_memory_stacks(value: Any) -> str:
    return checks.choice(
        OWNER,
        "cuda_memory_stacks",
        value,
        ("python", "all"),
        "'python' (Python frames only: a fast snapshot) or 'all' (C++ frames too)",
    )


def oom_dir(value: Any) -> str | None:
    return checks.path(OWNER, "oom_dir", value, "a directory path (str), or None for the logger's log dir")


def max_history(value: Any) -> int:
    return checks.integer(OWNER, "max_history", value, 1, "a positive integer (readings kept)")


def prefix(value: Any) -> str:
    return checks.text(OWNER, "prefix", value, "a non-empty str, e.g. 'memory'")


def extra_probes(value: Any) -> list[MemoryProbe]:
    """The probes, as a list; a str, or anything but MemoryProbe instances, is refused."""
    if (
        isinstance(value, (str, bytes))
        or not hasattr(value, "__iter__")
        or not all(isinstance(p, MemoryProbe) for p in value)
    ):
        raise checks.refuse(OWNER, "extra_probes", value, "a list of MemoryProbe instances")
    return list(value)


def compiled(value: Any) -> str:
    return checks.choice(
        OWNER,
        "compiled",
        value,
        COMPILED_CHOICES,
        "'keep' (measure the compiled steps as they run) or 'eager' (run the "
        "peak-measured steps eagerly for the accountant's breakdown)",
    )


def tensor_peak_every_n_steps(value: Any) -> int:
    return checks.integer(
        OWNER,
        "tensor_peak_every_n_steps",
        value,
        1,
        "a positive integer, e.g. 1 for the exact peak of every logged step",
    )


def records_file(value: Any) -> str | None:
    return checks.path(OWNER, "records_file", value, "a path (str), or None for the logger's log dir")


def leak_window(value: Any) -> int:
    return checks.integer(
        OWNER, "leak_window", value, 2, "an integer >= 2 (rises of the memory's floor that make a leak)"
    )
