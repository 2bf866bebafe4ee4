"""The CUDA-target estimate against real H100 memory (tests/data/gpu_truth), and each row of the CUDA
kernel table (lightning_memkit/estimate/cuda/kernels.py) pinned against the recorded allocator traces."""

from __future__ import annotations

import collections
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_memkit.accounting.accountant import TensorAccountant
from lightning_memkit.estimate import estimate_memory
from lightning_memkit.estimate.cuda.attention import attention_backend
from lightning_memkit.estimate.cuda.gpu_target import GpuTarget, conv_workspace_bytes, cublas_workspace_bytes
from lightning_memkit.estimate.cuda.kernels import KERNEL_TABLE, CudaKernels
from lightning_memkit.estimate.fake.session import FakeSession
from lightning_memkit.units import MiB
from tests.helpers.gpu_truth import MODES, load_trace, make_model, truth_rows


def _row_id(row):
    return f"{row['model']}-b{row['batch_size']}-{row['precision']}"


# cuDNN picks its algorithms (and workspaces) per dtype: on the H100 the fp16 run of ResNetish at batch 128
# reserved 11% less than the bf16 run with the same tensors; the model gives both the bf16 figure.
_KNOWN_HIGH = {
    ("ResNetish", 128, "16-mixed"): "reserved +17%: cuDNN chose smaller fp16 workspaces than the bf16 ones modelled"
}


@pytest.mark.parametrize("row", truth_rows(), ids=_row_id)
def test_cuda_estimate_matches_the_recorded_h100_peaks(row):
    module = make_model(row["model"], row["batch_size"])
    estimate = estimate_memory(module, mode=MODES[row["precision"]], device="cuda", gpu="h100")
    allocated = estimate.cuda.peak_allocated_bytes / row["peak_allocated_bytes"] - 1
    reserved = estimate.cuda.peak_reserved_bytes / row["peak_reserved_bytes"] - 1
    # the estimate achieves -0.32%..+0.41% on these rows (this torch, 2.13); a broken kernel or allocator rule moves
    # a row by more (e.g. splitting cached blocks without the >1 MiB rule: -0.75% and -0.89% on the ResNetish rows)
    assert abs(allocated) <= 0.005, f"peak allocated {allocated:+.2%} of the H100's"
    known = _KNOWN_HIGH.get((row["model"], row["batch_size"], row["precision"]))
    if known and reserved > 0.15:
        pytest.xfail(known)
    assert -0.05 <= reserved <= 0.15, f"peak reserved {reserved:+.1%} of the H100's"


# ---------------------------------------------------------------------------------------- kernel table
def _fake_allocations(run, precision=None, gpu="h100", autocast=None):
    """Bytes of every storage ``run(session)`` allocates on fakes under the CUDA kernels, in order."""
    session = FakeSession()
    accountant = TensorAccountant()
    sizes: list[int] = []
    accountant.add_storage_listener(lambda record: sizes.append(record.nbytes), None)
    kernels = CudaKernels(gpu, precision)
    with session.active():
        made = run(session)  # inputs, made outside the accountant
        with accountant, kernels.active():
            if autocast is not None:
                with torch.autocast("cpu", dtype=autocast):
                    result = made()
            else:
                result = made()
    return sizes, kernels, result


def _trace_sizes(name, frame_part, forward_only=True):
    """Sizes allocated in the trace under frames whose innermost frame contains ``frame_part``, by frame."""
    by_frame = collections.defaultdict(list)
    for event in load_trace(name)["events"]:
        if event["action"] == "alloc" and event["frames"] and frame_part in event["frames"][0]:
            by_frame[event["frames"][0]].append(event["size"])
    return by_frame


def _sdpa_frame_sizes(name, lse_bytes):
    """The sizes allocated at the one MultiheadAttention line that allocates the logsumexp (the sdpa call)."""
    frames = [sizes for sizes in _trace_sizes(name, "multi_head_attention_forward").values() if lse_bytes in sizes]
    assert len(frames) == 1
    return frames[0]


def _qkv(session, dtype, shape=(8, 12, 512, 64)):
    return [torch.empty(shape, dtype=dtype, requires_grad=True) for _ in range(3)]


def test_the_table_documents_every_choice():
    assert len(KERNEL_TABLE) >= 9
    for row in KERNEL_TABLE:
        assert row.op and row.when and row.cuda_allocates and row.evidence


