"""MemoryMeter around a plain PyTorch loop: the per-step peak equals the bytes worked out by hand."""

from __future__ import annotations

import pytest
import torch

from lightning_memkit import MemoryMeter, training_state_tensors
from lightning_memkit.probes import MemoryProbe

from conftest import FLOAT32, LinearStack

SCALAR = FLOAT32  # a 0-dim float32 tensor


@pytest.mark.parametrize("dims, batch_size", [((32, 64, 48, 16), 8), ((128, 256, 64, 10), 4)])
def test_plain_loop_peak_equals_hand_computed_bytes(dims, batch_size):
    """``zero_grad(); loss = net(x).pow(2).sum(); loss.backward(); opt.step()`` with plain SGD.

    zero_grad (set_to_none) frees last step's gradients first, so in these parameter-heavy
    nets the peak is the last moment of backward, when the first layer's bias gradient is
    allocated. Live then: parameters P, every gradient G = P (SGD keeps no state), the batch
    X = B*d0, the gradient w.r.t. the first Linear's output (B*d1, still held while that
    layer's weight and bias gradients are computed; every other activation has been freed),
    the loss and autograd's seed gradient (one float32 each). Views (``t()``, ``expand``) and
    the in-place update add nothing.
    """
    model = LinearStack(dims, batch_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(batch_size, dims[0])
    meter = MemoryMeter("cpu", host=False)

    P = model.parameter_bytes()
    G = P
    X = batch_size * dims[0] * FLOAT32
    grad_first_output = batch_size * dims[1] * FLOAT32
    expected_peak = P + G + X + grad_first_output + SCALAR + SCALAR
    # at step end: P, G, X and the loss (the seed gradient died with backward)
    expected_end = P + G + X + SCALAR

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
    base_peak = P + P + batch_size * dims[0] * FLOAT32 + batch_size * dims[1] * FLOAT32 + 2 * SCALAR
    readings = []
    for step in range(3):
        with meter.measure(step, existing=training_state_tensors(model, [optimizer], x)):
            optimizer.zero_grad()
            model(x).pow(2).sum().backward()
            optimizer.step()
        readings.append(meter.last)
    momentum = P  # one buffer the size of each parameter
    X = batch_size * dims[0] * FLOAT32
    # step 0: the buffers are cloned from the gradients in optimizer.step(), after backward
    # has freed its activations; the step ends with P, G, the buffers and X live (the loss
    # was not kept in a variable), which is more than backward's peak: that is the peak
    assert readings[0].peak_tensor_bytes == readings[0].tensor_bytes == P + P + momentum + X
    assert P + P + momentum + X > base_peak
    # later steps carry the buffers through backward's peak
    assert [r.peak_tensor_bytes for r in readings[1:]] == [base_peak + momentum] * 2
    meter.shutdown()


def test_inference_window_counts_only_new_tensors_when_nothing_is_adopted():
    model = LinearStack((16, 32, 8), 4)
    x = torch.randn(4, 16)
    meter = MemoryMeter("cpu", host=False)
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
