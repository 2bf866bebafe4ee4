"""Compiled models for tests/compiled/test_compile.py: a Hugging Face GPT-2 (small config, no download) and a
BatchNorm CNN, each a LightningModule whose inner model is ``torch.compile``d (``backend="aot_eager"`` by
default: AOT autograd's joint graph and partitioner as inductor gets them, without C++ compilation, so fast on CPU)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def tiny_gpt2(layers: int = 2, width: int = 32, vocab: int = 128, positions: int = 32) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=layers,
        n_embd=width,
        n_head=2,
        vocab_size=vocab,
        n_positions=positions,
        bos_token_id=0,
        eos_token_id=0,
        loss_type="ForCausalLM",
        use_cache=False,
    )
    config.attn_implementation = "eager"
    return GPT2LMHeadModel(config)


class CompiledGPT2(pl.LightningModule):
    """GPT-2 (Hugging Face, small config), its inner model compiled; batch: token ids ``(B, T)``."""

    def __init__(
        self,
        compile: bool = True,
        backend: str = "aot_eager",
        layers: int = 2,
        width: int = 32,
        seq_len: int = 16,
        batch_size: int = 4,
        samples: int = 48,
        leak: bool = False,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        model = tiny_gpt2(layers, width, positions=seq_len)
        if dropout == 0.0:
            model.config.resid_pdrop = model.config.embd_pdrop = model.config.attn_pdrop = 0.0
            for module in model.modules():
                if isinstance(module, nn.Dropout):
                    module.p = 0.0
        self.model = torch.compile(model, backend=backend) if compile else model
        self.batch_size = batch_size
        self.data = torch.randint(0, 128, (samples, seq_len), generator=torch.Generator().manual_seed(0))
        self.leak = leak
        self.kept: list[torch.Tensor] = []
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        output = self.model(input_ids=tokens, labels=tokens)
        loss = output.loss
        if self.leak:
            self.kept.append(
                (loss, output.logits)
            )  # the planted leak: each step's loss and logits kept with their graph
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.data), batch_size=self.batch_size, drop_last=True)


class CompiledCNN(pl.LightningModule):
    """A small BatchNorm CNN in a plain ``nn.Sequential``, compiled; batch: images ``(B, 3, 16, 16)``, labels."""

    def __init__(
        self,
        compile: bool = True,
        backend: str = "aot_eager",
        batch_size: int = 8,
        samples: int = 64,
        leak: bool = False,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for width in (8, 16, 16, 16):
            layers += [nn.Conv2d(channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
            channels = width
        net = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10))
        self.net = torch.compile(net, backend=backend) if compile else net
        self.batch_size = batch_size
        generator = torch.Generator().manual_seed(0)
        self.images = torch.randn(samples, 3, 16, 16, generator=generator)
        self.labels = torch.randint(0, 10, (samples,), generator=generator)
        self.leak = leak
        self.kept: list[torch.Tensor] = []
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        images, labels = batch
        logits = self.net(images)
        loss = F.cross_entropy(logits, labels)
        if self.leak:
            self.kept.append((loss, logits))  # the planted leak: each step's loss and logits kept with their graph
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.images, self.labels), batch_size=self.batch_size, drop_last=True)


class CountingBackend:
    """A ``torch.compile`` backend that counts: graphs compiled (``compiled``) and calls of compiled forward
    graphs (``calls``), so a test sees that compiled code ran at each step. Compiles with ``inner``."""

    def __init__(self, inner: str = "aot_eager") -> None:
        self.inner = inner
        self.compiled = 0
        self.calls = 0

    def __call__(self, graph_module, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend

        compiled = lookup_backend(self.inner)(graph_module, example_inputs)
        self.compiled += 1

        def run(*args):
            self.calls += 1
            return compiled(*args)

        return run


class GraphCallsPerStep(pl.Callback):
    """Records, per training step, how many compiled graphs ran (from a :class:`CountingBackend`)."""

    def __init__(self, backend: CountingBackend) -> None:
        self.backend = backend
        self.per_step: list[int] = []
        self._start = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = self.backend.calls

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.per_step.append(self.backend.calls - self._start)
