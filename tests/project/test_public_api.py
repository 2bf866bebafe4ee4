"""Every public name is documented, on a docs page, with an example that a test runs; the docs' CLI flags exist.

The public API is ``lightning_memkit.__all__``, the records those names return (found through their
annotations: fields, properties and return types) and the ``memkit`` verbs' flags. No training runs
here: the docs and examples are read as text, the CLI's parsers are built in-process (their
``format_help()`` is what ``memkit <verb> --help`` prints).
"""

from __future__ import annotations

import glob
import importlib
import inspect
import io
import os
import re
import sys
import tokenize
import typing

import pytest

import lightning_memkit
from tests.helpers.paths import REPO_ROOT

ROOT = REPO_ROOT
DOCS = os.path.join(ROOT, "docs")
API_PAGE = "api.md"
VERBS = ("demo", "estimate", "trace", "compare", "report", "doctor", "plan")


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as handle:
        return handle.read()


def _pages() -> dict[str, str]:
    return {os.path.basename(path): _read(path) for path in sorted(glob.glob(os.path.join(DOCS, "*.md")))}


def _mentions(text: str, name: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(name)}(?!\w)", text) is not None


def _public() -> dict[str, object]:
    return {name: getattr(lightning_memkit, name) for name in lightning_memkit.__all__}


def _own_doc(obj: object) -> str | None:
    """The object's own docstring: a class's is never inherited (``inspect.getdoc`` would take its base's)."""
    return vars(obj).get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)


# ---- (a) docstrings ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", lightning_memkit.__all__)
def test_every_public_name_has_a_docstring(name):
    doc = _own_doc(getattr(lightning_memkit, name))
    assert doc and len(doc.strip()) >= 20, f"lightning_memkit.{name} has no docstring of its own"


def _memkit_classes(annotation: object, module: object) -> list[type]:
    """memkit classes named by an annotation (a type, a typing construct or a string)."""
    if isinstance(annotation, str):
        found = (getattr(module, word.split(".")[-1], None) for word in re.findall(r"[A-Za-z_][\w.]*", annotation))
        return [obj for obj in found if inspect.isclass(obj) and obj.__module__.startswith("lightning_memkit")]
    classes = (
        [annotation] if inspect.isclass(annotation) and annotation.__module__.startswith("lightning_memkit") else []
    )
    for argument in typing.get_args(annotation):
        classes += _memkit_classes(argument, module)
    return classes


def _annotations(cls: type) -> dict[str, object]:
    found: dict[str, object] = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__.startswith("lightning_memkit"):
            found.update(vars(klass).get("__annotations__", {}))
    return {
        name: annotation
        for name, annotation in found.items()
        if not name.startswith("_") and "ClassVar" not in str(annotation)
    }


def _public_classes() -> dict[type, str]:
    """Every class in ``__all__`` and every memkit class reachable from them: fields, properties, returns."""
    reached: dict[type, str] = {}

    def returns(function: object, owner: str) -> None:
        function = inspect.unwrap(function)
        try:
            annotation = inspect.signature(function).return_annotation
        except (TypeError, ValueError):
            return
        for cls in _memkit_classes(annotation, sys.modules.get(getattr(function, "__module__", ""), None)):
            visit(cls, owner)

    def visit(cls: type, via: str) -> None:
        if cls in reached:
            return
        reached[cls] = via
        module = sys.modules[cls.__module__]
        for name, annotation in _annotations(cls).items():
            for found in _memkit_classes(annotation, module):
                visit(found, f"{cls.__name__}.{name}")
        for name, member in vars(cls).items():
            if not name.startswith("_"):
                target = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
                if inspect.isfunction(target):
                    returns(target, f"{cls.__name__}.{name}")

    for name, obj in _public().items():
        if inspect.isclass(obj):
            visit(obj, "__all__")
        else:
            returns(obj, f"{name}()")
    return reached


def _field_documented(cls: type, name: str) -> bool:
    """Named in the class's docstring, or where it is declared: that class's docstring or a ``#:`` comment above it."""
    declaring = next(klass for klass in cls.__mro__ if name in vars(klass).get("__annotations__", {}))
    if any(_mentions(_own_doc(klass) or "", name) for klass in (cls, declaring)):
        return True
    return re.search(rf"^\s*#:.*\n\s*{re.escape(name)}\s*:", inspect.getsource(declaring), flags=re.M) is not None


