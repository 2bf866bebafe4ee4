"""LayerTrace in real Trainer runs (TensorBoard read back with EventAccumulator, the JSON file),
the `memkit trace` command, and the private torch internals the tracer relies on."""

from __future__ import annotations

import glob
import itertools
import json
import os
import textwrap
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_memkit import LayerTrace, MemoryTracker
from lightning_memkit.trace._torch_compat import in_backward, in_checkpoint_recomputation, queue_backward_end_callback
from lightning_memkit.trace.trace_records import TRACE_FORMAT, read_trace
from tests.helpers.event_files import read_scalars
from tests.helpers.live_tensors import describe, live_tensor_bytes, live_tensors, storage_bytes, tensors_with_grad_fn
from tests.helpers.models import FLOAT32, LinearStack
from tests.helpers.paths import REPO_ROOT
from tests.helpers.processes import run_script
from tests.helpers.trainers import make_trainer

MiB = 2**20


def _tensorboard(log_dir: str):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (path,) = glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))
    accumulator = EventAccumulator(path, size_guidance={"tensors": 0, "images": 0, "scalars": 0})
    accumulator.Reload()
    return accumulator


def test_trainer_run_writes_table_figure_scalars_and_json(tmp_path):
    model = LinearStack(dims=(32, 64, 48, 16), batch_size=8, optimizer="adam")
    callback = LayerTrace()
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    trainer = make_trainer(
        tmp_path, max_steps=3, logger=[logger, CSVLogger(str(tmp_path), name="csv")], callbacks=[callback]
    )
    trainer.fit(model)

    (result,) = callback.results
    assert result.step == 1 and result.errors == []
    psi = model.parameter_bytes() // FLOAT32
    end = result.at_end
    # Lightning zeroes gradients (set_to_none) before backward, so they are alive at step end
    assert end["parameters"] == 4 * psi and end["gradients"] == 4 * psi
    assert end["optimizer_state"] == 8 * psi + FLOAT32 * 6  # Adam: two moments + a step counter per tensor
    assert end["inputs"] == 8 * 32 * FLOAT32
    # the whole training step is traced: forward, backward and the optimizer step
    phases = [e.phase for e in result.events]
    assert phases.index("forward") < phases.index("backward-end") < phases.index("optimizer-step")
    forward = {e.module: e.delta_bytes for e in result.module_events("forward")}
    assert forward["net.0"] == model.activation_bytes(0)

    # the JSON file in the logger's log dir
    path = os.path.join(logger.log_dir, "memkit_trace_step1.json")
    assert callback.paths == [path]
    with open(path) as handle:
        assert json.load(handle)["format"] == TRACE_FORMAT
    assert read_trace(path) == result

    # TensorBoard: text table, category table, figure, scalars
    accumulator = _tensorboard(logger.log_dir)
    texts = accumulator.Tags()["tensors"]
    assert "memory/trace/table/text_summary" in texts and "memory/trace/categories/text_summary" in texts
    (table_event,) = accumulator.Tensors("memory/trace/table/text_summary")
    table = table_event.tensor_proto.string_val[0].decode()
    assert table_event.step == 1 and "net.0 (Linear)" in table and "pre-backward" in table
    (image,) = accumulator.Images("memory/trace/figure")
    assert image.step == 1 and image.encoded_image_string[:4] == b"\x89PNG" and image.width > 300
    scalars = read_scalars(logger.log_dir)
    assert scalars["memory/trace/end/optimizer_state_MiB"] == [(1, pytest.approx((8 * psi + 24) / MiB, rel=1e-6))]
    assert scalars["memory/trace/peak_MiB"] == [(1, pytest.approx(result.peak_bytes / MiB, rel=1e-6))]
    assert scalars["memory/trace/end/gradients_MiB"][0][1] == pytest.approx(4 * psi / MiB, rel=1e-6)

    # nothing stays installed after the traced step
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks


