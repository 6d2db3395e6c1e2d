#!/usr/bin/env bash
# One call on the GPU machine (no TVM there): install the carried apache-tvm-ffi wheel,
# then check and time the bundles built here and carried in artifacts/.
#   STAGES   space-separated, any of: tests sweep bench compile   (default: all)
#   BENCH_ROWS, BENCH_HIDDEN   narrow the benchmark grid
# Everything lands in $OUT/results.tar.gz; the summary goes to stdout.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
export TVM_RMSQUANT_BUNDLE=$PWD/artifacts/bundle
OUT=${OUT:-/tmp/out}
RESULTS=$(mktemp -d)
STAGES=${STAGES:-tests sweep bench compile}
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$RESULTS/gpu.txt"
for stage in $STAGES; do
  case $stage in
    tests)
      python3 -m pytest -p no:cacheprovider -m gpu tests -q -rfE 2>&1 | tee "$RESULTS/gpu-tests.log" | tail -n 25
      status=${PIPESTATUS[0]} ;;
    sweep)
      for bundle in artifacts/sweep_*; do
        python3 -m tvm_rmsquant bench --bundle "$bundle" --providers ours --hidden 4096,7168 --rows 64,4096,16384 \
          --formats row:fp32,col:ue8m0 --out "$RESULTS/$(basename "$bundle")" > "$RESULTS/$(basename "$bundle").log" 2>&1
        echo "== $bundle"; grep -E "M= *(4096|16384)" "$RESULTS/$(basename "$bundle").log" | awk '{print $2, $3, $4, $8}'
      done ;;
    bench)
      python3 -m tvm_rmsquant bench --providers ours,triton --overhead --out "$RESULTS/bench" \
        ${BENCH_HIDDEN:+--hidden $BENCH_HIDDEN} ${BENCH_ROWS:+--rows $BENCH_ROWS} > "$RESULTS/bench.log" 2>&1
      grep -E "ceiling|overhead|WRONG|ERROR|Error" "$RESULTS/bench.log" | head -n 30 ;;
    compile)
      python3 -m tvm_rmsquant bench --providers ours,triton,torch_compile,torch_eager --hidden 4096,7168 --rows 4096,16384 \
        --out "$RESULTS/bench-compile" > "$RESULTS/bench-compile.log" 2>&1
      tail -n 50 "$RESULTS/bench-compile.log" ;;
  esac
done
mkdir -p "$OUT"; tar -czf "$OUT/results.tar.gz" -C "$RESULTS" .
exit $status
