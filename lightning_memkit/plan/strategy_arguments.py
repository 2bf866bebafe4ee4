"""How a plan on several devices names its strategy to Lightning: the ``Trainer(strategy=...)`` argument
(:func:`strategy_argument`), as Python text (:func:`strategy_text`) and as LightningCLI YAML (:func:`strategy_yaml`).

FSDP wraps the units the estimate sharded (the module's repeated blocks, as ``auto_wrap_policy``); DDP and DeepSpeed
are Lightning's registered names; FSDP2 is ``ModelParallelStrategy``, whose sharding is the module's own
``configure_model``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["strategy_argument", "strategy_text", "strategy_yaml"]

#: the strategies Lightning knows by a registered name
_REGISTERED = ("ddp", "deepspeed_stage_2", "deepspeed_stage_3")


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def strategy_argument(strategy: str, wrap: Iterable[type] | None, world_size: int) -> Any:
    """``Trainer(strategy=...)`` for ``strategy`` on ``world_size`` devices: a registered name, or an
    ``FSDPStrategy(auto_wrap_policy=...)`` / ``ModelParallelStrategy(data_parallel_size=world_size,
    tensor_parallel_size=1)`` object (its ``"auto"`` sizes would make one node's devices a tensor-parallel group)."""
    if strategy in _REGISTERED:
        return strategy
    # deferred: the planner's core has no Lightning strategy import (building one needs torch.distributed)
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    if strategy == "fsdp":
        return FSDPStrategy(auto_wrap_policy=set(wrap)) if wrap else FSDPStrategy()
    if strategy == "model_parallel":
        return ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)
    raise ValueError(f"strategy {strategy!r}: no Trainer argument for it")


def strategy_text(strategy: str, wrap: Iterable[type] | None, world_size: int) -> str:
    """The ``strategy=`` argument as Python text: ``'ddp'``, ``FSDPStrategy(auto_wrap_policy={LlamaDecoderLayer})``."""
    if strategy in _REGISTERED:
        return repr(strategy)
    if strategy == "fsdp":
        units = ", ".join(sorted(cls.__qualname__ for cls in wrap or ()))
        return f"FSDPStrategy(auto_wrap_policy={{{units}}})" if units else "FSDPStrategy()"
    return f"ModelParallelStrategy(data_parallel_size={world_size}, tensor_parallel_size=1)"


def strategy_yaml(strategy: str, wrap: Iterable[type] | None, world_size: int) -> list[str]:
    """The ``strategy:`` lines of a LightningCLI ``trainer:`` section (indented by two spaces)."""
    if strategy in _REGISTERED:
        return [f"  strategy: {strategy}"]
    if strategy == "model_parallel":
        return [
            "  strategy:",
            "    class_path: lightning.pytorch.strategies.ModelParallelStrategy",
            "    init_args:",
            f"      data_parallel_size: {world_size}",
            "      tensor_parallel_size: 1",
        ]
    lines = ["  strategy:", "    class_path: lightning.pytorch.strategies.FSDPStrategy"]
    if wrap:
        lines += ["    init_args:", "      auto_wrap_policy:"]
        lines += [f"        - {_class_path(cls)}" for cls in sorted(wrap, key=_class_path)]
    return lines
