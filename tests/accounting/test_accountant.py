"""TensorAccountant: exact live-storage bytes, views never double counted, frees seen anywhere."""

from __future__ import annotations

import gc

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_memkit import TensorAccountant
from lightning_memkit.accounting.accountant import returns_alias
from lightning_memkit.probes.base import ProbeSet
from lightning_memkit.probes.tensor import TensorProbe
from tests.helpers.paths import REPO_ROOT

F32 = 4


def test_new_tensor_counts_its_storage_bytes_exactly():
    acc = TensorAccountant()
    with acc:
        a = torch.empty(100)  # 400 B
        b = torch.empty(3, 5, dtype=torch.float64)  # 120 B
        c = torch.empty(7, dtype=torch.uint8)  # 7 B
    assert acc.current_bytes == 400 + 120 + 7
    assert acc.peak_bytes == 527
    assert acc.allocated_bytes_total == 527
    del a, b, c


def test_tensors_built_from_python_data_are_counted():
    """torch.tensor(data) builds its tensor in C++ outside the dispatcher and hands it to aten.lift_fresh (an alias by
    its schema): a loss weight or a step counter made that way inside a step is memory the step holds."""
    acc = TensorAccountant()
    with acc:
        weights = torch.tensor([1.0, 2.0, 3.0, 4.0])  # 4 float32
        step = torch.tensor(7, dtype=torch.int64)  # 1 int64
        mask = torch.tensor([[True, False]] * 5)  # 10 bool
        assert acc.current_bytes == 16 + 8 + 10
        assert all(acc.is_tracked(t) for t in (weights, step, mask))
        del weights, mask
        assert acc.current_bytes == 8
    assert acc.peak_bytes == 34


def test_views_inplace_and_detach_are_not_double_counted():
    acc = TensorAccountant()
    with acc:
        a = torch.zeros(10, 10)  # 400 B: the only allocation
        views = [
            a.view(100),
            a.t(),
            a[2:5],
            a.reshape(100),
            a.expand(1, 10, 10),
            a.view(torch.int32),
            a.detach(),
            a.unsqueeze(0),
        ]
        a.add_(1.0)
        a.mul_(2.0)
        a[0].fill_(3.0)
        a.t().abs_()
    assert acc.current_bytes == 400
    assert acc.peak_bytes == 400
    assert len(acc.live_records()) == 1
    # every alias maps to the same record
    assert {id(acc.record_of(v)) for v in views} == {id(acc.record_of(a))}
    with acc:
        copy = a.t().contiguous()  # a real copy: a new storage
    assert acc.current_bytes == 800
    del views, copy
    assert acc.current_bytes == 400
    del a
    assert acc.current_bytes == 0


def test_frees_outside_the_mode_are_seen():
    acc = TensorAccountant()
    with acc:
        a = torch.empty(1000)
        b = torch.empty(500)
    assert acc.current_bytes == 6000
    del a  # outside the mode
    assert acc.current_bytes == 2000
    assert acc.peak_bytes == 6000
    acc.reset_peak()
    assert acc.peak_bytes == 2000
    del b
    assert acc.current_bytes == 0 and acc.live_keys() == set()


def test_a_view_keeps_the_storage_alive_after_the_base_is_deleted():
    acc = TensorAccountant()
    with acc:
        a = torch.empty(256)
        v = a[:10]
    del a
    assert acc.current_bytes == 1024  # the storage lives on through the view
    del v
    assert acc.current_bytes == 0


