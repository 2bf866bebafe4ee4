"""A CUDA trial's allocator cap (plan/cuda_trial.capped_allocator): the budget less the context while the trial runs,
the cap before put back after, and where none was set before, none after. torch has no "unset" call: its caching
allocator keeps no maximum for a fraction of 1 (``setMemoryFraction`` leaves ``allowed_memory_maximum`` unset unless
the fraction is below 1; ``get_per_process_memory_fraction`` then reads 1), so 1 is how a cap is removed; and a budget
that caps nothing leaves the allocator untouched. On CPU the device's fraction API is a stand-in that records what
memkit asks of it; on a GPU the allocator itself shows it (a ``garbage_collection_threshold`` acts only under a cap).
"""

from __future__ import annotations

import textwrap
import types

import pytest
import torch

from lightning_memkit.estimate.cuda.caching_allocator import CUDA_CONTEXT_BYTES
from lightning_memkit.plan import cuda_trial
from tests.helpers.processes import run_script

GiB = 1 << 30
TOTAL = 80 * GiB


class _Device:
    """The per-process fraction of one device as torch.cuda keeps it, with every ``set`` recorded."""

    def __init__(self, fraction: float = cuda_trial.NO_CAP) -> None:
        self.fraction = fraction
        self.sets: list[float] = []

    def get_device_properties(self, device):
        return types.SimpleNamespace(total_memory=TOTAL)

    def get_per_process_memory_fraction(self, device):
        return self.fraction

    def set_per_process_memory_fraction(self, fraction, device):
        self.sets.append(fraction)
        self.fraction = fraction


@pytest.fixture
def device(monkeypatch):
    stand_in = _Device()
    for name in ("get_device_properties", "get_per_process_memory_fraction", "set_per_process_memory_fraction"):
        monkeypatch.setattr(torch.cuda, name, getattr(stand_in, name))
    return stand_in


def _trial(budget: int, fails: bool = False) -> int:
    with cuda_trial.capped_allocator(torch.device("cuda", 0), budget) as cap:
        if fails:
            raise ValueError("the trial failed")
    return cap


def test_a_budget_below_the_device_caps_it_for_the_trial_and_leaves_no_cap_after(device):
    budget = 10 * GiB
    share = (budget - CUDA_CONTEXT_BYTES) / TOTAL
    assert _trial(budget) == int(share * TOTAL)
    assert device.sets == [share, cuda_trial.NO_CAP] and device.fraction == cuda_trial.NO_CAP
    with pytest.raises(ValueError, match="the trial failed"):
        _trial(budget, fails=True)
    assert device.sets[-1] == cuda_trial.NO_CAP  # put back on error too


def test_a_budget_that_caps_nothing_leaves_the_allocator_untouched(device):
    assert _trial(200 * GiB) == TOTAL  # beyond the card: the card is the cap
    assert device.sets == []  # no fraction of 1 set: where torch would keep one as a cap, none is made


def test_a_users_cap_stays_and_is_put_back_after_a_lower_one(device):
    device.fraction = 0.25
    assert _trial(40 * GiB) == int(0.25 * TOTAL) and device.sets == []  # the user's cap is the lower
    share = (10 * GiB - CUDA_CONTEXT_BYTES) / TOTAL
    assert _trial(10 * GiB) == int(share * TOTAL)
    assert device.sets == [share, 0.25] and device.fraction == 0.25


GC_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from lightning_memkit.plan import cuda_trial
    device = torch.device("cuda", 0)
    total = torch.cuda.get_device_properties(device).total_memory
    if sys.argv[1] == "trial":  # a trial capped at a quarter of the device, as the planner runs one
        with cuda_trial.capped_allocator(device, total // 4):
            torch.ones(1 << 20, device=device)
    elif sys.argv[1] == "capped":  # a cap that stays: the control, under which the threshold acts
        torch.cuda.set_per_process_memory_fraction(0.9, device)
    # the threshold is 1% of the cap: 2 GiB cached is far above it. A larger request misses the cache: under a cap,
    # the allocator first frees the cached block (garbage collection); without one it keeps it
    block = torch.empty(2 << 30, dtype=torch.uint8, device=device)
    del block
    larger = torch.empty(3 << 30, dtype=torch.uint8, device=device)
    print(torch.cuda.memory_reserved(device) // (1 << 20))
    """
)


@pytest.mark.cuda
def test_after_a_trial_the_allocator_collects_garbage_as_a_process_that_never_capped_it(tmp_path, monkeypatch):
    script = tmp_path / "gc.py"
    script.write_text(GC_SCRIPT)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.01")
    reserved = {
        run: int(run_script([str(script), run], cwd=str(tmp_path), timeout=300).split()[-1])
        for run in ("none", "capped", "trial")
    }
    assert reserved["none"] >= 5 * 1024, reserved  # no cap: the 2 GiB block stays cached beside the 3 GiB one (MiB)
    assert reserved["capped"] < reserved["none"], reserved  # under a cap the threshold freed it
    assert reserved["trial"] == reserved["none"], reserved  # after a trial: no cap left
