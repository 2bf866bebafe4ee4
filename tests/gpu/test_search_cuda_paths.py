"""The CUDA paths, tested on CPU where their logic allows and on a GPU (``cuda`` marker) where it does not:
a GradScaler left "unscaled" by a trial that ran out of memory, NVML's device lookup, the CUDA memory
history's stacks, the capacity of ``cuda:0`` and ``StepTimer(0)``; the private torch API the search
touches is pinned here."""

from __future__ import annotations

import inspect
import types
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_memkit import MaxBatchSize, MemoryTracker
from lightning_memkit.probes.base import MemoryProbe, ProbeUnavailable
from lightning_memkit.probes.nvml import find_nvml_handle, pci_bus_id_of
from lightning_memkit.search._torch_compat import reset_scaler_optimizer_stages
from lightning_memkit.timing import StepTimer
from lightning_memkit.zoo import DemoMLP, SyntheticDataModule

FEATURES = 32
FITS_UP_TO = 8


# ------------------------------------------------------------------------------------------ GradScaler
def test_pinned_torch_gradscaler_keeps_per_optimizer_stages_that_the_reset_clears():
    """torch.amp.GradScaler._per_optimizer_states (a defaultdict of _refresh_per_optimizer_state) is what
    search/_torch_compat.py resets: a second unscale_ before update() raises until it is reset."""
    from torch.amp import grad_scaler

    assert callable(grad_scaler._refresh_per_optimizer_state)
    assert grad_scaler._refresh_per_optimizer_state()["stage"] is grad_scaler.OptState.READY
    parameter = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([parameter], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(parameter.sum()).backward()
    scaler.unscale_(optimizer)
    assert scaler._per_optimizer_states[id(optimizer)]["stage"] is grad_scaler.OptState.UNSCALED
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        scaler.unscale_(optimizer)
    assert reset_scaler_optimizer_stages(scaler) is True
    scaler.unscale_(optimizer)  # ready again, as after update()
    assert reset_scaler_optimizer_stages(object()) is False


class OutOfMemoryAfterUnscale(torch.optim.SGD):
    """SGD whose step runs out of memory above FITS_UP_TO samples: called by GradScaler.step, after
    Lightning's MixedPrecision.optimizer_step has called scaler.unscale_ (as Adam creating its state would)."""

    batch = 0

    def step(self, closure=None):
        if self.batch > FITS_UP_TO:
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 MiB (raised inside the optimizer step)"
            )
        return super().step(closure)


class ScaledMLP(DemoMLP):
    def __init__(self):
        super().__init__(in_features=FEATURES, hidden=32, depth=1)
        del self.batch_size  # on the datamodule
        self.sizes: list[int] = []

    def training_step(self, batch, batch_idx):
        self.sizes.append(int(batch[0].shape[0]))
        for optimizer in self.trainer.optimizers:
            optimizer.batch = int(batch[0].shape[0])
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        return OutOfMemoryAfterUnscale(self.parameters(), lr=0.01)


def _fit_with_scaler(tmp_path, accelerator, plugins, precision=None):
    data = SyntheticDataModule(batch_size=4, train_size=256, val_size=8, input_shape=(FEATURES,))
    model = ScaledMLP()
    search = MaxBatchSize(
        budget="1GiB" if accelerator == "cpu" else None, init_val=4, max_val=16, use_estimate=False, verbose=False
    )
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=1,
        max_steps=3,
        plugins=plugins,
        precision=precision,
        callbacks=[search],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(model, datamodule=data)
    return trainer, model, data, search


