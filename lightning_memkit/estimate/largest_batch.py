"""The largest batch that fits: estimates at a few sizes, an affine fit of their growth, a check at the answer.

Memory grows with the batch as ``fixed + per_sample * batch`` (parameters, gradients and optimizer
state are fixed; activations and inputs grow); the fit gives the jump, estimates confirm it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import psutil
import torch
from torch import nn

from lightning_memkit.errors import MemkitError
from lightning_memkit.estimate.api import compiled_original, estimate_memory
from lightning_memkit.estimate.data.batches import batch_size_of
from lightning_memkit.estimate.distributed.per_rank import estimate_distributed_memory
from lightning_memkit.estimate.distributed.sharding import sharding_of
from lightning_memkit.estimate.step.memory_estimate import EstimateError, MemoryEstimate
from lightning_memkit.estimate.step.runner import prepare_batch
from lightning_memkit.estimate.step.settings import EstimateSettings, reusing_fake_copies
from lightning_memkit.units import format_bytes, parse_bytes

if TYPE_CHECKING:
    from lightning.pytorch import LightningDataModule

    from lightning_memkit.estimate.distributed.per_rank import DistributedEstimate
    from lightning_memkit.modes.mode import ModeLike

__all__ = ["AffineGrowth", "BatchSizePrediction", "DoesNotFitError", "predict_max_batch_size", "device_capacity_bytes"]


class DoesNotFitError(MemkitError, ValueError):
    """Even batch size 1 needs more than the memory given (a ``ValueError``).

    Attributes:
        module_name: the module's class name.
        needed_bytes: what batch size 1 needs (the estimate's ``required_bytes``), bytes.
        target_bytes: the memory it had to fit in (``capacity_bytes`` less the margin), bytes (not rounded).
        capacity_bytes: the device memory given, bytes.
        margin: the fraction of ``capacity_bytes`` kept free.
        estimate: the estimate at batch size 1 (a :class:`~lightning_memkit.estimate.MemoryEstimate`, or for a
            per-rank question a :class:`~lightning_memkit.estimate.DistributedEstimate`): the whole breakdown of
            what does not fit.
    """

    def __init__(
        self,
        module_name: str,
        needed_bytes: int,
        target_bytes: float,
        capacity_bytes: int,
        margin: float,
        estimate: MemoryEstimate | DistributedEstimate | None = None,
    ) -> None:
        self.module_name = module_name
        self.needed_bytes = needed_bytes
        self.target_bytes = target_bytes
        self.capacity_bytes = capacity_bytes
        self.margin = margin
        self.estimate = estimate
        super().__init__(
            self.describe(
                "mode_needs() (lightning_memkit.estimate) estimates what each other mode needs at batch size 1; "
                "or a smaller model, or more memory"
            )
        )

    def describe(self, fixes: str) -> str:
        """The message, ending with ``fixes``: what to do, in the caller's interface (computed, never guessed)."""
        return (
            f"{self.module_name} does not fit in {format_bytes(self.target_bytes)} ({1 - self.margin:.0%} of "
            f"{format_bytes(self.capacity_bytes)}) even at batch size 1: it needs "
            f"{format_bytes(self.needed_bytes)}; {fixes}"
        )


@dataclass(frozen=True)
class AffineGrowth:
    """``bytes(batch) = fixed_bytes + per_sample_bytes * batch`` (bytes; ``per_sample_bytes`` > 0).

    A fit over a few batch sizes: ``fixed_bytes`` is the line's intercept there, not the model's fixed
    memory (it may be negative where allocator segments make the curve step); ``per_sample_bytes`` is
    the growth per sample near those sizes.
    """

    fixed_bytes: float
    per_sample_bytes: float

    @classmethod
    def fit(cls, points: Sequence[tuple[int, int]]) -> AffineGrowth:
        """Least-squares fit through ``(batch_size, bytes)`` points (at least two distinct sizes)."""
        sizes = {b for b, _ in points}
        if len(sizes) < 2:
            raise ValueError("an affine fit needs measurements at two different batch sizes")
        n = len(points)
        mean_b = sum(b for b, _ in points) / n
        mean_y = sum(y for _, y in points) / n
        covariance = sum((b - mean_b) * (y - mean_y) for b, y in points)
        variance = sum((b - mean_b) ** 2 for b, _ in points)
        slope = max(covariance / variance, 1.0)
        return cls(mean_y - slope * mean_b, slope)

    def bytes_at(self, batch_size: float) -> float:
        """Predicted bytes at ``batch_size``."""
        return self.fixed_bytes + self.per_sample_bytes * batch_size

    def largest_fitting(self, capacity_bytes: float) -> int:
        """The largest batch size whose predicted bytes are at most ``capacity_bytes`` (0 if none)."""
        return max(0, math.floor((capacity_bytes - self.fixed_bytes) / self.per_sample_bytes))


@dataclass
class BatchSizePrediction:
    """The predicted largest batch size and how it was found (sizes in bytes).

    Attributes:
        batch_size: the largest batch size whose estimated ``required_bytes`` fit in
            ``(1 - margin) * device_memory_bytes``.
        predicted_bytes: the estimate's ``required_bytes`` at ``batch_size``.
        device_memory_bytes: the memory the prediction is for.
        margin: the fraction of device memory kept free.
        growth: the affine fit of required bytes against batch size.
        estimates: ``(batch_size, required_bytes)`` of every estimate made, in order.
        mode: the mode's name.
        limited_by_max: ``True`` when ``max_val`` capped the answer (it would fit larger).
        batch_shapes: the shapes of the batch estimated at ``batch_size``, e.g. ``input_ids (817, 256)``.
        batch_note: which batch that is and what the answer holds for (the data's worst batch, the batch given,
            or the batch seen; see :attr:`MemoryEstimate.batch_note`).
    """

    batch_size: int
    predicted_bytes: int
    device_memory_bytes: int
    margin: float
    growth: AffineGrowth
    estimates: list[tuple[int, int]] = field(default_factory=list)
    mode: str = "baseline"
    limited_by_max: bool = False
    batch_shapes: str = ""
    batch_note: str = ""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)

    def __str__(self) -> str:
        # the growth's intercept is a local fit (it can be negative), so only the slope near the answer is shown
        return (
            f"max batch {self.batch_size} ({self.mode}): needs {format_bytes(self.predicted_bytes)} of "
            f"{format_bytes(self.device_memory_bytes)} with {self.margin:.0%} kept free; "
            f"+{format_bytes(self.growth.per_sample_bytes)} per sample "
            f"near it{' (capped by max_val)' if self.limited_by_max else ''}"
            + (f"\nbatch: {self.batch_shapes} ({self.batch_note})" if self.batch_shapes else "")
        )


