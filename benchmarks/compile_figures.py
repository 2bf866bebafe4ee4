"""The figures of docs/compile.md: a compiled model's step peak against the eager program's and the estimate's,
and what activation checkpointing does compiled.

For each model (HF GPT-2 small config, a BatchNorm CNN; tests/helpers/compile_models.py), a plain training loop (AdamW /
SGD, ``zero_grad(set_to_none=True)``), step 3 (optimizer state present) measured with ``MemoryMeter`` in the
``"step"`` scope (the training state plus what the step makes, bytes):

    eager peak          the uncompiled model, the exact accountant
    compiled peak       the compiled model, the CPU allocator's events (``MemoryMeter.compiled = "keep"``)
    estimate            ``estimate_memory(uncompiled module, device="cpu")``: the eager program's
    checkpointed        both again with ``apply_checkpointing(model, "auto")``; losses compared

    python benchmarks/compile_figures.py                      # inductor (needs a C++ compiler)
    python benchmarks/compile_figures.py --backend aot_eager
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lightning_memkit import estimate_memory  # noqa: E402
from lightning_memkit.meter import MemoryMeter, training_state_tensors  # noqa: E402
from lightning_memkit.modes.checkpointing import apply_checkpointing  # noqa: E402
from tests.helpers.compile_models import CompiledCNN, CompiledGPT2  # noqa: E402


def build(name: str, compiled: bool, backend: str):
    torch.manual_seed(0)
    if name == "gpt2":
        return CompiledGPT2(compile=compiled, backend=backend, layers=4, width=128, seq_len=64, batch_size=8)
    return CompiledCNN(compile=compiled, backend=backend, batch_size=32, samples=64)


def run(name: str, compiled: bool, backend: str, checkpointed: bool, steps: int = 4) -> tuple[int, list[float]]:
    model = build(name, compiled, backend)
    handle = apply_checkpointing(model, "auto") if checkpointed else None
    optimizer = model.configure_optimizers()
    batch = next(iter(model.train_dataloader()))
    meter = MemoryMeter("cpu", tensor_accounting=True, tensor_scope="step", host=False, nvml=False)
    if compiled:
        meter.compiled = "keep"
    for step in range(steps):
        with meter.measure(step, existing=training_state_tensors(model, [optimizer], batch)):
            loss = model.training_step(batch, step)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        del loss
    meter.shutdown()
    if handle is not None:
        handle.remove()
    return meter.last.peak_tensor_bytes, model.losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--models", default="gpt2,cnn")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    for name in args.models.split(","):
        eager, eager_losses = run(name, False, args.backend, False)
        compiled, compiled_losses = run(name, True, args.backend, False)
        eager_ck, eager_ck_losses = run(name, False, args.backend, True)
        compiled_ck, compiled_ck_losses = run(name, True, args.backend, True)
        model = build(name, False, args.backend)
        estimate = estimate_memory(model, device="cpu").peak_bytes
        print(f"{name} ({args.backend}), step 3 peak, bytes:")
        print(
            f"  eager {eager:,}  compiled {compiled:,} ({compiled / eager - 1:+.1%} against eager)  "
            f"estimate (eager program) {estimate:,} ({estimate / compiled - 1:+.1%} against compiled)"
        )
        print(
            f"  checkpointed ('auto'): eager {eager_ck:,} ({eager_ck / eager - 1:+.1%})  compiled {compiled_ck:,} "
            f"({compiled_ck / compiled - 1:+.1%})"
        )
        worst = max(abs(a - b) for a, b in zip(compiled_ck_losses, eager_ck_losses, strict=True))
        worst_plain = max(abs(a - b) for a, b in zip(compiled_losses, eager_losses, strict=True))
        print(
            f"  losses: compiled+checkpointed vs eager+checkpointed max |diff| {worst:.2e}; "
            f"compiled vs eager {worst_plain:.2e}"
        )


if __name__ == "__main__":
    main()
