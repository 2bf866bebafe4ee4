"""The README's example runs as written, and each feature in it leaves what a user would look for."""

from __future__ import annotations

import glob
import json
import os
import re

import pytest

from tests.helpers.event_files import read_scalars
from tests.helpers.paths import REPO_ROOT
from tests.helpers.processes import run_script

README = os.path.join(REPO_ROOT, "README.md")


def readme_example() -> str:
    """The README's first ```python block that uses MaxBatchSize: the example a new user copies."""
    with open(README, encoding="utf-8") as handle:
        blocks = re.findall(r"```python\n(.*?)```", handle.read(), flags=re.S)
    example = next((block for block in blocks if "MaxBatchSize(" in block), None)
    assert example is not None, "the README lost its example with every callback"
    return example


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_readme_example_runs_as_written_and_every_feature_shows(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(readme_example(), encoding="utf-8")
    output = run_script([str(script)], cwd=str(tmp_path), timeout=200)

    # MaxBatchSize: the size it chose, which it ran.
    chosen = re.search(
        r"memkit: batch size (\d+) (?:fits|ran its steps too slowly for a larger one) .*; using (\d+)", output
    )
    assert chosen and 1 <= int(chosen.group(2)) <= 64, output[-3000:]
    # ActivationCheckpointing: its plan, with what it wrapped and the activation memory it measured.
    plan = re.search(
        r"memkit checkpointing \(auto\): (\d+) region\(s\): blocks\.0.*?activation memory ([\d.]+) MiB -> ([\d.]+) MiB",
        output,
    )
    assert plan and int(plan.group(1)) >= 1 and float(plan.group(3)) < float(plan.group(2)), output[-3000:]
    # LayerTrace: its category table at step 1, printed (verbose by default).
    assert re.search(r"memkit LayerTrace: step 1 on \w+: peak [\d.]+ MiB", output), output[-3000:]
    assert re.search(r"\nactivations +[\d.]+", output) and re.search(r"\nrecomputed +[\d.]+", output), output[-3000:]
    # MemoryTracker: the summary table (its run peak from a training step), and per-step memory in TensorBoard.
    assert re.search(r"memkit memory summary\n(.*\n)*?peak at +step \d+ \(train\)", output), output[-3000:]
    log_dirs = glob.glob(str(tmp_path / "lightning_logs" / "version_*"))
    assert len(log_dirs) == 1, log_dirs
    scalars = read_scalars(log_dirs[0])
    assert any(tag.startswith("memory/train/") for tag in scalars), sorted(scalars)
    assert "memory/summary/run_peak_MiB" in scalars
    with open(os.path.join(log_dirs[0], "memkit_memory.json"), encoding="utf-8") as handle:
        records = json.load(handle)
    assert records["history"], "no step was recorded"
    # The layer trace's JSON went beside the logs, nothing into the working directory but the logs.
    assert glob.glob(os.path.join(log_dirs[0], "memkit_trace_step1*.json"))
    assert sorted(os.listdir(tmp_path)) == ["example.py", "lightning_logs"]
