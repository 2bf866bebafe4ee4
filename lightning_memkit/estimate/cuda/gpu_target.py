"""The GPU a CUDA-target estimate is for (:class:`GpuTarget`: a name and compute capability), and the library
workspaces its generation and environment decide (cuBLAS, cuBLASLt, cuDNN convolutions).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from lightning_memkit.units import KiB, MiB

__all__ = [
    "GPU_GENERATIONS",
    "GpuTarget",
    "GpuLike",
    "cublas_workspace_bytes",
    "cublaslt_workspace_bytes",
    "conv_workspace_bytes",
    "CONV_WEIGHT_GRAD_WORKSPACE_FACTOR",
]

#: GPU names -> compute capability (major, minor). ``sm90``, ``9.0`` or ``(9, 0)`` are accepted too.
GPU_GENERATIONS: dict[str, tuple[int, int]] = {
    "v100": (7, 0),
    "t4": (7, 5),
    "a100": (8, 0),
    "a30": (8, 0),
    "a10": (8, 6),
    "a10g": (8, 6),
    "a40": (8, 6),
    "rtx3090": (8, 6),
    "l4": (8, 9),
    "l40": (8, 9),
    "l40s": (8, 9),
    "rtx4090": (8, 9),
    "h100": (9, 0),
    "h200": (9, 0),
    "gh200": (9, 0),
    "b200": (10, 0),
    "gb200": (10, 0),
}


@dataclass(frozen=True)
class GpuTarget:
    """The GPU an estimate is for: its name and compute capability (``(9, 0)`` for an H100).

    The generation changes kernel choices (flash attention needs sm80+, bf16 memory-efficient
    attention sm80+) and the cuBLAS workspace (32 MiB on sm90+, 8 MiB + 128 KiB before).
    """

    name: str
    capability: tuple[int, int]

    @classmethod
    def parse(cls, gpu: GpuLike = None) -> GpuTarget:
        """``"h100"``, ``"a100"``, ``"sm90"``, ``"8.0"``, ``(8, 0)`` or a ``GpuTarget``; ``None`` is this
        machine's GPU when CUDA is available, else an H100 (the generation the recorded truth comes from)."""
        if isinstance(gpu, GpuTarget):
            return gpu
        if gpu is None:
            if torch.cuda.is_available():
                return cls(torch.cuda.get_device_name().lower(), torch.cuda.get_device_capability())
            return cls("h100", GPU_GENERATIONS["h100"])
        if isinstance(gpu, tuple) and len(gpu) == 2 and all(isinstance(v, int) for v in gpu):
            return cls(f"sm{gpu[0]}{gpu[1]}", gpu)
        text = str(gpu).strip().lower().replace("nvidia", "").replace(" ", "").replace("-", "")
        if text in GPU_GENERATIONS:
            return cls(text, GPU_GENERATIONS[text])
        match = re.fullmatch(r"(?:sm_?)?(\d+)(?:\.(\d))?", text)
        if match and (match.group(2) is not None or text.startswith("sm")):
            digits = match.group(1)
            if match.group(2) is not None:
                return cls(f"sm{digits}{match.group(2)}", (int(digits), int(match.group(2))))
            if len(digits) >= 2:
                return cls(f"sm{digits}", (int(digits[:-1]), int(digits[-1])))
        raise ValueError(
            f"unknown GPU {gpu!r}: give a name ({', '.join(sorted(GPU_GENERATIONS))}), "
            "a compute capability such as 'sm90' or '8.0', or a (major, minor) tuple"
        )

    @property
    def sm(self) -> int:
        """The capability as one number: 90 for (9, 0)."""
        return self.capability[0] * 10 + self.capability[1]


#: a ``gpu=`` argument: a name (``"h100"``), a compute capability (``"sm90"``, ``"8.0"``, ``(8, 0)``), a
#: :class:`GpuTarget`, or ``None`` (this machine's GPU, else an H100)
GpuLike = GpuTarget | str | tuple[int, int] | None


def _workspace_config_bytes(text: str) -> int:
    """Bytes of a ``CUBLAS_WORKSPACE_CONFIG`` such as ``":4096:8"`` (pairs of KiB size and count)."""
    numbers = [int(n) for n in re.findall(r":(\d+)", text)]
    return sum(numbers[i] * KiB * numbers[i + 1] for i in range(0, len(numbers) - 1, 2))


def cublas_workspace_bytes(gpu: GpuTarget) -> int:
    """The cuBLAS workspace torch allocates (through the caching allocator) at the first matmul on a
    stream: ``CUBLAS_WORKSPACE_CONFIG`` if set, else ``":4096:8"`` (32 MiB) on sm90+ and
    ``":4096:2:16:8"`` (8 MiB + 128 KiB) before (CublasHandlePool.cpp)."""
    configured = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if configured and _workspace_config_bytes(configured):
        return _workspace_config_bytes(configured)
    return 32 * MiB if gpu.capability >= (9, 0) else 8 * MiB + 128 * KiB


def cublaslt_workspace_bytes(gpu: GpuTarget) -> int:
    """The cuBLASLt workspace (addmm with a bias epilogue): ``CUBLASLT_WORKSPACE_SIZE`` KiB if set, else 1 MiB."""
    configured = os.environ.get("CUBLASLT_WORKSPACE_SIZE")
    return int(configured) * KiB if configured and configured.isdigit() else 1 * MiB


def conv_workspace_bytes(input: torch.Tensor, weight: torch.Tensor, output: torch.Tensor) -> int:
    """cuDNN's workspace for one convolution (forward, or each of backward-data and backward-weight):
    the bytes of input + output + weight (+16). On the H100 trace most convolutions' workspaces are
    exactly that (cuDNN 9's engines transpose NCHW operands into NHWC in the workspace); the
    algorithm, and so the size, is cuDNN's choice per shape, so this is a model, not a rule."""
    return _nbytes(input) + _nbytes(output) + _nbytes(weight) + 16


#: backward-weight workspaces on the H100 trace are 1.0-1.5x the forward's (median about 1.25x, fp32 and bf16)
CONV_WEIGHT_GRAD_WORKSPACE_FACTOR = 1.25


def _nbytes(tensor: Any) -> int:
    return tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0
