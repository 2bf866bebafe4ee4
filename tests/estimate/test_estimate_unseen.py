"""The estimate on models and set-ups its other tests do not use: a GPT-style LM with grouped-query causal
attention, an encoder with a padding mask, torchmetrics inside ``training_step``, optimizers that read their
scalars. Each test pins one thing such a model does that the estimate must follow.

The CUDA kernel choices are checked against torch's own rules (sdp_utils.cpp's ``select_sdp_backend``) and
the math fallback against torch's own composite ``_scaled_dot_product_attention_math`` run on real tensors.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memkit import estimate_memory, measure_training_step
from lightning_memkit.accounting.accountant import TensorAccountant
from lightning_memkit.estimate.cuda.attention import additive_mask, attention_backend, math_attention
from lightning_memkit.estimate.cuda.autocast import label_smoothing_term
from lightning_memkit.estimate.cuda.gpu_target import GpuTarget


# ============================================================================================ models
class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.dropout = heads, kv_heads, d // heads, dropout
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * kv_heads * self.head_dim)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        batch, length, d = x.shape
        q = self.q(x).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k, v = (
            t.view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
            for t in self.kv(x).split(self.kv_heads * self.head_dim, 2)
        )
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=True,
            enable_gqa=self.kv_heads != self.heads,
        )
        return self.proj(y.transpose(1, 2).reshape(batch, length, d))


class GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads, kv_heads, dropout)
        self.mlp = nn.Sequential(
            nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d), nn.Dropout(dropout)
        )

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GroupedGPT(pl.LightningModule):
    """GPT-style LM: learned positions, grouped-query causal sdpa, lm_head tied to the embedding, AdamW with
    decay / no-decay groups and a warm-up + cosine schedule from the trainer, label smoothing, ignore_index."""

    def __init__(
        self,
        vocab: int = 64,
        d: int = 32,
        heads: int = 4,
        kv_heads: int = 2,
        layers: int = 2,
        seq: int = 16,
        batch_size: int = 4,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(GPTBlock(d, heads, kv_heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        tokens = torch.randint(0, vocab, (16, seq + 1), generator=torch.Generator().manual_seed(0))
        targets = tokens[:, 1:].clone()
        targets[:, :2] = -100
        self.data = TensorDataset(tokens[:, :-1], targets)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        logits = self(idx)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, label_smoothing=0.1)
        self.log("loss", loss, on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=3e-4
        )
        total = max(2, int(self.trainer.estimated_stepping_batches))
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: min(1.0, (s + 1) / 2) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total)))
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class PaddedEncoder(pl.LightningModule):
    """nn.TransformerEncoder (batch_first, norm_first) given a src_key_padding_mask: a float mask reaches sdpa."""

    def __init__(self, vocab: int = 64, d: int = 32, seq: int = 16, batch_size: int = 4) -> None:
        super().__init__()
        self.batch_size = batch_size
        tokens = torch.randint(1, vocab, (16, seq), generator=torch.Generator().manual_seed(0))
        tokens[:, -4:] = 0
        self.data = TensorDataset(tokens)
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        layer = nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        hidden = self.encoder(self.emb(tokens), src_key_padding_mask=tokens == 0)
        return F.cross_entropy(self.head(hidden).flatten(0, 1), tokens.flatten(), ignore_index=0)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class MetricCNN(pl.LightningModule):
    """A small CNN that updates a torchmetrics accuracy and its own buffers inside training_step."""

    def __init__(self, batch_size: int = 4, optimizer: str = "sgd") -> None:
        super().__init__()
        torchmetrics = pytest.importorskip("torchmetrics")
        self.batch_size, self.optimizer = batch_size, optimizer
        generator = torch.Generator().manual_seed(0)
        self.data = TensorDataset(
            torch.randn(16, 3, 16, 16, generator=generator), torch.randint(0, 10, (16,), generator=generator)
        )
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 8, 3, groups=8, padding=1),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Dropout(0.2),
            nn.Linear(8, 10),
        )
        self.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=10)
        self.register_buffer("class_counts", torch.zeros(10))

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.accuracy(logits, y)
        self.class_counts += F.one_hot(y, 10).sum(0)
        self.log("accuracy", self.accuracy, on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self):
        if self.optimizer == "nadam":
            return torch.optim.NAdam(self.parameters(), lr=1e-3, decoupled_weight_decay=True, weight_decay=0.01)
        if self.optimizer == "adam_tensor_lr":
            return torch.optim.Adam(self.parameters(), lr=torch.tensor(1e-3))
        if self.optimizer == "adamw_capturable":
            return torch.optim.AdamW(self.parameters(), lr=1e-3, capturable=True)
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, nesterov=True)


# ============================================================================================ kernel choices
def _qkv(heads=4, kv_heads=4, length=16, source=16, head_dim=64, dtype=torch.bfloat16, grad=True):
    def make(h, n):
        return torch.empty(2, h, n, head_dim, dtype=dtype, device="meta", requires_grad=grad)

    return make(heads, length), make(kv_heads, source), make(kv_heads, source)


@pytest.mark.parametrize(
    ("case", "gpu", "expected"),
    [
        ({"kv_heads": 2}, "h100", "flash"),  # grouped-query heads: flash supports them
        ({"kv_heads": 2, "dtype": torch.float32}, "h100", "math"),  # ... memory-efficient does not
        ({"kv_heads": 2, "dtype": torch.float16}, "v100", "math"),  # no flash before sm80
        ({"source": 32, "causal": True}, "h100", "efficient"),  # flash: is_causal needs equal lengths
        ({"head_dim": 30, "dtype": torch.float32}, "v100", "efficient"),  # fp32 before sm80: alignment 1
        ({"head_dim": 30, "dtype": torch.float32}, "h100", "math"),  # fp32 on sm80+: alignment 4
        ({"head_dim": 200}, "a10", "efficient"),  # sm86: flash trains no head dim in (192, 224]
        ({"head_dim": 200, "grad": False}, "a10", "flash"),
        ({"head_dim": 200}, "h100", "flash"),
    ],
    ids=[
        "gqa-bf16",
        "gqa-fp32",
        "gqa-fp16-v100",
        "causal-rect",
        "hd30-fp32-v100",
        "hd30-fp32-h100",
        "hd200-sm86",
        "hd200-sm86-no-grad",
        "hd200-h100",
    ],
)
def test_attention_backend_follows_torchs_sdp_rules(case, gpu, expected):
    causal = case.pop("causal", False)
    query, key, value = _qkv(**case)
    assert (
        attention_backend(query, key, value, None, 0.1, GpuTarget.parse(gpu), enable_gqa=True, is_causal=causal)
        == expected
    )


def _math_step(attention, dtype, gqa, masked):
    """Allocations (bytes each) and peak of one forward + backward through ``attention`` on real CPU tensors."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 4, 16, 8, dtype=dtype, generator=generator).requires_grad_()
    key, value = (
        torch.randn(2, 2 if gqa else 4, 16, 8, dtype=dtype, generator=generator).requires_grad_() for _ in range(2)
    )
    mask = additive_mask(torch.rand(16, 16, generator=generator) > 0.2, dtype) if masked else None
    sizes: list[int] = []
    accountant = TensorAccountant()
    accountant.add_storage_listener(lambda record: sizes.append(record.nbytes), None)
    with accountant:
        attention(query, key, value, mask, gqa).sum().backward()
    return sorted(sizes), accountant.peak_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
