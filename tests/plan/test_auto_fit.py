"""AutoFit: the plan applied before fit, on CPU with a budget the user's batch does not fit.

Claims: the planned fit trains the same loss curve and weights as the unplanned run of the same effective batch
(one full batch per step, no budget) within float tolerance; its real peak (every step's tensors counted by the
accountant, as a budget counts them) stays under the budget the baseline is over; a batch that fits as is
changes nothing; a resumed fit applies the checkpointed plan without planning.
"""

from __future__ import annotations

import gc

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch import Callback

from lightning_memkit.accounting.accountant import TensorAccountant
from lightning_memkit.callbacks.activation_checkpointing import ActivationCheckpointing
from lightning_memkit.callbacks.auto_fit import AutoFit
from lightning_memkit.estimate.api import estimate_memory
from tests.helpers.lightning_gpt import CharDataModule, TinyGPT
from tests.helpers.models import FrozenBaseStack

BATCH = 16
MODEL = {"vocab": 64, "d_model": 32, "heads": 2, "layers": 2, "seq_len": 32}


class StepRecorder(Callback):
    """Each micro-batch's logged loss and the peak of live tensor bytes in its step, counted by an accountant that
    adopts the training state (parameters, gradients, optimizer state, the batch) at the step's start."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.peaks: list[int] = []
        self.first_gradients: list[torch.Tensor] = []
        self.checkpointed: list[int] = []  # regions the fit's ActivationCheckpointing wrapped, at each batch's end
        self._accountant: TensorAccountant | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        accountant = TensorAccountant()
        state = list(pl_module.parameters()) + [p.grad for p in pl_module.parameters() if p.grad is not None]
        for optimizer in trainer.optimizers:
            for values in optimizer.state.values():
                state += [v for v in values.values() if isinstance(v, torch.Tensor)]
        accountant.adopt(state)
        accountant.adopt(batch)
        accountant.__enter__()
        self._accountant = accountant

    def teardown(self, trainer, pl_module, stage) -> None:
        for name in ("log", "log_dict"):  # Lightning binds them to the module on every callback; kept, they keep it
            vars(self).pop(name, None)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if not self.first_gradients:
            self.first_gradients = [p.grad.detach().clone() for p in pl_module.parameters() if p.grad is not None]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        accountant, self._accountant = self._accountant, None
        accountant.__exit__(None, None, None)
        self.peaks.append(accountant.peak_bytes)
        self.losses.append(float(trainer.callback_metrics["train_loss"]))
        self.checkpointed.append(
            sum(c.plan.count for c in trainer.callbacks if isinstance(c, ActivationCheckpointing) and c.plan)
        )


def _fit(tmp_path, callbacks, *, batch_size=BATCH, accumulate=1, steps=3, **trainer_options):
    pl.seed_everything(0)
    module, data = (
        TinyGPT(**MODEL),
        CharDataModule(batch_size=batch_size, samples=8 * BATCH, vocab=MODEL["vocab"], seq_len=MODEL["seq_len"]),
    )
    recorder = StepRecorder()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        callbacks=[*callbacks, recorder],
        **trainer_options,
    )
    trainer.fit(module, datamodule=data)
    return module, data, trainer, recorder


def _reachable_tensors_and_modules(root) -> list:
    """Every tensor or nn.Module reachable from ``root`` through Python references (gc's referents)."""
    found, seen, stack = [], {id(root)}, [root]
    while stack:
        for child in gc.get_referents(stack.pop()):
            if id(child) in seen or isinstance(child, type):
                continue
            seen.add(id(child))
            if isinstance(child, (torch.Tensor, torch.nn.Module)):
                found.append(type(child).__name__)
            else:
                stack.append(child)
    return found


def _per_optimizer_step(losses: list[float], accumulation: int) -> list[float]:
    return [sum(losses[i : i + accumulation]) / accumulation for i in range(0, len(losses), accumulation)]


@pytest.fixture(scope="module")
def budget() -> int:
    """Half-way between the estimated peaks of the full batch and of half of it: the baseline does not fit."""
    data = CharDataModule(batch_size=BATCH, vocab=MODEL["vocab"], seq_len=MODEL["seq_len"])
    full = estimate_memory(TinyGPT(**MODEL), BATCH, datamodule=data, device="cpu").peak_bytes
    half = estimate_memory(TinyGPT(**MODEL), BATCH // 2, datamodule=data, device="cpu").peak_bytes
    return (full + half) // 2


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The unplanned run: the user's full batch each step, no budget."""
    module, _, _, recorder = _fit(tmp_path_factory.mktemp("full"), [])
    return module, recorder


def test_autofit_trains_the_same_curve_as_the_full_batch_within_the_budget(tmp_path, budget, reference):
    _, reference = reference
    assert max(reference.peaks) > budget  # the user's batch does not fit the budget
    auto = AutoFit(device_memory=budget, modes="micro_batch", trials=2, verbose=False)
    _, data, trainer, planned = _fit(tmp_path / "auto", [auto])
    applied = auto.applied
    assert auto.plan is not None and not auto.plan.fits_as_is and auto.plan.trials <= 2
    assert applied["micro_batch"] * applied["accumulate_grad_batches"] == BATCH
    assert applied["accumulate_grad_batches"] > 1 and applied["checkpoint"] is None
    assert (data.batch_size, trainer.accumulate_grad_batches) == (
        applied["micro_batch"],
        applied["accumulate_grad_batches"],
    )
    assert auto.plan.best.micro_batch == applied["micro_batch"] and applied["precision"] == "32-true"
    # the plan's effective batch is the user's, and so is the loss curve (same samples per step, same updates)
    assert auto.plan.effective_batch == BATCH
    curve = _per_optimizer_step(planned.losses, applied["accumulate_grad_batches"])
    torch.testing.assert_close(torch.tensor(curve), torch.tensor(reference.losses), rtol=1e-4, atol=1e-5)
    # the first optimizer step's gradients (accumulated over the micro-batches) are the full batch's
    # (later weights are not compared: AdamW's update of a near-zero gradient is its sign, float noise included)
    for mine, theirs in zip(planned.first_gradients, reference.first_gradients, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6)
    assert max(planned.peaks) <= budget, (max(planned.peaks), budget)


def test_autofit_applies_checkpointing_through_the_checkpointing_callback(tmp_path, reference, capsys):
    _, reference = reference
    data = CharDataModule(batch_size=BATCH, vocab=MODEL["vocab"], seq_len=MODEL["seq_len"])
    checkpointed = estimate_memory(TinyGPT(**MODEL), BATCH, datamodule=data, device="cpu", mode="checkpoint").peak_bytes
    budget = (checkpointed + max(reference.peaks)) // 2  # checkpointing every block fits; the batch as is does not
    auto = AutoFit(device_memory=budget, modes="checkpoint", trials=2, verbose=True)

    def fit():
        module, data, trainer, planned = _fit(tmp_path, [auto])
        # what it added is gone after the fit (the checkpointing callback and its wrapping)
        assert not any(isinstance(c, ActivationCheckpointing) for c in trainer.callbacks)
        assert not any("checkpoint" in type(m).__name__.lower() for m in module.modules())
        return planned

    planned = fit()
    # AutoFit kept after the fit (its plan included) reaches no tensor and no module: it keeps nothing alive
    assert _reachable_tensors_and_modules(auto) == []
    assert auto.applied["checkpoint"] in ("auto", "budget=0.5") and auto.applied["micro_batch"] == BATCH
    assert auto.plan.best.checkpoint is not None
    out = capsys.readouterr().out
    assert f"memkit AutoFit: training micro-batch {BATCH} x accumulate_grad_batches 1, checkpointing" in out
    assert planned.checkpointed[0] > 0 and len(set(planned.checkpointed)) == 1  # wrapped from the first step on
    assert reference.checkpointed == [0] * len(reference.checkpointed)
    torch.testing.assert_close(torch.tensor(planned.losses), torch.tensor(reference.losses), rtol=1e-5, atol=1e-6)
    assert max(planned.peaks) <= budget, (max(planned.peaks), budget)


def test_autofit_plans_within_its_time_budget(tmp_path, budget, capsys):
    """AutoFit(max_seconds=...) is the plan's time budget: with almost none, one trial runs (its choice is what
    trains), the next is left out and said so, and the fit trains within the memory budget."""
    auto = AutoFit(device_memory=budget, modes="micro_batch", trials=3, verbose=True, max_seconds=0.001)
    _, data, trainer, planned = _fit(tmp_path / "auto", [auto])
    out = capsys.readouterr().out
    assert auto.plan.max_seconds == 0.001 and auto.plan.trials == 1 and auto.plan.best_row.ran
    assert "are left" in auto.plan.skipped["trial"] and "memkit plan: trial of micro " in out
    assert data.batch_size == auto.plan.best.micro_batch == auto.applied["micro_batch"]
    assert max(planned.peaks) <= budget


def test_autofit_changes_nothing_when_the_batch_fits(tmp_path, budget, reference):
    _, reference = reference
    auto = AutoFit(device_memory=100 * budget, trials=1, verbose=False)
    _, data, trainer, planned = _fit(tmp_path / "auto", [auto])
    assert auto.plan.fits_as_is and auto.plan.best.micro_batch == BATCH
    assert (data.batch_size, trainer.accumulate_grad_batches) == (BATCH, 1)
    assert auto.applied == {
        "micro_batch": BATCH,
        "accumulate_grad_batches": 1,
        "checkpoint": None,
        "offload": False,
        "precision": "32-true",
    }
    assert planned.losses == reference.losses  # bit for bit: the plan's trials left nothing changed


def test_autofit_resumes_with_the_checkpointed_plan_without_planning(tmp_path, budget):
    applied = {
        "micro_batch": BATCH // 4,
        "accumulate_grad_batches": 4,
        "checkpoint": "budget=0.5",
        "offload": False,
        "precision": "32-true",
    }
    first = AutoFit(device_memory=budget, verbose=False)
    first.load_state_dict({"applied": dict(applied)})  # what a planned fit keeps (plain values)
    _, _, trainer, _ = _fit(tmp_path / "first", [], steps=1)
    trainer.callbacks.append(first)  # saved with the checkpoint, as after a planned fit
    path = str(tmp_path / "autofit.ckpt")
    trainer.save_checkpoint(path)
    assert torch.load(path, weights_only=True)["callbacks"][first.state_key] == {"applied": applied}
    resumed = AutoFit(device_memory=budget, verbose=False)
    pl.seed_everything(0)
    module, data = (
        TinyGPT(**MODEL),
        CharDataModule(batch_size=BATCH, samples=8 * BATCH, vocab=MODEL["vocab"], seq_len=MODEL["seq_len"]),
    )
    recorder = StepRecorder()
    again = pl.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        callbacks=[resumed, recorder],
    )
    again.fit(module, datamodule=data, ckpt_path=path)
    assert resumed.plan is None  # no planning
    assert resumed.applied == applied
    assert (data.batch_size, again.accumulate_grad_batches) == (BATCH // 4, 4)
    assert (
        again.global_step == 2
        and recorder.losses
        and set(recorder.checkpointed) == {recorder.checkpointed[0]}
        and recorder.checkpointed[0] > 0
    )


def test_autofit_refuses_data_it_cannot_resize(tmp_path):
    from lightning.pytorch.utilities.exceptions import MisconfigurationException
    from torch.utils.data import DataLoader, TensorDataset

    module = TinyGPT(**MODEL)
    tokens = torch.randint(0, MODEL["vocab"], (16, MODEL["seq_len"] + 1))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        callbacks=[AutoFit(verbose=False)],
    )
    with pytest.raises(MisconfigurationException, match="cannot resize dataloaders passed straight to trainer.fit"):
        trainer.fit(module, train_dataloaders=loader)


def test_autofit_plans_nothing_under_fast_dev_run(tmp_path):
    auto = AutoFit(device_memory=1, verbose=False)  # a budget nothing fits: a plan would fail
    with pytest.warns(UserWarning, match="AutoFit: no planning under fast_dev_run"):
        _, data, trainer, _ = _fit(tmp_path, [auto], fast_dev_run=1)
    assert auto.plan is None and auto.applied is None and data.batch_size == BATCH


def _frozen_fit(tmp_path, precision: str, callbacks) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=2,
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        callbacks=callbacks,
    )
    trainer.fit(FrozenBaseStack(log_loss=True))
    return trainer


