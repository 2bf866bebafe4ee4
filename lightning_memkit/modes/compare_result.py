"""The records of a mode comparison: one ModeResult per mode, the CompareResult, and the files they are written to.

compare.csv, compare.json and the figures; :func:`read_compare` reads compare.json back (``memkit report`` does).
"""

from __future__ import annotations

import csv
import dataclasses
import enum
import json
import os
from dataclasses import dataclass, field
from typing import Any

from lightning_memkit.summary_table import format_table
from lightning_memkit.tensorboard.dashboard import markdown_code
from lightning_memkit.timing import TIME_SOURCES, TimeSpread
from lightning_memkit.units import MiB, format_bytes

__all__ = ["COMPARE_FORMAT", "ModeStatus", "ModeResult", "CompareResult", "read_compare", "write_tensorboard_summary"]

#: the ``format`` key of compare.json; bump the number on an incompatible change.
COMPARE_FORMAT = "lightning-memkit/compare/1"
CSV_NAME = "compare.csv"
JSON_NAME = "compare.json"
PEAK_FIGURE = "compare_peak_memory.png"
STEPS_FIGURE = "compare_memory_per_step.png"
#: fewer timed steps than this and the table says the spread is unreliable.
MIN_TIMED_STEPS = 10


class ModeStatus(str, enum.Enum):
    """Whether a mode's run finished: a string (``"ok"``, ``"failed"``) in compare.json and compare.csv."""

    OK = "ok"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


