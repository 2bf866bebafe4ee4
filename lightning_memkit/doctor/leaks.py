"""Across steps: live bytes at each step's start, steady growth, and who made what survived.

Owns :class:`LeakWatcher` (the growth test, cheap enough to run every step) and the records it
produces: :class:`LeakReport` and :class:`CreatorGroup` (tensors grouped by where they were made).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Iterable

from lightning_memkit.doctor.recorder import STATE_ROLES, Creation, CreationRecorder, format_frame
from lightning_memkit.units import format_bytes

__all__ = ["CreatorGroup", "LeakReport", "LeakWatcher", "group_by_creator"]


@dataclass
class CreatorGroup:
    """Live storages made by the same code: same op, module, phase, shape, dtype, user line and role.

    Attributes:
        op: the aten op that made them (``"existing"``: made before recording, e.g. a batch).
        module: the module path whose forward ran the op (``""``: outside every module forward).
        phase: ``"forward"``, ``"backward"`` or ``"other"``.
        shape, dtype: of the tensors (as first seen).
        category: ``"inputs"`` for a batch, a training-state role, else ``"made in a step"``.
        frame: ``[filename, line, function]`` of the user's code that ran the op, or ``None``.
        count: how many live storages.
        total_bytes: their bytes together.
        steps: the steps they were made in (sorted, distinct).
        bytes_per_step: ``total_bytes / len(steps)`` rounded down (bytes kept per step).
        last_use_op, last_use_module: the op (and module) that last read them, when recorded.
    """

    op: str
    module: str
    phase: str
    shape: list
    dtype: str
    category: str
    frame: list | None
    count: int = 0
    total_bytes: int = 0
    steps: list = field(default_factory=list)
    bytes_per_step: int = 0
    last_use_op: str = ""
    last_use_module: str = ""

    @property
    def where(self) -> str:
        """``file.py:12 in fn: source`` of the user's line, or ``""``."""
        return format_frame(self.frame)

    def describe(self) -> str:
        """One line saying who made these tensors."""
        module = f" in {self.module}" if self.module else ""
        where = f", at {self.where}" if self.frame else ""
        return (f"{self.op}{module} ({self.phase}, {self.category}) {self.shape} {self.dtype.replace('torch.', '')}"
                f"{where}")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__} | {"where": self.where}


def _category(creation: Creation) -> str:
    return creation.role or "made in a step"


def group_by_creator(creations: Iterable[Creation], with_last_use: bool = False) -> list[CreatorGroup]:
    """Group storage records by creator, largest total first."""
    groups: dict[tuple, CreatorGroup] = {}
    step_sets: dict[tuple, set] = collections.defaultdict(set)
    for c in creations:
        key = (c.op, c.module, c.phase, tuple(c.shape), c.dtype, _category(c), tuple(c.frame) if c.frame else None)
        if with_last_use:
            key += (c.last_use_op, c.last_use_module)
        group = groups.get(key)
        if group is None:
            group = groups[key] = CreatorGroup(c.op, c.module, c.phase, list(c.shape), c.dtype, _category(c),
                                               list(c.frame) if c.frame else None,
                                               last_use_op=c.last_use_op if with_last_use else "",
                                               last_use_module=c.last_use_module if with_last_use else "")
        group.count += 1
        group.total_bytes += c.nbytes
        if c.step is not None:
            step_sets[key].add(c.step)
    for key, group in groups.items():
        group.steps = sorted(step_sets[key])
        group.bytes_per_step = group.total_bytes // max(1, len(group.steps))
    return sorted(groups.values(), key=lambda g: (-g.total_bytes, g.op, g.module))


