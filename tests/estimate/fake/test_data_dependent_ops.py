"""Ops whose output shape depends on values (unique, nonzero, boolean masks, masked_select, bincount) in a fake step:
sized exactly where real values decide them, else at their largest output (an upper bound) by the values the fake
step knows (estimate/fake/value_sets.py, estimate/fake/data_dependent_ops.py), so the estimate never fails for want of a
bound, is at least the real step's peak, and validation code (torchmetrics') passes as it does on data. Each estimate is
compared with a real step on the same batch, to the byte: the bound's extra bytes are computed by hand.
"""

from __future__ import annotations

import contextlib
import io
import json
import textwrap
import warnings
from contextlib import redirect_stderr, redirect_stdout

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_memkit import estimate_memory, measure_training_step
from lightning_memkit.estimate import EstimateError
from lightning_memkit.estimate.fake.session import FakeSession
from lightning_memkit.estimate.fake.step_ops import FakeStepOps
from lightning_memkit.estimate.step.hook_errors import DATA_DEPENDENT_ADVICE
from lightning_memkit.estimate.step.step_accountant import StepAccountant

torchmetrics = pytest.importorskip("torchmetrics")

B, FEATURES, C = 32, 8, 6  # rows, input features, classes
INT64, FLOAT32 = 8, 4  # bytes per element


def _in_fake_step(body):
    """``body()`` inside a fake step's dispatch stack (the fake mode, the estimate's accountant and its FakeStepOps);
    returns its result and the ops' note."""
    session = FakeSession()
    ops = FakeStepOps()
    with session.fake_mode_only(), StepAccountant(record_events=False, fake_ops=ops):
        result = body()
    return result, ops.data_dependent.note()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(B, FEATURES, generator=generator)
    labels = torch.randint(0, C, (B,), generator=generator)
    labels[::4] = -100  # ignored tokens, as padding is
    return x, labels


# ------------------------------------------------------------------------------------------ one op per module
# Each op returns (loss, kept): `kept` stays on the module from the op to the next step's start, so it is alive at the
# peak (in backward) of both the real and the fake step, and the two peaks differ by exactly its bytes' difference.
def _unique(logits, labels):
    return logits.sum(), (torch.unique(logits.argmax(-1)),)


def _unique_inverse_counts(logits, labels):
    return logits.sum(), torch.unique(logits.argmax(-1), return_inverse=True, return_counts=True)


def _unique_consecutive(logits, labels):
    return logits.sum(), (torch.unique_consecutive(logits.argmax(-1)),)


def _unique_dim(logits, labels):
    return logits.sum(), torch.unique(logits.argmax(-1).view(-1, 4), dim=0, return_inverse=True, return_counts=True)


def _nonzero(logits, labels):
    return logits.sum(), ((logits > 0).nonzero(),)


def _fake_mask_index(logits, labels):
    selected = logits[logits > 0]
    return logits.sum() + selected.sum(), (selected.detach(),)


def _fake_mask_select(logits, labels):
    selected = torch.masked_select(logits, logits > 0)
    return logits.sum() + selected.sum(), (selected.detach(),)


def _bincount(logits, labels):
    return logits.sum(), (torch.bincount(logits.argmax(-1)),)


def _real_mask_cross_entropy(logits, labels):
    keep = labels != -100  # real: the loader's labels
    return F.cross_entropy(logits[keep], labels[keep]), (logits[keep].detach(),)


def _real_mask_select(logits, labels):
    selected = torch.masked_select(logits, (labels != -100)[:, None])
    return logits.sum() + selected.sum(), (selected.detach(),)


