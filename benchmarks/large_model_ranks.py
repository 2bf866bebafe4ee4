"""The per-rank tables of docs/large_models.md ("Eight GPUs"): a Llama-7B- and a Llama-70B-shaped full fine-tune
(tests/helpers/llama_shapes.py, built on the meta device, sequence 2048, batch 1 per rank, AdamW) on 8 H100s under FSDP
(auto-wrapped on the decoder layer), FSDP2 (``configure_model`` as ModelParallelStrategy's docs write it) and DeepSpeed
ZeRO 2 and 3, in bf16-mixed and bf16-true, with and without activation checkpointing; each row one rank's
``estimate_distributed_memory``, and the fewest GPUs (of 1, 2, 4, ..., 128) on which one rank fits 95% of 80 GiB.

    python benchmarks/large_model_ranks.py --shapes 7b,70b
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

STRATEGIES = {"fsdp": "FSDP", "model_parallel": "FSDP2", "deepspeed_stage_2": "ZeRO 2", "deepspeed_stage_3": "ZeRO 3"}
MODES = ("bf16", "bf16+checkpoint", "bf16-true", "bf16-true+checkpoint")
USABLE = 0.95 * 80 * 2**30
SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


def _module(shape: str, strategy: str):
    from tests.helpers.llama_shapes import LlamaFineTune, LlamaModelParallel

    with torch.device("meta"):
        return (LlamaModelParallel if strategy == "model_parallel" else LlamaFineTune)(shape)


def _rank(module, strategy: str, mode: str, ranks: int):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from lightning_memkit.estimate import estimate_distributed_memory

    return estimate_distributed_memory(
        module, 1, strategy=strategy, world_size=ranks, mode=mode, device="cuda", gpu="h100", wrap={LlamaDecoderLayer}
    )


def fewest(module, strategy: str, mode: str, at_8: int) -> int | None:
    """The fewest of :data:`SIZES` on which a rank's device needs fit (they shrink as ranks grow): down from 8
    while it fits, up from 8 until it does."""
    needs = {8: at_8}
    if at_8 <= USABLE:
        for ranks in (4, 2, 1):
            needs[ranks] = _rank(module, strategy, mode, ranks).required_bytes
            if needs[ranks] > USABLE:
                return ranks * 2
        return 1
    for ranks in (16, 32, 64, 128):
        if _rank(module, strategy, mode, ranks).required_bytes <= USABLE:
            return ranks
    return None


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="7b,70b")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()
    header = (
        "| strategy | mode | peak in | parameters | gradients | optimizer state | weight copies | activations "
        "| temporaries | strategy buffers | tensor peak | allocated | reserved | device needs | fits 80 GiB "
        "| fewest GPUs | estimate |"
    )
    for shape in args.shapes.split(","):
        print(f"\n{shape}, 8 ranks, batch 1 x 2048 tokens per rank\n\n{header}\n|{'---|' * 17}")
        for strategy in args.strategies.split(","):
            module = _module(shape, strategy)
            for mode in args.modes.split(","):
                started = time.perf_counter()
                rank = _rank(module, strategy, mode, 8)
                elapsed = time.perf_counter() - started
                c = rank.by_category
                least = fewest(module, strategy, mode, rank.required_bytes)
                cells = [
                    STRATEGIES[strategy],
                    mode,
                    f"{rank.single.peak_phase} {rank.single.peak_step}",
                    *(_gib(c[k]) for k in ("parameters", "gradients", "optimizer_state", "autocast_weight_copies")),
                    *(_gib(c[k]) for k in ("activations", "temporaries", "strategy_buffers")),
                    _gib(rank.peak_bytes),
                    _gib(rank.cuda.peak_allocated_bytes),
                    _gib(rank.cuda.peak_reserved_bytes),
                    _gib(rank.required_bytes),
                    "yes" if rank.required_bytes <= USABLE else "no",
                    str(least) if least else "> 128",
                    f"{elapsed:.1f} s",
                ]
                print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
