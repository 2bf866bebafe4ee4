"""Helpers shared by memkit's sub-commands: loading a user's LightningModule from FILE.py:Class."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import sys
import types
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_memkit.errors import MemkitError

__all__ = ["load_object", "CliError", "build_trainer"]


class CliError(MemkitError):
    """A user error in a command's arguments; printed without a traceback, exit status 2."""


def load_object(spec: str) -> Any:
    """Load ``path/to/file.py:Name`` (or ``package.module:Name``) and return ``Name``.

    Raises:
        CliError: with what to write instead, when the spec, file or name is wrong.
    """
    if ":" not in spec:
        raise CliError(
            f"{spec!r}: write FILE.py:ClassName or package.module:ClassName, e.g. examples/models.py:MyModule"
        )
    location, name = spec.rsplit(":", 1)
    if location.endswith(".py") or os.sep in location:
        if not os.path.isfile(location):
            raise CliError(f"{location!r} does not exist; give the path of a Python file that defines {name}")
        module = _import_file(location)
    else:
        try:
            module = importlib.import_module(location)
        except SyntaxError as error:
            raise CliError(f"{error.filename}, line {error.lineno}: {error.msg}; fix the file and run again") from None
        except ImportError as error:
            raise CliError(
                f"cannot import {location!r} ({error}); give FILE.py:ClassName or an importable module"
            ) from error
    if not hasattr(module, name):
        classes = sorted(
            n
            for n, v in vars(module).items()
            if not n.startswith("_") and isinstance(v, type) and v.__module__ == module.__name__
        )
        if classes:
            raise CliError(f"{location!r} has no {name!r}; the classes it defines are: {', '.join(classes)}")
        available = sorted(n for n in dir(module) if not n.startswith("_"))
        raise CliError(f"{location!r} has no {name!r}; it defines: {', '.join(available)}")
    return getattr(module, name)


def _import_file(location: str) -> types.ModuleType:
    """The module of the Python file at ``location``; a :class:`CliError` when it cannot be imported."""
    stem = os.path.splitext(os.path.basename(location))[0]
    # The file's directory stays importable for the whole run, as under `python FILE.py`:
    # a train_dataloader() often imports a sibling module only when it is called. A file inside a
    # package is imported as package.module from the package's root instead, as under `python -m`:
    # the package's own directory on sys.path would let its subpackages shadow top-level libraries
    # (lightning_memkit/tensorboard/ hid the real tensorboard from Lightning's TensorBoardLogger).
    directory = os.path.dirname(os.path.abspath(location))
    parts = [stem]
    while os.path.isfile(os.path.join(directory, "__init__.py")):
        directory, package = os.path.split(directory)
        parts.insert(0, package)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    try:
        if len(parts) > 1:
            module = importlib.import_module(".".join(parts))
            if os.path.realpath(getattr(module, "__file__", None) or "") == os.path.realpath(location):
                return module
            # an installed package of the same name: load the file given
        module_name = "_memkit_user_" + stem
        module_spec = importlib.util.spec_from_file_location(module_name, location)
        if module_spec is None or module_spec.loader is None:
            raise CliError(f"{location}: Python cannot load this file as a module; give a .py file")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        module_spec.loader.exec_module(module)
        return module
    except SyntaxError as error:
        raise CliError(f"{error.filename}, line {error.lineno}: {error.msg}; fix the file and run again") from None
    except ImportError as error:
        raise CliError(
            f"importing {location} failed: {error}; install the missing package in this environment or fix the import"
        ) from None


def add_init_arguments(parser: Any, datamodule: bool = True) -> None:
    """The options every verb that builds a user's classes shares: --init-args and, optionally,
    --datamodule and --datamodule-args."""
    parser.add_argument(
        "--init-args",
        default="{}",
        metavar="JSON",
        help="JSON keyword arguments for the module class, e.g. '{\"hidden\": 512}' (default: none)",
    )
    if datamodule:
        parser.add_argument(
            "--datamodule",
            metavar="FILE.py:DataModuleClass",
            default=None,
            help="a LightningDataModule class to take the data from (default: the module's own dataloaders)",
        )
        parser.add_argument(
            "--datamodule-args",
            default="{}",
            metavar="JSON",
            help="JSON keyword arguments for the datamodule class (default: none)",
        )


