"""`memkit report`: a self-contained HTML report from a real run's files; clear failure on empty/foreign dirs."""

from __future__ import annotations

import base64
import html
import json
import os
import pickle
import re
import shutil

import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.tensorboard import SummaryWriter

from lightning_memkit import MemoryTracker
from lightning_memkit.cli import main
from lightning_memkit.records import RECORDS_FILENAME, StepReading, read_records
from lightning_memkit.report.html_report import readings_table
from lightning_memkit.report.sources import find_sources
from lightning_memkit.summary_table import format_summary
from lightning_memkit.units import MiB
from tests.helpers.event_files import read_layouts
from tests.helpers.models import LinearStack
from tests.helpers.trainers import make_trainer


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A real 4-step fit with MemoryTracker (validation after step 2) and a TensorBoardLogger."""
    root = tmp_path_factory.mktemp("report_run")
    model = LinearStack(val_batches=1)
    trainer = make_trainer(
        root,
        max_steps=4,
        logger=TensorBoardLogger(str(root), name="run", version=0),
        callbacks=[MemoryTracker(verbose=False)],
        limit_val_batches=1,
        val_check_interval=2,
        check_val_every_n_epoch=None,
    )
    trainer.fit(model)
    return str(root)


def _embedded_pngs(page: str) -> list[bytes]:
    return [base64.b64decode(data) for data in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)]


def test_report_of_a_real_run(run_dir, tmp_path, capsys):
    out, png_dir = tmp_path / "report.html", tmp_path / "png"
    assert main(["report", run_dir, "-o", str(out), "--png", str(png_dir)]) == 0
    printed = capsys.readouterr().out
    assert "1 run(s), 0 layer trace(s), 0 mode comparison(s), 0 out-of-memory report(s)" in printed
    assert "not found: no layer trace" in printed and "not found: no mode comparison" in printed
    page = out.read_text()
    summary, history = read_records(os.path.join(run_dir, "run", "version_0", RECORDS_FILENAME))
    # the same table as the terminal and TensorBoard, from the same records
    assert html.escape(format_summary(summary, history)) in page
    assert html.escape(readings_table(history)) in page
    assert [r.stage for r in history] == ["train", "train", "validate", "train", "train", "validate"]
    # self-contained: inline CSS and images, nothing fetched
    assert "<style>" in page and not re.search(r'(src|href)="(?!data:)', page) and "<script" not in page
    pngs = _embedded_pngs(page)
    assert len(pngs) == 1 and pngs[0][:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(png_dir)) == ["run_version_0_memory_per_step.png"]
    assert (png_dir / "run_version_0_memory_per_step.png").read_bytes() == pngs[0]
    assert "memkit_trace_step&lt;N&gt;.json" in page and "compare.json" in page  # says what it could not find


def test_run_without_records_is_rebuilt_from_tensorboard_scalars(run_dir, tmp_path):
    copy = tmp_path / "crashed"
    shutil.copytree(run_dir, copy)
    records = copy / "run" / "version_0" / RECORDS_FILENAME
    summary, history = read_records(str(records))
    records.unlink()  # a run that never reached fit end leaves only its event files
    sources = find_sources(str(copy))
    [run] = sources.runs
    assert not run.exact and run.name == "run/version_0"
    assert [(r.step, r.stage) for r in run.history] == [(r.step, r.stage) for r in history]
    for rebuilt, original in zip(run.history, history, strict=True):
        # TensorBoard keeps float32 MiB: bytes come back as round(float32(bytes / 2**20) * 2**20)
        for field in ("tensor_bytes", "peak_tensor_bytes"):  # the peak only on the steps the accountant measured it
            exact, back = getattr(original, field), getattr(rebuilt, field)
            assert (back is None) == (exact is None), field
            if exact is not None:
                assert back == round(float(np.float32(exact / MiB)) * MiB)
                assert abs(back - exact) <= exact * 2**-23
    assert run.summary.peak_step == summary.peak_step
    assert any("rounded to float32 MiB" in m for m in sources.missing)


def test_empty_directory_fails_and_says_what_is_missing(tmp_path, capsys):
    assert main(["report", str(tmp_path), "-o", str(tmp_path / "r.html")]) == 1
    message = capsys.readouterr().err
    assert "it is empty" in message and RECORDS_FILENAME in message and "memkit_trace_step<N>.json" in message
    assert "compare.json" in message and "MemoryTracker" in message
    assert not (tmp_path / "r.html").exists()


def test_foreign_directory_fails_and_names_what_it_found(tmp_path, capsys):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("hello")
    (foreign / "compare.json").write_text('{"modes": []}')  # a compare.json that is not memkit's
    writer = SummaryWriter(str(foreign / "tb"))  # TensorBoard events with no memkit scalars
    writer.add_scalar("loss", 1.0, 0)
    writer.close()
    assert main(["report", str(foreign), "-o", str(tmp_path / "r.html")]) == 1
    message = capsys.readouterr().err
    assert "none of them readable as memkit's (see below)" in message and "notes.txt" in message
    assert 'compare.json: cannot read it (no "format": "lightning-memkit/compare/1" key)' in message


def test_missing_directory_fails(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2  # a wrong argument, as every verb's: exit 2
    assert "is not a directory" in capsys.readouterr().err


class _Tripwire:
    """Unpickling this creates a file: the report must never do it."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_report_never_unpickles(run_dir, tmp_path):
    copy = tmp_path / "with_pickle"
    shutil.copytree(run_dir, copy)
    tripwire = tmp_path / "unpickled"
    for name in ("memkit_oom_rank0.pickle", "memkit_trace_step3.json"):
        (copy / name).write_bytes(pickle.dumps(_Tripwire(str(tripwire))))
    sources = find_sources(str(copy))
    assert not tripwire.exists()
    assert len(sources.runs) == 1
    assert any(p.startswith("memkit_trace_step3.json: cannot read it") for p in sources.problems)


