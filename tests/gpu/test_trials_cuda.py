"""The trials and searches on a GPU (the ``cuda`` lane: skipped where no CUDA device is), each the device-side twin
of a CPU test that checks its logic:

- AutoFit on ``trainer.fit(torch.compile(model))`` fails if a trial's copy calls the original's compiled methods
  (the original waits in host memory: a device mismatch). CPU: tests/compiled/test_compiled_copies.py.
- A search of a compiled model (static shapes, recompile limit 2) fails if dynamo's caches are kept across trials
  (later trials and the fit run uncompiled). CPU: tests/search/test_search_compiled.py.
- fp16 search trials fail if a trial "fits" on steps the GradScaler skipped, or starts from the last trial's scale.
  CPU: tests/search/test_search_fp16.py.
- A failed trial of a CUDA-graph model fails if its pools, cached blocks or frames hold device memory after it.
  CPU: tests/plan/test_trial_clean_up.py.
- The user's CUDA seed fails if memkit's seeding replaces the seed queued before CUDA started.
  CPU: tests/estimate/data/test_random_state.py.
- ``masked_select``'s positions fail if CUDA makes no ``(N, ndim)`` index temporary beside its output, as the CUDA
  target's estimate counts. CPU: tests/estimate/fake/test_data_dependent_ops.py.

The allocator cap's twin is in tests/plan/test_allocator_cap.py.
"""

from __future__ import annotations

import textwrap

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers.processes import run_script

pytestmark = pytest.mark.cuda

MiB = 1 << 20


def _trainer(tmp_path, **kwargs) -> pl.Trainer:
    options = {
        "accelerator": "gpu",
        "devices": 1,
        "max_steps": 3,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "default_root_dir": tmp_path,
    }
    options.update(kwargs)
    return pl.Trainer(**options)


class _Wide(pl.LightningModule):
    """``layers`` Linear(width, width) on rows of random numbers, Adam; ``loss_scale`` makes fp16's first scaled
    gradients overflow; records the GradScaler's scale at the start of each fit loop run (each trial's and the fit's)
    and raises at the ``explode_at``-th training batch (0: never)."""

    def __init__(self, width: int = 1024, layers: int = 2, rows: int = 8, loss_scale: float = 1.0) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        self.batch_size, self.loss_scale = rows, loss_scale
        self.data = torch.randn(64 * rows, width, generator=torch.Generator().manual_seed(0))
        self.start_scales: list[float] = []
        self.explode_at, self.batches = 0, 0

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).float().pow(2).mean() * self.loss_scale

    def on_train_start(self):
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            self.start_scales.append(float(scaler.get_scale()))

    def on_train_batch_start(self, batch, batch_idx):
        self.batches += 1
        if self.batches == self.explode_at:
            raise ValueError("planted in the trial's step")

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-4)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.data), batch_size=self.batch_size, drop_last=True)


def test_autofit_plans_and_trains_a_torch_compiled_module_on_cuda(tmp_path):
    from lightning_memkit import AutoFit
    from lightning_memkit.plan import RowStatus

    torch._dynamo.reset()
    module = _Wide()
    fit = AutoFit(device_memory="4GiB", trials=1, verbose=False)
    trainer = _trainer(tmp_path, callbacks=[fit])
    try:
        trainer.fit(torch.compile(module))
    finally:
        torch._dynamo.reset()
    assert any(row.status is RowStatus.RAN for row in fit.plan.rows), fit.plan.table()
    assert trainer.global_step == 3 and all(p.device.type == "cuda" for p in module.parameters())


class _Counting:
    """A compile backend counting graphs compiled and calls of compiled code (the graphs run eagerly)."""

    def __init__(self) -> None:
        self.compiled, self.calls = 0, 0

    def __call__(self, graph, inputs):
        self.compiled += 1

        def run(*args):
            self.calls += 1
            return graph.forward(*args)

        return run


class _CompiledWide(_Wide):
    def __init__(self, backend: _Counting) -> None:
        super().__init__(width=512, layers=2)
        self.net = torch.compile(self.net, backend=backend, dynamic=False)


