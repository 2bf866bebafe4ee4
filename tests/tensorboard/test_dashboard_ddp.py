"""The dashboard under real DDP (2 CPU processes, gloo): one layout, with per-rank charts that match the per-rank
tags."""

from __future__ import annotations

import re
import textwrap

import pytest

from lightning_memkit.tensorboard.readable import FRAME_TITLE
from lightning_memkit.tensorboard.tags import is_frame_tag
from tests.helpers.event_files import read_layouts, read_scalars
from tests.helpers.paths import REPO_ROOT
from tests.helpers.processes import run_script

SCRIPT = textwrap.dedent(
    """
    import sys, warnings
    warnings.filterwarnings("ignore")
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger
    sys.path.insert(0, {root!r})
    from tests.helpers.models import LinearStack
    from lightning_memkit import MemoryTracker
    from lightning_memkit.tensorboard.dashboard import register_dashboard

    class Probe(pl.Callback):
        def on_fit_start(self, trainer, pl_module):  # after MemoryTracker's: every rank asks again
            print(f"rank {{trainer.global_rank}} registered again: {{register_dashboard(trainer)}}", flush=True)

    trainer = pl.Trainer(
        strategy="ddp", accelerator="cpu", devices=2, max_steps=3,
        logger=TensorBoardLogger(sys.argv[1], name="tb", version=0),
        callbacks=[MemoryTracker(per_rank=True, verbose=False), Probe()], enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0,
        log_every_n_steps=1,
    )
    trainer.fit(LinearStack(batch_size=8))
    """
)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_ddp_one_layout_with_per_rank_charts(tmp_path):
    script = tmp_path / "ddp_dashboard.py"
    script.write_text(SCRIPT.format(root=REPO_ROOT))
    output = run_script([str(script), str(tmp_path)], cwd=str(tmp_path), timeout=180, ranks=2)
    assert "rank 0 registered again: False" in output and "rank 1 registered again: False" in output

    log_dir = str(tmp_path / "tb" / "version_0")
    layouts = read_layouts(log_dir)
    assert len(layouts) in (1, 2)  # registered once at fit start; fit end may drop single-step charts
    layout = layouts[-1]  # what TensorBoard shows
    assert list(layout) == ["memkit: memory per step", "memkit: per rank (DDP)"]
    scalars = read_scalars(log_dir)
    tags = set(scalars)
    per_rank = layout["memkit: per rank (DDP)"]

    # a chart whose values TensorBoard's three-digit axis could not label draws them above a base its title names
    # (tests/tensorboard/test_dashboard_rules.py checks those lines): here, as logged
    def logged(t: str) -> str:
        return re.sub(r"_(B|KiB|MiB|GiB)(_above_[0-9.]+_(B|KiB|MiB|GiB))?$", "_MiB", t.replace("/dashboard/", "/"))

    matched = {
        re.sub(r"\((B|KiB|MiB|GiB)( above [0-9,.]+ (B|KiB|MiB|GiB))?", "(MiB", title.removesuffix(FRAME_TITLE)): {
            logged(t) for t in tags for r in regexes if re.match(r, t) and not is_frame_tag(t)
        }
        for title, regexes in per_rank.items()
    }
    expected = {  # no reserved chart on CPU: every chart has lines, one per rank
        "per rank: live tensors at step end, exact (MiB; one line per rank)": {
            "memory/train/rank0/tensor_MiB",
            "memory/train/rank1/tensor_MiB",
        },
        "per rank: host RSS at step end (MiB; one line per rank)": {
            "memory/train/rank0/host_rss_MiB",
            "memory/train/rank1/host_rss_MiB",
        },
    }
    # 3 steps: a chart whose short lines TensorBoard would clip at both ends is drawn between flat lines at its lowest
    # and highest values, never left out
    assert matched == expected
    # the dashboard rules, on what this DDP run logged
    from lightning_memkit.tensorboard.rules import check_dashboard

    assert (
        check_dashboard(
            {c: {t: ["Multiline", r] for t, r in charts.items()} for c, charts in layout.items()}, {"tb": scalars}
        )
        == []
    )
    for title, regexes in layout["memkit: memory per step"].items():  # no validation chart: this fit does not validate
        assert {t for t in tags for r in regexes if re.match(r, t)}, title
