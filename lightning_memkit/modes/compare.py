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
import statistics
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from lightning_memkit.modes.mode import Mode, parse_modes
from lightning_memkit.summary_table import format_table
from lightning_memkit.units import MiB, format_bytes

__all__ = ["COMPARE_FORMAT", "ModeResult", "CompareResult", "compare_modes", "read_compare"]

#: the ``format`` key of compare.json; bump the number on an incompatible change.
COMPARE_FORMAT = "lightning-memkit/compare/1"
CSV_NAME = "compare.csv"
JSON_NAME = "compare.json"
PEAK_FIGURE = "compare_peak_memory.png"
STEPS_FIGURE = "compare_memory_per_step.png"


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
        peak_source: the StepReading field the peak comes from (``peak_allocated_bytes`` or ``peak_tensor_bytes``).
        peak_reserved_bytes: CUDA only: highest per-step peak reserved by the caching allocator.
        median_step_time_s: median wall time of a training step (batch start to batch end; the first
            step is left out when there are more), including memkit's probes (see docs/modes.md).
        throughput_samples_per_s: ``batch_size / median_step_time_s``.
        final_train_loss: the loss returned by the last training step.
        val_metric_name / val_metric: the validation metric (``val_acc``-like when logged, else ``val_loss``).
        val_metrics: every logged metric whose name starts with ``val``.
        peak_ratio, peak_reserved_ratio, step_time_ratio, throughput_ratio: against the baseline mode.
        checkpoint_regions: how many regions were checkpointed.
        checkpoint_predicted_saving_bytes: the checkpoint plan's predicted activation saving.
        step_peaks: ``[[step, peak_bytes], ...]`` for every measured training step.
        step_times_s: every step's wall time, in order.
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
    step_peaks: list[list[int]] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    log_dir: str | None = None

    #: the columns of compare.csv (per-step lists and the val_metrics dict are JSON-only)
    CSV_COLUMNS = (
        "mode", "status", "precision", "checkpoint", "steps", "batch_size", "peak_allocated_bytes", "peak_source",
        "peak_reserved_bytes", "median_step_time_s", "throughput_samples_per_s", "final_train_loss", "val_metric_name",
        "val_metric", "peak_ratio", "peak_reserved_ratio", "step_time_ratio", "throughput_ratio", "checkpoint_regions",
        "checkpoint_predicted_saving_bytes", "log_dir", "error",
    )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModeResult":
        """Inverse of :meth:`to_dict`; unknown keys are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


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

    def format_table(self) -> str:
        """The comparison as a fixed-width text table."""
        def ratio(value: float | None) -> str:
            return "-" if value is None else f"{value:.2f}x"

        def num(value: float | None, spec: str) -> str:
            return "-" if value is None else format(value, spec)

        rows = []
        for r in self.results:
            if r.status != "ok":
                rows.append((r.mode, "failed", "", "", "", "", "", "", (r.error or "")[:48]))
                continue
            rows.append((
                r.mode, format_bytes(r.peak_allocated_bytes), ratio(r.peak_ratio), format_bytes(r.peak_reserved_bytes),
                num(r.median_step_time_s and r.median_step_time_s * 1000, ".1f"), ratio(r.step_time_ratio),
                num(r.throughput_samples_per_s, ".1f"), num(r.final_train_loss, ".4f"),
                "-" if r.val_metric is None else f"{r.val_metric_name}={r.val_metric:.4f}",
            ))
        headers = ("mode", "peak", "vs base", "peak reserved", "step ms", "vs base", "samples/s", "train loss", "validation")
        return f"memkit compare ({self.device}, {self.max_steps} steps, ratios vs {self.baseline})\n" + format_table(headers, rows)

    def write(self, directory: str | None = None, figures: bool = True) -> dict[str, str]:
        """Write compare.csv, compare.json and (with ``figures``) the two PNG figures; returns their paths."""
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
        """Wall time, loss and batch size of each training step (thin: no measuring logic)."""

        #: puts the "modes compared" charts on memkit's TensorBoard dashboard (tensorboard/dashboard.py)
        memkit_dashboard_options = {"compare": True}

        def __init__(self) -> None:
            self.times: list[float] = []
            self.losses: list[float] = []
            self.batch_size: int | None = None
            self._start: float | None = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if self.batch_size is None:
                self.batch_size = _first_batch_size(batch)
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if self._start is not None:
                self.times.append(time.perf_counter() - self._start)
                self._start = None
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if loss is not None and hasattr(loss, "detach"):
                self.losses.append(float(loss.detach().float().cpu()))

    return _StepRecorder()


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
              trainer_kwargs: dict[str, Any], verbose: bool) -> ModeResult:
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
        tracker = MemoryTracker(verbose=False)
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
    train = [r for r in tracker.history if r.stage == "train" and r.peak_bytes is not None]
    result.steps = trainer.global_step
    result.step_peaks = [[r.step, int(r.peak_bytes)] for r in train]
    if train:
        result.peak_allocated_bytes = max(r.peak_bytes for r in train)
        result.peak_source = tracker.summary.peak_source
        reserved = [r.peak_reserved_bytes for r in train if r.peak_reserved_bytes is not None]
        result.peak_reserved_bytes = max(reserved) if reserved else None
    times = recorder.times[1:] if len(recorder.times) > 1 else recorder.times
    result.step_times_s = recorder.times
    result.batch_size = recorder.batch_size
    if times:
        result.median_step_time_s = statistics.median(times)
        if recorder.batch_size:
            result.throughput_samples_per_s = recorder.batch_size / result.median_step_time_s
    result.final_train_loss = recorder.losses[-1] if recorder.losses else None
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

    Returns:
        A :class:`CompareResult`, one :class:`ModeResult` per mode (``result["amp"]``): peaks in bytes,
        step times in seconds, throughput in samples/s, ratios against the baseline mode. A mode that fails (out of memory, unsupported precision) is kept with
        ``status="failed"`` and its error; the others still run.
    """
    if not isinstance(max_steps, int) or max_steps < 1:
        raise ValueError(f"max_steps={max_steps!r}: give a positive number of training steps, e.g. 20")
    parsed = parse_modes(modes if not isinstance(modes, Mode) else [modes])
    results = []
    device = "cpu"
    for mode in parsed:
        results.append(_run_mode(mode, model_factory, datamodule_factory, max_steps=max_steps, accelerator=accelerator,
                                 devices=devices, root_dir=root_dir, seed=seed, val_batches=val_batches, val_metric=val_metric,
                                 trainer_kwargs=dict(trainer_kwargs or {}), verbose=verbose))
    try:
        from lightning_memkit.modes.mode import _device_type

        device = _device_type(accelerator)
    except ValueError:
        pass
    baseline = next((r for m, r in zip(parsed, results) if m.is_baseline), results[0] if results else None)
    _ratios(results, baseline)
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
