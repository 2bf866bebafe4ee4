"""The GPU lane: memkit's CUDA claims, checked on a real CUDA device (``make test-gpu``).

Every test here is marked ``cuda``: collected everywhere, skipped where ``torch.cuda.is_available()`` is false
(tests/conftest.py). Each test's docstring says what breakage it catches; docs/gpu_tests.md has them in one table. The
checks they assert with (tests/helpers/gpu_checks.py) share nothing with the code they check: a step's peak from the
allocator's own events, never its peak counter; waits for the device caught where they happen, explicit ones included;
pinned blocks by address, asked of the driver; a step's time against a host clock around the same step of the same run.
Each check also runs on a CPU stand-in in the main lane, once as it is and once with the code it guards broken on
purpose (tests/gpu/test_gpu_lane_checks.py), so it is seen to fail for the breakage it names.
"""

from __future__ import annotations

import gc
import time

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch import Callback
from torch import nn

from lightning_memkit import ActivationCheckpointing, LayerTrace, MaxBatchSize, MemoryMeter, MemoryTracker, zoo
from lightning_memkit.modes.comparison import compare_modes
from lightning_memkit.timing import StepTimer
from tests.helpers.gpu_checks import (
    AllocatorStepPeaks,
    FirstStepScratch,
    PinnedBlocks,
    SyncCounter,
    SynchronizedStepTime,
    check_no_memkit_sync,
    check_pinned_released,
    check_same_steps_timed_alike,
    check_step_peaks,
    host_stats,
    pinned_bytes_held,
    watched_release,
)
from tests.helpers.live_tensors import describe, live_tensors

pytestmark = pytest.mark.cuda

# A transformer whose step is activation-bound and GPU-bound: 8 post-norm encoder blocks, d 512, ff 2048,
# 32 sequences of 512 tokens (about 5 GiB of fp32 activations against about 0.3 GiB of weights,
# gradients and Adam state; tens of ms of fp32 matmuls per step on an H100).
ACTIVATION_BOUND = {
    "vocab_size": 1000,
    "d_model": 512,
    "nhead": 8,
    "layers": 8,
    "dim_feedforward": 2048,
    "seq_len": 512,
    "batch_size": 32,
}
# A small one for the fits that only need to run.
SMALL = {
    "vocab_size": 100,
    "d_model": 64,
    "nhead": 4,
    "layers": 3,
    "dim_feedforward": 128,
    "seq_len": 32,
    "batch_size": 8,
}

MiB, GiB = 1 << 20, 1 << 30


def _trainer(tmp_path, callbacks=(), **overrides) -> pl.Trainer:
    options = {
        "accelerator": "gpu",
        "devices": 1,
        "max_steps": 6,
        "logger": False,
        "default_root_dir": str(tmp_path),
        "callbacks": list(callbacks),
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
        "log_every_n_steps": 1,
    }
    options.update(overrides)
    return pl.Trainer(**options)


class _ScratchFirstTransformer(FirstStepScratch, zoo.DemoTransformer):
    """The small transformer, its first training step also making and freeing a 64 MiB scratch tensor."""

    scratch_bytes = 64 * MiB


def _fit_waits(tmp_path, callbacks) -> SyncCounter:
    """Every wait for the device in a fit of the small transformer with ``callbacks``."""
    trainer = _trainer(tmp_path, callbacks)
    model = zoo.DemoTransformer(**SMALL)
    with SyncCounter() as syncs:
        trainer.fit(model)
    return syncs


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """baseline, bf16 and checkpoint on the activation-bound transformer, 20 steps each."""
    root = tmp_path_factory.mktemp("compare_cuda")
    return compare_modes(
        lambda: zoo.DemoTransformer(**ACTIVATION_BOUND),
        modes="baseline,bf16,checkpoint",
        max_steps=20,
        accelerator="gpu",
        root_dir=str(root),
        val_batches=0,
        verbose=False,
        figures=False,
    )


# ---------------------------------------------------------------------------------------------- reading
def test_tracker_peak_is_the_allocators_own_high_point_every_step(tmp_path):
    """MemoryTracker's ``peak_allocated_bytes`` of each training step equals the allocator's own high point of that
    step, exactly: the bytes allocated at its start plus the highest rise of the allocator's running total in it, as
    the profiler records it at every allocation and free (gpu_checks.AllocatorStepPeaks, which never reads nor resets
    the peak counter the tracker resets). The first step also makes and frees a 64 MiB scratch tensor, so its peak is
    the run's highest by about that much.

    Catches: a tracker that does not reset its peak each step (every later step would read the first step's scratch);
    one that reads its peak at another moment (before the optimizer step, or after the next step began), from another
    counter (reserved, active) or another device. CPU mutation run:
    test_gpu_lane_checks.py::test_the_step_peak_check_fails_when_the_tracker_never_resets_its_peak."""
    tracker, independent = MemoryTracker(every_n_steps=1, verbose=False), AllocatorStepPeaks("cuda")
    _trainer(tmp_path, [tracker, independent]).fit(_ScratchFirstTransformer(**SMALL))
    train = [r for r in tracker.history if r.stage == "train"]
    assert len(train) == 6 and tracker.summary.peak_source == "peak_allocated_bytes"
    check_step_peaks([r.peak_allocated_bytes for r in train], independent.peaks)
    peaks = independent.peaks
    assert peaks[0] - max(peaks[1:]) >= _ScratchFirstTransformer.scratch_bytes // 2, peaks  # the scratch is step 0's


