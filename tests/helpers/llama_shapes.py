"""Llama-shaped LightningModules as people fine-tune them: ``LlamaForCausalLM`` from a ``LlamaConfig`` (7B- or
70B-shaped, or smaller), optionally with peft LoRA adapters, trained with AdamW on random tokens.

Built on the meta device (``with torch.device("meta"):``, as ``memkit estimate --meta-init`` builds it), a 70B
model costs no memory to hold; the estimate needs only shapes. ``memkit estimate
tests/helpers/llama_shapes.py:LlamaFineTune --init-args '{"shape": "7b"}' --meta-init`` estimates it from the shell.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

#: the shapes of Llama-2-7B and Llama-2-70B (hidden size, layers, attention heads, key/value heads, MLP width,
#: vocabulary), and a small one whose real step runs on a CPU in seconds
SHAPES: dict[str, dict[str, int]] = {
    "7b": {"hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 32, "intermediate": 11008, "vocab": 32000},
    "70b": {"hidden": 8192, "layers": 80, "heads": 64, "kv_heads": 8, "intermediate": 28672, "vocab": 32000},
    "small": {"hidden": 1024, "layers": 8, "heads": 16, "kv_heads": 16, "intermediate": 2752, "vocab": 32000},
    # about 100M parameters (106.2M), grouped-query attention: the per-rank checks' real runs on CPU ranks
    "100m": {"hidden": 768, "layers": 8, "heads": 12, "kv_heads": 4, "intermediate": 2048, "vocab": 32000},
    # a few hundred thousand parameters: the per-rank checks that run on every `make test`
    "tiny": {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 512},
}

#: peft LoRA as fine-tuning recipes set it: rank 16 on the attention projections
LORA_RANK = 16
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def llama_config(shape: str):
    """The ``transformers.LlamaConfig`` of ``shape`` (a key of :data:`SHAPES`)."""
    import transformers

    size = SHAPES[shape]
    return transformers.LlamaConfig(
        vocab_size=size["vocab"],
        hidden_size=size["hidden"],
        intermediate_size=size["intermediate"],
        num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"],
        num_key_value_heads=size["kv_heads"],
        max_position_embeddings=4096,
        use_cache=False,
    )


class LlamaFineTune(pl.LightningModule):
    """One fine-tuning step of a Llama-shaped causal LM: random token ids of ``seq_len``, the model's own loss
    (``labels=input_ids``), AdamW over the trainable parameters (every one, or LoRA's adapters with ``lora=True``).
    """

    def __init__(self, shape: str = "7b", lora: bool = False, seq_len: int = 2048, batch_size: int = 1) -> None:
        super().__init__()
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r}; choose from: {', '.join(SHAPES)}")
        self.shape = shape
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.model = self.build_model(shape)
        if lora:
            import peft

            config = peft.LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules=list(LORA_TARGETS))
            self.model = peft.get_peft_model(self.model, config)
        vocab = SHAPES[shape]["vocab"]
        with torch.device("cpu"):  # the data is real even when the module is built on the meta device
            ids = torch.randint(0, vocab, (4 * batch_size, seq_len), generator=torch.Generator().manual_seed(0))
        self.data = TensorDataset(ids)

    def build_model(self, shape: str):
        """The ``LlamaForCausalLM`` of ``shape``, built in ``__init__``."""
        import transformers

        return transformers.LlamaForCausalLM(llama_config(shape))

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-5)


class LlamaModelParallel(LlamaFineTune):
    """Written as Lightning's ModelParallelStrategy docs write it: ``configure_model`` shards with FSDP2's
    ``fully_shard`` over ``self.device_mesh["data_parallel"]``, each decoder layer then the inner model, and
    ``training_step`` calls ``self.model(...)`` directly."""

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        if self.device_mesh is None:
            return
        dp_mesh = self.device_mesh["data_parallel"]
        if dp_mesh.size() > 1:
            for layer in self.model.model.layers:
                fully_shard(layer, mesh=dp_mesh)
            fully_shard(self.model, mesh=dp_mesh)


class LlamaFSDP(LlamaFineTune):
    """Written as Lightning's FSDPStrategy docs write it: the model is built in ``configure_model`` (under the
    strategy's init context, not in ``__init__``), the strategy wraps it (``auto_wrap_policy={LlamaDecoderLayer}``),
    and ``training_step`` calls ``self.model(...)`` directly."""

    def build_model(self, shape: str):
        return None

    def configure_model(self):
        if self.model is None:
            self.model = LlamaFineTune.build_model(self, self.shape)


class LlamaModelParallelKeepGathered(LlamaModelParallel):
    """:class:`LlamaModelParallel` whose layers stay gathered from forward to backward
    (``fully_shard(..., reshard_after_forward=False)``)."""

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        if self.device_mesh is None:
            return
        dp_mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=dp_mesh, reshard_after_forward=False)
        fully_shard(self.model, mesh=dp_mesh, reshard_after_forward=False)
