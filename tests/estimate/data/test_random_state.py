"""memkit seeds every generator while it sizes samples (so augmentations repeat) and puts every state back. Before
CUDA starts, ``torch.manual_seed`` does not seed the CUDA generators: it queues their seed for CUDA's start, and
memkit's own seeding must not replace the seed the user queued (their run's CUDA stream would change). Read through
lightning_memkit/estimate/_torch_compat.py (``torch.cuda``'s queue of lazy seeds), pinned here; the GPU lane checks
the CUDA stream itself (tests/gpu/test_trials_cuda.py)."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_memkit.estimate._torch_compat import queued_cuda_seeds
from lightning_memkit.estimate.data.batches import preserved_rng
from lightning_memkit.estimate.data.worst_batch import find_worst_batch

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.is_initialized(), reason="CUDA has started: no seed is queued for it"
)


class _Augmented(Dataset):
    """Samples with a random augmentation (their sizing seeds every generator)."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.randn(4) + index


def _queued_seed_values(queued) -> list[int]:
    """The seeds of the queued calls (each a closure over ``seed``, as torch.cuda.random makes them)."""
    return [inspect.getclosurevars(call).nonlocals["seed"] for call, _stack in (entry for entry in queued[2] if entry)]


def test_torch_queues_the_cuda_seed_before_cuda_starts():
    """Pins queued_cuda_seeds: ``torch.manual_seed`` before CUDA starts queues a ``manual_seed_all`` call."""
    torch.manual_seed(1234)
    queued = queued_cuda_seeds()
    assert queued[0] is not None and _queued_seed_values(queued) == [1234]
    torch.manual_seed(99)
    assert _queued_seed_values(queued_cuda_seeds()) == [99]  # the latest replaces it


def test_memkits_seeding_leaves_the_users_queued_cuda_seed():
    torch.manual_seed(1234)
    queued = queued_cuda_seeds()
    cpu_state = torch.get_rng_state()
    find_worst_batch(DataLoader(_Augmented(), batch_size=4))  # seeds every generator with memkit's seed inside
    assert queued_cuda_seeds() == queued and _queued_seed_values(queued_cuda_seeds()) == [1234]
    assert torch.equal(torch.get_rng_state(), cpu_state)
    with preserved_rng():
        torch.cuda.manual_seed(7)  # one device's seed queued too, in the block
    assert queued_cuda_seeds() == queued
