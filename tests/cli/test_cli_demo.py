"""``memkit demo`` end to end, as a user runs it: a subprocess, its output and its logs."""

from __future__ import annotations

import re

import pytest
import torch

from lightning_memkit.units import format_bytes
from tests.helpers.event_files import read_scalars
from tests.helpers.processes import run_process


def _memkit(*args: str, cwd) -> tuple[int, str]:
    """``python -m lightning_memkit.cli ARGS`` in a process of its own: its exit status and output. The hang guard is
    under the suite's 300 s per-test limit, so a hang shows the output."""
    return run_process(["-m", "lightning_memkit.cli", *args], str(cwd), timeout=280)


def test_demo_trains_prints_the_summary_and_the_tensorboard_line(tmp_path):
    status, out = _memkit("demo", "--model", "mlp", "--steps", "4", "--logdir", str(tmp_path / "logs"), cwd=tmp_path)
    assert status == 0, out[-3000:]
    assert f"tensorboard --logdir {tmp_path / 'logs'}" in out
    # the demo trains where a user's Trainer would (accelerator "auto"): the peak is the CUDA allocator's
    # on a GPU machine, the exact tensor accountant's on CPU
    peak_field, peak_tag = (
        ("peak_allocated_bytes", "peak_allocated_MiB")
        if torch.cuda.is_available()
        else ("peak_tensor_bytes", "peak_tensor_MiB")
    )
    assert "memkit memory summary" in out and "run peak" in out and f"({peak_field})" in out
    assert "steps measured" in out
    # what the run peak counts (the whole process), next to the layer trace's step: the numbers of the summary above
    peak = re.search(r"^run peak +(\S+ \w+) \(", out, flags=re.M).group(1)
    step = re.search(r"^peak at +step (\d+)", out, flags=re.M).group(1)
    assert f"What the peaks count: the run peak ({peak} at step {step}) is the whole process, " in out
    # DemoMLP's 512 training samples of 64 float32 and an int64 label each
    assert f"The training dataset's tensors alone are {format_bytes(512 * 64 * 4 + 512 * 8)}." in out
    assert re.search(
        r"^The layer trace's peak \([\d.]+ \w+ at step 1\) counts the traced step's tensors", out, flags=re.M
    )
    scalars = read_scalars(str(tmp_path / "logs" / "demo-mlp"))
    assert [s for s, _ in scalars[f"memory/train/{peak_tag}"]] == [0, 1, 2, 3]
    assert [s for s, _ in scalars[f"memory/val/{peak_tag}"]] == [1, 3]
    assert (tmp_path / "logs" / "demo-mlp-csv" / "version_0" / "metrics.csv").exists()


def test_demo_rejects_bad_arguments_with_a_clear_message(tmp_path, monkeypatch, capsys):
    """The command's own entry point, in this process (the test above runs the console's): status 2 and what to
    change, before anything trains."""
    from lightning_memkit.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--steps", "0"]) == 2
    assert "--steps and --batch-size must be positive integers" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_status:  # argparse's own refusal of a choice it does not know
        main(["demo", "--model", "resnet"])
    assert exit_status.value.code == 2 and "invalid choice: 'resnet'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing trained, nothing written