def test_attention_backend_follows_dtype_mask_head_dim_and_gpu_generation():
    q32, q16, qbf = (
        torch.empty(2, 4, 16, 64, dtype=d, device="meta") for d in (torch.float32, torch.float16, torch.bfloat16)
    )
    h100, v100, t4 = GpuTarget.parse("h100"), GpuTarget.parse("v100"), GpuTarget.parse("sm75")
    assert attention_backend(q32, q32, q32, None, 0.1, h100) == "efficient"
    assert attention_backend(qbf, qbf, qbf, None, 0.1, h100) == "flash"
    assert (
        attention_backend(q16, q16, q16, torch.empty(16, 16, device="meta"), 0.1, h100) == "efficient"
    )  # a mask: no flash
    assert attention_backend(q16, q16, q16, None, 0.1, t4) == "efficient"  # flash needs sm80+
    assert attention_backend(qbf, qbf, qbf, None, 0.1, GpuTarget.parse("a100")) == "flash"  # sm80 is enough
    assert attention_backend(qbf, qbf, qbf, None, 0.1, v100) == "math"  # bf16 needs sm80+
    odd = torch.empty(2, 4, 16, 30, dtype=torch.bfloat16, device="meta")
    assert attention_backend(odd, odd, odd, None, 0.0, h100) == "flash"  # torch pads the head dim to 8 for flash
    assert GpuTarget.parse("sm90") == GpuTarget.parse("9.0") == GpuTarget("sm90", (9, 0)) and GpuTarget.parse(
        "A100"
    ).capability == (8, 0)
    with pytest.raises(ValueError, match="unknown GPU 'k80x'.*compute capability"):
        GpuTarget.parse("k80x")


def test_efficient_attention_allocates_what_the_fp32_trace_shows():
    sizes, kernels, _ = _fake_allocations(
        lambda s: functools.partial(F.scaled_dot_product_attention, *_qkv(s, torch.float32), dropout_p=0.1)
    )
    assert "attention:efficient" in kernels.used
    traced = _sdpa_frame_sizes("BertLike_b8_32-true", 8 * 12 * 512 * 4)
    assert sorted(set(traced)) == [196608, 12582912]  # output and logsumexp, no L x L tensor
    assert sorted({s for s in sizes if s >= 512}) == sorted(set(traced))  # the fake's host philox scalars aside


def test_flash_attention_allocates_what_the_bf16_trace_shows():
    sizes, kernels, _ = _fake_allocations(
        lambda s: functools.partial(F.scaled_dot_product_attention, *_qkv(s, torch.bfloat16), dropout_p=0.1)
    )
    assert "attention:flash" in kernels.used
    traced = _sdpa_frame_sizes("BertLike_b8_bf16-mixed", 8 * 12 * 512 * 4)
    big = lambda values: sorted({v for v in values if v >= 512})  # noqa: E731
    assert big(traced) == big(sizes) == [196608, 6291456]
    per_call = traced.count(196608)
    assert (
        sum(v < 512 for v in traced) == 3 * per_call and sum(0 < v < 512 for v in sizes) == 2
    )  # seed + offset (+ a transient)


def test_fused_dropout_keeps_a_bool_mask_as_the_trace_shows():
    sizes, kernels, _ = _fake_allocations(lambda s: functools.partial(F.dropout, torch.empty(8, 512, 768), 0.1, True))
    assert sorted(sizes) == [3145728, 12582912]  # output, and a 1-byte-per-element mask
    traced = [size for sizes_ in _trace_sizes("BertLike_b8_32-true", "dropout@functional").values() for size in sizes_]
    assert traced.count(3145728) == 2 * 12 * 2  # the two (8, 512, 768) dropouts of 12 layers, 2 steps: bool masks


def test_linear_on_a_strided_input_adds_its_bias_in_place():
    def run(session):
        x = torch.empty(8, 512, 768).transpose(0, 1)
        weight, bias = torch.empty(2304, 768, requires_grad=True), torch.empty(2304, requires_grad=True)
        return lambda: F.linear(x, weight, bias)

    sizes, _, _ = _fake_allocations(run)
    assert [s for s in sizes if s != 32 * MiB] == [12582912, 37748736]  # the copied input and one output (cuBLAS aside)
    traced = next(v for k, v in _trace_sizes("BertLike_b8_32-true", "_in_projection_packed").items() if 33554432 in v)
    assert collections.Counter(traced)[37748736] == collections.Counter(traced)[12582912]  # one output per copied input


