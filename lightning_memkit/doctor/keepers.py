"""Which line of the user's code keeps a tensor: the store (``self.kept.append(x)``, ``self.x = y``,
``d[k] = v``) that made it reachable from where it is held, beside the line that made it.

Owns :class:`KeepTracer` (a ``sys.settrace`` tracer of the user's own lines, on while the doctor records)
and :func:`keeping_frame` (the keeping line of a group of tensors, matched against their holder's path).
Which lines are store statements is ``store_statements.py``'s; what a statement stored, read back, is
``stored_values.py``'s.

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
  :attr:`~lightning_memkit.doctor.creation.Creation.kept_at` gets the statement's first line.
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

import collections
import sys
import weakref
from collections.abc import Iterable
from types import FrameType
from typing import Any

from lightning_memkit.doctor.creation import STATE_ROLES, Creation
from lightning_memkit.doctor.recorder import CreationRecorder
from lightning_memkit.doctor.store_statements import (
    CODE_STATEMENTS,
    StoreStatement,
    code_statements,
    target_names,
)
from lightning_memkit.doctor.stored_values import stored_tensors

# STORE_METHODS and target_names live in store_statements.py; named here too, where the keeping line is decided
__all__ = ["KeepTracer", "MAX_KEPT_AT", "keeping_frame"]

#: the most keeping lines remembered per storage
MAX_KEPT_AT = 4


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
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            if frame.f_trace is None:
                statements = code_statements(frame.f_code)
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
        codes = CODE_STATEMENTS
        # a code object not looked at yet: this very (empty) dict, told apart by identity
        missing: dict[int, StoreStatement] = {}
        line_tracer = self._line_tracer

        def trace_call(frame: Any, event: str, arg: Any) -> Any:
            statements = codes.get(frame.f_code, missing)
            if statements is missing:
                statements = code_statements(frame.f_code)
            if statements is None:
                return None  # no line events in this frame: library code, or no store statement in it
            return line_tracer(statements)

        return trace_call

    def _line_tracer(self, statements: dict[int, StoreStatement]) -> Any:
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

    def _completed(self, frame: Any, statement: StoreStatement, clock: int) -> None:
        """A store statement of ``frame`` completed; it began at op clock ``clock``."""
        if not self._on:
            return
        try:
            self.statements += 1
            code = frame.f_code
            where = (code.co_filename, statement.line, code.co_name)
            recorder = self.recorder
            tensors, all_read = stored_tensors(statement, frame)
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
    of the lines in their :attr:`~lightning_memkit.doctor.creation.Creation.kept_at`, those whose target names share a
    name with ``path_names`` (the names on the path to their holder: ``{"kept"}`` for ``model.kept[27]``)
    first, then the one that stored most of them, then the one that stored the newest."""
    counts: collections.Counter[tuple[str, int, str]] = collections.Counter()
    newest: dict[tuple, int] = {}
    for creation in creations:
        for frame in creation.kept_at:
            counts[frame] += 1
            newest[frame] = max(newest.get(frame, -2), creation.created_at)
    if not counts:
        return None
    names = set(path_names)

    def rank(frame: tuple[str, int, str]) -> tuple[bool, int, int]:
        return (bool(names & target_names(frame)), counts[frame], newest[frame])

    line: tuple[str, int, str] = max(counts, key=rank)
    return list(line)
