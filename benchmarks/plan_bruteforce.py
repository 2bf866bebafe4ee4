"""The planner against brute force, on CPU: issue 25's acceptance table.

Three models (a transformer LM, tests/lightning_gpt.py's TinyGPT; a CNN, zoo.DemoResNet; a Hugging Face GPT-2 built
from a GPT2Config, no download) x two CPU budgets each, both below the baseline's peak at the effective batch
(set from the estimate: half-way between the full batch's and half the batch's peak, and between a quarter's and
an eighth's). For each case:

- brute force: every configuration of the planner's space (``candidate_space``: micro-batch x accumulation x
  checkpointing, precision unchanged) trained for real, ``WARMUP`` optimizer steps then ``TIMED`` timed ones
  (median samples/s), in ``ROUNDS`` rounds of rotated order (the median of the rounds; configurations that are the
  same program pooled), its peak counted by the budget's accountant; the fastest that fit is the reference;
- the planner (``plan_fit``, at most 3 real trials): its choice's samples/s within 5% of the best? its trials, and
  whether its choice's real peak stayed under the budget. When the choice is not the brute-force best (nor the same
  program), the two are timed side by side in ``HEAD_TO_HEAD`` more rounds and the median of the per-round ratios is
  the verdict (brute force's medians come from rounds minutes apart, and this machine drifts by tens of percent).
  A choice slower than 5% but by less than those rounds' own noise (the planner's tie rule: ``TIE_ERRORS`` standard
  errors of the mean per-round log ratio) is a tie; "(a tie, lower peak)" marks a choice the plan itself settled as
  a tie. A choice that brute force ranks best is not checked again: the check can only clear a miss, not make one;
- Spearman's rank correlation of the planner's predicted samples/s with the brute-force samples/s over the
  configurations that fit in brute force and that the plan estimated: "plan" is its final ranking (on CPU the rows
  that ran at their measurement, the rest scaled by the model's error at their micro-batch), "model alone" the time
  model's before any trial (on CPU after its calibration steps);
- a Composer-style "halve the micro-batch until it fits, accumulate" and a BatchSizeFinder-style "largest power-of-two
  batch that fits (doubling from 2), then accumulate to the effective batch": their answers replayed on the
  brute-force trials (the same runs: a trial's fit or OOM does not change), with the trials each would have run.

The trials run through the planner's own trial runner (a real Trainer on a copy, the MemoryBudget accountant),
so brute force, the planner and the baselines are measured the same way. Prints one markdown table.

Run: python benchmarks/plan_bruteforce.py [lm|cnn|gpt-2 ...]   (environment: PLAN_BRUTE_ROUNDS, default 5;
PLAN_BRUTE_TIMED, default 10; PLAN_BRUTE_HEAD_TO_HEAD, default 9. One model's brute force is 15 configurations x
ROUNDS x (1 + TIMED) optimizer steps: minutes on an idle CPU; stderr has every configuration's rounds and every plan
row's prediction beside its measurement. benchmarks/README.md's table: PLAN_BRUTE_TIMED=30 PLAN_BRUTE_ROUNDS=7,
16 minutes.
PLAN_BRUTE_REFERENCE=run1.err,run2.err,...: no brute force runs; the reference is the pooled brute force of those
earlier runs' stderr logs, so a change to the time model is checked against a steadier reference in minutes)
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

WARMUP, TIMED = 1, int(os.environ.get("PLAN_BRUTE_TIMED", "10"))
#: rounds of the brute force (every configuration once per round, the order rotated; the median of the rounds)
ROUNDS = int(os.environ.get("PLAN_BRUTE_ROUNDS", "5"))
#: rounds of the side-by-side check of the planner's choice against the brute-force best (when they differ)
HEAD_TO_HEAD_ROUNDS = int(os.environ.get("PLAN_BRUTE_HEAD_TO_HEAD", "9"))
#: stderr logs of earlier whole runs (comma-separated): their pooled brute force is the reference, none is run
REFERENCE = [path for path in os.environ.get("PLAN_BRUTE_REFERENCE", "").split(",") if path]


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
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


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
    """tests/lightning_gpt.py's TinyGPT with a train_dataloader of its own (the planner reads the module's batch)."""

    def __init__(self, batch_size: int = 16, seq: int = 32) -> None:
        super().__init__()
        from lightning_gpt import TinyGPT

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


def _budgets(module, batch: int) -> list[tuple[str, int]]:
    from lightning_memkit.estimate.core import estimate_memory

    peak = {
        size: estimate_memory(module, size, device="cpu").peak_bytes
        for size in (batch, batch // 2, batch // 4, batch // 8)
    }
    return [("mild", (peak[batch] + peak[batch // 2]) // 2), ("tight", (peak[batch // 4] + peak[batch // 8]) // 2)]


def _brute_force(make, batch: int, rounds: int) -> tuple[dict, float, dict]:
    """Every configuration of the planner's space trained for real with no budget: ``{candidate: (peak bytes, median
    samples/s)}``. A budget's trial fails exactly when this peak (the same accountant's) is above it, so each budget's
    fitting set is read from these runs instead of training every configuration again per budget.

    The machine's speed drifts by tens of percent over a minute (a configuration's step took 24, 20 and 14 ms in
    three rounds a few seconds apart on an idle 2-core VM), so one pass in a fixed order would favour whatever ran
    when the machine was fast. Each configuration runs in ``rounds`` rounds, the order rotated and reversed from
    round to round, and its samples/s is the median of its round medians."""
    from lightning_memkit.estimate.batches import sample_batch_and_length
    from lightning_memkit.modes.checkpoint_policy import find_repeated_blocks
    from lightning_memkit.plan.space import DEFAULT_PLAN_MODES, candidate_space
    from lightning_memkit.plan.trials import trial as _trial

    module = make()
    sample, _ = sample_batch_and_length(module, None)
    space = candidate_space(
        batch, modes=DEFAULT_PLAN_MODES, device_type="cpu", can_checkpoint=bool(find_repeated_blocks(module))
    )
    _trial(module, space[0], sample, 1 << 50, "cpu", WARMUP, TIMED)  # discarded: the process's first steps run slower
    started = time.perf_counter()
    peaks: dict = {}
    speeds: dict = {candidate: [] for candidate in space}
    for round_ in range(rounds):
        shift = round_ * len(space) // rounds
        order = space[shift:] + space[:shift]
        for candidate in order[::-1] if round_ % 2 else order:
            fits, peak, samples, note = _trial(module, candidate, sample, 1 << 50, "cpu", WARMUP, TIMED)
            if not fits:
                raise RuntimeError(f"{candidate.describe()} did not run without a budget: {note}")
            peaks.setdefault(candidate, peak)
            speeds[candidate].append(samples)
    # Configurations that are the same program (a budget that chose the same blocks as "auto": the same real peak and
    # the same ops in the fake step) are one configuration measured twice: their rounds are pooled, so the reference
    # does not rank two samples of the machine's noise against each other.
    same = _same_programs(module, space, sample, peaks)
    runs = {}
    for candidate in space:
        pooled = [s for twin in same[candidate] for s in speeds[twin]]
        runs[candidate] = (peaks[candidate], statistics.median(pooled))
    for candidate, (peak, samples) in runs.items():
        spread = max(speeds[candidate]) / min(speeds[candidate]) - 1
        twins = [c.describe() for c in same[candidate] if c != candidate]
        print(
            f"#   {candidate.describe()}: peak {peak:,} B, {samples:.1f} samples/s (rounds: "
            f"{', '.join(f'{s:.0f}' for s in speeds[candidate])}; spread {spread:.0%})"
            + (f"; the same program as {', '.join(twins)}: rounds pooled" if twins else ""),
            file=sys.stderr,
            flush=True,
        )
    return runs, time.perf_counter() - started, {"module": module, "sample": sample, "same": same}


def _pooled_reference(make, batch: int, paths: list[str]) -> tuple[dict, float, dict]:
    """Brute force read back instead of run: per configuration, the median of the samples/s that the stderr logs of
    earlier whole runs of this script (``paths``) printed, and the real peak they printed (the same in every run: the
    accountant counts exactly). A plan takes half a minute where brute force takes minutes, so a change to the time
    model can be checked against a reference pooled from several runs (steadier than any one of them) in minutes; the
    reference is this machine's on the day of those runs."""
    from pathlib import Path

    from lightning_memkit.estimate.batches import sample_batch_and_length
    from lightning_memkit.modes.checkpoint_policy import find_repeated_blocks
    from lightning_memkit.plan.space import DEFAULT_PLAN_MODES, candidate_space
    from plan_bruteforce_pooled import read_brute

    module = make()
    sample, _ = sample_batch_and_length(module, None)
    space = candidate_space(
        batch, modes=DEFAULT_PLAN_MODES, device_type="cpu", can_checkpoint=bool(find_repeated_blocks(module))
    )
    name = next(n for n, (m, _) in MODELS.items() if m is make)
    logs = [read_brute(Path(path)).get(name) for path in paths]
    runs, peaks = {}, {}
    for candidate in space:
        measured = [log[candidate.describe()] for log in logs if log and candidate.describe() in log]
        if len(measured) < len(paths):
            raise SystemExit(
                f"PLAN_BRUTE_REFERENCE: {candidate.describe()} of {name} is not in every log: give whole runs"
            )
        peaks[candidate] = measured[0][0]
        runs[candidate] = (peaks[candidate], statistics.median(samples for _, samples in measured))
        # "#   reference" (not "#   micro"): a log of this mode must not read back as a brute-force run's
        print(
            f"#   reference {candidate.describe()}: peak {peaks[candidate]:,} B, {runs[candidate][1]:.1f} samples/s "
            f"(pooled: median "
            f"of {len(measured)} runs' {', '.join(f'{s:.0f}' for _, s in measured)})",
            file=sys.stderr,
            flush=True,
        )
    return runs, 0.0, {"module": module, "sample": sample, "same": _same_programs(module, space, sample, peaks)}


