"""memkit's callbacks, dashboard and CLI on Trainer set-ups and modules the other tests do not use.

Each test holds one such case (logger-less and ``fast_dev_run`` runs, a step that
raises, a step that runs no forward, a model that checkpoints itself, more than three DDP ranks,
charts of 1,000 MiB and more, a wrong path to ``memkit report``), on real Trainer runs where a
Trainer is involved, read back as a user would (files, CSV, tensorboard's reader, the CLI).
"""

from __future__ import annotations

import csv
import glob
import os
import re
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_memkit import ActivationCheckpointing, LayerTrace, MemoryDoctor, MemoryTracker
from lightning_memkit.records import RECORDS_FILENAME, read_records
from lightning_memkit.tensorboard.axis import tensorboard_ticks, tensorboard_y_range, tick_label
from lightning_memkit.tensorboard.layout import (
    MAX_SERIES_PER_CHART,
    RANK_CATEGORY,
    dashboard_layout,
    layout_from_tags,
    layout_tags,
)
from lightning_memkit.tensorboard.readable import readable_layout
from lightning_memkit.tensorboard.rules import MAX_TICK_LABEL, check_dashboard
from lightning_memkit.units import MiB
from tests.helpers.models import LinearStack

D = 16


class Blocks(pl.LightningModule):
    """Four residual Linear+ReLU blocks and a head, MSE on (x, y) batches of 4."""

    def __init__(
        self, checkpoint_itself: bool = False, fail_at_step: int | None = None, skip_batch: int | None = None
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.ReLU()) for _ in range(4))
        self.head = nn.Linear(D, 1)
        self.checkpoint_itself = checkpoint_itself
        self.fail_at_step = fail_at_step
        self.skip_batch = skip_batch
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(64, D, generator=generator)
        self.y = torch.randn(64, 1, generator=generator)

    def forward(self, x):
        for block in self.blocks:
            # a user's own activation checkpointing, inside forward
            x = (
                torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if self.checkpoint_itself else block(x)
            ) + x
        return self.head(x)

    def training_step(self, batch, batch_idx):
        if self.global_step == self.fail_at_step:
            raise RuntimeError(f"boom at step {self.global_step}")
        if batch_idx == self.skip_batch:
            return None  # a skipped batch: no forward, no backward
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=4)


def _trainer(root, **overrides) -> pl.Trainer:
    options = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 4,
        "default_root_dir": str(root),
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "log_every_n_steps": 1,
    }
    options.update(overrides)
    return pl.Trainer(**options)


def _memkit_files(root) -> list[str]:
    return sorted(
        os.path.relpath(p, root) for p in glob.glob(os.path.join(str(root), "**", "memkit_*"), recursive=True)
    )


# ---------------------------------------------------------------------------------------------- files
@pytest.mark.parametrize("overrides", [{"logger": False}, {"fast_dev_run": 4}], ids=["logger=False", "fast_dev_run"])
def test_a_run_that_logs_nowhere_leaves_no_memkit_file_in_the_working_directory(
    overrides, tmp_path, monkeypatch, capsys
):
    """``fast_dev_run`` swaps the loggers for a DummyLogger whose log dir is ``default_root_dir`` (the working
    directory by default): memkit_memory.json and memkit_doctor.json landed there. Now no memkit callback
    writes a file without a logger; every result stays on the callback."""
    monkeypatch.chdir(tmp_path)
    tracker, trace, doctor = (
        MemoryTracker(verbose=True),
        LayerTrace(at_steps=(1,), verbose=False),
        MemoryDoctor(verbose=False),
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[tracker, trace, doctor],
        **overrides,
    )
    trainer.fit(LinearStack())
    assert [r.step for r in tracker.history if r.stage == "train"] == [0, 1, 2, 3]
    assert trace.results and trace.results[-1].step == 1 and doctor.report is not None
    assert tracker.records_path is None and doctor.report_path is None and trace.paths == []
    assert _memkit_files(tmp_path) == []
    # and the printed summary says where the readings are
    assert (
        "memkit readings: no logger, so nothing was logged; every measured step on this tracker's .history; "
        "records: no file" in capsys.readouterr().out
    )


