"""Fine-tuning a Llama-7B- and a Llama-70B-shaped model on one device: the estimate against counts written here by
hand from the architecture, and a smaller variant against a real CPU step.

The models are ``transformers.LlamaForCausalLM`` built on the meta device inside a LightningModule
(tests/helpers/llama_shapes.py), trained on random tokens of sequence 2048 with AdamW, in full or with peft LoRA (rank
16 on q/k/v/o), bf16-mixed or bf16-true, with and without activation checkpointing, at batch 1 and 4, for an H100. Every
category of the estimate's peak equals the count below to the byte (which is within 1%, and leaves no difference to
explain), and so does the peak.

How the counts were found: the tensors a ``LlamaDecoderLayer`` saves for backward were listed on a small config with
torch's ``saved_tensors_hooks`` (real CPU steps, each saved storage's shape, dtype and the module that saved it);
:meth:`LlamaCount.saved_per_layer` writes them out. The moment of the peak is one of three, and the count says which:
the end of the second forward (at the loss, the first step's gradients still alive: Lightning zeroes them just before
backward), the start of the second backward (the cross-entropy's gradient), or the first optimizer step (AdamW's
multi-tensor step, as torch runs it on CUDA, holds a square root of every ``exp_avg_sq``).
"""

from __future__ import annotations

import copy
import enum
import json
import os
import re
import time
from dataclasses import dataclass

import pytest
import torch

from lightning_memkit import estimate_memory, parse_mode
from lightning_memkit.accounting.categories import CATEGORIES
from lightning_memkit.cli import main
from lightning_memkit.units import format_bytes
from tests.helpers.dispatch_counter import StorageCounter
from tests.helpers.llama_shapes import LORA_RANK, SHAPES, LlamaFineTune
from tests.helpers.paths import REPO_ROOT

pytest.importorskip("transformers")
pytest.importorskip("peft")

SEQ = 2048
#: the cuBLAS workspace on an H100 (sm90), one per stream that runs a matmul: the forward's and the backward's
CUBLAS_WORKSPACE = 32 * 2**20
#: flash attention's RNG state, saved for backward by every call (torch's meta kernel: a seed of two uint64 and an
#: offset of one)
FLASH_RNG_STATE = 16 + 8
INT64, FP32, BF16 = 8, 4, 2


def _has_mode(word: str) -> bool:
    try:
        parse_mode(word)
    except ValueError:
        return False
    return True


TRUE_HALF_MISSING = "the mode 'bf16-true' does not exist on this branch yet (modes accept fp32, bf16-mixed, 16-mixed)"


class Moment(enum.Enum):
    """Where a step can peak, as the estimate names it: (phase, step)."""

    FORWARD_END = ("forward", 2)  # at the loss of the second step, the first step's gradients still alive
    BACKWARD_START = ("backward", 2)  # the cross-entropy's backward: log_softmax's gradient beside the loss's
    OPTIMIZER = ("optimizer", 1)  # AdamW's foreach step: a square root of every exp_avg_sq at once


@dataclass(frozen=True)
class Case:
    shape: str
    lora: bool
    precision: str  # "bf16-mixed" or "bf16-true"
    checkpoint: bool
    batch: int

    @property
    def mode(self) -> str:
        return self.precision + ("+checkpoint" if self.checkpoint else "")

    @property
    def id(self) -> str:
        return f"{self.shape}-{'lora' if self.lora else 'full'}-{self.mode}-b{self.batch}"