def test_every_n_steps_and_at_steps_and_memory_tracker_together(tmp_path):
    model = LinearStack(batch_size=8, optimizer="sgd")
    callback = LayerTrace(at_steps=(0,), every_n_steps=2, max_depth=1, dirpath=tmp_path, verbose=False)
    tracker = MemoryTracker(verbose=False, tensor_peak_every_n_steps=1)  # the exact peak of every step
    trainer = make_trainer(tmp_path, max_steps=5, callbacks=[tracker, callback])
    trainer.fit(model)
    assert [r.step for r in callback.results] == [0, 2, 4]
    assert all(e.depth <= 1 for r in callback.results for e in r.module_events())
    # MemoryTracker's accountant and the tracer's nest without disturbing each other: both exact
    step2 = next(r for r in tracker.history if r.step == 2)
    assert step2.peak_tensor_bytes >= callback.results[1].peak_bytes - callback.results[1].at_peak["inputs"]
    assert sorted(os.path.basename(p) for p in callback.paths) == [
        "memkit_trace_step0.json",
        "memkit_trace_step2.json",
        "memkit_trace_step4.json",
    ]


def test_gradient_accumulation_traces_every_micro_batch_of_the_step(tmp_path):
    model = LinearStack(batch_size=8, optimizer="sgd")
    callback = LayerTrace(at_steps=(1,))
    trainer = make_trainer(tmp_path, max_steps=2, accumulate_grad_batches=2, callbacks=[callback])
    trainer.fit(model)
    (result,) = callback.results
    assert [e.call for e in result.module_events("forward", "net.0")] == [0, 1]
    assert [e.phase for e in result.events].count("optimizer-step") == 1


def test_with_the_activation_checkpointing_callback_recomputation_shows(tmp_path):
    from torch import nn

    from lightning_memkit import ActivationCheckpointing

    model = LinearStack(dims=(32, 64, 64, 16), batch_size=8, optimizer="adam")
    callback = LayerTrace()
    checkpointing = ActivationCheckpointing(policy={nn.Sequential}, measure=False, verbose=False)
    make_trainer(tmp_path, max_steps=2, callbacks=[checkpointing, callback]).fit(model)
    (result,) = callback.results
    assert result.errors == []
    recomputed = {e.module for e in result.events if e.recompute}
    assert {"net.0", "net.1", "net.2"} <= recomputed <= {f"net.{i}" for i in range(5)}
    assert result.saved_bytes_by_module()["net"] == 0  # its input is the batch; nothing inside is kept
    first_backward = min(e.index for e in result.events if e.phase == "pre-backward")
    assert min(e.index for e in result.events if e.recompute) > first_backward


def test_bad_options_raise_misconfiguration():
    with pytest.raises(MisconfigurationException, match="every_n_steps"):
        LayerTrace(every_n_steps=0)
    with pytest.raises(MisconfigurationException, match="at_steps"):
        LayerTrace(at_steps=(-1,))
    with pytest.raises(MisconfigurationException, match="max_depth"):
        LayerTrace(max_depth=-2)


def test_unmatched_modules_filter_fails_with_a_clear_error(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=2, callbacks=[LayerTrace(at_steps=(0,), modules=["encoder.*"])])
    with pytest.raises(MisconfigurationException, match="selects no module"):
        trainer.fit(LinearStack(batch_size=8))


def test_cli_trace_prints_the_table(tmp_path):
    source = tmp_path / "my_model.py"
    source.write_text(
        textwrap.dedent("""
        import lightning.pytorch as pl, torch
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset

        class Small(pl.LightningModule):
            def __init__(self, batch_size=4):
                super().__init__()
                self.batch_size = batch_size
                self.net = nn.Sequential(
                    nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2), nn.Flatten(),
                    nn.Linear(8 * 8 * 8, 2),
                )
            def forward(self, x):
                return self.net(x)
            def training_step(self, batch, batch_idx):
                (x,) = batch
                return self(x).sum()
            def configure_optimizers(self):
                return torch.optim.Adam(self.parameters())
            def train_dataloader(self):
                return DataLoader(TensorDataset(torch.randn(32, 3, 16, 16)), batch_size=self.batch_size)
    """)
    )
    out_json = tmp_path / "trace.json"
    arguments = ["trace", f"{source}:Small", "--batch-size", "6", "--json", str(out_json)]
    out = run_script(["-m", "lightning_memkit.cli", *arguments], str(tmp_path), timeout=120)
    assert "layer trace of Small, step 1" in out
    conv_line = next(line for line in out.splitlines() if line.startswith("    net.0 (Conv2d)") and " forward " in line)
    assert "(6, 8, 16, 16) float32" in conv_line and f"+{6 * 8 * 16 * 16 * 4 / MiB:.3f}" in conv_line
    assert "optimizer_state" in out and "Ψ = " in out
    assert read_trace(out_json).module_events("forward", "net.0")[0].delta_bytes == 6 * 8 * 16 * 16 * 4


