"""GPU results carry their provenance: benchmarks/provenance.py names the commit, whether the tree had changes not
committed, torch, CUDA and the device, and every benchmark script that writes GPU results uses it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from tests.helpers.paths import REPO_ROOT

BENCHMARKS = os.path.join(REPO_ROOT, "benchmarks")
sys.path.insert(0, BENCHMARKS)

import provenance  # noqa: E402


def test_a_result_written_with_the_helper_names_its_provenance(tmp_path):
    path = tmp_path / "result.json"
    provenance.write_json(path, [{"model": "bert", "samples_per_s": 100.0}])
    data = json.loads(path.read_text())
    assert data["results"] == [{"model": "bert", "samples_per_s": 100.0}]
    made = data["provenance"]
    assert tuple(sorted(made)) == tuple(sorted(provenance.KEYS))
    assert made["torch"] == torch.__version__ and made["cuda"] == torch.version.cuda
    assert made["device"] == (torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    assert len(made["source_sha256"]) == 64
    head = (
        subprocess.run(["git", "rev-parse", "HEAD"], cwd=BENCHMARKS, capture_output=True, text=True)
        if shutil.which("git")
        else None
    )
    if head is not None and head.returncode == 0:
        assert made["commit"] == head.stdout.strip() and isinstance(made["dirty"], bool)
    line = provenance.provenance_line()
    assert line.startswith("# provenance: {")
    assert json.loads(line.removeprefix("# provenance: "))["torch"] == torch.__version__


def test_without_git_the_commit_comes_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("GIT_DIR", str(tmp_path / "no_repository"))  # as a device machine's copy of the tree: no .git
    monkeypatch.setenv("MEMKIT_COMMIT", "0123abc")
    monkeypatch.setenv("MEMKIT_DIRTY", "1")
    made = provenance.provenance()
    assert made["commit"] == "0123abc" and made["dirty"] is True
    monkeypatch.delenv("MEMKIT_COMMIT")
    monkeypatch.delenv("MEMKIT_DIRTY")
    made = provenance.provenance()
    assert made["commit"] is None and made["dirty"] is None


def test_every_gpu_result_script_names_its_provenance():
    for script in ("plan_gpu.py", "plan_gpu_table.py", "gpu_truth.py"):
        text = Path(BENCHMARKS, script).read_text()
        assert "from provenance import" in text and "provenance_line()" in text, script
    assert "write_json(args.json, results)" in Path(BENCHMARKS, "plan_gpu.py").read_text()
    for script in ("gpu_lease.sh", "gpu_lease2.sh"):
        assert "python3 benchmarks/provenance.py" in Path(BENCHMARKS, script).read_text(), script
