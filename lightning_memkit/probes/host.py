"""Host memory of this process: resident set size now, and its per-step peak.

On Linux the peak is VmHWM from /proc/self/status, reset before each step by writing "5"
to /proc/self/clear_refs. Where that reset is refused (other systems, some sandboxes) the
peak falls back to the lifetime maximum from getrusage, and :attr:`HostProbe.peak_is_per_step`
says so.
"""

from __future__ import annotations

import os
import sys

import psutil

from lightning_memkit.probes.base import MemoryProbe

__all__ = ["HostProbe"]

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def _read_vm_hwm() -> int | None:
    try:
        with open(_STATUS, "rb") as status:
            for line in status:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024  # the kernel reports kB
    except OSError:
        return None
    return None


def _reset_vm_hwm() -> bool:
    try:
        with open(_CLEAR_REFS, "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def _lifetime_peak_rss() -> int | None:
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # macOS: bytes, Linux: KiB


class HostProbe(MemoryProbe):
    """Process RSS (``host_rss_bytes``) and per-step peak RSS (``host_peak_rss_bytes``).

    RSS includes the Python interpreter, libraries and allocator caches, and glibc does not
    return freed memory promptly, so it measures the process, not the tensors: for exact
    tensor bytes use the tensor accountant.
    """

    name = "host"

    def __init__(self) -> None:
        self._process = psutil.Process(os.getpid())
        self.peak_is_per_step = sys.platform.startswith("linux") and _reset_vm_hwm() and _read_vm_hwm() is not None

    def reset_peak(self) -> None:
        if self.peak_is_per_step and not _reset_vm_hwm():
            self.peak_is_per_step = False

    def read(self) -> dict[str, int]:
        rss = int(self._process.memory_info().rss)
        peak = _read_vm_hwm() if self.peak_is_per_step else _lifetime_peak_rss()
        values = {"host_rss_bytes": rss}
        if peak is not None:
            values["host_peak_rss_bytes"] = max(peak, rss)
        return values
