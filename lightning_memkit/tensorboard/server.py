"""A local ``tensorboard --logdir`` server in a subprocess, for tests, screenshots and notebooks.

Binds to 127.0.0.1 only (never ``--bind_all``), on a free port, and is always stopped on exit.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import IO, Any

__all__ = ["TensorBoardServer", "free_port"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TensorBoardServer:
    """``tensorboard --logdir LOGDIR --host 127.0.0.1 --port PORT`` for as long as the ``with`` block runs.

    Usage::

        with TensorBoardServer("lightning_logs") as server:
            tags = server.get_json("/data/plugin/scalars/tags")

    Args:
        logdir: the log root to serve.
        port: the port; default: a free one.
        startup_timeout_s: seconds to wait for the server to answer and list a run.
        extra_args: more command-line arguments for ``tensorboard``.
    """

    def __init__(
        self, logdir: str, port: int | None = None, startup_timeout_s: float = 60.0, extra_args: tuple[str, ...] = ()
    ) -> None:
        self.logdir = os.path.abspath(logdir)
        self.port = port or free_port()
        self.startup_timeout_s = startup_timeout_s
        self.extra_args = tuple(extra_args)
        self.process: subprocess.Popen | None = None
        self.log: str = ""
        self._output: IO[str] | None = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The command line that starts the server (the ``tensorboard`` next to this Python)."""
        executable = os.path.join(os.path.dirname(sys.executable), "tensorboard")
        if not os.path.exists(executable):
            executable = shutil.which("tensorboard") or executable
        return [
            executable,
            "--logdir",
            self.logdir,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--load_fast",
            "false",
            "--reload_interval",
            "1",
            *self.extra_args,
        ]

    def start(self) -> TensorBoardServer:
        """Start the server and wait until it lists at least one run; raises RuntimeError on failure."""
        # a file, not a pipe: a pipe nobody reads would block the server once it fills
        # held open for the server's life (stop() closes it), so not a with block
        self._output = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        self.process = subprocess.Popen(
            self.command(), stdout=self._output, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                status = self.process.returncode
                self.stop()
                raise RuntimeError(f"tensorboard exited with status {status}:\n{self.log}")
            try:
                if self.get_json("/data/runs", timeout_s=2.0):
                    return self
            except (urllib.error.URLError, ConnectionError, OSError, ValueError):
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(
            f"tensorboard did not list a run of {self.logdir} within {self.startup_timeout_s:.0f} s:\n{self.log}"
        )

    def stop(self) -> None:
        """Stop the server (SIGTERM to its process group, SIGKILL after 10 s)."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
        output, self._output = self._output, None
        if output is not None:
            output.seek(0)
            self.log = output.read()
            output.close()

    def get(self, path: str, params: dict[str, Any] | None = None, timeout_s: float = 10.0) -> bytes:
        """GET ``path`` (e.g. ``/data/plugin/scalars/tags``) with query ``params``; the body."""
        query = ("?" + urllib.parse.urlencode(params)) if params else ""
        with urllib.request.urlopen(self.url + path + query, timeout=timeout_s) as response:
            return response.read()

    def get_json(self, path: str, params: dict[str, Any] | None = None, timeout_s: float = 10.0) -> Any:
        """GET ``path`` and parse the body as JSON."""
        return json.loads(self.get(path, params, timeout_s))

    def __enter__(self) -> TensorBoardServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
