"""The planner on a GPU: issue 25's device table (BERT-base and a ResNet-50 under 8 and 16 GiB, offload allowed).

    python benchmarks/plan_gpu.py                      # on a CUDA machine: both models, 8 and 16 GiB
    python benchmarks/plan_gpu.py bert --budgets 16GiB
    python benchmarks/plan_gpu.py --json out.json      # the rows and every trial, for the docs

Every output names where it came from (benchmarks/provenance.py): its first line on stdout and on stderr is
``# provenance: {...}`` (the commit and whether the tree had changes, torch, CUDA, the device), and ``--json``
writes ``{"provenance": {...}, "results": [...]}``.

A smaller GPU is simulated on a large one: the budget is the device's memory, so the caching allocator is capped
at the budget less the CUDA context's allowance (``torch.cuda.set_per_process_memory_fraction``), as a card of
that size would leave it. For each model and budget:

- the planner: ``plan_fit(device="cuda", device_memory=budget, modes="micro_batch,checkpoint,offload")`` (memory-only
  changes and offload; no precision change), at most 3 real trials (CUDA events, ``max_memory_allocated``);
- brute force: every configuration the planner estimated to fit, and those it predicted over the budget by at most
  ``OVER`` (a wrong "does not fit" would show there; the estimate's CUDA peaks are within 1% of real H100 ones), each
  run through the planner's own trial (a real Trainer on a copy, ``WARMUP`` steps then ``TIMED`` timed ones, median
  samples/s; it fits when it did not run out of memory under the cap and its reserved bytes plus the context stay
  in the budget). The smaller micro-batches the planner did not estimate (below two that fit in the same mode:
  the same FLOPs in more, smaller steps) are not run: a GPU lease is 15 minutes. The fastest that fit is the
  reference; the planner's choice is within 5%? its real peak under the budget?
- Spearman's rank correlation of the planner's predicted samples/s (the H100/H200 roofline, uncalibrated) with the
  measured over the configurations that fit, and the time model's error per row (predicted / measured step);
- "halve the micro-batch until it fits" and "largest power-of-two batch, then accumulate", replayed on the same
  trials (a smaller micro-batch than one that fit is taken to fit: memory grows with the micro-batch).

``--predict h200`` needs no GPU: it prints each case's plan table for that GPU, predictions only (the roofline
and the estimate run on fake tensors), what ``plan_gpu_table.py`` reads for rows a lease's plan did not print.
``--rows FILE`` runs no plan: it times the configurations a JSON file lists (``[{"model": word, "budget": bytes,
"rows": [Candidate.describe() text, ...]}]``) the same way, under the same cap: the rows a lease ran out of time for.

Environment: PLAN_GPU_WARMUP (default 1), PLAN_GPU_TIMED (default 3). ``--small`` runs tiny versions of both models
on this machine's device (CPU included) in seconds: a check of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from plan_choice import baselines, spearman  # noqa: E402
from provenance import provenance_line, write_json  # noqa: E402

WARMUP = int(os.environ.get("PLAN_GPU_WARMUP", "1"))
TIMED = int(os.environ.get("PLAN_GPU_TIMED", "3"))
#: brute force also runs the rows predicted over the budget by at most this share of it
OVER = 0.2
GiB = 1 << 30


def _models_module():
    from tests.helpers.gpu_truth import models_module

    return models_module()


class Bottleneck(nn.Module):
    """ResNet-50's block: 1x1 reduce, 3x3 (stride here), 1x1 expand x4, a projection when the shape changes."""

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = 4 * width
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


def resnet50(batch_size: int, size: int = 224, widths=(64, 128, 256, 512), depths=(3, 4, 6, 3), classes: int = 1000):
    """ResNet-50's layout (7x7/2 stem, max-pool, bottleneck stages 3-4-6-3, 25.6 M parameters at 1000 classes) on
    tests/data/gpu_truth/models.py's synthetic-data LightningModule base (AdamW, cross-entropy)."""
    base = _models_module()

    class ResNet50(base._Base):
        def __init__(self) -> None:
            super().__init__(batch_size, 4096)
            self.size = size
            self.stem = nn.Sequential(
                nn.Conv2d(3, widths[0], 7, 2, 3, bias=False),
                nn.BatchNorm2d(widths[0]),
                nn.ReLU(),
                nn.MaxPool2d(3, 2, 1),
            )
            blocks, cin = [], widths[0]
            for index, (width, depth) in enumerate(zip(widths, depths, strict=True)):
                for block in range(depth):
                    blocks.append(Bottleneck(cin, width, 2 if index > 0 and block == 0 else 1))
                    cin = 4 * width
            self.blocks = nn.Sequential(*blocks)
            self.fc = nn.Linear(cin, classes)

        def make_pool(self):
            g = torch.Generator().manual_seed(0)
            return (
                torch.randn(64, 3, self.size, self.size, generator=g),
                torch.randint(0, classes, (64,), generator=g),
            )

        def forward(self, x):
            return self.fc(self.blocks(self.stem(x)).mean((2, 3)))

        def loss(self, batch):
            x, y = batch
            return F.cross_entropy(self(x), y)

    torch.manual_seed(0)
    return ResNet50()


