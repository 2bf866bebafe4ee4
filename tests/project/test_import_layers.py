"""The package's import layers, read from the source with ``ast``: no import cycle among its modules,
and no lower layer imports the Lightning callbacks (the core works without them).

Every import is counted, at module level or inside a function: a function-level import is still a
dependency, only a later one. Imports under ``if TYPE_CHECKING:`` (annotations only) never run, so they
make no import cycle; they still count for the callbacks rule. ``import a.b.c`` and
``from a.b import c`` (``c`` a submodule) are edges to ``a.b.c``; ``from a.b import name`` is an edge
to ``a.b``. Parent packages a dotted import runs implicitly are not edges (every import of the
package would otherwise depend on its root ``__init__``).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.paths import REPO_ROOT

PACKAGE = "lightning_memkit"
ROOT = Path(REPO_ROOT) / PACKAGE

#: Packages and modules that may import ``lightning_memkit.callbacks``: the callbacks themselves,
#: the command line (it trains with them) and the public root ``__init__``.
ALLOWED_TO_IMPORT_CALLBACKS = (f"{PACKAGE}.callbacks", f"{PACKAGE}.cli")

#: The two places below the callbacks whose job is to build a Trainer's callbacks, each with a
#: function-level import that runs only when asked for that (no import cycle; the core's own code
#: paths never run it). ``(importer, imported)``: every other edge to the callbacks fails the test, and
#: an entry that no longer exists fails it too, so the list only shrinks.
TRAINER_BUILDING_EDGES: dict[tuple[str, str], str] = {
    (
        f"{PACKAGE}.modes.comparison",
        f"{PACKAGE}.callbacks.memory_tracker",
    ): "compare_modes trains one Trainer per mode, each measured by a MemoryTracker",
    (
        f"{PACKAGE}.modes.mode",
        f"{PACKAGE}.callbacks.activation_checkpointing",
    ): "Mode.trainer_kwargs returns the Trainer arguments of a mode: its precision flag and, for a "
    "checkpoint mode, the ActivationCheckpointing callback",
    (
        f"{PACKAGE}.modes.mode",
        f"{PACKAGE}.callbacks.activation_offload",
    ): "Mode.trainer_kwargs of an offload mode adds the ActivationOffload callback",
}


def module_names() -> dict[str, Path]:
    """Every module of the package: dotted name -> file."""
    names: dict[str, Path] = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _resolve(importer: str, is_package: bool, level: int, module: str | None) -> str:
    """The absolute dotted name of ``from {'.' * level}{module} import ...`` in ``importer``."""
    if not level:
        return module or ""
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` bodies (never run, so never part of an import cycle)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for statement in node.body:
                inside.update(id(n) for n in ast.walk(statement))
    return inside


def imports_of(name: str, path: Path, modules: dict[str, Path], type_checking: bool = True) -> dict[str, int]:
    """The package modules ``name`` imports: imported module -> first line number.

    ``type_checking=False`` leaves out the imports under ``if TYPE_CHECKING:`` (annotations only)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    skipped = set() if type_checking else _type_checking_nodes(tree)
    found: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        if target == PACKAGE or target.startswith(PACKAGE + "."):
            # an import of something not a module of ours (a typo) would fail elsewhere; point at its module
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target != name:
                found.setdefault(target, line)

    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(name, is_package, node.level, node.module)
            for alias in node.names:
                candidate = f"{source}.{alias.name}"
                add(candidate if candidate in modules else source, node.lineno)
    return found