def test_tensors_from_before_are_ignored_until_adopted_and_adoption_is_idempotent():
    weight = torch.empty(64, 32)  # 8192 B
    bias = torch.empty(32)  # 128 B
    acc = TensorAccountant()
    with acc:
        y = weight.sum()  # 4 B result; the operand existed before and is not counted
    assert acc.current_bytes == 4
    assert acc.adopt([weight, bias, None, "not a tensor"]) == 8192 + 128
    assert acc.adopt([weight, bias, weight.t(), weight[0]]) == 0  # views of adopted storages too
    assert acc.current_bytes == 8192 + 128 + 4
    assert acc.record_of(weight).adopted and acc.record_of(weight).label == "adopted"
    assert not acc.record_of(y).adopted
    assert acc.allocated_bytes_total == 4  # adoption is not allocation
    del weight
    assert acc.current_bytes == 128 + 4


def test_resize_is_tracked():
    acc = TensorAccountant()
    with acc:
        x = torch.empty(10)
        assert acc.current_bytes == 40
        x.resize_(1000)
        assert acc.current_bytes == 4000
        x.resize_(2000)
    assert acc.current_bytes == 8000 and acc.peak_bytes == 8000
    # shrinking a tensor keeps its storage's allocation (torch never shrinks a storage)
    with acc:
        x.resize_(5)
    assert acc.current_bytes == 8000
    del x
    assert acc.current_bytes == 0


def test_labels_split_current_and_peak():
    acc = TensorAccountant()
    with acc:
        with acc.labelled("forward"):
            a = torch.empty(100)
        previous = acc.set_label("backward")
        b = torch.empty(50)
        acc.set_label(previous)
    assert acc.current_bytes_by_label == {"forward": 400, "backward": 200}
    assert acc.peak_bytes_by_label == {"forward": 400, "backward": 200}
    del a
    assert acc.current_bytes_by_label == {"backward": 200}
    assert acc.peak_bytes_by_label == {"forward": 400, "backward": 200}  # the split at the peak
    del b


def test_many_short_lived_tensors_return_to_zero():
    # storage ids are reused by Python; the weakref callback must retire the old record first
    acc = TensorAccountant()
    with acc:
        total = torch.zeros(())
        for _ in range(200):
            total = total + torch.ones(17).sum()
    del total
    gc.collect()
    assert acc.current_bytes == 0
    # at the peak: the running total, ones(17) and its sum (the temporary ones(17) is freed
    # before the addition allocates the new total)
    assert acc.peak_bytes == 4 + 68 + 4


def test_fake_tensor_mode_counts_fake_storages_exactly():
    with FakeTensorMode():
        weight = torch.empty(1024, 1024)  # 4 MiB, fake: no real memory
        acc = TensorAccountant()
        acc.adopt([weight])
        with acc:
            y = weight @ weight
            z = y.relu()
            del y
            w = z.view(-1)
        assert acc.current_bytes == 2 * 1024 * 1024 * F32
        assert acc.peak_bytes == 3 * 1024 * 1024 * F32
        del z, w
        assert acc.current_bytes == 1024 * 1024 * F32
    assert acc.errors == []


def test_meta_tensors_are_counted():
    acc = TensorAccountant()
    with acc:
        m = torch.empty(1000, device="meta")
        n = (m + 1).to(torch.float16)
    assert acc.current_bytes == 4000 + 2000
    assert acc.peak_bytes == 4000 + 4000 + 2000
    del m, n


def test_an_error_in_our_accounting_never_propagates_out_of_dispatch():
    acc = TensorAccountant()

    def broken_listener(peak):
        raise ValueError("listener bug")

    acc.add_peak_listener(broken_listener)
    with acc:
        x = torch.ones(8)  # a new peak: the listener raises inside __torch_dispatch__
        v = x.view(2, 4)  # a view op after the failure still works
        y = x * 2
    assert torch.equal(y, torch.full((8,), 2.0))
    assert v.shape == (2, 4)
    assert acc.error_count == 2  # two new peaks, two failures
    assert acc.errors == ["aten.ones.default: ValueError: listener bug", "aten.mul.Tensor: ValueError: listener bug"]
    # counting itself went on
    assert acc.current_bytes == 64