def test_the_meter_never_synchronizes_the_device():
    """Three plain PyTorch steps measured by MemoryMeter wait for the device nowhere: no explicit wait
    (``torch.cuda.synchronize``, an Event's or a Stream's ``synchronize``) and no op that waits (sync-debug mode), in
    the meter or in the step (which has none).

    Catches: a probe or the meter's window (reset, read) that waits for the device, explicitly or through an op
    (``.item()``, ``.cpu()``, ``.tolist()`` of a CUDA tensor). CPU mutation run:
    test_gpu_lane_checks.py::test_the_sync_check_fails_when_memkit_waits_for_the_device."""
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs = torch.randn(64, 256, device="cuda")
    meter = MemoryMeter(torch.device("cuda"))
    with SyncCounter() as syncs:
        for step in range(3):
            with meter.measure(step=step):
                model(inputs).pow(2).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
    assert syncs.calls == [], syncs.describe()
    assert meter.last.peak_allocated_bytes > 0


def test_memory_tracker_adds_no_synchronizing_call_to_a_fit(tmp_path):
    """A fit with MemoryTracker: no wait for the device is made with memkit's code on the stack (its hooks, probes,
    readings, logging), explicit or inside an op, and the fit waits no more often, of any kind, than the same fit
    without it (before and after: Lightning's own waits).

    Catches: a probe, a reading or the tracker's logging that waits for the device: an explicit
    ``torch.cuda.synchronize`` or Event/Stream wait (which sync-debug mode does not report) or an op that waits. CPU
    mutation run: test_gpu_lane_checks.py::test_the_sync_check_fails_when_memkit_waits_for_the_device."""
    _fit_waits(tmp_path, [])  # warm-up: CUDA context, cuBLAS handles, Lightning's first fit
    without_before = _fit_waits(tmp_path, [])
    with_tracker = _fit_waits(tmp_path, [MemoryTracker(verbose=False)])
    without_after = _fit_waits(tmp_path, [])
    check_no_memkit_sync(with_tracker)
    for kind, count in with_tracker.counts().items():
        most = max(without_before.counts()[kind], without_after.counts()[kind])
        assert count <= most, (kind, count, most, with_tracker.describe())


# ---------------------------------------------------------------------------------------------- modes
def test_checkpoint_and_bf16_cut_a_transformers_cuda_peak(compared):
    """compare_modes on the activation-bound transformer, 20 steps a mode: checkpointing cuts the CUDA peak by at least
    45% and bf16 by at least 25%, every step's peak is CUDA's, and the baseline's peak is the highest of its steps.

    Catches: a checkpoint mode that does not checkpoint on CUDA (or checkpoints nothing that matters), bf16 not applied,
    a mode's peak read from another source than CUDA's allocator (host RSS, the accountant)."""
    base, bf16, checkpoint = compared["baseline"], compared["bf16"], compared["checkpoint"]
    for result in compared.results:
        assert result.status == "ok", result.error
        assert result.peak_source == "peak_allocated_bytes" and result.steps == 20
    assert 1 - checkpoint.peak_ratio >= 0.45, checkpoint.peak_ratio
    assert 1 - bf16.peak_ratio >= 0.25, bf16.peak_ratio
    assert checkpoint.checkpoint_helped is True and checkpoint.counterpart == "baseline"
    assert base.peak_allocated_bytes == max(peak for _, peak in base.step_peaks)


# ---------------------------------------------------------------------------------------------- time
def test_compare_step_time_is_the_device_time_of_the_same_steps(tmp_path):
    """compare_modes' step times (CUDA events) against a host clock around the same steps of the same run, the device
    waited for at both ends of each (gpu_checks.SynchronizedStepTime, after compare's own timer in the callbacks):
    every timed step, and their median, within 10%, on the activation-bound transformer (tens of ms a step).

    Catches: step times that are the host's launch time (a host clock read without waiting: a small part of the
    device's time here), events recorded on another stream than the step's, a unit slip, a step's time given to
    another step. CPU mutation run:
    test_gpu_lane_checks.py::test_the_timing_check_fails_when_the_timer_misses_the_time_a_step_waits."""
    truth = SynchronizedStepTime()
    compared = compare_modes(
        lambda: zoo.DemoTransformer(**ACTIVATION_BOUND),
        modes="baseline",
        max_steps=20,
        accelerator="gpu",
        root_dir=str(tmp_path),
        val_batches=0,
        write=False,
        figures=False,
        verbose=False,
        trainer_kwargs={"callbacks": [truth]},
    )
    measured = compared["baseline"]
    assert measured.status == "ok", measured.error
    assert measured.time_source == "cuda_events" and measured.timed_steps == 17
    warmup = measured.warmup_steps
    check_same_steps_timed_alike(measured.step_times_s[warmup:], truth.times_s[warmup:], 0.10)


