"""Every dashboard chart is readable at a glance: the rules of ``check_dashboard`` on real logs.

The rules (lightning_memkit/tensorboard/rules.py): every chart has data; at most 3 lines per run;
not only single-step lines; no line 100x bigger than another non-zero one in the same chart; every
line inside the y range TensorBoard draws with its default settings (smoothing 0.6, outliers ignored).

Checked on logs memkit writes here on CPU (a fit with MemoryTracker + LayerTrace; a compare run)
and on the shared H100 logs (tests/data/h100_logs, see its README). Those were written with the old
layout: it must break the rules (so the checker can fail), and today's layout built from their
tags with ``layout_from_tags`` (what ``update_dashboards`` writes into old logs, i.e. what a user
sees after upgrading) must keep them, read back through a real TensorBoard server too.
"""

from __future__ import annotations

import glob
import itertools
import os
import re
import shutil

import pytest
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_memkit import MemoryTracker
from lightning_memkit.callbacks.layer_trace import LayerTrace
from lightning_memkit.modes.compare_result import read_compare
from lightning_memkit.modes.comparison import compare_modes
from lightning_memkit.records import RECORDS_FILENAME, read_records
from lightning_memkit.tensorboard.axis import tensorboard_y_range
from lightning_memkit.tensorboard.dashboard import device_table, read_layout, update_dashboards
from lightning_memkit.tensorboard.figures import PEAK_COLOR, compare_figures, memory_per_step_figure
from lightning_memkit.tensorboard.layout import MAX_SERIES_PER_CHART, dashboard_layout, layout_from_tags, layout_tags
from lightning_memkit.tensorboard.readable import FRAME_TITLE, readable_layout
from lightning_memkit.tensorboard.rules import check_chart, check_dashboard
from lightning_memkit.tensorboard.tags import DASHBOARD_TAG_PART, is_frame_tag
from lightning_memkit.units import format_bytes
from tests.helpers.event_files import read_scalars
from tests.helpers.models import LinearStack
from tests.helpers.paths import DATA_DIR
from tests.helpers.trainers import make_trainer

H100 = os.path.join(DATA_DIR, "h100_logs")
H100_DEMO = os.path.join(H100, "gl")
H100_COMPARE = os.path.join(H100, "gc")


def run_dirs(root):
    return sorted(
        {os.path.dirname(p) for p in glob.glob(os.path.join(root, "**", "events.out.tfevents.*"), recursive=True)}
    )


def scalars_by_run(root):
    """``{run name: {tag: [(step, value)]}}`` of every run under ``root``, read with TensorBoard's reader."""
    return {os.path.relpath(d, root): read_scalars(d) for d in run_dirs(root)}


def steps_per_tag(scalars):
    return {tag: len({step for step, _ in points}) for tag, points in scalars.items()}


def todays_layout(scalars, compare=False):
    """What ``update_dashboards`` gives a run that logged ``scalars``: the layout, and the scalars with its rebased
    lines."""
    own = {t: v for t, v in scalars.items() if not t.startswith(f"memory/{DASHBOARD_TAG_PART}/")}
    layout, lines = readable_layout(layout_from_tags(steps_per_tag(own), compare=compare), {"run": own})
    return layout, {**own, **lines.get("run", {})}


def todays_compare_layout(runs):
    """What ``update_dashboards`` gives every mode's run of a compare root: one layout for all (one base per chart)."""
    own = {
        run: {t: v for t, v in scalars.items() if not t.startswith(f"memory/{DASHBOARD_TAG_PART}/")}
        for run, scalars in runs.items()
    }
    modes = {run: scalars for run, scalars in own.items() if any(t.startswith("memory/train/") for t in scalars)}
    layout, lines = readable_layout(layout_from_tags(steps_per_tag(next(iter(modes.values()))), compare=True), modes)
    return layout, {run: {**scalars, **lines.get(run, {})} for run, scalars in own.items()}


