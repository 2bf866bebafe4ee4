"""How long estimate_memory takes, before and after the speed work, side by side in one run.

    python benchmarks/estimate_speed.py                          # every case, 5 rounds
    python benchmarks/estimate_speed.py --repeats 3 --cases bert-b32-32-true
    python benchmarks/estimate_speed.py --before <git revision>  # compare with another revision
    python benchmarks/estimate_speed.py --levers                 # also: this tree with one lever off at a time

Cases: BERT-base (tests/data/gpu_truth's BertLike: 12 layers, d 768, seq 512, AdamW) at batch 32 in
32-true and bf16-mixed, and ResNet-18's layout (ResNetish, 224 px) at batch 128, each estimated for
an H100 (``device="cuda", gpu="h100"``) as tests/estimate/cuda/test_gpu_truth.py does.

Each measurement is a fresh Python process (torch's fake-tensor cache is per process), the model
built before the clock starts; it times the first estimate of the process ("cold": what
``memkit estimate`` or a first call pays) and a second one of the same model ("warm"), in wall
seconds and the process's CPU seconds. The variants run alternately, round after round, so a busy
machine slows them alike; the table gives the median and the best of the rounds, the ratio of the
medians to "before", and whether every estimated figure (peak bytes, CUDA allocated and reserved
peaks, categories, peak phase and step) is identical to "before".

"before" is the package as of ``--before`` (default: the last commit before this work), extracted
with ``git archive`` into a temporary folder; "after" is this working tree. ``--levers`` adds this
tree with one lever switched off at a time (see LEVERS), to show what each one buys.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

#: the last commit before the estimate's speed work
BEFORE = "72df438"

CASES = {
    "bert-b32-32-true": ("BertLike", 32, "32-true"),
    "bert-b32-bf16-mixed": ("BertLike", 32, "bf16-mixed"),
    "resnet-b128-32-true": ("ResNetish", 128, "32-true"),
}

#: levers that ``--levers`` switches off one at a time (in the child, by restoring the old behaviour)
LEVERS = {
    "one-dispatch-layer": "the accountant does the fake step's placeholder scalars, kept loss buffers and "
    "fake devices itself (one Python mode layer instead of three)",
    "foreach-in-place": "an optimizer's in-place _foreach_*_ ops on fakes are answered without FakeTensorMode "
    "(they return and allocate nothing)",
    "fake-parameter": "the fake copy flags its new fakes as parameters instead of nn.Parameter's detach() of each",
    "fake-view": "view ops of a fake (detach for autograd's saved tensors and gradient accumulation; t, view, "
    "transpose) are answered by the accountant's dispatch instead of FakeTensorMode",
}


# --------------------------------------------------------------------------------------------- child
def _switch_off(lever: str) -> None:
    """Put back the behaviour before ``lever`` (this tree only)."""
    import lightning_memkit.estimate.fake.copies as fake_copies
    import lightning_memkit.estimate.fake.session as fake_session
    import lightning_memkit.estimate.fake.step_ops as fake_step
    import lightning_memkit.estimate.step.runner as runner

    if (
        lever == "one-dispatch-layer"
    ):  # the three modes again: fake world + ScalarPlaceholders + LossBuffers, plain accountant
        fake_session.FakeSession.fake_mode_only = fake_session.FakeSession.active
        runner.FakeStepOps = lambda: None
    elif lever == "foreach-in-place":  # every in-place foreach op goes down to FakeTensorMode again
        fake_step._is_in_place_foreach = lambda func: False
    elif lever == "fake-parameter":  # nn.Parameter(fake): a detach() through FakeTensorMode per parameter
        from torch import nn

        fake_copies.fake_parameter = lambda tensor, requires_grad=True: nn.Parameter(
            tensor, requires_grad=requires_grad
        )
    elif lever == "fake-view":  # every view op goes down to FakeTensorMode again
        fake_step.is_plain_view = lambda func: False
    else:
        raise SystemExit(f"unknown lever {lever!r}; choose from: {', '.join(LEVERS)}")


def child(source: str, case: str, without: str | None) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    sys.path.insert(0, source)
    sys.path.insert(1, ROOT)  # tests.helpers from this tree; the estimate from the source measured, first
    from lightning_memkit.estimate import estimate_memory
    from tests.helpers.gpu_truth import MODES, make_model

    if without:
        _switch_off(without)
    name, batch_size, precision = CASES[case]
    module = make_model(name, batch_size)
    timings, figures = [], None
    for _ in range(2):  # cold (first in the process), then warm
        wall, cpu = time.perf_counter(), time.process_time()
        estimate = estimate_memory(module, mode=MODES[precision], device="cuda", gpu="h100")
        timings.append((time.perf_counter() - wall, time.process_time() - cpu))
        figures = {
            "peak_bytes": estimate.peak_bytes,
            "by_category": estimate.by_category,
            "peak_allocated_bytes": estimate.cuda.peak_allocated_bytes,
            "peak_reserved_bytes": estimate.cuda.peak_reserved_bytes,
            "segments": estimate.cuda.segments,
            "peak_phase": estimate.peak_phase,
            "peak_step": estimate.peak_step,
        }
    print(json.dumps({"cold": timings[0], "warm": timings[1], "figures": figures}))


# -------------------------------------------------------------------------------------------- parent
def _extract(revision: str, into: str) -> str:
    archive = subprocess.run(
        ["git", "-C", ROOT, "archive", revision, "lightning_memkit"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return into


def _measure(source: str, case: str, without: str | None, timeout: float) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--child", source, "--case", case]
    if without:
        command += ["--without", without]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{case} ({source}, without {without}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--without", help=argparse.SUPPRESS)
    parser.add_argument("--before", default=BEFORE, help=f"git revision to compare with (default {BEFORE})")
    parser.add_argument("--repeats", type=int, default=5, help="rounds (default 5)")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    parser.add_argument("--levers", action="store_true", help="also run this tree with each lever off in turn")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per measurement (default 600)")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.case, args.without)
        return
    sys.path.insert(0, ROOT)
    from lightning_memkit.summary_table import format_table

    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {', '.join(unknown)}; choose from: {', '.join(CASES)}")
    with tempfile.TemporaryDirectory(prefix="memkit_before_") as folder:
        variants = [("before", _extract(args.before, folder), None), ("after", ROOT, None)]
        if args.levers:
            variants += [(f"after, {lever} off", ROOT, lever) for lever in LEVERS]
        results: dict[tuple[str, str], list[dict]] = {}
        for round_ in range(args.repeats):
            for case in cases:
                order = variants if round_ % 2 == 0 else variants[::-1]
                for label, source, without in order:
                    result = _measure(source, case, without, args.timeout)
                    results.setdefault((case, label), []).append(result)
                    print(
                        f"round {round_ + 1} {case} {label}: cold {result['cold'][0]:.2f} s wall, "
                        f"{result['cold'][1]:.2f} s CPU; warm {result['warm'][0]:.2f} "
                        f"s wall, {result['warm'][1]:.2f} s CPU",
                        flush=True,
                    )
    rows = []
    for case in cases:
        before = results[(case, "before")]
        reference = before[0]["figures"]
        medians_before = {
            (key, i): statistics.median(r[key][i] for r in before) for key in ("cold", "warm") for i in (0, 1)
        }
        for label, _, _ in variants:
            runs = results[(case, label)]
            cells = [case, label]
            for key in ("cold", "warm"):
                for index in (0, 1):
                    values = [r[key][index] for r in runs]
                    median = statistics.median(values)
                    cells.append(f"{median:.2f} ({min(values):.2f})")
                    cells.append(f"{median / medians_before[(key, index)]:.2f}x")
            same = all(r["figures"] == reference for r in runs)
            cells.append("yes" if same else "NO")
            rows.append(cells)
    print()
    print(
        f"estimate_memory(..., device='cuda', gpu='h100'), {args.repeats} rounds, median (best) seconds, "
        f"ratio of medians to 'before' ({args.before})"
    )
    print(
        format_table(
            (
                "case",
                "variant",
                "cold wall s",
                "ratio",
                "cold CPU s",
                "ratio",
                "warm wall s",
                "ratio",
                "warm CPU s",
                "ratio",
                "same figures",
            ),
            rows,
        )
    )


if __name__ == "__main__":
    main()
