#!/usr/bin/env bash
# One call on the GPU machine (no TVM there): install each carried apache-tvm-ffi wheel into its
# own --target directory, then check and time the bundles built here and carried in artifacts/.
#   STAGES   space-separated, any of: tests overhead sanitize sweep bench compile transformers pairs tune profile
#            (default: all but tune, transformers, pairs and profile; pairs needs artifacts/flashinfer_peer, from
#            scripts/build_flashinfer_peer.py)
#   TEST_PATHS                 the tests stage's files (default: tests)
#   TESTS_SIDE_BY_SIDE=1       the tests stage runs the carried apache-tvm-ffi versions at once (default: one by one)
#   TESTS_WORKERS=N            each tests run spreads its tests over N pytest-xdist processes (carry the
#                              pytest_xdist and execnet wheels in .whl/); the suite's time is mostly the CPU
#                              reference, one core each (default: one process)
#   FFI_VERSION                the apache-tvm-ffi the stages other than tests run under (default: the version
#                              artifacts/bundle was built with, else the newest carried); tests runs under each
#   BENCH_ROWS, BENCH_HIDDEN, BENCH_FORMATS, BENCH_GROUP   narrow the benchmark grid (BENCH_GROUP=32:
#                              the G = 32 layouts, col:ue8m0_packed and tiled:mxfp8)
#   BENCH_PROVIDERS            the bench stage's providers (default: ours,triton); BENCH_SLOW_ROWS the M
#                              values at which torch_compile/torch_eager run (default: all)
#   SWEEP_ROWS, SWEEP_FORMATS, SWEEP_HIDDEN, SWEEP_PROVIDERS  the sweep stage's grid, over each
#                              artifacts/sweep_* bundle (default: K 4096,7168, provider ours)
#   TUNE_SPECS                 space-separated spec names: the tune stage measures only these
#   TUNE_BUNDLES               the candidate bundles the tune stage measures (default: artifacts/tune_*)
#   OVERHEAD_RUNS              how many times the overhead stage runs (default 1)
#   PROFILE_VARIANTS, PROFILE_ROWS  the profile stage: ncu (PROFILE_SET, default: throughput, memory,
#                              occupancy, warp-stall and launch sections) on each named variant's kernel
#                              at each M of PROFILE_ROWS (default 16384), run by bench (checked first);
#                              a variant with a residual and col fp32 scales is profiled against
#                              FlashInfer's kernel too when artifacts/flashinfer_peer is carried;
#                              PROFILE_NCU_ARGS adds ncu options (e.g. --warp-sampling-interval 0:
#                              one block at M = 1 gave ncu's default interval two stall samples)
# Each stage writes $OUT/<stage>.log as it goes (so a timed-out call still returns it)
# and packs its data into $OUT/<stage>.tar.gz; $OUT/stages.log has the GPU's clocks and each
# stage's start time. The tests stage runs the gpu tests once per carried apache-tvm-ffi wheel,
# into $OUT/tests-<version>.log each (three files with 0.1.11, 0.1.14.post1 and 0.1.15.post2).
# The device returns at most 8 files from $OUT: a call that runs this
# script several times (OUT=$OUT/a, OUT=$OUT/b) must stay within that, or files are dropped.
set -uo pipefail
# The runtime takes a range of apache-tvm-ffi versions (pyproject.toml): each carried one goes into
# /tmp/ffi-<version>, any other carried wheel into /tmp/site, which every run shares.
FFI_VERSIONS=""
for wheel in .whl/*.whl; do
  name=$(basename "$wheel")
  case $name in
    apache_tvm_ffi-*) version=$(echo "$name" | cut -d- -f2); site=/tmp/ffi-$version; FFI_VERSIONS="$FFI_VERSIONS $version" ;;
    *) site=/tmp/site ;;
  esac
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$wheel" || exit 1
done
FFI_VERSIONS=$(printf '%s\n' $FFI_VERSIONS | sort -uV)
[ -n "$FFI_VERSIONS" ] || { echo "no apache-tvm-ffi wheel in .whl/: carry at least one"; exit 1; }
# The installed layout (schedules/ and codegen/ inside the package), without pip or network.
PKG=/tmp/pkg-$$
mkdir -p $PKG && cp -r tvm_rmsquant $PKG/ && cp -r schedules $PKG/tvm_rmsquant/schedules \
  && cp -r codegen $PKG/tvm_rmsquant/codegen || exit 1
# No TVM there, on purpose: the tests that need the build toolchain skip instead of failing.
export TVM_RMSQUANT_BUNDLE=${TVM_RMSQUANT_BUNDLE:-$PWD/artifacts/bundle} PYTHONUNBUFFERED=1 TVM_RMSQUANT_NO_TOOLCHAIN=1
BUILT_WITH=$(python3 -P -c 'import json, sys; root = sys.argv[1]; live = open(root + "/CURRENT").read().strip()
print(json.load(open(f"{root}/bundles/{live}/manifest.json"))["toolchain"]["apache-tvm-ffi"])' "$TVM_RMSQUANT_BUNDLE" 2>/dev/null)
FFI_VERSION=${FFI_VERSION:-${BUILT_WITH:-$(echo "$FFI_VERSIONS" | tail -n 1)}}
[ -d "/tmp/ffi-$FFI_VERSION" ] || { echo "FFI_VERSION=$FFI_VERSION: no such wheel carried in .whl/ (carried: $(echo $FFI_VERSIONS))"; exit 1; }
SITES=/tmp/site:$PKG
export PYTHONPATH=/tmp/ffi-$FFI_VERSION:$SITES  # and python3 -P: the checkout must not shadow it
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
RESULTS=$OUT
STAGES=${STAGES:-tests overhead sanitize sweep bench compile}
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee -a "$RESULTS/stages.log"
echo "apache-tvm-ffi carried: $(echo $FFI_VERSIONS); tests run under each, the other stages under $FFI_VERSION" | tee -a "$RESULTS/stages.log"
for stage in $STAGES; do
  echo "$(date -u +%T) stage $stage" | tee -a "$RESULTS/stages.log"
  case $stage in
    tests)
      # Once per carried apache-tvm-ffi; each log starts with the version and the tvm_ffi it imported.
      # TESTS_SIDE_BY_SIDE=1 runs the versions at once, each with its share of the CPU cores and its
      # own compile caches: the suite's time is mostly the CPU reference (the GPU idles), and torch's
      # default of one thread per core in each of three processes would oversubscribe the host.
      versions=($FFI_VERSIONS)
      jobs=$([ "${TESTS_SIDE_BY_SIDE:-0}" = 1 ] && echo ${#versions[@]} || echo 1)
      workers=${TESTS_WORKERS:-1} spread=()
      [[ $workers =~ ^[1-9][0-9]*$ ]] || { echo "TESTS_WORKERS=$workers: give a number of test processes, e.g. 8"; exit 2; }
      if [ "$workers" != 1 ]; then
        PYTHONPATH=$SITES python3 -P -c 'import xdist' 2>/dev/null \
          || { echo "TESTS_WORKERS=$workers needs pytest-xdist: carry the pytest_xdist and execnet wheels in .whl/"; exit 2; }
        spread=(-n "$workers")
      fi
      threads=$(( $(nproc) / jobs / workers )); [ $threads -ge 1 ] || threads=1
      run_tests() {
        local version=$1 log=$RESULTS/tests-$1.log caches=/tmp/caches-$1
        PYTHONPATH=/tmp/ffi-$version:$SITES python3 -P -c 'import importlib.metadata as m, tvm_ffi
print("apache-tvm-ffi", m.version("apache-tvm-ffi"), "from", tvm_ffi.__file__)' > "$log" 2>&1
        OMP_NUM_THREADS=$threads TORCHINDUCTOR_CACHE_DIR=$caches/inductor TRITON_CACHE_DIR=$caches/triton \
          PYTHONSAFEPATH=1 PYTHONPATH=/tmp/ffi-$version:$SITES python3 -m pytest -p no:cacheprovider -m gpu ${spread[@]+"${spread[@]}"} ${TEST_PATHS:-tests} -q -rfE --durations=8 ${PYTEST_ARGS:-} \
          >> "$log" 2>&1
      }
      pids=()
      for version in "${versions[@]}"; do
        if [ $jobs -gt 1 ]; then run_tests "$version" & pids+=($!); else run_tests "$version" || status=1; fi
      done
      for pid in "${pids[@]}"; do wait "$pid" || status=1; done
      for version in "${versions[@]}"; do
        log=$RESULTS/tests-$version.log
        grep -E "^(FAILED|ERROR) " "$log" | head -n 20 | sed "s/^/apache-tvm-ffi $version: /"
        echo "tests under $(head -n 1 "$log"): $(tail -n 1 "$log")"
      done ;;
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
        python3 -P -m tvm_rmsquant bench --bundle "$bundle" --providers "${SWEEP_PROVIDERS:-ours}" --hidden "${SWEEP_HIDDEN:-4096,7168}" --rows "${SWEEP_ROWS:-64,4096,16384}" \
          --formats "${SWEEP_FORMATS:-row:fp32,col:ue8m0}" --out "/tmp/sweep/$(basename "$bundle")" >> "$RESULTS/sweep.log" 2>&1
      done
      grep -E "==|M= *(4096|16384)" "$RESULTS/sweep.log"; tar -czf "$RESULTS/sweep.tar.gz" -C /tmp sweep ;;
    bench)
      python3 -P -m tvm_rmsquant bench --providers "${BENCH_PROVIDERS:-ours,triton}" --overhead --out /tmp/bench \
        ${BENCH_HIDDEN:+--hidden $BENCH_HIDDEN} ${BENCH_ROWS:+--rows $BENCH_ROWS} ${BENCH_FORMATS:+--formats $BENCH_FORMATS} ${BENCH_GROUP:+--group $BENCH_GROUP} ${BENCH_SLOW_ROWS:+--slow-rows $BENCH_SLOW_ROWS} > "$RESULTS/bench.log" 2>&1
      grep -E "ceiling|overhead|WRONG|ERROR|Error" "$RESULTS/bench.log" | head -n 30; tar -czf "$RESULTS/bench.tar.gz" -C /tmp bench ;;
    tune)
      # Candidate bundles from `tune build`: checked, then timed; one results JSON each.
      for bundle in ${TUNE_BUNDLES:-artifacts/tune_*}; do
        echo "== $bundle" >> "$RESULTS/tune.log"
        python3 -P -m tvm_rmsquant tune measure "$bundle" ${TUNE_SPECS:+$(printf -- '--spec %s ' $TUNE_SPECS)} \
          --out "$RESULTS/$(basename "$bundle").json" >> "$RESULTS/tune.log" 2>&1 || status=1
      done
      grep -E "==|ceiling|DROPPED|wrote|Error" "$RESULTS/tune.log" | head -n 40 ;;
    pairs)
      python3 -P -m tvm_rmsquant bench --pairs --providers ours,flashinfer --rows 1,16,128,1024 --hidden 2048,4096,5120,7168,8192 \
        --out /tmp/pairs > "$RESULTS/pairs.log" 2>&1 || status=1
      tail -n 45 "$RESULTS/pairs.log"; tar -czf "$RESULTS/pairs.tar.gz" -C /tmp pairs ;;
    profile)
      # ncu on the first launch of each variant's kernel in a bench run (which checks it before timing):
      # PROFILE_SET=full adds instruction, scheduler and per-instruction stall sampling. Each report
      # is kept, with its details and its SASS source page as text, in profile.tar.gz.
      mkdir -p /tmp/profile
      sections=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section LaunchStats)
      [ -n "${PROFILE_SET:-}" ] && sections=(--set "$PROFILE_SET")
      for variant in ${PROFILE_VARIANTS:-bf16_k7168_g128_row_fp32}; do
        spec=$(python3 -P -c 'import sys; from tvm_rmsquant.spec import VariantSpec; s = VariantSpec.parse(sys.argv[1])
print(s.hidden, f"{s.layout}:{s.format}", int(s.residual and (s.layout, s.format) == ("col", "fp32")))' "$variant") || { status=1; continue; }
        read -r hidden pair peer <<< "$spec"
        cases="ours:$variant"
        [ "$peer" = 1 ] && [ -f artifacts/flashinfer_peer/flashinfer_peer.so ] && cases="$cases flashinfer:FusedAddRMSNormFP8BlockQuantKernel"
        for rows in $(echo "${PROFILE_ROWS:-16384}" | tr , ' '); do
          for case in $cases; do
            provider=${case%%:*} kernel=${case#*:} report=/tmp/profile/${provider}_${variant}_m$rows
            ncu "${sections[@]}" ${PROFILE_NCU_ARGS:-} -k "regex:$kernel" -c 1 -f -o "$report" python3 -P -m tvm_rmsquant bench --providers "$provider" --hidden "$hidden" \
              --rows "$rows" --formats "$pair" --out "$report.bench" >> "$RESULTS/profile.log" 2>&1 || status=1
            ncu -i "$report.ncu-rep" --page details > "$report.details.txt" 2>&1
            ncu -i "$report.ncu-rep" --page source --print-source sass --csv > "$report.sass.csv" 2>&1
            echo "== $provider $variant M=$rows" >> "$RESULTS/profile.log"; cat "$report.details.txt" >> "$RESULTS/profile.log"
          done
        done
      done
      tar -czf "$RESULTS/profile.tar.gz" -C /tmp profile
      grep -E "^==|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Executed Ipc A|Issue Slots Busy|Warp Cycles Per Issued|Stall|WRONG|Error" "$RESULTS/profile.log" | head -n 80 ;;
    transformers)
      # transformers' FP8 Qwen3 at Qwen3-8B's sizes, fused against unfused and bf16 (needs accelerate: carry its wheel).
      python3 -P scripts/bench_transformers.py --out "$RESULTS/transformers.json" > "$RESULTS/transformers.log" 2>&1 || status=1
      tail -n 12 "$RESULTS/transformers.log" ;;
    compile)
      python3 -P -m tvm_rmsquant bench --providers ours,triton,torch_compile,torch_eager --hidden 4096,7168 --rows 4096,16384 \
        --out /tmp/compile > "$RESULTS/compile.log" 2>&1
      tail -n 50 "$RESULTS/compile.log"; tar -czf "$RESULTS/compile.tar.gz" -C /tmp compile ;;
  esac
done
echo "$(date -u +%T) done" | tee -a "$RESULTS/stages.log"
exit $status