def test_records_the_public_names_return_are_reached():
    # the walk below is only as good as what it finds: the records the brief names are among them
    names = {cls.__name__ for cls in _public_classes()}
    assert {
        "StepReading",
        "RunSummary",
        "MemoryEstimate",
        "DistributedEstimate",
        "TraceEvent",
        "LayerTraceResult",
        "DoctorReport",
        "LeakReport",
        "LivenessReport",
        "SearchResult",
        "Trial",
        "BatchSizePrediction",
        "CompareResult",
        "ModeResult",
        "CheckpointHandle",
        "CategoryBreakdown",
        "Creation",
        "ModelStates",
    } <= names


def test_every_public_method_property_and_field_is_documented():
    missing = []
    for cls, via in _public_classes().items():
        label = f"{cls.__module__}.{cls.__qualname__} (via {via})"
        doc = _own_doc(cls)
        if not doc:
            missing.append(f"{label}: no class docstring")
            continue
        fields = _annotations(cls)
        for name in fields:
            if not _field_documented(cls, name):
                missing.append(f"{label}: field {name!r} not described in the class docstring")
        for name, member in vars(cls).items():
            if name.startswith("_") or name in fields:
                continue
            if isinstance(member, property):
                target = member.fget
            else:
                target = getattr(member, "__func__", member)
                if not inspect.isfunction(target):
                    continue
            # inspect.getdoc inherits: a Lightning hook override is documented by Lightning's Callback
            if not inspect.getdoc(getattr(cls, name) if not isinstance(member, property) else member):
                missing.append(f"{label}: {name} has no docstring")
    assert not missing, "\n".join(missing)


# ---- (b) a page under docs/ ---------------------------------------------------------------------------


def test_the_docs_index_links_every_page():
    pages = _pages()
    linked = set(re.findall(r"\]\(([\w.-]+\.md)\)", pages["index.md"]))
    assert set(pages) - {"index.md"} <= linked, (
        f"docs/index.md does not link {sorted(set(pages) - {'index.md'} - linked)}"
    )
    assert not linked - set(pages), f"docs/index.md links pages that do not exist: {sorted(linked - set(pages))}"


@pytest.mark.parametrize("name", lightning_memkit.__all__)
def test_every_public_name_is_explained_on_a_page_and_indexed(name):
    pages = _pages()
    explained = [page for page, text in pages.items() if page not in (API_PAGE, "index.md") and _mentions(text, name)]
    assert explained, f"{name} is not on any docs page (beside the index)"
    # docs/api.md's row for it links a page that explains it
    row = re.search(rf"^\| `{re.escape(name)}` \|.*$", _api_sections()[0], flags=re.M)
    assert row, f"docs/{API_PAGE} has no row for {name}"
    linked = re.findall(r"\]\(([\w.-]+\.md)\)", row.group(0))
    assert linked and all(page in explained for page in linked), (name, linked, explained)


#: records whose page explains them without naming the class yet (pages owned elsewhere; their fields are
#: described in the class docstrings). The test fails once a page names one: then remove it here.
UNNAMED_RECORDS: set[tuple[str, str]] = set()


def _api_sections() -> tuple[str, str]:
    """docs/api.md's public names and its records table."""
    text = _pages()[API_PAGE]
    names, rest = text.split("\n## Records the public names return\n")
    return names, rest.split("\n## ")[0]


def test_the_api_page_lists_the_public_names_and_the_records_they_return():
    names, records_table = _api_sections()
    listed = re.findall(r"^\| `(\w+)` \|", names, flags=re.M)
    assert sorted(listed) == sorted(lightning_memkit.__all__)  # each once
    records = {cls.__name__ for cls in _public_classes()}
    pages = _pages()
    rows = re.findall(r"^\| (`[^|]*?) \| [^|]*? \| \[[\w.]+\]\(([\w.]+\.md)\) \|$", records_table, flags=re.M)
    assert rows
    for cell, page in rows:
        for name in re.findall(r"`(\w+)`", cell):
            assert name in records, f"docs/{API_PAGE} lists {name}, which no public name returns"
            if (name, page) in UNNAMED_RECORDS:  # still a gap: remove the entry once the page names it
                assert not _mentions(pages[page], name), f"docs/{page} names {name} now: drop it from UNNAMED_RECORDS"
            else:
                assert _mentions(pages[page], name), (
                    f"docs/{API_PAGE} says docs/{page} explains {name}; it does not name it"
                )