def test_step_timer_reads_cuda_events_without_waiting_for_the_device():
    """StepTimer's start, stop and poll make no wait for the device (none of any kind: explicit or inside an op), the
    host is ahead of the device when the window closes, at most ``max_pending`` windows wait unread, and the first
    window's time is within 10% of the host clock around that same window with the device waited for at both ends.

    Catches: a timer that waits for its events while the steps run (``Event.synchronize``, which sync-debug mode does
    not report), one that times the host's launches instead of the device's work, a unit slip, an unbounded backlog.
    CPU mutation runs: test_gpu_lane_checks.py::test_the_sync_check_fails_when_memkit_waits_for_the_device (a timer that
    waits for its end event) and ::test_the_timing_check_fails_when_the_timer_misses_the_time_a_step_waits."""
    a = torch.randn(4096, 4096, device="cuda")

    def work(matrix):
        for _ in range(40):  # tens of ms of fp32 matmuls; the scale keeps the values near 1
            matrix = (matrix @ matrix).mul_(1 / 64)
        return matrix

    a = work(a)  # warm-up: cuBLAS handle, clocks
    timer = StepTimer(torch.device("cuda"), max_pending=2)
    assert timer.source == "cuda_events"
    torch.cuda.synchronize()
    started = time.perf_counter()
    with SyncCounter() as syncs:  # start, stop and poll must not wait
        timer.start()
        a = work(a)
        timer.stop()
        assert timer.pending == 1  # the host got here long before the device did
        assert timer.poll() in (0, 1)
    torch.cuda.synchronize()
    synchronized = time.perf_counter() - started
    assert syncs.calls == [], syncs.describe()
    for _ in range(4):  # more windows than max_pending: the oldest are read, waited for only past the bound
        timer.start()
        torch.mm(a, a)
        timer.stop()
        assert timer.pending <= 2
    times = timer.times_s()
    assert len(times) == 5 and timer.pending == 0 and all(t > 0 for t in times)
    check_same_steps_timed_alike(times[:1], [synchronized], 0.10)


# ---------------------------------------------------------------------------------------------- leaks
def test_no_cuda_memory_is_left_after_a_fit_with_every_memkit_callback(tmp_path):
    """After a fit with MemoryTracker, LayerTrace, ActivationCheckpointing and MaxBatchSize, no tensor is on the device
    (counted with gc, not with memkit) and CUDA's allocated bytes are back to what they were, while the callbacks are
    still referenced and after they are dropped.

    Catches: a callback kept after the fit that holds a tensor on the device (a reading, a trace, a search trial's
    batch or module), a hook left on the model, trials whose tensors outlive the search."""

    def fit(callbacks) -> None:
        model = zoo.DemoTransformer(**SMALL)
        trainer = _trainer(tmp_path, callbacks, max_steps=4)
        trainer.fit(model)
        del trainer, model
        gc.collect()

    fit([ActivationCheckpointing(verbose=False)])  # warm-up: cuBLAS workspaces (main and autograd threads), context
    before = torch.cuda.memory_allocated()
    callbacks = [
        MemoryTracker(verbose=False),
        LayerTrace(at_steps=(1,), figure=False),
        ActivationCheckpointing(verbose=False),
        MaxBatchSize(budget="2GiB", max_val=64, max_trials=6, verbose=False),
    ]
    fit(callbacks)
    # the callbacks are still referenced: they may hold records, never a tensor on the device
    left = live_tensors("cuda")
    assert left == [], describe(left)
    assert torch.cuda.memory_allocated() == before
    del callbacks
    gc.collect()
    assert torch.cuda.memory_allocated() == before


# ---------------------------------------------------------------------------------- memkit estimate --check
class _TwoStepPeaks(Callback):
    """Peaks of two training steps from ``on_train_start``, as the recorded GPU truth was taken."""

    def on_train_start(self, trainer, pl_module) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def on_train_end(self, trainer, pl_module) -> None:
        torch.cuda.synchronize()
        self.peaks = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())