def test_autofit_names_the_precision_to_add_when_only_bf16_true_fits_and_applies_it_under_a_bf16_true_trainer(
    tmp_path, capsys
):
    module = FrozenBaseStack()
    half = estimate_memory(module, mode="bf16-true", device="cpu").peak_bytes
    budget = (half + 4 * module.frozen_parameter_elements()) // 2  # below the fp32 weights alone
    auto = AutoFit(device_memory=budget, modes="micro_batch,bf16-true", trials=1, verbose=True)
    with pytest.warns(UserWarning, match="no plan at the Trainer's precision 32-true ran"):
        _frozen_fit(tmp_path / "fp32", "32-true", [auto])
    out = capsys.readouterr().out
    assert auto.plan.best.precision == "bf16-true" and auto.plan.best_row.ran
    assert (
        "memkit AutoFit: the fastest plan trains in bf16-true, which a callback cannot set: add "
        "Trainer(precision='bf16-true') (the plan's Trainer arguments: {'accumulate_grad_batches': 1, 'precision': "
        "'bf16-true'})" in out
    )
    # with the argument added, the plan applies as it is and the fit stays within the budget; the Trainer converted the
    # module's weights at setup, so mixed precision (fp32 weights) is not a candidate the plan could estimate
    auto = AutoFit(device_memory=budget, modes="micro_batch,bf16,bf16-true", trials=1, verbose=False)
    recorder = StepRecorder()
    trainer = _frozen_fit(tmp_path / "bf16", "bf16-true", [auto, recorder])
    assert auto.plan.fits_as_is and auto.applied["precision"] == "bf16-true" and trainer.global_step == 2
    assert recorder.peaks and max(recorder.peaks) <= budget
    assert any(note.startswith("no bf16 candidates: the Trainer's bf16-true converted") for note in auto.plan.notes)
