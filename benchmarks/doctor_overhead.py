"""Per-step cost of the memory doctor on a plain PyTorch training step, on CPU.

Variants run interleaved (round-robin, same model and batch), each step timed with the process's CPU
time (a shared machine's load stretches wall time at random, not the CPU time a step costs); the figure
is the median over rounds, and the ratio is to "plain". torch runs on one thread.

    python benchmarks/doctor_overhead.py            # about a minute on 2 cores
    python benchmarks/doctor_overhead.py --quick    # a smoke run
    python benchmarks/doctor_overhead.py --fit      # whole Trainer fits with a leak, before/after (doctor_run_cost.py)

Variants:
    plain                 the step alone
    LeakWatcher.observe   the always-on leak check MemoryTracker can run: one number per step
    recording             CreationRecorder active for the step (who made each tensor: op, module, line)
    recording+liveness    and every op's uses recorded (the one analysed step)
    kept-graph check      count_kept_graph_nodes(recorder) at step start, recording on (the doctor's steps)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from lightning_memkit.doctor.graphs import count_kept_graph_nodes
from lightning_memkit.doctor.leaks import LeakWatcher
from lightning_memkit.doctor.recorder import CreationRecorder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--fit",
        action="store_true",
        help="run benchmarks/doctor_run_cost.py instead: a whole fit with a "
        "leak, holder search included, against the code this branch started from",
    )
    args, rest = parser.parse_known_args()
    if args.fit:
        import os
        import runpy
        import sys

        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "doctor_run_cost.py")
        sys.argv = [path, "--rounds", str(args.rounds if args.rounds != 30 else 3), *rest]
        runpy.run_path(path, run_name="__main__")
        return
    rounds = 3 if args.quick else args.rounds
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(256, 256), nn.ReLU())], nn.Linear(256, 10))
    optimizer = torch.optim.Adam(model.parameters())
    x = torch.randn(64, 256)

    def step() -> None:
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    recorder = CreationRecorder()
    recorder.name_modules(model)
    watcher = LeakWatcher()
    counter = iter(range(10**9))

    def observe() -> None:
        watcher.observe(next(counter), 1000)
        step()

    def recording() -> None:
        recorder.start(0, batch=x, module=model, optimizers=[optimizer])
        step()
        recorder.stop()

    def liveness() -> None:
        recorder.start(0, batch=x, module=model, optimizers=[optimizer])
        recorder.begin_liveness()
        step()
        recorder.end_liveness()
        recorder.stop()

    def graphs() -> None:
        recorder.start(0, batch=x, module=model, optimizers=[optimizer])
        count_kept_graph_nodes(recorder)
        step()
        recorder.stop()

    variants = {
        "plain": step,
        "LeakWatcher.observe": observe,
        "recording": recording,
        "recording+liveness": liveness,
        "kept-graph check": graphs,
    }
    for run in variants.values():  # warm-up: Adam's state, caches
        run()
        run()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, run in variants.items():
            start = time.process_time()
            run()
            times[name].append(time.process_time() - start)
    base = statistics.median(times["plain"])
    print(f"{'variant':<22}{'CPU ms/step':>12}{'ratio':>8}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<22}{median * 1e3:>12.2f}{median / base:>8.3f}")


if __name__ == "__main__":
    main()
