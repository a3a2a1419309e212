#!/usr/bin/env bash
# GPU check: build, test, sanitize, benchmark and profile libsparge on a CUDA
# machine in one go, with a time limit per stage and an overall budget, so that
# one hang cannot eat the session. Every stage runs even if an earlier one
# failed (where it can: nothing runs without a build); a summary table is
# printed last.
#
#   tools/gpu_check.sh [stage ...]     (default: info build test sanitize bench ncu)
#
# Stages
#   info      nvidia-smi, GPU clocks, commit, toolchain versions
#   build     cmake (Release, Ninja, -DSPARGE_CUDA=ON) + build everything with -j16;
#             Catch2: the machine's (v2 or v3), else the v2 header .deps/catch2/catch.hpp
#   test      ctest (everything but gpu_tests), then the GPU test binary directly,
#             with its measured-accuracy table; the host-pointer tests in a
#             process of their own; the KEYS_LSE tests on the portable (mma.sync)
#             block-score kernel
#   sanitize  compute-sanitizer memcheck, racecheck, synccheck, initcheck on the [sanitize]
#             subset of the GPU tests (small shapes); synccheck, racecheck, memcheck on its
#             attention cases with every dense FP16 call on at most 3 persistent CTAs
#   bench     sparge_bench (all workloads) and tools/bench/anchors.py (torch SDPA
#             cuDNN / FLASH_ATTENTION, ceilings, accuracy vs float32 SDPA, side by side)
#   grid      tools/bench/grid.py: the benchmark grid (B x N x D x causal) through the Python API,
#             libsparge (default precision auto) dense and empty mask against torch SDPA cuDNN and FA2 (grid.csv, grid.md)
#   ncusrc    Nsight Compute full set on the same kernel: pipe utilization, stall reasons,
#             and a per-SASS-instruction CSV (sass_source.csv), summarized into ncusrc.log by
#             tools/bench/sass_stalls.py (the main loop's instructions, samples per opcode and reason)
#   ab        A/B against another source tree (AB_BASE): builds it into build-ab/, then
#             tools/bench/ab_compare.py runs both trees' sparge_bench alternately (ab.csv)
#   abenv     a developer switch (AB_ENV) against the default on this build: grid.py alternately
#             without and with it, then tools/bench/grid_compare.py shape by shape (abenv.log, abenv.csv)
#   trace     a build with -DSPARGE_SM90_TRACE=ON (build-trace/): clock stamps of every CTA of one
#             dense FP16 call per TRACE_SHAPES entry, read by tools/bench/trace_sm90.py (trace.log)
#   ncu       Nsight Compute (--clock-control none) on the int8_fp8 attention kernel
#             at N=16K D=128 (tensor-pipe utilization, throughput), the same for the
#             FP16-mode and INT8_FP16 sm_90a kernels, and kernel durations of one
#             predict+attention call
#
# Environment
#   BUILD_DIR (build-gpu)    GPU_CHECK_BUDGET_S (570: total seconds for all stages)
#   OUT (where logs go; default ./gpu_check_out)   JOBS (16)
#   BENCH_ARGS (extra sparge_bench arguments, e.g. --n64k)
#   NCU_KERNEL_REGEX (regex:MainloopInt8Fp8, matched against demangled names)
#   NCUSRC_ARGS (the ncusrc stage's sparge_bench arguments; default "--n 16384 --d 128 --causal 0 --modes dense";
#   e.g. NCU_KERNEL_REGEX=regex:Mainloop16 NCUSRC_ARGS="--batch 8 --n 8k --d 128 --causal 0 --modes fp16")
#   SPARGE_TEST_SEED (reproduce a test run)
#   AB_OVERLAY (instead of AB_BASE: a directory written by tools/ab_base.sh REV DIR; the base is
#   this tree with REV's versions of the files that changed since REV)
#   AB_BASE (a source tree to compare against in the ab stage; AB_ARGS: its sparge_bench
#   arguments; AB_ROUNDS (3): alternating rounds; AB_GRID: tools/bench/grid.py arguments, which
#   then also runs on both trees' libraries, e.g. "--b 64 --n 1k --d 128,64 --causal 0" for empty masks)
#   AB_ENV (abenv: the switch's VAR=value words, e.g. "SPARGE_SM90_EPILOGUE=direct"; AB_ENV_ROUNDS (2): rounds
#   of the two sides; AB_ENV_GRID: grid.py arguments, default "--b 1,8,64 --n 1k,2k,8k --sparse --no-fa2
#   --measure-ms 500 --batches 5")
#   GPU_CHECK_FP16AB (1; 0 skips the portable FP16-mode kernel A/B in bench)
#   GPU_CHECK_PORTABLE_FP16 (1; 0 skips the attention tests on the portable FP16-mode kernel)
#   GPU_CHECK_DIRECT_EPILOGUE (1; 0 skips the attention tests with the direct-store epilogue)
#   GPU_CHECK_PERSIST (1; 0 skips the attention tests with every dense FP16 call on 3 persistent CTAs)
#   GPU_CHECK_SHORT (1; 0 skips the attention tests with every D = 64 FP16 call on the short-row kernel)
#   GPU_CHECK_COMMIT (the commit to report, for a copy of the tree without current git metadata)
#   GPU_CHECK_ARCHS (the builds' SPARGE_CUDA_ARCHS, e.g. 90a: SASS for this GPU only, a shorter build;
#   unset: CMake's default or what the build folder has; GPU_CHECK_PTX: SPARGE_CUDA_PTX with it, default none)
#   GPU_CHECK_TARGETS (the build stage's targets, e.g. "sparge sparge_gpu_tests"; default all)
#   GRID_ARGS (extra tools/bench/grid.py arguments, e.g. --sparse --pred)
#   GRID_LIMIT_S (330: the grid stage's time limit; grid.py gets 30 s less as its --budget-s)
#   TRACE_SHAPES ("B H N D causal persist;...": persist 0, 1 or rule; default 64x32x1Kx128 one CTA
#   per row and persistent, 1x32x8Kx128)
#
# Files written to $OUT (10 at most): build.log test.log sanitize.log bench.log
# bench.csv anchors.csv ncu.log summary.txt, and with ncusrc: ncusrc.log sass_source.csv;
# the grid stage (only when named) writes grid.log grid.csv grid.md; abenv abenv.log abenv.csv; the trace stage trace.log
set -o pipefail
set -u

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
# Kernel choice is set per stage below, never inherited.
unset SPARGE_FP16_KERNEL SPARGE_SM90_EPILOGUE SPARGE_PDL SPARGE_SM90_PERSIST SPARGE_SM90_PERSIST_GRID SPARGE_SM90_WIDE \
  SPARGE_SM90_SHORT
