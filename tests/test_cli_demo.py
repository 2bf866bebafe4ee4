"""``memkit demo`` end to end, as a user runs it: a subprocess, its output and its logs."""

from __future__ import annotations

import subprocess
import sys

import torch

from conftest import read_scalars


def _memkit(*args: str, cwd, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lightning_memkit.cli", *args], cwd=str(cwd), capture_output=True,
                          text=True, timeout=timeout)


def test_demo_trains_prints_the_summary_and_the_tensorboard_line(tmp_path):
    result = _memkit("demo", "--model", "mlp", "--steps", "4", "--logdir", str(tmp_path / "logs"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert f"tensorboard --logdir {tmp_path / 'logs'}" in out
    # the demo trains where a user's Trainer would (accelerator "auto"): the peak is the CUDA allocator's
    # on a GPU machine, the exact tensor accountant's on CPU
    peak_field, peak_tag = ("peak_allocated_bytes", "peak_allocated_MiB") if torch.cuda.is_available() else ("peak_tensor_bytes", "peak_tensor_MiB")
    assert "memkit memory summary" in out and "run peak" in out and f"({peak_field})" in out
    assert "steps measured" in out
    scalars = read_scalars(str(tmp_path / "logs" / "demo-mlp"))
    assert [s for s, _ in scalars[f"memory/train/{peak_tag}"]] == [0, 1, 2, 3]
    assert [s for s, _ in scalars[f"memory/val/{peak_tag}"]] == [1, 3]
    assert (tmp_path / "logs" / "demo-mlp-csv" / "version_0" / "metrics.csv").exists()


def test_demo_rejects_bad_arguments_with_a_clear_message(tmp_path):
    result = _memkit("demo", "--steps", "0", cwd=tmp_path, timeout=60)
    assert result.returncode == 2
    assert "--steps and --batch-size must be positive integers" in result.stderr
    result = _memkit("demo", "--model", "resnet", cwd=tmp_path, timeout=60)
    assert result.returncode == 2 and "invalid choice: 'resnet'" in result.stderr