def test_cross_entropy_under_autocast_as_cuda_runs_it():
    def run(session):
        logits = torch.empty(4096, 30522, dtype=torch.bfloat16, requires_grad=True)
        target = torch.empty(4096, dtype=torch.long)
        return lambda: F.cross_entropy(logits, target)

    sizes, kernels, loss = _fake_allocations(run, autocast=torch.bfloat16)
    assert "cross_entropy:autocast" in kernels.used and loss.dtype == torch.float32
    assert sorted(s for s in sizes if s > 512) == [250036224, 500072448]  # bf16 log-probs, their fp32 copy
    traced = [
        size
        for sizes_ in _trace_sizes("BertLike_b8_bf16-mixed", "cross_entropy@functional").values()
        for size in sizes_
    ]
    assert sorted({s for s in traced if s > 512}) == [250036224, 500072448]


def test_layer_norm_under_autocast_runs_in_fp32_as_cuda_runs_it():
    """CUDA's autocast lists layer_norm as fp32: a bf16 input is copied to fp32 and the output is fp32
    (CPU autocast, which the fake step runs, leaves a bf16 input in bf16)."""
    shape = (8, 512, 768)

    def run(session):
        x = torch.empty(shape, dtype=torch.bfloat16, requires_grad=True)
        weight, bias = torch.empty(shape[-1], requires_grad=True), torch.empty(shape[-1], requires_grad=True)
        return lambda: F.layer_norm(x, shape[-1:], weight, bias)

    sizes, kernels, out = _fake_allocations(run, autocast=torch.bfloat16)
    elements = shape[0] * shape[1] * shape[2]
    assert out.dtype == torch.float32
    assert sorted(sizes) == sorted(
        [4 * elements, 4 * elements, 4 * shape[0] * shape[1], 4 * shape[0] * shape[1]]
    )  # input copy, output, mean, rstd


def test_cublas_workspaces_one_per_thread_kept_as_the_traces_show():
    assert (
        cublas_workspace_bytes(GpuTarget.parse("h100")) == 32 * MiB
        and cublas_workspace_bytes(GpuTarget.parse("a100")) == 8 * MiB + 128 * 1024
    )

    def run(session):
        layer = nn.Linear(64, 64)
        layer.weight, layer.bias = (nn.Parameter(session.tensor(p.detach())) for p in (layer.weight, layer.bias))
        x = torch.empty(4, 64)
        return lambda: layer(x).sum().backward()

    sizes, _, _ = _fake_allocations(run)
    assert sizes.count(32 * MiB) == 2 and sizes.count(1 * MiB) == 1  # forward's and backward's cuBLAS, one cuBLASLt
    for name in ("BertLike_b8_32-true", "ResNetish_b32_bf16-mixed"):
        events, live = load_trace(name)["events"], {}
        for event in events:
            if event["action"] == "alloc":
                live[event["addr"]] = event["size"]
            elif event["action"] == "free_completed":
                live.pop(event["addr"], None)
        kept = collections.Counter(live.values())
        assert kept[32 * MiB] == 2 and kept[1 * MiB] >= 1


def test_conv_workspace_model_matches_the_h100_trace_for_most_convolutions():
    traced = [size for sizes_ in _trace_sizes("ResNetish_b32_32-true", "_conv_forward").values() for size in sizes_]
    shapes = [
        ((32, 128, 28, 28), (128, 128, 3, 3), (32, 128, 28, 28)),
        ((32, 256, 14, 14), (256, 256, 3, 3), (32, 256, 14, 14)),
        ((32, 512, 7, 7), (512, 512, 3, 3), (32, 512, 7, 7)),
        ((32, 3, 224, 224), (64, 3, 7, 7), (32, 64, 112, 112)),
    ]
    for input, weight, output in shapes:
        meta = [torch.empty(shape, device="meta") for shape in (input, weight, output)]
        assert conv_workspace_bytes(*meta) in traced

    def run(session):
        conv = nn.Conv2d(128, 128, 3, 1, 1, bias=False)
        conv.weight = nn.Parameter(session.tensor(conv.weight.detach()))
        x = torch.empty(32, 128, 28, 28)
        return lambda: conv(x)

    sizes, kernels, _ = _fake_allocations(run)
    assert (
        sizes == [12845056, 26279952] and "conv:cudnn-workspace" in kernels.used
    )  # output, then its transient workspace