ROOT=$PWD
BUILD=${BUILD_DIR:-build-gpu}
OUTDIR=${OUT:-$ROOT/gpu_check_out}
JOBS=${JOBS:-16}
BUDGET=${GPU_CHECK_BUDGET_S:-570}
T0=$(date +%s)
mkdir -p "$OUTDIR"
LOG=$OUTDIR

if [ $# -eq 0 ]; then
  set -- info build test sanitize bench ncu
fi
STAGES=" $* "
want() { [[ $STAGES == *" $1 "* ]]; }

COMMIT=$(git -C "$ROOT" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
if ! git -C "$ROOT" diff --quiet HEAD 2>/dev/null; then COMMIT="$COMMIT+dirty"; fi
# A copy of the tree without current git metadata can name its commit.
COMMIT=${GPU_CHECK_COMMIT:-$COMMIT}
# Architectures of every build below (GPU_CHECK_ARCHS), and the build stage's targets.
ARCH_ARGS=()
[ -n "${GPU_CHECK_ARCHS:-}" ] && ARCH_ARGS=(-DSPARGE_CUDA_ARCHS="$GPU_CHECK_ARCHS" -DSPARGE_CUDA_PTX="${GPU_CHECK_PTX:-}")
read -ra BUILD_TARGETS <<<"${GPU_CHECK_TARGETS:-}"

SUMMARY=()
note() { SUMMARY+=("$(printf '| %-9s | %-7s | %5s s | %s |' "$1" "$2" "$3" "$4")"); }
elapsed() { echo $(($(date +%s) - T0)); }
# Seconds a stage may use: its own cap, or what is left of the budget (minus a reserve).
allow() {
  local cap=$1 left=$((BUDGET - $(elapsed) - 15))
  ((left < cap)) && cap=$left
  echo "$cap"
}
banner() { printf '\n==== %s (t=%ss)\n' "$*" "$(elapsed)"; }
# run_to LOGFILE SECONDS cmd...: runs with a timeout, appending to the log and to stdout.
run_to() {
  local log=$1 secs=$2
  shift 2
  if ((secs < 5)); then
    echo "(skipped: no time left in the budget) $*" | tee -a "$log"
    return 124
  fi
  echo "\$ $* (timeout ${secs}s)" | tee -a "$log"
  timeout --kill-after=10 "$secs" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  if ((rc == 124 || rc == 137)); then echo "TIMEOUT after ${secs}s: $*" | tee -a "$log"; fi
  return "$rc"
}

BUILT=0
[ -x "$BUILD/tests/sparge_gpu_tests" ] && [ -f "$BUILD/libsparge.so" ] && BUILT=1

# ---------------------------------------------------------------- info
if want info; then
  banner info
  s=$(date +%s)
  {
    echo "commit $COMMIT ($(git -C "$ROOT" log -1 --format='%cd %s' --date=iso 2>/dev/null))"
    nvidia-smi || echo "nvidia-smi failed"
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw,power.limit \
      --format=csv 2>/dev/null
    command -v nvcc >/dev/null && nvcc --version | tail -n 2
    cmake --version | head -n 1
    ninja --version 2>/dev/null | sed 's/^/ninja /'
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())' 2>&1
    command -v ncu >/dev/null && ncu --version | tail -n 1
    command -v compute-sanitizer >/dev/null && compute-sanitizer --version | tail -n 1
    nproc | sed 's/^/cpus /'
  } 2>&1 | tee -a "$LOG/build.log"
  note info ok $(($(date +%s) - s)) "commit $COMMIT"
fi

# ---------------------------------------------------------------- build
if want build; then
  banner build
  s=$(date +%s)
  # The machine's Catch2 (v2 or v3, as CMake finds it), else the carried v2 header.
  CATCH_ARGS=(-DSPARGE_CATCH2_INCLUDE_DIR=)
  probe_dir=$(mktemp -d)
  catch2=$(cmake -S "$ROOT/cmake/catch2-probe" -B "$probe_dir" 2>&1 | sed -n 's/^-- sparge-catch2: //p')
  rm -rf "$probe_dir"
  echo "catch2: $catch2" | tee -a "$LOG/build.log"
  if [[ $catch2 == found* ]]; then
    :
  elif [ -f "$ROOT/.deps/catch2/catch.hpp" ]; then
    CATCH_ARGS=(-DSPARGE_CATCH2_INCLUDE_DIR="$ROOT/.deps")
    echo "catch2: using the carried v2 header .deps/catch2/catch.hpp" | tee -a "$LOG/build.log"
  else
    echo "warning: no Catch2 that CMake accepts and no .deps/catch2/catch.hpp: configure will fail" | tee -a "$LOG/build.log"
  fi
  rc=0
  run_to "$LOG/build.log" "$(allow 120)" cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DSPARGE_CUDA=ON -DSPARGE_BUILD_TESTS=ON "${CATCH_ARGS[@]}" "${ARCH_ARGS[@]}" || rc=$?
  if ((rc == 0)); then
    targets=()
    ((${#BUILD_TARGETS[@]})) && targets=(--target "${BUILD_TARGETS[@]}")
    run_to "$LOG/build.log" "$(allow 480)" cmake --build "$BUILD" -j "$JOBS" "${targets[@]}" || rc=$?
  fi
  if ((rc == 0)); then
    BUILT=1
    note build ok $(($(date +%s) - s)) "$BUILD"
  else
    BUILT=0
    note build FAIL $(($(date +%s) - s)) "rc=$rc, see build.log"
    grep -E "error|Error" "$LOG/build.log" | head -n 20
  fi
fi

GPU_TESTS=$BUILD/tests/sparge_gpu_tests
BENCH=$BUILD/tools/bench/sparge_bench

# ---------------------------------------------------------------- test
if want test; then
  banner test
  s=$(date +%s)
  if ((BUILT == 0)); then
    note test skip 0 "no build"
  else
    fails=()
    if [ -x "$BUILD/tests/sparge_tests" ]; then
      run_to "$LOG/test.log" "$(allow 180)" ctest --test-dir "$BUILD" --output-on-failure -j 8 --timeout 170 \
        -E '^gpu_tests$' || fails+=("ctest")
    else
      echo "ctest skipped: the CPU tests are not built (GPU_CHECK_TARGETS)" | tee -a "$LOG/test.log"
    fi
    # SPARGE_FP16_KERNEL=sm90: an FP16 call the sm_90a kernel cannot take fails
    # instead of falling back, so the FP16 results below are that kernel's.
    run_to "$LOG/test.log" "$(allow 240)" env SPARGE_GPU_TEST_CSV="$BUILD/gpu_accuracy.csv" SPARGE_FP16_KERNEL=sm90 "$GPU_TESTS" \
      '~[hostptr]' -r compact -d yes
    rc=$?
    ((rc == 77)) && fails+=("gpu: SKIPPED (no device?)")
    ((rc != 0 && rc != 77)) && fails+=("gpu_tests rc=$rc")
    run_to "$LOG/test.log" "$(allow 60)" "$GPU_TESTS" '[hostptr]' -r compact -d yes
    rc=$?
    ((rc != 0 && rc != 77)) && fails+=("hostptr rc=$rc")
    # The mma.sync block-score kernel of the prediction, which the sm_90a one replaces on this GPU.
    run_to "$LOG/test.log" "$(allow 60)" env SPARGE_KERNEL_FAMILY=portable "$GPU_TESTS" '[keys_lse]' -r compact
    rc=$?
    ((rc != 0 && rc != 77)) && fails+=("keys_lse portable rc=$rc")
    # The portable FP16-mode kernel (the fallback where TMA cannot express the
    # strides) on the attention cases too.
    if [ "${GPU_CHECK_PORTABLE_FP16:-1}" != 0 ]; then
      run_to "$LOG/test.log" "$(allow 120)" env SPARGE_FP16_KERNEL=portable "$GPU_TESTS" '[attention]~[large]' \
        -r compact
      rc=$?
      ((rc != 0 && rc != 77)) && fails+=("portable fp16 rc=$rc")
    fi
    # The sm_90a kernels' direct-store epilogue (outputs whose strides no tensor
    # map expresses, and SPARGE_SM90_EPILOGUE=direct) on the attention cases.
    if [ "${GPU_CHECK_DIRECT_EPILOGUE:-1}" != 0 ]; then
      run_to "$LOG/test.log" "$(allow 120)" env SPARGE_SM90_EPILOGUE=direct SPARGE_FP16_KERNEL=sm90 "$GPU_TESTS" \
        '[attention]~[large]' -r compact
      rc=$?
      ((rc != 0 && rc != 77)) && fails+=("direct epilogue rc=$rc")
    fi
    # Every dense FP16 call on persistent CTAs, at most 3 of them (many rows per
    # CTA on the small shapes: the row boundaries and both Q buffers).
    if [ "${GPU_CHECK_PERSIST:-1}" != 0 ]; then
      run_to "$LOG/test.log" "$(allow 120)" env SPARGE_SM90_PERSIST=1 SPARGE_SM90_PERSIST_GRID=3 SPARGE_FP16_KERNEL=sm90 \
        "$GPU_TESTS" '[attention]~[large]' -r compact
      rc=$?
      ((rc != 0 && rc != 77)) && fails+=("persistent rc=$rc")
    fi
    # Every FP16 call at D = 64 on the short-row kernel (two CTAs per SM,
    # 64-key steps), dense and masked.
    if [ "${GPU_CHECK_SHORT:-1}" != 0 ]; then
      run_to "$LOG/test.log" "$(allow 120)" env SPARGE_SM90_SHORT=1 SPARGE_FP16_KERNEL=sm90 \
        "$GPU_TESTS" '[attention]~[large]' -r compact
      rc=$?
      ((rc != 0 && rc != 77)) && fails+=("short-row rc=$rc")
    fi
    acc=$(grep -c '^ACC .* FAIL$' "$LOG/test.log")
    tot=$(grep -c '^ACC ' "$LOG/test.log")
    summary_line=$(grep -E '^(test cases|All tests passed|Failed)' "$LOG/test.log" | tail -n 2 | tr '\n' ' ')
    if ((${#fails[@]} == 0)); then
      note test ok $(($(date +%s) - s)) "accuracy values $((tot - acc))/$tot within bars; $summary_line"
    else
      note test FAIL $(($(date +%s) - s)) "${fails[*]}; accuracy values outside bars: $acc/$tot"
    fi
  fi
fi

# ---------------------------------------------------------------- sanitize
if want sanitize; then
  banner sanitize
  s=$(date +%s)
  if ((BUILT == 0)); then
    note sanitize skip 0 "no build"
  elif ! command -v compute-sanitizer >/dev/null; then
    note sanitize skip 0 "compute-sanitizer not found"
  else
    res=()
    # One compute-sanitizer run: sanitize LABEL TOOL LIMIT FILTER [env assignments...];
    # its outcome is appended to res.
    sanitize() {
      local label=$1 tool=$2 lim=$3 filter=$4 extra=() rc
      shift 4
      [ "$tool" = racecheck ] && extra=(--racecheck-report hazard)
      run_to "$LOG/sanitize.log" "$(allow "$lim")" env SPARGE_FP16_KERNEL=sm90 "$@" compute-sanitizer --tool "$tool" \
        --error-exitcode 99 --print-limit 50 "${extra[@]}" "$GPU_TESTS" "$filter" -r compact
      rc=$?
      case $rc in
        0) res+=("$label ok") ;;
        99) res+=("$label ERRORS") ;;
        124 | 137) res+=("$label timeout") ;;
        *) res+=("$label rc=$rc") ;;
      esac
    }
    for tool in memcheck racecheck synccheck initcheck; do
      filter='[sanitize]'
      [ "$tool" != memcheck ] && filter='[sanitize]~[errors]'
      # racecheck's run time varies a lot between runs (17 s to over 150 s for the
      # same binary on the H200: it instruments every mbarrier poll), so it gets more.
      lim=150
      [ "$tool" = racecheck ] && lim=300
      sanitize "$tool" "$tool" $lim "$filter"
    done
    # The persistent FP16 path (see the test stage) under the tools that check
    # its barriers and shared memory.
    for tool in synccheck racecheck memcheck; do
      sanitize "persistent $tool" "$tool" 150 '[attention][sanitize]' SPARGE_SM90_PERSIST=1 SPARGE_SM90_PERSIST_GRID=3
    done
    # The short-row kernel (two CTAs per SM share the SM's barriers and memory).
    for tool in synccheck racecheck memcheck; do
      sanitize "short-row $tool" "$tool" 150 '[attention][sanitize]' SPARGE_SM90_SHORT=1
    done
    st=ok
    [[ "${res[*]}" == *ERRORS* || "${res[*]}" == *rc=* || "${res[*]}" == *timeout* ]] && st=FAIL
    note sanitize $st $(($(date +%s) - s)) "${res[*]}"
  fi
fi

# ---------------------------------------------------------------- bench
if want bench; then
  banner bench
  s=$(date +%s)
  if ((BUILT == 0)) || [ ! -x "$BENCH" ]; then
    note bench skip 0 "no build"
  else
    res=()
    # shellcheck disable=SC2086
    run_to "$LOG/bench.log" "$(allow 300)" "$BENCH" --csv "$LOG/bench.csv" --tag "$COMMIT" ${BENCH_ARGS:-}
    rc=$?
    ((rc == 0)) && res+=("sparge_bench ok") || res+=("sparge_bench rc=$rc")
    # A/B: the portable (mma.sync) FP16-mode kernel against the sm_90a one.
    if [ "${GPU_CHECK_FP16AB:-1}" != 0 ]; then
      run_to "$LOG/bench.log" "$(allow 120)" env SPARGE_FP16_KERNEL=portable "$BENCH" --modes fp16 \
        --tag portable-fp16
      rc=$?
      ((rc == 0)) && res+=("portable fp16 A/B ok") || res+=("portable fp16 A/B rc=$rc")
    fi
    run_to "$LOG/bench.log" "$(allow 150)" env PYTHONUNBUFFERED=1 python3 "$ROOT/tools/bench/anchors.py" \
      --lib "$BUILD/libsparge.so" --ours "$LOG/bench.csv" --csv "$LOG/anchors.csv"
    rc=$?
    ((rc == 0)) && res+=("anchors ok") || res+=("anchors rc=$rc")
    st=ok
    [[ "${res[*]}" == *rc=* ]] && st=FAIL
    note bench $st $(($(date +%s) - s)) "${res[*]}"
  fi
fi

# ---------------------------------------------------------------- grid
# The benchmark grid through the Python API (tools/bench/grid.py) on this build's library. It needs
# only libsparge.so and python3 with torch (CUDA); not in the default stage list.
if want grid; then
  banner grid
  s=$(date +%s)
  if [ ! -f "$BUILD/libsparge.so" ]; then
    note grid skip 0 "no build ($BUILD/libsparge.so)"
  else
    lim=$(allow "${GRID_LIMIT_S:-330}")
    gbud=$((lim > 60 ? lim - 30 : lim / 2))
    # shellcheck disable=SC2086
    run_to "$LOG/grid.log" "$lim" env PYTHONUNBUFFERED=1 python3 "$ROOT/tools/bench/grid.py" \
      --lib "$BUILD/libsparge.so" --commit "$COMMIT" --budget-s "$gbud" --csv "$LOG/grid.csv" \
      --md "$LOG/grid.md" ${GRID_ARGS:-}
    rc=$?
    line=$(grep -E '^grid: ' "$LOG/grid.log" | tail -n 1)
    case $rc in
      0) note grid ok $(($(date +%s) - s)) "$line" ;;
      77) note grid skip $(($(date +%s) - s)) "no CUDA device for torch" ;;
      *) note grid FAIL $(($(date +%s) - s)) "rc=$rc; ${line:-see grid.log}" ;;
    esac
  fi
