"""Byte units: parsing what users type ("16GiB") and formatting what they read.

memkit keeps bytes everywhere internally; MiB and GiB appear only at display.
"""

from __future__ import annotations

import re

__all__ = ["KiB", "MiB", "GiB", "format_bytes", "parse_bytes", "to_mib"]

KiB = 1024
MiB = 1024**2
GiB = 1024**3

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": KiB,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": MiB,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": GiB,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int | float) -> int:
    """Parse a memory size such as ``"16GiB"``, ``"512 MB"`` or ``1e9`` into bytes.

    Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB, GB, TB)
    powers of 1000, as on a GPU's data sheet. A bare number is bytes.

    Raises:
        ValueError: when the text is not a non-negative size with a known unit.
    """
    if isinstance(text, bool):
        raise ValueError(f"not a memory size: {text!r}; write e.g. 16GiB, 512MiB or 8e9")
    if isinstance(text, (int, float)):
        if text < 0:
            raise ValueError(f"a memory size cannot be negative: {text!r}")
        return int(text)
    match = _PATTERN.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"not a memory size: {text!r}; write a number with an optional unit, "
            "e.g. 16GiB, 512MiB, 80GB or 8e9 (bytes)"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def to_mib(nbytes: int | float | None) -> float | None:
    """Bytes to MiB (exact in float64 for any byte count below 2**53)."""
    return None if nbytes is None else nbytes / MiB


def format_bytes(nbytes: int | float | None) -> str:
    """``nbytes`` (bytes) as a human-readable size with a binary unit (powers of 1024), e.g.
    ``1.50 GiB``; ``-`` for ``None``."""
    if nbytes is None:
        return "-"
    value = float(nbytes)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if value >= size:
            return f"{sign}{value / size:.2f} {unit}"
    return f"{sign}{int(value)} B"
