"""Out-of-memory errors: recognising them on any device, and the report left behind.

Used by MemoryTracker (forensics) and by the batch-size search (a trial that ran out).
"""

from __future__ import annotations

import gc
import json
import os
import time
import traceback
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_memkit._lightning_compat import logging_step
from lightning_memkit.errors import MemkitError
from lightning_memkit.probes._torch_compat import dump_memory_snapshot
from lightning_memkit.records import RunSummary, StepReading

__all__ = [
    "is_out_of_memory",
    "largest_live_tensors",
    "write_oom_report",
    "OomMoment",
    "write_run_oom_report",
    "write_fit_oom_report",
]

# Messages of allocators that raise a plain RuntimeError rather than torch.OutOfMemoryError.
_OOM_MESSAGES = (
    "out of memory",  # CUDA, MPS, XPU
    "DefaultCPUAllocator: can't allocate memory",  # CPU
    "DefaultCPUAllocator: not enough memory",  # CPU on Windows
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` means an allocation failed for lack of memory, on any device.

    memkit's own errors (:class:`~lightning_memkit.MemkitError`) count only when they are one
    (:class:`~lightning_memkit.BudgetExceededError`) or were raised from one: a ``SearchError`` saying that batch size 1
    "ran out of memory" is the search's verdict, not an allocation that failed.
    """
    if isinstance(error, torch.OutOfMemoryError):
        return True
    if isinstance(error, MemkitError):
        return error.__cause__ is not None and is_out_of_memory(error.__cause__)
    if isinstance(error, (RuntimeError, MemoryError)):
        text = str(error)
        return isinstance(error, MemoryError) or any(message in text for message in _OOM_MESSAGES)
    return False


def _note_storage(storages: dict, obj: torch.Tensor, creation_of: Any, format_frame: Any) -> None:
    """Add ``obj``'s storage to ``storages`` (see :func:`largest_live_tensors`), or count one more tensor on it."""
    storage = obj.untyped_storage()
    if storage.device.type == "meta":  # a fake tensor (an estimate's): no memory behind it
        return
    key = (str(storage.device), storage.data_ptr())
    entry = storages.get(key)
    if entry is None:
        creation = creation_of(obj)
        storages[key] = {
            "nbytes": int(storage.nbytes()),
            "device": str(storage.device),
            "shape": list(obj.shape),
            "dtype": str(obj.dtype),
            "count": 1,
            "grad_fn": type(obj.grad_fn).__name__ if obj.grad_fn else "",
            "parameter": isinstance(obj, torch.nn.Parameter),
            "made_by": creation.describe() if creation else "",
            "where": format_frame(creation.frame) if creation else "",
        }
    else:
        entry["count"] += 1
        entry["parameter"] = entry["parameter"] or isinstance(obj, torch.nn.Parameter)
        if not entry["grad_fn"] and obj.grad_fn is not None:
            entry["grad_fn"] = type(obj.grad_fn).__name__


def largest_live_tensors(limit: int = 10) -> list[dict[str, Any]]:
    """The largest live tensor storages of the process, with who made them, largest first.

    Found with ``gc`` (every tensor object the process holds; views of one storage count once). Each
    entry: ``nbytes`` (the storage's bytes), ``device``, ``shape``, ``dtype``, ``count`` (tensors on the
    storage), ``grad_fn`` (the autograd op that made it, ``""`` for a leaf), ``parameter`` (whether it is
    an ``nn.Parameter``), and ``made_by`` / ``where`` (aten op, module and the user's line) when a memory
    doctor (:class:`~lightning_memkit.doctor.recorder.CreationRecorder`) saw it made. Never raises.
    """
    try:
        # deferred: the doctor imports Lightning and torchmetrics (to know their files): only when a report is written
        from lightning_memkit.doctor.frames import format_frame
        from lightning_memkit.doctor.recorder import creation_of  # deferred: as format_frame, above

        storages: dict[tuple[str, int], dict[str, Any]] = {}
        with warnings.catch_warnings():  # isinstance on a deprecated module alias warns
            warnings.simplefilter("ignore")
            objects = gc.get_objects()
            for obj in objects:
                try:
                    if (
                        not isinstance(obj, torch.Tensor)
                        or obj.device.type == "meta"
                        or obj.layout is not torch.strided
                    ):
                        continue
                    _note_storage(storages, obj, creation_of, format_frame)
                except Exception:  # noqa: BLE001 - one odd tensor (fake, sparse, proxy, a subclass left by an earlier
                    continue  # estimate) is skipped; the report lists the others
        del objects
        return sorted(storages.values(), key=lambda e: -e["nbytes"])[:limit]
    except Exception as error:  # noqa: BLE001 - a report must still be written
        return [{"error": f"{type(error).__name__}: {error}"}]


def write_oom_report(path: str, payload: dict[str, Any], error: BaseException, largest_tensors: int = 10) -> str:
    """Write a JSON report of an out-of-memory error to ``path`` and return the path.

    ``payload`` is what the caller knows (last readings, step, device); the error's type,
    message and traceback are added, on CUDA the allocator's text summary, and the
    ``largest_tensors`` largest live tensors by creator (:func:`largest_live_tensors`; 0: none).
    """
    report = dict(payload)
    report["error_type"] = type(error).__name__
    report["error"] = str(error)
    report["traceback"] = traceback.format_exception(type(error), error, error.__traceback__)
    report["time"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    if largest_tensors and "largest_live_tensors" not in report:
        report["largest_live_tensors"] = largest_live_tensors(largest_tensors)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        try:
            report["cuda_memory_summary"] = torch.cuda.memory_summary()
        except Exception as summary_error:  # noqa: BLE001 - the report is written without the summary, saying why
            report["cuda_memory_summary"] = f"unavailable: {summary_error}"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as file:
        json.dump(report, file, indent=2, default=str)
    return path


@dataclass(frozen=True)
class OomMoment:
    """Where in a training run an out-of-memory error happened: the OOM report's first keys."""

    step: int  #: the step on the loggers' axis (Lightning's own ``self.log`` step)
    global_step: int
    epoch: int
    rank: int  #: the process's global rank


def write_run_oom_report(
    directory: str,
    moment: OomMoment,
    summary: RunSummary,
    history: Sequence[StepReading],
    reading: StepReading | None,
    error: BaseException,
    snapshot: bool = False,
) -> str:
    """Write a run's report of an out-of-memory error, ``<directory>/memkit_oom_rank<r>.json`` (what ``memkit
    report`` reads): the moment, the run summary, the last ten readings and the failing step's reading up to the
    failure. ``snapshot``: CUDA memory history is recorded, so its snapshot is dumped beside the report as
    ``memkit_oom_rank<r>.pickle`` (named in the report). Returns the report's path.

    Raises:
        OSError: the report cannot be written.
    """
    stem = os.path.join(directory, f"memkit_oom_rank{moment.rank}")
    snapshot_path = stem + ".pickle" if snapshot and dump_memory_snapshot(stem + ".pickle") else None
    payload = {
        "step": moment.step,
        "global_step": moment.global_step,
        "epoch": moment.epoch,
        "rank": moment.rank,
        "device": summary.device,
        "capacity_bytes": summary.capacity_bytes,
        "failing_step_reading": reading.to_dict() if reading else None,
        "last_readings": [r.to_dict() for r in list(history)[-10:]],
        "summary": summary.to_dict(),
        "cuda_snapshot": snapshot_path,
    }
    return write_oom_report(stem + ".json", payload, error)


def write_fit_oom_report(
    trainer: Any,
    directory: str,
    summary: RunSummary,
    history: Sequence[StepReading],
    reading: StepReading | None,
    exception: BaseException,
    snapshot: bool,
) -> str | None:
    """Write a fit's OOM report into ``directory`` (MemoryTracker's ``oom_dir``, else the run's log dir), at the
    trainer's step, and warn where it is; ``None``, with a warning, when it cannot be written. ``reading``: the failed
    step's, closed at the failure."""
    # deferred: is_out_of_memory serves code that runs without Lightning; only a fit's report warns through it
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    moment = OomMoment(
        step=logging_step(trainer),
        global_step=trainer.global_step,
        epoch=trainer.current_epoch,
        rank=trainer.global_rank,
    )
    try:
        path = write_run_oom_report(directory, moment, summary, history, reading, exception, snapshot=snapshot)
        rank_zero_warn(f"memkit: out of memory at step {moment.step}; report written to {path}")
    except OSError as error:
        rank_zero_warn(f"memkit: out of memory, and the report could not be written to {directory}: {error}")
        return None
    return path
