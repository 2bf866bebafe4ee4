"""The memory doctor on real Trainer runs (CPU, exact bytes): a zoo of classic leaks, each found with the
bytes it keeps per step and the code that made them; no false alarm on the robustness modules over 20
steps; a large intermediate held by a Python variable named with its bytes and the op that last read it."""

from __future__ import annotations

import gc
import itertools
import json
import os
import textwrap

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_memkit import MemoryTracker
from lightning_memkit.callbacks.memory_doctor import MemoryDoctor
from lightning_memkit.cli import main
from lightning_memkit.doctor._torch_compat import mode_is_active
from lightning_memkit.doctor.verdict import DoctorReport, DoctorSession
from tests.helpers.live_tensors import describe, tensors_with_grad_fn
from tests.helpers.models import FLOAT32
from tests.helpers.paths import REPO_ROOT
from tests.helpers.trainers import make_trainer

B, D_IN, D = 4, 16, 32  # batch, input width, hidden width
ACTIVATION = B * D * FLOAT32  # bytes of one (B, D) float32 activation: 512
BATCH = B * D_IN * FLOAT32 + B * D * FLOAT32  # bytes of one (x, y) batch: 256 + 512


# ============================================================================================ the zoo
class Net(pl.LightningModule):
    """``Linear(16, 32) -> ReLU -> Linear(32, 32)``, MSE against y; (x, y) batches of 4; SGD."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D_IN, D), nn.ReLU(), nn.Linear(D, D))
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(64 * B, D_IN, generator=generator)
        self.y = torch.randn(64 * B, D, generator=generator)

    def forward(self, x):
        return self.body(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        loss = F.mse_loss(out, y)
        self.bug(out, y, loss)
        return loss

    def bug(self, out, y, loss) -> None:
        pass

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=B)


class LossWithGraph(Net):
    """``self.total += loss``: every step's graph stays reachable from ``total``."""

    total = 0

    def bug(self, out, y, loss) -> None:
        self.total += loss


class MonitoredLossWithGraph(Net):
    """A monitored L1 loss accumulated with its graph; it is never backwarded, so what its graph saved stays."""

    total_l1 = 0

    def bug(self, out, y, loss) -> None:
        self.total_l1 += (out - y).abs().mean()


class OutputsList(Net):
    def __init__(self) -> None:
        super().__init__()
        self.outputs = []

    def bug(self, out, y, loss) -> None:
        self.outputs.append(out)


class HookStoresInputs(Net):
    """A forward hook on the last Linear that keeps its input (the ReLU's output)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = []
        self.body[2].register_forward_hook(lambda module, inputs, output: self.seen.append(inputs[0]))


class DictCache(Net):
    def __init__(self) -> None:
        super().__init__()
        self.cache = {}

    def bug(self, out, y, loss) -> None:
        self.cache[self.global_step] = out.detach().clone()


class RetainGraphList(Net):
    """Manual optimization, ``retain_graph=True`` and the losses kept in a list: every graph and all it saved."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = F.mse_loss(self(x), y)
        self.manual_backward(loss, retain_graph=True)
        optimizer.step()
        self.losses.append(loss)


class KeepBatches(pl.Callback):
    def __init__(self) -> None:
        self.batches = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batches.append(batch)


def doctor_fit(module, tmp_path, steps=12, callbacks=(), doctor=None, **overrides) -> MemoryDoctor:
    doctor = doctor or MemoryDoctor(verbose=False)
    trainer = make_trainer(tmp_path, max_steps=steps, callbacks=[doctor, *callbacks], **overrides)
    trainer.fit(module)
    assert not mode_is_active(doctor._session.recorder if doctor._session else doctor), "the doctor's mode stayed on"
    return doctor


def growing(report: DoctorReport):
    assert report.leak is not None, report.format()
    assert report.leak.growing, report.format()
    return report.leak.growing


