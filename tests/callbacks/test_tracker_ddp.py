"""MemoryTracker under real DDP: 2 CPU processes (gloo), ranks using different memory."""

from __future__ import annotations

import json
import textwrap

import pytest

from lightning_memkit.units import MiB
from tests.helpers.event_files import read_scalars
from tests.helpers.paths import REPO_ROOT
from tests.helpers.processes import run_script

EXTRA_ELEMENTS = 2**20  # rank r holds (r + 1) * 4 MiB more than the model needs in its forward

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time, warnings, weakref
    warnings.filterwarnings("ignore")
    import torch
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger
    sys.path.insert(0, {root!r})
    from tests.helpers.models import LinearStack
    from lightning_memkit import MemoryTracker

    class RankDependent(LinearStack):
        def training_step(self, batch, batch_idx):
            # a rank-dependent tensor, live through the forward (where these steps peak)
            extra = torch.ones((self.global_rank + 1) * {extra})
            (x,) = batch
            return self.net(x).pow(2).sum() + extra[0] * 0

    def process_groups():
        from torch.distributed import distributed_c10d
        return len(distributed_c10d._world.pg_map)  # private: only this test counts the groups

    class CountGroups(pl.Callback):  # the groups while the tracker is set up (its own gloo group among them)
        def on_train_start(self, trainer, pl_module):
            self.during = process_groups()
            settle_sigterm_broadcasts(trainer.fit_loop.epoch_loop)

    def settle_sigterm_broadcasts(loop):
        # Lightning broadcasts a new 8-byte int64 tensor before every step (its SIGTERM check). gloo's worker
        # thread lets go of it after the broadcast returned, at a moment that depends on scheduling: on a loaded
        # machine it can still be alive at the step's peak on one rank (counted there: it is live memory), which
        # is not what this test holds. Lightning's broadcast runs unchanged; the step waits until it is freed.
        original = loop._broadcast_sigterm_tensor  # Lightning 2.6's name: fails loudly if it changes
        broadcast = torch.distributed.broadcast

        def tracked_broadcast(tensor, *args, **kwargs):
            result = broadcast(tensor, *args, **kwargs)
            sent.append(weakref.ref(tensor.untyped_storage()))
            return result

        def broadcast_then_settle():
            torch.distributed.broadcast = tracked_broadcast
            try:
                original()
            finally:
                torch.distributed.broadcast = broadcast
            deadline = time.monotonic() + 60
            while any(ref() is not None for ref in sent):
                assert time.monotonic() < deadline, "gloo kept Lightning's SIGTERM tensor for 60 s"
                time.sleep(0.001)
            settled.append(len(sent))
            sent.clear()

        sent, settled = [], []
        loop._broadcast_sigterm_tensor = broadcast_then_settle
        loop.settled = settled

    out = sys.argv[1]
    tracker = MemoryTracker(per_rank=True, verbose=False, tensor_peak_every_n_steps=1)
    counter = CountGroups()
    trainer = pl.Trainer(
        strategy="ddp", accelerator="cpu", devices=2, max_steps=3, logger=TensorBoardLogger(out, name="tb", version=0),
        callbacks=[tracker, counter], enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        limit_val_batches=0, num_sanity_val_steps=0, log_every_n_steps=1,
    )
    trainer.fit(RankDependent(batch_size=8))
    with open(os.path.join(out, f"rank{{trainer.global_rank}}.json"), "w") as file:
        json.dump({{"history": [r.to_dict() for r in tracker.history], "world_size": trainer.world_size,
                   "groups_during": counter.during, "groups_after": process_groups(),
                   "sigterm_broadcasts": trainer.fit_loop.epoch_loop.settled}}, file)
    """
)


@pytest.mark.slow
def test_ddp_two_cpu_ranks_log_the_cross_rank_max(tmp_path):
    script = tmp_path / "ddp_run.py"
    script.write_text(SCRIPT.format(root=REPO_ROOT, extra=EXTRA_ELEMENTS))
    run_script([str(script), str(tmp_path)], cwd=str(tmp_path), timeout=180, ranks=2)  # kills both ranks on timeout

    ranks = []
    for rank in (0, 1):
        with open(tmp_path / f"rank{rank}.json") as file:
            ranks.append(json.load(file))
    assert ranks[0]["world_size"] == 2
    # the tracker's own gloo group is destroyed at teardown: a job of many fits does not accumulate groups
    assert [(r["groups_during"] - r["groups_after"]) for r in ranks] == [1, 1]
    # Lightning's SIGTERM broadcast ran once before each step, and its tensor was freed before the step began
    assert [r["sigterm_broadcasts"] for r in ranks] == [[1, 1, 1], [1, 1, 1]]
    # both ranks hold the same reduced history: the max over ranks, rank=-1
    assert ranks[0]["history"] == ranks[1]["history"]
    history = ranks[0]["history"]
    assert [r["step"] for r in history] == [0, 1, 2] and {r["rank"] for r in history} == {-1}

    scalars = read_scalars(str(tmp_path / "tb" / "version_0"))
    bytes_of = lambda tag: [round(v * MiB) for _, v in scalars[tag]]  # noqa: E731
    maximum = bytes_of("memory/train/peak_tensor_MiB")
    rank0 = bytes_of("memory/train/rank0/peak_tensor_MiB")
    rank1 = bytes_of("memory/train/rank1/peak_tensor_MiB")
    for tag in (
        "memory/train/peak_tensor_MiB",
        "memory/train/rank0/peak_tensor_MiB",
        "memory/train/rank1/peak_tensor_MiB",
        "memory/train/rank0/host_rss_MiB",
        "memory/train/rank1/host_peak_rss_MiB",
    ):
        assert [s for s, _ in scalars[tag]] == [0, 1, 2], tag
    # rank 1 holds 4 MiB more at the same peak moment; the logged value is the max. "Exactly" holds up to a
    # scalar or two: the process scope counts every live tensor, and a background thread (gloo's workers,
    # TensorBoard's writer on rank 0) can let go of a few bytes at a moment that depends on scheduling. One
    # loaded CI run saw 4194300 at step 1 (a 4-byte scalar on one rank); 4 MiB missing or doubled still fails.
    differences = [b - a for a, b in zip(rank0, rank1, strict=True)]
    assert all(abs(d - 4 * EXTRA_ELEMENTS) <= 32 for d in differences), differences
    assert maximum == [max(a, b) for a, b in zip(rank0, rank1, strict=True)] == rank1
    assert [r["peak_tensor_bytes"] for r in history] == maximum
    host0 = bytes_of("memory/train/rank0/host_rss_MiB")
    host1 = bytes_of("memory/train/rank1/host_rss_MiB")
    assert bytes_of("memory/train/host_rss_MiB") == [max(a, b) for a, b in zip(host0, host1, strict=True)]
