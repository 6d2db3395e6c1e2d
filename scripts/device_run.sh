#!/usr/bin/env bash
# One call on the GPU machine (no TVM there): install the carried apache-tvm-ffi wheel,
# then check and time the bundles built here and carried in artifacts/.
#   STAGES   space-separated, any of: tests overhead sanitize sweep bench compile tune   (default: all but tune)
#   BENCH_ROWS, BENCH_HIDDEN   narrow the benchmark grid
#   BENCH_PROVIDERS            the bench stage's providers (default: ours,triton); BENCH_SLOW_ROWS the M
#                              values at which torch_compile/torch_eager run (default: all)
#   SWEEP_ROWS, SWEEP_FORMATS  the M values and layout:format pairs of the sweep stage
#   TUNE_SPECS                 space-separated spec names: the tune stage measures only these
#   TUNE_BUNDLES               the candidate bundles the tune stage measures (default: artifacts/tune_*)
#   OVERHEAD_RUNS              how many times the overhead stage runs (default 1)
# Each stage writes $OUT/<stage>.log as it goes (so a timed-out call still returns it)
# and packs its data into $OUT/<stage>.tar.gz; $OUT/stages.log has the GPU's clocks and each
# stage's start time. The device returns at most 8 files from $OUT: a call that runs this
# script several times (OUT=$OUT/a, OUT=$OUT/b) must stay within that, or files are dropped.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
# The installed layout (schedules/ and codegen/ inside the package), without pip or network.
PKG=/tmp/pkg-$$
mkdir -p $PKG && cp -r tvm_rmsquant $PKG/ && cp -r schedules $PKG/tvm_rmsquant/schedules \
  && cp -r codegen $PKG/tvm_rmsquant/codegen || exit 1
export PYTHONPATH=/tmp/site:$PKG  # and python3 -P: the checkout must not shadow it
# No TVM there, on purpose: the tests that need the build toolchain skip instead of failing.
export TVM_RMSQUANT_BUNDLE=$PWD/artifacts/bundle PYTHONUNBUFFERED=1 TVM_RMSQUANT_NO_TOOLCHAIN=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
RESULTS=$OUT
STAGES=${STAGES:-tests overhead sanitize sweep bench compile}
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee -a "$RESULTS/stages.log"
for stage in $STAGES; do
  echo "$(date -u +%T) stage $stage" | tee -a "$RESULTS/stages.log"
  case $stage in
    tests)
      python3 -P -m pytest -p no:cacheprovider -m gpu tests -q -rfE --durations=8 ${PYTEST_ARGS:-} > "$RESULTS/tests.log" 2>&1
      status=$?; tail -n 25 "$RESULTS/tests.log" ;;
    overhead)
      # OVERHEAD_RUNS independent runs (default 1): the host's speed drifts between runs.
      for run in $(seq "${OVERHEAD_RUNS:-1}"); do
        python3 -P -m tvm_rmsquant bench --providers ours --overhead --hidden 4096 --rows 1 --formats col:fp32 \
          --out "/tmp/overhead/run$run" >> "$RESULTS/overhead.log" 2>&1
      done
      grep -E "overhead|Error" "$RESULTS/overhead.log"; tar -czf "$RESULTS/overhead.tar.gz" -C /tmp overhead ;;
    sanitize)
      SANITIZER=$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")
      # The three tools side by side on the one GPU; each log ends with its error summary.
      for tool in memcheck racecheck initcheck; do
        "$SANITIZER" --tool $tool --error-exitcode 1 python3 scripts/sanitize.py ${SANITIZE_ARGS:-} \
          > "$RESULTS/sanitize_$tool.log" 2>&1 &
      done
      wait
      for tool in memcheck racecheck initcheck; do echo "== $tool"; grep -E "ERROR SUMMARY|sanitize:|WRONG|Error" "$RESULTS/sanitize_$tool.log" | tail -n 5; done ;;
    sweep)
      for bundle in artifacts/sweep_*; do
        echo "== $bundle" >> "$RESULTS/sweep.log"
        python3 -P -m tvm_rmsquant bench --bundle "$bundle" --providers ours --hidden 4096,7168 --rows "${SWEEP_ROWS:-64,4096,16384}" \
          --formats "${SWEEP_FORMATS:-row:fp32,col:ue8m0}" --out "/tmp/sweep/$(basename "$bundle")" >> "$RESULTS/sweep.log" 2>&1
      done
      grep -E "==|M= *(4096|16384)" "$RESULTS/sweep.log"; tar -czf "$RESULTS/sweep.tar.gz" -C /tmp sweep ;;
    bench)
      python3 -P -m tvm_rmsquant bench --providers "${BENCH_PROVIDERS:-ours,triton}" --overhead --out /tmp/bench \
        ${BENCH_HIDDEN:+--hidden $BENCH_HIDDEN} ${BENCH_ROWS:+--rows $BENCH_ROWS} ${BENCH_SLOW_ROWS:+--slow-rows $BENCH_SLOW_ROWS} > "$RESULTS/bench.log" 2>&1
      grep -E "ceiling|overhead|WRONG|ERROR|Error" "$RESULTS/bench.log" | head -n 30; tar -czf "$RESULTS/bench.tar.gz" -C /tmp bench ;;
    tune)
      # Candidate bundles from `tune build`: checked, then timed; one results JSON each.
      for bundle in ${TUNE_BUNDLES:-artifacts/tune_*}; do
        echo "== $bundle" >> "$RESULTS/tune.log"
        python3 -P -m tvm_rmsquant tune measure "$bundle" ${TUNE_SPECS:+$(printf -- '--spec %s ' $TUNE_SPECS)} \
          --out "$RESULTS/$(basename "$bundle").json" >> "$RESULTS/tune.log" 2>&1 || status=1
      done
      grep -E "==|ceiling|DROPPED|wrote|Error" "$RESULTS/tune.log" | head -n 40 ;;
    compile)
      python3 -P -m tvm_rmsquant bench --providers ours,triton,torch_compile,torch_eager --hidden 4096,7168 --rows 4096,16384 \
        --out /tmp/compile > "$RESULTS/compile.log" 2>&1
      tail -n 50 "$RESULTS/compile.log"; tar -czf "$RESULTS/compile.tar.gz" -C /tmp compile ;;
  esac
done
echo "$(date -u +%T) done" | tee -a "$RESULTS/stages.log"
exit $status