fi

# ---------------------------------------------------------------- ab
if want ab; then
  banner ab
  s=$(date +%s)
  # AB_OVERLAY (tools/ab_base.sh): the base is a copy of this tree with the overlay's files laid
  # over it and the files it lists in .ab_removed deleted (only when there is a build to compare).
  ab_skip="AB_BASE is not a source tree"
  if [ -z "${AB_BASE:-}" ] && [ -n "${AB_OVERLAY:-}" ] && ((BUILT == 1)) && [ -x "$BENCH" ]; then
    if [ -f "$AB_OVERLAY/.ab_removed" ]; then
      AB_BASE=$ROOT/build-ab-src
      rm -rf "$AB_BASE" && mkdir -p "$AB_BASE"
      tar -C "$ROOT" --exclude='./build*' --exclude=./.git --exclude=./.deps --exclude="./$(basename "$OUTDIR")" \
        -cf - . | tar -C "$AB_BASE" -xf -
      cp -r "$AB_OVERLAY/." "$AB_BASE/"
      while IFS= read -r f; do [ -n "$f" ] && rm -f "$AB_BASE/$f"; done <"$AB_OVERLAY/.ab_removed"
      rm -f "$AB_BASE/.ab_removed"
      echo "ab: base = this tree with the overlay $AB_OVERLAY ($(find "$AB_OVERLAY" -type f ! -name .ab_removed | wc -l) file(s) replaced, $(grep -c . "$AB_OVERLAY/.ab_removed") removed)" | tee -a "$LOG/ab.log"
    else
      ab_skip="AB_OVERLAY has no .ab_removed (tools/ab_base.sh REV DIR writes it)"
    fi
  fi
  if ((BUILT == 0)) || [ ! -x "$BENCH" ]; then
    note ab skip 0 "no build"
  elif [ -z "${AB_BASE:-}" ] || [ ! -f "${AB_BASE}/CMakeLists.txt" ]; then
    note ab skip 0 "$ab_skip"
  else
    ABB=$ROOT/build-ab
    rc=0
    run_to "$LOG/ab.log" "$(allow 60)" cmake -S "$AB_BASE" -B "$ABB" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSPARGE_CUDA=ON \
      -DSPARGE_BUILD_TESTS=OFF "${ARCH_ARGS[@]}" || rc=$?
    ((rc == 0)) && { run_to "$LOG/ab.log" "$(allow 240)" cmake --build "$ABB" -j "$JOBS" --target sparge_bench || rc=$?; }
    if ((rc == 0)); then
      # shellcheck disable=SC2086
      run_to "$LOG/ab.log" "$(allow 420)" python3 "$ROOT/tools/bench/ab_compare.py" --a "$ABB/tools/bench/sparge_bench" \
        --b "$BENCH" --rounds "${AB_ROUNDS:-3}" --csv "$LOG/ab.csv" -- ${AB_ARGS:---modes dense,d0.2,i8f16,fp16} || rc=$?
    fi
    # The grid's shapes through the Python API on both libraries (base first), empty masks included.
    if ((rc == 0)) && [ -n "${AB_GRID:-}" ]; then
      for lib in "$ABB/libsparge.so" "$BUILD/libsparge.so"; do
        # shellcheck disable=SC2086
        run_to "$LOG/ab.log" "$(allow 150)" env PYTHONUNBUFFERED=1 python3 "$ROOT/tools/bench/grid.py" --lib "$lib" \
          --commit "$lib" --budget-s 120 $AB_GRID || rc=$?
      done
    fi
    line=$(grep -E '^[0-9]+ workloads: median change' "$LOG/ab.log" | tail -n 1)
    ((rc == 0)) && note ab ok $(($(date +%s) - s)) "$line" || note ab FAIL $(($(date +%s) - s)) "rc=$rc"
  fi
