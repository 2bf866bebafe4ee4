"""memkit's callbacks under Lightning's sharded strategies, per rank, 2 CPU processes (gloo).

What runs on CPU with torch 2.13 / Lightning 2.6: ``ModelParallelStrategy`` (FSDP2: ``fully_shard`` in
``configure_model``) does, and one run here holds MemoryTracker, LayerTrace, ActivationCheckpointing and
MaxBatchSize together, with one rank's probe failing and one rank alone over the search's budget, then a
second fit in which one rank alone raises a real out-of-memory error inside a trial.
``FSDPStrategy`` (FSDP1) does not: Lightning refuses ``accelerator="cpu"`` and torch's
``FullyShardedDataParallel`` itself needs an accelerator (pinned below), so FSDP1 is checked only through
what runs without it: torch's ``checkpoint_wrapper`` (what its ``activation_checkpointing_policy``
applies) and the wrapper names the layer trace removes.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from torch import nn

from lightning_memkit.trace.trace_records import read_trace
from lightning_memkit.trace.tracer import LayerTracer
from lightning_memkit.units import MiB
from tests.helpers.event_files import read_scalars
from tests.helpers.processes import run_process

EXTRA_PER_SAMPLE = 1024  # float32 elements rank 1 alone holds per sample through its step: 4 KiB a sample

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    from torch import nn
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader, TensorDataset
    from lightning_memkit import ActivationCheckpointing, LayerTrace, MaxBatchSize, MemoryTracker
    from lightning_memkit.probes.base import MemoryProbe

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            return x + self.fc2(torch.relu(self.fc1(x)))

    class Net(pl.LightningModule):
        def __init__(self, d=32, blocks=3, batch_size=4):
            super().__init__()
            self.batch_size = batch_size
            self.blocks = nn.ModuleList(Block(d) for _ in range(blocks))
            self.head = nn.Linear(d, 1)
            self.data = torch.randn(512, d, generator=torch.Generator().manual_seed(0))

        def configure_model(self):  # FSDP2, as ModelParallelStrategy's users write it
            from torch.distributed.fsdp import fully_shard
            for block in self.blocks:
                fully_shard(block, mesh=self.device_mesh)
            fully_shard(self, mesh=self.device_mesh)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(x)

        def training_step(self, batch, batch_idx):
            (x,) = batch
            # rank 1 alone holds 4 KiB more per sample through its step: it alone runs out first
            extra = torch.ones(len(x) * {extra}) if self.global_rank == 1 else torch.zeros(1)
            return self(x).pow(2).mean() + extra[0] * 0

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

        def train_dataloader(self):
            return DataLoader(TensorDataset(self.data), batch_size=self.batch_size, drop_last=True)

    class FlakyProbe(MemoryProbe):
        # a user's probe that breaks on rank 1 at its second read: it must step aside there, alone
        name = "flaky"
        def __init__(self, rank):
            self.rank, self.reads = rank, 0
        def read(self):
            self.reads += 1
            if self.rank == 1 and self.reads == 2:
                raise RuntimeError("flaky probe broke")
            return {{"device_used_bytes": 1000 + self.rank}}

    out, budget = sys.argv[1], int(sys.argv[2])
    rank = int(os.environ.get("LOCAL_RANK", 0))
    tracker = MemoryTracker(per_rank=True, verbose=False, tensor_peak_every_n_steps=1, extra_probes=[FlakyProbe(rank)])
    trace = LayerTrace(at_steps=(1,), verbose=False, figure=False)
    checkpointing = ActivationCheckpointing({{Block}}, verbose=False)
    search = MaxBatchSize(budget=budget, init_val=8, max_val=256, steps_per_trial=2, use_estimate=False, verbose=False)
    trainer = pl.Trainer(
        strategy=ModelParallelStrategy(), accelerator="cpu", devices=2, max_steps=3,
        logger=TensorBoardLogger(out, name="tb", version=0), callbacks=[tracker, trace, checkpointing, search],
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
        num_sanity_val_steps=0, log_every_n_steps=1,
    )
    model = Net()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)

    # activation checkpointing as the callback applies it, on the FSDP2 model: the same gradients as without
    from lightning_memkit.modes.checkpointing import apply_checkpointing
    x = model.data[:8]
    grads = []
    for checkpointed in (False, True):
        handle = apply_checkpointing(model, {{Block}}) if checkpointed else None
        model.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        grads.append([p.grad.to_local().clone() for p in model.parameters()])
        if handle is not None:
            handle.remove()
    same_gradients = all(torch.equal(a, b) for a, b in zip(*grads))
    blocks_sharded = type(model.blocks[0]).__name__

    with open(os.path.join(out, f"rank{{trainer.global_rank}}.json"), "w") as file:
        json.dump({{
            "history": [r.to_dict() for r in tracker.history],
            "warnings": [str(w.message) for w in caught if "memkit" in str(w.message)],
            "plan": sorted(checkpointing.plan.names), "activation": [checkpointing.plan.measured_activation_bytes],
            "batch_size": model.batch_size, "found": search.optimal_batch_size,
            "trials": [[t.batch_size, t.fits, t.peak_bytes, t.error, t.seconds] for t in search.result.trials],
            "same_gradients": same_gradients, "blocks_sharded": blocks_sharded, "steps": trainer.global_step,
        }}, file)

    # a second fit in the same 2 processes: rank 0 alone raises a real out-of-memory error inside a trial's
    # FSDP2 step, between two all-gathers of its forward, while rank 1 goes on to the next all-gather
    class FailsOnRankZero(Net):
        def training_step(self, batch, batch_idx):
            (x,) = batch
            hidden = self.blocks[0](x)
            if self.global_rank == 0 and len(x) >= 16:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (rank 0 only)")
            for block in self.blocks[1:]:
                hidden = block(hidden)
            return self.head(hidden).pow(2).mean()

    search = MaxBatchSize(budget=budget, init_val=16, max_val=64, steps_per_trial=1, use_estimate=False, verbose=False)
    trainer = pl.Trainer(strategy=ModelParallelStrategy(), accelerator="cpu", devices=2, max_steps=1, logger=False,
                         callbacks=[search], enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0)
    print("SECOND FIT", trainer.global_rank, flush=True)
    trainer.fit(FailsOnRankZero())
    print("FINISHED", trainer.global_rank, flush=True)
    """
)


