"""What a per-rank estimate costs against a bare fake step of the same model, side by side in one run.

For a Llama-7B- and a Llama-70B-shaped model (70B: 80 layers, grouped-query attention with 8 key/value heads) built
on the meta device, sequence 2048, batch 1 per rank, bf16-mixed, for an H100: ``estimate_distributed_memory`` on 8
ranks under DDP, FSDP (auto-wrapped on the decoder layer), FSDP2 (the module's own ``configure_model``, as
ModelParallelStrategy's docs write it) and DeepSpeed ZeRO 2 and 3, against a bare ``FakeTensorMode`` step: the model
made fake (``to_empty`` inside the mode), ``loss = model(ids, labels=ids).loss`` under CPU autocast, ``backward()`` and
AdamW's foreach ``step()``. The estimate runs two steps (the second is the steady state), so the table gives the
ratio to one bare step and to two. Times are process CPU seconds, torch on one thread, each variant once per round,
rounds interleaved, medians.

    python benchmarks/rank_speed.py --shapes 7b,70b --rounds 1
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

STRATEGIES = ("ddp", "fsdp", "model_parallel", "deepspeed_stage_2", "deepspeed_stage_3")


def _module(shape: str, strategy: str):
    from tests.helpers.llama_shapes import LlamaFineTune, LlamaModelParallel

    with torch.device("meta"):
        return (LlamaModelParallel if strategy == "model_parallel" else LlamaFineTune)(shape)


def bare_step(shape: str, steps: int) -> float:
    """CPU seconds of ``steps`` bare FakeTensorMode steps (forward, backward, AdamW's foreach step)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    module = _module(shape, "ddp")
    started = time.process_time()
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = module.model.to_empty(device="cpu")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
        ids = torch.randint(0, 32000, (1, module.seq_len))
        for _ in range(steps):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            del loss
    elapsed = time.process_time() - started
    del model, optimizer, module
    gc.collect()
    return elapsed


def rank_estimate(shape: str, strategy: str, ranks: int) -> tuple[float, int]:
    """CPU seconds of one per-rank estimate, and its device needs (bytes)."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from lightning_memkit.estimate import estimate_distributed_memory

    module = _module(shape, strategy)
    started = time.process_time()
    estimate = estimate_distributed_memory(
        module, 1, strategy=strategy, world_size=ranks, mode="bf16", device="cuda", gpu="h100", wrap={LlamaDecoderLayer}
    )
    elapsed = time.process_time() - started
    needs = estimate.required_bytes
    del estimate, module
    gc.collect()
    return elapsed, needs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="7b,70b", help="llama_shapes.SHAPES keys, comma-separated")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    strategies = args.strategies.split(",")
    print(f"torch {torch.__version__}, {args.ranks} ranks, bf16-mixed, batch 1 x 2048 tokens per rank, CPU seconds")
    print("shape  variant              CPU s   x 1 bare step  x 2 bare steps  device needs/rank")
    for shape in args.shapes.split(","):
        times: dict[str, list[float]] = {}
        needs: dict[str, int] = {}
        for _ in range(args.rounds):
            times.setdefault("bare 1 step", []).append(bare_step(shape, 1))
            times.setdefault("bare 2 steps", []).append(bare_step(shape, 2))
            for strategy in strategies:
                elapsed, needs[strategy] = rank_estimate(shape, strategy, args.ranks)
                times.setdefault(strategy, []).append(elapsed)
        one, two = statistics.median(times["bare 1 step"]), statistics.median(times["bare 2 steps"])
        for variant, values in times.items():
            seconds = statistics.median(values)
            memory = f"{needs[variant] / 2**30:.2f} GiB" if variant in needs else "-"
            print(
                f"{shape:<6} {variant:<18} {seconds:7.1f}   {seconds / one:12.2f}  {seconds / two:14.2f}  {memory:>17}"
            )


if __name__ == "__main__":
    main()
