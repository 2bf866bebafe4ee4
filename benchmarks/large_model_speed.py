"""What an estimate of a 7B or 70B model costs, against a bare fake step of the same model, side by side in one run.

    python benchmarks/large_model_speed.py              # 7B and 70B, 3 rounds
    python benchmarks/large_model_speed.py --shapes 7b --rounds 1

Per shape (Llama-2-7B: 32 layers, MHA; Llama-2-70B: 80 layers, GQA with 8 KV heads; a full fine-tune in bf16-mixed,
sequence 2048, batch 1, AdamW, an H100 target), each in a fresh Python process, the model built on the meta device
before the clock starts:

- **bare**: a ``FakeTensorMode`` forward, backward and ``AdamW`` step of the model (``torch.autocast`` bf16), no
  memkit: the floor any estimate on fake tensors pays;
- **one device**: ``estimate_memory(module, 1, mode="bf16", device="cuda", gpu="h100")``;
- **8 ranks**: ``estimate_distributed_memory(..., strategy="fsdp", world_size=8)`` (one rank role answers for all 8);

and the ``memkit estimate`` command line, wall time and peak host memory (GNU time's maximum resident set): one mode
that does not fit 80 GiB (every figure, and each other mode's need at batch 1), a max-batch answer over three modes
of a LoRA fine-tune, and ``--strategy fsdp --world-size 8 --wrap LlamaDecoderLayer`` (FSDP's units: without
``--wrap`` the whole model is one unit). The rounds alternate, so a busy machine
slows them alike; the table gives the medians and the ratios to the bare step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

#: the module the command lines build (Llama-shaped fine-tuning, tests' helpers)
MODULE = "tests/helpers/llama_shapes.py:LlamaFineTune"

#: one measurement, run in a fresh process: prints {"seconds": ...}
PROBE = r"""
import json, sys, time, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, ".")
import torch
from tests.helpers.llama_shapes import LlamaFineTune, llama_config
kind, shape = sys.argv[1], sys.argv[2]
with torch.device("meta"):
    module = LlamaFineTune(shape)
if kind == "bare":
    import transformers
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        model = transformers.LlamaForCausalLM(llama_config(shape))
        ids = torch.randint(0, 32000, (1, 2048))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        started = time.perf_counter()
        for _ in range(2):  # as the estimate runs two steps (the second is the steady state)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        seconds = time.perf_counter() - started
else:
    from lightning_memkit.estimate import estimate_memory, estimate_distributed_memory
    started = time.perf_counter()
    if kind == "one device":
        estimate_memory(module, 1, mode="bf16", device="cuda", gpu="h100")
    else:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer
        estimate_distributed_memory(module, 1, strategy="fsdp", world_size=8, wrap={LlamaDecoderLayer}, mode="bf16",
                                    device="cuda", gpu="h100")
    seconds = time.perf_counter() - started
print(json.dumps({"seconds": seconds}))
"""

COMMANDS = {
    "one mode (bf16, does not fit 80 GiB: every figure)": ({}, ["--modes", "bf16", "--device-memory", "80GiB"]),
    "max batch, 3 modes (LoRA)": (
        {"lora": True},
        ["--modes", "bf16,bf16+checkpoint,bf16-true+checkpoint", "--device-memory", "80GiB"],
    ),
    "--strategy fsdp --world-size 8 --wrap LlamaDecoderLayer": (
        {},
        ["--modes", "bf16", "--strategy", "fsdp", "--world-size", "8", "--wrap", "LlamaDecoderLayer"]
        + ["--device-memory", "80GiB"],
    ),
}


def _probe(kind: str, shape: str) -> float:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, kind, shape], cwd=ROOT, capture_output=True, text=True, timeout=1800
    )
    if done.returncode:
        raise SystemExit(f"{kind} {shape} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["seconds"]


def _command(init_args: dict, arguments: list[str], shape: str) -> tuple[float, int]:
    """Wall seconds and peak host memory (bytes: GNU time's maximum resident set) of one memkit estimate."""
    started = time.perf_counter()
    init = json.dumps({"shape": shape, **init_args})
    memkit = os.path.join(os.path.dirname(sys.executable), "memkit")
    done = subprocess.run(
        [
            "/usr/bin/time",
            "-f",
            "MAXRSS %M",
            memkit,
            "estimate",
            MODULE,
            "--init-args",
            init,
            "--meta-init",
            "--gpu",
            "h100",
            *arguments,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    seconds = time.perf_counter() - started
    if done.returncode not in (0, 1):
        raise SystemExit(f"memkit estimate {arguments} failed:\n{done.stderr[-3000:]}")
    peak_kib = int(next(line for line in done.stderr.splitlines() if line.startswith("MAXRSS ")).split()[1])
    return seconds, peak_kib * 1024


def main() -> None:
    from provenance import provenance_line

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="7b,70b")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(provenance_line())
    print(f"# load average at the start {os.getloadavg()[0]:.1f}")
    kinds = ("bare", "one device", "8 ranks")
    for shape in args.shapes.split(","):
        times: dict[str, list[float]] = {k: [] for k in (*kinds, *COMMANDS)}
        peaks: dict[str, int] = {}
        for round_ in range(args.rounds):
            order = list(kinds) if round_ % 2 == 0 else list(reversed(kinds))
            for kind in order:
                times[kind].append(_probe(kind, shape))
            for name, (init_args, arguments) in COMMANDS.items():
                seconds, peak = _command(init_args, arguments, shape)
                times[name].append(seconds)
                peaks[name] = peak
            print(
                f"# {shape} round {round_ + 1}: " + ", ".join(f"{k} {v[-1]:.1f} s" for k, v in times.items()),
                flush=True,
            )
        bare = statistics.median(times["bare"])
        print(f"\n| {shape} (median of {args.rounds} rounds) | seconds | / bare fake step | peak host memory |")
        print("|---|---:|---:|---:|")
        for name, values in times.items():
            median = statistics.median(values)
            memory = f"{peaks[name] / 2**30:.2f} GiB" if name in peaks else "-"
            print(f"| {name} | {median:.1f} | {median / bare:.2f} | {memory} |", flush=True)
    print(f"\n# load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