# op -> (its step, the bytes its kept outputs have at their largest on fakes, the ops in the note and how sized)
OPS = {
    "unique": (_unique, C * INT64, "aten._unique2 x2 on fakes sized at their largest output (an upper bound)"),
    "unique-inverse-counts": (
        _unique_inverse_counts,
        (C + B + C) * INT64,
        "aten._unique2 x2 on fakes sized at their largest output (an upper bound)",
    ),
    "unique_consecutive": (
        _unique_consecutive,
        B * INT64,
        "aten.unique_consecutive x2 on fakes sized at their largest output (an upper bound)",
    ),
    # B / 4 rows of 4 at most; the CPU kernel gives the inverse and the counts, asked for or not
    "unique-dim": (
        _unique_dim,
        (B // 4 * 4 + B // 4 + B // 4) * INT64,
        "aten.unique_dim x2 on fakes sized at their largest output (an upper bound)",
    ),
    "nonzero": (_nonzero, B * C * 2 * INT64, "aten.nonzero x2 on fakes sized at their largest output (an upper bound)"),
    "bool-mask-index": (
        _fake_mask_index,
        B * C * FLOAT32,
        "aten.index x2 on fakes sized at their largest output (an upper bound)",
    ),
    "masked_select": (
        _fake_mask_select,
        B * C * FLOAT32,
        "aten.masked_select x2 on fakes sized at their largest output (an upper bound)",
    ),
    # argmax over C classes: at most C - 1, so C bins (here the real length too)
    "bincount": (_bincount, C * INT64, "aten.bincount x2 on fakes sized at their largest output (an upper bound)"),
    "cross_entropy-ignore_index": (
        _real_mask_cross_entropy,
        None,
        "aten.index x4 on fakes sized exactly (by a real mask or known values)",
    ),
    "masked_select-real-mask": (
        _real_mask_select,
        None,
        "aten.masked_select x2 on fakes sized exactly (by a real mask or known values)",
    ),
}


class OneOp(pl.LightningModule):
    """A linear classifier whose step runs one data-dependent op. Zero weights and a bias of ``c - 1`` per class
    make every row's logits ``-1, 0, 1, ..., C - 2`` (the argmax is always C - 1, C - 2 logits are positive), and
    ``lr=0`` keeps them so in the second step: the real step's sizes are known."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.step_op = OPS[op][0]
        self.layer = nn.Linear(FEATURES, C)
        with torch.no_grad():
            self.layer.weight.zero_()
            self.layer.bias.copy_(torch.arange(C) - 1.0)
        self.kept = ()

    def training_step(self, batch, batch_idx):
        x, labels = batch
        self.kept = ()  # the last step's outputs go first: one step's are alive at a time
        loss, self.kept = self.step_op(self.layer(x), labels)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.parametrize("op", list(OPS))
def test_each_data_dependent_op_is_estimated_at_least_as_the_real_step_to_the_computed_byte(op):
    module, batch = OneOp(op), _batch()
    estimate = estimate_memory(module, batch=batch, device="cpu")
    measured = measure_training_step(module, batch=batch)
    step, bound_bytes, note = OPS[op]
    with torch.no_grad():
        _, real_kept = step(module.layer(batch[0]), batch[1])
    real_bytes = sum(t.untyped_storage().nbytes() for t in real_kept)
    assert any(note in line for line in estimate.notes), estimate.notes
    assert estimate.peak_bytes >= measured.peak_bytes
    if bound_bytes is None:  # a real mask decides the shape: exact
        assert estimate.peak_bytes == measured.peak_bytes and estimate.by_category == measured.by_category
    else:
        assert estimate.peak_bytes - measured.peak_bytes == bound_bytes - real_bytes
    assert (estimate.peak_phase, estimate.peak_step) == (measured.peak_phase, measured.peak_step)


def test_the_sizes_on_fakes_by_what_is_known_of_the_values():
    labels = torch.tensor([1, -100, 2, 2, -100, 0])

    def body():
        logits = torch.empty(6, 5)
        preds = logits.argmax(-1)  # values 0..4
        values, inverse, counts = torch.unique(preds, return_inverse=True, return_counts=True)
        keep = labels != -100
        shapes = {
            "unique": (values.shape, inverse.shape, counts.shape),
            "unique of a boolean": torch.unique(logits > 0).shape,
            "unique of a fill": torch.unique(torch.zeros_like(preds)).shape,  # one known value
            "nonzero": (logits > 0).nonzero().shape,
            "nonzero of ones": torch.ones_like(preds).nonzero().shape,  # every element non-zero: exact
            "where": torch.where(logits > 0)[0].shape,
            "fake mask": logits[logits > 0].shape,
            "real mask": logits[keep].shape,
            "real mask select": torch.masked_select(logits, keep[:, None]).shape,
            "bincount": torch.bincount(preds).shape,
            "bincount minlength": torch.bincount(preds, minlength=7).shape,
            "bincount of real values, fake weights": torch.bincount(labels[keep], weights=logits[keep][:, 0]).shape,
            "one_hot": F.one_hot(preds).shape,  # max().item() answers the largest member
            "repeat_interleave": torch.repeat_interleave(torch.full((3,), 2) + preds[:3] * 0).shape,
        }
        return shapes, preds.max().item(), preds.min().item()

    (shapes, largest, smallest), note = _in_fake_step(body)
    assert shapes == {
        "unique": ((5,), (6,), (5,)),
        "unique of a boolean": (2,),
        "unique of a fill": (1,),
        "nonzero": (30, 2),
        "nonzero of ones": (6, 1),
        "where": (30,),
        "fake mask": (30,),
        "real mask": (4, 5),
        "real mask select": (20,),
        "bincount": (5,),
        "bincount minlength": (7,),
        "bincount of real values, fake weights": (3,),
        "one_hot": (6, 5),
        "repeat_interleave": (6,),
    }
    assert (largest, smallest) == (4, 0)
    assert note.startswith("data-dependent ops: ")
    assert (
        "aten._unique2 x2, aten.bincount x2, aten.index x1, aten.nonzero x2 on fakes sized at their largest "
        "output (an upper bound)"
    ) in note
    assert (
        "aten._unique2 x1, aten.bincount x1, aten.index x2, aten.masked_select x1, aten.nonzero x1, "
        "aten.repeat_interleave x1 on fakes sized exactly (by a real mask or known values)"
    ) in note
    assert note.endswith("; aten.index x1 ran on real values")  # labels[keep]: real labels, a real mask


def test_comparisons_of_ops_made_from_one_fake_stay_tied_to_it():
    def body():
        preds = (torch.empty(16) > 0).long()  # {0, 1}
        unique = torch.unique(preds)
        binary = bool(torch.any((unique != 0) & (unique != 1)))  # torchmetrics' binary check: False on data
        classes = torch.unique(torch.empty(16, 4).argmax(-1))
        outside = bool(((classes < 0) | (classes > 3)).any())
        inside = bool(((classes >= 0) & (classes <= 3)).all())
        return unique.shape, binary, outside, inside

    (shape, binary, outside, inside), _ = _in_fake_step(body)
    assert shape == (2,) and binary is False and outside is False and inside is True


def test_an_op_without_a_bound_still_fails_and_says_why():
    def body():
        return torch.bincount((torch.empty(8) * 10).long())  # values of a float cast: nothing known, no minlength

    with pytest.raises(Exception, match="bincount"):
        _in_fake_step(body)


# ------------------------------------------------------------------------------------------ torchmetrics
def test_torchmetrics_multiclass_validation_counts_the_unique_values_of_preds():
    """Pins the path the bound must pass: torchmetrics' multiclass check takes torch.unique of the (integer) preds and
    raises when it finds more values than classes. If torchmetrics changes this, the sizes above need a new look."""
    from torchmetrics.functional.classification.stat_scores import _multiclass_stat_scores_tensor_validation

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append((func, args[0] if args else None))
            return func(*args, **(kwargs or {}))

    preds, target = torch.tensor([0, 1, 3, 3]), torch.tensor([0, 2, 3, 1])
    with Ops() as ops:
        _multiclass_stat_scores_tensor_validation(preds, target, num_classes=4)
    uniques = [argument for func, argument in ops.seen if func is torch.ops.aten._unique2.default]
    assert len(uniques) == 2 and any(argument is preds for argument in uniques)
    with pytest.raises(RuntimeError, match="Detected more unique values in `preds`"):
        _multiclass_stat_scores_tensor_validation(torch.tensor([0, 1, 2, 3, 4]), torch.tensor([0] * 5), num_classes=4)


def test_preds_nothing_is_known_of_would_fail_torchmetrics_check_argmax_preds_pass():
    """Why the sizes keep value sets: a unique sized at the element count alone (16 values for 4 classes) fails the
    multiclass check, while argmax predictions (at most 4 classes) pass it as real predictions do."""
    target = torch.randint(0, 4, (16,))

    def unknown():
        # integers made from a fake float: nothing is known of their values (an integer factory would run for real,
        # and its values would be whatever the memory held)
        torchmetrics.Accuracy(task="multiclass", num_classes=4)(torch.empty(16).long(), target)

    def argmax():
        return torchmetrics.Accuracy(task="multiclass", num_classes=4)(torch.empty(16, 4).argmax(-1), target).shape

    with pytest.raises(RuntimeError, match="Detected more unique values in `preds`"):
        _in_fake_step(unknown)
    shape, note = _in_fake_step(argmax)
    assert shape == () and "aten._unique2 x1 on fakes sized at their largest output (an upper bound)" in note
    assert "aten._unique2 x1 ran on real values" in note  # the target's: real labels


class BinaryMetric(pl.LightningModule):
    """Binary accuracy on integer predictions, ``(logits > 0).long()``: torchmetrics checks their unique values are
    in {0, 1} with ``any((u != 0) & (u != 1))``."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(FEATURES, 1)
        self.accuracy = torchmetrics.classification.BinaryAccuracy()

    def training_step(self, batch, batch_idx):
        x, labels = batch
        logits = self.layer(x).squeeze(-1)
        self.accuracy((logits > 0).long(), (labels > 2).long())
        return F.binary_cross_entropy_with_logits(logits, (labels > 2).float())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def test_binary_torchmetrics_on_integer_predictions_estimates_the_real_step():
    module, batch = BinaryMetric(), _batch()
    estimate = estimate_memory(module, batch=batch, device="cpu")
    measured = measure_training_step(module, batch=batch)
    assert estimate.peak_bytes == measured.peak_bytes and estimate.by_category == measured.by_category
    assert any("aten._unique2 x2 on fakes sized at their largest output (an upper bound)" in n for n in estimate.notes)


def _padded_text_classifier():
    from lightning_memkit.zoo_variable import PaddedTextClassifier

    torch.manual_seed(0)
    module = PaddedTextClassifier(
        d_model=32, nhead=2, layers=2, dim_feedforward=64, max_length=64, min_length=8, train_size=64, batch_size=8
    )
    return module, next(iter(module.train_dataloader()))


@pytest.mark.parametrize("mode", [None, "bf16", "checkpoint:budget=0.5"])
def test_accuracy_and_f1_on_argmax_predictions_estimate_the_real_step(mode):
    """The zoo's PaddedTextClassifier updates torchmetrics Accuracy and F1 on ``logits.argmax(-1)`` every step; their
    input checks take torch.unique of the predictions (fakes) and of the labels (real). The estimate (under a
    checkpoint budget, its measuring forward too) measures what the real step does, to the byte."""
    module, batch = _padded_text_classifier()
    estimate = estimate_memory(module, batch=batch, device="cpu", mode=mode)
    measured = measure_training_step(module, batch=batch, mode=mode)
    assert estimate.peak_bytes == measured.peak_bytes and estimate.by_category == measured.by_category
    steps = 2 if mode is None or "budget" not in mode else 4  # a budget's two measuring forwards run the step's too
    note = (
        f"data-dependent ops: aten._unique2 x{2 * steps}, aten.bincount x{steps} on fakes sized at their largest "
        f"output (an upper bound); aten._unique2 x{2 * steps} ran on real values"
    )
    assert note in estimate.notes


# ------------------------------------------------------------------------------------------ when there is no bound
UNBOUNDED = textwrap.dedent('''
    import torch
    import lightning.pytorch as pl
    from torch import nn


    class Unbounded(pl.LightningModule):
        """A bincount of values from a float cast, without minlength: no bound on fakes."""

        def __init__(self, batch_size=8):
            super().__init__()
            self.batch_size = batch_size
            self.layer = nn.Linear(16, 4)

        def training_step(self, batch, batch_idx):
            logits = self.layer(batch[0])
            counts = torch.bincount((logits.detach().abs() * 10).long().flatten())
            return logits.sum() + 0 * counts.sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            data = torch.utils.data.TensorDataset(torch.randn(256, 16, generator=torch.Generator().manual_seed(0)))
            return torch.utils.data.DataLoader(data, batch_size=self.batch_size)
''')


@pytest.fixture
def unbounded(tmp_path, monkeypatch):
    (tmp_path / "unbounded_module.py").write_text(UNBOUNDED)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    import unbounded_module

    importlib.reload(unbounded_module)
    return tmp_path / "unbounded_module.py", unbounded_module.Unbounded


def _memkit(argv: list[str]) -> tuple[int, str, str]:
    from lightning_memkit.cli import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def test_an_unbounded_op_fails_the_estimate_with_python_advice_and_the_cli_names_its_own_command(unbounded):
    path, cls = unbounded
    with pytest.raises(EstimateError) as raised:
        estimate_memory(cls(), device="cpu")
    assert raised.value.data_dependent and DATA_DEPENDENT_ADVICE in str(raised.value)
    assert "aten.bincount.default" in str(raised.value) and "unbounded_module.py:17" in str(raised.value)
    code, _, err = _memkit(
        [
            "estimate",
            f"{path}:Unbounded",
            "--device",
            "cpu",
            "--device-memory",
            "64MiB",
            "--init-args",
            json.dumps({"batch_size": 4}),
        ]
    )
    assert code == 1
    assert "DynamicOutputShapeException: aten.bincount.default" in err
    assert "measure_training_step()" not in err
    assert f"memkit trace {path}:Unbounded --init-args '{{\"batch_size\": 4}}' --batch-size N" in err


@pytest.mark.timeout(300)
def test_memkit_plan_says_the_estimate_failed_not_that_memory_is_short(unbounded):
    path, _ = unbounded
    code, out, err = _memkit(
        ["plan", f"{path}:Unbounded", "--device", "cpu", "--device-memory", "64MiB", "--trials", "1"]
    )
    assert code == 1
    assert "give more memory" not in out + err
    said = (
        "the estimate failed for every candidate, so no trial ran (more memory would not help): "
        "Unbounded.training_step failed on fake tensors: DynamicOutputShapeException: aten.bincount.default"
    )
    assert f"note: {said}" in out and err.startswith(f"memkit plan: {said}")


@pytest.mark.timeout(300)
def test_max_batch_size_warns_once_that_the_estimate_failed_and_why(unbounded, tmp_path):
    from lightning_memkit import MaxBatchSize

    _, cls = unbounded
    finder = MaxBatchSize(budget=2_000_000, max_val=64, verbose=False)
    trainer = pl.Trainer(
        max_steps=1,
        callbacks=[finder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        default_root_dir=str(tmp_path),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(cls())
    said = [str(w.message) for w in caught if "memkit: the estimate" in str(w.message)]
    assert len(said) == 1
    assert said[0].startswith(
        "memkit: the estimate failed (EstimateError: Unbounded.training_step failed on fake "
        "tensors: DynamicOutputShapeException: aten.bincount.default"
    )
    assert said[0].endswith("; searching by trials only")
    assert finder.result.predicted is None and finder.result.batch_size >= 1


# ------------------------------------------------------------------------------------------ a CUDA target's kernels
def _op_bytes(inputs, op, cuda: bool) -> int:
    """The bytes ``op(*inputs())`` adds to a fake step's peak (its inputs made before), on a CPU or a CUDA target: the
    outputs it makes and, on CUDA, what its kernel makes beside them (estimate/cuda_workspaces.py)."""
    from lightning_memkit.estimate.cuda.kernels import CudaKernels

    session = FakeSession()
    acc = StepAccountant(record_events=False, fake_ops=FakeStepOps(cuda=cuda))
    with session.fake_mode_only(), acc, CudaKernels().active() if cuda else contextlib.nullcontext():
        made = inputs()
        acc.reset_peak()
        start = acc.current_bytes
        op(*made)
        return acc.peak_bytes - start


@pytest.mark.parametrize("asked", [{}, {"return_inverse": True}, {"return_counts": True}])
def test_unique_dim_makes_its_inverse_and_counts_on_a_cuda_target_only_when_asked(asked):
    rows, width = 8, 4  # ids cast from floats, nothing known of them: at most every row is unique

    def inputs():
        return (torch.empty(rows, width).long(),)

    def op(ids):
        return torch.unique(ids, dim=0, **asked)

    values, inverse, counts = rows * width * INT64, rows * INT64, rows * INT64
    assert _op_bytes(inputs, op, cuda=False) == values + inverse + counts  # the CPU kernel gives both, always
    cuda = values + (inverse if asked.get("return_inverse") else 0) + (counts if asked.get("return_counts") else 0)
    assert _op_bytes(inputs, op, cuda=True) == cuda


def test_masked_select_on_a_cuda_target_counts_the_positions_it_selects_by():
    shape = (6, 5)

    def inputs():
        x = torch.empty(shape)
        return x, x > 0  # a fake mask: every element selected at most

    selected = shape[0] * shape[1]
    assert _op_bytes(inputs, torch.masked_select, cuda=False) == selected * FLOAT32
    # CUDA indexes by the expanded mask: nonzero's (N, ndim) int64 positions are alive with the output
    assert _op_bytes(inputs, torch.masked_select, cuda=True) == selected * FLOAT32 + selected * len(shape) * INT64


class _UniqueRowsStep(pl.LightningModule):
    """A step whose peak is at ``torch.unique(ids, dim=0)`` of ROWS single-id rows (its outputs are dropped at once)."""

    ROWS = 100_000

    def __init__(self, **asked) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 1)
        self.asked = asked

    def training_step(self, batch, batch_idx):
        out = self.layer(batch)
        torch.unique(out.detach().long(), dim=0, **self.asked)
        return out.sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_a_cuda_target_estimate_counts_uniques_inverse_and_counts_only_when_the_step_asks_for_them():
    batch = torch.randn(_UniqueRowsStep.ROWS, 1, generator=torch.Generator().manual_seed(0))
    asked = {"return_inverse": True, "return_counts": True}
    for device, extra in (("cpu", 0), ("cuda", 2 * _UniqueRowsStep.ROWS * INT64)):
        plain = estimate_memory(_UniqueRowsStep(), batch=batch, device=device)
        both = estimate_memory(_UniqueRowsStep(**asked), batch=batch, device=device)
        assert plain.peak_phase == both.peak_phase == "forward"
        assert both.peak_bytes - plain.peak_bytes == extra, device  # CPU makes both anyway; CUDA only when asked