def check_rebased_lines(layout, scalars):
    """Every rebased line a layout draws is its logged line minus the base its chart's title names, at the same steps.

    Returns how many lines were checked."""
    checked = 0
    for title, regexes in layout_tags(layout).items():
        for tag in sorted(t for t in scalars for r in regexes if re.match(r, t)):
            if not tag.startswith(f"memory/{DASHBOARD_TAG_PART}/") or is_frame_tag(tag):
                continue
            above = re.search(r"\((B|KiB|MiB|GiB) above ([0-9,.]+) (B|KiB|MiB|GiB)", title)
            if above:
                unit, base = above.group(1, 2)
                source = tag.replace(f"/{DASHBOARD_TAG_PART}/", "/").replace(
                    f"_{unit}_above_{base.replace(',', '')}_{unit}", "_MiB"
                )
            else:  # drawn in a larger unit, no base: "(GiB)"
                unit, base = re.search(r"\((GiB)\b", title).group(1), "0"
                source = tag.replace(f"/{DASHBOARD_TAG_PART}/", "/").replace(f"_{unit}", "_MiB")
            factor = {"B": 2**20, "KiB": 1024, "MiB": 1, "GiB": 1 / 1024}[unit]
            assert [s for s, _ in scalars[tag]] == [s for s, _ in scalars[source]], tag
            for (_, rebased), (_, value) in zip(scalars[tag], scalars[source], strict=True):
                assert rebased == pytest.approx(value * factor - float(base.replace(",", "")), abs=1e-5), (tag, title)
            assert min(v for _, v in scalars[tag]) >= -1e-5  # the base is at or below every value
            checked += 1
    return checked


def check_frame_lines(layout, scalars):
    """Every framed chart (its title ends with FRAME_TITLE) draws two flat lines, named by their values, at exactly the
    lowest and the highest value of its other lines, at their steps; no other chart has them. Returns how many charts
    had frames."""
    framed = 0
    for title, regexes in layout_tags(layout).items():
        tags = sorted(t for t in scalars if any(re.match(r, t) for r in regexes))
        frames = [t for t in tags if is_frame_tag(t)]
        lines = [t for t in tags if not is_frame_tag(t)]
        if not title.endswith(FRAME_TITLE):
            assert not frames, (title, frames)
            continue
        values = [v for t in lines for _, v in scalars[t]]
        steps = sorted({s for t in lines for s, _ in scalars[t]})
        [low] = [t for t in frames if "/low_" in t]
        [high] = [t for t in frames if "/high_" in t]
        for tag, expected in ((low, min(values)), (high, max(values))):
            assert [s for s, _ in scalars[tag]] == steps, tag
            assert all(v == pytest.approx(expected, rel=1e-6, abs=1e-5) for _, v in scalars[tag]), (
                tag,
                expected,
            )  # float32 events
            assert float(re.search(r"/(low|high)_([0-9.]+)_(B|KiB|MiB|GiB)$", tag).group(2)) == pytest.approx(
                expected, rel=1e-6, abs=1e-5
            )
        framed += 1
    return framed


def matched(layout, tags):
    return {
        title: sorted(t for t in tags for r in regexes if re.match(r, t))
        for title, regexes in layout_tags(layout).items()
    }


# ---------------------------------------------------------------------------------------------- H100 logs
def test_the_h100_runs_old_layout_breaks_the_rules():
    """What the H100 screenshots showed, found by the checker: the checker can fail."""
    demo = check_dashboard(read_layout(run_dirs(H100_DEMO)[0]), scalars_by_run(H100_DEMO))
    assert any("device_total_MiB" in p and "is 474x" in p and "flat" in p for p in demo), demo
    assert any(
        p.startswith('"layer trace: categories at the traced step\'s peak (MiB)": every line is a single step')
        for p in demo
    )
    assert any("'CUDA allocator: allocated vs reserved vs step peak (MiB)': 4 lines" in p for p in demo)
    compare_runs = scalars_by_run(H100_COMPARE)
    compare = check_dashboard(read_layout(os.path.join(H100_COMPARE, "baseline")), compare_runs)
    assert sum("'NVML device memory vs what the allocator holds (MiB)': 4 lines" in p for p in compare) == 4  # 16 lines
    assert any(p.startswith("'validation runs: peaks (MiB)': every line is a single step") for p in compare)


