"""What a completed store statement stored, read back in its frame without running the user's code.

From where it stores: ``obj.__dict__[name]`` for ``obj.name = v``, ``container[key]`` of a dict or a list (the
key a constant, a name or ``x.attr``), the last item of a list or deque appended to. When that cannot be read so
(``extend``, ``update``, a property, a key that is a call, a container of a user type), its value expressions
stand in (a name, ``x.attr``, ``x[constant]``; in any other expression, the tensors its names refer to), and the
caller adds the tensors ops made while it ran. A tensor is looked for one level into lists, tuples and dicts.
"""

from __future__ import annotations

import ast
import collections
from typing import Any

import torch

from lightning_memkit.doctor.store_statements import Store, StoreStatement

__all__ = ["stored_tensors"]

#: the most items of a list, tuple or dict a value is looked into (one level)
_MAX_ITEMS = 32
_MISSING = object()


def _lookup(frame: Any, name: str) -> Any:
    value = frame.f_locals.get(name, _MISSING)
    if value is _MISSING:
        value = frame.f_globals.get(name, _MISSING)
    return value


def _value(node: ast.AST, frame: Any) -> Any:
    """The value of ``name``, ``x.attr`` (from ``x.__dict__``) or ``x[constant]`` (of a list, tuple or dict)
    read without running user code; ``_MISSING`` for anything else."""
    if isinstance(node, ast.Name):
        return _lookup(frame, node.id)
    if isinstance(node, ast.Attribute):
        base = _value(node.value, frame)
        if base is _MISSING:
            return _MISSING
        try:
            namespace = object.__getattribute__(base, "__dict__")
        except (AttributeError, TypeError):
            return _MISSING
        return namespace.get(node.attr, _MISSING) if isinstance(namespace, dict) else _MISSING
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        base = _value(node.value, frame)
        key = node.slice.value
        if type(base) in (list, tuple) and type(key) is int and -len(base) <= key < len(base):
            return base[key]
        if type(base) is dict:
            return base.get(key, _MISSING)
    return _MISSING


def _collect(value: Any, out: list) -> None:
    """The tensors ``value`` is, or holds one level down in a list, tuple or dict."""
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)) and len(value) <= _MAX_ITEMS:
        out.extend(item for item in value if isinstance(item, torch.Tensor))
    elif isinstance(value, dict) and len(value) <= _MAX_ITEMS:
        out.extend(item for item in value.values() if isinstance(item, torch.Tensor))


def _key(node: ast.AST, frame: Any) -> Any:
    """A subscript's key read without running user code (a constant, a name, ``x.attr``), or ``_MISSING``."""
    if isinstance(node, ast.Constant):
        return node.value
    return _value(node, frame)


def _read_back(store: Store, frame: Any) -> Any:
    """What ``store`` put where it stores, read from there after the statement without running user code:
    ``obj.__dict__[name]``, ``container[key]`` of a dict or a list, the last (first) item of a list or deque
    appended to; ``_MISSING`` when it cannot be read that way."""
    if store.kind == "other" or store.target is None:
        return _MISSING
    target = _value(store.target, frame)
    if target is _MISSING:
        return _MISSING
    if store.kind == "attr":
        try:
            namespace = object.__getattribute__(target, "__dict__")
        except (AttributeError, TypeError):
            return _MISSING
        return namespace.get(store.key, _MISSING) if isinstance(namespace, dict) else _MISSING
    if store.kind in ("append", "appendleft"):
        if type(target) in (list, collections.deque) and target:
            return target[-1] if store.kind == "append" else target[0]
        return _MISSING
    key = _key(store.key, frame)
    if key is _MISSING:
        return _MISSING
    if type(target) is dict:
        try:
            return target.get(key, _MISSING)
        except TypeError:  # an unhashable key
            return _MISSING
    if type(target) is list and type(key) is int and -len(target) <= key < len(target):
        return target[key]
    return _MISSING


def stored_tensors(statement: StoreStatement, frame: Any) -> tuple[list[torch.Tensor], bool]:
    """The tensors a completed store statement stored, read in its frame (see the module's docstring), and
    whether every store was read back from where it stores (else the tensors its value expressions name
    stand in, and the caller adds the tensors made while the statement ran)."""
    found: list[torch.Tensor] = []
    all_read = True
    for store in statement.stores:
        value = _read_back(store, frame)
        if value is not _MISSING:
            _collect(value, found)
            continue
        all_read = False
        for expression in store.values:
            if isinstance(expression, ast.Starred):
                expression = expression.value
            if isinstance(expression, (ast.Tuple, ast.List)):
                elements = list(expression.elts)
            elif isinstance(expression, ast.Dict):
                elements = list(expression.values)
            else:
                elements = [expression]
            for element in elements:
                value = _value(element, frame)
                if value is not _MISSING:
                    _collect(value, found)
                    continue
                # an expression that calls or computes: the tensors its names refer to (x in x.detach(), in [a, b])
                for node in ast.walk(element):
                    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                        named = _lookup(frame, node.id)
                        if named is not _MISSING:
                            _collect(named, found)
    return found, all_read
