"""The supported torch range: declared once (lightning_memkit/_torch_range.py), the same in pyproject.toml,
the README and docs/versions.md, and enforced on import with one clear line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_memkit._torch_range import MINIMUM_TORCH, SUPPORTED_RANGE, check_torch_version
from tests.helpers.paths import REPO_ROOT

ROOT = Path(REPO_ROOT)
BELOW = f"{MINIMUM_TORCH[0]}.{MINIMUM_TORCH[1] - 1}.0+cu128" if MINIMUM_TORCH[1] else f"{MINIMUM_TORCH[0] - 1}.9.0"
LOWEST = f"{MINIMUM_TORCH[0]}.{MINIMUM_TORCH[1]}.0"


def _import_with_torch_version(version: str) -> subprocess.CompletedProcess:
    """``import lightning_memkit`` in a fresh interpreter whose ``torch.__version__`` reads ``version``."""
    code = f"import torch; torch.__version__ = {version!r}; import lightning_memkit"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=280, cwd=ROOT, env=env)


def test_import_below_the_range_fails_with_one_line_naming_the_range():
    result = _import_with_torch_version(BELOW)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last == (
        f"ImportError: lightning-memkit supports {SUPPORTED_RANGE}; this is torch {BELOW}: "
        f"pip install '{SUPPORTED_RANGE}' (the build for your CUDA)"
    )


def test_import_at_the_lowest_supported_release_succeeds():
    result = _import_with_torch_version(LOWEST)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("version", "supported"),
    [
        (LOWEST, True),
        (f"{LOWEST}a0+git1234", True),
        (f"{MINIMUM_TORCH[0]}.{MINIMUM_TORCH[1] + 3}.1+cu130", True),
        (f"{MINIMUM_TORCH[0] + 1}.0.0", True),
        (BELOW, False),
        ("2.4.1", False),
        ("1.13.1+cpu", False),
        ("a source build", True),
    ],
)
def test_check_torch_version_compares_major_and_minor(version, supported):
    if supported:
        check_torch_version(version)
    else:
        with pytest.raises(ImportError, match=re.escape(SUPPORTED_RANGE)):
            check_torch_version(version)


def test_the_range_is_the_same_in_pyproject_readme_and_the_versions_page():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.findall(r'"(torch[<>=!~][^"]*)"', pyproject) == [SUPPORTED_RANGE]
    assert SUPPORTED_RANGE in (ROOT / "README.md").read_text()
    versions = (ROOT / "docs" / "versions.md").read_text()
    assert SUPPORTED_RANGE in versions
