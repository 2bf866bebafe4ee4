"""Across steps: live bytes at each step, a floor that keeps rising, and who made what survived.

Owns the leak rule shared by the doctor and MemoryTracker's leak watch: :func:`rising_floor` (the
lower envelope of the live bytes keeps rising across the run) and :class:`LeakWatcher` (cheap enough
to run every step), and the records they produce: :class:`LeakReport` and :class:`CreatorGroup`
(tensors grouped by where they were made).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from lightning_memkit.doctor.creation import STATE_ROLES, Creation
from lightning_memkit.doctor.frames import format_frame
from lightning_memkit.doctor.keepers import keeping_frame
from lightning_memkit.doctor.recorder import CreationRecorder
from lightning_memkit.units import format_bytes

__all__ = ["CreatorGroup", "LeakReport", "LeakWatcher", "group_by_creator", "rising_floor"]


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
        holder: where a program can reach them, as code you can paste (``"model.outputs[17]"``,
            ``"trainer.callbacks[1].saved[3]"``), or ``""`` when no known root reaches them (see
            :func:`~lightning_memkit.doctor.holders.find_holders`).
        holder_note: what the holder is, when it says more than its path (hooks piled up on a
            module, a torchmetrics list state, Lightning's own objects), and the fix.
        kept_at: ``[filename, line, function]`` of the user's statement that stored them where they are held
            (``self.kept.append(logits)``), beside :attr:`frame` that made them, or ``None`` when none was
            seen (see :func:`~lightning_memkit.doctor.keepers.keeping_frame`).
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
    holder: str = ""
    holder_note: str = ""
    kept_at: list | None = None

    @property
    def where(self) -> str:
        """``file.py:12 in fn: source`` of the user's line, or ``""``."""
        return format_frame(self.frame)

    @property
    def kept_where(self) -> str:
        """``file.py:30 in fn: source`` of the user's line that keeps them, or ``""``."""
        return format_frame(self.kept_at)

    def describe(self) -> str:
        """One line saying who made these tensors."""
        module = f" in {self.module}" if self.module else ""
        where = f", at {self.where}" if self.frame else ""
        return (
            f"{self.op}{module} ({self.phase}, {self.category}) {self.shape} {self.dtype.replace('torch.', '')}{where}"
        )

    def holder_lines(self) -> list[str]:
        """The lines naming the code that keeps these tensors, who holds them and where to delete them (none
        when unknown)."""
        lines = [f"kept at {self.kept_where}"] if self.kept_at else []
        if not self.holder:
            return lines
        lines.append(f"held by {self.holder}  <- delete here")
        if self.holder_note:
            lines.append(self.holder_note)
        return lines

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__} | {
            "where": self.where,
            "kept_where": self.kept_where,
        }


def _category(creation: Creation) -> str:
    return creation.role or "made in a step"


def group_key(c: Creation) -> tuple:
    """The key :func:`group_by_creator` groups a record by (without last use)."""
    return (c.op, c.module, c.phase, tuple(c.shape), c.dtype, _category(c), tuple(c.frame) if c.frame else None)


def group_by_creator(
    creations: Iterable[Creation], with_last_use: bool = False, per_step_over_span: bool = False
) -> list[CreatorGroup]:
    """Group storage records by creator, largest total first.

    ``bytes_per_step`` is ``total_bytes`` over the distinct steps they were made in; with
    ``per_step_over_span``, over the steps they span instead: the bytes made after their first step,
    divided by the steps from their first to their last (a list that validation fills every 2 steps
    keeps its bytes per validation / 2 each step)."""
    groups: dict[tuple, CreatorGroup] = {}
    step_sets: dict[tuple, set] = collections.defaultdict(set)
    first_step_bytes: dict[tuple, dict] = collections.defaultdict(lambda: collections.defaultdict(int))
    members: dict[tuple, list] = collections.defaultdict(list)
    for c in creations:
        key = group_key(c)
        if with_last_use:
            key += (c.last_use_op, c.last_use_module)
        group = groups.get(key)
        if group is None:
            group = groups[key] = CreatorGroup(
                c.op,
                c.module,
                c.phase,
                list(c.shape),
                c.dtype,
                _category(c),
                list(c.frame) if c.frame else None,
                last_use_op=c.last_use_op if with_last_use else "",
                last_use_module=c.last_use_module if with_last_use else "",
            )
        group.count += 1
        group.total_bytes += c.nbytes
        members[key].append(c)
        if c.step is not None:
            step_sets[key].add(c.step)
            first_step_bytes[key][c.step] += c.nbytes
    for key, group in groups.items():
        group.kept_at = keeping_frame(members[key])  # the holder search refines it with the holder's path
        group.steps = sorted(step_sets[key])
        group.bytes_per_step = group.total_bytes // max(1, len(group.steps))
        if per_step_over_span and len(group.steps) >= 2:
            first, last = group.steps[0], group.steps[-1]
            group.bytes_per_step = (group.total_bytes - first_step_bytes[key][first]) // (last - first)
    return sorted(groups.values(), key=lambda g: (-g.total_bytes, g.op, g.module))


