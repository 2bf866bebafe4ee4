"""A step's memory, measured: open a window, run the step, close it into a StepReading.

This is the core that MemoryTracker wires to Lightning's hooks; it works the same around a
plain PyTorch training loop (see ``MemoryMeter.measure``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import psutil
import torch

from lightning_memkit._torch_compat import tree_flatten
from lightning_memkit.compiled import NOT_SEEN_COMPILED
from lightning_memkit.probes import build_probes
from lightning_memkit.probes.base import MemoryProbe, ProbeSet
from lightning_memkit.probes.cuda import CudaAllocatorProbe
from lightning_memkit.probes.tensor import TENSOR_SCOPES, TensorProbe
from lightning_memkit.records import StepReading

__all__ = ["MemoryMeter", "training_state_tensors"]


def training_state_tensors(
    module: torch.nn.Module | None, optimizers: Iterable[Any] = (), batch: Any = None
) -> Iterator[torch.Tensor]:
    """Every tensor a training step starts with: parameters, their gradients, buffers,
    optimizer state and the batch (nested lists, tuples and dicts are walked).

    ``module`` gives the parameters, their gradients and the buffers (``None``: none), ``optimizers``
    their state (``optimizer.state``), ``batch`` its tensors. Pass the result as ``existing=`` to
    :meth:`MemoryMeter.measure` so what the step starts with is counted once, in bytes.
    """
    if module is not None:
        for parameter in module.parameters():
            yield parameter
            if parameter.grad is not None:
                yield parameter.grad
        yield from module.buffers()
    for optimizer in optimizers:
        for state in getattr(optimizer, "state", {}).values():
            for value in state.values() if isinstance(state, dict) else ():
                if isinstance(value, torch.Tensor):
                    yield value
    if batch is not None:
        for leaf in tree_flatten(batch)[0]:
            if isinstance(leaf, torch.Tensor):
                yield leaf


#: the reading's fields that are a window's highest value (kept over :meth:`MemoryMeter.set_aside`)
_PEAK_FIELDS = ("peak_allocated_bytes", "peak_reserved_bytes", "host_peak_rss_bytes", "peak_tensor_bytes")


class MemoryMeter:
    """Measure the memory of steps on one device.

    Args:
        device: the device the step runs on (``"cpu"``, ``"cuda:0"``, ...).
        tensor_accounting: read the exact tensor accountant. ``"auto"`` turns it on where no
            allocator counters exist (every device but CUDA).
        tensor_scope: what ``tensor_bytes`` and ``peak_tensor_bytes`` cover. ``"process"``
            (default): every live tensor storage of the process on ``device``, whoever made it and
            whenever (the meaning of CUDA's allocated bytes); found by a full sweep of the
            garbage collector's objects when the meter is built, then by looking at young objects
            (see :class:`~lightning_memkit.accounting.process.ProcessTensors`). ``"step"``: only the
            ``existing`` tensors given to :meth:`resume`/:meth:`measure` plus what the steps
            allocate (to compare several models held in one process).
        nvml: read NVML on CUDA devices.
        host: read the process's RSS and per-step peak RSS.
        extra_probes: more :class:`~lightning_memkit.probes.base.MemoryProbe` instances to read each
            step (a failing one warns once and is switched off, like the built-in ones).

    Plain PyTorch::

        meter = MemoryMeter("cpu")
        with meter.measure(step=0, existing=training_state_tensors(model, [opt], batch)):
            loss = model(x).sum(); loss.backward(); opt.step()
        print(meter.last.peak_tensor_bytes)
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        *,
        tensor_accounting: bool | str = "auto",
        tensor_scope: str = "process",
        nvml: bool = True,
        host: bool = True,
        extra_probes: Iterable[MemoryProbe] = (),
    ) -> None:
        self.device = torch.device(device)
        if tensor_accounting == "auto":
            tensor_accounting = self.device.type != "cuda"
        elif not isinstance(tensor_accounting, bool):
            raise ValueError(f"tensor_accounting must be True, False or 'auto', not {tensor_accounting!r}")
        if tensor_scope not in TENSOR_SCOPES:
            raise ValueError(
                f"tensor_scope must be 'process' (every live tensor of the process) or 'step', not {tensor_scope!r}"
            )
        self.probes: ProbeSet = build_probes(
            self.device,
            tensor_accounting=tensor_accounting,
            tensor_scope=tensor_scope,
            nvml=nvml,
            host=host,
            extra=extra_probes,
        )
        self.last: StepReading | None = None
        self._open: tuple[int, str, int] | None = None
        self._tensor_peak = True
        self._aside: tuple[tuple[int, str, int], bool, dict[str, int]] | None = None
        self._carried_peaks: dict[str, int] = {}

    @property
    def tensor_probe(self) -> TensorProbe | None:
        """The accountant's probe, when tensor accounting is on and working."""
        return self.probes.find(TensorProbe)

    @property
    def compiled(self) -> str | None:
        """How the steps of a compiled model are measured (:attr:`TensorProbe.compiled
        <lightning_memkit.probes.tensor.TensorProbe.compiled>`): ``"keep"`` (the peak from the allocator's events, the
        step runs compiled), ``"eager"`` (the accountant, the measured steps run eagerly) or ``None`` (no
        compiled model: the accountant). Set it when the model is compiled; memkit's callbacks do."""
        probe = self.tensor_probe
        return probe.compiled if probe is not None else None

    @compiled.setter
    def compiled(self, value: str | None) -> None:
        probe = self.tensor_probe
        if probe is not None:
            probe.compiled = value

    @property
    def is_open(self) -> bool:
        """Whether a window is open."""
        return self._open is not None

    def capacity_bytes(self) -> int | None:
        """The measured device's memory capacity in bytes: the CUDA device's total, or host RAM."""
        cuda = self.probes.find(CudaAllocatorProbe)
        if cuda is not None:
            return cuda.capacity_bytes()
        if self.device.type == "cpu":
            return int(psutil.virtual_memory().total)
        return None

    def open(self, step: int, stage: str = "train", rank: int = 0, *, tensor_peak: bool = True) -> None:
        """Open a window: every probe's peak starts from now.

        ``step`` (training steps), ``stage`` (``"train"`` or ``"validate"``) and ``rank`` (the global
        rank) label the :class:`~lightning_memkit.StepReading` that :meth:`close` returns.
        ``tensor_peak=False``: the accountant stays inactive in this window (no per-op cost);
        the reading has ``tensor_bytes`` (live at the window's end) but no ``peak_tensor_bytes``.
        """
        self._open = (step, stage, rank)
        self._tensor_peak = tensor_peak
        self._carried_peaks = {}
        self._reset_peaks()

    @property
    def has_window_aside(self) -> bool:
        """Whether a window was set aside by :meth:`set_aside` (and not yet taken back)."""
        return self._aside is not None

    def set_aside(self) -> None:
        """Set the open window aside, so that another can open and close (a validation run that
        Lightning starts inside a training step's accumulation window) without splitting it.

        The window's peaks so far (bytes) are kept; :meth:`take_back` reopens it, and its reading at
        :meth:`close` has the higher of its peaks before and after, the other window's memory not
        included. Its end-of-window values (``tensor_bytes``, ``allocated_bytes``...) are read at close.
        """
        if self._open is None:
            raise RuntimeError("MemoryMeter.set_aside() called with no open window")
        if self._aside is not None:
            raise RuntimeError("MemoryMeter.set_aside(): a window is already set aside; take_back() it first")
        self.pause()
        peaks = {name: value for name, value in self.probes.read().items() if name in _PEAK_FIELDS}
        for name, value in self._carried_peaks.items():
            peaks[name] = max(value, peaks.get(name, value))
        self._aside = (self._open, self._tensor_peak, peaks)
        self._open = None
        self._carried_peaks = {}

    def take_back(self) -> None:
        """Reopen the window :meth:`set_aside` kept (close any window opened since first)."""
        if self._aside is None:
            raise RuntimeError("MemoryMeter.take_back() called with no window set aside")
        if self._open is not None:
            raise RuntimeError("MemoryMeter.take_back(): close the window opened since set_aside() first")
        self._open, self._tensor_peak, peaks = self._aside
        self._aside = None
        self._reset_peaks()
        self._carried_peaks = peaks

    def _reset_peaks(self) -> None:
        probe = self.tensor_probe
        if probe is not None:
            # a window without the tensor peak reads only tensor_bytes at its end, swept for then
            probe.sweep_at_reset = self._tensor_peak
        self.probes.reset_peak()

    def resume(self, existing: Iterable[Any] = ()) -> None:
        """Activate the accountant for a (micro-)batch, counting ``existing`` tensors once
        (parameters' gradients and optimizer state have no Python object a sweep could find
        until someone reads them: pass :func:`training_state_tensors`)."""
        probe = self.tensor_probe
        if probe is None:
            return
        if self._tensor_peak or self._open is None:
            probe.start(existing)
        else:
            probe.accountant.adopt(existing)

    def pause(self) -> None:
        """Deactivate the accountant between (micro-)batches of one window."""
        probe = self.tensor_probe
        if probe is not None:
            probe.stop()

    def close(self) -> StepReading:
        """Close the window and return its reading (also kept as :attr:`last`)."""
        if self._open is None:
            raise RuntimeError("MemoryMeter.close() called with no open window; call open() first")
        self.pause()
        step, stage, rank = self._open
        self._open = None
        values = self.probes.read()
        for name, value in self._carried_peaks.items():  # the peaks before a set_aside()
            values[name] = max(value, values.get(name, value))
        self._carried_peaks = {}
        self.last = StepReading(step=step, stage=stage, rank=rank, **values)
        return self.last

    def compiled_note(self) -> str:
        """How a compiled model's steps are measured (:attr:`compiled` set), said once in the run summary."""
        if self.tensor_probe is None:
            return "CUDA allocator counters (the compiled program's)"
        if self.compiled == "keep":
            return f"peak_tensor from the allocator's events, steps kept compiled; {NOT_SEEN_COMPILED}"
        return (
            "peak_tensor by the accountant: the peak-measured steps run EAGERLY (compiled='eager'), so their "
            "peak is the eager program's"
        )

    def live_bytes_like(self, reading: StepReading) -> int | None:
        """The live bytes now, measured as ``reading`` was: CUDA's allocated bytes, or the accountant's (after a
        sweep for the tensors made since); ``None`` when neither is read."""
        if reading.allocated_bytes is not None:
            return torch.cuda.memory_allocated(self.device)
        probe = self.tensor_probe
        if probe is None:
            return None
        probe.sweep()
        return probe.accountant.current_bytes

    @contextlib.contextmanager
    def measure(
        self, step: int, existing: Iterable[Any] = (), stage: str = "train", rank: int = 0, *, tensor_peak: bool = True
    ) -> Iterator[MemoryMeter]:
        """Open, activate, run the ``with`` body, close. The reading is in :attr:`last`.

        ``step``, ``stage``, ``rank`` and ``tensor_peak`` are :meth:`open`'s; ``existing`` is
        :meth:`resume`'s (the tensors the step starts with: :func:`training_state_tensors`).
        """
        self.open(step, stage, rank, tensor_peak=tensor_peak)
        self.resume(existing)
        try:
            yield self
        finally:
            self.close()

    def shutdown(self) -> None:
        """Deactivate and release every probe."""
        self.pause()
        self.probes.close()