def test_outputs_appended_to_a_list(tmp_path):
    report = doctor_fit(OutputsList(), tmp_path).report
    assert report.leak.bytes_per_step == ACTIVATION
    top = growing(report)[0]
    assert (top.op, top.module, top.phase, top.shape, top.dtype) == (
        "aten.addmm",
        "body.2",
        "forward",
        [B, D],
        "torch.float32",
    )
    assert top.bytes_per_step == ACTIVATION and top.where.endswith(
        "in forward: return self.body(x)"
    )  # the innermost user line
    assert top.holder == "model.outputs[11]"  # the newest of the 12 kept, as code to paste
    assert "model.outputs is a list of 12 entries" in top.holder_note and "held by model.outputs[11]" in report.format()
    assert report.graph_leak is not None  # each kept output holds its (emptied) graph too


def test_monitored_loss_accumulated_with_its_graph(tmp_path):
    report = doctor_fit(MonitoredLossWithGraph(), tmp_path).report
    # abs() saved its input, out - y, for a backward that never runs
    assert report.leak.bytes_per_step == ACTIVATION
    top = growing(report)[0]
    assert (top.op, top.module, top.phase, top.bytes_per_step) == ("aten.sub", "", "other", ACTIVATION)
    assert "self.total_l1 += (out - y).abs().mean()" in top.where
    # held by the graph of model.total_l1: AddBackward0 -> MeanBackward0 -> AbsBackward0, which saved out - y
    assert top.holder.startswith("model.total_l1.grad_fn.next_functions[") and top.holder.endswith("._saved_self")
    assert top.holder_note.startswith("model.total_l1 keeps its autograd graph")
    # never backpropagated: the kept graphs still save each step's out - y, 12 of them (one per step)
    graph = report.graph_leak
    assert (graph.saved_tensors, graph.saved_bytes) == (12, 12 * ACTIVATION)
    assert "backward never ran on them" in graph.format() and "backward freed" not in graph.format()


def test_loss_accumulated_with_its_graph_keeps_graph_nodes(tmp_path):
    report = doctor_fit(LossWithGraph(), tmp_path).report
    # backward freed what each step's graph saved: no tensor bytes grow, the graph's nodes do
    assert report.leak is None, report.format()
    module = Net()
    out = module(module.x[:B])
    loss = F.mse_loss(out, module.y[:B])
    nodes, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in nodes and type(node).__name__ != "AccumulateGrad":
            nodes.add(node)
            stack.extend(n for n, _ in node.next_functions)
    assert report.graph_leak is not None, report.format()
    assert report.graph_leak.nodes_per_step == len(nodes) + 1  # one step's graph, and the in-place add that chains it
    holder = report.graph_leak.holders[0]
    assert holder.grad_fn == "AddBackward0" and holder.shape == [] and "self.total += loss" in holder.where
    assert "graph kept across steps" in report.format()
    assert report.graph_leak.saved_tensors == 0 and "backward freed their saved tensors" in report.format()
    assert holder.holder == "model.total" and "held by model.total  <- delete here" in report.format()


def test_forward_hook_that_stores_inputs(tmp_path):
    report = doctor_fit(HookStoresInputs(), tmp_path).report
    assert report.leak.bytes_per_step == ACTIVATION
    top = growing(report)[0]
    assert (top.op, top.module, top.shape) == ("aten.relu", "body.1", [B, D])
    assert top.holder == "model.seen[11]"


def test_dict_cache_keyed_by_step(tmp_path):
    report = doctor_fit(DictCache(), tmp_path).report
    assert report.leak.bytes_per_step == ACTIVATION
    top = growing(report)[0]
    assert (top.op, top.module, top.phase) == ("aten.clone", "", "other")
    assert "self.cache[self.global_step] = out.detach().clone()" in top.where
    assert top.holder in {f"model.cache[{step}]" for step in range(12)} and "a dict of 12 entries" in top.holder_note
    assert report.graph_leak is None  # detached: no graph kept