fi

# ---------------------------------------------------------------- abenv
# A developer switch against the default through the grid: grid.py on this build
# without and with AB_ENV (e.g. "SPARGE_SM90_EPILOGUE=direct"), alternating, for
# AB_ENV_ROUNDS rounds; tools/bench/grid_compare.py then compares the two sides
# shape by shape (abenv.log, abenv.csv).
if want abenv; then
  banner abenv
  s=$(date +%s)
  if [ ! -f "$BUILD/libsparge.so" ]; then
    note abenv skip 0 "no build ($BUILD/libsparge.so)"
  elif [ -z "${AB_ENV:-}" ]; then
    note abenv skip 0 "AB_ENV is not set"
  else
    tmp=$(mktemp -d)
    rc=0
    offs=()
    ons=()
    for ((r = 1; r <= ${AB_ENV_ROUNDS:-2}; ++r)); do
      for side in off on; do
        envs=()
        # shellcheck disable=SC2206
        [ "$side" = on ] && envs=($AB_ENV)
        # shellcheck disable=SC2086
        run_to "$LOG/abenv.log" "$(allow 150)" env "${envs[@]}" PYTHONUNBUFFERED=1 python3 "$ROOT/tools/bench/grid.py" \
          --lib "$BUILD/libsparge.so" --commit "$COMMIT $side" --budget-s 120 --csv "$tmp/$side$r.csv" \
          ${AB_ENV_GRID:---b 1,8,64 --n 1k,2k,8k --sparse --no-fa2 --measure-ms 500 --batches 5} || rc=$?
        if [ "$side" = on ]; then ons+=("$tmp/$side$r.csv"); else offs+=("$tmp/$side$r.csv"); fi
      done
    done
    if ((rc == 0)); then
      run_to "$LOG/abenv.log" 30 python3 "$ROOT/tools/bench/grid_compare.py" --a "${offs[@]}" --b "${ons[@]}" \
        --names "default,switch" --csv "$LOG/abenv.csv" || rc=$?
    fi
    rm -rf "$tmp"
    line=$(grep -E '^dense +[0-9]+ rows' "$LOG/abenv.log" | tail -n 1)
    ((rc == 0)) && note abenv ok $(($(date +%s) - s)) "$AB_ENV: $line" || note abenv FAIL $(($(date +%s) - s)) "rc=$rc"
  fi
