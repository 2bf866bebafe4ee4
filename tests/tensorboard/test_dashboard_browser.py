"""The dashboard as a browser draws it: headless Chromium on a real ``tensorboard``, the Custom Scalars tab read from
the page.

For each kind of run (a CPU fit with MemoryTracker + LayerTrace, a 5-step fit and a 12-step fit logged every 5 steps
of a small GPT, a two-process DDP run, a ``memkit compare`` root,
and the shared H100 logs of ``memkit demo --model transformer`` and ``memkit compare`` given today's layout), the
rendered page is read through the Chrome DevTools protocol (its DOM, shadow roots included) and held to the
dashboard's rules at TensorBoard's default settings:

- every chart of the served layout is on the page once, under its title, and no other;
- the run's primary charts (step peak, live memory, the process's memory) are among them (:data:`PRIMARY`);
- every chart lists at least one matching tag and at most 3 per run ("Matches (N)") and draws a line;
- the y axis's tick labels, as TensorBoard writes them, all differ, and are exactly the ones
  ``lightning_memkit.tensorboard.axis`` predicts from the served values (``tensorboard_y_range``,
  ``tensorboard_ticks``, ``tick_label``): the model ``check_chart`` uses is the browser's.

Skipped, saying so, where Chromium is not installed (Debian/Ubuntu: ``apt-get install -y chromium``).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import textwrap
import time

import pytest
from lightning.pytorch.loggers import TensorBoardLogger

from tests.helpers.models import LinearStack
from tests.helpers.paths import DATA_DIR, REPO_ROOT
from tests.helpers.processes import run_script
from tests.helpers.trainers import make_trainer

CHROMIUM = next((path for path in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if path), None)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="headless Chromium is not installed (Debian/Ubuntu: apt-get install -y chromium): "
        "the dashboard's browser check needs it",
    ),
]
H100 = os.path.join(DATA_DIR, "h100_logs")


class Chromium:
    """Headless Chromium driven over ``--remote-debugging-pipe`` (commands in on fd 3, replies out on fd 4, JSON ended
    by NUL).

    Its own process group and profile directory; :meth:`close` kills the group and removes the profile."""

    def __init__(self, executable: str, width: int = 1240, height: int = 1400) -> None:
        self.profile = tempfile.mkdtemp(prefix="memkit-chromium-")
        commands_in, self._commands = os.pipe()
        self._replies, replies_out = os.pipe()

        def as_fds_3_and_4():  # in the child: the pipe's ends become its fds 3 and 4, inherited through exec
            commands, replies = os.dup(commands_in), os.dup(replies_out)  # fresh numbers: neither is 3 or 4
            os.dup2(commands, 3)
            os.dup2(replies, 4)

        self.process = subprocess.Popen(
            [
                executable,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--disable-extensions",
                "--remote-debugging-pipe",
                f"--user-data-dir={self.profile}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            close_fds=False,
            preexec_fn=as_fds_3_and_4,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        os.close(commands_in)
        os.close(replies_out)
        self._buffer = b""
        self._id = 0
        page = next(t for t in self.send("Target.getTargets")["targetInfos"] if t["type"] == "page")
        self.session = self.send("Target.attachToTarget", {"targetId": page["targetId"], "flatten": True})["sessionId"]

    def send(self, method: str, params: dict | None = None, session: str | None = None, timeout_s: float = 30) -> dict:
        self._id += 1
        message = {
            "id": self._id,
            "method": method,
            "params": params or {},
            **({"sessionId": session} if session else {}),
        }
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        while True:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self._id:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return reply["result"]
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"Chromium did not answer {method} within {timeout_s} s")
            if select.select([self._replies], [], [], left)[0]:
                chunk = os.read(self._replies, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"Chromium exited (status {self.process.poll()})")
                self._buffer += chunk

    def open(self, url: str) -> None:
        self.send("Page.navigate", {"url": url}, session=self.session)

    def evaluate(self, expression: str):
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session=self.session)
        return result["result"].get("value")

    def close(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
        for fd in (self._commands, self._replies):
            os.close(fd)
        shutil.rmtree(self.profile, ignore_errors=True)


# Every chart card of the Custom Scalars tab, read from the page with its shadow roots: title, the tags listed
# under "Matches (N)" (with their runs), the y axis's tick labels, and the lines drawn (SVG paths with points).
CARDS = r"""
(() => {
  const deep = (root, test, out = []) => {
    for (const node of root.querySelectorAll('*')) {
      if (test(node)) out.push(node);
      if (node.shadowRoot) deep(node.shadowRoot, test, out);
    }
    return out;
  };
  const cards = deep(document, n => n.tagName === 'TF-CUSTOM-SCALAR-MULTI-LINE-CHART-CARD');
  return JSON.stringify(cards.map(card => {
    const root = card.shadowRoot || card;
    const heading = deep(root, n => n.classList && n.classList.contains('heading-label'))[0]
                 || deep(root, n => n.tagName === 'FIGCAPTION')[0];
    const yAxis = deep(root, n => n.classList && n.classList.contains('y-axis'))[0];
    return {
      title: heading ? heading.textContent.trim() : null,
      matches: deep(root, n => n.classList && n.classList.contains('match-list-entry'))
        .map(n => n.textContent.replace(/\s+/g, ' ').trim()),
      y: yAxis ? deep(yAxis, n => n.classList && n.classList.contains('tick-label')).map(n => n.textContent) : [],
      // each tag is drawn twice (the smoothed line and the raw one): a path of two points or more has an "L"
      lines: deep(root, n => n.tagName === 'path' && n.classList.contains('line')
                             && /L/.test(n.getAttribute('d') || '')).length,
      text: root.textContent.includes('No data')
        || deep(root, n => /no data/i.test(n.textContent || '') && !n.children.length).length > 0,
    };
  }));
})()
"""


def rendered_cards(browser: Chromium, url: str, expected: int, timeout_s: float = 90) -> list[dict]:
    """The chart cards of ``url``'s Custom Scalars tab once ``expected`` cards are drawn with their axes."""
    browser.open(url + "/#custom_scalars")
    deadline = time.monotonic() + timeout_s
    cards: list[dict] = []
    while time.monotonic() < deadline:
        time.sleep(1.0)
        previous, cards = cards, json.loads(browser.evaluate(CARDS) or "[]")
        if len(cards) >= expected and all(c["y"] and c["matches"] for c in cards) and cards == previous:
            return cards  # every card has its axis and its matches, and nothing changed in the last second
    return cards


