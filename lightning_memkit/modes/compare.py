"""compare_modes: train the same LightningModule in several memory modes and put memory, speed and
accuracy side by side (returned, printed, CSV/JSON, figures, one TensorBoard run per mode).

Each mode gets a fresh model and data from the factories, the same seed, and a MemoryTracker.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import re
import traceback
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from lightning_memkit.modes.mode import Mode, parse_modes
from lightning_memkit.summary_table import format_table
from lightning_memkit.timing import TIME_SOURCES, StepTimer, TimeSpread, time_spread, within_noise
from lightning_memkit.units import MiB, format_bytes

__all__ = ["COMPARE_FORMAT", "ModeResult", "CompareResult", "CheckpointWarning", "compare_modes", "read_compare", "progress_line"]

#: the ``format`` key of compare.json; bump the number on an incompatible change.
COMPARE_FORMAT = "lightning-memkit/compare/1"
CSV_NAME = "compare.csv"
JSON_NAME = "compare.json"
PEAK_FIGURE = "compare_peak_memory.png"
STEPS_FIGURE = "compare_memory_per_step.png"
#: fewer timed steps than this and the table says the spread is unreliable.
MIN_TIMED_STEPS = 10
#: StepReading peak fields, best first: a mode's peak comes from the first one its readings have.
PEAK_SOURCES = ("peak_allocated_bytes", "peak_tensor_bytes", "host_peak_rss_bytes")


class CheckpointWarning(UserWarning):
    """A checkpoint mode whose peak is not below the same precision's mode without checkpointing."""


