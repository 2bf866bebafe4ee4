"""Predicted step time on a GPU from the fake step: FLOPs and bytes moved per op, a roofline per device, a per-op
overhead.

The estimate's fake step (:func:`~lightning_memkit.estimate.estimate_memory`) runs every op of a training step on
fake tensors; :class:`OpCosts` listens to those ops
(:func:`~lightning_memkit.estimate.step.settings.observing_ops`) in the same fake step that gives the memory, and
keeps, for the steady-state step (the second), each op's FLOPs (torch's own formulas, ``torch.utils.flop_counter``),
bytes moved (inputs + outputs; a view moves none) and dtype, split into the per-micro-batch part (forward, backward
and the recompute of checkpointed regions, which reruns inside the backward) and the once-per-step part (the
optimizer).

One op takes ``max(flops / peak_flops[dtype], bytes / bandwidth) + op_overhead`` (a roofline plus the launch cost);
a step takes ``accumulation * (micro-batch ops + batch_overhead [+ offload copies]) + optimizer ops``. The device
figures come from one table, :data:`ROOFLINES` (the vendor's dense peak FLOP/s per dtype, HBM bandwidth, host link).
A plan uses the model where no trial can run (a plan for a GPU this machine lacks: its table is the prediction); its
trials, not the model, choose.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_memkit._torch_compat import tree_flatten
from lightning_memkit.estimate.cuda.gpu_target import GpuTarget
from lightning_memkit.modes.checkpoint_wrap import in_checkpointed_region
from lightning_memkit.plan._torch_compat import is_view_op, op_flops

__all__ = [
    "INTERCONNECTS",
    "KERNEL_EFFICIENCY",
    "ROOFLINES",
    "OpCosts",
    "Roofline",
    "StepTerms",
    "TimeModel",
    "roofline_for",
]

_LOW = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Roofline:
    """One device's speeds.

    Attributes:
        name: the device.
        fp32_flops: peak dense FP32 FLOP/s (no TF32: torch's default matmul precision).
        low_flops: peak dense FLOP/s in bf16/fp16 (tensor cores on GPUs).
        bandwidth: memory bandwidth, bytes/s (HBM on GPUs).
        host_link: host <-> device bandwidth, bytes/s (PCIe or NVLink-C2C; what activation offload moves over).
        op_overhead_s: seconds per op beyond its roofline time (kernel launch, Python and dispatcher), seconds.
        batch_overhead_s: seconds per micro-batch beyond its ops (Lightning's loop, hooks, the batch's transfer).
        memory_bytes: the device's memory, bytes (the budget when none is given).
    """

    name: str
    fp32_flops: float
    low_flops: float
    bandwidth: float
    host_link: float
    op_overhead_s: float = 8e-6
    batch_overhead_s: float = 1e-3
    memory_bytes: int = 0


_T = 1e12
_GB = 1e9
_GIB = 1 << 30
#: The roofline table (dense peaks from the vendors' data sheets; SXM parts where there are several). Real kernels
#: reach :data:`KERNEL_EFFICIENCY` of these. Host links: PCIe 3 x16 16 GB/s, PCIe 4 32 GB/s, PCIe 5 64 GB/s,
#: PCIe 6 128 GB/s, NVLink-C2C (GH200, GB200) 450 GB/s per direction. Memory: the largest part's, GiB.
ROOFLINES: dict[str, Roofline] = {
    "v100": Roofline("v100", 15.7 * _T, 125 * _T, 900 * _GB, 16 * _GB, memory_bytes=32 * _GIB),
    "t4": Roofline("t4", 8.1 * _T, 65 * _T, 320 * _GB, 16 * _GB, memory_bytes=16 * _GIB),
    "a100": Roofline("a100", 19.5 * _T, 312 * _T, 2039 * _GB, 32 * _GB, memory_bytes=80 * _GIB),
    "a10": Roofline("a10", 31.2 * _T, 125 * _T, 600 * _GB, 32 * _GB, memory_bytes=24 * _GIB),
    "l4": Roofline("l4", 30.3 * _T, 121 * _T, 300 * _GB, 32 * _GB, memory_bytes=24 * _GIB),
    "l40s": Roofline("l40s", 91.6 * _T, 362 * _T, 864 * _GB, 32 * _GB, memory_bytes=48 * _GIB),
    "h100": Roofline("h100", 67 * _T, 989 * _T, 3350 * _GB, 64 * _GB, memory_bytes=80 * _GIB),
    "h200": Roofline("h200", 67 * _T, 989 * _T, 4800 * _GB, 64 * _GB, memory_bytes=141 * _GIB),
    "gh200": Roofline("gh200", 67 * _T, 989 * _T, 4000 * _GB, 450 * _GB, memory_bytes=96 * _GIB),
    "b200": Roofline("b200", 80 * _T, 2250 * _T, 8000 * _GB, 128 * _GB, memory_bytes=180 * _GIB),
}
#: the row for a compute capability not named in the table (by major version)
_BY_MAJOR = {7: "v100", 8: "a100", 9: "h100", 10: "b200"}
#: the share of a roofline's peak that real kernels reach (matmuls, elementwise)
KERNEL_EFFICIENCY = {"flops": 0.7, "bandwidth": 0.8}
#: what one rank's collectives move per second, bytes/s, by interconnect: NVLink 4 within a node (H100 SXM: 450 GB/s
#: per direction, about 400 GB/s reached by NCCL's ring collectives), InfiniBand NDR across nodes (400 Gb/s per GPU),
#: PCIe 4 x16 without NVLink
INTERCONNECTS: dict[str, float] = {"nvlink": 400e9, "infiniband": 50e9, "pcie": 25e9}


def roofline_for(gpu: Any = None) -> Roofline:
    """The :data:`ROOFLINES` row for a GPU (a name, ``"sm90"``, a
    :class:`~lightning_memkit.estimate.cuda.gpu_target.GpuTarget`; ``None``: this machine's GPU, else an H100).
    Names are matched as :class:`GpuTarget` parses them; an unnamed GPU gets its generation's row."""
    target = GpuTarget.parse(gpu)
    for name in sorted(ROOFLINES, key=len, reverse=True):
        if name in target.name:
            return ROOFLINES[name]
    return ROOFLINES[_BY_MAJOR.get(target.capability[0], "h100")]


@dataclass
class _Ops:
    flops_fp32: float = 0.0
    flops_low: float = 0.0
    count: int = 0
    items: list[tuple[int, int, bool]] = field(default_factory=list)  # (flops, bytes, low precision) per op

    def add(self, flops: int, nbytes: int, low: bool) -> None:
        self.items.append((flops, nbytes, low))
        self.count += 1
        if low:
            self.flops_low += flops
        else:
            self.flops_fp32 += flops

    @property
    def bytes(self) -> int:
        return sum(item[1] for item in self.items)

    def kernel_seconds(self, roof: Roofline) -> float:
        """The ops' roofline time (no overhead), seconds."""
        flops_fp32 = roof.fp32_flops * KERNEL_EFFICIENCY["flops"]
        flops_low = roof.low_flops * KERNEL_EFFICIENCY["flops"]
        bandwidth = roof.bandwidth * KERNEL_EFFICIENCY["bandwidth"]
        total = 0.0
        for flops, nbytes, low in self.items:
            total += max(flops / (flops_low if low else flops_fp32), nbytes / bandwidth)
        return total


def _tensor_bytes(tree: Any) -> tuple[int, torch.dtype | None]:
    total, dtype = 0, None
    for leaf in tree_flatten(tree)[0]:
        if isinstance(leaf, torch.Tensor):
            total += leaf.numel() * leaf.element_size()
            if dtype is None and leaf.is_floating_point():
                dtype = leaf.dtype
    return total, dtype


class OpCosts:
    """The ops of one fake step, as a listener for :func:`~lightning_memkit.estimate.step.settings.observing_ops`.

    Keeps the steady-state step's (the second step's) ops: :attr:`micro` (forward, backward, recompute; all the
    micro-batches the fake step ran: :attr:`micro_batches`) and :attr:`optimizer` (the optimizer step, once per step).
    """

    def __init__(self, step: int = 2) -> None:
        self.step = step
        self.micro = _Ops()
        self.optimizer = _Ops()
        self.recompute = _Ops()  # the micro-batch ops that rerun a checkpointed region's forward in the backward
        self.micro_batches = 1

    def __call__(self, func: Any, args: Any, kwargs: Any, result: Any, accountant: Any) -> None:
        if accountant.step != self.step:
            return
        self.micro_batches = max(self.micro_batches, getattr(accountant, "micro_batch", 0) + 1)
        out_bytes, out_dtype = _tensor_bytes(result)
        if is_view_op(func):
            nbytes = 0
        else:
            in_bytes, _ = _tensor_bytes((args, kwargs))
            nbytes = in_bytes + out_bytes
        flops = op_flops(func, args, kwargs, result)
        target = self.optimizer if accountant.label == "optimizer" else self.micro
        target.add(flops, nbytes, out_dtype in _LOW)
        if accountant.label == "backward" and in_checkpointed_region():
            self.recompute.add(flops, nbytes, out_dtype in _LOW)

    @property
    def micro_batch_flops(self) -> float:
        """FLOPs of one micro-batch's forward and backward (recompute included)."""
        return (self.micro.flops_fp32 + self.micro.flops_low) / self.micro_batches


@dataclass(frozen=True)
class StepTerms:
    """One optimizer step's predicted time on one device, by term (seconds; bytes where named).

    Attributes:
        compute_s: the forward and backward of every micro-batch, without the recompute (roofline plus per-op cost).
        recompute_s: the checkpointed regions' forward run again in the backward.
        optimizer_s: the optimizer step (on a sharding strategy, on this rank's shard).
        loop_s: the training loop's own cost per micro-batch.
        offload_s: activation offload's copies to the host and back (over the host link).
        comm_bytes: what this rank sends to the others per optimizer step (all-reduce, all-gathers,
            reduce-scatters), bytes.
        comm_s: ``comm_bytes`` at the interconnect's bandwidth, not overlapped with compute (an upper bound).
    """

    compute_s: float
    recompute_s: float
    optimizer_s: float
    loop_s: float
    offload_s: float = 0.0
    comm_bytes: int = 0
    comm_s: float = 0.0

    @property
    def total_s(self) -> float:
        """The step, seconds: every term added."""
        return self.compute_s + self.recompute_s + self.optimizer_s + self.loop_s + self.offload_s + self.comm_s


@dataclass(frozen=True)
class TimeModel:
    """Step time from :class:`OpCosts` on a :class:`Roofline` (seconds): ``accumulation * (roofline(micro-batch ops)
    + op_overhead * ops + batch_overhead [+ offload copies]) + roofline(optimizer ops) + op_overhead * optimizer
    ops [+ communication]``, by term (:class:`StepTerms`).

    Attributes:
        roofline: the device's speeds (its ``op_overhead_s`` and ``batch_overhead_s`` are the overheads).
        interconnect: bytes per second one rank's collectives move at (:data:`INTERCONNECTS`); ``None`` on one device.
    """

    roofline: Roofline
    interconnect: float | None = None

    def step_terms(
        self,
        costs: OpCosts,
        accumulation: int,
        offload_bytes: int = 0,
        comm_bytes: int = 0,
        optimizer_share: float = 1.0,
    ) -> StepTerms:
        """Predicted terms of one optimizer step of ``accumulation`` micro-batches. ``offload_bytes``: bytes of saved
        activations one micro-batch moves to the host and back; ``comm_bytes``: bytes this rank sends per step;
        ``optimizer_share``: the part of the optimizer's ops this rank runs (``1 / world_size`` where the optimizer
        state is sharded)."""
        roof = self.roofline

        def seconds(ops: _Ops) -> float:
            return ops.kernel_seconds(roof) + roof.op_overhead_s * ops.count

        per_micro = accumulation / costs.micro_batches
        recompute = seconds(costs.recompute) * per_micro
        if comm_bytes and not self.interconnect:
            raise ValueError("a step that communicates needs the interconnect's bandwidth (TimeModel.interconnect)")
        return StepTerms(
            compute_s=seconds(costs.micro) * per_micro - recompute,
            recompute_s=recompute,
            optimizer_s=seconds(costs.optimizer) * optimizer_share,
            loop_s=accumulation * roof.batch_overhead_s,
            offload_s=accumulation * 2 * offload_bytes / roof.host_link if offload_bytes else 0.0,
            comm_bytes=comm_bytes,
            comm_s=comm_bytes / self.interconnect if comm_bytes and self.interconnect else 0.0,
        )

    def step_seconds(self, costs: OpCosts, accumulation: int, offload_bytes: int = 0) -> float:
        """Predicted seconds of one optimizer step of ``accumulation`` micro-batches on one device (the sum of
        :meth:`step_terms`)."""
        return self.step_terms(costs, accumulation, offload_bytes).total_s
