"""Processes a test runs (a script, a DDP launcher and its ranks), each with a timeout that kills the whole group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest


def run_process(args: list[str], cwd: str, timeout: float = 180) -> tuple[int, str]:
    """Run ``python *args`` in its own session (a DDP launcher and its ranks) until every process writing
    to its output has ended; kill the whole group and fail the test as a hang on timeout. Returns
    ``(exit status, output)`` (stdout and stderr)."""
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