def _head_to_head(context: dict, chosen, best, rounds: int) -> tuple[float, list[float]]:
    """The planner's choice against the brute-force best, side by side: ``rounds`` rounds, each timing both (the order
    alternating), and the median of the per-round ratios ``chosen / best`` (samples/s), with the ratios.

    Brute force's medians come from rounds minutes apart, and this machine's speed drifts by tens of percent within a
    minute: two configurations a few percent apart can swap places between two brute-force runs. A ratio taken within
    one round (two trials seconds apart) cancels most of the drift, so it is what "within 5% of the best" is read from
    whenever the planner chose something other than the brute-force best."""
    from lightning_memkit.plan.trials import trial as _trial

    ratios = []
    for round_ in range(rounds):
        speeds = {}
        for candidate in (chosen, best) if round_ % 2 == 0 else (best, chosen):
            fits, _, samples, note = _trial(
                context["module"], candidate, context["sample"], 1 << 50, "cpu", WARMUP, TIMED
            )
            if not fits:
                raise RuntimeError(f"{candidate.describe()} did not run without a budget: {note}")
            speeds[candidate] = samples
        ratios.append(speeds[chosen] / speeds[best])
    return statistics.median(ratios), ratios


def paired_noise(ratios: list[float]) -> float | None:
    """The side-by-side rounds' noise as the planner's tie rule reads it (``TIE_ERRORS`` standard errors of the mean
    per-round log ratio), a fraction: the choice is a tie with the best when it is slower by no more than this.
    ``None`` with fewer than two rounds."""
    from lightning_memkit.plan.settle import TIE_ERRORS

    if len(ratios) < 2:
        return None
    logs = [math.log(r) for r in ratios]
    return math.exp(TIE_ERRORS * statistics.stdev(logs) / math.sqrt(len(logs))) - 1