def test_math_fallback_allocates_what_torchs_composite_allocates(dtype, gqa, masked):
    # torch's own math path (the CUDA fallback is this composite with CUDA's dropout) against memkit's copy of it:
    # fp32 accumulation for bf16, grouped heads repeated, C++ locals alive until it returns, both outputs cast back
    torch_sizes, torch_peak = _math_step(
        lambda q, k, v, m, g: torch.ops.aten._scaled_dot_product_attention_math(
            q, k, v, m, 0.0, False, None, enable_gqa=g
        )[0],
        dtype,
        gqa,
        masked,
    )
    sizes, peak = _math_step(lambda q, k, v, m, g: math_attention(q, k, v, m, 0.0, False, None, g), dtype, gqa, masked)
    assert peak == torch_peak
    if masked:  # under a dispatch mode torch adds the mask out of place; on plain CUDA tensors in place
        torch_sizes.remove(2 * 4 * 16 * 16 * 4)
    assert sizes == torch_sizes


def _cross_entropy_step(loss_fn, weighted, reduction):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 10, generator=generator).requires_grad_()
    target = torch.randint(0, 10, (12,), generator=generator)
    target[:3] = -100
    weight = torch.rand(10, generator=generator) if weighted else None
    sizes: list[int] = []
    accountant = TensorAccountant()
    accountant.add_storage_listener(lambda record: sizes.append(record.nbytes), None)
    with accountant:
        loss = loss_fn(logits, target, weight, reduction)
        (loss.sum() if loss.dim() else loss).backward()
    return sorted(sizes), accountant.peak_bytes


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "class-weights"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_label_smoothing_term_allocates_what_torchs_cross_entropy_allocates(weighted, reduction):
    # on fp32 logits (no autocast casts) memkit's CUDA-autocast cross_entropy is torch's own composite, op for op
    def memkit(logits, target, weight, reduction):
        log_probs = torch.log_softmax(logits, 1, dtype=logits.dtype)
        nll = F.nll_loss(log_probs.float(), target, weight, ignore_index=-100, reduction=reduction)
        return label_smoothing_term(log_probs, nll, target, weight, 1, reduction, -100, 0.1)

    def torchs(logits, target, weight, reduction):
        return F.cross_entropy(logits, target, weight, ignore_index=-100, reduction=reduction, label_smoothing=0.1)

    assert _cross_entropy_step(memkit, weighted, reduction) == _cross_entropy_step(torchs, weighted, reduction)


