"""Finding and reading what memkit wrote under a log dir, for the offline report.

Reads only memkit's own JSON and CSV files and TensorBoard event files (never unpickles);
every file is recognised by its name and its ``"format"`` key, and whatever is missing is
said in words (``ReportSources.missing``).
"""

from __future__ import annotations

import csv
import fnmatch
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from lightning_memkit.errors import MemkitError
from lightning_memkit.records import RECORDS_FILENAME, RunSummary, StepReading, read_records
from lightning_memkit.report.logged_readings import (
    CSV_METRICS,
    csv_readings,
    rebuilt_summary,
    same_readings,
    scalar_readings,
)

__all__ = [
    "TRACE_FORMAT",
    "COMPARE_FORMAT",
    "MEMORY_FORMAT",
    "TRACE_PATTERN",
    "COMPARE_JSON",
    "COMPARE_CSV",
    "OOM_PATTERN",
    "DOCTOR_JSON",
    "DoctorFile",
    "RunRecords",
    "TraceFile",
    "CompareFile",
    "OomFile",
    "ReportSources",
    "ReportInputError",
    "find_sources",
]

MEMORY_FORMAT = "lightning-memkit/memory"
TRACE_FORMAT = "lightning-memkit/trace"
COMPARE_FORMAT = "lightning-memkit/compare"
#: LayerTrace's per-step file name: ``memkit_trace_step{N}.json``, ``memkit_trace_step{N}_rank{r}.json``, with ``-v{k}``
#: before ``.json`` when an earlier run's file of that name was there (LayerTrace never overwrites one).
TRACE_PATTERN = re.compile(r"^memkit_trace_step(\d+|x)(?:_rank(\d+))?(?:-v\d+)?\.json$")
#: MemoryTracker's out-of-memory report: ``memkit_oom_rank{r}.json`` (see lightning_memkit.oom).
OOM_PATTERN = re.compile(r"^memkit_oom_rank(\d+)\.json$")
#: what MemoryDoctor writes at fit end (lightning_memkit.callbacks.memory_doctor.REPORT_FILENAME)
DOCTOR_JSON = "memkit_doctor.json"
COMPARE_JSON = "compare.json"
COMPARE_CSV = "compare.csv"
_EVENTS_GLOB = "events.out.tfevents.*"
#: at most this many files are looked at (a report of a huge tree says so instead of hanging)
MAX_FILES = 200_000


class ReportInputError(MemkitError):
    """The log dir holds nothing the report can show; the message says what is missing and what to do."""


@dataclass
class RunRecords:
    """One run's memory readings: from ``memkit_memory.json`` (exact bytes), or, where a run has none
    (it was killed, or an older memkit), rebuilt from the memory columns of its CSVLogger's
    ``metrics.csv`` (float64 MiB: exact bytes, ``rebuilt_from="metrics.csv"``) or from the scalars
    of its TensorBoard event files (``exact=False``: float32 MiB).

    Attributes:
        name: the run's directory relative to the log dir (``.`` for the log dir itself).
        path: the file read (the JSON, or the run directory for event files).
        summary: the run summary (from the file, or folded from the readings by ``RunSummary.update``).
        history: the readings, oldest first.
        exact: whether the bytes are exact (JSON, CSV) or rounded from TensorBoard's float32 MiB.
        rebuilt_from: ``""`` for ``memkit_memory.json``, else what the readings were rebuilt from
            (``"metrics.csv"``, ``"TensorBoard scalars"``).
    """

    name: str
    path: str
    summary: RunSummary
    history: list[StepReading]
    exact: bool = True
    rebuilt_from: str = ""


@dataclass
class TraceFile:
    """A LayerTrace file ``memkit_trace_step{N}[_rank{r}].json`` (``"format": "lightning-memkit/trace/1"``).

    ``data`` is the parsed JSON; ``step`` and ``rank`` come from the file name.
    """

    name: str
    path: str
    step: int | None
    rank: int
    data: dict[str, Any]


@dataclass
class CompareFile:
    """A ``memkit compare`` result: ``compare.json`` (``"format": "lightning-memkit/compare/1"``)
    and/or ``compare.csv`` at the compare root. ``rows`` are the CSV's rows (header -> text)."""

    name: str
    root: str
    data: dict[str, Any] | None
    csv_header: list[str]
    rows: list[dict[str, str]]


