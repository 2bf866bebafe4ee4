"""Pins the private torch internals the memory doctor relies on (dispatch-mode stack surgery, frames),
the recorder's module paths from torch's global forward hooks, and the out-of-memory report's largest
live tensors by creator. If a torch release moves one, these say which."""

from __future__ import annotations

import json

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from lightning_memkit.doctor._torch_compat import (
    caller_frame,
    enter_mode_at_bottom,
    exit_mode_anywhere,
    mode_is_active,
    saved_values,
)
from lightning_memkit.doctor.frames import user_frame
from lightning_memkit.doctor.recorder import CreationRecorder
from lightning_memkit.oom import largest_live_tensors, write_oom_report


class Counting(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_a_mode_entered_at_the_bottom_survives_other_modes_entered_and_exited_around_it():
    other, ours = Counting(), Counting()
    other.__enter__()  # another callback's mode, entered first
    enter_mode_at_bottom(ours)  # ours goes below it
    assert _get_current_dispatch_mode_stack() == [ours, other]
    torch.ones(2) + 1
    assert ours.ops == other.ops == 2  # both see every op
    other.__exit__(None, None, None)  # its plain exit pops its own mode, not ours
    assert _get_current_dispatch_mode_stack() == [ours]
    later = Counting()
    later.__enter__()
    assert exit_mode_anywhere(ours)  # ours leaves from under a later mode
    assert _get_current_dispatch_mode_stack() == [later]
    later.__exit__(None, None, None)
    assert _get_current_dispatch_mode_stack() == [] and not mode_is_active(ours)
    assert not exit_mode_anywhere(ours)


def test_caller_frame_and_user_frame_skip_library_code():
    assert caller_frame(0).f_code.co_name == "test_caller_frame_and_user_frame_skip_library_code"
    filename, line, function = user_frame(0)
    assert filename == __file__ and function == "test_caller_frame_and_user_frame_skip_library_code"


def test_recorder_names_module_paths_phases_and_lines_and_leaves_no_hook():
    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.ReLU(), nn.Linear(8, 2)))
    recorder = CreationRecorder()
    recorder.name_modules(model)
    recorder.start(0, module=model)
    x = torch.randn(3, 4, requires_grad=True)
    out = model(x)
    loss = out.sum()  # noqa: E702 - one line, two ops
    loss.backward()
    recorder.stop()
    made = {(c.op, c.module, c.phase) for c in recorder.live_creations()}
    assert ("aten.addmm", "1.1", "forward") in made
    assert ("aten.sum", "", "other") in made
    assert any(c.phase == "backward" for c in recorder.live_creations())  # x.grad
    out_record = recorder.creation_of(out)
    assert (
        out_record.nbytes == 3 * 2 * 4
        and out_record.frame[2] == "test_recorder_names_module_paths_phases_and_lines_and_leaves_no_hook"
    )
    assert "out = model(x)" in out_record.describe()
    assert not mode_is_active(recorder)
    assert not torch.nn.modules.module._global_forward_pre_hooks and not torch.nn.modules.module._global_forward_hooks
    assert recorder.errors == []


def test_oom_report_names_the_largest_live_tensors_by_creator(tmp_path):
    model = nn.Linear(8, 1000)
    recorder = CreationRecorder()
    recorder.name_modules(model)
    recorder.start(0, module=model)
    big = model(torch.randn(50, 8))
    recorder.stop()
    top = largest_live_tensors(limit=50)
    mine = [entry for entry in top if entry["shape"] == [50, 1000]]
    assert mine and mine[0]["nbytes"] == 50 * 1000 * 4 and mine[0]["grad_fn"] == "AddmmBackward0"
    assert "aten.addmm in Linear (forward)" in mine[0]["made_by"] and "big = model(" in mine[0]["where"]
    assert [e["nbytes"] for e in top] == sorted((e["nbytes"] for e in top), reverse=True)
    path = write_oom_report(str(tmp_path / "oom.json"), {"step": 3}, RuntimeError("CUDA out of memory"))
    with open(path) as file:
        report = json.load(file)
    assert any(e["shape"] == [50, 1000] for e in report["largest_live_tensors"])
    del big


def test_saved_values_reads_what_a_node_saved_until_backward_frees_it():
    # the holder search and the kept-graph report read autograd nodes' _saved_* attributes
    x = torch.ones(4, requires_grad=True)
    y = torch.full((4,), 2.0)
    loss = (x * y).sum()
    node = loss.grad_fn.next_functions[0][0]  # MulBackward0: saved both operands
    saved = dict(saved_values(node))
    assert set(saved) >= {"_saved_self", "_saved_other"}
    assert saved["_saved_other"].untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
    loss.backward()
    assert "_saved_other" not in dict(saved_values(node))  # freed by backward: left out, no error


def test_the_oom_reports_tensor_list_skips_fake_tensors_and_odd_tensors_instead_of_failing():
    """A fake tensor an estimate left alive has no memory: it is not listed; a tensor that cannot be read (here a
    subclass whose storage raises) is skipped, and the real tensors are still listed (the list once became one
    error entry when an earlier test left such a tensor in the process)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_memkit.oom import largest_live_tensors

    class Unreadable(torch.Tensor):
        def untyped_storage(self):
            raise RuntimeError("no storage here")

    with FakeTensorMode():
        fake = torch.empty(1 << 20)
    odd = torch.zeros(3).as_subclass(Unreadable)
    real = torch.ones(1 << 19)
    entries = largest_live_tensors(limit=1000)
    assert all("error" not in entry for entry in entries), entries[:1]
    assert not any(entry["device"] == "meta" for entry in entries)
    assert any(entry["nbytes"] == real.untyped_storage().nbytes() and entry["shape"] == [1 << 19] for entry in entries)
    del fake, odd, real
