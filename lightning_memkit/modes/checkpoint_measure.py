"""Measuring: what a forward saves for backward (in all, and per region) and what each region costs, kept nowhere.

A measuring forward runs with gradients on under a ``saved_tensors_hooks`` pack hook that records each
saved storage's bytes (each storage once) and hands autograd a tiny placeholder instead of the tensor:
nothing is saved, so every activation is freed as soon as the forward moves past it, exactly as under
``no_grad``. No backward is run and the output is dropped; the measuring forward's peak is about a
``no_grad`` forward's, never a full training forward's. A
:class:`~lightning_memkit.accounting.accountant.TensorAccountant` runs alongside: it tells a storage the
forward allocated (an activation) from one that existed before (parameters, buffers, the batch),
gives each allocation a unique key (a freed storage's address may be reused by the next one) and
reads the measuring forward's own peak.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_memkit._torch_compat import tree_flatten
from lightning_memkit.accounting.accountant import TensorAccountant
from lightning_memkit.compiled._torch_compat import force_eager
from lightning_memkit.errors import MemkitError
from lightning_memkit.modes._torch_compat import next_node_sequence_number, node_sequence_number
from lightning_memkit.modes.checkpoint_wrap import frozen_running_stats
from lightning_memkit.modes.offload import offload_suspended

__all__ = [
    "BlockProfile",
    "ForwardMeasure",
    "MeasureError",
    "measure_activation_bytes",
    "measure_forward",
    "profile_blocks",
]


class MeasureError(MemkitError, RuntimeError):
    """The measuring forward failed (the sample's forward raised, or it tried to run a backward)."""


class _Dropped:
    """What autograd holds instead of a saved tensor during a measuring forward: nothing to free, no graph."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<memkit: saved tensor dropped by a measuring forward>"


_DROPPED = _Dropped()


def _unpack(_packed: Any) -> torch.Tensor:
    raise MeasureError(
        "memkit's measuring forward keeps no saved tensors, so it cannot run a backward; give a sample "
        "(or ActivationCheckpointing(sample_fn=...)) that runs the forward only"
    )


@dataclass
class ForwardMeasure:
    """What one measuring forward saved for backward, in bytes (exact; storages counted once).

    Attributes:
        saved: allocation key -> bytes of every storage the forward allocated and autograd saved.
        output_bytes: bytes of the output's storages that were not also saved.
        peak_bytes: the peak of the storages the measuring forward itself allocated (the placeholders
            let each activation go as soon as the forward moves on).
        region_saved: region name -> {key: bytes} saved while the region ran.
        region_inputs: region name -> keys of the storages passed into the region.
        outside: keys of storages saved while no region ran.
        flops: region name -> FLOPs of its forward (when counted).
        seconds: region name -> wall seconds of its forward.
    """

    saved: dict[int, int] = field(default_factory=dict)
    output_bytes: int = 0
    peak_bytes: int = 0
    region_saved: dict[str, dict[int, int]] = field(default_factory=dict)
    region_inputs: dict[str, set[int]] = field(default_factory=dict)
    outside: set[int] = field(default_factory=set)
    flops: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def activation_bytes(self) -> int:
        """Saved-for-backward bytes plus the output's: what the forward would leave alive for backward."""
        return sum(self.saved.values()) + self.output_bytes


def _runner(module: nn.Module, sample: Any) -> Callable[[], Any]:
    if callable(sample) and not isinstance(sample, torch.Tensor):
        return sample
    if isinstance(sample, dict):
        return lambda: module(**sample)
    if isinstance(sample, (tuple, list)):
        return lambda: module(*sample)
    return lambda: module(sample)


@contextlib.contextmanager
def _side_effect_free(module: nn.Module) -> Iterator[None]:
    """A measuring forward must not change training: RNG streams and running statistics are restored."""
    devices = sorted({p.device.index or 0 for p in module.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices), frozen_running_stats(list(module.modules())):
        yield


def _key(accountant: TensorAccountant, tensor: Any) -> tuple[int, int] | None:
    """(unique allocation key, bytes) of a storage the measuring forward allocated, else ``None``."""
    record = accountant.record_of(tensor) if isinstance(tensor, torch.Tensor) else None
    return None if record is None else (record.sequence, record.nbytes)


def _output_bytes(accountant: TensorAccountant, leaves: list[Any], saved: set[int]) -> int:
    total = 0
    for leaf in leaves:
        found = _key(accountant, leaf)
        if found is not None and found[0] not in saved:
            saved.add(found[0])
            total += found[1]
    return total


def _saved_by_other_hooks(leaves: list[Any], since: int | None, limit: int = 10_000) -> bool:
    """Whether the graph behind ``leaves`` holds a saved tensor that memkit's pack hook did not pack: reading a node's
    saved tensor (``grad_fn._saved_<name>``, autograd's documented accessor) unpacks it, which raises for one of ours
    and returns the tensor for one that other hooks packed. Asked only of a forward whose pack hook never ran (any
    call of it means memkit's hooks were the innermost for at least that save); a 0-dim tensor does not count (a
    Python number an op saved as a tensor, which no hook sees). Only the nodes the forward made are read (order
    number ``since`` or later: not the graph an input carried in, saved before any hook of the forward); where torch
    does not number its nodes, nothing is read. Stops at the first such tensor (one unpack, freed at once), after
    ``limit`` nodes at most."""
    if since is None:
        return False
    stack = [leaf.grad_fn for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None]
    seen: set[int] = set()
    while stack and len(seen) < limit:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        number = node_sequence_number(node)
        if number is None or number < since:  # an input's graph (or a node torch does not number): not this forward's
            continue
        for name in dir(node):
            if not name.startswith("_saved_"):
                continue
            try:
                value = getattr(node, name)
            except Exception:  # noqa: BLE001 - ours (MeasureError: dropped), or a value autograd cannot give back here
                continue
            values = value if isinstance(value, (tuple, list)) else (value,)
            if any(isinstance(v, torch.Tensor) and v.dim() > 0 for v in values):
                return True
        stack.extend(next_node for next_node, _ in getattr(node, "next_functions", ()))
    return False


class _Measuring:
    """One measuring forward's state: what its pack hook saw, which regions were running, their FLOPs and time."""

    def __init__(self, regions: dict[str, list[nn.Module]], count_flops: bool) -> None:
        self.regions = regions
        self.result = ForwardMeasure(
            region_saved={n: {} for n in regions},
            region_inputs={n: set() for n in regions},
            flops=dict.fromkeys(regions, 0),
            seconds=dict.fromkeys(regions, 0.0),
        )
        self.accountant = TensorAccountant()
        self.active: list[str] = []
        self.starts: dict[str, tuple[int, float]] = {}
        self.counter = None
        if count_flops:
            from torch.utils.flop_counter import FlopCounterMode  # deferred: a heavy import only a plan needs

            self.counter = FlopCounterMode(display=False)
        self.packed = 0  # the pack hook's calls, whatever it packed (the forward's own storages or not)
        self.handles: list[Any] = []

    def pack(self, tensor: torch.Tensor) -> _Dropped:
        self.packed += 1
        found = _key(self.accountant, tensor)
        if found is not None:
            key, nbytes = found
            self.result.saved[key] = nbytes
            if self.active:
                for name in self.active:
                    self.result.region_saved[name][key] = nbytes
            else:
                self.result.outside.add(key)
        return _DROPPED

    def _total_flops(self) -> int:
        return self.counter.get_total_flops() if self.counter is not None else 0

    def _pre(self, name: str, args: Any, kwargs: Any) -> None:
        for leaf in tree_flatten((args, kwargs))[0]:
            found = _key(self.accountant, leaf)
            if found is not None:
                self.result.region_inputs[name].add(found[0])
        self.active.append(name)
        self.starts[name] = (self._total_flops(), time.perf_counter())

    def _post(self, name: str) -> None:
        if name in self.active:
            self.active.remove(name)
            flops0, t0 = self.starts.pop(name)
            self.result.flops[name] += self._total_flops() - flops0
            self.result.seconds[name] += time.perf_counter() - t0

    def add_region_hooks(self) -> None:
        for name, chain in self.regions.items():
            self.handles.append(
                chain[0].register_forward_pre_hook(
                    lambda _m, args, kwargs=None, name=name: self._pre(name, args, kwargs), with_kwargs=True
                )
            )
            self.handles.append(chain[-1].register_forward_hook(lambda _m, _args, *_rest, name=name: self._post(name)))

    def remove_hooks(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def measure_forward(
    module: nn.Module, sample: Any, regions: dict[str, list[nn.Module]] | None = None, count_flops: bool = False
) -> ForwardMeasure:
    """Run one measuring forward of ``sample`` and return what it saved (see the module docstring).

    ``regions`` maps a name to the chained modules it runs (one module, or consecutive children of a
    Sequential); each saved storage is attributed to the regions running when it is saved. Nothing the
    forward made outlives this call: no graph, no saved tensor, no output.

    Raises:
        MeasureError: when the forward raises (the cause attached).
    """
    measuring = _Measuring(regions or {}, count_flops)
    measuring.add_region_hooks()
    run = _runner(module, sample)
    try:
        with contextlib.ExitStack() as stack:
            # the accountant (a dispatch mode) would make dynamo skip a compiled frame it first meets here for the
            # rest of the process: the measuring forward runs eagerly and leaves dynamo's caches alone
            stack.enter_context(force_eager())
            stack.enter_context(_side_effect_free(module))
            stack.enter_context(torch.enable_grad())
            # what the modules save, not where offload would put it: under offload's hooks this one would see none
            stack.enter_context(offload_suspended())
            first_node = next_node_sequence_number()  # the nodes this forward makes are numbered from here
            output = _run_measured(measuring, run)
            measuring.remove_hooks()  # the regions' hooks and the FLOP counter are off before any unpack below
            leaves = tree_flatten(output)[0]
            measuring.result.output_bytes = _output_bytes(measuring.accountant, leaves, set(measuring.result.saved))
            # a forward whose own saved_tensors_hooks took every save: the pack hook never ran. Partial hiding (their
            # hooks around some blocks only) is not detected: the walk cannot tell their saves from the inputs'
            # graph or a saved Python number without more of autograd's internals
            hidden = measuring.packed == 0 and _saved_by_other_hooks(leaves, first_node)
            del output, leaves  # before raising: the error's frames must not keep the graph alive
            if hidden:
                raise MeasureError(_hidden_saves_message(module))
    except MeasureError:
        raise
    except Exception as error:  # noqa: BLE001 - the user's forward may raise anything
        raise MeasureError(
            f"the measuring forward of {type(module).__name__} failed: {type(error).__name__}: {error}"
        ) from error
    finally:
        measuring.remove_hooks()
    measuring.result.peak_bytes = measuring.accountant.peak_bytes
    return measuring.result


def _run_measured(measuring: _Measuring, run: Any) -> Any:
    """``run()`` under the FLOP counter (if any), the pack hook and the accountant; returns its output."""
    with contextlib.ExitStack() as stack:
        if measuring.counter is not None:
            stack.enter_context(measuring.counter)
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(measuring.pack, _unpack))
        with measuring.accountant:
            return run()


def _hidden_saves_message(module: nn.Module) -> str:
    return (
        f"the forward of {type(module).__name__} saved tensors for backward through its own "
        "saved_tensors_hooks (torch.autograd.graph.save_on_cpu, or another pair of hooks entered in the "
        "model or the step), which take them before memkit's measuring hooks can see them; a budget needs "
        "what the forward saves: measure without those hooks (a sample or sample_fn that runs the forward "
        'without them), or give a policy that needs no measuring ("auto", a set of module classes)'
    )


def measure_activation_bytes(module: nn.Module, sample: Any) -> int:
    """Exact bytes a forward pass leaves alive for backward: the distinct storages autograd saves plus the
    output's, in bytes, measured without keeping them.

    Parameters, buffers, the inputs and anything else that existed before the forward are not counted.
    ``sample`` is the forward's input (a tensor, a tuple of positional arguments or a dict of keyword
    arguments) or a zero-argument callable that runs the forward and returns its output (e.g.
    ``lambda: model.training_step(batch, 0)``). RNG state and running statistics are left as they were;
    the forward's peak is about a ``no_grad`` forward's (see :func:`measure_forward`).

    Raises:
        MeasureError: when the forward raises.
    """
    return measure_forward(module, sample).activation_bytes


@dataclass
class BlockProfile:
    """A region's measured cost on one sample forward (see :class:`CheckpointSegment` for the fields)."""

    saved_bytes: int
    predicted_saving_bytes: int
    recompute_flops: int
    forward_seconds: float


def block_profiles(measure: ForwardMeasure) -> dict[str, BlockProfile]:
    """Each region's :class:`BlockProfile` from a measuring forward run with those regions.

    A storage is *freed by checkpointing* a region when it is not one of the region's inputs
    (checkpoint keeps those) and not also saved by code outside every region.
    """
    result = {}
    for name, saved in measure.region_saved.items():
        total = sum(saved.values())
        freed = sum(
            n for key, n in saved.items() if key not in measure.region_inputs[name] and key not in measure.outside
        )
        result[name] = BlockProfile(total, freed, int(measure.flops[name]), measure.seconds[name])
    return result


def profile_blocks(module: nn.Module, sample: Any, regions: dict[str, list[nn.Module]]) -> dict[str, BlockProfile]:
    """Measure, on one forward of ``sample``, what each region saves for backward (bytes) and what it
    costs (FLOPs from ``torch.utils.flop_counter.FlopCounterMode``, wall seconds), keeping nothing.

    ``regions`` maps a name to the chained modules it runs (one module, or consecutive children of a
    Sequential). See :func:`block_profiles` for what a region's checkpointing is predicted to free.
    """
    return block_profiles(measure_forward(module, sample, regions, count_flops=True))
