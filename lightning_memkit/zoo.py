"""Small built-in LightningModules on synthetic data, for the demo, examples and benchmarks.

No downloads, no torchvision: each model's tensor sizes are simple enough to compute by hand.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, Dataset

__all__ = ["SyntheticClassification", "SyntheticDataModule", "DemoMLP", "DemoCNN", "DemoTransformer", "DemoResNet"]


class SyntheticClassification(Dataset):
    """A fixed random classification set whose label is a learnable function of the input.

    Args:
        size: number of samples.
        input_shape: shape of one input (e.g. ``(64,)`` or ``(3, 32, 32)``); for token inputs
            pass ``vocab_size`` and a ``(seq_len,)`` shape.
        num_classes: number of labels.
        vocab_size: if given, inputs are int64 token ids in ``[0, vocab_size)``.
        seed: the generator seed, so every run sees the same data.
    """

    def __init__(
        self,
        size: int = 512,
        input_shape: tuple[int, ...] = (64,),
        num_classes: int = 10,
        vocab_size: int | None = None,
        seed: int = 0,
    ) -> None:
        generator = torch.Generator().manual_seed(seed)
        if vocab_size:
            self.inputs = torch.randint(0, vocab_size, (size, *input_shape), generator=generator)
            self.labels = self.inputs[:, 0] % num_classes
        else:
            self.inputs = torch.randn(size, *input_shape, generator=generator)
            weights = torch.randn(math.prod(input_shape), num_classes, generator=generator)
            self.labels = (self.inputs.flatten(1) @ weights).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int):
        return self.inputs[index], self.labels[index]


class SyntheticDataModule(pl.LightningDataModule):
    """Train and validation loaders over :class:`SyntheticClassification`.

    ``batch_size`` is a public attribute, so Lightning's and memkit's batch-size searches can set it.
    """

    def __init__(
        self,
        batch_size: int = 32,
        train_size: int = 512,
        val_size: int = 128,
        input_shape: tuple[int, ...] = (64,),
        num_classes: int = 10,
        vocab_size: int | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.train_set = SyntheticClassification(train_size, input_shape, num_classes, vocab_size, seed)
        self.val_set = SyntheticClassification(val_size, input_shape, num_classes, vocab_size, seed + 1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, generator=torch.Generator().manual_seed(0)
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)


class _Classifier(pl.LightningModule):
    """Shared training logic: cross-entropy, Adam, and a torchmetrics accuracy on validation."""

    #: samples per batch: a public attribute that Lightning's and memkit's batch-size searches set
    batch_size: int

    def __init__(self, num_classes: int, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.val_accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)

    def training_step(self, batch, batch_idx):
        inputs, labels = batch
        loss = nn.functional.cross_entropy(self(inputs), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        inputs, labels = batch
        logits = self(inputs)
        self.log("val_loss", nn.functional.cross_entropy(logits, labels), sync_dist=True)
        self.val_accuracy(logits, labels)
        self.log("val_acc", self.val_accuracy)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)

    def _data(self) -> SyntheticDataModule:
        raise TypeError(f"{type(self).__name__} must define _data(): the synthetic data it trains on")

    def train_dataloader(self) -> DataLoader:
        # a fresh datamodule each time, so a batch-size search that changes self.batch_size takes effect
        return self._data().train_dataloader()

    def val_dataloader(self) -> DataLoader:
        return self._data().val_dataloader()


def _image_data(model: _Classifier) -> SyntheticDataModule:
    size = model.hparams["image_size"]
    return SyntheticDataModule(
        model.batch_size,
        train_size=256,
        val_size=64,
        input_shape=(3, size, size),
        num_classes=model.hparams["num_classes"],
    )


class DemoMLP(_Classifier):
    """A stack of Linear+ReLU layers: ``in_features -> hidden x depth -> num_classes``."""

    def __init__(
        self,
        in_features: int = 64,
        hidden: int = 256,
        depth: int = 3,
        num_classes: int = 10,
        lr: float = 1e-3,
        batch_size: int = 32,
    ) -> None:
        super().__init__(num_classes, lr)
        self.save_hyperparameters()
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)
        self.batch_size = batch_size

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs)

    def _data(self) -> SyntheticDataModule:
        return SyntheticDataModule(
            self.batch_size, input_shape=(self.hparams["in_features"],), num_classes=self.hparams["num_classes"]
        )


class DemoCNN(_Classifier):
    """A small VGG-like CNN: ``blocks`` x (conv3x3 -> BatchNorm -> ReLU -> maxpool2), then linear."""

    def __init__(
        self,
        channels: int = 16,
        blocks: int = 2,
        image_size: int = 32,
        num_classes: int = 10,
        dropout: float = 0.1,
        lr: float = 1e-3,
        batch_size: int = 32,
    ) -> None:
        super().__init__(num_classes, lr)
        self.save_hyperparameters()
        layers: list[nn.Module] = []
        in_channels = 3
        for index in range(blocks):
            out_channels = channels * 2**index
            layers += [
                nn.Conv2d(in_channels, out_channels, 3, padding=1),
                nn.BatchNorm2d(out_channels),
                nn.ReLU(),
                nn.MaxPool2d(2),
            ]
            in_channels = out_channels
        self.features = nn.Sequential(*layers)
        side = image_size // 2**blocks
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(in_channels * side * side, num_classes))
        self.batch_size = batch_size

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(inputs))

    def _data(self) -> SyntheticDataModule:
        return _image_data(self)


class DemoTransformer(_Classifier):
    """A transformer encoder classifier over token ids: embedding, ``layers`` encoder blocks, mean-pool, linear."""

    def __init__(
        self,
        vocab_size: int = 1000,
        d_model: int = 128,
        nhead: int = 4,
        layers: int = 4,
        dim_feedforward: int = 512,
        seq_len: int = 64,
        num_classes: int = 10,
        dropout: float = 0.1,
        lr: float = 1e-3,
        batch_size: int = 16,
    ) -> None:
        super().__init__(num_classes, lr)
        self.save_hyperparameters()
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.position = nn.Parameter(torch.zeros(seq_len, d_model))
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout, batch_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(d_model, num_classes)
        self.batch_size = batch_size

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embedding(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden.mean(dim=1))

    def _data(self) -> SyntheticDataModule:
        hp = self.hparams
        return SyntheticDataModule(
            self.batch_size,
            train_size=256,
            val_size=64,
            input_shape=(hp["seq_len"],),
            num_classes=hp["num_classes"],
            vocab_size=hp["vocab_size"],
        )


class _BasicBlock(nn.Module):
    """ResNet's basic block: conv3x3-BN-ReLU-conv3x3-BN plus a (projected) shortcut, then ReLU."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.bn1(self.conv1(inputs)))
        return torch.relu(self.bn2(self.conv2(hidden)) + self.shortcut(inputs))


