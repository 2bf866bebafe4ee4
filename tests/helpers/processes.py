"""Processes a test runs (a script, a DDP launcher and its ranks, the test itself again), each with a timeout that kills
the whole group.

Starting Python and importing torch and Lightning costs a process about 6 s of CPU here (more than most scripts' own
work, and the main lane runs dozens of them), so a script runs in a process forked from a warm interpreter that has
imported them once and run nothing (:class:`ForkServer`, one per pytest process): each script still runs in a process
of its own, as ``__main__``, with its own argv, working directory, environment and output, and exits with its status.
With ``ranks``, every rank is forked so (as ``torchrun`` starts them); a process a script starts itself (Lightning's
launcher starting the other DDP ranks) is a fresh interpreter, as it is for a user.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading

import pytest
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from tests.helpers.paths import REPO_ROOT

#: what each script process gets besides the pytest process's environment: warnings off (their text is not what the
#: tests read), one torch thread per process (a 2-rank run on 2 cores), a plotting backend without a display
SCRIPT_ENVIRONMENT = {"PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}

# The warm interpreter: imports what the scripts import, then for each request (a line of JSON on stdin) forks one
# child, or one per rank, each in a session of its own, whose output (and that of every process they start) goes to
# one pipe; it answers two lines: the children's pids, then, once every process holding the pipe has ended, the exit
# status (the first failing rank's; when a rank fails the others are stopped, as torchrun stops them).
_SERVER = r"""
import json, os, runpy, select, signal, sys, traceback, warnings
import pytest, torch, lightning.pytorch, lightning_memkit, lightning_memkit.zoo


def child(request, rank, write_end):
    code = 1
    try:
        os.setsid()
        os.dup2(write_end, 1)
        os.dup2(write_end, 2)
        os.chdir(request["cwd"])
        env = dict(request["env"])
        if request["ranks"]:  # as torchrun starts each rank (Lightning then launches no process of its own)
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE=str(request["ranks"]),
                       LOCAL_WORLD_SIZE=str(request["ranks"]), MASTER_ADDR="127.0.0.1",
                       TORCHELASTIC_RUN_ID="memkit-tests")
        for name, value in env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if env.get("OMP_NUM_THREADS"):  # read at torch's import, which this process did not run
            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        if env.get("PYTHONWARNINGS") == "ignore":  # read at start-up, likewise
            warnings.simplefilter("ignore")
        argv = request["argv"]
        try:
            if argv[0] == "-m":  # as `python -m module args` has it
                sys.argv, sys.path[0] = [argv[1], *argv[2:]], request["cwd"]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:  # as `python script args` has it
                sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.abspath(argv[0]))
                runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except BaseException:
            traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(request):
    read_end, write_end = os.pipe()
    pids = []
    for rank in range(max(1, request["ranks"])):
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            child(request, rank, write_end)
        pids.append(pid)
    os.close(write_end)
    print(json.dumps({"pids": pids}), flush=True)
    statuses, ended, stopped = {}, False, False
    with open(request["log"], "wb") as log:
        while not ended or len(statuses) < len(pids):
            if not ended and select.select([read_end], [], [], 0.2)[0]:
                chunk = os.read(read_end, 65536)
                log.write(chunk)
                ended = not chunk
            elif ended:
                select.select([], [], [], 0.05)
            for pid in pids:
                if pid not in statuses:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done == pid:
                        statuses[pid] = os.waitstatus_to_exitcode(status)
            if not stopped and any(statuses.values()):
                stopped = True
                for pid in pids:
                    if pid not in statuses:
                        os.killpg(pid, signal.SIGKILL)
    os.close(read_end)
    failed = [status for status in statuses.values() if status]  # in the order they ended: the first failure first
    print(json.dumps({"status": failed[0] if failed else 0}), flush=True)


print("ready", flush=True)
for line in sys.stdin:
    serve(json.loads(line))