def bert_base(batch_size: int, **sizes):
    """tests/data/gpu_truth/models.py's BertLike: BERT-base (12 layers, d 768, seq 512) with a masked-LM head."""
    torch.manual_seed(0)
    return _models_module().BertLike(batch_size=batch_size, **sizes)


#: name: (build(batch_size), effective batch); the batch does not fit 16 GiB as is (BERT-base at 32: 17.7 GiB
#: allocated on an H100, tests/data/gpu_truth/truth.json; ResNet-50 at 256: about 22 GiB)
MODELS = {
    "BERT-base (seq 512, MLM head)": (bert_base, 32),
    "ResNet-50 (224x224)": (resnet50, 256),
}
#: tiny versions for ``--small``
SMALL = {
    "BERT-base (seq 512, MLM head)": (lambda b: bert_base(b, seq=32, vocab=128, d=32, layers=2, heads=2), 8),
    "ResNet-50 (224x224)": (lambda b: resnet50(b, size=32, widths=(4, 8, 8, 8), depths=(2, 2, 1, 1), classes=10), 8),
}


def _cap(budget: int, cuda: bool) -> None:
    """A card of ``budget`` bytes: the allocator may use the budget less the CUDA context's allowance."""
    if not cuda:
        return
    from lightning_memkit.estimate.cuda.caching_allocator import CUDA_CONTEXT_BYTES

    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, (budget - CUDA_CONTEXT_BYTES) / total))


def plain_fits(ran: dict[int, bool]):
    """``fits(candidate)`` for the one-knob baselines, from the plain micro-batches that ran (``{micro-batch: fit}``):
    one that did not run fits when a larger one fit (memory grows with the micro-batch), else it counts as out of
    memory (larger than every one that fit: the halving's first trial, predicted far over the budget)."""

    def fits(candidate) -> bool:
        if candidate.micro_batch in ran:
            return ran[candidate.micro_batch]
        return any(ok and micro > candidate.micro_batch for micro, ok in ran.items())

    return fits


def run_case(name: str, build, batch: int, budget: int, device: str, modes: str) -> dict:
    from lightning_memkit.estimate.data.batches import sample_batch_and_length
    from lightning_memkit.plan import plan_fit
    from lightning_memkit.plan.space import candidate_space
    from lightning_memkit.units import format_bytes
    from plan_choice import trial_figures as _trial

    cuda = device == "cuda"
    _cap(budget, cuda)
    log = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    module = build(batch)
    started = time.perf_counter()
    plan = plan_fit(module, device=device, device_memory=budget, modes=modes, verbose=False)
    plan_s = time.perf_counter() - started
    log(
        f"# {name} {format_bytes(budget)}: planned in {plan_s:.0f} s, {plan.trials} trials, best "
        f"{plan.best.describe() if plan.best else None}"
    )
    for note in plan.notes:
        log(f"#   note: {note}")
    sample, _ = sample_batch_and_length(module, None)
    runs = {}
    brute_started = time.perf_counter()
    for row in plan.rows:
        if row.predicted_peak_bytes is None or row.predicted_peak_bytes > (1 + OVER) * budget:
            continue
        try:
            fits, peak, samples, note = _trial(module, row.candidate, sample, budget, device, WARMUP, TIMED)
        except Exception as error:  # noqa: BLE001 - a row that fails (not out of memory) is reported, the rest still run
            fits, peak, samples, note = False, None, None, f"failed: {type(error).__name__}: {str(error)[:200]}"
        runs[row.candidate] = {
            "fits": fits,
            "peak": peak,
            "samples": samples,
            "note": note,
            "predicted_samples": row.predicted_samples_per_s,
            "predicted_peak": row.predicted_peak_bytes,
            "predicted_fits": row.fits,
            "trial": row.note,
        }
        log(
            f"#   {row.candidate.describe()}: predicted {format_bytes(row.predicted_peak_bytes)}, "
            f"{row.predicted_samples_per_s or 0:.1f} samples/s{' (fits)' if row.fits else ''}; brute force {note}, "
            f"peak {format_bytes(peak) if peak else '-'}, {samples or 0:.1f} samples/s; plan's trial: {row.note or '-'}"
        )
    brute_s = time.perf_counter() - brute_started
    fitting = {c: r for c, r in runs.items() if r["fits"]}
    best = max(fitting, key=lambda c: fitting[c]["samples"]) if fitting else None
    chosen = plan.best
    pairs = [(r["predicted_samples"], r["samples"]) for r in fitting.values() if r["predicted_samples"]]
    errors = [
        r["samples"] / r["predicted_samples"] for r in fitting.values() if r["predicted_samples"]
    ]  # = predicted / measured step

    space = candidate_space(batch, modes=modes, device_type=device, can_checkpoint=True)
    plain = sorted((c for c in space if c.checkpoint is None and not c.offload), key=lambda c: -c.micro_batch)

    fits = plain_fits({c.micro_batch: r["fits"] for c, r in runs.items() if c in plain})

    def speed(candidate):
        return runs[candidate]["samples"] if candidate in runs and runs[candidate]["fits"] else None

    composer, composer_trials, finder, finder_trials = baselines(plain, fits, batch)
    best_row = plan.best_row
    return {
        "model": name,
        "budget": budget,
        "batch": batch,
        "space": len(space),
        "estimated": len(runs),
        "fitting": len(fitting),
        "best": best.describe() if best else None,
        "best_speed": speed(best) if best else None,
        "chosen": chosen.describe() if chosen else None,
        "chosen_speed": speed(chosen) if chosen else None,
        "plan_speed": best_row.measured_samples_per_s if best_row else None,
        "plan_peak": best_row.measured_peak_bytes if best_row else None,
        "effective": chosen.effective_batch if chosen else None,
        "trials": plan.trials,
        "rho": spearman([p for p, _ in pairs], [m for _, m in pairs]) if len(pairs) >= 3 else float("nan"),
        "pairs": len(pairs),
        "error_median": statistics.median(errors) if errors else None,
        "error_range": (min(errors), max(errors)) if errors else None,
        "composer": composer.describe() if composer else None,
        "composer_speed": speed(composer) if composer else None,
        "composer_trials": composer_trials,
        "finder": finder.describe() if finder else None,
        "finder_speed": speed(finder) if finder else None,
        "finder_trials": finder_trials,
        "plan_s": plan_s,
        "brute_s": brute_s,
        "rows": [dict(candidate=c.describe(), **dict(r.items())) for c, r in runs.items()],
    }


