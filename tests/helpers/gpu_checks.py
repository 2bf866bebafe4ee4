"""The checks the GPU lane (tests/gpu/test_cuda.py) asserts with, written so that each also runs on a CPU: the main
lane's tests/gpu/test_gpu_lane_checks.py runs them on CPU stand-ins as they are, and again with the code they guard
broken on purpose, so each check is seen to fail for the breakage it names (docs/gpu_tests.md has the table).

- :class:`AllocatorStepPeaks`: each training step's peak from the allocator's own events, never from its peak counter
  (which MemoryTracker resets every step).
- :class:`SyncCounter`: every host wait for a CUDA device inside a block, caught where it happens, with the memkit
  code that made it.
- :class:`PinnedBlocks`: the pinned host blocks a run made, by address, and whether each is still pinned.
- :class:`SynchronizedStepTime`: each training step timed by a host clock with the device waited for at both ends, in
  the same run as the timing it checks.

Each has a ``check_...`` function that raises ``AssertionError`` saying what broke.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import os
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import Callback
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import lightning_memkit

# ------------------------------------------------------------------------------------------------ per-step peaks


def allocator_events(recorded: profile, device_type: str) -> list[tuple[int, int]]:
    """``(signed bytes, allocated bytes after it)`` of every allocation and free a finished
    ``profile(profile_memory=True)`` recorded on ``device_type``, in time order: the allocator's own running total,
    reported at each event (CUDA's caching allocator passes its ``allocated_bytes.all.current``; the CPU allocator its
    count of the blocks it knows the size of)."""
    found = []
    pending = list(recorded.profiler.kineto_results.experimental_event_tree())
    while pending:
        event = pending.pop()
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == device_type:
            fields = event.extra_fields
            found.append((event.start_time_ns, fields.alloc_size, fields.total_allocated))
        pending.extend(event.children)
    found.sort(key=lambda item: item[0])
    return [(size, total) for _, size, total in found]


def highest_rise(events: Sequence[tuple[int, int]]) -> int:
    """Bytes: how far the allocator's running total rose above its value before the first event (0 without events)."""
    if not events:
        return 0
    first_size, first_total = events[0]
    before = first_total - first_size
    return max(0, max(total - before for _, total in events))


class AllocatorStepPeaks(Callback):
    """Each training step's peak allocated bytes, read a second way: the profiler (``profile_memory=True``) records the
    allocator's running total at every allocation and free; the step's peak is the bytes live at its start plus the
    highest rise of that total in the step. Nothing here reads or resets the allocator's peak counter
    (``max_memory_allocated``, ``reset_peak_memory_stats``), the one MemoryTracker resets per step: a tracker that never
    reset would read an earlier step's higher peak, and this would not.

    Put it after the MemoryTracker in the Trainer's callbacks: its window opens right after the tracker's opened and
    closes right after the tracker read the step (one batch per optimizer step). ``bytes_now(pl_module)`` gives the
    bytes live at the window's start: by default CUDA's ``memory_allocated()``; on CPU an independent gc count. CUDA's
    caching allocator reports its own allocated bytes of the device, so there the peak is the highest of the start and
    every reported total, in whatever order the threads' events were stamped; the CPU allocator counts only the blocks
    it has seen, so there the rise above its count before the first event is added to the start.

    Attributes:
        peaks: bytes, one per training step, in order.
    """

    def __init__(self, device_type: str = "cuda", bytes_now: Callable[[Any], int] | None = None) -> None:
        self.device_type = device_type
        self.bytes_now = bytes_now or (lambda pl_module: torch.cuda.memory_allocated())
        self.peaks: list[int] = []
        self._start = 0
        self._recording: profile | None = None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._start = self.bytes_now(pl_module)
        self._recording = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._recording.start()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        recording, self._recording = self._recording, None
        recording.stop()
        events = allocator_events(recording, self.device_type)
        if self.device_type == "cuda":
            self.peaks.append(max([self._start] + [total for _, total in events]))
        else:
            self.peaks.append(self._start + highest_rise(events))