@dataclass
class OomFile:
    """An out-of-memory report ``memkit_oom_rank{r}.json`` written by MemoryTracker when a run ran out.

    ``data`` is the parsed JSON: ``step``, ``error_type``, ``error``, ``failing_step_reading``,
    ``last_readings``, ``summary``, ``cuda_snapshot`` (a path; never opened here) and more.
    """

    name: str
    path: str
    rank: int
    data: dict[str, Any]


@dataclass
class DoctorFile:
    """The memory doctor's verdict ``memkit_doctor.json`` (MemoryDoctor, at fit end): ``data`` is
    :meth:`lightning_memkit.doctor.verdict.DoctorReport.to_dict`'s JSON."""

    name: str
    path: str
    data: dict[str, Any]


@dataclass
class ReportSources:
    """Everything found under a log dir, and what was not.

    Attributes:
        logdir: the directory searched.
        runs: memory readings per run.
        traces: layer-trace files.
        compares: compare results.
        ooms: out-of-memory reports.
        doctors: the memory doctor's verdicts.
        problems: files that looked like memkit's but could not be read, with why.
        missing: one sentence per kind of data that was not found, saying what writes it.
        files_seen: how many files were looked at.
    """

    logdir: str
    runs: list[RunRecords] = field(default_factory=list)
    traces: list[TraceFile] = field(default_factory=list)
    compares: list[CompareFile] = field(default_factory=list)
    ooms: list[OomFile] = field(default_factory=list)
    doctors: list[DoctorFile] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    files_seen: int = 0

    @property
    def empty(self) -> bool:
        """Whether nothing at all can be shown."""
        return not (self.runs or self.traces or self.compares or self.ooms or self.doctors)


def _format_of(data: Any) -> str:
    value = data.get("format", "") if isinstance(data, dict) else ""
    return "/".join(str(value).split("/")[:2])


def _relative(logdir: str, directory: str) -> str:
    name = os.path.relpath(directory, logdir)
    return "." if name == os.curdir else name.replace(os.sep, "/")


def _read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as file:
        return json.load(file)


def _rebuilt_run(
    logdir: str, directory: str, history: list[StepReading], device: str, exact: bool, origin: str
) -> RunRecords | None:
    if not history:
        return None
    return RunRecords(
        _relative(logdir, directory),
        directory,
        rebuilt_summary(history, device),
        history,
        exact=exact,
        rebuilt_from=origin,
    )


@dataclass
class _Walk:
    """What the walk over the log dir saw besides memkit's own files: where readings can be rebuilt from."""

    event_dirs: list[str] = field(default_factory=list)  # directories with TensorBoard event files
    csv_dirs: list[str] = field(default_factory=list)  # directories with a CSVLogger's metrics.csv
    record_dirs: set[str] = field(default_factory=set)  # directories with memkit_memory.json (nothing to rebuild)
    examples: list[str] = field(default_factory=list)  # the first few files seen, for the message when none is ours


def _trace_file(run: str, path: str, match: re.Match[str]) -> TraceFile:
    """The trace file at ``path``, its name matched by :data:`TRACE_PATTERN`."""
    data = _read_json(path)
    if _format_of(data) != TRACE_FORMAT:
        raise ValueError(f'no "format": "{TRACE_FORMAT}/1" key')
    step = int(match.group(1)) if match.group(1).isdigit() else None
    return TraceFile(run, path, step, int(match.group(2) or 0), data)


def _oom_file(run: str, path: str, match: re.Match[str]) -> OomFile:
    """The out-of-memory report at ``path``, its name matched by :data:`OOM_PATTERN`."""
    data = _read_json(path)
    if not isinstance(data, dict) or not {"error_type", "summary"} <= set(data):
        raise ValueError("not a memkit out-of-memory report (no error_type and summary keys)")
    return OomFile(run, path, int(match.group(1)), data)


def _doctor_file(run: str, path: str) -> DoctorFile:
    data = _read_json(path)
    if not isinstance(data, dict) or not {"steps", "leak"} <= set(data):
        raise ValueError("not a memkit doctor report (no steps and leak keys)")
    return DoctorFile(run, path, data)


