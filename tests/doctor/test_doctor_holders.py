"""Who holds a leak, and leaks that do not grow every step (real Trainer fits on CPU, exact bytes).

Each new leak is found with its exact bytes per step (worked out by hand in the comments) and its
holder as code a user can paste; healthy patterns that look like growth for a while (a list cleared at
each epoch's end, pre-built batches, a bounded cache, ...) are reported by neither the doctor nor
MemoryTracker. The holder search itself: bounded, cheap when nothing the user knows holds the tensor.
"""

from __future__ import annotations

import collections
import gc

import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_memkit import MemoryTracker
from lightning_memkit.callbacks.memory_doctor import MemoryDoctor
from lightning_memkit.doctor.holders import find_holders, user_roots
from lightning_memkit.doctor.leaks import LeakWatcher, rising_floor
from tests.helpers.models import FLOAT32
from tests.helpers.trainers import make_trainer

B, D_IN, D = 4, 16, 32  # batch, input width, hidden width
ACTIVATION = B * D * FLOAT32  # one (4, 32) float32 output: 512 B
VAL_ROWS = 10
VAL_OUTPUT = VAL_ROWS * D * FLOAT32  # one (10, 32) float32 validation output: 1280 B


class Net(pl.LightningModule):
    """``Linear(16, 32) -> ReLU -> Linear(32, 32)``, MSE against y; (x, y) batches of 4; SGD."""

    def __init__(self, batches: int = 64) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D_IN, D), nn.ReLU(), nn.Linear(D, D))
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(batches * B, D_IN, generator=generator)
        self.y = torch.randn(batches * B, D, generator=generator)

    def forward(self, x):
        return self.body(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=B)


def fit(module, tmp_path, steps, callbacks=(), **overrides):
    gc.collect()  # the tracker counts the whole process's tensors: no earlier test's garbage freed mid-run
    doctor, tracker = MemoryDoctor(verbose=False), MemoryTracker(verbose=False)
    trainer = make_trainer(tmp_path, max_steps=steps, callbacks=[doctor, tracker, *callbacks], **overrides)
    trainer.fit(module)
    return doctor.report, tracker, trainer


def top_group(report):
    assert report.leak is not None and report.leak.growing, report.format()
    return report.leak.growing[0]


# ============================================================================================ new leaks
class KeepsValidationOutputs(Net):
    """Validation outputs kept in a list that is never cleared: memory grows only on validation steps."""

    def __init__(self) -> None:
        super().__init__()
        self.val_outputs = []
        self.xv, self.yv = torch.randn(VAL_ROWS, D_IN), torch.randn(VAL_ROWS, D)

    def validation_step(self, batch, batch_idx):
        out = self(batch[0])
        self.val_outputs.append(out)

    def val_dataloader(self):
        return DataLoader(TensorDataset(self.xv, self.yv), batch_size=VAL_ROWS)


def test_a_leak_only_on_validation_steps_is_found_with_its_average_bytes_and_holder(tmp_path):
    # validation after every 2nd step keeps one (10, 32) float32 output: 1280 B every 2 steps = 640 B per step
    report, tracker, _ = fit(KeepsValidationOutputs(), tmp_path, 20, limit_val_batches=1, val_check_interval=2)
    assert report.leak.bytes_per_step == VAL_OUTPUT // 2 == 640
    top = top_group(report)
    assert (top.op, top.module, top.shape, top.bytes_per_step) == ("aten.addmm", "body.2", [VAL_ROWS, D], 640)
    assert top.holder.startswith("model.val_outputs[") and "list of 10 entries" in top.holder_note
    assert "held by model.val_outputs[" in report.format()
    # MemoryTracker's leak watch has the same rule: it sees it too, with the same figure
    assert tracker.leak_report is not None and tracker.leak_report.bytes_per_step == 640


class KeepPredictions(pl.Callback):
    """A callback that collects every step's predictions for later and never lets them go."""

    def __init__(self) -> None:
        self.saved = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.saved.append(outputs["preds"])