def test_memkit_estimate_check_prints_the_estimate_against_two_real_steps_and_leaves_nothing(tmp_path, capsys):
    """``memkit estimate --check`` in baseline and bf16: what it prints and writes as real is what torch reports for the
    same two steps of a fresh fit (peak allocated and reserved), its table rows are those figures, and it leaves no
    tensor on the device.

    Catches: a check that measures something else than two real steps from the fit's start (another window, another
    precision), a table that misprints its figures, copies or cached blocks left behind."""
    import json
    import re

    from lightning_memkit.cli import main
    from lightning_memkit.units import format_bytes

    def fit_two_steps(precision: str) -> tuple[int, int]:
        reader = _TwoStepPeaks()
        trainer = _trainer(tmp_path, [reader], max_steps=2, precision=precision)
        trainer.fit(zoo.DemoTransformer(**SMALL))
        del trainer
        gc.collect()
        torch.cuda.empty_cache()
        return reader.peaks

    fit_two_steps("32-true")  # warm-up: cuBLAS workspaces (main and autograd threads), context
    before = torch.cuda.memory_allocated()
    out_json = tmp_path / "check.json"
    status = main(
        [
            "estimate",
            "lightning_memkit.zoo:DemoTransformer",
            "--init-args",
            json.dumps(SMALL),
            "--modes",
            "baseline,bf16",
            "--check",
            "--json",
            str(out_json),
        ]
    )
    out = capsys.readouterr().out
    assert status == 0, out
    # the check's copies, trainers and cached blocks are gone
    left = live_tensors("cuda")
    assert left == [], describe(left)
    assert torch.cuda.memory_allocated() == before
    results = {r["mode"]: r for r in json.loads(out_json.read_text())["results"]}
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("mode") and "allocated real" in line)
    rows = {
        re.split(r"\s{2,}", line.strip())[0]: re.split(r"\s{2,}", line.strip()) for line in lines[start + 2 : start + 4]
    }
    for mode, precision in (("baseline", "32-true"), ("bf16", "bf16-mixed")):
        check, cuda = results[mode]["check"], results[mode]["estimate"]["cuda"]
        assert check["steps"] == 2
        assert check["estimated_peak_allocated_bytes"] == cuda["peak_allocated_bytes"]
        # what it printed as real is what torch reports for the same two steps of a fresh fit
        assert (check["peak_allocated_bytes"], check["peak_reserved_bytes"]) == fit_two_steps(precision)
        real_allocated, real_reserved = check["peak_allocated_bytes"], check["peak_reserved_bytes"]
        assert rows[mode][2:] == [
            format_bytes(cuda["peak_allocated_bytes"]),
            format_bytes(real_allocated),
            f"{(cuda['peak_allocated_bytes'] - real_allocated) / real_allocated:+.1%}",
            format_bytes(cuda["peak_reserved_bytes"]),
            format_bytes(real_reserved),
            f"{(cuda['peak_reserved_bytes'] - real_reserved) / real_reserved:+.1%}",
        ]


def test_one_fsdp2_rank_on_the_device_against_the_world_size_1_estimate(tmp_path):
    """One rank of an FSDP2 step (``fully_shard`` on each block and the root, NCCL, world size 1, in a fresh process)
    against ``estimate_distributed_memory(strategy="model_parallel", world_size=1, device="cuda")``: the sharded
    parameters exactly, and the two steps' peak allocated within the CUDA estimate's bounds (-3%..+10%, as for the
    recorded H100 truth).

    Catches: a per-rank estimate whose shards or CUDA peak drift from what FSDP2 allocates on a device."""
    from tests.helpers.processes import run_script

    script = tmp_path / "fsdp2_rank.py"
    script.write_text(
        "import warnings\n"
        "warnings.filterwarnings('ignore')\n"
        "import torch, torch.distributed as dist\n"
        "from torch import nn\n"
        "from torch.distributed.fsdp import fully_shard\n"
        "from lightning_memkit.estimate.distributed.per_rank import estimate_distributed_memory\n"
        "from lightning_memkit.zoo import DemoTransformer\n"
        "name = torch.cuda.get_device_name(0).lower()\n"
        "gpu = next((g for g in ('h200', 'h100', 'a100', 'l4', 'v100') if g in name), None)\n"
        "estimate = estimate_distributed_memory(DemoTransformer(dropout=0.0), 16, strategy='model_parallel',\n"
        "                                       world_size=1, wrap={nn.TransformerEncoderLayer}, device='cuda',\n"
        "                                       gpu=gpu)\n"
        "print('estimate', estimate.by_category['parameters'], estimate.single.cuda.peak_allocated_bytes)\n"
        "torch.cuda.set_device(0)\n"
        "dist.init_process_group('nccl', store=dist.HashStore(), rank=0, world_size=1,\n"
        "                        device_id=torch.device('cuda', 0))\n"
        "torch.manual_seed(0)\n"
        "model = DemoTransformer(dropout=0.0).cuda()\n"
        "for block in model.blocks:\n"
        "    fully_shard(block)\n"
        "fully_shard(model)\n"
        "optimizer = model.configure_optimizers()\n"
        "inputs, labels = next(iter(model.train_dataloader()))\n"
        "inputs, labels = inputs.cuda(), labels.cuda()\n"
        "torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()\n"
        "for _ in range(2):  # Lightning's order: forward, zero_grad, backward, step\n"
        "    loss = nn.functional.cross_entropy(model(inputs), labels)\n"
        "    optimizer.zero_grad(set_to_none=True)\n"
        "    loss.backward()\n"
        "    del loss\n"
        "    optimizer.step()\n"
        "torch.cuda.synchronize()\n"
        "local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())\n"
        "print('real', local, torch.cuda.max_memory_allocated())\n"
        "dist.destroy_process_group()\n"
    )
    output = run_script([str(script)], cwd=str(tmp_path), timeout=600)
    (estimated,) = [list(map(int, line.split()[1:])) for line in output.splitlines() if line.startswith("estimate ")]
    (real,) = [list(map(int, line.split()[1:])) for line in output.splitlines() if line.startswith("real ")]
    assert estimated[0] == real[0], output[-3000:]
    error = (estimated[1] - real[1]) / real[1]
    assert -0.03 <= error <= 0.10, f"estimated {estimated[1]} B, real {real[1]} B ({error:+.1%})"