def test_errors_are_reported_after_the_step_by_switching_the_probe_off():
    probe = TensorProbe()
    probe.accountant.add_peak_listener(lambda peak: 1 / 0)
    probes = ProbeSet([probe])
    probes.reset_peak()
    probe.start()
    x = torch.ones(4)
    probe.stop()
    with pytest.warns(RuntimeWarning, match="'tensor' memory probe is switched off.*ZeroDivisionError"):
        assert probes.read() == {}
    assert probes.probes == [] and "tensor" in probes.disabled
    del x


def test_the_ops_own_errors_still_reach_the_caller():
    acc = TensorAccountant()
    with acc, pytest.raises(RuntimeError, match="size"):
        torch.ones(3) + torch.ones(4)
    assert acc.errors == []


def test_returns_alias_reads_the_op_schema():
    # pins the private OpOverload._schema that the accountant's fast path relies on
    aten = torch.ops.aten
    for op in (
        aten.view.default,
        aten.t.default,
        aten.add_.Tensor,
        aten.add.out,
        aten.resize_.default,
        aten.detach.default,
        aten.set_.source_Storage,
    ):
        assert returns_alias(op), op
    for op in (aten.add.Tensor, aten.mm.default, aten.clone.default, aten._to_copy.default, aten.ones_like.default):
        assert not returns_alias(op), op
    assert returns_alias(object())  # unknown: the careful path


def test_out_variant_resizing_its_output_is_tracked():
    acc = TensorAccountant()
    with acc:
        out = torch.empty(0)
        torch.add(torch.ones(10), torch.ones(10), out=out)  # out= resizes the empty tensor
    assert acc.current_bytes == 40
    del out


def test_storage_listeners_see_every_allocation_and_free_in_order():
    from lightning_memkit.accounting.accountant import TensorAccountant

    events = []
    accountant = TensorAccountant()
    accountant.add_storage_listener(
        lambda r: events.append(("track", r.nbytes)), lambda r: events.append(("release", r.nbytes))
    )
    with accountant:
        a = torch.ones(10)  # 40 bytes
        b = a * 2  # 40 bytes
        del a
        c = b.view(2, 5)  # a view: no event
        d = torch.zeros(3, dtype=torch.int64)  # 24 bytes
    del b, c, d
    assert events == [("track", 40), ("track", 40), ("release", 40), ("track", 24), ("release", 40), ("release", 24)]


def test_storage_listeners_see_a_resize_in_place_as_it_happens():
    """FSDP frees and re-grows its gathered parameters with ``UntypedStorage.resize_``: a resize listener is told
    each new size, between the storage's allocation and its free, so an allocator model frees and reallocates."""
    from lightning_memkit.accounting.accountant import TensorAccountant

    events = []
    accountant = TensorAccountant()
    accountant.add_storage_listener(
        lambda r: events.append(("track", r.nbytes)),
        lambda r: events.append(("release", r.nbytes)),
        lambda r: events.append(("resize", r.nbytes)),
    )
    with accountant:
        a = torch.ones(10)  # 40 bytes
    a.untyped_storage().resize_(0)  # outside the dispatcher, as FSDP frees
    a.untyped_storage().resize_(80)
    del a
    assert events == [("track", 40), ("resize", 0), ("resize", 80), ("release", 80)]


def test_saved_tensor_data_pins_the_private_autograd_api():
    """ProcessTensors reaches a graph's saved tensors through ``node._raw_saved_*`` and
    ``SavedTensor.data`` (private torch bindings): a plainly saved tensor comes back sharing its
    storage; a hook-packed one comes back as the packed object, with no unpack hook run; one
    freed by backward is skipped."""
    from lightning_memkit.accounting.process import saved_tensor_data

    w = torch.ones(4, requires_grad=True)
    hidden = w * 3
    y = hidden.sin()
    (saved,) = saved_tensor_data(y.grad_fn)
    assert saved.untyped_storage().data_ptr() == hidden.untyped_storage().data_ptr()
    unpacked = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: ("packed", t), lambda p: unpacked.append(p) or p[1]):
        z = (w * 3).sin()
    (packed,) = saved_tensor_data(z.grad_fn)
    assert packed[0] == "packed" and unpacked == []
    y.sum().backward()
    assert saved_tensor_data(y.grad_fn) == []  # freed by backward
    assert any(n.startswith("_raw_saved_") for n in dir(z.grad_fn))


