"""A model of PyTorch's CUDA caching allocator: what a stream of tensor allocations costs on a GPU.

It replays allocation and free events (bytes, in order) through the allocator's rules
(c10/cuda/CUDACachingAllocator.cpp) and reports the allocated and reserved peaks, in bytes. Replaying
the recorded H100 traces in tests/data/gpu_truth reproduces their segments and reserved peaks
(tests/estimate/cuda/test_allocator_replay.py).
"""

from __future__ import annotations

import bisect
import itertools
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from lightning_memkit.units import MiB

__all__ = [
    "AllocatorConfig",
    "AllocatorView",
    "CudaAllocatorModel",
    "round_allocation",
    "segment_size",
    "CUDA_CONTEXT_BYTES",
    "CUBLAS_WORKSPACE_BYTES",
    "CUDNN_WORKSPACE_BYTES",
]

#: every allocation is rounded up to a multiple of this (kMinBlockSize).
MIN_BLOCK_BYTES = 512
#: requests up to this size come from the small pool (kSmallSize).
SMALL_REQUEST_BYTES = 1 * MiB
#: the small pool grows by segments of this size (kSmallBuffer).
SMALL_SEGMENT_BYTES = 2 * MiB
#: requests below this size (and above SMALL_REQUEST_BYTES) get a segment of LARGE_SEGMENT_BYTES (kMinLargeAlloc).
MIN_LARGE_ALLOC_BYTES = 10 * MiB
#: the large pool's segment size for mid-sized requests (kLargeBuffer).
LARGE_SEGMENT_BYTES = 20 * MiB
#: larger requests get their own segment, rounded up to this (kRoundLarge).
ROUND_LARGE_BYTES = 2 * MiB

#: Allowance for the CUDA context and the kernels loaded with it (lazy loading, CUDA 12): not
#: visible to the caching allocator, measured at roughly 300-600 MiB on A100/H100 with torch 2.x.
CUDA_CONTEXT_BYTES = 512 * MiB
#: cuBLAS workspace on Hopper (torch's default CUBLAS_WORKSPACE_CONFIG ":4096:8", 8 x 4 MiB). The
#: CUDA-target estimate allocates it inside the simulated step (see estimate/cuda/kernels.py);
#: kept here as a named figure for callers that budget without an estimate.
CUBLAS_WORKSPACE_BYTES = 32 * MiB
#: A rough cuDNN workspace allowance for callers that budget without an estimate; the CUDA-target
#: estimate simulates each convolution's workspace instead (estimate/cuda/kernels.py).
CUDNN_WORKSPACE_BYTES = 64 * MiB