def test_retain_graph_with_a_growing_list(tmp_path):
    report = doctor_fit(RetainGraphList(), tmp_path).report
    # the retained graph keeps what it saved: the batch (x for the first Linear, y for the loss),
    # the ReLU's output (for ReLU and the second Linear) and the output (for the loss); the list keeps
    # each loss, whose storage is larger than its one element (torch's mse_loss returns a view)
    module = Net()
    loss_storage = F.mse_loss(module(module.x[:B]), module.y[:B]).untyped_storage().nbytes()
    assert report.leak.bytes_per_step == BATCH + 2 * ACTIVATION + loss_storage
    by_maker = {(g.op, g.module, g.category): g.bytes_per_step for g in growing(report)}
    assert by_maker[("aten.mse_loss", "", "made in a step")] == loss_storage
    assert by_maker[("aten.relu", "body.1", "made in a step")] == ACTIVATION
    assert by_maker[("aten.addmm", "body.2", "made in a step")] == ACTIVATION
    assert sum(g.bytes_per_step for g in growing(report) if g.category == "inputs") == BATCH
    # the list keeps each loss, and each loss's retained graph keeps what it saved
    assert {g.holder for g in growing(report)} == {
        "model.losses[11]",
        "model.losses[11].grad_fn._saved_self",
        "model.losses[11].grad_fn._saved_target",
        "model.losses[11].grad_fn.next_functions[0][0]._saved_mat1",
        "model.losses[11].grad_fn.next_functions[0][0].next_functions[1][0].next_functions[0][0]._saved_mat1",
    }


def test_callback_that_keeps_each_batch(tmp_path):
    report = doctor_fit(Net(), tmp_path, callbacks=[KeepBatches()]).report
    assert report.leak.bytes_per_step == BATCH
    kept = [g for g in growing(report) if g.category == "inputs"]
    assert sum(g.bytes_per_step for g in kept) == BATCH
    assert {tuple(g.shape) for g in kept} == {(B, D_IN), (B, D)}
    # the callback is trainer.callbacks[1] (the doctor is [0]); each batch is a list [x, y]
    assert {g.holder for g in kept} == {"trainer.callbacks[1].batches[11][0]", "trainer.callbacks[1].batches[11][1]"}
    assert all("trainer.callbacks[1].batches is a list of 12 entries" in g.holder_note for g in kept)
    # the batches are made by the DataLoader inside trainer.fit: Lightning's doing, not the test's fit line
    assert all("(Lightning's own)" in g.where and "trainer.fit" not in g.where for g in kept), [g.where for g in kept]
    assert report.graph_leak is None


class KeepScaledInputs(pl.Callback):
    """Makes a tensor in its on_train_batch_end, which runs after the doctor's (the doctor comes first)."""

    def __init__(self) -> None:
        self.kept = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.kept.append(batch[0] * 2)


def test_a_tensor_made_in_another_callbacks_hook_after_the_doctors_is_attributed(tmp_path):
    # recording runs from one step's start to the next's, so hooks after the doctor's own are seen
    report = doctor_fit(Net(), tmp_path, callbacks=[KeepScaledInputs()]).report
    assert report.leak.bytes_per_step == B * D_IN * FLOAT32
    top = growing(report)[0]
    assert (top.op, top.phase, top.shape) == ("aten.mul", "other", [B, D_IN])
    assert top.where.endswith("in on_train_batch_end: self.kept.append(batch[0] * 2)")
    assert top.holder == "trainer.callbacks[1].kept[11]"


def test_a_leak_is_warned_once_and_the_report_is_written(tmp_path):
    doctor = MemoryDoctor(verbose=True)
    with pytest.warns(UserWarning, match="memory leak") as warned:
        # with a logger: without one (logger=False, fast_dev_run) no memkit file is written, as for MemoryTracker's
        # records
        doctor_fit(OutputsList(), tmp_path, steps=16, doctor=doctor, logger=CSVLogger(str(tmp_path)))
    assert sum("memory leak" in str(w.message) for w in warned) == 1
    with open(doctor.report_path) as file:
        saved = DoctorReport.from_dict(json.load(file))
    assert saved.to_dict() == doctor.report.to_dict()
    assert saved.format() == doctor.report.format()


