"""The GPU lane's checks (tests/helpers/gpu_checks.py) exercised both ways on this CPU: each runs on a CPU stand-in of
its claim and passes, then runs again with the code it guards broken on purpose (``monkeypatch``) and fails for that
breakage. docs/gpu_tests.md has the table of GPU tests, the breakage each catches and the test here that shows it.

- per-step peak: a CPU fit's MemoryTracker (the accountant) against the CPU allocator's own events; broken: the
  per-step reset removed;
- synchronisation: a CPU fit measured by MemoryTracker and timed by StepTimer waits for no device; broken: a probe, a
  reading or the timer that waits (the explicit waits sync-debug mode does not report);
- pinned memory: a trial's release of the caching host allocator's blocks, with a stand-in for that allocator (this
  torch has no CUDA); broken: the pinned release skipped;
- step time: compare's step times against a host clock around the same steps of the same run; broken: a timer clock
  that misses the time a step waits;
- the device index: a CUDA plan enters the device it names and its trials' Trainer trains there (the logic, with this
  machine's CUDA answers standing in for a two-GPU machine's).
"""

from __future__ import annotations

import time

import pytest
import torch

from lightning_memkit import MemoryTracker
from lightning_memkit.compiled._torch_compat import track_cpu_allocation_sizes
from lightning_memkit.modes.comparison import _step_recorder, compare_modes
from lightning_memkit.plan import _torch_compat as plan_compat
from lightning_memkit.plan import cuda_trial, inputs, lightning_runs, trials
from lightning_memkit.plan.space import Candidate
from lightning_memkit.probes.base import MemoryProbe, ProbeSet
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
    pinned_bytes_held,
    watched_release,
)
from tests.helpers.live_tensors import live_tensors, storage_bytes
from tests.helpers.models import LinearStack
from tests.helpers.trainers import make_trainer

SCRATCH_BYTES = 1 << 20


# ------------------------------------------------------------------------------------------------ per-step peak
class _ScratchFirst(FirstStepScratch, LinearStack):
    scratch_bytes = SCRATCH_BYTES


def _cpu_live_bytes(pl_module) -> int:
    """Bytes of every CPU tensor storage alive now, counted with gc (no collection first: the tracker's reading counts
    what the collector has not freed yet too), plus the parameters' gradients, which gc cannot find until read."""
    gradients = [p.grad for p in pl_module.parameters() if p.grad is not None]
    return storage_bytes(live_tensors("cpu", collect=False) + gradients)


def _step_peaks(tmp_path) -> tuple[list[int], list[int]]:
    """A CPU fit's per-step peaks: MemoryTracker's (the accountant, every step) and the allocator's own high points."""
    track_cpu_allocation_sizes()  # the CPU allocator reports a free of a block made between two windows too
    tracker = MemoryTracker(verbose=False, tensor_peak_every_n_steps=1)
    independent = AllocatorStepPeaks("cpu", _cpu_live_bytes)
    make_trainer(tmp_path, max_steps=4, callbacks=[tracker, independent]).fit(_ScratchFirst())
    return [r.peak_tensor_bytes for r in tracker.history if r.stage == "train"], independent.peaks


def test_the_step_peak_check_agrees_with_a_tracker_that_resets_every_step(tmp_path):
    readings, independent = _step_peaks(tmp_path)
    check_step_peaks(readings, independent)
    assert len(readings) == 4
    assert independent[0] - max(independent[1:]) >= SCRATCH_BYTES // 2, independent  # the first step's scratch shows


def test_the_step_peak_check_fails_when_the_tracker_never_resets_its_peak(tmp_path, monkeypatch):
    monkeypatch.setattr(ProbeSet, "reset_peak", lambda self: None)  # broken: no probe's peak is reset per step
    readings, independent = _step_peaks(tmp_path)
    with pytest.raises(AssertionError, match="per-step peaks differ from the allocator's own high point"):
        check_step_peaks(readings, independent)
    # every later step read the first step's scratch
    assert min(readings[1:]) - max(independent[1:]) >= SCRATCH_BYTES // 2, (readings, independent)


# ------------------------------------------------------------------------------------------------ synchronisation
class _WaitingProbe(MemoryProbe):
    """A stand-in probe whose reading makes the host wait for the device."""

    name = "waiting"

    def read(self) -> dict[str, int]:
        torch.cuda.synchronize()
        return {}


def _fit_counting_waits(tmp_path, extra_probes=()) -> SyncCounter:
    tracker = MemoryTracker(verbose=False, extra_probes=extra_probes)
    timed = _step_recorder()  # what compare_modes times each step with: memkit's StepTimer on the run's device
    with SyncCounter() as syncs:
        make_trainer(tmp_path, max_steps=3, callbacks=[tracker, timed]).fit(LinearStack())
    assert len(timed.step_times_s()) == 3
    return syncs


