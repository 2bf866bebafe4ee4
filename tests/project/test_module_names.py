"""No two modules of the package share a name: a name says one concept, and a reader who meets ``render`` or
``records`` knows which module is meant. ``__init__.py`` and ``_torch_compat.py`` are per package by design."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from tests.helpers.paths import REPO_ROOT

ROOT = Path(REPO_ROOT) / "lightning_memkit"

#: file names every package may have its own of
PER_PACKAGE = ("__init__.py", "__main__.py", "_torch_compat.py")


def shared_names(root: Path) -> dict[str, list[str]]:
    """Module file name -> the paths (relative to ``root``'s parent) of the modules that share it, for each name
    more than one module has."""
    paths: dict[str, list[str]] = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        if path.name not in PER_PACKAGE:
            paths[path.name].append(str(path.relative_to(root.parent)))
    return {name: found for name, found in paths.items() if len(found) > 1}


def test_the_check_finds_a_shared_name(tmp_path: Path) -> None:
    package = tmp_path / "lightning_memkit"
    for relative in ("__init__.py", "records.py", "trace/__init__.py", "trace/records.py", "trace/_torch_compat.py"):
        (package / relative).parent.mkdir(parents=True, exist_ok=True)
        (package / relative).write_text("")
    (package / "_torch_compat.py").write_text("")
    assert shared_names(package) == {"records.py": ["lightning_memkit/records.py", "lightning_memkit/trace/records.py"]}


def test_no_two_modules_of_the_package_share_a_name() -> None:
    assert len(list(ROOT.rglob("*.py"))) > 100  # the walk sees the package
    shared = shared_names(ROOT)
    assert not shared, f"rename one of each so its name says its concept: {shared}"