@dataclass
class ModeResult:
    """One mode's run. Bytes in bytes, times in seconds; ratios are this mode / the baseline.

    Attributes:
        mode: the mode's name (also its TensorBoard run name).
        precision: the Lightning precision flag used (``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``).
        checkpoint: the checkpoint policy's description, or ``None``.
        status: ``"ok"`` or ``"failed"`` (then ``error`` says why; other fields may be ``None``).
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
            no better, or worse: the table marks it and a :class:`CheckpointWarning` is issued), ``True``
            when it is below, ``None`` without a counterpart.
        step_peaks: ``[[step, peak_bytes], ...]`` for every measured training step.
        step_times_s: every step's time (seconds, ``time_source``), in order, warm-up included.
        log_dir: this mode's TensorBoard run directory.
    """

    mode: str
    precision: str | None = None
    checkpoint: str | None = None
    status: str = "ok"
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
        "mode", "status", "precision", "checkpoint", "steps", "batch_size", "peak_allocated_bytes", "peak_source",
        "peak_reserved_bytes", "median_step_time_s", "throughput_samples_per_s", "final_train_loss", "val_metric_name",
        "val_metric", "peak_ratio", "peak_reserved_ratio", "step_time_ratio", "throughput_ratio", "checkpoint_regions",
        "checkpoint_predicted_saving_bytes", "log_dir", "error",
        "step_time_q1_s", "step_time_q3_s", "step_time_min_s", "step_time_max_s", "warmup_steps", "timed_steps",
        "time_source", "step_time_within_noise", "counterpart", "counterpart_peak_bytes", "counterpart_peak_ratio",
        "checkpoint_helped",
    )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModeResult":
        """Inverse of :meth:`to_dict`; unknown keys are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    @property
    def step_time_spread(self) -> TimeSpread | None:
        """The timed steps' spread (seconds), or ``None`` when there were none (older files: the median only)."""
        if self.median_step_time_s is None or self.step_time_q1_s is None or self.step_time_q3_s is None:
            return None
        return TimeSpread(self.timed_steps or 0, self.median_step_time_s, self.step_time_q1_s, self.step_time_q3_s,
                          self.step_time_min_s if self.step_time_min_s is not None else self.step_time_q1_s,
                          self.step_time_max_s if self.step_time_max_s is not None else self.step_time_q3_s)

    def checkpoint_warning(self) -> str | None:
        """The sentence saying this checkpoint mode did not lower the peak (``None`` when it did, or cannot be judged)."""
        if self.checkpoint_helped is not False:
            return None
        names = ", ".join(self.checkpoint_names[:6]) + (f", ... ({len(self.checkpoint_names) - 6} more)" if len(self.checkpoint_names) > 6 else "")
        wrapped = f"{self.checkpoint_regions} region(s): {names}" if self.checkpoint_regions is not None else "an unknown plan"
        difference = (self.peak_allocated_bytes or 0) - (self.counterpart_peak_bytes or 0)
        relation = f"{format_bytes(difference)} higher than" if difference > 0 else "the same as"
        return (f"checkpointing did not lower the peak: {self.mode} peaks at {format_bytes(self.peak_allocated_bytes)}, "
                f"{relation} {self.counterpart} (same precision, no checkpointing: {format_bytes(self.counterpart_peak_bytes)}, "
                f"{self.counterpart_peak_ratio:.2f}x); policy {self.checkpoint} wrapped {wrapped}. The wrapped blocks' saved "
                "activations are not what sets this peak (it may be parameters, optimizer state, a block outside them, or "
                "the recompute itself); try another policy or see the layer trace")


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
        def ratio(value: float | None) -> str:
            return "-" if value is None else f"{value:.2f}x"

        def ms(value: float | None) -> str:
            return "-" if value is None else f"{value * 1000:.1f}"

        rows = []
        notes = []
        for r in self.results:
            if r.status != "ok":
                rows.append((r.mode, "failed", "", "", "", "", "", "", "", "", (r.error or "")[:48]))
                continue
            iqr = "-" if r.step_time_q1_s is None else f"{ms(r.step_time_q1_s)}-{ms(r.step_time_q3_s)}"
            time_ratio = ratio(r.step_time_ratio) + (" ~" if r.step_time_within_noise else "")
            counterpart = "-"
            if r.counterpart_peak_ratio is not None:
                counterpart = ratio(r.counterpart_peak_ratio) + (" !" if r.checkpoint_helped is False else "")
            rows.append((
                r.mode, format_bytes(r.peak_allocated_bytes), ratio(r.peak_ratio), counterpart, format_bytes(r.peak_reserved_bytes),
                ms(r.median_step_time_s), iqr, time_ratio, "-" if r.throughput_samples_per_s is None else f"{r.throughput_samples_per_s:.1f}",
                "-" if r.final_train_loss is None else f"{r.final_train_loss:.4f}",
                "-" if r.val_metric is None else f"{r.val_metric_name}={r.val_metric:.4f}",
            ))
            if r.checkpoint_helped is False:
                notes.append(f"! {r.checkpoint_warning()}.")
        headers = ("mode", "peak", "vs base", "vs no-ckpt", "peak reserved", "step ms", "IQR ms", "vs base", "samples/s",
                   "train loss", "validation")
        lines = [f"memkit compare ({self.device}, {self.max_steps} steps, ratios vs {self.baseline})", format_table(headers, rows)]
        timed = [r for r in self.results if r.status == "ok" and r.timed_steps]
        if timed:
            first = timed[0]
            source = TIME_SOURCES.get(first.time_source or "", first.time_source or "unknown clock")
            lines.append(f"step ms: median of {first.timed_steps} timed steps after {first.warmup_steps} warm-up step(s), "
                         f"batch start to batch end, memkit's probes included; {source}. IQR ms: the middle half of those steps.")
            if any(r.step_time_within_noise for r in timed):
                lines.append("~ within noise: this mode's IQR overlaps the baseline's, so the time difference is smaller than "
                             "the step-to-step spread.")
            if min(r.timed_steps for r in timed) < MIN_TIMED_STEPS:
                lines.append(f"only {min(r.timed_steps for r in timed)} timed step(s): the median and spread are unreliable; "
                             f"run at least {MIN_TIMED_STEPS + (first.warmup_steps or 0)} steps (--steps).")
        if any(r.counterpart_peak_ratio is not None for r in self.results):
            lines.append("vs no-ckpt: peak / the peak of the same precision without checkpointing.")
        lines.extend(notes)
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
    return CompareResult([ModeResult.from_dict(m) for m in data["modes"]], data.get("baseline"), data.get("device", "cpu"),
                         data.get("max_steps", 0), data.get("seed", 0), data.get("root_dir", os.path.dirname(path)), data.get("files", {}))