fi

# ---------------------------------------------------------------- trace
# Where an sm_90a attention CTA's time goes (src/cuda/attention/sm90/trace.cuh):
# a build with -DSPARGE_SM90_TRACE=ON in build-trace/, one dense FP16 call per
# shape of TRACE_SHAPES, its clock stamps read by tools/bench/trace_sm90.py.
if want trace; then
  banner trace
  s=$(date +%s)
  TB=$ROOT/build-trace
  rc=0
  run_to "$LOG/trace.log" "$(allow 60)" cmake -S "$ROOT" -B "$TB" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSPARGE_CUDA=ON \
    -DSPARGE_BUILD_TESTS=OFF -DSPARGE_SM90_TRACE=ON "${ARCH_ARGS[@]}" || rc=$?
  ((rc == 0)) && { run_to "$LOG/trace.log" "$(allow 240)" cmake --build "$TB" -j "$JOBS" --target sparge_bench || rc=$?; }
  n_traced=0
  if ((rc == 0)); then
    IFS=';' read -ra shapes <<<"${TRACE_SHAPES:-64 32 1024 128 0 0;64 32 1024 128 0 1;1 32 8192 128 0 0}"
    for sh in "${shapes[@]}"; do
      read -r b h n d c pe <<<"$sh"
      f=$TB/trace_${b}x${h}x${n}x${d}_c${c}_p${pe}.bin
      echo "== B=$b H=$h N=$n D=$d causal=$c SPARGE_SM90_PERSIST=$pe" | tee -a "$LOG/trace.log"
      run_to "$LOG/trace.log" "$(allow 60)" env SPARGE_GRAPHS=0 SPARGE_SM90_PERSIST="$pe" SPARGE_SM90_TRACE_OUT="$f" \
        "$TB/tools/bench/sparge_bench" --modes fp16full --batch "$b" --heads "$h" --n "$n" --d "$d" --causal "$c" \
        --warmup 1 --min-iters 3 --max-iters 3 >/dev/null || rc=$?
      run_to "$LOG/trace.log" "$(allow 30)" python3 "$ROOT/tools/bench/trace_sm90.py" "$f" && n_traced=$((n_traced + 1))
    done
  fi
  if ((rc == 0)); then
    note trace ok $(($(date +%s) - s)) "$n_traced shapes traced"
  else
    note trace FAIL $(($(date +%s) - s)) "rc=$rc; see trace.log"
  fi
