"""Predicted step time from the fake step: FLOPs and bytes moved per op, a roofline per device, a per-op overhead.

The estimate's fake step (:func:`~lightning_memkit.estimate.estimate_memory`) runs every op of a training step on
fake tensors; :class:`OpCosts` listens to those ops (:func:`~lightning_memkit.estimate.core.observing_ops`) in the
same fake step that gives the memory, and keeps, for the steady-state step (the second), each op's FLOPs (torch's
own formulas, ``torch.utils.flop_counter``), bytes moved (inputs + outputs; a view moves none) and dtype, split into
the per-micro-batch part (forward, backward and the recompute of checkpointed regions, which reruns inside the
backward) and the once-per-step part (the optimizer).

One op takes ``max(flops / peak_flops[dtype], bytes / bandwidth) + op_overhead`` (a roofline plus the launch and
dispatch cost that makes small micro-batches slow); a step takes ``accumulation * (factor * micro-batch ops +
batch_overhead + checkpointing's overhead) + optimizer ops + step_overhead`` (``factor``: a measured correction per
micro-batch size, 1 on a GPU; the overheads: the training loop's own cost, which no op shows, and what torch's
checkpoint runs in Python per checkpointed call and per op inside one).
The device figures come from one table, :data:`ROOFLINES` (CUDA: the vendor's dense peak FLOP/s per dtype, HBM
bandwidth, host link). On CPU they are measured on this machine by :func:`calibrate_cpu` (a matmul, a large
elementwise op, a tiny op: about 0.1 s, no model step), the loop's overheads and checkpointing's are measured by the
planner (a trivial module in Lightning's loop; a chain of tiny blocks plain and checkpointed,
:mod:`~lightning_memkit.plan.checkpoint_cost`), and the per-op overhead and the kernels' scale are fitted
(:meth:`TimeModel.fit`) to real steps at a small micro-batch with accumulation 1 and 4 (calibration, not trials:
their difference also measures the once-per-step part, :attr:`TimeModel.step_s`), at each larger micro-batch size
that fits (the kernels' scale parted from the per-op overhead, and each size's own correction,
:attr:`TimeModel.micro_factors`) and to every real trial as it ends.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from lightning_memkit._torch_compat import tree_flatten
from lightning_memkit.estimate.cuda_kernels import GpuTarget
from lightning_memkit.modes.checkpoint_wrap import checkpoint_region
from lightning_memkit.plan._torch_compat import is_view_op, op_flops

__all__ = [
    "Roofline",
    "ROOFLINES",
    "roofline_for",
    "calibrate_cpu",
    "OpCosts",
    "TimeModel",
    "KERNEL_EFFICIENCY",
    "MIN_MICRO_FACTOR",
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
        memory_bytes: the device's memory, bytes (the budget when none is given; 0 for the CPU).
        step_overhead_s: seconds per optimizer step beyond its ops (Lightning's optimizer loop, ``zero_grad``).
        checkpoint_call_s: seconds per checkpointed call beyond its ops (torch's checkpoint frame, the recompute's
            start; Python on the host). Measured on CPU (:mod:`~lightning_memkit.plan.checkpoint_cost`); 0 in the
            GPU rows (not measured there: a GPU plan's trials time it).
        checkpoint_op_s: seconds per op inside a checkpointed call beyond the op (the saved-tensor hooks of the
            forward, the recompute and the backward). Measured on CPU; 0 in the GPU rows.
    """

    name: str
    fp32_flops: float
    low_flops: float
    bandwidth: float
    host_link: float
    op_overhead_s: float = 8e-6
    batch_overhead_s: float = 1e-3
    memory_bytes: int = 0
    step_overhead_s: float = 0.0
    checkpoint_call_s: float = 0.0
    checkpoint_op_s: float = 0.0


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
#: the smallest per-size correction :meth:`TimeModel.fit` keeps (a step measured faster than the model's overheads
#: alone: the machine's noise, priced as nearly all overhead)
MIN_MICRO_FACTOR = 0.05


def roofline_for(gpu: Any = None) -> Roofline:
    """The :data:`ROOFLINES` row for a GPU (a name, ``"sm90"``, a
    :class:`~lightning_memkit.estimate.cuda_kernels.GpuTarget`; ``None``: this machine's GPU, else an H100). Names are
    matched as :class:`GpuTarget` parses them; an unnamed GPU gets
    its generation's row."""
    target = GpuTarget.parse(gpu)
    for name in sorted(ROOFLINES, key=len, reverse=True):
        if name in target.name:
            return ROOFLINES[name]
    return ROOFLINES[_BY_MAJOR.get(target.capability[0], "h100")]


