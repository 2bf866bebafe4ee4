"""Will it fit? Side by side in one run (alternating, repeated, medians):

1. estimate_memory vs the real step: agreement with the accountant-measured peak (MLP, CNN,
   transformer) and speed against one real training step of the CNN (no accountant), at the zoo's
   default size and at a larger CNN.
2. The batch-size search under the same CPU budget: memkit's MaxBatchSize vs Lightning's
   BatchSizeFinder (power and binsearch, the budget enforced around the whole tuner call): real
   trials, total search time, and distance from the true maximum (exact bisection on real trials).

3. Speed of the estimate: a BERT-base-sized encoder at batch 32, and memkit estimate's five modes with
   and without reusing the fake copy (reusing_fake_copies).

Run: python benchmarks/batch_size.py [--repeats 3] [--clock cpu|wall] [--threads 1] [--sections estimate,speed,search]

``--clock cpu`` (default) times with this process's CPU time, which other jobs on a shared machine
do not inflate; ``--threads 1`` makes CPU time equal to compute time.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import time
import warnings

import torch

warnings.filterwarnings("ignore")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.tuner import Tuner  # noqa: E402

for _name in (
    "lightning.pytorch",
    "lightning.fabric",
    "lightning.pytorch.utilities.rank_zero",
    "lightning.pytorch.tuner.batch_size_scaling",
):
    logging.getLogger(_name).setLevel(logging.ERROR)

from lightning_memkit.callbacks.max_batch_size import find_max_batch_size  # noqa: E402
from lightning_memkit.estimate import estimate_memory, measure_training_step  # noqa: E402
from lightning_memkit.search.batch_search import SearchError  # noqa: E402
from lightning_memkit.search.budget import MemoryBudget  # noqa: E402
from lightning_memkit.summary_table import format_table  # noqa: E402
from lightning_memkit.zoo import DemoCNN, DemoMLP, DemoTransformer, SyntheticDataModule  # noqa: E402

CLOCK = time.process_time
FEATURES = 256
STEPS_PER_TRIAL = 3
MAX_VAL = 4096


def real_step_seconds(module, repeats):
    """Median wall time of one real training step (forward, zero_grad, backward, Adam step), no accountant."""
    batch = next(iter(module.train_dataloader()))
    optimizer = module.configure_optimizers()
    times = []
    for _ in range(repeats + 1):
        started = CLOCK()
        loss = module.training_step(batch, 0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        times.append(CLOCK() - started)
    return statistics.median(times[1:])  # the first step pays one-off costs


def estimate_section(repeats):
    rows = []
    for name, make in (("MLP", DemoMLP), ("CNN", DemoCNN), ("transformer", DemoTransformer)):
        for mode in ("baseline", "bf16"):
            estimate, measured = (
                estimate_memory(make(), mode=mode, device="cpu"),
                measure_training_step(make(), mode=mode),
            )
            rows.append(
                (
                    f"{name} {mode}",
                    estimate.peak_bytes,
                    measured.peak_bytes,
                    f"{(estimate.peak_bytes - measured.peak_bytes) / measured.peak_bytes:+.4%}",
                )
            )
    print(format_table(("model / mode", "estimated peak B", "measured peak B", "error"), rows))
    print()
    speed = []
    for label, make in (
        ("DemoCNN() batch 32", lambda: DemoCNN()),
        (
            "DemoCNN(64 ch, 3 blocks, 64px) batch 128",
            lambda: DemoCNN(channels=64, blocks=3, image_size=64, batch_size=128),
        ),
    ):
        fake, real, measured = [], [], []
        for _ in range(repeats):  # alternate the variants
            module = make()
            started = CLOCK()
            estimate_memory(module, device="cpu")
            fake.append(CLOCK() - started)
            real.append(real_step_seconds(make(), 3))
            started = CLOCK()
            measure_training_step(make())
            measured.append(CLOCK() - started)
        f, r, m = (statistics.median(v) for v in (fake, real, measured))
        speed.append((label, f"{f:.3f}s", f"{r:.3f}s", f"{r / f:.2f}x", f"{m:.3f}s", f"{m / f:.2f}x"))
    print(
        "estimate_memory (2 fake steps) vs one real step (no accountant) and vs measure_training_step "
        "(2 real steps, accountant); medians of",
        repeats,
    )
    print(format_table(("CNN", "estimate", "real step", "real/estimate", "measured", "measured/estimate"), speed))
    print()


def speed_section(repeats):
    """BERT-base-sized encoder at batch 32 (CUDA target): one estimate; and memkit estimate's work for five
    modes (an estimate and a prediction each) with a fresh fake copy per estimate vs reusing_fake_copies()."""
    from lightning_memkit.estimate import predict_max_batch_size
    from lightning_memkit.estimate.step.settings import reusing_fake_copies

    bert = DemoTransformer(
        vocab_size=30522, d_model=768, nhead=12, layers=12, dim_feedforward=3072, seq_len=512, batch_size=32
    )
    estimate_memory(bert, 32, device="cuda")  # one-off costs (imports, kernel tables)
    single = []
    for _ in range(repeats):
        started = CLOCK()
        estimate_memory(bert, 32, device="cuda")
        single.append(CLOCK() - started)
    print(
        f"estimate_memory(BERT-base shape, batch 32, device='cuda'): median {statistics.median(single):.2f}s of "
        f"{repeats} ({', '.join(f'{t:.2f}' for t in single)})"
    )
    modes = ("baseline", "amp", "checkpoint", "amp+checkpoint", "checkpoint:budget=0.5")
    module = DemoTransformer()

    def table(reuse):
        started = CLOCK()
        with reusing_fake_copies() if reuse else contextlib.nullcontext():
            for mode in modes:
                estimate_memory(module, None, mode=mode, device="cuda")
                predict_max_batch_size(module, 16 * 2**30, mode=mode, device="cuda")
        return CLOCK() - started

    fresh, reused = [], []
    for _ in range(repeats):  # alternate
        fresh.append(table(False))
        reused.append(table(True))
    f, r = statistics.median(fresh), statistics.median(reused)
    print(
        format_table(
            ("memkit estimate, DemoTransformer, 5 modes", "time", "vs fresh"),
            [
                ("a fresh fake copy per estimate, no memo", f"{f:.2f}s", "1.00x"),
                ("reusing_fake_copies() (what memkit estimate does)", f"{r:.2f}s", f"{r / f:.2f}x"),
            ],
        )
    )
    print()


def make_run(batch_size=2):
    torch.manual_seed(0)
    module = DemoMLP(in_features=FEATURES, hidden=256, depth=3)
    del module.batch_size
    data = SyntheticDataModule(batch_size=batch_size, train_size=MAX_VAL, val_size=16, input_shape=(FEATURES,))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir="/tmp/memkit_bench",
    )
    return module, data, trainer


def runs(size, budget):
    module, data, trainer = make_run()
    try:
        find_max_batch_size(
            trainer,
            module,
            data,
            budget=budget,
            init_val=size,
            max_val=size,
            max_trials=1,
            use_estimate=False,
            verbose=False,
            steps_per_trial=STEPS_PER_TRIAL,
        )
        return True
    except SearchError:
        return False


def true_maximum(budget, guess):
    lo, hi = 1, MAX_VAL + 1
    lo_guess, hi_guess = max(1, int(guess * 0.97)), int(guess * 1.03) + 1
    if runs(lo_guess, budget):
        lo = lo_guess
        if not runs(hi_guess, budget):
            hi = hi_guess
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if runs(mid, budget):
            lo = mid
        else:
            hi = mid
    return lo


def lightning_search(mode, budget):
    module, data, trainer = make_run()
    tried = []
    original_run = trainer.fit_loop.run

    def counting_run():  # Lightning runs the fit loop once per trial
        tried.append(data.batch_size)
        return original_run()

    trainer.fit_loop.run = counting_run
    guard = MemoryBudget(budget)
    guard.adopt(module.parameters())
    started = CLOCK()
    with guard:
        found = Tuner(trainer).scale_batch_size(
            module,
            datamodule=data,
            mode=mode,
            steps_per_trial=STEPS_PER_TRIAL,
            init_val=2,
            max_trials=25,
            max_val=MAX_VAL,
        )
    seconds = CLOCK() - started
    return found, len(tried), seconds, found in tried


def memkit_search(budget):
    module, data, trainer = make_run()
    started = CLOCK()
    result = find_max_batch_size(
        trainer, module, data, budget=budget, max_val=MAX_VAL, verbose=False, steps_per_trial=STEPS_PER_TRIAL
    )
    tried = any(t.fits and t.batch_size == result.batch_size for t in result.trials)
    return result.batch_size, result.trial_count, CLOCK() - started, tried


def search_section(repeats, target):
    module, _, _ = make_run()
    budget = measure_training_step(
        module, target, batch=(torch.randn(2, FEATURES), torch.zeros(2, dtype=torch.int64))
    ).peak_bytes
    truth = true_maximum(budget, target)
    print(f"budget {budget} bytes; true maximum batch (exact bisection on real trials): {truth}")
    results = {"memkit MaxBatchSize": [], "Lightning power": [], "Lightning binsearch": []}
    for _ in range(repeats):  # alternate the finders
        results["memkit MaxBatchSize"].append(memkit_search(budget))
        for mode in ("power", "binsearch"):
            results[f"Lightning {mode}"].append(lightning_search(mode, budget))
    base = statistics.median(v[2] for v in results["memkit MaxBatchSize"])
    rows = []
    for name, values in results.items():
        found, trials, _, tried = values[-1]
        seconds = statistics.median(v[2] for v in values)
        rows.append(
            (
                name,
                found,
                trials,
                f"{seconds:.2f}s",
                f"{seconds / base:.2f}x",
                f"{(found - truth) / truth:+.1%}",
                "yes" if tried else ("no, smaller than one that ran" if found <= truth else "no, and too large"),
            )
        )
    print(
        format_table(
            ("finder", "batch", "real trials", "search time", "time vs memkit", "vs true max", "answer was a trial?"),
            rows,
        )
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--target", type=int, default=700, help="the budget is the measured peak at this batch size")
    parser.add_argument(
        "--clock", choices=("cpu", "wall"), default="cpu", help="process CPU time (default) or wall time"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--sections", default="estimate,speed,search", help="comma-separated: estimate, speed, search")
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, lightning {pl.__version__}, "
        f"{torch.get_num_threads()} threads, {args.clock} clock\n"
    )
    sections = set(args.sections.split(","))
    if "estimate" in sections:
        estimate_section(args.repeats)
    if "speed" in sections:
        speed_section(args.repeats)
    if "search" in sections:
        search_section(args.repeats, args.target)


if __name__ == "__main__":
    main()
