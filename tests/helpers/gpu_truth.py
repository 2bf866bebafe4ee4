"""Helpers for the recorded H100 truth in tests/data/gpu_truth (real CUDA peaks and allocator traces).

Shared by tests/estimate/cuda/test_allocator_replay.py, tests/estimate/cuda/test_gpu_truth.py and
benchmarks/gpu_truth.py.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
from typing import Any

import torch

from tests.helpers.paths import DATA_DIR

TRUTH_DIR = os.path.join(DATA_DIR, "gpu_truth")
#: Lightning precision -> memkit mode
MODES = {"32-true": None, "16-mixed": "fp16", "bf16-mixed": "bf16"}


def truth_rows() -> list[dict[str, Any]]:
    """The rows of truth.json: model, batch_size, precision and the recorded peaks (bytes)."""
    with open(os.path.join(TRUTH_DIR, "truth.json")) as handle:
        return json.load(handle)["rows"]


def trace_names() -> list[str]:
    """The recorded traces, as ``<model>_b<batch>_<precision>``."""
    return sorted(name[len("trace_") : -len(".json.gz")] for name in os.listdir(TRUTH_DIR) if name.startswith("trace_"))


def load_trace(name: str) -> dict[str, Any]:
    """One trace: ``model``, ``batch_size``, ``precision`` and ``events`` (action, addr, size, stream, frames)."""
    with gzip.open(os.path.join(TRUTH_DIR, f"trace_{name}.json.gz"), "rt") as handle:
        return json.load(handle)


def truth_row(trace: dict[str, Any]) -> dict[str, Any]:
    """The truth.json row recorded in the same run as ``trace``."""
    return next(
        r
        for r in truth_rows()
        if (r["model"], r["batch_size"], r["precision"]) == (trace["model"], trace["batch_size"], trace["precision"])
    )


def models_module():
    """tests/data/gpu_truth/models.py, imported (BertLike, ResNetish)."""
    spec = importlib.util.spec_from_file_location("gpu_truth_models", os.path.join(TRUTH_DIR, "models.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_model(name: str, batch_size: int, device: str = "cpu") -> torch.nn.Module:
    """The recorded model at ``batch_size`` (on the meta device: no memory, shapes only, when asked)."""
    cls = getattr(models_module(), name)
    with torch.device(device):
        return cls(batch_size=batch_size)


def device_order_sizes(module: torch.nn.Module) -> list[int]:
    """Bytes of each parameter and buffer in the order ``module.to("cuda")`` allocates them
    (``nn.Module._apply``: children first, depth first, then the module's own parameters and buffers)."""
    sizes: list[int] = []

    def visit(each: torch.nn.Module) -> None:
        for child in each.children():
            visit(child)
        for tensor in list(each._parameters.values()) + list(each._buffers.values()):
            if tensor is not None:
                sizes.append(tensor.numel() * tensor.element_size())

    visit(module)
    return sizes
