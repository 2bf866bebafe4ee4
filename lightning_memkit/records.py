"""Plain records of what was measured: one step's memory reading and a run's summary.

Probes fill records; sinks (loggers, TensorBoard, CSV, the report) only read them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "MEMORY_FIELDS",
    "COUNT_FIELDS",
    "RECORDS_FILENAME",
    "StepReading",
    "RunSummary",
    "write_records",
    "read_records",
    "records_filename",
    "RecordsWriter",
    "ended_by",
]

#: the file MemoryTracker writes in the log dir at fit end, and `memkit report` reads.
RECORDS_FILENAME = "memkit_memory.json"

#: Byte-valued fields of :class:`StepReading`, in display order, with their meaning.
MEMORY_FIELDS: dict[str, str] = {
    "allocated_bytes": "CUDA: bytes held by live tensors at step end (torch.cuda.memory_allocated)",
    "peak_allocated_bytes": "CUDA: highest allocated bytes during this step (peak reset every step)",
    "reserved_bytes": "CUDA: bytes the caching allocator holds from the driver at step end",
    "peak_reserved_bytes": "CUDA: highest reserved bytes during this step",
    "active_bytes": "CUDA: bytes in active blocks (allocated plus their rounding)",
    "fragmentation_bytes": "CUDA: inactive split bytes: reserved, free, but cut off from larger blocks",
    "device_used_bytes": "NVML: device memory used by every process (what nvidia-smi shows)",
    "device_total_bytes": "NVML: device memory capacity",
    "process_device_bytes": "NVML: device memory used by this process (CUDA context and libraries included)",
    "host_rss_bytes": "host: resident set size of this process at step end",
    "host_peak_rss_bytes": "host: peak resident set size during this step (Linux VmHWM, reset every step)",
    "tensor_bytes": "accountant: bytes of every live tensor storage of the process at step end "
    "(exact; as CUDA's allocated)",
    "peak_tensor_bytes": "accountant: highest of those bytes during this step "
    "(exact; on the steps the accountant measured)",
}

#: Count-valued fields of :class:`StepReading`.
COUNT_FIELDS: dict[str, str] = {
    "alloc_retries": "CUDA: cumulative allocator retries (cudaMalloc failed, cache flushed, retried)",
    "ooms": "CUDA: cumulative out-of-memory errors raised by the allocator",
}


@dataclass
class StepReading:
    """One step's memory, as read by the probes. Every memory field is in bytes.

    ``step`` is the training-step axis that Lightning's own logged metrics use, so memory
    lines up with the loss curve; ``stage`` is ``"train"`` or ``"validate"`` (a validation
    reading covers the whole validation run and sits at the training step it followed).
    Fields a probe could not read on this device are ``None``.

    Attributes:
        step: the training step (Lightning's ``global_step`` axis) the reading belongs to.
        stage: ``"train"`` or ``"validate"``.
        rank: the global rank of the process that read it; ``-1`` for the maximum over ranks
            (under DDP, the reading MemoryTracker logs).
    """

    step: int
    stage: str = "train"
    rank: int = 0
    allocated_bytes: int | None = None
    peak_allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    active_bytes: int | None = None
    fragmentation_bytes: int | None = None
    alloc_retries: int | None = None
    ooms: int | None = None
    device_used_bytes: int | None = None
    device_total_bytes: int | None = None
    process_device_bytes: int | None = None
    host_rss_bytes: int | None = None
    host_peak_rss_bytes: int | None = None
    tensor_bytes: int | None = None
    peak_tensor_bytes: int | None = None

    @staticmethod
    def value_fields() -> list[str]:
        """Names of the measured fields (bytes and counts), in display order."""
        return list(MEMORY_FIELDS) + list(COUNT_FIELDS)

    def values(self) -> dict[str, int]:
        """The measured fields that have a value."""
        return {name: getattr(self, name) for name in self.value_fields() if getattr(self, name) is not None}

    @property
    def peak_bytes(self) -> int | None:
        """The step's best peak: CUDA peak allocated, else the accountant's, else host peak RSS."""
        for name in ("peak_allocated_bytes", "peak_tensor_bytes", "host_peak_rss_bytes"):
            value = getattr(self, name)
            if value is not None:
                return value
        return None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        # every field is a plain int/str/None: a flat copy, several times cheaper than
        # dataclasses.asdict's deep copy (checkpoints hold up to max_history readings)
        return {name: getattr(self, name) for name in _STEP_READING_FIELDS}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepReading:
        """Inverse of :meth:`to_dict`; unknown keys are ignored so old files still load."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


# the measured fields' meanings are defined once, in MEMORY_FIELDS and COUNT_FIELDS; help() shows them too
if StepReading.__doc__:  # None under python -OO
    StepReading.__doc__ = (
        StepReading.__doc__.rstrip()
        + "\n"
        + "".join(f"        {name} (bytes): {meaning}.\n" for name, meaning in MEMORY_FIELDS.items())
        + "".join(f"        {name} (a count): {meaning}.\n" for name, meaning in COUNT_FIELDS.items())
        + "    "
    )
_STEP_READING_FIELDS = tuple(f.name for f in dataclasses.fields(StepReading))
#: where a step's peak comes from, best first (see StepReading.peak_bytes)
_PEAK_SOURCES = ("peak_allocated_bytes", "peak_tensor_bytes", "host_peak_rss_bytes")


@dataclass
class RunSummary:
    """The run's memory in one line: its peak, where it happened and the room there was.

    Attributes:
        peak_bytes: the highest per-step peak of the run, in bytes (see :attr:`peak_source`), over
            the readings that have the best source seen (CUDA's peak, else the accountant's,
            else host peak RSS): steps without it do not count.
        peak_source: which reading the peak comes from, e.g. ``"peak_allocated_bytes"``.
        peak_step: the training step at which it happened.
        peak_stage: ``"train"`` or ``"validate"``.
        capacity_bytes: the device's memory capacity in bytes when known (CUDA device total,
            or host RAM for a CPU run), else ``None``.
        device: the device measured, e.g. ``"cuda:0"`` or ``"cpu"``.
        steps_measured: how many readings the run produced (training steps and validation runs).
        train_steps_measured: how many training steps were measured.
        train_steps_with_peak: how many of them have a reading of :attr:`peak_source` (on CPU the
            accountant's exact peak is sampled: ``MemoryTracker(tensor_peak_every_n_steps=...)``).
        validation_runs_measured: how many validation runs were measured.
        peak_reserved_bytes: the highest per-step reserved peak (CUDA), or ``None``.
        max_fragmentation_bytes: the highest fragmentation seen (CUDA), or ``None``.
        alloc_retries: allocator retries by the end of the run (CUDA; a count), or ``None``.
        extra: what a writer adds beyond these fields, JSON-ready (MemoryTracker's ``"leak"``:
            ``bytes_per_measured_step`` in bytes, ``first_step`` / ``last_step`` and ``every_n_steps``
            in training steps); kept through :meth:`to_dict` / :meth:`from_dict`.
    """

    peak_bytes: int | None = None
    peak_source: str | None = None
    peak_step: int | None = None
    peak_stage: str | None = None
    capacity_bytes: int | None = None
    device: str = "cpu"
    steps_measured: int = 0
    train_steps_measured: int = 0
    train_steps_with_peak: int = 0
    validation_runs_measured: int = 0
    peak_reserved_bytes: int | None = None
    max_fragmentation_bytes: int | None = None
    alloc_retries: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def update(self, reading: StepReading) -> None:
        """Fold one reading into the summary (constant memory, whatever the run's length)."""
        self.steps_measured += 1
        if reading.stage == "train":
            self.train_steps_measured += 1
        else:
            self.validation_runs_measured += 1
        peak = reading.peak_bytes
        if peak is not None:
            source = next(n for n in _PEAK_SOURCES if getattr(reading, n) is not None)
            # one source for the run: a reading without the best source seen (a step the CPU
            # accountant did not measure has host RSS only) never stands in for it
            better = self.peak_source is None or _PEAK_SOURCES.index(source) < _PEAK_SOURCES.index(self.peak_source)
            if better:  # counted again under the better source
                self.train_steps_with_peak = 0
            if better or source == self.peak_source:
                self.train_steps_with_peak += reading.stage == "train"
            if better or (source == self.peak_source and self.peak_bytes is not None and peak > self.peak_bytes):
                self.peak_bytes = peak
                self.peak_step = reading.step
                self.peak_stage = reading.stage
                self.peak_source = source
        if reading.peak_reserved_bytes is not None:
            self.peak_reserved_bytes = max(self.peak_reserved_bytes or 0, reading.peak_reserved_bytes)
        if reading.fragmentation_bytes is not None:
            self.max_fragmentation_bytes = max(self.max_fragmentation_bytes or 0, reading.fragmentation_bytes)
        if reading.alloc_retries is not None:
            self.alloc_retries = reading.alloc_retries

    @property
    def peak_fraction(self) -> float | None:
        """The peak as a fraction of the capacity, when both are known."""
        if self.peak_bytes is None or not self.capacity_bytes:
            return None
        return self.peak_bytes / self.capacity_bytes

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunSummary:
        """Inverse of :meth:`to_dict`; unknown keys are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def write_records(path: str, summary: RunSummary, history: list[StepReading]) -> str:
    """Write a run's summary and readings as JSON (``{"summary": ..., "history": [...]}``)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as file:
        json.dump(
            {
                "format": "lightning-memkit/memory/1",
                "summary": summary.to_dict(),
                "history": [r.to_dict() for r in history],
            },
            file,
        )
    return path


def records_filename(prefix: str | None = None) -> str:
    """:data:`RECORDS_FILENAME`, or for a tracker with its own logging ``prefix`` ``memkit_memory_<prefix>.json``:
    a second tracker writes beside the default one instead of over it."""
    if prefix is None:
        return RECORDS_FILENAME
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in prefix)
    return RECORDS_FILENAME.replace(".json", f"_{safe}.json")


