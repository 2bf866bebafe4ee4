"""Which of the user's lines store a value where it can outlive the step: the *store statements* of a source file.

A store statement is a simple statement that assigns (or augments) an attribute or a subscript
(``self.x = y``, ``d[k] = v``, ``self.total += loss``), calls a container's store method (:data:`STORE_METHODS`:
``append``, ``extend``, ``insert``, ``add``, ``update``, ``setdefault``, ``appendleft``, ...) or calls ``setattr``.
Each file is parsed once per text, each code object looked at once: the keep tracer
(:class:`~lightning_memkit.doctor.keepers.KeepTracer`) asks for line events only in the user's code objects
that hold one.
"""

from __future__ import annotations

import ast
import linecache
from collections.abc import Iterable
from typing import Any

from lightning_memkit._user_code import is_user_code

__all__ = [
    "CODE_STATEMENTS",
    "STORE_METHODS",
    "Store",
    "StoreStatement",
    "code_statements",
    "file_statements",
    "target_names",
]

#: methods whose call stores their arguments in the object they are called on
STORE_METHODS = frozenset(
    {
        "append",
        "appendleft",
        "extend",
        "extendleft",
        "insert",
        "add",
        "update",
        "setdefault",
        "__setitem__",
        "put",
        "put_nowait",
    }
)


class Store:
    """One store in a statement: ``kind`` ``"attr"`` (``obj.name = v``: ``target`` is ``obj``, ``key`` the
    name), ``"item"`` (``container[key] = v``), ``"append"`` / ``"appendleft"`` (``container.append(v)``), or
    ``"other"`` (a store whose stored value is not read back: ``extend``, ``update``, ``setattr``, ...);
    ``values``: the expressions stored."""

    __slots__ = ("kind", "target", "key", "values")

    def __init__(self, kind: str, target: ast.AST | None, key: Any, values: list) -> None:
        self.kind = kind
        self.target = target
        self.key = key
        self.values = values


class StoreStatement:
    """A store statement: its first line, its stores, and the names of what it stores into
    (``{"self", "kept"}`` for ``self.kept.append(x)``)."""

    __slots__ = ("line", "stores", "targets")

    def __init__(self, line: int, stores: tuple, targets: frozenset) -> None:
        self.line = line
        self.stores = stores
        self.targets = targets


def _chain_names(node: ast.AST) -> set[str]:
    """The attribute names, subscript strings and base name of ``self.cache["a"]``-like expressions."""
    names: set[str] = set()
    while True:
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
            node = node.value
        elif isinstance(node, ast.Subscript):
            if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                names.add(node.slice.value)
            node = node.value
        elif isinstance(node, ast.Name):
            names.add(node.id)
            return names
        else:
            return names


def _store_of(statement: ast.stmt) -> tuple[list, set] | None:
    """``(stores, target names)`` of a simple statement that stores into a container or an object, or ``None``."""
    stores: list[Store] = []
    targets: set[str] = set()

    def assigned(target: ast.AST, value: ast.AST) -> None:
        if isinstance(target, (ast.Tuple, ast.List, ast.Starred)):  # unpacking: which part goes where is not read
            elements = target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target.value]
            for element in elements:
                if isinstance(element, (ast.Attribute, ast.Subscript, ast.Tuple, ast.List, ast.Starred)):
                    targets.update(_chain_names(element))
                    stores.append(Store("other", None, None, [value]))
        elif isinstance(target, ast.Attribute):
            targets.update(_chain_names(target))
            stores.append(Store("attr", target.value, target.attr, [value]))
        elif isinstance(target, ast.Subscript):
            targets.update(_chain_names(target))
            stores.append(Store("item", target.value, target.slice, [value]))
        # a plain name is a local: nothing that outlives the step

    if isinstance(statement, ast.Assign):
        for target in statement.targets:
            assigned(target, statement.value)
    elif isinstance(statement, (ast.AugAssign, ast.AnnAssign)) and statement.value is not None:
        assigned(statement.target, statement.value)
    for node in ast.walk(statement):
        if not isinstance(node, ast.Call):
            continue
        function = node.func
        arguments = list(node.args) + [keyword.value for keyword in node.keywords]
        if isinstance(function, ast.Attribute) and function.attr in STORE_METHODS:
            targets.update(_chain_names(function.value))
            kind = function.attr if function.attr in ("append", "appendleft") and len(node.args) == 1 else "other"
            stores.append(Store(kind, function.value, None, arguments))
        elif isinstance(function, ast.Name) and function.id == "setattr" and len(node.args) == 3:
            targets.update(_chain_names(node.args[0]))
            if isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                targets.add(node.args[1].value)
            stores.append(Store("other", None, None, [node.args[2]]))
    return (stores, targets) if stores else None


