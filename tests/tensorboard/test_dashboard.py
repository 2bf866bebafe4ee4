"""The dashboard: layout regexes agree with the logged tags, one layout per run, figures mark the record's peak."""

from __future__ import annotations

import glob
import os
import re
import shutil

from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_memkit import MemoryTracker
from lightning_memkit.callbacks.layer_trace import LayerTrace
from lightning_memkit.records import COUNT_FIELDS, MEMORY_FIELDS, RunSummary, StepReading, read_records
from lightning_memkit.tensorboard.dashboard import register_dashboard
from lightning_memkit.tensorboard.figures import PEAK_COLOR, memory_per_step_figure
from lightning_memkit.tensorboard.layout import dashboard_layout
from lightning_memkit.tensorboard.tags import step_tag
from lightning_memkit.units import MiB
from tests.helpers.event_files import read_layouts, read_scalars
from tests.helpers.models import LinearStack
from tests.helpers.trainers import make_trainer

ALL_FIELDS = list(MEMORY_FIELDS) + list(COUNT_FIELDS)


def _regexes(layout):
    return {title: spec[1] for category in layout.values() for title, spec in category.items()}


def _matches(layout, tags):
    return {title: {t for t in tags for r in regexes if re.match(r, t)} for title, regexes in _regexes(layout).items()}


def test_every_chart_matches_tags_memory_tracker_logs():
    train = {step_tag(f, "train") for f in ALL_FIELDS}
    val = {step_tag(f, "validate") for f in ALL_FIELDS}
    ranks = {step_tag(f, "train", rank=r) for f in ALL_FIELDS for r in (0, 1)}
    layout = dashboard_layout(cuda=True, ranks=True)
    matched = _matches(layout, train | val | ranks)
    assert all(matched.values()), [t for t, m in matched.items() if not m]
    assert all(len(m) <= 3 for m in matched.values()), matched  # 2 ranks: at most 2 lines on a per-rank chart
    assert matched["CUDA step peak, top to bottom: reserved, allocated (MiB)"] == {
        "memory/train/peak_allocated_MiB",
        "memory/train/peak_reserved_MiB",
    }
    assert matched["CUDA at step end, top to bottom: reserved, allocated (MiB)"] == {
        "memory/train/allocated_MiB",
        "memory/train/reserved_MiB",
    }
    assert matched["CUDA allocator: retries after flushing the cache, OOMs (count)"] == {
        "memory/train/alloc_retries",
        "memory/train/ooms",
    }
    assert matched["device (NVML), top to bottom: all processes, this process, allocator reserved (MiB)"] == {
        "memory/train/device_used_MiB",
        "memory/train/process_device_MiB",
        "memory/train/reserved_MiB",
    }
    assert matched["tensors (exact): step peak (MiB)"] == {"memory/train/peak_tensor_MiB"}
    assert matched["tensors (exact): live at step end (MiB)"] == {"memory/train/tensor_MiB"}
    assert matched["host RSS, top to bottom: step peak, step end (MiB)"] == {
        "memory/train/host_rss_MiB",
        "memory/train/host_peak_rss_MiB",
    }
    assert matched["validation runs, top to bottom: CUDA peak reserved, peak allocated (MiB)"] == {
        "memory/val/peak_allocated_MiB",
        "memory/val/peak_reserved_MiB",
    }
    assert matched["per rank: CUDA step peak allocated (MiB; one line per rank)"] == {
        "memory/train/rank0/peak_allocated_MiB",
        "memory/train/rank1/peak_allocated_MiB",
    }
    # every train-stage field is on some chart but the capacity (a number in the device table, never a
    # line that flattens the others) and active (allocated plus rounding); per-rank tags stay off run-level charts
    on_charts = set().union(*matched.values())
    assert train - on_charts == {"memory/train/active_MiB", "memory/train/device_total_MiB"}
    run_level = set().union(*(m for t, m in matched.items() if not t.startswith("per rank")))
    assert not run_level & ranks
    # NVML off (no pynvml): no NVML chart
    assert not any("NVML" in title for title in _regexes(dashboard_layout(cuda=True, nvml=False)))