# ---------------------------------------------------------------------------------------------- figures
def _write_figures(compare: CompareResult, directory: str) -> dict[str, str]:
    from lightning_memkit.tensorboard.figures import compare_figures

    paths = {}
    for key, figure in compare_figures(compare).items():
        path = os.path.join(directory, PEAK_FIGURE if key == "peak_figure" else STEPS_FIGURE)
        figure.savefig(path, dpi=100)
        paths[key] = path
    return paths


def _write_tensorboard_summary(compare: CompareResult) -> str:
    """Figures and the table in a ``compare`` run under the root (the per-mode runs hold the scalars)."""
    from torch.utils.tensorboard import SummaryWriter

    from lightning_memkit.tensorboard.dashboard import markdown_code
    from lightning_memkit.tensorboard.figures import compare_figures

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


# ---------------------------------------------------------------------------------------------- running
def _run_name(mode: Mode) -> str:
    return re.sub(r"[^A-Za-z0-9_.+=-]+", "_", mode.name)


def _first_batch_size(batch: Any) -> int | None:
    from torch.utils._pytree import tree_flatten

    import torch

    for leaf in tree_flatten(batch)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return None


def _step_recorder():
    from lightning.pytorch import Callback

    class _StepRecorder(Callback):
        """Time, last loss and batch size of the training steps (thin: the timing is lightning_memkit.timing).

        Nothing here waits for the device during the run: the step times are CUDA events on CUDA, and
        the loss is kept as the last step's (detached) tensor and read once training has ended.
        """

        #: puts the "modes compared" charts on memkit's TensorBoard dashboard (tensorboard/dashboard.py)
        memkit_dashboard_options = {"compare": True}

        def __init__(self) -> None:
            self.timer: StepTimer | None = None
            self.final_loss: float | None = None
            self.batch_size: int | None = None
            self._last_loss: Any = None

        def on_train_start(self, trainer, pl_module) -> None:
            self.timer = StepTimer(trainer.strategy.root_device)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if self.batch_size is None:
                self.batch_size = _first_batch_size(batch)
            if self.timer is not None:
                self.timer.cancel()  # a window left open by a step that returned None
                self.timer.start()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if self.timer is not None and self.timer.running:
                self.timer.stop()
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if loss is not None and hasattr(loss, "detach"):
                self._last_loss = loss.detach()  # read at train end: float() here would wait for the device every step

        def on_train_end(self, trainer, pl_module) -> None:
            if self._last_loss is not None:
                self.final_loss = float(self._last_loss.float().cpu())
                self._last_loss = None

        def step_times_s(self) -> list[float]:
            """Every step's time in seconds (waits for the device's last steps: call after the fit)."""
            return self.timer.times_s() if self.timer is not None else []

    return _StepRecorder()


