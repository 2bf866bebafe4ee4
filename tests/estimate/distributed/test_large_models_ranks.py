"""Fine-tuning a Llama-7B-shaped model on 8 GPUs with FSDP2, one rank at a time: the per-rank estimate (built on the
meta device, for an H100) against a per-rank count written here from the architecture, and the rank's caching
allocator against its tensors.

The count is :class:`test_large_models.LlamaCount`'s one-device step (the same batch per rank, the same saved
activations, autocast's weight copies and temporaries) with FSDP2's layout put in: parameters, gradients and AdamW's
state as this rank's dim-0 shards; the root's parameters (embedding, lm_head, final norm) gathered in fp32 from
forward to backward; the last decoder layer's flat all-gather output, which FSDP2's implicit forward prefetch keeps
until the next copy-out (``FSDPParamGroup.wait_for_unshard``).
"""

from __future__ import annotations

import pytest
import torch

from tests.estimate.test_large_models import FP32, Case, LlamaCount, Moment
from tests.helpers.llama_shapes import LlamaModelParallel

pytest.importorskip("transformers")

GIB = 2**30
#: one H100's memory, less the 5% memkit's answers keep free
USABLE = 0.95 * 80 * GIB
#: the CUDA context a rank's device holds besides the caching allocator (memkit's allowance)
CONTEXT = 512 * 2**20


def _shard(numel_dim0: int, rest: int, ranks: int) -> int:
    """Elements of rank 0's dim-0 shard (FSDP2 pads dim 0 to a multiple of the ranks)."""
    return -(-numel_dim0 // ranks) * rest


def fsdp2_rank_count(ranks: int) -> dict[str, dict[str, int]]:
    """The rank's bytes by category at the end of the second forward and at the first optimizer step."""
    count = LlamaCount(Case("7b", False, "bf16-mixed", False, 1))
    h, V, L, ff, kv = count.h, count.V, count.L, count.ff, count.kv
    layer_shapes = [(h, h), (kv, h), (kv, h), (h, h), (ff, h), (ff, h), (h, ff), (h, 1), (h, 1)]
    root_shapes = [(V, h), (V, h), (h, 1)]
    layer_shard = sum(_shard(rows, cols, ranks) for rows, cols in layer_shapes)
    shard = L * layer_shard + sum(_shard(rows, cols, ranks) for rows, cols in root_shapes)
    tensors = 9 * L + 3
    states = {"parameters": FP32 * shard, "gradients": FP32 * shard, "optimizer_state": 2 * FP32 * shard + 4 * tensors}
    gathered_root = FP32 * sum(-(-rows // ranks) * ranks * cols for rows, cols in root_shapes)
    gather_buffer = FP32 * ranks * layer_shard  # the last layer's all-gather output, padded rows included
    forward = {**count.at(Moment.FORWARD_END), **states}
    forward["temporaries"] += gather_buffer
    forward["strategy_buffers"] = gathered_root
    optimizer = {**count.at(Moment.OPTIMIZER), **states}
    optimizer["temporaries"] = count.temporaries(Moment.OPTIMIZER)[0][1] + FP32 * shard  # cuBLAS, sqrt of the shards
    optimizer["strategy_buffers"] = 0
    return {"forward": forward, "optimizer": optimizer}


def _fewest(needs: dict[int, int]) -> int | None:
    return next((ranks for ranks in sorted(needs) if needs[ranks] <= USABLE), None)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_7b_fsdp2_on_8_ranks_equals_the_per_rank_count_and_its_allocator_holds_only_its_tensors():
    from lightning_memkit.estimate import estimate_distributed_memory, reusing_fake_copies

    with torch.device("meta"):
        module = LlamaModelParallel("7b")  # configure_model shards as ModelParallelStrategy's docs write it
    estimates = {}
    with reusing_fake_copies():
        for ranks in (2, 4, 8):
            estimates[ranks] = estimate_distributed_memory(
                module, 1, strategy="model_parallel", world_size=ranks, mode="bf16", device="cuda", gpu="h100"
            )
    rank = estimates[8]
    expected = fsdp2_rank_count(8)["forward"]
    assert (rank.single.peak_phase, rank.single.peak_step) == ("forward", 2)
    for category, value in expected.items():
        assert abs(rank.by_category[category] - value) <= 0.01 * max(value, 1), (category, rank.by_category, expected)
    assert abs(rank.peak_bytes - sum(expected.values())) <= 0.01 * sum(expected.values())
    # the rank's allocator, replayed from the rank's own events: allocated exceeds the tensor peak by no more than
    # the rounding of the blocks live at the peak, far less than its workspaces and communication buffers
    workspaces = 2 * 32 * 2**20 + 2**20  # cuBLAS (forward and backward streams) and cuBLASLt
    comm = (
        expected["temporaries"]
        - LlamaCount(Case("7b", False, "bf16-mixed", False, 1)).at(Moment.FORWARD_END)["temporaries"]
    )
    assert 0 <= rank.cuda.peak_allocated_bytes - rank.peak_bytes <= workspaces + comm
    assert rank.cuda.peak_reserved_bytes >= rank.cuda.peak_allocated_bytes
    # the fewest GPUs: the first world size whose rank fits 95% of 80 GiB, by the estimate and by the count
    counted = {
        ranks: max(sum(moment.values()) for moment in fsdp2_rank_count(ranks).values()) + CONTEXT for ranks in (2, 4, 8)
    }
    estimated = {ranks: estimate.required_bytes for ranks, estimate in estimates.items()}
    for ranks in (2, 4, 8):
        needs, count_needs = estimated[ranks] / GIB, counted[ranks] / GIB
        print(f"7B FSDP2 bf16 x{ranks}: device needs {needs:.2f} GiB, counted {count_needs:.2f} GiB")
    print(
        f"x8: tensor peak {rank.peak_bytes / GIB:.2f} GiB, allocated {rank.cuda.peak_allocated_bytes / GIB:.2f} GiB, "
        f"reserved {rank.cuda.peak_reserved_bytes / GIB:.2f} GiB, count {sum(expected.values()) / GIB:.2f} GiB"
    )
    assert _fewest(estimated) == _fewest(counted) == 4, (estimated, counted)
