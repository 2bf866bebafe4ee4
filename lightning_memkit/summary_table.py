"""Plain-text tables of memory records, for the terminal and TensorBoard's text tab."""

from __future__ import annotations

from collections.abc import Sequence

from lightning_memkit.records import RunSummary, StepReading
from lightning_memkit.units import format_bytes

__all__ = ["format_table", "format_summary", "where_readings_went", "fit_ended", "EARLIER_FIT_NOTE"]

# fits a MemoryTracker saw end in this process, and whether the note on an earlier fit's tensors was printed (once)
_PROCESS = {"fits_ended": 0, "earlier_fit_said": False}
#: the note printed (once per process, with the summary) when an earlier fit ran in the same process (a notebook)
EARLIER_FIT_NOTE = (
    "memkit MemoryTracker: an earlier fit ran in this process. The readings count every live tensor "
    "of the process (on CUDA, everything allocated on the device), so tensors an earlier fit left "
    "alive (a model, trainer or outputs still referenced, e.g. in a notebook) are in them; delete "
    "those references (and run gc.collect()) before fit to read this run's memory alone."
)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]], left_columns: int = 1) -> str:
    """A fixed-width table; the first ``left_columns`` columns are left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        padded = (
            c.ljust(w) if i < left_columns else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        return "  ".join(padded).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])


def format_summary(summary: RunSummary, history: Sequence[StepReading] = ()) -> str:
    """The run summary as a table: the peak, where it happened, capacity and headroom."""
    rows = [
        ("device", summary.device),
        ("run peak", f"{format_bytes(summary.peak_bytes)} ({summary.peak_source or 'no reading'})"),
        ("peak at", f"step {summary.peak_step} ({summary.peak_stage})" if summary.peak_step is not None else "-"),
        ("capacity", format_bytes(summary.capacity_bytes)),
    ]
    if summary.peak_fraction is not None:
        rows.append(("peak / capacity", f"{summary.peak_fraction:.1%}"))
    if summary.peak_reserved_bytes is not None:
        rows.append(("peak reserved", format_bytes(summary.peak_reserved_bytes)))
    if summary.max_fragmentation_bytes is not None:
        rows.append(("max fragmentation", format_bytes(summary.max_fragmentation_bytes)))
    if summary.alloc_retries is not None:
        rows.append(("allocator retries", str(summary.alloc_retries)))
    last = history[-1] if history else None
    if last is not None and last.host_rss_bytes is not None:
        rows.append(("host RSS (last step)", format_bytes(last.host_rss_bytes)))
    leak = summary.extra.get("leak")
    if leak:
        rows.append(
            (
                "memory growth",
                f"{format_bytes(leak['bytes_per_measured_step'])} per measured step from step "
                f"{leak['first_step']} (a leak unless freed at epoch end)",
            )
        )
    search = summary.extra.get("batch_search")
    if isinstance(search, str):  # MaxBatchSize's peak measures something else than the run peak: said once, here
        rows.append(("batch-size search", search))
    compiled = summary.extra.get("compiled")
    if compiled:
        rows.append(("compiled model", f"{', '.join(compiled['parts'])}: {compiled['measured']}"))
    rows.append(("training steps measured", str(summary.train_steps_measured)))
    if summary.peak_source and summary.train_steps_with_peak < summary.train_steps_measured:
        rows.append(
            (
                "steps with the peak",
                f"{summary.train_steps_with_peak} of {summary.train_steps_measured} "
                f"training steps ({summary.peak_source} is sampled)",
            )
        )
    if summary.validation_runs_measured:
        rows.append(("validation runs measured", str(summary.validation_runs_measured)))
    return "memkit memory summary\n" + format_table(("measure", "value"), rows, left_columns=2)


def where_readings_went(
    loggers: Sequence[str], every_n_steps: int, log_every_n_steps: int, records_path: str | None
) -> str:
    """One line under the printed summary: where a user finds the per-step readings of a run logged by ``loggers``
    (their class names), measured every ``every_n_steps``, whose records file is ``records_path``."""
    if not loggers:
        where = "no logger, so nothing was logged"
    elif every_n_steps == 1 and not log_every_n_steps:
        where = f"{', '.join(loggers)}: the summary only (log_every_n_steps=0: Lightning logs no step)"
    elif every_n_steps == 1:
        where = f"{', '.join(loggers)} at the steps Lightning logs (log_every_n_steps={log_every_n_steps})"
    else:
        where = ", ".join(loggers)
    file = records_path or "no file (MemoryTracker(records_file=...) or .save_records(path) writes one)"
    return f"memkit readings: {where}; every measured step on this tracker's .history; records: {file}"


def fit_ended(summary: RunSummary, history: Sequence[StepReading], where: str | None) -> None:
    """A tracked fit ended (global rank zero): print its summary table and ``where`` its readings went (``None``:
    print nothing), and, the first time a later fit of this process prints, :data:`EARLIER_FIT_NOTE`."""
    if where is not None:
        print(format_summary(summary, list(history)))
        print(where)
        if _PROCESS["fits_ended"] and not _PROCESS["earlier_fit_said"]:
            _PROCESS["earlier_fit_said"] = True
            print(EARLIER_FIT_NOTE)
    _PROCESS["fits_ended"] += 1
