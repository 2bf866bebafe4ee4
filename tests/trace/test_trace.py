"""LayerTracer on plain PyTorch steps: exact per-layer bytes, event order, in-place ops,
modules called twice, activation checkpointing, autocast, hooks removed, outputs."""

from __future__ import annotations

import csv
import io
import itertools
import json

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils.checkpoint import checkpoint

from lightning_memkit.trace.trace_records import CSV_COLUMNS, TRACE_FORMAT, LayerTraceResult, TraceEvent, read_trace
from lightning_memkit.trace.tracer import LayerTracer, trace_step
from tests.helpers.live_tensors import describe, live_tensor_bytes, live_tensors, tensors_with_grad_fn

F32, I64, BF16 = 4, 8, 2
B, C1, C2, H = 4, 8, 16, 16  # batch, channels, image side


def make_cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, C1, 3, padding=1),
        nn.BatchNorm2d(C1),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(C1, C2, 3, padding=1),
        nn.BatchNorm2d(C2),
        nn.ReLU(),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(C2 * (H // 4) ** 2, 10),
    )


def train_step(model, optimizer, x, y):
    optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


def traced_cnn_step(**options) -> tuple[nn.Module, LayerTraceResult]:
    model = make_cnn()
    optimizer = torch.optim.Adam(model.parameters())
    x, y = torch.randn(B, 3, H, H), torch.randint(0, 10, (B,))
    train_step(model, optimizer, x, y)  # warm-up: Adam state exists
    with trace_step(model, optimizer, inputs=(x, y), step=1, **options) as tracer:
        train_step(model, optimizer, x, y)
    return model, tracer.result


def forward_event(result: LayerTraceResult, name: str, call: int = 0) -> TraceEvent:
    (event,) = [e for e in result.module_events("forward", name) if e.call == call and not e.recompute]
    return event


def test_cnn_forward_deltas_equal_analytic_bytes():
    _, result = traced_cnn_step()
    assert result.errors == []
    side2 = H // 2
    # conv: its output; batch norm (training): output + saved mean and inverse std (C floats each)
    assert forward_event(result, "0").delta_bytes == B * C1 * H * H * F32
    assert forward_event(result, "1").delta_bytes == B * C1 * H * H * F32 + 2 * C1 * F32
    assert forward_event(result, "2").delta_bytes == 0  # in-place ReLU
    # max-pool in training keeps the argmax indices, int64
    assert forward_event(result, "3").delta_bytes == B * C1 * side2 * side2 * (F32 + I64)
    assert forward_event(result, "4").delta_bytes == B * C2 * side2 * side2 * F32
    assert forward_event(result, "5").delta_bytes == B * C2 * side2 * side2 * F32 + 2 * C2 * F32
    assert forward_event(result, "6").delta_bytes == B * C2 * side2 * side2 * F32  # out-of-place ReLU
    assert forward_event(result, "7").delta_bytes == B * C2 * (H // 4) ** 2 * F32  # avg-pool: no indices
    assert forward_event(result, "8").delta_bytes == 0  # flatten is a view
    assert forward_event(result, "9").delta_bytes == B * 10 * F32
    assert forward_event(result, "9").shapes == [[B, 10]] and forward_event(result, "9").dtypes == ["float32"]


def test_saved_for_backward_bytes_per_layer():
    _, result = traced_cnn_step()
    side2 = H // 2
    saved = result.saved_bytes_by_module()
    assert saved["0"] == 0  # conv 0 saves the batch (an input) and its weight (a parameter)
    assert saved["1"] == B * C1 * H * H * F32 + 2 * C1 * F32  # conv output + saved statistics
    assert saved["2"] == B * C1 * H * H * F32  # in-place ReLU saves its result (the BN output)
    assert saved["3"] == B * C1 * side2 * side2 * I64  # indices; its input was saved by ReLU
    assert saved["4"] == B * C1 * side2 * side2 * F32  # the pooled input
    assert saved["5"] == B * C2 * side2 * side2 * F32 + 2 * C2 * F32
    assert saved["6"] == B * C2 * side2 * side2 * F32
    assert saved["7"] == 0  # avg-pool saves nothing it did not already
    assert saved["9"] == B * C2 * (H // 4) ** 2 * F32  # Linear's input (the flattened pool output)
    assert saved[""] == sum(v for k, v in saved.items() if k)  # the root is credited its children's


def test_event_order_forward_then_backward_then_optimizer():
    model, result = traced_cnn_step()
    phases = [e.phase for e in result.events]
    assert phases[0] == "step-start" and phases[-1] == "step-end"
    last_forward = max(i for i, p in enumerate(phases) if p == "forward")
    first_backward = min(i for i, p in enumerate(phases) if p in ("pre-backward", "backward"))
    assert last_forward < first_backward < phases.index("backward-end") < phases.index("optimizer-step")
    names = [n for n, _ in model.named_modules()]
    for name in names:  # each module: exactly one event per phase, in phase order
        events = result.module_events(module=name)
        assert [e.phase for e in events] == ["pre-forward", "forward", "pre-backward", "backward"], name
    # backward runs layers in reverse: the Linear's gradient is ready before the first conv's
    pre_bw = [e.module for e in result.module_events("pre-backward") if e.module]
    assert pre_bw == [str(i) for i in reversed(range(10))]
    # live bytes chain: every delta is the difference of consecutive live values
    for previous, event in itertools.pairwise(result.events):
        assert event.delta_bytes == event.live_bytes - previous.live_bytes
        assert event.peak_bytes >= event.live_bytes
    assert result.events[result.peak_event_index].peak_bytes == result.peak_bytes
    assert result.at_peak.total_bytes == result.peak_bytes
    assert result.at_end.total_bytes == result.end_bytes


def test_in_place_relu_traced_and_gradients_unchanged():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 2)
    )
    x = torch.randn(5, 8)
    model(x).pow(2).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with trace_step(model) as tracer:
        model(x).pow(2).sum().backward()
    assert tracer.result.errors == []
    for parameter, grad in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(parameter.grad, grad, rtol=0, atol=0)
    for name in ("1", "3"):
        assert [e.phase for e in tracer.result.module_events(module=name)] == [
            "pre-forward",
            "forward",
            "pre-backward",
            "backward",
        ]


def test_full_backward_hooks_break_in_place_relu_which_is_why_the_tracer_uses_gradient_hooks():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True))
    model[0].register_full_backward_hook(lambda *args: None)
    with pytest.raises(RuntimeError, match="inplace|in-place"):
        model(torch.randn(2, 8)).sum().backward()


