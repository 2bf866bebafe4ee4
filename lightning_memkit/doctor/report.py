"""The doctor's verdict as one plain record, and the step-by-step session that produces it.

Owns :class:`DoctorReport` (``to_dict`` / ``from_dict`` / ``format``: what ``memkit doctor`` prints and
what a report page or a TensorBoard text panel shows) and :class:`DoctorSession`, the framework-free
driver: call :meth:`DoctorSession.step_start` / :meth:`DoctorSession.step_end` around each training step.
"""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from lightning_memkit.doctor.graphs import GraphHolder, GraphLeakReport, count_kept_graph_nodes
from lightning_memkit.doctor.leaks import CreatorGroup, LeakReport, LeakWatcher
from lightning_memkit.doctor.liveness import LivenessReport, analyse_liveness
from lightning_memkit.doctor.recorder import CreationRecorder
from lightning_memkit.units import format_bytes

__all__ = ["DoctorReport", "DoctorSession"]


@dataclass
class DoctorReport:
    """The memory doctor's verdict on a run (all sizes in bytes).

    Attributes:
        steps: how many training steps were watched.
        live_bytes_at_start: ``[[step, bytes], ...]`` live tensor bytes at each watched step's start
            (the last ``max_points``; every storage the doctor knows: training state, batches, and
            whatever was made in a watched step).
        steady_bytes: the live bytes at the last watched step's start.
        leak: the steady growth found, once, or ``None``.
        graph_leak: autograd graph nodes kept across steps, growing (``total += loss``), or ``None``.
        liveness: the analysed step's peak, what it is made of and what is held too long there, or ``None``.
        errors: problems met while recording (the doctor steps aside rather than failing training).
        compiled: on a compiled model, how it was recorded and what could not be seen (``""``: not compiled).
    """

    steps: int = 0
    live_bytes_at_start: list = field(default_factory=list)
    steady_bytes: int | None = None
    leak: LeakReport | None = None
    graph_leak: GraphLeakReport | None = None
    liveness: LivenessReport | None = None
    errors: list = field(default_factory=list)
    compiled: str = ""

    @property
    def healthy(self) -> bool:
        """No leak (of tensor bytes or of autograd graphs) was found."""
        return self.leak is None and self.graph_leak is None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (see :meth:`from_dict`)."""
        return {"steps": self.steps, "live_bytes_at_start": [list(p) for p in self.live_bytes_at_start],
                "steady_bytes": self.steady_bytes, "leak": self.leak.to_dict() if self.leak else None,
                "graph_leak": self.graph_leak.to_dict() if self.graph_leak else None,
                "liveness": self.liveness.to_dict() if self.liveness else None, "errors": list(self.errors),
                "compiled": self.compiled}

    def to_json(self, path: str) -> str:
        """Write :meth:`to_dict` to ``path`` as JSON; returns the path."""
        with open(path, "w") as file:
            json.dump(self.to_dict(), file, indent=2)
        return path

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DoctorReport":
        """Inverse of :meth:`to_dict`."""
        def groups(items):
            return [CreatorGroup(**{k: v for k, v in g.items() if k != "where"}) for g in items or []]

        leak = data.get("leak")
        if leak:
            leak = LeakReport(leak["bytes_per_step"], leak["first_step"], leak["last_step"], leak["live_bytes_at_start"],
                              groups(leak.get("survivors")), groups(leak.get("growing")))
        liveness = data.get("liveness")
        if liveness:
            liveness = LivenessReport(**{k: v for k, v in liveness.items() if k != "held_too_long"},
                                      held_too_long=groups(liveness.get("held_too_long")))
        graph_leak = data.get("graph_leak")
        if graph_leak:
            graph_leak = GraphLeakReport(**{k: v for k, v in graph_leak.items() if k != "holders"},
                                         holders=[GraphHolder(**h) for h in graph_leak.get("holders", [])])
        return cls(steps=data.get("steps", 0), graph_leak=graph_leak or None, live_bytes_at_start=data.get("live_bytes_at_start", []),
                   steady_bytes=data.get("steady_bytes"), leak=leak or None, liveness=liveness or None,
                   errors=data.get("errors", []), compiled=data.get("compiled", ""))

    def format(self) -> str:
        """The verdict as text: steady state, leaks (bytes/step, who), held too long at the peak, the peak's parts."""
        lines = [f"memkit doctor: {self.steps} steps watched"]
        if self.compiled:
            lines.append(self.compiled)
        if self.leak is None:
            steady = f"{format_bytes(self.steady_bytes)} ({self.steady_bytes} bytes)" if self.steady_bytes is not None else "-"
            lines.append(("no leak: " if self.graph_leak is None else "")
                         + f"live tensor memory at step start is steady at {steady}")
        else:
            lines.append(self.leak.format())
        if self.graph_leak is not None:
            lines.append(self.graph_leak.format())
        if self.liveness is not None:
            lines.append(self.liveness.format())
        if self.errors:
            lines.append("recording problems: " + "; ".join(self.errors[:3]))
        return "\n".join(lines)


