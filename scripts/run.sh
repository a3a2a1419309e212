#!/usr/bin/env bash
# The main job in one command: checks the build dependencies (installing what is
# missing, where it can), builds the library and the sparge tool, and runs it. No
# test framework is needed. The tool picks the GPU when the library has the CUDA
# backend and a device is present, else a small CPU workload. Arguments go to the
# tool (see ./build/tools/sparge --help), e.g.
#   scripts/run.sh -L 32768 --causal
# SPARGE_SKIP_DEPS=1 skips the dependency step; SPARGE_NO_INSTALL=1 checks only.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
if [ "${SPARGE_SKIP_DEPS:-0}" != "1" ]; then sparge_step dependencies bash "$ROOT/scripts/deps.sh" build; fi
# The tests are configured when Catch2 is there (AUTO), but not built here.
cfg_log=$(mktemp "${TMPDIR:-/tmp}/sparge-configure.XXXXXX")
if ! sparge_configure -DSPARGE_BUILD_TESTS=AUTO >"$cfg_log" 2>&1; then
  cat "$cfg_log" >&2
  rm -f "$cfg_log"
  echo "run.sh: step 'configure' failed (cmake -S $ROOT -B $BUILD_DIR)" >&2
  exit 1
fi
grep -E '^-- libsparge:' "$cfg_log" || true
rm -f "$cfg_log"
sparge_step build cmake --build "$BUILD_DIR" -j "$JOBS" --target sparge_cli
sparge_step run "$BUILD_DIR/tools/sparge" "$@"