# Host RSS of a long-lived process: flat within a MiB of hundreds of MiB, its step peak equal to its step end (nothing
# grew inside the steps). Drawn as they are, both would break the tick rule: 0.9 MiB above its base is 921.6 KiB,
# and an axis up to 1,000 KiB labels its top "1e+3"; the chart reads 0 to 0.9 MiB above the base instead.
FLAT_HOST_RSS = {
    "a step of 0.9 MiB at 685 MiB, 100 steps": [685.0] * 50 + [685.9] * 50,
    "one bump of 0.9 MiB at 1,503.7 MiB, 2 steps": [1503.7, 1504.6],
    "one bump of 0.9 MiB at 685.3 MiB, 2 steps": [685.3, 686.2],
    "exactly flat at 685.3 MiB": [685.2999877929688] * 31,
}


@pytest.mark.parametrize("case", sorted(FLAT_HOST_RSS))
def test_a_nearly_flat_host_rss_line_is_drawn_by_the_rules(case):
    values = FLAT_HOST_RSS[case]
    logged = {
        "memory/train/host_rss_MiB": list(enumerate(values)),
        "memory/train/host_peak_rss_MiB": list(enumerate(values)),
    }
    layout, scalars = todays_layout(logged)
    assert check_dashboard(layout, {"run": scalars}) == []
    [title] = [t for t in layout_tags(layout) if t.startswith("host RSS")]
    drawn = matched(layout, scalars)[title]
    assert len([t for t in drawn if not is_frame_tag(t)]) == 2, drawn  # both readings stay on the chart
    check_rebased_lines(layout, scalars)


def test_the_y_range_of_float32_neighbours_is_computed():
    """Smoothed float32 neighbours of 1,503.7 MiB: d3's nice() rounds the padded domain to nothing on the way (its step
    is NaN and it stops); ours raised ValueError from math.log10 inside readable_layout at fit end."""
    low, high = tensorboard_y_range([1503.7001953124998, 1503.7001953125, 1503.7002575932715])
    # the top value lies above the 95th percentile (outliers ignored): the range is the two others', padded
    assert low <= 1503.7001953124998 < 1503.7001953125 <= high < 1503.7002575932715