def _read_file(sources: ReportSources, walk: _Walk, directory: str, name: str, files: list[str]) -> None:
    """Read the file ``name`` of ``directory`` into ``sources`` if it is memkit's; note where readings can be rebuilt
    from. Raises what reading a damaged file raises (the caller says it in ``problems``)."""
    path = os.path.join(directory, name)
    run = _relative(sources.logdir, directory)
    if name == RECORDS_FILENAME:
        summary, history = read_records(path)
        sources.runs.append(RunRecords(run, path, summary, history))
        walk.record_dirs.add(directory)
    elif trace := TRACE_PATTERN.match(name):
        sources.traces.append(_trace_file(run, path, trace))
    elif oom := OOM_PATTERN.match(name):
        sources.ooms.append(_oom_file(run, path, oom))
    elif name == DOCTOR_JSON:
        sources.doctors.append(_doctor_file(run, path))
    elif name == COMPARE_JSON or (name == COMPARE_CSV and COMPARE_JSON not in files):
        sources.compares.append(_read_compare(run, directory, files))
    elif fnmatch.fnmatch(name, _EVENTS_GLOB) and directory not in walk.event_dirs:
        walk.event_dirs.append(directory)
    elif name == CSV_METRICS:
        walk.csv_dirs.append(directory)


def _walk(sources: ReportSources) -> _Walk:
    """Every file under the log dir, in name order, up to :data:`MAX_FILES`."""
    walk = _Walk()
    for directory, subdirs, files in os.walk(sources.logdir):
        subdirs.sort()
        for name in sorted(files):
            sources.files_seen += 1
            if sources.files_seen > MAX_FILES:
                sources.problems.append(f"stopped after {MAX_FILES} files; point memkit report at a smaller directory")
                return walk
            path = os.path.join(directory, name)
            if len(walk.examples) < 5:
                walk.examples.append(os.path.relpath(path, sources.logdir))
            try:
                _read_file(sources, walk, directory, name, files)
            except (OSError, ValueError, KeyError, TypeError) as error:
                sources.problems.append(f"{os.path.relpath(path, sources.logdir)}: cannot read it ({error})")
    return walk


def _add_rebuilt_runs(sources: ReportSources, walk: _Walk) -> None:
    """The runs without ``memkit_memory.json``, rebuilt from their event files or their CSVLogger's rows."""
    logdir = sources.logdir
    for directory in walk.event_dirs:
        if directory in walk.record_dirs:
            continue
        try:
            run = _rebuilt_run(
                logdir,
                directory,
                scalar_readings(directory),
                "? (from TensorBoard scalars)",
                exact=False,
                origin="TensorBoard scalars",
            )
        except Exception as error:  # noqa: BLE001 - a damaged event file must not stop the report
            sources.problems.append(f"{_relative(logdir, directory)}: cannot read its TensorBoard events ({error})")
            continue
        if run is not None:
            sources.runs.append(run)
    for directory in walk.csv_dirs:  # a CSVLogger's run without memkit_memory.json
        if directory in walk.record_dirs:
            continue
        try:
            run = _rebuilt_run(
                logdir, directory, csv_readings(directory), "? (from metrics.csv)", exact=True, origin=CSV_METRICS
            )
        except (OSError, ValueError, csv.Error) as error:
            where = os.path.relpath(os.path.join(directory, CSV_METRICS), logdir)
            sources.problems.append(f"{where}: cannot read it ({error})")
            continue
        if run is None:
            continue
        # The same fit logged to TensorBoard too (loggers=[TensorBoardLogger, CSVLogger]: two directories): one run,
        # from its records or, exact, from the CSV rather than from float32 event scalars.
        same = next((other for other in sources.runs if same_readings(run.history, other.history, other.exact)), None)
        if same is None:
            sources.runs.append(run)
        elif not same.exact:
            sources.runs[sources.runs.index(same)] = run


def _nothing_to_report(sources: ReportSources, examples: list[str]) -> ReportInputError:
    what = "none of them readable as memkit's (see below)" if sources.problems else "none of them memkit's"
    found = (
        f"it holds {sources.files_seen} file(s), e.g. {', '.join(examples)}, {what}"
        if sources.files_seen
        else "it is empty"
    )
    problems = "".join(f"\n  - {p}" for p in sources.problems)
    return ReportInputError(
        f"nothing to report in {sources.logdir}: {found}.{problems}\n"
        "memkit report looks for:\n"
        f"  - {RECORDS_FILENAME} (MemoryTracker writes it at fit end), or TensorBoard event files or a "
        f"{CSV_METRICS} with memory/ scalars\n"
        "  - memkit_trace_step<N>.json (LayerTrace)\n"
        f"  - {COMPARE_JSON} / {COMPARE_CSV} (memkit compare)\n"
        "  - memkit_oom_rank<r>.json (MemoryTracker, when a run runs out of memory)\n"
        f"  - {DOCTOR_JSON} (MemoryDoctor, memkit doctor)\n"
        "Train with MemoryTracker and a logger (e.g. `memkit demo --logdir DIR`), then run `memkit report DIR`."
    )


