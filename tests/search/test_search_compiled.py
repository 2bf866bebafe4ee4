"""The batch-size search of a compiled module: dynamo's caches are reset before and after each trial, so what the
trials left in them (compiled code for other sizes) never makes the fit after the search recompile past the limit or
run uncompiled; and an estimate runs compiled code eagerly without making dynamo skip it afterwards. On CPU every trial
runs eagerly inside its memory budget; the fit after the search is the compiled run to check."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memkit.callbacks.max_batch_size import MaxBatchSize

FEATURES, HIDDEN, CLASSES, SAMPLES = 32, 64, 4, 512


class _CountingBackend:
    """A compile backend that records each graph it compiles (its inputs' shapes) and each call of compiled code."""

    def __init__(self) -> None:
        self.compiled: list[list[tuple[int, ...]]] = []
        self.calls = 0

    def __call__(self, graph, inputs):
        self.compiled.append([tuple(each.shape) for each in inputs if isinstance(each, torch.Tensor)])

        def run(*args):
            self.calls += 1
            return graph.forward(*args)

        return run


class _CompiledMLP(pl.LightningModule):
    def __init__(self, backend: _CountingBackend) -> None:
        super().__init__()
        self.batch_size = 4
        net = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))
        self.net = torch.compile(net, backend=backend, dynamic=False)
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, FEATURES, generator=generator)
        self.y = torch.randint(0, CLASSES, (SAMPLES,), generator=generator)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size, drop_last=True)


class _AtTheFitsFirstBatch(pl.Callback):
    """What the backend had done when the fit's own first batch started (the search's trials run without it)."""

    def __init__(self, backend: _CountingBackend) -> None:
        self.backend, self.compiled, self.calls = backend, None, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.compiled is None:
            self.compiled, self.calls = len(self.backend.compiled), self.backend.calls


def _trainer(tmp_path, steps: int, callbacks: list) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        callbacks=callbacks,
    )


@pytest.mark.timeout(300)
def test_a_search_after_a_compiled_fit_leaves_the_next_fit_compiling_at_the_size_found(tmp_path):
    """The module trained compiled at batch 4 before the search (a first fit, or epochs before a search started
    mid-training), under a recompile limit of 1: had its cached code survived the search, the fit at the size found
    would be a recompile past the limit, and run uncompiled."""
    # dynamo's own config.patch, not monkeypatch: monkeypatch's undo deletes the setting, and a deleted dynamo
    # setting is hidden for the rest of the process
    limit = torch._dynamo.config.patch(recompile_limit=1)
    limit.__enter__()
    torch._dynamo.reset()
    backend = _CountingBackend()
    module = _CompiledMLP(backend)
    steps = 3
    try:
        _trainer(tmp_path, 2, []).fit(module)  # compiled at batch 4
        assert len(backend.compiled) == 1 and backend.calls == 2
        mark = _AtTheFitsFirstBatch(backend)
        # the search (with its estimate) at fit start, then 3 steps at the size found
        _trainer(tmp_path, steps, [MaxBatchSize(budget=2**20, max_val=256, verbose=False), mark]).fit(module)
    finally:
        limit.__exit__(None, None, None)
        torch._dynamo.reset()
    found = module.batch_size
    assert found > 4
    in_the_fit = backend.compiled[mark.compiled :]
    assert len(in_the_fit) == 1 and (found, FEATURES) in in_the_fit[0], backend.compiled
    assert backend.calls - mark.calls == steps  # every step of the fit ran the compiled code


def test_an_estimate_of_a_compiled_module_leaves_it_compiling_afterwards():
    """The estimate's fake step runs compiled code eagerly (the eager program's figure); met first under its dispatch
    mode instead, a compiled frame would be skipped by dynamo for the rest of the process."""
    from lightning_memkit import estimate_memory

    torch._dynamo.reset()
    backend = _CountingBackend()
    module = _CompiledMLP(backend)
    batch = (module.x[:8], module.y[:8])
    try:
        estimate = estimate_memory(module, batch=batch, device="cpu")
        assert estimate.by_category["gradients"] == sum(p.numel() * p.element_size() for p in module.parameters())
        assert backend.compiled == []  # the estimate compiled nothing
        module.net(batch[0])
        assert len(backend.compiled) == 1 and backend.calls == 1  # the module's next call compiles and runs it
    finally:
        torch._dynamo.reset()
