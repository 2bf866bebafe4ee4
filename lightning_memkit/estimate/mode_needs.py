"""What would make a step fit, computed: each mode's need at batch size 1 (:func:`mode_needs`), so that a mode is
suggested only where its estimate needs less than the mode that did not fit.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from torch import nn

from lightning_memkit.estimate.api import estimate_memory
from lightning_memkit.estimate.data.batches import NoBatchError
from lightning_memkit.estimate.step.memory_estimate import EstimateError
from lightning_memkit.estimate.step.settings import reusing_fake_copies
from lightning_memkit.modes.mode import Mode, parse_mode
from lightning_memkit.units import parse_bytes

__all__ = ["ALTERNATIVE_MODES", "ModeNeed", "mode_needs", "needing_less"]

#: the modes whose need is estimated when a step does not fit: full, mixed and true half precision, each with and
#: without activation checkpointing (a suggested bf16-true says that it rounds the weights themselves: docs/modes.md)
ALTERNATIVE_MODES = ("baseline", "bf16", "bf16-true", "checkpoint", "bf16+checkpoint", "bf16-true+checkpoint")


@dataclass
class ModeNeed:
    """What one mode needs at batch size 1 on one device (bytes), and whether that fits.

    Attributes:
        mode: the mode's name (``"bf16+checkpoint"``...).
        required_bytes: the device memory the step needs at batch size 1 (``MemoryEstimate.required_bytes``); 0 when
            the mode could not be estimated.
        peak_bytes: the tensor peak at batch size 1 (``MemoryEstimate.peak_bytes``); 0 when not estimated.
        fits: whether ``required_bytes`` is at most the memory given less the margin.
        error: why the mode could not be estimated (empty when it was).
    """

    mode: str
    required_bytes: int
    peak_bytes: int
    fits: bool
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (bytes as ints)."""
        return asdict(self)


def mode_needs(
    module: nn.Module,
    device_memory: int | str,
    *,
    modes: Iterable[str | Mode] = ALTERNATIVE_MODES,
    margin: float = 0.05,
    **estimate_kwargs: Any,
) -> list[ModeNeed]:
    """Estimate each of ``modes`` at batch size 1 and say what it needs and whether it fits ``device_memory`` with
    ``margin`` kept free, in the order given.

    ``estimate_kwargs`` are :func:`~lightning_memkit.estimate.estimate_memory`'s (``device=``, ``batch=``,
    ``datamodule=``, ``gpu=``...; not ``batch_size``, which is 1). A mode that cannot be estimated gets its error, not
    an exception; one fake copy of the module serves every mode.
    """
    if "batch_size" in estimate_kwargs:
        raise ValueError("mode_needs estimates batch size 1; leave batch_size= out")
    if not 0 <= margin < 1:
        raise ValueError(f"margin={margin!r}: give a fraction in [0, 1), e.g. 0.05 to keep 5% free")
    usable = (1 - margin) * parse_bytes(device_memory)
    needs = []
    with reusing_fake_copies():
        for mode in modes:
            parsed = parse_mode(mode)  # a bad mode is the caller's error: it raises
            try:
                estimate = estimate_memory(module, 1, mode=parsed, **estimate_kwargs)
            except (EstimateError, NoBatchError, ValueError) as error:
                needs.append(ModeNeed(parsed.name, 0, 0, False, str(error)))
                continue
            needs.append(
                ModeNeed(parsed.name, estimate.required_bytes, estimate.peak_bytes, estimate.required_bytes <= usable)
            )
    return needs


def needing_less(needs: list[ModeNeed], than_bytes: int) -> list[ModeNeed]:
    """The modes of ``needs`` that were estimated and need less than ``than_bytes`` at batch size 1, least first:
    the only ones worth suggesting instead of a mode that needs ``than_bytes``."""
    return sorted(
        (need for need in needs if not need.error and need.required_bytes < than_bytes), key=lambda n: n.required_bytes
    )
