"""MemoryMeter around a plain PyTorch loop: the per-step peak equals the bytes worked out by hand.

The default ``tensor_scope="process"`` counts every live tensor storage of the process (what CUDA's
allocated bytes mean); a test reads the process's bytes before its loop with an empty window
(``_process_bytes``: the model, the batch, the data and whatever else this pytest process holds)
and works out by hand what the steps add on top. ``tensor_scope="step"`` keeps the older meaning
(only what the step is given and allocates) and is tested with absolute figures.
"""

from __future__ import annotations

import pytest
import torch

from lightning_memkit import MemoryMeter, training_state_tensors
from lightning_memkit.probes.base import MemoryProbe
from tests.helpers.models import FLOAT32, LinearStack
from tests.helpers.paths import REPO_ROOT

SCALAR = FLOAT32  # a 0-dim float32 tensor


def _process_bytes(meter: MemoryMeter) -> int:
    """The process's live tensor bytes as the meter reads them now (an empty window), after a full
    collection: garbage that earlier tests left in reference cycles would otherwise be counted here
    and freed by a collection later in the test."""
    import gc

    gc.collect()
    meter.open(-1)
    return meter.close().tensor_bytes


@pytest.mark.parametrize("scope", ["process", "step"])
@pytest.mark.parametrize(("dims", "batch_size"), [((32, 64, 48, 16), 8), ((128, 256, 64, 10), 4)])
def test_plain_loop_peak_equals_hand_computed_bytes(dims, batch_size, scope):
    """``zero_grad(); loss = net(x).pow(2).sum(); loss.backward(); opt.step()`` with plain SGD.

    zero_grad (set_to_none) frees last step's gradients first, so in these parameter-heavy
    nets the peak is the last moment of backward, when the first layer's bias gradient is
    allocated. Live then: parameters P, every gradient G = P (SGD keeps no state), the batch
    X = B*d0, the gradient w.r.t. the first Linear's output (B*d1, still held while that
    layer's weight and bias gradients are computed; every other activation has been freed),
    the loss and autograd's seed gradient (one float32 each). Views (``t()``, ``expand``) and
    the in-place update add nothing.

    "process" scope: P and X (and the model's data, and anything else alive) are in the process
    before the loop, read as ``base``; "step" scope: only P and X, adopted at each step.
    """
    model = LinearStack(dims, batch_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(batch_size, dims[0])
    meter = MemoryMeter("cpu", host=False, tensor_scope=scope)

    P = model.parameter_bytes()
    G = P
    X = batch_size * dims[0] * FLOAT32
    base = _process_bytes(meter) if scope == "process" else P + X
    if scope == "process":
        assert base >= P + X + model.data.nbytes
    grad_first_output = batch_size * dims[1] * FLOAT32
    expected_peak = base + G + grad_first_output + SCALAR + SCALAR
    # at step end: P, G, X and the loss (the seed gradient died with backward)
    expected_end = base + G + SCALAR

    peaks, ends = [], []
    for step in range(3):
        with meter.measure(step, existing=training_state_tensors(model, [optimizer], x)):
            optimizer.zero_grad()
            loss = model(x).pow(2).sum()
            loss.backward()
            optimizer.step()
        peaks.append(meter.last.peak_tensor_bytes)
        ends.append(meter.last.tensor_bytes)
        assert meter.last.step == step and meter.last.stage == "train"
    assert peaks == [expected_peak] * 3
    assert ends == [expected_end] * 3
    meter.shutdown()


def test_momentum_state_is_counted_once_created():
    """SGD with momentum allocates one buffer per parameter at the first step (inside the
    window, so counted as new) and keeps it: from then on it is part of every step's peak."""
    dims, batch_size = (32, 64, 48, 16), 8
    model = LinearStack(dims, batch_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    x = torch.randn(batch_size, dims[0])
    meter = MemoryMeter("cpu", host=False)
    P = model.parameter_bytes()
    base = _process_bytes(meter)  # P, X, the model's data and the rest of the process
    base_peak = base + P + batch_size * dims[1] * FLOAT32 + 2 * SCALAR
    readings = []
    for step in range(3):
        with meter.measure(step, existing=training_state_tensors(model, [optimizer], x)):
            optimizer.zero_grad()
            model(x).pow(2).sum().backward()
            optimizer.step()
        readings.append(meter.last)
    momentum = P  # one buffer the size of each parameter
    # step 0: the buffers are cloned from the gradients in optimizer.step(), after backward
    # has freed its activations; the step ends with P, G, the buffers and X live (the loss
    # was not kept in a variable), which is more than backward's peak: that is the peak
    assert readings[0].peak_tensor_bytes == readings[0].tensor_bytes == base + P + momentum
    assert base + P + momentum > base_peak
    # later steps carry the buffers through backward's peak
    assert [r.peak_tensor_bytes for r in readings[1:]] == [base_peak + momentum] * 2
    meter.shutdown()


def test_inference_window_counts_only_new_tensors_when_nothing_is_adopted():
    model = LinearStack((16, 32, 8), 4)
    x = torch.randn(4, 16)
    meter = MemoryMeter("cpu", host=False, tensor_scope="step")
    with torch.no_grad(), meter.measure(0):
        y = model(x)
    # no_grad: h1 (B*32) is freed after ReLU, which (out of place) allocates r1 (B*32); the
    # peak holds h1 and r1 together, then r1 and y (B*8) remain until y is the only one left
    assert meter.last.peak_tensor_bytes == 2 * 4 * 32 * FLOAT32
    assert meter.last.tensor_bytes == 4 * 8 * FLOAT32
    del y
    meter.shutdown()


def test_meter_lifecycle_errors_are_clear():
    meter = MemoryMeter("cpu", tensor_accounting=False)
    assert meter.tensor_probe is None
    with pytest.raises(RuntimeError, match="call open"):
        meter.close()
    with pytest.raises(ValueError, match="True, False or 'auto'"):
        MemoryMeter("cpu", tensor_accounting="yes")
    meter.open(5, "validate", rank=1)
    reading = meter.close()
    assert (reading.step, reading.stage, reading.rank) == (5, "validate", 1)
    assert reading.host_rss_bytes > 0 and reading.host_peak_rss_bytes >= reading.host_rss_bytes
    assert reading.peak_tensor_bytes is None
    assert meter.capacity_bytes() > 0  # host RAM on CPU


def test_auto_accounting_is_on_for_cpu():
    assert MemoryMeter("cpu").tensor_probe is not None
    assert MemoryMeter("meta").tensor_probe is not None


class _Broken(MemoryProbe):
    name = "broken"

    def __init__(self):
        self.reads = 0

    def read(self):
        self.reads += 1
        raise OSError("device went away")


def test_failing_extra_probe_warns_once_and_the_others_keep_reading(recwarn):
    broken = _Broken()
    meter = MemoryMeter("cpu", extra_probes=[broken])
    for step in range(3):
        with meter.measure(step):
            torch.ones(10)
        assert meter.last.host_rss_bytes > 0
    warnings = [w for w in recwarn.list if "broken" in str(w.message)]
    assert len(warnings) == 1
    assert "OSError: device went away" in str(warnings[0].message)
    assert broken.reads == 1
    with pytest.raises(TypeError, match="MemoryProbe"):
        MemoryMeter("cpu", extra_probes=[object()])


# ---------------------------------------------------------------------------- the whole process
def test_process_scope_sees_tensors_made_outside_any_window():
    """Whatever keeps memory alive between windows shows in ``tensor_bytes`` by its exact bytes:
    a tensor made by plain code, one that survived a full collection before the window opened,
    one made without any aten op (``torch.from_numpy``), a leaf's gradient (no Python object
    until read) and an autograd graph kept outside the window, whose saved activation has no
    Python object either. Their frees show too."""
    import gc

    import numpy as np

    meter = MemoryMeter("cpu", host=False)
    base = _process_bytes(meter)
    kept = torch.zeros(1000)  # 4,000 bytes
    gc.collect()  # moved out of the young generation: seen by the collector hook
    from_numpy = torch.from_numpy(np.zeros(250, dtype=np.float64))  # 2,000 bytes, made by numpy
    leaf = torch.zeros(100, requires_grad=True)  # 400 bytes
    leaf.sum().backward()  # leaf.grad: 400 bytes, made in C++
    w = torch.ones(300, requires_grad=True)  # 1,200 bytes
    y = (w * 2).sin()  # y: 1,200 bytes; sin saved w * 2 (1,200 bytes), reachable only through y's graph
    # and mul saved its other operand: the Python 2, wrapped by torch as a 0-dim int64 tensor (8 bytes)
    with meter.measure(0):
        pass
    assert meter.last.tensor_bytes - base == 4000 + 2000 + 400 + 400 + 1200 + 1200 + 1200 + 8
    assert meter.last.peak_tensor_bytes == meter.last.tensor_bytes
    del y  # the graph and its saved activation go with it
    with meter.measure(1):
        pass
    assert meter.last.tensor_bytes - base == 4000 + 2000 + 400 + 400 + 1200
    del kept, from_numpy, leaf, w
    with meter.measure(2):
        pass
    assert meter.last.tensor_bytes == base
    meter.shutdown()


def test_process_scope_never_unpacks_what_a_hook_packed():
    """A graph whose saved tensors went through ``saved_tensors_hooks`` (activation checkpointing
    does this) is walked without running the unpack hook: nothing is recomputed, and the tensors
    the pack hook kept are counted through their own Python objects."""
    unpacked = []
    meter = MemoryMeter("cpu", host=False)
    base = _process_bytes(meter)
    w = torch.ones(300, requires_grad=True)  # 1,200 bytes
    with torch.autograd.graph.saved_tensors_hooks(lambda t: ("kept", t.clone()), lambda p: unpacked.append(1) or p[1]):
        y = (w * 2).sin()  # the pack hook keeps a clone (1,200 bytes); w * 2 itself dies
    with meter.measure(0):
        pass
    assert unpacked == []
    # w, y, the packed clone, and the Python 2 that mul saved (a 0-dim int64 tensor; packed
    # through the same hook, so a clone of it is kept)
    assert meter.last.tensor_bytes - base == 1200 + 1200 + 1200 + 8
    y.sum().backward()
    assert unpacked == [1]  # backward unpacked it once, as it should
    del y, w
    meter.shutdown()


def test_process_reading_equals_an_independent_gc_count(tmp_path):
    """In a fresh process, the meter's reading equals the bytes of every tensor the garbage
    collector can reach (tests/helpers/live_tensors.py), before and after a step that keeps tensors."""
    from tests.helpers.processes import run_script

    script = tmp_path / "count.py"
    script.write_text(
        "import sys, torch\n"
        f"sys.path.insert(0, {REPO_ROOT!r})\n"
        "from tests.helpers.live_tensors import live_tensor_bytes\n"
        "from lightning_memkit import MemoryMeter\n"
        "model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))\n"
        "kept = [torch.randn(33, 7) for _ in range(5)]\n"
        "meter = MemoryMeter('cpu', host=False)\n"
        "x = torch.randn(16, 64)\n"
        "with meter.measure(0):\n"
        "    with torch.no_grad():\n"
        "        kept.append(model(x))\n"
        "print('first', meter.last.tensor_bytes, live_tensor_bytes())\n"
        "kept.append(torch.zeros(12345, dtype=torch.uint8))\n"
        "with meter.measure(1):\n"
        "    pass\n"
        "print('second', meter.last.tensor_bytes, live_tensor_bytes())\n"
    )
    output = run_script([str(script)], cwd=str(tmp_path), timeout=300)
    lines = {
        line.split()[0]: [int(v) for v in line.split()[1:]]
        for line in output.splitlines()
        if line.startswith(("first", "second"))
    }
    assert lines["first"][0] == lines["first"][1] > 0
    assert lines["second"][0] == lines["second"][1] == lines["first"][0] + 12345


def test_the_collector_hook_goes_with_the_meter():
    import gc

    gc.collect()  # meters other tests dropped without shutdown() take their hooks with them here
    hooks = len(gc.callbacks)
    meter = MemoryMeter("cpu", host=False)
    assert len(gc.callbacks) == hooks + 1
    meter.shutdown()
    assert len(gc.callbacks) == hooks
    forgotten = MemoryMeter("cpu", host=False)  # never shut down: the hook must not outlive it
    assert len(gc.callbacks) == hooks + 1
    del forgotten
    gc.collect()
    assert len(gc.callbacks) == hooks