def import_graph(type_checking: bool = True) -> dict[str, dict[str, int]]:
    """module -> {module it imports: line}; ``type_checking=False``: the imports that run."""
    modules = module_names()
    return {name: imports_of(name, path, modules, type_checking) for name, path in modules.items()}


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, {}):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _without_pending(graph: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {
        name: {t: line for t, line in targets.items() if (name, t) not in TRAINER_BUILDING_EDGES}
        for name, targets in graph.items()
    }


def _may_import_callbacks(name: str) -> bool:
    return name == PACKAGE or any(
        name == allowed or name.startswith(allowed + ".") for allowed in ALLOWED_TO_IMPORT_CALLBACKS
    )


def _is_callbacks(name: str) -> bool:
    return name == f"{PACKAGE}.callbacks" or name.startswith(f"{PACKAGE}.callbacks.")


def _path_to_callbacks(graph: dict[str, dict[str, int]], start: str) -> list[str] | None:
    """The shortest import chain from ``start`` to a callbacks module, or None."""
    previous: dict[str, str | None] = {start: None}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for target in sorted(graph.get(node, {})):
            if target in previous:
                continue
            previous[target] = node
            if _is_callbacks(target):
                chain = [target]
                while previous[chain[-1]] is not None:
                    chain.append(previous[chain[-1]])
                return chain[::-1]
            queue.append(target)
    return None


# ---------------------------------------------------------------------------------------------- the walker itself


def test_the_walker_sees_every_kind_of_import(tmp_path: Path) -> None:
    """Top-level, function-level, relative and ``from package import submodule`` imports are edges."""
    package = tmp_path / PACKAGE
    (package / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "import lightning_memkit.b\n",
        "b.py": "def f():\n    from lightning_memkit.sub import c\n",
        "sub/__init__.py": "from .c import X\n",
        "sub/c.py": "from .. import a\nfrom ..b import f\nX = 1\n",
        "d.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lightning_memkit.a import A\n"
            "import lightning_memkit.sub\n"
        ),
    }
    for relative, text in files.items():
        (package / relative).write_text(text)
    modules = {
        ".".join(p.relative_to(tmp_path).with_suffix("").parts).removesuffix(".__init__"): p
        for p in package.rglob("*.py")
    }
    graph = {name: set(imports_of(name, path, modules)) for name, path in modules.items()}
    assert graph == {
        PACKAGE: set(),
        f"{PACKAGE}.a": {f"{PACKAGE}.b"},
        f"{PACKAGE}.b": {f"{PACKAGE}.sub.c"},
        f"{PACKAGE}.sub": {f"{PACKAGE}.sub.c"},
        f"{PACKAGE}.sub.c": {f"{PACKAGE}.a", f"{PACKAGE}.b"},
        f"{PACKAGE}.d": {f"{PACKAGE}.a", f"{PACKAGE}.sub"},
    }
    # an annotation-only import never runs: no edge for the cycle rule
    assert set(imports_of(f"{PACKAGE}.d", package / "d.py", modules, type_checking=False)) == {f"{PACKAGE}.sub"}
    cycles = find_cycles({k: dict.fromkeys(v, 1) for k, v in graph.items()})
    assert cycles == [[f"{PACKAGE}.a", f"{PACKAGE}.b", f"{PACKAGE}.sub.c"]]


def test_the_walker_finds_the_package_and_its_layers() -> None:
    graph = import_graph()
    assert len(graph) > 30, sorted(graph)
    # known edges that must be seen (a walker that saw nothing would pass the tests below)
    assert f"{PACKAGE}.trace.tracer" in graph[f"{PACKAGE}.callbacks.layer_trace"]
    assert f"{PACKAGE}.callbacks.memory_tracker" in graph[PACKAGE]


# ---------------------------------------------------------------------------------------------- the rules


def test_no_import_cycle_among_the_package_modules() -> None:
    graph = import_graph(type_checking=False)
    cycles = find_cycles(graph)  # every edge, the Trainer-building ones too
    described = []
    for component in cycles:
        members = set(component)
        edges = [f"{a} -> {b} (line {graph[a][b]})" for a in component for b in sorted(graph[a]) if b in members]
        described.append("\n    ".join(edges))
    assert not cycles, "import cycles:\n  " + "\n  ".join(described)


def test_no_lower_layer_imports_the_callbacks() -> None:
    graph = import_graph()
    direct = [
        f"{name} imports {target} (line {line})"
        for name, targets in sorted(graph.items())
        if not _may_import_callbacks(name)
        for target, line in sorted(targets.items())
        if _is_callbacks(target) and (name, target) not in TRAINER_BUILDING_EDGES
    ]
    assert not direct, "lower layers import the Lightning callbacks:\n  " + "\n  ".join(direct)
    # nor through another module (e.g. the root package, which exports the callbacks)
    pruned = _without_pending(graph)
    chains = []
    for name in sorted(pruned):
        if _may_import_callbacks(name):
            continue
        chain = _path_to_callbacks(pruned, name)
        if chain:
            chains.append(" -> ".join(chain))
    assert not chains, "lower layers reach the callbacks through other imports:\n  " + "\n  ".join(chains)


def test_pending_edges_still_exist() -> None:
    """Each allow-listed edge is still in the source: once it is gone, its entry must go too."""
    graph = import_graph()
    gone = [f"{a} -> {b}" for a, b in TRAINER_BUILDING_EDGES if b not in graph.get(a, {})]
    assert not gone, f"these edges are gone; remove them from TRAINER_BUILDING_EDGES: {gone}"


# ---------------------------------------------------------------------------------------------- one path to each name


def _is_compat(name: str) -> bool:
    """A compat module (``_torch_compat``, ``_lightning_compat``): the one place memkit reaches a library's private
    names, so a name it imports from outside the package is its own to give."""
    return name.rsplit(".", 1)[-1].endswith("_compat")