# ---------------------------------------------------------------------------------------------- the runs
DDP_SCRIPT = textwrap.dedent(
    """
    import sys, warnings
    warnings.filterwarnings("ignore")
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger
    sys.path.insert(0, {root!r})
    from tests.helpers.models import LinearStack
    from lightning_memkit import MemoryTracker

    trainer = pl.Trainer(
        strategy="ddp", accelerator="cpu", devices=2, max_steps=12,
        logger=TensorBoardLogger(sys.argv[1], name="ddp", version=0),
        callbacks=[MemoryTracker(per_rank=True, verbose=False)], enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0, log_every_n_steps=1,
    )
    trainer.fit(LinearStack(batch_size=8))
    """
)


def make_logs(kind: str, tmp_path_factory) -> str:
    """The log root of one kind of run, written here (the shared H100 logs: copied and given today's layout)."""
    from lightning_memkit import MemoryTracker, zoo
    from lightning_memkit.callbacks.layer_trace import LayerTrace
    from lightning_memkit.modes.comparison import compare_modes
    from lightning_memkit.tensorboard.dashboard import update_dashboards

    root = tmp_path_factory.mktemp(f"browser_{kind}")
    if kind == "cpu":
        trainer = make_trainer(
            root,
            max_steps=31,
            logger=TensorBoardLogger(str(root), name="cpu", version=0),
            limit_val_batches=1,
            val_check_interval=10,
            check_val_every_n_epoch=None,
            callbacks=[MemoryTracker(verbose=False), LayerTrace(at_steps=(1,), verbose=False)],
        )
        trainer.fit(LinearStack(val_batches=1, optimizer="adam"))
        return str(root)
    if kind in (
        "cpu5",
        "sparse",
    ):  # a short run, and a sparsely logged one: a small GPT with a datamodule, as a user writes it
        from tests.helpers.lightning_gpt import CharDataModule, TinyGPT

        steps, every = (5, 1) if kind == "cpu5" else (12, 5)
        trainer = make_trainer(
            root,
            max_steps=steps,
            log_every_n_steps=every,
            logger=TensorBoardLogger(str(root), name=kind, version=0),
            callbacks=[MemoryTracker(verbose=False)],
        )
        trainer.fit(TinyGPT(), datamodule=CharDataModule())
        return str(root)
    if kind == "ddp":
        script = root / "ddp_run.py"
        script.write_text(DDP_SCRIPT.format(root=REPO_ROOT))
        run_script([str(script), str(root / "logs")], cwd=str(root), timeout=240, ranks=2)
        return str(root / "logs")
    if kind == "compare":
        compare_modes(
            lambda: zoo.DemoTransformer(
                vocab_size=50, d_model=32, nhead=2, layers=3, dim_feedforward=64, seq_len=16, batch_size=8
            ),
            modes="baseline,checkpoint",
            max_steps=10,
            accelerator="cpu",
            root_dir=str(root),
            verbose=False,
        )
        return str(root)
    name = kind.split("_", 1)[1]  # the shared H100 logs, as a user sees them after `memkit report --update-dashboards`
    shutil.copytree(os.path.join(H100, name), root / name)
    update_dashboards(str(root / name))
    return str(root / name)