def check_step_peaks(readings: Sequence[int | None], independent: Sequence[int]) -> None:
    """Every step's peak as the tracker read it is the allocator's own high point of that step (bytes, exactly)."""
    # not strict: the lengths are asserted below, with both series in the message
    wrong = [
        (step, read, truth)
        for step, (read, truth) in enumerate(zip(readings, independent, strict=False))
        if read != truth
    ]
    assert len(readings) == len(independent) and not wrong, (
        f"per-step peaks differ from the allocator's own high point: (step, read, independent) {wrong}"
    )


class FirstStepScratch:
    """A LightningModule mixin: the first training step also makes and frees ``scratch_bytes`` bytes on the step's
    device, so that step's peak is the run's highest by about that much, and a per-step peak carried from step to step
    would show it in every later step."""

    scratch_bytes = 0

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.global_step == 0:
            scratch = torch.zeros(self.scratch_bytes, dtype=torch.uint8, device=self.device)
            del scratch
        return super().training_step(batch, batch_idx)


# ------------------------------------------------------------------------------------------------ synchronisation

#: torch's text for a synchronising operation under ``torch.cuda.set_sync_debug_mode("warn")``
SYNC_WARNING = "synchronizing CUDA operation"

_MEMKIT_DIR = os.path.dirname(os.path.realpath(lightning_memkit.__file__)) + os.sep


def _explicit_waits() -> list[tuple[Any, str, str]]:
    """``(owner, attribute, name)`` of each function that makes the host wait for the device on purpose: what
    sync-debug mode does not report (it flags the waits inside ops and copies)."""
    waits = [
        (torch.cuda, "synchronize", "torch.cuda.synchronize"),
        (torch.cuda.Event, "synchronize", "torch.cuda.Event.synchronize"),
        (torch.cuda.Stream, "synchronize", "torch.cuda.Stream.synchronize"),
    ]
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "synchronize"):
        waits.append((accelerator, "synchronize", "torch.accelerator.synchronize"))
    return waits


@dataclass(frozen=True)
class SyncCall:
    """One host wait: ``kind`` (the function's name, or ``"implicit"`` for an op sync-debug mode flagged) and
    ``memkit_frame`` (``"file:line in function"`` of the innermost lightning_memkit frame on the stack when it
    happened, or ``None``: not made by memkit, directly or through torch)."""

    kind: str
    memkit_frame: str | None


def _innermost_memkit_frame() -> str | None:
    for frame in reversed(traceback.extract_stack()):
        if os.path.realpath(frame.filename).startswith(_MEMKIT_DIR):
            return (
                f"{os.path.relpath(frame.filename, os.path.dirname(_MEMKIT_DIR[:-1]))}:{frame.lineno} in {frame.name}"
            )
    return None