def test_cli_trace_bad_input_says_what_to_do(tmp_path, capsys):
    from lightning_memkit.cli import main

    source = tmp_path / "plain.py"
    source.write_text("import torch\nclass Net(torch.nn.Module):\n    pass\n")
    assert main(["trace", f"{source}:Nope"]) == 2
    assert "has no 'Nope'" in capsys.readouterr().err
    assert main(["trace", f"{source}:Net"]) == 2
    assert "not a LightningModule" in capsys.readouterr().err
    assert main(["trace", f"{source}:Net", "--batch-size", "0"]) == 2
    assert "positive" in capsys.readouterr().err


# ---- pins of the private torch internals (lightning_memkit/trace/_torch_compat.py) ----------


def test_in_backward_is_true_only_inside_backward():
    seen = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda grad: seen.append(in_backward()))
    assert not in_backward()
    y.sum().backward()
    assert seen == [True] and not in_backward()


def test_backward_end_callback_runs_after_all_gradients():
    order = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2

    def hook(grad):
        order.append("hook")
        queue_backward_end_callback(lambda: order.append("end"))

    y.register_hook(hook)
    x.register_post_accumulate_grad_hook(lambda p: order.append("accumulated"))
    y.sum().backward()
    assert order == ["hook", "accumulated", "end"]


def test_in_checkpoint_recomputation_only_while_checkpoint_recomputes():
    from torch.utils.checkpoint import checkpoint

    seen = []

    def region(x):
        seen.append((in_backward(), in_checkpoint_recomputation()))
        return x.sin().sin()

    x = torch.randn(3, requires_grad=True)
    checkpoint(region, x, use_reentrant=False).sum().backward()
    assert seen == [(False, False), (True, True)]  # the forward, then its recomputation
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert not in_checkpoint_recomputation()


# ---- nothing held after the fit; unreached steps; what verbose prints; where files go -------------


def test_a_kept_layer_trace_holds_no_tensor_of_the_model_after_the_fit(tmp_path):
    """A user's case: DemoTransformer, 3 steps, model and Trainer deleted, the callback kept to read its
    results. Lightning binds ``callback.log`` to the module at fit start and never unbinds it, which would keep
    14.33 MiB (parameters, gradients, Adam's state) alive. Counted with gc over the whole process."""
    from lightning_memkit.zoo import DemoTransformer

    make_trainer(tmp_path / "warm", max_steps=1).fit(
        DemoTransformer(layers=1)
    )  # torch's and Lightning's one-time state
    empty = live_tensor_bytes()
    model = DemoTransformer()
    callback = LayerTrace()
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    trainer = make_trainer(tmp_path, max_steps=3, logger=logger, callbacks=[callback])
    trainer.fit(model)
    model_state = live_tensor_bytes() - empty
    assert model_state >= 3 * sum(p.numel() * p.element_size() for p in model.parameters())  # weights, gradients, Adam
    del model, trainer
    assert live_tensor_bytes() == empty, describe(live_tensors())
    assert tensors_with_grad_fn() == []
    (result,) = callback.results  # the records are still there to read
    assert result.step == 1 and "optimizer_state" in result.format_categories()
    # the same callback, given to a new Trainer, traces again (Lightning binds its log functions again)
    model = DemoTransformer(layers=1)
    make_trainer(tmp_path / "again", max_steps=2, callbacks=[callback]).fit(model)
    assert [r.step for r in callback.results] == [1, 1]
    del model
    assert live_tensor_bytes() == empty, describe(live_tensors())


def _memkit_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "memkit LayerTrace" in str(w.message)]


@pytest.mark.parametrize(
    ("options", "batches", "max_steps", "never", "last"),
    [
        ({"at_steps": (1,)}, 1, -1, "step 1 of at_steps never reached", 0),  # the README's trap: one batch per epoch
        ({"at_steps": (100,)}, 8, 2, "step 100 of at_steps never reached", 1),
        ({"at_steps": (0, 1, 5, 7)}, 8, 3, "steps 5, 7 of at_steps never reached", 2),
        ({"every_n_steps": 100}, 8, 3, "every_n_steps=100 traced no step", 2),
    ],
)
def test_a_step_never_reached_is_named_in_one_warning_at_fit_end(tmp_path, options, batches, max_steps, never, last):
    model = LinearStack(batch_size=8, samples=8 * batches)
    callback = LayerTrace(verbose=False, **options)
    trainer = make_trainer(tmp_path, max_steps=max_steps, max_epochs=1, callbacks=[callback])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(model)
    (message,) = _memkit_warnings(record)
    assert never in message and f"the run's last training step was {last}" in message
    assert f"LayerTrace(at_steps=({last},))" in message and "train longer" in message
    assert callback.last_step == last == trainer.global_step - 1
    assert all(r.step <= last for r in callback.results)