# ------------------------------------------------------------------------------------------ the planner's trials


class _Wide(pl.LightningModule):
    """``layers`` Linear(width, width) on batches of ``rows`` random rows, Adam: a trial's memory is mostly the model's
    (width 4096: 64 MiB of fp32 weights per layer, four times that with their gradients and Adam's state), so a
    model counted twice shows. From inside the real (not fake) steps of its trials, which train copies of it, it
    records on the class the device it ran on and whether allocating ``probe_bytes`` failed; ``explode`` raises."""

    devices: list = []
    probes: list = []
    probe_bytes = 0
    explode = False

    def __init__(self, width: int = 2048, layers: int = 4, rows: int = 8, loss_scale: float = 1.0) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        self.batch_size = rows
        self.loss_scale = loss_scale
        self.data = torch.randn(4 * rows, width, generator=torch.Generator().manual_seed(0))

    def training_step(self, batch, batch_idx):
        from torch._subclasses.fake_tensor import FakeTensor

        (x,) = batch
        if not isinstance(x, FakeTensor):  # the estimate's fake steps are not the trial's
            type(self).devices.append(x.device)
            if type(self).probe_bytes:
                try:
                    probe = torch.empty(type(self).probe_bytes, dtype=torch.uint8, device=x.device)
                    type(self).probes.append(True)
                    del probe
                except torch.OutOfMemoryError:
                    type(self).probes.append(False)
            if type(self).explode:
                raise ValueError("planted in the trial's step")
        return self.net(x).float().pow(2).mean() * self.loss_scale

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-4)

    def train_dataloader(self):
        from torch.utils.data import DataLoader, TensorDataset

        return DataLoader(TensorDataset(self.data), batch_size=self.batch_size, drop_last=True)


@pytest.fixture
def wide_records():
    _Wide.devices, _Wide.probes, _Wide.probe_bytes, _Wide.explode = [], [], 0, False
    yield _Wide
    _Wide.devices, _Wide.probes, _Wide.probe_bytes, _Wide.explode = [], [], 0, False


def _trial(module, candidate, budget, warmup=1, timed=2, **row_fields):
    """One of the planner's CUDA trials of ``candidate`` on ``module``'s first batch: ``(fits, note, row)``."""
    from lightning_memkit.plan.result import PlanRow
    from lightning_memkit.plan.trials import TrialSteps, trial

    batch = next(iter(module.train_dataloader()))
    row = PlanRow(candidate, None, None, None, True, **row_fields)
    record = trial(module, candidate, batch, budget, "cuda", TrialSteps(warmup, timed), row.offload_bytes)
    row.keep(record)
    return record.fits, row.note, row


def test_a_plans_trial_counts_the_model_on_the_device_once(wide_records):
    """AutoFit plans at fit start, its module already on the device. Its trial's reserved peak is the one-model figure
    (the original waits in host memory while the copy trains), the same Parameter objects are back on the device after,
    and a budget of that figure plus the CUDA context, once, fits.

    Catches: a trial that keeps the original on the device beside its copy (a model counted twice: plans that refuse
    what fits), one that moves the original back as new Parameter objects (an optimizer built on them would train
    stale ones), a budget that counts the context twice."""
    from lightning_memkit.estimate.cuda.caching_allocator import CUDA_CONTEXT_BYTES
    from lightning_memkit.plan import Candidate

    module = _Wide(width=4096)  # 256 MiB of weights
    weights = sum(p.numel() * p.element_size() for p in module.parameters())
    candidate = Candidate(8, 1)
    _trial(module, candidate, 64 * GiB)  # warm-up: cuBLAS workspaces, the context
    fits, note, on_host = _trial(module, candidate, 64 * GiB)
    assert fits, note
    module.cuda()  # where AutoFit finds it: the strategy moved it before on_fit_start
    parameters = list(module.parameters())
    fits, note, on_device = _trial(module, candidate, 64 * GiB)
    assert fits, note
    assert abs(on_device.measured_reserved_bytes - on_host.measured_reserved_bytes) < weights // 4, (on_host.note, note)
    assert all(a is b for a, b in zip(module.parameters(), parameters, strict=True)) and all(
        p.is_cuda for p in parameters
    )
    budget = on_host.measured_reserved_bytes + CUDA_CONTEXT_BYTES + 64 * MiB
    fits, note, row = _trial(module, candidate, budget)
    assert fits, note
    assert row.measured_reserved_bytes + CUDA_CONTEXT_BYTES <= budget
    module.cpu()