def test_a_cuda_search_of_a_compiled_model_compiles_each_trial_and_the_fit_runs_compiled(tmp_path, monkeypatch):
    from lightning_memkit.callbacks.max_batch_size import find_max_batch_size

    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 2)
    torch._dynamo.reset()
    backend = _Counting()
    module = _CompiledWide(backend)
    try:
        result = find_max_batch_size(_trainer(tmp_path), module, max_val=256, use_estimate=False, verbose=False)
        assert len(result.trials) > 2  # more sizes than the recompile limit
        compiled = backend.compiled
        assert compiled >= len(result.trials)  # every trial compiled its own graph
        calls = backend.calls
        _trainer(tmp_path, max_steps=3).fit(module)
        assert backend.calls - calls == 3 and backend.compiled > compiled  # the fit ran compiled, afresh
    finally:
        torch._dynamo.reset()


def test_fp16_search_trials_on_cuda_hold_the_optimizer_state_and_start_from_the_fits_scale(tmp_path):
    from lightning_memkit.callbacks.max_batch_size import find_max_batch_size

    module = _Wide(width=1024, loss_scale=2.0**20)
    trainer = _trainer(tmp_path, precision="16-mixed")
    result = find_max_batch_size(trainer, module, max_val=64, use_estimate=False, verbose=False)
    weights = sum(p.numel() * p.element_size() for p in module.parameters())
    fitting = [trial for trial in result.trials if trial.fits]
    assert fitting and all(trial.peak_bytes >= 4 * weights for trial in fitting), result.trials
    assert len(set(module.start_scales[: len(result.trials)])) == 1, module.start_scales


def test_a_failed_trial_of_a_cuda_graph_model_leaves_the_device_as_it_found_it():
    from lightning_memkit.plan import Candidate
    from lightning_memkit.plan.cuda_trial import release
    from lightning_memkit.plan.trials import trial

    torch._dynamo.reset()
    module = _Wide(width=2048).cuda()
    module.net = torch.compile(module.net, mode="reduce-overhead", dynamic=False)
    warm = nn.Linear(8, 8).cuda()  # cuBLAS's workspaces (main and autograd threads), before the reading
    warm(torch.ones(8, 8, device="cuda")).sum().backward()
    del warm
    release(True)
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    module.explode_at, module.batches = 4, 0  # after the warm-up step, in the timed ones: CUDA graphs recorded
    batch = next(iter(module.train_dataloader()))
    try:
        with pytest.raises(ValueError, match="planted") as failed:
            trial(module, Candidate(8, 1), batch, 64 << 30, "cuda", 2, 3)
        assert failed.value is not None  # held, as a caller's traceback holds it
        assert torch.cuda.memory_allocated() == allocated
        assert torch.cuda.memory_reserved() - reserved < 32 * MiB
    finally:
        torch._dynamo.reset()


SEED_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from torch.utils.data import DataLoader, TensorDataset
    from lightning_memkit.estimate.data.batches import preserved_rng
    from lightning_memkit.estimate.data.worst_batch import find_worst_batch

    case = sys.argv[1]
    if case != "unseeded":
        torch.manual_seed(1234)
    if case == "sized":  # memkit seeds every generator while it sizes samples, CUDA not started
        find_worst_batch(DataLoader(TensorDataset(torch.arange(16.0)), batch_size=4))
    else:  # CUDA starts inside a block that seeded every generator
        with preserved_rng():
            torch.manual_seed(0)
            torch.empty(1, device="cuda")
    after = torch.randn(4, device="cuda").tolist()
    if case == "unseeded":
        print(torch.cuda.initial_seed() == torch.Generator(device="cuda").initial_seed())
    else:
        torch.cuda.manual_seed_all(1234)
        print(after == torch.randn(4, device="cuda").tolist())
    """
)


@pytest.mark.parametrize("case", ["sized", "started", "unseeded"])
def test_the_users_cuda_seed_survives_memkits_seeding(tmp_path, case):
    script = tmp_path / "seed.py"
    script.write_text(SEED_SCRIPT)
    assert run_script([str(script), case], cwd=str(tmp_path), timeout=300).split()[-1] == "True"


def test_masked_select_on_cuda_holds_its_positions_beside_its_output():
    rows, columns = 4096, 1024
    x = torch.ones(rows, columns, device="cuda")
    mask = x > 0  # every element selected
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    selected = torch.masked_select(x, mask)
    peak = torch.cuda.max_memory_allocated() - before
    output = selected.numel() * selected.element_size()
    positions = selected.numel() * mask.dim() * torch.int64.itemsize  # what the CUDA target's estimate counts
    assert output + positions <= peak <= output + positions + 4 * MiB, (peak, output, positions)
