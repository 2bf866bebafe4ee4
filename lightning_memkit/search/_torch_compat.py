"""The private torch internals the batch-size search touches, wrapped in one place.

Pinned by tests/gpu/test_search_cuda_paths.py: if a torch release moves one, that test says which.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

__all__ = ["reset_scaler_optimizer_stages"]


def reset_scaler_optimizer_stages(scaler: Any) -> bool:
    """Forget every optimizer's stage in a ``torch.amp.GradScaler`` (``unscale_`` called, stepped),
    as the scaler's own ``update()`` does at its end; ``False`` when ``scaler`` keeps no such state.

    A trial that runs out of memory between ``scaler.unscale_(optimizer)`` and ``scaler.update()``
    (inside the optimizer step: Adam creating its state, foreach temporaries, clipping) leaves that
    optimizer "unscaled", and the next ``unscale_`` raises ``unscale_() has already been called on
    this optimizer since the last update()``; ``GradScaler.load_state_dict`` does not reset it.
    Reads torch's private ``GradScaler._per_optimizer_states`` (a ``defaultdict`` whose factory is
    ``torch.amp.grad_scaler._refresh_per_optimizer_state``).
    """
    states = getattr(scaler, "_per_optimizer_states", None)
    if states is None:
        return False
    # deferred: private torch API; a torch that moved it fails this call (pinned by the test), not the import
    from torch.amp.grad_scaler import _refresh_per_optimizer_state

    scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
    return True
