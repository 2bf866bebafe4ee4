"""True half precision (Lightning's ``bf16-true`` and ``16-true``): the estimate against real Lightning fits, counted by
tests/helpers/dispatch_counter.py (no code shared with memkit), and against analytic counts of the model states, up to a
Llama-2-7B LoRA fine-tune built on the meta device.

Lightning's ``HalfPrecision`` plugin converts the module (``module.to(dtype)``) before the first step, converts each
batch's floating-point tensors (``convert_input``) and runs ``training_step`` with the half dtype as torch's default
dtype; there is no autocast and no GradScaler.
"""

from __future__ import annotations

import time

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_memkit import estimate_distributed_memory, estimate_memory, measure_training_step
from lightning_memkit.estimate.step.settings import reusing_fake_copies
from tests.helpers.fit_count import closure_bytes, fit_peak_bytes
from tests.helpers.lightning_gpt import TinyGPT
from tests.helpers.models import LinearStack

HALF = {"bf16-true": torch.bfloat16, "16-true": torch.float16}
MODE_OF = {"32-true": None, "bf16-true": "bf16-true", "16-true": "fp16-true"}


class TokenGPT(TinyGPT):
    """TinyGPT with a bare training step (no ``self.log``) and AdamW: integer inputs, which ``convert_input`` keeps."""

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        return F.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class FloatStack(LinearStack):
    """A Linear stack fed floating-point inputs (``convert_input`` converts them) whose ``training_step`` makes a
    tensor without a dtype: the default dtype, which ``HalfPrecision.forward_context`` sets to the half dtype (in
    fp32, the product below would be fp32 too)."""

    def training_step(self, batch, batch_idx):
        (x,) = batch
        ramp = torch.linspace(0.5, 1.5, x.shape[1])
        return self.net(x * ramp).pow(2).sum()


def _token_gpt() -> TokenGPT:
    torch.manual_seed(0)
    return TokenGPT(vocab=64, d_model=32, heads=2, layers=2, seq_len=16)


def _token_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (4, 16), generator=generator), torch.randint(0, 64, (4, 16), generator=generator)


def _float_stack() -> FloatStack:
    torch.manual_seed(0)
    # 256 samples: the peak is in the forward (the saved activations outgrow Adam's temporaries), where Lightning's
    # loop holds nothing besides the step's own tensors
    return FloatStack((32, 256, 256, 8), batch_size=256, samples=256, optimizer="adam")


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
@pytest.mark.parametrize("kind", ["tokens", "floats"])
def test_a_true_half_precision_fit_peaks_at_the_estimate_to_the_byte(kind, precision):
    make = _token_gpt if kind == "tokens" else _float_stack
    batch = _token_batch() if kind == "tokens" else next(iter(make().train_dataloader()))
    mode = MODE_OF[precision]
    estimate = estimate_memory(make(), batch=batch, mode=mode, device="cpu")
    assert estimate.mode == mode and estimate.peak_phase == "forward"  # the shapes put it there: no closure scalars
    module = make()
    assert fit_peak_bytes(module, batch, precision) == estimate.peak_bytes
    assert {p.dtype for p in module.parameters()} == {HALF[precision]}  # the fit trained the module in half precision
    assert measure_training_step(make(), batch=batch, mode=mode, device="cpu").peak_bytes == estimate.peak_bytes
    # convert_input: floating-point inputs in the half dtype, integers as they are
    inputs = sum(t.numel() * (2 if t.is_floating_point() else t.element_size()) for t in batch)
    assert estimate.by_category["inputs"] == inputs
    # against the fit in fp32 of the same module and batch, the fp32 estimate is exact too: the half one is lower
    full = estimate_memory(make(), batch=batch, device="cpu")
    closure = closure_bytes(full.peak_phase, loss_bytes=4)
    assert fit_peak_bytes(make(), batch, "32-true") == full.peak_bytes + closure > estimate.peak_bytes