def parse_candidate(text: str):
    """The :class:`~lightning_memkit.plan.space.Candidate` that ``Candidate.describe()`` wrote as ``text``."""
    from lightning_memkit.modes.checkpoint_policy import CheckpointBudget
    from lightning_memkit.plan.space import Candidate

    parts = text.split(", ")
    micro, _, accumulation = parts[0].removeprefix("micro ").partition(" x ")
    checkpoint, offload = None, False
    for part in parts[2:]:
        if part == "offload":
            offload = True
        elif part == "checkpoint auto":
            checkpoint = "auto"
        elif part.startswith("checkpoint budget="):
            checkpoint = CheckpointBudget(fraction=float(part.removeprefix("checkpoint budget=")))
        else:
            raise ValueError(f"{text!r}: cannot read {part!r}")
    return Candidate(int(micro), int(accumulation), parts[1], checkpoint, offload)


def time_rows(path: str, models: dict, device: str) -> None:
    """``--rows``: time the listed configurations of each model and budget, under the budget's cap."""
    from lightning_memkit.estimate.data.batches import sample_batch_and_length
    from lightning_memkit.units import format_bytes
    from plan_choice import trial_figures as _trial

    with open(path) as handle:
        cases = json.load(handle)
    for case in cases:
        name, (build, batch) = next((n, m) for n, m in models.items() if case["model"].lower() in n.lower())
        _cap(case["budget"], device == "cuda")
        module = build(batch)
        sample, _ = sample_batch_and_length(module, None)
        for text in case["rows"]:
            try:
                _fits, peak, samples, note = _trial(
                    module, parse_candidate(text), sample, case["budget"], device, WARMUP, TIMED
                )
            except Exception as error:  # noqa: BLE001 - reported, the next row still runs
                peak, samples, note = None, None, f"failed: {type(error).__name__}: {str(error)[:200]}"
            print(
                f"# {name} {format_bytes(case['budget'])}: {text}: brute force {note}, peak "
                f"{format_bytes(peak) if peak else '-'}, {samples or 0:.1f} samples/s",
                file=sys.stderr,
                flush=True,
            )


