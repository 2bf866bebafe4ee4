#!/usr/bin/env bash
# One GPU lease's checks in one run (a lease is 15 minutes, a machine's start included): the planner's device table
# for BERT-base, the `cuda` test lane, then the ResNet-50 table in the time left. The device image has torch, lightning
# and the test tools but no network, so this runs `make test-gpu`'s pytest line with that python and the checkout on
# PYTHONPATH instead of building .venv-gpu. Everything lands in $OUT (default gpu_out/).
#
#   bash benchmarks/gpu_lease.sh            # on the GPU machine, from the repository root
set -u
OUT=${OUT:-gpu_out}
LIMIT=${LIMIT:-570}  # seconds for the whole script
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  sha256sum benchmarks/plan_gpu.py lightning_memkit/plan/planner.py  # which code made these figures
  python3 benchmarks/provenance.py  # the commit (MEMKIT_COMMIT/MEMKIT_DIRTY where the copy has no git), torch, CUDA, device
  python3 -c "import sys, torch, lightning, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'lightning', lightning.__version__, 'transformers', transformers.__version__)"
} >"$OUT/gpu.txt" 2>&1
timeout -k 10 240 python3 benchmarks/plan_gpu.py bert --budgets 16GiB,8GiB --json "$OUT/bert.json" >"$OUT/bert.md" 2>"$OUT/bert.err"
echo "exit $? after ${SECONDS} s" >>"$OUT/bert.md"
timeout -k 10 150 python3 -m pytest -q -p no:cacheprovider -m cuda -rs -v -n 4 --dist loadfile --timeout 140 --durations=15 \
  tests/compiled/test_compile.py tests/gpu/test_cuda.py tests/doctor/test_doctor.py tests/estimate/test_estimate.py tests/modes/test_offload.py \
  tests/plan/test_plan.py tests/gpu/test_search_cuda_paths.py >"$OUT/test_gpu.txt" 2>&1
echo "exit $? after ${SECONDS} s" >>"$OUT/test_gpu.txt"
left=$((LIMIT - SECONDS))
if [ "$left" -gt 60 ]; then
  timeout -k 10 "$left" python3 benchmarks/plan_gpu.py resnet --budgets 16GiB,8GiB --json "$OUT/resnet.json" >"$OUT/resnet.md" 2>"$OUT/resnet.err"
  echo "exit $? after ${SECONDS} s" >>"$OUT/resnet.md"
fi
