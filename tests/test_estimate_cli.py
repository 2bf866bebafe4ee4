"""``memkit estimate``: one table, a row per mode, numbers equal to the library's."""

from __future__ import annotations

import json

from lightning_memkit.cli import main
from lightning_memkit.estimate import estimate_memory, predict_max_batch_size
from lightning_memkit.units import format_bytes


def test_estimate_table_has_a_row_per_mode_matching_the_library(tmp_path, capsys):
    out_json = tmp_path / "estimate.json"
    status = main(["estimate", "lightning_memkit/zoo.py:DemoMLP", "--device-memory", "64MiB", "--device", "cpu",
                   "--modes", "baseline,bf16", "--json", str(out_json)])
    assert status == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:6] == ["mode", "batch", "peak", "(tensors)", "device", "needs"]
    rows = {line.split()[0]: line.split() for line in lines[3:]}
    assert set(rows) == {"baseline", "bf16"}
    from lightning_memkit.zoo import DemoMLP

    estimate = estimate_memory(DemoMLP(), mode="baseline", device="cpu")
    prediction = predict_max_batch_size(DemoMLP(), 64 * 2**20, mode="baseline", device="cpu")
    assert rows["baseline"][1] == "32"
    assert " ".join(rows["baseline"][2:4]) == format_bytes(estimate.peak_bytes)
    assert rows["baseline"][6] == str(prediction.batch_size)
    data = json.loads(out_json.read_text())
    assert data["results"][0]["estimate"]["peak_bytes"] == estimate.peak_bytes
    assert data["results"][0]["max_batch"]["batch_size"] == prediction.batch_size


def test_estimate_bad_input_says_what_to_do(capsys):
    assert main(["estimate", "no_such_file.py:Model", "--device-memory", "1GiB"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["estimate", "lightning_memkit/zoo.py:DemoMLP", "--device-memory", "lots"]) == 2
    assert "16GiB" in capsys.readouterr().err
    assert main(["estimate", "lightning_memkit/zoo.py:DemoMLP", "--device-memory", "1GiB", "--modes", "ampp"]) == 2
    assert "unknown mode word" in capsys.readouterr().err


def test_estimate_takes_a_datamodule_and_equals_the_measured_step(tmp_path, capsys):
    """A LightningModule whose configure_optimizers reads self.trainer.estimated_stepping_batches, fed by a
    LightningDataModule that makes its dataset in setup(): the CLI's figure is the measured step's, to the byte."""
    import sys

    sys.path.insert(0, "tests")
    from lightning_gpt import CharDataModule, TinyGPT

    from lightning_memkit.estimate import measure_training_step

    out_json = tmp_path / "estimate.json"
    status = main(["estimate", "tests/lightning_gpt.py:TinyGPT", "--datamodule", "tests/lightning_gpt.py:CharDataModule",
                   "--datamodule-args", '{"batch_size": 12}', "--device", "cpu", "--device-memory", "64MiB",
                   "--modes", "baseline,bf16", "--json", str(out_json)])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    data = json.loads(out_json.read_text())
    measured = {mode: measure_training_step(TinyGPT(), datamodule=CharDataModule(batch_size=12), mode=mode).peak_bytes
                for mode in ("baseline", "bf16")}
    for result in data["results"]:
        assert result["estimate"]["batch_size"] == 12
        assert result["estimate"]["peak_bytes"] == measured[result["mode"]], result["mode"]
        # the largest batch's predicted need is within the memory the table says it fits
        assert result["max_batch"]["predicted_bytes"] <= 0.95 * 64 * 2**20
    header = captured.out.splitlines()[1]
    assert "per sample" not in header and "needs at max" in header


def test_estimate_without_a_loader_points_at_datamodule_and_a_negative_memory_is_one_line(capsys):
    assert main(["estimate", "tests/lightning_gpt.py:TinyGPT", "--device-memory", "16GiB"]) == 2
    assert "--datamodule FILE.py:DataModuleClass" in capsys.readouterr().err
    assert main(["estimate", "lightning_memkit/zoo.py:DemoMLP", "--device-memory", "-16GiB"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "memkit estimate: --device-memory -16GiB: a memory size is positive; write e.g. --device-memory 16GiB"
    assert main(["estimate", "lightning_memkit/zoo.py:DemoMLP", "--device-memory", "0"]) == 2
    assert "a memory size is positive" in capsys.readouterr().err
