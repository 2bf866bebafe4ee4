"""The memory doctor on batches that change size: text padded per batch, lengths 16 to 256, with a planted
leak (each step's loss and logits appended to a list on the module). Real Trainer fits on CPU, exact bytes.

The logits are ``(batch, classes)`` whatever the padded length, so the leak keeps the same bytes every step:
``8 * 4 * 4 + 4 = 132`` B for batches of 8, 4 classes, float32 and a 0-dim loss. The batch in flight (and,
with a loader of unknown length, the batch Lightning fetched ahead) moves by tens of KiB from step to step;
the doctor leaves both out of the bytes it watches, so the floor rises by exactly 132 B a step. The report names
the ``append`` lines that keep the tensors beside the lines that made them, and each verdict is shown once.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import textwrap
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_memkit._lightning_compat import prefetched_batches
from lightning_memkit.callbacks.memory_doctor import MemoryDoctor
from lightning_memkit.cli import main
from lightning_memkit.cli.common import load_object
from lightning_memkit.doctor.keepers import keeping_frame
from lightning_memkit.doctor.verdict import DoctorReport, DoctorSession
from tests.helpers.models import FLOAT32
from tests.helpers.trainers import make_trainer

B, CLASSES = 8, 4  # batch size, classes of PaddedTextClassifier
TRUE_BYTES_PER_STEP = B * CLASSES * FLOAT32 + FLOAT32  # the logits (8, 4) float32 and the 0-dim loss: 132
STEPS = 12

LEAKY_TEXT = textwrap.dedent(
    '''
    from torch import nn
    from torch.utils.data import DataLoader, IterableDataset

    from lightning_memkit.zoo_variable import PaddedTextClassifier


    class Stream(IterableDataset):
        """The padded batches of a loader, as a stream with no length: Lightning then fetches a batch ahead."""

        def __init__(self, loader):
            self.loader = loader

        def __iter__(self):
            return iter(self.loader)


    class LeakyPaddedText(PaddedTextClassifier):
        """PaddedTextClassifier's step, and the planted leak: the loss and the logits kept every step."""

        def __init__(self, batch_size: int = 8, iterable: bool = False):
            super().__init__(batch_size=batch_size, train_size=256)
            self.iterable = iterable
            self.kept = []

        def training_step(self, batch, batch_idx):
            logits = self(batch["input_ids"], batch["attention_mask"])
            loss = nn.functional.cross_entropy(logits, batch["labels"])
            predictions = logits.argmax(dim=-1)
            self.train_accuracy(predictions, batch["labels"])
            self.train_f1(predictions, batch["labels"])
            self.log_dict({"train_loss": loss, "train_acc": self.train_accuracy, "train_f1": self.train_f1})
            self.kept.append(loss)
            self.kept.append(logits)
            return loss

        def train_dataloader(self):
            loader = super().train_dataloader()
            return DataLoader(Stream(loader), batch_size=None) if self.iterable else loader
    '''
)


def line_of(source: str, statement: str) -> int:
    """The 1-based line of ``statement`` in ``source`` (it must be there once)."""
    found = [number for number, text in enumerate(source.splitlines(), 1) if text.strip() == statement]
    assert len(found) == 1, (statement, found)
    return found[0]


@pytest.fixture
def leaky_file(tmp_path):
    path = tmp_path / "leaky_text.py"
    path.write_text(LEAKY_TEXT)
    return path


class SeeBatches(pl.Callback):
    """The padded length of each step's batch, and how many batches Lightning had fetched ahead of it."""

    def __init__(self) -> None:
        self.lengths, self.ahead = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.lengths.append(batch["input_ids"].shape[1])
        self.ahead.append(len(prefetched_batches(trainer)))


def verdict_headlines(text: str) -> list[str]:
    """The lines that open a verdict (a tensor leak, a kept graph): each must be shown once."""
    openings = ("memory leak: the floor of live tensor memory grows by", "autograd graph kept across steps:")
    return [line for line in text.splitlines() if any(opening in line for opening in openings)]


def check_leak(leak, path, source) -> None:
    """Exact bytes per step, each group's bytes, maker and keeping line (by file:line)."""
    assert leak.bytes_per_step == TRUE_BYTES_PER_STEP, leak.format()
    groups = {tuple(g.shape): g for g in leak.growing}
    logits, loss = groups[(B, CLASSES)], groups[()]
    assert (logits.bytes_per_step, loss.bytes_per_step) == (B * CLASSES * FLOAT32, FLOAT32)
    assert logits.frame[1] == line_of(source, 'logits = self(batch["input_ids"], batch["attention_mask"])')
    assert loss.frame[1] == line_of(source, 'loss = nn.functional.cross_entropy(logits, batch["labels"])')
    for group, statement in ((logits, "self.kept.append(logits)"), (loss, "self.kept.append(loss)")):
        line = line_of(source, statement)
        assert group.kept_at[:2] == [str(path), line], (group.kept_at, statement)
        assert group.kept_where == f"{os.path.basename(path)}:{line} in training_step: {statement}"
        assert group.holder.startswith("model.kept[")
        assert f"kept at {os.path.basename(path)}:{line} in training_step: {statement}" in leak.format()


@pytest.mark.parametrize("iterable", [False, True], ids=["sized-loader", "loader-fetching-ahead"])
def test_the_callback_gives_the_exact_bytes_per_step_and_the_append_lines_once(iterable, leaky_file, tmp_path, capsys):
    cls = load_object(f"{leaky_file}:LeakyPaddedText")
    doctor, seen = MemoryDoctor(verbose=True), SeeBatches()
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        make_trainer(tmp_path, max_steps=STEPS, callbacks=[doctor, seen]).fit(cls(batch_size=B, iterable=iterable))
    printed = capsys.readouterr()
    # the batches really change size, and a loader of unknown length really has one fetched ahead
    assert len(set(seen.lengths)) > STEPS // 2, seen.lengths
    assert seen.ahead == ([1] * STEPS if iterable else [0] * STEPS)
    assert sys.gettrace() is None  # the keeping-line tracer is gone with the fit

    report = doctor.report
    check_leak(report.leak, leaky_file, LEAKY_TEXT)
    # exact at every step: what is watched grows by the leak alone once training state and logging are made
    points = report.live_bytes_at_start
    assert [b - a for (_, a), (_, b) in itertools.pairwise(points[1:])] == [TRUE_BYTES_PER_STEP] * (STEPS - 2), points
    assert report.graph_leak is not None  # the kept loss and logits keep their graphs' nodes too

    # each verdict is shown once: printed at fit end; the warning only says a leak was found
    shown = "\n".join([printed.out, printed.err] + [str(w.message) for w in warned])
    assert printed.out.count(report.format()) == 1
    assert sorted(verdict_headlines(shown)) == sorted(verdict_headlines(report.format())), shown
    assert len(verdict_headlines(report.format())) == 2
    assert sum("memory leak found" in str(w.message) for w in warned) == 1


def test_the_cli_gives_the_exact_bytes_per_step_and_the_append_lines_once(leaky_file, tmp_path, capsys):
    out_json = tmp_path / "verdict.json"
    with warnings.catch_warnings(record=True) as warned:  # what a terminal shows on stderr
        warnings.simplefilter("always")
        status = main(
            [
                "doctor",
                f"{leaky_file}:LeakyPaddedText",
                "--steps",
                str(STEPS),
                "--init-args",
                '{"iterable": true}',
                "--json",
                str(out_json),
            ]
        )
    printed = capsys.readouterr()
    assert status == 3  # a leak
    assert sys.gettrace() is None
    report = DoctorReport.from_dict(json.loads(out_json.read_text()))
    check_leak(report.leak, leaky_file, LEAKY_TEXT)
    assert f"grows by {TRUE_BYTES_PER_STEP} B ({TRUE_BYTES_PER_STEP} bytes) per step" in printed.out
    shown = "\n".join([printed.out, printed.err] + [str(w.message) for w in warned])
    assert printed.out.count(report.format()) == 1
    assert sorted(verdict_headlines(shown)) == sorted(verdict_headlines(report.format())), shown
    assert len(verdict_headlines(report.format())) == 2


# ============================================================================================ the keeping lines
class Keeper:
    """Where a training loop keeps tensors: a list, an attribute, a dict."""

    def __init__(self) -> None:
        self.outputs: list = []
        self.cache: dict = {}
        self.last = None


def keeping_step(model: nn.Module, keeper: Keeper, x: torch.Tensor, step: int) -> torch.Tensor:
    out = model(x)
    keeper.outputs.append(out)
    keeper.last = out * 2
    total = out.sum(dim=1)
    keeper.cache[step] = total
    keeper.outputs.append(
        out.relu(),  # the trailing comma keeps this statement over two lines, as the test needs
    )
    return out.sum()


def source_line(function, statement: str) -> int:
    import inspect

    lines, first = inspect.getsourcelines(function)
    found = [first + i for i, text in enumerate(lines) if text.strip() == statement]
    assert len(found) == 1, statement
    return found[0]


def test_the_keeping_line_of_an_append_an_attribute_and_a_dict_item():
    model, keeper = nn.Linear(4, 3), Keeper()
    session = DoctorSession(model, graph_check=False, analyse_step=None)
    for step in range(2):
        session.step_start(step, None)
        keeping_step(model, keeper, torch.randn(2, 4), step).backward()
        session.step_end(step)
    recorder = session.recorder
    here = os.path.abspath(__file__)

    def kept(tensor) -> list:
        return [(os.path.abspath(f), line) for f, line, _ in recorder.creation_of(tensor).kept_at]

    appended = source_line(keeping_step, "keeper.outputs.append(out)")
    attribute = source_line(keeping_step, "keeper.last = out * 2")
    item = source_line(keeping_step, "keeper.cache[step] = total")
    multi_line = source_line(keeping_step, "keeper.outputs.append(")
    assert kept(keeper.outputs[2]) == [(here, appended)]  # the name appended
    assert kept(keeper.last) == [(here, attribute)]  # made on the line that keeps it
    assert kept(keeper.cache[1]) == [(here, item)]  # a dict item
    assert kept(keeper.outputs[3]) == [(here, multi_line)]  # a statement over two lines: its first
    session.close(finish=True)
    assert sys.gettrace() is None


def store_twice(model: nn.Module, keeper: Keeper) -> torch.Tensor:
    out = model(torch.randn(2, 4))
    keeper.last = out
    keeper.outputs.append(out)
    return out


def test_a_tensor_stored_twice_is_given_the_line_that_stores_into_its_holder():
    model, keeper = nn.Linear(4, 3), Keeper()
    session = DoctorSession(model, graph_check=False, analyse_step=None)
    session.step_start(0, None)
    out = store_twice(model, keeper)  # a function entered while tracing: the test's own frame began before
    session.close()
    creation = session.recorder.creation_of(out)
    first, second = (line for _, line, _ in creation.kept_at)
    assert (first, second) == (
        source_line(store_twice, "keeper.last = out"),
        source_line(store_twice, "keeper.outputs.append(out)"),
    )
    assert keeping_frame([creation], {"model", "last"})[1] == first
    assert keeping_frame([creation], {"model", "outputs"})[1] == second
    assert keeping_frame([creation])[1] in (first, second)  # no holder: the most frequent, then the newest


def test_another_trace_function_is_left_alone_and_said():
    def other(frame, event, arg):
        return None

    model = nn.Linear(4, 3)
    session = DoctorSession(model, graph_check=False, analyse_step=None)
    sys.settrace(other)
    try:
        session.step_start(0, None)
        model(torch.randn(2, 4)).sum().backward()
        session.close()
        assert sys.gettrace() is other
    finally:
        sys.settrace(None)
    assert any("another trace function is set" in error for error in session.report().errors)


def test_a_loop_written_inline_is_traced_from_the_first_step():
    # the loop's own frame began before the recording: the tracer gives it a line tracer when it starts, as pdb does
    model, kept = nn.Linear(4, 3), []
    session = DoctorSession(model, graph_check=False, analyse_step=None)
    for step in range(2):
        session.step_start(step, None)
        out = model(torch.randn(2, 4))
        kept.append(out)
        out.sum().backward()
    session.close()
    line = source_line(test_a_loop_written_inline_is_traced_from_the_first_step, "kept.append(out)")
    assert [[frame[1] for frame in session.recorder.creation_of(t).kept_at] for t in kept] == [[line], [line]]
    assert sys.gettrace() is None