def test_h100_demo_with_todays_layout_keeps_the_rules():
    [run] = run_dirs(H100_DEMO)
    logged = read_scalars(run)
    # the charts chosen from the tags alone: host RSS moves by 13 MiB around 1,500 MiB, and TensorBoard's
    # three-digit labels read 1.5e+3 or 1.51e+3 on every tick
    # and NVML's chart reaches 1,403 MiB, which TensorBoard labels "1e+3" ... "1.5e+3" (the screenshot's NVML axis)
    host_ticks = "['1.5e+3', '1.5e+3', '1.5e+3', '1.51e+3', '1.51e+3', '1.51e+3', '1.51e+3', '1.51e+3', '1.51e+3']"
    assert check_dashboard(layout_from_tags(steps_per_tag(logged)), {"demo": logged}) == [
        "'device (NVML), top to bottom: all processes, this process, allocator reserved (MiB)': the y axis over "
        "[100, 1500] labels ticks ['1e+3', '1.1e+3', '1.2e+3', '1.3e+3', '1.4e+3', '1.5e+3'] in exponent notation "
        "(values of 1,000 or more): draw them in a larger unit",
        "'host RSS, top to bottom: step peak, step end (MiB)': the y axis over [1503.5, 1507.5] labels its ticks "
        f"{host_ticks}: three significant digits cannot tell them apart",
        "'host RSS, top to bottom: step peak, step end (MiB)': the y axis over [1503.5, 1507.5] labels ticks "
        f"{host_ticks} in exponent notation (values of 1,000 or more): draw them in a larger unit",
    ]
    layout, scalars = todays_layout(logged)
    assert check_dashboard(layout, {"demo": scalars}) == []
    assert check_rebased_lines(layout, scalars) == 5
    lines = matched(layout, scalars)
    assert lines["host RSS, top to bottom: step peak, step end (MiB above 1,490 MiB)"] == [
        "memory/dashboard/train/host_peak_rss_MiB_above_1490_MiB",
        "memory/dashboard/train/host_rss_MiB_above_1490_MiB",
    ]
    # NVML's chart in GiB (1.37 GiB, not "1.4e+3"); the logged _MiB tags are unchanged
    assert lines["device (NVML), top to bottom: all processes, this process, allocator reserved (GiB)"] == [
        "memory/dashboard/train/device_used_GiB",
        "memory/dashboard/train/process_device_GiB",
        "memory/dashboard/train/reserved_GiB",
    ]
    assert (
        max(v for _, v in scalars["memory/dashboard/train/device_used_GiB"])
        < 1.4
        < max(v for _, v in scalars["memory/train/device_used_MiB"]) / 1000
    )
    assert lines["CUDA step peak, top to bottom: reserved, allocated (MiB)"] == [
        "memory/train/peak_allocated_MiB",
        "memory/train/peak_reserved_MiB",
    ]
    assert lines["validation runs, top to bottom: CUDA peak reserved, peak allocated (MiB)"] == [
        "memory/val/peak_allocated_MiB",
        "memory/val/peak_reserved_MiB",
    ]
    drawn = {
        re.sub(r"_(B|KiB|MiB|GiB)(_above_[0-9.]+_(B|KiB|MiB|GiB))?$", "_MiB", t.replace("/dashboard/", "/"))
        for ts in lines.values()
        for t in ts
    }
    # the capacity and the layer trace's one-step values are on no chart ...
    assert not any(t == "memory/train/device_total_MiB" or t.startswith("memory/trace/") for t in drawn)
    # ... every other per-step training quantity is (active is allocated plus rounding: in the readings table)
    assert {t for t in scalars if t.startswith("memory/train/")} - drawn == {
        "memory/train/device_total_MiB",
        "memory/train/active_MiB",
    }
    # the capacity and the headroom are numbers, from NVML's own readings
    summary, history = read_records(os.path.join(run, RECORDS_FILENAME))
    total = max(r.device_total_bytes for r in history)
    used = max(r.device_used_bytes for r in history)
    table = device_table(history)
    assert f"capacity (NVML total)  {format_bytes(total)}".replace("  ", " ") in re.sub(" +", " ", table)
    assert f"headroom at that step {format_bytes(total - used)} ({(total - used) / total:.1%} of capacity)" in re.sub(
        " +", " ", table
    )
    process = max(history, key=lambda r: r.process_device_bytes)
    assert (
        f"of which outside the allocator {format_bytes(process.process_device_bytes - process.reserved_bytes)}"
        in re.sub(" +", " ", table)
    )


def test_h100_compare_with_todays_layout_keeps_the_rules():
    runs = scalars_by_run(H100_COMPARE)
    modes = [name for name, scalars in runs.items() if any(t.startswith("memory/train/") for t in scalars)]
    assert sorted(modes) == ["amp", "amp+checkpoint", "baseline", "checkpoint"]
    layout, runs = todays_compare_layout(runs)
    assert list(layout) == ["memkit: modes compared"]
    assert check_dashboard(layout, runs) == []
    for title, regexes in layout_tags(layout).items():  # one line per mode's run, in every chart
        for mode in modes:
            assert len(matched({"c": {title: ["Multiline", regexes]}}, runs[mode])[title]) == 1, (title, mode)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_h100_logs_served_by_tensorboard_with_todays_layout(tmp_path):
    """``update_dashboards`` on a copy of the old logs; a real ``tensorboard`` serves today's layout and every chart's
    data."""
    from lightning_memkit.tensorboard.server import TensorBoardServer

    for name, compare in (("gl", False), ("gc", True)):
        root = str(tmp_path / name)
        shutil.copytree(os.path.join(H100, name), root)
        updated = update_dashboards(root)
        runs = scalars_by_run(root)
        assert {os.path.relpath(d, root) for d in updated} == {
            n for n, s in runs.items() if any(t.startswith("memory/train/") for t in s)
        }
        expected = next(iter(updated.values()))
        assert all(layout == expected for layout in updated.values())
        assert expected == (todays_compare_layout(runs) if compare else todays_layout(next(iter(runs.values()))))[0]
        with TensorBoardServer(root, startup_timeout_s=90) as server:
            served = server.get_json("/data/plugin/custom_scalars/layout")
            charts = {
                c["title"]: {ch["title"]: ["Multiline", ch["multiline"]["tag"]] for ch in c["chart"]}
                for c in served["category"]
            }
            assert charts == expected  # the new layout replaced the one written at fit start
            served_runs = {}
            for regexes in layout_tags(charts).values():
                for run in runs:
                    for regex in regexes:  # what the Custom Scalars tab fetches for this chart
                        answer = server.get_json("/data/plugin/custom_scalars/scalars", {"run": run, "tag": regex})
                        for tag, events in answer["tag_to_events"].items():
                            served_runs.setdefault(run, {})[tag] = [(step, value) for _, step, value in events]
            assert check_dashboard(charts, served_runs) == []