def test_storage_resized_outside_the_dispatcher_is_counted_when_it_happens():
    """``UntypedStorage.resize_`` runs no aten op (FSDP2 frees and re-grows its all-gather buffers
    with it): the accountant follows it through memkit's wrap, live bytes and peak alike."""
    from lightning_memkit.accounting.storage_resize import watching_storage_resizes

    acc = TensorAccountant()
    assert watching_storage_resizes()
    with acc:
        buffer = torch.empty(1000)  # 4000 B
        other = torch.empty(250)  # 1000 B
    assert acc.current_bytes == 5000
    buffer.untyped_storage().resize_(0)  # freed in place, outside the mode
    assert acc.current_bytes == 1000
    acc.reset_peak()
    assert acc.peak_bytes == 1000
    buffer.untyped_storage().resize_(4000)  # grown back, outside the mode: the peak sees it now
    assert acc.current_bytes == 5000 and acc.peak_bytes == 5000
    buffer.untyped_storage().resize_(0)
    with acc:
        small = torch.empty(500)  # 2000 B: a peak of 3000 B, not 7000 B
    assert acc.current_bytes == 3000 and acc.peak_bytes == 5000
    acc.reset_peak()
    with acc:
        buffer.untyped_storage().resize_(8000)  # inside the mode too (no aten op either way)
        buffer.view(-1)[:2000].fill_(1.0)
    assert acc.current_bytes == 11000 and acc.peak_bytes == 11000
    assert acc.current_bytes_by_label == {"unlabelled": 11000}
    del buffer
    assert acc.current_bytes == 3000
    del other, small
    assert acc.current_bytes == 0 and acc.errors == []


def test_storage_resize_wrap_is_what_fsdp2_calls_and_never_changes_the_result():
    """Pins the private surface the wrap relies on: FSDP2's ``free_storage`` / ``alloc_storage``
    resize through ``UntypedStorage.resize_`` (no aten op), and the wrap returns torch's result."""
    import inspect

    from torch.distributed.fsdp._fully_shard import _fsdp_param

    assert ".resize_(0)" in inspect.getsource(_fsdp_param.free_storage)
    assert ".resize_(size)" in inspect.getsource(_fsdp_param.alloc_storage)
    acc = TensorAccountant()
    with acc:
        tensor = torch.arange(64, dtype=torch.float32)  # 256 B
    _fsdp_param.free_storage(tensor)
    assert acc.current_bytes == 0 and tensor.untyped_storage().nbytes() == 0
    _fsdp_param.alloc_storage(tensor)
    assert acc.current_bytes == 256 and acc.peak_bytes == 256
    storage = tensor.untyped_storage()
    assert (
        storage.resize_(128) is storage and storage.nbytes() == 128
    )  # torch's own result (the storage), passed through
    assert acc.current_bytes == 128
    untracked = torch.empty(10)
    untracked.untyped_storage().resize_(0)  # not counted, not an error
    assert acc.current_bytes == 128 and acc.errors == []
    del tensor, storage
    assert acc.current_bytes == 0


