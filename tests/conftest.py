"""Fixtures and hooks for the whole suite: markers applied (``cuda``, ``extended``), Lightning's noise silenced, no
trace function left behind, a test rerun in a fresh process on request, and no file left in the repository tree.
What tests share besides (models, readers, processes) is in ``tests.helpers``."""

from __future__ import annotations

import os
import re
import sys
import threading
import warnings
from collections.abc import Callable

import pytest
import torch

from tests.helpers.paths import REPO_ROOT
from tests.helpers.processes import SCRIPT_ENVIRONMENT, run_process


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` (the GPU lane, ``make test-gpu``) are collected everywhere and skipped where torch sees no
    CUDA device. Tests marked ``extended`` (4-process runs, the 70B matrix, the 7B plan on 8 GPUs: beyond what the
    10-minute suite can hold on 2 cores) are skipped unless ``MEMKIT_EXTENDED=1`` (``make test-extended``)."""
    extended = os.environ.get("MEMKIT_EXTENDED") == "1"
    skip_extended = pytest.mark.skip(reason="beyond the 10-minute suite; run `make test-extended` (MEMKIT_EXTENDED=1)")
    skip_cuda = pytest.mark.skip(
        reason="needs a CUDA GPU (torch.cuda.is_available() is False); run `make test-gpu` on one"
    )
    for item in items:
        if item.get_closest_marker("cuda") is not None and not torch.cuda.is_available():
            item.add_marker(skip_cuda)
        if item.get_closest_marker("extended") is not None and not extended:
            item.add_marker(skip_extended)


def pytest_configure(config):
    """Under pytest-xdist, each worker's torch gets its share of the cores (one thread each with one worker per core,
    as `make test` runs): torch's OpenMP threads wait for each other by spinning, so two workers of two threads each on
    two cores, beside a test's own processes, made a 4 s test of 100 real steps take 25-70 s."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if os.environ.get("PYTEST_XDIST_WORKER") and workers:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, cores // int(workers)))


def pytest_collection_finish(session):
    """Move what importing the suite made (torch, Lightning, transformers, the test modules: about 500,000 objects)
    out of the garbage collector's reach with ``gc.freeze()``, once per worker, so each full ``gc.collect()`` and each
    ``gc.get_objects()`` walks what the tests make, not the libraries: memkit runs both at every fit's start and end,
    and with that heap each cost 0.2-0.4 s here, which made a third of the main lane's time.

    What tests count is unchanged: the tensors they measure are made after the freeze. A test whose claim is about the
    whole process (``rerun_in_own_process``) runs unfrozen, as a user's process does; ``MEMKIT_NO_FREEZE=1`` turns the
    freeze off for a whole run."""
    if os.environ.get("MEMKIT_OWN_PROCESS") or os.environ.get("MEMKIT_NO_FREEZE") == "1":
        return
    import gc

    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _quiet_lightning():
    """Lightning's advice about dataloader workers and the like is noise in these tests."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*number of training batches.*")
        warnings.filterwarnings("ignore", message=".*GPU available but not used.*")
        yield


@pytest.fixture(autouse=True)
def _no_trace_function_outlives_a_test():
    """The doctor's keeping-line tracer (sys.settrace) is the test's to remove; a test that fails before removing it
    must not leave it to the next ones (dynamo compiles nothing under a trace function, and hooks tests count it).
    The doctor's own tests assert it is gone where it must be."""
    had = sys.gettrace()
    yield
    if had is None and sys.gettrace() is not None:
        sys.settrace(None)
        threading.settrace(None)


@pytest.fixture(autouse=True)
def _no_torch_mode_outlives_a_test():
    """A dispatch or function mode left on torch's stack sees every later test's ops (and may hold their tensors): the
    test that leaves one fails here, by name, and the mode is popped so the tests after it run as written."""
    from torch.overrides import _pop_mode as pop_function_mode
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode

    dispatch_before, function_before = len(_get_current_dispatch_mode_stack()), torch._C._len_torch_function_stack()
    yield
    left = []
    while len(_get_current_dispatch_mode_stack()) > dispatch_before:
        left.append(type(_pop_mode()).__name__)
    while torch._C._len_torch_function_stack() > function_before:
        left.append(type(pop_function_mode()).__name__)
    if left:
        pytest.fail(f"the test left torch modes active: {left}")


@pytest.fixture
def rerun_in_own_process(request, tmp_path) -> Callable[..., bool]:
    """Run the calling test again in a fresh Python process and assert it passes there; ``False`` inside that process.

    For a whole-process reading that what earlier tests leave in the process moves (caches of torch and the libraries,
    the process's resident memory): the claim is checked as a user's run sees it, from a fresh process (forked from an
    interpreter that has imported the libraries and run nothing: :func:`tests.helpers.processes.run_process`). Usage,
    first line of the test: ``if rerun_in_own_process(): return``."""

    def rerun(timeout_s: int = 600) -> bool:
        nodeid = request.node.nodeid
        if os.environ.get("MEMKIT_OWN_PROCESS") == nodeid:
            return False
        arguments = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", nodeid]
        status, output = run_process(
            [*arguments, "--basetemp", str(tmp_path / "own-process")],
            str(request.config.rootpath),
            timeout_s,
            # as this test runs here, not as a script: the warnings and the torch threads this process has
            env={
                **{name: os.environ.get(name) for name in SCRIPT_ENVIRONMENT},
                "OMP_NUM_THREADS": str(torch.get_num_threads()),
                "MEMKIT_OWN_PROCESS": nodeid,
            },
        )
        assert status == 0 and re.search(r"\b1 passed", output), output[-6000:]
        return True

    return rerun


# ---- tests leave the repository tree as they found it ------------------------------------------------------------

#: path parts that are set-up, not test output: virtual environments, bytecode, build metadata, the tools' caches
NOT_TEST_OUTPUT = (".venv*", "__pycache__", "*.egg-info", ".pytest_cache", ".ruff_cache", ".mypy_cache")
#: new untracked (not ignored) files of these kinds are someone's edit, not test output: others may be adding
#: modules and pages to the checkout while the tests run (a test writes its scripts under tmp_path)
EDITED_SOURCES = (".py", ".md")
_TREE_AT_START = pytest.StashKey["set[str] | None"]()
_ROOT_WRITERS = pytest.StashKey["dict[str, str]"]()
_TREE_REPORT = pytest.StashKey[str]()


def _is_test_output(path: str) -> bool:
    import fnmatch

    return not any(fnmatch.fnmatch(part, pattern) for part in path.split("/") for pattern in NOT_TEST_OUTPUT)


def untracked_and_ignored_files() -> set[str] | None:
    """Every file of the checkout git does not track, ignored ones included (paths from the repository root),
    set-up (:data:`NOT_TEST_OUTPUT`) and new sources (:data:`EDITED_SOURCES`) aside; ``None`` without git or outside a
    git checkout (a tarball)."""
    import shutil
    import subprocess

    if shutil.which("git") is None or not os.path.exists(os.path.join(REPO_ROOT, ".git")):
        return None
    try:
        status = subprocess.run(
            ["git", "status", "--porcelain", "-z", "--untracked-files=all", "--ignored"],
            cwd=REPO_ROOT,
            capture_output=True,
            timeout=120,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    entries = iter(status.decode("utf-8", "surrogateescape").split("\0"))
    found = set()
    for entry in entries:
        code, path = entry[:2], entry[3:]
        if "R" in code or "C" in code:  # a rename or copy: the next entry is its source
            next(entries, None)
        elif (code == "!!" or (code == "??" and not path.endswith(EDITED_SOURCES))) and _is_test_output(path):
            found.add(path)
    return found


def pytest_sessionstart(session):
    """Note the untracked and ignored files before anything runs (collection included)."""
    session.config.stash[_TREE_AT_START] = untracked_and_ignored_files()
    session.config.stash[_ROOT_WRITERS] = {}


@pytest.fixture(autouse=True)
def _note_who_writes_into_the_repository_root(request):
    """A new entry in the repository's root after a test: remember the test, for the session's report below."""
    before = set(os.listdir(REPO_ROOT))
    yield
    writers = request.config.stash.get(_ROOT_WRITERS, None)
    if writers is not None:
        for name in set(os.listdir(REPO_ROOT)) - before:
            writers.setdefault(name, request.node.nodeid)


def pytest_sessionfinish(session, exitstatus):
    """Fail the session when files appeared in the repository tree: a test must write under ``tmp_path``.

    Only new paths count (untracked or ignored files that were not there at the start), never changes to tracked
    files: others may be editing the checkout while the tests run. The files are listed in the terminal summary.
    """
    before = session.config.stash.get(_TREE_AT_START, None)
    after = untracked_and_ignored_files() if before is not None else None
    if after is None or not after - before:
        return
    writers = session.config.stash.get(_ROOT_WRITERS, {})
    lines = []
    for path in sorted(after - before):
        writer = writers.get(path.split("/")[0])
        lines.append(f"  {path}" + (f"  (appeared during {writer})" if writer else ""))
    message = (
        "the tests wrote these files into the repository tree, so the session fails; write under tmp_path "
        "instead (e.g. monkeypatch.chdir(tmp_path), or a Trainer's default_root_dir=tmp_path):\n" + "\n".join(lines)
    )
    session.config.stash[_TREE_REPORT] = message
    if session.config.pluginmanager.get_plugin("terminalreporter") is None:
        import sys

        print(message, file=sys.stderr)
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    """The files the tests wrote into the repository tree (found at session finish, above), before the last line."""
    message = terminalreporter.config.stash.get(_TREE_REPORT, None)
    if message:
        terminalreporter.write_sep("=", "files written into the repository tree", red=True, bold=True)
        terminalreporter.write_line(message)
