"""The tests are grouped like the package: a test file sits in ``tests/<package>/`` (or ``tests/<package>/<sub>/``)
beside the code it checks, or in one of the groups that hold more than one package (:data:`CROSS_CUTTING`); every
group is a Python package, so test modules import by their full names and two of them may share a file name; what
tests share is imported from ``tests.helpers``, never from ``conftest``, which holds fixtures and hooks only.

Read from the tree and the sources with ``ast``: a new flat ``tests/test_x.py``, a group with no package of that name
or a ``from conftest import`` fails here with the place to put it.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.paths import REPO_ROOT

TESTS = Path(REPO_ROOT) / "tests"
PACKAGE = Path(REPO_ROOT) / "lightning_memkit"
#: groups of tests whose subject is more than one package: name -> what they hold
CROSS_CUTTING = {
    "core": "the package's top-level modules (meter, timing, units, errors)",
    "compat": "the pinned private torch and Lightning internals and the supported torch range",
    "project": "the project as a whole: public API, import layers, module names, docs site, README, examples",
    "gpu": "the GPU lane (`cuda` marker) and the CUDA paths' logic on CPU",
}
#: directories under tests/ that hold no tests: shared code and recorded data
NOT_GROUPS = {"helpers", "data"}


def _test_files() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def test_every_test_file_sits_in_a_group_named_after_a_package_or_a_cross_cutting_group():
    files = _test_files()
    assert len(files) > 80  # the walk sees the suite
    flat = [path.name for path in files if path.parent == TESTS]
    assert not flat, (
        f"test files directly under tests/: {flat}; move each into tests/<package>/ (or {sorted(CROSS_CUTTING)})"
    )
    wrong = []
    for path in files:
        group = path.parent.relative_to(TESTS)
        if group.parts[0] in NOT_GROUPS:
            wrong.append(f"{path.relative_to(TESTS)} (tests/{group.parts[0]}/ holds no tests)")
        elif group.parts[0] in CROSS_CUTTING:
            if len(group.parts) > 1:
                wrong.append(f"{path.relative_to(TESTS)} (a cross-cutting group has no subgroups)")
        elif not (PACKAGE / group / "__init__.py").is_file():
            wrong.append(f"{path.relative_to(TESTS)} (lightning_memkit/{group.as_posix()}/ is not a package)")
    assert not wrong, "test files outside the package's groups: " + "; ".join(wrong)


def test_every_group_and_the_helpers_are_packages():
    directories = {path.parent for path in TESTS.rglob("*.py") if path.relative_to(TESTS).parts[0] != "data"}
    missing = sorted(str(d.relative_to(REPO_ROOT)) for d in directories if not (d / "__init__.py").is_file())
    assert not missing, f"directories of test code without __init__.py: {missing}"


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_no_test_imports_conftest():
    importing = sorted(
        str(path.relative_to(REPO_ROOT))
        for path in TESTS.rglob("*.py")
        if {"conftest", "tests.conftest"} & _imported_modules(path)
    )
    assert not importing, (
        f"{importing} import conftest; import what they share from tests.helpers, or take it as a fixture"
    )
