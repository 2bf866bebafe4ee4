"""Activation offload (saved tensors to pinned host memory, CUDA only): the mode word, the CPU refusal, the
estimate's device and host bytes against an independent count, and (``cuda``) a real fit with it.

The independent reference for the estimate: a real CPU step under the tensor accountant with saved-tensor hooks
that keep each saved tensor as a NumPy copy (memory no torch storage holds, so the accountant does not count it:
what a GPU's ledger sees when the copy goes to the host) and bring it back as a fresh tensor in backward (counted:
``packed.to(device)``). That is what ``save_on_cpu`` does, written without memkit's code.
"""

from __future__ import annotations

import contextlib
import copy
import re

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_memkit.accounting.accountant import TensorAccountant
from lightning_memkit.callbacks.activation_checkpointing import ActivationCheckpointing
from lightning_memkit.callbacks.activation_offload import ActivationOffload
from lightning_memkit.estimate.api import estimate_memory
from lightning_memkit.estimate.step.memory_estimate import EstimateError
from lightning_memkit.modes.checkpoint_policy import CheckpointBudget
from lightning_memkit.modes.mode import Mode, parse_mode
from lightning_memkit.modes.offload import OFFLOAD_ON_CPU, apply_offload
from lightning_memkit.zoo import DemoMLP, DemoTransformer


def _activation_bound() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _reference(model: nn.Module, batch: torch.Tensor, offload: bool) -> tuple[int, int, int]:
    """(device peak, host peak, bytes saved in one forward) of two real CPU steps, counted independently."""
    model = copy.deepcopy(model)
    optimizer = _sgd(model.parameters())
    accountant = TensorAccountant()
    accountant.adopt(model.parameters())
    accountant.adopt([batch])
    host = {"now": 0, "peak": 0}
    saved_in_forward = []

    class HostCopy:
        def __init__(self, tensor: torch.Tensor) -> None:
            self.array = tensor.detach().numpy().copy()  # numel * itemsize bytes, outside torch's storages
            host["now"] += self.array.nbytes
            host["peak"] = max(host["peak"], host["now"])

        def __del__(self) -> None:
            host["now"] -= self.array.nbytes

    def count(tensor):
        saved_in_forward.append(tensor.numel() * tensor.element_size())
        return tensor

    with accountant:
        for step in range(2):
            hooks = (
                torch.autograd.graph.saved_tensors_hooks(
                    HostCopy, lambda packed: torch.from_numpy(packed.array).clone()
                )
                if offload
                else torch.autograd.graph.saved_tensors_hooks(count, lambda tensor: tensor)
                if step == 0
                else contextlib.nullcontext()
            )
            with hooks:
                loss = model(batch).float().sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            del loss
            optimizer.step()
    return accountant.peak_bytes, host["peak"], sum(saved_in_forward)


def test_offload_is_a_mode_word():
    mode = parse_mode("bf16+checkpoint+offload")
    assert (mode.precision, mode.checkpoint, mode.offload) == ("bf16-mixed", "auto", True)
    assert Mode(offload=True).name == "offload" and not Mode(offload=True).is_baseline
    assert parse_mode("offload").to_dict() == {
        "name": "offload",
        "precision": None,
        "checkpoint": None,
        "offload": True,
    }
    assert "offload" not in parse_mode("bf16").to_dict()
    callbacks = parse_mode("offload").trainer_kwargs("gpu")["callbacks"]
    assert [type(c) for c in callbacks] == [ActivationOffload]
    with pytest.raises(ValueError, match="names offload twice"):
        parse_mode("offload+offload")
    with pytest.raises(ValueError, match="Mode\\(offload='yes'\\)"):
        Mode(offload="yes")


def test_offload_estimate_moves_the_saved_tensors_to_the_host_exactly():
    model, batch = _activation_bound(), torch.randn(2048, 16)
    baseline = estimate_memory(model, batch=batch, device="cuda", optimizer=_sgd)
    offload = estimate_memory(model, batch=batch, device="cuda", optimizer=_sgd, mode="offload")
    cpu_baseline = estimate_memory(model, batch=batch, device="cpu", optimizer=_sgd)
    device_peak, host_zero, saved = _reference(model, batch, offload=False)
    offload_peak, host_peak, _ = _reference(model, batch, offload=True)
    assert cpu_baseline.peak_bytes == device_peak  # the reference counts what the estimate counts
    assert host_zero == 0 and baseline.host_bytes == 0
    # host: one copy of every tensor saved in a forward (parameters included), all alive until backward
    assert offload.host_bytes == host_peak == saved
    # device: the peak drops by exactly what the independent run drops (the saved activations leave the device;
    # backward brings each back while its op runs), on the CUDA target as on the CPU reference
    drop = device_peak - offload_peak
    assert drop > 0
    assert baseline.peak_bytes - offload.peak_bytes == drop
    assert offload.by_category["activations"] == 0 < baseline.by_category["activations"]
    assert offload.cuda.peak_allocated_bytes < baseline.cuda.peak_allocated_bytes
    assert "offloaded to host (pinned)" in offload.summary()


