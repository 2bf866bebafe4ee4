"""The estimate's accountant (:class:`StepAccountant`): the tensor accountant plus the records at each new peak, the
phase and step of the peak, the allocation events the CUDA model replays, and on a fake step the fake ops' answers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_memkit.accounting.accountant import StorageRecord, TensorAccountant
from lightning_memkit.accounting.categories import CATEGORIES, CategoryAttributor, is_parameter_cast
from lightning_memkit.estimate.fake.step_ops import FakeStepOps
from lightning_memkit.estimate.fake.tensors import NOT_ANSWERED

__all__ = ["StepAccountant", "OPTIMIZER_FLOAT_PLACEHOLDER"]

_ITEM = torch.ops.aten._local_scalar_dense.default

#: What ``.item()`` of a fake floating-point tensor answers inside the optimizer's step (elsewhere it is 1.0,
#: see :class:`~lightning_memkit.estimate.fake.outputs.ScalarPlaceholders`). An optimizer reads its scalars there (step
#: counts, NAdam's running product of momentum factors) and divides by ``x`` and ``1 - x``: 1.0 makes NAdam's
#: ``1 - mu_product`` zero, 0.5 keeps both non-zero. Memory does not depend on the value.
OPTIMIZER_FLOAT_PLACEHOLDER = 0.5


class StepAccountant(TensorAccountant):
    """The accountant plus what the estimate needs: the live records at each new peak, the phase
    of the peak, and (for the CUDA model) the allocation, resize and free events in order.

    On a fake step it also does :class:`~lightning_memkit.estimate.fake.step_ops.FakeStepOps`' work (placeholder
    scalars, kept loss buffers, fake tensors' devices) in the same dispatch call: one Python mode layer
    per op instead of three, with the same results (the step runs inside ``FakeSession.fake_mode_only``).
    """

    def __init__(
        self, record_events: bool, fake_ops: FakeStepOps | None = None, op_listener: Callable[..., None] | None = None
    ) -> None:
        super().__init__()
        self.fake_ops = fake_ops
        events: list[tuple[str, int, int]] = []
        self.events: list[tuple[str, int, int]] | None = events if record_events else None
        if record_events:
            self.add_storage_listener(
                lambda record: events.append(("alloc", record.sequence, record.nbytes)),
                lambda record: events.append(("free", record.sequence, 0)),
                lambda record: events.append(("resize", record.sequence, record.nbytes)),
            )
        # storages resized in place (FSDP's gathered parameters), by id(record), and their sizes at the peak: a record
        # reads its size now, and a gathered parameter is back at 0 bytes by the time the peak is read
        self.resized: dict[int, StorageRecord] = {}
        self.add_storage_listener(on_resize=self._note_resized)
        self.peak_resized_bytes: dict[int, int] = {}
        self.peak_records: list[StorageRecord] = []
        self.peak_tick = 0
        self.attributor = CategoryAttributor(self)
        self.peak_phase = ""
        self.peak_step = 0
        self.step = 0
        self.add_peak_listener(self._on_peak)
        self.optimizer_phase = False  # inside optimizer.step(): a fake float read answers OPTIMIZER_FLOAT_PLACEHOLDER
        self.micro_batch = 0  # which micro-batch of the step (gradient accumulation, see accumulating())
        # called as listener(func, args, kwargs, result, accountant) for each op of a fake step that runs a kernel
        self.op_listener = op_listener if fake_ops is not None else None
        self.host_copy = False  # inside offload's pack: the copy lives in host memory, not on the device counted here

    def _note_resized(self, record: StorageRecord) -> None:
        self.resized.setdefault(id(record), record)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        ops = self.fake_ops
        if ops is None:
            if self.host_copy:
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)
        answer = ops.answer(func, args, kwargs)
        if answer is not NOT_ANSWERED:  # no kernel, no tensor made: nothing to count
            if func is _ITEM and self.optimizer_phase and type(answer) is float:
                return OPTIMIZER_FLOAT_PLACEHOLDER
            return answer
        # masks, token ids and positions keep their real values; a data-dependent shape is sized (DataDependentOps)
        result = ops.run(func, args, kwargs)
        if self.host_copy:
            return result
        try:
            self._account(func, args, kwargs, result)
        except BaseException as error:  # noqa: BLE001 - never raise inside dispatch (see TensorAccountant): recorded
            self._record_error(f"{func}: {type(error).__name__}: {error}")
        listener = self.op_listener
        if listener is not None:
            try:
                listener(func, args, kwargs, result, self)
            except BaseException as error:  # noqa: BLE001 - never raise inside dispatch: the listener only observes
                self._record_error(f"op listener on {func}: {type(error).__name__}: {error}")
        return result

    def _account(self, func, args, kwargs, result) -> None:
        super()._account(func, args, kwargs, result)
        # autocast's low-precision copy of a weight is model-sized, not batch-sized: its own category, as LayerTrace
        # files it (saved for backward, it would otherwise read as activations)
        if is_parameter_cast(func, args, kwargs, self._is_parameter):
            self.attributor.assign(result, "autocast_weight_copies")

    def _is_parameter(self, tensor: torch.Tensor) -> bool:
        # a parameter of the step, or one a strategy gathered for it (FSDP's unsharded parameters are parameters,
        # their storage the strategy's)
        return isinstance(tensor, torch.nn.Parameter) or self.attributor.role_of(tensor) == "parameters"

    def size_at_peak(self, record: StorageRecord) -> int:
        """The bytes ``record``'s storage held at the peak (a storage resized in place since reads its size now)."""
        return self.peak_resized_bytes.get(id(record), record.nbytes)

    def peak_breakdown(self) -> dict[str, int]:
        """The peak's bytes by category (:data:`~lightning_memkit.accounting.categories.CATEGORIES`), each storage at
        its size at the peak: they sum to ``peak_bytes``."""
        by_category = dict.fromkeys(CATEGORIES, 0)
        for record in self.peak_records:
            by_category[self.attributor.category_of(record, self.peak_tick)] += self.size_at_peak(record)
        return by_category

    def _on_peak(self, _peak: int) -> None:
        self.peak_resized_bytes = {key: record.nbytes for key, record in self.resized.items()}
        self.peak_records = self.live_records()
        self.peak_tick = self.attributor.tick
        self.peak_phase = self.label
        self.peak_step = self.step
