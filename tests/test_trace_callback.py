"""LayerTrace in real Trainer runs (TensorBoard read back with EventAccumulator, the JSON file),
the `memkit trace` command, and the private torch internals the tracer relies on."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from conftest import FLOAT32, LinearStack, make_trainer, read_scalars
from lightning_memkit import LayerTrace, MemoryTracker
from lightning_memkit.trace import TRACE_FORMAT, read_trace
from lightning_memkit.trace._torch_compat import in_backward, in_checkpoint_recomputation, queue_backward_end_callback

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
    trainer = make_trainer(tmp_path, max_steps=3, logger=[logger, CSVLogger(str(tmp_path), name="csv")], callbacks=[callback])
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
    callback = LayerTrace(at_steps=(0,), every_n_steps=2, max_depth=1)
    tracker = MemoryTracker(verbose=False)
    trainer = make_trainer(tmp_path, max_steps=5, callbacks=[tracker, callback])
    trainer.fit(model)
    assert [r.step for r in callback.results] == [0, 2, 4]
    assert all(e.depth <= 1 for r in callback.results for e in r.module_events())
    # MemoryTracker's accountant and the tracer's nest without disturbing each other: both exact
    step2 = next(r for r in tracker.history if r.step == 2)
    assert step2.peak_tensor_bytes >= callback.results[1].peak_bytes - callback.results[1].at_peak["inputs"]
    assert sorted(os.path.basename(p) for p in callback.paths) == ["memkit_trace_step0.json", "memkit_trace_step2.json", "memkit_trace_step4.json"]


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
    source.write_text(textwrap.dedent('''
        import lightning.pytorch as pl, torch
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset

        class Small(pl.LightningModule):
            def __init__(self, batch_size=4):
                super().__init__()
                self.batch_size = batch_size
                self.net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 8 * 8, 2))
            def forward(self, x):
                return self.net(x)
            def training_step(self, batch, batch_idx):
                (x,) = batch
                return self(x).sum()
            def configure_optimizers(self):
                return torch.optim.Adam(self.parameters())
            def train_dataloader(self):
                return DataLoader(TensorDataset(torch.randn(32, 3, 16, 16)), batch_size=self.batch_size)
    '''))
    out_json = tmp_path / "trace.json"
    completed = subprocess.run(
        [sys.executable, "-m", "lightning_memkit.cli", "trace", f"{source}:Small", "--batch-size", "6", "--json", str(out_json)],
        capture_output=True, text=True, timeout=120, cwd=str(tmp_path),
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    out = completed.stdout
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