@pytest.mark.slow
def test_model_parallel_fsdp2_two_cpu_ranks_every_callback_per_rank(tmp_path):
    """One FSDP2 run (ModelParallelStrategy, 2 processes) with every memkit callback.

    MemoryTracker logs each rank's tags and the max; rank 1's probe fails and steps aside there while
    both ranks keep reducing in step. LayerTrace writes one file per rank with the user's module names and
    classes (not FSDP2's ``FSDPBlock``). ActivationCheckpointing wraps the three blocks inside FSDP2's
    hooks; gradients equal the unwrapped model's. MaxBatchSize: rank 1 alone crosses the budget at the
    larger sizes, inside steps full of FSDP2 collectives; no rank stops mid-step (no deadlock), every
    trial's outcome and the answer are the same on both ranks, and the failing trials name rank 1.
    A second fit in the same processes: rank 0 alone raises a real out-of-memory error inside a trial; the
    run ends on both ranks with memkit's message.
    """
    script = tmp_path / "fsdp2_run.py"
    script.write_text(SCRIPT.format(extra=EXTRA_PER_SAMPLE))
    budget = 900 * 1024  # bytes: between rank 0's and rank 1's peaks at the larger trial sizes
    returncode, output = run_process([str(script), str(tmp_path), str(budget)], str(tmp_path), timeout=240)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]

    # ---- the second fit: a real out-of-memory error on rank 0 alone inside an FSDP2 trial ends the run on
    # both ranks (rank 1's all-gather fails as rank 0's process goes), with memkit's message; no hang
    assert output.count("SECOND FIT") == 2 and "FINISHED" not in output and returncode != 0, output[-3000:]
    assert "rank 0 ran out of memory at batch size 16 inside a step of ModelParallelStrategy" in output, output[-3000:]
    assert "Give MaxBatchSize(budget=...)" in output
    assert "[rank1]" in output and "Connection closed by peer" in output, output[-3000:]

    # ---- the model really is FSDP2-sharded, and trained its steps after the search
    assert [r["blocks_sharded"] for r in ranks] == ["FSDPBlock", "FSDPBlock"]
    assert [r["steps"] for r in ranks] == [3, 3]

    # ---- MaxBatchSize: the same trials and answer on both ranks; the failures were rank 1's alone
    outcomes = [[t[:3] + t[4:] for t in r["trials"]] for r in ranks]  # times too: the slowest rank's, on every rank
    assert outcomes[0] == outcomes[1] and ranks[0]["found"] == ranks[1]["found"], outcomes
    trials = ranks[0]["trials"]
    failed = [t for t in trials if not t[1]]
    # both ranks name rank 1; rank 1 adds its own measurement
    assert failed and all(t[3] == "out of memory on rank 1" for t in failed), trials
    assert all(
        t[3].startswith("out of memory on rank 1: peak ") and "over the budget of 900.00 KiB" in t[3]
        for t in ranks[1]["trials"]
        if not t[1]
    ), ranks[1]["trials"]
    found = ranks[0]["found"]
    assert any(t[1] and t[0] == found for t in trials) and all(t[0] > found for t in failed)
    assert all(t[2] <= budget for t in trials if t[1])
    assert [r["batch_size"] for r in ranks] == [found, found]

    # ---- ActivationCheckpointing: the three blocks, on both ranks, gradients unchanged under FSDP2
    assert [r["plan"] for r in ranks] == [["blocks.0", "blocks.1", "blocks.2"]] * 2
    assert all(r["activation"][0] is not None and r["activation"][0] > 0 for r in ranks)
    assert [r["same_gradients"] for r in ranks] == [True, True]

    # ---- MemoryTracker: both ranks hold the same reduced history; a probe failing on rank 1 steps aside there only
    assert ranks[0]["history"] == ranks[1]["history"]
    history = ranks[0]["history"]
    assert [r["step"] for r in history] == [0, 1, 2] and {r["rank"] for r in history} == {-1}
    assert [w for w in ranks[0]["warnings"] if "flaky" in w] == []
    assert len([w for w in ranks[1]["warnings"] if "'flaky' memory probe is switched off" in w]) == 1
    scalars = read_scalars(str(tmp_path / "tb" / "version_0"))
    bytes_of = lambda tag: [round(v * MiB) for _, v in scalars[tag]]  # noqa: E731
    assert bytes_of("memory/train/rank0/device_used_MiB") == [1000, 1000, 1000]
    assert [s for s, _ in scalars["memory/train/rank1/device_used_MiB"]] == [0]  # its second read failed
    assert bytes_of("memory/train/device_used_MiB") == [1001, 1000, 1000]  # the max over the ranks that read
    for tag in ("tensor_MiB", "peak_tensor_MiB", "host_rss_MiB"):
        rank0, rank1 = bytes_of(f"memory/train/rank0/{tag}"), bytes_of(f"memory/train/rank1/{tag}")
        assert [s for s, _ in scalars[f"memory/train/rank1/{tag}"]] == [0, 1, 2], tag
        assert bytes_of(f"memory/train/{tag}") == [max(a, b) for a, b in zip(rank0, rank1, strict=True)], tag
    # rank 1's extra tensor (4 KiB per sample of the batch found) is live at its step's peak
    assert all(
        b > a
        for a, b in zip(
            bytes_of("memory/train/rank0/peak_tensor_MiB"), bytes_of("memory/train/rank1/peak_tensor_MiB"), strict=True
        )
    )

    # ---- LayerTrace: one file per rank, the user's names and classes, the same modules in the same order
    log_dir = tmp_path / "tb" / "version_0"
    trace0, trace1 = (
        read_trace(log_dir / "memkit_trace_step1.json"),
        read_trace(log_dir / "memkit_trace_step1_rank1.json"),
    )
    assert (trace0.rank, trace1.rank) == (0, 1) and trace0.errors == trace1.errors == []
    assert trace0.model == trace1.model == "Net"
    assert [(e.module, e.phase) for e in trace0.events] == [(e.module, e.phase) for e in trace1.events]
    classes = {e.module: e.module_class for e in trace0.events if e.module}
    assert classes["blocks.0"] == "Block" and classes["blocks.0.fc1"] == "Linear" and classes["head"] == "Linear"
    assert not any("FSDP" in c for c in classes.values()) and not any("_wrapped_module" in m for m in classes)
    assert any(e.recompute for e in trace0.events if e.module == "blocks.1.fc1")  # checkpointed blocks recompute
    # each rank's shards, by hand: fully_shard splits every parameter's dim 0 over the 2 ranks, padded to
    # ceil(dim0 / 2) rows. A block: fc1 (128, 32) + (128,), fc2 (32, 128) + (32,) -> 64*32 + 64 + 16*128 + 16;
    # the head (1, 32) + (1,): one padded row each, which rank 1 holds as padding only.
    block = 64 * 32 + 64 + 16 * 128 + 16
    head = 32 + 1
    assert trace0.parameter_count == 3 * (128 * 32 + 128 + 32 * 128 + 32) + head  # the model's, not a shard
    for rank, trace in enumerate((trace0, trace1)):
        assert trace.at_end["parameters"] == 4 * (3 * block + head), rank
        # Adam's exp_avg and exp_avg_sq follow the local shard without its padding (rank 1's head shard is
        # empty), plus a 4-byte step per parameter (14 parameters)
        assert trace.at_end["optimizer_state"] == 2 * 4 * (3 * block + (head if rank == 0 else 0)) + 4 * 14, rank


