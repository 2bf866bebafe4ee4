"""Where a benchmark result came from: the commit (and whether the tree had changes not committed), the versions of
torch and CUDA, and the device. Every GPU benchmark result names it (issue 36): the H200 logs of 2026-11-27 did not,
and eight later commits changed the planner they measured.

    from provenance import provenance, provenance_line, write_json
    print(provenance_line())                     # first line of a text result: '# provenance: {...}'
    write_json("out.json", results)              # {"provenance": {...}, "results": results}

    python benchmarks/provenance.py              # the JSON object on one line (the lease scripts put it in gpu.txt)

Without git (a copy of the tree on a device machine) the commit is read from ``MEMKIT_COMMIT`` and the tree's state
from ``MEMKIT_DIRTY`` (``1``/``0``) when the caller set them (``MEMKIT_COMMIT=$(git rev-parse HEAD)``), else
``None``; ``source_sha256`` (the package's Python sources, hashed) names the code either way.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: the keys every result's provenance has
KEYS = ("commit", "dirty", "source_sha256", "torch", "cuda", "device", "written")


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def source_sha256(root: Path = ROOT) -> str:
    """The SHA-256 of the package's Python sources (``lightning_memkit/**/*.py``: each path and its bytes, sorted)."""
    digest = hashlib.sha256()
    for path in sorted((root / "lightning_memkit").rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def provenance(device: Any = None) -> dict[str, Any]:
    """``{"commit", "dirty", "source_sha256", "torch", "cuda", "device", "written"}``: ``git rev-parse HEAD``, whether
    ``git status --porcelain`` lists anything (changed, staged or untracked files), the hash of the sources, torch's
    version, the CUDA it was built with (``None`` for a CPU build), the device's name (``device``: an index or a
    ``torch.device``, default the current CUDA device; ``"cpu"`` without a GPU) and the time (UTC, ISO 8601)."""
    import torch

    head = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain")
    commit = head.strip() if head else os.environ.get("MEMKIT_COMMIT") or None
    if status is not None:
        dirty: bool | None = bool(status.strip())
    else:
        dirty = {"1": True, "0": False}.get(os.environ.get("MEMKIT_DIRTY", ""))
    name = "cpu"
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
    return {
        "commit": commit,
        "dirty": dirty,
        "source_sha256": source_sha256(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": name,
        "written": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def provenance_line(device: Any = None) -> str:
    """One line for a text result: ``# provenance: {...}`` (the JSON object of :func:`provenance`)."""
    return "# provenance: " + json.dumps(provenance(device), sort_keys=True)


def with_provenance(results: Any, device: Any = None) -> dict[str, Any]:
    """``{"provenance": provenance(device), "results": results}``: what a JSON result file holds."""
    return {"provenance": provenance(device), "results": results}


def write_json(path: str | os.PathLike, results: Any, device: Any = None) -> None:
    """Write ``results`` to ``path`` as JSON, under the ``provenance`` of this run."""
    with open(path, "w") as handle:
        json.dump(with_provenance(results, device), handle, indent=1, default=str)


if __name__ == "__main__":
    print(json.dumps(provenance(), sort_keys=True))
