"""The torch releases lightning-memkit supports, checked when the package is imported (first thing).

memkit reads private torch internals (fake tensors, dispatch modes, saved-tensor bindings; see the
``_torch_compat`` modules); below :data:`MINIMUM_TORCH` they differ, and the suite fails there (docs/versions.md).
"""

from __future__ import annotations

import re

import torch

__all__ = ["MINIMUM_TORCH", "SUPPORTED_RANGE", "check_torch_version"]

#: The lowest torch (major, minor) the whole test suite passes on (docs/versions.md gives the runs).
MINIMUM_TORCH = (2, 11)
#: The supported range as pip writes it (also ``pyproject.toml``'s dependency).
SUPPORTED_RANGE = f"torch>={MINIMUM_TORCH[0]}.{MINIMUM_TORCH[1]}"


def check_torch_version(version: str) -> None:
    """Raise ``ImportError`` (one line, naming the supported range) when the torch ``version`` string
    (``torch.__version__``, e.g. ``"2.8.0+cu128"``) is below :data:`MINIMUM_TORCH`. A version that cannot be
    read (a source build's odd string) is let through."""
    found = re.match(r"(\d+)\.(\d+)", str(version))
    if found is None:
        return
    if (int(found.group(1)), int(found.group(2))) < MINIMUM_TORCH:
        raise ImportError(
            f"lightning-memkit supports {SUPPORTED_RANGE}; this is torch {version}: "
            f"pip install '{SUPPORTED_RANGE}' (the build for your CUDA)"
        )


check_torch_version(torch.__version__)  # on import, before any module reads torch's internals
