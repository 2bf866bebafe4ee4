"""Users' real models: Hugging Face transformers (GPT-2, Llama, BERT from small configs, no download) and a peft LoRA,
each fed an attention mask by its loader, in fp32 and bf16 autocast and checkpointed. The estimate on fake tensors
equals the real step's absolute peak, counted by tests/helpers/dispatch_counter.py (no code shared with memkit).

Each library check the fake step must answer as the real step does is pinned here, so a transformers release that
changes it fails a test that names it.
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_memkit import estimate_memory, parse_mode
from tests.helpers.dispatch_counter import StorageCounter
from tests.helpers.fit_count import closure_bytes, fit_peak_bytes

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH, LAYERS = 128, 64, 4, 4


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB,
            n_embd=64,
            n_layer=LAYERS,
            n_head=4,
            n_positions=SEQ,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
        )
        return transformers.GPT2LMHeadModel(config)
    if kind in ("llama", "lora"):
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=LAYERS,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
            use_cache=False,
        )
        model = transformers.LlamaForCausalLM(config)
        if kind == "lora":
            peft = pytest.importorskip("peft")
            model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        return model
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForMaskedLM(config)


class HFModule(pl.LightningModule):
    """A LightningModule around a transformers model, as users write one: the loader gives token ids and an
    attention mask (all ones: no padding), the model's own loss."""

    def __init__(self, kind: str, mask: bool = True) -> None:
        super().__init__()
        self.model = _model(kind)
        self.batch_size = BATCH
        ids = torch.randint(0, VOCAB, (16, SEQ), generator=torch.Generator().manual_seed(0))
        self.data = TensorDataset(ids, torch.ones_like(ids)) if mask else TensorDataset(ids)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)

    def training_step(self, batch, batch_idx):
        ids = batch[0]
        return self.model(input_ids=ids, attention_mask=batch[1] if len(batch) > 1 else None, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def counted_real_peak(module: HFModule, mode: str) -> int:
    """Two real steps in Lightning's order (training_step under the precision's autocast, zero_grad, backward,
    optimizer step) on a copy, counted by StorageCounter: the absolute peak, parameters and batch included."""
    model = copy.deepcopy(module)
    model.train()
    batch = next(iter(model.train_dataloader()))
    if mode in ("checkpoint", "bf16+checkpoint"):
        from lightning_memkit.modes.checkpointing import apply_checkpointing

        apply_checkpointing(model, "auto")
    optimizer = model.configure_optimizers()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode.startswith("bf16"))
    counter = StorageCounter(existing=[*model.parameters(), *model.buffers(), *batch])
    with counter:
        for index in range(2):
            with autocast:
                loss = model.training_step(batch, index)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            del loss
            optimizer.step()
    return counter.peak_bytes


