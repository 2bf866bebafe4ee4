"""A plan's inputs, checked: the settings of its trials (:class:`TrialSettings`) and what it plans for
(:class:`PlanInputs`: the module, the data's worst batch, the effective batch, the memory budget, the device and the
candidate space). Bad input raises :class:`~lightning_memkit.plan.result.PlanError` saying what to give instead."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_memkit._lightning_compat import attached_trainer
from lightning_memkit.estimate.data.batches import NoBatchError, batch_size_of
from lightning_memkit.estimate.data.worst_batch import WorstBatch, worst_batch_and_length
from lightning_memkit.modes.checkpoint_policy import find_repeated_blocks, repeated_block_classes
from lightning_memkit.modes.mode import TRUE_HALF_PRECISIONS
from lightning_memkit.plan.cuda_trial import cuda_device, device_budget_bytes, release
from lightning_memkit.plan.rank_space import Devices, ParameterCounts, parse_strategies
from lightning_memkit.plan.result import PlanError
from lightning_memkit.plan.space import (
    MIXED_PLAN_WORDS,
    PLAN_PRECISIONS,
    Candidate,
    allows_true_half,
    candidate_space,
    parse_plan_modes,
)
from lightning_memkit.plan.time_model import INTERCONNECTS, roofline_for
from lightning_memkit.search.trainer_state import host_search_budget_bytes
from lightning_memkit.units import format_bytes, parse_bytes

__all__ = ["MAX_TRIALS", "PlanInputs", "TrialSettings", "devices_of", "plan_device", "plan_inputs", "trial_settings"]

#: the most real trials a plan runs
MAX_TRIALS = 3


@dataclass(frozen=True)
class TrialSettings:
    """How a plan runs its trials (see :func:`~lightning_memkit.plan.planner.plan_fit`'s arguments of these names).

    Attributes:
        trials: the most real trials (1 to :data:`MAX_TRIALS`).
        warmup_steps: optimizer steps run before the timed ones.
        timed_steps: optimizer steps timed at least.
        timed_seconds: CPU: seconds a trial's timed steps add up to (0: ``timed_steps`` once).
        max_seconds: the plan's wall-time budget, seconds (``None``: the default).
    """

    trials: int
    warmup_steps: int
    timed_steps: int
    timed_seconds: float
    max_seconds: float | None = None


@dataclass
class PlanInputs:
    """What a plan plans for.

    Attributes:
        module: the LightningModule (trials train deep copies of it).
        batch: the batch every estimate and trial is cut from (the data's worst: ``worst.batch``).
        effective: the effective batch, samples per optimizer step (every candidate keeps it).
        budget: the memory budget, bytes.
        device_type: ``"cpu"`` or ``"cuda"``.
        space: the candidates, the baseline (the user's batch as is) first.
        precision: the user's precision (``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``,
            ``"16-true"``).
        gpu: the GPU planned for (``"h100"``...), or ``None``.
        datamodule: the LightningDataModule the batch came from, or ``None``.
        worst: the data's worst batch as found (its description and shapes), or ``None`` when ``batch`` was given.
        notes: what the reader should know about the space (no checkpointing candidates, manual optimization).
        devices: the devices it plans for (:class:`~lightning_memkit.plan.rank_space.Devices`: one by default).
        modes: the words of what may change (:func:`~lightning_memkit.plan.space.parse_plan_modes`).
        op_costs: the fake steps' ops by per-rank step, so that the strategies of one step share them (the estimate
            runs a step once inside ``reusing_fake_copies``).
    """

    module: Any
    batch: Any
    effective: int
    budget: int
    device_type: str
    space: list[Candidate] = field(default_factory=list)
    precision: str = "32-true"
    gpu: Any = None
    datamodule: Any = None
    worst: WorstBatch | None = None
    notes: list[str] = field(default_factory=list)
    devices: Devices = field(default_factory=Devices)
    modes: tuple[str, ...] = ()
    op_costs: dict[tuple, Any] = field(default_factory=dict, repr=False)

    @property
    def cpu(self) -> bool:
        """Whether the plan is for the CPU."""
        return self.device_type == "cpu"

    @property
    def can_run(self) -> bool:
        """Whether real trials can run here: not for a CUDA plan without a GPU, nor for a module built on the meta
        device (no weights to train): those plans are the prediction only."""
        if any(p.is_meta for p in self.module.parameters()):
            return False
        return self.cpu or torch.cuda.is_available()


def trial_settings(
    trials: Any, warmup_steps: Any, timed_steps: Any, timed_seconds: Any, max_seconds: Any
) -> TrialSettings:
    """The trials' settings, checked."""
    if isinstance(trials, bool) or not isinstance(trials, int) or not 1 <= trials <= MAX_TRIALS:
        raise PlanError(
            f"trials={trials!r}: give 1 to {MAX_TRIALS} "
            f"(the plan proves its choice in at most {MAX_TRIALS} real trials)"
        )
    for name, value in (("warmup_steps", warmup_steps), ("timed_steps", timed_steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "warmup_steps" else 1):
            raise PlanError(
                f"{name}={value!r}: give a {'non-negative' if name == 'warmup_steps' else 'positive'} integer"
            )
    if (
        isinstance(timed_seconds, bool)
        or not isinstance(timed_seconds, (int, float))
        or not 0 <= timed_seconds < float("inf")
    ):
        raise PlanError(f"timed_seconds={timed_seconds!r}: give seconds >= 0 (0: time timed_steps steps once)")
    if max_seconds is not None and (
        isinstance(max_seconds, bool) or not isinstance(max_seconds, (int, float)) or not max_seconds > 0
    ):
        raise PlanError(
            f"max_seconds={max_seconds!r}: give a positive number of seconds (the plan's time budget; "
            "inf: none), or None for the default (the estimate plus 20 baseline steps)"
        )
    return TrialSettings(trials, warmup_steps, timed_steps, timed_seconds, max_seconds)


def plan_inputs(
    module: Any,
    *,
    batch_size: Any,
    device_memory: Any,
    gpu: Any,
    device: Any,
    modes: Any,
    datamodule: Any,
    world_size: Any,
    strategy: Any,
    max_world_size: Any = None,
    interconnect: Any = None,
) -> PlanInputs:
    """What the plan plans for, checked: raises :class:`~lightning_memkit.plan.result.PlanError` for a module that is
    not a LightningModule, unknown modes, device or strategy, a bad budget, batch size or world size, or a budget below
    the model's parameters (sharded over the most devices allowed)."""
    if not isinstance(module, LightningModule):
        raise PlanError(
            f"plan_fit plans a LightningModule's training (its trials run a real Trainer); {type(module).__name__} "
            "is not one: wrap it in a LightningModule with training_step and configure_optimizers"
        )
    try:
        plan_modes = parse_plan_modes(modes)
    except ValueError as error:
        raise PlanError(str(error)) from None
    device_type = device_type_of(device, gpu)
    devices = devices_of(module, world_size, max_world_size, strategy, interconnect, device_type)
    budget = budget_bytes(device_memory, device_type, gpu)
    try:
        # every estimate and trial runs on the data's worst batch, so what the plan proves holds for the run
        worst, _ = worst_batch_and_length(module, datamodule)
    except NoBatchError as error:
        raise PlanError(str(error)) from None
    effective = batch_size
    if effective is None:  # the loader's batch is per device, as under Lightning's DDP
        loader_batch = batch_size_of(worst.batch)
        effective = loader_batch * (1 if devices.fewest else devices.world_size) if loader_batch else loader_batch
    if effective is None or isinstance(effective, bool) or not isinstance(effective, int) or effective < 1:
        raise PlanError(
            f"batch_size={effective!r}: give the effective batch as a positive integer (samples per optimizer step)"
        )
    if not devices.fewest and effective % devices.world_size:
        raise PlanError(
            f"batch_size={effective}: the effective batch is split evenly over world_size={devices.world_size} "
            "devices; give a multiple of it"
        )
    precision = user_precision(module)
    true_half = precision in TRUE_HALF_PRECISIONS or allows_true_half(plan_modes)
    # a sharding strategy spreads the parameters over every device
    state_bytes = _smallest_parameter_bytes(module, true_half) // devices.world_size
    if state_bytes > budget:
        half_fits = not true_half and _smallest_parameter_bytes(module, True) <= budget
        raise PlanError(
            f"the budget of {format_bytes(budget)} is below the model's parameters alone "
            f"({format_bytes(state_bytes)}): "
            + (
                "only true half precision keeps them in it (2 bytes each): allow it with bf16-true in the modes "
                "(it rounds the weights and optimizer state themselves to bf16), or give more memory"
                if half_fits
                else "no micro-batch, checkpointing or precision makes it fit; give more memory or a smaller model"
            )
        )
    inputs = PlanInputs(module, worst.batch, effective, budget, device_type, [], precision, gpu, datamodule, worst)
    inputs.devices, inputs.modes = devices, plan_modes
    inputs.space = _space(inputs, plan_modes)
    return inputs


def devices_of(
    module: Any, world_size: Any, max_world_size: Any, strategy: Any, interconnect: Any, device_type: str = "cuda"
) -> Devices:
    """The devices a plan is for, checked (:class:`~lightning_memkit.plan.rank_space.Devices`)."""
    for name, value in (("world_size", world_size), ("max_world_size", max_world_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise PlanError(f"{name}={value!r}: give a positive number of devices")
    if max_world_size is not None and world_size not in (None, 1):
        raise PlanError(
            f"world_size={world_size} and max_world_size={max_world_size}: give one (world_size plans on that many "
            "devices; max_world_size finds the fewest that fit, up to it)"
        )
    most = max_world_size if max_world_size is not None else (world_size or 1)
    if most == 1:
        if strategy is not None:
            raise PlanError(f"strategy={strategy!r} is for several devices: give world_size or max_world_size")
        return Devices()
    can_model_parallel = is_overridden("configure_model", module, LightningModule)
    try:
        strategies = parse_strategies(strategy, can_model_parallel, device_type)
    except ValueError as error:
        raise PlanError(str(error)) from None
    speed = _bytes_per_second(interconnect)
    # FSDP's units: the module's repeated blocks (as an auto_wrap_policy of their classes)
    blocks = repeated_block_classes(module)
    fewest = max_world_size is not None
    return Devices(most, fewest, strategies, speed, blocks or None, ParameterCounts.of(module))


def _bytes_per_second(interconnect: Any) -> float:
    """An interconnect's bytes per second: a name of :data:`~.time_model.INTERCONNECTS` (default ``nvlink``) or a
    positive number."""
    if interconnect is None:
        return INTERCONNECTS["nvlink"]
    if isinstance(interconnect, str) and interconnect in INTERCONNECTS:
        return INTERCONNECTS[interconnect]
    if isinstance(interconnect, (int, float)) and not isinstance(interconnect, bool) and interconnect > 0:
        return float(interconnect)
    raise PlanError(f"interconnect={interconnect!r}: name one of {', '.join(INTERCONNECTS)}, or give bytes per second")


def _smallest_parameter_bytes(module: Any, true_half: bool) -> int:
    """The parameters' bytes in the candidates' precision that keeps the fewest: a true half precision (when
    ``true_half``) converts the floating-point parameters to 2 bytes each (Lightning's ``HalfPrecision``); the others
    keep them as built."""
    return sum(
        p.numel() * (2 if true_half and p.is_floating_point() else p.element_size()) for p in module.parameters()
    )


def _space(inputs: PlanInputs, plan_modes: Any) -> list[Candidate]:
    """The candidates for ``plan_modes`` (the notes say which modes the module cannot take)."""
    manual = not inputs.module.automatic_optimization
    can_checkpoint = bool(find_repeated_blocks(inputs.module))
    mixed = [word for word in plan_modes if word in MIXED_PLAN_WORDS]
    if inputs.precision in TRUE_HALF_PRECISIONS and mixed:
        # the Trainer's HalfPrecision converted the module at setup: its fp32 weights, which a mixed precision keeps,
        # are gone, so a mixed candidate's step cannot be estimated or tried from it
        plan_modes = tuple(word for word in plan_modes if word not in mixed)
        inputs.notes.append(
            f"no {', '.join(mixed)} candidates: the Trainer's {inputs.precision} converted the module's weights "
            "before the plan; plan before the fit (memkit plan, plan_fit) to weigh mixed precision against it"
        )
    try:
        space = candidate_space(
            inputs.effective,
            modes=plan_modes,
            device_type=inputs.device_type,
            precision=inputs.precision,
            can_checkpoint=can_checkpoint,
            can_accumulate=not manual,
        )
    except ValueError as error:
        raise PlanError(str(error)) from None
    if "checkpoint" in plan_modes and not can_checkpoint:
        inputs.notes.append(
            f"no checkpointing candidates: {type(inputs.module).__name__} has no repeated blocks to checkpoint"
        )
    if manual and "micro_batch" in plan_modes:
        inputs.notes.append(
            "manual optimization: no gradient accumulation (Lightning's accumulate_grad_batches does not apply)"
        )
    return space


def budget_bytes(device_memory: Any, device_type: str, gpu: Any) -> int:
    """The memory budget, bytes: ``device_memory`` as given; else a CUDA device's (``gpu``'s memory, or this
    process's share of the current device: :func:`~lightning_memkit.plan.cuda_trial.device_budget_bytes`); else half
    the host memory available now."""
    if device_memory is not None:
        if isinstance(device_memory, bool):
            raise PlanError(f"device_memory={device_memory!r}: give bytes (an int) or a size such as '4GiB'")
        try:
            budget = parse_bytes(device_memory) if isinstance(device_memory, str) else int(device_memory)
        except (ValueError, TypeError) as error:
            raise PlanError(
                f"device_memory={device_memory!r}: {error}; give bytes (an int) or a size such as '4GiB'"
            ) from None
        if budget <= 0:
            raise PlanError(f"device_memory={device_memory!r}: a memory size is positive; give e.g. '4GiB'")
        return budget
    if device_type == "cuda":
        if gpu is not None or not torch.cuda.is_available():
            return roofline_for(gpu).memory_bytes
        device = cuda_device()
        release(True)
        free, total = torch.cuda.mem_get_info(device)
        read = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        fraction = float(read(device)) if read is not None else None
        return device_budget_bytes(free, torch.cuda.memory_reserved(device), total, fraction)
    return host_search_budget_bytes()


def device_type_of(device: Any, gpu: Any) -> str:
    """``"cpu"`` or ``"cuda"``: what ``device`` names, else CUDA when ``gpu`` is given or a GPU is here."""
    if device is None:
        return "cuda" if gpu is not None or torch.cuda.is_available() else "cpu"
    kind = torch.device(device).type if not isinstance(device, str) or device not in ("gpu",) else "cuda"
    if kind not in ("cpu", "cuda"):
        raise PlanError(f"device={device!r}: plan_fit plans for 'cpu' or 'cuda'")
    if gpu is not None and kind != "cuda":
        raise PlanError(f"gpu={gpu!r} names a CUDA device; drop it or give device='cuda'")
    return kind


def plan_device(device: Any) -> Any:
    """``torch.cuda.device(index)`` for a CUDA plan on this machine, so that its budget, trials and peaks are on the
    device ``device`` names (``"cuda:1"``, ``torch.device("cuda", 1)``; the current one when it names no index) and
    the current device is set back after the plan (a trial's Trainer sets it); a null context for a CPU plan or
    where no GPU is (a CUDA plan is then a prediction)."""
    if not torch.cuda.is_available():
        return contextlib.nullcontext()
    try:
        target = torch.device("cuda" if device is None or device == "gpu" else device)
    except (RuntimeError, TypeError, ValueError):  # device_type_of says what is wrong with it
        return contextlib.nullcontext()
    if target.type != "cuda":
        return contextlib.nullcontext()
    index = torch.cuda.current_device() if target.index is None else target.index
    if not 0 <= index < torch.cuda.device_count():
        raise PlanError(
            f"device={device!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
            f"0 to {torch.cuda.device_count() - 1}"
        )
    return torch.cuda.device(index)


def user_precision(module: Any) -> str:
    """The precision of the Trainer ``module`` is attached to (AutoFit plans at fit start), else ``"32-true"``."""
    trainer = attached_trainer(module)
    text = str(getattr(trainer, "precision", "32-true")) if trainer is not None else "32-true"
    return text if text in PLAN_PRECISIONS else "32-true"
