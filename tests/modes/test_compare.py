"""compare_modes and `memkit compare` in real CPU Trainer runs: exact peaks from the tracker, ratios,
identical loss with checkpointing, files a user (and `memkit report`) reads back."""

from __future__ import annotations

import csv
import glob
import json
import os
import re
import statistics
import textwrap

import pytest

from lightning_memkit import zoo
from lightning_memkit.cli import main
from lightning_memkit.modes.compare_result import COMPARE_FORMAT, ModeResult, read_compare
from lightning_memkit.modes.comparison import CheckpointWarning, compare_modes
from lightning_memkit.modes.mode import Mode
from lightning_memkit.records import read_records
from lightning_memkit.units import format_bytes
from tests.helpers.event_files import read_scalars
from tests.helpers.models import LinearStack

TINY = {"vocab_size": 50, "d_model": 32, "nhead": 2, "layers": 3, "dim_feedforward": 64, "seq_len": 16, "batch_size": 8}


def tiny_transformer():
    return zoo.DemoTransformer(**TINY)


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    return compare_modes(
        tiny_transformer,
        modes="baseline,bf16,checkpoint,bf16+checkpoint",
        max_steps=3,
        accelerator="cpu",
        root_dir=str(root),
        verbose=False,
    )


def test_every_mode_runs_and_peaks_are_the_trackers_exact_bytes(compared):
    assert [r.mode for r in compared.results] == ["baseline", "bf16", "checkpoint", "bf16+checkpoint"]
    assert compared.baseline == "baseline"
    for result in compared.results:
        assert result.status == "ok", result.error
        assert result.steps == 3 and result.batch_size == 8
        _, history = read_records(os.path.join(result.log_dir, "memkit_memory.json"))
        train = [r for r in history if r.stage == "train"]
        assert result.peak_allocated_bytes == max(r.peak_tensor_bytes for r in train)
        assert result.step_peaks == [[r.step, r.peak_tensor_bytes] for r in train]
        assert result.peak_source == "peak_tensor_bytes" and result.peak_reserved_bytes is None
        assert result.median_step_time_s > 0 and len(result.step_times_s) == 3
        assert result.val_metric_name == "val_acc" and 0 <= result.val_metric <= 1


def test_ratios_and_what_each_mode_saves(compared):
    base = compared["baseline"]
    assert base.peak_ratio == 1.0
    for name in ("bf16", "checkpoint", "bf16+checkpoint"):
        r = compared[name]
        assert r.peak_ratio == r.peak_allocated_bytes / base.peak_allocated_bytes
        assert r.step_time_ratio == r.median_step_time_s / base.median_step_time_s
        assert r.peak_allocated_bytes < base.peak_allocated_bytes, name
    assert compared["bf16+checkpoint"].peak_allocated_bytes < compared["checkpoint"].peak_allocated_bytes
    # checkpointing recomputes, it does not change the training: same seed, same loss
    assert compared["checkpoint"].final_train_loss == base.final_train_loss
    assert compared["checkpoint"].checkpoint_regions == 2 and compared["checkpoint"].precision == "32-true"
    assert compared["bf16"].precision == "bf16-mixed"


def test_each_checkpoint_mode_is_judged_against_the_same_precision_without_checkpointing(compared):
    base, bf16 = compared["baseline"], compared["bf16"]
    for name, counterpart in (("checkpoint", base), ("bf16+checkpoint", bf16)):
        r = compared[name]
        assert r.counterpart == counterpart.mode and r.counterpart_peak_bytes == counterpart.peak_allocated_bytes
        assert r.counterpart_peak_ratio == r.peak_allocated_bytes / counterpart.peak_allocated_bytes
        assert r.checkpoint_helped is True and r.checkpoint_warning() is None
        assert r.checkpoint_names == ["blocks.0", "blocks.1"]
    for name in ("baseline", "bf16"):
        assert compared[name].counterpart is None and compared[name].checkpoint_helped is None
    assert " !" not in compared.format_table()