@dataclass
class LeakReport:
    """Steady growth of the live bytes at step start, and who made what survived.

    Attributes:
        bytes_per_step: the growth per step over the window, in bytes: the median of the
            step-to-step differences (the exact figure when the leak keeps the same bytes each step).
        first_step, last_step: the window of steps whose starts were compared.
        live_bytes_at_start: ``[[step, bytes], ...]`` the live bytes at each of those steps' start.
        survivors: tensors made in earlier steps still alive at ``last_step``'s start, grouped by
            creator, largest first (training state excluded). Empty without a recorder.
        growing: the survivor groups that kept storages from at least half the window's steps
            (the leak's makers), largest first.
    """

    bytes_per_step: int
    first_step: int
    last_step: int
    live_bytes_at_start: list
    survivors: list[CreatorGroup] = field(default_factory=list)
    growing: list[CreatorGroup] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {"bytes_per_step": self.bytes_per_step, "first_step": self.first_step, "last_step": self.last_step,
                "live_bytes_at_start": [list(p) for p in self.live_bytes_at_start],
                "survivors": [g.to_dict() for g in self.survivors], "growing": [g.to_dict() for g in self.growing]}

    def format(self, limit: int = 8) -> str:
        """The report as text, at most ``limit`` groups of who made what was kept (MiB = 2**20 bytes)."""
        lines = [f"memory leak: live tensor memory at step start grows by {format_bytes(self.bytes_per_step)} "
                 f"({self.bytes_per_step} bytes) per step, steps {self.first_step}..{self.last_step}"]
        if self.growing:
            lines.append("kept from earlier steps, by who made them (largest first):")
            for group in self.growing[:limit]:
                lines.append(f"  {format_bytes(group.bytes_per_step)}/step ({group.bytes_per_step} B/step, "
                             f"{group.count} tensors from {len(group.steps)} steps): {group.describe()}")
        elif self.survivors:
            lines.append("tensors made in earlier steps still alive (largest first):")
            for group in self.survivors[:limit]:
                lines.append(f"  {format_bytes(group.total_bytes)} ({group.count} tensors): {group.describe()}")
        else:
            lines.append("who made them is unknown here: add lightning_memkit.MemoryDoctor() or run `memkit doctor` "
                         "to see which code keeps them")
        return "\n".join(lines)


class LeakWatcher:
    """Watch the live bytes at each step's start for steady growth; report it once.

    Cheap enough for every step: :meth:`observe` takes a number. With a
    :class:`~lightning_memkit.doctor.CreationRecorder` (``recorder=``), the report also groups the
    tensors that survived from earlier steps by who made them.

    Usage::

        watcher = LeakWatcher(window=5)
        for step, batch in enumerate(loader):
            report = watcher.observe(step, live_bytes_now)   # before the step runs
            if report: warnings.warn(report.format())
            train_step(batch)

    Args:
        window: how many consecutive step-to-step increases make steady growth (>= 2).
        warmup_steps: steps ignored first (gradients and optimizer state appear in the first steps).
        min_bytes_per_step: a smaller growth is not reported.
        recorder: the recorder whose records name the survivors (optional).
    """

    def __init__(self, window: int = 5, warmup_steps: int = 2, min_bytes_per_step: int = 1,
                 recorder: CreationRecorder | None = None) -> None:
        if not isinstance(window, int) or window < 2:
            raise ValueError(f"LeakWatcher(window={window!r}): give an integer >= 2 (steps of growth that make a leak)")
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"LeakWatcher(warmup_steps={warmup_steps!r}): give an integer >= 0")
        self.window = window
        self.warmup_steps = warmup_steps
        self.min_bytes_per_step = min_bytes_per_step
        self.recorder = recorder
        self._seen = 0
        self._history: collections.deque = collections.deque(maxlen=window + 1)
        self.report: LeakReport | None = None

    def reset(self) -> None:
        """Forget what was observed (a new run)."""
        self._seen = 0
        self._history.clear()
        self.report = None

    def observe(self, step: int, live_bytes: int) -> LeakReport | None:
        """Take ``live_bytes`` (bytes of live tensors) at the start of ``step``; return a :class:`LeakReport`
        the first time growth is steady (``window`` increases in a row), else ``None``."""
        self._seen += 1
        if self._seen <= self.warmup_steps:
            return None
        self._history.append((int(step), int(live_bytes)))
        if self.report is not None or len(self._history) <= self.window:
            return None
        points = list(self._history)
        deltas = [b - a for (_, a), (_, b) in zip(points, points[1:])]
        if min(deltas) < max(1, self.min_bytes_per_step):
            return None
        ordered = sorted(deltas)
        report = LeakReport(bytes_per_step=ordered[len(ordered) // 2], first_step=points[0][0], last_step=points[-1][0],
                            live_bytes_at_start=[list(p) for p in points])
        if self.recorder is not None:
            self._attribute(report, step)
        self.report = report
        return report

    def _attribute(self, report: LeakReport, step: int) -> None:
        survivors = [c for c in self.recorder.live_creations()
                     if c.step is not None and c.step < step and c.role not in STATE_ROLES]
        report.survivors = group_by_creator(survivors)
        needed = max(2, (report.last_step - report.first_step + 1) // 2)
        report.growing = [g for g in report.survivors if len(g.steps) >= needed]
