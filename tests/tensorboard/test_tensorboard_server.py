"""A real `tensorboard --logdir` server on a real Trainer run's logs: what a user's browser gets.

Reads, through TensorBoard's HTTP API, the memkit scalars, the custom-scalars layout, the
memory figure (an image) and the summary table (text), and checks them against the records
MemoryTracker wrote (exact float32 of bytes / 2**20).
"""

from __future__ import annotations

import html
import re
import socket
import struct

import numpy as np
import pytest
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_memkit import MemoryTracker
from lightning_memkit.records import read_records
from lightning_memkit.summary_table import format_summary
from lightning_memkit.tensorboard.dashboard import FIGURE_TAG, SUMMARY_TEXT_TAG
from lightning_memkit.tensorboard.figures import figure_rgb, memory_per_step_figure
from lightning_memkit.tensorboard.layout import dashboard_layout, prune_layout
from lightning_memkit.tensorboard.readable import FRAME_TITLE, readable_layout
from lightning_memkit.tensorboard.rules import check_dashboard
from lightning_memkit.tensorboard.server import TensorBoardServer
from lightning_memkit.tensorboard.tags import DASHBOARD_TAG_PART
from lightning_memkit.units import MiB
from tests.helpers.models import LinearStack
from tests.helpers.trainers import make_trainer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def run_logs(tmp_path_factory):
    """A 6-step CPU fit with MemoryTracker, validation every 3 steps, a TensorBoardLogger."""
    root = tmp_path_factory.mktemp("tb_server")
    model = LinearStack(val_batches=1, log_loss=True)
    logger = TensorBoardLogger(str(root), name="run", version=0)
    tracker = MemoryTracker(verbose=False)
    trainer = make_trainer(
        root,
        max_steps=6,
        logger=logger,
        callbacks=[tracker],
        limit_val_batches=1,
        val_check_interval=3,
        check_val_every_n_epoch=None,
        log_every_n_steps=1,
    )
    trainer.fit(model)
    summary, history = read_records(tracker.records_path)
    return str(root), "run/version_0", summary, history


@pytest.fixture(scope="module")
def server(run_logs):
    tensorboard = TensorBoardServer(run_logs[0], startup_timeout_s=90)
    try:
        tensorboard.start()
        yield tensorboard
    finally:
        tensorboard.stop()


def test_server_is_local_only():
    command = TensorBoardServer("x", port=1234).command()
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert "--bind_all" not in command


def test_scalars_through_http_equal_the_records(server, run_logs):
    _, run, summary, history = run_logs
    tags = server.get_json("/data/plugin/scalars/tags")[run]
    for name in ("tensor", "peak_tensor", "host_rss", "host_peak_rss"):
        assert f"memory/train/{name}_MiB" in tags
        assert f"memory/val/{name}_MiB" in tags
    assert "memory/summary/run_peak_MiB" in tags
    points = server.get_json("/data/plugin/scalars/scalars", {"run": run, "tag": "memory/train/tensor_MiB"})
    train = [r for r in history if r.stage == "train"]
    assert [step for _, step, _ in points] == [r.step for r in train] == list(range(6))
    # TensorBoard stores float32: the served value is exactly float32(bytes / 2**20)
    assert [value for _, _, value in points] == [float(np.float32(r.tensor_bytes / MiB)) for r in train]
    peaks = server.get_json("/data/plugin/scalars/scalars", {"run": run, "tag": "memory/train/peak_tensor_MiB"})
    measured = [r for r in train if r.peak_tensor_bytes is not None]  # every step, or sampled: as the records say
    assert [(step, value) for _, step, value in peaks] == [
        (r.step, float(np.float32(r.peak_tensor_bytes / MiB))) for r in measured
    ]
    run_peak = server.get_json("/data/plugin/scalars/scalars", {"run": run, "tag": "memory/summary/run_peak_MiB"})
    assert [value for _, _, value in run_peak] == [float(np.float32(summary.peak_bytes / MiB))]