def test_report_with_a_layer_trace(tmp_path):
    from lightning_memkit.callbacks import layer_trace
    from lightning_memkit.trace.trace_records import read_trace

    model = LinearStack(optimizer="adam")
    logger = TensorBoardLogger(str(tmp_path / "logs"), name="run", version=0)
    trainer = make_trainer(
        tmp_path,
        max_steps=3,
        logger=logger,
        callbacks=[MemoryTracker(verbose=False), layer_trace.LayerTrace(at_steps=(1,))],
    )
    trainer.fit(model)
    out, png_dir = tmp_path / "report.html", tmp_path / "png"
    assert main(["report", str(tmp_path / "logs"), "-o", str(out), "--png", str(png_dir)]) == 0
    page = out.read_text()
    trace = read_trace(os.path.join(logger.log_dir, "memkit_trace_step1.json"))
    # the trace's own tables, verbatim: the report computes nothing of its own
    assert html.escape(trace.format_table()) in page and html.escape(trace.format_categories()) in page
    assert "Layer trace <code>run/version_0</code>, step 1" in page
    assert sorted(os.listdir(png_dir)) == ["run_version_0_memory_per_step.png", "run_version_0_trace_step1.png"]
    assert len(_embedded_pngs(page)) == 2
    assert "no layer trace" not in page


def test_report_of_a_compare_run(tmp_path, capsys):
    from lightning_memkit.modes.comparison import compare_modes

    root = tmp_path / "cmp"
    result = compare_modes(
        lambda: LinearStack(val_batches=1),
        modes="baseline,amp",
        max_steps=2,
        accelerator="cpu",
        root_dir=str(root),
        val_batches=1,
        verbose=False,
    )
    out, png_dir = tmp_path / "report.html", tmp_path / "png"
    assert main(["report", str(root), "-o", str(out), "--png", str(png_dir)]) == 0
    assert "2 run(s), 0 layer trace(s), 1 mode comparison(s), 0 out-of-memory report(s)" in capsys.readouterr().out
    page = out.read_text()
    assert html.escape(result.format_table()) in page
    assert [r.name for r in find_sources(str(root)).runs] == ["baseline", "amp"]  # in the comparison's order
    for mode in ("baseline", "amp"):
        assert f"Run <code>{mode}</code>" in page
        # each mode's TensorBoard run carries the dashboard of the modes overlaid (one line per mode)
        layout = read_layouts(str(root / mode))[-1]
        assert list(layout) == ["memkit: modes compared"]
        summary, history = read_records(os.path.join(root, mode, RECORDS_FILENAME))
        assert html.escape(format_summary(summary, history)) in page
    pngs = sorted(os.listdir(png_dir))
    assert pngs == sorted(
        [
            "amp_memory_per_step.png",
            "baseline_memory_per_step.png",
            "compare_peak_figure.png",
            "compare_steps_figure.png",
        ]
    )
    assert len(_embedded_pngs(page)) == 4
    # compare.csv alone (e.g. copied off a cluster without the JSON) still gives the table
    (root / "compare.json").unlink()
    [only] = find_sources(str(root)).compares
    assert only.data is None and [row["mode"] for row in only.rows] == ["baseline", "amp"]


class _RunsOutAtStep2(LinearStack):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step == 2:
            torch.empty(2**60, dtype=torch.uint8)  # 1 EiB: the CPU allocator refuses it, a real out-of-memory error
        return loss


def test_report_of_a_run_that_ran_out_of_memory(tmp_path, capsys):
    logger = TensorBoardLogger(str(tmp_path / "logs"), name="run", version=0)
    trainer = make_trainer(
        tmp_path, max_steps=5, logger=logger, callbacks=[MemoryTracker(verbose=False)], log_every_n_steps=1
    )
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        trainer.fit(_RunsOutAtStep2())
    out = tmp_path / "report.html"
    assert main(["report", str(tmp_path / "logs"), "-o", str(out)]) == 0
    assert "1 run(s), 0 layer trace(s), 0 mode comparison(s), 1 out-of-memory report(s)" in capsys.readouterr().out
    page = out.read_text()
    with open(os.path.join(logger.log_dir, "memkit_oom_rank0.json")) as file:
        oom = json.load(file)
    assert "Out of memory: <code>run/version_0</code>, step 2, rank 0" in page
    assert "RuntimeError: " + html.escape(oom["error"][:100]) in page
    readings = [StepReading.from_dict(r) for r in oom["last_readings"]] + [
        StepReading.from_dict(oom["failing_step_reading"])
    ]
    assert [r.step for r in readings] == [0, 1, 2]
    assert html.escape(readings_table(readings)) in page
    # the fit raised: MemoryTracker wrote its exact readings up to the failure, and the report says the fit did not
    # finish
    [run] = find_sources(str(tmp_path / "logs")).runs
    assert run.exact and [r.step for r in run.history] == [0, 1]
    assert run.summary.extra["ended_by"].startswith("RuntimeError: ") and "the fit did not finish: RuntimeError" in page
    # without that file (a run killed with no exception, or an older memkit) they come back from the TensorBoard scalars
    os.remove(os.path.join(logger.log_dir, RECORDS_FILENAME))
    [run] = find_sources(str(tmp_path / "logs")).runs
    assert not run.exact and [r.step for r in run.history] == [0, 1]
    assert main(["report", str(tmp_path / "logs"), "-o", str(out)]) == 0
    assert "rebuilt from TensorBoard scalars" in out.read_text()