class SyncCounter:
    """Every host wait for a CUDA device inside the ``with`` block, caught where it happens.

    - Explicit waits: ``torch.cuda.synchronize``, ``torch.cuda.Event.synchronize``, ``torch.cuda.Stream.synchronize``
      (and ``torch.accelerator.synchronize`` where torch has it), wrapped for the block's duration. Where torch has no
      CUDA device the call is counted and returns (there is nothing to wait for).
    - Implicit waits: the ops and copies that wait (``.item()``, ``.cpu()``, ``.tolist()`` of a CUDA tensor, a
      data-dependent op), as torch's sync-debug mode (``"warn"``) reports them; only where CUDA is available.

    Each is kept as a :class:`SyncCall` with the memkit code on the stack when it happened (a wait inside an op made
    by memkit, or by a probe memkit called, names memkit's frame). A wait made through a reference bound before the
    block (``from torch.cuda import synchronize``) is not seen by the explicit part.
    """

    def __init__(self) -> None:
        self.calls: list[SyncCall] = []
        self._restore: list[tuple[Any, str, Any]] = []
        self._warnings: Any = None
        self._debug_mode: int | None = None

    def _note(self, kind: str) -> None:
        self.calls.append(SyncCall(kind, _innermost_memkit_frame()))

    def _counted(self, original: Callable[..., Any], kind: str) -> Callable[..., Any]:
        @functools.wraps(original)
        def waits(*args: Any, **kwargs: Any) -> Any:
            self._note(kind)
            return original(*args, **kwargs) if torch.cuda.is_available() else None

        return waits

    def __enter__(self) -> SyncCounter:
        for owner, attribute, kind in _explicit_waits():
            own = vars(owner).get(attribute)  # None: inherited, so put back by deleting the wrapper
            self._restore.append((owner, attribute, own))
            setattr(owner, attribute, self._counted(getattr(owner, attribute), kind))
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.filterwarnings("always", message=f".*{SYNC_WARNING}")
        shown = warnings.showwarning

        def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
            if SYNC_WARNING in str(message):
                self._note("implicit")
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        if torch.cuda.is_available():
            self._debug_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._debug_mode is not None:
            torch.cuda.set_sync_debug_mode(self._debug_mode)
            self._debug_mode = None
        self._warnings.__exit__(*exc)
        for owner, attribute, own in reversed(self._restore):
            if own is None:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, own)
        self._restore = []

    @property
    def by_memkit(self) -> list[SyncCall]:
        """The waits made with memkit's code on the stack."""
        return [call for call in self.calls if call.memkit_frame is not None]

    def counts(self) -> Counter:
        """How many waits of each kind."""
        return Counter(call.kind for call in self.calls)

    def describe(self) -> str:
        """The waits memkit made (kind and where), and the count of each kind, for an assertion's message."""
        made = "; ".join(f"{call.kind} at {call.memkit_frame}" for call in self.by_memkit[:10])
        return f"memkit made: [{made}]; all waits by kind: {dict(self.counts())}"


def check_no_memkit_sync(syncs: SyncCounter) -> None:
    """memkit's code made the host wait for the device nowhere in the block."""
    assert not syncs.by_memkit, f"memkit made the host wait for the device: {syncs.describe()}"


# ------------------------------------------------------------------------------------------------ pinned memory


def is_pinned_address(address: int) -> bool:
    """Whether the host memory at ``address`` is pinned now, as the CUDA driver says (``Tensor.is_pinned`` asks
    ``cudaPointerGetAttributes``): a one-byte view at the address, which nothing reads."""
    view = (ctypes.c_ubyte * 1).from_address(address)
    return bool(torch.frombuffer(view, dtype=torch.uint8).is_pinned())


class PinnedBlocks(TorchDispatchMode):
    """The pinned host blocks the ops make while it is active (a factory with ``pin_memory=True``, such as the
    buffers ``save_on_cpu(pin_memory=True)`` copies saved tensors into, and ``Tensor.pin_memory()``), by address,
    with the most bytes asked of each (a cached block is handed out again at the same address).

    ``is_pinned(address)`` asks whether an address is pinned now (default: :func:`is_pinned_address`, the driver);
    :meth:`note` adds a block made outside any op (the CPU stand-in's)."""

    def __init__(self, is_pinned: Callable[[int], bool] = is_pinned_address) -> None:
        super().__init__()
        self.is_pinned = is_pinned
        self.blocks: dict[int, int] = {}

    def note(self, address: int, nbytes: int) -> None:
        """Count a pinned block of ``nbytes`` at ``address``."""
        self.blocks[address] = max(nbytes, self.blocks.get(address, 0))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if kwargs.get("pin_memory") or func is torch.ops.aten._pin_memory.default:
            for tensor in tree_flatten(out)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
                    storage = tensor.untyped_storage()
                    if storage.nbytes():
                        self.note(storage.data_ptr(), storage.nbytes())
        return out

    def pinned_now(self) -> dict[int, int]:
        """The blocks still pinned: ``{address: bytes}``."""
        return {address: nbytes for address, nbytes in self.blocks.items() if self.is_pinned(address)}