def round_allocation(nbytes: int) -> int:
    """The size the caching allocator gives a request of ``nbytes``: a multiple of 512 bytes, at least 512."""
    if nbytes <= MIN_BLOCK_BYTES:
        return MIN_BLOCK_BYTES
    return MIN_BLOCK_BYTES * ((nbytes + MIN_BLOCK_BYTES - 1) // MIN_BLOCK_BYTES)


def segment_size(rounded: int) -> int:
    """The ``cudaMalloc`` size when a rounded request of ``rounded`` bytes finds no cached block."""
    if rounded <= SMALL_REQUEST_BYTES:
        return SMALL_SEGMENT_BYTES
    if rounded < MIN_LARGE_ALLOC_BYTES:
        return LARGE_SEGMENT_BYTES
    return ROUND_LARGE_BYTES * ((rounded + ROUND_LARGE_BYTES - 1) // ROUND_LARGE_BYTES)


def _parse_size_mb(value: str, option: str) -> int:
    try:
        megabytes = int(value)
    except ValueError:
        raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: {option}:{value!r} is not a whole number of MiB") from None
    if megabytes <= 0:
        raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF: {option} must be positive, not {megabytes}")
    return megabytes * MiB


@dataclass(frozen=True)
class AllocatorConfig:
    """The caching allocator's settings that change what a step reserves (from ``PYTORCH_CUDA_ALLOC_CONF``).

    Attributes:
        expandable_segments: one growing segment per pool, mapped in pages (2 MiB small pool, 20 MiB
            large pool), blocks split down to 512 bytes; ``expandable_segments:True``.
        max_split_size_bytes: blocks at least this large are never split, and are not used for
            requests below it (``max_split_size_mb:N``); ``None`` = no limit (the default).

    Options that do not change a single-stream step's peaks (``garbage_collection_threshold``,
    ``roundup_power2_divisions``, backend choices) are accepted and not modelled.
    """

    expandable_segments: bool = False
    max_split_size_bytes: int | None = None

    @classmethod
    def parse(cls, text: str | None) -> AllocatorConfig:
        """Parse a ``PYTORCH_CUDA_ALLOC_CONF`` string such as ``"expandable_segments:True,max_split_size_mb:128"``."""
        expandable, max_split = False, None
        for item in filter(None, (part.strip() for part in (text or "").split(","))):
            key, _, value = item.partition(":")
            key, value = key.strip(), value.strip()
            if key == "expandable_segments":
                if value not in ("True", "False"):
                    raise ValueError(
                        f"PYTORCH_CUDA_ALLOC_CONF: expandable_segments must be True or False, not {value!r}"
                    )
                expandable = value == "True"
            elif key == "max_split_size_mb":
                max_split = _parse_size_mb(value, key)
        return cls(expandable, max_split)

    @classmethod
    def from_env(cls) -> AllocatorConfig:
        """The settings in this process's ``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``)."""
        return cls.parse(os.environ.get("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF")))


@dataclass
class AllocatorView:
    """What the CUDA caching allocator would report for a replayed step (all sizes in bytes).

    Attributes:
        peak_allocated_bytes: predicted ``torch.cuda.max_memory_allocated()``: the peak of live
            blocks, each rounded to 512 bytes (or the whole cached block when it was not split).
        peak_reserved_bytes: predicted ``torch.cuda.max_memory_reserved()``: the peak of segments
            obtained with ``cudaMalloc`` (2 MiB small-pool segments, 20 MiB or rounded large ones).
        segments: number of segments at the end of the replay.
        context_bytes: the allowance for the CUDA context (see :data:`CUDA_CONTEXT_BYTES`).
        workspace_bytes: an allowance for workspaces not simulated in the step (0 when the
            CUDA-target estimate allocated cuBLAS and cuDNN workspaces inside the step itself).
        device_bytes: what the device must hold: ``peak_reserved_bytes + context_bytes + workspace_bytes``.
    """

    peak_allocated_bytes: int = 0
    peak_reserved_bytes: int = 0
    segments: int = 0
    context_bytes: int = 0
    workspace_bytes: int = 0

    @property
    def device_bytes(self) -> int:
        """Bytes the GPU must have for the step: reserved peak plus the context and workspace allowances."""
        return self.peak_reserved_bytes + self.context_bytes + self.workspace_bytes

    def to_dict(self) -> dict:
        """A JSON-ready dict (``device_bytes`` included)."""
        data = asdict(self)
        data["device_bytes"] = self.device_bytes
        return data


@dataclass(frozen=True)
class _ResizedKey:
    """The key a resized storage's new block is allocated under while its old block is still live."""

    key: object


@dataclass(eq=False)
class _Block:
    segment: int
    offset: int
    size: int
    free: bool = True
    small: bool = True


@dataclass
class CudaAllocatorModel:
    """Replays allocations and frees through the caching allocator's rules (one stream, no ``empty_cache``).

    Rules modelled (CUDACachingAllocator.cpp): 512-byte rounding; the small pool (requests <= 1 MiB)
    carved from 2 MiB segments and split down to 512 bytes; the large pool, 20 MiB segments for
    requests below 10 MiB and 2 MiB-rounded segments above, a cached block split only when more than
    1 MiB would be left over (an unsplit block counts whole in ``allocated``); best-fit reuse (the
    smallest cached block that fits, the oldest segment first among equals); freed neighbours in a
    segment merged; segments never released (no ``empty_cache``, no out-of-memory flush);
    ``max_split_size_mb`` and ``expandable_segments`` as :class:`AllocatorConfig` describes.
    Not modelled: several streams, and the memory of the context itself (see :class:`AllocatorView`).

    Usage::

        model = CudaAllocatorModel()
        model.allocate("a", 3000); model.allocate("b", 5 * 2**20); model.free("a")
        model.view().peak_reserved_bytes     # 2 MiB + 20 MiB
    """

    config: AllocatorConfig = field(default_factory=AllocatorConfig)
    allocated_bytes: int = 0
    reserved_bytes: int = 0
    peak_allocated_bytes: int = 0
    peak_reserved_bytes: int = 0
    _segments: dict[int, list[_Block]] = field(default_factory=dict)
    _free_small: list[tuple[int, int, int]] = field(default_factory=list)
    _free_large: list[tuple[int, int, int]] = field(default_factory=list)
    _live: dict[object, _Block] = field(default_factory=dict)
    _ids: itertools.count = field(default_factory=itertools.count)
    _expandable: dict[bool, int] = field(default_factory=dict)  # pool (small?) -> its one segment's id

    # free lists hold (size, segment, offset), sorted, for best-fit lookup
    def _free_list(self, small: bool) -> list[tuple[int, int, int]]:
        return self._free_small if small else self._free_large

    def _add_free(self, block: _Block) -> None:
        bisect.insort(self._free_list(block.small), (block.size, block.segment, block.offset))

    def _remove_free(self, block: _Block) -> None:
        entries = self._free_list(block.small)
        index = bisect.bisect_left(entries, (block.size, block.segment, block.offset))
        del entries[index]

    def _block_at(self, segment: int, offset: int) -> _Block:
        return next(b for b in self._segments[segment] if b.offset == offset)

    def _find_free(self, rounded: int, small: bool) -> _Block | None:
        entries = self._free_list(small)
        index = bisect.bisect_left(entries, (rounded, -1, -1))
        if index == len(entries):
            return None
        size, segment, offset = entries[index]
        limit = self.config.max_split_size_bytes
        # the best fit only: an oversize block is not handed to a request below the limit, nor wasted on a request
        # more than 20 MiB smaller than it (get_free_block); a new segment is made instead
        if (
            limit is not None
            and not small
            and ((rounded < limit <= size) or (rounded >= limit and size >= rounded + LARGE_SEGMENT_BYTES))
        ):
            return None
        del entries[index]
        return self._block_at(segment, offset)

    def _new_segment(self, size: int, small: bool) -> _Block:
        segment = next(self._ids)
        block = _Block(segment, 0, size, True, small)
        self._segments[segment] = [block]
        self._grow(size)
        return block

    def _grow(self, nbytes: int) -> None:
        self.reserved_bytes += nbytes
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)

    def _expand(self, rounded: int, small: bool) -> _Block:
        """expandable_segments: map more pages at the end of the pool's one segment (merging a free tail)."""
        page = SMALL_SEGMENT_BYTES if small else LARGE_SEGMENT_BYTES
        segment = self._expandable.get(small)
        if segment is None:
            segment = next(self._ids)
            self._segments[segment] = []
            self._expandable[small] = segment
        blocks = self._segments[segment]
        tail = blocks[-1] if blocks and blocks[-1].free else None
        have = tail.size if tail is not None else 0
        grow = page * ((rounded - have + page - 1) // page)
        self._grow(grow)
        if tail is not None:
            self._remove_free(tail)
            tail.size += grow
            return tail
        offset = blocks[-1].offset + blocks[-1].size if blocks else 0
        block = _Block(segment, offset, grow, True, small)
        blocks.append(block)
        return block

    def _should_split(self, block: _Block, rounded: int) -> bool:
        remaining = block.size - rounded
        if block.small or self.config.expandable_segments:
            return remaining >= MIN_BLOCK_BYTES
        limit = self.config.max_split_size_bytes
        return (limit is None or rounded < limit) and remaining > SMALL_REQUEST_BYTES

    def allocate(self, key: object, nbytes: int) -> int:
        """Allocate ``nbytes`` under ``key``; return the block size charged (0 for an empty tensor)."""
        if nbytes <= 0:
            return 0
        rounded = round_allocation(nbytes)
        small = rounded <= SMALL_REQUEST_BYTES
        block = self._find_free(rounded, small)
        if block is None:
            block = (
                self._expand(rounded, small)
                if self.config.expandable_segments
                else self._new_segment(segment_size(rounded), small)
            )
        if self._should_split(block, rounded):
            rest = _Block(block.segment, block.offset + rounded, block.size - rounded, True, small)
            blocks = self._segments[block.segment]
            blocks.insert(blocks.index(block) + 1, rest)
            block.size = rounded
            self._add_free(rest)
        block.free = False
        self._live[key] = block
        self.allocated_bytes += block.size
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)
        return block.size

    def free(self, key: object) -> None:
        """Free the block allocated under ``key`` (unknown keys are ignored) and merge free neighbours."""
        block = self._live.pop(key, None)
        if block is None:
            return
        self.allocated_bytes -= block.size
        block.free = True
        blocks = self._segments[block.segment]
        index = blocks.index(block)
        if index + 1 < len(blocks) and blocks[index + 1].free:
            after = blocks.pop(index + 1)
            self._remove_free(after)
            block.size += after.size
        if index > 0 and blocks[index - 1].free:
            before = blocks[index - 1]
            self._remove_free(before)
            before.size += block.size
            blocks.pop(index)
            block = before
        self._add_free(block)

    def resize(self, key: object, nbytes: int) -> None:
        """Resize the storage under ``key`` in place to ``nbytes``, as ``UntypedStorage.resize_`` does on CUDA
        (``resize_bytes_cuda``): a new block of the new size is allocated, the old data copied, then the old block
        freed; to 0 bytes only the free. A key not live (freed, or resized to 0 before) is allocated anew."""
        if nbytes <= 0:
            self.free(key)
            return
        grown = _ResizedKey(key)
        self.allocate(grown, nbytes)
        self.free(key)
        self._live[key] = self._live.pop(grown)

    def cache_segment(self, nbytes: int, small: bool = False) -> None:
        """Add a free segment of ``nbytes`` to the small or large pool, as if earlier work had left it
        cached (reserved, nothing allocated in it): the state a replay starts from."""
        if nbytes <= 0 or nbytes % MIN_BLOCK_BYTES:
            raise ValueError(f"a segment is a positive multiple of {MIN_BLOCK_BYTES} bytes, not {nbytes}")
        self._add_free(self._new_segment(nbytes, small))

    def replay(self, events: Iterable[tuple[str, object, int]]) -> CudaAllocatorModel:
        """Apply ``("alloc", key, nbytes)``, ``("resize", key, nbytes)`` (the storage's new size) and
        ``("free", key, 0)`` events in order; returns self."""
        for kind, key, nbytes in events:
            if kind == "alloc":
                self.allocate(key, nbytes)
            elif kind == "resize":
                self.resize(key, nbytes)
            else:
                self.free(key)
        return self

    @property
    def segment_sizes(self) -> list[int]:
        """The size of each segment now held, in the order they were made (bytes)."""
        return [sum(b.size for b in blocks) for _, blocks in sorted(self._segments.items())]

    def view(self, context_bytes: int = 0, workspace_bytes: int = 0) -> AllocatorView:
        """The peaks so far as an :class:`AllocatorView`, with the given allowances (bytes)."""
        return AllocatorView(
            self.peak_allocated_bytes, self.peak_reserved_bytes, len(self._segments), context_bytes, workspace_bytes
        )
