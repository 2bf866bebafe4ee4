"""CudaAllocatorModel against the real allocator: replaying the H100 traces in tests/data/gpu_truth
must give the segments the real allocator made and its reserved peak (within 1%)."""

from __future__ import annotations

import pytest

from lightning_memkit.estimate.cuda.caching_allocator import AllocatorConfig, CudaAllocatorModel
from lightning_memkit.units import MiB
from tests.helpers.gpu_truth import device_order_sizes, load_trace, make_model, trace_names, truth_row


def _seeded(trace: dict) -> tuple[CudaAllocatorModel, int]:
    """A model holding what the device held at on_train_start: the parameters in .to() order, and the
    few 512-byte blocks a previous run in the same process left behind (the truth's start minus those)."""
    row = truth_row(trace)
    sizes = device_order_sizes(make_model(trace["model"], trace["batch_size"], device="meta"))
    model = CudaAllocatorModel()
    for index, size in enumerate(sizes):
        model.allocate(("parameter", index), size)
    # what was reserved at the start is recorded: the peak minus the segments the trace made (it frees none)
    reserved_at_start = row["peak_reserved_bytes"] - sum(
        e["size"] for e in trace["events"] if e["action"] == "segment_alloc"
    )
    assert not any(e["action"] == "segment_free" for e in trace["events"])
    extra = reserved_at_start - model.reserved_bytes
    assert 0 <= extra <= 2 * MiB, "the parameters' segments should account for the start, up to one small segment"
    if extra:  # a small segment a previous run in the process left, holding its few leftover blocks
        model.cache_segment(extra, small=True)
    leftover = row["start_allocated_bytes"] - model.allocated_bytes
    assert 0 <= leftover <= 4 * 512, "the parameters alone should account for the start, up to a few small blocks"
    for index in range(leftover // 512):
        model.allocate(("leftover", index), 512)
    return model, row["start_allocated_bytes"]


@pytest.mark.parametrize("name", trace_names())
def test_replaying_a_recorded_trace_gives_its_segments_and_reserved_peak(name):
    trace = load_trace(name)
    row = truth_row(trace)
    model, start = _seeded(trace)
    assert (
        model.allocated_bytes == start
    )  # 512-byte rounding, whole blocks: the parameters' own bytes as the device counted them
    model.peak_allocated_bytes = model.allocated_bytes
    segments_before = len(model.segment_sizes)
    live: set[int] = set()
    recorded_segments = []
    for event in trace["events"]:
        action = event["action"]
        if action == "alloc":
            model.allocate(event["addr"], event["size"])
            live.add(event["addr"])
        elif action == "free_completed":
            assert event["addr"] in live, "a free of a block the replay never saw"
            live.discard(event["addr"])
            model.free(event["addr"])
        elif action == "segment_alloc":
            recorded_segments.append(event["size"])
        elif action == "segment_free":
            recorded_segments.remove(event["size"])
    made = model.segment_sizes[segments_before:]
    # the large pool's segments exactly; the small pool's 2 MiB segments to within one (the order in which the
    # real allocator placed the previous run's leftover blocks among its small blocks is not recorded)
    assert sorted(s for s in made if s > 2 * MiB) == sorted(s for s in recorded_segments if s > 2 * MiB)
    assert abs(made.count(2 * MiB) - recorded_segments.count(2 * MiB)) <= 1
    assert model.peak_reserved_bytes == pytest.approx(row["peak_reserved_bytes"], rel=0.01)
    assert model.peak_allocated_bytes == pytest.approx(row["peak_allocated_bytes"], rel=0.01)


def test_expandable_segments_grow_one_segment_per_pool_by_pages():
    model = CudaAllocatorModel(AllocatorConfig.parse("expandable_segments:True"))
    model.allocate("a", 30 * MiB)  # large pool: one segment mapped in 20 MiB pages -> 40 MiB
    model.allocate("b", 5 * MiB)  # fits in the mapped tail (10 MiB free): no growth
    assert model.reserved_bytes == 40 * MiB and model.allocated_bytes == 35 * MiB  # split at 512 bytes, not 1 MiB
    model.allocate("c", 7 * MiB)  # 5 MiB free at the end: grows by one page, merging the free tail
    assert model.reserved_bytes == 60 * MiB and len(model.segment_sizes) == 1
    model.allocate("d", 1000)  # small pool: its own segment, 2 MiB pages
    assert model.reserved_bytes == 62 * MiB and len(model.segment_sizes) == 2
    model.free("a")
    model.allocate("e", 25 * MiB)  # reuses the freed 30 MiB at the front
    assert model.reserved_bytes == 62 * MiB


def test_max_split_size_keeps_large_blocks_whole():
    model = CudaAllocatorModel(AllocatorConfig.parse("max_split_size_mb:64"))
    model.allocate("big", 100 * MiB)
    model.free("big")
    model.allocate("small", 30 * MiB)  # below the limit: the cached 100 MiB block is not used
    assert model.reserved_bytes == 130 * MiB
    model.allocate("large", 85 * MiB)  # above the limit, within 20 MiB of the block: takes it, unsplit
    assert model.reserved_bytes == 130 * MiB and model.allocated_bytes == 130 * MiB
    model.allocate("other", 70 * MiB)  # 20 MiB or more smaller than any cached oversize block: a new segment
    assert model.reserved_bytes == 200 * MiB
    plain = CudaAllocatorModel()
    plain.allocate("big", 100 * MiB)
    plain.free("big")
    plain.allocate("small", 30 * MiB)
    assert plain.reserved_bytes == 100 * MiB  # without the limit the cached block is split


def test_a_storage_resized_in_place_frees_its_block_and_allocates_a_new_one():
    """``resize_`` on CUDA allocates the new size, copies, then frees the old block; to 0 bytes it only frees: a
    gathered parameter freed with ``resize_(0)`` leaves its block cached (reserved), not allocated."""
    model = CudaAllocatorModel()
    model.allocate("gathered", 30 * MiB)
    model.resize("gathered", 0)
    assert model.allocated_bytes == 0 and model.reserved_bytes == 30 * MiB
    model.resize("gathered", 30 * MiB)  # grown back: the cached block serves it
    assert model.allocated_bytes == 30 * MiB and model.reserved_bytes == 30 * MiB
    model.resize("gathered", 40 * MiB)  # both blocks live while the data is copied
    assert model.peak_allocated_bytes == 70 * MiB and model.allocated_bytes == 40 * MiB
    model.replay([("resize", "gathered", 0), ("free", "gathered", 0)])
    assert model.allocated_bytes == 0


def test_allocator_config_parses_pytorch_cuda_alloc_conf(monkeypatch):
    config = AllocatorConfig.parse("expandable_segments:True, max_split_size_mb:128,garbage_collection_threshold:0.6")
    assert config.expandable_segments and config.max_split_size_bytes == 128 * MiB
    assert AllocatorConfig.parse(None) == AllocatorConfig() == AllocatorConfig.parse("")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert AllocatorConfig.from_env().expandable_segments
    with pytest.raises(ValueError, match="expandable_segments must be True or False"):
        AllocatorConfig.parse("expandable_segments:yes")
    with pytest.raises(ValueError, match="max_split_size_mb.*whole number of MiB"):
        AllocatorConfig.parse("max_split_size_mb:lots")
