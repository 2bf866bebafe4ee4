"""ActivationCheckpointing in real Trainer runs: same training as baseline, reported plan, restored
module, budgets, FSDP deferral and DDP with two CPU processes."""

from __future__ import annotations

import copy
import textwrap
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memkit import ActivationCheckpointing, parse_mode
from tests.helpers.event_files import read_scalars
from tests.helpers.paths import REPO_ROOT
from tests.helpers.processes import run_script
from tests.helpers.trainers import make_trainer


class DropoutBatchNormNet(pl.LightningModule):
    """Four residual blocks with BatchNorm and dropout, in a ModuleList; logs its loss."""

    def __init__(self, blocks: int = 4, width: int = 32) -> None:
        super().__init__()
        self.stem = nn.Linear(8, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.Linear(width, 2 * width),
                nn.BatchNorm1d(2 * width),
                nn.Dropout(0.2),
                nn.ReLU(),
                nn.Linear(2 * width, width),
            )
            for _ in range(blocks)
        )
        self.head = nn.Linear(width, 1)
        self.data = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))

    def forward(self, x):
        h = self.stem(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)

    def training_step(self, batch, batch_idx):
        loss = self(batch[0]).pow(2).mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.data), batch_size=16)


def _fit(model, tmp_path, callbacks=(), **kwargs):
    pl.seed_everything(0, verbose=False)
    trainer = make_trainer(tmp_path, max_steps=3, callbacks=list(callbacks), **kwargs)
    trainer.fit(model)
    return trainer


def test_callback_trains_exactly_like_baseline_and_restores_the_module(tmp_path):
    torch.manual_seed(0)
    base = DropoutBatchNormNet()
    model = copy.deepcopy(base)
    _fit(base, tmp_path / "base")
    callback = ActivationCheckpointing("auto")
    logger = TensorBoardLogger(str(tmp_path), name="ckpt", version="")
    _fit(model, tmp_path / "ckpt", [callback], logger=logger)
    for (name, p), (_, q) in zip(base.named_parameters(), model.named_parameters(), strict=True):
        assert (p - q).abs().max().item() <= 1e-6, name
    for (name, a), (_, b) in zip(base.named_buffers(), model.named_buffers(), strict=True):
        assert torch.equal(a, b), name
    assert callback.plan.names == ["blocks.0", "blocks.1", "blocks.2"]  # the last block runs plain
    assert callback.plan.measured_activation_bytes < callback.plan.baseline_activation_bytes
    assert not any("forward" in m.__dict__ for m in model.modules())  # restored at teardown
    scalars = read_scalars(logger.log_dir)
    assert scalars["memory/checkpoint/regions"] == [(0, 3.0)]
    assert "memory/checkpoint/predicted_saving_MiB" in scalars


def test_budget_callback_meets_its_budget_in_a_trainer(tmp_path):
    model = DropoutBatchNormNet(blocks=6)
    callback = ActivationCheckpointing(budget=0.5)
    _fit(model, tmp_path, [callback])
    plan = callback.plan
    assert plan.budget_bytes == int(0.5 * plan.baseline_activation_bytes)
    assert plan.measured_activation_bytes <= plan.budget_bytes
    assert 0 < plan.count <= 6


def test_mode_trainer_kwargs_checkpoints_through_the_callback(tmp_path):
    kwargs = parse_mode("bf16+checkpoint").trainer_kwargs("cpu", verbose=False)
    assert kwargs["precision"] == "bf16-mixed"
    model = DropoutBatchNormNet()
    trainer = _fit(model, tmp_path, kwargs["callbacks"], precision=kwargs["precision"])
    assert kwargs["callbacks"][0].plan.count == 3
    assert trainer.precision == "bf16-mixed"
    assert all(p.grad is not None for p in model.parameters())


def test_policy_matching_nothing_fails_before_training(tmp_path):
    with pytest.raises(MisconfigurationException, match="matched no module"):
        _fit(DropoutBatchNormNet(), tmp_path, [ActivationCheckpointing({nn.Conv2d})])
    with pytest.raises(MisconfigurationException, match="policy"):
        ActivationCheckpointing(policy=42)


def test_under_fsdp_it_defers_to_the_strategy_with_a_warning():
    from lightning.pytorch.strategies import FSDPStrategy

    model = DropoutBatchNormNet()
    for strategy, says in (
        (FSDPStrategy(), "Pass FSDPStrategy"),
        (FSDPStrategy(activation_checkpointing_policy={nn.Sequential}), "strategy's"),
    ):
        callback = ActivationCheckpointing("auto")
        with pytest.warns(UserWarning, match=says):
            callback.setup(SimpleNamespace(strategy=strategy), model, "fit")
        assert not callback._pending and callback.plan is None
    assert not any("forward" in m.__dict__ for m in model.modules())