# ---------------------------------------------------------------------------------------------- memkit's own CPU runs
@pytest.fixture(scope="module")
def cpu_fit(tmp_path_factory):
    """A real CPU fit: MemoryTracker + LayerTrace, validation after steps 2, 5 and 8."""
    root = tmp_path_factory.mktemp("rules_fit")
    logger = TensorBoardLogger(str(root), name="run", version=0)
    trainer = make_trainer(
        root,
        max_steps=9,
        logger=logger,
        limit_val_batches=1,
        val_check_interval=3,
        check_val_every_n_epoch=None,
        callbacks=[MemoryTracker(verbose=False), LayerTrace(at_steps=(1,), verbose=False)],
    )
    trainer.fit(LinearStack(val_batches=1, optimizer="adam"))
    return logger.log_dir


def test_cpu_fit_with_tracker_and_trace_keeps_the_rules(request, rerun_in_own_process):
    """The rules on memkit's own CPU fit, in a fresh process: the tracker's tensor readings are the whole process's,
    and what earlier tests in a worker leave alive would lift them out of the chart's empty range asserted below."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if rerun_in_own_process():
        return
    cpu_fit = request.getfixturevalue("cpu_fit")

    scalars = read_scalars(cpu_fit)
    layout = read_layout(cpu_fit)
    assert check_dashboard(layout, {"run": scalars}) == []
    assert layout == todays_layout(scalars)[0]  # written at fit time = rebuilt from the logged scalars
    assert list(layout) == ["memkit: memory per step"]
    check_rebased_lines(layout, scalars)
    # each chart draws these logged lines, or the same lines above a base its title names
    check_frame_lines(layout, scalars)
    sources = {
        re.sub(r" \((B|KiB|MiB|GiB)( above [0-9,.]+ (B|KiB|MiB|GiB))?", " (MiB", title.removesuffix(FRAME_TITLE)): [
            re.sub(r"_(B|KiB|MiB|GiB)(_above_[0-9.]+_(B|KiB|MiB|GiB))?$", "_MiB", t.replace("/dashboard/", "/"))
            for t in tags
            if not is_frame_tag(t)
        ]
        for title, tags in matched(layout, scalars).items()
    }
    expected = {
        "tensors (exact): step peak (MiB)": ["memory/train/peak_tensor_MiB"],
        "tensors (exact): live at step end (MiB)": ["memory/train/tensor_MiB"],
        "host RSS, top to bottom: step peak, step end (MiB)": [
            "memory/train/host_peak_rss_MiB",
            "memory/train/host_rss_MiB",
        ],
        "validation runs, exact tensors, top to bottom: peak, live at end (MiB)": [
            "memory/val/peak_tensor_MiB",
            "memory/val/tensor_MiB",
        ],
    }
    # the accountant's peak is read on the first two steps (and one in ten after): two points, both under 1 MiB, which
    # TensorBoard draws in its empty chart's [0, 1] (test_a_sampled_peak_of_a_few_points_... has one it would clip)
    assert (
        len(scalars["memory/train/peak_tensor_MiB"]) == 2
        and max(v for _, v in scalars["memory/train/peak_tensor_MiB"]) < 1
    )
    assert sources == expected
    assert sorted({s for s, _ in scalars["memory/val/peak_tensor_MiB"]}) == [2, 5, 8]
    # the layer trace is one step: its scalars are logged but on no chart; its figure and tables are in Images and Text
    assert any(t.startswith("memory/trace/") for t in scalars)
    accumulator = EventAccumulator(cpu_fit, size_guidance={"images": 0, "tensors": 0})
    accumulator.Reload()
    assert "memory/trace/figure" in accumulator.Tags()["images"]
    assert {"memory/trace/categories/text_summary", "memory/trace/table/text_summary"} <= set(
        accumulator.Tags()["tensors"]
    )


def test_fit_end_drops_a_chart_the_run_left_single_step(tmp_path):
    """Validation is configured but runs once (after step 2 of 4): the validation chart would be a dot."""
    logger = TensorBoardLogger(str(tmp_path), name="run", version=0)
    trainer = make_trainer(
        tmp_path,
        max_steps=4,
        logger=logger,
        limit_val_batches=1,
        val_check_interval=3,
        check_val_every_n_epoch=None,
        callbacks=[MemoryTracker(verbose=False)],
    )
    trainer.fit(LinearStack(val_batches=1))
    scalars = read_scalars(logger.log_dir)
    assert [s for s, _ in scalars["memory/val/peak_tensor_MiB"]] == [2]
    layout = read_layout(logger.log_dir)  # what TensorBoard shows: the last layout of the run
    assert "validation runs, exact tensors, top to bottom: peak, live at end (MiB)" not in layout_tags(layout)
    assert check_dashboard(layout, {"run": scalars}) == []
    assert layout == todays_layout(scalars)[0]


class GrowingStep(LinearStack):
    """A step whose peak grows by 64 KiB per step (a scratch tensor sized by the step): every sampled peak differs."""

    def training_step(self, batch, batch_idx):
        import torch

        scratch = torch.ones(16384 * (self.global_step + 1))  # 64 KiB more each step, freed at step end
        return super().training_step(batch, batch_idx) + 0 * scratch[0]


@pytest.mark.timeout(300)
def test_a_sampled_peak_of_a_few_points_is_framed_at_fit_end(tmp_path, rerun_in_own_process):
    """The accountant's peak read on steps 0, 1, 11 and 21 of a 31-step run logged every step: TensorBoard's outlier
    clipping (5th to 95th percentile, on by default) cuts the ends of so short a line. The layout written at fit start
    draws it and breaks the rule; the one written at fit end (what TensorBoard shows) keeps the chart, drawn between two
    flat lines at its lowest and highest values (so the 5th-95th percentile range holds every point), and keeps every
    rule."""
    # The claim is the step-peak chart's; the run checks every chart, and host RSS depends on what earlier tests grew
    # (within 1 MiB of ~685 MiB after the suite: test_a_nearly_flat_host_rss_line_is_drawn_by_the_rules), so a fresh
    # process.
    if rerun_in_own_process():
        return
    from tests.helpers.event_files import read_layouts

    logger = TensorBoardLogger(str(tmp_path), name="run", version=0)
    trainer = make_trainer(tmp_path, max_steps=31, logger=logger, callbacks=[MemoryTracker(verbose=False)])
    trainer.fit(GrowingStep(optimizer="adam"))
    scalars = read_scalars(logger.log_dir)
    assert [s for s, _ in scalars["memory/train/peak_tensor_MiB"]] == [0, 1, 11, 21]
    peaks = [v for _, v in scalars["memory/train/peak_tensor_MiB"]]
    assert peaks == sorted(peaks) and len(set(peaks)) == 4
    assert len(scalars["memory/train/tensor_MiB"]) == 31
    first, last = (
        {c: {t: ["Multiline", r] for t, r in charts.items()} for c, charts in read_layouts(logger.log_dir)[0].items()},
        read_layout(logger.log_dir),
    )
    title = "tensors (exact): step peak (MiB)"
    assert title in layout_tags(first)
    problems = check_dashboard(first, {"run": scalars})
    assert any(
        p.startswith(f"{title!r}: ")
        and "points of memory/train/peak_tensor_MiB of run 'run' lie outside the y range" in p
        for p in problems
    ), problems
    assert title not in layout_tags(last) and check_dashboard(last, {"run": scalars}) == []
    framed = [t for t in layout_tags(last) if t.startswith("tensors (exact): step peak (") and t.endswith(FRAME_TITLE)]
    assert len(framed) == 1, layout_tags(last)  # the chart stays, framed
    assert check_frame_lines(last, scalars) >= 1
    assert last == todays_layout(scalars)[0]
    assert any(
        t.startswith("tensors (exact): live at step end") for t in layout_tags(last)
    )  # read every step: its chart stays


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_cpu_compare_run_keeps_the_rules(tmp_path):
    from lightning_memkit import zoo

    compare_modes(
        lambda: zoo.DemoTransformer(
            vocab_size=50, d_model=32, nhead=2, layers=3, dim_feedforward=64, seq_len=16, batch_size=8
        ),
        modes="baseline,checkpoint",
        max_steps=10,
        accelerator="cpu",
        root_dir=str(tmp_path),
        verbose=False,
    )
    runs = scalars_by_run(str(tmp_path))
    layouts = {name: read_layout(os.path.join(str(tmp_path), name)) for name in ("baseline", "checkpoint")}
    layout = layouts["baseline"]
    assert layouts["checkpoint"] == layout and list(layout) == ["memkit: modes compared"]
    assert check_dashboard(layout, runs) == []
    for title, lines in matched(layout, runs["baseline"]).items():
        assert len([t for t in lines if not is_frame_tag(t)]) == 1, title
        frames = [t for t in lines if is_frame_tag(t)]
        assert len(frames) == (2 if title.endswith(FRAME_TITLE) else 0), (title, frames)
        if frames:  # one frame for every mode: at the lowest and highest value of the chart's lines over all modes
            values = [
                v
                for run in ("baseline", "checkpoint")
                for t in matched(layout, runs[run])[title]
                if not is_frame_tag(t)
                for _, v in runs[run][t]
            ]
            assert sorted(float(re.search(r"_([0-9.]+)_(B|KiB|MiB|GiB)$", t).group(1)) for t in frames) == [
                pytest.approx(min(values), rel=1e-6, abs=1e-5),
                pytest.approx(max(values), rel=1e-6, abs=1e-5),
            ]
            assert all(set(matched(layout, runs[run])[title]) >= set(frames) for run in ("baseline", "checkpoint"))
    assert layout == todays_compare_layout(runs)[0]
    for scalars in runs.values():  # the lines fit end wrote above a base: each the logged one minus that base
        check_rebased_lines(layout, scalars)


# --------------------------------------------------------------------------------- figures (Images tab, memkit report)
def figure_problems(figure, runs_are_lines=False):
    """check_chart on every axes of a matplotlib figure: its lines (the red peak marker is a point of one of them)."""
    problems = []
    for ax in figure.axes:
        series = {}
        for line in ax.get_lines():
            if line.get_color() == PEAK_COLOR:
                continue
            label = line.get_label()
            series[(label if runs_are_lines else "figure", label)] = list(
                zip(line.get_xdata(), line.get_ydata(), strict=True)
            )
        if not series:  # a bar chart (one value per mode: single-step data, drawn as bars): only the scale rule
            heights = [patch.get_height() for patch in ax.patches]
            assert heights and max(heights) <= 100 * min(heights), heights
            continue
        problems += check_chart(
            ax.get_title(loc="left") or ax.get_title() or figure._suptitle.get_text(), series, tensorboard_y_range=False
        )
        assert len(series) <= (len(series) if runs_are_lines else MAX_SERIES_PER_CHART)
    return problems


def test_memory_per_step_figures_keep_the_rules(cpu_fit):
    summary, history = read_records(os.path.join(H100_DEMO, "demo-transformer", "version_0", RECORDS_FILENAME))
    figure = memory_per_step_figure(summary, history)
    assert figure_problems(figure) == []
    assert [ax.get_title(loc="left") for ax in figure.axes] == [
        "CUDA step peak, top to bottom: reserved, allocated (MiB)",
        "CUDA at step end, top to bottom: reserved, allocated (MiB)",
        "device (NVML), top to bottom: all processes, this process, allocator reserved (MiB)",
        "host RSS, top to bottom: step peak, step end (MiB)",
    ]
    cpu_summary, cpu_history = read_records(os.path.join(cpu_fit, RECORDS_FILENAME))
    assert figure_problems(memory_per_step_figure(cpu_summary, cpu_history)) == []
    compare = read_compare(H100_COMPARE)
    for figure in compare_figures(compare).values():
        assert figure_problems(figure, runs_are_lines=True) == []


def test_memkit_report_of_the_h100_logs_has_the_device_numbers(tmp_path):
    from lightning_memkit.cli import main

    out = tmp_path / "report.html"
    assert main(["report", H100, "-o", str(out)]) == 0
    page = out.read_text()
    _, history = read_records(os.path.join(H100_DEMO, "demo-transformer", "version_0", RECORDS_FILENAME))
    import html

    assert html.escape(device_table(history)) in page


def test_memkit_report_update_dashboards_gives_old_logs_todays_layout(tmp_path, capsys):
    from lightning_memkit.cli import main

    root = tmp_path / "gl"
    shutil.copytree(H100_DEMO, root)
    [run] = run_dirs(str(root))
    old = read_layout(run)
    assert main(["report", str(root), "-o", str(tmp_path / "r.html"), "--update-dashboards"]) == 0
    assert "updated the dashboard of demo-transformer/version_0: 7 chart(s)" in capsys.readouterr().out
    layout = read_layout(run)
    assert layout != old and layout == todays_layout(read_scalars(run))[0]
    assert (
        check_rebased_lines(layout, read_scalars(run)) == 5
    )  # host RSS's two lines above 1,490 MiB, NVML's three in GiB
    logged = {t: v for t, v in read_scalars(run).items() if not t.startswith(f"memory/{DASHBOARD_TAG_PART}/")}
    assert logged == read_scalars(os.path.join(H100_DEMO, "demo-transformer", "version_0"))  # nothing else changed
    files = sorted(os.listdir(run))
    assert update_dashboards(str(root)) == {} and sorted(os.listdir(run)) == files  # a second call adds nothing


def top_to_bottom(regex):
    """The tags a "top to bottom" chart's regex names, in its order: ``^memory/train/(a|b)$`` -> [a, b]."""
    head, alternatives = re.match(r"\^(.*)/\((.*)\)\$$", regex).groups()
    return [head.replace("\\", "") + "/" + name.replace("\\", "") for name in alternatives.split("|")]