CASES = [(kind, mode) for kind in ("gpt2", "llama", "bert", "lora") for mode in ("baseline", "bf16")]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(("kind", "mode"), CASES, ids=[f"{k}-{m}" for k, m in CASES])
def test_estimate_with_the_loaders_attention_mask_equals_the_real_step(kind, mode):
    module = HFModule(kind)
    estimate = estimate_memory(module, BATCH, mode=mode, device="cpu")
    assert abs(estimate.peak_bytes - counted_real_peak(module, mode)) <= 64


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_checkpoint_mode_on_hf_decoders_equals_the_real_checkpointed_step(kind):
    # a fake step that built a (B, 1, L, L) mask would fail: "Attempting to broadcast a dimension of length 64"
    module = HFModule(kind)
    estimate = estimate_memory(module, BATCH, mode="checkpoint", device="cpu")
    assert abs(estimate.peak_bytes - counted_real_peak(module, "checkpoint")) <= 64
    assert estimate.peak_bytes < estimate_memory(module, BATCH, device="cpu").peak_bytes


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_with_and_without_the_all_ones_mask_the_estimate_is_the_same():
    # the real step drops an all-ones mask (SDPA's is_causal): so must the fake step
    masked = estimate_memory(HFModule("llama"), BATCH, device="cpu")
    unmasked = estimate_memory(HFModule("llama", mask=False), BATCH, device="cpu")
    assert masked.peak_bytes - unmasked.peak_bytes == BATCH * SEQ * 8  # the loader's int64 mask, nothing built from it
    assert masked.by_category["inputs"] - unmasked.by_category["inputs"] == BATCH * SEQ * 8


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(("kind", "mode"), [("llama", "bf16-true"), ("lora", "bf16-true+checkpoint")])
def test_a_bf16_true_fit_of_a_transformers_model_peaks_at_the_estimate(kind, mode):
    """Lightning's HalfPrecision converts the model (rotary frequencies included) and runs training_step with bf16 as
    the default dtype; a real fit, counted from its start, peaks at the estimate's bytes."""
    batch = next(iter(HFModule(kind).train_dataloader()))
    estimate = estimate_memory(HFModule(kind), batch=batch, mode=mode, device="cpu")
    callbacks = parse_mode(mode).trainer_kwargs("cpu", verbose=False, measure=False)["callbacks"]
    closure = closure_bytes(estimate.peak_phase, loss_bytes=4)  # transformers' loss is on fp32 logits
    assert fit_peak_bytes(HFModule(kind), batch, "bf16-true", callbacks) == estimate.peak_bytes + closure
    assert estimate.peak_bytes < estimate_memory(HFModule(kind), batch=batch, mode="bf16", device="cpu").peak_bytes


# ---- the library checks the fake step answers as the real step does ---------------------------------------------
def test_transformers_is_tracing_looks_at_the_tensor_type():
    """transformers builds the (B, 1, L, L) mask instead of dropping an all-ones one when ``is_tracing(mask)``, which
    is true for a FakeTensor: memkit keeps the loader's small integer/bool tensors real for that reason."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers.utils.import_utils import is_tracing

    mask = torch.ones(2, 8, dtype=torch.long)
    assert not is_tracing(mask)
    with FakeTensorMode() as mode:
        assert is_tracing(mode.from_tensor(mask))


def test_transformers_drops_an_all_ones_mask_for_sdpa_by_reading_its_values():
    from transformers.masking_utils import _ignore_bidirectional_mask_sdpa, _ignore_causal_mask_sdpa

    ones, padded = torch.ones(2, 8, dtype=torch.bool), torch.ones(2, 8, dtype=torch.bool)
    padded[0, -1] = False
    assert _ignore_causal_mask_sdpa(ones, 8, 8, 0, 0) and not _ignore_causal_mask_sdpa(padded, 8, 8, 0, 0)
    assert _ignore_bidirectional_mask_sdpa(ones, 8) and not _ignore_bidirectional_mask_sdpa(padded, 8)


def test_the_fake_step_keeps_the_loaders_mask_real_and_floats_fake():
    from lightning_memkit.estimate.fake.tensors import REAL_VALUES_NUMEL, keeps_real_values

    assert keeps_real_values(torch.ones(4, SEQ, dtype=torch.long)) and keeps_real_values(
        torch.ones(3, dtype=torch.bool)
    )
    assert not keeps_real_values(torch.ones(4, SEQ))  # activations' dtypes stay fake
    assert not keeps_real_values(torch.ones(REAL_VALUES_NUMEL + 1, dtype=torch.int8))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_cuda_target_bf16_decoder_runs_flash_attention_with_and_without_the_all_ones_mask():
    # with the mask built on fakes, SDPA got an attn_mask and the CUDA estimate assumed memory-efficient attention
    estimates = {
        mask: estimate_memory(HFModule("llama", mask=mask), BATCH, device="cuda", gpu="h100", mode="bf16")
        for mask in (True, False)
    }
    for estimate in estimates.values():
        (kernels,) = [note for note in estimate.notes if note.startswith("CUDA kernels assumed")]
        assert "attention: flash" in kernels
    assert estimates[True].peak_bytes - estimates[False].peak_bytes == BATCH * SEQ * 8  # the loader's mask only