fi

# ---------------------------------------------------------------- ncu
if want ncu; then
  banner ncu
  s=$(date +%s)
  if ((BUILT == 0)) || [ ! -x "$BENCH" ]; then
    note ncu skip 0 "no build"
  elif ! command -v ncu >/dev/null; then
    note ncu skip 0 "ncu not found"
  else
    # Tensor-pipe metrics that this ncu knows for the chip (names differ between versions).
    mets="gpu__time_duration.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size"
    avail=$(timeout 60 ncu --query-metrics --chip gh100 2>/dev/null | awk '{print $1}')
    for m in sm__pipe_tensor_op_gmma_cycles_active sm__pipe_tensor_op_hmma_cycles_active sm__pipe_tensor_cycles_active \
      sm__inst_executed_pipe_tensor_op_gmma sm__pipe_shared_cycles_active; do
      if grep -qx "$m" <<<"$avail"; then
        case $m in
          sm__inst_executed*) mets="$mets,$m.sum" ;;
          *) mets="$mets,$m.avg.pct_of_peak_sustained_active" ;;
        esac
      fi
    done
    KRE=${NCU_KERNEL_REGEX:-regex:MainloopInt8Fp8}
    rc1=0
    run_to "$LOG/ncu.log" "$(allow 150)" ncu --clock-control none --kernel-name-base demangled -k "$KRE" --launch-skip 1 -c 1 \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section Occupancy --section LaunchStats \
      --section WarpStateStats --section MemoryWorkloadAnalysis \
      --metrics "$mets" "$BENCH" --n 16384 --d 128 --causal 0 --modes dense --warmup 1 --min-iters 1 \
      --max-iters 1 || rc1=$?
    # Achieved throughput: the kernel's own work over its ncu-measured duration.
    dur=$(grep -E 'gpu__time_duration.sum' "$LOG/ncu.log" | tail -n 1 | awk '{print $NF, $(NF-1)}')
    echo "kernel duration (ncu): $dur for 4*32*16384^2*128 = 4.398e12 ops (TOPS = 4398 / duration in ms)" | tee -a "$LOG/ncu.log"
    # The 16-bit P.V sm_90a kernel on the same workload, in the FP16 mode and in
    # INT8_FP16 (the same template with int8 Q.K^T): duration and pipe use. Each
    # run gets a header line, so the duration read is that run's (empty if no
    # kernel matched).
    ncu16() {  # bench mode, label; sets NCU16_DUR
      echo "== $2 kernel" | tee -a "$LOG/ncu.log"
      run_to "$LOG/ncu.log" "$(allow 90)" ncu --clock-control none --kernel-name-base demangled -k regex:Mainloop16 --launch-skip 1 -c 1 \
        --section SpeedOfLight --metrics "$mets" "$BENCH" --n 16384 --d 128 --causal 0 --modes "$1" --warmup 1 \
        --min-iters 1 --max-iters 1 || rc1=$?
      NCU16_DUR=$(awk -v h="== $2 kernel" '/^== /{f = ($0 == h); if (f) d=""} f && /gpu__time_duration.sum/{
        d=$NF " " $(NF-1)} END{print d}' "$LOG/ncu.log")
      echo "$2 kernel duration (ncu): $NCU16_DUR for 4.398e12 operations" | tee -a "$LOG/ncu.log"
    }
    ncu16 fp16 fp16
    dur16=$NCU16_DUR
    ncu16 i8f16 int8_fp16
    durif=$NCU16_DUR
    rc2=0
    # Every kernel of one predict+attention call (prediction breakdown), durations only.
    run_to "$LOG/ncu.log" "$(allow 120)" ncu --clock-control none --metrics gpu__time_duration.sum \
      "$BENCH" --n 32768 --d 128 --causal 0 --modes pred+attn --warmup 0 --min-iters 1 --max-iters 1 || rc2=$?
    st=ok
    ((rc1 != 0 || rc2 != 0)) && st=FAIL
    note ncu $st $(($(date +%s) - s)) "kernel rc=$rc1, breakdown rc=$rc2; int8_fp8 $dur; fp16 $dur16; int8_fp16 $durif"
  fi
