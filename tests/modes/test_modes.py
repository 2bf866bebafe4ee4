"""Mode and parse_mode: the words, the errors, the Trainer arguments and the autocast helper."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from lightning_memkit import CheckpointBudget, Mode, parse_mode
from lightning_memkit.modes.mode import MODE_WORDS, parse_modes, resolve_precision


@pytest.mark.parametrize(
    ("text", "precision", "checkpoint"),
    [
        ("baseline", None, None),
        ("amp", "amp", None),
        ("bf16", "bf16-mixed", None),
        ("fp16", "16-mixed", None),
        ("checkpoint", None, "auto"),
        ("checkpoint:auto", None, "auto"),
        ("checkpoint:budget=0.5", None, CheckpointBudget(fraction=0.5)),
        ("checkpoint:budget=512MiB", None, CheckpointBudget(bytes=512 * 2**20)),
        ("amp+checkpoint", "amp", "auto"),
        (" BF16 + checkpoint:budget=0.25 ", "bf16-mixed", CheckpointBudget(fraction=0.25)),
        ("bf16-true", "bf16-true", None),
        ("fp16-true", "16-true", None),
        ("16-true", "16-true", None),
        ("bf16-true+checkpoint", "bf16-true", "auto"),
    ],
)
def test_parse_mode_words(text, precision, checkpoint):
    mode = parse_mode(text)
    assert (mode.precision, mode.checkpoint) == (precision, checkpoint)
    assert mode.name == text.strip().lower()
    assert parse_mode(mode) is mode


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("ampp", "unknown mode word 'ampp'"),
        ("amp+bf16", "two precisions"),
        ("bf16+bf16-true", "two precisions"),
        ("checkpoint+checkpoint:auto", "checkpointing twice"),
        ("checkpoint:everything", "unknown checkpoint policy"),
        ("checkpoint:budget=lots", "bad budget"),
        ("checkpoint:budget=2", r"bad budget '2'.*fraction.*512MiB"),  # 2 bytes or 200%? refused when parsed
        ("checkpoint:budget=1.5", r"bad budget '1.5'.*fraction.*512MiB"),
        ("amp+checkpoint:budget=1e9", r"bad budget '1e9'"),
        ("", "not a mode"),
    ],
)
def test_bad_modes_list_the_valid_words(text, message):
    with pytest.raises(ValueError, match=message) as error:
        parse_mode(text)
    if "word" in message:
        assert all(word in str(error.value) for word in MODE_WORDS)


def test_parse_modes_and_duplicates():
    assert [m.name for m in parse_modes("baseline,amp,checkpoint,amp+checkpoint")] == [
        "baseline",
        "amp",
        "checkpoint",
        "amp+checkpoint",
    ]
    with pytest.raises(ValueError, match="named twice"):
        parse_modes("amp,amp")
    with pytest.raises(ValueError, match="no modes"):
        parse_modes(" , ")


def test_amp_means_fp16_on_cuda_and_bf16_on_cpu_like_lightning():
    assert resolve_precision("amp", "cpu") == "bf16-mixed"
    assert resolve_precision("amp", "cuda") == "16-mixed"
    assert resolve_precision("amp", torch.device("cuda", 1)) == "16-mixed"
    assert resolve_precision(None, "cuda") is None
    with pytest.warns(UserWarning, match="bf16-mixed"):
        assert resolve_precision("16-mixed", "cpu") == "bf16-mixed"


def test_trainer_kwargs():
    assert parse_mode("baseline").trainer_kwargs("cpu") == {"precision": "32-true", "callbacks": []}
    assert parse_mode("amp").trainer_kwargs("gpu")["precision"] == "16-mixed"
    kwargs = parse_mode("amp+checkpoint:budget=0.5").trainer_kwargs("cpu")
    assert kwargs["precision"] == "bf16-mixed"
    (callback,) = kwargs["callbacks"]
    assert type(callback).__name__ == "ActivationCheckpointing" and callback.policy == CheckpointBudget(fraction=0.5)


def test_true_half_precision_is_lightnings_half_precision_on_every_device():
    for text, precision, dtype, name in (
        ("bf16-true", "bf16-true", torch.bfloat16, "bf16-true"),
        ("fp16-true", "16-true", torch.float16, "fp16-true"),
    ):
        mode = parse_mode(text)
        assert mode.is_true_half and not mode.is_baseline and Mode(precision=precision).name == name
        assert mode.true_half_dtype() == dtype
        for device in ("cpu", "cuda"):  # no autocast, and no fallback on CPU: Lightning runs 16-true there as asked
            assert mode.precision_for(device) == precision and mode.autocast_dtype(device) is None
            assert mode.trainer_kwargs(device) == {"precision": precision, "callbacks": []}
        layer = nn.Linear(4, 4)
        with mode.autocast("cpu"):  # nothing to autocast: the module itself is converted
            assert layer(torch.randn(2, 4)).dtype == torch.float32
    for text in ("baseline", "bf16", "amp"):
        assert not parse_mode(text).is_true_half and parse_mode(text).true_half_dtype() is None
    assert resolve_precision("16-true", "cpu") == "16-true"
    kwargs = parse_mode("bf16-true+checkpoint").trainer_kwargs("cpu")
    assert kwargs["precision"] == "bf16-true" and type(kwargs["callbacks"][0]).__name__ == "ActivationCheckpointing"
    with pytest.raises(ValueError, match="'bf16-true' or '16-true'"):
        resolve_precision("8-true", "cpu")


def test_the_trainers_true_half_precision_is_the_mode_the_batch_size_search_estimates():
    import lightning.pytorch as pl

    from lightning_memkit.search.trainer_state import trainer_mode

    for precision in ("bf16-true", "16-true"):
        assert trainer_mode(pl.Trainer(precision=precision, accelerator="cpu", logger=False)) == Mode(
            precision=precision
        )
    assert trainer_mode(pl.Trainer(precision="bf16-mixed", accelerator="cpu", logger=False)) == Mode("bf16-mixed")
    assert trainer_mode(pl.Trainer(precision="32-true", accelerator="cpu", logger=False)) is None


def test_autocast_helper_for_plain_modules():
    layer = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with parse_mode("amp").autocast("cpu"):
        assert layer(x).dtype == torch.bfloat16
    with parse_mode("checkpoint").autocast("cpu"):
        assert layer(x).dtype == torch.float32
    assert parse_mode("bf16").autocast_dtype("cuda") == torch.bfloat16


def test_mode_is_a_frozen_hashable_value_with_a_default_name():
    mode = Mode(precision="bf16-mixed", checkpoint={nn.Linear})
    assert mode.name == "bf16+checkpoint:{Linear}"
    assert Mode().is_baseline and Mode().name == "baseline"
    assert hash(parse_mode("amp+checkpoint")) == hash(parse_mode("amp+checkpoint"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        mode.precision = None  # type: ignore[misc]
    with pytest.raises(ValueError, match="precision"):
        Mode(precision="fp8")
    assert parse_mode("amp+checkpoint").to_dict() == {
        "name": "amp+checkpoint",
        "precision": "amp",
        "checkpoint": "auto",
    }