def test_the_sync_check_finds_no_wait_in_a_cpu_fit_measured_and_timed_by_memkit(tmp_path):
    syncs = _fit_counting_waits(tmp_path)
    check_no_memkit_sync(syncs)
    assert syncs.calls == []


def _reading_waits_for_the_stream(monkeypatch) -> tuple:
    read = ProbeSet.read

    def waiting_read(self):
        torch.cuda.Stream.synchronize(None)
        return read(self)

    monkeypatch.setattr(ProbeSet, "read", waiting_read)
    return ()


def _timer_waits_for_its_end_event(monkeypatch) -> tuple:
    stop = StepTimer.stop

    def waiting_stop(self):
        torch.cuda.Event.synchronize(None)
        stop(self)

    monkeypatch.setattr(StepTimer, "stop", waiting_stop)
    return ()


@pytest.mark.parametrize(
    ("breakage", "kind"),
    [
        (lambda monkeypatch: (_WaitingProbe(),), "torch.cuda.synchronize"),
        (_reading_waits_for_the_stream, "torch.cuda.Stream.synchronize"),
        (_timer_waits_for_its_end_event, "torch.cuda.Event.synchronize"),
    ],
    ids=["a probe that synchronizes", "a reading that waits for the stream", "a timer that waits for its end event"],
)
def test_the_sync_check_fails_when_memkit_waits_for_the_device(tmp_path, monkeypatch, breakage, kind):
    syncs = _fit_counting_waits(tmp_path, extra_probes=breakage(monkeypatch))
    with pytest.raises(AssertionError, match="memkit made the host wait for the device"):
        check_no_memkit_sync(syncs)
    assert {call.kind for call in syncs.by_memkit} == {kind} and len(syncs.by_memkit) >= 3  # one a step at least
    assert all(call.memkit_frame.startswith("lightning_memkit") for call in syncs.by_memkit)


def test_the_sync_counter_puts_back_what_it_wrapped():
    wrapped = (torch.cuda.synchronize, torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize)
    with SyncCounter() as syncs:
        assert torch.cuda.synchronize is not wrapped[0]
        torch.cuda.synchronize()  # counted, and without a CUDA device nothing to wait for
    assert (torch.cuda.synchronize, torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize) == wrapped
    assert [call.kind for call in syncs.calls] == ["torch.cuda.synchronize"] and syncs.by_memkit == []


# ------------------------------------------------------------------------------------------------ pinned memory
class _HostCacheStandIn:
    """Stands in, where torch has no CUDA, for torch's caching host allocator: pinned blocks handed out at addresses,
    still pinned once freed (cached), given back by ``empty_cache`` (what ``torch.accelerator.empty_host_cache``
    runs)."""

    def __init__(self) -> None:
        self.pinned: dict[int, int] = {}
        self._next_address = 1 << 30

    def pin(self, nbytes: int) -> int:
        address = self._next_address
        self._next_address += 1 << max(nbytes - 1, 1).bit_length()  # a power of two per block, as torch rounds
        self.pinned[address] = nbytes
        return address

    def empty_cache(self) -> None:
        self.pinned.clear()

    def is_pinned(self, address: int) -> bool:
        return address in self.pinned


@pytest.fixture
def host_cache(monkeypatch):
    """A CUDA process's release path on this CPU: ``release(True)`` finds the stand-in's ``empty_cache`` where it finds
    torch's function, with CUDA said to be available and initialised, and the device's own cache empty."""
    cache = _HostCacheStandIn()
    monkeypatch.setattr(plan_compat, "host_cache_release", lambda: cache.empty_cache)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    return cache


def _offload_trial_release(cache: _HostCacheStandIn) -> tuple[PinnedBlocks, list]:
    """What an offload trial leaves (pinned blocks, freed and cached), then the release the trial calls at its end,
    watched as the GPU test watches it."""
    blocks = PinnedBlocks(is_pinned=cache.is_pinned)
    for nbytes in (4096, 3 << 20, 1 << 20):
        blocks.note(cache.pin(nbytes), nbytes)
    seen: list = []
    with watched_release(trials, "release", lambda: set(blocks.pinned_now()), seen):
        trials.release(True)
    return blocks, seen


def test_the_pinned_check_passes_when_the_release_gives_the_cached_blocks_back(host_cache):
    blocks, seen = _offload_trial_release(host_cache)
    check_pinned_released(blocks, seen[-1])
    assert host_cache.pinned == {}


def test_the_pinned_check_fails_when_the_pinned_release_is_skipped(host_cache, monkeypatch):
    monkeypatch.setattr(cuda_trial, "empty_host_cache", lambda: False)  # broken: the device's cache only
    blocks, seen = _offload_trial_release(host_cache)
    with pytest.raises(AssertionError, match="3 pinned blocks .* are still pinned after the release"):
        check_pinned_released(blocks, seen[-1])


