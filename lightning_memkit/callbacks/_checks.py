"""The callbacks' argument checks: one place, one wording.

Every public callback checks its arguments when it is built (not at fit start), so a wrong value
fails where it was written, with a message ``Owner(name=value): give <accepted form>``. The accepted
forms here are the ones docs/arguments.md lists (tests/callbacks/test_callback_arguments.py reads that table and
builds each wrong case). Booleans are ``bool`` (a ``1`` or a ``"no"`` is refused, not read as true);
integers are ``int`` (a ``bool`` or a float is refused, never truncated).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, Literal, overload

import torch.nn as nn
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_memkit._class_paths import resolve_class_path

__all__ = ["refuse", "boolean", "integer", "number", "text", "path", "choice", "steps", "module_filters", "A_BOOL"]

#: the accepted form of every boolean argument
A_BOOL = "True or False (a bool)"


def refuse(owner: str, name: str, value: Any, accepted: str) -> MisconfigurationException:
    """The error for ``owner(name=value)``: it names the argument, the value and the accepted form."""
    return MisconfigurationException(f"{owner}({name}={value!r}): give {accepted}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def boolean(owner: str, name: str, value: Any) -> bool:
    """``value`` if it is a ``bool``; else refused."""
    if not isinstance(value, bool):
        raise refuse(owner, name, value, A_BOOL)
    return value


@overload
def integer(
    owner: str, name: str, value: Any, minimum: int, accepted: str, *, optional: Literal[False] = False
) -> int: ...


@overload
def integer(owner: str, name: str, value: Any, minimum: int, accepted: str, *, optional: bool) -> int | None: ...


def integer(owner: str, name: str, value: Any, minimum: int, accepted: str, *, optional: bool = False) -> int | None:
    """``value`` if it is an ``int`` (not a bool) ``>= minimum`` (or ``None`` when ``optional``)."""
    if optional and value is None:
        return None
    if not _is_int(value) or value < minimum:
        raise refuse(owner, name, value, accepted)
    return value


@overload
def number(
    owner: str,
    name: str,
    value: Any,
    accepted: str,
    *,
    low: float,
    high: float | None = None,
    low_open: bool = True,
    high_open: bool = True,
    optional: Literal[False] = False,
) -> float: ...


@overload
def number(
    owner: str,
    name: str,
    value: Any,
    accepted: str,
    *,
    low: float,
    high: float | None = None,
    low_open: bool = True,
    high_open: bool = True,
    optional: bool,
) -> float | None: ...


def number(
    owner: str,
    name: str,
    value: Any,
    accepted: str,
    *,
    low: float,
    high: float | None = None,
    low_open: bool = True,
    high_open: bool = True,
    optional: bool = False,
) -> float | None:
    """``value`` if it is a real number (int or float, not a bool) within the given bounds."""
    if optional and value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        ok = (value > low if low_open else value >= low) and (
            high is None or (value < high if high_open else value <= high)
        )
    if not ok:
        raise refuse(owner, name, value, accepted)
    return value


def text(owner: str, name: str, value: Any, accepted: str) -> str:
    """``value`` if it is a non-empty ``str``."""
    if not isinstance(value, str) or not value.strip():
        raise refuse(owner, name, value, accepted)
    return value


def path(owner: str, name: str, value: Any, accepted: str) -> str | None:
    """``value`` as a ``str`` path if it is a non-empty ``str`` or ``os.PathLike``; ``None`` stays ``None``."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise refuse(owner, name, value, accepted)
    return os.fspath(value)


def choice(owner: str, name: str, value: Any, choices: Iterable[Any], accepted: str) -> Any:
    """``value`` if it is one of ``choices`` (compared with the type: ``1`` is not ``True``)."""
    for option in choices:
        if type(value) is type(option) and value == option:
            return value
    raise refuse(owner, name, value, accepted)


def steps(owner: str, name: str, value: Any, accepted: str) -> frozenset[int]:
    """Training steps: an ``int``, a ``str`` holding one (``"12"`` is step 12, as from a command line), or
    an iterable of ints (or such strings); each ``>= 0``. Floats, bools and other strings are refused."""
    if _is_int(value) or isinstance(value, str):
        value = (value,)
    try:
        items = list(value)
    except TypeError:
        raise refuse(owner, name, value, accepted) from None
    found: set[int] = set()
    for item in items:
        if isinstance(item, str) and item.strip().isdigit():
            item = int(item.strip())
        if not _is_int(item) or item < 0:
            raise refuse(owner, name, value, accepted)
        found.add(item)
    return frozenset(found)


def module_filters(owner: str, name: str, value: Any, accepted: str) -> tuple[str | type, ...] | None:
    """Module filters (LayerTrace's ``modules``): ``None``, or one or a list of: an ``fnmatch`` pattern of
    qualified module names (``"encoder.layers.*"``), an ``nn.Module`` subclass, or a class path naming one
    (``"torch.nn.Linear"``, as a YAML config gives it; resolved by import here)."""
    if value is None:
        return None
    items = [value] if isinstance(value, (str, type)) else value
    try:
        items = list(items)
    except TypeError:
        raise refuse(owner, name, value, accepted) from None
    filters: list[str | type] = []
    for item in items:
        if isinstance(item, str) and item.strip():
            try:
                resolved = resolve_class_path(item)
            except ValueError as error:
                raise MisconfigurationException(f"{owner}({name}={value!r}): {error}; give {accepted}") from None
            if resolved is not None and not issubclass(resolved, nn.Module):
                raise refuse(owner, name, value, accepted)
            filters.append(resolved if resolved is not None else item)
        elif isinstance(item, type) and issubclass(item, nn.Module):
            filters.append(item)
        else:
            raise refuse(owner, name, value, accepted)
    if not filters:
        raise refuse(owner, name, value, accepted)
    return tuple(filters)