# ---- (c) an example that a test runs ------------------------------------------------------------------


def _examples_run_by_tests() -> set[str]:
    run: set[str] = set()
    for path in glob.glob(os.path.join(ROOT, "tests", "**", "test_*.py"), recursive=True):
        text = _read(path)
        run.update(re.findall(r"run_example\(\s*\"(\w+\.py)\"", text))
        run.update(re.findall(r"os\.path\.join\(\s*\"examples\",\s*\"(\w+\.py)\"\s*\)", text))
    return run


def _identifiers(source: str) -> set[str]:
    """The names a Python source uses as code (not in strings or comments)."""
    return {
        token.string for token in tokenize.generate_tokens(io.StringIO(source).readline) if token.type == tokenize.NAME
    }


def test_every_example_is_run_by_a_test():
    examples = {os.path.basename(path) for path in glob.glob(os.path.join(ROOT, "examples", "*.py"))}
    assert examples - _examples_run_by_tests() == set(), "examples no test runs"


def test_every_public_name_is_used_by_an_example_that_a_test_runs():
    sources = {name: _read(os.path.join(ROOT, "examples", name)) for name in _examples_run_by_tests()}
    # the README's example with every callback, which tests/project/test_readme.py runs as written
    blocks = re.findall(r"```python\n(.*?)```", _read(os.path.join(ROOT, "README.md")), flags=re.S)
    sources["README.md"] = next(block for block in blocks if "MaxBatchSize(" in block)
    used = {source: _identifiers(text) for source, text in sources.items()}
    unused = [name for name in lightning_memkit.__all__ if not any(name in names for names in used.values())]
    assert not unused, f"no example that a test runs uses {unused}"


# ---- (d) the CLI: documented flags exist, existing flags are documented ------------------------------


def _cli_flags() -> dict[str, set[str]]:
    from lightning_memkit.cli import build_parser

    parser = build_parser()
    verbs = next(
        action for action in parser._actions if hasattr(action, "choices") and isinstance(action.choices, dict)
    ).choices
    assert set(verbs) == set(VERBS)
    flags = {}
    for verb, sub in verbs.items():
        text = sub.format_help()  # what `memkit <verb> --help` prints
        flags[verb] = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text)) - {"--help"}
    return flags


def _documented_flags() -> dict[str, dict[str, list[str]]]:
    """verb -> flag -> where: every ``--flag`` on a ``memkit <verb> ...`` line of docs/*.md or the README."""
    texts = {f"docs/{page}": text for page, text in _pages().items()}
    texts["README.md"] = _read(os.path.join(ROOT, "README.md"))
    found: dict[str, dict[str, list[str]]] = {verb: {} for verb in VERBS}
    pattern = re.compile(rf"\bmemkit ({'|'.join(VERBS)})\b")
    for where, text in texts.items():
        for line in text.replace("\\\n", " ").splitlines():
            matches = list(pattern.finditer(line))
            for i, match in enumerate(matches):
                # to the end of the line or of the inline code span, and never into the next command
                end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
                segment = line[match.end() : end]
                for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", segment):
                    found[match.group(1)].setdefault(flag, []).append(where)
    return found


@pytest.mark.parametrize("verb", VERBS)
def test_every_documented_flag_exists(verb):
    unknown = {flag: where for flag, where in _documented_flags()[verb].items() if flag not in _cli_flags()[verb]}
    assert not unknown, f"memkit {verb} has no such flags (see memkit {verb} --help): {unknown}"


@pytest.mark.parametrize("verb", VERBS)
def test_every_flag_is_documented(verb):
    undocumented = sorted(_cli_flags()[verb] - set(_documented_flags()[verb]))
    assert not undocumented, f"memkit {verb} flags on no `memkit {verb} ...` line of the docs: {undocumented}"


# ---- the docs' code names things that exist ----------------------------------------------------------