def test_the_pinned_check_fails_when_nothing_was_cached_to_release(host_cache):
    blocks = PinnedBlocks(is_pinned=host_cache.is_pinned)
    blocks.note(host_cache.pin(4096), 4096)
    host_cache.empty_cache()  # given back before the release: the release itself is not what made it so
    with pytest.raises(AssertionError, match="no longer pinned before the release"):
        check_pinned_released(blocks, set(blocks.pinned_now()))


def test_the_pinned_bytes_held_are_read_from_either_layout_of_host_memory_stats():
    """Figures with ``active_bytes`` (torch 2.13): ``allocated_bytes`` are the blocks held (handed out or cached),
    ``active_bytes`` those handed out; older figures: ``reserved_bytes`` held, ``allocated_bytes`` handed out (0 once
    freed, released or not)."""
    cached = 1 << 20
    newer = {"allocated_bytes.current": cached, "active_bytes.current": 0, "allocations.current": 1}
    older = {"allocated_bytes.current": 0, "reserved_bytes.current": cached, "segment.current": 1}
    assert pinned_bytes_held(newer) == cached and pinned_bytes_held(older) == cached
    assert pinned_bytes_held({}) is None and pinned_bytes_held(None) is None


# ------------------------------------------------------------------------------------------------ step time
class _WaitingStep(LinearStack):
    """A step that spends 20 ms waiting outside this process's CPU (a sleep, as a host waits for a device's work)."""

    def training_step(self, batch, batch_idx):
        time.sleep(0.02)
        return super().training_step(batch, batch_idx)


def _compared_with_the_clock(tmp_path) -> tuple[list[float], list[float]]:
    """compare_modes' step times of one run and a host clock around the same steps (seconds), after the warm-up."""
    truth = SynchronizedStepTime()
    compared = compare_modes(
        _WaitingStep,
        modes="baseline",
        max_steps=6,
        accelerator="cpu",
        root_dir=str(tmp_path),
        val_batches=0,
        write=False,
        figures=False,
        verbose=False,
        warmup_steps=1,
        trainer_kwargs={"callbacks": [truth]},
    )
    measured = compared["baseline"]
    assert measured.status == "ok", measured.error
    return measured.step_times_s[measured.warmup_steps :], truth.times_s[measured.warmup_steps :]


def test_the_timing_check_agrees_when_the_timer_sees_the_whole_step(tmp_path):
    timed, synchronized = _compared_with_the_clock(tmp_path)
    assert len(timed) == 5
    check_same_steps_timed_alike(timed, synchronized, 0.10)


def test_the_timing_check_fails_when_the_timer_misses_the_time_a_step_waits(tmp_path, monkeypatch):
    # broken: the timer's clock counts this process's CPU time only, as a host clock counts only the launches of a
    # step whose work runs on the device
    monkeypatch.setitem(StepTimer.__init__.__kwdefaults__, "clock", time.process_time)
    timed, synchronized = _compared_with_the_clock(tmp_path)
    with pytest.raises(AssertionError, match="steps timed more than 10% off the synchronised clock"):
        check_same_steps_timed_alike(timed, synchronized, 0.10)


# ------------------------------------------------------------------------------------------------ the device index
class _TrainerBuilt(Exception):
    pass


def test_a_cuda_plan_enters_the_device_it_names_and_its_trials_train_there(monkeypatch):
    """The index plumbing of ``plan_fit(device="cuda:1")``, with this machine's CUDA answers standing in for a machine
    of two GPUs: ``plan_device`` enters device 1 (the current one when no index is named; an index the machine lacks
    is refused), the trial's device is the current one, and the trial's Trainer is given that index."""
    from lightning_memkit.plan import PlanError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert inputs.plan_device("cuda:1").idx == 1 and inputs.plan_device(torch.device("cuda", 1)).idx == 1
    assert inputs.plan_device("cuda").idx == 0 and inputs.plan_device(None).idx == 0
    with pytest.raises(PlanError, match=r"device='cuda:2': this machine has 2 CUDA device\(s\), 0 to 1"):
        inputs.plan_device("cuda:2")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # inside plan_device("cuda:1")'s block
    assert cuda_trial.cuda_device() == torch.device("cuda", 1)
    built = {}

    def trainer(**kwargs):
        built.update(kwargs)
        raise _TrainerBuilt

    monkeypatch.setattr(lightning_runs, "Trainer", trainer)
    with pytest.raises(_TrainerBuilt):
        lightning_runs.fit_steps(LinearStack(), Candidate(8, 1), (torch.ones(8, 32),), "cuda", 2, 1, None, None)
    assert built["accelerator"] == "gpu" and built["devices"] == [1]
