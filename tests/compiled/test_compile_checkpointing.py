"""ActivationCheckpointing on a Hugging Face GPT-2 whose inner model is ``torch.compile``d in the LightningModule,
and the rule that makes it work: a checkpointed block runs without its key/value cache.

GPT-2's config has ``use_cache=True``, so in training too its blocks append each forward's keys to a cache. With the
cache on, a checkpointed block's recompute would append them again: the recomputed attention would see ``2 * T`` keys.
Eager with no mask, sdpa's causal path takes that; with a ``(B, 1, T, T)`` mask (a padded batch, or any mask under
dynamo, where transformers cannot read that an all-ones mask is all ones) it crashes: "The size of tensor a (128) must
match the size of tensor b (64) at non-singleton dimension 3". Models from configs, no download; ``backend="aot_eager"``
(AOT autograd's joint graph and partitioner, without C++ compilation) through a counting backend.
"""

from __future__ import annotations

import gc

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memkit import ActivationCheckpointing
from lightning_memkit.modes.checkpointing import apply_checkpointing
from tests.helpers.compile_models import CountingBackend, GraphCallsPerStep
from tests.helpers.trainers import make_trainer

SEQ = 64  # half of n_positions: the cache doubled the keys to 128, the mask stayed 64 wide


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    gc.collect()
    yield
    torch._dynamo.reset()


class PaddedGPT2(pl.LightningModule):
    """GPT-2 (2 layers, width 64, 4 heads, 128 positions, vocabulary 256; its config's defaults otherwise:
    ``use_cache=True``, sdpa attention), compiled in ``__init__`` as users do; a batch is what a tokenizer pads:
    token ids, an attention mask (some rows right-padded) and labels (-100 on the padding)."""

    def __init__(self, backend=None, batch_size: int = 4, samples: int = 12) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            n_layer=2,
            n_embd=64,
            n_head=4,
            n_positions=128,
            vocab_size=256,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
            loss_type="ForCausalLM",
        )
        assert config.use_cache  # the trigger: the default
        self.model = GPT2LMHeadModel(config)
        if backend is not None:
            self.model = torch.compile(self.model, backend=backend)
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(1, 256, (samples, SEQ), generator=generator)
        lengths = torch.randint(SEQ // 2, SEQ + 1, (samples,), generator=generator)
        lengths[::2] = SEQ  # every other sample unpadded
        self.mask = (torch.arange(SEQ) < lengths[:, None]).long()
        self.tokens[self.mask == 0] = 0
        self.batch_size = batch_size
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        tokens, mask = batch
        labels = tokens.masked_fill(mask == 0, -100)
        return self.model(input_ids=tokens, attention_mask=mask, labels=labels).loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())  # the training steps' losses (not the measuring forwards')

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.tokens, self.mask), batch_size=self.batch_size)


def _fit(model, tmp_path, callbacks):
    pl.seed_everything(0, verbose=False)
    make_trainer(tmp_path, max_steps=3, callbacks=callbacks).fit(model)
    return model


def test_a_compiled_gpt2_trains_checkpointed_with_the_eager_checkpointed_losses(tmp_path):
    backend = CountingBackend()
    torch.manual_seed(0)
    compiled = PaddedGPT2(backend=backend)
    torch.manual_seed(0)
    eager = PaddedGPT2()
    torch.manual_seed(0)
    unchecked = PaddedGPT2()
    counts = GraphCallsPerStep(backend)
    checkpointing = ActivationCheckpointing("auto", verbose=False)
    _fit(compiled, tmp_path / "compiled", [checkpointing, counts])
    _fit(eager, tmp_path / "eager", [ActivationCheckpointing("auto", verbose=False)])
    _fit(unchecked, tmp_path / "unchecked", [])

    # "auto" leaves the last block alone (backward would recompute it at once): h.0 is checkpointed
    assert checkpointing.plan is not None and checkpointing.plan.names == ["model._orig_mod.transformer.h.0"]
    assert backend.compiled >= 1 and len(counts.per_step) == 3 and all(calls >= 1 for calls in counts.per_step)
    assert len(compiled.losses) == 3
    # aot_eager runs the same aten ops as eager on CPU: the losses and the trained weights are equal bit for bit
    assert compiled.losses == eager.losses == unchecked.losses, (compiled.losses, eager.losses, unchecked.losses)
    for (name, a), (_, b) in zip(compiled.model.named_parameters(), eager.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name


class _CachingBlock(nn.Module):
    """A block that appends its input to a cache it is given, as a key/value cache does."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.seen: list[tuple] = []

    def forward(self, x, cache=None, *, use_cache=False, **kwargs):
        self.seen.append((cache is None, use_cache, kwargs.get("past_key_values") is None))
        if cache is not None:
            cache.append(x)
        return torch.tanh(self.linear(x))


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_CachingBlock(), _CachingBlock()])

    def forward(self, x, cache=None, by_keyword=False):
        for block in self.blocks:
            if by_keyword:
                x = block(x, cache=cache, use_cache=True, past_key_values=cache)
            else:
                x = block(x, cache, use_cache=True)
        return x


@pytest.mark.parametrize("by_keyword", [False, True], ids=["positional", "keyword"])
def test_a_checkpointed_block_runs_without_its_cache_with_gradients_and_with_it_without(by_keyword):
    stack = _Stack()
    handle = apply_checkpointing(stack, {_CachingBlock})
    assert handle.plan.count == 2
    x = torch.randn(3, 4, requires_grad=True)
    cache: list[torch.Tensor] = []
    stack(x, cache, by_keyword).sum().backward()
    assert cache == []  # neither the forward nor the recompute appended
    for block in stack.blocks:
        assert block.seen and all(seen == (True, False, True) for seen in block.seen), block.seen
        block.seen.clear()
    with torch.no_grad():
        stack(x, cache, by_keyword)  # no backward, no recompute: runs as given
    assert len(cache) == 2
    assert all(block.seen == [(False, True, not by_keyword)] for block in stack.blocks)
    handle.remove()
    assert not any("forward" in block.__dict__ for block in stack.blocks)


def test_a_block_that_only_reads_its_cache_keeps_it():
    stack = _Stack()
    for block in stack.blocks:
        block._can_checkpoint_with_cache = True  # transformers' flag for a layer that only reads its cache
    apply_checkpointing(stack, {_CachingBlock})
    stack(torch.randn(3, 4, requires_grad=True), [], False).sum().backward()
    assert all(seen == (False, False, True) for block in stack.blocks for seen in block.seen)