def test_offload_is_refused_on_cpu_with_the_reason(tmp_path):
    model = _activation_bound()
    with pytest.raises(EstimateError, match="on CPU there is nothing to offload"):
        estimate_memory(model, batch=torch.randn(4, 16), device="cpu", optimizer=_sgd, mode="offload")
    with pytest.raises(ValueError, match=re.escape(OFFLOAD_ON_CPU)) as caught:
        apply_offload(model, "cpu")
    assert OFFLOAD_ON_CPU in str(caught.value) and "'cpu'" in str(caught.value)
    assert "forward" not in model.__dict__  # nothing was wrapped
    module = DemoMLP(hidden=16, depth=1, batch_size=4)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        callbacks=[ActivationOffload()],
    )
    with pytest.raises(MisconfigurationException, match="ActivationOffload: offload moves saved activations"):
        trainer.fit(module)
    assert "training_step" not in module.__dict__
    with pytest.raises(MisconfigurationException, match=r"ActivationOffload\(verbose=1\)"):
        ActivationOffload(verbose=1)


class _Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.peaks: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        torch.cuda.synchronize()
        self.peaks.append(torch.cuda.max_memory_allocated())
        self.losses.append(float(outputs["loss"]))


def _fit_twice(tmp_path, runs) -> None:
    for offload in (False, True):
        torch.manual_seed(0)
        module = DemoTransformer(
            vocab_size=500,
            d_model=256,
            nhead=4,
            layers=4,
            dim_feedforward=1024,
            seq_len=256,
            dropout=0.0,
            batch_size=16,
        )
        recorder = _Losses()
        callbacks = [recorder, *([ActivationOffload()] if offload else [])]
        trainer = pl.Trainer(
            accelerator="gpu",
            devices=1,
            max_steps=4,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            default_root_dir=str(tmp_path),
            callbacks=callbacks,
        )
        trainer.fit(module)
        assert "training_step" not in module.__dict__  # restored after fit
        runs[offload] = recorder
        del module, trainer
        torch.cuda.empty_cache()


@pytest.mark.cuda
def test_offload_trains_the_same_losses_with_a_lower_cuda_peak(tmp_path):
    runs = {}
    # the math attention kernel: flash/memory-efficient backward kernels may sum in another order run to run
    kernels = torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled()
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    try:
        _fit_twice(tmp_path, runs)
    finally:
        torch.backends.cuda.enable_flash_sdp(kernels[0])
        torch.backends.cuda.enable_mem_efficient_sdp(kernels[1])
    # the first step's forward is the same computation bit for bit (offload copies what autograd saves, exactly);
    # after the first backward the weights agree to float rounding only: on an H200 the second losses were 2.6420715
    # and 2.6420717, a CUDA kernel that sums in a run-dependent order (which one was not isolated)
    assert runs[True].losses[0] == runs[False].losses[0]
    assert runs[True].losses == pytest.approx(runs[False].losses, rel=1e-5)
    assert max(runs[True].peaks[1:]) < 0.8 * max(runs[False].peaks[1:]), (runs[True].peaks, runs[False].peaks)


def _small_transformer(batch_size: int = 4) -> DemoTransformer:
    torch.manual_seed(0)
    return DemoTransformer(
        vocab_size=50, d_model=32, nhead=2, layers=3, dim_feedforward=64, seq_len=16, dropout=0.0, batch_size=batch_size
    )


def test_a_deep_copy_of_an_offloading_module_offloads_its_own_step():
    """A plan's trials and an estimate's fake step run deep copies: the copy's wrapped step is the copy's (a closure
    over the original's bound step would train the original), and remove() restores the module's own step."""
    module = _small_transformer()
    handle = apply_offload(module, "cuda")  # wrapping only checks the device's kind; nothing runs on a GPU here
    copied = copy.deepcopy(module)
    assert copied.training_step.__self__ is copied and copied.training_step._memkit_offload
    assert module.training_step.__self__ is module
    handle.remove()
    assert "training_step" not in module.__dict__ and not getattr(module.training_step, "_memkit_offload", False)


def test_a_pickled_offloading_module_still_offloads_its_own_step():
    """A module wrapped by hand and then pickled (a spawned process, torch.save) keeps offloading, bound to the
    loaded module: not its class's plain step, silently."""
    import pickle

    module = _small_transformer()
    apply_offload(module, "cuda")
    loaded = pickle.loads(pickle.dumps(module))
    assert loaded.training_step._memkit_offload and loaded.training_step.__self__ is loaded
    from lightning.pytorch.utilities.model_helpers import is_overridden
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

    # what Lightning reads from a training_step: overridden, and its signature through __wrapped__
    assert is_overridden("training_step", loaded) and is_param_in_hook_signature(loaded.training_step, "batch_idx")