# ============================================================================================ whole estimates
@pytest.mark.parametrize(
    "factory",
    [GroupedGPT, PaddedEncoder, MetricCNN, lambda: MetricCNN(optimizer="nadam")],
    ids=["grouped-gpt", "padded-encoder", "torchmetrics", "nadam"],
)
def test_cpu_estimate_equals_the_measured_step(factory):
    module = factory()
    estimate, measured = estimate_memory(module, 4, device="cpu"), measure_training_step(module, 4, device="cpu")
    assert estimate.peak_bytes == measured.peak_bytes and estimate.by_category == measured.by_category


@pytest.mark.parametrize(
    ("factory", "gpu", "mode", "kernel"),
    [
        (GroupedGPT, "h100", "bf16", "attention: flash"),
        (GroupedGPT, "v100", "fp16", "attention: math"),
        (GroupedGPT, "a100", "bf16", "cross_entropy: CUDA autocast"),  # label smoothing: CUDA's autocast path too
        (PaddedEncoder, "h100", "bf16", "attention: memory-efficient"),
        (PaddedEncoder, "v100", "bf16", "attention: math"),
        (lambda: MetricCNN(optimizer="adam_tensor_lr"), "h100", None, "cuDNN workspaces"),
        (lambda: MetricCNN(optimizer="nadam"), "v100", "fp16", "cuDNN workspaces"),
        (lambda: MetricCNN(optimizer="adamw_capturable"), "h100", "bf16", "cuDNN workspaces"),
    ],
    ids=[
        "gpt-h100-bf16",
        "gpt-v100-fp16",
        "gpt-a100-bf16-smoothing",
        "encoder-h100-bf16",
        "encoder-v100-bf16",
        "adam-tensor-lr-h100",
        "nadam-v100-fp16",
        "adamw-capturable-h100",
    ],
)
def test_cuda_target_estimates_and_names_the_kernel(factory, gpu, mode, kernel):
    estimate = estimate_memory(factory(), 4, device="cuda", gpu=gpu, mode=mode)
    assumed = next(note for note in estimate.notes if note.startswith("CUDA kernels assumed"))
    assert kernel in assumed
    assert estimate.cuda.peak_allocated_bytes >= estimate.peak_bytes > 0