def test_fsdp2_reading_equals_an_independent_gc_count(tmp_path):
    """FSDP2 (``fully_shard`` on each block and the root, gloo, world size 1, in a fresh process): after each
    step the meter's whole-process reading equals the bytes of every storage ``gc`` can reach. It needs both:
    DTensors counted by their local shard (their own storage is the full size with no memory) and the gathered
    parameters' ``resize_(0)`` after use followed (otherwise each unit's unsharded parameters stay counted)."""

    from tests.helpers.processes import run_script

    script = tmp_path / "fsdp2_count.py"
    script.write_text(
        "import sys, warnings\n"
        "warnings.filterwarnings('ignore')\n"
        "import torch, torch.distributed as dist\n"
        f"sys.path.insert(0, {REPO_ROOT!r})\n"
        "from tests.helpers.live_tensors import live_tensor_bytes\n"
        "from torch.distributed.fsdp import fully_shard\n"
        "from lightning_memkit import MemoryMeter\n"
        "from lightning_memkit.zoo import DemoTransformer\n"
        "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "torch.manual_seed(0)\n"
        "model = DemoTransformer(dropout=0.0)\n"
        "for block in model.blocks:\n"
        "    fully_shard(block)\n"
        "fully_shard(model)\n"
        "opt = torch.optim.Adam(model.parameters(), lr=1e-3)\n"
        "meter = MemoryMeter('cpu', host=False)\n"
        "tokens, labels = torch.randint(0, 1000, (16, 64)), torch.randint(0, 10, (16,))\n"
        "for step in range(2):\n"
        "    with meter.measure(step):\n"
        "        loss = torch.nn.functional.cross_entropy(model(tokens), labels)\n"
        "        opt.zero_grad(set_to_none=True)\n"
        "        loss.backward()\n"
        "        del loss\n"
        "        opt.step()\n"
        "    print('step', meter.last.tensor_bytes, live_tensor_bytes(), meter.last.peak_tensor_bytes)\n"
        "print('states', sum(p.numel() * 4 for p in model.parameters()))\n"
        "dist.destroy_process_group()\n"
    )
    output = run_script([str(script)], cwd=str(tmp_path), timeout=300)
    steps = [[int(v) for v in line.split()[1:]] for line in output.splitlines() if line.startswith("step ")]
    (states,) = [int(line.split()[1]) for line in output.splitlines() if line.startswith("states ")]
    assert len(steps) == 2, output[-3000:]
    for reading, counted, peak in steps:
        assert reading == counted and peak > reading
    # parameters, their gradients and Adam's two moments (plus a 4-byte step per tensor), the batch besides
    assert steps[1][0] - 4 * states > 0 and steps[1][0] == steps[0][0]


def test_an_accountant_exited_below_another_mode_leaves_that_mode_active():
    # TorchDispatchMode.__exit__ pops the top of the stack: MemoryTracker pausing its accountant between two
    # micro-batches while LayerTrace's accountant sits above it must not pop LayerTrace's instead of its own.
    from lightning_memkit.accounting._torch_compat import dispatch_mode_stack

    below, above = TensorAccountant(), TensorAccountant()
    below.__enter__()
    above.__enter__()
    try:
        below.__exit__(None, None, None)
        assert dispatch_mode_stack() == [above]
        x = torch.ones(256)  # 1 KiB, seen by the mode still active, not by the one that left
        assert above.current_bytes == 1024 and below.current_bytes == 0
        below.__exit__(None, None, None)  # not on the stack: nothing happens
        assert dispatch_mode_stack() == [above]
    finally:
        above.__exit__(None, None, None)
    assert dispatch_mode_stack() == []
    del x


def test_torch_compat_mode_stack_functions_are_where_the_accountant_reads_them():
    # pins the private torch.utils._python_dispatch functions behind accounting/_torch_compat.py
    from torch.utils import _python_dispatch

    from lightning_memkit.accounting import _torch_compat

    for name in ("_get_current_dispatch_mode_stack", "_pop_mode", "_push_mode"):
        assert callable(getattr(_python_dispatch, name)), name
    mode = TensorAccountant()
    with mode:
        assert _torch_compat.dispatch_mode_stack() == [mode]
    assert _torch_compat.dispatch_mode_stack() == []