def test_rows_memkit_writes_itself_carry_the_epoch_as_lightnings_rows_do(tmp_path):
    """A module that logs nothing gets memkit's own CSV rows; their epoch read "0.0", "1.0" where
    Lightning's rows read "0", "1" (a user filtering on row["epoch"] == "1" missed them)."""
    logger = CSVLogger(str(tmp_path), name="csv")
    _trainer(
        tmp_path,
        logger=logger,
        max_steps=-1,
        max_epochs=2,
        limit_train_batches=2,
        callbacks=[MemoryTracker(verbose=False)],
    ).fit(LinearStack())
    with open(os.path.join(logger.log_dir, "metrics.csv")) as file:
        rows = [row for row in csv.DictReader(file) if row.get("memory/train/tensor_MiB")]
    assert [(row["step"], row["epoch"]) for row in rows] == [("0", "0"), ("1", "0"), ("2", "1"), ("3", "1")]


def test_a_step_that_raises_leaves_the_exact_readings_and_the_doctors_verdict(tmp_path):
    """Nothing is lost: a CSV-only run that raised at step 3 had no memkit_memory.json (the report found
    nothing: no event files to rebuild from) and no memkit_doctor.json. Both are written at the failure."""
    from lightning_memkit.cli import main

    logger = CSVLogger(str(tmp_path), name="csv")
    tracker, doctor = MemoryTracker(verbose=False), MemoryDoctor(verbose=False)
    with pytest.raises(RuntimeError, match="boom at step 3"):
        _trainer(tmp_path, logger=logger, max_steps=8, callbacks=[tracker, doctor]).fit(Blocks(fail_at_step=3))
    summary, history = read_records(os.path.join(logger.log_dir, RECORDS_FILENAME))
    assert [r.step for r in history] == [0, 1, 2] and history == list(tracker.history)  # exact bytes, as kept
    assert (
        summary.extra["ended_by"] == "RuntimeError: boom at step 3" and summary.peak_bytes == tracker.summary.peak_bytes
    )
    assert os.path.exists(os.path.join(logger.log_dir, "memkit_doctor.json")) and doctor.report_path is not None
    with open(os.path.join(logger.log_dir, "metrics.csv")) as file:  # the loggers were flushed
        rows = [row for row in csv.DictReader(file) if row.get("memory/train/tensor_MiB")]
    assert [int(row["step"]) for row in rows] == [0, 1, 2]
    assert [round(float(row["memory/train/tensor_MiB"]) * MiB) for row in rows] == [r.tensor_bytes for r in history]
    assert main(["report", str(tmp_path), "-o", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text()
    assert "the fit did not finish: RuntimeError: boom at step 3" in page and "rebuilt from TensorBoard" not in page


def test_max_batch_size_under_fast_dev_run_says_it_did_not_search(tmp_path):
    """Under fast_dev_run the search was skipped in silence (``result`` None, no line printed)."""
    from lightning_memkit import MaxBatchSize

    search = MaxBatchSize(budget="64MiB", max_val=64)
    model = LinearStack(batch_size=8)
    with pytest.warns(
        UserWarning, match=r"no batch-size search under fast_dev_run .* uses the batch size as set \(8\)"
    ):
        _trainer(tmp_path, fast_dev_run=2, callbacks=[search]).fit(model)
    assert search.result is None and model.batch_size == 8


# ---------------------------------------------------------------------------------------------- steps
def test_a_traced_step_that_runs_no_forward_says_so(tmp_path):
    """A training_step that returns None before calling the model gave a trace of step markers alone,
    read as a step that used no memory (``memkit trace --step 0`` on such a module). Now it warns."""
    trace = LayerTrace(at_steps=(0, 1), verbose=False)
    with pytest.warns(UserWarning, match=r"step 0 ran no module's forward") as caught:
        _trainer(tmp_path, logger=False, max_steps=2, callbacks=[trace]).fit(Blocks(skip_batch=0))
    assert not [w for w in caught if "step 1 ran no" in str(w.message)]  # step 1 ran the model: no warning
    assert [r.step for r in trace.results] == [0, 1] and trace.results[1].module_events("forward")


def test_activation_checkpointing_on_a_model_that_checkpoints_itself_wraps_nothing(tmp_path):
    """A forward that calls torch.utils.checkpoint itself was wrapped again ("activation memory 1.03 KiB
    -> 1.03 KiB (measured)"): each block recomputed twice for no saving. Now the measured plan that saves
    nothing is undone, with a warning, and training is the same as without the callback."""
    from lightning_memkit.modes.checkpoint_wrap import is_checkpointed

    wrapped_during_fit = []

    class Spy(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            wrapped_during_fit.append(any(is_checkpointed(m) for m in pl_module.modules()))

    losses = {}
    for name, callbacks in (("without", []), ("with", [ActivationCheckpointing("auto", verbose=False)])):
        torch.manual_seed(0)
        model = Blocks(checkpoint_itself=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _trainer(tmp_path, logger=False, max_steps=3, callbacks=[*callbacks, Spy()]).fit(model)
        losses[name] = [p.detach().clone() for p in model.parameters()]
        if callbacks:
            plan = callbacks[0].plan
            assert plan.measured_saving_bytes <= 0 < plan.count and "unwrapped" in plan.note
            assert any("saved no activation memory when measured" in str(w.message) for w in caught)
    assert wrapped_during_fit == [False] * 6
    assert all(torch.equal(a, b) for a, b in zip(losses["without"], losses["with"], strict=True))


# ---------------------------------------------------------------------------------------------- dashboard
def _rank_runs(world_size: int, steps: int = 20) -> dict[str, list[tuple[int, float]]]:
    """What MemoryTracker(per_rank=True) logs under DDP with ``world_size`` ranks (tags and plausible MiB values)."""
    scalars = {}
    for field, base in (("tensor_MiB", 100.0), ("host_rss_MiB", 400.0)):
        for rank in range(world_size):
            scalars[f"memory/train/rank{rank}/{field}"] = [(s, base + 7 * rank + 0.5 * s) for s in range(steps)]
        scalars[f"memory/train/{field}"] = [(s, base + 7 * (world_size - 1) + 0.5 * s) for s in range(steps)]  # the max
    scalars["memory/train/peak_tensor_MiB"] = [(s, 150.0 + s) for s in range(steps)]
    scalars["memory/train/host_peak_rss_MiB"] = [(s, 480.0 + s) for s in range(steps)]
    return scalars


@pytest.mark.parametrize("world_size", [2, 3, 4, 8, 13])
def test_per_rank_charts_draw_at_most_three_lines_for_any_number_of_ranks(world_size):
    """One chart per quantity with a line per rank would break the 3-lines rule from 4 ranks on: each rank's
    line is in exactly one chart per quantity, and every chart keeps the dashboard's rules."""
    scalars = _rank_runs(world_size)
    steps = {tag: len(points) for tag, points in scalars.items()}
    layout = layout_from_tags(steps)
    rank_categories = [c for c in layout if c.startswith(RANK_CATEGORY)]
    assert rank_categories == (
        [RANK_CATEGORY]
        if world_size <= MAX_SERIES_PER_CHART
        else [f"{RANK_CATEGORY}: live tensors at step end, exact", f"{RANK_CATEGORY}: host RSS at step end"]
    )
    # the layout from the world size at fit start is the one read back off the tags
    assert {c: layout[c] for c in rank_categories} == {
        c: charts for c, charts in dashboard_layout(ranks=world_size).items() if c.startswith(RANK_CATEGORY)
    }
    charts = {
        title: regexes
        for category in rank_categories
        for title, regexes in layout_tags({category: layout[category]}).items()
    }
    for field in ("tensor_MiB", "host_rss_MiB"):
        for rank in range(world_size):
            tag = f"memory/train/rank{rank}/{field}"
            assert sum(any(re.match(r, tag) for r in regexes) for regexes in charts.values()) == 1, tag
    assert all(
        1 <= len([t for t in scalars if any(re.match(r, t) for r in regexes)]) <= MAX_SERIES_PER_CHART
        for regexes in charts.values()
    )
    readable, lines = readable_layout(layout, {"run": scalars})
    assert check_dashboard(readable, {"run": {**scalars, **lines.get("run", {})}}) == []


@pytest.mark.parametrize(
    ("low", "high", "title_unit"), [(1200.0, 2400.0, "(GiB)"), (1494.0, 1507.0, "(MiB above 1,490 MiB)")]
)
def test_charts_of_1000_mib_or_more_have_no_exponent_labels(low, high, title_unit):
    """TensorBoard labels 1,400 MiB "1.4e+3". A chart whose values reach 1,000 MiB is drawn in GiB
    (lines ``memory/dashboard/train/<field>_GiB`` = MiB / 1024 at the same steps); values that move by a
    few MiB there, which in GiB would repeat "1.46", are drawn in MiB above a base. The logged tags stay."""
    steps = 20
    scalars = {
        "memory/train/host_rss_MiB": [(s, low + (high - low) * s / (steps - 1)) for s in range(steps)],
        "memory/train/host_peak_rss_MiB": [(s, low + 1 + (high - low) * s / (steps - 1)) for s in range(steps)],
        "memory/train/tensor_MiB": [(s, 10.0 + s) for s in range(steps)],
    }
    layout = layout_from_tags(dict.fromkeys(scalars, steps))
    assert any("exponent notation" in p for p in check_dashboard(layout, {"run": scalars}))  # as logged: "1.2e+3" ...
    readable, lines = readable_layout(layout, {"run": scalars})
    drawn = {**scalars, **lines["run"]}
    assert check_dashboard(readable, {"run": drawn}) == []
    [host_title] = [t for t in layout_tags(readable) if t.startswith("host RSS")]
    assert host_title == f"host RSS, top to bottom: step peak, step end {title_unit}"
    [chart] = [regexes for title, regexes in layout_tags(readable).items() if title == host_title]
    matched = sorted(t for t in drawn for r in chart if re.match(r, t))
    if title_unit == "(GiB)":
        assert matched == ["memory/dashboard/train/host_peak_rss_GiB", "memory/dashboard/train/host_rss_GiB"]
        assert [v for _, v in drawn["memory/dashboard/train/host_rss_GiB"]] == pytest.approx(
            [v / 1024 for _, v in scalars["memory/train/host_rss_MiB"]], abs=1e-6
        )
    values = [v for tag in matched for _, v in drawn[tag]]
    labels = [tick_label(t) for t in tensorboard_ticks(*tensorboard_y_range(values))]
    assert all("e" not in label and float(label) < MAX_TICK_LABEL for label in labels), labels
    assert "tensors (exact): live at step end (MiB)" in layout_tags(readable)  # 10-29 MiB: drawn as logged


# ---------------------------------------------------------------------------------------------- CLI
def test_memkit_report_rebuilds_a_csv_only_run_exactly_and_one_run_per_fit(tmp_path, capsys):
    """A CSVLogger run without memkit_memory.json (killed, or an older memkit) was "none of them memkit's";
    its metrics.csv holds the readings as float64 MiB, so they come back to the byte. A fit logged to
    TensorBoard and CSV (two directories) is one run, not two."""
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_memkit.cli import main
    from lightning_memkit.report.sources import find_sources

    trackers = []
    for version, loggers in enumerate(
        (
            [CSVLogger(str(tmp_path), name="csv")],
            [TensorBoardLogger(str(tmp_path), name="both"), CSVLogger(str(tmp_path), name="both_csv")],
        )
    ):
        trackers.append(MemoryTracker(verbose=False))
        _trainer(tmp_path, logger=loggers, max_steps=3 + version, callbacks=[trackers[-1]]).fit(
            LinearStack(log_loss=True)
        )
    for path in glob.glob(str(tmp_path / "**" / RECORDS_FILENAME), recursive=True):
        os.remove(path)  # as after a run that was killed
    runs = find_sources(str(tmp_path)).runs
    assert [(r.name, r.exact, r.rebuilt_from) for r in runs] == [
        ("both_csv/version_0", True, "metrics.csv"),
        ("csv/version_0", True, "metrics.csv"),
    ]
    readings = lambda history: [(r.step, r.stage, r.values()) for r in history]  # noqa: E731
    assert [readings(r.history) for r in runs] == [
        readings(trackers[1].history),
        readings(trackers[0].history),
    ]  # to the byte
    assert main(["report", str(tmp_path), "-o", str(tmp_path / "r.html")]) == 0
    assert (
        "2 run(s)" in capsys.readouterr().out
        and "rebuilt from metrics.csv: float64 MiB, exact bytes" in (tmp_path / "r.html").read_text()
    )


@pytest.mark.parametrize("path", ["missing_dir", "a_file.txt"])
def test_memkit_report_on_a_path_that_is_not_a_directory_is_one_line_and_exit_2(path, tmp_path, capsys):
    from lightning_memkit.cli import main

    (tmp_path / "a_file.txt").write_text("not a log dir")
    assert main(["report", str(tmp_path / path), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("memkit report: ") and "is not a directory" in err
    assert not (tmp_path / "r.html").exists()