def device_capacity_bytes(device: str | torch.device = "cuda") -> int:
    """Total memory of ``device`` in bytes (the current CUDA device, or host RAM for CPU).

    Raises:
        ValueError: for CUDA when no GPU is visible (then give ``device_memory=`` explicitly).
    """
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                "no CUDA device here to read the memory of: give device_memory=, e.g. "
                "device_memory='16GiB' or 16 * 2**30"
            )
        # cuda:0 is device 0 (an index of 0 is falsy: `index or current_device()` read the current device's)
        index = device.index if device.index is not None else torch.cuda.current_device()
        return int(torch.cuda.get_device_properties(index).total_memory)
    if device.type == "cpu":
        return int(psutil.virtual_memory().total)
    raise ValueError(f"cannot read the memory of {device}; give device_memory= in bytes")


def predict_max_batch_size(
    module: nn.Module,
    device_memory: int | str | None = None,
    *,
    mode: ModeLike = None,
    margin: float = 0.05,
    device: str | torch.device = "cuda",
    batch: Any = None,
    max_val: int = 1 << 20,
    tolerance: float = 0.01,
    estimator: Callable[..., MemoryEstimate] = estimate_memory,
    strategy: Any = None,
    world_size: int = 1,
    datamodule: LightningDataModule | None = None,
    **estimate_kwargs: Any,
) -> BatchSizePrediction:
    """Predict the largest batch size whose training step fits in ``device_memory`` (fake tensors only).

    Estimates the step at two batch sizes, fits ``fixed + per_sample * batch``, jumps to the
    predicted answer and checks it with a few more estimates (secant steps), until the fitting and
    the non-fitting size are within ``tolerance`` of each other.

    Args:
        module: as for :func:`~lightning_memkit.estimate.estimate_memory`.
        device_memory: bytes (or ``"16GiB"``); default: the current CUDA device's total memory.
        mode: a mode string or Mode.
        margin: fraction of ``device_memory`` to keep free (0.05 = aim for 95%).
        device: the target device (``"cuda"`` adds allocator rounding, segments and allowances).
        batch: an example batch (default: one from the module's train dataloader).
        max_val: never predict more than this many samples per batch.
        tolerance: stop refining when the bracket is this fraction of the answer.
        estimator: the function that estimates one size (``estimate_memory``; tests pass
            ``measure_training_step``).
        strategy, world_size: the largest batch *per rank* under a multi-device strategy on ``world_size``
            ranks (``"ddp"``, ``"model_parallel"``, ``"fsdp"``, ``"deepspeed_stage_2"``...; see
            :func:`~lightning_memkit.estimate.distributed.per_rank.estimate_distributed_memory`, whose own arguments
            such as ``wrap=`` go in ``estimate_kwargs``): each size is one rank's estimate, one fake step per
            rank role, and ``device_memory`` is one device's memory.
        datamodule: a LightningDataModule whose train dataloader gives the batch (default: the module's own).

    Without ``batch=``, every size is estimated on the data's worst batch (the largest samples the train dataloader's
    dataset holds, collated by its own ``collate_fn``: see
    :func:`~lightning_memkit.estimate.data.worst_batch.find_worst_batch`),
    so the answer holds for the largest batch the data can produce; :attr:`BatchSizePrediction.batch_shapes` and
    ``batch_note`` say which batch it was.

    Raises:
        DoesNotFitError: when even batch size 1 does not fit (a ``ValueError``: its ``estimate`` holds the whole
            breakdown at batch size 1).
        ValueError: when the arguments are invalid.
    """
    if not 0 <= margin < 1:
        raise ValueError(f"margin={margin!r}: give a fraction in [0, 1), e.g. 0.05 to keep 5% free")
    if strategy is not None:
        if estimator is not estimate_memory:
            raise ValueError("give strategy= (a per-rank distributed estimate) or estimator=, not both")
        sharding_of(strategy, world_size)  # a bad name or size fails here, before any estimate

        def estimator(module_: nn.Module, batch_size: int | None, **kwargs: Any) -> Any:
            return estimate_distributed_memory(module_, batch_size, strategy=strategy, world_size=world_size, **kwargs)
    elif world_size != 1:
        raise ValueError(
            f"world_size={world_size!r} needs strategy= (e.g. strategy='ddp'): without one the estimate "
            "is one process's"
        )
    capacity = parse_bytes(device_memory) if device_memory is not None else device_capacity_bytes(device)
    target = (1 - margin) * capacity
    module = compiled_original(module) or module  # a torch.compile'd module: its eager program (see estimate_memory)
    if datamodule is not None:
        estimate_kwargs["datamodule"] = datamodule
    with reusing_fake_copies():  # one fake copy and one sample batch serve every size
        return _predict(
            module, capacity, target, mode, margin, device, batch, max_val, tolerance, estimator, estimate_kwargs
        )