@dataclass
class LeakReport:
    """Growth of the memory's floor across the run, and who made (and who holds) what survived.

    The floor (lower envelope) at a step is the least live bytes seen from that step on: memory that
    is freed later (a list cleared at the epoch's end, a cache that is bounded) never raises it; memory
    that is kept raises it for good. A leak is a floor that keeps rising (see :func:`rising_floor`).

    Attributes:
        bytes_per_step: the floor's growth per step, in bytes: its rise from the first to the last
            step it rose at, divided by the steps between them (exact when the same bytes are kept
            every step, or every ``k`` steps: then it is their average per step).
        first_step, last_step: the first and the last step the floor rose at.
        live_bytes_at_start: ``[[step, bytes], ...]`` the live bytes at each watched step (its start
            for the doctor, its end for MemoryTracker), from the step before ``first_step``.
        survivors: tensors made in earlier steps still alive when the leak was judged, grouped by
            creator, largest first (training state excluded). Empty without a recorder.
        growing: the survivor groups made in several different steps (at least half of ``window``,
            and 2): the leak's makers, largest first; each names its holder when the doctor found it
            (:attr:`CreatorGroup.holder`).
        rises: how many times the floor rose.
    """

    bytes_per_step: int
    first_step: int
    last_step: int
    live_bytes_at_start: list
    survivors: list[CreatorGroup] = field(default_factory=list)
    growing: list[CreatorGroup] = field(default_factory=list)
    rises: int = 0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "bytes_per_step": self.bytes_per_step,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "live_bytes_at_start": [list(p) for p in self.live_bytes_at_start],
            "survivors": [g.to_dict() for g in self.survivors],
            "growing": [g.to_dict() for g in self.growing],
            "rises": self.rises,
        }

    def format(self, limit: int = 8) -> str:
        """The report as text, at most ``limit`` groups of who made what was kept (MiB = 2**20 bytes)."""
        steadily = (
            ""
            if self.rises <= 0 or self.rises >= self.last_step - self.first_step
            else f", rising at {self.rises} of those steps"
        )
        lines = [
            f"memory leak: the floor of live tensor memory grows by {format_bytes(self.bytes_per_step)} "
            f"({self.bytes_per_step} bytes) per step, steps {self.first_step}..{self.last_step}{steadily}"
        ]
        if self.growing:
            lines.append("kept from earlier steps, by who made them (largest first):")
            for group in self.growing[:limit]:
                lines.append(
                    f"  {format_bytes(group.bytes_per_step)}/step ({group.bytes_per_step} B/step, "
                    f"{group.count} tensors from {len(group.steps)} steps): {group.describe()}"
                )
                lines.extend("    " + line for line in group.holder_lines())
        elif self.survivors:
            lines.append("tensors made in earlier steps still alive (largest first):")
            for group in self.survivors[:limit]:
                lines.append(f"  {format_bytes(group.total_bytes)} ({group.count} tensors): {group.describe()}")
                lines.extend("    " + line for line in group.holder_lines())
        else:
            lines.append(
                "who made them is unknown here: add lightning_memkit.MemoryDoctor() or run `memkit doctor` "
                "to see which code keeps them"
            )
        return "\n".join(lines)