DDP_SCRIPT = textwrap.dedent(
    """
    import sys, torch, lightning.pytorch as pl
    sys.path.insert(0, {root!r})
    from tests.modes.test_checkpointing_callback import DropoutBatchNormNet
    from lightning_memkit import ActivationCheckpointing

    class Check(pl.Callback):
        def on_after_backward(self, trainer, module):
            missing = [n for n, p in module.named_parameters() if p.grad is None]
            assert not missing, missing
            wrapped = [n for n, m in module.named_modules() if "forward" in m.__dict__]
            print(f"rank{{trainer.global_rank}} wrapped={{len(wrapped)}} step={{trainer.global_step}}", flush=True)

    if __name__ == "__main__":
        pl.seed_everything(0)
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=2, logger=False,
                             enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                             callbacks=[ActivationCheckpointing(budget=0.6), Check()])
        trainer.fit(DropoutBatchNormNet())
        print(f"rank{{trainer.global_rank}} done", flush=True)
    """
)


def test_ddp_two_cpu_processes_train_with_checkpointing(tmp_path):
    script = tmp_path / "ddp_ckpt.py"
    script.write_text(DDP_SCRIPT.format(root=REPO_ROOT))
    env = {"PL_DISABLE_FORK": "1"}
    output = run_script([str(script)], str(tmp_path), timeout=150, env=env, ranks=2)  # kills both ranks on timeout
    for rank in (0, 1):
        assert f"rank{rank} done" in output, output[-3000:]
        assert f"rank{rank} wrapped=" in output
    counts = {line.split("wrapped=")[1].split()[0] for line in output.splitlines() if "wrapped=" in line}
    assert len(counts) == 1 and counts != {"0"}, output[-3000:]  # both ranks wrapped the same blocks


def test_measuring_forwards_stay_out_of_the_first_step_reading_whatever_the_order(tmp_path):
    """ActivationCheckpointing listed after MemoryTracker still measures before the step window opens:
    step 0's exact peak, above what the process held before the fit, is the same in both orders."""
    import gc

    from lightning_memkit import MemoryTracker
    from tests.helpers.live_tensors import live_tensor_bytes

    peaks = []
    for order in (
        "warm_up",
        "tracker_first",
        "checkpoint_first",
    ):  # the first fit makes torch's and Lightning's lazy globals
        gc.collect()
        before = live_tensor_bytes()  # the tracker's reading is the whole process's: compare what the fit adds
        tracker = MemoryTracker(verbose=False)
        checkpointing = ActivationCheckpointing(budget=0.5, verbose=False)
        callbacks = [tracker, checkpointing] if order == "tracker_first" else [checkpointing, tracker]
        _fit(DropoutBatchNormNet(blocks=6), tmp_path / order, callbacks)
        peaks.append(
            [
                r.peak_tensor_bytes - before
                for r in tracker.history
                if r.stage == "train" and r.peak_tensor_bytes is not None
            ]
        )
    assert peaks[1] and peaks[1] == peaks[2]


# ------------------------------------------------------------------------------------------ nothing held
def _small_transformer(batch_size: int = 16):
    from lightning_memkit.zoo import DemoTransformer

    torch.manual_seed(0)
    return DemoTransformer(
        vocab_size=100,
        d_model=32,
        nhead=4,
        layers=4,
        dim_feedforward=64,
        seq_len=32,
        dropout=0.1,
        batch_size=batch_size,
    )


class _Step0Probe(pl.Callback):
    """Listed after ActivationCheckpointing: what the whole process holds when step 0 starts (gc count)."""

    def __init__(self) -> None:
        self.live_bytes = None
        self.graph = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        from tests.helpers.live_tensors import describe, live_tensor_bytes, tensors_with_grad_fn

        if batch_idx == 0 and trainer.global_step == 0:
            self.live_bytes = live_tensor_bytes()
            self.graph = describe(tensors_with_grad_fn()) or None

    def teardown(self, trainer, pl_module, stage):
        for name in ("log", "log_dict"):  # Lightning's binding to the model, which would keep it alive
            vars(self).pop(name, None)