def _release_previous_mode() -> None:
    """Free what the previous mode left to the cycle collector (Trainer <-> module cycles keep a model,
    its gradients and optimizer state alive until a collection): on CUDA, and in the CPU reading of every
    live tensor, the next mode's peak would count them."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the next mode's peak reserved starts from an empty cache too


def _pick_val_metric(metrics: dict[str, float], wanted: str | None) -> tuple[str | None, float | None]:
    if wanted is not None:
        return wanted, metrics.get(wanted)
    for key in sorted(metrics):
        if "acc" in key:
            return key, metrics[key]
    for key in sorted(metrics):
        if key.startswith("val"):
            return key, metrics[key]
    return None, None


def _run_mode(mode: Mode, model_factory: Callable[[], Any], datamodule_factory: Callable[[], Any] | None, *, max_steps: int,
              accelerator: Any, devices: Any, root_dir: str, seed: int, val_batches: int, val_metric: str | None,
              trainer_kwargs: dict[str, Any], verbose: bool, warmup_steps: int) -> ModeResult:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_memkit.callbacks.memory_tracker import MemoryTracker

    result = ModeResult(mode=mode.name, checkpoint=mode.to_dict()["checkpoint"])
    logger = TensorBoardLogger(root_dir, name=_run_name(mode), version="", default_hp_metric=False)
    result.log_dir = os.path.abspath(logger.log_dir)
    try:
        mode_kwargs = mode.trainer_kwargs(accelerator, verbose=verbose) if mode.checkpoint is not None else mode.trainer_kwargs(accelerator)
        result.precision = mode_kwargs["precision"]
        pl.seed_everything(seed, verbose=False)
        model = model_factory()
        datamodule = datamodule_factory() if datamodule_factory is not None else None
        tracker = MemoryTracker(verbose=False, tensor_peak_every_n_steps=1)  # CPU: the exact peak of every step
        recorder = _step_recorder()
        options = dict(
            accelerator=accelerator, devices=devices, max_steps=max_steps, logger=logger, default_root_dir=root_dir,
            val_check_interval=max_steps, check_val_every_n_epoch=None, limit_val_batches=val_batches, num_sanity_val_steps=0,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
        )
        options.update(trainer_kwargs)
        options["precision"] = mode_kwargs["precision"]
        options["callbacks"] = [*mode_kwargs["callbacks"], tracker, recorder, *trainer_kwargs.get("callbacks", [])]
        trainer = pl.Trainer(**options)
        trainer.fit(model, datamodule=datamodule)
    except Exception as error:  # a mode this device cannot run, or OOM: report it and go on with the others
        result.status = "failed"
        result.error = f"{type(error).__name__}: {error}"
        if verbose:
            traceback.print_exc()
        return result
    train = [r for r in tracker.history if r.stage == "train"]
    result.steps = trainer.global_step
    # one source for every step (a step without the CUDA or accountant peak must not fall back to host RSS)
    source = next((f for f in PEAK_SOURCES if any(getattr(r, f) is not None for r in train)), None)
    train = [r for r in train if source is not None and getattr(r, source) is not None]
    result.step_peaks = [[r.step, int(getattr(r, source))] for r in train]
    if train:
        result.peak_allocated_bytes = max(peak for _, peak in result.step_peaks)
        result.peak_source = source
        reserved = [r.peak_reserved_bytes for r in train if r.peak_reserved_bytes is not None]
        result.peak_reserved_bytes = max(reserved) if reserved else None
    times = recorder.step_times_s()
    result.step_times_s = times
    result.time_source = recorder.timer.source if recorder.timer is not None else None
    result.batch_size = recorder.batch_size
    result.warmup_steps = min(warmup_steps, len(times) // 2)
    spread = time_spread(times[result.warmup_steps:])
    if spread is not None:
        result.timed_steps = spread.count
        result.median_step_time_s = spread.median_s
        result.step_time_q1_s, result.step_time_q3_s = spread.q1_s, spread.q3_s
        result.step_time_min_s, result.step_time_max_s = spread.min_s, spread.max_s
        if recorder.batch_size:
            result.throughput_samples_per_s = recorder.batch_size / result.median_step_time_s
    result.final_train_loss = recorder.final_loss
    metrics = {}
    for key, value in trainer.callback_metrics.items():
        if key.startswith("val"):
            try:
                metrics[key] = float(value)
            except (TypeError, ValueError):
                pass
    result.val_metrics = metrics
    result.val_metric_name, result.val_metric = _pick_val_metric(metrics, val_metric)
    for callback in mode_kwargs["callbacks"]:
        plan = getattr(callback, "plan", None)
        if plan is not None:
            result.checkpoint_regions = plan.count
            result.checkpoint_names = list(plan.names)
            result.checkpoint_predicted_saving_bytes = plan.predicted_saving_bytes
    return result


def _ratios(results: list[ModeResult], baseline: ModeResult | None) -> None:
    def div(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else a / b

    for r in results:
        if baseline is None or baseline.status != "ok" or r.status != "ok":
            continue
        r.peak_ratio = div(r.peak_allocated_bytes, baseline.peak_allocated_bytes)
        r.peak_reserved_ratio = div(r.peak_reserved_bytes, baseline.peak_reserved_bytes)
        r.step_time_ratio = div(r.median_step_time_s, baseline.median_step_time_s)
        r.throughput_ratio = div(r.throughput_samples_per_s, baseline.throughput_samples_per_s)
        if r is not baseline:
            r.step_time_within_noise = within_noise(r.step_time_spread, baseline.step_time_spread)


def _judge_checkpoints(modes: list[Mode], results: list[ModeResult]) -> list[str]:
    """Each checkpoint mode against the mode of the same precision without checkpointing (checkpoint vs
    baseline, amp+checkpoint vs amp, bf16+checkpoint vs bf16); returns a warning per mode that did not
    lower the peak."""
    warnings_text = []
    for mode, result in zip(modes, results):
        if mode.checkpoint is None or result.status != "ok" or result.peak_allocated_bytes is None:
            continue
        candidates = [(m, r) for m, r in zip(modes, results) if m.checkpoint is None and r.status == "ok"
                      and r.peak_allocated_bytes is not None and r.precision == result.precision]
        if not candidates:
            continue
        # the same precision word first (amp+checkpoint vs amp), else the same Lightning precision (amp vs bf16 on CPU)
        _, counterpart = next(((m, r) for m, r in candidates if m.precision == mode.precision), candidates[0])
        result.counterpart = counterpart.mode
        result.counterpart_peak_bytes = counterpart.peak_allocated_bytes
        result.counterpart_peak_ratio = result.peak_allocated_bytes / counterpart.peak_allocated_bytes if counterpart.peak_allocated_bytes else None
        result.checkpoint_helped = result.peak_allocated_bytes < counterpart.peak_allocated_bytes
        if not result.checkpoint_helped:
            warnings_text.append(result.checkpoint_warning())
    return warnings_text


def progress_line(index: int, count: int, result: "ModeResult", seconds: float) -> str:
    """The line ``compare_modes(progress=True)`` prints as mode ``index`` of ``count`` ends: its peak (bytes, as
    ``format_bytes`` writes them), median step time (ms) and the mode's wall time (seconds), or why it failed."""
    head = f"memkit compare: mode {index}/{count} {result.mode}"
    if result.status != "ok":
        return f"{head}: failed ({str(result.error).splitlines()[0][:200] if result.error else 'no message'}) ({seconds:.1f}s)"
    step = "-" if result.median_step_time_s is None else f"{result.median_step_time_s * 1000:.1f} ms/step"
    return f"{head}: peak {format_bytes(result.peak_allocated_bytes)}, {step}, {result.steps} steps ({seconds:.1f}s)"