@dataclass
class ModeResult:
    """One mode's run. Bytes in bytes, times in seconds; ratios are this mode / the baseline.

    Attributes:
        mode: the mode's name (also its TensorBoard run name).
        precision: the Lightning precision flag used (``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``).
        checkpoint: the checkpoint policy's description, or ``None``.
        status: :class:`ModeStatus`, a string: ``"ok"`` or ``"failed"`` (then ``error`` says why; other fields may
            be ``None``).
        error: the exception's type and message for a failed mode.
        steps: training steps run.
        batch_size: samples per training batch (first tensor's first dimension), when known.
        peak_allocated_bytes: highest per-step peak: CUDA peak allocated, or on CPU the exact peak
            tensor bytes from the accountant (see ``peak_source``).
        peak_source: the StepReading field the peak comes from, the same for every step: ``peak_allocated_bytes``
            (CUDA), else ``peak_tensor_bytes`` (the accountant), else ``host_peak_rss_bytes``.
        peak_reserved_bytes: CUDA only: highest per-step peak reserved by the caching allocator.
        median_step_time_s: median time of a training step (batch start to batch end) over the timed
            steps (those after ``warmup_steps``), including memkit's probes. On CUDA it is GPU time
            (CUDA events), elsewhere wall time; ``time_source`` says which (see docs/modes.md).
        step_time_q1_s, step_time_q3_s: first and third quartiles of the timed steps' times (seconds).
        step_time_min_s, step_time_max_s: the fastest and slowest timed step (seconds).
        warmup_steps: the first steps left out of the timing (checkpoint measuring, optimizer state
            creation, allocator and kernel warm-up happen there).
        timed_steps: how many steps the median and spread are over.
        time_source: ``"cuda_events"`` or ``"perf_counter"`` (see ``lightning_memkit.timing.TIME_SOURCES``).
        step_time_within_noise: whether this mode's step-time interquartile range overlaps the
            baseline's (then ``step_time_ratio`` is within noise); ``None`` for the baseline itself.
        throughput_samples_per_s: ``batch_size / median_step_time_s``.
        final_train_loss: the loss returned by the last training step.
        val_metric_name / val_metric: the validation metric (``val_acc``-like when logged, else ``val_loss``).
        val_metrics: every logged metric whose name starts with ``val``.
        peak_ratio, peak_reserved_ratio, step_time_ratio, throughput_ratio: against the baseline mode.
        checkpoint_regions: how many regions were checkpointed.
        checkpoint_predicted_saving_bytes: the checkpoint plan's predicted activation saving.
        checkpoint_names: the names of the checkpointed regions (the plan's ``names``).
        counterpart: for a checkpoint mode, the mode of the same precision without checkpointing that its
            peak is judged against (``checkpoint`` vs ``baseline``, ``amp+checkpoint`` vs ``amp``), when run.
        counterpart_peak_bytes: the counterpart's peak (bytes).
        counterpart_peak_ratio: this mode's peak / the counterpart's.
        checkpoint_helped: ``False`` when the peak is *not below* the counterpart's (checkpointing made it
            no better, or worse: the table marks it and a
            :class:`~lightning_memkit.modes.comparison.CheckpointWarning` is issued), ``True``
            when it is below, ``None`` without a counterpart.
        step_peaks: ``[[step, peak_bytes], ...]`` for every measured training step.
        step_times_s: every step's time (seconds, ``time_source``), in order, warm-up included.
        log_dir: this mode's TensorBoard run directory.
    """

    mode: str
    precision: str | None = None
    checkpoint: str | None = None
    status: ModeStatus = ModeStatus.OK
    error: str | None = None
    steps: int = 0
    batch_size: int | None = None
    peak_allocated_bytes: int | None = None
    peak_source: str | None = None
    peak_reserved_bytes: int | None = None
    median_step_time_s: float | None = None
    step_time_q1_s: float | None = None
    step_time_q3_s: float | None = None
    step_time_min_s: float | None = None
    step_time_max_s: float | None = None
    warmup_steps: int | None = None
    timed_steps: int | None = None
    time_source: str | None = None
    step_time_within_noise: bool | None = None
    throughput_samples_per_s: float | None = None
    final_train_loss: float | None = None
    val_metric_name: str | None = None
    val_metric: float | None = None
    val_metrics: dict[str, float] = field(default_factory=dict)
    peak_ratio: float | None = None
    peak_reserved_ratio: float | None = None
    step_time_ratio: float | None = None
    throughput_ratio: float | None = None
    checkpoint_regions: int | None = None
    checkpoint_predicted_saving_bytes: int | None = None
    checkpoint_names: list[str] = field(default_factory=list)
    counterpart: str | None = None
    counterpart_peak_bytes: int | None = None
    counterpart_peak_ratio: float | None = None
    checkpoint_helped: bool | None = None
    step_peaks: list[list[int]] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    log_dir: str | None = None

    #: the columns of compare.csv (per-step lists, region names and the val_metrics dict are JSON-only)
    CSV_COLUMNS = (
        "mode",
        "status",
        "precision",
        "checkpoint",
        "steps",
        "batch_size",
        "peak_allocated_bytes",
        "peak_source",
        "peak_reserved_bytes",
        "median_step_time_s",
        "throughput_samples_per_s",
        "final_train_loss",
        "val_metric_name",
        "val_metric",
        "peak_ratio",
        "peak_reserved_ratio",
        "step_time_ratio",
        "throughput_ratio",
        "checkpoint_regions",
        "checkpoint_predicted_saving_bytes",
        "log_dir",
        "error",
        "step_time_q1_s",
        "step_time_q3_s",
        "step_time_min_s",
        "step_time_max_s",
        "warmup_steps",
        "timed_steps",
        "time_source",
        "step_time_within_noise",
        "counterpart",
        "counterpart_peak_bytes",
        "counterpart_peak_ratio",
        "checkpoint_helped",
    )

    def __post_init__(self) -> None:
        self.status = ModeStatus(self.status)  # read back from JSON as its string

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModeResult:
        """Inverse of :meth:`to_dict`; unknown keys are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    @property
    def step_time_spread(self) -> TimeSpread | None:
        """The timed steps' spread (seconds), or ``None`` when there were none (older files: the median only)."""
        if self.median_step_time_s is None or self.step_time_q1_s is None or self.step_time_q3_s is None:
            return None
        return TimeSpread(
            self.timed_steps or 0,
            self.median_step_time_s,
            self.step_time_q1_s,
            self.step_time_q3_s,
            self.step_time_min_s if self.step_time_min_s is not None else self.step_time_q1_s,
            self.step_time_max_s if self.step_time_max_s is not None else self.step_time_q3_s,
        )

    def checkpoint_warning(self) -> str | None:
        """The sentence saying this checkpoint mode did not lower the peak (``None`` when it did, or cannot be
        judged)."""
        if self.checkpoint_helped is not False:
            return None
        more = len(self.checkpoint_names) - 6
        names = ", ".join(self.checkpoint_names[:6]) + (f", ... ({more} more)" if more > 0 else "")
        wrapped = (
            f"{self.checkpoint_regions} region(s): {names}"
            if self.checkpoint_regions is not None
            else "an unknown plan"
        )
        difference = (self.peak_allocated_bytes or 0) - (self.counterpart_peak_bytes or 0)
        relation = f"{format_bytes(difference)} higher than" if difference > 0 else "the same as"
        return (
            f"checkpointing did not lower the peak: {self.mode} peaks at "
            f"{format_bytes(self.peak_allocated_bytes)}, {relation} {self.counterpart} (same precision, no "
            f"checkpointing: {format_bytes(self.counterpart_peak_bytes)}, {self.counterpart_peak_ratio:.2f}x); "
            f"policy {self.checkpoint} wrapped {wrapped}. The wrapped blocks' saved activations are not what sets "
            "this peak (it may be parameters, optimizer state, a block outside them, or the recompute itself); "
            "try another policy or see the layer trace"
        )