def test_no_warning_when_every_chosen_step_was_traced(tmp_path):
    callback = LayerTrace(at_steps=(0, 2), every_n_steps=1000, verbose=False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        make_trainer(tmp_path, max_steps=3, callbacks=[callback]).fit(LinearStack(batch_size=8))
    assert [r.step for r in callback.results] == [0, 2]
    assert _memkit_warnings(record) == []


@pytest.fixture
def lightning_info():
    """What Lightning's rank-zero info log (the console lines Lightning's own callbacks print) received."""
    import logging

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    from lightning_utilities.core import rank_zero

    handler = Collect(level=logging.INFO)
    # the logger rank_zero_info writes to: lightning.pytorch's, or pytorch_lightning's once that package was imported
    # (torchmetrics may import it; it re-points the shared rank_zero module's logger, still to the console)
    logger = rank_zero.log
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


def test_verbose_by_default_prints_the_categories_and_where_everything_went(tmp_path, lightning_info):
    model = LinearStack(dims=(32, 64, 48, 16), batch_size=8, optimizer="adam")
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    callback = LayerTrace()
    make_trainer(tmp_path, max_steps=3, logger=logger, callbacks=[callback]).fit(model)
    (printed,) = [line for line in lightning_info if line.startswith("memkit LayerTrace: step 1")]
    psi = model.parameter_bytes() // FLOAT32
    optimizer_row = next(line for line in printed.splitlines() if line.startswith("optimizer_state"))
    assert optimizer_row.split()[-1] == str(8 * psi + FLOAT32 * 6)  # exact bytes at step end
    assert f"tensorboard --logdir {logger.log_dir}" in printed and "memory/trace/table" in printed
    assert f"raw events: {callback.paths[0]}" in printed


def test_verbose_without_tensorboard_says_how_to_see_the_table_and_false_prints_nothing(tmp_path, lightning_info):
    logger = CSVLogger(str(tmp_path), name="csv")
    callback = LayerTrace(at_steps=(0,))
    make_trainer(tmp_path, max_steps=1, logger=logger, callbacks=[callback]).fit(LinearStack(batch_size=8))
    (printed,) = [line for line in lightning_info if line.startswith("memkit LayerTrace")]
    assert ".results[-1].format_table()" in printed and f"memkit report {logger.log_dir}" in printed
    assert f"raw events: {os.path.join(logger.log_dir, 'memkit_trace_step0.json')}" in printed
    lightning_info.clear()
    make_trainer(tmp_path / "nolog", max_steps=1, callbacks=[LayerTrace(at_steps=(0,))]).fit(LinearStack(batch_size=8))
    (printed,) = [line for line in lightning_info if line.startswith("memkit LayerTrace")]
    assert "no file without a logger; LayerTrace(dirpath=...) writes them" in printed
    lightning_info.clear()
    make_trainer(tmp_path / "quiet", max_steps=1, callbacks=[LayerTrace(at_steps=(0,), verbose=False)]).fit(
        LinearStack(batch_size=8)
    )
    assert not [line for line in lightning_info if "memkit" in line]


def test_files_go_to_the_logger_or_dirpath_never_unasked_into_the_working_directory(tmp_path, monkeypatch):
    from lightning_memkit.report.sources import find_sources

    working = tmp_path / "cwd"
    working.mkdir()
    monkeypatch.chdir(working)
    # no logger, no dirpath: no file at all (not in the working directory, not in default_root_dir)
    quiet = LayerTrace(verbose=False)
    make_trainer(tmp_path / "default_root", max_steps=2, logger=False, callbacks=[quiet]).fit(LinearStack(batch_size=8))
    assert quiet.paths == [] and quiet.results[0].step == 1
    assert list(working.iterdir()) == [] and not list((tmp_path / "default_root").rglob("memkit_trace*"))
    # the logger's log dir
    logger = CSVLogger(str(tmp_path), name="csv")
    logged = LayerTrace(verbose=False)
    make_trainer(tmp_path, max_steps=2, logger=logger, callbacks=[logged]).fit(LinearStack(batch_size=8))
    assert logged.paths == [os.path.join(logger.log_dir, "memkit_trace_step1.json")]
    # dirpath, twice: the second run never overwrites the first run's file
    root = tmp_path / "traces"
    first = LayerTrace(verbose=False, dirpath=root)
    make_trainer(tmp_path, max_steps=2, logger=False, callbacks=[first]).fit(LinearStack(batch_size=8))
    assert first.paths == [str(root / "memkit_trace_step1.json")]
    written = (root / "memkit_trace_step1.json").read_text()
    second = LayerTrace(verbose=False, dirpath=str(root))
    make_trainer(tmp_path, max_steps=2, logger=False, callbacks=[second]).fit(LinearStack(batch_size=16))
    assert second.paths == [str(root / "memkit_trace_step1-v1.json")]
    assert (root / "memkit_trace_step1.json").read_text() == written  # the first run's file is untouched
    assert read_trace(second.paths[0]) == second.results[0] and read_trace(first.paths[0]) == first.results[0]
    assert list(working.iterdir()) == []  # nothing in the working directory
    # memkit report finds both runs' traces
    assert sorted(os.path.basename(t.path) for t in find_sources(str(root)).traces) == [
        "memkit_trace_step1-v1.json",
        "memkit_trace_step1.json",
    ]
    with pytest.raises(MisconfigurationException, match="dirpath"):
        LayerTrace(dirpath=3)


def test_write_new_file_takes_the_first_free_version(tmp_path):
    from lightning_memkit.trace.trace_records import write_new_file

    paths = [write_new_file(tmp_path / "d", "memkit_trace_step3_rank1.json", str(i)) for i in range(3)]
    assert [os.path.basename(p) for p in paths] == [
        "memkit_trace_step3_rank1.json",
        "memkit_trace_step3_rank1-v1.json",
        "memkit_trace_step3_rank1-v2.json",
    ]
    assert [Path(p).read_text() for p in paths] == ["0", "1", "2"]
    os.remove(paths[1])  # a gap is reused: the name is free again
    assert (
        os.path.basename(write_new_file(tmp_path / "d", "memkit_trace_step3_rank1.json", "3"))
        == "memkit_trace_step3_rank1-v1.json"
    )


# ---- memkit trace: hints that name the flag that fixes the case ---------------------------------

GPT_SOURCE = '''
import lightning.pytorch as pl, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

class TinyGPT(pl.LightningModule):
    """Its data comes from a datamodule; no batch_size anywhere in the module."""
    def __init__(self, vocab=64, d=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.head = nn.Linear(d, vocab)
    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        return nn.functional.cross_entropy(self.head(self.embed(tokens)).flatten(0, 1), tokens.flatten())
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())

class TokensDM(pl.LightningDataModule):
    def __init__(self, batch_size=4):
        super().__init__()
        self.save_hyperparameters()
    def setup(self, stage=None):
        self.train_set = TensorDataset(torch.randint(0, 64, (64, 16)))
    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size)
'''


def test_cli_trace_batch_size_on_a_module_fed_by_a_datamodule_points_at_datamodule(tmp_path, capsys):
    from lightning_memkit.cli import main

    source = tmp_path / "gpt.py"
    source.write_text(GPT_SOURCE)
    assert main(["trace", f"{source}:TinyGPT", "--batch-size", "8"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "--datamodule FILE.py:DataModuleClass" in error and "--init-args" not in error
    assert "TinyGPT defines no train_dataloader()" in error and "--batch-size then goes to the datamodule" in error
    # without --batch-size: the same flag
    assert main(["trace", f"{source}:TinyGPT"]) == 2
    assert "--datamodule FILE.py:DataModuleClass" in capsys.readouterr().err
    # the fix the message names works, and the batch size reaches the datamodule
    assert (
        main(["trace", f"{source}:TinyGPT", "--datamodule", f"{source}:TokensDM", "--batch-size", "8", "--step", "0"])
        == 0
    )
    out = capsys.readouterr().out
    embed = next(
        line for line in out.splitlines() if line.strip().startswith("embed (Embedding)") and " forward " in line
    )
    assert "(8, 16, 32) float32" in embed


def test_cli_trace_step_never_reached_says_the_last_step(tmp_path, capsys):
    from lightning_memkit.cli import main

    source = tmp_path / "stops.py"
    source.write_text(
        textwrap.dedent(
            f"""
        import sys
        sys.path.insert(0, {REPO_ROOT!r})
        from tests.helpers.models import LinearStack

        class StopsEarly(LinearStack):
            def on_train_batch_end(self, outputs, batch, batch_idx):
                if self.trainer.global_step >= 2:
                    self.trainer.should_stop = True
    """
        )
    )
    assert main(["trace", f"{source}:StopsEarly", "--step", "5"]) == 1
    error = capsys.readouterr().err
    assert "step 5 was never reached: training stopped after step 1; pass --step 1 or less" in error


def test_traced_steps_leave_the_next_steps_start_as_an_untraced_run_has_it(tmp_path):
    """LayerTrace leaves nothing to the next step: at each step's start, no autograd graph is alive and the process's
    live tensor bytes equal those of the same fit without LayerTrace (a transformer with dropout)."""
    from lightning.pytorch import Callback, seed_everything

    from lightning_memkit.zoo import DemoTransformer

    class StepStarts(Callback):
        def __init__(self) -> None:
            self.readings: list[tuple[int, int]] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            tensors = live_tensors("cpu")  # one collection and scan for both readings
            self.readings.append((storage_bytes(tensors), sum(t.grad_fn is not None for t in tensors)))

    def fit(*callbacks) -> list[tuple[int, int]]:
        seed_everything(0, verbose=False)
        probe = StepStarts()
        make_trainer(tmp_path, max_steps=3, callbacks=[*callbacks, probe]).fit(DemoTransformer(layers=2, dropout=0.1))
        return probe.readings

    baseline = fit()
    traced = fit(LayerTrace(at_steps=(0, 1), verbose=False))
    assert [graphs for _, graphs in traced] == [0, 0, 0]
    assert traced == baseline


class _MetricAccumulating(pl.LightningModule):
    """A step whose activations dominate, updating torchmetrics metrics (one called like a module, one with a
    list state, whose hash changes with every update) and logging one."""

    def __init__(self) -> None:
        super().__init__()
        torchmetrics = pytest.importorskip("torchmetrics")
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, 1024),
            torch.nn.ReLU(),
            torch.nn.Linear(1024, 1024),
            torch.nn.ReLU(),
            torch.nn.Linear(1024, 8),
        )
        self.train_loss = torchmetrics.MeanMetric()
        self.losses = torchmetrics.CatMetric()
        self.data = torch.randn(1024, 64, generator=torch.Generator().manual_seed(0))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = self.net(x).pow(2).mean()
        self.train_loss(loss)
        self.losses.update(loss.detach())
        self.log("train_loss", self.train_loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters())

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.data), batch_size=256)