class Twice(nn.Module):
    """One Linear applied twice (weight sharing), then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(6, 6)
        self.head = nn.Linear(6, 1)

    def forward(self, x):
        return self.head(self.shared(self.shared(x).relu()))


def test_module_called_twice_is_traced_per_call():
    model = Twice()
    x = torch.randn(3, 6)
    with trace_step(model) as tracer:
        model(x).sum().backward()
    result = tracer.result
    forward = result.module_events("forward", "shared")
    assert [e.call for e in forward] == [0, 1]
    assert [e.delta_bytes for e in forward] == [3 * 6 * F32, 3 * 6 * F32]
    backward = result.module_events("backward", "shared")
    pre_backward = result.module_events("pre-backward", "shared")
    assert sorted(e.call for e in backward) == [0, 1] and sorted(e.call for e in pre_backward) == [0, 1]
    assert [e.call for e in pre_backward] == [1, 0]  # autograd reaches the second call first
    table = result.format_table()
    assert "shared (Linear) #1" in table


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU())

    def forward(self, x):
        return self.body(x)


class CheckpointWrapper(nn.Module):
    """Runs ``inner`` under non-reentrant activation checkpointing."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=False)


class Checkpointed(nn.Module):
    """``stem -> block -> head``; with ``use_checkpoint`` the block is checkpointed (non-reentrant)."""

    def __init__(self, width: int = 16, use_checkpoint: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(width, width)
        self.block = CheckpointWrapper(Block(width)) if use_checkpoint else Block(width)
        self.head = nn.Linear(width, 2)

    def forward(self, x):
        return self.head(self.block(self.stem(x)))


def test_checkpointed_block_saves_only_its_boundary_and_recomputes_in_backward():
    rows, width = 10, 16
    x = torch.randn(rows, width)
    results = {}
    for use_checkpoint in (False, True):
        model = Checkpointed(width, use_checkpoint)
        with trace_step(model, inputs=x) as tracer:
            model(x).sum().backward()
        results[use_checkpoint] = tracer.result
    activation = rows * width * F32
    plain = results[False].saved_bytes_by_module()
    # the block's first Linear saves its input (the stem output), each ReLU its output (the
    # second Linear's input is the first ReLU's output, already saved); the head saves the
    # block's output, which the last ReLU saved first
    assert plain["block"] == 3 * activation and plain["head"] == 0 and plain[""] == 3 * activation
    checkpointed = results[True].saved_bytes_by_module()
    assert checkpointed["block.inner"] == 0  # nothing inside the checkpointed block is kept
    assert checkpointed["block"] == activation  # checkpoint keeps the block's input, the boundary
    assert checkpointed["head"] == activation  # and the head keeps the block's output
    assert checkpointed[""] == 2 * activation
    result = results[True]
    recomputed = [e for e in result.events if e.recompute]
    assert {e.phase for e in recomputed} == {"pre-forward", "forward"}
    assert {e.module for e in recomputed} == {
        "block.inner",
        "block.inner.body",
        "block.inner.body.0",
        "block.inner.body.1",
        "block.inner.body.2",
        "block.inner.body.3",
    }
    first_backward = min(e.index for e in result.events if e.phase == "pre-backward")
    assert all(e.index > first_backward for e in recomputed)
    # recomputation allocates the block's activations again, during backward
    leaves = [e for e in recomputed if e.phase == "forward" and e.module.startswith("block.inner.body.")]
    assert [e.delta_bytes for e in leaves] == [activation] * 4
    assert "forward (recompute)" in result.format_table()
    # at the end of forward the plain block holds 3 activations, the checkpointed one 2 (in and out)
    live_after_forward = {k: r.module_events("forward", "")[0].live_bytes for k, r in results.items()}
    assert live_after_forward[False] - live_after_forward[True] == activation


def test_recomputed_activations_are_their_own_category_at_the_peak():
    rows, width = 512, 16  # activations dominate, so the peak is during recomputation
    x = torch.randn(rows, width)
    model = Checkpointed(width, use_checkpoint=True)
    with trace_step(model, inputs=x) as tracer:
        model(x).sum().backward()
    result = tracer.result
    activation = rows * width * F32
    peak_event = result.events[result.peak_event_index]
    assert peak_event.recompute and peak_event.module == "block.inner.body.3"
    # at the allocation of the last ReLU's output during recomputation: the first ReLU's output,
    # the second Linear's output (still in Sequential.forward's hands) and that new output
    assert result.at_peak["recomputed"] == 3 * activation
    assert result.at_peak["activations"] == activation  # the boundary tensor checkpoint saved
    assert result.at_end["recomputed"] == 0


class FunctionalBlock(nn.Module):
    """Two tanh layers written functionally: no submodules, so no module hooks inside."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.w2 = nn.Parameter(torch.randn(width, width) / width**0.5)

    def forward(self, x):
        return torch.tanh(torch.tanh(x @ self.w1) @ self.w2)


def test_recomputation_that_bypasses_module_hooks_is_still_recomputed():
    # ActivationCheckpointing-style wrapping: an instance forward checkpointing the class's forward,
    # so recomputation calls FunctionalBlock.forward directly and no module hook fires
    torch.manual_seed(0)
    rows, width = 512, 16
    block = FunctionalBlock(width)
    block.forward = lambda x: checkpoint(FunctionalBlock.forward, block, x, use_reentrant=False)
    model = nn.Sequential(nn.Linear(width, width), block, nn.Linear(width, 2))
    x = torch.randn(rows, width)
    with trace_step(model, inputs=x) as tracer:
        model(x).sum().backward()
    result = tracer.result
    activation = rows * width * F32
    assert not [e for e in result.events if e.recompute]
    assert result.saved_bytes_by_module()["1"] == activation  # the block's input, its boundary
    # the peak is the recomputation's last tanh: first tanh output, second matmul output, new output
    assert result.at_peak["recomputed"] == 3 * activation
    assert result.at_peak["activations"] == activation


def test_autocast_weight_copies_are_their_own_category():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    x = torch.randn(4, 32)
    # the trace ends inside autocast: its weight cache is alive
    with torch.autocast("cpu", dtype=torch.bfloat16), trace_step(model, inputs=x) as tracer:
        out = model(x)
    result = tracer.result
    assert result.errors == [] and out.dtype == torch.bfloat16
    # the first Linear's forward: bf16 copies of weight, bias and input, then its bf16 output
    assert forward_event(result, "0").delta_bytes == (32 * 64 + 64 + 4 * 32 + 4 * 64) * BF16
    assert forward_event(result, "2").delta_bytes == (64 * 8 + 8 + 4 * 8) * BF16
    # every parameter's bf16 copy is cached until autocast exits, and shows as what it is
    assert result.at_end["autocast_weight_copies"] == (32 * 64 + 64 + 64 * 8 + 8) * BF16
    assert result.at_end["parameters"] == (32 * 64 + 64 + 64 * 8 + 8) * F32


def test_autocast_copies_are_freed_when_autocast_exits():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    x = torch.randn(4, 32)
    with trace_step(model, inputs=x) as tracer:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        out.float().sum().backward()
    # autograd kept only what backward needs (the second weight's copy, freed as its node ran)
    assert tracer.result.at_end["autocast_weight_copies"] == 0
    assert tracer.result.at_end["gradients"] == (32 * 64 + 64 + 64 * 8 + 8) * F32


def test_hooks_and_modes_are_removed_after_the_step():
    model = make_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(B, 3, H, H), torch.randint(0, 10, (B,))
    with trace_step(model, optimizer) as tracer:
        train_step(model, optimizer, x, y)
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
    for parameter in model.parameters():
        assert not parameter._post_accumulate_grad_hooks
    assert not optimizer._optimizer_step_post_hooks
    assert _get_current_dispatch_mode() is None
    events = len(tracer.result.events)
    train_step(model, optimizer, x, y)  # a later step adds nothing
    assert len(tracer.result.events) == events


def test_a_failing_step_still_removes_everything():
    model = make_cnn()
    # the step fails inside the trace: the raise in the block is what is tested
    with pytest.raises(ValueError, match="boom"), trace_step(model) as tracer:  # noqa: PT012
        model(torch.randn(B, 3, H, H))
        raise ValueError("boom")
    assert tracer.result is not None
    assert all(not m._forward_hooks for m in model.modules())
    assert _get_current_dispatch_mode() is None


def test_a_traced_step_keeps_nothing_alive_and_a_kept_tracer_holds_no_tensor():
    """Counted with gc over the whole process, not with memkit's accountant."""
    empty = live_tensor_bytes()
    model = make_cnn()
    optimizer = torch.optim.Adam(model.parameters())
    x, y = torch.randn(B, 3, H, H), torch.randint(0, 10, (B,))
    train_step(model, optimizer, x, y)  # warm-up: Adam's state exists
    state = live_tensor_bytes() - empty  # parameters, buffers, gradients, Adam's state, the batch
    assert state > 0
    with trace_step(model, optimizer, inputs=(x, y), step=1) as tracer:
        train_step(model, optimizer, x, y)
    # the traced step leaves what an untraced one leaves: the same state, no graph
    assert tensors_with_grad_fn() == [], describe(tensors_with_grad_fn())
    assert live_tensor_bytes() - empty == state
    result = tracer.result
    assert result.at_end.total_bytes == state  # the tracer's exact reading agrees with gc's count
    # the user keeps the tracer (to read its result) and drops the model: nothing of the model stays
    del model, optimizer, x, y
    assert live_tensor_bytes() == empty, describe(live_tensors())
    assert tracer.model is None and tracer.result is result and "1 (BatchNorm2d)" in result.format_table()
    with pytest.raises(RuntimeError, match="one step"):
        tracer.start()


def test_a_failing_traced_step_keeps_nothing_alive():
    empty = live_tensor_bytes()
    model = make_cnn()
    # the step fails inside the trace, leaving its graph: the raise in the block is what is tested
    with pytest.raises(ValueError, match="boom"), trace_step(model, inputs=torch.randn(B, 3, H, H)) as tracer:  # noqa: PT012
        model(tracer_input := torch.randn(B, 3, H, H)).sum()  # a graph, abandoned by the failure
        raise ValueError("boom")
    del tracer_input
    assert tensors_with_grad_fn() == [], describe(tensors_with_grad_fn())
    del model
    assert live_tensor_bytes() == empty, describe(live_tensors())
    assert tracer.result.events


def test_max_depth_and_module_filters():
    _, shallow = traced_cnn_step(max_depth=0)
    assert {e.module for e in shallow.module_events()} == {""}
    _, convs = traced_cnn_step(modules=[nn.Conv2d])
    assert {e.module for e in convs.module_events()} == {"0", "4"}
    _, named = traced_cnn_step(modules=["9"])
    assert {e.module for e in named.module_events()} == {"9"}


def test_bad_arguments_say_what_to_do():
    with pytest.raises(ValueError, match="max_depth"):
        LayerTracer(make_cnn(), max_depth=-1)
    with pytest.raises(ValueError, match="selects no module"):
        LayerTracer(make_cnn(), modules=["decoder.*"])
    with pytest.raises(TypeError, match="nn.Module"):
        LayerTracer(lambda x: x)
    tracer = LayerTracer(make_cnn())
    with pytest.raises(RuntimeError, match="before start"):
        tracer.stop()


def test_json_and_csv_round_trip(tmp_path):
    _, result = traced_cnn_step()
    path = tmp_path / "trace.json"
    text = result.to_json(path)
    data = json.loads(text)
    assert data["format"] == TRACE_FORMAT
    assert data["categories"][0] == "parameters"
    assert read_trace(path) == result
    with pytest.raises(ValueError, match="not a memkit layer trace"):
        LayerTraceResult.from_dict({"format": "something/else"})
    rows = list(csv.DictReader(io.StringIO(result.to_csv())))
    assert list(rows[0]) == CSV_COLUMNS
    assert len(rows) == len(result.events)
    conv = next(r for r in rows if r["module"] == "0" and r["phase"] == "forward")
    assert conv["shapes"] == f"{B}x{C1}x{H}x{H}" and int(conv["delta_bytes"]) == B * C1 * H * H * F32


def test_table_figure_and_metrics(tmp_path):
    _, result = traced_cnn_step()
    table = result.format_table()
    lines = table.splitlines()
    assert lines[1].split() == ["module", "phase", "delta", "MiB", "live", "MiB", "saved", "MiB", "shape"]
    conv_line = next(line for line in lines if line.startswith("  0 (Conv2d)") and " forward " in line)
    assert f"+{B * C1 * H * H * F32 / 2**20:.3f}" in conv_line and f"({B}, {C1}, {H}, {H}) float32" in conv_line
    assert "<- peak" in table and "[backward-end]" in table
    categories = result.format_categories()
    assert "optimizer_state" in categories and str(result.at_end["optimizer_state"]) in categories
    figure = result.figure()
    ax = figure.axes[0]
    assert "MiB" in ax.get_ylabel() and "event index" in ax.get_xlabel()
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(label.startswith("forward") for label in labels) and any(
        label.startswith("backward") for label in labels
    )
    assert "layer trace" in figure._suptitle.get_text()
    figure.savefig(tmp_path / "trace.png")
    assert (tmp_path / "trace.png").stat().st_size > 1000
    metrics = result.metrics()
    assert metrics["memory/trace/peak_MiB"] == result.peak_bytes / 2**20
    assert metrics["memory/trace/end/optimizer_state_MiB"] == result.at_end["optimizer_state"] / 2**20


def test_table_says_a_small_saved_size_is_small_not_zero():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    x = torch.randn(4, 8)
    with trace_step(model, inputs=(x,), step=0) as tracer:
        model(x).sum().backward()
    relu = next(e for e in tracer.result.events if e.module == "1" and e.phase == "forward")
    assert relu.saved_bytes == 4 * 16 * 4  # ReLU keeps its fp32 output: 256 bytes
    line = next(
        line
        for line in tracer.result.format_table().splitlines()
        if line.strip().startswith("1 (ReLU)") and " forward" in line
    )
    assert "<0.001" in line.split("forward", 1)[1] and "0.000" not in line