def pinned_bytes_held(stats: dict[str, Any] | None) -> int | None:
    """Bytes of pinned blocks the caching host allocator holds, handed out or cached, from
    ``torch.cuda.host_memory_stats()``: a torch whose figures have ``active_bytes`` (2.13) names them
    ``allocated_bytes`` (``active_bytes`` being those handed out); an older one ``reserved_bytes`` (its
    ``allocated_bytes`` being those handed out, 0 once the tensors are freed, released or not). ``None`` without the
    figures."""
    if not stats:
        return None
    key = "allocated_bytes.current" if "active_bytes.current" in stats else "reserved_bytes.current"
    value = stats.get(key)
    return None if value is None else int(value)


def host_stats() -> dict[str, Any] | None:
    """``torch.cuda.host_memory_stats()``, or ``None`` where torch has no such function."""
    read = getattr(torch.cuda, "host_memory_stats", None)
    return dict(read()) if read is not None else None


def check_pinned_released(blocks: PinnedBlocks, cached_before: set[int]) -> None:
    """The run pinned blocks, each was still pinned (cached) just before the release (``cached_before``: so that none
    being pinned after is not vacuous), and none is pinned now."""
    assert blocks.blocks, "the run pinned no host memory: nothing to check"
    assert cached_before == set(blocks.blocks), (
        f"{len(blocks.blocks) - len(cached_before & set(blocks.blocks))} of {len(blocks.blocks)} pinned blocks were "
        "no longer pinned before the release: the check below would prove nothing"
    )
    left = blocks.pinned_now()
    assert not left, f"{len(left)} pinned blocks ({sum(left.values())} bytes) are still pinned after the release"


@contextlib.contextmanager
def watched_release(module: Any, name: str, read: Callable[[], Any], seen: list) -> Iterator[None]:
    """Within the block, each call of ``module.<name>`` (the ``release`` a trial calls) first collects the garbage and
    appends ``read()`` to ``seen``, then runs the real release: what the trial left cached, read just before it is
    given back."""
    release = getattr(module, name)

    def watched(*args: Any, **kwargs: Any) -> Any:
        gc.collect()
        seen.append(read())
        return release(*args, **kwargs)

    setattr(module, name, watched)
    try:
        yield
    finally:
        setattr(module, name, release)


# ------------------------------------------------------------------------------------------------ step time


class SynchronizedStepTime(Callback):
    """The truth a step time is checked against, in the same run: the host clock (``time.perf_counter``) read after
    waiting for the device at both ends of each training step's window (on CUDA; on CPU there is nothing to wait for).
    Put it after the callback whose timing it checks, so its window holds that one.

    Attributes:
        times_s: seconds per training step, in order.
    """

    def __init__(self) -> None:
        self.times_s: list[float] = []
        self._start = 0.0

    def _wait(self) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._wait()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._wait()
        self.times_s.append(time.perf_counter() - self._start)


def check_same_steps_timed_alike(timed_s: Sequence[float], synchronized_s: Sequence[float], tolerance: float) -> None:
    """Each step's time (seconds) is within ``tolerance`` (a fraction) of the synchronised host clock's time of the
    same step, and so is their median."""
    import statistics

    assert len(timed_s) == len(synchronized_s) and timed_s, (len(timed_s), len(synchronized_s))
    off = [
        (step, round(timed, 6), round(truth, 6))
        for step, (timed, truth) in enumerate(zip(timed_s, synchronized_s, strict=True))
        if abs(timed / truth - 1) > tolerance
    ]
    median = statistics.median(timed_s) / statistics.median(synchronized_s)
    assert not off and abs(median - 1) <= tolerance, (
        f"steps timed more than {tolerance:.0%} off the synchronised clock: (step, timed s, synchronised s) {off}; "
        f"median ratio {median:.3f}"
    )
