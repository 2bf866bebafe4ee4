"""Will it fit on N GPUs? Per-rank memory of a 1B-parameter transformer under each strategy, estimated
on fake tensors (no GPU, no cluster, no real weights: the model is built on the meta device).

    python examples/distributed_estimate.py              # the table in docs/distributed.md
    python examples/distributed_estimate.py --layers 2   # the same tables for 2 blocks instead of 20, in seconds
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
from torch import nn

from lightning_memkit.estimate import estimate_distributed_memory, model_state_bytes, reusing_fake_copies
from lightning_memkit.summary_table import format_table

VOCAB, WIDTH, LAYERS, HEADS, SEQ, BATCH = 32_000, 2048, 20, 16, 1024, 4


class GPTLike(nn.Module):
    """Token embedding, ``layers`` pre-norm encoder blocks (causal mask), tied-free output head."""

    def __init__(self, layers: int = LAYERS) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embedding(tokens)
        for block in self.blocks:
            hidden = block(
                hidden,
                is_causal=True,
                src_mask=nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device),
            )
        return self.head(hidden)


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    tokens, targets = batch
    return nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=LAYERS, help=f"encoder blocks (default: {LAYERS})")
    layers = parser.parse_args().layers
    warnings.filterwarnings("ignore")
    with torch.device("meta"):  # 1B parameters (20 blocks), no memory
        model = GPTLike(layers)
    parameters = sum(p.numel() for p in model.parameters())
    batch = (torch.zeros(BATCH, SEQ, dtype=torch.long), torch.zeros(BATCH, SEQ, dtype=torch.long))
    strategies = ["ddp", "deepspeed_stage_1", "deepspeed_stage_2", "fsdp_shard_grad_op", "fsdp", "model_parallel"]
    sizes = [1, 2, 8, 64]
    print(f"GPTLike: {parameters / 1e9:.2f}B parameters, AdamW, fp32, batch {BATCH} x {SEQ} tokens per rank")
    print("\nModel states per rank (GB), the ZeRO paper's mixed-precision Adam layout (16 bytes per parameter):")
    rows = [
        [s]
        + [
            format(
                model_state_bytes(parameters, s, n, precision="16-mixed", optimizer=torch.optim.AdamW).total_bytes
                / 1e9,
                ".2f",
            )
            for n in sizes
        ]
        for s in ["ddp", "deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3"]
    ]
    print(format_table(["strategy"] + [f"N={n}" for n in sizes], rows))
    print(
        "\nPeak per rank (GiB): model-state shards + strategy buffers + activations of one fake step"
        " (model_parallel: FSDP2's own fake step, sharded by fully_shard):"
    )
    rows, shown = [], None
    adamw = lambda params: torch.optim.AdamW(params)  # noqa: E731
    with reusing_fake_copies():  # the fake copy of the model is made once
        for strategy in strategies:
            row = [strategy]
            for n in sizes:
                estimate = estimate_distributed_memory(
                    model,
                    strategy=strategy,
                    world_size=n,
                    batch=batch,
                    loss_fn=loss_fn,
                    optimizer=adamw,
                    device="cpu",
                    wrap={nn.TransformerEncoderLayer},
                )
                row.append(f"{estimate.peak_bytes / 2**30:.2f}")
                if (strategy, n) == ("model_parallel", 8):
                    shown = estimate
            rows.append(row)
        print(format_table(["strategy"] + [f"N={n}" for n in sizes], rows))
    print("\nOne estimate at N=8 under FSDP2 (fully_shard run on a fake process group of 8), by category:")
    print(shown.summary())
    for strategy in ("fsdp", "model_parallel"):
        for n in (2, 64):  # fresh estimates (no reuse): one fake step whatever the world size
            started = time.perf_counter()
            estimate_distributed_memory(
                model,
                strategy=strategy,
                world_size=n,
                batch=batch,
                loss_fn=loss_fn,
                optimizer=adamw,
                device="cpu",
                wrap={nn.TransformerEncoderLayer},
            )
            print(f"time of one fresh estimate, {strategy}, N={n}: {time.perf_counter() - started:.2f} s")


if __name__ == "__main__":
    main()