# ---------------------------------------------------------------------------------------------- FSDP1 (no CPU)
def test_lightning_and_torch_refuse_fsdp1_on_cpu():
    """Pins the limit the module docstring states: if a release lifts it, extend this file to FSDPStrategy."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel

    with pytest.raises(ValueError, match="requires a GPU accelerator"):
        pl.Trainer(strategy=FSDPStrategy(), accelerator="cpu", devices=2, logger=False)
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: FSDP1 would not be refused")
    with pytest.raises(RuntimeError, match="FSDP needs a non-CPU accelerator device"):
        FullyShardedDataParallel(nn.Linear(2, 2))  # refused before any process group is needed


class _Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


def test_layer_trace_names_through_torch_checkpoint_wrapper():
    """torch's checkpoint_wrapper (what FSDPStrategy(activation_checkpointing_policy=...) installs) adds a
    ``_checkpoint_wrapped_module`` segment; the trace keeps the user's names and classes, traces each block
    once, and shows the blocks' layers recomputed in backward."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block(), nn.Linear(8, 1))
    plain = [(n, type(m).__name__) for n, m in model.named_modules()]
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, _Block))
    assert "0._checkpoint_wrapped_module.fc1" in dict(model.named_modules())
    x = torch.randn(4, 8)
    results = []
    for modules in ([_Block], None):  # a class filter finds the blocks inside their wrappers
        tracer = LayerTracer(model, modules=modules)
        tracer.start(inputs=x)
        model(x).pow(2).sum().backward()
        results.append(tracer.stop())
    blocks_only, result = results
    assert {e.module for e in blocks_only.events if e.module} == {"0", "1"}
    assert result.errors == []
    forward = [(e.module, e.module_class) for e in result.events if e.phase == "forward" and not e.recompute]
    assert sorted(forward) == sorted((n, c) for n, c in plain)  # every user module once, by its own name and class
    assert {e.module for e in result.events if e.recompute} == {"0.fc1", "0.fc2", "1.fc1", "1.fc2"}