# ============================================================================================ manual optimization
class ManualTwoOptimizers(pl.LightningModule):
    """Manual optimization as Lightning's docs write it: two optimizers from configure_optimizers with a
    scheduler, toggle_optimizer, manual_backward inside a closure passed to step, clip_gradients,
    self.lr_schedulers().step()."""

    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.batch_size = batch_size
        self.encoder = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 1)
        generator = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(16, 16, generator=generator), torch.randn(16, 1, generator=generator))

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)

    def training_step(self, batch, batch_idx):
        x, y = batch
        encoder_opt, head_opt = self.optimizers()

        def closure():
            loss = F.mse_loss(self.head(self.encoder(x)), y)
            encoder_opt.zero_grad()
            self.manual_backward(loss)
            self.clip_gradients(encoder_opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
            return loss

        self.toggle_optimizer(encoder_opt)
        encoder_opt.step(closure=closure)
        self.untoggle_optimizer(encoder_opt)
        self.toggle_optimizer(head_opt)
        loss = F.mse_loss(self.head(self.encoder(x).detach()), y)
        head_opt.zero_grad()
        self.manual_backward(loss)
        head_opt.step()
        self.untoggle_optimizer(head_opt)
        self.lr_schedulers().step()

    def configure_optimizers(self):
        encoder_opt = torch.optim.AdamW(self.encoder.parameters(), lr=1e-3)
        head_opt = torch.optim.SGD(self.head.parameters(), lr=0.1, momentum=0.9)
        return [encoder_opt, head_opt], [torch.optim.lr_scheduler.StepLR(encoder_opt, 1)]


def _gan():
    from tests.callbacks.test_robustness import GAN

    return GAN()


@pytest.mark.parametrize("factory", [_gan, ManualTwoOptimizers], ids=["gan", "closure-toggle-clip-schedule"])
def test_manual_optimization_is_estimated_as_its_training_step_runs_it(factory):
    module = factory()
    estimate, measured = estimate_memory(module, 4, device="cpu"), measure_training_step(module, 4, device="cpu")
    assert estimate.peak_bytes == measured.peak_bytes and estimate.by_category == measured.by_category
    optimizers = configured = module.configure_optimizers()
    if isinstance(configured, (list, tuple)) and configured and isinstance(configured[0], list):
        optimizers = configured[0]
    # both optimizers' state (Adam: two moments per parameter; SGD: one momentum buffer) is counted
    state = sum(
        p.numel() * 4 * (2 if isinstance(opt, torch.optim.Adam) else 1)
        for opt in optimizers
        for g in opt.param_groups
        for p in g["params"]
    )
    assert state <= estimate.by_category["optimizer_state"] <= state + 4 * 64
    cuda = estimate_memory(module, 4, device="cuda", gpu="h100", mode="bf16")
    assert cuda.cuda.peak_allocated_bytes > cuda.peak_bytes > estimate.parameters_bytes


def test_manual_optimization_refuses_a_loss_fn_it_would_not_use():
    with pytest.raises(Exception, match="manual optimization.*loss_fn= does not apply"):
        estimate_memory(
            ManualTwoOptimizers(), 4, device="cpu", loss_fn=lambda module, batch: module.head(batch[0]).sum()
        )


def test_a_checkpoint_budget_measures_a_forward_that_updates_a_metric():
    # the budget's measuring forward runs training_step on fakes too: torchmetrics' bincount must answer there
    module = MetricCNN()
    estimate = estimate_memory(module, 4, device="cpu", mode="checkpoint:budget=0.5")
    measured = measure_training_step(module, 4, device="cpu", mode="checkpoint:budget=0.5")
    assert estimate.peak_bytes == measured.peak_bytes and estimate.by_category == measured.by_category


# ============================================================================================ Lightning's hooks
class HookedGPT(GroupedGPT):
    """Keeps a flat copy of every gradient after backward (as a gradient-noise or EMA-of-gradients hook does)
    and records the clipping Lightning asks for."""

    clip_requests: list = []

    def on_after_backward(self):
        self.grad_snapshot = torch.cat([p.grad.flatten() for p in self.parameters() if p.grad is not None])

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        type(self).clip_requests.append((gradient_clip_val, gradient_clip_algorithm))
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)


