"""The documentation as a site and as pages for users: ``mkdocs build --strict`` passes, every page is in the
navigation, every link resolves, the first page's table names every public callback and ``memkit`` verb, no
page, docstring or message cites source documents (project history lives in CHANGELOG.md), and no page is over
300 lines (development logs and benchmark runs live in benchmarks/README.md)."""

from __future__ import annotations

import ast
import glob
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import REPO_ROOT

ROOT = REPO_ROOT
DOCS = os.path.join(ROOT, "docs")
PAGES = sorted(os.path.basename(p) for p in glob.glob(os.path.join(DOCS, "*.md")))


def nav_pages(nav) -> list[str]:
    """Every page file named in mkdocs.yml's ``nav`` (nested sections included)."""
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def load_mkdocs_config() -> dict:
    import yaml

    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as handle:
        return yaml.safe_load(handle)


@pytest.mark.timeout(300)
def test_the_site_builds_strictly(tmp_path):
    """A broken link, a missing anchor or a page left out of the navigation fails the build (strict: warnings are
    errors)."""
    pytest.importorskip("mkdocs", reason="the dev extra installs mkdocs: pip install -e '.[dev]'")
    pytest.importorskip("material", reason="the dev extra installs mkdocs-material: pip install -e '.[dev]'")
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for page in PAGES:  # every page was built, and the runnable examples the pages link are served beside them
        name = "" if page == "index.md" else page[:-3] + "/"
        assert (site / name / "index.html").exists(), page
    text = "".join(Path(DOCS, p).read_text(encoding="utf-8") for p in PAGES)
    linked = set(re.findall(r"\]\(\.\./examples/([\w.]+)", text))
    assert linked and all((site / "examples" / name).exists() for name in linked), linked


def test_every_page_is_in_the_navigation_once():
    assert sorted(nav_pages(load_mkdocs_config()["nav"])) == PAGES


def test_every_relative_link_of_the_pages_resolves():
    broken = []
    for page in PAGES:
        text = Path(DOCS, page).read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            if not os.path.exists(os.path.normpath(os.path.join(DOCS, target))):
                broken.append((page, target))
    assert broken == []


def index_rows() -> list[list[str]]:
    text = Path(DOCS, "index.md").read_text(encoding="utf-8")
    rows = [line.strip().strip("|").split("|") for line in text.splitlines() if line.startswith("|")]
    header, _, *body = rows
    assert [c.strip() for c in header] == ["question", "tool", "what it prints (and writes)", "page"]
    return [[c.strip() for c in row] for row in body]


def test_the_first_page_names_every_public_callback_and_memkit_verb():
    import lightning.pytorch as pl

    import lightning_memkit
    from lightning_memkit.cli import build_parser

    public = {name: getattr(lightning_memkit, name) for name in lightning_memkit.__all__}
    callbacks = {name for name, obj in public.items() if isinstance(obj, type) and issubclass(obj, pl.Callback)}
    parser = build_parser()
    [subparsers] = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    verbs = set(subparsers.choices)
    assert {"MemoryTracker", "MaxBatchSize"} <= callbacks and {"compare", "demo"} <= verbs
    tools = " ".join(row[1] for row in index_rows())
    named = set(re.findall(r"`(\w+)`", tools)) | set(re.findall(r"`memkit (\w+)", tools))
    assert callbacks - named == set() and verbs - named == set()
    for row in index_rows():  # each row says what the tool prints and links its page
        assert row[2] and re.fullmatch(r"\[[^]]+\]\([\w_]+\.md\)", row[3]), row


#: A docs page says what its tool does, how to read its output, an example and its limits, in at most this many
#: lines; development logs and benchmark runs go to benchmarks/README.md or CHANGELOG.md.
MAX_PAGE_LINES = 300


def test_no_page_is_over_300_lines():
    lines = {page: len(Path(DOCS, page).read_text(encoding="utf-8").splitlines()) for page in PAGES}
    over = {page: count for page, count in lines.items() if count > MAX_PAGE_LINES}
    assert over == {}, f"over {MAX_PAGE_LINES} lines: {over} (runs go to benchmarks/README.md, history to CHANGELOG.md)"


SOURCE_CITATIONS = re.compile(r"seed article|seed's table|the seed paper", re.IGNORECASE)


def test_no_page_docstring_or_message_cites_source_documents():
    """Users read what the tool does; they were never given "the seed article" or "the seed's table"."""
    found = []
    for path in glob.glob(os.path.join(DOCS, "*.md")) + [os.path.join(ROOT, "README.md")]:
        found += [
            (path, line)
            for line in Path(path).read_text(encoding="utf-8").splitlines()
            if SOURCE_CITATIONS.search(line)
        ]
    for path in glob.glob(os.path.join(ROOT, "lightning_memkit", "**", "*.py"), recursive=True):
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
        for node in ast.walk(tree):  # docstrings and every string a message is made of
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and SOURCE_CITATIONS.search(node.value):
                found.append((path, node.value[:80]))
        comments = [
            line
            for line in Path(path).read_text(encoding="utf-8").splitlines()
            if "#" in line and SOURCE_CITATIONS.search(line.split("#", 1)[1])
        ]
        found += [(path, line) for line in comments]
    assert found == []


def test_the_changelog_has_an_unreleased_section():
    text = Path(ROOT, "CHANGELOG.md").read_text(encoding="utf-8")
    assert text.startswith("# Changelog") and "\n## Unreleased\n" in text


def test_make_demo_shows_pips_progress(tmp_path):
    """``make demo``'s set-up takes about a minute: pip's own progress shows, not ``--quiet``."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    done = subprocess.run(
        ["make", "-n", "demo", f"VENV={tmp_path / 'venv'}"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    installs = [line for line in done.stdout.splitlines() if "pip install" in line]
    assert len(installs) == 2 and not any("--quiet" in line or " -q" in line for line in installs), installs


def _make_dry_run(target: str, venv) -> list[str]:
    """The ``pip install`` lines ``make -n target`` would run, with its venv at ``venv``."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    done = subprocess.run(
        ["make", "-n", target, f"VENV={venv}", "NEWEST=0"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return [line.split("pip install ", 1)[1].strip() for line in done.stdout.splitlines() if "pip install" in line]


def test_make_demo_installs_what_the_demo_needs_and_make_test_the_dev_extra_too(tmp_path):
    """``make demo`` installs torch and memkit (no pytest, mkdocs or transformers); ``make test`` the dev extra besides,
    also after a ``make demo`` (its own stamp)."""
    venv = tmp_path / "venv"
    demo = _make_dry_run("demo", venv)
    assert demo == ['--progress-bar on "torch==2.13.0"', "--progress-bar on -e ."], demo
    test = _make_dry_run("test", venv)
    assert test == demo + ["--progress-bar on -e '.[dev]'"], test
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "memkit").touch()  # what `make demo` leaves (newer than pyproject.toml)
    assert _make_dry_run("demo", venv) == []
    assert _make_dry_run("test", venv) == ["--progress-bar on -e '.[dev]'"]