# ============================================================================================ no false alarm
ROBUST = ["DictBatch", "GAN", "accumulation", "lstm", "gru", "WithValidation", "TwoValLoaders", "Scheduled", "plain"]


@pytest.mark.parametrize("name", ROBUST)
def test_no_false_alarm_on_robustness_modules_over_20_steps(name, tmp_path):
    from tests.callbacks import test_robustness as r

    overrides = {}
    if name == "accumulation":
        module, overrides = r.Base(), {"accumulate_grad_batches": 2}
    elif name in ("lstm", "gru"):
        module = r.Recurrent(cell=name)
    elif name == "plain":
        module = Net()
    else:
        module = getattr(r, name)()
    if name in ("WithValidation", "TwoValLoaders"):
        overrides = {"limit_val_batches": None, "val_check_interval": 3}
    # two optimizers step twice per batch: Lightning's max_steps counts optimizer steps
    doctor = doctor_fit(module, tmp_path, steps=40 if name == "GAN" else 20, **overrides)
    report = doctor.report
    assert report.steps == 20
    assert report.healthy, report.format()
    assert report.errors == []
    assert "no leak" in report.format()
    assert tensors_with_grad_fn() == [], describe(tensors_with_grad_fn())


# ============================================================================================ held too long
WIDE = 4096


class HeldTooLong(Net):
    """A frozen, wide projection whose output is only averaged into a gate, but stays in a variable for
    the rest of the forward."""

    def __init__(self, release: bool = False) -> None:
        super().__init__()
        self.release = release
        self.expand = nn.Linear(D_IN, WIDE)
        self.expand.requires_grad_(False)

    def forward(self, x):
        wide = self.expand(x)
        gate = wide.mean(dim=1, keepdim=True)
        if self.release:
            del wide
        h = self.body(x)
        return torch.tanh(h) * torch.sigmoid(gate) + h


def test_held_too_long_names_the_intermediate_its_bytes_and_last_reader(tmp_path):
    report = doctor_fit(HeldTooLong(), tmp_path, steps=3).report
    liveness = report.liveness
    assert liveness is not None and liveness.step == 1
    top = liveness.held_too_long[0]
    assert (top.op, top.module, top.total_bytes, top.count) == ("aten.addmm", "expand", B * WIDE * FLOAT32, 1)
    assert top.last_use_op == "aten.mean"
    assert top.where.endswith("wide = self.expand(x)")
    assert liveness.held_too_long_bytes >= B * WIDE * FLOAT32
    assert sum(liveness.peak_parts.values()) == liveness.peak_bytes
    assert "held too long at the peak" in report.format() and "last used by aten.mean" in report.format()
    # the scalars Lightning keeps (its copy of the loss, 4 B each) are summed on one line, not listed one by one
    tiny = [g for g in liveness.held_too_long if g.total_bytes < 64]
    assert (
        tiny and f"{sum(g.total_bytes for g in tiny)} B in {sum(g.count for g in tiny)} tiny tensors" in report.format()
    )


def test_released_intermediate_is_not_held_too_long(tmp_path):
    report = doctor_fit(HeldTooLong(release=True), tmp_path, steps=3).report
    assert all(g.module != "expand" for g in report.liveness.held_too_long), report.format()
    assert report.liveness.held_too_long_bytes < B * WIDE * FLOAT32


# ============================================================================================ wiring
@pytest.mark.parametrize("doctor_first", [True, False])
def test_doctor_and_memory_tracker_together_in_either_order(doctor_first, tmp_path):
    gc.collect()  # the tracker counts the process's tensors: no earlier test's garbage freed mid-run
    tracker = MemoryTracker(verbose=False)
    doctor = MemoryDoctor(verbose=False)
    callbacks = [doctor, tracker] if doctor_first else [tracker, doctor]
    trainer = make_trainer(tmp_path, max_steps=12, callbacks=callbacks)
    trainer.fit(OutputsList())
    assert doctor.report.leak.bytes_per_step == ACTIVATION
    steps = [r.step for r in tracker.history if r.stage == "train"]
    assert steps == list(range(12))
    tensor_bytes = [r.tensor_bytes for r in tracker.history if r.stage == "train"]
    # the tracker sees the same leak (at step end) with its own accountant
    assert {b - a for a, b in itertools.pairwise(tensor_bytes[3:])} == {ACTIVATION}