def _same_programs(module, space, sample, peaks) -> dict:
    """``{candidate: [candidates that run the same program, itself included]}``: the same micro-batch, accumulation and
    precision, the same real peak (measured) and the same ops in the fake step (count, FLOPs, bytes)."""
    from lightning_memkit.estimate.core import reusing_fake_copies
    from lightning_memkit.plan.inputs import PlanInputs
    from lightning_memkit.plan.rows import estimate_row as _estimate_row
    from lightning_memkit.plan.rows import signature as _signature
    from lightning_memkit.plan.time_model import ROOFLINES, TimeModel

    keys = {}
    with reusing_fake_copies():
        for candidate in space:
            inputs = PlanInputs(module, sample, candidate.effective_batch, 1 << 50, "cpu", space)
            row = _estimate_row(inputs, candidate, TimeModel(ROOFLINES["h100"]))
            keys[candidate] = (_signature(row), peaks[candidate])
    return {c: [d for d in space if keys[d] == keys[c]] for c in space}


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


def _run_case(name: str, make, batch: int, label: str, budget: int, runs: dict, context: dict) -> dict:
    from lightning_memkit.plan.planner import plan_fit

    brute = {c: (peak <= budget, peak, samples) for c, (peak, samples) in runs.items()}
    fitting = {c: v for c, v in brute.items() if v[0]}
    best = max(fitting, key=lambda c: fitting[c][2]) if fitting else None

    plan = plan_fit(make(), batch_size=batch, device_memory=budget, device="cpu", verbose=False)
    chosen = plan.best
    chosen_brute = brute.get(chosen) if chosen is not None else None
    predicted = {row.candidate: row.predicted_samples_per_s for row in plan.rows}
    pairs = [(predicted[c], fitting[c][2]) for c in fitting if predicted.get(c) is not None]
    for row in plan.rows:  # the time model against brute force, row by row (stderr: the diagnosis, not the table)
        measured = brute.get(row.candidate)
        model_alone = (
            f" (model alone {row.candidate.effective_batch / row.model_step_s:.1f})" if row.model_step_s else ""
        )
        print(
            f"#     {row.candidate.describe()}: predicted {row.predicted_samples_per_s or 0:.1f} samples/s{model_alone}"
            f"{' (fits)' if row.fits else ''}, brute force {measured[2]:.1f}{' (fits)' if measured[0] else ''}; "
            f"trial: {row.note}",
            file=sys.stderr,
            flush=True,
        )
    for note in plan.notes:
        print(f"#     note: {note}", file=sys.stderr, flush=True)
    rho = spearman([p for p, _ in pairs], [m for _, m in pairs]) if len(pairs) >= 3 else float("nan")
    # the time model alone (CPU: after its calibration, before any trial) over the same rows
    alone = {row.candidate: row.candidate.effective_batch / row.model_step_s for row in plan.rows if row.model_step_s}
    model_pairs = [
        (alone[c], fitting[c][2]) for c in fitting if alone.get(c) is not None and predicted.get(c) is not None
    ]
    rho_model = (
        spearman([p for p, _ in model_pairs], [m for _, m in model_pairs]) if len(model_pairs) >= 3 else float("nan")
    )

    plain = [c for c in brute if c.checkpoint is None and not c.offload]
    composer, composer_trials, finder, finder_trials = baselines(plain, lambda c: brute[c][0], batch)

    def speed(candidate) -> float | None:
        return brute[candidate][2] if candidate is not None and candidate in brute and brute[candidate][0] else None

    best_speed = fitting[best][2] if best is not None else None
    # the planner's choice against the brute-force best, side by side, unless they are the same program
    head_to_head, ratios = None, []
    if (
        HEAD_TO_HEAD_ROUNDS > 0
        and chosen is not None
        and best is not None
        and chosen in brute
        and brute[chosen][0]
        and chosen not in context["same"][best]
    ):
        head_to_head, ratios = _head_to_head(context, chosen, best, HEAD_TO_HEAD_ROUNDS)
        print(
            f"#     head to head: {chosen.describe()} / {best.describe()} = {head_to_head:.1%} "
            f"(rounds: {', '.join(f'{r:.0%}' for r in ratios)})",
            file=sys.stderr,
            flush=True,
        )
    return {
        "head_to_head": head_to_head,
        "noise": paired_noise(ratios),
        "plan_tie": any(note.startswith("a tie within the measured noise") for note in plan.notes),
        "model": name,
        "label": label,
        "budget": budget,
        "space": len(brute),
        "fitting": len(fitting),
        "best": best,
        "best_speed": best_speed,
        "chosen": chosen,
        "chosen_speed": speed(chosen),
        "plan_speed": plan.best_row.measured_samples_per_s if plan.best_row else None,
        "plan_peak": plan.best_row.measured_peak_bytes if plan.best_row else None,
        "brute_peak": chosen_brute[1] if chosen_brute else None,
        "trials": plan.trials,
        "rho": rho,
        "rho_model": rho_model,
        "pairs": len(pairs),
        "composer": composer,
        "composer_speed": speed(composer),
        "composer_trials": composer_trials,
        "finder": finder,
        "finder_speed": speed(finder),
        "finder_trials": finder_trials,
        "plan_s": plan.seconds,
    }