class LlamaCount:
    """The bytes of one fine-tuning step of a Llama-shaped model, counted from its shapes (``B`` batch, ``S``
    sequence, ``h`` hidden, ``L`` layers, ``H`` heads of size ``d``, ``kv`` = key/value heads x ``d``, ``ff`` MLP
    width, ``V`` vocabulary, ``R`` LoRA rank)."""

    def __init__(self, case: Case) -> None:
        size = SHAPES[case.shape]
        self.case = case
        self.B, self.S = case.batch, SEQ
        self.h, self.L, self.H, self.ff, self.V = (
            size[k] for k in ("hidden", "layers", "heads", "intermediate", "vocab")
        )
        self.d = self.h // self.H
        self.kv = size["kv_heads"] * self.d
        self.R = LORA_RANK
        self.mixed = case.precision == "bf16-mixed"
        self.w = FP32 if self.mixed else BF16  # bytes of a parameter (and of its gradient and Adam moments)

    # ------------------------------------------------------------------ parameters (elements)
    def layer_matmul(self) -> int:
        """A decoder layer's matmul weights: q and o (h x h), k and v (kv x h), gate, up and down (h x ff each)."""
        return 2 * self.h * self.h + 2 * self.h * self.kv + 3 * self.h * self.ff

    def base_parameters(self) -> int:
        """The embedding and lm_head (V x h each, untied), each layer's matmuls and two RMSNorm weights, the final
        norm."""
        return 2 * self.V * self.h + self.L * (self.layer_matmul() + 2 * self.h) + self.h

    def adapter_parameters(self) -> int:
        """LoRA's A (R x in) and B (out x R) on q (h -> h), k and v (h -> kv) and o (h -> h), per layer."""
        return self.L * self.R * (6 * self.h + 2 * self.kv)

    def trainable(self) -> tuple[int, int]:
        """(elements, tensors) the optimizer steps: every parameter, or LoRA's A and B of four projections a layer."""
        if self.case.lora:
            return self.adapter_parameters(), 8 * self.L
        return self.base_parameters(), 9 * self.L + 3

    # ------------------------------------------------------------------ model states (the ZeRO paper's arithmetic)
    def model_states(self) -> dict[str, int]:
        """Parameters, gradients and AdamW's state, in bytes.

        The ZeRO paper counts mixed-precision Adam as 2 + 2 + 12 = 16 bytes per parameter: fp16 parameters and
        gradients, and fp32 master parameters, momentum and variance. Lightning's bf16-mixed keeps the fp32 parameter
        as the master and an fp32 gradient, so the same 16 bytes split 4 + 4 + 8; the bf16 copies autocast makes for
        the matmuls (ZeRO's 2 bytes of fp16 parameter) come on top, alive from a weight's forward to its backward
        (:meth:`weight_copies`). bf16-true keeps no master: 2 + 2 + 4 = 8 bytes (Adam's moments in the parameter's
        dtype). AdamW adds a float32 ``step`` per parameter tensor. LoRA freezes the base (parameters only) and trains
        the adapters with the same arithmetic.
        """
        params, tensors = self.trainable()
        total = self.base_parameters() + (self.adapter_parameters() if self.case.lora else 0)
        return {
            "parameters": self.w * total,
            "gradients": self.w * params,
            "optimizer_state": 2 * self.w * params + FP32 * tensors,
        }

    # ------------------------------------------------------------------ autocast's weight copies (bf16-mixed only)
    def weight_copies(self, moment: Moment) -> int:
        """Bytes of autocast's bf16 copies of the weights alive at ``moment``.

        Autocast caches the copy of a weight that requires grad until autocast exits (the end of training_step); a
        matmul saves the copy of its weight for the backward of its input. So in the forward every trainable matmul
        weight's copy is alive, in the backward only the saved ones: all of them without checkpointing, the last
        layer's with it (a checkpointed layer's forward saves nothing). A frozen weight (LoRA's base) is cast at every
        call and kept only where saved: where its input needs a gradient, which layer 0's q, k and v inputs do not
        (the embedding is frozen too).
        """
        if not self.mixed or moment is Moment.OPTIMIZER:
            return 0
        layers = 1 if self.case.checkpoint else self.L
        if not self.case.lora:
            cached = self.L if moment is Moment.FORWARD_END else layers
            return BF16 * (cached * self.layer_matmul() + self.V * self.h)
        base = self.V * self.h + layers * self.layer_matmul()
        if not self.case.checkpoint:  # layer 0's q, k, v have no input gradient: their copies are not saved
            base -= self.h * self.h + 2 * self.h * self.kv
        a_per_layer, b_per_layer = 4 * self.R * self.h, self.R * (2 * self.h + 2 * self.kv)
        if moment is Moment.FORWARD_END:
            adapters = self.L * (a_per_layer + b_per_layer)  # in autocast's cache
        else:  # saved: every B (its input, A's output, needs a gradient); an A where its input needs one
            adapters = layers * (a_per_layer + b_per_layer)
            if not self.case.checkpoint:
                adapters -= 3 * self.R * self.h  # layer 0's q, k, v A copies
        return BF16 * (base + adapters)

    # ------------------------------------------------------------------ activations: what backward keeps
    def saved_per_layer(self, index: int) -> list[tuple[str, int]]:
        """Every tensor a (not checkpointed) ``LlamaDecoderLayer`` number ``index`` saves for backward, in bytes (the
        weights and their copies aside). Listed from the layer's real steps (see the module docstring)."""
        B, S, h, kv, ff, H, R = self.B, self.S, self.h, self.kv, self.ff, self.H, self.R
        attention = [
            ("q after RoPE (B, H, S, d), bf16", BF16 * B * S * h),
            ("k after RoPE (B, kv heads, S, d), bf16", BF16 * B * S * kv),
            ("v (B, kv heads, S, d), bf16", BF16 * B * S * kv),
            ("attention output (B, H, S, d), bf16 (also o_proj's input)", BF16 * B * S * h),
            ("flash attention's logsumexp (B, H, S), fp32", FP32 * B * H * S),
            ("flash attention's RNG seed and offset", FLASH_RNG_STATE),
        ]
        lora, first = self.case.lora, index == 0
        if self.mixed and not lora:
            norm = [("norm input (B, S, h), fp32", FP32 * B * S * h), ("rsqrt (B, S, 1), fp32", FP32 * B * S)]
            norm.append(("normalized input, before the weight (B, S, h), fp32", FP32 * B * S * h))
            projections = [(f"{p}_proj input cast to bf16 (B*S, h)", BF16 * B * S * h) for p in "qkv"]
            mlp = [(f"{p}_proj input cast to bf16 (B*S, h)", BF16 * B * S * h) for p in ("gate", "up")]
            mlp += [(name, BF16 * B * S * ff) for name in ("gate output (SiLU's input)", "SiLU output", "up output")]
            mlp.append(("SiLU x up (down_proj's input), bf16", BF16 * B * S * ff))
            return [*norm, *projections, *attention, *norm, *mlp]
        if self.mixed:  # LoRA: the base is frozen, so a base matmul saves no input and a norm no normalized input
            norm = [("norm input (B, S, h), fp32", FP32 * B * S * h), ("rsqrt (B, S, 1), fp32", FP32 * B * S)]
            adapters = []
            for p in "qkvo":  # peft casts the input to A's fp32, then autocast to bf16: a copy per projection
                adapters += [(f"{p}_proj lora_A input cast to bf16 (B*S, h)", BF16 * B * S * h)]
                adapters += [(f"{p}_proj lora_A output (B*S, R), bf16", BF16 * B * S * R)]
            mlp = [(name, BF16 * B * S * ff) for name in ("gate output (SiLU's input)", "SiLU output", "up output")]
            return [*([] if first else norm), *adapters, *attention, *norm, *mlp]
        # bf16-true: no casts; RMSNorm computes in fp32 from a copy of its input, and returns bf16
        if not lora:
            norm = [("norm input cast to fp32 (B, S, h)", FP32 * B * S * h), ("rsqrt (B, S, 1), fp32", FP32 * B * S)]
            norm.append(("normalized input cast back to bf16 (B, S, h)", BF16 * B * S * h))
            mlp = [("norm output, gate_proj's and up_proj's input (B, S, h), bf16", BF16 * B * S * h)]
            mlp += [(name, BF16 * B * S * ff) for name in ("gate output (SiLU's input)", "SiLU output", "up output")]
            mlp.append(("SiLU x up (down_proj's input), bf16", BF16 * B * S * ff))
            projections = [("norm output, q/k/v_proj's input (B, S, h), bf16", BF16 * B * S * h)]
            return [*norm, *projections, *attention, *norm, *mlp]
        norm = [("norm input cast to fp32 (B, S, h)", FP32 * B * S * h), ("rsqrt (B, S, 1), fp32", FP32 * B * S)]
        adapters = [("norm output, the q/k/v lora_A input (B, S, h), bf16", BF16 * B * S * h)]
        adapters += [(f"{p}_proj lora_A output (B*S, R), bf16", BF16 * B * S * R) for p in "qkvo"]
        mlp = [(name, BF16 * B * S * ff) for name in ("gate output (SiLU's input)", "SiLU output", "up output")]
        return [*([] if first else norm), *adapters, *attention, *norm, *mlp]

    def saved_by_the_model(self, moment: Moment) -> list[tuple[str, int]]:
        """What the model saves outside its layers and is still saved at ``moment``, in bytes."""
        B, S, h, V = self.B, self.S, self.h, self.V
        act = FP32 if self.mixed else BF16  # the residual stream's dtype
        saved = [("RoPE cos and sin (1, S, d), shared by every layer and sample", 2 * act * S * self.d)]
        if self.mixed:
            saved += [("final norm input (B, S, h), fp32", FP32 * B * S * h), ("final rsqrt", FP32 * B * S)]
            if not self.case.lora:  # a trainable norm weight and lm_head
                saved += [("final normalized input (B, S, h), fp32", FP32 * B * S * h)]
                saved += [("lm_head input cast to bf16", BF16 * B * S * h)]
        else:
            saved += [("final norm input cast to fp32 (B, S, h)", FP32 * B * S * h), ("final rsqrt", FP32 * B * S)]
            if not self.case.lora:
                saved += [("final normalized input cast back to bf16", BF16 * B * S * h)]
                saved += [("final norm output, lm_head's input (B, S, h), bf16", BF16 * B * S * h)]
        saved.append(("log_softmax output (B*S, V), fp32", FP32 * B * S * V))
        if moment is Moment.FORWARD_END:  # nll_loss's backward, done before log_softmax's, releases its target
            # the labels padded by one (-100) and shifted: a view of the padded (1, S + 1) at batch 1, a copy otherwise
            saved.append(("shifted labels, int64", INT64 * (S + 1) if B == 1 else INT64 * B * S))
        return saved

    def activations(self, moment: Moment) -> int:
        """Bytes saved for backward at ``moment`` (forward end or backward start): every layer's (a checkpointed layer
        keeps only its input, which the checkpoint saves), and the model's."""
        if self.case.checkpoint:  # every layer but the last (the auto policy's): the last would be recomputed at once
            boundary = (FP32 if self.mixed else BF16) * self.B * self.S * self.h
            layers = (self.L - 1) * boundary + sum(b for _, b in self.saved_per_layer(self.L - 1))
        else:
            layers = sum(sum(b for _, b in self.saved_per_layer(i)) for i in range(self.L))
        return layers + sum(b for _, b in self.saved_by_the_model(moment))

    # ------------------------------------------------------------------ temporaries at each moment
    def temporaries(self, moment: Moment) -> list[tuple[str, int]]:
        """What else is alive at ``moment``: made during the step, neither saved nor a model state."""
        B, S, h, V = self.B, self.S, self.h, self.V
        live = [("cuBLAS workspaces of the forward's and the backward's stream", 2 * CUBLAS_WORKSPACE)]
        if moment is Moment.OPTIMIZER:
            return live + [("sqrt of every exp_avg_sq (AdamW's foreach step)", self.w * self.trainable()[0])]
        if self.case.checkpoint:  # the checkpoint keeps each layer's keyword arguments for the recompute
            live.append(("cache_position / position_ids (S,), int64", INT64 * S))
        if moment is Moment.BACKWARD_START:
            live += [("nll_loss's gradient (B*S, V), fp32", FP32 * B * S * V)]
            live += [("log_softmax's gradient (B*S, V), fp32", FP32 * B * S * V), ("loss and its gradient", 8)]
            return live
        if self.mixed:
            live.append(("final norm output (B, S, h), fp32, held by the model's output", FP32 * B * S * h))
        elif self.case.lora:
            live.append(("final norm output (B, S, h), bf16, held by the model's output", BF16 * B * S * h))
        live += [("logits (B, S, V), bf16", BF16 * B * S * V), ("logits.float() (B, S, V)", FP32 * B * S * V)]
        if B > 1:
            live.append(("labels padded by one (B, S + 1), int64", INT64 * B * (S + 1)))
        return live + [("loss and nll_loss's total weight", 8)]

    # ------------------------------------------------------------------ the peak
    def at(self, moment: Moment) -> dict[str, int]:
        """Every category's bytes at ``moment``."""
        states = self.model_states()
        counted = dict.fromkeys(CATEGORIES, 0)
        counted["parameters"] = states["parameters"]
        counted["buffers"] = 2 * (self.d // 2) * (FP32 if self.mixed else BF16)  # RoPE's inv_freq and its original
        counted["gradients"] = 0 if moment is Moment.BACKWARD_START else states["gradients"]  # zeroed before backward
        counted["optimizer_state"] = states["optimizer_state"]
        counted["autocast_weight_copies"] = self.weight_copies(moment)
        counted["activations"] = 0 if moment is Moment.OPTIMIZER else self.activations(moment)
        counted["inputs"] = INT64 * self.B * self.S
        counted["temporaries"] = sum(b for _, b in self.temporaries(moment))
        return counted

    def peak(self) -> tuple[Moment, dict[str, int]]:
        """The moment with the most bytes, and its categories."""
        moment = max(Moment, key=lambda m: sum(self.at(m).values()))
        return moment, self.at(moment)


CASES = [
    Case(shape, lora, precision, checkpoint, batch)
    for shape in ("7b", "70b")
    for lora in (False, True)
    for precision in ("bf16-mixed", "bf16-true")
    for checkpoint in (False, True)
    for batch in (1, 4)
]


#: the batch-4 and 70B cases `make test` runs; `make test-extended` runs every case (a 70B estimate: 6-15 s on a quiet
#: 2-core machine, 15-60 s when the cores are shared; how a category grows with the batch is checked apart, below)
MAIN_LANE = {"7b-full-bf16-mixed+checkpoint-b4", "70b-full-bf16-mixed-b1"}


def _marks(case: Case) -> list:
    marks = []
    if case.shape == "70b" or case.batch == 4:
        marks.append(pytest.mark.slow if case.id in MAIN_LANE else pytest.mark.extended)
    if case.precision == "bf16-true" and not _has_mode("bf16-true"):
        marks.append(pytest.mark.skip(reason=TRUE_HALF_MISSING))
    return marks


_MODULES: dict[tuple[str, bool], LlamaFineTune] = {}


def _module(shape: str, lora: bool) -> LlamaFineTune:
    """The model, built once on the meta device (as ``memkit estimate --meta-init`` builds it)."""
    if (shape, lora) not in _MODULES:
        _MODULES.clear()  # one at a time: a 70B module on meta is small, but its fake copies are not
        with torch.device("meta"):
            _MODULES[(shape, lora)] = LlamaFineTune(shape, lora=lora)
    return _MODULES[(shape, lora)]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=_marks(c)) for c in CASES])
