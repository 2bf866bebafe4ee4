"""The planner's choice against brute force, on CPU: stable across runs, and within 5% of the best.

For each case (a model and a memory budget below its batch's peak):

- **plans**: ``plan_fit`` runs ``--runs`` times (default 5), its defaults otherwise; each run's choice, trials and time;
- **brute force over the plan's table**: every configuration the plan estimated to fit is trained for real under the
  budget (the planner's own trial runner: a real ``Trainer`` on a copy, the ``MemoryBudget`` accountant), ``--rounds``
  rounds (default 5) in rotated order, ``TIMED`` timed steps each; the fastest that fit in every round (the median
  of its round medians) is the reference;
- **side by side**: each distinct choice against the brute-force best, timed alternately in ``--head-to-head`` rounds
  (default 7); the median of the per-round ratios is the verdict (brute force's medians are rounds minutes apart, and
  a CPU drifts by tens of percent).

Model sets (``--models``):

- ``held-out`` (default): two models no planner test uses, each at half its batch's real peak (measured by a real
  step): a small vision transformer with dropout (patch embedding, 4 pre-norm blocks of ``nn.MultiheadAttention`` and
  an MLP) and a ConvMixer-style CNN with BatchNorm (depthwise and pointwise convolutions, residual blocks);
- ``three``: the three models x two budgets of benchmarks/README.md's earlier tables (tests/helpers/lightning_gpt.py's
  TinyGPT LM, zoo.DemoResNet, a Hugging Face GPT-2 from a config), budgets half-way between the batch's and half the
  batch's estimated peaks ("mild") and between a quarter's and an eighth's ("tight").

Prints one markdown table (and every plan's and configuration's figures on stderr).

    python benchmarks/plan_choice.py                       # held-out, 5 plans per model
    python benchmarks/plan_choice.py --models three --runs 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

warnings.filterwarnings("ignore")

#: timed optimizer steps per brute-force configuration and round (after one warm-up step)
TIMED = 6


class TinyViT(pl.LightningModule):
    """A vision transformer: 4x4 patches of 32x32 images, 4 pre-norm blocks (multi-head attention, GELU MLP, dropout
    0.1), mean-pooled, 10 classes."""

    def __init__(self, batch_size: int = 32, width: int = 96, depth: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.batch_size = batch_size
        self.patches = nn.Conv2d(3, width, kernel_size=4, stride=4)
        self.position = nn.Parameter(torch.zeros(1, 64, width))
        self.blocks = nn.ModuleList(_ViTBlock(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 10)
        generator = torch.Generator().manual_seed(0)
        self.data = TensorDataset(
            torch.randn(8 * batch_size, 3, 32, 32, generator=generator),
            torch.randint(0, 10, (8 * batch_size,), generator=generator),
        )

    def forward(self, images):
        x = self.patches(images).flatten(2).transpose(1, 2) + self.position
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(1))

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        return nn.functional.cross_entropy(self(images), labels)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class _ViTBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, 4, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * width, width))

    def forward(self, x):
        y = self.norm1(x)
        x = x + self.attention(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class ConvMixer(pl.LightningModule):
    """A ConvMixer-style CNN: a patch stem, then residual depthwise 5x5 convolutions and pointwise 1x1 ones, each
    with GELU and BatchNorm, global pooling, 10 classes; 24x24 images."""

    def __init__(self, batch_size: int = 32, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.batch_size = batch_size
        self.stem = nn.Sequential(nn.Conv2d(3, width, 2, stride=2), nn.GELU(), nn.BatchNorm2d(width))
        self.blocks = nn.ModuleList(_MixerBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 10)
        generator = torch.Generator().manual_seed(1)
        self.data = TensorDataset(
            torch.randn(8 * batch_size, 3, 24, 24, generator=generator),
            torch.randint(0, 10, (8 * batch_size,), generator=generator),
        )

    def forward(self, images):
        x = self.stem(images)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((2, 3)))

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        return nn.functional.cross_entropy(self(images), labels)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class _MixerBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.depthwise = nn.Sequential(nn.Conv2d(width, width, 5, padding=2, groups=width), nn.GELU())
        self.norm1 = nn.BatchNorm2d(width)
        self.pointwise = nn.Sequential(nn.Conv2d(width, width, 1), nn.GELU(), nn.BatchNorm2d(width))

    def forward(self, x):
        return self.pointwise(x + self.norm1(self.depthwise(x)))


class GPT2Module(pl.LightningModule):
    """A GPT-2 from a transformers GPT2Config (no download), trained on its own LM loss over random token ids."""

    def __init__(self, batch_size: int = 16, seq: int = 32, vocab: int = 256, layers: int = 2, width: int = 64) -> None:
        super().__init__()
        import transformers

        torch.manual_seed(0)
        config = transformers.GPT2Config(
            vocab_size=vocab,
            n_embd=width,
            n_layer=layers,
            n_head=4,
            n_positions=seq,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
        )
        self.model = transformers.GPT2LMHeadModel(config)
        self.batch_size = batch_size
        self.ids = torch.randint(0, vocab, (4 * batch_size, seq), generator=torch.Generator().manual_seed(0))

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.ids), batch_size=self.batch_size)

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class LMModule(pl.LightningModule):
    """tests/helpers/lightning_gpt.py's TinyGPT with a train_dataloader of its own (the planner reads the module's
    batch)."""

    def __init__(self, batch_size: int = 16, seq: int = 32) -> None:
        super().__init__()
        from tests.helpers.lightning_gpt import TinyGPT

        torch.manual_seed(0)
        self.gpt = TinyGPT(vocab=256, d_model=64, heads=4, layers=2, seq_len=seq)
        self.batch_size = batch_size
        tokens = torch.randint(0, 256, (4 * batch_size, seq + 1), generator=torch.Generator().manual_seed(0))
        self.data = TensorDataset(tokens[:, :-1], tokens[:, 1:])

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        return torch.nn.functional.cross_entropy(self.gpt(tokens).flatten(0, 1), targets.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _cnn():
    from lightning_memkit.zoo import DemoResNet

    torch.manual_seed(0)
    return DemoResNet(channels=8, image_size=16, batch_size=16)


MODELS = {
    "transformer LM (TinyGPT d64 x2, seq 32)": (lambda: LMModule(batch_size=16), 16),
    "CNN (DemoResNet c8, 16x16)": (_cnn, 16),
    "HF GPT-2 (GPT2Config d64 x2, seq 32)": (lambda: GPT2Module(batch_size=16), 16),
}


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties): Pearson's correlation of the ranks."""

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        result = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                result[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return result

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def baselines(plain: list, fits, batch: int) -> tuple:
    """The two one-knob answers, replayed on trials already run: ``(composer, its trials, finder, its trials)``.

    ``plain``: the configurations without checkpointing (one per micro-batch); ``fits(candidate)``: whether its trial
    fit. Composer-style: halve the micro-batch from the effective batch until a trial fits, accumulate (no
    checkpointing). BatchSizeFinder-style (power mode): double from 2 while it fits; then the largest divisor of the
    batch <= the largest that fit, accumulated to the effective batch."""
    composer, composer_trials = None, 0
    size = batch
    while size >= 1:
        candidate = next((c for c in plain if c.micro_batch == size), None)
        if candidate is not None:
            composer_trials += 1
            if fits(candidate):
                composer = candidate
                break
        size //= 2
    finder_trials, largest, size = 0, None, 2
    while size <= batch:
        candidate = next((c for c in plain if c.micro_batch == size), None)
        finder_trials += 1
        if candidate is None or not fits(candidate):
            break
        largest, size = size, size * 2
    finder = None
    if largest is not None:
        finder = max(
            (c for c in plain if c.micro_batch <= largest and fits(c)), key=lambda c: c.micro_batch, default=None
        )
    return composer, composer_trials, finder, finder_trials


def trial_figures(module, candidate, batch, budget: int, device: str, warmup: int, timed: int) -> tuple:
    """One planner trial (:func:`lightning_memkit.plan.trials.trial`) as ``(fits, peak bytes, samples/s, note)``."""
    from lightning_memkit.plan.trials import TrialSteps, trial

    record = trial(module, candidate, batch, budget, device, TrialSteps(warmup, timed))
    samples = candidate.effective_batch / record.median_step_s if record.fits else None
    return record.fits, record.peak_bytes, samples, record.note


def _half_real_peak(module) -> list[tuple[str, int]]:
    from lightning_memkit.estimate import measure_training_step

    return [("half the real peak", measure_training_step(module, device="cpu").peak_bytes // 2)]


def _mild_and_tight(module) -> list[tuple[str, int]]:
    from lightning_memkit.estimate import estimate_memory

    batch = module.batch_size
    peak = {
        size: estimate_memory(module, size, device="cpu").peak_bytes
        for size in (batch, batch // 2, batch // 4, batch // 8)
    }
    return [("mild", (peak[batch] + peak[batch // 2]) // 2), ("tight", (peak[batch // 4] + peak[batch // 8]) // 2)]


def _three():
    return [(name, make, _mild_and_tight) for name, (make, _) in MODELS.items()]


MODEL_SETS = {
    "held-out": lambda: [
        ("TinyViT (4 blocks, d96, 32x32, batch 32)", lambda: TinyViT(), _half_real_peak),
        ("ConvMixer (4 blocks, c64, BatchNorm, batch 32)", lambda: ConvMixer(), _half_real_peak),
    ],
    "three": _three,
}


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _brute_force(module, batch, budget: int, candidates: list, rounds: int) -> dict:
    """``{candidate: median samples/s}`` of every candidate that fit the budget in its trials (rotated rounds)."""
    from lightning_memkit.plan.trials import TrialSteps, trial

    speeds: dict = {c: [] for c in candidates}
    failed: set = set()
    for round_ in range(rounds):
        shift = round_ * len(candidates) // max(rounds, 1)
        order = candidates[shift:] + candidates[:shift]
        for candidate in order[::-1] if round_ % 2 else order:
            if candidate in failed:
                continue
            record = trial(module, candidate, batch, budget, "cpu", TrialSteps(1, TIMED))
            if not record.fits:
                failed.add(candidate)
                _say(f"#   brute {candidate.describe()}: {record.note}")
                continue
            speeds[candidate].append(candidate.effective_batch / record.median_step_s)
    result = {c: statistics.median(s) for c, s in speeds.items() if s and c not in failed}
    for candidate, speed in sorted(result.items(), key=lambda item: -item[1]):
        _say(f"#   brute {candidate.describe()}: {speed:.1f} samples/s ({len(speeds[candidate])} rounds)")
    return result


def _head_to_head(module, batch, chosen, best, rounds: int) -> float:
    """The median over ``rounds`` alternating rounds of ``best``'s step over ``chosen``'s (1.0: as fast; below 1: the
    choice is slower), each timed for a second (at least 5 steps) after one warm-up step; every round on stderr."""
    from lightning_memkit.plan.lightning_runs import timed_step

    ratios = []
    for round_ in range(rounds):
        pair = (chosen, best) if round_ % 2 else (best, chosen)
        step = {c: statistics.median(timed_step(module, c, batch, "cpu", 1, 5, 1.0)) for c in pair}
        ratios.append(step[best] / step[chosen])
        _say(
            f"#   side by side {round_ + 1}: {chosen.describe()} {step[chosen] * 1e3:.1f} ms, {best.describe()} "
            f"{step[best] * 1e3:.1f} ms (load {os.getloadavg()[0]:.1f})"
        )
    return statistics.median(ratios)


def _case(name: str, make, label: str, budget: int, args) -> dict:
    from lightning_memkit.estimate.data.worst_batch import worst_batch_and_length
    from lightning_memkit.plan import plan_fit

    module = make()
    plans = []
    for run in range(args.runs):
        started = time.perf_counter()
        plan = plan_fit(module, device_memory=budget, device="cpu", verbose=False)
        plans.append((plan, time.perf_counter() - started))
        _say(
            f"# {name} {label} run {run + 1}: {plan.best.describe() if plan.best else None} ({plan.trials} trials, "
            f"{plans[-1][1]:.0f} s): {plan.reason}"
        )
    candidates = [row.candidate for row in plans[0][0].rows if row.fits]
    batch = worst_batch_and_length(module, None)[0].batch
    brute = _brute_force(module, batch, budget, candidates, args.rounds)
    best = max(brute, key=brute.get) if brute else None
    choices = [plan.best for plan, _ in plans]
    verdicts = {}
    for chosen in dict.fromkeys(c for c in choices if c is not None):
        if best is None or chosen == best:
            verdicts[chosen] = 1.0
        else:
            verdicts[chosen] = _head_to_head(module, batch, chosen, best, args.head_to_head)
        _say(f"#   {chosen.describe()}: {verdicts[chosen]:.1%} of the best side by side")
    return {
        "name": name,
        "label": label,
        "budget": budget,
        "choices": choices,
        "best": best,
        "brute": brute,
        "verdicts": verdicts,
        "seconds": [s for _, s in plans],
        "trials": [p.trials for p, _ in plans],
    }


def main() -> None:
    from lightning_memkit.units import format_bytes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", choices=sorted(MODEL_SETS), default="held-out")
    parser.add_argument("--runs", type=int, default=5, help="plans per case (default 5)")
    parser.add_argument("--rounds", type=int, default=5, help="brute-force rounds (default 5)")
    parser.add_argument("--head-to-head", type=int, default=7, help="side-by-side rounds per distinct choice")
    args = parser.parse_args()
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    from provenance import provenance_line

    print(provenance_line())
    print(f"# torch threads {torch.get_num_threads()}, load average at start {os.getloadavg()[0]:.1f}")
    print(
        "| model | budget | plan's choices (runs) | same every run | brute force's best | choice / best, side by side "
        "| plan seconds (median) | trials |"
    )
    print("|---|---|---|---|---|---|---:|---|")
    started = time.perf_counter()
    for name, make, budgets in MODEL_SETS[args.models]():
        for label, budget in budgets(make()):
            r = _case(name, make, label, budget, args)
            counts = {c: r["choices"].count(c) for c in dict.fromkeys(r["choices"])}
            shown = "; ".join(f"{c.describe() if c else 'none'} x{n}" for c, n in counts.items())
            verdict = ", ".join(f"{v:.1%}" for v in r["verdicts"].values()) or "-"
            print(
                f"| {name} | {label}: {format_bytes(budget)} | {shown} | {'yes' if len(counts) == 1 else 'no'} | "
                f"{r['best'].describe() if r['best'] else '-'} | {verdict} | {statistics.median(r['seconds']):.0f} | "
                f"{', '.join(map(str, r['trials']))} |",
                flush=True,
            )
    print(f"\ntotal {time.perf_counter() - started:.0f} s, load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