@pytest.mark.parametrize("root", [H100_DEMO, H100_COMPARE, "cpu"])
def test_lines_lie_top_to_bottom_as_the_titles_say(root, cpu_fit):
    """Within a run TensorBoard tells lines apart by marker shape only: the title's order is the lines' order, at every
    step."""
    runs = {"cpu": read_scalars(cpu_fit)} if root == "cpu" else scalars_by_run(root)
    checked = 0
    charts = {**layout_tags(dashboard_layout(cuda=True)), **layout_tags(dashboard_layout(cuda=False))}
    for title, [regex] in charts.items():
        if "top to bottom" not in title:
            continue
        order = top_to_bottom(regex)
        for scalars in runs.values():
            if not all(tag in scalars for tag in order):
                continue
            values = [dict(scalars[tag]) for tag in order]
            for step in set.intersection(*(set(v) for v in values)):
                assert all(upper[step] >= lower[step] for upper, lower in itertools.pairwise(values)), (
                    title,
                    step,
                    order,
                )
                checked += 1
    assert checked >= 10  # steps x charts compared


def test_the_device_table_goes_to_the_text_tab(tmp_path, cpu_fit):
    """log_memory_summary (MemoryTracker's fit end) on the H100 run's records: capacity and headroom as text, next to
    the summary."""
    from lightning.pytorch import Trainer
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lightning_memkit.tensorboard.dashboard import DEVICE_TEXT_TAG, log_memory_summary, markdown_code

    summary, history = read_records(os.path.join(H100_DEMO, "demo-transformer", "version_0", RECORDS_FILENAME))
    logger = TensorBoardLogger(str(tmp_path), name="run", version=0)
    trainer = Trainer(logger=logger, accelerator="cpu", enable_progress_bar=False, enable_model_summary=False)
    assert log_memory_summary(trainer, summary, history, step=60)
    accumulator = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0})
    accumulator.Reload()
    [event] = accumulator.Tensors(f"memory/{DEVICE_TEXT_TAG}/text_summary")
    assert event.step == 60 and event.tensor_proto.string_val[0].decode() == markdown_code(device_table(history))
    # no NVML reading (the CPU fit): no device table
    _, cpu_history = read_records(os.path.join(cpu_fit, RECORDS_FILENAME))
    assert cpu_history and device_table(cpu_history) is None