def test_true_half_model_states_are_half_of_fp32_but_adams_step_counters():
    """The ZeRO paper's arithmetic for Adam(W), at the peak (step 2's forward: step 1's gradients still alive):
    fp32 keeps 4 + 4 + 8 bytes per parameter, true half 2 + 2 + 4, and either one fp32 ``step`` scalar per tensor."""
    module, batch = _token_gpt(), _token_batch()
    parameters = list(module.parameters())  # the tied embedding and head once
    elements, tensors = sum(p.numel() for p in parameters), len(parameters)
    full = estimate_memory(module, batch=batch, device="cpu").by_category
    half = estimate_memory(module, batch=batch, mode="bf16-true", device="cpu").by_category
    assert (full["parameters"], full["gradients"], full["optimizer_state"]) == (
        4 * elements,
        4 * elements,
        8 * elements + 4 * tensors,
    )
    assert (half["parameters"], half["gradients"], half["optimizer_state"]) == (
        2 * elements,
        2 * elements,
        4 * elements + 4 * tensors,
    )
    states = ("parameters", "gradients", "optimizer_state")
    assert sum(half[name] for name in states) - 4 * tensors == (sum(full[name] for name in states) - 4 * tensors) // 2
    assert half["autocast_weight_copies"] == 0  # no autocast: no weight copies


def test_estimates_of_every_precision_in_one_block_keep_their_own_fake_copy():
    module, batch = _token_gpt(), _token_batch()
    modes = [None, "bf16-true", "bf16", "fp16-true", None, "bf16-true+checkpoint"]
    alone = [estimate_memory(module, batch=batch, mode=mode, device="cpu").peak_bytes for mode in modes]
    with reusing_fake_copies():
        together = [estimate_memory(module, batch=batch, mode=mode, device="cpu").peak_bytes for mode in modes]
    assert together == alone
    assert alone[1] < alone[2] < alone[0] and alone[3] == alone[1]
    assert {p.dtype for p in module.parameters()} == {torch.float32}  # the module itself is never converted


