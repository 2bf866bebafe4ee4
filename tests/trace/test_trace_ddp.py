"""LayerTrace under real DDP: 2 CPU processes (gloo), each rank traces its own step, no collectives."""

from __future__ import annotations

import textwrap

import pytest

from lightning_memkit.trace.trace_records import read_trace
from tests.helpers.paths import REPO_ROOT
from tests.helpers.processes import run_script

EXTRA_ELEMENTS = 2**20  # rank r allocates (r + 1) * 4 MiB more inside its training step

SCRIPT = textwrap.dedent(
    """
    import sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger
    sys.path.insert(0, {root!r})
    from tests.helpers.models import LinearStack
    from lightning_memkit import LayerTrace

    class RankDependent(LinearStack):
        def training_step(self, batch, batch_idx):
            extra = torch.ones((self.global_rank + 1) * {extra})  # live through forward and backward
            (x,) = batch
            loss = self.net(x).pow(2).sum() + extra[0] * 0
            self.extra = extra
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.extra = None

    trainer = pl.Trainer(
        strategy="ddp", accelerator="cpu", devices=2, max_steps=2,
        logger=TensorBoardLogger(sys.argv[1], name="tb", version=0),
        callbacks=[LayerTrace(at_steps=(1, 50))], enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0,
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(RankDependent(batch_size=8, optimizer="adam"))
    unreached = [str(w.message) for w in record if "memkit LayerTrace" in str(w.message)]
    print(f"RANK {{trainer.global_rank}} UNREACHED {{len(unreached)}}: {{unreached}}", flush=True)
    """
)


@pytest.mark.slow
def test_ddp_each_rank_traces_its_own_step(tmp_path):
    script = tmp_path / "ddp_trace.py"
    script.write_text(SCRIPT.format(root=REPO_ROOT, extra=EXTRA_ELEMENTS))
    output = run_script([str(script), str(tmp_path)], cwd=str(tmp_path), ranks=2)
    # the printed summary and the unreached-step warning come from global rank zero only
    assert output.count("memkit LayerTrace: step 1 on cpu") == 1, output[-3000:]
    assert "RANK 1 UNREACHED 0: []" in output and "RANK 0 UNREACHED 1:" in output, output[-3000:]
    assert "step 50 of at_steps never reached: the run's last training step was 1" in output

    log_dir = tmp_path / "tb" / "version_0"
    rank0 = read_trace(log_dir / "memkit_trace_step1.json")
    rank1 = read_trace(log_dir / "memkit_trace_step1_rank1.json")
    assert (rank0.rank, rank1.rank) == (0, 1) and rank0.step == rank1.step == 1
    assert rank0.errors == [] and rank1.errors == []
    # the same modules in the same order on both ranks (DDP's wrapper is not traced, the module is)
    assert [(e.module, e.phase) for e in rank0.events] == [(e.module, e.phase) for e in rank1.events]
    # each rank measured its own memory: rank 1's extra tensor is exactly 4 MiB bigger
    assert rank1.peak_bytes - rank0.peak_bytes == 4 * EXTRA_ELEMENTS
    assert rank1.at_peak["temporaries"] - rank0.at_peak["temporaries"] == 4 * EXTRA_ELEMENTS
    psi = rank0.parameter_count
    for result in (rank0, rank1):
        assert result.at_end["parameters"] == 4 * psi and result.at_end["gradients"] == 4 * psi
        assert result.at_end["optimizer_state"] == 8 * psi + 4 * 6