def test_a_trial_out_of_memory_after_unscale_leaves_the_scaler_ready_and_the_fit_trains(tmp_path):
    """16-mixed with an explicit torch.amp.GradScaler on CPU (Lightning turns a plain precision="16-mixed" into
    bf16 on CPU, with no scaler): trials at 4 and 8 fit, 16 runs out of memory inside the optimizer step; the
    search goes on (each failed trial is followed by another, which unscales again) and the fit trains 3 steps at 8."""
    scaler = torch.amp.GradScaler("cpu")
    trainer, model, data, search = _fit_with_scaler(tmp_path, "cpu", [MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    assert trainer.precision_plugin.scaler is scaler
    failed = [t.batch_size for t in search.result.trials if not t.fits]
    assert len(failed) >= 2 and all(size > FITS_UP_TO for size in failed), failed
    assert max(t.batch_size for t in search.result.trials if t.fits) == FITS_UP_TO
    assert data.batch_size == FITS_UP_TO and trainer.global_step == 3
    assert model.sizes[-3:] == [FITS_UP_TO] * 3


@pytest.mark.cuda
def test_a_trial_out_of_memory_after_unscale_on_cuda_16_mixed(tmp_path):
    trainer, model, data, search = _fit_with_scaler(tmp_path, "cuda", [], precision="16-mixed")
    assert trainer.precision_plugin.scaler is not None
    assert data.batch_size == FITS_UP_TO and trainer.global_step == 3
    assert model.sizes[-3:] == [FITS_UP_TO] * 3


# ------------------------------------------------------------------------------------------ NVML
class FakeNvml:
    """pynvml's lookups, answering only for the keys given; every other one raises like NVML does."""

    class NVMLError_NotFound(Exception):
        pass

    def __init__(self, known: dict[str, str]):
        self.known = known
        self.asked: list[str] = []

    def _lookup(self, key):
        self.asked.append(key)
        if key not in self.known:
            raise self.NVMLError_NotFound("Not Found")
        return self.known[key]

    nvmlDeviceGetHandleByUUID = _lookup
    nvmlDeviceGetHandleByPciBusId = _lookup
    # no nvmlDeviceGetHandleByIndex: a lookup by the CUDA ordinal would fail here with AttributeError


def test_nvml_lookup_by_uuid_then_mig_uuid_then_pci_bus_id_never_by_index():
    uuid, pci = "0f1e2d3c-aaaa-bbbb-cccc-000000000001", "00000000:3B:00.0"
    gpu = FakeNvml({f"GPU-{uuid}": "gpu"})
    assert find_nvml_handle(gpu, uuid, pci) == "gpu" and gpu.asked == [f"GPU-{uuid}"]
    mig = FakeNvml({f"MIG-{uuid}": "mig"})
    assert find_nvml_handle(mig, f"MIG-{uuid}", pci) == "mig" and mig.asked == [f"GPU-{uuid}", f"MIG-{uuid}"]
    bus = FakeNvml({pci: "bus"})
    assert find_nvml_handle(bus, uuid, pci) == "bus" and bus.asked == [f"GPU-{uuid}", f"MIG-{uuid}", pci]
    none = FakeNvml({})
    with pytest.raises(ProbeUnavailable, match="NVML does not know this CUDA device .*NVMLError_NotFound"):
        find_nvml_handle(none, uuid, pci)
    assert pci_bus_id_of(types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0)) == pci
    assert pci_bus_id_of(object()) is None


class RaisingNvmlProbe(MemoryProbe):
    """A probe whose reading raises NVML's error, as a device NVML lost would."""

    name = "nvml-fake"

    def read(self):
        import pynvml

        raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)


def test_an_nvml_error_switches_the_probe_off_with_one_warning_and_the_fit_trains(tmp_path):
    pytest.importorskip("pynvml")
    tracker = MemoryTracker(verbose=False, extra_probes=[RaisingNvmlProbe()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=3,
            callbacks=[tracker],
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            default_root_dir=str(tmp_path),
        )
        trainer.fit(
            ScaledMLP(),
            datamodule=SyntheticDataModule(batch_size=4, train_size=64, val_size=8, input_shape=(FEATURES,)),
        )
    said = [str(w.message) for w in caught if "nvml-fake" in str(w.message)]
    assert len(said) == 1 and "switched off" in said[0] and "NVMLError" in said[0], said
    assert trainer.global_step == 3 and [r.step for r in tracker.history] == [0, 1, 2]
    assert all(r.tensor_bytes for r in tracker.history)


@pytest.mark.cuda
def test_nvml_finds_this_cuda_device_by_its_uuid():
    pynvml = pytest.importorskip("pynvml")
    from lightning_memkit.probes.nvml import NvmlProbe

    probe = NvmlProbe("cuda:0")
    try:
        uuid = str(torch.cuda.get_device_properties(0).uuid)
        found = pynvml.nvmlDeviceGetUUID(probe._handle)
        found = found.decode() if isinstance(found, bytes) else found
        assert (
            found.split("-", 1)[1] == uuid.split("-", 1)[1]
            if uuid.startswith(("GPU-", "MIG-"))
            else found.endswith(uuid)
        )
        assert probe.read()["device_total_bytes"] > 0
    finally:
        probe.close()


# ------------------------------------------------------------------------------------------ the rest
def test_pinned_torch_memory_history_takes_stacks_and_max_entries():
    parameters = inspect.signature(torch.cuda.memory._record_memory_history).parameters
    assert "stacks" in parameters and "max_entries" in parameters
    assert MemoryTracker().cuda_memory_stacks == "python"


def test_step_timer_reads_an_int_as_that_cuda_device():
    if torch.cuda.is_available():
        assert StepTimer(0).source == "cuda_events"
    else:
        with pytest.raises(ValueError, match="CUDA is not available"):
            StepTimer(0)  # it timed on the host clock, silently
    with pytest.raises(ValueError, match="not a bool"):
        StepTimer(True)


@pytest.mark.cuda
def test_the_capacity_of_cuda_0_is_device_0s():
    from lightning_memkit.estimate.largest_batch import device_capacity_bytes

    last = torch.cuda.device_count() - 1
    with torch.cuda.device(last):  # the current device is another one where there are several
        assert device_capacity_bytes("cuda:0") == torch.cuda.get_device_properties(0).total_memory
        assert device_capacity_bytes("cuda") == torch.cuda.get_device_properties(last).total_memory
