"""memkit's core, piece by piece, around plain PyTorch steps (no Trainer): exact bytes you can check by hand.

    python examples/building_blocks.py        # CPU, a few seconds

1. ``TensorAccountant``: the live tensor bytes of a step, exactly (what existed before is adopted).
2. ``MemoryBudget``: an out-of-memory error on any device (``BudgetExceededError``), recognised by
   ``is_out_of_memory`` like a CUDA one.
3. ``MemoryMeter`` readings (``StepReading``) folded into a ``RunSummary``; both round-trip through JSON.
4. ``LayerTracer``: one step module by module (``LayerTraceResult`` of ``TraceEvent``\\ s).
5. ``CreationRecorder`` + ``LeakWatcher``: a loop that keeps each step's output; the growth per step
   and who made it. ``DoctorSession`` does the same and returns a ``DoctorReport``.
6. ``Mode`` and ``CheckpointBudget``: bf16 autocast with activation checkpointing under a budget.

Every size printed is in bytes (B); MiB = 2**20 bytes.
"""

from __future__ import annotations

import json

import torch
from torch import nn

from lightning_memkit import (
    BudgetExceededError,
    CheckpointBudget,
    CreationRecorder,
    DoctorReport,
    DoctorSession,
    LayerTracer,
    LayerTraceResult,
    LeakWatcher,
    MemoryBudget,
    MemoryMeter,
    Mode,
    RunSummary,
    StepReading,
    TensorAccountant,
    TraceEvent,
    apply_checkpointing,
    format_bytes,
    is_out_of_memory,
    training_state_tensors,
)

BATCH, WIDTH_IN, WIDTH_OUT = 32, 256, 128


def accountant() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(WIDTH_IN, WIDTH_OUT)
    x = torch.randn(BATCH, WIDTH_IN)  # made before: not counted unless adopted
    acc = TensorAccountant()
    adopted = acc.adopt(layer.parameters())
    with acc:
        out = layer(x)
        loss = out.pow(2).sum()
        loss.backward()
    # live now: the parameters (adopted), their gradients, ``out`` and ``loss``: every byte by hand
    print(f"accountant: adopted {adopted} B, live {acc.current_bytes} B, peak {acc.peak_bytes} B")


def budget() -> None:
    layer = nn.Linear(WIDTH_IN, WIDTH_OUT)
    limit = 64 * 1024
    watchdog = MemoryBudget(limit)  # bytes of live tensors, counted as the accountant counts them
    with watchdog:
        small = torch.empty(8 * 1024, dtype=torch.uint8)  # 8 KiB: fits
        try:
            layer(torch.randn(BATCH * 4, WIDTH_IN))  # a 128 KiB input alone crosses 64 KiB
        except BudgetExceededError as error:
            print(
                f"budget: {error.requested_bytes} B requested over {error.budget_bytes} B; "
                f"is_out_of_memory: {is_out_of_memory(error)}; exceeded {watchdog.exceeded} time(s)"
            )
    del small


def readings() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH_IN, 512), nn.ReLU(), nn.Linear(512, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # tensor_scope="step": the step's own tensors and the ``existing`` ones, not the whole process's
    meter = MemoryMeter("cpu", tensor_scope="step")
    summary = RunSummary(device="cpu")
    for step in range(3):
        x, y = torch.randn(BATCH, WIDTH_IN), torch.randint(0, 10, (BATCH,))
        with meter.measure(step, existing=training_state_tensors(model, [optimizer], (x, y))):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        reading: StepReading = meter.last
        summary.update(reading)
        assert StepReading.from_dict(json.loads(json.dumps(reading.to_dict()))) == reading
        print(f"reading: step {reading.step}: peak {reading.peak_tensor_bytes} B, live at end {reading.tensor_bytes} B")
    meter.shutdown()
    assert RunSummary.from_dict(json.loads(json.dumps(summary.to_dict()))) == summary
    print(
        f"summary: peak {summary.peak_bytes} B at step {summary.peak_step} ({summary.peak_source}), "
        f"{summary.train_steps_measured} steps"
    )


def layer_tracer() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH_IN, 512), nn.ReLU(), nn.Linear(512, 10))
    optimizer = torch.optim.Adam(model.parameters())
    x, y = torch.randn(BATCH, WIDTH_IN), torch.randint(0, 10, (BATCH,))
    tracer = LayerTracer(model, [optimizer], step=0)
    tracer.start(inputs=(x, y))
    try:
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    finally:
        result: LayerTraceResult = tracer.stop()
    forwards: list[TraceEvent] = result.module_events(phase="forward")
    for event in forwards:
        print(
            f"trace: {event.module or '(root)':6} {event.module_class:10} forward: saved {event.saved_bytes} B, "
            f"live {event.live_bytes} B"
        )
    again = LayerTraceResult.from_dict(json.loads(result.to_json()))
    print(
        f"trace: {len(result.events)} events, peak {result.peak_bytes} B, "
        f"optimizer state at end {result.at_end['optimizer_state']} B; from JSON: {again.peak_bytes} B"
    )


def leaks() -> None:
    torch.manual_seed(0)
    model = nn.Linear(WIDTH_IN, WIDTH_OUT)
    kept = []  # the bug: each step's output is kept

    recorder = CreationRecorder()
    recorder.name_modules(model)
    watcher = LeakWatcher(window=3, warmup_steps=0, recorder=recorder)
    report = None
    for step in range(6):
        x = torch.randn(BATCH, WIDTH_IN)
        report = watcher.observe(step, recorder.live_bytes) or report  # at the step's start
        recorder.start(step, batch=x, module=model)
        with torch.no_grad():
            kept.append(model(x))
        recorder.stop()
    print(f"leak: {report.bytes_per_step} B per step, made by {report.survivors[0].op} in {report.survivors[0].module}")

    kept.clear()
    session = DoctorSession(model, [], window=3, warmup_steps=0, analyse_step=None)
    for step in range(6):
        x = torch.randn(BATCH, WIDTH_IN)
        session.step_start(step, x)
        with torch.no_grad():
            kept.append(model(x))
        session.step_end(step)
    session.close()
    verdict: DoctorReport = session.report()
    again = DoctorReport.from_dict(json.loads(json.dumps(verdict.to_dict())))
    print(
        f"doctor: healthy {verdict.healthy}, {verdict.leak.bytes_per_step} B per step; "
        f"from JSON: {again.leak.bytes_per_step} B"
    )


def modes() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(6)])
    x = torch.randn(BATCH, 64)
    mode = Mode(precision="bf16-mixed", checkpoint=CheckpointBudget(fraction=0.5))
    with apply_checkpointing(model, mode.checkpoint, sample=(x,)) as handle:
        plan = handle.plan
        with mode.autocast("cpu"):
            loss = model(x).float().pow(2).mean()
        loss.backward()
    print(
        f"mode {mode.name}: autocast {mode.autocast_dtype('cpu')}; checkpointed {plan.count} of 6 blocks, activations "
        f"{format_bytes(plan.baseline_activation_bytes)} -> {format_bytes(plan.measured_activation_bytes)} "
        f"(budget {format_bytes(plan.budget_bytes)}, {plan.budget_bytes} B)"
    )


if __name__ == "__main__":
    accountant()
    budget()
    readings()
    layer_tracer()
    leaks()
    modes()
