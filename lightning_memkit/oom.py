"""Out-of-memory errors: recognising them on any device, and the report left behind.

Used by MemoryTracker (forensics) and by the batch-size search (a trial that ran out).
"""

from __future__ import annotations

import json
import os
import time
import traceback
from typing import Any

import torch

__all__ = ["is_out_of_memory", "write_oom_report"]

# Messages of allocators that raise a plain RuntimeError rather than torch.OutOfMemoryError.
_OOM_MESSAGES = (
    "out of memory",                                  # CUDA, MPS, XPU
    "DefaultCPUAllocator: can't allocate memory",    # CPU
    "DefaultCPUAllocator: not enough memory",        # CPU on Windows
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` means an allocation failed for lack of memory, on any device."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    if isinstance(error, (RuntimeError, MemoryError)):
        text = str(error)
        return isinstance(error, MemoryError) or any(message in text for message in _OOM_MESSAGES)
    return False


def write_oom_report(path: str, payload: dict[str, Any], error: BaseException) -> str:
    """Write a JSON report of an out-of-memory error to ``path`` and return the path.

    ``payload`` is what the caller knows (last readings, step, device); the error's type,
    message and traceback are added, and on CUDA the allocator's text summary.
    """
    report = dict(payload)
    report["error_type"] = type(error).__name__
    report["error"] = str(error)
    report["traceback"] = traceback.format_exception(type(error), error, error.__traceback__)
    report["time"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        try:
            report["cuda_memory_summary"] = torch.cuda.memory_summary()
        except Exception as summary_error:
            report["cuda_memory_summary"] = f"unavailable: {summary_error}"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as file:
        json.dump(report, file, indent=2, default=str)
    return path
