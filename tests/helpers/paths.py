"""Where the repository's files are, whatever group a test file sits in."""

from __future__ import annotations

import os

#: the repository's root directory (pyproject.toml, docs/, examples/, benchmarks/, lightning_memkit/)
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: recorded data the tests read (tests/data: the H100 truth and logs)
DATA_DIR = os.path.join(REPO_ROOT, "tests", "data")
