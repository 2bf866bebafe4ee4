"""Shared test helpers: a Linear stack whose tensor bytes are computable by hand, a small
CPU Trainer factory, and a reader for TensorBoard event files (tensorboard's own reader)."""

from __future__ import annotations

import glob
import os
import sys
import threading
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

FLOAT32 = 4  # bytes per element


class LinearStack(pl.LightningModule):
    """``Linear(d0, d1) -> ReLU -> ... -> Linear(d_{L-1}, d_L)``, loss ``out.pow(2).sum()``.

    The batch is ``(x,)`` with ``x`` of shape ``(batch_size, d0)``. Nothing is logged from
    ``training_step`` unless ``log_loss`` is set, so every live tensor is one a test can name.
    """

    def __init__(
        self,
        dims=(32, 64, 48, 16),
        batch_size: int = 8,
        optimizer: str = "sgd",
        samples: int = 64,
        log_loss: bool = False,
        val_batches: int = 0,
    ) -> None:
        super().__init__()
        self.dims = tuple(dims)
        self.batch_size = batch_size
        self.optimizer_name = optimizer
        self.log_loss = log_loss
        self.val_batches = val_batches
        layers: list[nn.Module] = []
        for index in range(len(dims) - 1):
            layers.append(nn.Linear(dims[index], dims[index + 1]))
            if index < len(dims) - 2:
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)
        generator = torch.Generator().manual_seed(0)
        self.data = torch.randn(samples, dims[0], generator=generator)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = self.net(x).pow(2).sum()
        if self.log_loss:
            self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        (x,) = batch
        loss = self.net(x).pow(2).sum()
        if self.log_loss:
            self.log("val_loss", loss)

    def configure_optimizers(self):
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=1e-3)
        return torch.optim.SGD(self.parameters(), lr=1e-4)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.data), batch_size=self.batch_size, drop_last=True)

    def val_dataloader(self):
        size = self.batch_size * max(self.val_batches, 1)
        return DataLoader(TensorDataset(self.data[:size]), batch_size=self.batch_size)

    # ---- sizes, by hand, in bytes (float32) --------------------------------------------
    def parameter_bytes(self) -> int:
        """Weights ``d_i * d_{i+1}`` plus biases ``d_{i+1}`` of every layer."""
        d = self.dims
        return sum(d[i] * d[i + 1] + d[i + 1] for i in range(len(d) - 1)) * FLOAT32

    def activation_bytes(self, layer: int) -> int:
        """Bytes of the output of Linear ``layer`` (0-based) for one batch: ``B * d_{layer+1}``."""
        return self.batch_size * self.dims[layer + 1] * FLOAT32


class FrozenBaseStack(LinearStack):
    """A :class:`LinearStack` whose layers but the last are frozen, trained with Adam: a fine-tune whose frozen weights
    are most of its memory (a LoRA's base), so that only true half precision (2 bytes per weight) fits a budget below
    its fp32 weights."""

    def __init__(self, dims=(64, 512, 512, 8), batch_size: int = 8, **kwargs) -> None:
        super().__init__(dims, batch_size=batch_size, optimizer="adam", **kwargs)
        for layer in list(self.net)[:-1]:
            layer.requires_grad_(False)

    def configure_optimizers(self):
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=1e-3)

    def frozen_parameter_elements(self) -> int:
        return sum(p.numel() for p in self.parameters() if not p.requires_grad)


def make_trainer(tmp_path, **overrides) -> pl.Trainer:
    """A small, quiet CPU Trainer writing under ``tmp_path``."""
    options = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 4,
        "logger": False,
        "default_root_dir": str(tmp_path),
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
        "log_every_n_steps": 1,
    }
    options.update(overrides)
    return pl.Trainer(**options)


def read_scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files under ``log_dir``: ``{tag: [(step, value), ...]}`` (by step)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(glob.glob(os.path.join(log_dir, "**", "events.out.tfevents.*"), recursive=True))
    assert files, f"no TensorBoard event file under {log_dir}"
    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in files:
        accumulator = EventAccumulator(path, size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in accumulator.Scalars(tag))
    return {tag: sorted(values) for tag, values in scalars.items()}


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` (the GPU lane, ``make test-gpu``) are collected everywhere and skipped
    where torch sees no CUDA device. Tests marked ``extended`` (4-process runs: half a minute each on
    2 cores, beyond what the 10-minute suite can hold) are skipped unless ``MEMKIT_EXTENDED=1``
    (``make test-extended``)."""
    extended = os.environ.get("MEMKIT_EXTENDED") == "1"
    skip_extended = pytest.mark.skip(
        reason="a 4-process check beyond the 10-minute suite; run `make test-extended` (MEMKIT_EXTENDED=1)"
    )
    skip_cuda = pytest.mark.skip(
        reason="needs a CUDA GPU (torch.cuda.is_available() is False); run `make test-gpu` on one"
    )
    for item in items:
        if item.get_closest_marker("cuda") is not None and not torch.cuda.is_available():
            item.add_marker(skip_cuda)
        if item.get_closest_marker("extended") is not None and not extended:
            item.add_marker(skip_extended)


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


def run_process(args: list[str], cwd: str, timeout: float = 180) -> tuple[int, str]:
    """Run ``python *args`` in its own session (a DDP launcher and its ranks) until every process writing
    to its output has ended; kill the whole group and fail the test as a hang on timeout. Returns
    ``(exit status, output)`` (stdout and stderr)."""
    import signal
    import subprocess
    import sys

    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    env.pop("MASTER_PORT", None)
    process = subprocess.Popen(
        [sys.executable, *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{args[0]} did not finish (every rank) in {timeout} s:\n{output[-4000:]}")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return process.returncode, output


def run_script(args: list[str], cwd: str, timeout: float = 180) -> str:
    """:func:`run_process`, failing the test unless it exits 0; returns its output."""
    returncode, output = run_process(args, cwd, timeout)
    assert returncode == 0, output[-4000:]
    return output


def rerun_in_own_process(request, tmp_path, timeout_s: int = 600) -> bool:
    """Run the calling test again in a fresh Python process and assert it passes there; ``False`` inside that process.

    For a whole-process reading that what earlier tests leave in the process moves (caches of torch and the libraries,
    the process's resident memory): the claim is checked as a user's run sees it, from a fresh process. Usage, first
    line of the test: ``if rerun_in_own_process(request, tmp_path): return``."""
    import re
    import subprocess
    import sys

    nodeid = request.node.nodeid
    if os.environ.get("MEMKIT_OWN_PROCESS") == nodeid:
        return False
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-x",
            nodeid,
            "--basetemp",
            str(tmp_path / "own-process"),
        ],
        cwd=str(request.config.rootpath),
        env={**os.environ, "MEMKIT_OWN_PROCESS": nodeid},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert result.returncode == 0 and re.search(r"\b1 passed", result.stdout), (
        result.stdout[-4000:] + result.stderr[-2000:]
    )
    return True


# ---- tests leave the repository tree as they found it ------------------------------------------------------------

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
