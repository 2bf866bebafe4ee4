"""Built-in LightningModules whose batches change shape: text padded per batch (optionally bucketed) and images
of varying size, on synthetic data, for examples, benchmarks and the worst-batch tests.

Each dataset is fixed by its seed, so every run sees the same samples; the loaders shuffle with a seeded generator.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import lightning.pytorch as pl
import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

__all__ = [
    "VariableLengthText",
    "pad_collate",
    "BucketBatchSampler",
    "PaddedTextDataModule",
    "PaddedTextClassifier",
    "VaryingSizeImages",
    "VaryingImageDataModule",
    "VaryingImageClassifier",
]


class VariableLengthText(Dataset):
    """Token sequences of lengths drawn uniformly in ``[min_length, max_length]``, each with a label.

    A sample is ``{"input_ids": LongTensor(length), "label": LongTensor()}``; the label is a function of the first
    token, so the task can be learnt.
    """

    def __init__(
        self,
        size: int = 512,
        min_length: int = 16,
        max_length: int = 256,
        vocab_size: int = 1000,
        num_classes: int = 4,
        seed: int = 0,
    ) -> None:
        if not 1 <= min_length <= max_length:
            raise ValueError(f"need 1 <= min_length <= max_length, got {min_length} and {max_length}")
        generator = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(min_length, max_length + 1, (size,), generator=generator).tolist()
        # token 0 is padding, so ids start at 1
        self.tokens = [torch.randint(1, vocab_size, (length,), generator=generator) for length in self.lengths]
        self.num_classes = num_classes

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = self.tokens[index]
        return {"input_ids": tokens, "label": tokens[0] % self.num_classes}


def pad_collate(samples: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Pad a list of :class:`VariableLengthText` samples to the longest one: ``input_ids`` and ``attention_mask``
    ``(batch, longest)``, ``labels`` ``(batch,)``."""
    longest = max(len(sample["input_ids"]) for sample in samples)
    input_ids = torch.zeros(len(samples), longest, dtype=torch.long)
    attention_mask = torch.zeros(len(samples), longest, dtype=torch.long)
    for row, sample in enumerate(samples):
        length = len(sample["input_ids"])
        input_ids[row, :length] = sample["input_ids"]
        attention_mask[row, :length] = 1
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": torch.stack([sample["label"] for sample in samples]),
    }