_FILES: dict[tuple, dict[int, StoreStatement] | None] = {}
#: code object -> :func:`code_statements`' answer; the keep tracer's trace function reads it directly, for it
#: runs on every Python call while recording
CODE_STATEMENTS: dict[Any, dict[int, StoreStatement] | None] = {}


def file_statements(filename: str) -> dict[int, StoreStatement] | None:
    """``{line: store statement covering it}`` of a source file (``None``: unreadable, or no store in it),
    cached per file text."""
    lines = linecache.getlines(filename)
    if not lines:
        return None
    text = "".join(lines)
    key = (filename, len(text), hash(text))
    if key in _FILES:
        return _FILES[key]
    try:
        tree = ast.parse(text, filename)
    except (SyntaxError, ValueError):
        _FILES[key] = None
        return None
    spans: list[list] = []  # [first line, last line, stores, target names] of each store statement
    for node in ast.walk(tree):
        # simple statements only: a compound one (if, for, with, def) stores through the simple ones inside it
        if not isinstance(node, ast.stmt) or hasattr(node, "body"):
            continue
        store = _store_of(node)
        if store is not None:
            spans.append([node.lineno, node.end_lineno or node.lineno, *store])
    spans.sort(key=lambda span: span[0])
    merged: list[list] = []
    for span in spans:  # statements sharing a line (a; b) are one statement for the tracer
        if merged and span[0] <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], span[1])
            merged[-1][2] = merged[-1][2] + span[2]
            merged[-1][3] = merged[-1][3] | span[3]
        else:
            merged.append(span)
    found: dict[int, StoreStatement] = {}
    for first, last, stores, targets in merged:
        # one object for all its lines: the tracer tells a statement has completed by the object changing
        statement = StoreStatement(first, tuple(stores), frozenset(targets))
        for line in range(first, last + 1):
            found[line] = statement
    _FILES[key] = found or None
    return _FILES[key]


def code_statements(code: Any) -> dict[int, StoreStatement] | None:
    """The store statements a user's code object may run (``None``: library code, or none in it); cached."""
    try:
        return CODE_STATEMENTS[code]
    except KeyError:
        pass
    found = None
    try:  # called from the trace function: an exception here would turn tracing off and reach the user's code
        if is_user_code(code):
            statements = file_statements(code.co_filename)
            if statements is not None and any(line in statements for _, _, line in code.co_lines()):
                found = statements
    except Exception:  # noqa: BLE001 - a file that cannot be read or parsed: its lines are not traced
        found = None
    if len(CODE_STATEMENTS) > 100_000:  # code made at run time (exec, lambdas of eval'd strings) must not pile up
        CODE_STATEMENTS.clear()
    CODE_STATEMENTS[code] = found
    return found


def target_names(frame: Iterable[Any] | None) -> frozenset:
    """The names a keeping line stores into (``{"self", "kept"}`` for ``self.kept.append(x)``), from its
    ``(filename, line, function)``; empty when unknown."""
    if not frame:
        return frozenset()
    filename, line = list(frame)[:2]
    statements = file_statements(filename) or {}
    statement = statements.get(line)
    return statement.targets if statement is not None else frozenset()