def compare_modes(
    model_factory: Callable[[], Any],
    datamodule_factory: Callable[[], Any] | None = None,
    modes: str | Sequence[str | Mode] = ("baseline", "amp", "checkpoint", "amp+checkpoint"),
    max_steps: int = 20,
    *,
    accelerator: Any = "auto",
    devices: Any = 1,
    root_dir: str = "memkit_compare",
    seed: int = 0,
    val_batches: int = 2,
    val_metric: str | None = None,
    trainer_kwargs: dict[str, Any] | None = None,
    write: bool = True,
    figures: bool = True,
    verbose: bool = True,
    warmup_steps: int = 3,
    progress: bool = False,
) -> CompareResult:
    """Train a fresh model in each mode for ``max_steps`` steps and compare memory, speed and accuracy.

    Args:
        model_factory: returns a new LightningModule (called once per mode, after seeding).
        datamodule_factory: returns a new LightningDataModule, or ``None`` to use the module's own loaders.
        modes: mode strings (see :func:`~lightning_memkit.modes.parse_mode`), a comma-separated string,
            or :class:`Mode` values. Ratios are taken against the first full-precision, non-checkpointed
            mode (``baseline``), else against the first mode.
        max_steps: training steps per mode; validation runs once at the end (``val_batches`` batches).
        accelerator, devices: as for ``Trainer``. ``"amp"`` resolves per device (see Mode).
        root_dir: TensorBoard root; each mode is the run ``root_dir/<mode>`` so TensorBoard overlays them,
            and ``root_dir/compare`` holds the figures and table. CSV, JSON and PNGs go in ``root_dir``.
        seed: every mode starts from ``seed_everything(seed)``.
        val_metric: the validation metric to report; default: a logged ``*acc*`` metric, else the first ``val*``.
        trainer_kwargs: more ``Trainer`` arguments (e.g. ``limit_train_batches``); ``precision`` is the mode's.
        write: write compare.csv, compare.json, the figures and the TensorBoard summary.
        figures: draw the figures (matplotlib).
        verbose: print the table (and the checkpoint plans).
        warmup_steps: steps left out of the step timing (at most half of the steps run). The median and
            spread are over the rest; on CUDA they are GPU time (CUDA events, no host synchronisation per
            step), elsewhere wall time. A time ratio is "within noise" when the mode's interquartile
            range overlaps the baseline's.
        progress: print one line per mode as it ends (its peak, median step time and seconds), so a long
            comparison shows where it is (``memkit compare`` does; ``--no-progress`` turns it off).

    Returns:
        A :class:`CompareResult`, one :class:`ModeResult` per mode (``result["amp"]``): peaks in bytes,
        step times in seconds, throughput in samples/s, ratios against the baseline mode. A mode that fails (out of memory, unsupported precision) is kept with
        ``status="failed"`` and its error; the others still run. A checkpoint mode whose peak is not below
        the same precision's mode without checkpointing gets ``checkpoint_helped=False``, a ``!`` in the
        table and a :class:`CheckpointWarning` naming what was wrapped.
    """
    if not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps < 1:
        raise ValueError(f"max_steps={max_steps!r}: give a positive number of training steps, e.g. 20")
    if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 0:
        raise ValueError(f"warmup_steps={warmup_steps!r}: give 0 or more steps to leave out of the timing, e.g. 3")
    parsed = parse_modes(modes if not isinstance(modes, Mode) else [modes])
    results = []
    device = "cpu"
    for index, mode in enumerate(parsed, start=1):
        _release_previous_mode()
        started = time.perf_counter()
        results.append(_run_mode(mode, model_factory, datamodule_factory, max_steps=max_steps, accelerator=accelerator,
                                 devices=devices, root_dir=root_dir, seed=seed, val_batches=val_batches, val_metric=val_metric,
                                 trainer_kwargs=dict(trainer_kwargs or {}), verbose=verbose, warmup_steps=warmup_steps))
        if progress:
            print(progress_line(index, len(parsed), results[-1], time.perf_counter() - started), flush=True)
    _release_previous_mode()  # the last mode's model is freed before compare returns, too
    try:
        from lightning_memkit.modes.mode import _device_type

        device = _device_type(accelerator)
    except ValueError:
        pass
    baseline = next((r for m, r in zip(parsed, results) if m.is_baseline), results[0] if results else None)
    _ratios(results, baseline)
    for text in _judge_checkpoints(parsed, results):
        warnings.warn(f"memkit compare: {text}", CheckpointWarning, stacklevel=2)
    compare = CompareResult(results, baseline.mode if baseline else None, device, max_steps, seed, os.path.abspath(root_dir))
    if write:
        compare.write(figures=figures)
        if figures:
            compare.files["tensorboard"] = _write_tensorboard_summary(compare)
            with open(compare.files["json"], "w") as file:
                json.dump(dict(compare.to_dict(), files=compare.files), file, indent=1)
    if verbose:
        print(compare.format_table())
        if write:
            print(f"\nwritten: {', '.join(compare.files.values())}\nTensorBoard: tensorboard --logdir {root_dir}")
    return compare