def json_object(text: str, flag: str) -> dict:
    """Parse a JSON object of keyword arguments given to ``flag``.

    Raises:
        CliError: with an example, when the text is not a JSON object.
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise CliError(f"{flag}: not JSON ({error}); write e.g. '{{\"batch_size\": 32}}'") from error
    if not isinstance(value, dict):
        raise CliError(f"{flag}: give a JSON object of keyword arguments, e.g. '{{\"batch_size\": 32}}'")
    return value


def build_instance(cls: Any, init_args: dict, batch_size: int | None = None, what: str = "module") -> Any:
    """``cls(**init_args)``, with ``batch_size`` passed as ``batch_size=`` when ``cls`` takes it,
    else set as the instance's ``batch_size`` attribute.

    Raises:
        CliError: when ``cls`` is not a class, cannot be built from ``init_args``, or has no place
            for the batch size.
    """
    if not isinstance(cls, type):
        raise CliError(f"the {what} {cls!r} is not a class; give FILE.py:ClassName")
    if what == "datamodule":
        if issubclass(cls, pl.LightningModule):
            raise CliError(
                f"--datamodule {cls.__name__}: that is a LightningModule, not a LightningDataModule; give the module "
                "as the first argument (FILE.py:ModuleClass) and a LightningDataModule class to --datamodule, "
                "or leave --datamodule out to use the module's own dataloaders"
            )
        if not callable(getattr(cls, "train_dataloader", None)):
            raise CliError(
                f"--datamodule {cls.__name__}: it has no train_dataloader(); give a LightningDataModule class"
            )
    try:
        accepts = "batch_size" in inspect.signature(cls).parameters
    except (TypeError, ValueError):
        accepts = False
    arguments = dict(init_args)
    if batch_size is not None and accepts:
        arguments["batch_size"] = batch_size
    try:
        instance = cls(**arguments)
    except TypeError as error:
        raise CliError(
            f"cannot build the {what} {cls.__name__}(**{arguments}) ({error}); "
            "give its arguments defaults or pass them with --init-args / --datamodule-args"
        ) from error
    if batch_size is not None and not accepts:
        if not hasattr(instance, "batch_size"):
            if what == "datamodule":
                raise CliError(
                    f"the datamodule {cls.__name__} has no batch_size argument or attribute; drop --batch-size "
                    "and pass its own size argument in --datamodule-args, e.g. '{\"bs\": 8}'"
                )
            raise CliError(
                f"the {what} {cls.__name__} has no batch_size argument or attribute; drop --batch-size, "
                "or pass the size in --init-args"
            )
        instance.batch_size = batch_size
    return instance


def build_module_and_datamodule(cls: Any, args: Any) -> tuple[Any, Any]:
    """The module ``cls`` built from ``--init-args`` and, when ``--datamodule`` is given, the datamodule built from
    ``--datamodule-args``; ``--batch-size`` goes to the datamodule when there is one, else to the module."""
    module = build_instance(
        cls, json_object(args.init_args, "--init-args"), None if args.datamodule else args.batch_size, "module"
    )
    if not args.datamodule:
        return module, None
    datamodule = build_instance(
        load_object(args.datamodule),
        json_object(args.datamodule_args, "--datamodule-args"),
        args.batch_size,
        "datamodule",
    )
    return module, datamodule


def build_trainer(**options: Any) -> Any:
    """``lightning.pytorch.Trainer(**options)``.

    Raises:
        CliError: when Lightning rejects a setting the user gave (an accelerator this machine does not
            have, an unknown precision), with Lightning's reason and what to try instead.
    """
    try:
        return pl.Trainer(**options)
    except (MisconfigurationException, ValueError) as error:
        given = ", ".join(
            f"--{key} {options[key]}" for key in ("accelerator", "precision") if options.get(key) is not None
        )
        hint = "--accelerator cpu" + (
            " or --precision 32-true / bf16-mixed" if options.get("precision") is not None else " (or auto)"
        )
        raise CliError(f"Lightning cannot train with {given}: {error} Try {hint}.") from None
