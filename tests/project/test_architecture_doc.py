"""docs/architecture.md matches the tree: every package (and top-level module) its map names exists, and every package
that exists is named, so the map a newcomer reads first cannot drift from the code."""

from __future__ import annotations

import re
from pathlib import Path

import lightning_memkit
from tests.helpers.paths import REPO_ROOT

ROOT = Path(REPO_ROOT)
PACKAGE = Path(lightning_memkit.__file__).parent


def _map() -> str:
    """The code block of docs/architecture.md that draws ``lightning_memkit/``."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```\n(lightning_memkit/\n.*?)```", text, flags=re.S)
    assert len(blocks) == 1, (
        "docs/architecture.md draws the package's tree in one code block starting `lightning_memkit/`"
    )
    return blocks[0]


def _named() -> tuple[set[str], set[str]]:
    """The packages (``name/``) and modules (``name.py``) the map names at the start of its entries."""
    packages, modules = set(), set()
    for line in _map().splitlines()[1:]:
        match = re.match(r"^  (\S+)", line)
        if not match:
            continue
        name = match.group(1)
        if name.endswith("/"):
            packages.add(name.rstrip("/"))
        elif name.endswith(".py"):
            modules.add(name)
    return packages, modules


def test_every_package_the_architecture_map_names_exists_and_every_package_is_named():
    packages, modules = _named()
    existing = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    assert packages - existing == set(), f"docs/architecture.md names packages that do not exist: {packages - existing}"
    assert existing - packages == set(), f"packages docs/architecture.md does not name: {sorted(existing - packages)}"
    missing = {name for name in modules if not (PACKAGE / name).is_file()}
    assert not missing, f"docs/architecture.md names modules that do not exist: {sorted(missing)}"


def _named_subpackages() -> set[str]:
    """The subpackages the map draws under a package (``    name/`` below ``  package/``), as ``package/name``."""
    named, parent = set(), None
    for line in _map().splitlines()[1:]:
        top = re.match(r"^  (\S+)/\s", line)
        nested = re.match(r"^    (\S+)/\s", line)
        if top:
            parent = top.group(1)
        elif nested and parent:
            named.add(f"{parent}/{nested.group(1)}")
    return named


def test_every_subpackage_the_map_draws_exists_and_every_subpackage_is_drawn():
    named = _named_subpackages()
    existing = {str(path.parent.relative_to(PACKAGE)) for path in PACKAGE.glob("*/*/__init__.py")}
    assert named, "the map draws no subpackage (its nested entries are indented four spaces: `    name/`)"
    assert named - existing == set(), f"docs/architecture.md draws subpackages that do not exist: {named - existing}"
    assert existing - named == set(), f"subpackages docs/architecture.md does not draw: {sorted(existing - named)}"