def test_custom_scalars_layout_has_no_empty_chart(server, run_logs):
    _, run, _, _ = run_logs
    layout = server.get_json("/data/plugin/custom_scalars/layout")
    # the layout written at fit start, less the charts fit end found single-step (the accountant's
    # peak may be sampled: in 6 steps it may be read once) or clipped, readable for the values logged
    logged = {
        tag: [
            (step, value)
            for _, step, value in server.get_json("/data/plugin/scalars/scalars", {"run": run, "tag": tag})
        ]
        for tag in server.get_json("/data/plugin/scalars/tags")[run]
        if not tag.startswith(f"memory/{DASHBOARD_TAG_PART}/")
    }
    steps = {tag: len({step for step, _ in points}) for tag, points in logged.items()}
    expected = readable_layout(
        prune_layout(dashboard_layout(cuda=False, tensors=True, host=True, validation=True), steps), {run: logged}
    )[0]
    [host_title] = [
        t for t in expected["memkit: memory per step"] if t.startswith("host RSS, top to bottom: step peak, step end (")
    ]
    assert [c["title"] for c in layout["category"]] == list(expected)
    charts = {chart["title"]: chart["multiline"]["tag"] for c in layout["category"] for chart in c["chart"]}
    assert charts == {title: spec[1] for category in expected.values() for title, spec in category.items()}
    layout_as_written = expected
    tags = set(server.get_json("/data/plugin/scalars/tags")[run])
    for title, regexes in charts.items():
        for regex in regexes:
            # what the Custom Scalars tab fetches for this chart
            served = server.get_json("/data/plugin/custom_scalars/scalars", {"run": run, "tag": regex})
            assert served["regex_valid"], regex
            matched = set(served["tag_to_events"])
            assert matched and matched == {t for t in tags if re.match(regex, t)}, (title, regex)
    host_chart = charts[host_title][0]
    served = server.get_json("/data/plugin/custom_scalars/scalars", {"run": run, "tag": host_chart})
    host_title = host_title.removesuffix(
        FRAME_TITLE
    )  # a short run's lines between flat lines at their lowest and highest
    if host_title.endswith("(MiB)"):
        assert set(served["tag_to_events"]) == {f"memory/train/{n}_MiB" for n in ("host_rss", "host_peak_rss")}
    elif host_title.endswith("(GiB)"):  # values of 1,000 MiB or more: drawn in GiB, the lines fit end wrote
        assert set(served["tag_to_events"]) == {
            f"memory/{DASHBOARD_TAG_PART}/train/{n}_GiB" for n in ("host_rss", "host_peak_rss")
        }
    else:  # drawn above a base: the lines fit end wrote
        unit, base = re.search(r"\((B|KiB|MiB|GiB) above ([0-9,.]+) ", host_title).groups()
        assert set(served["tag_to_events"]) == {
            f"memory/{DASHBOARD_TAG_PART}/train/{n}_{unit}_above_{base.replace(',', '')}_{unit}"
            for n in ("host_rss", "host_peak_rss")
        }
    # and the rules every chart keeps, on the data the server hands the Custom Scalars tab
    served_runs = {run: {}}
    for regexes in charts.values():
        for regex in regexes:
            answer = server.get_json("/data/plugin/custom_scalars/scalars", {"run": run, "tag": regex})
            served_runs[run].update(
                {tag: [(step, value) for _, step, value in events] for tag, events in answer["tag_to_events"].items()}
            )
    assert check_dashboard(layout_as_written, served_runs) == []


def test_memory_figure_is_served_as_png(server, run_logs):
    _, run, summary, history = run_logs
    assert f"memory/{FIGURE_TAG}" in server.get_json("/data/plugin/images/tags")[run]
    images = server.get_json("/data/plugin/images/images", {"run": run, "tag": f"memory/{FIGURE_TAG}", "sample": 0})
    assert len(images) == 1 and images[0]["step"] == 6
    png = server.get("/data/plugin/images/individualImage?" + images[0]["query"])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert (height, width, 3) == figure_rgb(memory_per_step_figure(summary, history)).shape


def test_summary_table_is_served_as_text(server, run_logs):
    _, run, summary, history = run_logs
    assert f"memory/{SUMMARY_TEXT_TAG}/text_summary" in server.get_json("/data/plugin/text/tags")[run]
    texts = server.get_json("/data/plugin/text/text", {"run": run, "tag": f"memory/{SUMMARY_TEXT_TAG}/text_summary"})
    assert len(texts) == 1
    served = html.unescape(re.search(r"<pre><code>(.*)</code></pre>", texts[0]["text"], re.S).group(1))
    assert served.rstrip("\n") == format_summary(summary, history)


def test_server_stops(run_logs):
    tensorboard = TensorBoardServer(run_logs[0], startup_timeout_s=90)
    with tensorboard:
        port = tensorboard.port
        assert tensorboard.get_json("/data/runs")
    assert tensorboard.process is None
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0
