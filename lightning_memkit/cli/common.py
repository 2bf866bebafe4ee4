"""Helpers shared by memkit's sub-commands: loading a user's LightningModule from FILE.py:Class."""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

__all__ = ["load_object", "CliError"]


class CliError(Exception):
    """A user error in a command's arguments; printed without a traceback, exit status 2."""


def load_object(spec: str) -> Any:
    """Load ``path/to/file.py:Name`` (or ``package.module:Name``) and return ``Name``.

    Raises:
        CliError: with what to write instead, when the spec, file or name is wrong.
    """
    if ":" not in spec:
        raise CliError(f"{spec!r}: write FILE.py:ClassName or package.module:ClassName, e.g. examples/models.py:MyModule")
    location, name = spec.rsplit(":", 1)
    if location.endswith(".py") or os.sep in location:
        if not os.path.isfile(location):
            raise CliError(f"{location!r} does not exist; give the path of a Python file that defines {name}")
        module_name = "_memkit_user_" + os.path.splitext(os.path.basename(location))[0]
        module_spec = importlib.util.spec_from_file_location(module_name, location)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        sys.path.insert(0, os.path.dirname(os.path.abspath(location)))
        try:
            module_spec.loader.exec_module(module)
        finally:
            sys.path.pop(0)
    else:
        try:
            module = importlib.import_module(location)
        except ImportError as error:
            raise CliError(f"cannot import {location!r} ({error}); give FILE.py:ClassName or an importable module") from error
    if not hasattr(module, name):
        available = sorted(n for n in dir(module) if not n.startswith("_"))
        raise CliError(f"{location!r} has no {name!r}; it defines: {', '.join(available)}")
    return getattr(module, name)
