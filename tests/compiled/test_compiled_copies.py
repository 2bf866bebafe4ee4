"""Copies of a module that ``trainer.fit(torch.compile(model))`` compiled: Lightning's ``from_compiled`` puts compiled
wrappers of the module's bound methods on the instance, and memkit's copies (a plan's trial, an estimate's fake step)
must run their own parameters through them, never the original's (lightning_memkit/_lightning_compat.copy_module).
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.compile import from_compiled

from lightning_memkit import estimate_memory
from lightning_memkit.compiled import compiled_parts
from lightning_memkit.plan import lightning_runs, trials
from lightning_memkit.plan.space import Candidate

GiB = 1 << 30
FEATURES, OUTPUTS, ROWS = 16, 8, 4


class _Linear(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(FEATURES, OUTPUTS)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        return self(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _compiled(compiles: list | None = None) -> _Linear:
    """A ``_Linear`` as Lightning's fit makes it from ``torch.compile(model)`` (``from_compiled``); ``compiles``
    collects one entry per graph the backend compiles."""

    def backend(graph, inputs):
        if compiles is not None:
            compiles.append(graph)
        return graph.forward

    torch.manual_seed(0)
    return from_compiled(torch.compile(_Linear(), backend=backend))


def _batch() -> torch.Tensor:
    return torch.randn(ROWS, FEATURES, generator=torch.Generator().manual_seed(1))


def test_a_trials_copy_of_a_compiled_module_computes_with_its_own_parameters():
    module = _compiled()
    copied = lightning_runs.copy_of(module)
    batch = _batch()
    expected = copied.layer(batch).pow(2).mean().detach()  # the copy's weights, through no compiled method
    with torch.no_grad():
        module.layer.weight.zero_()  # the original changes after the copy: the copy must not see it
    loss = copied.training_step(batch, 0)
    assert torch.equal(loss.detach(), expected)
    loss.backward()
    assert copied.layer.weight.grad is not None and module.layer.weight.grad is None
    assert "training_step" in compiled_parts(copied) and compiled_parts(copied) == compiled_parts(module)


def test_a_trial_of_a_compiled_module_trains_the_copy_and_leaves_the_original_untouched():
    compiles: list = []
    module = _compiled(compiles)
    before = {name: tensor.clone() for name, tensor in module.state_dict().items()}
    record = trials.trial(module, Candidate(ROWS, 1), _batch(), GiB, "cpu", trials.TrialSteps(1, 2))
    fits, peak, note = record.fits, record.peak_bytes, record.note
    assert fits, note
    assert all(torch.equal(module.state_dict()[name], tensor) for name, tensor in before.items())
    assert all(parameter.grad is None for parameter in module.parameters())
    weights = sum(p.numel() * p.element_size() for p in module.parameters())
    assert peak >= 2 * weights  # the copy's weights and their gradients were counted
    assert compiles  # the copy's timing ran compiled


def test_an_estimate_of_a_compiled_module_counts_its_copys_gradients_and_leaves_the_original_alone():
    module = _compiled()
    estimate = estimate_memory(module, batch=_batch(), device="cpu")
    weights = sum(p.numel() * p.element_size() for p in module.parameters())
    assert estimate.by_category["parameters"] == weights
    assert estimate.by_category["gradients"] == weights
    assert all(parameter.grad is None for parameter in module.parameters())
