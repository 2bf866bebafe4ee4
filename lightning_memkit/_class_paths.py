"""Class paths as a YAML config or a command line gives them (``"torch.nn.TransformerEncoderLayer"``),
resolved by import: plain Python, shared by the checkpointing policy and LayerTrace's module filters."""

from __future__ import annotations

import importlib
import importlib.util

__all__ = ["resolve_class_path"]


def resolve_class_path(path_text: str, strict: bool = False) -> type | None:
    """The class a dotted path names (``"torch.nn.TransformerEncoderLayer"``), imported; ``None`` when
    ``path_text`` does not look like a class path (no dot, a wildcard, a last part that does not start with
    an upper-case letter) or, unless ``strict``, its top-level package is not installed. Raises
    ``ValueError`` when it looks like one but the package (``strict``), module or class cannot be found."""
    candidate = path_text.strip()
    if "." not in candidate or any(c in candidate for c in "*?[] /") or not candidate.rsplit(".", 1)[1][:1].isupper():
        return None
    module_name, class_name = candidate.rsplit(".", 1)
    if importlib.util.find_spec(module_name.split(".")[0]) is None:
        if strict:
            raise ValueError(f"class path {path_text!r}: no package {module_name.split('.')[0]!r} is installed")
        return None
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"class path {path_text!r}: cannot import {module_name!r} ({error})") from None
    found = getattr(module, class_name, None)
    if not isinstance(found, type):
        raise ValueError(f"class path {path_text!r}: {module_name!r} has no class {class_name!r}")
    return found
