"""The planner's candidate space: every way to train the user's effective batch that the allowed modes give.

A candidate is a micro-batch and an accumulation whose product is the user's effective batch exactly, a
precision (only when the user allows one: a mixed precision, a true half precision, or one of each), an
activation-checkpointing policy (none, a budget of half the
activations, or every repeated block) and, on CUDA only, activation offload. The space stays small (tens of
candidates): at most :data:`MAX_MICRO_BATCHES` micro-batches (the divisors of the batch nearest to its halvings),
three checkpointing choices, the precisions allowed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from lightning_memkit.modes.checkpoint_policy import CheckpointBudget, describe_policy
from lightning_memkit.modes.mode import TRUE_HALF_PRECISIONS, Mode, resolve_precision

__all__ = [
    "Candidate",
    "candidate_space",
    "preference",
    "recompute_level",
    "micro_batches",
    "parse_plan_modes",
    "allowed_precisions",
    "allows_true_half",
    "PLAN_MODE_WORDS",
    "PLAN_PRECISIONS",
    "MIXED_PLAN_WORDS",
    "DEFAULT_PLAN_MODES",
    "MAX_MICRO_BATCHES",
    "CHECKPOINT_CHOICES",
]

#: the words ``modes=`` (``--modes``) accepts: what the planner may change. ``bf16``, ``fp16`` and ``amp`` allow a mixed
#: precision (autocast over fp32 weights), ``bf16-true`` and ``fp16-true`` a true half precision (the weights,
#: gradients and optimizer state themselves in half precision); one word of each kind at most.
PLAN_MODE_WORDS = ("baseline", "micro_batch", "checkpoint", "bf16", "fp16", "amp", "bf16-true", "fp16-true", "offload")
#: the Lightning precisions a candidate may have
PLAN_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", *TRUE_HALF_PRECISIONS)
#: each mixed precision word's Lightning precision (``amp`` is resolved per device)
_MIXED_WORDS = {"bf16": "bf16-mixed", "fp16": "16-mixed", "amp": "amp"}
#: the words that allow a mixed precision
MIXED_PLAN_WORDS = tuple(_MIXED_WORDS)
#: each true half precision word's Lightning precision
_TRUE_HALF_WORDS = {"bf16-true": "bf16-true", "fp16-true": "16-true"}
#: how low each precision is, the rule's order: true half precision, then mixed, then full (``32-true``)
_PRECISION_RANK = {"bf16-true": 0, "16-true": 0, "bf16-mixed": 1, "16-mixed": 1, "32-true": 2}
#: the rule's order of strategies on several devices: no sharding (one all-reduce of the gradients per step), then
#: gradients and optimizer state sharded (ZeRO-2: the same bytes on the wire), then parameters too (gathered for each
#: micro-batch's forward and backward: half again as many bytes)
_STRATEGY_RANK = {None: 0, "ddp": 0, "deepspeed_stage_2": 1, "fsdp": 2, "model_parallel": 2, "deepspeed_stage_3": 2}
#: what the planner may change by default: memory-only changes (no precision change, no offload)
DEFAULT_PLAN_MODES = ("micro_batch", "checkpoint")
#: the most micro-batch sizes tried (the batch, then the divisors nearest to its halvings)
MAX_MICRO_BATCHES = 8
#: the checkpointing choices: none, a budget of half the baseline activation memory, every repeated block ("auto")
CHECKPOINT_CHOICES: tuple[Any, ...] = (None, CheckpointBudget(fraction=0.5), "auto")


@dataclass(frozen=True)
class Candidate:
    """One way to train the user's effective batch.

    Attributes:
        micro_batch: samples per forward/backward on one device (the dataloader's batch size).
        accumulation: micro-batches per optimizer step (``accumulate_grad_batches``);
            ``micro_batch * accumulation * world_size`` is the user's effective batch.
        precision: a Lightning precision string: ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"`` or
            ``"16-true"``.
        checkpoint: ``None`` or what ``ActivationCheckpointing(policy=...)`` / ``apply_checkpointing`` accept
            (``"auto"``, a :class:`~lightning_memkit.modes.checkpoint_policy.CheckpointBudget`, a set of module
            classes).
        offload: saved activations kept in pinned host memory (CUDA only).
        strategy: on several devices, the Lightning strategy (a name of
            :data:`~lightning_memkit.plan.rank_space.PLAN_STRATEGIES`: ``"ddp"``, ``"fsdp"``, ``"model_parallel"``,
            ``"deepspeed_stage_2"``, ``"deepspeed_stage_3"``); ``None`` on one device.
        world_size: devices (ranks) the batch is split over, each training ``micro_batch * accumulation`` samples per
            optimizer step.
    """

    micro_batch: int
    accumulation: int
    precision: str = "32-true"
    checkpoint: Any = None
    offload: bool = False
    strategy: str | None = None
    world_size: int = 1

    def __post_init__(self) -> None:
        for name in ("micro_batch", "accumulation", "world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Candidate({name}={value!r}): give a positive integer")
        if self.precision not in PLAN_PRECISIONS:
            raise ValueError(
                f"Candidate(precision={self.precision!r}): give one of {', '.join(repr(p) for p in PLAN_PRECISIONS)}"
            )

    @property
    def effective_batch(self) -> int:
        """Samples per optimizer step over every device: ``micro_batch * accumulation * world_size``."""
        return self.micro_batch * self.accumulation * self.world_size

    @property
    def mode(self) -> Any:
        """The :class:`~lightning_memkit.modes.mode.Mode` (precision and checkpointing) the estimate runs in."""
        precision = None if self.precision == "32-true" else self.precision
        mode = Mode(precision=precision, checkpoint=self.checkpoint)
        if self.offload:
            try:
                mode = dataclasses.replace(mode, offload=True)  # the offload mode (modes/offload.py)
            except TypeError:
                raise ValueError("offload is not available in this version of memkit's modes") from None
        return mode

    @property
    def checkpoint_text(self) -> str:
        """The checkpointing policy in words (``"none"``, ``"auto"``, ``"budget=0.5"``)."""
        return "none" if self.checkpoint is None else describe_policy(self.checkpoint)

    def describe(self) -> str:
        """One short line: ``micro 16 x 4, 32-true, checkpoint budget=0.5`` (on several devices it starts with the
        strategy and the devices: ``fsdp x 8, micro 2 x 4, bf16-mixed``)."""
        parts = [f"{self.strategy} x {self.world_size}"] if self.strategy is not None else []
        parts += [f"micro {self.micro_batch} x {self.accumulation}", self.precision]
        if self.checkpoint is not None:
            parts.append(f"checkpoint {self.checkpoint_text}")
        if self.offload:
            parts.append("offload")
        return ", ".join(parts)


def micro_batches(effective_batch: int, limit: int = MAX_MICRO_BATCHES) -> list[int]:
    """The micro-batch sizes tried for ``effective_batch``: divisors only (micro-batch x accumulation is the batch
    exactly), the batch itself first, then for each halving the largest divisor not above it; at most ``limit``."""
    if isinstance(effective_batch, bool) or not isinstance(effective_batch, int) or effective_batch < 1:
        raise ValueError(f"batch_size={effective_batch!r}: give a positive integer (samples per optimizer step)")
    divisors = [d for d in range(1, effective_batch + 1) if effective_batch % d == 0]
    chosen: list[int] = []
    aim = float(effective_batch)
    while aim >= 1 and len(chosen) < limit:
        size = max(d for d in divisors if d <= aim)
        if size not in chosen:
            chosen.append(size)
        aim /= 2
    if 1 not in chosen and len(chosen) < limit:
        chosen.append(1)
    return chosen


def parse_plan_modes(modes: str | Iterable[str] | None) -> tuple[str, ...]:
    """The planner's modes from ``"checkpoint,micro_batch,bf16"`` (or a list); ``None`` gives
    :data:`DEFAULT_PLAN_MODES`.

    Raises:
        ValueError: for an unknown word (the message lists :data:`PLAN_MODE_WORDS`), or two mixed precisions (or two
            true half precisions).
    """
    if modes is None:
        return DEFAULT_PLAN_MODES
    words = [w.strip().lower() for w in (modes.split(",") if isinstance(modes, str) else list(modes)) if str(w).strip()]
    if not words:
        raise ValueError(
            f"no modes in {modes!r}; write e.g. micro_batch,checkpoint (add bf16 to allow a precision change)"
        )
    for word in words:
        if word not in PLAN_MODE_WORDS:
            raise ValueError(f"unknown plan mode {word!r}; choose from: {', '.join(PLAN_MODE_WORDS)} (comma-separated)")
    if len({w for w in words if w in _MIXED_WORDS}) > 1:
        raise ValueError(f"modes {modes!r} allow two mixed precisions; give one of bf16, fp16, amp")
    if len({w for w in words if w in _TRUE_HALF_WORDS}) > 1:
        raise ValueError(f"modes {modes!r} allow two true half precisions; give one of bf16-true, fp16-true")
    return tuple(dict.fromkeys(words))


def allows_true_half(modes: tuple[str, ...]) -> bool:
    """Whether ``modes`` (from :func:`parse_plan_modes`) allow a true half precision (``bf16-true``, ``fp16-true``)."""
    return any(word in _TRUE_HALF_WORDS for word in modes)


def allowed_precisions(modes: tuple[str, ...], device_type: str) -> list[str]:
    """The precisions ``modes`` allow the plan to change to, on ``device_type`` (``amp`` and ``fp16`` on CPU resolve
    as Lightning's Trainer resolves them): at most a mixed one and a true half one."""
    resolved = [resolve_precision(precision, device_type) for word, precision in _MIXED_WORDS.items() if word in modes]
    allowed = [precision for precision in resolved if precision is not None]  # a mixed word never resolves to None
    return allowed + [precision for word, precision in _TRUE_HALF_WORDS.items() if word in modes]


def candidate_space(
    effective_batch: int,
    *,
    modes: tuple[str, ...] = DEFAULT_PLAN_MODES,
    device_type: str = "cpu",
    precision: str = "32-true",
    can_checkpoint: bool = True,
    can_accumulate: bool = True,
) -> list[Candidate]:
    """Every candidate for ``effective_batch`` the ``modes`` allow (the baseline, the user's batch as is, first).

    Args:
        effective_batch: the user's samples per optimizer step.
        modes: from :func:`parse_plan_modes`: ``micro_batch`` (smaller micro-batches with accumulation),
            ``checkpoint`` (:data:`CHECKPOINT_CHOICES`), precision words (a mixed and a true half one at most),
            ``offload`` (CUDA only).
        device_type: ``"cpu"`` or ``"cuda"``.
        precision: the user's own precision (the baseline's).
        can_checkpoint: whether the module has blocks to checkpoint (``find_repeated_blocks``).
        can_accumulate: whether accumulation applies (not under manual optimization).

    Raises:
        ValueError: ``offload`` asked for on a device other than CUDA (the reason says why).
    """
    if "offload" in modes and device_type != "cuda":
        raise ValueError(
            f"offload keeps saved activations in pinned host memory while a CUDA device computes; on "
            f"{device_type} the activations are already in host memory: leave offload out of the modes"
        )
    sizes = micro_batches(effective_batch) if "micro_batch" in modes and can_accumulate else [effective_batch]
    precisions = [precision]
    precisions += [other for other in allowed_precisions(modes, device_type) if other != precision]
    checkpoints = list(CHECKPOINT_CHOICES) if "checkpoint" in modes and can_checkpoint else [None]
    offloads = [False, True] if "offload" in modes else [False]
    space = [Candidate(effective_batch, 1, precision)]
    for offload in offloads:
        for chosen_precision in precisions:
            for checkpoint in checkpoints:
                for size in sizes:
                    candidate = Candidate(size, effective_batch // size, chosen_precision, checkpoint, offload)
                    if candidate not in space:
                        space.append(candidate)
    return space


def recompute_level(candidate: Candidate) -> int:
    """How much ``candidate`` recomputes in its backward: 0 without checkpointing, 1 for a checkpointing budget
    (part of the blocks), 2 for every repeated block (``"auto"``) or a set of block classes."""
    if candidate.checkpoint is None:
        return 0
    return 1 if isinstance(candidate.checkpoint, CheckpointBudget) else 2


def preference(candidate: Candidate) -> tuple[int, int, int, bool, int]:
    """The plan's rule, as a sort key (smaller first): no recompute before recompute (a checkpointed step runs its
    forward again), then on several devices the strategy that shards less (:data:`_STRATEGY_RANK`), then a lower
    precision where the user allowed one: true half precision (``bf16-true``, ``16-true``: half the bytes of weights,
    gradients and optimizer state to move, no casts) before mixed precision, and ``32-true`` only where no other is
    allowed; then no offload (its copies to the host and back), then fewer and larger micro-batches (the same samples
    in fewer, larger kernels and fewer trips through the training loop). The trials decide between candidates; the
    rule orders them, picks which the trials take, and keeps its first when no other was measured clearly faster
    (:mod:`~lightning_memkit.plan.choice`)."""
    rank = _PRECISION_RANK[candidate.precision]
    strategy = _STRATEGY_RANK.get(candidate.strategy, 2)
    return recompute_level(candidate), strategy, rank, candidate.offload, candidate.accumulation