class DoctorSession:
    """Drive the doctor around a plain PyTorch training loop (the Lightning callback does the same).

    Usage::

        session = DoctorSession(model, optimizers=[opt], analyse_step=1)
        for step, batch in enumerate(loader):
            session.step_start(step, batch)
            loss = model(batch).sum(); loss.backward(); opt.step(); opt.zero_grad()
            session.step_end(step)
        session.close()
        print(session.report().format())

    Recording stays on from a step's start to the next step's start (so whatever runs between steps is
    attributed too) and stops in :meth:`close`.

    Args:
        module: the model (named in the records; its parameters, buffers and gradients are state).
        optimizers: their state is state, never a leak.
        window: steps of growth in a row that make a leak (see :class:`LeakWatcher`).
        warmup_steps: first steps not compared (gradients and optimizer state appear there).
        analyse_step: the step whose liveness is analysed, or the first watched step after it (a resumed
            run); ``None``: none.
        graph_check: also count the autograd nodes reachable at each step's start from the tensors the
            recorder saw made, to find graphs kept across steps (``total += loss``).
        max_points: live-bytes points kept for the report.
    """

    def __init__(self, module: torch.nn.Module | None = None, optimizers: Iterable[Any] = (), *, window: int = 5,
                 warmup_steps: int = 2, analyse_step: int | None = 1, graph_check: bool = True,
                 max_points: int = 1000) -> None:
        self.module = module
        self.optimizers = list(optimizers)
        self.recorder = CreationRecorder()
        if module is not None:
            self.recorder.name_modules(module)
        self.watcher = LeakWatcher(window=window, warmup_steps=warmup_steps, recorder=self.recorder)
        self.graph_watcher = LeakWatcher(window=window, warmup_steps=warmup_steps) if graph_check else None
        self.graph_leak: GraphLeakReport | None = None
        self.analyse_step = analyse_step
        self.liveness: LivenessReport | None = None
        self.points: collections.deque = collections.deque(maxlen=max_points)
        self.steps = 0
        self._analysing = False
        self.compiled_note = ""  # set by whoever finds the model compiled (MemoryDoctor): said once in the report

    def step_start(self, step: int, batch: Any = None, *, module: torch.nn.Module | None = None,
                   optimizers: Iterable[Any] | None = None) -> LeakReport | GraphLeakReport | None:
        """A step begins: measure the live bytes, test for growth (a :class:`LeakReport`, or a
        :class:`GraphLeakReport` for graphs kept across steps, the first time it is steady), then record the step (its liveness too when it is ``analyse_step``).

        ``batch``: the step's input (its tensors are recorded as the input of this step); ``module`` /
        ``optimizers``: the training state when it is not the session's own (``None``: the session's).
        """
        module = module if module is not None else self.module
        optimizers = self.optimizers if optimizers is None else list(optimizers)
        recorder = self.recorder
        recorder.assign_roles(module, optimizers)  # state made in the last step (grads, Adam's moments)
        recorder.catch_up()  # a compiled model kept compiled: what the last step made, found by a walk
        live = recorder.live_bytes_now()
        self.points.append([int(step), int(live)])
        self.steps += 1
        found = self.watcher.observe(step, live)
        if self.graph_watcher is not None and self.graph_leak is None:
            nodes, _ = count_kept_graph_nodes(recorder)
            grown = self.graph_watcher.observe(step, nodes)
            if grown is not None:
                _, holders = count_kept_graph_nodes(recorder, holders=True)
                self.graph_leak = GraphLeakReport(grown.bytes_per_step, grown.first_step, grown.last_step,
                                                  grown.live_bytes_at_start, holders[:10])
                found = found or self.graph_leak
        recorder.start(step, batch=batch, module=module, optimizers=optimizers)
        if (self.analyse_step is not None and step >= self.analyse_step and self.liveness is None and not self._analysing
                and recorder.compiled != "keep"):  # no op is seen inside compiled code: no liveness to analyse
            self._analysing = True
            recorder.begin_liveness()
        return found

    def step_end(self, step: int, *, module: torch.nn.Module | None = None, optimizers: Iterable[Any] | None = None) -> None:
        """A step's optimizer step is done: finish its liveness analysis if it was being analysed.
        Recording goes on until the next :meth:`step_start` or :meth:`close`. ``module`` /
        ``optimizers``: as in :meth:`step_start`."""
        if self._analysing:
            self._analysing = False
            module = module if module is not None else self.module
            self.recorder.assign_roles(module, self.optimizers if optimizers is None else list(optimizers))
            creations, start, end = self.recorder.end_liveness()
            self.liveness = analyse_liveness(creations, start, end, step)

    def close(self) -> None:
        """Stop recording (call when training ends or fails); the report stays readable."""
        if self._analysing:
            self._analysing = False
            self.recorder.end_liveness()
        self.recorder.stop()

    def report(self) -> DoctorReport:
        """The verdict so far."""
        points = list(self.points)
        return DoctorReport(steps=self.steps, live_bytes_at_start=points, steady_bytes=points[-1][1] if points else None,
                            leak=self.watcher.report, graph_leak=self.graph_leak, liveness=self.liveness, errors=list(self.recorder.errors),
                            compiled=self.compiled_note)