class RecordsWriter:
    """Writes a run's records file (:func:`write_records`), never over a file it did not write itself: a name taken
    by another file gets ``-v1``, ``-v2``... (as Lightning's ModelCheckpoint does); its own file it rewrites."""

    def __init__(self) -> None:
        self._written: set[str] = set()

    def write(self, path: str | os.PathLike, filename: str, summary: RunSummary, history: list[StepReading]) -> str:
        """Write to ``path`` (a file, or an existing directory: ``filename`` in it); returns the path written."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, filename)
        stem, extension = os.path.splitext(path)
        candidate, version = path, 0
        while os.path.exists(candidate) and candidate not in self._written:
            version += 1
            candidate = f"{stem}-v{version}{extension}"
        written = write_records(candidate, summary, history)
        self._written.add(written)
        return written


def read_records(path: str) -> tuple[RunSummary, list[StepReading]]:
    """Read what :func:`write_records` wrote.

    Raises:
        ValueError: if the file is not a memkit memory file.
    """
    with open(path) as file:
        data = json.load(file)
    if not isinstance(data, dict) or data.get("format", "").split("/")[:2] != ["lightning-memkit", "memory"]:
        raise ValueError(f"{path} is not a memkit memory file (written by MemoryTracker at fit end)")
    summary, history = RunSummary.from_dict(data["summary"]), [StepReading.from_dict(r) for r in data["history"]]
    if "train_steps_measured" not in data["summary"]:  # written before the split: count from the history
        summary.train_steps_measured = sum(r.stage == "train" for r in history)
        summary.validation_runs_measured = len(history) - summary.train_steps_measured
    return summary, history


def ended_by(exception: BaseException) -> str:
    """``summary.extra["ended_by"]``: the exception's type and message, at most 500 characters."""
    message = str(exception)
    text = f"{type(exception).__name__}: {message}" if message else type(exception).__name__
    return text[:500]