class DemoResNet(_Classifier):
    """A small ResNet: stem conv, ``len(stages)`` stages (``nn.Sequential`` of basic blocks, channels doubling,
    stride 2 from the second stage), global average pool, dropout, linear. ``stages=(2, 2, 2, 2)`` with
    ``channels=64`` is ResNet-18's layout."""

    def __init__(
        self,
        channels: int = 16,
        stages: tuple[int, ...] = (2, 2, 2),
        image_size: int = 32,
        num_classes: int = 10,
        dropout: float = 0.1,
        lr: float = 1e-3,
        batch_size: int = 32,
    ) -> None:
        super().__init__(num_classes, lr)
        self.save_hyperparameters()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, 1, 1, bias=False), nn.BatchNorm2d(channels), nn.ReLU())
        layers = []
        in_channels = channels
        for index, count in enumerate(stages):
            out_channels = channels * 2**index
            blocks = [_BasicBlock(in_channels, out_channels, 1 if index == 0 else 2)]
            blocks += [_BasicBlock(out_channels, out_channels) for _ in range(count - 1)]
            layers.append(nn.Sequential(*blocks))
            in_channels = out_channels
        self.layers = nn.ModuleList(layers)
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(dropout), nn.Linear(in_channels, num_classes)
        )
        self.batch_size = batch_size

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = self.stem(inputs)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.head(hidden)

    def _data(self) -> SyntheticDataModule:
        return _image_data(self)