def _row(r: dict) -> str:
    from lightning_memkit.units import format_bytes

    def short(text):
        return text.replace(", 32-true", "") if text else "none fit"

    def pct(speed):
        return f"{100 * speed / r['best_speed']:.0f}%" if speed and r["best_speed"] else "-"

    within = (
        "-"
        if not r["chosen_speed"] or not r["best_speed"]
        else ("yes" if r["chosen_speed"] >= 0.95 * r["best_speed"] else "no")
    )
    peak = r["plan_peak"]
    under = "-" if peak is None else ("yes" if peak <= r["budget"] else "NO") + f" ({format_bytes(peak)})"
    best = f"{short(r['best'])} ({r['best_speed']:.1f})" if r["best"] else "none fit"
    error = (
        f"{r['error_median']:.2f} ({r['error_range'][0]:.2f}-{r['error_range'][1]:.2f})" if r["error_median"] else "-"
    )
    return (
        f"| {r['model']} | {format_bytes(r['budget'])} | {r['fitting']} / {r['estimated']} | {best} | "
        f"{short(r['chosen'])} | "
        f"{pct(r['chosen_speed'])} | {within} | {r['trials']} | {under} | {r['rho']:.2f} (n={r['pairs']}) | {error} | "
        f"{short(r['composer'])}: {pct(r['composer_speed'])}, {r['composer_trials']} trials | "
        f"{short(r['finder'])}: {pct(r['finder_speed'])}, {r['finder_trials']} trials |"
    )


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="words of the model names to run (default: all)")
    parser.add_argument("--budgets", default="8GiB,16GiB", help="comma-separated device memories (default 8GiB,16GiB)")
    parser.add_argument(
        "--modes", default=None, help="the planner's modes (default micro_batch,checkpoint, plus offload on CUDA)"
    )
    parser.add_argument(
        "--small", action="store_true", help="tiny models, budgets from their estimates: a check of the script"
    )
    parser.add_argument("--json", default=None, help="write every case's result and trial rows here")
    parser.add_argument(
        "--rows", default=None, help="no plan: time the configurations this JSON file lists (see above)"
    )
    parser.add_argument(
        "--predict",
        default=None,
        metavar="GPU",
        help="no GPU needed: print each case's plan table for this GPU (predictions only, no trial)",
    )
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    line = provenance_line()  # what made these figures, on both streams (the table and the log)
    print(line, flush=True)
    print(line, file=sys.stderr, flush=True)
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    from lightning_memkit.estimate import estimate_memory
    from lightning_memkit.units import parse_bytes

    if args.predict:  # the roofline and the estimate need no GPU: the table the plan ranks before its trials
        from lightning_memkit.plan import plan_fit

        for model_name, (build, batch) in MODELS.items():
            if args.models and not any(word.lower() in model_name.lower() for word in args.models):
                continue
            for text in args.budgets.split(","):
                plan = plan_fit(
                    build(batch),
                    device="cuda",
                    gpu=args.predict,
                    device_memory=text,
                    modes=args.modes or "micro_batch,checkpoint,offload",
                    verbose=False,
                )
                print(f"## {model_name} {text}\n{plan.table()}", flush=True)
        return
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if not cuda and not args.small:
        raise SystemExit("plan_gpu.py measures on a CUDA GPU; none here (--small checks the script on this machine)")
    modes = args.modes or ("micro_batch,checkpoint,offload" if cuda else "micro_batch,checkpoint")
    models = SMALL if args.small else MODELS
    if args.rows:
        time_rows(args.rows, models, device)
        return
    name = torch.cuda.get_device_name() if cuda else "CPU"
    print(
        f"{name}, torch {torch.__version__}; brute force {WARMUP} warm-up + {TIMED} timed optimizer steps per "
        f"configuration (median; CUDA events); modes {modes}; % of the brute-force best"
    )
    print()
    print(
        "| model | budget | fit / run | brute-force best (samples/s) | planner's choice | % of best | within 5% | "
        "trials | "
        "real peak <= budget | Spearman | predicted / measured step | halve until it fits | largest batch, then "
        "accumulate |"
    )
    print("|---|---|---:|---|---|---:|---|---:|---|---:|---|---|---|", flush=True)
    results = []
    started = time.perf_counter()
    for model_name, (build, batch) in models.items():
        if args.models and not any(word.lower() in model_name.lower() for word in args.models):
            continue
        if args.small:  # between the estimates at the batch and at half of it, and at a quarter and an eighth
            peaks = [
                estimate_memory(build(batch), size, device=device).peak_bytes
                for size in (batch, batch // 2, batch // 4)
            ]
            budgets = [(peaks[0] + peaks[1]) // 2, (peaks[1] + peaks[2]) // 2]
        else:
            budgets = [parse_bytes(text) for text in args.budgets.split(",")]
        for budget in budgets:
            try:
                result = run_case(model_name, build, batch, budget, device, modes)
            except Exception:  # noqa: BLE001 - one case's failure is reported, the next case still runs
                import traceback

                traceback.print_exc()
                print(f"| {model_name} | {budget} | failed: see stderr |", flush=True)
                continue
            results.append(result)
            print(_row(result), flush=True)
            if args.json:
                write_json(args.json, results)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