def test_layout_follows_prefix_and_switches():
    layout = dashboard_layout(prefix="mem.x", cuda=False, trace=True)
    assert list(layout) == ["memkit: memory per step"]  # a layer trace is a figure and tables, not charts
    regexes = [r for rs in _regexes(layout).values() for r in rs]
    assert all(r.startswith("^mem\\.x/") for r in regexes)
    assert not any("CUDA" in title or "NVML" in title for title in _regexes(layout))
    tensors = _regexes(layout)["tensors (exact): live at step end (MiB)"][0]
    assert re.match(tensors, "mem.x/train/tensor_MiB") and not re.match(tensors, "mem.x/train/peak_tensor_MiB")
    assert not re.match(tensors, "memAx/train/tensor_MiB") and not re.match(tensors, "mem.x/train/tensor_MiBs")
    # a compare mode's run: one category, one quantity per chart (one line per mode's run)
    compare = dashboard_layout(cuda=True, compare=True)
    assert list(compare) == ["memkit: modes compared"]
    assert _matches(compare, {step_tag(f, "train") for f in ALL_FIELDS}) == {
        "modes overlaid: CUDA step peak allocated (MiB)": {"memory/train/peak_allocated_MiB"},
        "modes overlaid: CUDA allocated at step end (MiB)": {"memory/train/allocated_MiB"},
        "modes overlaid: CUDA step peak reserved (MiB)": {"memory/train/peak_reserved_MiB"},
        "modes overlaid: CUDA fragmentation (MiB)": {"memory/train/fragmentation_MiB"},
        "modes overlaid: this process on the device, NVML (MiB)": {"memory/train/process_device_MiB"},
        "modes overlaid: host RSS at step end (MiB)": {"memory/train/host_rss_MiB"},
    }


def _layout_events(log_dir):
    """How many times the run's layout was registered (at fit start). A second layout event is
    fit end's rewrite without the charts the run left empty, single-step or clipped, with the lines TensorBoard
    could not label drawn above a base: it must be exactly what ``update_dashboards`` gives these logs."""
    from lightning_memkit.tensorboard.dashboard import read_layout, read_run_scalars
    from lightning_memkit.tensorboard.layout import layout_from_tags
    from lightning_memkit.tensorboard.readable import readable_layout

    layouts = read_layouts(log_dir)
    if len(layouts) == 2:
        scalars = read_run_scalars(log_dir)
        steps = {tag: len({s for s, _ in points}) for tag, points in scalars.items()}
        assert (
            layouts[1] != layouts[0]
            and read_layout(log_dir) == readable_layout(layout_from_tags(steps), {"run": scalars})[0]
        )
        return 1
    return len(layouts)


class _OtherMemkitCallback(Callback):
    """Stands for a second memkit callback (LayerTrace, ...): it registers the dashboard too."""

    def __init__(self):
        self.registered = None

    def on_fit_start(self, trainer, pl_module):
        self.registered = register_dashboard(trainer)


def test_layout_written_once_per_run_with_several_callbacks(tmp_path):
    first, last = _OtherMemkitCallback(), _OtherMemkitCallback()
    logger = TensorBoardLogger(str(tmp_path), name="run", version=0)
    trainer = make_trainer(tmp_path, max_steps=2, logger=logger, callbacks=[first, MemoryTracker(verbose=False), last])
    trainer.fit(LinearStack())
    assert first.registered is True and last.registered is False
    assert register_dashboard(trainer) is False
    assert _layout_events(logger.log_dir) == 1
    # a second fit into a new version is a new run: it gets its own layout
    logger2 = TensorBoardLogger(str(tmp_path), name="run", version=1)
    trainer2 = make_trainer(tmp_path, max_steps=2, logger=logger2, callbacks=[MemoryTracker(verbose=False)])
    trainer2.fit(LinearStack())
    assert _layout_events(logger2.log_dir) == 1
    # a notebook re-run: the log dir is deleted and a new logger writes there again: it needs its layout again
    shutil.rmtree(logger2.log_dir)
    logger3 = TensorBoardLogger(str(tmp_path), name="run", version=1)
    make_trainer(tmp_path, max_steps=2, logger=logger3, callbacks=[MemoryTracker(verbose=False)]).fit(LinearStack())
    assert _layout_events(logger3.log_dir) == 1


def test_no_tensorboard_logger_is_skipped_silently(tmp_path, recwarn):
    other = _OtherMemkitCallback()
    tracker = MemoryTracker(verbose=False)
    trainer = make_trainer(tmp_path, max_steps=2, logger=CSVLogger(str(tmp_path)), callbacks=[tracker, other])
    trainer.fit(LinearStack())
    assert other.registered is False
    assert not glob.glob(os.path.join(str(tmp_path), "**", "events.out.tfevents.*"), recursive=True)
    assert not [w for w in recwarn if "memkit" in str(w.message)]
    summary, history = read_records(tracker.records_path)
    assert summary.steps_measured == 2


def _peak_markers(figure):
    return [
        (list(line.get_xdata()), list(line.get_ydata()), ax)
        for ax in figure.axes
        for line in ax.get_lines()
        if line.get_color() == PEAK_COLOR
    ]


