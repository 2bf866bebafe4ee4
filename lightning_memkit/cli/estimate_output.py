"""What ``memkit estimate`` prints under its tables: the CUDA kernels assumed, the notes, the target's name."""

from __future__ import annotations

import argparse
from typing import Any

from lightning_memkit.estimate.cuda.gpu_target import GpuTarget
from lightning_memkit.estimate.step.hook_errors import DATA_DEPENDENT_ADVICE

__all__ = ["KERNELS_PREFIX", "in_cli_terms", "kernels_and_notes", "target_words"]

#: the estimate's note that lists the CUDA kernels assumed (estimate/cuda/kernels.py writes it)
KERNELS_PREFIX = "CUDA kernels assumed: "


def kernels_and_notes(notes_by_mode: list[tuple[str, list[str]]]) -> list[str]:
    """The lines under a table: the CUDA kernels each mode assumed (modes that assumed the same share a
    line), then every other note once."""
    kernels: dict[str, list[str]] = {}
    others: dict[str, None] = {}
    for mode, notes in notes_by_mode:
        for note in notes:
            if note.startswith(KERNELS_PREFIX):
                kernels.setdefault(note[len(KERNELS_PREFIX) :], []).append(mode)
            else:
                others[note] = None
    lines = [f"kernels assumed ({', '.join(dict.fromkeys(names))}): {text}" for text, names in kernels.items()]
    return lines + [f"note: {note}" for note in others]


def target_words(args: argparse.Namespace, gpu: Any) -> str:
    if args.device != "cuda":
        return args.device
    target = gpu if gpu is not None else GpuTarget.parse(None)
    return f"cuda ({target.name}, sm{target.sm})"


def in_cli_terms(error: Any, args: argparse.Namespace) -> Any:
    """``error`` as this command says it: a data-dependent estimate failure's advice names memkit trace, which
    measures real steps (the Python advice names measure_training_step()); any other error as it is."""
    text = str(error)
    if not getattr(error, "data_dependent", False) or DATA_DEPENDENT_ADVICE not in text:
        return error
    given = (("init-args", args.init_args), ("datamodule", args.datamodule), ("datamodule-args", args.datamodule_args))
    same = "".join(f" --{name} '{value}'" for name, value in given if value and value != "{}")
    advice = (
        f"measure real steps instead: memkit trace {args.module}{same} --batch-size N (a small N; "
        "--accelerator gpu on a GPU), or express it without the data-dependent shape."
    )
    return text.replace(DATA_DEPENDENT_ADVICE, advice)