def rising_floor(points: list, min_rises: int = 5, min_bytes_per_step: int = 1) -> tuple[int, int, int, int] | None:
    """The lower-envelope leak rule: whether the floor of ``points`` keeps rising across them.

    ``points``: ``[(step, bytes), ...]`` in step order. The floor at point ``i`` is the least bytes
    from ``i`` to the last point, so bytes freed later never count (a rise at the last point, whose
    floor is only itself, is not counted). The floor *keeps rising* when it
    rose at least ``min_rises`` times, and the steps since its last rise are at most twice the widest
    gap between two rises (growth that stopped, as a bounded cache filling up, is not a leak;
    growth every ``k`` steps, as a list kept by validation, is). Returns ``(bytes_per_step,
    first_step, last_step, rises)``: the floor's growth from its first to its last rise over the steps
    between (an integer division), or ``None``.
    """
    if len(points) < 2:
        return None
    floors = [0] * len(points)
    low = None
    for i in range(len(points) - 1, -1, -1):
        value = points[i][1]
        low = value if low is None or value < low else low
        floors[i] = low
    # the last point's floor is itself, whatever it holds for a moment: a rise there is not yet known
    rises = [i for i in range(1, len(points) - 1) if floors[i] > floors[i - 1]]
    if len(rises) < max(2, min_rises):
        return None
    steps = [points[i][0] for i in rises]
    widest = max(b - a for a, b in itertools.pairwise(steps))
    if points[-1][0] - steps[-1] > 2 * widest:
        return None
    span = steps[-1] - steps[0]
    if span <= 0:
        return None
    per_step = (floors[rises[-1]] - floors[rises[0]]) // span
    if per_step < max(1, min_bytes_per_step):
        return None
    return per_step, steps[0], steps[-1], len(rises)