"""


class ForkServer:
    """A Python process that has imported pytest, torch, Lightning and memkit, forking one child per script."""

    def __init__(self, start_timeout: float = 180) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([REPO_ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        self.process = subprocess.Popen(
            [sys.executable, "-c", _SERVER],
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        first = self._next(start_timeout)
        if first != "ready":
            self.close()
            pytest.fail(f"the script runner did not start: {first}")

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def _next(self, timeout: float) -> str | None:
        return self.lines.get(timeout=timeout)

    def run(self, argv: list[str], cwd: str, timeout: float, env: dict[str, str | None], ranks: int) -> tuple[int, str]:
        """Run ``python *argv`` in ``cwd`` (``ranks`` > 0: that many ranks, as torchrun starts them) with ``env`` over
        this process's environment (``None`` removes a name) until every process writing to its output has ended; kill
        their sessions and fail the test as a hang on timeout. Returns ``(exit status, output)``."""
        descriptor, log = tempfile.mkstemp(prefix="memkit-process-", suffix=".txt")
        os.close(descriptor)
        request = {"argv": argv, "cwd": cwd, "log": log, "env": env, "ranks": ranks}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        pids = json.loads(self._next(60))["pids"]
        try:
            status = json.loads(self._next(timeout))["status"]
        except queue.Empty:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
            self._next(60)
            pytest.fail(f"{argv[0]} did not finish (every process it started) in {timeout} s:\n{_take(log)[-4000:]}")
        return status, _take(log)

    def close(self) -> None:
        # idle between scripts, it holds nothing to flush: its whole session goes at once (an orderly interpreter
        # exit with torch loaded took 4 s)
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.process.stdin.close()
        self.process.stdout.close()


def _take(path: str) -> str:
    """The text of ``path``, which is removed."""
    with open(path, encoding="utf-8", errors="replace") as handle:
        text = handle.read()
    os.remove(path)
    return text


_server: ForkServer | None = None


def fork_server() -> ForkServer | None:
    """This pytest process's warm interpreter, started at the first call (``None`` where processes cannot fork)."""
    global _server
    if not hasattr(os, "fork"):
        return None
    if _server is None or _server.process.poll() is not None:
        _server = ForkServer()
        atexit.register(_server.close)
    return _server


def run_process(
    args: list[str], cwd: str, timeout: float = 180, env: dict[str, str | None] | None = None, ranks: int = 0
) -> tuple[int, str]:
    """Run ``python *args`` (a script, or ``-m module``) in its own session until every process writing to its output
    has ended; kill the whole session and fail the test as a hang on timeout. ``env``: names set (or, ``None``,
    removed) over :data:`SCRIPT_ENVIRONMENT` and this process's environment. ``ranks`` > 0: that many processes, started
    as ``torchrun --nproc-per-node RANKS`` starts them (``RANK``, ``WORLD_SIZE``, ... and a free ``MASTER_PORT``), so a
    Trainer with ``devices=RANKS`` runs as one of them. Returns ``(exit status, output)`` (stdout and stderr)."""
    changes: dict[str, str | None] = {**SCRIPT_ENVIRONMENT, "MASTER_PORT": None, **(env or {})}
    if ranks:
        changes["MASTER_PORT"] = str(find_free_network_port())  # the ranks' rendezvous, as Lightning finds one
    server = fork_server()
    if server is not None:
        return server.run(list(args), cwd, timeout, changes, ranks)
    environment = {**os.environ, **{k: v for k, v in changes.items() if v is not None}}
    for name in [k for k, v in changes.items() if v is None]:
        environment.pop(name, None)
    if ranks:
        port = changes["MASTER_PORT"]
        args = ["-m", "torch.distributed.run", f"--nproc-per-node={ranks}", f"--master-port={port}", *args]
    process = subprocess.Popen(
        [sys.executable, *args],
        cwd=cwd,
        env=environment,
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


def run_script(
    args: list[str], cwd: str, timeout: float = 180, env: dict[str, str | None] | None = None, ranks: int = 0
) -> str:
    """:func:`run_process`, failing the test unless it exits 0; returns its output."""
    returncode, output = run_process(args, cwd, timeout, env, ranks)
    assert returncode == 0, output[-4000:]
    return output
