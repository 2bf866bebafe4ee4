"""A training memory mode: precision, activation checkpointing and activation offload as one value, parsed from
a string.

``parse_mode("amp+checkpoint:auto")`` gives a :class:`Mode`; ``mode.trainer_kwargs("cpu")`` gives the
Trainer arguments for it, and ``mode.autocast("cpu")`` / ``apply_checkpointing`` apply it to a plain module.
The precisions are Lightning's: full (``32-true``), mixed (``bf16-mixed``, ``16-mixed``: autocast over fp32
weights) and true half (``bf16-true``, ``16-true``: the weights, gradients, optimizer state and floating-point
inputs themselves in half precision, no autocast).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from lightning_memkit.modes.checkpoint_policy import describe_policy, normalize_policy
from lightning_memkit.modes.devices import DeviceLike
from lightning_memkit.modes.devices import device_type as _device_type

__all__ = [
    "Mode",
    "ModeLike",
    "parse_mode",
    "parse_modes",
    "resolve_precision",
    "PRECISION_WORDS",
    "CHECKPOINT_WORDS",
    "OFFLOAD_WORD",
    "MODE_WORDS",
    "PRECISIONS",
    "TRUE_HALF_PRECISIONS",
]

#: precision words -> the precision they ask for ("amp" is resolved per device by :func:`resolve_precision`).
PRECISION_WORDS: dict[str, str | None] = {
    "baseline": None,
    "fp32": None,
    "amp": "amp",
    "bf16": "bf16-mixed",
    "bf16-mixed": "bf16-mixed",
    "fp16": "16-mixed",
    "16-mixed": "16-mixed",
    "bf16-true": "bf16-true",
    "fp16-true": "16-true",
    "16-true": "16-true",
}
#: Lightning's true half precisions: the module converted to the half dtype, no autocast, no GradScaler.
TRUE_HALF_PRECISIONS = ("bf16-true", "16-true")
#: the values :attr:`Mode.precision` takes (``None`` is full precision; ``"amp"`` is resolved per device).
PRECISIONS = (None, "amp", "bf16-mixed", "16-mixed", *TRUE_HALF_PRECISIONS)
#: checkpoint words (``checkpoint`` means ``checkpoint:auto``; ``budget=`` takes a fraction in (0, 1] or a size with
#: a unit).
CHECKPOINT_WORDS = ("checkpoint", "checkpoint:auto", "checkpoint:budget=FRACTION", "checkpoint:budget=SIZE")
#: the offload word: saved activations to pinned host memory (CUDA only, see :mod:`lightning_memkit.modes.offload`).
OFFLOAD_WORD = "offload"
#: every word a mode string may combine with ``+``.
MODE_WORDS = tuple(PRECISION_WORDS) + CHECKPOINT_WORDS + (OFFLOAD_WORD,)

_LIGHTNING_PRECISION = {
    None: "32-true",
    "bf16-mixed": "bf16-mixed",
    "16-mixed": "16-mixed",
    "bf16-true": "bf16-true",
    "16-true": "16-true",
}
_AUTOCAST_DTYPE: dict[str | None, torch.dtype] = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
_TRUE_HALF_DTYPE: dict[str | None, torch.dtype] = {"bf16-true": torch.bfloat16, "16-true": torch.float16}
_NAMES = {"amp": "amp", "bf16-mixed": "bf16", "16-mixed": "fp16", "bf16-true": "bf16-true", "16-true": "fp16-true"}
_PRECISION_CHOICES = "None, 'amp', 'bf16-mixed', '16-mixed', 'bf16-true' or '16-true'"


def resolve_precision(precision: str | None, device: DeviceLike) -> str | None:
    """The concrete precision for ``device``: ``None`` (full precision), ``"bf16-mixed"``, ``"16-mixed"``,
    ``"bf16-true"`` or ``"16-true"``.

    ``"amp"`` is ``"16-mixed"`` on CUDA (and MPS) and ``"bf16-mixed"`` elsewhere (CPU). ``"16-mixed"``
    on CPU falls back to ``"bf16-mixed"`` with a warning, exactly as Lightning's Trainer does. The true half
    precisions are the same on every device (Lightning's Trainer runs ``"16-true"`` on CPU as asked).
    """
    device_type = _device_type(device)
    if precision == "amp":
        return "16-mixed" if device_type in ("cuda", "mps") else "bf16-mixed"
    if precision == "16-mixed" and device_type == "cpu":
        warnings.warn(
            "memkit: fp16 mixed precision is not supported on CPU; using bf16-mixed instead (as Lightning does)",
            stacklevel=3,
        )
        return "bf16-mixed"
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose {_PRECISION_CHOICES}")
    return precision


@dataclass(frozen=True)
class Mode:
    """One way to train the same module: a precision, an activation-checkpointing policy and activation offload.

    Attributes:
        precision: ``None`` (full fp32), ``"amp"`` (``16-mixed`` on CUDA, ``bf16-mixed`` on CPU, see
            :func:`resolve_precision`), ``"bf16-mixed"`` or ``"16-mixed"`` (autocast over fp32 weights), or
            ``"bf16-true"`` or ``"16-true"`` (true half precision: the module's floating-point parameters and
            buffers and the batch's floating-point tensors converted to the half dtype, as Lightning's
            ``HalfPrecision`` plugin does; no autocast, no GradScaler).
        checkpoint: ``None`` (no checkpointing) or a policy for
            :func:`~lightning_memkit.modes.checkpointing.apply_checkpointing`: ``"auto"``, a frozenset of
            module classes, a callable ``(name, module) -> bool`` or a
            :class:`~lightning_memkit.modes.checkpoint_policy.CheckpointBudget`.
        offload: ``True`` to move what autograd saves to pinned host memory during the forward (torch's
            ``save_on_cpu``; CUDA only: refused on CPU, see :mod:`lightning_memkit.modes.offload`).
        name: the label used in tables, CSV and TensorBoard run names (default: built from the parts,
            e.g. ``"amp+checkpoint"``).

    Usage::

        mode = parse_mode("amp+checkpoint")
        trainer = Trainer(max_steps=100, **mode.trainer_kwargs("cpu"))      # Lightning
        handle = apply_checkpointing(model, mode.checkpoint)                 # plain PyTorch
        with mode.autocast("cpu"):
            loss = model(x).sum()
    """

    precision: str | None = None
    checkpoint: Any = None
    name: str = ""
    offload: bool = False

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"Mode(precision={self.precision!r}): choose {_PRECISION_CHOICES}")
        if self.checkpoint is not None:
            object.__setattr__(self, "checkpoint", normalize_policy(self.checkpoint))
        if not isinstance(self.offload, bool):
            raise ValueError(f"Mode(offload={self.offload!r}): give True or False (a bool)")
        if not self.name:
            object.__setattr__(self, "name", self._default_name())

    def _default_name(self) -> str:
        parts = []
        if self.precision is not None:
            parts.append(_NAMES[self.precision])
        if self.checkpoint is not None:
            parts.append(
                "checkpoint" if self.checkpoint == "auto" else f"checkpoint:{describe_policy(self.checkpoint)}"
            )
        if self.offload:
            parts.append(OFFLOAD_WORD)
        return "+".join(parts) or "baseline"

    @property
    def is_baseline(self) -> bool:
        """Whether the mode changes nothing (full precision, no checkpointing, no offload)."""
        return self.precision is None and self.checkpoint is None and not self.offload

    @property
    def is_true_half(self) -> bool:
        """Whether the mode trains in true half precision (``bf16-true``/``16-true``: no fp32 master weights)."""
        return self.precision in TRUE_HALF_PRECISIONS

    def precision_for(self, device: DeviceLike) -> str | None:
        """The concrete precision on ``device`` (``None`` for full precision); see :func:`resolve_precision`."""
        return resolve_precision(self.precision, device)

    def autocast_dtype(self, device: DeviceLike) -> torch.dtype | None:
        """The autocast dtype on ``device`` (``torch.bfloat16``/``torch.float16``), or ``None`` for fp32 and for
        true half precision (which has no autocast)."""
        return _AUTOCAST_DTYPE.get(self.precision_for(device))

    def true_half_dtype(self) -> torch.dtype | None:
        """The dtype a true half precision converts the module and the batch's floating-point tensors to
        (``torch.bfloat16`` for ``bf16-true``, ``torch.float16`` for ``16-true``), else ``None``."""
        return _TRUE_HALF_DTYPE.get(self.precision)

    def autocast(self, device_type: DeviceLike = "cpu") -> AbstractContextManager[Any]:
        """``torch.autocast(device_type, dtype)`` for this mode's precision, or a no-op context for fp32.

        For plain PyTorch loops; under a Trainer use :meth:`trainer_kwargs`, which lets Lightning's
        own precision plugin do the same. True half precision has no autocast (a no-op context): convert the
        module and the batch's floating-point tensors with ``.to(mode.true_half_dtype())`` instead.
        """
        dtype = self.autocast_dtype(device_type)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=_device_type(device_type), dtype=dtype)

    def trainer_kwargs(self, accelerator: DeviceLike = "auto", **callback_kwargs: Any) -> dict[str, Any]:
        """Keyword arguments for ``lightning.pytorch.Trainer`` that train in this mode.

        Returns ``{"precision": ..., "callbacks": [...]}``: the Lightning precision flag (``"32-true"``,
        ``"bf16-mixed"`` or ``"16-mixed"``, so Lightning's own ``MixedPrecision`` plugin does the
        autocast and, for fp16, the gradient scaling; ``"bf16-true"`` or ``"16-true"``, so its
        ``HalfPrecision`` plugin converts the module and the inputs) and an
        :class:`~lightning_memkit.callbacks.activation_checkpointing.ActivationCheckpointing` callback
        when the mode checkpoints (``callback_kwargs`` are passed to it), and an
        :class:`~lightning_memkit.callbacks.activation_offload.ActivationOffload` callback when it offloads
        (it refuses a CPU run at fit start). Merge ``callbacks`` with your own.
        ``accelerator`` (``"auto"``, ``"cpu"``, ``"gpu"`` or a device) decides what ``"amp"`` means there
        (see :meth:`precision_for`).
        """
        kwargs: dict[str, Any] = {"precision": _LIGHTNING_PRECISION[self.precision_for(accelerator)], "callbacks": []}
        if self.checkpoint is not None:
            # deferred: a cycle (the callbacks import lightning_memkit.modes) and a lower layer's one allowed edge up
            from lightning_memkit.callbacks.activation_checkpointing import ActivationCheckpointing

            kwargs["callbacks"].append(ActivationCheckpointing(policy=self.checkpoint, **callback_kwargs))
        if self.offload:
            from lightning_memkit.callbacks.activation_offload import ActivationOffload  # deferred: as above

            kwargs["callbacks"].append(ActivationOffload(verbose=callback_kwargs.get("verbose", True)))
        return kwargs

    def with_name(self, name: str) -> Mode:
        """A copy with another display name."""
        return dataclasses.replace(self, name=name)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description: name, precision word and checkpoint policy description (and
        ``"offload": True`` when the mode offloads)."""
        data: dict[str, Any] = {
            "name": self.name,
            "precision": self.precision,
            "checkpoint": None if self.checkpoint is None else describe_policy(self.checkpoint),
        }
        if self.offload:
            data["offload"] = True
        return data


#: a ``mode=`` argument: a :class:`Mode`, a mode string (``"bf16"``, ``"amp+checkpoint"``: see :func:`parse_mode`), or
#: ``None`` (full precision, nothing checkpointed)
ModeLike = Mode | str | None


def _parse_checkpoint_word(word: str, text: str) -> Any:
    if word == "checkpoint":
        return "auto"
    argument = word[len("checkpoint:") :]
    if argument == "auto":
        return "auto"
    if argument.startswith("budget="):
        try:
            return normalize_policy(argument)  # the one parser of budget strings
        except ValueError:
            raise ValueError(
                f"mode {text!r}: bad budget {argument[len('budget=') :]!r}; write checkpoint:budget=0.5 (a fraction of "
                "the baseline activation memory, 0 < f <= 1) or checkpoint:budget=512MiB (a size with a "
                "unit); a bare number above 1 is ambiguous"
            ) from None
    raise ValueError(
        f"mode {text!r}: unknown checkpoint policy {argument!r}; choose from: {', '.join(CHECKPOINT_WORDS)}"
    )


def parse_mode(text: str | Mode) -> Mode:
    """Parse a mode string such as ``"baseline"``, ``"amp"``, ``"bf16+checkpoint"`` or ``"checkpoint:budget=0.5"``.

    Words are joined with ``+``: at most one precision word (``baseline``/``fp32``, ``amp``, ``bf16``,
    ``fp16``, or true half precision ``bf16-true``, ``fp16-true``; Lightning's ``bf16-mixed``, ``16-mixed``,
    ``16-true`` too) and at most one checkpoint word (``checkpoint`` = ``checkpoint:auto``,
    ``checkpoint:budget=0.5`` for a fraction of the baseline activation memory,
    ``checkpoint:budget=512MiB`` for a size) and ``offload`` (saved activations to pinned host memory, CUDA
    only). The mode's name is the text as written.

    Raises:
        ValueError: naming the bad word and listing the valid ones.
    """
    if isinstance(text, Mode):
        return text
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"not a mode: {text!r}; write e.g. baseline, amp, checkpoint or amp+checkpoint")
    cleaned = text.strip().lower()
    precision: str | None = None
    checkpoint: Any = None
    seen_precision = seen_checkpoint = offload = False
    for word in (w.strip() for w in cleaned.split("+")):
        if word in PRECISION_WORDS:
            if seen_precision:
                raise ValueError(f"mode {text!r} names two precisions; use one of: {', '.join(PRECISION_WORDS)}")
            precision, seen_precision = PRECISION_WORDS[word], True
        elif word == "checkpoint" or word.startswith("checkpoint:"):
            if seen_checkpoint:
                raise ValueError(f"mode {text!r} names checkpointing twice; use one of: {', '.join(CHECKPOINT_WORDS)}")
            checkpoint, seen_checkpoint = _parse_checkpoint_word(word, text), True
        elif word == OFFLOAD_WORD:
            if offload:
                raise ValueError(f"mode {text!r} names offload twice; give it once")
            offload = True
        else:
            raise ValueError(
                f"unknown mode word {word!r} in {text!r}; valid words (join with '+'): {', '.join(MODE_WORDS)}"
            )
    return Mode(precision=precision, checkpoint=checkpoint, name=cleaned, offload=offload)


def parse_modes(text: str | Sequence[str | Mode]) -> list[Mode]:
    """Parse a comma-separated list (``"baseline,amp,checkpoint"``) or a list of mode strings.

    Raises:
        ValueError: for an empty list, a bad mode, or two modes with the same name.
    """
    items: list[str | Mode] = list(text.split(",")) if isinstance(text, str) else list(text)
    modes = [parse_mode(t) for t in items if not (isinstance(t, str) and not t.strip())]
    if not modes:
        raise ValueError(f"no modes in {text!r}; write e.g. baseline,amp,checkpoint,amp+checkpoint")
    names = [m.name for m in modes]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"modes named twice: {', '.join(duplicates)}; give each mode once")
    return modes
