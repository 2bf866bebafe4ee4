"""Checkpoint records: what a policy checkpointed and what it was measured or predicted to save.

Plain dataclasses that serialise to JSON; they hold names and numbers, never modules or tensors, so a
callback may keep them after the fit.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_memkit.units import format_bytes

__all__ = ["CheckpointSegment", "CheckpointPlan"]


@dataclass
class CheckpointSegment:
    """One checkpointed region.

    Attributes:
        name: the region's name: a module's qualified name (``"blocks.3"``) or, for a run of
            children of an ``nn.Sequential``, ``"features[0:4]"``.
        module_names: qualified names of the modules the region runs.
        saved_bytes: bytes of the storages the region's modules saved for backward without
            checkpointing (parameters excluded), when measured.
        predicted_saving_bytes: the part of ``saved_bytes`` that checkpointing frees (storages
            not also kept by the region's inputs or by code outside the region), when measured.
        recompute_flops: FLOPs of one forward of the region (the recompute cost), when measured.
        forward_seconds: wall time of one forward of the region on the sample, when measured.
    """

    name: str
    module_names: tuple[str, ...]
    saved_bytes: int | None = None
    predicted_saving_bytes: int | None = None
    recompute_flops: int | None = None
    forward_seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        data = asdict(self)
        data["module_names"] = list(self.module_names)
        return data


@dataclass
class CheckpointPlan:
    """What a policy checkpointed and what it was predicted or measured to save (bytes).

    Attributes:
        policy: the policy's description (``describe_policy``).
        segments: the checkpointed regions.
        baseline_activation_bytes: activation bytes without checkpointing (exact, saved-tensor hooks), when measured.
        measured_activation_bytes: activation bytes with these segments checkpointed (exact), when measured.
        budget_bytes: the budget in bytes, for budget policies.
        note: why the plan is what it is (e.g. how segments were grouped).
        measuring_peak_bytes: the highest peak of the storages the measuring forwards allocated (exact;
            each keeps no activation, so this is about a ``no_grad`` forward's peak), when measured.
    """

    policy: str
    segments: list[CheckpointSegment] = field(default_factory=list)
    baseline_activation_bytes: int | None = None
    measured_activation_bytes: int | None = None
    budget_bytes: int | None = None
    note: str = ""
    measuring_peak_bytes: int | None = None

    @property
    def count(self) -> int:
        """Number of checkpointed regions."""
        return len(self.segments)

    @property
    def names(self) -> list[str]:
        """Names of the checkpointed regions."""
        return [s.name for s in self.segments]

    @property
    def predicted_saving_bytes(self) -> int | None:
        """Sum of the segments' predicted savings, or ``None`` when not measured."""
        values = [s.predicted_saving_bytes for s in self.segments]
        known = [v for v in values if v is not None]
        return int(sum(known)) if values and len(known) == len(values) else None

    @property
    def measured_saving_bytes(self) -> int | None:
        """Baseline minus checkpointed activation bytes, when both were measured."""
        if self.baseline_activation_bytes is None or self.measured_activation_bytes is None:
            return None
        return self.baseline_activation_bytes - self.measured_activation_bytes

    def summary(self) -> str:
        """One paragraph for logs: count, names, predicted and measured saving."""
        names = ", ".join(self.names[:8]) + (f", ... ({self.count - 8} more)" if self.count > 8 else "")
        text = f"memkit checkpointing ({self.policy}): {self.count} region(s): {names or 'none'}"
        if self.predicted_saving_bytes is not None:
            text += f"; predicted saving {format_bytes(self.predicted_saving_bytes)}"
        if self.measured_saving_bytes is not None:
            text += (
                f"; activation memory {format_bytes(self.baseline_activation_bytes)} -> "
                f"{format_bytes(self.measured_activation_bytes)} (measured)"
            )
        if self.budget_bytes is not None:
            text += f"; budget {format_bytes(self.budget_bytes)}"
        if self.note:
            text += f". {self.note}"
        return text

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (segments included, plus the derived totals)."""
        return {
            "policy": self.policy,
            "count": self.count,
            "segments": [s.to_dict() for s in self.segments],
            "baseline_activation_bytes": self.baseline_activation_bytes,
            "measured_activation_bytes": self.measured_activation_bytes,
            "predicted_saving_bytes": self.predicted_saving_bytes,
            "budget_bytes": self.budget_bytes,
            "note": self.note,
            "measuring_peak_bytes": self.measuring_peak_bytes,
        }