def test_a_trial_runs_under_an_allocator_capped_at_the_budget(wide_records):
    """While a trial trains, the caching allocator of an 80+ GiB card cannot reserve more than the budget less the CUDA
    context (a step's attempt to allocate that much fails in the trial, and succeeds after it); the cap before is
    restored after, also when the trial raises; a trial over the cap runs out of memory and reports how far it got;
    the peaks are on the row and in its note.

    Catches: a trial that is not capped (on a large card it fits what a card of the budget's size would not), a cap left
    after the trial (the real fit capped), the module left off the device after a trial that raised."""
    from lightning_memkit.estimate.cuda.caching_allocator import CUDA_CONTEXT_BYTES
    from lightning_memkit.plan import Candidate
    from lightning_memkit.units import format_bytes

    module = _Wide()  # 64 MiB of weights: about 300 MiB in a trial
    budget = 2 * GiB
    cap = budget - CUDA_CONTEXT_BYTES
    assert torch.cuda.get_per_process_memory_fraction(0) == 1.0
    wide_records.probe_bytes = cap
    fits, note, row = _trial(module, Candidate(8, 1), budget)
    assert fits, note
    assert wide_records.probes and not any(wide_records.probes)  # every step's probe ran out of memory: capped
    assert torch.cuda.get_per_process_memory_fraction(0) == 1.0
    probe = torch.empty(cap, dtype=torch.uint8, device="cuda")  # uncapped again
    del probe
    assert row.measured_allocated_bytes <= row.measured_reserved_bytes <= cap
    assert (
        note.startswith("ran: ")
        and (
            f"peaks {format_bytes(row.measured_allocated_bytes)} allocated, "
            f"{format_bytes(row.measured_reserved_bytes)} reserved"
        )
        in note
    )
    assert f"allocator capped at {format_bytes(cap)}" in note
    # over the cap: out of memory, as a card of 640 MiB would
    wide_records.probe_bytes = 0
    fits, note, row = _trial(module, Candidate(8, 1), CUDA_CONTEXT_BYTES + 128 * MiB)
    assert not fits and note.startswith("out of memory"), note
    assert row.measured_reserved_bytes <= 128 * MiB and torch.cuda.get_per_process_memory_fraction(0) == 1.0
    # a trial that raises: the cap and the module on the device are restored
    module.cuda()
    wide_records.explode = True
    with pytest.raises(ValueError, match="planted"):
        _trial(module, Candidate(8, 1), budget)
    assert torch.cuda.get_per_process_memory_fraction(0) == 1.0
    assert all(p.is_cuda for p in module.parameters())
    module.cpu()


def test_a_plan_refuses_a_device_index_the_machine_lacks(wide_records):
    """``plan_fit(device="cuda:<device_count>")`` is refused, naming the devices there are.

    Catches: an index dropped or wrapped (a plan on a device other than the one named)."""
    from lightning_memkit.plan import PlanError, plan_fit

    with pytest.raises(PlanError, match=rf"device='cuda:{torch.cuda.device_count()}': this machine has"):
        plan_fit(_Wide(), device=f"cuda:{torch.cuda.device_count()}", device_memory="2GiB", verbose=False)


def test_a_plan_runs_its_trials_on_the_device_it_names(wide_records):
    """``plan_fit(device="cuda:N")``, N the machine's last device (``cuda:0`` on a machine of one GPU), with
    ``cuda:0`` current: every real step of its trial trains on ``cuda:N``, its peaks are that device's (more than the
    model's 64 MiB of weights), ``cuda:0`` is current again after, and where N is not 0 nothing of the trial was on
    ``cuda:0``. The index plumbing itself, on CPU:
    test_gpu_lane_checks.py::test_a_cuda_plan_enters_the_device_it_names_and_its_trials_train_there.

    Catches: trials trained elsewhere than the named device (on the CPU; on the current device instead of the one
    named, where there are two), the current device left changed, peaks read from another device."""
    from lightning_memkit.plan import plan_fit

    index = torch.cuda.device_count() - 1
    torch.cuda.set_device(0)
    torch.cuda.reset_peak_memory_stats(0)
    with torch.cuda.device(0):
        plan = plan_fit(
            _Wide(),
            device=f"cuda:{index}",
            device_memory="2GiB",
            trials=1,
            verbose=False,
            warmup_steps=1,
            timed_steps=2,
        )
        assert torch.cuda.current_device() == 0
    assert plan.fits_as_is, plan.table()
    assert wide_records.devices and set(wide_records.devices) == {torch.device("cuda", index)}
    assert plan.rows[0].measured_reserved_bytes > 64 * MiB
    if index != 0:
        assert torch.cuda.max_memory_allocated(0) < 16 * MiB  # nothing of the trial was on cuda:0


