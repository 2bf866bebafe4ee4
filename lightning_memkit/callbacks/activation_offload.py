"""ActivationOffload: a LightningModule's saved activations to pinned host memory (CUDA), as a callback.

Wiring only: the offload itself is lightning_memkit.modes.offload (torch's ``save_on_cpu`` around ``training_step``).
"""

from __future__ import annotations

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_memkit._lightning_compat import forget_model_logging
from lightning_memkit.callbacks import _checks as checks
from lightning_memkit.modes.offload import OffloadHandle, apply_offload, check_offload_device

__all__ = ["ActivationOffload"]


class ActivationOffload(Callback):
    """Offload what ``training_step`` saves for backward to pinned host memory (CUDA only).

    Usage::

        trainer = Trainer(accelerator="gpu", callbacks=[ActivationOffload()])
        trainer.fit(model)      # the module's training_step is wrapped during fit, restored after

    The device then holds no saved activation between forward and backward: each is copied from pinned
    memory back to the GPU when the backward op that needs it runs. The copies (both ways) run on the step's
    CUDA stream between its kernels, not overlapping them; in torch before pytorch/pytorch#175421 the forward's
    copy also blocks the host. It costs host memory (one pinned copy of every saved tensor of a step, bytes
    ``numel * element_size``, see ``MemoryEstimate.host_bytes``) and host-link time on every step. It computes
    nothing: losses and gradients match a run without it to float rounding (on a GPU a kernel that sums in a
    run-dependent order, such as an embedding's backward, parts any two runs after the first backward).

    Args:
        verbose: say on global rank 0 that the step offloads.

    Raises:
        MisconfigurationException: at fit start on any device but CUDA (on CPU there is nothing to offload).
    """

    def __init__(self, verbose: bool = True) -> None:
        checks.boolean("ActivationOffload", "verbose", verbose)
        self.verbose = verbose
        self._handle: OffloadHandle | None = None

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit" or self._handle is not None:
            return
        try:
            check_offload_device(trainer.strategy.root_device)
            self._handle = apply_offload(pl_module, trainer.strategy.root_device)
        except ValueError as error:
            raise MisconfigurationException(f"ActivationOffload: {error}") from None
        if self.verbose:
            rank_zero_info("memkit: training_step's saved activations go to pinned host memory (ActivationOffload)")

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        forget_model_logging(self)