def test_an_estimate_of_an_offloading_module_counts_what_its_step_saves():
    """estimate_memory's fake step of a module whose training_step apply_offload wrapped: the same peak and the same
    breakdown as the module's own (offload is what mode="offload" models; torch's save_on_cpu inside the fake step
    took every saved tensor from the counting: 0 B of activations, all of it "temporaries")."""
    plain = estimate_memory(_small_transformer(), device="cpu")
    module = _small_transformer()
    apply_offload(module, "cuda")
    offloading = estimate_memory(module, device="cpu")
    assert plain.by_category["activations"] > 0
    assert (offloading.peak_bytes, offloading.by_category) == (plain.peak_bytes, plain.by_category)


def _fit_with_budget(module, **checkpointing) -> ActivationCheckpointing:
    callback = ActivationCheckpointing(policy=CheckpointBudget(fraction=0.5), verbose=False, **checkpointing)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[callback],
    )
    trainer.fit(module)
    return callback


@pytest.mark.parametrize(
    "sample_fn", [None, lambda module, batch: module.training_step(batch, 0)], ids=["step", "sample_fn"]
)
def test_a_checkpoint_budget_chooses_the_same_blocks_when_the_step_offloads(sample_fn):
    """ActivationCheckpointing's budget measures what its blocks save with offload suspended: through an offloading
    step (torch's save_on_cpu takes every saved tensor first) no block would seem to hold any and the budget "cannot
    be met" (an H200 plan's trial). On CPU the same wrapping (save_on_cpu without pinning) shows it: the same
    blocks as without offload, through the step itself or a sample_fn that calls it."""
    plain = _fit_with_budget(_small_transformer(), sample_fn=sample_fn)
    module = _small_transformer()
    handle = apply_offload(module, "cuda")
    try:
        offloading = _fit_with_budget(module, sample_fn=sample_fn)
    finally:
        handle.remove()
    assert 1 <= plain.plan.count < 3 and offloading.plan.names == plain.plan.names
    assert offloading.plan.measured_activation_bytes == plain.plan.measured_activation_bytes


def test_a_measuring_checkpointing_callback_keeps_its_blocks_when_the_step_offloads():
    """measure=True without a budget: through an offloading step the measurement saw no activation memory saved and
    the callback unwrapped its blocks as "saving nothing", warning about the wrong cause."""
    import warnings

    module = _small_transformer()
    handle = apply_offload(module, "cuda")
    callback = ActivationCheckpointing(policy="auto", measure=True, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[callback],
    )
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(module)
    finally:
        handle.remove()
    assert not [w for w in caught if "saved no activation memory" in str(w.message)]
    assert callback.plan.count == 2 and "unwrapped" not in (callback.plan.note or "")  # "auto" leaves the last block
    assert callback.plan.measured_activation_bytes < callback.plan.baseline_activation_bytes


def test_apply_checkpointing_by_budget_measures_a_plain_module_that_offloads():
    """Plain PyTorch: apply_offload wraps forward, apply_checkpointing(budget, sample) still sees the blocks' saves."""
    from lightning_memkit.modes.checkpointing import apply_checkpointing

    def model():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16)) for _ in range(3)])

    x = torch.randn(8, 16)
    expected = apply_checkpointing(model(), CheckpointBudget(fraction=0.5), sample=(x,)).plan
    offloaded = model()
    apply_offload(offloaded, "cuda")
    plan = apply_checkpointing(offloaded, CheckpointBudget(fraction=0.5), sample=(x,)).plan
    assert plan.count >= 1 and plan.names == expected.names


@pytest.mark.cuda
def test_a_checkpoint_budget_with_offload_chooses_blocks_by_what_they_save_on_the_device(tmp_path):
    """On the GPU, with ActivationOffload: the budget chooses the blocks it chooses without offload ("budget ...
    cannot be met" was an H200 plan's trial), and the fit trains."""
    from lightning_memkit import ActivationCheckpointing
    from lightning_memkit.modes.checkpoint_policy import CheckpointBudget

    chosen = {}
    for offload in (False, True):
        torch.manual_seed(0)
        module = DemoTransformer(
            vocab_size=500, d_model=128, nhead=4, layers=4, dim_feedforward=512, seq_len=128, dropout=0.0, batch_size=8
        )
        checkpointing = ActivationCheckpointing(policy=CheckpointBudget(fraction=0.5), verbose=False)
        trainer = pl.Trainer(
            accelerator="gpu",
            devices=1,
            max_steps=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            default_root_dir=str(tmp_path),
            callbacks=[checkpointing, *([ActivationOffload(verbose=False)] if offload else [])],
        )
        trainer.fit(module)
        chosen[offload] = checkpointing.plan.names
    assert chosen[True] == chosen[False] and len(chosen[True]) >= 1
