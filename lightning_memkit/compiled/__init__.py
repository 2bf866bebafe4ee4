"""memkit and ``torch.compile``: find what is compiled, read the allocator without switching compile off.

memkit's exact accountant is a TorchDispatchMode, and dynamo runs no compiled code while such a mode is active
(worse: a frame first met under one is skipped for the rest of the process). So on a compiled model memkit measures
what the allocator sees instead (:class:`AllocatorPeak`: the allocator's own events, recorded by torch's profiler,
which is infrastructure and keeps compile on), and enters its modes only when asked, inside :func:`force_eager`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_memkit.compiled._torch_compat import (
    MARK_PREFIX,
    OPTIMIZED_MODULE,
    allocator_events,
    compiled_call_impl,
    compiled_function,
    mark,
    profiler_active,
    track_cpu_allocation_sizes,
)

__all__ = [
    "AllocatorBalance",
    "AllocatorPeak",
    "COMPILED_CHOICES",
    "compiled_parts",
    "compiled_regions",
    "is_compiled_wrapper",
    "NOT_SEEN_COMPILED",
]

#: What memkit does with a compiled model: ``"keep"`` (default) measures what the allocator sees and leaves it
#: compiled; ``"eager"`` runs the measured steps eagerly for the per-op / per-module breakdown (the eager program's).
COMPILED_CHOICES = ("keep", "eager")

#: What memkit cannot see in a compiled model when it keeps it compiled (said once in each output).
NOT_SEEN_COMPILED = (
    "inside compiled code memkit sees the allocator only: no per-op or per-module attribution "
    '(the eager breakdown: compiled="eager", which runs those steps eagerly)'
)

_STEP_METHODS = ("forward", "training_step", "validation_step")


def compiled_regions(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of the outermost compiled submodules of ``module``: ``torch.compile(m)``
    wrappers and modules compiled in place (``m.compile()``), in ``named_modules`` order."""
    found: list[tuple[str, nn.Module]] = []
    for name, child in module.named_modules():
        if (
            (OPTIMIZED_MODULE is not None and isinstance(child, OPTIMIZED_MODULE))
            or compiled_call_impl(child) is not None
        ) and not any(name.startswith(n + ".") or not n for n, _ in found):
            found.append((name, child))
    return found


def is_compiled_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is ``torch.compile(m)``'s wrapper (its hooks run outside the compiled code, around it)."""
    return OPTIMIZED_MODULE is not None and isinstance(module, OPTIMIZED_MODULE)


