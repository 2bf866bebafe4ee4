"""The fake world a rank's estimate runs in: a fake default process group of the world size (torch's
``FakeProcessGroup``: this process is rank 0, collectives move no data) and the device mesh Lightning's
ModelParallelStrategy builds over it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from lightning_memkit.estimate import _torch_compat

__all__ = ["fake_process_group", "DATA_PARALLEL"]

#: the data-parallel dimension's name in Lightning's device mesh (``self.device_mesh["data_parallel"]``)
DATA_PARALLEL = "data_parallel"


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[Any]:
    """A fake default process group of ``world_size`` ranks for the length of the block, and the device mesh over
    it that Lightning's ModelParallelStrategy gives ``configure_model`` as ``self.device_mesh``: two dimensions,
    ``("data_parallel", "tensor_parallel")`` of sizes ``(world_size, 1)`` (tensor parallelism is not modelled).

    The ``"fake"`` backend is registered by the private ``torch.testing._internal.distributed.fake_pg`` (what
    TorchTitan's memory estimation uses), through estimate/_torch_compat.py; tests/test_torch_compat.py pins it.
    """
    import torch.distributed as dist  # a torch built without it answers below

    if not dist.is_available():
        raise ValueError(
            "this torch has no torch.distributed: the per-rank estimate runs the strategy itself and needs it"
        )
    if dist.is_initialized():
        raise ValueError(
            "a process group is already initialized in this process: estimate a sharded strategy (fsdp, "
            "model_parallel) before init_process_group, or in a separate process (its fake process group is the "
            "default group)"
        )
    from torch.distributed.device_mesh import init_device_mesh  # only where torch.distributed is available

    _torch_compat.register_fake_process_group()

    excepthook = sys.excepthook  # init_process_group prefixes every later traceback with "[rank0]:" and never undoes it
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=world_size)
    try:
        # outside fake mode: the mesh reads its ranks' values
        yield init_device_mesh("cpu", (world_size, 1), mesh_dim_names=(DATA_PARALLEL, "tensor_parallel"))
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook
