"""The GPU lane: memkit's CUDA claims, checked on a real CUDA device (``make test-gpu``).

Every test here is marked ``cuda``: collected everywhere, skipped where ``torch.cuda.is_available()``
is false (tests/conftest.py). The claims:

- MemoryTracker's per-step peak equals ``torch.cuda.max_memory_allocated()`` over the same window;
- MemoryTracker adds no synchronising CUDA call (sync debug mode);
- checkpoint and bf16 modes cut a transformer's CUDA peak by at least 45% and 25%;
- compare's step time (CUDA events) is within 10% of a synchronised measurement of the same steps,
  and StepTimer never waits for the device while the steps run;
- no CUDA memory is left allocated after a fit with every memkit callback;
- the planner's CUDA trials (issue 36): the model under plan counted once, the allocator capped at the budget during
  a trial (and restored), the device index kept, fp16 trials run until the optimizer really stepped, offload's
  host memory checked and released, a compiled model's trials each compiled and no CUDA-graph pool left.
"""

from __future__ import annotations

import gc
import statistics
import time
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch import Callback
from torch import nn

from lightning_memkit import ActivationCheckpointing, LayerTrace, MaxBatchSize, MemoryMeter, MemoryTracker, zoo
from lightning_memkit.modes.comparison import compare_modes
from lightning_memkit.timing import StepTimer
from live_tensors import describe, live_tensors

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

SYNC_WARNING = "synchronizing CUDA operation"  # torch's text under set_sync_debug_mode("warn")


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


class IndependentPeak(Callback):
    """``torch.cuda.max_memory_allocated()`` over each training step's window, from torch itself.

    Placed after the MemoryTracker, it resets after the tracker opens its window and reads after the
    tracker closes it: the same window, read a second time, by torch's public function."""

    def __init__(self) -> None:
        self.peaks: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        torch.cuda.reset_peak_memory_stats()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.peaks.append(torch.cuda.max_memory_allocated())


class SynchronizedStepTime(Callback):
    """The truth a step time is checked against: wait for the device at both ends of the window."""

    def __init__(self) -> None:
        self.times_s: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        torch.cuda.synchronize()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        torch.cuda.synchronize()
        self.times_s.append(time.perf_counter() - self._start)


def _count_sync_warnings(tmp_path, callbacks) -> int:
    trainer = _trainer(tmp_path, callbacks)
    model = zoo.DemoTransformer(**SMALL)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.fit(model)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum(SYNC_WARNING in str(w.message) for w in caught)


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
def test_tracker_peak_is_torchs_max_memory_allocated_every_step(tmp_path):
    tracker, independent = MemoryTracker(every_n_steps=1, verbose=False), IndependentPeak()
    _trainer(tmp_path, [tracker, independent]).fit(zoo.DemoTransformer(**SMALL))
    train = [r for r in tracker.history if r.stage == "train"]
    assert len(train) == 6 and tracker.summary.peak_source == "peak_allocated_bytes"
    assert [r.peak_allocated_bytes for r in train] == independent.peaks


def test_the_meter_never_synchronizes_the_device():
    # "error" makes any synchronising CUDA call inside the window raise: the step itself has none
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs = torch.randn(64, 256, device="cuda")
    meter = MemoryMeter(torch.device("cuda"))
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(3):
            with meter.measure(step=step):
                model(inputs).pow(2).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert meter.last.peak_allocated_bytes > 0


def test_memory_tracker_adds_no_synchronizing_call_to_a_fit(tmp_path):
    _count_sync_warnings(tmp_path, [])  # warm-up: CUDA context, cuBLAS handles, Lightning's first fit
    without_before = _count_sync_warnings(tmp_path, [])
    with_tracker = _count_sync_warnings(tmp_path, [MemoryTracker(verbose=False)])
    without_after = _count_sync_warnings(tmp_path, [])
    assert with_tracker <= max(without_before, without_after), (with_tracker, without_before, without_after)


# ---------------------------------------------------------------------------------------------- modes
def test_checkpoint_and_bf16_cut_a_transformers_cuda_peak(compared):
    base, bf16, checkpoint = compared["baseline"], compared["bf16"], compared["checkpoint"]
    for result in compared.results:
        assert result.status == "ok", result.error
        assert result.peak_source == "peak_allocated_bytes" and result.steps == 20
    assert 1 - checkpoint.peak_ratio >= 0.45, checkpoint.peak_ratio
    assert 1 - bf16.peak_ratio >= 0.25, bf16.peak_ratio
    assert checkpoint.checkpoint_helped is True and checkpoint.counterpart == "baseline"
    assert base.peak_allocated_bytes == max(peak for _, peak in base.step_peaks)


