"""Whether code is the user's or a library's: torch, Lightning, memkit, the standard library, installed packages.

One definition for every place that names "the user's line" (the doctor's recorder, holders and keepers).
"""

from __future__ import annotations

import os
import sysconfig
from typing import Any

__all__ = [
    "LIBRARY_PACKAGES",
    "LIBRARY_ROOTS",
    "LIGHTNING_ROOTS",
    "is_library_file",
    "is_installed_file",
    "is_user_file",
    "is_library_code",
    "is_user_code",
    "is_lightning_code",
]

#: the packages whose code is never the user's, wherever they are installed
LIBRARY_PACKAGES = (
    "torch",
    "lightning",
    "lightning_fabric",
    "lightning_utilities",
    "pytorch_lightning",
    "torchmetrics",
    "lightning_memkit",
    "typing_extensions",
)


def _package_roots(names: tuple[str, ...]) -> set[str]:
    """The directories of the importable packages ``names`` (real and as-given paths, each ending in a separator)."""
    roots = set()
    for name in names:
        try:
            module = __import__(name)
        except ImportError:
            continue
        path = getattr(module, "__file__", None)
        if path:
            roots.add(os.path.dirname(os.path.realpath(path)) + os.sep)
            roots.add(os.path.dirname(os.path.abspath(path)) + os.sep)
    return roots


def _library_roots() -> tuple[str, ...]:
    roots = _package_roots(LIBRARY_PACKAGES)
    for key in ("stdlib", "platstdlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            roots.add(os.path.realpath(path) + os.sep)
            roots.add(os.path.abspath(path) + os.sep)
    return tuple(sorted(roots))


# Found once, at import: the checks run inside dispatch modes and trace functions, where importing is not safe.
#: the directories of :data:`LIBRARY_PACKAGES` and of the standard library
LIBRARY_ROOTS = _library_roots()
#: the directories of Lightning's packages
LIGHTNING_ROOTS = tuple(sorted(_package_roots(("lightning", "pytorch_lightning", "lightning_fabric"))))


def is_library_file(filename: str) -> bool:
    """Whether ``filename`` is generated code (``<string>``) or under :data:`LIBRARY_ROOTS`."""
    return (
        filename.startswith("<")
        or filename.startswith(LIBRARY_ROOTS)
        or os.path.abspath(filename).startswith(LIBRARY_ROOTS)
    )


def is_installed_file(filename: str) -> bool:
    """Whether ``filename`` is in an installed package (``site-packages``, ``dist-packages``)."""
    return os.sep + "site-packages" + os.sep in filename or os.sep + "dist-packages" + os.sep in filename


def is_user_file(filename: str) -> bool:
    """Whether ``filename`` is the user's own: neither a library's (:func:`is_library_file`) nor an installed
    package's (:func:`is_installed_file`)."""
    return not is_library_file(filename) and not is_installed_file(filename)


_LIBRARY_CODE: dict[Any, bool] = {}
_USER_CODE: dict[Any, bool] = {}
_LIGHTNING_CODE: dict[Any, bool] = {}


def is_library_code(code: Any) -> bool:
    """:func:`is_library_file` of a code object's file, cached per code object (a few microseconds per call).

    Code of another installed package (transformers, timm) is not library code here: the doctor's recorder names
    the line there that made a tensor."""
    found = _LIBRARY_CODE.get(code)
    if found is None:
        found = _LIBRARY_CODE[code] = is_library_file(code.co_filename)
    return found


def is_user_code(code: Any) -> bool:
    """:func:`is_user_file` of a code object's file, cached per code object."""
    found = _USER_CODE.get(code)
    if found is None:
        found = _USER_CODE[code] = not is_library_code(code) and not is_installed_file(code.co_filename)
    return found


def is_lightning_code(code: Any) -> bool:
    """Whether a code object is Lightning's (under :data:`LIGHTNING_ROOTS`), cached per code object."""
    found = _LIGHTNING_CODE.get(code)
    if found is None:
        found = _LIGHTNING_CODE[code] = code.co_filename.startswith(LIGHTNING_ROOTS)
    return found
