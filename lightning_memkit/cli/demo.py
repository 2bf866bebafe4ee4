"""``memkit demo``: train a built-in model on synthetic data with MemoryTracker and show the result."""

from __future__ import annotations

import argparse
import os
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_memkit import zoo
from lightning_memkit.callbacks.layer_trace import LayerTrace
from lightning_memkit.callbacks.memory_tracker import MemoryTracker
from lightning_memkit.cli.common import CliError, build_trainer
from lightning_memkit.units import format_bytes

__all__ = ["add_parser", "run", "MODELS", "explain_peaks"]

MODELS = ("mlp", "cnn", "transformer")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `memkit demo` and its flags on the ``memkit`` parser's ``subparsers``."""
    parser = subparsers.add_parser(
        "demo",
        help="train a small built-in model with MemoryTracker and write TensorBoard logs",
        description="Train a small built-in LightningModule on synthetic data with MemoryTracker, "
        "write TensorBoard logs and print the memory summary.",
    )
    parser.add_argument("--model", choices=MODELS, default="cnn", help="which built-in model (default: cnn)")
    parser.add_argument("--steps", type=int, default=30, help="training steps (default: 30)")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size (default: 32)")
    parser.add_argument("--logdir", default="memkit_logs", help="TensorBoard log root (default: memkit_logs)")
    parser.add_argument("--accelerator", default="auto", help="Lightning accelerator: auto, cpu, gpu (default: auto)")
    parser.set_defaults(run=run)


def build_model(name: str, batch_size: int):
    """The built-in model ``name`` ('mlp', 'cnn' or 'transformer')."""
    if name == "mlp":
        return zoo.DemoMLP(batch_size=batch_size)
    if name == "cnn":
        return zoo.DemoCNN(batch_size=batch_size)
    if name == "transformer":
        return zoo.DemoTransformer(batch_size=batch_size)
    raise ValueError(f"unknown model {name!r}; choose from: {', '.join(MODELS)}")


def run(args: argparse.Namespace) -> int:
    """Run `memkit demo` with the parsed ``args``; returns the exit status (0 on success; bad input exits 2 with one
    line saying what to write)."""
    if args.steps < 1 or args.batch_size < 1:
        print("memkit demo: --steps and --batch-size must be positive integers", file=sys.stderr)
        return 2
    pl.seed_everything(0, verbose=False)
    model = build_model(args.model, args.batch_size)
    tracker = MemoryTracker(tensor_peak_every_n_steps=1)  # a showcase: the exact peak of every step (costs ~1.1x here)
    # Step 1 is the first step after Adam has created its state: the layer trace shows all of it.
    # verbose=False: the demo prints the category table itself, below, with where the module table went.
    layer_trace = LayerTrace(at_steps=(1,) if args.steps > 1 else (0,), verbose=False)
    tensorboard = TensorBoardLogger(args.logdir, name=f"demo-{args.model}")
    loggers = [tensorboard, CSVLogger(args.logdir, name=f"demo-{args.model}-csv")]
    try:
        trainer = build_trainer(
            accelerator=args.accelerator,
            devices=1,
            max_steps=args.steps,
            val_check_interval=max(1, args.steps // 2),
            check_val_every_n_epoch=None,
            limit_val_batches=2,
            callbacks=[tracker, layer_trace],
            logger=loggers,
            log_every_n_steps=1,
            enable_checkpointing=False,
            enable_model_summary=False,
            enable_progress_bar=False,
        )
    except CliError as error:
        print(f"memkit demo: {error}", file=sys.stderr)
        return 2
    trainer.fit(model)
    for result in layer_trace.results:
        print(
            f"\nLayer trace of step {result.step} (memory by category; the module table is in TensorBoard's Text tab):"
        )
        print(result.format_categories())
    explained = explain_peaks(tracker.summary, layer_trace.results[-1] if layer_trace.results else None, trainer)
    if explained:
        print("\n" + explained)
    print(f"\nTensorBoard logs: {os.path.abspath(tensorboard.log_dir)}")
    print(f"Open them with:   tensorboard --logdir {args.logdir}   (the Custom Scalars tab is memkit's dashboard)")
    print(f"Offline report:   memkit report {args.logdir} -o memkit_report.html")
    return 0


def _dataset_bytes(trainer) -> int | None:
    """Bytes of the tensors the training dataset holds (its ``tensors``, as a ``TensorDataset`` keeps them, or tensor
    attributes, as the built-in models' datasets do; each storage once), else ``None``."""
    dataset = getattr(getattr(trainer, "train_dataloader", None), "dataset", None)
    if dataset is None:
        return None
    held = list(getattr(dataset, "tensors", None) or ()) + list(getattr(dataset, "__dict__", {}).values())
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held if isinstance(t, torch.Tensor)
    }
    return sum(storages.values()) or None


def explain_peaks(summary, trace, trainer) -> str | None:
    """What the run peak of the summary counts, next to the layer trace's peak: the whole process vs the traced step.

    Args:
        summary: MemoryTracker's :class:`~lightning_memkit.records.RunSummary` (bytes).
        trace: the last :class:`~lightning_memkit.trace.trace_records.LayerTraceResult`, or ``None``.
        trainer: the fitted Trainer (its training dataset's tensors, when it holds them, are named in bytes).

    Returns:
        the explanation (plain text, sizes as ``format_bytes`` writes them), or ``None`` without a run peak.
    """
    if summary.peak_bytes is None:
        return None
    cuda = (summary.peak_source or "").endswith(("allocated_bytes", "reserved_bytes"))
    where = "everything the process holds on the GPU" if cuda else "every live tensor of the process"
    parts = [
        f"What the peaks count: the run peak ({format_bytes(summary.peak_bytes)} at step {summary.peak_step}) is the "
        f"whole process, {where}: the model, its gradients and optimizer state, the step's activations, and whatever "
        "else is alive (the dataset held in memory, tensors of an earlier fit still referenced)."
    ]
    data = None if cuda else _dataset_bytes(trainer)
    if data:
        parts.append(f"The training dataset's tensors alone are {format_bytes(data)}.")
    if trace is not None:
        parts.append(
            f"The layer trace's peak ({format_bytes(trace.peak_bytes)} at step {trace.step}) counts the traced step's "
            "tensors by category (parameters, gradients, optimizer state, activations, temporaries): the gap is "
            "memory the step did not make."
        )
    return "\n".join(parts)