def test_step_times_median_and_spread_over_the_steps_after_warm_up(compared):
    base = compared["baseline"]
    for r in compared.results:
        assert r.time_source == "perf_counter" and len(r.step_times_s) == 3
        assert r.warmup_steps == 1 and r.timed_steps == 2  # warm-up is at most half of the steps run
        timed = r.step_times_s[1:]
        q1, _, q3 = statistics.quantiles(timed, n=4, method="inclusive")
        assert r.median_step_time_s == statistics.median(timed)
        assert (r.step_time_q1_s, r.step_time_q3_s, r.step_time_min_s, r.step_time_max_s) == (
            q1,
            q3,
            min(timed),
            max(timed),
        )
        assert r.throughput_samples_per_s == 8 / r.median_step_time_s
        if r is base:
            assert r.step_time_within_noise is None
        else:  # the rule, independently: the two interquartile ranges overlap
            assert r.step_time_within_noise == (
                r.step_time_q1_s <= base.step_time_q3_s and base.step_time_q1_s <= r.step_time_q3_s
            )
    table = compared.format_table()
    assert "step ms: median of 2 timed steps after 1 warm-up step(s)" in table and "time.perf_counter" in table
    assert "only 2 timed step(s)" in table  # too few to trust: the table says so
    noisy = [r.mode for r in compared.results if r.step_time_within_noise]
    for line in table.splitlines()[2:6]:
        assert (" ~" in line) == (line.split()[0] in noisy), line
    assert ("~ within noise" in table) == bool(noisy)


def test_modes_do_not_see_each_other_and_compare_leaves_nothing_behind(tmp_path):
    from tests.helpers.live_tensors import describe, live_tensor_bytes, tensors_with_grad_fn

    before = live_tensor_bytes()
    # the same mode twice: the second must not count the first's model, gradients and optimizer state
    # (a Trainer <-> module cycle keeps them until the cycle collector runs)
    result = compare_modes(
        tiny_transformer,
        modes=["baseline", Mode(name="again")],
        max_steps=2,
        accelerator="cpu",
        root_dir=str(tmp_path),
        verbose=False,
        write=False,
    )
    first, again = result["baseline"], result["again"]
    assert first.peak_source == again.peak_source == "peak_tensor_bytes"
    assert again.peak_allocated_bytes == first.peak_allocated_bytes and again.peak_ratio == 1.0
    assert tensors_with_grad_fn() == [], describe(tensors_with_grad_fn())
    assert live_tensor_bytes() - before == 0


def test_the_warm_up_is_validated_and_all_steps_are_timed_without_it(tmp_path):
    with pytest.raises(ValueError, match="warmup_steps"):
        compare_modes(tiny_transformer, max_steps=2, warmup_steps=-1)
    result = compare_modes(
        tiny_transformer,
        modes="baseline",
        max_steps=2,
        accelerator="cpu",
        root_dir=str(tmp_path),
        verbose=False,
        write=False,
        warmup_steps=0,
    )
    base = result["baseline"]
    assert (
        base.warmup_steps == 0
        and base.timed_steps == 2
        and base.median_step_time_s == statistics.median(base.step_times_s)
    )


