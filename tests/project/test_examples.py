"""Every example in examples/ runs to the end, from a clean directory, and prints what it is for.

Each example runs as its own process (``python examples/X.py [quick options]`` with the working
directory a fresh ``tmp_path``, so nothing is written into the repository; forked from a warm
interpreter, :func:`tests.helpers.processes.run_script`), and its printed figures are read back and
checked against what can be computed: bytes by hand, files it wrote, the search's own trials.
``examples/doctor.py`` is run by tests/doctor/test_doctor.py.
"""

from __future__ import annotations

import json
import math
import os
import re

import pytest

from tests.helpers.paths import REPO_ROOT
from tests.helpers.processes import run_script

ROOT = REPO_ROOT
EXAMPLES = os.path.join(ROOT, "examples")
FLOAT32, INT64 = 4, 8
MiB = 1024**2


def run_example(name: str, args: list[str], cwd, timeout: float = 240) -> str:
    return run_script([os.path.join(EXAMPLES, name), *args], str(cwd), timeout)


def _read_text(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as handle:
        return handle.read()


def mib(text: str) -> float:
    """``'54.10 MiB'`` or ``'896.00 KiB'`` (format_bytes) in MiB."""
    value, unit = text.split()
    return float(value) * {"B": 1 / MiB, "KiB": 1 / 1024, "MiB": 1, "GiB": 1024}[unit]


# ---- one test per example ---------------------------------------------------------------------------


def test_plain_pytorch_meter(tmp_path):
    # The meter reads every live tensor of the process, so the libraries' own module-level tensors are in it
    # (torchmetrics holds a 4-byte one): counted with gc in a process that imported what the example imports.
    (tmp_path / "base.py").write_text(
        f"import sys\nsys.path.insert(0, {REPO_ROOT!r})\n"
        "import lightning_memkit\nfrom tests.helpers.live_tensors import live_tensor_bytes\n"
        "print('base', live_tensor_bytes())\n",
        encoding="utf-8",
    )
    base = int(
        re.search(r"^base (\d+)$", run_script([str(tmp_path / "base.py")], str(tmp_path), 60), flags=re.M).group(1)
    )
    output = run_example("plain_pytorch_meter.py", [], tmp_path)
    steps = re.findall(r"step (\d): peak .* \((\d+) B\), live at end .* \((\d+) B\), host RSS", output)
    assert [int(s) for s, _, _ in steps] == [0, 1, 2], output[-3000:]
    # Live at the end of a step, by hand: Linear(256, 1024) and Linear(1024, 10), their gradients,
    # Adam's two moments and one float32 step counter per parameter, and the batch (x float32, y int64).
    parameters = (256 * 1024 + 1024 + 1024 * 10 + 10) * FLOAT32
    live = base + 4 * parameters + 4 * FLOAT32 + 64 * 256 * FLOAT32 + 64 * INT64
    peaks = [int(peak) for _, peak, _ in steps]
    assert [int(end) for _, _, end in steps] == [live] * 3
    # the peak holds the step's activations on top: above the end, and the same once Adam's state exists
    assert all(peak > live for peak in peaks) and peaks[1] == peaks[2]


def test_memory_tracker(tmp_path):
    from tests.helpers.event_files import read_scalars

    output = run_example("memory_tracker.py", ["--steps", "4", "--logdir", "logs"], tmp_path)
    run_peak = re.search(r"run peak: (\d+) bytes at step (\d+)", output)
    assert run_peak, output[-3000:]
    scalars = read_scalars(str(tmp_path / "logs" / "mlp"))
    assert len(scalars["memory/train/tensor_MiB"]) == 4
    logged = [
        (value, step)
        for tag in ("memory/train/peak_tensor_MiB", "memory/val/peak_tensor_MiB")
        for step, value in scalars.get(tag, [])
    ]
    # the printed run peak is the largest peak in TensorBoard (float32 MiB there), at its step
    top_mib, top_step = max(logged)
    assert int(run_peak.group(1)) == pytest.approx(top_mib * MiB, rel=1e-6)
    assert int(run_peak.group(2)) == top_step
    with open(tmp_path / "logs" / "mlp-csv" / "version_0" / "metrics.csv", encoding="utf-8") as handle:
        assert "memory/train/peak_tensor_MiB" in handle.readline().split(",")


def test_report(tmp_path):
    output = run_example("report.py", ["out"], tmp_path)
    printed = re.search(r"run mlp/version_0: peak (\d+) bytes at step (\d+) \((\w+)\), (\d+) readings", output)
    assert printed, output[-3000:]
    with open(tmp_path / "out" / "logs" / "mlp" / "version_0" / "memkit_memory.json", encoding="utf-8") as handle:
        records = json.load(handle)
    summary = records["summary"]
    assert (int(printed.group(1)), int(printed.group(2)), printed.group(3)) == (
        summary["peak_bytes"],
        summary["peak_step"],
        summary["peak_source"],
    )
    assert summary["peak_bytes"] == max(reading["peak_tensor_bytes"] or 0 for reading in records["history"])
    assert (
        int(printed.group(4))
        == len(records["history"])
        == summary["train_steps_measured"] + summary["validation_runs_measured"]
    )
    written = [os.path.join(tmp_path, path) for path in re.findall(r"^wrote (.+)$", output, flags=re.M)]
    assert str(tmp_path / "out" / "report.html") in written and any(path.endswith(".png") for path in written)
    assert all(os.path.getsize(path) > 0 for path in written)
    assert "mlp/version_0" in _read_text(str(tmp_path / "out" / "report.html"))


def test_checkpoint_budget(tmp_path):
    output = run_example("checkpoint_budget.py", ["--steps", "1"], tmp_path)
    plan = re.search(r"checkpointed (\d+) block\(s\): (.+)", output)
    memory = re.search(
        r"activation memory: ([\d.]+ \w+) -> ([\d.]+ \w+) \(budget ([\d.]+ \w+)\); "
        r"the measuring forwards peaked at ([\d.]+ \w+)",
        output,
    )
    assert plan and memory, output[-3000:]
    names = plan.group(2).split(", ")
    assert len(names) == int(plan.group(1)) >= 1 and all(re.fullmatch(r"blocks\.\d+", name) for name in names)
    baseline, measured, budget, measuring_peak = (mib(memory.group(i)) for i in range(1, 5))
    assert budget == pytest.approx(baseline / 2, abs=0.01)  # budget=0.5 of the baseline (printed to 0.01 MiB)
    assert measured <= budget
    assert measuring_peak < baseline  # no_grad measuring forwards keep no activation


def test_quickstart(tmp_path):
    from lightning_memkit.zoo import DemoCNN

    output = run_example("quickstart.py", ["--max-batch-size", "8"], tmp_path)
    found = re.search(
        r"memkit: batch size (\d+) (?:fits|ran its steps too slowly for a larger one) .*; using (\d+)", output
    )
    chosen = re.search(r"batch size chosen: (\d+)", output)
    measured = re.search(r"training steps measured\s+(\d+)", output)
    assert found and chosen and measured, output[-3000:]
    batch = int(chosen.group(1))
    assert int(found.group(2)) == batch and 1 <= batch <= 8
    # MemoryTracker measured every training step of the fit: limit_train_batches=8 or one epoch at that batch
    assert int(measured.group(1)) == min(8, len(DemoCNN(blocks=3, batch_size=batch).train_dataloader()))
    assert re.search(r"memkit checkpointing \(auto\): \d+ region\(s\)", output), output[-3000:]
    assert re.search(r"^activations\s", output, flags=re.M), output[-3000:]  # LayerTrace's category table at step 1


def test_find_batch_size(tmp_path):
    output = run_example("find_batch_size.py", ["--budget", "24MiB"], tmp_path)
    trained = re.search(r"trained with batch size (\d+) \(budget ([\d.]+ \w+)\)", output)
    assert trained and mib(trained.group(2)) == 24, output[-3000:]
    trials = [
        (int(batch), outcome, peak)
        for batch, outcome, peak in re.findall(
            r"^\d+\s+(\d+)\s+(fits|out of memory)\s+(\S+(?: \w+)?)\s+[\d.]+s$", output, flags=re.M
        )
    ]
    fits = [(batch, peak) for batch, outcome, peak in trials if outcome == "fits"]
    assert fits, output[-3000:]
    batch, peak = max(fits)
    # the size it trained with is the largest trial that fitted, within the budget; every larger one did not fit
    assert int(trained.group(1)) == batch and mib(peak) <= 24
    assert all(outcome == "out of memory" for size, outcome, _ in trials if size > batch)
    # the 16 GiB predictions: bf16 halves the activations, so more samples fit than in fp32
    predicted = {mode: int(size) for size, mode in re.findall(r"^max batch (\d+) \((\w+)\)", output, flags=re.M)}
    assert predicted.keys() == {"baseline", "bf16"} and predicted["bf16"] > predicted["baseline"], output[-3000:]


def test_plan_fit(tmp_path):
    output = run_example("plan_fit.py", ["--steps", "2"], tmp_path, timeout=400)
    head = re.search(r"baseline: batch (\d+) needs ([\d.]+ \w+); budget ([\d.]+ \w+)", output)
    trained = re.search(r"trained (\d+) steps of (\d+) samples with micro (\d+) x (\d+)", output)
    best = re.search(r"^\* micro (\d+) x (\d+).*?\s([\d.]+ \w+)\s+[\d.]+\s+ran: (?:median )?step", output, flags=re.M)
    assert head and trained and best, output[-3000:]
    batch, budget = int(head.group(1)), mib(head.group(3))
    assert mib(head.group(2)) > budget  # the baseline does not fit the budget
    assert int(trained.group(1)) == 2 and int(trained.group(2)) == batch  # the effective batch is kept
    assert int(trained.group(3)) * int(trained.group(4)) == batch
    assert (trained.group(3), trained.group(4)) == best.groups()[:2]
    assert mib(best.group(3)) <= budget  # the chosen configuration's measured peak, in the budget
    assert int(re.search(r"; (\d) real trials?", output).group(1)) <= 3
    ran = re.search(r"^(\d+) of (\d+) candidates trained for real$", output, flags=re.M)
    assert ran and 1 <= int(ran.group(1)) <= min(3, int(ran.group(2))), output[-3000:]


def test_auto_fit(tmp_path):
    output = run_example("auto_fit.py", ["--steps", "2"], tmp_path, timeout=400)
    head = re.search(r"^batch (\d+) needs ([\d.]+ \w+); budget ([\d.]+ \w+)$", output, flags=re.M)
    applied = re.search(
        r"^AutoFit applied: micro-batch (\d+) x accumulate_grad_batches (\d+), checkpointing (\S+), offload (\w+)$",
        output,
        flags=re.M,
    )
    trained = re.search(r"^trained (\d+) steps of (\d+) samples", output, flags=re.M)
    assert head and applied and trained, output[-3000:]
    batch = int(head.group(1))
    assert mib(head.group(2)) > mib(head.group(3))  # the batch as is does not fit: something had to change
    micro, accumulation = int(applied.group(1)), int(applied.group(2))
    assert micro * accumulation == batch == int(trained.group(2)) and int(trained.group(1)) == 2
    assert (micro, applied.group(3)) != (batch, "None")  # the plan changed the micro-batch or checkpointed
    assert applied.group(4) == "False" and "ActivationOffload in the Trainer's callbacks: False (CUDA only)" in output


def test_layer_trace(tmp_path):
    from lightning_memkit.zoo import DemoCNN

    output = run_example("layer_trace.py", ["--out", "out", "--batch-size", "8"], tmp_path)
    count = re.search(r"Ψ = (\d+) parameters", output)
    assert count and int(count.group(1)) == sum(p.numel() for p in DemoCNN().parameters()), output[-3000:]
    rows = re.findall(r"^(parameters|optimizer_state|inputs)\s+[\d.]+\s+[\d.]+\s+(\d+)\s+(\d+)$", output, flags=re.M)
    lightning, plain = rows[:3], rows[-3:]
    assert {name: int(end) for name, _, end in lightning}["parameters"] == int(count.group(1)) * FLOAT32
    # the plain step by hand: Conv2d(3,16,3), two Conv2d(16,16,3), Linear(16,10); Adam's two moments and a
    # float32 step per parameter tensor (8); inputs x (8, 3, 32, 32) float32 and y (8,) int64
    parameters = ((16 * 3 * 9 + 16) + 2 * (16 * 16 * 9 + 16) + (16 * 10 + 10)) * FLOAT32
    assert {name: int(end) for name, _, end in plain} == {
        "parameters": parameters,
        "optimizer_state": 2 * parameters + 8 * FLOAT32,
        "inputs": 8 * 3 * 32 * 32 * FLOAT32 + 8 * INT64,
    }
    for written in ("layer_trace_cnn.png", "layer_trace_checkpointed.png", "plain_pytorch_trace.csv"):
        assert (tmp_path / "out" / written).stat().st_size > 0
    assert list((tmp_path / "out" / "layer_trace").glob("version_0/memkit_trace_step1.json"))


def test_compare_modes(tmp_path):
    output = run_example("compare_modes.py", ["--steps", "2", "--modes", "baseline,checkpoint"], tmp_path)
    assert "restored: True" in output, output[-3000:]  # the plain-PyTorch part undid its checkpointing
    lowest = re.search(r"lowest peak: (\S+) \(([\d.]+)x of baseline", output)
    assert lowest, output[-3000:]
    with open(tmp_path / "memkit_compare" / "compare.json", encoding="utf-8") as handle:
        modes = {mode["mode"]: mode for mode in json.load(handle)["modes"]}
    assert modes.keys() == {"baseline", "checkpoint"} and all(mode["status"] == "ok" for mode in modes.values())
    assert all(mode["steps"] == 2 for mode in modes.values())
    # checkpointing the transformer's blocks lowers its peak, and the printed line says so from the JSON
    assert modes["checkpoint"]["peak_allocated_bytes"] < modes["baseline"]["peak_allocated_bytes"]
    best = min(modes.values(), key=lambda mode: mode["peak_allocated_bytes"])
    assert lowest.group(1) == best["mode"]
    ratio = best["peak_allocated_bytes"] / modes["baseline"]["peak_allocated_bytes"]
    assert math.isclose(float(lowest.group(2)), ratio, abs_tol=0.005)


def test_distributed_estimate(tmp_path):
    output = run_example("distributed_estimate.py", ["--layers", "2"], tmp_path)
    # GPTLike's parameters by hand: embedding and head (vocab x width each), and per pre-norm encoder block
    # in_proj 3W^2+3W, out_proj W^2+W, linear1 4W^2+4W, linear2 4W^2+W, two LayerNorms 4W
    vocab, width, layers = 32_000, 2048, 2
    parameters = 2 * vocab * width + layers * (12 * width**2 + 13 * width)
    assert f"GPTLike: {parameters / 1e9:.2f}B parameters" in output, output[-3000:]
    tables = re.findall(r"^strategy\s+N=1\s+N=2\s+N=8\s+N=64\n-[- ]+\n((?:\w+(?:\s+[\d.]+){4}\n)+)", output, flags=re.M)
    assert len(tables) == 2, output[-3000:]
    states, peaks = (
        {row.split()[0]: [float(v) for v in row.split()[1:]] for row in table.splitlines()} for table in tables
    )
    # model states per rank: the ZeRO paper's 16 bytes per parameter (fp16 weights and gradients, fp32 Adam
    # copy, momentum and variance), stage 1 shards the 12 optimizer bytes, stage 2 the gradients too, stage 3 all
    zero = {
        "ddp": lambda n: 16,
        "deepspeed_stage_1": lambda n: 4 + 12 / n,
        "deepspeed_stage_2": lambda n: 2 + 14 / n,
        "deepspeed_stage_3": lambda n: 16 / n,
    }
    assert states.keys() == zero.keys()
    for strategy, per_parameter in zero.items():
        expected = [per_parameter(n) * parameters / 1e9 for n in (1, 2, 8, 64)]
        assert states[strategy] == pytest.approx(expected, abs=0.0051), strategy  # printed to 0.01 GB
    # peaks per rank: a sharded strategy needs less on more ranks, and less than DDP's replica on 2 or more
    assert peaks.keys() == {
        "ddp",
        "deepspeed_stage_1",
        "deepspeed_stage_2",
        "fsdp_shard_grad_op",
        "fsdp",
        "model_parallel",
    }
    for strategy, row in peaks.items():
        if strategy != "ddp":
            assert row == sorted(row, reverse=True) and all(row[i] < peaks["ddp"][i] for i in (1, 2, 3)), (
                strategy,
                row,
            )
    # the FSDP2 estimate shown by category is the table's N=8 cell; its fp32 parameters are an eighth of the
    # model's (shards padded to a multiple of 8 rows), Adam's two moments twice that
    shown = re.search(
        r"^parameters\s+([\d.]+ \w+)\n^optimizer_state\s+([\d.]+ \w+)\n"
        r"(?:.*\n)*?^peak per rank \(tensors\)\s+([\d.]+) GiB",
        output,
        flags=re.M,
    )
    assert shown, output[-3000:]
    assert float(shown.group(3)) == peaks["model_parallel"][2]
    assert mib(shown.group(1)) == pytest.approx(parameters * FLOAT32 / 8 / MiB, rel=1e-3)
    assert mib(shown.group(2)) == pytest.approx(2 * mib(shown.group(1)), abs=0.01)
    assert (
        len(re.findall(r"^time of one fresh estimate, (fsdp|model_parallel), N=(2|64): [\d.]+ s$", output, flags=re.M))
        == 4
    )


def test_building_blocks(tmp_path):
    output = run_example("building_blocks.py", [], tmp_path)
    assert os.listdir(tmp_path) == []  # plain PyTorch steps: nothing written

    def numbers(pattern: str) -> list[int]:
        found = re.search(pattern, output, flags=re.M)
        assert found, (pattern, output[-3000:])
        return [int(group) for group in found.groups()]

    # 1. Linear(256, 128) adopted, then a step inside the accountant: its gradients, out (32 x 128) and the loss
    linear = (256 * 128 + 128) * FLOAT32
    adopted, live, peak = numbers(r"^accountant: adopted (\d+) B, live (\d+) B, peak (\d+) B$")
    assert (adopted, live) == (linear, 2 * linear + 32 * 128 * FLOAT32 + FLOAT32) and peak > live
    # 2. the 8 KiB tensor, then the 128 x 256 input that crossed the 64 KiB budget
    assert numbers(r"^budget: (\d+) B requested over (\d+) B; is_out_of_memory: True; exceeded (\d+) time") == [
        8 * 1024 + 128 * 256 * FLOAT32,
        64 * 1024,
        1,
    ]
    # 3. SGD keeps no state: live at each step's end are the parameters, their gradients and the batch
    mlp = (256 * 512 + 512 + 512 * 10 + 10) * FLOAT32
    readings = [
        tuple(map(int, row))
        for row in re.findall(r"^reading: step (\d): peak (\d+) B, live at end (\d+) B$", output, flags=re.M)
    ]
    assert [step for step, _, _ in readings] == [0, 1, 2], output[-3000:]
    assert all(end == 2 * mlp + 32 * 256 * FLOAT32 + 32 * INT64 < peak for _, peak, end in readings)
    summary = re.search(r"^summary: peak (\d+) B at step (\d) \(peak_tensor_bytes\), 3 steps$", output, flags=re.M)
    top = max(peak for _, peak, _ in readings)
    assert summary and (int(summary.group(1)), int(summary.group(2))) == (
        top,
        next(s for s, p, _ in readings if p == top),
    )
    # 4. ReLU saves its output (32 x 512) for backward, the second Linear saves that same storage (counted once);
    # Adam's two moments per parameter and one float32 step per parameter tensor
    assert re.search(rf"^trace: 1\s+ReLU\s+forward: saved {32 * 512 * FLOAT32} B", output, flags=re.M), output[-3000:]
    assert re.search(r"^trace: 2\s+Linear\s+forward: saved 0 B", output, flags=re.M), output[-3000:]
    events, trace_peak, state, again = numbers(
        r"^trace: (\d+) events, peak (\d+) B, optimizer state at end (\d+) B; from JSON: (\d+) B$"
    )
    assert state == 2 * mlp + 4 * FLOAT32 and again == trace_peak and events >= 8
    # 5. each step keeps one 32 x 128 output: the watcher's and the doctor's growth per step, exactly
    assert numbers(r"^leak: (\d+) B per step, made by aten\.addmm") == [32 * 128 * FLOAT32]
    assert numbers(r"^doctor: healthy False, (\d+) B per step; from JSON: (\d+) B$") == [32 * 128 * FLOAT32] * 2
    # 6. the budget is half the measured baseline activations, and the chosen blocks meet it
    plan = re.search(
        r"^mode bf16\+checkpoint:budget=0\.5: autocast torch\.bfloat16; checkpointed (\d) of 6 blocks, "
        r"activations ([\d.]+ \w+) -> ([\d.]+ \w+) \(budget [\d.]+ \w+, (\d+) B\)$",
        output,
        flags=re.M,
    )
    assert plan and 1 <= int(plan.group(1)) <= 6, output[-3000:]
    assert int(plan.group(4)) == pytest.approx(mib(plan.group(2)) * MiB / 2, abs=0.01 * MiB)
    assert mib(plan.group(3)) * MiB <= int(plan.group(4))


def test_estimate_and_search(tmp_path):
    from lightning_memkit.zoo import DemoMLP

    output = run_example("estimate_and_search.py", ["--budget", "3MiB"], tmp_path)
    parameters = sum(p.numel() * p.element_size() for p in DemoMLP().parameters())
    assert f"DemoMLP: {parameters} B of parameters" in output, output[-3000:]
    # on a CPU target the fake step's peak is the real step's, byte for byte; Adam: two moments and a step per tensor
    estimate = re.search(
        r"^estimate: peak (\d+) B \(fake, .*\); measured: peak (\d+) B \(measured\); optimizer state (\d+) B$",
        output,
        flags=re.M,
    )
    tensors = len(list(DemoMLP().parameters()))
    assert estimate and estimate.group(1) == estimate.group(2), output[-3000:]
    assert int(estimate.group(3)) == 2 * parameters + tensors * FLOAT32
    # one rank of four: DDP holds everything; ZeRO-3 a quarter of the parameters (DeepSpeed pads each partition to
    # whole elements), the model gathered whole at the peak, fp32 master weights and Adam's two moments over its flat
    # partition with one step counter, and its gradient bucket of reduce_bucket_size elements allocated whole
    ranks = {
        name: tuple(map(int, rest))
        for name, *rest in re.findall(
            r"^(\w+) on 4 ranks: parameters (\d+) B, optimizer state (\d+) B, peak (\d+) B per rank$",
            output,
            flags=re.M,
        )
    }
    assert ranks.keys() == {"ddp", "deepspeed_stage_3"}, output[-3000:]
    assert ranks["ddp"][:2] == (parameters, 2 * parameters + tensors * FLOAT32)
    elements = parameters // FLOAT32
    partition = -(-elements // 4) * FLOAT32
    assert ranks["deepspeed_stage_3"][:2] == (parameters + partition, 3 * partition + FLOAT32)
    buffers = dict(re.findall(r"^deepspeed_stage_3 buffer (\w+): (\d+) B$", output, flags=re.M))
    lightning_reduce_bucket_size = 200_000_000  # DeepSpeedStrategy's default, in elements
    assert buffers == {
        "deepspeed_gradient_partition": str(partition),
        "deepspeed_gradient_buckets": str(lightning_reduce_bucket_size * FLOAT32),
    }
    assert ranks["deepspeed_stage_3"][2] > lightning_reduce_bucket_size * FLOAT32 > ranks["ddp"][2]
    # the search: the size found is the largest trial that fitted, under the budget; the fit trained with it
    trials = [
        (int(size), outcome)
        for size, outcome in re.findall(r"^trial: batch (\d+): (fits|out of memory)", output, flags=re.M)
    ]
    fitted = [
        (int(size), int(peak))
        for size, peak in re.findall(r"^trial: batch (\d+): fits, peak (\d+) B$", output, flags=re.M)
    ]
    found = re.search(
        r"^search: batch size (\d+) under (\d+) B \((\w+)\); module's batch_size (\d+)$", output, flags=re.M
    )
    assert found and fitted and int(found.group(2)) == 3 * MiB, output[-3000:]
    batch = int(found.group(1))
    assert (batch, int(found.group(4))) == (max(fitted)[0], batch) and max(fitted)[1] <= 3 * MiB
    assert all(outcome == "out of memory" for size, outcome in trials if size > batch)
    assert f"trained 2 steps with batch size {batch}" in output
    assert os.listdir(tmp_path) == []  # no logger, no checkpoint, the search's trials leave nothing


def test_worst_batch(tmp_path):
    output = run_example("worst_batch.py", ["--steps", "12"], tmp_path)
    found = dict(re.findall(r"^(padded text|bucketed text|images of varying size): (.*)$", output, flags=re.M))
    assert set(found) == {"padded text", "bucketed text", "images of varying size"}, output[-3000:]
    # the padded batch is the longest sample's length: the data's lengths are seeded, so this is computable here
    from lightning_memkit.zoo_variable import PaddedTextDataModule, VaryingImageDataModule

    longest = max(PaddedTextDataModule().train_set.lengths)
    side = max(VaryingImageDataModule().train_set.sides)
    assert found["padded text"].startswith(
        f"input_ids (16, {longest}), attention_mask (16, {longest}), labels (16,): "
        f"the worst batch of all 512 samples ({16 * longest * 16 + 16 * 8} bytes"
    )
    assert "custom batch sampler BucketBatchSampler" in found["bucketed text"]
    assert found["images of varying size"].startswith(f"batch[0] (8, 3, {side}, {side})")
    estimate = re.search(r"^estimate: peak (\d+) bytes on input_ids \(16, (\d+)\)", output, flags=re.M)
    assert estimate and int(estimate.group(2)) == longest, output[-3000:]
    predicted = re.search(r"^max batch (\d+) \(baseline\).*\nbatch: input_ids \((\d+), (\d+)\)", output, flags=re.M)
    assert predicted and predicted.group(1) == predicted.group(2) and int(predicted.group(3)) == longest
    assert "each trial trained on the worst batch of all 512 samples at its size" in output
    trained = re.search(r"^trained 12 steps with batch size (\d+)$", output, flags=re.M)
    assert trained and re.search(
        rf"^batch {trained.group(1)}: input_ids \({trained.group(1)}, {longest}\)", output, flags=re.M
    ), output[-3000:]