def test_figure_marks_the_records_peak_with_title_units_legend():
    history = [
        StepReading(
            step=s,
            peak_tensor_bytes=(s + 1) * MiB,
            tensor_bytes=MiB // 2,
            host_rss_bytes=300 * MiB,
            host_peak_rss_bytes=310 * MiB,
        )
        for s in range(5)
    ]
    history.append(StepReading(step=4, stage="validate", peak_tensor_bytes=9 * MiB))
    summary = RunSummary(device="cpu")
    for reading in history:
        summary.update(reading)
    figure = memory_per_step_figure(summary, history)
    markers = _peak_markers(figure)
    assert len(markers) == 1
    xs, ys, ax = markers[0]
    assert (xs, ys) == ([summary.peak_step], [summary.peak_bytes / MiB]) == ([4], [9.0])
    assert "validate" in "".join(t.get_text() for t in ax.texts) and "9.00 MiB" in "".join(
        t.get_text() for t in ax.texts
    )
    assert figure._suptitle.get_text() == "memkit: memory per step (cpu)"
    assert [a.get_ylabel() for a in figure.axes] == ["MiB", "MiB"]
    labels = [t.get_text() for t in figure.axes[0].get_legend().get_texts()]
    assert labels == [
        "tensors: peak (per step, exact)",
        "tensors: peak (validation run)",
        "tensors: live at step end (exact)",
    ]
    assert figure.axes[1].get_legend() is not None and figure.axes[-1].get_xlabel() == "training step"


def test_figure_marks_a_cuda_peak_on_the_allocator_panel():
    history = [
        StepReading(
            step=s,
            allocated_bytes=MiB,
            peak_allocated_bytes=(3 - abs(s - 2)) * MiB,
            reserved_bytes=4 * MiB,
            peak_reserved_bytes=4 * MiB,
        )
        for s in range(5)
    ]
    summary = RunSummary(device="cuda:0")
    for reading in history:
        summary.update(reading)
    [(xs, ys, _)] = _peak_markers(memory_per_step_figure(summary, history))
    assert (xs, ys) == ([2], [3.0])


def test_figure_without_readings():
    figure = memory_per_step_figure(RunSummary(), [])
    assert "no readings" in [t.get_text() for t in figure.axes[0].texts]


def test_layer_trace_alone_writes_no_charts_but_its_figure_and_tables(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(str(tmp_path), name="run", version=0)
    trainer = make_trainer(tmp_path, max_steps=3, logger=logger, callbacks=[LayerTrace(at_steps=(1, 2))])
    trainer.fit(LinearStack(optimizer="adam"))
    assert read_layouts(logger.log_dir) == []  # its values are single steps: no chart of dots at one step
    tags = set(read_scalars(logger.log_dir))
    assert {"memory/trace/peak/parameters_MiB", "memory/trace/peak/activations_MiB", "memory/trace/peak_MiB"} <= tags
    accumulator = EventAccumulator(logger.log_dir, size_guidance={"images": 0, "tensors": 0})
    accumulator.Reload()
    assert [e.step for e in accumulator.Images("memory/trace/figure")] == [1, 2]
    assert [e.step for e in accumulator.Tensors("memory/trace/categories/text_summary")] == [1, 2]


def test_memory_tracker_with_layer_trace_one_layout_with_both(tmp_path):
    logger = TensorBoardLogger(str(tmp_path), name="run", version=0)
    trainer = make_trainer(
        tmp_path, max_steps=3, logger=logger, callbacks=[LayerTrace(at_steps=(1,)), MemoryTracker(verbose=False)]
    )
    trainer.fit(LinearStack())
    layout = read_layouts(logger.log_dir)[-1]  # what TensorBoard shows: the last one
    assert list(layout) == ["memkit: memory per step"]
    tags = set(read_scalars(logger.log_dir))
    for category in layout.values():  # limit_val_batches=0: no validation chart, every chart has lines
        for title, regexes in category.items():
            assert {t for t in tags for r in regexes if re.match(r, t)}, title


class _AsksForCompare(Callback):
    memkit_dashboard_options = {"compare": True}


def test_a_callback_can_ask_for_the_compare_charts(tmp_path):
    logger = TensorBoardLogger(str(tmp_path), name="baseline", version="")
    trainer = make_trainer(
        tmp_path, max_steps=2, logger=logger, callbacks=[MemoryTracker(verbose=False), _AsksForCompare()]
    )
    trainer.fit(LinearStack())
    layout = read_layouts(logger.log_dir)[0]  # the one written at fit start
    assert layout == {
        "memkit: modes compared": {
            "modes overlaid: tensor step peak, exact (MiB)": ["^memory/train/peak_tensor_MiB$"],
            "modes overlaid: live tensors at step end, exact (MiB)": ["^memory/train/tensor_MiB$"],
            "modes overlaid: host RSS at step end (MiB)": ["^memory/train/host_rss_MiB$"],
        }
    }