@pytest.fixture(scope="module")
def browser():
    chromium = Chromium(CHROMIUM)
    try:
        yield chromium
    finally:
        chromium.close()


def served_chart_values(server, layout: dict) -> dict[str, dict[tuple[str, str], list[tuple[int, float]]]]:
    """``{chart title: {(run, tag): [(step, value)]}}``: what the server hands the Custom Scalars tab for each chart."""
    runs = list(server.get_json("/data/runs"))
    charts = {}
    for category in layout["category"]:
        for chart in category["chart"]:
            series = {}
            for run in runs:
                for regex in chart["multiline"]["tag"]:
                    answer = server.get_json("/data/plugin/custom_scalars/scalars", {"run": run, "tag": regex})
                    for tag, events in answer["tag_to_events"].items():
                        series[(run, tag)] = [(step, value) for _, step, value in events]
            charts[chart["title"]] = series
    return charts


#: the primary charts every kind of run shows, with data: the step peak, the live memory of the device it trained on
#: (tensors on CPU, allocated on CUDA) and the process's memory (host RSS on CPU, the device seen by NVML on CUDA)
PRIMARY = {
    "cpu": (
        "tensors (exact): step peak (",
        "tensors (exact): live at step end (",
        "host RSS, top to bottom: step peak, step end (",
    ),
    "compare": (
        "modes overlaid: tensor step peak, exact (",
        "modes overlaid: live tensors at step end, exact (",
        "modes overlaid: host RSS at step end (",
    ),
    "h100_gl": (
        "CUDA step peak, top to bottom: reserved, allocated (",
        "CUDA at step end, top to bottom: reserved, allocated (",
        "device (NVML), top to bottom: all processes, this process, allocator reserved (",
    ),
    "h100_gc": (
        "modes overlaid: CUDA step peak allocated (",
        "modes overlaid: CUDA allocated at step end (",
        "modes overlaid: this process on the device, NVML (",
    ),
}
PRIMARY["cpu5"] = PRIMARY["sparse"] = PRIMARY["ddp"] = PRIMARY["cpu"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "kind",
    [
        "cpu",
        # five steps of the same layout, and the 2-process run's per-rank charts (test_dashboard_ddp.py checks that
        # layout without a browser): in make test-extended
        pytest.param("cpu5", marks=pytest.mark.extended),
        "sparse",
        pytest.param("ddp", marks=pytest.mark.extended),
        "compare",
        "h100_gl",
        "h100_gc",
    ],
)
def test_every_chart_is_drawn_and_readable_in_chromium(kind, browser, tmp_path_factory):
    from lightning_memkit.tensorboard.axis import tensorboard_ticks, tick_label
    from lightning_memkit.tensorboard.layout import MAX_SERIES_PER_CHART
    from lightning_memkit.tensorboard.readable import FRAME_TITLE
    from lightning_memkit.tensorboard.rules import check_chart, drawn_lines
    from lightning_memkit.tensorboard.server import TensorBoardServer

    with TensorBoardServer(make_logs(kind, tmp_path_factory), startup_timeout_s=90) as server:
        layout = server.get_json("/data/plugin/custom_scalars/layout")
        titles = [chart["title"] for category in layout["category"] for chart in category["chart"]]
        assert titles, f"no memkit layout served for {kind}"
        values = served_chart_values(server, layout)
        cards = rendered_cards(browser, server.url, expected=len(titles))

    by_title = {card["title"]: card for card in cards}
    assert sorted(card["title"] for card in cards) == sorted(titles), [
        c["title"] for c in cards
    ]  # each chart once, no other
    for start in PRIMARY[
        kind
    ]:  # never dropped, whatever the run's length and logging interval: drawn below with its lines
        assert [t for t in titles if t.startswith(start)], (kind, start, titles)
    for title in titles:
        card = by_title[title]
        runs = [entry.rsplit("(", 1)[1].rstrip(")") for entry in card["matches"]]
        assert card["matches"], (kind, title, "no tag matched")
        per_run_limit = (MAX_SERIES_PER_CHART if not title.startswith("per rank:") else 8) + 2 * title.endswith(
            FRAME_TITLE
        )
        assert max(runs.count(run) for run in runs) <= per_run_limit, (kind, title, card["matches"])
        assert card["lines"] >= 1 and not card["text"], (kind, title, card)
        # the axis as drawn: distinct labels, exactly the ones the rules' model of TensorBoard predicts
        assert len(set(card["y"])) == len(card["y"]), (kind, title, card["y"])
        _, (low, high) = drawn_lines(values[title], 0.6)
        assert card["y"] == [tick_label(t) for t in tensorboard_ticks(low, high)], (kind, title, card["y"], (low, high))
        assert check_chart(title, values[title]) == []


@pytest.mark.timeout(300)
def test_the_h100_runs_old_layout_fails_in_chromium(browser):
    """The H100 demo run's own layout (written at fit start by the memkit of that day), as the browser draws it: the
    page shows what the rules catch, so the check above can fail: layer-trace charts that draw no line (one step
    each), 4 lines for one run, the device's 80 GB capacity stretching the axis to 9e+4 MiB."""
    from lightning_memkit.tensorboard.server import TensorBoardServer

    with TensorBoardServer(os.path.join(H100, "gl"), startup_timeout_s=90) as server:
        layout = server.get_json("/data/plugin/custom_scalars/layout")
        titles = [chart["title"] for category in layout["category"] for chart in category["chart"]]
        cards = {card["title"]: card for card in rendered_cards(browser, server.url, expected=len(titles))}
    assert sorted(cards) == sorted(titles)
    assert cards["layer trace: categories at the traced step's peak (MiB)"]["lines"] == 0
    assert len(cards["CUDA allocator: allocated vs reserved vs step peak (MiB)"]["matches"]) == 4
    device = cards["NVML device memory vs what the allocator holds (MiB)"]
    assert len(device["matches"]) == 4 and device["y"][-1] == "9e+4"