def compiled_parts(module: nn.Module) -> list[str]:
    """The compiled parts of ``module``, by qualified name: submodules that are ``torch.compile(m)`` wrappers
    or were compiled in place (``m.compile()``), and compiled methods (``forward``, ``training_step``: what
    Lightning's ``from_compiled`` installs), e.g. ``["model", "training_step"]``. Empty: nothing compiled.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"compiled_parts(module): give an nn.Module, not {type(module).__name__}")
    parts = [name or "<root>" for name, _ in compiled_regions(module)]
    for method in _STEP_METHODS:
        if compiled_function(module.__dict__.get(method)):
            parts.append(method)
    return parts


class _AllocatorStream:
    """The one torch profiler (``profile_memory=True``) that every memkit reader of the allocator's events shares:
    only one profiler records at a time, so MemoryTracker, LayerTrace and MemoryDoctor read the same recording.
    :meth:`flush` stops it, hands the events to every reader, and starts it again while anyone reads."""

    def __init__(self) -> None:
        self._profile: Any = None
        self._readers: list[Any] = []

    def subscribe(self, reader: Any) -> bool:
        if reader in self._readers:
            return True
        if self._profile is None:
            if profiler_active():
                return False
            self._start()
        else:
            self.flush()  # what came before is not this reader's
        self._readers.append(reader)
        return True

    def unsubscribe(self, reader: Any) -> None:
        if reader not in self._readers:
            return
        self.flush()
        self._readers.remove(reader)
        if not self._readers and self._profile is not None:
            profile, self._profile = self._profile, None
            profile.__exit__(None, None, None)

    def flush(self) -> None:
        profile, self._profile = self._profile, None
        if profile is None:
            return
        profile.__exit__(None, None, None)
        by_device: dict[str, list[Any]] = {}
        for reader in list(self._readers):
            kind = reader.device.type
            if kind not in by_device:
                by_device[kind] = allocator_events(profile, kind, marks=True)
            reader.feed(by_device[kind])
        if self._readers:
            self._start()

    def _start(self) -> None:
        track_cpu_allocation_sizes()  # frees of blocks allocated while nothing recorded are reported too
        self._profile = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True, record_shapes=False, with_stack=False
        )
        self._profile.__enter__()


_STREAM = _AllocatorStream()


class AllocatorPeak:
    """The peak of the allocator's live bytes over windows of a step, from the allocator's own events.

    Torch's profiler (``profile_memory=True``) records every allocation and free the allocator makes on
    ``device`` (compiled code included: it is infrastructure, dynamo keeps compiling under it). A window's
    peak is the bytes live when it opens (given to :meth:`start`) plus the highest running sum of the signed
    event bytes. Costs about a profiled step (every op is recorded): a diagnosis mode, not free.

    memkit's readers share one profiler. When another one is already recording (yours, or Lightning's
    ``profiler="pytorch"``), :meth:`start` returns False and the window has no peak.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.peak_bytes: int | None = None
        self._active = False
        self._base = self._running = self._highest = 0
        self._mark_prefix = f"{id(self)}:"
        #: ``name -> (live bytes, peak bytes so far)`` at each :meth:`mark`, once its window's events are read
        self.marks: dict[str, tuple[int, int]] = {}

    @property
    def active(self) -> bool:
        """Whether a window is recording."""
        return self._active

    def reset(self) -> None:
        """Forget the peak (a new step)."""
        self.peak_bytes = None

    def start(self, live_bytes: int) -> bool:
        """Open a window; ``live_bytes``: the bytes live on the device now. False when another profiler records."""
        if self._active:
            return True
        if not _STREAM.subscribe(self):
            return False
        self._active = True
        self._base, self._running, self._highest = int(live_bytes), 0, 0
        self.marks = {}
        return True

    def feed(self, events: list[Any]) -> None:
        """Take the allocator's ``(time ns, signed bytes)`` events and memkit's marks, in time order (the shared
        profiler calls it)."""
        running, highest = self._running, self._highest
        for event in events:
            if len(event) == 3:
                key = event[2][len(MARK_PREFIX) :]
                if key.startswith(self._mark_prefix):
                    self.marks[key[len(self._mark_prefix) :]] = (self._base + running, self._base + highest)
                continue
            running += event[1]
            if running > highest:
                highest = running
        self._running, self._highest = running, highest

    def mark(self, name: str) -> None:
        """Remember this moment: after the window's events are read, :attr:`marks` ``[name]`` holds
        ``(live bytes, peak bytes so far)`` at it. Safe anywhere, backward hooks included (nothing stops)."""
        if self._active:
            mark(self._mark_prefix + name)

    def now(self) -> tuple[int, int]:
        """``(live bytes now, peak bytes since the window opened)`` of an open window (bytes). It stops and restarts
        the profiler: never call it inside backward or an op (use :meth:`mark`)."""
        if self._active:
            _STREAM.flush()
        return self._base + self._running, self._base + self._highest

    def stop(self) -> int | None:
        """Close the window; returns the step's peak so far (bytes), also on :attr:`peak_bytes`."""
        if not self._active:
            return self.peak_bytes
        _STREAM.unsubscribe(self)
        self._active = False
        peak = self._base + self._highest
        self.peak_bytes = peak if self.peak_bytes is None else max(self.peak_bytes, peak)
        return self.peak_bytes


class AllocatorBalance:
    """The allocator's live bytes on ``device`` over a long stretch (many steps), from its own events: the
    bytes live at :meth:`start` plus every allocation and free since. What a leak check between steps reads on
    a compiled model, where no dispatch mode can see the tensors compiled code makes (saved activations of a
    kept graph included). Shares memkit's one profiler (see :class:`AllocatorPeak`)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._active = False
        self._bytes = 0

    @property
    def active(self) -> bool:
        """Whether it is recording."""
        return self._active

    def start(self, live_bytes: int) -> bool:
        """Begin from ``live_bytes`` live now. False when another profiler records."""
        if self._active:
            return True
        if not _STREAM.subscribe(self):
            return False
        self._active, self._bytes = True, int(live_bytes)
        return True

    def feed(self, events: list[Any]) -> None:
        """Take the allocator's events (the shared profiler calls it; marks are skipped)."""
        self._bytes += sum(event[1] for event in events)

    def live_bytes(self) -> int:
        """The allocator's live bytes now (bytes)."""
        if self._active:
            _STREAM.flush()
        return self._bytes

    def stop(self) -> None:
        """Stop recording."""
        if self._active:
            _STREAM.unsubscribe(self)
            self._active = False