def test_activation_checkpointing_steps_aside_for_a_model_that_checkpoints_itself(tmp_path):
    """A model already holding torch's checkpoint_wrapper (applied in configure_model, as under
    ModelParallelStrategy) is not wrapped twice: one warning, no plan, training as the model set it up."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    from lightning_memkit import ActivationCheckpointing
    from lightning_memkit.modes.checkpoint_wrap import is_checkpointed
    from lightning_memkit.trace._torch_compat import is_checkpoint_wrapper
    from tests.helpers.models import LinearStack
    from tests.helpers.trainers import make_trainer

    class SelfCheckpointed(LinearStack):
        def configure_model(self):
            apply_activation_checkpointing(self, check_fn=lambda m: isinstance(m, nn.Linear))

    model = SelfCheckpointed()
    callback = ActivationCheckpointing({nn.Linear}, verbose=False)
    with pytest.warns(
        UserWarning, match=r"already checkpoints 3 module\(s\) with torch's checkpoint_wrapper \(net.0, net.2, net.4\)"
    ):
        make_trainer(tmp_path, max_steps=2, callbacks=[callback]).fit(model)
    assert callback.plan is None and not any(is_checkpointed(m) for m in model.modules())
    assert sum(is_checkpoint_wrapper(m) for m in model.modules()) == 3  # the model's own, as it set them up


def test_wrapper_names_match_torch():
    """Pins the wrapper attribute names the trace removes against torch's own constants."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_WRAPPED_MODULE
    from torch.distributed.fsdp._common_utils import FSDP_WRAPPED_MODULE

    from lightning_memkit.trace._torch_compat import CHECKPOINT_WRAPPED_MODULE, user_name
    from lightning_memkit.trace._torch_compat import FSDP_WRAPPED_MODULE as OURS

    assert (OURS, CHECKPOINT_WRAPPED_MODULE) == (FSDP_WRAPPED_MODULE, _CHECKPOINT_WRAPPED_MODULE)
    assert user_name("blocks.0._fsdp_wrapped_module._checkpoint_wrapped_module.fc1") == "blocks.0.fc1"