def test_files_csv_json_figures_and_tensorboard(compared):
    files = compared.files
    with open(files["csv"]) as file:
        rows = list(csv.DictReader(file))
    assert [row["mode"] for row in rows] == ["baseline", "bf16", "checkpoint", "bf16+checkpoint"]
    assert tuple(rows[0]) == ModeResult.CSV_COLUMNS
    assert int(rows[2]["peak_allocated_bytes"]) == compared["checkpoint"].peak_allocated_bytes
    with open(files["json"]) as file:
        data = json.load(file)
    assert data["format"] == COMPARE_FORMAT and data["baseline"] == "baseline"
    again = read_compare(os.path.dirname(files["json"]))
    assert [r.to_dict() for r in again.results] == [r.to_dict() for r in compared.results]
    for key in ("peak_figure", "steps_figure"):
        with open(files[key], "rb") as file:
            assert file.read(8) == b"\x89PNG\r\n\x1a\n"
    # one TensorBoard run per mode under one root, so TensorBoard overlays them
    for result in compared.results:
        assert os.path.dirname(result.log_dir) == compared.root_dir
        scalars = read_scalars(result.log_dir)
        assert len(scalars["memory/train/peak_tensor_MiB"]) == 3
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (event_file,) = glob.glob(os.path.join(files["tensorboard"], "events.out.tfevents.*"))
    accumulator = EventAccumulator(event_file, size_guidance={"images": 0, "tensors": 0})
    accumulator.Reload()
    assert set(accumulator.Tags()["images"]) == {"memkit/compare/peak_figure", "memkit/compare/steps_figure"}
    assert "baseline" in compared.format_table() and "1.00x" in compared.format_table()


# Big weights, tiny activations (2 tokens of 2 samples): the peak is the optimizer step (parameters,
# gradients, Adam's state and its temporaries), when every activation is already freed, so no
# checkpointing policy can lower it.
STATE_BOUND = {
    "vocab_size": 50,
    "d_model": 128,
    "nhead": 2,
    "layers": 3,
    "dim_feedforward": 512,
    "seq_len": 2,
    "batch_size": 2,
}


def test_a_checkpoint_mode_that_does_not_lower_the_peak_is_marked_and_warned_about(tmp_path):
    with pytest.warns(CheckpointWarning) as caught:
        result = compare_modes(
            lambda: zoo.DemoTransformer(**STATE_BOUND),
            modes="baseline,checkpoint",
            max_steps=2,
            accelerator="cpu",
            root_dir=str(tmp_path),
            verbose=False,
            figures=False,
        )
    base, checkpoint = result["baseline"], result["checkpoint"]
    assert checkpoint.status == "ok" and checkpoint.checkpoint_names == ["blocks.0", "blocks.1"]
    assert checkpoint.peak_allocated_bytes >= base.peak_allocated_bytes
    assert checkpoint.counterpart == "baseline" and checkpoint.counterpart_peak_bytes == base.peak_allocated_bytes
    assert checkpoint.checkpoint_helped is False
    (warning,) = [w for w in caught if issubclass(w.category, CheckpointWarning)]
    message = str(warning.message)
    assert message.startswith("memkit compare: checkpointing did not lower the peak: checkpoint peaks at")
    assert "than baseline" in message or "the same as baseline" in message
    assert "policy auto wrapped 2 region(s): blocks.0, blocks.1" in message
    table = result.format_table()
    row = next(line for line in table.splitlines() if line.startswith("checkpoint "))
    assert f"{checkpoint.counterpart_peak_ratio:.2f}x !" in row
    assert f"! {checkpoint.checkpoint_warning()}." in table
    with open(result.files["csv"]) as file:
        assert [row["checkpoint_helped"] for row in csv.DictReader(file)] == ["", "False"]
    assert read_compare(str(tmp_path))["checkpoint"].checkpoint_warning() == checkpoint.checkpoint_warning()


def test_the_lowest_bars_ratio_is_in_its_marker_label_not_under_the_dot(compared):
    from lightning_memkit.tensorboard.figures import compare_figures

    (ax,) = compare_figures(compared)["peak_figure"].axes
    ok = compared.results
    lowest = min(range(len(ok)), key=lambda i: ok[i].peak_allocated_bytes)
    texts = [(t.get_text(), t.xy[0]) for t in ax.texts]
    at_lowest = [text for text, x in texts if abs(x - lowest) < 0.5]
    assert at_lowest == [f"lowest: {format_bytes(ok[lowest].peak_allocated_bytes)}\n{ok[lowest].peak_ratio:.2f}x"]
    others = sorted(text for text, x in texts if abs(x - lowest) >= 0.5)
    assert others == sorted(f"{r.peak_ratio:.2f}x" for i, r in enumerate(ok) if i != lowest)