def test_an_fp16_trial_runs_until_its_optimizer_state_exists(wide_records):
    """A plan's trial in ``16-mixed`` on a loss large enough that the GradScaler skips its first steps (more of them
    than the trial's warm-up and timed steps): the trial runs on until its timed steps were real ones, so Adam's two
    states per weight were allocated (the peak holds weights, gradients and both states) and the skipped steps are
    not timed.

    Catches: a trial that fits on steps the GradScaler skipped (a peak without the optimizer's state: a plan that runs
    out of memory at the first real step), skipped steps timed as real ones."""
    from lightning_memkit.plan import Candidate

    module = _Wide(width=1024, loss_scale=2.0**20)
    weights = sum(p.numel() * p.element_size() for p in module.parameters())
    fits, note, row = _trial(module, Candidate(8, 1, "16-mixed"), 64 * GiB, warmup=1, timed=4)
    assert fits, note
    assert "optimizer steps skipped by the GradScaler" in note and "ms of 4;" in note
    assert row.measured_allocated_bytes >= 4 * weights


def _watching_the_release(read, seen):
    """The release a trial calls at its end (by either name it may be called), watched: ``read()`` goes to ``seen`` just
    before each call (gpu_checks.watched_release)."""
    import contextlib

    from lightning_memkit.plan import cuda_trial, trials

    stack = contextlib.ExitStack()
    stack.enter_context(watched_release(trials, "release", read, seen))
    stack.enter_context(watched_release(cuda_trial, "release", read, seen))
    return stack


def test_offload_trials_check_the_host_and_leave_no_pinned_memory_cached():
    """An offload trial whose predicted pinned bytes the host cannot spare is refused before it runs. One that runs
    pins host memory (every block its saved tensors were copied into, seen by address: gpu_checks.PinnedBlocks); each
    block is still pinned, cached by torch's caching host allocator, when the trial's release starts, and none is after
    (the driver's answer for each address); the pinned bytes the allocator holds (``torch.cuda.host_memory_stats``,
    read in either torch's layout) drop from at least those blocks' bytes to 0.

    Catches: the pinned release skipped (the blocks stay pinned for the rest of the process, out of the host's reach),
    or run while the trial's tensors still live; a trial that does not offload; the host check not made. CPU mutation
    run: test_gpu_lane_checks.py::test_the_pinned_check_fails_when_the_pinned_release_is_skipped."""
    from lightning_memkit.estimate import estimate_memory
    from lightning_memkit.plan import Candidate
    from lightning_memkit.plan.cuda_trial import release

    module = zoo.DemoTransformer(**SMALL)
    candidate = Candidate(8, 1, offload=True)
    fits, note, row = _trial(module, candidate, 64 * GiB, offload_bytes=1 << 50)
    assert not fits and note.startswith("not run: offload pins about"), note
    assert row.measured_reserved_bytes is None  # nothing ran
    host = estimate_memory(module, 8, mode="offload", device="cuda").host_bytes
    assert host > 0
    release(True)
    blocks, seen = PinnedBlocks(), []

    def read():
        return pinned_bytes_held(host_stats()), set(blocks.pinned_now())

    with _watching_the_release(read, seen), blocks:
        fits, note, row = _trial(module, candidate, 64 * GiB, offload_bytes=host)
    assert fits, note
    held_before, cached_before = seen[-1]
    check_pinned_released(blocks, cached_before)
    held_after = pinned_bytes_held(host_stats())
    if held_before is not None:  # torch.cuda.host_memory_stats: every supported torch has it
        assert held_before >= sum(blocks.blocks.values()) and held_after == 0, (held_before, held_after)


class _CompiledWide(_Wide):
    """_Wide with its layers compiled (inductor, ``mode``, static shapes)."""

    def __init__(self, mode: str | None = None, **sizes) -> None:
        super().__init__(**sizes)
        self.net = torch.compile(self.net, mode=mode, dynamic=False)


def _reserved_after_warm_up() -> int:
    """CUDA's reserved bytes once cuBLAS's workspaces (main and autograd threads) exist and the caches are empty: what a
    trial must leave the device with."""
    from lightning_memkit.plan.cuda_trial import release

    warm = nn.Linear(8, 8).cuda()
    warm(torch.ones(8, 8, device="cuda")).sum().backward()
    del warm
    release(True)
    return torch.cuda.memory_reserved()