def _bracket(points: list[tuple[int, int]], target: float, max_val: int) -> tuple[int, int]:
    """``(lo, hi)``: the largest batch size of ``points`` (``(size, required bytes)``) that fits ``target`` bytes (at
    most ``max_val``; 0 when none does) and the smallest that does not (``max_val + 1`` when all fit)."""
    lo, hi = 0, max_val + 1
    for size, value in points:
        if value <= target:
            lo = max(lo, min(size, max_val))  # the first sizes (the batch's own and double) may exceed max_val
        else:
            hi = min(hi, size)
    return lo, hi


def _predict(
    module: nn.Module,
    capacity: int,
    target: float,
    mode: ModeLike,
    margin: float,
    device: str | torch.device,
    batch: Any,
    max_val: int,
    tolerance: float,
    estimator: Callable[..., MemoryEstimate],
    estimate_kwargs: dict[str, Any],
) -> BatchSizePrediction:
    given = batch
    reuse = EstimateSettings.current().reuse  # the block's, so the estimates below take the same batch
    batch = prepare_batch(module, batch, None, estimate_kwargs.get("datamodule"), reuse).batch
    base = batch_size_of(batch)
    if base is None:
        raise EstimateError("the batch has no batch dimension; pass an example batch (batch=...) with one")
    points: list[tuple[int, int]] = []
    cache: dict[int, MemoryEstimate] = {}

    def required(size: int) -> int:
        if size not in cache:
            cache[size] = estimator(module, size, batch=given, mode=mode, device=device, **estimate_kwargs)
            points.append((size, cache[size].required_bytes))
        return cache[size].required_bytes

    first, second = base, max(2, base * 2)  # the batch's own size: often estimated already (memkit estimate's table)
    required(first), required(second)
    growth = AffineGrowth.fit(points)
    mode_name = cache[first].mode
    lo, hi = _bracket(points, target, max_val)
    guess = growth.largest_fitting(target)
    for _ in range(12):
        if hi - lo <= max(1, tolerance * max(lo, 1)) or lo >= max_val:
            break
        if not lo < guess < hi:
            # The fit points outside the bracket. Past an open top (the peak can be flat in the batch
            # at small sizes, so the fitted slope is near zero) probe max_val itself: it either fits,
            # or closes the bracket so that the next fit spans it. Inside a closed bracket, bisect.
            # (Creeping up from lo by a percent took 8 estimates to go from 8 to 10.)
            guess = max_val if hi > max_val else (lo + hi) // 2
            guess = min(max(guess, lo + 1), hi - 1)
        guess = min(guess, max_val)
        if required(guess) <= target:
            lo = guess
        else:
            hi = guess
        sized = sorted(points, key=lambda point: abs(point[0] - guess))[:2]
        try:
            guess = AffineGrowth.fit(sized).largest_fitting(target)
        except ValueError:
            guess = (lo + hi) // 2
        if guess == lo:  # the fit says lo is the answer: confirm just past it
            guess = lo + max(1, math.ceil(tolerance * lo))
    if lo == 0:
        value = required(1)
        if value > target:
            raise DoesNotFitError(type(module).__name__, value, target, capacity, margin, cache[1])
        lo = 1
    # The growth near the answer (at small batches the peak may sit in the optimizer step, flat in
    # batch), fitted over a wide enough span that allocator segment steps do not dominate the slope.
    near = [point for point in points if point[0] >= lo / 4]
    if len({size for size, _ in near}) < 2:
        near = sorted(points, key=lambda point: abs(point[0] - lo))[:2]
    growth = AffineGrowth.fit(near)
    if lo not in cache:
        required(lo)
    answer = cache[lo]
    return BatchSizePrediction(
        lo,
        answer.required_bytes,
        capacity,
        margin,
        growth,
        list(points),
        mode_name,
        limited_by_max=lo >= max_val,
        batch_shapes=answer.batch_shapes,
        batch_note=answer.batch_note,
    )