def main() -> None:
    warnings.simplefilter("ignore")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    from lightning_memkit.units import format_bytes

    def describe(candidate) -> str:
        return candidate.describe().replace(", 32-true", "") if candidate is not None else "none fit"

    def pct(speed, best) -> str:
        return f"{100 * speed / best:.0f}%" if speed is not None and best else "-"

    def row(r) -> str:
        peak = r["plan_peak"] if r["plan_peak"] is not None else r["brute_peak"]
        under = "-" if peak is None else ("yes" if peak <= r["budget"] else "NO") + f" ({format_bytes(peak)})"
        if r["head_to_head"] is not None:  # measured side by side: the reference for the verdict
            share = (
                f"{100 * r['head_to_head']:.0f}% side by side ({pct(r['chosen_speed'], r['best_speed'])} by the "
                f"medians)"
            )
            within = "yes" if r["head_to_head"] >= 0.95 else "no"
            if within == "no" and r["noise"] is not None and r["head_to_head"] >= 1 / (1 + r["noise"]):
                # slower by less than the side-by-side rounds' own noise (the planner's tie rule): a tie
                within = f"tie (noise +-{r['noise']:.1%})"
        else:
            share = pct(r["chosen_speed"], r["best_speed"])
            within = (
                "-"
                if r["chosen_speed"] is None or not r["best_speed"]
                else ("yes" if r["chosen_speed"] >= 0.95 * r["best_speed"] else "no")
            )
        best = f"{describe(r['best'])} ({r['best_speed']:.1f})" if r["best"] is not None else "none fit"
        return (
            f"| {r['model']} | {r['label']} {format_bytes(r['budget'])} | {r['fitting']} / {r['space']} | {best} | "
            f"{describe(r['chosen'])}{' (a tie, lower peak)' if r['plan_tie'] else ''} | {share} | {within} | "
            f"{r['trials']} | {under} | "
            f"{r['rho']:.2f} (n={r['pairs']}) | {r['rho_model']:.2f} | "
            f"{describe(r['composer'])}: {pct(r['composer_speed'], r['best_speed'])}, {r['composer_trials']} trials | "
            f"{describe(r['finder'])}: {pct(r['finder_speed'], r['best_speed'])}, {r['finder_trials']} trials |"
        )

    started = time.perf_counter()
    if REFERENCE:
        print(
            f"CPU, torch {torch.__version__}, {torch.get_num_threads()} threads; brute force not run: the median of "
            f"{len(REFERENCE)} "
            f"earlier runs' ({', '.join(REFERENCE)}); samples/s as they measured them; % of that pooled best"
        )
    else:
        print(
            f"CPU, torch {torch.__version__}, {torch.get_num_threads()} threads; brute force {WARMUP} warm-up + "
            f"{TIMED} timed optimizer "
            f"steps per configuration and round (median), {ROUNDS} rounds in rotated order (median of the rounds); "
            f"samples/s as brute "
            "force measured them; % of the brute-force best"
        )
    print()
    print(
        "| model | budget | fit / space | brute-force best (samples/s) | planner's choice | % of best | within 5% | "
        "trials | "
        "real peak <= budget | Spearman (plan) | Spearman (model alone) | halve until it fits | "
        "largest batch, then accumulate |"
    )
    print("|---|---|---:|---|---|---:|---|---:|---|---:|---:|---|---|", flush=True)
    only = sys.argv[1:]
    for name, (make, batch) in MODELS.items():
        if only and not any(word.lower() in name.lower() for word in only):
            continue
        if REFERENCE:
            runs, seconds, context = _pooled_reference(make, batch, REFERENCE)
        else:
            runs, seconds, context = _brute_force(make, batch, ROUNDS)
        print(
            f"# {name}: "
            + (
                f"reference pooled from {len(REFERENCE)} runs"
                if REFERENCE
                else f"brute force {len(runs)} configurations in {seconds:.0f} s"
            ),
            file=sys.stderr,
            flush=True,
        )
        for label, budget in _budgets(make(), batch):
            result = _run_case(name, make, batch, label, budget, runs, context)
            print(row(result), flush=True)
            print(f"# {name} {label}: planned in {result['plan_s']:.0f} s", file=sys.stderr, flush=True)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
