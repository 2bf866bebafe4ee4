"""The planner on a device: what of it runs on a CPU.

- the CUDA budget's arithmetic counts the model under plan once and the CUDA context once, and caps a trial's
  allocator at the budget less the context (lightning_memkit/plan/cuda_trial.py);
- a plan whose best offloads says so in ``yaml()`` (valid LightningCLI YAML), ``trainer_arguments()`` and
  ``memkit plan``'s printout (a CUDA plan's prediction, made here without a GPU);
- a CUDA plan keeps the device index it was given;
- an fp16 trial's steps that the GradScaler skipped (a real ``torch.amp.GradScaler("cpu")`` under Lightning's
  ``16-mixed`` plugin) are run beyond those asked and not timed;
- an offload trial that the host cannot pin is refused; the caching host allocator's release is torch's own;
- a compiled module's trials each compile at their own micro-batch (dynamo reset around each).

Each has a twin in the GPU lane (tests/gpu/test_cuda.py) that checks it on a real device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
from contextlib import redirect_stdout

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision

from lightning_memkit.estimate.cuda.caching_allocator import CUDA_CONTEXT_BYTES
from lightning_memkit.modes.checkpoint_policy import CheckpointBudget
from lightning_memkit.plan import cuda_trial, inputs, lightning_runs, planner, trials
from lightning_memkit.plan.space import Candidate
from lightning_memkit.quiet_lightning import quiet_lightning
from lightning_memkit.search.real_steps import MAX_SKIPPED_STEPS, RealSteps, real_step_seconds
from lightning_memkit.zoo import DemoTransformer
from tests.helpers.models import LinearStack

MiB, GiB = 1 << 20, 1 << 30


# ------------------------------------------------------------------------------------------ the arithmetic
def test_a_cuda_budget_counts_the_model_once_and_the_context_once():
    """A process holds the model under plan (M bytes reserved) on a device with F bytes free; the real fit needs X
    bytes more than the model. The default budget is this process's share of the device in device bytes (F + M, plus
    its context, which ``free`` left out); the trial, with the original off the device, reserves M + X: it fits
    exactly when X <= F, as the real fit does. (Before: a budget of F + M, the trial's M + M + X reserved, plus the
    context: it fit only when X <= F - M - context.)"""
    free, model, total = 10 * GiB, 3 * GiB, 80 * GiB
    budget = cuda_trial.device_budget_bytes(free=free, reserved=model, total=total)
    assert budget == free + model + CUDA_CONTEXT_BYTES
    for more, fits in ((free - MiB, True), (free, True), (free + MiB, False)):
        trial_reserved = model + more  # one model: the original waits in host memory (cuda_trial.off_device)
        assert (cuda_trial.over_budget(trial_reserved, budget) is None) is fits, more
    assert cuda_trial.over_budget(14 * GiB, budget) == (
        "over the budget: 14.00 GiB reserved + 512.00 MiB CUDA context > 13.50 GiB"
    )
    # a per-process fraction set by the user caps what the allocator can reach; the context is still on top
    assert cuda_trial.device_budget_bytes(free, model, total, fraction=0.1) == 8 * GiB + CUDA_CONTEXT_BYTES
    assert cuda_trial.device_budget_bytes(free, model, total, fraction=1.0) == budget


def test_a_trials_allocator_is_capped_at_the_budget_less_the_context():
    total = 80 * GiB
    budget = 16 * GiB  # a card of 16 GiB: its allocator gets what the context leaves
    assert cuda_trial.allocator_bytes(budget) == budget - CUDA_CONTEXT_BYTES
    assert cuda_trial.memory_fraction(budget, total) == (budget - CUDA_CONTEXT_BYTES) / total
    assert cuda_trial.memory_fraction(budget, total, previous=0.1) == 0.1  # a lower cap already set stays
    assert cuda_trial.memory_fraction(200 * GiB, total) == 1.0  # a budget beyond the card: the card
    assert cuda_trial.memory_fraction(CUDA_CONTEXT_BYTES // 2, total) == 0.0  # nothing left for tensors


def test_a_module_on_the_cpu_is_not_moved_for_a_trial():
    module = LinearStack((8, 16, 4))
    before = list(module.parameters())
    with cuda_trial.off_device(module, torch.device("cuda", 0)) as moved:
        assert not moved
    assert list(module.parameters()) == before and all(p.device.type == "cpu" for p in before)


# ------------------------------------------------------------------------------------------ offload printed
def _offloading_plan(checkpoint: bool) -> planner.Plan:
    """A CUDA plan's prediction (no GPU here: nothing runs), its best set to its fastest offload row, as a GPU's
    trials would leave it when that row won."""
    module = DemoTransformer(
        vocab_size=64,
        d_model=32,
        nhead=2,
        layers=2,
        dim_feedforward=64,
        seq_len=16,
        num_classes=4,
        dropout=0.0,
        batch_size=2,
    )
    modes = "micro_batch,checkpoint,offload" if checkpoint else "micro_batch,offload"
    plan = planner.plan_fit(module, gpu="h100", device_memory="80GiB", modes=modes, verbose=False)
    assert plan.device == "cuda" and plan.trials == 0
    row = max(
        (r for r in plan.rows if r.candidate.offload and (r.candidate.checkpoint is not None) == checkpoint),
        key=lambda r: r.predicted_samples_per_s,
    )
    return dataclasses.replace(plan, best=row.candidate)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU here the plan runs real trials")
@pytest.mark.timeout(300)
def test_a_plan_whose_best_offloads_carries_activation_offload(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    from lightning_memkit import ActivationCheckpointing, ActivationOffload
    from lightning_memkit.cli.plan import print_best

    for checkpoint in (False, True):
        plan = _offloading_plan(checkpoint)
        best = plan.best
        arguments = plan.trainer_arguments()
        kinds = [type(callback) for callback in arguments["callbacks"]]
        assert kinds == ([ActivationCheckpointing] if checkpoint else []) + [ActivationOffload]
        text = plan.yaml()
        assert "    - class_path: lightning_memkit.ActivationOffload\n" in text
        assert text.count("  callbacks:\n") == 1
        out = io.StringIO()
        with redirect_stdout(out):
            print_best(plan)
        printed = out.getvalue()
        # the checkpointing callback printed as the trial ran it, as trainer_arguments() and yaml() give it: a budget
        # measures (it chooses its blocks from the measurement), another policy does not (its forward would add a peak)
        measures = isinstance(best.checkpoint, CheckpointBudget)
        listed = (
            f"ActivationCheckpointing(policy={best.checkpoint_text!r}{'' if measures else ', measure=False'}), "
            if checkpoint
            else ""
        ) + "ActivationOffload()"
        if checkpoint:
            assert arguments["callbacks"][0].measure is measures
            assert ("        measure: false\n" in plan.yaml()) is not measures
            # a checkpointing of named blocks (not a budget) is printed with measure=False
            named = next(
                r.candidate
                for r in plan.rows
                if r.candidate.offload
                and r.candidate.checkpoint is not None
                and not isinstance(r.candidate.checkpoint, CheckpointBudget)
            )
            out = io.StringIO()
            with redirect_stdout(out):
                print_best(dataclasses.replace(plan, best=named))
            assert f"ActivationCheckpointing(policy={named.checkpoint_text!r}, measure=False)" in out.getvalue()
        assert f"callbacks=[{listed}])" in printed and printed.endswith(text)
        # LightningCLI reads it: the callbacks are instantiated, the micro-batch is the module's batch_size
        config = tmp_path / f"plan_{checkpoint}.yaml"
        config.write_text(text)
        cli = LightningCLI(
            DemoTransformer,
            args=[f"--config={config}", "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}"],
            run=False,
            save_config_callback=None,
        )
        ours = [type(c) for c in cli.trainer.callbacks if type(c) in (ActivationCheckpointing, ActivationOffload)]
        assert ours == kinds
        assert cli.model.batch_size == best.micro_batch
        assert cli.trainer.accumulate_grad_batches == best.accumulation


# ------------------------------------------------------------------------------------------ the device index
def test_a_cuda_plan_keeps_its_device_index():
    assert isinstance(inputs.plan_device("cpu"), contextlib.nullcontext)
    if not torch.cuda.is_available():  # a CUDA plan here is a prediction: no device to enter
        assert isinstance(inputs.plan_device("cuda:1"), contextlib.nullcontext)
        module = LinearStack((32, 64, 16), batch_size=8)
        plan = planner.plan_fit(
            module, device="cuda:1", gpu="h100", device_memory="1GiB", modes="micro_batch", verbose=False
        )
        assert plan.device == "cuda" and plan.trials == 0


# ------------------------------------------------------------------------------------------ fp16 trials
class _Overflowing(pl.LightningModule):
    """One Linear whose loss is large enough that the GradScaler's first scales overflow fp16's gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 8)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class _Same:
    def __init__(self, count: int) -> None:
        self.count = count

    def __iter__(self):
        batch = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
        return iter([batch] * self.count)

    def __len__(self) -> int:
        return self.count


