"""Private torch and Lightning APIs live only in the compat modules (``_torch_compat.py``, ``_lightning_compat.py``),
each pinned by a test: a torch or Lightning release that moves one breaks one wrapper and its test, not code spread
over the package. Read from the source with ``ast``: an import of a private module or name (``torch.utils._pytree``,
``from lightning.pytorch.x import _y``) or an attribute chain through one (``torch._C.X``) anywhere else fails.
``torch.ops.aten._to_copy`` and the like are op names, not private APIs."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.paths import REPO_ROOT

ROOT = Path(REPO_ROOT) / "lightning_memkit"
LIBRARIES = ("torch", "lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities")


def _private(dotted: str) -> bool:
    parts = dotted.split(".")
    if parts[0] not in LIBRARIES or parts[:2] == ["torch", "ops"]:
        return False
    return any(part.startswith("_") and not part.startswith("__") for part in parts[1:])


def _attribute_chain(node: ast.Attribute) -> str | None:
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return ".".join([node.id] + names[::-1]) if isinstance(node, ast.Name) else None


def private_uses(path: Path) -> list[str]:
    """``"line: what"`` for each private torch or Lightning name ``path`` imports or reaches through an attribute."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            found += [f"{node.lineno}: from {node.module} import ..." for name in names[:1] if _private(node.module)]
            found += [f"{node.lineno}: {name}" for name in names if not _private(node.module) and _private(name)]
        elif isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {alias.name}" for alias in node.names if _private(alias.name)]
        elif isinstance(node, ast.Attribute):
            chain = _attribute_chain(node)
            if chain is not None and _private(chain) and not _private(chain.rsplit(".", 1)[0]):
                found.append(f"{node.lineno}: {chain}")
    return found


def test_private_torch_and_lightning_apis_are_used_only_in_the_compat_modules():
    outside = {
        str(path.relative_to(ROOT.parent)): uses
        for path in sorted(ROOT.rglob("*.py"))
        if not path.name.endswith("_compat.py") and (uses := private_uses(path))
    }
    assert not outside, f"wrap these in the package's _torch_compat.py / _lightning_compat.py: {outside}"


def test_the_scan_sees_each_form_of_private_use(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import torch\n"
        "from torch.utils._pytree import tree_map\n"
        "from lightning.pytorch.utilities import _ok\n"
        "import torch._dynamo\n"
        "x = torch._C.DisableTorchFunctionSubclass\n"
        "y = torch.ops.aten._to_copy.default\n"  # an op name: allowed
        "z = torch.nn.functional.relu\n"
    )
    assert private_uses(sample) == [
        "2: from torch.utils._pytree import ...",
        "3: lightning.pytorch.utilities._ok",
        "4: import torch._dynamo",
        "5: torch._C",
    ]
