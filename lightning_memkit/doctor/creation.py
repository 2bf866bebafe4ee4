"""The record of one storage: who made it (op, module, phase, the user's line), when, its role and its last use.

Plain data the recorder fills and the leak, liveness and holder reports read; JSON-ready.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from lightning_memkit.doctor.frames import format_frame

__all__ = ["STATE_ROLES", "Creation"]

#: Roles a storage keeps for its whole life: training state, never a leak nor waste.
STATE_ROLES = ("parameters", "buffers", "gradients", "optimizer_state")


@dataclass(eq=False)
class Creation:
    """Where and when one storage was made, and (when liveness is recorded) its last use.

    Attributes:
        nbytes: the storage's size in bytes.
        device: e.g. ``"cpu"``, ``"cuda:0"``.
        shape: the shape of the first tensor seen on the storage (its creating op's output).
        dtype: e.g. ``"torch.float32"``.
        op: the aten op that allocated it (``"aten.addmm"``), or how it was first seen for storages
            made outside the recording (``"existing"``).
        module: the path of the innermost module whose forward was running (``"net.0"``; the root
            module is its class name; ``""`` outside every module forward).
        phase: ``"forward"`` (inside a module's forward), ``"backward"`` (in autograd's backward) or
            ``"other"`` (the loss, the optimizer, hooks).
        frame: ``(filename, line, function)`` of the user's code that ran the op, or ``None``.
        step: the training step it was made in (or, for a batch, the step it is the input of).
        role: a lifetime role: ``"parameters"``, ``"buffers"``, ``"gradients"``,
            ``"optimizer_state"``, ``"inputs"``, or ``None``.
        created_at: the recorder's op clock when it was made (``-1``: before the recording).
        freed_at: the op clock when torch freed it (``None`` while it lives).
        last_use_at: op clock of the last op that read it while liveness was recorded
            (its creation when never read).
        last_use_op, last_use_module, last_use_phase, last_use_frame: that op, like the fields above.
        before_run: alive before the recording began (a dataset's tensors, a pre-built batch; see
            :meth:`CreationRecorder.know_existing`): never memory a step added.
        kept_at: ``((filename, line, function), ...)`` the user's statements that stored it in a list, a dict
            or an attribute (``self.kept.append(x)``), in the order first seen, at most 4
            (:class:`~lightning_memkit.doctor.keepers.KeepTracer`; empty when none was seen).
    """

    nbytes: int
    device: str
    shape: tuple
    dtype: str
    op: str
    module: str
    phase: str
    frame: tuple | None
    step: int | None
    role: str | None = None
    created_at: int = -1
    freed_at: int | None = None
    last_use_at: int = -1
    last_use_op: str = ""
    last_use_module: str = ""
    last_use_phase: str = ""
    last_use_frame: tuple | None = None
    before_run: bool = False
    kept_at: tuple = ()

    def describe(self) -> str:
        """One line: op, module, shape, dtype and the user's line."""
        where = f" in {self.module}" if self.module else ""
        line = format_frame(self.frame)
        return f"{self.op}{where} ({self.phase}) {list(self.shape)} {self.dtype.replace('torch.', '')}" + (
            f" at {line}" if line else ""
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        data = asdict(self)
        data["shape"] = list(self.shape)
        return data
