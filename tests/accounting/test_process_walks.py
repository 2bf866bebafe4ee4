"""ProcessTensors' graph walks: each autograd graph walked once, what it holds still counted exactly.

What keeps MemoryTracker() cheap on a compiled model: a sweep walks only the graphs made since the
last one (dynamo keeps FakeTensors with a ``grad_fn`` alive as long as its compiled code: walking them at every
sweep would cost ~30 ms a step), and a tensor seen twice is never compared with itself (a WeakSet would do
that with ``==``: an elementwise op, through FakeTensor dispatch). Pinned here by counts, never by time.
"""

from __future__ import annotations

import gc

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_memkit import MemoryTracker, TensorAccountant
from lightning_memkit.accounting.process import ProcessTensors
from tests.helpers.compile_models import CompiledCNN, CountingBackend, GraphCallsPerStep
from tests.helpers.trainers import make_trainer

F32 = 4


def _started() -> tuple[TensorAccountant, ProcessTensors]:
    gc.collect()  # garbage of an earlier test, freed during this one, would move the readings
    accountant = TensorAccountant()
    return accountant, ProcessTensors(accountant, "cpu").start()


def test_a_live_graph_is_walked_once_and_the_gradient_backward_makes_later_is_counted():
    w = torch.randn(64, 32, requires_grad=True)
    x = torch.randn(8, 64)
    accountant, process = _started()
    base = accountant.current_bytes
    loss = (x @ w).pow(2).sum()  # pow saves the product (8 x 32 float32): only the graph holds it
    process.sweep()
    assert accountant.current_bytes - base == 8 * 32 * F32 + F32  # the saved product and the loss
    walked = process.nodes_walked
    assert walked >= 4  # SumBackward0, PowBackward0, MmBackward0, AccumulateGrad
    process.sweep()
    process.sweep()
    assert process.nodes_walked == walked  # the graph is not walked again
    loss.backward()  # frees the saved product; makes w.grad, which has no Python object until read
    process.sweep()
    assert accountant.current_bytes - base == 64 * 32 * F32 + F32  # the gradient and the loss
    assert process.nodes_walked == walked
    del loss
    w.grad = None
    assert accountant.current_bytes == base
    process.stop()


def test_an_in_place_op_on_a_walked_tensor_walks_its_new_graph():
    w = torch.randn(64, 32, requires_grad=True)
    x = torch.randn(8, 64)
    accountant, process = _started()
    product = x @ w
    process.sweep()
    before = accountant.current_bytes
    product.mul_(torch.full((8, 32), 2.0))  # a new grad_fn, which saved the factor (no Python object after this line)
    process.sweep()
    assert accountant.current_bytes - before == 8 * 32 * F32
    process.stop()


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_tensor_seen_at_two_sweeps_is_never_compared_with_itself():
    accountant, process = _started()
    y = torch.randn(16, requires_grad=True) * 2  # 16 elements, a grad_fn, in the youngest generation
    with _Ops() as recorded:
        process.sweep()
        process.sweep()
    assert recorded.ops == [] and process.errors == 0  # no `y == y` (an op; "ambiguous" error for 16 elements)
    del y
    process.stop()


def test_an_accountant_error_met_by_a_sweep_is_reported_by_the_accountant():
    accountant, process = _started()
    accountant.add_peak_listener(lambda peak: 1 / 0)
    x = torch.ones(4)  # not counted yet: the sweep adopts it, a new peak, and the listener raises
    process.sweep()
    assert any("ZeroDivisionError" in error for error in accountant.errors), accountant.errors
    del x
    process.stop()


def test_the_steps_of_a_compiled_fit_walk_no_graph_again(tmp_path):
    """dynamo's FakeTensors with a grad_fn live as long as the compiled code: the tracker walks their graphs once."""
    import lightning.pytorch as pl

    torch._dynamo.reset()
    backend = CountingBackend()
    model = CompiledCNN(backend=backend)
    tracker = MemoryTracker(verbose=False, records_file=None)
    counts = GraphCallsPerStep(backend)
    walked: list[int] = []

    class Spy(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            walked.append(tracker._meter.tensor_probe.process.nodes_walked)

    make_trainer(tmp_path, max_steps=6, callbacks=[tracker, Spy(), counts]).fit(model)
    torch._dynamo.reset()
    assert all(calls >= 1 for calls in counts.per_step), counts.per_step  # compiled at every step
    assert walked[-1] > 0 and walked[2:] == [walked[2]] * 4, walked  # walked, and not again after step 1
