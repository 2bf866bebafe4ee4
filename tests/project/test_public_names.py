"""The public API, listed: a refactor that moves code between modules must leave ``lightning_memkit.__all__`` and
where each name comes from (``from lightning_memkit import X``) as they are. Adding a name means adding it here."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

import lightning_memkit
from tests.helpers.paths import REPO_ROOT

PUBLIC = [
    "ActivationCheckpointing",
    "ActivationOffload",
    "AutoFit",
    "BudgetExceededError",
    "Candidate",
    "CheckpointBudget",
    "CreationRecorder",
    "DistributedEstimate",
    "DoctorReport",
    "DoctorSession",
    "LayerTrace",
    "LayerTraceResult",
    "LayerTracer",
    "LeakWatcher",
    "MaxBatchSize",
    "MemkitError",
    "MemoryBudget",
    "MemoryDoctor",
    "MemoryEstimate",
    "MemoryMeter",
    "MemoryTracker",
    "Mode",
    "Plan",
    "PlanError",
    "PlanRow",
    "RunSummary",
    "StepReading",
    "TensorAccountant",
    "TraceEvent",
    "WorstBatch",
    "apply_checkpointing",
    "compare_modes",
    "estimate_distributed_memory",
    "estimate_memory",
    "find_max_batch_size",
    "find_worst_batch",
    "format_bytes",
    "is_out_of_memory",
    "measure_training_step",
    "model_state_bytes",
    "parse_bytes",
    "parse_mode",
    "plan_fit",
    "predict_max_batch_size",
    "trace_step",
    "training_state_tensors",
]

#: the callables' parameters (names and kinds) users pass by keyword: a rename breaks their code
SIGNATURES = {
    "estimate_memory": [
        "module",
        "batch_size",
        "batch",
        "mode",
        "device",
        "optimizer",
        "loss_fn",
        "datamodule",
        "trainer",
        "gpu",
    ],
    "find_worst_batch": ["loader", "batch_size", "size_of", "max_samples"],
}


def test_the_public_names_are_these():
    assert sorted(lightning_memkit.__all__) == sorted(PUBLIC)
    assert len(set(lightning_memkit.__all__)) == len(lightning_memkit.__all__)
    for name in PUBLIC:
        assert getattr(lightning_memkit, name) is not None


def test_the_keyword_arguments_users_pass_are_these():
    for name, parameters in SIGNATURES.items():
        assert list(inspect.signature(getattr(lightning_memkit, name)).parameters) == parameters, name


def test_each_public_name_is_imported_on_first_use_from_the_home_type_checkers_read():
    """The package imports a public name from its home when it is first read (``_HOMES``); type checkers read the
    ``if TYPE_CHECKING:`` imports. Both tables, ``__all__`` and the objects' own modules agree."""
    tree = ast.parse(Path(lightning_memkit.__file__).read_text(encoding="utf-8"))
    checked = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    imported = {
        alias.name: node.module for node in checked.body if isinstance(node, ast.ImportFrom) for alias in node.names
    }
    homes = {name: module for module, names in lightning_memkit._HOMES.items() for name in names}
    assert homes == imported
    assert sorted(homes) == sorted(lightning_memkit.__all__)
    for name, module in homes.items():
        value = getattr(lightning_memkit, name)
        assert value is getattr(importlib.import_module(module), name)
        if inspect.isclass(value) or inspect.isfunction(value):
            assert value.__module__ == module, name
    assert set(lightning_memkit.__all__) <= set(dir(lightning_memkit))
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        lightning_memkit.not_a_name  # noqa: B018


def test_the_modules_mypy_holds_to_full_annotations_are_the_public_apis():
    """pyproject.toml's strict mypy override (every function fully annotated) names the three public packages and
    every module a name they export is defined in: a public name that moves takes the rule with it."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((Path(REPO_ROOT) / "pyproject.toml").read_text(encoding="utf-8"))
    strict = [o for o in config["tool"]["mypy"]["overrides"] if o.get("disallow_untyped_defs")]
    assert len(strict) == 1 and strict[0].get("disallow_incomplete_defs") is True, strict
    packages = ["lightning_memkit", "lightning_memkit.estimate", "lightning_memkit.plan"]
    defining = set(packages)
    for package in map(importlib.import_module, packages):
        for name in package.__all__:
            value = getattr(package, name)
            if inspect.isclass(value) or inspect.isfunction(value):
                defining.add(value.__module__)
    assert sorted(strict[0]["module"]) == sorted(defining)