def definitions(name: str, tree: ast.Module) -> set[str]:
    """The names ``name`` defines at module level (functions, classes, assignments, also under ``if``/``try``/
    ``with``), and, for a compat module, the names it imports from outside the package."""
    defined: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                defined.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.Import, ast.ImportFrom)) and _is_compat(name):
                outside = isinstance(node, ast.Import) or (
                    not node.level and not (node.module or "").startswith(PACKAGE)
                )
                if outside:
                    defined.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                visit(getattr(node, "finalbody", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(tree.body)
    return defined


def names_imported_from_elsewhere(modules: dict[str, Path]) -> list[str]:
    """``"importer:line imports X from M"`` for each ``from M import X`` (at any level, annotation-only ones too)
    inside the package where ``M`` is a package module that neither defines ``X`` nor has a submodule ``X``."""
    trees = {name: ast.parse(path.read_text(encoding="utf-8"), filename=str(path)) for name, path in modules.items()}
    defined = {name: definitions(name, tree) for name, tree in trees.items()}
    found: list[tuple[str, int, str]] = []
    for importer, tree in trees.items():
        is_package = modules[importer].name == "__init__.py"
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = _resolve(importer, is_package, node.level, node.module)
            if source not in modules:
                continue
            found += [
                (importer, node.lineno, f"{importer}:{node.lineno} imports {alias.name} from {source}")
                for alias in node.names
                if f"{source}.{alias.name}" not in modules and alias.name not in defined[source]
            ]
    return [text for _, _, text in sorted(found)]


#: the public packages: the only modules that gather names defined elsewhere, for users
PUBLIC_PACKAGES = (PACKAGE, f"{PACKAGE}.estimate", f"{PACKAGE}.plan")


def reexported_names(modules: dict[str, Path]) -> list[str]:
    """``"module: X"`` for each name a module other than the public packages (and the compat modules) lists in
    ``__all__`` without defining it: a re-export, a second path to the name."""
    found = []
    for name, path in sorted(modules.items()):
        if name in PUBLIC_PACKAGES or _is_compat(name):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        exported: list[str] = []
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AugAssign)) and isinstance(node.value, (ast.List, ast.Tuple)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                    exported += [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
        own = definitions(name, tree)
        found += [f"{name}: {each}" for each in exported if each not in own]
    return found


def test_the_name_check_sees_a_reexport_and_lets_a_definition_pass(tmp_path: Path) -> None:
    package = tmp_path / PACKAGE
    (package / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from lightning_memkit.home import Thing\n__all__ = ['Thing']\n",
        "home.py": "class Thing:\n    pass\nLIMIT: int = 3\n",
        "shim.py": "from lightning_memkit.home import Thing\n__all__ = ['Thing', 'helper']\ndef helper():\n    pass\n",
        "_torch_compat.py": "from torch.utils._pytree import tree_map\n",
        "sub/__init__.py": "from lightning_memkit.home import LIMIT\n__all__ = ['LIMIT']\n",
        "sub/user.py": (
            "from lightning_memkit.home import LIMIT, Thing\n"  # the definer: passes
            "from lightning_memkit.shim import helper\n"  # defined there: passes
            "from lightning_memkit import sub\n"  # a submodule: passes
            "from lightning_memkit._torch_compat import tree_map\n"  # a compat module's own: passes
            "def f():\n    from ..shim import Thing\n"  # through the shim, in a function: fails
            "from lightning_memkit import Thing\n"  # through the package: fails
        ),
    }
    for relative, text in files.items():
        (package / relative).write_text(text)
    modules = {
        ".".join(p.relative_to(tmp_path).with_suffix("").parts).removesuffix(".__init__"): p
        for p in package.rglob("*.py")
    }
    assert names_imported_from_elsewhere(modules) == [
        f"{PACKAGE}.sub.user:6 imports Thing from {PACKAGE}.shim",
        f"{PACKAGE}.sub.user:7 imports Thing from {PACKAGE}",
    ]
    # the public package gathers names for users; a shim, or another package's __init__, may not
    assert reexported_names(modules) == [f"{PACKAGE}.shim: Thing", f"{PACKAGE}.sub: LIMIT"]


def test_every_import_inside_the_package_names_the_module_that_defines_the_name() -> None:
    """One path to each name: code inside the package imports a name from its home, never through a module or
    package that imports it from there (the public packages gather names for users, not for the package)."""
    found = names_imported_from_elsewhere(module_names())
    assert not found, "import these from the module that defines them:\n  " + "\n  ".join(found)


def test_no_module_reexports_a_name_it_does_not_define() -> None:
    found = reexported_names(module_names())
    assert not found, "these modules list in __all__ names defined elsewhere (import them from there):\n  " + (
        "\n  ".join(found)
    )
