"""Within a step: each storage from creation to last use, and what is held past its last use at the peak.

Owns :func:`analyse_liveness`, which replays a :class:`~lightning_memkit.doctor.recorder.CreationRecorder`
liveness window (allocation, last use and free of every storage on one op clock) into a
:class:`LivenessReport`: the step's peak, what it is made of, and the bytes *held too long* there:
live at the peak although their last use came before it (what a memory planner would reclaim).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_memkit.doctor.creation import Creation
from lightning_memkit.doctor.leaks import CreatorGroup, group_by_creator
from lightning_memkit.units import format_bytes

__all__ = ["LivenessReport", "analyse_liveness", "PEAK_PARTS", "TINY_BYTES"]

#: held-too-long groups under this many bytes are summed on one line of :meth:`LivenessReport.format`
TINY_BYTES = 64

#: What the peak is made of, in display order, and what each part means.
PEAK_PARTS: dict[str, str] = {
    "parameters": "the model's parameters",
    "buffers": "the model's buffers",
    "gradients": "the parameters' .grad tensors",
    "optimizer_state": "tensors in optimizer.state",
    "inputs": "the step's batch",
    "held_for_backward": "read again later in backward (activations autograd saved)",
    "in_use": "read again later in the step, not by backward",
    "held_too_long": "never read again after an op before the peak: held past last use",
}


@dataclass
class LivenessReport:
    """One step's liveness at its peak (all sizes in bytes).

    Attributes:
        step: the training step analysed.
        peak_bytes: the most bytes live at once in the step (every storage the recorder knows).
        peak_op: the op at whose end the peak was reached, and ``peak_module`` / ``peak_phase`` its place.
        peak_parts: :data:`PEAK_PARTS` name -> bytes at the peak; they sum to ``peak_bytes``.
        held_too_long_bytes: bytes live at the peak whose last use came before it.
        held_too_long: those storages grouped by creator and last use, largest first.
    """

    step: int | None
    peak_bytes: int
    peak_op: str
    peak_module: str
    peak_phase: str
    peak_parts: dict = field(default_factory=dict)
    held_too_long_bytes: int = 0
    held_too_long: list[CreatorGroup] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "step": self.step,
            "peak_bytes": self.peak_bytes,
            "peak_op": self.peak_op,
            "peak_module": self.peak_module,
            "peak_phase": self.peak_phase,
            "peak_parts": dict(self.peak_parts),
            "held_too_long_bytes": self.held_too_long_bytes,
            "held_too_long": [g.to_dict() for g in self.held_too_long],
        }

    def format(self, limit: int = 8) -> str:
        """The report as text, at most ``limit`` groups of what is held too long (MiB = 2**20 bytes)."""
        where = f" in {self.peak_module}" if self.peak_module else ""
        lines = [
            f"step {self.step} peak: {format_bytes(self.peak_bytes)} ({self.peak_bytes} bytes), "
            f"after {self.peak_op}{where} ({self.peak_phase})",
            "  made of:",
        ]
        for part, value in self.peak_parts.items():
            if value:
                lines.append(f"    {part:<18} {format_bytes(value):>12}  {PEAK_PARTS[part]}")
        lines.append(
            f"  held too long at the peak: {format_bytes(self.held_too_long_bytes)} ({self.held_too_long_bytes} bytes)"
        )
        tiny = [g for g in self.held_too_long if g.total_bytes < TINY_BYTES]
        for group in [g for g in self.held_too_long if g.total_bytes >= TINY_BYTES][:limit]:
            last = (
                f"{group.last_use_op}" + (f" in {group.last_use_module}" if group.last_use_module else "")
                if group.last_use_op
                else "nothing in this step (kept from an earlier one)"
            )
            lines.append(
                f"    {format_bytes(group.total_bytes)} ({group.total_bytes} B, {group.count} tensors): "
                f"{group.describe()}; last used by {last}"
            )
        if tiny:
            together = sum(g.total_bytes for g in tiny)
            lines.append(
                f"    {together} B in {sum(g.count for g in tiny)} tiny tensors (under {TINY_BYTES} B each, "
                f"{len(tiny)} makers: scalars such as losses; not worth freeing)"
            )
        return "\n".join(lines)


def analyse_liveness(creations: list[Creation], start: int, end: int, step: int | None = None) -> LivenessReport:
    """Replay a liveness window (from :meth:`CreationRecorder.end_liveness`) and report its peak.

    A storage is live at op clock ``t`` (just after op ``t`` ran) when it was made at or before ``t``
    (before the window: ``start``) and not freed before ``t`` ran. Held too long at the peak: live
    there, not training state, made before the peak, and last read before it.
    """
    changes: dict[int, int] = {}
    for c in creations:
        born = max(c.created_at, start)
        changes[born] = changes.get(born, 0) + c.nbytes
        if c.freed_at is not None:
            changes[c.freed_at + 1] = changes.get(c.freed_at + 1, 0) - c.nbytes
    live = peak = 0
    peak_at = start
    for clock in sorted(changes):
        live += changes[clock]
        if live > peak and clock <= end:
            peak, peak_at = live, clock
    at_peak = [
        c for c in creations if max(c.created_at, start) <= peak_at and (c.freed_at is None or c.freed_at >= peak_at)
    ]
    parts = dict.fromkeys(PEAK_PARTS, 0)
    held: list[Creation] = []
    for c in at_peak:
        if c.role is not None:
            parts[c.role] += c.nbytes
        elif c.last_use_at > peak_at:
            parts["held_for_backward" if c.last_use_phase == "backward" else "in_use"] += c.nbytes
        elif c.created_at < peak_at and c.last_use_at < peak_at:
            parts["held_too_long"] += c.nbytes
            held.append(c)
        else:
            parts["in_use"] += c.nbytes  # made or read by the peak's own op
    peak_op, peak_module, peak_phase = _op_at(creations, peak_at)
    return LivenessReport(
        step=step,
        peak_bytes=peak,
        peak_op=peak_op,
        peak_module=peak_module,
        peak_phase=peak_phase,
        peak_parts=parts,
        held_too_long_bytes=parts["held_too_long"],
        held_too_long=group_by_creator(held, with_last_use=True),
    )


def _op_at(creations: list[Creation], clock: int) -> tuple[str, str, str]:
    for c in creations:
        if c.created_at == clock:
            return c.op, c.module, c.phase
    return "", "", ""
