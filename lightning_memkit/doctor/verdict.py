"""The doctor's verdict as one plain record, and the step-by-step session that produces it.

Owns :class:`DoctorReport` (``to_dict`` / ``from_dict`` / ``format``: what ``memkit doctor`` prints and
what a report page or a TensorBoard text panel shows) and :class:`DoctorSession`, the framework-free
driver: call :meth:`DoctorSession.step_start` / :meth:`DoctorSession.step_end` around each training step.
"""

from __future__ import annotations

import collections
import json
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_memkit.accounting.accountant import _tensors_in, storage_of
from lightning_memkit.doctor.graphs import GraphHolder, GraphLeakReport, count_kept_graph_nodes, saved_in_nodes
from lightning_memkit.doctor.holders import HolderSearch, attach_holders, find_holders, user_roots
from lightning_memkit.doctor.keepers import KeepTracer
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
            (the last ``max_points``): what the leak rule watches, every storage the doctor knows
            (whatever was made in a watched step, a batch kept from an earlier step) less training state,
            less the tensors that fed the run before it began and less the step's batch and the batches
            fetched ahead of it (:meth:`DoctorSession.watched_bytes`).
        steady_bytes: the live bytes at the last watched step's start.
        leak: the steady growth found, once, or ``None``.
        graph_leak: autograd graph nodes kept across steps, growing (``total += loss``), or ``None``.
        liveness: the analysed step's peak, what it is made of and what is held too long there, or ``None``.
        errors: problems met while recording (the doctor steps aside rather than failing training).
        steps_needed: the fewest watched steps that can show a leak (warm-up, then ``window`` rises of the
            floor); with fewer, the verdict says there were too few steps to judge (0: unknown).
        compiled: on a compiled model, how it was recorded and what could not be seen (``""``: not compiled).
    """

    steps: int = 0
    live_bytes_at_start: list = field(default_factory=list)
    steady_bytes: int | None = None
    leak: LeakReport | None = None
    graph_leak: GraphLeakReport | None = None
    liveness: LivenessReport | None = None
    errors: list = field(default_factory=list)
    steps_needed: int = 0
    compiled: str = ""

    @property
    def healthy(self) -> bool:
        """No leak (of tensor bytes or of autograd graphs) was found."""
        return self.leak is None and self.graph_leak is None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (see :meth:`from_dict`)."""
        return {
            "steps": self.steps,
            "live_bytes_at_start": [list(p) for p in self.live_bytes_at_start],
            "steady_bytes": self.steady_bytes,
            "leak": self.leak.to_dict() if self.leak else None,
            "graph_leak": self.graph_leak.to_dict() if self.graph_leak else None,
            "liveness": self.liveness.to_dict() if self.liveness else None,
            "errors": list(self.errors),
            "steps_needed": self.steps_needed,
            "compiled": self.compiled,
        }

    def to_json(self, path: str) -> str:
        """Write :meth:`to_dict` to ``path`` as JSON; returns the path."""
        with open(path, "w") as file:
            json.dump(self.to_dict(), file, indent=2)
        return path

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DoctorReport:
        """Inverse of :meth:`to_dict`."""

        def groups(items: list[dict[str, Any]] | None) -> list[CreatorGroup]:
            derived = ("where", "kept_where")  # texts to_dict adds, read back from the frames
            return [CreatorGroup(**{k: v for k, v in g.items() if k not in derived}) for g in items or []]

        leak = data.get("leak")
        if leak:
            leak = LeakReport(
                leak["bytes_per_step"],
                leak["first_step"],
                leak["last_step"],
                leak["live_bytes_at_start"],
                groups(leak.get("survivors")),
                groups(leak.get("growing")),
                leak.get("rises", 0),
            )
        liveness = data.get("liveness")
        if liveness:
            liveness = LivenessReport(
                **{k: v for k, v in liveness.items() if k != "held_too_long"},
                held_too_long=groups(liveness.get("held_too_long")),
            )
        graph_leak = data.get("graph_leak")
        if graph_leak:
            graph_leak = GraphLeakReport(
                **{k: v for k, v in graph_leak.items() if k != "holders"},
                holders=[GraphHolder(**h) for h in graph_leak.get("holders", [])],
            )
        return cls(
            steps=data.get("steps", 0),
            graph_leak=graph_leak or None,
            live_bytes_at_start=data.get("live_bytes_at_start", []),
            steady_bytes=data.get("steady_bytes"),
            leak=leak or None,
            liveness=liveness or None,
            errors=data.get("errors", []),
            steps_needed=data.get("steps_needed", 0),
            compiled=data.get("compiled", ""),
        )

    def format(self) -> str:
        """The verdict as text: steady state, leaks (bytes/step, who), held too long at the peak, the peak's parts."""
        lines = [f"memkit doctor: {self.steps} steps watched"]
        if self.compiled:
            lines.append(self.compiled)
        if self.leak is None:
            steady = (
                "-" if self.steady_bytes is None else f"{format_bytes(self.steady_bytes)} ({self.steady_bytes} bytes)"
            )
            if self.graph_leak is None and self.steps < self.steps_needed:
                lines.append(
                    f"too few steps to judge a leak: {self.steps} watched, {self.steps_needed} needed "
                    f"(warm-up, then rises of the memory's floor); live tensor memory at the last step's "
                    f"start: {steady}"
                )
            else:
                lines.append(
                    ("no leak: " if self.graph_leak is None else "")
                    + f"live tensor memory at step start is steady at {steady}"
                )
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
        session.close(finish=True)
        print(session.report().format())

    Recording stays on from a step's start to the next step's start (so whatever runs between steps is
    attributed too) and stops in :meth:`close`. Give ``step_start(..., epoch=e)`` when the loop has
    epochs: growth is then judged when an epoch ends and at :meth:`finish` (``close(finish=True)``), so
    memory freed at each epoch's end is no leak; without epochs every step is judged. When a leak is
    reported, who holds it is searched (:func:`~lightning_memkit.doctor.holders.attach_holders`) and
    the search kept in :attr:`holder_search`.

    Args:
        module: the model (named in the records; its parameters, buffers and gradients are state).
        optimizers: their state is state, never a leak.
        window: rises of the live memory's floor that make a leak (see :class:`LeakWatcher`).
        warmup_steps: first steps not compared (gradients and optimizer state appear there).
        analyse_step: the step whose liveness is analysed, or the first watched step after it (a resumed
            run); ``None``: none.
        roots: a function returning the objects a user knows, ``{id(obj): (obj, "name", kind)}`` (see
            :func:`~lightning_memkit.doctor.holders.user_roots`), from which the holders of a leak are
            searched when one is reported; ``None``: the module as ``model`` and the user's module globals.
        holders_time_limit_s: the most seconds the holder search may take, for a report (0: no search).
        graph_check: also count the autograd nodes reachable at each step's start from the tensors the
            recorder saw made, to find graphs kept across steps (``total += loss``).
        max_points: live-bytes points kept for the report.
        keeping_lines: name the line of the user's code that stored each kept tensor (``self.kept.append(x)``)
            beside the line that made it: a ``sys.settrace`` tracer of the user's store statements while
            recording (:class:`~lightning_memkit.doctor.keepers.KeepTracer`), off on a compiled model kept compiled.
    """

    def __init__(
        self,
        module: torch.nn.Module | None = None,
        optimizers: Iterable[Any] = (),
        *,
        window: int = 5,
        warmup_steps: int = 2,
        analyse_step: int | None = 1,
        graph_check: bool = True,
        max_points: int = 1000,
        roots: Callable[[], dict] | None = None,
        holders_time_limit_s: float = 1.0,
        keeping_lines: bool = True,
    ) -> None:
        self.module = module
        self.roots = roots
        self.holders_time_limit_s = holders_time_limit_s
        self.holder_search: HolderSearch | None = None
        self.optimizers = list(optimizers)
        self.recorder = CreationRecorder()
        self.keep_tracer = KeepTracer(self.recorder) if keeping_lines else None
        if module is not None:
            self.recorder.name_modules(module)
        self.window = window
        self.warmup_steps = warmup_steps
        self.watcher = LeakWatcher(window=window, warmup_steps=warmup_steps, recorder=self.recorder)
        self.graph_watcher = LeakWatcher(window=window, warmup_steps=warmup_steps) if graph_check else None
        self.graph_leak: GraphLeakReport | None = None
        self.analyse_step = analyse_step
        self.liveness: LivenessReport | None = None
        self.points: collections.deque = collections.deque(maxlen=max_points)
        self.steps = 0
        self._analysing = False
        self._finished = False
        self._last_step: int | None = None
        self.compiled_note = ""  # set by whoever finds the model compiled (MemoryDoctor): said once in the report
        self._epoch_end_bytes: int | None = None
        # storage key -> weak reference to each storage of the batch in flight and of the batches fetched ahead
        # (those given to the last step_start): left out of the watched bytes while they live
        self._in_flight: dict[int, weakref.ref] = {}

    def watched_bytes(self) -> int:
        """The live bytes the leak rule watches, in bytes: every storage the recorder knows, less training state
        (parameters, buffers, gradients, optimizer state: never a leak, and freed or made at times of
        Lightning's choosing), less what was alive before the run (:meth:`know_existing`), and less the batch
        in flight and the batches fetched ahead of it (given to the last :meth:`step_start`), while they live:
        with batches that change size (text padded per batch) they would move the floor by more than a leak
        adds per step. A batch some code keeps past its step is counted again once a later step starts."""
        recorder = self.recorder
        # a compiled model kept compiled: the allocator's live bytes
        if recorder.live_bytes_now() != recorder.live_bytes:
            return recorder.live_bytes_now() - self.in_flight_bytes()
        return recorder.live_bytes - recorder.state_bytes - recorder.before_run_bytes - self.in_flight_bytes()

    def in_flight_bytes(self) -> int:
        """Bytes of the batch in flight and the batches fetched ahead (as given to the last :meth:`step_start`)
        still alive, as the recorder counts them (storages it knows; training state and what was alive before
        the run are left out of the watched bytes already)."""
        storages = [storage for storage in (ref() for ref in self._in_flight.values()) if storage is not None]
        return self.recorder.watched_bytes_of(storages)

    def _note_in_flight(self, *batches: Any) -> None:
        """Keep weak references to the storages of ``batches`` (tensors in nested lists, tuples and dicts),
        replacing the last ones."""
        self._in_flight = {}
        for tensor in _tensors_in(list(batches)):
            storage = storage_of(tensor)
            if storage is not None and id(storage) not in self._in_flight:
                try:
                    self._in_flight[id(storage)] = weakref.ref(storage)
                except TypeError:  # a storage that takes no weak reference: counted as any other
                    continue

    def know_existing(self, *roots: Any) -> int:
        """Note the tensors reachable from ``roots`` (the dataloader, the datamodule) as alive before the
        run: a pre-built batch is never memory a step added. Returns how many storages were noted."""
        return self.recorder.know_existing(roots)

    def step_start(
        self,
        step: int,
        batch: Any = None,
        *,
        prefetched: Iterable[Any] = (),
        module: torch.nn.Module | None = None,
        optimizers: Iterable[Any] | None = None,
        epoch: int | None = None,
    ) -> LeakReport | GraphLeakReport | None:
        """A step begins: measure the live bytes, judge the growth (a :class:`LeakReport`, or a
        :class:`GraphLeakReport` for graphs kept across steps, the first time the floor keeps rising), then
        record the step (its liveness too when it is ``analyse_step``).

        ``batch``: the step's input (its tensors are recorded as the input of this step); ``prefetched``: the
        batches already fetched for the next steps (a loader that fetches ahead; Lightning's fetcher keeps
        one for a train loader without a length); neither is in the bytes measured (:meth:`watched_bytes`).
        ``module`` / ``optimizers``: the training state when it is not the session's own (``None``: the
        session's); ``epoch``: the step's epoch, when there are epochs: growth is then judged when an epoch
        ends and at :meth:`close` (memory freed at each epoch's end is not a leak), else at every step.
        """
        module = module if module is not None else self.module
        optimizers = self.optimizers if optimizers is None else list(optimizers)
        recorder = self.recorder
        recorder.assign_roles(module, optimizers)  # state made in the last step (grads, Adam's moments)
        recorder.catch_up()  # a compiled model kept compiled: what the last step made, found by a walk
        self._note_in_flight(batch, *prefetched)
        live = self.watched_bytes()
        self.points.append([int(step), int(live)])
        self.steps += 1
        self._last_step = int(step)
        found = self.watcher.observe(step, live, epoch=epoch)
        if found is not None:
            self._find_holders(found)
        if self.graph_watcher is not None and self.graph_leak is None:
            nodes, _ = count_kept_graph_nodes(recorder)
            grown = self.graph_watcher.observe(step, nodes, epoch=epoch)
            if grown is not None:
                self._graph_report(grown)
                found = found or self.graph_leak
        recorder.start(step, batch=batch, module=module, optimizers=optimizers)
        if (
            self.keep_tracer is not None
            and recorder.compiled != "keep"
            and not self.keep_tracer.start()
            and self.keep_tracer.note
            and self.keep_tracer.note not in recorder.errors
        ):
            recorder.errors.append(self.keep_tracer.note)  # another tracer (a debugger, coverage) is left alone
        # no op is seen inside compiled code kept compiled: no liveness to analyse
        if (
            self.analyse_step is not None
            and step >= self.analyse_step
            and self.liveness is None
            and not self._analysing
            and recorder.compiled != "keep"
        ):
            self._analysing = True
            recorder.begin_liveness()
        return found

    def _graph_report(self, grown: LeakReport) -> None:
        nodes: list = []
        samples: dict = {}
        _, holders = count_kept_graph_nodes(self.recorder, holders=True, nodes_out=nodes, samples_out=samples)
        saved = saved_in_nodes(nodes, self.recorder)
        del nodes
        if self.holders_time_limit_s > 0 and samples:
            try:
                roots = self.roots() if self.roots is not None else user_roots(module=self.module)
                tensors = [samples[id(h)] for h in holders[:10] if id(h) in samples]
                search = find_holders(tensors, roots, self.holders_time_limit_s, graphs=False)
                for holder in holders[:10]:
                    tensor = samples.get(id(holder))
                    storage = tensor.untyped_storage() if tensor is not None else None
                    path = search.paths.get(id(storage)) if storage is not None else None
                    if path is not None:
                        holder.holder = path.text
            except Exception as error:  # noqa: BLE001 - naming the holder must never fail the diagnosis
                self.recorder.errors.append(f"graph holder search: {type(error).__name__}: {error}")
        samples.clear()
        self.graph_leak = GraphLeakReport(
            grown.bytes_per_step,
            grown.first_step,
            grown.last_step,
            grown.live_bytes_at_start,
            holders[:10],
            saved["tensors"],
            saved["bytes"],
            saved["unseen_tensors"],
            saved["unseen_bytes"],
            saved["constants"],
        )

    def _find_holders(self, report: LeakReport) -> None:
        if self.holders_time_limit_s <= 0:
            return
        try:
            roots = self.roots() if self.roots is not None else user_roots(module=self.module)
            self.holder_search = attach_holders(report, self.recorder, roots, self.holders_time_limit_s)
        except Exception as error:  # noqa: BLE001 - naming the holder must never fail the diagnosis
            self.recorder.errors.append(f"holder search: {type(error).__name__}: {error}")

    def epoch_end(self) -> None:
        """An epoch's steps are done (call before the epoch-end code that may free what the epoch kept):
        :meth:`finish` then tells memory freed at the epoch's end from memory kept."""
        self.recorder.assign_roles(self.module, self.optimizers)
        self._epoch_end_bytes = self.watched_bytes()

    def finish(self) -> LeakReport | GraphLeakReport | None:
        """Training ended (after the last epoch's end): judge the whole run, with the memory now. Returns
        what was found now (a :class:`LeakReport` or :class:`GraphLeakReport`), else ``None``."""
        if self._finished or self._last_step is None:
            return None
        self._finished = True
        self.recorder.assign_roles(self.module, self.optimizers)
        now = self.watched_bytes()
        freed = None if self._epoch_end_bytes is None else self._epoch_end_bytes - now
        found = self.watcher.finish(now, step=self._last_step, freed_at_end=freed)
        if found is not None:
            self._find_holders(found)
        if self.graph_watcher is not None and self.graph_leak is None:
            nodes, _ = count_kept_graph_nodes(self.recorder)
            grown = self.graph_watcher.finish(nodes, step=self._last_step)
            if grown is not None:
                self._graph_report(grown)
                found = found or self.graph_leak
        return found

    def step_end(
        self, step: int, *, module: torch.nn.Module | None = None, optimizers: Iterable[Any] | None = None
    ) -> None:
        """A step's optimizer step is done: finish its liveness analysis if it was being analysed.
        Recording goes on until the next :meth:`step_start` or :meth:`close`. ``module`` /
        ``optimizers``: as in :meth:`step_start`."""
        if self._analysing:
            self._analysing = False
            module = module if module is not None else self.module
            self.recorder.assign_roles(module, self.optimizers if optimizers is None else list(optimizers))
            creations, start, end = self.recorder.end_liveness()
            self.liveness = analyse_liveness(creations, start, end, step)

    def close(self, finish: bool = False) -> None:
        """Stop recording (call when training ends or fails); the report stays readable. ``finish``: the
        training ended (not failed): judge the whole run first (:meth:`finish`)."""
        if finish:
            self.finish()
        if self._analysing:
            self._analysing = False
            self.recorder.end_liveness()
        self.recorder.stop()
        if self.keep_tracer is not None:
            self.keep_tracer.stop()

    def report(self) -> DoctorReport:
        """The verdict so far."""
        points = list(self.points)
        return DoctorReport(
            steps=self.steps,
            live_bytes_at_start=points,
            steady_bytes=points[-1][1] if points else None,
            leak=self.watcher.report,
            graph_leak=self.graph_leak,
            liveness=self.liveness,
            errors=list(self.recorder.errors),
            steps_needed=self.watcher.steps_needed,
            compiled=self.compiled_note,
        )
