"""A model of PyTorch's CUDA caching allocator: what a stream of tensor allocations costs on a GPU.

It replays allocation and free events (bytes, in order) through the allocator's documented rules
(c10/cuda/CUDACachingAllocator.cpp) and reports the allocated and reserved peaks, in bytes.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import asdict, dataclass, field
from typing import Iterable

from lightning_memkit.units import MiB

__all__ = [
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
#: cuBLAS workspace for the default stream; torch's default CUBLAS_WORKSPACE_CONFIG on Hopper is
#: ":4096:8" (8 x 4 MiB). It is allocated through the caching allocator on first matmul.
CUBLAS_WORKSPACE_BYTES = 32 * MiB
#: Allowance for cuDNN convolution workspaces (algorithm dependent, through the caching allocator);
#: added only for modules that contain convolutions.
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
        workspace_bytes: the allowance for cuBLAS (and, for convolutional modules, cuDNN) workspaces.
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


@dataclass
class _Block:
    segment: int
    offset: int
    size: int
    free: bool = True
    small: bool = True


@dataclass
class CudaAllocatorModel:
    """Replays allocations and frees through the caching allocator's rules (one stream, no ``empty_cache``).

    Rules modelled: 512-byte rounding; the small pool (requests <= 1 MiB) carved from 2 MiB segments
    and split down to 512 bytes; the large pool, 20 MiB segments for requests below 10 MiB and
    2 MiB-rounded segments above, a cached block split only when more than 1 MiB would be left over;
    best-fit reuse of cached blocks (smallest block that fits); freed neighbours in a segment merged.
    Not modelled: several streams, ``max_split_size_mb``, expandable segments, cache flushes when the
    device is full, and the memory of the context itself (see :class:`AllocatorView`).

    Usage::

        model = CudaAllocatorModel()
        model.allocate("a", 3000); model.allocate("b", 5 * 2**20); model.free("a")
        model.view().peak_reserved_bytes     # 2 MiB + 20 MiB
    """

    allocated_bytes: int = 0
    reserved_bytes: int = 0
    peak_allocated_bytes: int = 0
    peak_reserved_bytes: int = 0
    _segments: dict[int, list[_Block]] = field(default_factory=dict)
    _free_small: list[tuple[int, int, int]] = field(default_factory=list)
    _free_large: list[tuple[int, int, int]] = field(default_factory=list)
    _live: dict[object, _Block] = field(default_factory=dict)
    _ids: "itertools.count" = field(default_factory=itertools.count)

    # free lists hold (size, segment, offset), sorted, for best-fit lookup
    def _free_list(self, small: bool) -> list[tuple[int, int, int]]:
        return self._free_small if small else self._free_large

    def _add_free(self, block: _Block) -> None:
        bisect.insort(self._free_list(block.small), (block.size, block.segment, block.offset))

    def _remove_free(self, block: _Block) -> None:
        entries = self._free_list(block.small)
        index = bisect.bisect_left(entries, (block.size, block.segment, block.offset))
        del entries[index]

    def allocate(self, key: object, nbytes: int) -> int:
        """Allocate ``nbytes`` under ``key``; return the block size charged (0 for an empty tensor)."""
        if nbytes <= 0:
            return 0
        rounded = round_allocation(nbytes)
        small = rounded <= SMALL_REQUEST_BYTES
        entries = self._free_list(small)
        index = bisect.bisect_left(entries, (rounded, -1, -1))
        if index < len(entries):
            size, segment, offset = entries.pop(index)
            block = next(b for b in self._segments[segment] if b.offset == offset)
        else:
            size = segment_size(rounded)
            segment = next(self._ids)
            block = _Block(segment, 0, size, True, small)
            self._segments[segment] = [block]
            self.reserved_bytes += size
            self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        remaining = block.size - rounded
        if (small and remaining >= MIN_BLOCK_BYTES) or (not small and remaining > SMALL_REQUEST_BYTES):
            rest = _Block(block.segment, block.offset + rounded, remaining, True, small)
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

    def replay(self, events: Iterable[tuple[str, object, int]]) -> "CudaAllocatorModel":
        """Apply ``("alloc", key, nbytes)`` and ``("free", key, 0)`` events in order; returns self."""
        for kind, key, nbytes in events:
            if kind == "alloc":
                self.allocate(key, nbytes)
            else:
                self.free(key)
        return self

    def view(self, context_bytes: int = 0, workspace_bytes: int = 0) -> AllocatorView:
        """The peaks so far as an :class:`AllocatorView`, with the given allowances (bytes)."""
        return AllocatorView(self.peak_allocated_bytes, self.peak_reserved_bytes, len(self._segments), context_bytes, workspace_bytes)