def find_sources(logdir: str) -> ReportSources:
    """Find memkit's files under ``logdir`` (recursively) and read them.

    Raises:
        ReportInputError: when ``logdir`` is not a directory, or holds nothing memkit wrote
            (the message lists what the report looks for and how to produce it).
    """
    if not os.path.isdir(logdir):
        raise ReportInputError(
            f"{logdir!r} is not a directory; give the log dir of a run trained with memkit "
            "(e.g. the --logdir of `memkit demo`, or lightning_logs)"
        )
    sources = ReportSources(os.path.abspath(logdir))
    walk = _walk(sources)
    _add_rebuilt_runs(sources, walk)
    sources.runs.sort(key=_run_order(sources))
    sources.traces.sort(key=lambda t: (t.name, t.step if t.step is not None else -1, t.rank))
    sources.ooms.sort(key=lambda o: (o.name, o.rank))
    _say_what_is_missing(sources)
    if sources.empty:
        raise _nothing_to_report(sources, walk.examples)
    return sources


def _run_order(sources: ReportSources):
    """Sort key for runs: a comparison's mode runs in the order of its modes, then the others by name."""
    position: dict[str, int] = {}
    for compare in sources.compares:
        for mode in (compare.data or {}).get("modes", []):
            if isinstance(mode, dict) and mode.get("log_dir"):
                position.setdefault(os.path.realpath(str(mode["log_dir"])), len(position))

    def key(run: RunRecords) -> tuple[int, str]:
        directory = run.path if os.path.isdir(run.path) else os.path.dirname(run.path)
        return position.get(os.path.realpath(directory), len(position)), run.name

    return key


def _read_compare(run: str, directory: str, files: list[str]) -> CompareFile:
    data = None
    if COMPARE_JSON in files:
        data = _read_json(os.path.join(directory, COMPARE_JSON))
        if _format_of(data) != COMPARE_FORMAT:
            raise ValueError(f'no "format": "{COMPARE_FORMAT}/1" key')
    header: list[str] = []
    rows: list[dict[str, str]] = []
    if COMPARE_CSV in files:
        with open(os.path.join(directory, COMPARE_CSV), newline="", encoding="utf-8") as file:
            reader = csv.DictReader(file)
            header = list(reader.fieldnames or [])
            rows = [dict(row) for row in reader]
    return CompareFile(run, directory, data, header, rows)


def _say_what_is_missing(sources: ReportSources) -> None:
    if not sources.runs:
        sources.missing.append(
            f"no memory readings: no {RECORDS_FILENAME}, no TensorBoard event file and no "
            f"{CSV_METRICS} with memory/ scalars; add MemoryTracker() to the Trainer's callbacks"
        )
    for origin, detail in (
        ("TensorBoard scalars", ", rounded to float32 MiB"),
        (CSV_METRICS, " (float64 MiB: exact bytes)"),
    ):
        runs = [r for r in sources.runs if r.rebuilt_from == origin]
        # a run with validation readings only was trainer.validate() (or test): MemoryTracker writes the
        # records at fit end, which such a run has not
        evaluated = ", ".join(r.name for r in runs if r.history and all(x.stage != "train" for x in r.history))
        rebuilt = ", ".join(r.name for r in runs if not (r.history and all(x.stage != "train" for x in r.history)))
        if evaluated:
            sources.missing.append(
                f"no {RECORDS_FILENAME} for {evaluated}: a validate-only run (no training step; "
                f"MemoryTracker writes that file at fit end): its readings come from "
                f"{origin}{detail}"
            )
        if rebuilt:
            sources.missing.append(
                f"no {RECORDS_FILENAME} for {rebuilt} (the run did not reach fit end?): its "
                f"readings come from {origin}{detail}"
            )
    if not sources.traces:
        sources.missing.append(
            "no layer trace (memkit_trace_step<N>.json): add LayerTrace() to the callbacks, "
            "or run `memkit trace FILE.py:Module`"
        )
    if not sources.compares:
        sources.missing.append(
            f"no mode comparison ({COMPARE_JSON} / {COMPARE_CSV}): run `memkit compare "
            "FILE.py:Module --modes baseline,amp,checkpoint`"
        )
