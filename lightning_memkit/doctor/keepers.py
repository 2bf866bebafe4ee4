"""Which line of the user's code keeps a tensor: the store (``self.kept.append(x)``, ``self.x = y``,
``d[k] = v``) that made it reachable from where it is held, beside the line that made it.

Owns :class:`KeepTracer` (a ``sys.settrace`` tracer of the user's own lines, on while the doctor records)
and :func:`keeping_frame` (the keeping line of a group of tensors, matched against their holder's path).

How it works, and why:

* Storing a tensor runs no aten op (``list.append`` is plain Python), so the dispatch mode that names the
  maker cannot see it; only the interpreter can. Python 3.11 has no cheaper hook than ``sys.settrace``
  for a line that completes, so the tracer asks for line events only in code objects of the user's
  files (not torch, Lightning, memkit, the standard library or site-packages) whose source has a *store
  statement*: an assignment or augmented assignment to an attribute or a subscript
  (``self.x = y``, ``d[k] = v``, ``self.total += loss``), a call of a container's store method
  (``append``, ``extend``, ``insert``, ``add``, ``update``, ``setdefault``, ``appendleft``, ...) or
  ``setattr``. Every other function call costs one Python call that returns at once.
* When such a statement completes (the frame moves to another statement, or returns), what it stored is
  read back from where it stored it, without running user code: ``obj.__dict__[name]`` for ``obj.name =
  v``, ``container[key]`` of a dict or a list (the key a constant, a name or ``x.attr``), the last item of
  a list or deque appended to. When that cannot be read so (``extend``, ``update``, a property, a key that
  is a call, a container of a user type), its value expressions stand in (a name, ``x.attr``,
  ``x[constant]``; in any other expression, the tensors its names refer to), with the tensors ops made
  while it ran. A tensor is looked for one level into lists, tuples and dicts. Each one's
  :attr:`~lightning_memkit.doctor.Creation.kept_at` gets the statement's first line.
* Frames already running when tracing starts get no call event: the user's ones (a training loop written
  inline) are given their line tracer when it starts, as ``pdb`` does.
* A tensor stored by several statements keeps up to :data:`MAX_KEPT_AT` of them; the report picks the
  one whose target names (``kept`` in ``self.kept.append``) are on the path of references to the
  tensor's holder (``model.kept[27]``), else the most frequent in its group. A tensor an autograd graph
  saved (held by ``model.losses[11].grad_fn._saved_self``) is kept by the line that kept the tensor the
  graph hangs from (``self.losses.append(loss)``).

Limits: a store in a one-line loop (``for t in ts: self.kept.append(t)``) is seen once, at the loop's
end; a store through a library's function (``torch.save``, ``heapq.heappush``, ``copy.copy``) or code in
site-packages names no line; where the stored value is not read back, a tensor only named in the value
(``torch.cat([a, b])``) is noted too (the holder's path then picks the right line when it was stored
elsewhere); another trace function set before the recording (a debugger, coverage) leaves the tracer off
(said in the report's recording problems), and a debugger started inside the recording replaces it.
Cost: a Python call per Python function call while recording (about a quarter more time per recorded
step on the padded-text model of ``lightning_memkit.zoo_variable``, CPU), and a line event per line of the
user's functions that hold a store statement.
"""

from __future__ import annotations

import ast
import collections
import linecache
import sys
import weakref
from typing import Any, Iterable

import torch

from lightning_memkit._user_code import is_user_code
from lightning_memkit.doctor.creation import STATE_ROLES, Creation
from lightning_memkit.doctor.recorder import CreationRecorder

__all__ = ["KeepTracer", "MAX_KEPT_AT", "STORE_METHODS", "keeping_frame", "target_names"]

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
#: the most keeping lines remembered per storage
MAX_KEPT_AT = 4
#: the most items of a list, tuple or dict a value is looked into (one level)
_MAX_ITEMS = 32
_MISSING = object()


class _Store:
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