# ---------------------------------------------------------------------------------------------- time
def test_compare_step_time_is_within_10_percent_of_a_synchronized_measurement(compared, tmp_path):
    measured = compared["baseline"]
    assert measured.time_source == "cuda_events" and measured.timed_steps == 17
    # the same steps again, with the device waited for at both ends of the same window (and the
    # same MemoryTracker in it, as compare runs one)
    pl.seed_everything(0, verbose=False)
    truth = SynchronizedStepTime()
    _trainer(tmp_path, [MemoryTracker(verbose=False), truth], max_steps=20).fit(zoo.DemoTransformer(**ACTIVATION_BOUND))
    synchronized = statistics.median(truth.times_s[measured.warmup_steps :])
    assert abs(measured.median_step_time_s / synchronized - 1) <= 0.10, (measured.median_step_time_s, synchronized)


def test_step_timer_reads_cuda_events_without_waiting_for_the_device():
    a = torch.randn(4096, 4096, device="cuda")

    def work(matrix):
        for _ in range(40):  # tens of ms of fp32 matmuls; the scale keeps the values near 1
            matrix = (matrix @ matrix).mul_(1 / 64)
        return matrix

    a = work(a)  # warm-up: cuBLAS handle, clocks
    torch.cuda.synchronize()
    timer = StepTimer(torch.device("cuda"), max_pending=2)
    assert timer.source == "cuda_events"
    torch.cuda.set_sync_debug_mode("error")  # start, stop and poll must not synchronise
    try:
        timer.start()
        a = work(a)
        timer.stop()
        assert timer.pending == 1  # the host got here long before the device did
        assert timer.poll() in (0, 1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for _ in range(4):  # more windows than max_pending: the oldest are read, waited for only past the bound
        timer.start()
        torch.mm(a, a)
        timer.stop()
        assert timer.pending <= 2
    times = timer.times_s()
    assert len(times) == 5 and timer.pending == 0 and all(t > 0 for t in times)
    # the first window against a synchronised measurement of the same work
    torch.cuda.synchronize()
    started = time.perf_counter()
    a = work(a)
    torch.cuda.synchronize()
    synchronized = time.perf_counter() - started
    assert abs(times[0] / synchronized - 1) <= 0.10, (times[0], synchronized)


# ---------------------------------------------------------------------------------------------- leaks
def test_no_cuda_memory_is_left_after_a_fit_with_every_memkit_callback(tmp_path):
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
    """Issue 12's GPU lane: one rank of an FSDP2 step (``fully_shard`` on each block and the root, NCCL,
    world size 1, in a fresh process) against ``estimate_distributed_memory(strategy="model_parallel",
    world_size=1, device="cuda")``: the sharded parameters exactly, and the two steps' peak allocated within
    the CUDA estimate's bounds (-3%..+10%, as for the recorded H100 truth)."""
    from conftest import run_script

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


# ------------------------------------------------------------------------------- the planner's trials (issue 36)
MiB, GiB = 1 << 20, 1 << 30


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
    from lightning_memkit.plan.trials import trial

    batch = next(iter(module.train_dataloader()))
    row = PlanRow(candidate, None, None, None, True, **row_fields)
    fits, _, _, note = trial(module, candidate, batch, budget, "cuda", warmup, timed, row=row)
    return fits, note, row


def test_a_plans_trial_counts_the_model_on_the_device_once(wide_records):
    """Issue 36, item 1: AutoFit plans at fit start, its module already on the device. Its trial's reserved peak is
    the one-model figure (the original waits in host memory while the copy trains), the same Parameter objects are
    back on the device after, and a budget of that figure plus the CUDA context, once, fits."""
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
    assert all(a is b for a, b in zip(module.parameters(), parameters)) and all(p.is_cuda for p in parameters)
    budget = on_host.measured_reserved_bytes + CUDA_CONTEXT_BYTES + 64 * MiB
    fits, note, row = _trial(module, candidate, budget)
    assert fits, note
    assert row.measured_reserved_bytes + CUDA_CONTEXT_BYTES <= budget
    module.cpu()


def test_a_trial_runs_under_an_allocator_capped_at_the_budget(wide_records):
    """Issue 36, item 2: while a trial trains, the caching allocator of an 80+ GiB card cannot reserve more than the
    budget less the CUDA context (a step's attempt to allocate that much fails in the trial, and succeeds after it);
    the cap before is restored after, also when the trial raises; a trial over the cap runs out of memory and
    reports how far it got; the peaks are on the row and in its note."""
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
    """Issue 36, item 4 (one GPU): an index is read, not dropped."""
    from lightning_memkit.plan import PlanError, plan_fit

    with pytest.raises(PlanError, match=rf"device='cuda:{torch.cuda.device_count()}': this machine has"):
        plan_fit(_Wide(), device=f"cuda:{torch.cuda.device_count()}", device_memory="2GiB", verbose=False)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_plan_runs_its_trials_on_the_device_it_names(wide_records):
    """Issue 36, item 4: plan_fit(device="cuda:1") trains its trials on cuda:1 (not cuda:0), its budget and peaks are
    cuda:1's, and the current device is cuda:0 again after."""
    from lightning_memkit.plan import plan_fit

    torch.cuda.set_device(0)
    torch.cuda.reset_peak_memory_stats(0)
    plan = plan_fit(
        _Wide(), device="cuda:1", device_memory="2GiB", trials=1, verbose=False, warmup_steps=1, timed_steps=2
    )
    assert plan.fits_as_is, plan.table()
    assert set(wide_records.devices) == {torch.device("cuda", 1)}
    assert torch.cuda.current_device() == 0
    assert torch.cuda.max_memory_allocated(0) < 16 * MiB  # nothing of the trial was on cuda:0
    assert plan.rows[0].measured_reserved_bytes > 64 * MiB


def test_an_fp16_trial_runs_until_its_optimizer_state_exists(wide_records):
    """Issue 36, item 5: a loss large enough that the GradScaler skips its first steps (more of them than the trial's
    warm-up and timed steps): the trial runs on until its timed steps were real ones, so Adam's two states per
    weight were allocated (the peak holds weights, gradients and both states) and the skipped steps are not timed."""
    from lightning_memkit.plan import Candidate

    module = _Wide(width=1024, loss_scale=2.0**20)
    weights = sum(p.numel() * p.element_size() for p in module.parameters())
    fits, note, row = _trial(module, Candidate(8, 1, "16-mixed"), 64 * GiB, warmup=1, timed=4)
    assert fits, note
    assert "optimizer steps skipped by the GradScaler" in note and "ms of 4;" in note
    assert row.measured_allocated_bytes >= 4 * weights


def test_offload_trials_check_the_host_and_leave_no_pinned_memory_cached():
    """Issue 36, item 6: an offload trial whose predicted pinned bytes the host cannot spare is refused before it
    runs; one that runs pins host memory, which the caching host allocator gives back after the trial."""
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
    stats = getattr(torch.cuda, "host_memory_stats", None)  # torch's pinned allocator's figures, where it has them
    if stats is not None:
        torch.cuda.reset_peak_host_memory_stats()
    fits, note, row = _trial(module, candidate, 64 * GiB, offload_bytes=host)
    assert fits, note
    if stats is not None:
        assert stats()["allocated_bytes.peak"] > 0  # the trial pinned host memory...
        assert stats()["allocated_bytes.current"] == 0  # ...and none of it is kept cached


class _CompiledWide(_Wide):
    """_Wide with its layers compiled (inductor, ``mode``, static shapes)."""

    def __init__(self, mode: str | None = None, **sizes) -> None:
        super().__init__(**sizes)
        self.net = torch.compile(self.net, mode=mode, dynamic=False)


def test_the_trials_of_a_compiled_model_each_compile_and_leave_no_cuda_graph_pool(wide_records, monkeypatch):
    """Issue 36, item 7: with ``mode="reduce-overhead"`` (CUDA graphs), static shapes and a recompile limit of 1,
    each trial (two micro-batches) compiles its own graph (the last trial's code does not stand in the way), and
    after each the device holds what it held before (the CUDA-graph pools went with dynamo's reset)."""
    from lightning_memkit.compiled._torch_compat import dynamo_counters
    from lightning_memkit.plan import Candidate
    from lightning_memkit.plan.cuda_trial import release

    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    torch._dynamo.reset()
    module = _CompiledWide(mode="reduce-overhead", width=4096, layers=3, rows=1024)  # 16 MiB per activation
    warm = nn.Linear(8, 8).cuda()  # cuBLAS's workspaces (main and autograd threads), before the reading
    warm(torch.ones(8, 8, device="cuda")).sum().backward()
    del warm
    release(True)
    before = torch.cuda.memory_reserved()

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
        torch._dynamo.reset()
