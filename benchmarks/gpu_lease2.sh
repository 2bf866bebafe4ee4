#!/usr/bin/env bash
# The second GPU lease of 2026-11-27 (see benchmarks/gpu_lease.sh): the `cuda` tests of the offload fix, then the
# configurations the first lease's brute force did not reach (benchmarks/gpu_lease_rows.json), each case led by the
# planner's choice timed again (the two leases' timings side by side).
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  sha256sum benchmarks/plan_gpu.py lightning_memkit/plan/planner.py
  python3 benchmarks/provenance.py; } >"$OUT/gpu.txt" 2>&1
timeout -k 5 70 python3 -m pytest -q -p no:cacheprovider -m cuda -rs -v -n 3 --timeout 60 \
  tests/modes/test_offload.py tests/plan/test_plan.py >"$OUT/test_gpu.txt" 2>&1
echo "exit $? after ${SECONDS} s" >>"$OUT/test_gpu.txt"
left=$((${LIMIT:-280} - SECONDS)); [ "$left" -gt 10 ] || left=10
timeout -k 5 "$left" python3 benchmarks/plan_gpu.py --rows benchmarks/gpu_lease_rows.json \
  >"$OUT/rows.md" 2>"$OUT/rows.err"
echo "exit $? after ${SECONDS} s" >>"$OUT/rows.md"
