"""Host memory of this process: resident set size now, and its per-step peak.

On Linux the peak is VmHWM from /proc/self/status, reset before each step by writing "5"
to /proc/self/clear_refs. Where that reset is refused (other systems, some sandboxes) the
peak falls back to the lifetime maximum from getrusage, and :attr:`HostProbe.peak_is_per_step`
says so.
"""

from __future__ import annotations

import contextlib
import os
import sys

import psutil

from lightning_memkit.probes.base import MemoryProbe

__all__ = ["HostProbe"]

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def _lifetime_peak_rss() -> int | None:
    try:
        import resource  # deferred: POSIX only, Windows has none
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # macOS: bytes, Linux: KiB


class HostProbe(MemoryProbe):
    """Process RSS (``host_rss_bytes``) and per-step peak RSS (``host_peak_rss_bytes``).

    RSS includes the Python interpreter, libraries and allocator caches, and glibc does not
    return freed memory promptly, so it measures the process, not the tensors: for exact
    tensor bytes use the tensor accountant.

    On Linux both numbers come from one read of /proc/self/status (VmRSS, VmHWM) through a
    file descriptor kept open, and the peak is reset by writing to an open
    /proc/self/clear_refs: about 25 microseconds per step in all. Elsewhere RSS comes from
    psutil and the peak from ``getrusage`` (lifetime, see :attr:`peak_is_per_step`).
    """

    name = "host"

    def __init__(self) -> None:
        self._process = psutil.Process(os.getpid())
        self._pid = -1
        self._status_fd: int | None = None
        self._clear_fd: int | None = None
        self.peak_is_per_step = (
            sys.platform.startswith("linux") and self._open_proc() and self._reset() and self._read_status() is not None
        )

    def _open_proc(self) -> bool:
        self._close_proc()
        try:
            self._status_fd = os.open(_STATUS, os.O_RDONLY)
            self._clear_fd = os.open(_CLEAR_REFS, os.O_WRONLY)
        except OSError:
            self._close_proc()
            return False
        self._pid = os.getpid()
        return True

    def _close_proc(self) -> None:
        for fd in (self._status_fd, self._clear_fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._status_fd = self._clear_fd = None

    def _ensure_own_process(self) -> bool:
        # /proc/self was resolved when the files were opened: after a fork they would
        # describe the parent, so reopen them in the child.
        return os.getpid() == self._pid or self._open_proc()

    def _reset(self) -> bool:
        try:
            if not self._ensure_own_process() or self._clear_fd is None:  # closed
                return False
            return os.write(self._clear_fd, b"5") == 1
        except (OSError, TypeError):
            return False

    def _read_status(self) -> tuple[int, int] | None:
        """(VmRSS, VmHWM) in bytes, or ``None`` if /proc/self/status cannot be read."""
        try:
            if not self._ensure_own_process() or self._status_fd is None:  # closed
                return None
            data = os.pread(self._status_fd, 8192, 0)
            rss_at = data.index(b"VmRSS:")
            hwm_at = data.index(b"VmHWM:")
            rss = int(data[rss_at + 6 : data.index(b"kB", rss_at)]) * 1024  # the kernel reports kB
            hwm = int(data[hwm_at + 6 : data.index(b"kB", hwm_at)]) * 1024
            return rss, hwm
        except (OSError, ValueError, TypeError):
            return None

    def reset_peak(self) -> None:
        if self.peak_is_per_step and not self._reset():
            self.peak_is_per_step = False

    def read(self) -> dict[str, int]:
        if self.peak_is_per_step:
            status = self._read_status()
            if status is not None:
                rss, hwm = status
                return {"host_rss_bytes": rss, "host_peak_rss_bytes": max(hwm, rss)}
            self.peak_is_per_step = False
        rss = int(self._process.memory_info().rss)
        peak = _lifetime_peak_rss()
        values = {"host_rss_bytes": rss}
        if peak is not None:
            values["host_peak_rss_bytes"] = max(peak, rss)
        return values

    def close(self) -> None:
        self._close_proc()

    def __del__(self) -> None:  # a probe dropped without close() must not leak descriptors
        with contextlib.suppress(Exception):  # never raise from a finalizer
            self._close_proc()
