"""Pins the private torch internals wrapped in lightning_memkit/estimate/_torch_compat.py and
lightning_memkit/accounting/_torch_compat.py: if a torch release moves one, the test named after it fails."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from lightning_memkit.accounting import _torch_compat as accounting_compat
from lightning_memkit.accounting.process import saved_tensor_data
from lightning_memkit.doctor.frames import user_frame
from lightning_memkit.estimate import _torch_compat as estimate_compat


def test_fake_tensors_name_the_extras_a_plain_fake_view_must_not_carry():
    mode = FakeTensorMode()
    with mode:
        plain = torch.empty(2, 3)
        constant = torch.tensor(2.0)  # FakeTensorMode keeps a scalar's value as the fake's constant
    for name in estimate_compat.FAKE_EXTRAS:  # a renamed attribute would read as "absent" and let a view skip the mode
        assert hasattr(plain, name), name
    assert not estimate_compat.carries_more_than_metadata(plain)
    assert estimate_compat.carries_more_than_metadata(constant)


def test_wrap_fake_makes_the_fake_fakeTensorMode_makes():
    mode = FakeTensorMode()
    with mode:
        made = torch.empty(4, 6).t()
    meta = torch.empty(4, 6, device="meta").t()
    wrapped = estimate_compat.wrap_fake(FakeTensor, mode, meta, torch.device("cpu"))
    assert type(wrapped) is FakeTensor and wrapped.fake_mode is mode
    assert (wrapped.device, wrapped.shape, wrapped.stride()) == (made.device, made.shape, made.stride())


def test_the_fake_process_group_backend_and_fully_shard():
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    estimate_compat.register_fake_process_group()
    assert "fake" in dist.Backend.backend_list
    assert estimate_compat.fully_shard() is fully_shard


def test_safe_softmax_gives_zeros_for_a_fully_masked_row():
    weights = torch.tensor([[0.0, 1.0, 2.0], [float("-inf")] * 3])
    out = estimate_compat.safe_softmax(weights, -1)
    assert torch.equal(out[0], torch.softmax(weights[0], -1))
    assert torch.equal(out[1], torch.zeros(3))


@pytest.mark.parametrize("kernel", ["flash", "efficient"])
def test_the_attention_kernels_take_their_arguments_by_schema_name(kernel):
    query = torch.empty(2, 4, 16, 32, device="meta", dtype=torch.float16)
    key = torch.empty(2, 4, 24, 32, device="meta", dtype=torch.float16)
    if kernel == "flash":
        out = estimate_compat.flash_attention(query, key, key, 0.1, False, None)
        positional = torch.ops.aten._scaled_dot_product_flash_attention(query, key, key, 0.1, False, False)[0]
    else:
        out = estimate_compat.efficient_attention(query, key, key, None, True, 0.1, False, 0.5)
        positional = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, key, None, True, 0.1, False, scale=0.5
        )[0]
    assert (out.shape, out.dtype) == (positional.shape, positional.dtype) == ((2, 4, 16, 32), torch.float16)


def test_argument_reads_an_aten_argument_by_its_schema_name():
    for op in (
        torch.ops.aten._scaled_dot_product_flash_attention_backward.default,
        torch.ops.aten._scaled_dot_product_efficient_attention_backward.default,
    ):
        args = tuple(range(len(op._schema.arguments)))
        assert estimate_compat.argument(op, "query", args, {}) == 1  # grad_out, query, key, value, ...
        assert estimate_compat.argument(op, "scale", args[:-1], {"scale": "s"}) == "s"
    with pytest.raises(RuntimeError, match="has no argument 'querry'"):
        estimate_compat.argument(torch.ops.aten._scaled_dot_product_flash_attention_backward.default, "querry", (), {})


def test_saved_values_of_a_node_share_the_saved_tensors_storage_and_are_gone_after_backward():
    x = torch.randn(5, requires_grad=True)
    w = torch.randn(5, requires_grad=True)  # both need the other's value for backward
    y = x * w
    node = y.grad_fn
    assert set(accounting_compat.saved_tensor_attributes(node)) == {"_raw_saved_other", "_raw_saved_self"}
    assert type(node._raw_saved_self).__name__ == "SavedTensor" and hasattr(type(node._raw_saved_self), "data")
    pointers = sorted(t.untyped_storage().data_ptr() for t in saved_tensor_data(node))
    assert pointers == sorted([x.untyped_storage().data_ptr(), w.untyped_storage().data_ptr()])
    y.sum().backward()
    assert saved_tensor_data(node) == []


def test_version_of_moves_with_the_in_place_op_that_gives_a_tensor_a_new_grad_fn():
    # ProcessTensors walks a tensor's graph again only when this number moved (accounting/_torch_compat.version_of)
    x = torch.randn(4, requires_grad=True)
    y = x * 2
    before, node = accounting_compat.version_of(y), type(y.grad_fn)
    y.exp_()
    assert accounting_compat.version_of(y) == before + 1 and type(y.grad_fn) is not node  # ExpBackward0 now
    y[0:2].add_(1)  # through a view: the base's version and grad_fn (CopySlices) change too
    assert accounting_compat.version_of(y) == before + 2 and type(y.grad_fn).__name__ == "CopySlices"
    with torch.inference_mode():
        z = torch.ones(2)
    assert accounting_compat.version_of(z) is None  # an inference tensor keeps no version counter


def test_a_torch_without_saved_tensor_data_warns_once_and_counts_nothing(monkeypatch):
    class SavedWithoutData:  # torch 2.8's SavedTensor binding: no ``data``
        pass

    monkeypatch.setattr(accounting_compat, "_warned", set())
    with pytest.warns(RuntimeWarning, match="has no SavedTensor.data"):
        assert accounting_compat.saved_value(SavedWithoutData()) is accounting_compat.SAVED_FREED
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert accounting_compat.saved_value(SavedWithoutData()) is accounting_compat.SAVED_FREED  # once only


def test_wrapper_subclass_types_are_recognised():
    from torch.distributed.tensor import DTensor

    assert accounting_compat.is_traceable_wrapper_subclass_type(DTensor)
    assert not accounting_compat.is_traceable_wrapper_subclass_type(torch.Tensor)
    assert not accounting_compat.is_traceable_wrapper_subclass_type(torch.nn.Parameter)


_LIBRARY_FRAMES = "def through(depth, fn):\n    return fn() if depth == 0 else through(depth - 1, fn)\n"


@pytest.mark.parametrize("depth", [0, 1, 2, 5])
def test_user_frame_is_found_by_what_frames_are_not_how_many(depth):
    """Any number of library frames (here: code whose file is inside torch's package) between the user's
    line and the caller of user_frame: the user's line is found."""
    namespace: dict = {}
    exec(
        compile(_LIBRARY_FRAMES, os.path.join(os.path.dirname(torch.__file__), "_memkit_test_frames.py"), "exec"),
        namespace,
    )
    line = sys._getframe().f_lineno + 1
    found = namespace["through"](depth, user_frame)
    assert found == (__file__, line, "test_user_frame_is_found_by_what_frames_are_not_how_many")


def test_the_recorder_names_the_users_line_under_torchs_own_python_frames():
    """Ops made directly, through torch's Python functional (F.dropout) and through a module's forward:
    each creation names this file's line, whatever frames torch's dispatch puts in between."""
    from lightning_memkit.doctor.recorder import CreationRecorder

    layer = torch.nn.Linear(4, 3)
    recorder = CreationRecorder()
    recorder.start(0, module=layer)
    first = test_the_recorder_names_the_users_line_under_torchs_own_python_frames.__code__.co_firstlineno
    x = torch.randn(2, 4)  # first + 9
    hidden = layer(x)  # first + 10
    dropped = F.dropout(hidden, 0.5, training=True)  # first + 11
    recorder.stop()
    name = "test_the_recorder_names_the_users_line_under_torchs_own_python_frames"
    assert recorder.creation_of(x).frame == (__file__, first + 9, name)
    assert recorder.creation_of(hidden).frame == (__file__, first + 10, name)
    assert recorder.creation_of(dropped).frame == (__file__, first + 11, name)


def test_arguments_binds_an_aten_call_by_schema_name_with_its_defaults():
    unique = torch.ops.aten._unique2.default  # (self, sorted=True, return_inverse=False, return_counts=False)
    x = torch.tensor([1, 1, 2])
    assert estimate_compat.arguments(unique, (x,), {"return_counts": True}) == {
        "self": x,
        "sorted": True,
        "return_inverse": False,
        "return_counts": True,
    }
    bincount = torch.ops.aten.bincount.default  # (self, weights=None, minlength=0)
    assert estimate_compat.arguments(bincount, (x, None, 5), None) == {"self": x, "weights": None, "minlength": 5}
    index = torch.ops.aten.index.Tensor  # (self, indices): no default, left out when the call leaves it out
    assert estimate_compat.arguments(index, (x,), {}) == {"self": x}


def test_no_dispatch_modes_runs_below_the_fake_mode():
    with FakeTensorMode():
        fake = torch.empty(2)
        with estimate_compat.no_dispatch_modes():
            real = torch.ones(2)
    assert isinstance(fake, FakeTensor) and not isinstance(real, FakeTensor)
    assert real.sum().item() == 2.0  # a real tensor: its values can be read


def test_the_dispatcher_tells_a_view_with_kernels_from_a_composite():
    assert estimate_compat.is_op_overload(torch.ops.aten.view.default)
    assert not estimate_compat.is_op_overload(torch.ops.aten.view)  # the packet, not an overload
    assert not estimate_compat.has_composite_implicit_kernel(torch.ops.aten.view.default)
    assert estimate_compat.has_composite_implicit_kernel(torch.ops.aten.reshape.default)


def test_the_nn_builtins_are_what_torch_nn_functional_calls():
    assert estimate_compat.nn_builtin("linear") is torch._C._nn.linear
    assert estimate_compat.nn_builtin("scaled_dot_product_attention") is F.scaled_dot_product_attention
    assert estimate_compat.nn_builtin("softplus") is torch._C._nn.softplus
    assert estimate_compat.nn_builtin("no_such_builtin") is None
    assert estimate_compat.nn_builtins() is torch._C._nn


def test_in_backward_is_true_only_while_autograd_runs_a_backward():
    seen = []
    x = torch.ones(2, requires_grad=True)
    x.register_hook(lambda grad: seen.append(estimate_compat.in_backward()))
    assert not estimate_compat.in_backward()
    (x * 2).sum().backward()
    assert seen == [True]


def test_compiled_original_unwraps_torch_compile():
    module = torch.nn.Linear(2, 2)
    assert estimate_compat.compiled_original(torch.compile(module)) is module  # compiling is lazy: nothing runs
    assert estimate_compat.compiled_original(module) is None


def test_the_shared_torch_internals_are_what_memkit_reads():
    """lightning_memkit/_torch_compat.py: torch's pytree flattens a batch into its tensors (with their paths) and back,
    a TorchDispatchMode sees each op, and DisableTorchFunctionSubclass keeps a subclass's __torch_function__ out."""
    from lightning_memkit import _torch_compat as shared

    batch = {"x": torch.ones(2), "pair": (torch.zeros(1), 3)}
    leaves, spec = shared.tree_flatten(batch)
    assert [type(leaf) for leaf in leaves] == [torch.Tensor, torch.Tensor, int]
    assert shared.tree_unflatten(leaves, spec)["pair"][1] == 3
    paths = [shared.keystr(path) for path, _ in shared.tree_flatten_with_path(batch)[0]]
    assert paths == ["['x']", "['pair'][0]", "['pair'][1]"]
    assert shared.tree_map(lambda v: v * 2 if isinstance(v, int) else v, batch)["pair"][1] == 6

    class Ops(shared.TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Ops() as ops:
        torch.ones(2).add(1)
    assert any("add" in name for name in ops.seen)

    class Loud(torch.Tensor):
        calls = 0

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            cls.calls += 1
            return super().__torch_function__(func, types, args, kwargs or {})

    loud = torch.ones(2).as_subclass(Loud)
    Loud.calls = 0
    with shared.disable_torch_function_subclass():
        _ = loud.shape
    assert Loud.calls == 0
    _ = loud.shape
    assert Loud.calls == 1


def test_ddps_bucket_assignment_is_torchs_own():
    """DDP's reducer sizes its buckets with ``torch.distributed._compute_bucket_assignment_by_size``: one bucket per
    dtype without a limit (its initial assignment), ``bucket_cap_mb`` buckets after a 1 MiB first one (its rebuild)."""
    import torch.distributed as dist

    params = [torch.empty(256, 1024), torch.empty(256, 1024, dtype=torch.bfloat16), torch.empty(512, 1024)]
    assert estimate_compat.ddp_first_bucket_bytes() == dist._DEFAULT_FIRST_BUCKET_BYTES == 2**20
    assert sorted(map(sorted, estimate_compat.ddp_bucket_assignment(params, [sys.maxsize]))) == [[0, 2], [1]]
    capped = estimate_compat.ddp_bucket_assignment(params, [2**20, 2 * 2**20])
    assert sorted(map(sorted, capped)) == [[0], [1], [2]]


def test_dtensor_local_is_the_local_shard_without_a_view():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    estimate_compat.register_fake_process_group()
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=2)
    try:
        local = torch.ones(2, 3)
        shard = DTensor.from_local(local, init_device_mesh("cpu", (2,)), [Shard(0)], run_check=False)
        found = estimate_compat.dtensor_local(shard)
        assert found.shape == (2, 3) and found.data_ptr() == shard.to_local().data_ptr() == local.data_ptr()
        assert estimate_compat.dtensor_local(local) is None
    finally:
        dist.destroy_process_group()
