"""``memkit estimate --check``: two real training steps per mode on this machine's GPU, printed beside the
estimate with the error."""

from __future__ import annotations

import argparse
import copy
import gc
import sys
import tempfile
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.parsing import lightning_hasattr, lightning_setattr

from lightning_memkit.cli.common import CliError, build_instance, json_object, load_object
from lightning_memkit.estimate.cuda.gpu_target import GpuTarget
from lightning_memkit.estimate.data.batches import batch_size_of
from lightning_memkit.modes.checkpoint_policy import CheckpointBudget
from lightning_memkit.quiet_lightning import quiet_lightning
from lightning_memkit.summary_table import format_table
from lightning_memkit.units import format_bytes

__all__ = ["check_refusal", "check_estimates"]


def check_refusal(args: argparse.Namespace, gpu: Any) -> None:
    """``--check`` needs a CUDA target, one GPU here, and the estimate made for that GPU."""
    if args.strategy is not None:
        raise CliError("--check trains on this machine's one GPU; it does not run --strategy (drop one of them)")
    if args.meta_init:
        raise CliError(
            "--check trains real steps, and a module built with --meta-init has no weights; drop one of them"
        )
    if args.device != "cuda":
        raise CliError("--check measures a real step on a GPU against a CUDA estimate; use --device cuda (the default)")
    if not torch.cuda.is_available():
        raise CliError(
            "--check trains two real steps on a GPU, and torch sees none here (torch.cuda.is_available() is "
            "False); drop --check, or run it on a machine with a GPU and a CUDA build of torch"
        )
    here = GpuTarget.parse(None)
    if gpu is not None and gpu.capability != here.capability:
        raise CliError(
            f"--check measures on this machine's {here.name} (sm{here.sm}); --gpu {args.gpu} would estimate "
            f"another GPU's kernels: drop --gpu or give --gpu sm{here.sm}"
        )


def _error_percent(estimated: int, measured: int) -> str:
    return f"{(estimated - measured) / measured:+.1%}" if measured else "-"


def check_estimates(args: argparse.Namespace, module: Any, estimates: dict[str, tuple[Any, Any]]) -> dict[str, dict]:
    """Two real training steps per estimated mode on this GPU, printed beside the estimate; returns per-mode results."""
    rows: list[tuple] = []
    checks: dict[str, dict[str, Any]] = {}
    for name, (mode, estimate) in estimates.items():
        try:
            measured = _measure_cuda_steps(module, args, mode, estimate.batch_size)
        except Exception as error:  # noqa: BLE001 - one mode's failure is reported in its row, the others still run
            first_line = (str(error).strip().splitlines() or [""])[0]
            checks[name] = {"error": f"{type(error).__name__}: {first_line}"}
            rows.append(
                (
                    name,
                    estimate.batch_size,
                    format_bytes(estimate.cuda.peak_allocated_bytes),
                    "-",
                    "-",
                    format_bytes(estimate.cuda.peak_reserved_bytes),
                    "-",
                    "-",
                )
            )
            print(f"memkit estimate --check: mode {name}: {checks[name]['error']}", file=sys.stderr)
            continue
        allocated, reserved = estimate.cuda.peak_allocated_bytes, estimate.cuda.peak_reserved_bytes
        checks[name] = {
            "estimated_peak_allocated_bytes": allocated,
            "estimated_peak_reserved_bytes": reserved,
            **measured,
        }
        rows.append(
            (
                name,
                estimate.batch_size,
                format_bytes(allocated),
                format_bytes(measured["peak_allocated_bytes"]),
                _error_percent(allocated, measured["peak_allocated_bytes"]),
                format_bytes(reserved),
                format_bytes(measured["peak_reserved_bytes"]),
                _error_percent(reserved, measured["peak_reserved_bytes"]),
            )
        )
    gc.collect()  # what a failed fit's error held is gone now: give its cached blocks back too
    torch.cuda.empty_cache()
    print(
        f"\ncheck: two real training steps per mode on {torch.cuda.get_device_name()} (a Trainer on a copy of "
        "the module, peaks from on_train_start)"
    )
    print(
        format_table(
            ("mode", "batch", "allocated est", "allocated real", "error", "reserved est", "reserved real", "error"),
            rows,
        )
    )
    return checks