def test_the_trials_of_a_compiled_model_each_compile_and_leave_no_cuda_graph_pool(wide_records):
    """With ``mode="reduce-overhead"`` (CUDA graphs), static shapes and a recompile limit of 1, each trial (two
    micro-batches) compiles its own graph (the last trial's code does not stand in the way), and after each the device
    holds what it held before (the CUDA-graph pools went with dynamo's reset).

    Catches: dynamo's caches not reset around a trial (the second micro-batch past the recompile limit runs eagerly,
    timed and measured as another program than the real fit's), CUDA-graph pools left on the device after a trial."""
    from lightning_memkit.compiled._torch_compat import dynamo_counters
    from lightning_memkit.plan import Candidate

    # dynamo's own config.patch: monkeypatch's undo would delete the setting, hidden from later tests
    limit = torch._dynamo.config.patch(recompile_limit=1)
    limit.__enter__()
    torch._dynamo.reset()
    module = _CompiledWide(mode="reduce-overhead", width=4096, layers=3, rows=1024)  # 16 MiB per activation
    before = _reserved_after_warm_up()

    def graphs() -> int:
        return dynamo_counters().get("stats", {}).get("unique_graphs", 0)

    try:
        for micro in (1024, 512):
            compiled = graphs()
            fits, note, row = _trial(module, Candidate(micro, 1024 // micro), 64 * GiB, warmup=2, timed=3)
            assert fits and "compiled: dynamo's caches reset before and after the trial" in note, note
            assert graphs() > compiled, micro
            assert torch.cuda.memory_reserved() - before < 32 * MiB, (micro, torch.cuda.memory_reserved(), before)
    finally:
        limit.__exit__(None, None, None)
        torch._dynamo.reset()


def test_an_offload_trial_of_a_reduce_overhead_model_leaves_no_pool_and_no_pinned_memory(wide_records):
    """An offload trial of a model compiled with ``mode="reduce-overhead"`` (CUDA graphs; what its compiled forward
    saves for backward goes to pinned host memory): it runs and fits, its caches are reset around it, the device holds
    what it held before (no CUDA-graph pool left), and the pinned bytes torch's caching host allocator holds drop from
    more than 0 when the trial's release starts (the offload pinned) to 0 after.

    Catches: offload and CUDA graphs that do not run together in a trial (a plan could never choose offload for a
    reduce-overhead model), CUDA-graph pools or pinned blocks left behind by such a trial."""
    from lightning_memkit.plan import Candidate

    torch._dynamo.reset()
    module = _CompiledWide(mode="reduce-overhead", width=4096, layers=3, rows=1024)
    before = _reserved_after_warm_up()
    seen: list = []
    try:
        with _watching_the_release(lambda: pinned_bytes_held(host_stats()), seen):
            fits, note, row = _trial(module, Candidate(1024, 1, offload=True), 64 * GiB, warmup=2, timed=3)
        assert fits and "compiled: dynamo's caches reset before and after the trial" in note, note
        assert torch.cuda.memory_reserved() - before < 32 * MiB, (torch.cuda.memory_reserved(), before)
        held_before, held_after = seen[-1], pinned_bytes_held(host_stats())
        if held_before is not None:  # torch.cuda.host_memory_stats: every supported torch has it
            assert held_before > 0 and held_after == 0, (held_before, held_after)
    finally:
        torch._dynamo.reset()


# ------------------------------------------------------------------------------------------ search and AutoFit
def test_an_fp16_search_trial_fits_only_once_its_optimizer_stepped(tmp_path, wide_records):
    """MaxBatchSize in ``16-mixed`` on a loss so large that the GradScaler skips more steps than a trial has (its scaled
    gradients overflow fp16 until the scale has halved about ten times): each trial that fits ran until its optimizer
    really stepped, so Adam's two states per weight were allocated and are in its peak (weights, gradients and both
    states: at least 4 x the weights' bytes; a trial of skipped steps only reaches about 2.5 x: weights, gradients and
    their fp16 copies).

    Catches: a trial that fits on steps the GradScaler skipped (a size proved without the optimizer's state, which runs
    out of memory at the first real step)."""
    module = _Wide(width=4096, layers=2, rows=8, loss_scale=2.0**20)  # 128 MiB of fp32 weights
    weights = sum(p.numel() * p.element_size() for p in module.parameters())
    search = MaxBatchSize(init_val=8, max_val=16, max_trials=2, use_estimate=False, verbose=False)
    _trainer(tmp_path, [search], precision="16-mixed", max_steps=1).fit(module)
    fitted = [trial for trial in search.result.trials if trial.fits]
    assert fitted, search.result.trials
    assert all(trial.peak_bytes >= 4 * weights for trial in fitted), (
        [(t.batch_size, t.peak_bytes) for t in fitted],
        weights,
    )


def test_autofit_plans_and_trains_a_torch_compiled_module_on_the_device(tmp_path, wide_records):
    """``trainer.fit(torch.compile(module))`` with AutoFit: Lightning unwraps the compiled module and puts its compiled
    ``forward`` and ``training_step`` on the instance; the plan's trial trains a copy of it on the device and fits,
    and the fit trains its steps. Every real step, the trial's and the fit's, ran on ``cuda:0``.

    Catches: a trial's copy that runs the original module's compiled methods (the original waits in host memory while
    the copy trains: a device mismatch, and AutoFit stops the fit), or that measures the original instead of the
    copy."""
    from lightning_memkit.callbacks.auto_fit import AutoFit
    from lightning_memkit.plan.result import RowStatus

    autofit = AutoFit(device_memory="8GiB", trials=1, verbose=False)
    trainer = _trainer(tmp_path, [autofit], max_steps=2)
    trainer.fit(torch.compile(_Wide(width=1024)))
    assert autofit.plan is not None and any(row.status is RowStatus.RAN for row in autofit.plan.rows)
    assert trainer.global_step == 2
    assert wide_records.devices and set(wide_records.devices) == {torch.device("cuda", 0)}
    torch._dynamo.reset()
