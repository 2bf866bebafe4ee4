"""A plan's trial that fails with an error other than running out of memory still cleans up after itself: dynamo's
caches are reset (a compiled module's next call compiles afresh, as the real fit's will) and its error, which goes on
to the caller, holds none of the trial's tensors (counted with ``gc``)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities.compile import from_compiled

from lightning_memkit.plan import trials
from lightning_memkit.plan.space import Candidate
from tests.helpers.live_tensors import live_tensors, storage_bytes

GiB = 1 << 30
FEATURES, OUTPUTS, ROWS = 64, 32, 4


class _FailsMidTiming(pl.LightningModule):
    """A Linear whose fourth training batch fails with a ValueError: after the trial's two budgeted steps (run
    eagerly) and its first timed step (compiled), so the failure comes with compiled code in dynamo's caches."""

    FAILING_BATCH = 4

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(FEATURES, OUTPUTS)
        self.batches = 0

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        return self(batch).pow(2).mean()

    def on_train_batch_start(self, batch, batch_idx):  # not compiled: from_compiled compiles the step methods only
        self.batches += 1
        if self.batches == self.FAILING_BATCH:
            raise ValueError("planted in the trial's fourth batch")

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


@pytest.mark.timeout(300)
def test_a_trial_failing_with_another_error_resets_dynamo_and_its_error_holds_no_tensor_of_it():
    compiles: list = []

    def backend(graph, inputs):
        compiles.append(graph)
        return graph.forward

    torch.manual_seed(0)
    module = from_compiled(torch.compile(_FailsMidTiming(), backend=backend))
    batch = torch.randn(ROWS, FEATURES, generator=torch.Generator().manual_seed(1))
    before = storage_bytes(live_tensors())
    with pytest.raises(ValueError, match="planted") as failed:
        trials.trial(module, Candidate(ROWS, 1), batch, GiB, "cpu", trials.TrialSteps(1, 2))
    # the error is still held here (as a caller's traceback would hold it): the trial's copy, its gradients and
    # Adam's state are not alive through it
    assert storage_bytes(live_tensors()) == before
    assert failed.value is not None
    compiled_in_the_trial = len(compiles)
    assert compiled_in_the_trial >= 1  # its timed step ran compiled before the failure
    module.training_step(batch, 0)  # the original, at the trial's shape: its code was the trial's code
    assert len(compiles) == compiled_in_the_trial + 1  # compiled afresh: the trial's cache entry is gone