def _measure_cuda_steps(module: Any, args: argparse.Namespace, mode: Any, batch_size: int | None) -> dict[str, int]:
    """Train two real steps of a copy of ``module`` on this GPU in ``mode`` (Lightning's Trainer, as the recorded
    GPU truth was taken) and return ``torch.cuda.max_memory_allocated()`` / ``max_memory_reserved()`` over them,
    counted from ``on_train_start`` (model and optimizer on the device, no optimizer state yet), in bytes.

    The module itself is not touched; everything the fit made is freed and the allocator's cache emptied.
    Raises ``ValueError`` when the loader's batch is not ``batch_size`` (the size cannot be set).
    """
    real, datamodule = _copy_to_train(module, args)
    kwargs = _mode_trainer_kwargs(mode)
    reader = _PeakReader()
    gc.collect()
    torch.cuda.empty_cache()
    try:
        with quiet_lightning(), tempfile.TemporaryDirectory(prefix="memkit_check_") as root:
            trainer = _two_step_trainer(root, kwargs["precision"], [*kwargs["callbacks"], reader])
            trainer.fit(real, datamodule=datamodule)
            del trainer
    finally:
        del real, datamodule
        gc.collect()
        torch.cuda.empty_cache()
    if reader.peaks is None or not reader.batch_sizes:
        raise ValueError("the fit ended before two training steps (is the train dataset empty?)")
    if batch_size is not None and reader.batch_sizes[0] != batch_size:
        raise ValueError(
            f"the real fit's batch has {reader.batch_sizes[0]} samples, the estimate's {batch_size}: the loader "
            "does not take its size from a batch_size attribute; give the size in --init-args / --datamodule-args"
        )
    return {
        "peak_allocated_bytes": reader.peaks[0],
        "peak_reserved_bytes": reader.peaks[1],
        "steps": len(reader.batch_sizes),
    }


class _PeakReader(pl.Callback):
    """CUDA's peaks from ``on_train_start`` to ``on_train_end`` (``peaks``: allocated, reserved) and each training
    batch's size (``batch_sizes``)."""

    def __init__(self) -> None:
        self.batch_sizes: list[int | None] = []
        self.peaks: tuple[int, int] | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batch_sizes.append(batch_size_of(batch))

    def on_train_end(self, trainer, pl_module) -> None:
        torch.cuda.synchronize()
        self.peaks = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())


def _copy_to_train(module: Any, args: argparse.Namespace) -> tuple[Any, Any]:
    """A deep copy of ``module`` and the datamodule ``--datamodule`` names, built at ``--batch-size``; without a
    datamodule the copy's own ``batch_size`` is set to it."""
    real = copy.deepcopy(module)
    datamodule = None
    if args.datamodule:
        datamodule = build_instance(
            load_object(args.datamodule),
            json_object(args.datamodule_args, "--datamodule-args"),
            batch_size=args.batch_size,
            what="datamodule",
        )
    elif args.batch_size is not None:
        if not lightning_hasattr(real, "batch_size"):
            raise ValueError(
                f"{type(module).__name__} has no batch_size attribute or hparam to train --batch-size "
                f"{args.batch_size} with; drop --batch-size or give the size in --init-args"
            )
        lightning_setattr(real, "batch_size", args.batch_size)
    return real, datamodule


def _mode_trainer_kwargs(mode: Any) -> dict[str, Any]:
    """The mode's Trainer arguments on CUDA (its precision and callbacks)."""
    if mode.checkpoint is None:
        return mode.trainer_kwargs("cuda")
    # auto checkpointing needs no measuring forward (the estimate makes none); a budget measures, as in training
    measure = {} if isinstance(mode.checkpoint, CheckpointBudget) else {"measure": False}
    return mode.trainer_kwargs("cuda", verbose=False, **measure)


def _two_step_trainer(root: str, precision: Any, callbacks: list[Any]) -> Any:
    """A Trainer of two training steps on this machine's one GPU: no logger, checkpoint, validation or progress bar,
    its files under ``root``."""
    return pl.Trainer(
        accelerator="cuda",
        devices=1,
        max_steps=2,
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=root,
        callbacks=callbacks,
    )