def _timed(fn: Any, repeats: int) -> float:
    fn()  # warm
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - started) / repeats)
    return best


def calibrate_cpu() -> Roofline:
    """This CPU's speeds, measured (about 0.1 s; the tensors are freed before it returns): FP32 and bf16 matmul
    FLOP/s (512 x 512), bandwidth of an elementwise add over 16 MiB, the cost of one tiny op."""
    with torch.no_grad():
        fp32, low, bandwidth, overhead = _cpu_speeds()  # its tensors are freed as it returns
    return Roofline("cpu (measured)", fp32, low, bandwidth, bandwidth, op_overhead_s=overhead, batch_overhead_s=1e-3)


def _cpu_speeds() -> tuple[float, float, float, float]:
    """``(fp32 FLOP/s, bf16 FLOP/s, bytes/s, seconds per tiny op)`` of this CPU."""
    a = torch.randn(512, 512)
    b = torch.randn(512, 512)
    fp32 = 2 * 512**3 / _timed(lambda: torch.mm(a, b), 4)
    a16, b16 = a.bfloat16(), b.bfloat16()
    low = 2 * 512**3 / _timed(lambda: torch.mm(a16, b16), 4)
    big = torch.empty(4 << 20)
    bandwidth = 3 * big.numel() * 4 / _timed(lambda: torch.add(big, 1.0), 4)  # read + write + the out allocation
    tiny = torch.zeros(1)
    overhead = _timed(lambda: torch.add(tiny, 1.0), 200)
    return fp32, low, bandwidth, overhead


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
    """The ops of one fake step, as a listener for :func:`~lightning_memkit.estimate.core.observing_ops`.

    Keeps the steady-state step's (the second step's) ops: :attr:`micro` (forward, backward, recompute; all the
    micro-batches the fake step ran: :attr:`micro_batches`) and :attr:`optimizer` (the optimizer step, once per step).
    """

    def __init__(self, step: int = 2) -> None:
        self.step = step
        self.micro = _Ops()
        self.optimizer = _Ops()
        self.micro_batches = 1
        self.regions: set[int] = set()  # the checkpointed calls of the step's forwards
        self.region_ops = 0  # the ops inside them (their first forward; the recompute's are in micro too)

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
        region = checkpoint_region()
        if region and accountant.label == "forward":
            self.regions.add(region)
            self.region_ops += 1

    @property
    def checkpoint_terms(self) -> tuple[float, float]:
        """Per micro-batch: ``(checkpointed regions, ops inside them)`` (their first forward)."""
        return len(self.regions) / self.micro_batches, self.region_ops / self.micro_batches

    @property
    def micro_batch_flops(self) -> float:
        """FLOPs of one micro-batch's forward and backward (recompute included)."""
        return (self.micro.flops_fp32 + self.micro.flops_low) / self.micro_batches