def test_per_rank_buffers_hold_the_converted_modules_half_precision_tensors():
    """DDP's gradient buckets, FSDP's gathered parameters and DeepSpeed's flat weights are the bf16 module's (Lightning
    converts it before the strategy wraps it)."""
    module, batch = _token_gpt(), _token_batch()
    elements = sum(p.numel() for p in module.parameters())

    def rank(strategy: str, mode=None):
        return estimate_distributed_memory(
            module, strategy=strategy, world_size=2, mode=mode, batch=batch, device="cpu"
        )

    assert rank("ddp").buffers["ddp_gradient_buckets"] == 4 * elements
    assert rank("ddp", "bf16-true").buffers["ddp_gradient_buckets"] == 2 * elements
    # the whole model is one FSDP unit: its flat parameter (padded to a multiple of the 2 ranks) gathered whole
    padded = -(-elements // 2) * 2
    fsdp = rank("fsdp", "bf16-true")
    assert fsdp.buffers["fsdp_gathered_parameters"] == 2 * padded and fsdp.by_category["parameters"] == padded
    # ZeRO 2 keeps every rank's bf16 weights whole, flattened and padded to a multiple of 2 x world size elements
    deepspeed = rank("deepspeed_stage_2", "bf16-true")
    assert deepspeed.by_category["parameters"] == 2 * (-(-elements // 4) * 4)


# ------------------------------------------------------------------------------------------ a 7B LoRA on 24 GiB
LLAMA_7B = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
}
SEQUENCE, LORA_RANK = 2048, 16
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


class LoRALlama(pl.LightningModule):
    """A Llama-shaped ``LlamaForCausalLM`` from its config with peft's LoRA on the attention projections, as a LoRA
    fine-tune is written: random tokens (labels are the inputs), AdamW over the adapters."""

    def __init__(self, sizes: dict[str, int], sequence: int, batch_size: int = 1) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        peft = pytest.importorskip("peft")
        config = transformers.LlamaConfig(**sizes, max_position_embeddings=sequence, use_cache=False)
        lora = peft.LoraConfig(r=LORA_RANK, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS)
        self.model = peft.get_peft_model(transformers.LlamaForCausalLM(config), lora)
        self.vocab, self.sequence, self.batch_size = sizes["vocab_size"], sequence, batch_size

    def train_dataloader(self):
        tokens = torch.randint(0, self.vocab, (4, self.sequence), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(tokens), batch_size=self.batch_size)

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        return self.model(input_ids=tokens, labels=tokens).loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)


#: cuBLAS's default workspace before Hopper (CUBLAS_WORKSPACE_CONFIG=:4096:2:16:8), bytes
CUBLAS_WORKSPACE_BYTES = (4096 * 2 + 16 * 8) * 1024


def lora_llama_peak_count(sizes: dict[str, int], sequence: int, batch: int, parameters: int, buffers: int) -> dict:
    """The analytic count of a bf16-true LoRA step with every decoder layer but the last checkpointed (memkit's
    ``auto``: backward would recompute the last at once), at its peak: the start of step 2's backward (the loss's
    gradient made, no LoRA gradient yet: ``zero_grad`` set them to ``None`` after the forward). Bytes by category.

    ``parameters``: every parameter (base and adapters); ``buffers``: the buffers' elements (the rotary
    frequencies). Saved for backward (``activations``), per token of the batch (``tokens``):

    - each checkpointed layer's input (the embedding's output for the first): ``(L - 1) * H`` bf16;
    - shared by the layers: the rotary ``cos`` and ``sin``, ``2 * head_dim`` bf16, and the position ids, int64;
    - the last layer: its two RMSNorms' fp32 inputs and ``rsqrt`` (``2 * (H + 1)`` fp32), the first norm's bf16
      output (the adapters' input for q, k and v), the adapters' rank-r outputs (``4 * r``), q and k after the
      rotation and v (``3 * H``), the attention's output (``H``) and its log-sum-exp (``heads`` fp32); the MLP's
      gate and up projections and the SiLU (``3 * I``), all bf16 (the frozen projections keep no input);
    - the final RMSNorm's fp32 input and ``rsqrt`` (``H + 1`` fp32), the log-softmax of the fp32 logits (``V`` fp32).

    Temporaries: the gradient of the log-probabilities and of the logits (``2 * V`` fp32 per token), the labels
    padded by one position (int64), and on a CUDA target before Hopper cuBLAS's default workspace (``:4096:2:16:8``,
    8320 KiB) for each thread that runs matmuls: the forward's and the autograd engine's. Optimizer state: AdamW's
    two bf16 moments per adapter element and one fp32 ``step`` per adapter tensor (two per targeted projection and
    layer).
    """
    tokens = batch * sequence
    hidden, inner, vocab = sizes["hidden_size"], sizes["intermediate_size"], sizes["vocab_size"]
    layers, heads = sizes["num_hidden_layers"], sizes["num_attention_heads"]
    head_dim = hidden // heads
    adapters = layers * len(LORA_TARGETS) * 2 * LORA_RANK * hidden
    bf16, fp32, int64 = 2, 4, 8
    saved_per_token = (
        (layers - 1) * hidden * bf16
        + 2 * head_dim * bf16
        + int64
        + 2 * (hidden + 1) * fp32
        + (hidden + 4 * LORA_RANK + 3 * hidden + hidden) * bf16
        + 3 * inner * bf16
        + (hidden + 1) * fp32
        + vocab * fp32
    )
    return {
        "parameters": parameters * bf16,
        "buffers": buffers * bf16,
        "gradients": 0,
        "optimizer_state": adapters * 2 * bf16 + layers * len(LORA_TARGETS) * 2 * fp32,
        "activations": tokens * saved_per_token + batch * heads * sequence * fp32,
        "inputs": tokens * int64,
        "temporaries": tokens * 2 * vocab * fp32 + batch * (sequence + 1) * int64 + 2 * CUBLAS_WORKSPACE_BYTES,
    }


@pytest.mark.slow  # 9-21 s on 2 shared cores (quiet, loaded): two fake steps of 6.76e9 parameters
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_7b_lora_with_checkpointing_fits_24gib_in_bf16_true_by_the_estimate_and_the_analytic_count():
    started = time.perf_counter()
    with torch.device("meta"):  # as `memkit estimate --meta-init` builds it: no weights, no host memory
        module = LoRALlama(LLAMA_7B, SEQUENCE)
    parameters = sum(p.numel() for p in module.parameters())
    buffers = sum(b.numel() for b in module.buffers())
    layers, hidden = LLAMA_7B["num_hidden_layers"], LLAMA_7B["hidden_size"]
    assert sum(p.numel() for p in module.parameters() if p.requires_grad) == layers * 4 * 2 * LORA_RANK * hidden
    budget = 24 * 2**30
    # an fp32 base alone never fits: 4 bytes x 6.76e9 parameters is 25.2 GiB
    assert 4 * parameters > budget
    estimate = estimate_memory(module, 1, mode="bf16-true+checkpoint", device="cuda", gpu="l4")
    count = lora_llama_peak_count(LLAMA_7B, SEQUENCE, 1, parameters, buffers)
    analytic_peak = sum(count.values())
    assert estimate.required_bytes <= budget and analytic_peak <= budget  # fits at batch 1
    assert estimate.peak_phase == "backward" and estimate.peak_step == 2
    assert abs(estimate.peak_bytes - analytic_peak) <= 0.01 * analytic_peak
    for name in ("parameters", "buffers", "gradients", "optimizer_state", "inputs"):
        assert estimate.by_category[name] == count[name], name
    for name in ("activations", "temporaries"):  # a few scalars apart (flash attention's seeds, the loss)
        assert abs(estimate.by_category[name] - count[name]) <= 0.01 * count[name], name
    seconds = time.perf_counter() - started
    print(f"7B LoRA bf16-true+checkpoint estimate: {seconds:.1f} s, peak {estimate.peak_bytes / 2**30:.2f} GiB")


@pytest.mark.cuda
@pytest.mark.timeout(600)
def test_on_a_gpu_a_bf16_true_fit_is_within_the_cuda_estimates_bounds(tmp_path, capsys):
    """`memkit estimate --check` trains two real bf16-true steps on the GPU: the CUDA estimate is within the bounds
    docs/cuda_estimate.md states for every precision (allocated -3%..+10%, reserved -5%..+15%)."""
    import json

    from lightning_memkit.cli import main

    model = {"vocab_size": 1000, "d_model": 512, "nhead": 8, "layers": 4, "dim_feedforward": 2048, "seq_len": 512}
    out_json = tmp_path / "check.json"
    arguments = [
        "estimate",
        "lightning_memkit.zoo:DemoTransformer",
        "--init-args",
        json.dumps({**model, "batch_size": 16}),
    ]
    assert main([*arguments, "--modes", "baseline,bf16-true", "--check", "--json", str(out_json)]) == 0, (
        capsys.readouterr()
    )
    results = {r["mode"]: r for r in json.loads(out_json.read_text())["results"]}
    for result in results.values():
        check, cuda = result["check"], result["estimate"]["cuda"]
        allocated = (cuda["peak_allocated_bytes"] - check["peak_allocated_bytes"]) / check["peak_allocated_bytes"]
        reserved = (cuda["peak_reserved_bytes"] - check["peak_reserved_bytes"]) / check["peak_reserved_bytes"]
        assert -0.03 <= allocated <= 0.10 and -0.05 <= reserved <= 0.15, (result["mode"], allocated, reserved)
    assert results["bf16-true"]["check"]["peak_allocated_bytes"] < results["baseline"]["check"]["peak_allocated_bytes"]