def test_plain_pytorch_session_finds_the_leak_and_leaves_no_mode_on():
    model = nn.Sequential(nn.Linear(D_IN, D), nn.ReLU(), nn.Linear(D, D))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    session = DoctorSession(model, [optimizer], window=3, warmup_steps=1)
    kept = []
    for step in range(8):
        x = torch.randn(B, D_IN)
        session.step_start(step, x)
        out = model(x)
        kept.append(out.detach())
        out.pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        session.step_end(step)
    session.close()
    report = session.report()
    assert report.leak.bytes_per_step == ACTIVATION
    assert report.leak.growing[0].module == "2"
    assert not mode_is_active(session.recorder)
    del kept


class FailsAtStep3(OutputsList):
    def training_step(self, batch, batch_idx):
        if batch_idx == 3:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


def test_a_failed_fit_leaves_no_mode_or_hook_and_keeps_the_report(tmp_path):
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    doctor = MemoryDoctor(verbose=False)
    trainer = make_trainer(tmp_path, max_steps=12, callbacks=[doctor, MemoryTracker(verbose=False)])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(FailsAtStep3())
    assert _get_current_dispatch_mode_stack() == []
    assert not torch.nn.modules.module._global_forward_pre_hooks and not torch.nn.modules.module._global_forward_hooks
    assert doctor.report is not None and doctor.report.steps == 4 and doctor.report.liveness.step == 1


def test_doctor_arguments_are_checked():
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    with pytest.raises(MisconfigurationException, match="window"):
        MemoryDoctor(window=1)
    with pytest.raises(MisconfigurationException, match="analyse_step"):
        MemoryDoctor(analyse_step=-1)


# ============================================================================================ the CLI
LEAKY_FILE = textwrap.dedent(
    """
    import torch, lightning.pytorch as pl
    from torch import nn
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, TensorDataset


    class Leaky(pl.LightningModule):
        def __init__(self, batch_size: int = 8, leak: bool = True):
            super().__init__()
            self.batch_size, self.leak = batch_size, leak
            self.encoder = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
            self.x, self.y = torch.randn(512, 32), torch.randn(512, 16)
            self.history = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self.encoder(x)
            if self.leak:
                self.history.append(out)
            return F.mse_loss(out, y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

        def train_dataloader(self):
            return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size)
    """
)


def test_cli_doctor_prints_the_verdict_and_writes_json(tmp_path, capsys):
    path = tmp_path / "leaky.py"
    path.write_text(LEAKY_FILE)
    out_json = tmp_path / "verdict.json"
    status = main(["doctor", f"{path}:Leaky", "--steps", "10", "--batch-size", "4", "--json", str(out_json)])
    printed = capsys.readouterr().out
    assert status == 3  # a leak was found
    assert f"grows by {4 * 16 * FLOAT32} B" in printed
    assert "aten.addmm in encoder.2 (forward" in printed and "out = self.encoder(x)" in printed
    data = json.loads(out_json.read_text())
    assert data["leak"]["bytes_per_step"] == 4 * 16 * FLOAT32
    assert data["leak"]["growing"][0]["module"] == "encoder.2"
    assert data["leak"]["growing"][0]["holder"] == "model.history[9]" and "held by model.history[9]" in printed

    status = main(["doctor", f"{path}:Leaky", "--steps", "10", "--init-args", '{"leak": false}'])
    printed = capsys.readouterr().out
    assert status == 0 and "no leak" in printed and "step 1 peak" in printed


