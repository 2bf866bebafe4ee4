"""The CUDA-target estimate against real H100 memory: one row per recorded run in tests/data/gpu_truth.

    python benchmarks/gpu_truth.py            # every row of truth.json
    python benchmarks/gpu_truth.py BertLike   # rows whose model name contains the word

Prints the recorded peaks (torch.cuda.max_memory_allocated / max_memory_reserved over two training
steps from on_train_start, AdamW) beside estimate_memory(..., device="cuda", gpu="h100"), the error of
each, and the estimate's wall and process CPU time on this machine (the model is built outside the timing).
"""

from __future__ import annotations

import os
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # provenance.py

from lightning_memkit.estimate import estimate_memory  # noqa: E402
from lightning_memkit.summary_table import format_table  # noqa: E402
from provenance import provenance_line  # noqa: E402
from tests.helpers.gpu_truth import MODES, make_model, truth_rows  # noqa: E402

GiB = 2**30


def main(argv: list[str]) -> None:
    warnings.filterwarnings("ignore")
    word = argv[0] if argv else ""
    # the estimate's code and versions (this run), and the recorded truth's (tests/data/gpu_truth/truth.json's meta)
    import json

    from tests.helpers.gpu_truth import TRUTH_DIR

    print(provenance_line())
    with open(os.path.join(TRUTH_DIR, "truth.json")) as handle:
        print(f"# truth's provenance: {json.dumps(json.load(handle)['meta'], sort_keys=True)}")
    rows = []
    for row in truth_rows():
        if word not in row["model"]:
            continue
        module = make_model(row["model"], row["batch_size"])
        started, cpu_started = time.perf_counter(), time.process_time()
        estimate = estimate_memory(module, mode=MODES[row["precision"]], device="cuda", gpu="h100")
        seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
        allocated, reserved = estimate.cuda.peak_allocated_bytes, estimate.cuda.peak_reserved_bytes
        rows.append(
            (
                row["model"],
                row["batch_size"],
                row["precision"],
                f"{row['peak_allocated_bytes'] / GiB:.3f}",
                f"{row['peak_reserved_bytes'] / GiB:.3f}",
                f"{allocated / GiB:.3f}",
                f"{reserved / GiB:.3f}",
                f"{allocated / row['peak_allocated_bytes'] - 1:+.1%}",
                f"{reserved / row['peak_reserved_bytes'] - 1:+.1%}",
                f"{seconds:.2f}",
                f"{cpu_seconds:.2f}",
            )
        )
        print(" | ".join(map(str, rows[-1])), flush=True)
    print()
    print(
        format_table(
            (
                "model",
                "batch",
                "precision",
                "H100 alloc GiB",
                "H100 reserved GiB",
                "estimate alloc GiB",
                "estimate reserved GiB",
                "alloc error",
                "reserved error",
                "estimate wall s",
                "estimate CPU s",
            ),
            rows,
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])