def test_one_device_step_equals_the_analytic_count(case):
    module = _module(case.shape, case.lora)
    started = time.perf_counter()
    estimate = estimate_memory(module, case.batch, mode=case.mode, device="cuda", gpu="h100")
    elapsed = time.perf_counter() - started
    count = LlamaCount(case)
    moment, expected = count.peak()
    assert (estimate.peak_phase, estimate.peak_step) == moment.value, (case.id, moment)
    assert estimate.by_category == expected, case.id
    assert estimate.peak_bytes == sum(expected.values())
    # the model states, by the ZeRO paper's arithmetic: 16 (bf16-mixed) or 8 (bf16-true) bytes per trained parameter,
    # and 4 (or 2) for a frozen one, beside a 4-byte step counter per trained tensor
    trained, tensors = count.trainable()
    frozen = count.base_parameters() if case.lora else 0
    if moment is not Moment.BACKWARD_START:
        states = sum(estimate.by_category[c] for c in ("parameters", "gradients", "optimizer_state"))
        per_trained = 16 if case.precision == "bf16-mixed" else 8
        assert states == per_trained * trained + count.w * frozen + 4 * tensors
    print(f"{case.id}: peak {estimate.peak_bytes} B in {moment.name.lower()}, {elapsed:.1f} s")


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_autocast_weight_copies_are_fixed_and_activations_grow_with_the_batch():
    """The categories mean what they say: between batch 1 and 4, the weight copies and model states stay put and the
    activations grow by what the batch makes: 4x their per-sample bytes."""
    module = _module("7b", False)
    one, four = (estimate_memory(module, b, mode="bf16", device="cuda", gpu="h100") for b in (1, 4))
    copies = LlamaCount(Case("7b", False, "bf16-mixed", False, 1)).weight_copies(Moment.FORWARD_END)
    assert one.by_category["autocast_weight_copies"] == four.by_category["autocast_weight_copies"] == copies
    for name in ("parameters", "gradients", "optimizer_state", "buffers"):
        assert one.by_category[name] == four.by_category[name]
    # RoPE's cos and sin are shared by every sample, flash attention's RNG state is per call; at batch 1 the saved
    # labels are a view of the labels padded by one
    shared = 2 * FP32 * SEQ * (4096 // 32) + 32 * FLASH_RNG_STATE
    padding = INT64
    assert four.by_category["activations"] - shared == 4 * (one.by_category["activations"] - shared - padding)


# ------------------------------------------------------------------------------ a smaller variant, on a real CPU step
SMALL_SEQ = 128  # the real step's compute grows with the sequence; 128 tokens keep it to seconds on two cores


def _real_peak(module: LlamaFineTune, mode: str) -> int:
    """Two real steps in Lightning's order (training_step under the mode's autocast, zero_grad, backward, the
    optimizer's step) on a copy, their absolute peak counted by tests/helpers/dispatch_counter.py (no memkit code)."""
    model = copy.deepcopy(module)
    model.train()
    batch = next(iter(model.train_dataloader()))
    optimizer = model.configure_optimizers()
    counter = StorageCounter(existing=[*model.parameters(), *model.buffers(), *batch])
    with counter:
        for index in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16"):
                loss = model.training_step(batch, index)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            del loss
            optimizer.step()
    return counter.peak_bytes


@pytest.mark.slow  # two real steps of a 166M-parameter model: 5 s on a quiet 2-core machine, 50 s when shared
@pytest.mark.timeout(600)
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(
    "mode",
    # fp32's real step is the slower (20 s when the cores are shared): in make test-extended; bf16 in every run
    [pytest.param("baseline", marks=pytest.mark.extended), "bf16"],
)
def test_small_variant_estimate_equals_a_real_cpu_step(mode):
    """Hidden 1024, 8 layers (the 7B's vocabulary, heads of 64): the CPU estimate is the real step's peak, to the
    byte."""
    torch.manual_seed(0)
    module = LlamaFineTune("small", seq_len=SMALL_SEQ)
    assert estimate_memory(module, 1, mode=mode, device="cpu").peak_bytes == _real_peak(module, mode)


# ------------------------------------------------------------------------------ what a user sees when nothing fits
LLAMA_FILE = os.path.join(REPO_ROOT, "tests", "helpers", "llama_shapes.py")


def _cells(line: str) -> list[str]:
    return re.split(r"\s{2,}", line.strip())


def _rows_under(text: str, header: str) -> dict[str, list[str]]:
    """The rows of the first printed table whose header line starts with ``header``, by their first cell."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    width = len(_cells(lines[start]))
    rows = {}
    for line in lines[start + 2 :]:
        cells = _cells(line)
        if len(cells) != width:
            break
        rows[cells[0]] = cells
    return rows


@pytest.mark.slow  # five 7B estimates (two of them checkpointed): 14 s on a quiet 2-core machine, 26 s when shared
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_7b_full_fine_tune_at_80gib_prints_its_breakdown_and_the_computed_suggestions(tmp_path, capsys):
    out_json = tmp_path / "7b.json"
    arguments = [LLAMA_FILE + ":LlamaFineTune", "--meta-init", "--device-memory", "80GiB", "--modes", "bf16"]
    status = main(["estimate", *arguments, "--json", str(out_json)])
    out = capsys.readouterr().out
    assert status == 1  # the mode asked for does not fit
    data = json.loads(out_json.read_text())
    (result,) = data["results"]
    estimate, needs = result["estimate"], {n["mode"]: n for n in data["mode_needs"]}
    assert result["fits"] is False and result["max_batch"] is None and "error" not in result
    # the table's row: every figure, with "does not fit" where the largest batch would be
    row = _rows_under(out, "mode")["bf16"]
    cuda = estimate["cuda"]
    assert row[1:] == [
        "1",
        format_bytes(cuda["peak_allocated_bytes"]),
        format_bytes(cuda["peak_reserved_bytes"]),
        format_bytes(estimate["required_bytes"]),
        format_bytes(needs["bf16"]["required_bytes"]),
        "does not fit",
        "-",
    ]
    # the breakdown at the peak (batch 1 here), by the count written above; a sample more, by the count at batch 2
    one, two = (LlamaCount(Case("7b", False, "bf16-mixed", False, b)) for b in (1, 2))
    (moment_one, at_one), (moment_two, at_two) = one.peak(), two.peak()
    assert moment_one is moment_two is Moment.FORWARD_END
    breakdown = _rows_under(out, "category")
    for name in CATEGORIES:
        per_sample = at_two[name] - at_one[name]
        if at_one[name] or per_sample:
            assert breakdown[name][1:] == [format_bytes(at_one[name])] * 2 + [format_bytes(per_sample)], name
    for name in ("parameters", "gradients", "optimizer_state", "autocast_weight_copies"):
        assert breakdown[name][3] == "0 B"  # the model's, whatever the batch
    assert estimate["by_category"] == at_one and result["batch_split"]["peak_phases"] == ["forward"] * 3
    # the suggestions: each other mode estimated at batch 1; printed only where it needs less than bf16
    assert set(needs) == {"bf16", "baseline", "checkpoint", "bf16+checkpoint", "bf16-true", "bf16-true+checkpoint"}
    for mode, precision, checkpoint in (("bf16+checkpoint", "bf16-mixed", True), ("bf16-true", "bf16-true", False)):
        counted = LlamaCount(Case("7b", False, precision, checkpoint, 1)).peak()[1]
        assert needs[mode]["peak_bytes"] == sum(counted.values()), mode
    ran = needs["bf16"]["required_bytes"]
    less = sorted((n for n in needs.values() if n["required_bytes"] < ran), key=lambda n: n["required_bytes"])
    assert less and result["suggestions"] == [n["mode"] for n in less]
    tried = [line.strip() for line in out.splitlines() if line.strip().startswith("try --modes")]
    assert tried == [
        f"try --modes {n['mode']}: needs {format_bytes(n['required_bytes'])} at batch size 1 "
        f"({format_bytes(ran - n['required_bytes'])} less; "
        f"{'fits' if n['fits'] else 'does not fit 76.00 GiB either'})"
        for n in less
    ]
    # true half precision (no fp32 master weights: 8 bytes per parameter, not 16) fits one 80 GiB card at batch 1
    assert needs["bf16-true"]["fits"] and needs["bf16-true"]["required_bytes"] <= 76 * 2**30
    assert "none of them fits one device" not in out


@pytest.mark.extended  # four 7B LoRA estimates at batch 1 and one at batch 2: 21 s quiet, 58 s on 2 shared cores
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_lora_checkpointed_at_24gib_suggests_only_modes_that_need_less(tmp_path, capsys):
    """LoRA + bf16 + checkpointing does not fit 24 GiB. bf16 alone needs far more at batch 1 (every layer keeps its
    activations), so it is not suggested; a mode is suggested only where its own estimate needs less."""
    out_json = tmp_path / "lora.json"
    arguments = [LLAMA_FILE + ":LlamaFineTune", "--init-args", '{"lora": true}', "--meta-init", "--device-memory"]
    status = main(["estimate", *arguments, "24GiB", "--modes", "bf16+checkpoint", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert status == 1
    data = json.loads(out_json.read_text())
    needs = {n["mode"]: n["required_bytes"] for n in data["mode_needs"]}
    ran = needs["bf16+checkpoint"]
    assert needs["bf16"] > ran + 16 * 2**30  # what the old hint offered first
    less = sorted((m for m in needs if needs[m] < ran), key=needs.get)
    assert data["results"][0]["suggestions"] == less and "bf16" not in less
    tried = [line.strip().split(":")[0] for line in out.splitlines() if line.strip().startswith("try --modes")]
    assert tried == [f"try --modes {m}" for m in less]
