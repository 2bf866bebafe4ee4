"""The settings a rank's estimate takes from the strategy (:class:`StrategyOptions`): given as arguments, or read from
a Lightning strategy object (FSDPStrategy's mixed precision and keyword arguments, DDPStrategy's keyword arguments,
DeepSpeedStrategy's config), the object's winning where the caller left an argument at its default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["StrategyOptions", "options_of"]


@dataclass(frozen=True)
class StrategyOptions:
    """What sizes and shapes a strategy's buffers and sharding, besides the strategy's name and world size.

    Attributes:
        bucket_cap_mb: DDP's bucket size limit in MiB (``None``: torch's default, 25 after a 1 MiB first bucket).
        gradient_as_bucket_view, find_unused_parameters: DDP's arguments of those names.
        wrap: module classes (FSDP's auto-wrap units; FSDP2's stand-in ``fully_shard`` classes), or ``None``.
        fully_shard_kwargs: FSDP2's ``fully_shard`` arguments for the stand-in (other than ``mesh``).
        fsdp_kwargs: FSDP1's ``FullyShardedDataParallel`` arguments (``mixed_precision`` included when given).
        offload_optimizer: DeepSpeed's optimizer offloaded to the CPU.
        deepspeed_config: DeepSpeed's ``zero_optimization`` settings given (bucket sizes...).
    """

    bucket_cap_mb: float | None = None
    gradient_as_bucket_view: bool = False
    find_unused_parameters: bool = False
    wrap: Any = None
    fully_shard_kwargs: dict[str, Any] = field(default_factory=dict)
    fsdp_kwargs: dict[str, Any] = field(default_factory=dict)
    offload_optimizer: bool = False
    deepspeed_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.bucket_cap_mb is not None and self.bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive (DDP's default is 25), not {self.bucket_cap_mb!r}")


def options_of(strategy: Any, **given: Any) -> StrategyOptions:
    """The :class:`StrategyOptions` of ``strategy`` (a name or a Lightning strategy object) with the caller's
    arguments ``given`` (``None`` for a mapping argument means none given)."""
    values = {name: value for name, value in given.items() if value is not None or name == "bucket_cap_mb"}
    for name in ("fully_shard_kwargs", "fsdp_kwargs", "deepspeed_config"):
        values[name] = dict(values.get(name) or {})
    kind = type(strategy).__name__
    if kind == "FSDPStrategy":
        values["fsdp_kwargs"] = {**_fsdp_strategy_kwargs(strategy), **values["fsdp_kwargs"]}
    elif kind == "DeepSpeedStrategy":
        config = dict(getattr(strategy, "config", None) or {})
        zero = dict(config.get("zero_optimization", {}))
        values["deepspeed_config"] = {**zero, **values["deepspeed_config"]}
        if "offload_optimizer" in zero and not values.get("offload_optimizer"):
            values["offload_optimizer"] = _offloads(zero["offload_optimizer"])
    elif kind == "DDPStrategy":
        from lightning_memkit._lightning_compat import ddp_kwargs

        kwargs = ddp_kwargs(strategy)
        for name in ("bucket_cap_mb", "gradient_as_bucket_view", "find_unused_parameters"):
            if name in kwargs and values.get(name) in (None, False):
                values[name] = kwargs[name]
    return StrategyOptions(**values)


def _fsdp_strategy_kwargs(strategy: Any) -> dict[str, Any]:
    """FSDPStrategy's ``FullyShardedDataParallel`` arguments: its keyword arguments (the auto-wrap policy among them)
    and its own ``mixed_precision`` when given."""
    kwargs = dict(getattr(strategy, "kwargs", None) or {})
    kwargs.pop("device_mesh", None)  # the estimate makes its own (fake) mesh
    if getattr(strategy, "mixed_precision", None) is not None:
        kwargs["mixed_precision"] = strategy.mixed_precision
    return kwargs


def _offloads(offload: Any) -> bool:
    """Whether a DeepSpeed ``offload_optimizer`` setting offloads (a dict with ``device`` ``"cpu"``, or ``True``)."""
    if isinstance(offload, dict):
        return str(offload.get("device", "none")).lower() == "cpu"
    return bool(offload)