@pytest.mark.timeout(300)
def test_fp16_steps_the_grad_scaler_skipped_are_run_beyond_and_not_timed():
    wanted, accumulation = 3, 2
    for init_scale, skips in ((2.0**24, True), (2.0**4, False)):
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
        gate = RealSteps(wanted)
        module = _Overflowing()
        trainer = pl.Trainer(
            accelerator="cpu",
            max_steps=wanted + MAX_SKIPPED_STEPS,
            accumulate_grad_batches=accumulation,
            plugins=[MixedPrecision("16-mixed", "cpu", scaler)],
            callbacks=[gate],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, train_dataloaders=_Same(accumulation * (wanted + MAX_SKIPPED_STEPS)))
        assert gate.real == wanted and len(gate.skipped) == trainer.global_step, gate.skipped
        assert any(gate.skipped) is skips and not gate.skipped[-1]  # it stopped at a real step
        assert len(trainer.optimizers[0].state) == 2  # Adam's state exists: the optimizer stepped
    # the timings kept: the real steps after the warm-up's real ones
    assert real_step_seconds([1.0, 2.0, 3.0, 4.0, 5.0], [True, False, True, False, False], warmup=1) == [4.0, 5.0]
    assert real_step_seconds([1.0, 2.0, 3.0], [], warmup=1) == [2.0, 3.0]


