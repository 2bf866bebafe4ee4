"""compare_modes: train the same LightningModule in several memory modes and put memory, speed and
accuracy side by side (returned, printed, CSV/JSON, figures, one TensorBoard run per mode).

Each mode gets a fresh model and data from the factories, the same seed, and a MemoryTracker. The records
(:class:`ModeResult`, :class:`CompareResult`, :func:`read_compare`) are in compare_result.py.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from lightning_memkit._torch_compat import tree_flatten
from lightning_memkit.modes.compare_result import (
    CompareResult,
    ModeResult,
    ModeStatus,
    write_tensorboard_summary,
)
from lightning_memkit.modes.devices import DeviceLike, device_type
from lightning_memkit.modes.mode import Mode, parse_modes
from lightning_memkit.timing import StepTimer, time_spread, within_noise
from lightning_memkit.units import format_bytes

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

__all__ = ["CheckpointWarning", "compare_modes", "progress_line"]

#: StepReading peak fields, best first: a mode's peak comes from the first one its readings have.
PEAK_SOURCES = ("peak_allocated_bytes", "peak_tensor_bytes", "host_peak_rss_bytes")


class CheckpointWarning(UserWarning):
    """A checkpoint mode whose peak is not below the same precision's mode without checkpointing."""


@dataclass(frozen=True)
class _RunSettings:
    """What every mode of one comparison is trained with (:func:`compare_modes`' arguments of the same names)."""

    max_steps: int
    accelerator: Any
    devices: Any
    root_dir: str
    seed: int
    val_batches: int
    val_metric: str | None
    verbose: bool
    warmup_steps: int
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)


def _check_step_counts(max_steps: Any, warmup_steps: Any) -> None:
    """compare_modes' step counts: a positive number of training steps, 0 or more warm-up steps."""
    if not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps < 1:
        raise ValueError(f"max_steps={max_steps!r}: give a positive number of training steps, e.g. 20")
    if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 0:
        raise ValueError(f"warmup_steps={warmup_steps!r}: give 0 or more steps to leave out of the timing, e.g. 3")


# ---------------------------------------------------------------------------------------------- running
def _run_name(mode: Mode) -> str:
    return re.sub(r"[^A-Za-z0-9_.+=-]+", "_", mode.name)


def _first_batch_size(batch: Any) -> int | None:
    for leaf in tree_flatten(batch)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return None