@dataclass
class CompareResult:
    """All modes of one comparison, the baseline they are compared with, and where files went.

    Attributes:
        results: one :class:`ModeResult` per mode, in the order asked.
        baseline: the name of the mode ratios are taken against.
        device: the device trained on, e.g. ``"cpu"`` or ``"cuda:0"``.
        max_steps: training steps per mode.
        seed: the seed every mode started from.
        root_dir: the TensorBoard root (one run per mode under it) where the files are written.
        files: name -> path of what was written (``csv``, ``json``, ``peak_figure``, ``steps_figure``).
    """

    results: list[ModeResult]
    baseline: str | None
    device: str
    max_steps: int
    seed: int
    root_dir: str
    files: dict[str, str] = field(default_factory=dict)

    def __getitem__(self, name: str) -> ModeResult:
        for result in self.results:
            if result.mode == name:
                return result
        raise KeyError(f"no mode {name!r}; modes: {', '.join(r.mode for r in self.results)}")

    def to_dict(self) -> dict[str, Any]:
        """The compare.json document (see docs/modes.md for the schema)."""
        return {
            "format": COMPARE_FORMAT,
            "baseline": self.baseline,
            "device": self.device,
            "max_steps": self.max_steps,
            "seed": self.seed,
            "root_dir": self.root_dir,
            "modes": [r.to_dict() for r in self.results],
        }

    @property
    def time_source(self) -> str | None:
        """What the step times are (``"cuda_events"``, ``"perf_counter"``), from the modes that ran."""
        return next((r.time_source for r in self.results if r.time_source), None)

    def format_table(self) -> str:
        """The comparison as a fixed-width text table, with what is timed and the notes below it.

        ``step ms`` is the median over the timed steps and ``IQR ms`` the middle half of them; a time
        ratio marked ``~`` is within noise (the two modes' IQRs overlap). A checkpoint mode whose peak
        is not below its counterpart's is marked ``!`` in ``vs no-ckpt``.
        """
        headers = (
            "mode",
            "peak",
            "vs base",
            "vs no-ckpt",
            "peak reserved",
            "step ms",
            "IQR ms",
            "vs base",
            "samples/s",
            "train loss",
            "validation",
        )
        lines = [
            f"memkit compare ({self.device}, {self.max_steps} steps, ratios vs {self.baseline})",
            format_table(headers, [_table_row(r) for r in self.results]),
        ]
        lines += _timing_notes([r for r in self.results if r.status == ModeStatus.OK and r.timed_steps])
        if any(r.counterpart_peak_ratio is not None for r in self.results):
            lines.append("vs no-ckpt: peak / the peak of the same precision without checkpointing.")
        lines += [
            f"! {r.checkpoint_warning()}."
            for r in self.results
            if r.status == ModeStatus.OK and r.checkpoint_helped is False
        ]
        return "\n".join(lines)

    def write(self, directory: str | None = None, figures: bool = True) -> dict[str, str]:
        """Write compare.csv, compare.json and (with ``figures``) the two PNG figures into ``directory``
        (default: :attr:`root_dir`); returns their paths by kind."""
        directory = directory or self.root_dir
        os.makedirs(directory, exist_ok=True)
        csv_path = os.path.join(directory, CSV_NAME)
        with open(csv_path, "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=ModeResult.CSV_COLUMNS, extrasaction="ignore")
            writer.writeheader()
            for result in self.results:
                writer.writerow({k: ("" if v is None else v) for k, v in result.to_dict().items()})
        self.files["csv"] = csv_path
        if figures:
            self.files.update(_write_figures(self, directory))
        json_path = os.path.join(directory, JSON_NAME)
        self.files["json"] = json_path
        with open(json_path, "w") as file:
            json.dump(dict(self.to_dict(), files=self.files), file, indent=1)
        return dict(self.files)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _table_row(r: ModeResult) -> tuple[str, ...]:
    """One mode's row of :meth:`CompareResult.format_table`."""
    if r.status != ModeStatus.OK:
        return (r.mode, "failed", "", "", "", "", "", "", "", "", (r.error or "")[:48])
    iqr = "-" if r.step_time_q1_s is None else f"{_ms(r.step_time_q1_s)}-{_ms(r.step_time_q3_s)}"
    time_ratio = _ratio(r.step_time_ratio) + (" ~" if r.step_time_within_noise else "")
    counterpart = "-"
    if r.counterpart_peak_ratio is not None:
        counterpart = _ratio(r.counterpart_peak_ratio) + (" !" if r.checkpoint_helped is False else "")
    return (
        r.mode,
        format_bytes(r.peak_allocated_bytes),
        _ratio(r.peak_ratio),
        counterpart,
        format_bytes(r.peak_reserved_bytes),
        _ms(r.median_step_time_s),
        iqr,
        time_ratio,
        "-" if r.throughput_samples_per_s is None else f"{r.throughput_samples_per_s:.1f}",
        "-" if r.final_train_loss is None else f"{r.final_train_loss:.4f}",
        "-" if r.val_metric is None else f"{r.val_metric_name}={r.val_metric:.4f}",
    )


def _timing_notes(timed: list[ModeResult]) -> list[str]:
    """What the table's step times are (the modes that were timed), and when to trust them less."""
    if not timed:
        return []
    first = timed[0]
    source = TIME_SOURCES.get(first.time_source or "", first.time_source or "unknown clock")
    lines = [
        f"step ms: median of {first.timed_steps} timed steps after {first.warmup_steps} warm-up step(s), "
        f"batch start to batch end, memkit's probes included; {source}. IQR ms: the middle half of those steps."
    ]
    if any(r.step_time_within_noise for r in timed):
        lines.append(
            "~ within noise: this mode's IQR overlaps the baseline's, so the time difference is smaller "
            "than the step-to-step spread."
        )
    fewest = min(r.timed_steps or 0 for r in timed)
    if fewest < MIN_TIMED_STEPS:
        lines.append(
            f"only {fewest} timed step(s): the median and spread are unreliable; "
            f"run at least {MIN_TIMED_STEPS + (first.warmup_steps or 0)} steps (--steps)."
        )
    return lines


def read_compare(path: str) -> CompareResult:
    """Read a compare.json (or the directory holding it).

    Raises:
        ValueError: if the file is not a memkit compare file.
    """
    if os.path.isdir(path):
        path = os.path.join(path, JSON_NAME)
    with open(path) as file:
        data = json.load(file)
    if not isinstance(data, dict) or str(data.get("format", "")).split("/")[:2] != ["lightning-memkit", "compare"]:
        raise ValueError(f"{path} is not a memkit compare file (written by compare_modes / memkit compare)")
    return CompareResult(
        [ModeResult.from_dict(m) for m in data["modes"]],
        data.get("baseline"),
        data.get("device", "cpu"),
        data.get("max_steps", 0),
        data.get("seed", 0),
        data.get("root_dir", os.path.dirname(path)),
        data.get("files", {}),
    )


# ---------------------------------------------------------------------------------------------- figures
def _write_figures(compare: CompareResult, directory: str) -> dict[str, str]:
    from lightning_memkit.tensorboard.figures import compare_figures  # matplotlib: heavy, only when drawn

    paths = {}
    for key, figure in compare_figures(compare).items():
        path = os.path.join(directory, PEAK_FIGURE if key == "peak_figure" else STEPS_FIGURE)
        figure.savefig(path, dpi=100)
        paths[key] = path
    return paths


def write_tensorboard_summary(compare: CompareResult) -> str:
    """Figures and the table in a ``compare`` run under the root (the per-mode runs hold the scalars)."""
    # TensorBoard's writer and matplotlib: heavy, only when a comparison is written
    from torch.utils.tensorboard import SummaryWriter

    from lightning_memkit.tensorboard.figures import compare_figures  # deferred: matplotlib, as above

    log_dir = os.path.join(compare.root_dir, "compare")
    writer = SummaryWriter(log_dir)
    try:
        for key, figure in compare_figures(compare).items():
            writer.add_figure(f"memkit/compare/{key}", figure, global_step=compare.max_steps, close=False)
        writer.add_text("memkit/compare/table", markdown_code(compare.format_table()), global_step=compare.max_steps)
        for r in compare.results:
            if r.peak_allocated_bytes is not None:
                writer.add_scalar(f"memkit/compare/peak_MiB/{r.mode}", r.peak_allocated_bytes / MiB, compare.max_steps)
    finally:
        writer.close()
    return log_dir