def _doc_texts() -> dict[str, str]:
    texts = {f"docs/{page}": text for page, text in _pages().items()}
    texts["README.md"] = _read(os.path.join(ROOT, "README.md"))
    return texts


def test_imports_and_dotted_names_in_the_docs_exist():
    missing = []
    for where, text in _doc_texts().items():
        for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
            for module_name, names in re.findall(
                r"^\s*from (lightning_memkit[\w.]*) import ([^#\n]+)", block, flags=re.M
            ):
                module = importlib.import_module(module_name)
                for name in (part.strip(" ()").split(" as ")[0] for part in names.split(",")):
                    if name and not hasattr(module, name):
                        missing.append(f"{where}: from {module_name} import {name}")
        for dotted in set(re.findall(r"(?<![\w/])lightning_memkit(?:\.\w+)+", text)):
            parts = dotted.split(".")
            if parts[-1] == "py":  # a file path written with dots
                continue
            obj, i = None, len(parts)
            while i > 0:
                try:
                    obj = importlib.import_module(".".join(parts[:i]))
                    break
                except ImportError:
                    i -= 1
            for part in parts[i:]:
                if not hasattr(obj, part):
                    missing.append(f"{where}: {dotted}")
                    break
                obj = getattr(obj, part)
    assert not missing, "\n".join(missing)


def _calls(code: str, names: set[str]) -> list[tuple[str, str]]:
    """``(name, arguments)`` of every call ``name(...)`` in ``code`` (balanced parentheses; nested calls removed)."""
    calls = []
    for match in re.finditer(r"(?<![\w.])(\w+)\(", code):
        if match.group(1) not in names:
            continue
        depth, i = 1, match.end()
        while i < len(code) and depth:
            depth += {"(": 1, ")": -1}.get(code[i], 0)
            i += 1
        if depth:
            continue  # unbalanced: an elided call such as ``estimate_memory(...``
        arguments = code[match.end() : i - 1]
        while re.search(r"\([^()]*\)", arguments):  # a nested call's keywords are not this call's
            arguments = re.sub(r"\([^()]*\)", "", arguments)
        calls.append((match.group(1), arguments))
    return calls


def _parameters(obj) -> dict:
    """``obj``'s parameters; none for an exception class that keeps its builtin base's constructor (PlanError)."""
    try:
        return dict(inspect.signature(obj).parameters)
    except ValueError:
        return {}


def test_keyword_arguments_in_documented_calls_exist():
    public = _public()
    every_parameter = {parameter for obj in public.values() if callable(obj) for parameter in _parameters(obj)}
    wrong, checked = [], 0
    for where, text in _doc_texts().items():
        code = re.findall(r"`([^`\n]*\w\([^`\n]*)`", text)  # inline calls
        code += [body for language, body in _code_blocks(text) if language == "python"]
        for snippet in code:
            for name, arguments in _calls(snippet, set(public)):
                checked += 1
                parameters = _parameters(public[name])
                passes_on = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
                for keyword in re.findall(r"(?:^|,)\s*(\w+)\s*=(?!=)", arguments):
                    # **kwargs that are passed on (estimate_kwargs, options) go to another public callable
                    if keyword not in parameters and not (passes_on and keyword in every_parameter):
                        wrong.append(f"{where}: {name}({keyword}=...)")
    assert checked >= 30 and not wrong, "\n".join(wrong)


def _code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block of a markdown text."""
    blocks, language, lines = [], None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if language is None:
                language, lines = line[3:].strip(), []
            else:
                blocks.append((language, "\n".join(lines)))
                language = None
        elif language is not None:
            lines.append(line)
    return blocks


def test_make_targets_in_the_docs_exist():
    targets = set(re.findall(r"^([\w-]+):", _read(os.path.join(ROOT, "Makefile")), flags=re.M))
    named = {}
    for where, text in _doc_texts().items():
        code = [body for language, body in _code_blocks(text) if language in ("", "bash", "sh", "console")]
        code += re.findall(r"`(make [^`\n]+)`", text)
        for snippet in code:
            for target in re.findall(r"(?:^|[\s;&(])make ([a-z][\w-]*)", snippet, flags=re.M):
                named.setdefault(target, where)
    assert {"demo", "test"} <= set(named), "the README's two commands are gone"
    assert not {target: where for target, where in named.items() if target not in targets}, targets