def _step_recorder() -> Any:
    from lightning.pytorch import Callback  # Lightning only when a comparison runs: lightning_memkit.modes is core

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

        def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
            self.timer = StepTimer(trainer.strategy.root_device)

        def on_train_batch_start(
            self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
        ) -> None:
            if self.batch_size is None:
                self.batch_size = _first_batch_size(batch)
            if self.timer is not None:
                self.timer.cancel()  # a window left open by a step that returned None
                self.timer.start()

        def on_train_batch_end(
            self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            if self.timer is not None and self.timer.running:
                self.timer.stop()
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if loss is not None and hasattr(loss, "detach"):
                # read at train end: float() here would wait for the device every step
                self._last_loss = loss.detach()

        def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
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


def _fit(
    mode: Mode,
    mode_kwargs: dict[str, Any],
    model_factory: Callable[[], Any],
    datamodule_factory: Callable[[], Any] | None,
    logger: Any,
    settings: _RunSettings,
) -> tuple[Any, Any, Any]:
    """Train one mode; returns (trainer, its MemoryTracker, its step recorder)."""
    import lightning.pytorch as pl  # Lightning only when a comparison runs: lightning_memkit.modes is core

    # a Trainer-building edge below the callbacks (tests/project/test_import_layers.py names it)
    from lightning_memkit.callbacks.memory_tracker import MemoryTracker

    pl.seed_everything(settings.seed, verbose=False)
    model = model_factory()
    datamodule = datamodule_factory() if datamodule_factory is not None else None
    tracker = MemoryTracker(verbose=False, tensor_peak_every_n_steps=1)  # CPU: the exact peak of every step
    recorder = _step_recorder()
    options = {
        "accelerator": settings.accelerator,
        "devices": settings.devices,
        "max_steps": settings.max_steps,
        "logger": logger,
        "default_root_dir": settings.root_dir,
        "val_check_interval": settings.max_steps,
        "check_val_every_n_epoch": None,
        "limit_val_batches": settings.val_batches,
        "num_sanity_val_steps": 0,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "log_every_n_steps": 1,
    }
    options.update(settings.trainer_kwargs)
    options["precision"] = mode_kwargs["precision"]
    options["callbacks"] = [*mode_kwargs["callbacks"], tracker, recorder, *settings.trainer_kwargs.get("callbacks", [])]
    trainer = pl.Trainer(**options)
    trainer.fit(model, datamodule=datamodule)
    return trainer, tracker, recorder


def _read_peaks(result: ModeResult, history: Sequence[Any]) -> None:
    """The mode's per-step peaks and its highest, from one source for every step (a step without the CUDA or
    accountant peak must not fall back to host RSS)."""
    train = [r for r in history if r.stage == "train"]
    source = next((f for f in PEAK_SOURCES if any(getattr(r, f) is not None for r in train)), None)
    train = [r for r in train if source is not None and getattr(r, source) is not None]
    result.step_peaks = [[r.step, int(getattr(r, source))] for r in train] if source is not None else []
    if train:
        result.peak_allocated_bytes = max(peak for _, peak in result.step_peaks)
        result.peak_source = source
        reserved = [r.peak_reserved_bytes for r in train if r.peak_reserved_bytes is not None]
        result.peak_reserved_bytes = max(reserved) if reserved else None


def _read_times(result: ModeResult, recorder: Any, warmup_steps: int) -> None:
    """The step times, their spread after the warm-up steps (at most half of them) and the throughput."""
    times = recorder.step_times_s()
    result.step_times_s = times
    result.time_source = recorder.timer.source if recorder.timer is not None else None
    result.batch_size = recorder.batch_size
    result.warmup_steps = min(warmup_steps, len(times) // 2)
    spread = time_spread(times[result.warmup_steps :])
    if spread is not None:
        result.timed_steps = spread.count
        result.median_step_time_s = spread.median_s
        result.step_time_q1_s, result.step_time_q3_s = spread.q1_s, spread.q3_s
        result.step_time_min_s, result.step_time_max_s = spread.min_s, spread.max_s
        if recorder.batch_size:
            result.throughput_samples_per_s = recorder.batch_size / result.median_step_time_s


def _read_validation(result: ModeResult, callback_metrics: dict[str, Any], wanted: str | None) -> None:
    metrics = {}
    for key, value in callback_metrics.items():
        if key.startswith("val"):
            with contextlib.suppress(TypeError, ValueError):
                metrics[key] = float(value)
    result.val_metrics = metrics
    result.val_metric_name, result.val_metric = _pick_val_metric(metrics, wanted)


def _run_mode(
    mode: Mode, model_factory: Callable[[], Any], datamodule_factory: Callable[[], Any] | None, settings: _RunSettings
) -> ModeResult:
    from lightning.pytorch.loggers import TensorBoardLogger  # Lightning only when a comparison runs

    result = ModeResult(mode=mode.name, checkpoint=mode.to_dict()["checkpoint"])
    logger = TensorBoardLogger(settings.root_dir, name=_run_name(mode), version="", default_hp_metric=False)
    result.log_dir = os.path.abspath(logger.log_dir)
    try:
        if mode.checkpoint is not None:
            mode_kwargs = mode.trainer_kwargs(settings.accelerator, verbose=settings.verbose)
        else:
            mode_kwargs = mode.trainer_kwargs(settings.accelerator)
        result.precision = mode_kwargs["precision"]
        trainer, tracker, recorder = _fit(mode, mode_kwargs, model_factory, datamodule_factory, logger, settings)
    except Exception as error:  # noqa: BLE001 - a mode this device cannot run, or OOM: reported, the others still run
        result.status = ModeStatus.FAILED
        result.error = f"{type(error).__name__}: {error}"
        if settings.verbose:
            traceback.print_exc()
        return result
    result.steps = trainer.global_step
    _read_peaks(result, tracker.history)
    _read_times(result, recorder, settings.warmup_steps)
    result.final_train_loss = recorder.final_loss
    _read_validation(result, trainer.callback_metrics, settings.val_metric)
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
        if baseline is None or baseline.status != ModeStatus.OK or r.status != ModeStatus.OK:
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
    for mode, result in zip(modes, results, strict=True):
        if mode.checkpoint is None or result.status != ModeStatus.OK or result.peak_allocated_bytes is None:
            continue
        candidates = [
            (m, r)
            for m, r in zip(modes, results, strict=True)
            if m.checkpoint is None
            and r.status == ModeStatus.OK
            and r.peak_allocated_bytes is not None
            and r.precision == result.precision
        ]
        if not candidates:
            continue
        # the same precision word first (amp+checkpoint vs amp), else the same Lightning precision (amp vs bf16 on
        # CPU)
        _, counterpart = next(((m, r) for m, r in candidates if m.precision == mode.precision), candidates[0])
        counterpart_peak = counterpart.peak_allocated_bytes
        if counterpart_peak is None:  # the candidates all have a peak
            continue
        result.counterpart = counterpart.mode
        result.counterpart_peak_bytes = counterpart_peak
        if counterpart_peak:
            result.counterpart_peak_ratio = result.peak_allocated_bytes / counterpart_peak
        result.checkpoint_helped = result.peak_allocated_bytes < counterpart_peak
        warning = result.checkpoint_warning()  # a sentence when checkpointing did not help
        if warning is not None:
            warnings_text.append(warning)
    return warnings_text


def progress_line(index: int, count: int, result: ModeResult, seconds: float) -> str:
    """The line ``compare_modes(progress=True)`` prints as mode ``index`` of ``count`` ends: its peak (bytes, as
    ``format_bytes`` writes them), median step time (ms) and the mode's wall time (seconds), or why it failed."""
    head = f"memkit compare: mode {index}/{count} {result.mode}"
    if result.status != ModeStatus.OK:
        why = str(result.error).splitlines()[0][:200] if result.error else "no message"
        return f"{head}: failed ({why}) ({seconds:.1f}s)"
    step = "-" if result.median_step_time_s is None else f"{result.median_step_time_s * 1000:.1f} ms/step"
    return f"{head}: peak {format_bytes(result.peak_allocated_bytes)}, {step}, {result.steps} steps ({seconds:.1f}s)"


def _run_modes(
    modes: list[Mode],
    model_factory: Callable[[], Any],
    datamodule_factory: Callable[[], Any] | None,
    settings: _RunSettings,
    progress: bool,
) -> list[ModeResult]:
    """Each mode in turn, from a clean slate, one progress line as each ends (``progress``)."""
    results = []
    for index, mode in enumerate(modes, start=1):
        _release_previous_mode()
        started = time.perf_counter()
        results.append(_run_mode(mode, model_factory, datamodule_factory, settings))
        if progress:
            print(progress_line(index, len(modes), results[-1], time.perf_counter() - started), flush=True)
    _release_previous_mode()  # the last mode's model is freed before compare returns, too
    return results


def _compared(modes: list[Mode], results: list[ModeResult], settings: _RunSettings) -> tuple[CompareResult, list[str]]:
    """The comparison's record (ratios against the baseline mode: the first full-precision, non-checkpointed mode,
    else the first), and a warning per checkpoint mode that did not lower the peak."""
    try:
        device = device_type(settings.accelerator)
    except ValueError:
        device = "cpu"
    baseline = next((r for m, r in zip(modes, results, strict=True) if m.is_baseline), results[0] if results else None)
    _ratios(results, baseline)
    warned = _judge_checkpoints(modes, results)
    root = os.path.abspath(settings.root_dir)
    compare = CompareResult(
        results, baseline.mode if baseline else None, device, settings.max_steps, settings.seed, root
    )
    return compare, warned


def _write(compare: CompareResult, figures: bool) -> None:
    compare.write(figures=figures)
    if figures:
        compare.files["tensorboard"] = write_tensorboard_summary(compare)
        with open(compare.files["json"], "w") as file:
            json.dump(dict(compare.to_dict(), files=compare.files), file, indent=1)


def _write_and_show(compare: CompareResult, settings: _RunSettings, write: bool, figures: bool) -> None:
    """The files (``write``; ``figures``: the figures too) and, with ``verbose``, the table and where they went."""
    if write:
        _write(compare, figures)
    if settings.verbose:
        print(compare.format_table())
        if write:
            print(
                f"\nwritten: {', '.join(compare.files.values())}\nTensorBoard: tensorboard --logdir {settings.root_dir}"
            )


def compare_modes(
    model_factory: Callable[[], Any],
    datamodule_factory: Callable[[], Any] | None = None,
    modes: str | Mode | Sequence[str | Mode] = ("baseline", "amp", "checkpoint", "amp+checkpoint"),
    max_steps: int = 20,
    *,
    accelerator: DeviceLike = "auto",
    devices: int | str | list[int] = 1,
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
        modes: mode strings (see :func:`~lightning_memkit.modes.mode.parse_mode`), a comma-separated string,
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
        step times in seconds, throughput in samples/s, ratios against the baseline mode. A mode that fails (out
        of memory, unsupported precision) is kept with ``status="failed"`` (:class:`ModeStatus`) and its error;
        the others still run. A checkpoint mode whose peak is not below the same precision's mode without
        checkpointing gets ``checkpoint_helped=False``, a ``!`` in the table and a :class:`CheckpointWarning`
        naming what was wrapped.
    """
    _check_step_counts(max_steps, warmup_steps)
    settings = _RunSettings(
        max_steps=max_steps,
        accelerator=accelerator,
        devices=devices,
        root_dir=root_dir,
        seed=seed,
        val_batches=val_batches,
        val_metric=val_metric,
        verbose=verbose,
        warmup_steps=warmup_steps,
        trainer_kwargs=dict(trainer_kwargs or {}),
    )
    parsed = parse_modes(modes if not isinstance(modes, Mode) else [modes])
    results = _run_modes(parsed, model_factory, datamodule_factory, settings, progress)
    compare, warned = _compared(parsed, results, settings)
    for text in warned:
        warnings.warn(f"memkit compare: {text}", CheckpointWarning, stacklevel=2)
    _write_and_show(compare, settings, write, figures)
    return compare