class ReturnsPredictions(Net):
    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        return {"loss": F.mse_loss(out, y), "preds": out.detach()}


def test_a_leak_inside_a_callback_names_the_callback(tmp_path):
    keep = KeepPredictions()
    report, tracker, trainer = fit(ReturnsPredictions(), tmp_path, 12, callbacks=[keep])
    index = trainer.callbacks.index(keep)
    # each step keeps the (4, 32) float32 output: 512 B per step
    assert report.leak.bytes_per_step == ACTIVATION
    top = top_group(report)
    assert (top.op, top.module, top.bytes_per_step) == ("aten.addmm", "body.2", ACTIVATION)
    assert top.holder.startswith(f"trainer.callbacks[{index}].saved[")
    assert tracker.leak_report is not None and tracker.leak_report.bytes_per_step == ACTIVATION


class HooksPileUp(Net):
    """Registers a forward hook in every step; each hook keeps the gate tensor it closes over."""

    def training_step(self, batch, batch_idx):
        gate = torch.ones(B, D)  # 4 x 32 float32: 512 B, one per hook
        self.body[2].register_forward_hook(lambda module, args, output: output * gate)
        return super().training_step(batch, batch_idx)


def test_hooks_piling_up_are_named_as_the_modules_hooks_with_their_function(tmp_path):
    report, tracker, _ = fit(HooksPileUp(), tmp_path, 12)
    assert report.leak.bytes_per_step == ACTIVATION
    top = top_group(report)
    assert (top.op, top.shape, top.bytes_per_step) == ("aten.ones", [B, D], ACTIVATION)
    assert top.holder == "model.body[2]._forward_hooks"
    assert (
        "12 hooks on model.body[2]._forward_hooks: 12 x HooksPileUp.training_step.<locals>.<lambda>" in top.holder_note
    )
    assert "test_doctor_holders.py:" in top.holder_note and "handle.remove()" in top.holder_note
    assert tracker.leak_report is not None and tracker.leak_report.bytes_per_step == ACTIVATION


class MetricNeverReset(Net):
    """A torchmetrics AUROC updated every step and never reset: its list states grow."""

    def __init__(self) -> None:
        super().__init__()
        self.train_auroc = torchmetrics.classification.BinaryAUROC()

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        probabilities = torch.sigmoid(out.mean(dim=1)).detach()  # (4,) float32: 16 B
        labels = (y.mean(dim=1) > 0).long()  # (4,) int64: 32 B
        self.train_auroc.update(probabilities, labels)
        return F.mse_loss(out, y)


class MetricCalledEveryStep(MetricNeverReset):
    """The same metric called (its forward: the batch's value) instead of updated; torchmetrics then copies
    its list states every step, so every kept tensor is remade in the newest step."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        self.train_auroc(torch.sigmoid(out.mean(dim=1)).detach(), (y.mean(dim=1) > 0).long())
        return F.mse_loss(out, y)


@pytest.mark.parametrize("module_class", [MetricNeverReset, MetricCalledEveryStep])
def test_a_metric_list_state_is_named_as_the_metric_with_bytes_per_update(module_class, tmp_path):
    report, tracker, _ = fit(module_class(), tmp_path, 12)
    # each update keeps 4 float32 probabilities (16 B) and 4 int64 labels (32 B): 48 B per step
    assert report.leak.bytes_per_step == 4 * FLOAT32 + 4 * 8 == 48
    holders = {g.holder: g for g in report.leak.growing or report.leak.survivors if g.holder}
    assert {"model.train_auroc.preds", "model.train_auroc.target"} <= set(holders), report.format()
    if module_class is MetricNeverReset:  # made one per step: the groups' own figures are per step too
        assert holders["model.train_auroc.preds"].bytes_per_step == 16
        assert holders["model.train_auroc.target"].bytes_per_step == 32
    note = holders["model.train_auroc.preds"].holder_note
    assert (
        "torchmetrics BinaryAUROC model.train_auroc: list state 'preds' has 12 entries, 192 B (16 B per update)" in note
    )
    assert "model.train_auroc.reset()" in note and "compute_on_cpu=True" in note
    assert tracker.leak_report is not None and tracker.leak_report.bytes_per_step == 48


# ============================================================================================ clean runs
class PerEpochLosses(Net):
    """Keeps each step's loss in a list and clears it at each epoch's end (Lightning's own documented pattern)."""

    def __init__(self) -> None:
        super().__init__(batches=8)  # 8 steps per epoch
        self.losses = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.detach())
        return loss

    def on_train_epoch_end(self) -> None:
        self.losses.clear()