@pytest.mark.timeout(300)
def test_a_trial_fit_without_a_grad_scaler_skips_nothing():
    module = LinearStack((8, 16, 4), batch_size=4, optimizer="adam")
    with quiet_lightning():
        skipped = lightning_runs.fit_steps(module, Candidate(4, 1), (torch.randn(4, 8),), "cpu", 2, 1, None, None)
    assert skipped == []


# ------------------------------------------------------------------------------------------ host memory
def test_an_offload_trial_the_host_cannot_pin_is_refused():
    import psutil

    available = psutil.virtual_memory().available
    assert cuda_trial.host_refusal(available // 4, available) is None
    refusal = cuda_trial.host_refusal(available, available)
    assert refusal.startswith("not run: offload pins about") and "leave offload out" in refusal
    assert cuda_trial.host_refusal(3 * GiB, 4 * GiB) == (
        "not run: offload pins about 3.00 GiB of host memory (the caching host allocator rounds each block up to a "
        "power of two: up to twice that), more than 50% of the 4.00 GiB the host has available; free host memory "
        "or leave offload out"
    )


def test_the_host_cache_release_is_torchs_own():
    """Pins the torch function plan/_torch_compat.py calls to give offload's pinned blocks back."""
    from lightning_memkit.plan._torch_compat import empty_host_cache, host_cache_release

    assert host_cache_release() is torch.accelerator.empty_host_cache
    assert empty_host_cache() is (torch.cuda.is_available() and torch.cuda.is_initialized())


# ------------------------------------------------------------------------------------------ compiled models
def test_reset_compiled_is_torchs_compiler_reset():
    """Pins compiled/_torch_compat.reset_compiled: a compiled function compiles again after it."""
    from lightning_memkit.compiled._torch_compat import reset_compiled

    compiled = []

    def backend(graph, inputs):
        compiled.append(graph)
        return graph.forward

    doubled = torch.compile(lambda x: x * 2, backend=backend)
    doubled(torch.ones(2))
    doubled(torch.ones(2))
    assert len(compiled) == 1
    reset_compiled()
    doubled(torch.ones(2))
    assert len(compiled) == 2


@pytest.mark.timeout(600)
def test_each_trial_of_a_compiled_module_compiles_at_its_own_micro_batch():
    """With dynamo's recompile limit at 1 and static shapes, a second trial at another micro-batch could only
    recompile past the limit (and so run eagerly) if the first trial's code were still cached: reset around each
    trial, each compiles its own graph."""
    from lightning_memkit.compiled._torch_compat import dynamo_counters
    from tests.helpers.compile_models import CompiledCNN

    # dynamo's own config.patch, not monkeypatch: monkeypatch's undo deletes the setting, and a deleted dynamo
    # setting is hidden for the rest of the process (later tests read recompile_limit and fail)
    limit = torch._dynamo.config.patch(recompile_limit=1)
    limit.__enter__()
    torch._dynamo.reset()
    module = CompiledCNN(backend="eager", batch_size=4)
    batch = next(iter(module.train_dataloader()))

    def graphs() -> int:
        return dynamo_counters().get("stats", {}).get("unique_graphs", 0)

    try:
        for micro in (4, 2):
            before = graphs()
            record = trials.trial(module, Candidate(micro, 4 // micro), batch, GiB, "cpu", trials.TrialSteps(1, 1))
            assert record.fits and record.note.endswith("; compiled: dynamo's caches reset before and after the trial")
            assert graphs() > before, micro  # it compiled at its own micro-batch
    finally:
        limit.__exit__(None, None, None)
        torch._dynamo.reset()
