#!/usr/bin/env bash
# Sanitizer and fuzzing jobs (CPU-only builds, -DSPARGE_CUDA=OFF), run by CI
# after scripts/test.sh:
#   asan     AddressSanitizer + UndefinedBehaviorSanitizer (gcc): every CPU
#            Catch2 test and the fuzz driver's fixed cases
#   tsan     ThreadSanitizer (gcc): the concurrency test ([threads]: many
#            threads creating, sharing and destroying plans)
#   fault    fault injection (tests/fault: refused pthread_create, failing
#            operator new), unsanitized: a status, never an abort
#   libfuzz  libFuzzer (clang) with the library instrumented, ASan + UBSan,
#            FUZZ_SECONDS (default 90) on the checked-in corpus tests/fuzz/corpus
# Runs all jobs, then exits non-zero if any failed.
#   SANITIZE_BUILD=/tmp/sparge-san JOBS=N FUZZ_SECONDS=S scripts/sanitize.sh [job...]
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"

BASE="${SANITIZE_BUILD:-$ROOT/build-sanitize}"
FUZZ_SECONDS="${FUZZ_SECONDS:-90}"
jobs=("$@")
[ ${#jobs[@]} -eq 0 ] && jobs=(asan tsan fault libfuzz)

t_all=$(date +%s)

build() {  # dir, targets (space-separated), extra cmake args...
  local dir="$1" targets="$2"
  shift 2
  local gen=()
  command -v ninja >/dev/null 2>&1 && [ ! -f "$dir/CMakeCache.txt" ] && gen=(-G Ninja)
  cmake -S "$ROOT" -B "$dir" "${gen[@]}" -DSPARGE_CUDA=OFF -DSPARGE_BUILD_TESTS=ON -DSPARGE_BUILD_TOOLS=OFF "$@" \
    >"$dir.configure.log" 2>&1 || { cat "$dir.configure.log"; return 1; }
  local t
  for t in $targets; do cmake --build "$dir" -j "$JOBS" --target "$t" || return 1; done
}

# Stop at the first report; leak checks on (the library must free what it allocates).
export ASAN_OPTIONS="abort_on_error=1:halt_on_error=1:detect_leaks=1:strict_string_checks=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1"

for job in "${jobs[@]}"; do
  t0=$(date +%s)
  case "$job" in
    asan)
      section "ASan + UBSan: CPU tests and the fuzz driver"
      d="$BASE/asan"
      mkdir -p "$BASE"
      if build "$d" "sparge_tests sparge_fuzz_api" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSPARGE_SANITIZE=address,undefined; then
        ok=0
        "$d/tests/sparge_tests" || ok=1
        SPARGE_FUZZ_ITERS="${SANITIZE_FUZZ_ITERS:-20000}" "$d/tests/fuzz/sparge_fuzz_api" >"$BASE/asan-fuzz.log" 2>&1 ||
          ok=1
        tail -n 5 "$BASE/asan-fuzz.log"
        record asan "$ok" "($(($(date +%s) - t0)) s)"
      else
        record asan 1 "(build failed)"
      fi
      ;;
    tsan)
      section "ThreadSanitizer: the concurrency test"
      d="$BASE/tsan"
      mkdir -p "$BASE"
      if build "$d" sparge_tests -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSPARGE_SANITIZE=thread; then
        ok=0
        "$d/tests/sparge_tests" "[threads]" || ok=1
        record tsan "$ok" "($(($(date +%s) - t0)) s)"
      else
        record tsan 1 "(build failed)"
      fi
      ;;
    fault)
      section "fault injection: refused threads, failing allocations"
      # The main build's binary when scripts/test.sh has built it, else a plain build here.
      exe="$BUILD_DIR/tests/sparge_fault_tests"
      d="$BASE/fault"
      mkdir -p "$BASE"
      if [ -x "$exe" ] || { build "$d" sparge_fault_tests -DCMAKE_BUILD_TYPE=RelWithDebInfo && exe="$d/tests/sparge_fault_tests"; }; then
        ok=0
        "$exe" || ok=1
        record fault "$ok" "($(($(date +%s) - t0)) s)"
      else
        record fault 1 "(build failed)"
      fi
      ;;
    libfuzz)
      section "libFuzzer (library instrumented), ${FUZZ_SECONDS} s on tests/fuzz/corpus"
      if ! command -v clang++ >/dev/null 2>&1; then
        record libfuzz 2 "(clang++ not installed: scripts/deps.sh installs it)"
        continue
      fi
      d="$BASE/libfuzz"
      mkdir -p "$BASE"
      if build "$d" sparge_libfuzzer_api -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
           -DSPARGE_SANITIZE=address,undefined -DSPARGE_BUILD_LIBFUZZER=ON; then
        # The checked-in corpus is read only; new inputs go to a scratch folder.
        work="$BASE/libfuzz-corpus"
        rm -rf "$work" && mkdir -p "$work"
        ok=0
        (cd "$BASE" && "$d/tests/fuzz/sparge_libfuzzer_api" -max_total_time="$FUZZ_SECONDS" -max_len=512 \
            -timeout=20 -rss_limit_mb=4096 -print_final_stats=1 "$work" "$ROOT/tests/fuzz/corpus" \
            2>"$BASE/libfuzz.log") || ok=1
        grep -E "^#[0-9]+ +(INITED|DONE)|stat::number_of_executed_units|stat::peak_rss" "$BASE/libfuzz.log" | tail -n 5
        if [ $ok -ne 0 ]; then tail -n 60 "$BASE/libfuzz.log"; fi
        record libfuzz "$ok" "($(($(date +%s) - t0)) s)"
      else
        record libfuzz 1 "(build failed)"
      fi
      ;;
    *)
      record "$job" 1 "(unknown job)"
      ;;
  esac
done

section "sanitize summary ($(($(date +%s) - t_all)) s)"
printf '%s\n' "${results[@]}"
echo "sanitize jobs: $passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
