"""torchvision and timm models: the CPU estimate against the real step's absolute peak
(tests/helpers/dispatch_counter.py), in 32-true and bf16-mixed. torchvision does not import beside the CPU torch 2.13
wheel of the main environment: these tests run where it does (the torch 2.14 environment of the torch-versions matrix)
and are skipped, saying why, elsewhere."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_memkit import estimate_memory
from tests.helpers.dispatch_counter import StorageCounter

try:
    import timm
    import torchvision
except Exception as error:  # noqa: BLE001 - an ImportError, or torchvision's operator registration failing
    pytest.skip(
        f"torchvision/timm do not import here ({type(error).__name__}: {error}); run under the torch 2.14 "
        "environment (docs/versions.md)",
        allow_module_level=True,
    )

BATCH = 2


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "mobilenet_v3_small":
        return torchvision.models.mobilenet_v3_small(num_classes=10)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, num_classes=10)


class Classifier(pl.LightningModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.model = _model(kind)
        generator = torch.Generator().manual_seed(0)
        self.data = TensorDataset(
            torch.randn(8, 3, 32, 32, generator=generator), torch.randint(0, 10, (8,), generator=generator)
        )

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=BATCH)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        return torch.nn.functional.cross_entropy(self.model(images), labels)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def counted_real_peak(module: Classifier, mode: str) -> int:
    model = copy.deepcopy(module)
    model.train()
    batch = next(iter(model.train_dataloader()))
    optimizer = model.configure_optimizers()
    counter = StorageCounter(existing=[*model.parameters(), *model.buffers(), *batch])
    with counter:
        for index in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16"):
                loss = model.training_step(batch, index)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            del loss
            optimizer.step()
    return counter.peak_bytes


CASES = [(kind, mode) for kind in ("mobilenet_v3_small", "vit") for mode in ("baseline", "bf16")]


@pytest.mark.parametrize(("kind", "mode"), CASES, ids=[f"{k}-{m}" for k, m in CASES])
def test_estimate_equals_the_real_step(kind, mode):
    module = Classifier(kind)
    assert (
        abs(estimate_memory(module, BATCH, mode=mode, device="cpu").peak_bytes - counted_real_peak(module, mode)) <= 64
    )
