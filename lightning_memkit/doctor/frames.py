"""The user's line: the innermost Python frame that is the user's code, and how a frame is printed.

Found by walking ``f_back`` past torch, Lightning, memkit and the standard library (:mod:`lightning_memkit._user_code`).
"""

from __future__ import annotations

import linecache
import os

from lightning_memkit._user_code import is_library_code, is_lightning_code
from lightning_memkit.doctor import _torch_compat

__all__ = ["LIGHTNING_OWN", "user_frame", "format_frame"]

#: Trainer methods a user's script calls: an op whose innermost user frame is such a call was made by Lightning itself
_TRAINER_ENTRIES = frozenset({"fit", "validate", "test", "predict"})
#: the ``function`` of a frame :func:`user_frame` gives for a tensor Lightning made itself
LIGHTNING_OWN = "(Lightning's own)"


def user_frame(depth: int = 1) -> tuple[str, int, str] | None:
    """``(filename, line, function)`` of the innermost frame above the caller that is the user's
    code (not torch, Lightning, memkit or the standard library), or ``None``.

    When that frame is only the call of ``trainer.fit`` (``validate``, ...) that ran Lightning, the op was
    made by Lightning itself (a prefetched batch, a logged value): the innermost Lightning frame is given
    instead, its function marked ``"<name> (Lightning's own)"``."""
    frame = _torch_compat.caller_frame(depth + 1)
    lightning = callee = None
    while frame is not None:
        code = frame.f_code
        if not is_library_code(code):
            if (
                lightning is not None
                and callee is not None
                and callee.f_code.co_name in _TRAINER_ENTRIES
                and is_lightning_code(callee.f_code)
            ):
                own = lightning.f_code
                return own.co_filename, lightning.f_lineno, f"{own.co_name} {LIGHTNING_OWN}"
            return code.co_filename, frame.f_lineno, code.co_name
        if lightning is None and is_lightning_code(code):
            lightning = frame
        callee = frame
        frame = frame.f_back
    return None


def format_frame(frame: tuple[str, int, str] | list | None, source: bool = True) -> str:
    """``file.py:12 in fn: <source line>`` for a frame from :func:`user_frame` (``""`` for ``None``)."""
    if not frame:
        return ""
    filename, line, function = frame
    text = f"{os.path.basename(filename)}:{line} in {function}"
    if source:
        code = linecache.getline(filename, line).strip()
        if code:
            text += f": {code}"
    return text
