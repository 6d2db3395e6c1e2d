#!/usr/bin/env bash
# One call on the GPU machine: install the carried apache-tvm-ffi wheel, then run the
# GPU tests and the benchmark against the carried bundle. Results land in $OUT.
# Usage: bash scripts/device_run.sh [pytest args...]; BENCH_ARGS="..." adds a benchmark run.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
export TVM_RMSQUANT_BUNDLE=${TVM_RMSQUANT_BUNDLE:-$PWD/artifacts/bundle}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
status=0
if [ "$#" -gt 0 ]; then
  python3 -m pytest -p no:cacheprovider "$@" 2>&1 | tee "$OUT/gpu-tests.log" | tail -n 40
  status=${PIPESTATUS[0]}
fi
if [ -n "${BENCH_ARGS:-}" ]; then
  python3 -m tvm_rmsquant bench --out "$OUT/bench" $BENCH_ARGS 2>&1 | tee "$OUT/bench.log" | tail -n 60
fi
exit $status