fi

# ---------------------------------------------------------------- ncusrc
# Per-pipe utilization, warp stall reasons (PC sampling) and a per-SASS-instruction
# source view of the int8_fp8 attention kernel (N=16K D=128 dense), as CSV.
if want ncusrc; then
  banner ncusrc
  s=$(date +%s)
  if ((BUILT == 0)) || [ ! -x "$BENCH" ] || ! command -v ncu >/dev/null; then
    note ncusrc skip 0 "no build or no ncu"
  else
    KRE=${NCU_KERNEL_REGEX:-regex:MainloopInt8Fp8}
    rep="$BUILD/attn_profile"
    rm -f "$rep.ncu-rep"
    rc1=0
    # shellcheck disable=SC2086
    run_to "$LOG/ncusrc.log" "$(allow 200)" ncu --clock-control none --kernel-name-base demangled -k "$KRE" --launch-skip 1 -c 1 --set full \
      --import-source no -o "$rep" "$BENCH" ${NCUSRC_ARGS:---n 16384 --d 128 --causal 0 --modes dense} --warmup 1 \
      --min-iters 1 --max-iters 1 || rc1=$?
    if [ -f "$rep.ncu-rep" ]; then
      ncu -i "$rep.ncu-rep" --page details --print-details all >>"$LOG/ncusrc.log" 2>&1
      ncu -i "$rep.ncu-rep" --page raw --csv --metrics \
        "regex:^sm__inst_executed_pipe_.*pct_of_peak_sustained_active$,regex:^sm__pipe_.*cycles_active.avg.pct_of_peak_sustained_active$,regex:^smsp__pcsamp_warps_issue_stalled_[a-z_]+$" \
        >>"$LOG/ncusrc.log" 2>&1
      ncu -i "$rep.ncu-rep" --page source --csv --print-source sass >"$LOG/sass_source.csv" 2>&1
      python3 "$ROOT/tools/bench/sass_stalls.py" "$LOG/sass_source.csv" --top 25 >>"$LOG/ncusrc.log" 2>&1
    fi
    st=ok
    ((rc1 != 0)) && st=FAIL
    note ncusrc $st $(($(date +%s) - s)) "rc=$rc1"
  fi
fi

# ---------------------------------------------------------------- summary
{
  printf '\n==== summary (commit %s, %s s in all)\n\n' "$COMMIT" "$(elapsed)"
  echo "| stage     | status  | time    | note |"
  echo "|-----------|---------|---------|------|"
  for l in "${SUMMARY[@]}"; do echo "$l"; done
  if [ -f "$BUILD/gpu_accuracy.csv" ]; then
    echo
    echo "accuracy values outside their test bars (hard=1) or design targets (hard=0), from the GPU tests:"
    echo "test,case,metric,value,bar,higher_is_better,hard,pass"
    awk -F, 'NR > 1 && $NF == 0' "$BUILD/gpu_accuracy.csv" | head -n 30
  fi
  if [ -f "$LOG/bench.csv" ]; then
    echo
    echo "benchmark targets missed:"
    grep -c MISS "$LOG/bench.csv" || true
  fi
} 2>&1 | tee "$LOG/summary.txt"
echo "logs: $LOG"
# Non-zero when any stage failed.
for l in "${SUMMARY[@]}"; do [[ $l == *"| FAIL "* ]] && exit 1; done
exit 0
