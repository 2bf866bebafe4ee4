"""DeepSpeed ZeRO on one rank (placeholder while the model is written)."""

from __future__ import annotations

from typing import Any

from lightning_memkit.estimate.distributed.rank_step import RankSetup

__all__ = ["DeepSpeedSetup"]


class DeepSpeedSetup(RankSetup):
    def __init__(self, stage: int, shard_size: int, precision: str, half: Any, options: Any) -> None:
        super().__init__()
        raise NotImplementedError("deepspeed")