class BucketBatchSampler(Sampler[list[int]]):
    """Batches of similar lengths: indices sorted by length, cut into batches, the batches shuffled (seeded).

    Args:
        lengths: each sample's length.
        batch_size: samples per batch (the last batch may be smaller).
        seed: the shuffle's seed; the order changes every epoch.
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, seed: int = 0) -> None:
        self.lengths = list(lengths)
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0

    def _batches(self) -> list[list[int]]:
        order = sorted(range(len(self.lengths)), key=lambda index: self.lengths[index])
        return [order[start : start + self.batch_size] for start in range(0, len(order), self.batch_size)]

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._batches()
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        self.epoch += 1
        for index in torch.randperm(len(batches), generator=generator).tolist():
            yield batches[index]

    def __len__(self) -> int:
        return len(self._batches())


class PaddedTextDataModule(pl.LightningDataModule):
    """Variable-length text padded per batch, shuffled (seeded) or bucketed by length.

    ``batch_size`` is a public attribute, so batch-size searches can set it.
    """

    def __init__(
        self,
        batch_size: int = 16,
        train_size: int = 512,
        min_length: int = 16,
        max_length: int = 256,
        vocab_size: int = 1000,
        num_classes: int = 4,
        bucketed: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.bucketed = bucketed
        self.seed = seed
        self.train_set = VariableLengthText(train_size, min_length, max_length, vocab_size, num_classes, seed)

    def train_dataloader(self) -> DataLoader:
        if self.bucketed:
            sampler = BucketBatchSampler(self.train_set.lengths, self.batch_size, self.seed)
            return DataLoader(self.train_set, batch_sampler=sampler, collate_fn=pad_collate)
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=True,
            collate_fn=pad_collate,
            generator=torch.Generator().manual_seed(self.seed),
        )


class PaddedTextClassifier(pl.LightningModule):
    """A BERT-like encoder classifier: token and position embeddings, ``layers`` encoder blocks that mask padding,
    the first token's state, a linear head; AdamW; torchmetrics accuracy and F1 on ``argmax`` predictions in
    every training step (the usual pattern, whose input checks call ``torch.unique``).

    With the defaults it has 0.18M parameters; ``d_model=256, layers=6, dim_feedforward=1024`` has 5.0M.
    """

    def __init__(
        self,
        vocab_size: int = 1000,
        d_model: int = 64,
        nhead: int = 4,
        layers: int = 2,
        dim_feedforward: int = 256,
        max_length: int = 256,
        num_classes: int = 4,
        lr: float = 1e-3,
        batch_size: int = 16,
        min_length: int = 16,
        train_size: int = 512,
        bucketed: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.batch_size = batch_size
        self.embedding = nn.Embedding(vocab_size, d_model, padding_idx=0)
        self.position = nn.Embedding(max_length, d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, num_classes)
        self.train_accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)
        self.train_f1 = torchmetrics.F1Score(task="multiclass", num_classes=num_classes, average="macro")

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden = self.embedding(input_ids) + self.position(positions)
        hidden = self.encoder(hidden, src_key_padding_mask=attention_mask == 0)
        return self.head(hidden[:, 0])

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self(batch["input_ids"], batch["attention_mask"])
        loss = nn.functional.cross_entropy(logits, batch["labels"])
        predictions = logits.argmax(dim=-1)
        self.train_accuracy(predictions, batch["labels"])
        self.train_f1(predictions, batch["labels"])
        self.log_dict({"train_loss": loss, "train_acc": self.train_accuracy, "train_f1": self.train_f1})
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])

    def datamodule(self) -> PaddedTextDataModule:
        """The synthetic data this model trains on, at its current ``batch_size``."""
        hp = self.hparams
        return PaddedTextDataModule(
            self.batch_size,
            hp["train_size"],
            hp["min_length"],
            hp["max_length"],
            hp["vocab_size"],
            hp["num_classes"],
            hp["bucketed"],
        )

    def train_dataloader(self) -> DataLoader:
        # a fresh loader each time, so a batch-size search that changes self.batch_size takes effect
        return self.datamodule().train_dataloader()


class VaryingSizeImages(Dataset):
    """Square RGB images whose side is drawn from ``sizes`` (seeded), each with a label; ``(image, label)``."""

    def __init__(
        self, size: int = 256, sizes: Sequence[int] = (32, 48, 64, 96), num_classes: int = 10, seed: int = 0
    ) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.sides = [sizes[i] for i in torch.randint(0, len(sizes), (size,), generator=generator).tolist()]
        self.seeds = torch.randint(0, 2**31 - 1, (size,), generator=generator).tolist()
        self.num_classes = num_classes

    def __len__(self) -> int:
        return len(self.sides)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        side = self.sides[index]
        image = torch.randn(3, side, side, generator=torch.Generator().manual_seed(self.seeds[index]))
        return image, torch.tensor(self.seeds[index] % self.num_classes)


def _resize_collate(samples: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad each image (bottom and right, zeros) to the batch's largest side."""
    side = max(image.shape[-1] for image, _ in samples)
    images = torch.zeros(len(samples), 3, side, side)
    for row, (image, _) in enumerate(samples):
        images[row, :, : image.shape[-2], : image.shape[-1]] = image
    return images, torch.stack([label for _, label in samples])


class VaryingImageDataModule(pl.LightningDataModule):
    """Images of varying side, padded per batch to the batch's largest, shuffled with a seeded generator."""

    def __init__(
        self,
        batch_size: int = 16,
        train_size: int = 256,
        sizes: Sequence[int] = (32, 48, 64, 96),
        num_classes: int = 10,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.seed = seed
        self.train_set = VaryingSizeImages(train_size, sizes, num_classes, seed)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=True,
            collate_fn=_resize_collate,
            generator=torch.Generator().manual_seed(self.seed),
        )


class VaryingImageClassifier(pl.LightningModule):
    """A small fully convolutional classifier (conv-BN-ReLU blocks, global average pool, linear) that takes any
    image size; Adam; cross-entropy."""

    def __init__(
        self,
        channels: int = 16,
        blocks: int = 3,
        num_classes: int = 10,
        lr: float = 1e-3,
        batch_size: int = 16,
        sizes: Sequence[int] = (32, 48, 64, 96),
        train_size: int = 256,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.batch_size = batch_size
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
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_channels, num_classes))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = nn.functional.cross_entropy(self(images), labels)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams["lr"])

    def datamodule(self) -> VaryingImageDataModule:
        """The synthetic data this model trains on, at its current ``batch_size``."""
        hp = self.hparams
        return VaryingImageDataModule(self.batch_size, hp["train_size"], tuple(hp["sizes"]), hp["num_classes"])

    def train_dataloader(self) -> DataLoader:
        return self.datamodule().train_dataloader()
