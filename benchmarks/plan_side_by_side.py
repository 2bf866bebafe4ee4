"""Two configurations of one of plan_choice.py's three models timed side by side, for as many rounds as a verdict needs.

    python benchmarks/plan_side_by_side.py lm 8x2 16x1:auto --rounds 30
    python benchmarks/plan_side_by_side.py cnn 4x4:budget=0.5 2x8 --rounds 16 --both

A configuration is ``MICROxACCUMULATION`` with an optional ``:auto`` or ``:budget=FRACTION`` checkpointing; their
effective batch must be the model's (16). Each round times both (the order alternating) the way brute force does
(the planner's ``_trial``: a real Trainer on a copy, 1 warm-up step, 30 timed steps, the median); ``--both`` also times
each the way a plan's interleaved rounds do (``_timed_step``, half a second), in the same rounds, to tell a difference
of the two timings from the machine's noise. Prints the first's samples/s over the second's: the median of the
per-round ratios, their geometric mean with a 95% interval (2 standard errors of the mean log ratio), and the rounds.

brute force's nine rounds side by side move by several percent from one run to the next on a 2-core VM (a 0.5 s
timing moves by about 15% from one round to the next); a tie between two configurations takes tens of rounds to
tell apart from a 5% difference.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def parse_candidate(text: str):
    """``8x2``, ``16x1:auto``, ``4x4:budget=0.5`` -> a Candidate."""
    from lightning_memkit.modes.checkpoint_policy import CheckpointBudget
    from lightning_memkit.plan.space import Candidate

    split, _, checkpoint = text.partition(":")
    try:
        micro, accumulation = (int(part) for part in split.lower().split("x"))
    except ValueError:
        raise SystemExit(f"{text!r}: give MICROxACCUMULATION[:auto|:budget=FRACTION], e.g. 8x2 or 16x1:auto") from None
    if checkpoint.startswith("budget="):
        policy = CheckpointBudget(float(checkpoint.split("=", 1)[1]))
    elif checkpoint in ("", "auto"):
        policy = checkpoint or None
    else:
        raise SystemExit(f"{text!r}: the checkpointing is ':auto' or ':budget=FRACTION'")
    return Candidate(micro, accumulation, checkpoint=policy)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="lm, cnn or gpt-2 (a word of plan_choice.py's model names)")
    parser.add_argument("first")
    parser.add_argument("second")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--both", action="store_true", help="also time each the way a plan's rounds do")
    args = parser.parse_args()
    if args.rounds < 2:
        raise SystemExit(f"--rounds {args.rounds}: give at least 2 (a verdict needs a spread)")
    warnings.simplefilter("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    import plan_choice as brute
    from lightning_memkit.estimate.data.batches import sample_batch_and_length
    from lightning_memkit.plan.lightning_runs import timed_step as _timed_step
    from plan_choice import trial_figures as _trial

    names = [name for name in brute.MODELS if args.model.lower() in name.lower()]
    if len(names) != 1:
        raise SystemExit(f"{args.model!r}: give one of lm, cnn, gpt-2")
    make, batch = brute.MODELS[names[0]]
    first, second = parse_candidate(args.first), parse_candidate(args.second)
    for candidate in (first, second):
        if candidate.effective_batch != batch:
            raise SystemExit(
                f"{candidate.describe()}: the effective batch is {candidate.effective_batch}, the model's {batch}"
            )
    module = make()
    sample, _ = sample_batch_and_length(module, None)
    _trial(module, first, sample, 1 << 50, "cpu", 1, 5)  # discarded: the process's first steps run slower

    def trial_step(candidate) -> float:
        fits, _, samples, note = _trial(module, candidate, sample, 1 << 50, "cpu", 1, 30)
        if not fits or samples is None:
            raise SystemExit(f"{candidate.describe()} did not run: {note}")
        return candidate.effective_batch / samples

    trial_ratios, plan_ratios = [], []
    for round_ in range(args.rounds):
        steps = {}
        order = (0, 1) if round_ % 2 == 0 else (1, 0)
        for index in order:  # the two timings of each kind back to back, the order alternating from round to round
            steps[index, "trial"] = trial_step((first, second)[index])
        for index in order[::-1] if args.both else ():
            steps[index, "plan"] = statistics.median(
                _timed_step(module, (first, second)[index], sample, "cpu", 1, 4, 0.5)
            )
        trial_ratios.append(steps[1, "trial"] / steps[0, "trial"])  # samples/s of the first over the second's
        if args.both:
            plan_ratios.append(steps[1, "plan"] / steps[0, "plan"])

    def verdict(label: str, ratios: list[float]) -> str:
        logs = [math.log(r) for r in ratios]
        mean, error = statistics.fmean(logs), statistics.stdev(logs) / math.sqrt(len(logs))
        return (
            f"{label}: median {statistics.median(ratios):.3f}, geometric mean {math.exp(mean):.3f} (95% interval "
            f"{math.exp(mean - 2 * error):.3f} to {math.exp(mean + 2 * error):.3f}); rounds: "
            + ", ".join(f"{r:.2f}" for r in ratios)
        )

    print(f"{names[0]}: samples/s of {first.describe()} over {second.describe()}, {args.rounds} rounds side by side")
    print(verdict("brute force's timing (30 steps)", trial_ratios))
    if args.both:
        print(verdict("a plan's timing (half a second)", plan_ratios))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