class _Statement:
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
    stores: list[_Store] = []
    targets: set[str] = set()

    def assigned(target: ast.AST, value: ast.AST) -> None:
        if isinstance(target, (ast.Tuple, ast.List, ast.Starred)):  # unpacking: which part goes where is not read
            elements = target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target.value]
            for element in elements:
                if isinstance(element, (ast.Attribute, ast.Subscript, ast.Tuple, ast.List, ast.Starred)):
                    targets.update(_chain_names(element))
                    stores.append(_Store("other", None, None, [value]))
        elif isinstance(target, ast.Attribute):
            targets.update(_chain_names(target))
            stores.append(_Store("attr", target.value, target.attr, [value]))
        elif isinstance(target, ast.Subscript):
            targets.update(_chain_names(target))
            stores.append(_Store("item", target.value, target.slice, [value]))
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
            stores.append(_Store(kind, function.value, None, arguments))
        elif isinstance(function, ast.Name) and function.id == "setattr" and len(node.args) == 3:
            targets.update(_chain_names(node.args[0]))
            if isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                targets.add(node.args[1].value)
            stores.append(_Store("other", None, None, [node.args[2]]))
    return (stores, targets) if stores else None


_FILES: dict[tuple, dict[int, _Statement] | None] = {}
_CODES: dict[Any, dict[int, _Statement] | None] = {}


def _file_statements(filename: str) -> dict[int, _Statement] | None:
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
    found: dict[int, _Statement] = {}
    for first, last, stores, targets in merged:
        # one object for all its lines: the tracer tells a statement has completed by the object changing
        statement = _Statement(first, tuple(stores), frozenset(targets))
        for line in range(first, last + 1):
            found[line] = statement
    _FILES[key] = found or None
    return _FILES[key]


def _code_statements(code: Any) -> dict[int, _Statement] | None:
    """The store statements a user's code object may run (``None``: library code, or none in it); cached."""
    try:
        return _CODES[code]
    except KeyError:
        pass
    found = None
    try:  # called from the trace function: an exception here would turn tracing off and reach the user's code
        if is_user_code(code):
            statements = _file_statements(code.co_filename)
            if statements is not None and any(line in statements for _, _, line in code.co_lines()):
                found = statements
    except Exception:  # noqa: BLE001 - a file that cannot be read or parsed: its lines are not traced
        found = None
    if len(_CODES) > 100_000:  # code made at run time (exec, lambdas of eval'd strings) must not pile up
        _CODES.clear()
    _CODES[code] = found
    return found


def target_names(frame: Iterable[Any] | None) -> frozenset:
    """The names a keeping line stores into (``{"self", "kept"}`` for ``self.kept.append(x)``), from its
    ``(filename, line, function)``; empty when unknown."""
    if not frame:
        return frozenset()
    filename, line = list(frame)[:2]
    statements = _file_statements(filename) or {}
    statement = statements.get(line)
    return statement.targets if statement is not None else frozenset()


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


def _read_back(store: _Store, frame: Any) -> Any:
    """What ``store`` put where it stores, read from there after the statement without running user code:
    ``obj.__dict__[name]``, ``container[key]`` of a dict or a list, the last (first) item of a list or deque
    appended to; ``_MISSING`` when it cannot be read that way."""
    if store.kind == "other":
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


def _stored_tensors(statement: _Statement, frame: Any) -> tuple[list[torch.Tensor], bool]:
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