class PrebuiltBatches(Net):
    """A loader over a list of batches built before training: each batch is new to the doctor when first seen."""

    def __init__(self) -> None:
        super().__init__(batches=16)
        self.batches = [(self.x[i * B : (i + 1) * B].clone(), self.y[i * B : (i + 1) * B].clone()) for i in range(16)]

    def train_dataloader(self):
        return DataLoader(self.batches, batch_size=None)


class BoundedCache(Net):
    """Keeps the last 3 outputs only."""

    def __init__(self) -> None:
        super().__init__()
        self.recent = collections.deque(maxlen=3)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        self.recent.append(out.detach())
        return F.mse_loss(out, y)


class LazyAdam(Net):
    """Adam: its state is made at the first optimizer step."""

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class WithValidation(Net):
    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.mse_loss(self(batch[0]), batch[1]))

    def val_dataloader(self):
        return DataLoader(TensorDataset(self.x[:8], self.y[:8]), batch_size=B)


class Scheduled(Net):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)]


CLEAN = {
    "per-epoch list, 8-step epochs x 4": (PerEpochLosses, 32, {}),
    "pre-built batches": (PrebuiltBatches, 16, {}),
    "bounded cache": (BoundedCache, 16, {}),
    "lazily created optimizer state": (LazyAdam, 16, {}),
    "validation every 3 steps": (WithValidation, 18, {"limit_val_batches": 2, "val_check_interval": 3}),
    "accumulation": (Net, 16, {"accumulate_grad_batches": 2}),
    "a scheduler": (Scheduled, 16, {}),
}


@pytest.mark.parametrize("name", list(CLEAN))
def test_healthy_runs_are_reported_by_neither_the_doctor_nor_memory_tracker(name, tmp_path):
    module_class, steps, overrides = CLEAN[name]
    report, tracker, trainer = fit(module_class(), tmp_path, steps, **overrides)
    assert report.steps == steps and report.errors == []
    assert report.healthy, report.format()
    assert "no leak" in report.format()
    assert tracker.leak_report is None and "leak" not in tracker.summary.extra


def test_the_per_epoch_list_does_look_like_growth_within_each_epoch(tmp_path):
    # what makes the clean run above a real test: within each epoch the live bytes climb by one kept loss
    # per step (its storage: mse_loss's (4, 32) float32 buffer, 512 B, of which the loss is a view), and
    # fall back to the floor when the epoch's end clears the list
    report, _, _ = fit(PerEpochLosses(), tmp_path, 32)
    points = dict(report.live_bytes_at_start)
    losses = F.mse_loss(torch.zeros(B, D), torch.zeros(B, D)).untyped_storage().nbytes()
    assert [points[step] - points[8] for step in range(8, 16)] == [k * losses for k in range(8)]
    assert [points[8 * e] for e in range(1, 4)] == [points[8]] * 3


