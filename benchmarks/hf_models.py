"""Hugging Face models: the CPU estimate against the real step's absolute peak, counted independently.

GPT-2, Llama, BERT (4 layers, hidden 64, dropout off, batch 4, sequence 64, the loader's all-ones attention mask)
and Llama + peft LoRA, in 32-true, bf16-mixed and (decoders) activation checkpointing. "Real" is two real steps in
Lightning's order counted by tests/helpers/dispatch_counter.py (no code shared with memkit); the models and the step are
tests/estimate/test_hf_models.py's. Prints the markdown table of docs/will_it_fit.md.

Run: python benchmarks/hf_models.py
"""

from __future__ import annotations

import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> None:
    warnings.simplefilter("ignore")
    from lightning_memkit import estimate_memory
    from tests.estimate.test_hf_models import BATCH, HFModule, counted_real_peak

    print("| model | mode | real step (bytes) | estimate (bytes) | difference |")
    print("|---|---|---:|---:|---:|")
    for kind in ("gpt2", "llama", "bert", "lora"):
        for mode in ("baseline", "bf16", "checkpoint"):
            if mode == "checkpoint" and kind not in ("gpt2", "llama"):
                continue
            module = HFModule(kind)
            estimate = estimate_memory(module, BATCH, mode=mode, device="cpu").peak_bytes
            real = counted_real_peak(module, mode)
            print(f"| {kind} | {mode} | {real:,} | {estimate:,} | {estimate - real:+,} |", flush=True)


if __name__ == "__main__":
    main()