def test_the_step_runs_lightnings_hooks_and_the_trainers_gradient_clipping():
    trainer = pl.Trainer(
        gradient_clip_val=0.5,
        gradient_clip_algorithm="value",
        max_steps=10,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    HookedGPT.clip_requests.clear()
    hooked, plain = HookedGPT(dropout=0.0), GroupedGPT(dropout=0.0)
    estimate = estimate_memory(hooked, 4, device="cpu", trainer=trainer)
    assert HookedGPT.clip_requests == [(0.5, "value")] * 2  # once per step, with the trainer's settings
    measured = measure_training_step(hooked, 4, device="cpu", trainer=trainer)
    assert estimate.peak_bytes == measured.peak_bytes and estimate.by_category == measured.by_category
    # the snapshot (one float per parameter element) lives from the first backward on: the peak holds it
    snapshot = sum(p.numel() for p in hooked.parameters()) * 4
    assert estimate.peak_bytes == estimate_memory(plain, 4, device="cpu", trainer=trainer).peak_bytes + snapshot


# ============================================================================================ CUDA's autocast lists
def _cuda_autocast_fp32_cases():
    # torch/testing/_internal/autocast_test_lists.py's AutocastTestLists, read from the file: importing the module
    # needs torch's test dependencies (expecttest), the class itself only torch
    import collections
    import pathlib

    text = (pathlib.Path(torch.__file__).parent / "testing" / "_internal" / "autocast_test_lists.py").read_text()
    namespace = {"torch": torch, "collections": collections, "TEST_WITH_ROCM": False}
    exec(text[text.index("class AutocastTestLists") : text.index("class AutocastCPUTestLists")], namespace)  # noqa: S102
    lists = namespace["AutocastTestLists"](torch.device("cpu"))
    cases = [(torch, entry) for entry in lists.torch_fp32] + [(torch._C._nn, entry) for entry in lists.nn_fp32]
    return cases + [(torch.Tensor, entry) for entry in lists.methods_fp32]


def test_the_cuda_target_runs_torchs_cuda_autocast_fp32_lists():
    # torch's own CUDA autocast test lists (ops CUDA runs in fp32 whatever the autocast dtype): on the CUDA target's
    # fake step each comes out fp32, where CPU autocast (what the fake step runs on) leaves several in fp16
    from lightning_memkit.estimate.cuda.functions import CudaFunctions
    from lightning_memkit.estimate.cuda.kernels import CudaKernels

    functions = CudaFunctions(CudaKernels("h100", "16-mixed"))
    wrong = []
    for owner, entry in _cuda_autocast_fp32_cases():
        name, args, kwargs = entry[0], entry[1], (entry[2] if len(entry) > 2 else {})
        with functions, functions.patched(), torch.autocast("cpu", dtype=torch.float16):
            out = getattr(owner, name)(*args, **kwargs)
        if (out[0] if isinstance(out, tuple) else out).dtype != torch.float32:
            wrong.append(name)
    assert not wrong, f"not fp32 as CUDA autocast makes them: {wrong}"
    with functions, functions.patched(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert (
            torch.einsum("ij,jk->ik", torch.randn(4, 4), torch.randn(4, 4)).dtype == torch.bfloat16
        )  # CUDA: lower precision
        volume = torch.empty(1, 2, 4, 4, 4, dtype=torch.bfloat16, device="meta")  # the CPU kernel has no bf16
        assert F.avg_pool3d(volume, 2).dtype == torch.bfloat16  # CPU autocast would run it in fp32; CUDA's leaves it
    assert torch.Tensor.__dict__.get("exp") is None and F.layer_norm.__module__ == "torch.nn.functional"  # all put back


def test_the_cuda_autocast_patches_leave_other_threads_alone():
    # the patches are process-wide while the fake step runs; another thread's real computation under CPU autocast
    # (a user's thread, a loader's) must get CPU autocast's dtypes, not the CUDA policy the fake step follows
    import threading

    from lightning_memkit.estimate.cuda.functions import CudaFunctions
    from lightning_memkit.estimate.cuda.kernels import CudaKernels

    def sum_dtype():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch.randn(4, 4).to(torch.bfloat16).sum(0).dtype

    cpu_policy = sum_dtype()
    functions = CudaFunctions(CudaKernels("h100", "bf16-mixed"))
    seen = {}
    with functions, functions.patched():
        seen["step thread"] = sum_dtype()
        other = threading.Thread(target=lambda: seen.update(other=sum_dtype()))
        other.start()
        other.join(timeout=60)
    assert cpu_policy == torch.bfloat16 and seen == {"step thread": torch.float32, "other": cpu_policy}


def test_group_norm_and_softmax_under_bf16_are_fp32_on_a_cuda_target():
    # a UNet-style block: bf16 convolution outputs normalised by GroupNorm (fp32 on CUDA: an fp32 copy and output)
    # and a hand-written attention softmax (fp32 on CUDA); checkpointed, the recomputation must agree
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.norm = nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(2, 8)

        def forward(self, x):
            h = self.norm(self.conv(x))
            flat = h.flatten(2)
            weights = (flat.transpose(1, 2) @ flat).softmax(-1)
            return h + (flat @ weights).view_as(h)

    model = nn.Sequential(Block(), Block(), Block())
    batch = torch.randn(2, 8, 16, 16)
    options = {
        "batch": batch,
        "device": "cuda",
        "gpu": "h100",
        "optimizer": lambda params: torch.optim.SGD(params, lr=0.1),
    }
    bf16 = estimate_memory(model, mode="bf16", **options)
    assert any("CUDA autocast's op lists" in note for note in bf16.notes)
    # the fp32 softmax weights (2 x 256 x 256 x 4 bytes per block) are held for backward
    assert bf16.activations_bytes >= 3 * 2 * 256 * 256 * 4
    checkpointed = estimate_memory(model, mode="bf16+checkpoint", **options)
    assert checkpointed.peak_bytes < bf16.peak_bytes


# ============================================================================================ against a real fit
def _tensor_attributes(module: nn.Module) -> list[torch.Tensor]:
    return [v for each in module.modules() for v in vars(each).values() if isinstance(v, torch.Tensor)]


class _StepPeak(pl.Callback):
    """Each training batch's peak in a real Trainer.fit, counted by the accountant: what is live when the batch
    starts (parameters, buffers, gradients, tensors the module keeps, optimizer state, the batch) adopted, then
    every allocation."""

    def __init__(self) -> None:
        self.peaks: list[int] = []
        self.initial: set[int] = set()

    def on_train_start(self, trainer, pl_module):
        self.initial = {id(v) for v in _tensor_attributes(pl_module)}  # on the host, as a GPU run would leave them

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        live = (
            list(pl_module.parameters())
            + list(pl_module.buffers())
            + [p.grad for p in pl_module.parameters() if p.grad is not None]
        )
        live += [
            v for v in _tensor_attributes(pl_module) if id(v) not in self.initial
        ]  # a hook's kept tensor, not a dataset
        live += [
            v
            for opt in trainer.optimizers
            for state in opt.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor)
        ]
        live += [t for t in (batch if isinstance(batch, (list, tuple)) else [batch]) if isinstance(t, torch.Tensor)]
        self.accountant = TensorAccountant()
        self.accountant.adopt(live)
        self.accountant.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.accountant.__exit__(None, None, None)
        self.peaks.append(self.accountant.peak_bytes)


@pytest.mark.parametrize(
    ("factory", "steps", "clip"),
    [
        (_gan, 4, None),
        (ManualTwoOptimizers, 4, None),
        (lambda: HookedGPT(dropout=0.0), 2, None),
        (lambda: HookedGPT(dropout=0.0), 2, 0.5),
    ],
    ids=["gan", "closure-toggle-clip-schedule", "hooked-gpt", "hooked-gpt-clipped-by-the-trainer"],
)
def test_the_estimate_equals_a_real_lightning_step(tmp_path, factory, steps, clip):
    # two optimizer steps per batch for the manual modules (global_step counts both)
    peaks = _StepPeak()
    trainer = pl.Trainer(
        max_steps=steps,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[peaks],
        accelerator="cpu",
        gradient_clip_val=clip,
    )
    trainer.fit(factory())
    assert len(peaks.peaks) == 2
    unattached = pl.Trainer(max_steps=steps, logger=False, gradient_clip_val=clip)
    assert estimate_memory(factory(), 4, device="cpu", trainer=unattached).peak_bytes == max(peaks.peaks)


def test_max_batch_size_searches_a_manually_optimized_module_with_the_estimate(tmp_path):
    from lightning_memkit import MaxBatchSize
    from tests.callbacks.test_robustness import GAN

    def search(use_estimate):
        finder = MaxBatchSize(budget=400_000, max_val=1024, use_estimate=use_estimate, verbose=False)
        trainer = pl.Trainer(
            max_steps=4,
            default_root_dir=tmp_path,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[finder],
            accelerator="cpu",
        )
        trainer.fit(GAN(samples=1024))
        return finder.result

    guided, blind = search(True), search(False)
    assert guided.predicted is not None and len(guided.trials) <= 4 < len(blind.trials)
    assert guided.batch_size == blind.batch_size