# ============================================================================================ the rule alone
def test_the_floor_rule_finds_growth_every_k_steps_and_not_a_saw_tooth_or_a_filled_cache():
    # 1280 B kept every 2nd step, and 3000 B that live only on odd steps (a validation's own tensors):
    # the floor at odd step k is the next even step's bytes; it rises at steps 1, 3, ..., 17 (step 19 is
    # the last point, not yet a floor), by 1280 B each: 8 x 1280 B over 16 steps is 640 B per step
    periodic = [(step, 1000 + 1280 * (step // 2) + (3000 if step % 2 else 0)) for step in range(20)]
    assert rising_floor(periodic, 5) == (640, 1, 17, 9)
    # a list cleared every 8 steps: within each epoch it climbs, then its floor is back where it was;
    # the last epoch's climb alone looks like growth until its end is seen (why the watcher waits for it)
    saw_tooth = [(step, 1000 + 512 * (step % 8)) for step in range(32)]
    assert rising_floor(saw_tooth + [(32, 1000)], 5) is None
    assert rising_floor(saw_tooth, 5) == (512, 25, 30, 6)
    # a cache that fills up in 6 steps and then stays: the floor stopped rising long ago
    cache = [(step, 1000 + 512 * min(step, 6)) for step in range(24)]
    assert rising_floor(cache, 5) is None
    assert rising_floor(cache[:9], 5) == (512, 1, 6, 6)  # while it fills, it is growth like any other


def test_the_watcher_judges_epochs_when_they_end_and_the_run_when_it_ends():
    watcher = LeakWatcher(window=3, warmup_steps=0)
    # 3 epochs of 8 steps; a per-epoch list (512 B a step) cleared at each epoch's end
    found = [watcher.observe(step, 1000 + 512 * (step % 8), epoch=step // 8) for step in range(24)]
    assert found == [None] * 24
    assert watcher.finish(live_bytes=1000) is None  # the last epoch's end freed it: no leak
    leaking = LeakWatcher(window=3, warmup_steps=0)
    # the same growth, never freed: found at the first epoch's end (the first step of epoch 1)
    found = [leaking.observe(step, 1000 + 512 * step, epoch=step // 8) for step in range(24)]
    assert [i for i, r in enumerate(found) if r is not None] == [8]
    assert found[8].bytes_per_step == 512
    # one epoch only: judged at the end, and only if the memory is still there
    single = LeakWatcher(window=3, warmup_steps=0)
    assert all(single.observe(step, 1000 + 512 * step, epoch=0) is None for step in range(8))
    assert single.finish(live_bytes=1000 + 512 * 8, freed_at_end=0).bytes_per_step == 512
    freed = LeakWatcher(window=3, warmup_steps=0)
    assert all(freed.observe(step, 1000 + 512 * step, epoch=0) is None for step in range(8))
    assert freed.finish(live_bytes=1000, freed_at_end=512 * 8) is None


# ============================================================================================ the search alone
class Holder:
    def __init__(self) -> None:
        self.items = {"a": [], "b": []}


def test_find_holders_names_the_shortest_path_from_the_best_root():
    kept = torch.zeros(8)
    holder = Holder()
    holder.items["b"].append(kept.view(2, 4))  # a view kept: the same storage counts
    model = nn.Linear(2, 2)
    model.extra = holder
    roots = user_roots(module=model, extra={"cache": holder}, globals_of_user_modules=False)
    search = find_holders([kept], roots, time_limit_s=5.0)
    [path] = search.paths.values()
    # two roots reach it: the holder itself in fewer steps than through the model
    assert (path.text, path.kind, search.stopped) == ("cache.items['b'][0]", "global", "all found")
    assert "cache.items is a dict of 2 entries" in path.note  # the largest container on the way
    del roots[id(holder)]
    search = find_holders([kept], roots, time_limit_s=5.0)
    assert [p.text for p in search.paths.values()] == ["model.extra.items['b'][0]"]


def test_find_holders_gives_up_fast_when_no_root_reaches_the_tensor():
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(50)])
    unreachable = [torch.zeros(3)]  # a local variable: no root the user knows reaches it
    search = find_holders(unreachable, user_roots(module=model, globals_of_user_modules=False), time_limit_s=5.0)
    assert search.paths == {} and search.stopped == "no more referents"
    # it walked what the model reaches (its modules, their dicts, parameters), not the whole process
    assert search.objects < 2000 < len(gc.get_objects())
    limited = find_holders(unreachable, user_roots(module=model, globals_of_user_modules=False), time_limit_s=0.0)
    assert limited.stopped == "time limit" and limited.objects < search.objects


def test_a_tensor_lightning_keeps_is_named_as_lightnings(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=2)
    module = Net()
    trainer.fit(module)
    kept = torch.zeros(3)
    trainer.fit_loop.epoch_loop.hidden_for_the_test = [kept]
    [path] = find_holders([kept], user_roots(trainer, module, globals_of_user_modules=False)).paths.values()
    assert path.text == "trainer.fit_loop.epoch_loop.hidden_for_the_test[0]" and path.lightning
    assert path.note.startswith("Lightning's own objects keep it (not your code)")
    del trainer.fit_loop.epoch_loop.hidden_for_the_test


def test_the_doctor_leaves_nothing_behind_after_naming_holders(tmp_path):
    from tests.helpers.live_tensors import live_tensor_bytes, tensors_with_grad_fn

    gc.collect()
    before = live_tensor_bytes()
    module = HooksPileUp()
    report = fit(module, tmp_path, 12)[0]  # the trainer (it keeps the module) is not kept
    assert report.leak.growing[0].holder == "model.body[2]._forward_hooks"
    del module
    gc.collect()
    assert live_tensor_bytes() - before == 0 and tensors_with_grad_fn() == []


def test_memkit_doctor_prints_one_progress_line_per_window_unless_told_not_to(tmp_path, capsys):
    from lightning_memkit.cli import main
    from tests.doctor.test_doctor import LEAKY_FILE

    path = tmp_path / "leaky.py"
    path.write_text(LEAKY_FILE)
    assert main(["doctor", f"{path}:Leaky", "--steps", "10", "--batch-size", "4"]) == 3
    captured = capsys.readouterr()
    progress = [line for line in captured.err.splitlines() if line.startswith("memkit doctor: step ")]
    # the first step, then one line per --window (5) steps watched: steps 0, 4 and 9
    assert [line.split(",")[0] for line in progress] == [
        "memkit doctor: step 0/10",
        "memkit doctor: step 4/10",
        "memkit doctor: step 9/10",
    ], captured.err
    assert "held by model.history[9]" in captured.out
    assert main(["doctor", f"{path}:Leaky", "--steps", "10", "--batch-size", "4", "--no-progress"]) == 3
    assert "memkit doctor: step " not in capsys.readouterr().err


def test_too_few_steps_are_said_to_be_too_few_to_judge(tmp_path):
    doctor = MemoryDoctor(verbose=False)
    make_trainer(tmp_path, fast_dev_run=True, callbacks=[doctor]).fit(Net())
    # the 2 warm-up steps, then 5 rises of the floor between a first and a last point: 9 steps
    assert "too few steps to judge a leak: 1 watched, 9 needed" in doctor.report.format()
    assert "no leak" not in doctor.report.format()


class OutputsEveryEpoch(Net):
    """Keeps each step's output over 4 epochs of 8 steps: a leak that no epoch's end frees."""

    def __init__(self) -> None:
        super().__init__(batches=8)
        self.outputs = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        self.outputs.append(out.detach())
        return F.mse_loss(out, y)


def test_a_leak_across_epochs_is_found_when_the_first_epoch_ends(tmp_path):
    doctor = MemoryDoctor(verbose=False)
    with pytest.warns(UserWarning, match="memory leak") as warned:
        make_trainer(tmp_path, max_steps=32, callbacks=[doctor]).fit(OutputsEveryEpoch())
    report = doctor.report
    # judged at step 8, the first of epoch 1: the floor rose at steps 3..7 (8 is the newest point)
    assert (report.leak.first_step, report.leak.last_step, report.leak.bytes_per_step) == (3, 7, ACTIVATION)
    assert report.leak.growing[0].holder == "model.outputs[7]"
    assert sum("memory leak" in str(w.message) for w in warned) == 1