class LeakWatcher:
    """Watch the live bytes at each step for a floor that keeps rising; report it once.

    Cheap enough for every step: :meth:`observe` takes a number. The rule is :func:`rising_floor`, the
    same for the doctor and MemoryTracker. When the epoch of each step is given, growth is judged when
    an epoch ends (at the next epoch's first step) and at :meth:`finish`, with the memory measured
    after the epoch's end: memory a run frees at each epoch's end (a list of the epoch's losses) is
    not a leak. Without epochs, every step is judged. With a
    :class:`~lightning_memkit.doctor.recorder.CreationRecorder` (``recorder=``), the report also groups the
    tensors that survived from earlier steps by who made them.

    Usage::

        watcher = LeakWatcher(window=5)
        for epoch in range(epochs):
            for step, batch in enumerate(loader):
                report = watcher.observe(step, live_bytes_now, epoch=epoch)   # before the step runs
                train_step(batch)
        report = report or watcher.finish(live_bytes_now)                      # after training

    Args:
        window: how many times the floor must rise to make a leak (>= 2).
        warmup_steps: steps ignored first (gradients and optimizer state appear in the first steps).
        min_bytes_per_step: a smaller growth per step, in bytes, is not reported.
        recorder: the recorder whose records name the survivors (optional).
        max_points: points kept (the oldest are dropped).
    """

    def __init__(
        self,
        window: int = 5,
        warmup_steps: int = 2,
        min_bytes_per_step: int = 1,
        recorder: CreationRecorder | None = None,
        max_points: int = 100_000,
    ) -> None:
        if not isinstance(window, int) or isinstance(window, bool) or window < 2:
            raise ValueError(
                f"LeakWatcher(window={window!r}): give an integer >= 2 (rises of the memory's floor that make a leak)"
            )
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"LeakWatcher(warmup_steps={warmup_steps!r}): give an integer >= 0")
        self.window = window
        self.warmup_steps = warmup_steps
        self.min_bytes_per_step = min_bytes_per_step
        self.recorder = recorder
        self._seen = 0
        self._history: collections.deque = collections.deque(maxlen=max_points)
        self._epoch: Any = None
        self.report: LeakReport | None = None

    @property
    def points(self) -> list:
        """``[(step, bytes), ...]`` the points watched so far (after the warm-up)."""
        return list(self._history)

    @property
    def steps_needed(self) -> int:
        """The fewest observed steps that can show a leak: the warm-up, then ``window + 2`` points (``window``
        rises, the first point before them and a last point after, whose own floor is not yet known)."""
        return self.warmup_steps + self.window + 2

    @property
    def enough_steps(self) -> bool:
        """Whether enough steps were watched for a leak to be judged (see :attr:`steps_needed`)."""
        return self._seen >= self.steps_needed

    def reset(self) -> None:
        """Forget what was observed (a new run)."""
        self._seen = 0
        self._history.clear()
        self._epoch = None
        self.report = None

    def observe(self, step: int, live_bytes: int, epoch: int | None = None) -> LeakReport | None:
        """Take ``live_bytes`` (bytes of live tensors) at ``step`` (of ``epoch``, when known); return a
        :class:`LeakReport` the first time the floor is found to keep rising, else ``None``."""
        self._seen += 1
        if self._seen <= self.warmup_steps:
            self._epoch = epoch
            return None
        self._history.append((int(step), int(live_bytes)))
        new_epoch = epoch is not None and self._epoch is not None and epoch != self._epoch
        # without epochs every step is judged; a judgement reads every point, so past 256 points only
        # one step in len/64 is (the cost stays O(n log n) over a run, and a leak is seen a little later)
        points = len(self._history)
        judge = new_epoch or (epoch is None and points % max(1, points // 64 if points > 256 else 1) == 0)
        self._epoch = epoch
        if self.report is not None or not judge:
            return None
        return self._judge(step)

    def finish(
        self, live_bytes: int | None = None, step: int | None = None, freed_at_end: int | None = None
    ) -> LeakReport | None:
        """The run ended: judge every point. The growth must still be there (at least half of it), else
        the memory freed at the end was only held for the epoch: ``freed_at_end`` (the bytes freed from
        the end of the last epoch's steps to now, after its end hooks) under half the growth, or, with a
        recorder, the bytes the growing groups made in the rising steps still alive; without either,
        ``live_bytes`` (the live bytes now) over the floor before the first rise at least half of it.
        Returns the report when found now."""
        if self.report is not None:
            return None
        return self._judge(
            step if step is not None else (self._history[-1][0] if self._history else 0),
            live_bytes,
            final=True,
            freed_at_end=freed_at_end,
        )

    def _judge(
        self, step: int, final_bytes: int | None = None, final: bool = False, freed_at_end: int | None = None
    ) -> LeakReport | None:
        points = list(self._history)
        found = rising_floor(points, self.window, self.min_bytes_per_step)
        if found is None:
            return None
        per_step, first, last, rises = found
        start = max(i for i, p in enumerate(points) if p[0] < first) if points[0][0] < first else 0
        grown = per_step * (last - first)
        if final and self.recorder is None:
            if freed_at_end is not None and freed_at_end >= grown - grown // 2:
                return None  # freed when the epoch ended: it was held for the epoch
            if (
                freed_at_end is None
                and final_bytes is not None
                and final_bytes - min(b for _, b in points[start:]) < grown // 2
            ):
                return None
        report = LeakReport(
            bytes_per_step=per_step,
            first_step=first,
            last_step=last,
            live_bytes_at_start=[list(p) for p in points[start:]],
            rises=rises,
        )
        if self.recorder is not None:
            kept = self._attribute(self.recorder, report, step, final)
            undone = freed_at_end is not None and freed_at_end >= grown - grown // 2
            if final and kept < grown // 2 and (freed_at_end is None or undone):
                # what the rising steps made is freed now (a list of the epoch's tensors), or, when it was
                # re-made since (torchmetrics copies its list states on each forward), the epoch's end
                # freed the growth: it was held for the epoch
                return None
        self.report = report
        return report

    def _attribute(self, recorder: CreationRecorder, report: LeakReport, step: int, final: bool) -> int:
        """Group the survivors; returns the bytes the growing groups still keep from the rising steps."""
        survivors = [
            c
            for c in recorder.live_creations()
            if c.step is not None
            and (c.step <= step if final else c.step < step)
            and c.role not in STATE_ROLES
            and not c.before_run
        ]
        report.survivors = group_by_creator(survivors, per_step_over_span=True)
        needed = max(2, min(report.rises, self.window) // 2)
        report.growing = [g for g in report.survivors if len(g.steps) >= needed]
        growing = {group_key(c) for c in survivors} & {_key_of(g) for g in report.growing}
        return sum(
            c.nbytes
            for c in survivors
            if c.step is not None and report.first_step <= c.step <= report.last_step and group_key(c) in growing
        )


def _key_of(group: CreatorGroup) -> tuple:
    return (
        group.op,
        group.module,
        group.phase,
        tuple(group.shape),
        group.dtype,
        group.category,
        tuple(group.frame) if group.frame else None,
    )
