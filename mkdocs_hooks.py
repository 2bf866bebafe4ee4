"""mkdocs hooks for the documentation site (mkdocs.yml).

The docs pages link the runnable examples as ``../examples/NAME.py`` (the right path when reading them in the
repository); the site serves those files at ``examples/NAME.py``, and the pages' links are rewritten to match, so
``mkdocs build --strict`` checks them like any other link (a missing example fails the build).
"""

from __future__ import annotations

import os
import re

_EXAMPLE_LINK = re.compile(r"\]\(\.\./examples/")


def on_files(files, config):
    """Add every ``examples/*.py`` to the site, at ``examples/NAME.py``."""
    from mkdocs.structure.files import File

    examples = os.path.join(os.path.dirname(config["config_file_path"]), "examples")
    for name in sorted(os.listdir(examples)):
        if name.endswith(".py"):
            files.append(File.generated(config, f"examples/{name}", abs_src_path=os.path.join(examples, name)))
    return files


def on_page_markdown(markdown, page, config, files):
    """``](../examples/NAME.py)`` -> ``](examples/NAME.py)`` (every docs page sits at the docs root)."""
    return _EXAMPLE_LINK.sub("](examples/", markdown)