def test_a_mode_that_cannot_run_is_reported_and_the_others_still_run(tmp_path):
    # one Linear layer: no repeated block, no chain to cut, so checkpoint:auto cannot run
    result = compare_modes(
        lambda: LinearStack(dims=(32, 16)),
        modes=["baseline", "checkpoint"],
        max_steps=2,
        accelerator="cpu",
        root_dir=str(tmp_path),
        verbose=False,
        figures=False,
    )
    assert result["baseline"].status == "ok"
    assert result["checkpoint"].status == "failed" and "found no repeated blocks" in result["checkpoint"].error
    assert result["baseline"].peak_ratio == 1.0 and result["checkpoint"].peak_ratio is None
    with pytest.raises(ValueError, match="max_steps"):
        compare_modes(tiny_transformer, max_steps=0)
    with pytest.raises(ValueError, match="unknown mode word"):
        compare_modes(tiny_transformer, modes="baseline,ampp")


def test_cli_compare(tmp_path, capsys):
    spec = f"{zoo.__file__}:DemoTransformer"
    args = [
        "compare",
        spec,
        "--modes",
        "baseline,checkpoint",
        "--steps",
        "2",
        "--accelerator",
        "cpu",
        "--no-figures",
        "--logdir",
        str(tmp_path),
        "--init-args",
        json.dumps(TINY),
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "memkit compare (cpu, 2 steps, ratios vs baseline)" in out and "checkpoint" in out
    written = read_compare(str(tmp_path))
    assert written["checkpoint"].checkpoint_regions == 2
    # one line per mode as it ends, before the table: its peak as compare.json has it, its median step time, its steps
    progress = re.findall(
        r"^memkit compare: mode (\d)/2 (\S+): peak ([^,]+), ([\d.]+) ms/step, (\d+) steps \(([\d.]+)s\)$",
        out,
        flags=re.M,
    )
    assert [(n, mode, peak, steps) for n, mode, peak, _, steps, _ in progress] == [
        (str(i + 1), mode, format_bytes(written[mode].peak_allocated_bytes), "2")
        for i, mode in enumerate(("baseline", "checkpoint"))
    ]
    assert [float(ms) for _, _, _, ms, _, _ in progress] == [
        round(written[m].median_step_time_s * 1000, 1) for m in ("baseline", "checkpoint")
    ]
    assert out.index("memkit compare: mode 2/2") < out.index("memkit compare (cpu, 2 steps")
    assert main(args[:4] + ["--modes", "baseline", "--steps", "1", "--no-progress"] + args[8:]) == 0
    assert "memkit compare: mode" not in capsys.readouterr().out
    assert main(["compare", spec, "--modes", "baseline,ampp", "--logdir", str(tmp_path)]) == 2
    assert "valid words" in capsys.readouterr().err
    assert main(["compare", spec, "--init-args", "[1]", "--logdir", str(tmp_path)]) == 2
    assert "JSON object" in capsys.readouterr().err


def test_cli_compare_runs_true_half_precision_as_lightnings_bf16_true(tmp_path, capsys):
    spec = f"{zoo.__file__}:DemoTransformer"
    modes = ["baseline", "bf16", "bf16-true", "bf16-true+checkpoint"]
    args = ["compare", spec, "--modes", ",".join(modes), "--steps", "2", "--accelerator", "cpu", "--no-figures"]
    assert main([*args, "--no-progress", "--logdir", str(tmp_path), "--init-args", json.dumps(TINY)]) == 0
    out = capsys.readouterr().out
    table = out[out.index("memkit compare (cpu, 2 steps, ratios vs baseline)") :]
    assert all(re.search(rf"^\s*{re.escape(mode)}\s", table, flags=re.M) for mode in modes)
    written = read_compare(str(tmp_path))
    with open(tmp_path / "compare.json") as file:
        precisions = {entry["mode"]: entry["precision"] for entry in json.load(file)["modes"]}
    assert precisions == {
        "baseline": "32-true",
        "bf16": "bf16-mixed",
        "bf16-true": "bf16-true",
        "bf16-true+checkpoint": "bf16-true",
    }
    half, mixed, base = written["bf16-true"], written["bf16"], written["baseline"]
    assert all(written[mode].status == "ok" and written[mode].steps == 2 for mode in modes)
    # the weights, gradients and optimizer state in bf16, no fp32 master weights: below mixed precision's peak
    assert half.peak_allocated_bytes < mixed.peak_allocated_bytes < base.peak_allocated_bytes
    assert half.peak_ratio == half.peak_allocated_bytes / base.peak_allocated_bytes
    checkpointed = written["bf16-true+checkpoint"]  # judged against the same precision without checkpointing
    assert checkpointed.counterpart == "bf16-true" and checkpointed.counterpart_peak_bytes == half.peak_allocated_bytes


DATAMODULES = textwrap.dedent("""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset


    class FixedDM(pl.LightningDataModule):
        # its batch size is called bs: --batch-size has nowhere to go
        def __init__(self, bs: int = 4):
            super().__init__()
            self.bs = bs

        def train_dataloader(self):
            return DataLoader(
                TensorDataset(torch.randint(0, 50, (16, 16)), torch.randint(0, 10, (16,))), batch_size=self.bs
            )


    class NoLoaders:
        pass
""")


def test_cli_compare_names_the_flag_for_a_wrong_datamodule(tmp_path, capsys):
    (tmp_path / "gpt_nobs.py").write_text(DATAMODULES)
    spec = f"{zoo.__file__}:DemoTransformer"
    base = ["compare", spec, "--steps", "2", "--accelerator", "cpu", "--logdir", str(tmp_path / "logs")]
    # a datamodule without batch_size: the fix is its own argument in --datamodule-args, not --init-args
    assert main(base + ["--datamodule", f"{tmp_path / 'gpt_nobs.py'}:FixedDM", "--batch-size", "8"]) == 2
    err = capsys.readouterr().err
    assert "--datamodule-args" in err and "--init-args" not in err and err.count("\n") == 1, err
    # a LightningModule given as --datamodule: one line, not Lightning's traceback
    assert main(base + ["--datamodule", spec]) == 2
    err = capsys.readouterr().err
    assert "DemoTransformer: that is a LightningModule, not a LightningDataModule" in err and err.count("\n") == 1, err
    assert main(base + ["--datamodule", f"{tmp_path / 'gpt_nobs.py'}:NoLoaders"]) == 2
    err = capsys.readouterr().err
    assert (
        "NoLoaders: it has no train_dataloader(); give a LightningDataModule class" in err and err.count("\n") == 1
    ), err
    assert main(base + ["--warmup-steps", "-1"]) == 2
    assert "--warmup-steps -1: give 0 or more" in capsys.readouterr().err
    assert not (tmp_path / "logs" / "compare.json").exists()  # nothing trained


def test_cli_compare_warns_in_one_line_when_checkpointing_does_not_lower_the_peak(tmp_path, capsys):
    spec = f"{zoo.__file__}:DemoTransformer"
    args = [
        "compare",
        spec,
        "--modes",
        "baseline,checkpoint",
        "--steps",
        "2",
        "--accelerator",
        "cpu",
        "--no-figures",
        "--logdir",
        str(tmp_path),
        "--init-args",
        json.dumps(STATE_BOUND),
    ]
    assert main(args) == 0
    captured = capsys.readouterr()
    checkpoint = read_compare(str(tmp_path))["checkpoint"]
    assert checkpoint.checkpoint_helped is False
    lines = [line for line in captured.err.splitlines() if "did not lower the peak" in line]
    assert lines == [f"memkit compare: warning: {checkpoint.checkpoint_warning()}"]
    assert f"! {checkpoint.checkpoint_warning()}." in captured.out
