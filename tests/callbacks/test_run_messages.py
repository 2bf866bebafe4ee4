"""What memkit says about a run matches what the run was: too few steps for a leak verdict, a
validate-only run, a validation after fit (its records rewritten), sampled peaks drawn as samples,
a compact set of LayerTrace columns in metrics.csv, tiny held-too-long groups summed on one line."""

from __future__ import annotations

import csv
import os

from lightning.pytorch.loggers import CSVLogger

from lightning_memkit import LayerTrace, MemoryDoctor, MemoryTracker
from lightning_memkit.records import RunSummary, StepReading, read_records
from tests.helpers.models import LinearStack
from tests.helpers.trainers import make_trainer


def test_the_doctor_under_fast_dev_run_says_too_few_steps_not_no_leak(tmp_path):
    doctor = MemoryDoctor(verbose=False)
    make_trainer(tmp_path, fast_dev_run=True, callbacks=[doctor]).fit(LinearStack())
    text = doctor.report.format()
    assert doctor.report.steps == 1 and doctor.report.steps_needed > 1
    assert (
        f"too few steps to judge a leak: 1 watched, {doctor.report.steps_needed} needed" in text
        and "no leak" not in text
    ), text


def test_a_validate_only_run_is_named_so_by_the_report(tmp_path):
    from lightning_memkit.report.sources import find_sources

    logger = CSVLogger(str(tmp_path), name="csv")
    make_trainer(tmp_path, logger=logger, limit_val_batches=1, callbacks=[MemoryTracker(verbose=False)]).validate(
        LinearStack(val_batches=1), verbose=False
    )
    sources = find_sources(str(tmp_path))
    said = " | ".join(sources.missing)
    assert "a validate-only run" in said and "did not reach fit end" not in said, said


def test_a_validation_after_fit_rewrites_the_records_written_at_fit_end(tmp_path):
    logger = CSVLogger(str(tmp_path), name="csv")
    tracker = MemoryTracker(verbose=False)
    model = LinearStack(val_batches=1)
    trainer = make_trainer(tmp_path, max_steps=2, logger=logger, callbacks=[tracker], limit_val_batches=1)
    trainer.fit(model)
    path = tracker.records_path
    assert path is not None and [r.stage for r in read_records(path)[1]] == ["train", "train"]
    trainer.validate(model, verbose=False)
    assert tracker.records_path == path  # the same file, rewritten: not a -v1 beside it
    assert [(r.step, r.stage) for r in read_records(path)[1]] == [(r.step, r.stage) for r in tracker.history]
    assert [r.stage for r in tracker.history] == ["train", "train", "validate"]


def test_the_figure_draws_sampled_peaks_as_markers_and_keeps_its_subtitle_off_the_titles():
    from lightning_memkit.tensorboard.figures import memory_per_step_figure

    history = [
        StepReading(step=s, tensor_bytes=2**20 * (10 + s), peak_tensor_bytes=2**20 * 20 if s in (1, 6) else None)
        for s in range(8)
    ]
    summary = RunSummary()
    for reading in history:
        summary.update(reading)
    figure = memory_per_step_figure(summary, history)
    lines = {line.get_label(): line for line in figure.axes[0].get_lines()}
    sampled = [line for label, line in lines.items() if "sampled steps" in label]
    assert len(sampled) == 1 and sampled[0].get_linestyle() == "None" and list(sampled[0].get_xdata()) == [1, 6]
    every = [line for label, line in lines.items() if "sampled" not in label and len(line.get_xdata()) == 8]
    assert every and every[0].get_linestyle() not in ("None", "")  # read every step: a line
    assert figure.axes[0].get_title(loc="right") == ""
    assert figure._supxlabel.get_text() == "8 readings; run peak from peak_tensor_bytes"


def test_layer_trace_adds_a_compact_set_of_columns_to_metrics_csv(tmp_path):
    from lightning_memkit.callbacks.layer_trace import COMPACT_METRICS

    logger = CSVLogger(str(tmp_path), name="csv")
    make_trainer(tmp_path, max_steps=2, logger=logger, callbacks=[LayerTrace(verbose=False)]).fit(LinearStack())
    with open(os.path.join(logger.log_dir, "metrics.csv")) as file:
        columns = next(csv.reader(file))
    assert sorted(c for c in columns if c.startswith("memory/trace")) == sorted(f"memory/{m}" for m in COMPACT_METRICS)
    assert len(COMPACT_METRICS) == 6


def test_the_doctor_sums_tiny_held_too_long_groups_on_one_line():
    from lightning_memkit.doctor.leaks import CreatorGroup
    from lightning_memkit.doctor.liveness import LivenessReport

    def group(nbytes, count, op):
        return CreatorGroup(
            op, "net.0", "forward", [1], "torch.float32", "made in a step", None, count=count, total_bytes=nbytes
        )

    report = LivenessReport(
        step=1,
        peak_bytes=10_000,
        peak_op="aten.mm",
        peak_module="net.0",
        peak_phase="forward",
        held_too_long_bytes=4096 + 12,
        held_too_long=[group(4096, 1, "aten.relu"), group(4, 1, "aten.add"), group(8, 2, "aten.mul")],
    )
    text = report.format()
    assert "aten.relu" in text and "aten.add" not in text and "aten.mul" not in text, text
    assert "12 B in 3 tiny tensors" in text, text