def _micro_batch_peaks(result) -> list[int]:
    starts = [e.index for e in result.events if e.phase == "pre-forward" and e.module == "net"]
    bounds = starts + [len(result.events)]
    return [max(e.live_bytes for e in result.events[a:b]) for a, b in itertools.pairwise(bounds)]


@pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning")  # torchmetrics on torch's pytree, not memkit's
def test_beside_memory_tracker_under_accumulation_with_torchmetrics_both_micro_batches_are_traced(tmp_path):
    alone = LayerTrace(at_steps=(1,), verbose=False, dirpath=tmp_path / "alone")
    make_trainer(tmp_path, max_steps=2, accumulate_grad_batches=2, callbacks=[alone]).fit(_MetricAccumulating())
    trace = LayerTrace(at_steps=(1,), verbose=False, dirpath=tmp_path / "both")
    tracker = MemoryTracker(verbose=False)  # pauses its accountant after each micro-batch, under the tracer's
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tmp_path, max_steps=2, accumulate_grad_batches=2, callbacks=[tracker, trace]).fit(
            _MetricAccumulating()
        )
    assert [str(w.message) for w in caught if "memkit" in str(w.message)] == []
    (result,) = trace.results
    (reference,) = alone.results
    first, second = _micro_batch_peaks(result)
    assert abs(first - second) <= 0.01 * first  # the same micro-batch twice (plain PyTorch: the same height)
    assert result.peak_bytes == reference.peak_bytes  # the tracker beside it changes nothing the trace sees
    assert result.errors == []
    metric_phases = {e.phase for e in result.events if e.module in ("train_loss", "losses")}
    assert metric_phases == {"pre-forward", "forward"}  # a metric's update has no backward row