class KeepTracer:
    """Note, on each tensor the ``recorder`` knows, the user's lines that store it (see the module's docstring).

    Usage (the doctor's session does this around the recorded steps)::

        tracer = KeepTracer(recorder)
        tracer.start()            # after recorder.start(...)
        ...                       # training steps
        tracer.stop()
        recorder.creation_of(kept_tensor).kept_at   # (("train.py", 30, "training_step"), ...)

    Attributes:
        active: whether this tracer is the thread's trace function now.
        note: why it is off when :meth:`start` could not turn it on (``""`` otherwise).
        statements: store statements seen to complete (a count).
    """

    def __init__(self, recorder: CreationRecorder) -> None:
        self.recorder = recorder
        self.note = ""
        self.statements = 0
        self._on = False
        self._global = self._make_global()

    @property
    def active(self) -> bool:
        return self._on and sys.gettrace() is self._global

    def start(self) -> bool:
        """Trace the user's store statements on this thread from now, in the frames called from now on and in
        the user's frames running now (a training loop written inline); ``False`` (and :attr:`note`) when
        another trace function is set (a debugger, coverage): it is left alone."""
        current = sys.gettrace()
        if current is self._global:
            self._on = True
            return True
        if current is not None:
            self.note = (
                f"the line that keeps a tensor is not named: another trace function is set "
                f"({getattr(current, '__qualname__', type(current).__name__)}: a debugger or coverage)"
            )
            return False
        self._on = True
        sys.settrace(self._global)
        # frames already running get no call event: give the user's ones their line tracer now, as pdb does
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_trace is None:
                statements = _code_statements(frame.f_code)
                if statements is not None:
                    frame.f_trace = self._line_tracer(statements)
            frame = frame.f_back
        return True

    def stop(self) -> None:
        """Stop tracing (statements still running are not read). Safe to call when not tracing."""
        self._on = False
        if sys.gettrace() is self._global:
            sys.settrace(None)

    def _make_global(self) -> Any:
        """The global trace function: called for every Python call while tracing (torch's dispatch included), so
        it is a closure over its lookups and returns at once for code with no store statement."""
        codes = _CODES
        missing = _MISSING
        line_tracer = self._line_tracer

        def trace_call(frame: Any, event: str, arg: Any) -> Any:
            statements = codes.get(frame.f_code, missing)
            if statements is missing:
                statements = _code_statements(frame.f_code)
            if statements is None:
                return None  # no line events in this frame: library code, or no store statement in it
            return line_tracer(statements)

        return trace_call

    def _line_tracer(self, statements: dict[int, _Statement]) -> Any:
        """The trace function of one frame: tells when a store statement completed (the frame moved to another
        statement, or returned). Holds the tracer weakly: a frame that outlives the recording (the script's own)
        keeps neither it nor the recorder alive, and stops tracing at its next line."""
        tracer = weakref.ref(self)
        state: list = [None, 0]  # the store statement running in this frame, and the op clock when it began

        def trace_line(frame: Any, event: str, arg: Any) -> Any:
            keeper = tracer()
            if keeper is None or not keeper._on:
                return None
            if event == "line":
                statement = statements.get(frame.f_lineno)
                if statement is not state[0]:
                    if state[0] is not None:
                        keeper._completed(frame, state[0], state[1])
                    state[0] = statement
                    state[1] = keeper.recorder.clock
            elif event == "return" and state[0] is not None:
                keeper._completed(frame, state[0], state[1])
                state[0] = None
            return trace_line

        return trace_line

    def _completed(self, frame: Any, statement: _Statement, clock: int) -> None:
        """A store statement of ``frame`` completed; it began at op clock ``clock``."""
        if not self._on:
            return
        try:
            self.statements += 1
            code = frame.f_code
            where = (code.co_filename, statement.line, code.co_name)
            recorder = self.recorder
            tensors, all_read = _stored_tensors(statement, frame)
            creations: list[Creation | None] = [recorder.creation_of(t) for t in tensors]
            if not all_read:  # what was stored is not known exactly: what the statement made may be it
                creations += recorder.made_since(clock)
            for creation in creations:
                if creation is None or creation.role in STATE_ROLES or where in creation.kept_at:
                    continue
                if len(creation.kept_at) < MAX_KEPT_AT:
                    creation.kept_at = creation.kept_at + (where,)
        except Exception as error:  # noqa: BLE001 - naming a line must never break training
            message = f"keeping lines: {type(error).__name__}: {error}"
            if message not in self.recorder.errors and len(self.recorder.errors) < 20:
                self.recorder.errors.append(message)


def keeping_frame(creations: Iterable[Creation], path_names: Iterable[str] = ()) -> list | None:
    """The line that keeps a group of tensors, ``[filename, line, function]``, or ``None`` when none was seen:
    of the lines in their :attr:`~lightning_memkit.doctor.Creation.kept_at`, those whose target names share a
    name with ``path_names`` (the names on the path to their holder: ``{"kept"}`` for ``model.kept[27]``)
    first, then the one that stored most of them, then the one that stored the newest."""
    counts: collections.Counter = collections.Counter()
    newest: dict[tuple, int] = {}
    for creation in creations:
        for frame in creation.kept_at:
            counts[frame] += 1
            newest[frame] = max(newest.get(frame, -2), creation.created_at)
    if not counts:
        return None
    names = set(path_names)

    def rank(frame: tuple) -> tuple:
        return (bool(names & target_names(frame)), counts[frame], newest[frame])

    return list(max(counts, key=rank))