def test_cli_doctor_refuses_bad_arguments(tmp_path, capsys):
    path = tmp_path / "leaky.py"
    path.write_text(LEAKY_FILE)
    assert main(["doctor", f"{path}:Leaky", "--steps", "0"]) == 2
    assert "--steps must be a positive integer" in capsys.readouterr().err
    assert main(["doctor", f"{path}:Nope"]) == 2
    assert "has no 'Nope'" in capsys.readouterr().err
    assert main(["doctor", f"{path}:Leaky", "--steps", "3", "--analyse-step", "5"]) == 2


# ============================================================================================ the watcher alone
def test_leak_watcher_reports_steady_growth_once_and_ignores_oscillation():
    from lightning_memkit.doctor.leaks import LeakWatcher

    watcher = LeakWatcher(window=3, warmup_steps=1)
    found = [watcher.observe(step, 1000 + 100 * step) for step in range(8)]
    reports = [r for r in found if r is not None]
    # warm-up step 0; no epochs given: judged at every step; the floor rises at steps 2, 3 and 4, the
    # last counted once step 5 is seen (a point's floor is the least bytes from it on)
    assert len(reports) == 1 and found.index(reports[0]) == 5
    assert reports[0].bytes_per_step == 100 and (reports[0].first_step, reports[0].last_step) == (2, 4)
    assert "add lightning_memkit.MemoryDoctor()" in reports[0].format()  # no recorder: who is unknown
    calm = LeakWatcher(window=3, warmup_steps=0)
    assert all(calm.observe(step, 1000 + (step % 2) * 64) is None for step in range(20))  # accumulation-like
    with pytest.raises(ValueError, match="window"):
        LeakWatcher(window=1)


def test_the_doctor_kept_after_fit_holds_no_tensor(tmp_path):
    from tests.helpers.live_tensors import live_tensor_bytes

    gc.collect()
    before = live_tensor_bytes()
    module = OutputsList()
    doctor = doctor_fit(module, tmp_path)
    assert doctor.report.leak is not None
    del module
    gc.collect()
    assert live_tensor_bytes() - before == 0
    assert doctor.report.to_dict()["leak"]["bytes_per_step"] == ACTIVATION


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_outputs_appended_to_a_list_on_cuda(tmp_path):
    # the recorder counts storages on any device: the same exact bytes per step, on the GPU
    report = doctor_fit(OutputsList(), tmp_path, accelerator="gpu").report
    assert report.leak.bytes_per_step == ACTIVATION
    top = growing(report)[0]
    assert (top.op, top.module) == ("aten.addmm", "body.2")
    assert report.liveness is not None and report.liveness.peak_bytes > 0


def test_the_example_runs_and_finds_both_problems():
    from tests.helpers.processes import run_script

    root = REPO_ROOT
    output = run_script([os.path.join("examples", "doctor.py")], cwd=root, timeout=300)
    assert f"-> {16 * FLOAT32 * 8} bytes kept per step; made by aten.addmm in encoder.2" in output
    assert f"({16 * 4096 * FLOAT32} B, 1 tensors): aten.addmm in expand" in output


def test_the_verdict_is_in_tensorboards_text_tab_and_in_memkit_report(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lightning_memkit.callbacks.memory_doctor import DOCTOR_TEXT_TAG
    from lightning_memkit.cli import main

    logger = TensorBoardLogger(str(tmp_path / "logs"), name="leaky", version=0)
    doctor = doctor_fit(OutputsList(), tmp_path, logger=logger)
    verdict = doctor.report.format()
    accumulator = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0})
    accumulator.Reload()
    [event] = accumulator.Tensors(f"{DOCTOR_TEXT_TAG}/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert text.splitlines() == ["    " + line for line in verdict.splitlines()]
    assert f"({ACTIVATION} bytes) per step" in text

    out = tmp_path / "report.html"
    assert main(["report", str(tmp_path / "logs"), "-o", str(out)]) == 0
    page = out.read_text()
    assert "Memory doctor <code>leaky/version_0</code>: memory survives steps" in page
    assert f"({ACTIVATION} bytes) per step" in page and "aten.addmm" in page
