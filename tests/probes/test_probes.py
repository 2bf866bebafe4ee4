"""Memory probes: host RSS with a per-step peak, NVML/CUDA failing the way they fail here."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch

from lightning_memkit.probes import _torch_compat as probe_compat
from lightning_memkit.probes import build_probes
from lightning_memkit.probes import host as host_probe
from lightning_memkit.probes.base import MemoryProbe, ProbeSet, ProbeUnavailable
from lightning_memkit.probes.cuda import CudaAllocatorProbe
from lightning_memkit.probes.host import HostProbe
from lightning_memkit.probes.nvml import NvmlProbe
from lightning_memkit.probes.tensor import TensorProbe

BIG = 256 * 2**20  # 256 MiB: far above RSS noise


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM reset is Linux-only")
def test_host_peak_rss_is_per_step_on_linux():
    probe = HostProbe()
    assert probe.peak_is_per_step
    probe.reset_peak()
    before = probe.read()
    # an anonymous mapping written through, then unmapped: resident while mapped and returned to the OS at close,
    # whatever the allocator or an earlier test in this process did to malloc's thresholds
    block = mmap.mmap(-1, BIG)
    for offset in range(0, BIG, mmap.PAGESIZE):
        block[offset] = 1  # each page touched, so resident
    block.close()
    during = probe.read()
    assert during["host_peak_rss_bytes"] >= before["host_rss_bytes"] + BIG * 0.9
    assert during["host_rss_bytes"] < during["host_peak_rss_bytes"] - BIG * 0.9  # freed again
    probe.reset_peak()  # a new step: the big block is not in its peak
    after = probe.read()
    assert after["host_peak_rss_bytes"] < during["host_peak_rss_bytes"] - BIG * 0.9
    assert after["host_peak_rss_bytes"] >= after["host_rss_bytes"]


def test_host_peak_falls_back_to_lifetime_peak_when_reset_is_refused(monkeypatch):
    # an OS (or sandbox) that refuses /proc/self/clear_refs: the peak becomes the lifetime peak
    monkeypatch.setattr(host_probe, "_CLEAR_REFS", "/proc/nonexistent/clear_refs")
    probe = HostProbe()
    assert not probe.peak_is_per_step
    values = probe.read()
    assert values["host_peak_rss_bytes"] >= values["host_rss_bytes"] > 0


def test_nvml_unavailable_here_raises_probe_unavailable_with_nvmls_reason():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    pynvml = pytest.importorskip("pynvml")
    with pytest.raises(pynvml.NVMLError):
        pynvml.nvmlInit()  # the real failure on this machine: no driver library
    with pytest.raises(ProbeUnavailable, match=r"nvmlInit failed \(NVMLError_LibraryNotFound"):
        NvmlProbe("cuda:0")
    with pytest.raises(ProbeUnavailable, match="CUDA devices only"):
        NvmlProbe("cpu")


def test_cuda_probes_unavailable_here_warn_once_each_and_are_left_out():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ProbeUnavailable, match="CUDA is not available"):
        CudaAllocatorProbe("cuda")
    with pytest.warns(RuntimeWarning) as record:
        probes = build_probes("cuda", tensor_accounting=False)
    messages = [str(w.message) for w in record]
    assert len(messages) == 2
    assert "CUDA is not available" in messages[0] and "nvmlInit failed" in messages[1]
    assert [type(p) for p in probes.probes] == [HostProbe]


def test_build_probes_for_cpu():
    probes = build_probes("cpu", tensor_accounting=True)
    assert [type(p) for p in probes.probes] == [HostProbe, TensorProbe]
    assert probes.find(TensorProbe) is probes.probes[1]
    assert [type(p) for p in build_probes("cpu", tensor_accounting=False, host=False).probes] == []


def test_cuda_history_wrappers_pin_the_private_api(tmp_path):
    # memkit reaches torch.cuda.memory's private history API only through these wrappers
    assert callable(torch.cuda.memory._record_memory_history)
    assert callable(torch.cuda.memory._dump_snapshot)
    if not torch.cuda.is_available():  # a CPU build, or a CUDA build (pip's torch 2.14.1) on a machine without a GPU
        assert probe_compat.start_memory_history(1000) is False
        assert probe_compat.dump_memory_snapshot(str(tmp_path / "none.pickle")) is False
        assert not (tmp_path / "none.pickle").exists()
        probe_compat.stop_memory_history()  # never raises


def test_tensor_probe_reads_the_accountant():
    probe = TensorProbe(scope="step")  # only what it is given and what the step allocates
    weight = torch.empty(100)
    probe.reset_peak()
    probe.start([weight])
    y = weight * 2
    del y
    probe.stop()
    assert probe.read() == {"tensor_bytes": 400, "peak_tensor_bytes": 800}
    probe.close()


def test_tensor_probe_process_scope_counts_what_it_was_not_given():
    weight = torch.empty(100)
    probe = TensorProbe()  # scope="process": every live CPU tensor storage
    probe.reset_peak()
    before = probe.read()
    assert "peak_tensor_bytes" not in before  # the accountant was not active: no peak to report
    other = torch.empty(50)  # made by nobody the probe knows of
    probe.reset_peak()
    probe.start()
    y = weight * 2
    del y
    probe.stop()
    assert probe.read() == {
        "tensor_bytes": before["tensor_bytes"] + 200,
        "peak_tensor_bytes": before["tensor_bytes"] + 200 + 400,
    }
    with pytest.raises(ValueError, match="'process'.*'step'"):
        TensorProbe(scope="everything")
    probe.close()
    del other


def test_process_scope_leaves_out_memkits_own_buffers_for_as_long_as_they_live():
    """keep_out_of_readings (the cross-rank reducer's gloo buffers): a whole-process reading never counts
    those storages, whether they exist before the probe starts or are made after; the rest is counted."""
    from lightning_memkit.accounting.process import keep_out_of_readings

    older = torch.empty(64)  # 256 B, made before the probe's full sweep
    keep_out_of_readings(older)
    probe = TensorProbe()
    probe.reset_peak()
    before = probe.read()["tensor_bytes"]
    newer, counted = torch.empty(32), torch.empty(8)  # 128 B left out, 32 B counted
    keep_out_of_readings(newer)
    probe.reset_peak()
    assert probe.read()["tensor_bytes"] == before + 32
    assert not probe.accountant.is_tracked(older) and not probe.accountant.is_tracked(newer)
    probe.close()
    del older, newer, counted


class _Counting(MemoryProbe):
    name = "counting"

    def __init__(self):
        self.resets = 0

    def reset_peak(self):
        self.resets += 1
        if self.resets == 2:
            raise ValueError("second reset fails")

    def read(self):
        return {"tensor_bytes": self.resets}


def test_probe_set_drops_a_probe_whose_reset_fails(recwarn):
    probe = _Counting()
    probes = ProbeSet([probe])
    probes.reset_peak()
    assert probes.read() == {"tensor_bytes": 1}
    probes.reset_peak()
    probes.reset_peak()
    assert probes.read() == {}
    assert probe.resets == 2
    assert len([w for w in recwarn.list if "counting" in str(w.message)]) == 1
    assert "reset_peak failed: ValueError" in probes.disabled["counting"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and /proc are Linux here")
def test_host_probe_reads_its_own_process_after_fork():
    import os

    probe = HostProbe()
    probe.reset_peak()
    parent_before = probe.read()["host_peak_rss_bytes"]
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: a big touched block (no torch: its thread pool does not survive fork)
        try:
            probe.reset_peak()
            block = b"x" * BIG
            os.write(write_end, str(probe.read()["host_peak_rss_bytes"]).encode())
            del block
        finally:
            os._exit(0)
    os.close(write_end)
    import select

    ready, _, _ = select.select([read_end], [], [], 60)
    if not ready:
        os.kill(pid, 9)
    child_peak = int(os.read(read_end, 64) or 0) if ready else 0
    os.waitpid(pid, 0)
    os.close(read_end)
    assert child_peak > BIG  # the child's own VmHWM, reopened after the fork
    assert probe.read()["host_peak_rss_bytes"] < parent_before + BIG * 0.5  # the parent never held it