@pytest.mark.parametrize("arguments", [{}, {"budget": 0.5}], ids=["default", "budget"])
def test_measuring_leaves_no_graph_and_a_kept_callback_holds_no_tensor(tmp_path, arguments):
    """At default arguments (measure=True) and with a budget, on a transformer with dropout: step 0 starts
    with no autograd graph alive and exactly the live tensor bytes of a baseline fit; after the fit no graph;
    with model and Trainer deleted the kept callback holds no tensor of the model's; with it deleted too,
    the process holds what it held before."""
    import gc
    import weakref

    from tests.helpers.live_tensors import describe, live_tensor_bytes, live_tensors, tensors_with_grad_fn

    gc.collect()
    before = live_tensor_bytes()
    baseline_probe = _Step0Probe()
    _fit(_small_transformer(), tmp_path / "baseline", [baseline_probe])
    gc.collect()

    callback = ActivationCheckpointing(verbose=False, **arguments)
    probe = _Step0Probe()
    model = _small_transformer()
    trainer = _fit(model, tmp_path / "checkpointed", [callback, probe])
    assert callback.plan is not None and callback.plan.count > 0 and callback.plan.measured_activation_bytes is not None
    assert probe.graph is None, f"graph alive at step 0's start: {probe.graph}"
    assert probe.live_bytes == baseline_probe.live_bytes, (probe.live_bytes, baseline_probe.live_bytes)
    assert tensors_with_grad_fn() == [], describe(tensors_with_grad_fn())

    model_tensors = [weakref.ref(t) for t in [*model.parameters(), *model.buffers()]]
    del model, trainer
    gc.collect()
    assert not [r for r in model_tensors if r() is not None], "the kept callback keeps the model's tensors alive"
    del callback
    assert live_tensor_bytes() == before, describe(live_tensors())


def test_default_measuring_trains_at_the_largest_batch_that_trains_checkpointed(tmp_path):
    """Measuring needs no more memory than the checkpointed steps: under a MemoryBudget set to the exact peak
    of a checkpointed fit that does not measure (the tightest budget that run trains in: its batch is the
    largest that fits), the same fit at default arguments (measure=True) trains too, and its step 0 (the
    measuring forwards included) peaks no higher than its later steps. An unchecked fit does not fit."""
    from lightning_memkit.search.budget import BudgetExceededError, MemoryBudget

    class StepPeaks(pl.Callback):  # listed first: its window takes in ActivationCheckpointing's measuring
        def __init__(self, budget):
            self.budget, self.peaks = budget, []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.budget.accountant.reset_peak()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.peaks.append(self.budget.accountant.peak_bytes)

    def fit(budget_bytes, callbacks):
        budget = MemoryBudget(budget_bytes)
        model = _small_transformer(batch_size=32)
        budget.adopt([*model.parameters(), *model.buffers()])
        peaks = StepPeaks(budget)
        with budget:
            _fit(model, tmp_path, [peaks, *callbacks])
        return budget.accountant.peak_bytes, peaks.peaks

    tight, _ = fit(2**40, [ActivationCheckpointing(measure=False, verbose=False)])
    with pytest.raises(BudgetExceededError):
        fit(tight, [])  # without checkpointing the step does not fit: the budget is tight
    measured = ActivationCheckpointing(verbose=False)
    peak, step_peaks = fit(tight, [measured])
    assert measured.plan.measured_activation_bytes < measured.plan.baseline_activation_bytes
    assert peak <= tight
    assert step_peaks[0] <= min(step_peaks[1:]), step_peaks
    assert measured.plan.measuring_peak_bytes < measured.plan.baseline_activation_bytes


def test_budget_units_are_unambiguous_and_a_class_policy_limits_the_budget(tmp_path):
    for ambiguous in (1.5, 2, "2", "1e9"):
        with pytest.raises(MisconfigurationException, match=r"fraction in \(0, 1\].*unit"):
            ActivationCheckpointing(budget=ambiguous)
    assert ActivationCheckpointing(budget=1).policy.fraction == 1.0
    assert ActivationCheckpointing(budget="512MiB").policy.bytes == 512 * 2**20
    with pytest.raises(MisconfigurationException, match="budget= once"):
        ActivationCheckpointing("budget=0.5", budget=0.5)
    with pytest.raises(MisconfigurationException, match="matched no module"):
        _fit(DropoutBatchNormNet(), tmp_path, [ActivationCheckpointing({nn.Conv2d}, budget=0.5)])

    class Block(nn.Module):  # a block whose MLP part is a class of its own
        def __init__(self, width=32):
            super().__init__()
            self.mix = nn.Linear(width, width)
            self.mlp = nn.Sequential(
                nn.Linear(width, 4 * width), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * width, width)
            )

        def forward(self, x):
            h = x + torch.tanh(self.mix(x))
            return h + self.mlp(h)

    class Net(DropoutBatchNormNet):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(4))

    callback = ActivationCheckpointing({nn.Sequential}, budget=0.6, verbose=False)
    _fit(Net(), tmp_path / "mlp", [callback])
    plan = callback.plan
    assert plan.count > 0 and all(name.endswith(".mlp") for name in plan.names), plan.names
    assert plan.measured_activation_bytes <= plan.budget_bytes
    assert plan.policy == "budget=0.6 within {Sequential}"
