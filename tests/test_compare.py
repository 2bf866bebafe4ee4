"""compare_modes and `memkit compare` in real CPU Trainer runs: exact peaks from the tracker, ratios,
identical loss with checkpointing, files a user (and `memkit report`) reads back."""

from __future__ import annotations

import csv
import glob
import json
import os

import pytest

from lightning_memkit import zoo
from lightning_memkit.cli import main
from lightning_memkit.modes.compare import COMPARE_FORMAT, ModeResult, compare_modes, read_compare
from lightning_memkit.records import read_records

from conftest import LinearStack, read_scalars

TINY = dict(vocab_size=50, d_model=32, nhead=2, layers=3, dim_feedforward=64, seq_len=16, batch_size=8)


def tiny_transformer():
    return zoo.DemoTransformer(**TINY)


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    return compare_modes(tiny_transformer, modes="baseline,bf16,checkpoint,bf16+checkpoint", max_steps=3, accelerator="cpu",
                         root_dir=str(root), verbose=False)


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


def test_a_mode_that_cannot_run_is_reported_and_the_others_still_run(tmp_path):
    # one Linear layer: no repeated block, no chain to cut, so checkpoint:auto cannot run
    result = compare_modes(lambda: LinearStack(dims=(32, 16)), modes=["baseline", "checkpoint"], max_steps=2, accelerator="cpu",
                           root_dir=str(tmp_path), verbose=False, figures=False)
    assert result["baseline"].status == "ok"
    assert result["checkpoint"].status == "failed" and "found no repeated blocks" in result["checkpoint"].error
    assert result["baseline"].peak_ratio == 1.0 and result["checkpoint"].peak_ratio is None
    with pytest.raises(ValueError, match="max_steps"):
        compare_modes(tiny_transformer, max_steps=0)
    with pytest.raises(ValueError, match="unknown mode word"):
        compare_modes(tiny_transformer, modes="baseline,ampp")


def test_cli_compare(tmp_path, capsys):
    spec = f"{zoo.__file__}:DemoTransformer"
    args = ["compare", spec, "--modes", "baseline,checkpoint", "--steps", "2", "--accelerator", "cpu", "--no-figures",
            "--logdir", str(tmp_path), "--init-args", json.dumps(TINY)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "memkit compare (cpu, 2 steps, ratios vs baseline)" in out and "checkpoint" in out
    assert read_compare(str(tmp_path))["checkpoint"].checkpoint_regions == 2
    assert main(["compare", spec, "--modes", "baseline,ampp", "--logdir", str(tmp_path)]) == 2
    assert "valid words" in capsys.readouterr().err
    assert main(["compare", spec, "--init-args", "[1]", "--logdir", str(tmp_path)]) == 2
    assert "JSON object" in capsys.readouterr().err
