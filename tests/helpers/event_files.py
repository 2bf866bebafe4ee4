"""Readers of TensorBoard event files (tensorboard's own reader): the scalars a run logged and its custom-scalars
layouts."""

from __future__ import annotations

import glob
import os


def read_scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files under ``log_dir``: ``{tag: [(step, value), ...]}`` (by step)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(glob.glob(os.path.join(log_dir, "**", "events.out.tfevents.*"), recursive=True))
    assert files, f"no TensorBoard event file under {log_dir}"
    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in files:
        accumulator = EventAccumulator(path, size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in accumulator.Scalars(tag))
    return {tag: sorted(values) for tag, values in scalars.items()}


def read_layouts(log_dir: str) -> list[dict[str, dict[str, list[str]]]]:
    """Every custom-scalars layout in the run's event files, as TensorBoard parses it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    layouts = []
    for path in glob.glob(os.path.join(log_dir, "events.out.tfevents.*")):
        accumulator = EventAccumulator(path, size_guidance={"tensors": 0})
        accumulator.Reload()
        if "custom_scalars__config__" in accumulator.Tags()["tensors"]:
            for event in accumulator.Tensors("custom_scalars__config__"):
                layout = layout_pb2.Layout()
                layout.ParseFromString(event.tensor_proto.string_val[0])
                layouts.append({c.title: {ch.title: list(ch.multiline.tag) for ch in c.chart} for c in layout.category})
    return layouts