@dataclass
class TimeModel:
    """Step time from :class:`OpCosts` on a :class:`Roofline` (seconds).

    ``step = accumulation * (factor * (scale * roofline(micro-batch ops) + op_overhead * ops) + batch_overhead
    + checkpoint_call * checkpointed calls + checkpoint_op * ops inside them [+ offload copies])
    + scale * roofline(optimizer ops) + op_overhead * optimizer ops + step_overhead``; with :attr:`step_s` measured,
    its last three terms are ``step_s``; ``factor`` is :meth:`micro_factor` (1 unless fitted).

    Attributes:
        roofline: the device's speeds (its ``op_overhead_s`` and ``batch_overhead_s`` are the overheads).
        scale: measured / roofline time of the ops' kernels (1.0 before calibration, see :meth:`fit`).
        step_s: the once-per-step part measured, seconds (the optimizer step, ``zero_grad``, Lightning's optimizer
            loop: the same for every candidate of one module at the precision it was measured in; a ``16-mixed``
            candidate's GradScaler work per step is not in it), or ``None``: from the optimizer's ops. On a CPU the
            optimizer's many tiny ops cost a fraction of the model's per op, which one fitted per-op overhead
            cannot say.
        micro_factors: measured / predicted time of a micro-batch's ops (scaled kernels plus per-op overhead) at each
            micro-batch size observed, per precision (``(precision, samples)`` -> factor; empty before a :meth:`fit`
            to observations that give them): what one scale and one per-op overhead miss at that size (see
            :meth:`_fit_micro_factors`). Used where :meth:`step_seconds` is told the micro-batch and precision.
    """

    roofline: Roofline
    scale: float = 1.0
    step_s: float | None = None
    micro_factors: dict[tuple[str, int], float] = field(default_factory=dict)

    def micro_factor(self, micro_batch: int | None, precision: str = "") -> float:
        """The measured correction of a micro-batch's ops at ``micro_batch`` samples in ``precision`` (1.0 where
        none was measured in that precision): :attr:`micro_factors` at a measured size, interpolated on log scales
        between two, the nearest's beyond them."""
        factors = {size: f for (p, size), f in self.micro_factors.items() if p == precision}
        if micro_batch is None or not factors:
            return 1.0
        sizes = sorted(factors)
        clamped = min(max(micro_batch, sizes[0]), sizes[-1])
        if clamped in factors:
            return factors[clamped]
        below = max(size for size in sizes if size < clamped)
        above = min(size for size in sizes if size > clamped)
        weight = math.log(clamped / below) / math.log(above / below)
        return math.exp((1 - weight) * math.log(factors[below]) + weight * math.log(factors[above]))

    def _micro_seconds(self, costs: OpCosts, accumulation: int) -> float:
        """Seconds of the step's micro-batch ops (kernels x scale + their per-op overhead; no measured overheads)."""
        kernels, ops = self._micro_terms(costs, accumulation)
        return self.scale * kernels + self.roofline.op_overhead_s * ops

    def _micro_terms(self, costs: OpCosts, accumulation: int) -> tuple[float, float]:
        """(roofline seconds of the step's micro-batch kernels at scale 1, their op count)."""
        return (
            accumulation * costs.micro.kernel_seconds(self.roofline) / costs.micro_batches,
            accumulation * costs.micro.count / costs.micro_batches,
        )

    def _parts(self, costs: OpCosts, accumulation: int) -> tuple[float, float]:
        """(roofline seconds, overhead seconds) of one step."""
        roof = self.roofline
        kernels, ops = self._terms(costs, accumulation)
        return kernels, ops * roof.op_overhead_s + self._measured_overheads(costs, accumulation)

    def _measured_overheads(self, costs: OpCosts, accumulation: int) -> float:
        """Seconds of one step that the roofline's measured overheads give: Lightning's loop, checkpointing's frames."""
        roof = self.roofline
        calls, inside = costs.checkpoint_terms
        checkpointing = calls * roof.checkpoint_call_s + inside * roof.checkpoint_op_s
        once = roof.step_overhead_s if self.step_s is None else self.step_s
        return accumulation * (roof.batch_overhead_s + checkpointing) + once

    def step_seconds(
        self,
        costs: OpCosts,
        accumulation: int,
        offload_bytes: int = 0,
        micro_batch: int | None = None,
        precision: str = "",
    ) -> float:
        """Predicted seconds of one optimizer step of ``accumulation`` micro-batches. ``offload_bytes``: bytes of saved
        activations one micro-batch moves to the host and back (over :attr:`Roofline.host_link`, not overlapped).
        ``micro_batch`` (samples) and ``precision`` (the Trainer's, e.g. ``"32-true"``): with :attr:`micro_factors`
        fitted, the micro-batch ops are scaled by :meth:`micro_factor` there."""
        kernels, overhead = self._parts(costs, accumulation)
        copies = accumulation * 2 * offload_bytes / self.roofline.host_link if offload_bytes else 0.0
        factor = self.micro_factor(micro_batch, precision)
        correction = (factor - 1) * self._micro_seconds(costs, accumulation) if factor != 1.0 else 0.0
        return self.scale * kernels + overhead + copies + correction

    def _terms(self, costs: OpCosts, accumulation: int) -> tuple[float, float]:
        """(roofline seconds of the step's kernels at scale 1, the step's op count)."""
        kernels, ops = self._micro_terms(costs, accumulation)
        if self.step_s is None:  # the optimizer from its ops; else it is in step_s
            kernels += costs.optimizer.kernel_seconds(self.roofline)
            ops += costs.optimizer.count
        return kernels, ops

    def fit(self, observations: list[tuple]) -> TimeModel:
        """A copy fitted to real steps: ``observations`` are ``(costs, accumulation, measured seconds)``, or
        ``(costs, accumulation, measured seconds, micro-batch samples, precision)``: those also fit
        :attr:`micro_factors` (:meth:`_fit_micro_factors`, after the fit below). Offload's copies are not parted
        from an observation (CPU plans, the only ones fitted, have no offload).

        The loop's overheads (:attr:`Roofline.batch_overhead_s` per micro-batch, :attr:`Roofline.step_overhead_s` per
        step) and checkpointing's (:attr:`Roofline.checkpoint_call_s`, :attr:`Roofline.checkpoint_op_s`) are measured
        apart and kept, and so is :attr:`step_s` when measured; the kernel scale ``a`` and the per-op overhead ``o``
        solve ``seconds - loop = a * roofline + o * ops`` by least squares on relative errors (each observation divided
        by its seconds, so a 10 ms step weighs as much as a 1 s one), both kept positive. With one observation (or a fit
        that is not positive) only the scale is fitted and the per-op overhead kept."""
        fitted = self._fit_scale_and_overhead([observation[:3] for observation in observations])
        return fitted._fit_micro_factors([o for o in observations if len(o) > 4 and o[3] is not None])

    def _fit_micro_factors(self, observations: list[tuple]) -> TimeModel:
        """A copy whose :attr:`micro_factors` make it meet ``(costs, accumulation, seconds, micro-batch, precision)``
        observations at their micro-batches (the geometric mean of the factors of those at one size and precision;
        none kept from before; at least :data:`MIN_MICRO_FACTOR`: a step measured below the model's overheads alone
        is priced at the floor, not at its neighbours' factor). One scale and one per-op overhead cannot follow a
        CPU's kernels across micro-batch sizes: their efficiency jumps with the batch (a DemoResNet's step costs about
        twice as much at micro-batch 2 as at 1, but 2.3 times at 4), so each micro-batch measured is priced at its
        own correction of the micro-batch ops (its checkpointed rows' recompute runs the same kernels on the same
        shapes)."""
        logs: dict[tuple[str, int], list[float]] = {}
        for costs, accumulation, seconds, micro_batch, precision in observations:
            micro = self._micro_seconds(costs, accumulation)
            rest = self.step_seconds(costs, accumulation) - micro
            if seconds > 0 and micro > 0:
                factor = max((seconds - rest) / micro, MIN_MICRO_FACTOR)
                logs.setdefault((precision, micro_batch), []).append(math.log(factor))
        factors = {size: math.exp(sum(values) / len(values)) for size, values in logs.items()}
        return replace(self, micro_factors=factors)

    def _fit_scale_and_overhead(self, observations: list[tuple[OpCosts, int, float]]) -> TimeModel:
        """:meth:`fit`'s kernel scale and per-op overhead (:attr:`micro_factors` kept)."""
        roof = self.roofline
        terms = []
        for costs, accumulation, seconds in observations:
            if seconds > 0:
                kernels, ops = self._terms(costs, accumulation)
                loop = self._measured_overheads(costs, accumulation)
                terms.append((kernels / seconds, ops / seconds, (seconds - loop) / seconds))
        if not terms:
            return self
        if len(terms) >= 2:
            skk = sum(k * k for k, _, _ in terms)
            skn = sum(k * n for k, n, _ in terms)
            snn = sum(n * n for _, n, _ in terms)
            skt = sum(k * t for k, _, t in terms)
            snt = sum(n * t for _, n, t in terms)
            det = skk * snn - skn * skn
            if det > 1e-6 * skk * snn:  # else the observations' kernels and ops are in one ratio: no split
                scale = (skt * snn - skn * snt) / det
                overhead = (skk * snt - skn * skt) / det
                if scale > 0 and overhead > 0:
                    return replace(self, scale=scale, roofline=replace(roof, op_overhead_s=overhead))
        # the scale alone, from the observations' sums (the per-op overhead kept)
        kernels = sum(k for k, _, _ in terms)
        rest = sum(t - n * roof.op_overhead_s for _, n, t in terms)
        if kernels > 0 and rest > 0:
            return replace(self, scale=rest / kernels)
        # the overheads alone already exceed the measured time: shrink the per-op overhead to fit
        ops = sum(n for _, n, _ in terms)
        target = sum(t for _, _, t in terms) - self.scale * kernels
        if ops > 0 and target > 0:
            return replace(self, roofline=replace(roof, op_overhead_s=target / ops))
        return self