def test_batch_norm_saves_c_floats_per_statistic_as_the_trace_shows():
    def run(session):
        norm = nn.BatchNorm2d(64)
        for name, tensor in list(norm.named_parameters()):
            setattr(norm, name, nn.Parameter(session.tensor(tensor.detach())))
        for name, tensor in list(norm.named_buffers()):
            setattr(norm, name, session.tensor(tensor))
        x = torch.empty(32, 64, 112, 112, requires_grad=True)
        return lambda: norm(x)

    sizes, _, _ = _fake_allocations(run)
    traced = [
        size for sizes_ in _trace_sizes("ResNetish_b32_32-true", "batch_norm@functional").values() for size in sizes_
    ]
    assert 102760448 in sizes and sizes.count(256) == 2
    assert traced.count(256) == 5 * 2 * 2  # the five 64-channel BatchNorms, 2 statistics, 2 steps


def test_16_mixed_keeps_the_grad_scaler_state():
    sizes, kernels, _ = _fake_allocations(lambda s: lambda: None, precision="16-mixed")
    assert sizes == [4, 4] and "16-mixed:grad-scaler" in kernels.used


class _TinyTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)

    def forward(self, x):
        return self.layer(x)


def test_the_gpu_generation_changes_the_attention_kernel_and_the_estimate():
    module, batch = _TinyTransformer(), torch.randn(8, 1024, 64)
    optimizer = lambda params: torch.optim.AdamW(params)  # noqa: E731
    h100 = estimate_memory(module, batch=batch, mode="bf16", optimizer=optimizer, device="cuda", gpu="h100")
    v100 = estimate_memory(module, batch=batch, mode="bf16", optimizer=optimizer, device="cuda", gpu="v100")
    assert any("attention: flash" in note for note in h100.notes) and any(
        "attention: math" in note for note in v100.notes
    )
    assert v100.cuda.peak_allocated_bytes > h100.cuda.peak_allocated_bytes  # L x L weights on the V100


def test_the_cuda_target_leaves_nothing_behind_and_restores_torch_functions():
    from tests.helpers.live_tensors import live_tensor_bytes

    module, batch = _TinyTransformer(), torch.randn(2, 64, 64)
    originals = (F.scaled_dot_product_attention, F.dropout, F.linear, F.cross_entropy)
    estimate_memory(
        module, batch=batch, mode="bf16", optimizer=lambda p: torch.optim.AdamW(p), device="cuda"
    )  # warm-up
    before = live_tensor_bytes()
    estimate = estimate_memory(
        module, batch=batch, mode="bf16", optimizer=lambda p: torch.optim.AdamW(p), device="cuda"
    )
    assert estimate.cuda.peak_allocated_bytes > 64 * MiB  # the two cuBLAS workspaces are in the simulated peak
    assert live_tensor_bytes() == before
    assert (F.scaled_dot_product_attention, F.dropout, F.linear, F.cross_entropy) == originals


@pytest.mark.parametrize(
    ("dtype", "trace", "buffer"),
    [(torch.float32, "BertLike_b8_32-true", 12595200), (torch.bfloat16, "BertLike_b8_bf16-mixed", 12779776)],
)
def test_fused_attention_backward_buffers_match_the_traces(dtype, trace, buffer):
    def run(session):
        q, k, v = _qkv(session, dtype)
        return lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=0.1).sum().backward()

    sizes, _, _ = _fake_allocations(run)
    backward = [e["size"] for e in load_trace(trace)["events"] if e["action"] == "alloc" and not e["frames"]]
    assert backward.count(buffer) == 24  # one per layer (12) and step (2), freed at once
    assert any(
        abs(size - buffer) <= 512 for size in sizes
    )  # the modelled transient: the same 512-byte blocks, or one more


def test_the_estimate_replays_with_the_allocator_settings_of_pytorch_cuda_alloc_conf(monkeypatch):
    module, batch = _TinyTransformer(), torch.randn(8, 256, 64)
    options = {"batch": batch, "optimizer": lambda p: torch.optim.AdamW(p), "device": "cuda", "gpu": "h100"}
    plain = estimate_memory(module, **options).cuda
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    expandable = estimate_memory(module, **options).cuda
    assert CudaKernels().config.expandable_segments
    assert expandable.segments <= 2 < plain.segments  # one growing segment per pool
    assert expandable.peak_allocated_bytes <= plain.peak_allocated_bytes  # blocks split down to 512 bytes
