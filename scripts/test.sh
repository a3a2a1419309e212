#!/usr/bin/env bash
# Builds everything and runs every test suite: CTest (Catch2 CPU tests, the C99
# header check, the export check, the sparge tool smoke test, and the GPU tests,
# which report SKIPPED without a GPU), pytest (tests/python, with SPARGE_LIBRARY
# pointing at the built library) and cargo test (bindings/rust, when cargo is
# installed), and the Python package's install paths in fresh virtual environments
# (scripts/test_python_package.sh: needs PyPI; SPARGE_SKIP_PACKAGE=1 skips it).
# First checks the dependencies (scripts/deps.sh test: Catch2 v2 or v3 as CMake
# finds it, ...; installs what is missing where it can, and says what is missing
# and how to install it where it cannot). Runs all suites, then exits non-zero
# if any failed; a failed dependency, configure or build step stops it.
#   BUILD_DIR=build SPARGE_CUDA=AUTO|ON|OFF JOBS=N scripts/test.sh
#   SPARGE_SKIP_DEPS=1 skips the dependency step; SPARGE_NO_INSTALL=1 checks only.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"

t_start=$(date +%s)

stop() {  # a step that the suites need failed
  echo "test.sh: step '$1' failed; no suite was run" >&2
  echo "suites: 0 passed, 1 failed"
  exit 1
}

if [ "${SPARGE_SKIP_DEPS:-0}" != "1" ]; then
  section "dependencies"
  bash "$ROOT/scripts/deps.sh" test || stop dependencies
fi

section "configure + build ($BUILD_DIR, $BUILD_TYPE, SPARGE_CUDA=$SPARGE_CUDA, -j$JOBS)"
command -v nvcc >/dev/null 2>&1 && echo "nvcc: $(command -v nvcc) ($(nvcc --version | tail -n 2 | head -n 1))"
sparge_configure -DSPARGE_BUILD_TESTS=ON || stop configure
cmake --build "$BUILD_DIR" -j "$JOBS" || stop build
echo "build: $(($(date +%s) - t_start)) s"
LIB="$BUILD_DIR/libsparge.so"

section "ctest"
if ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$JOBS"; then
  record ctest 0 ""
else
  record ctest 1 ""
fi
if ctest --test-dir "$BUILD_DIR" -N 2>/dev/null | grep -q 'gpu_tests'; then
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "note: no GPU on this machine: gpu_tests is reported as SKIPPED above (exit code 77), not run"
  fi
else
  echo "note: built without the CUDA backend: no GPU tests"
fi

section "pytest (tests/python)"
if [ ! -d tests/python ]; then
  record pytest 2 "(no tests/python directory)"
elif ! python3 -c 'import numpy, pytest' >/dev/null 2>&1; then
  record pytest 2 "(numpy/pytest not installed: run scripts/deps.sh)"
else
  SPARGE_LIBRARY="$LIB" PYTHONPATH="$ROOT/bindings/python${PYTHONPATH:+:$PYTHONPATH}" \
    python3 -m pytest tests/python -q
  rc=$?
  if [ $rc -eq 0 ]; then record pytest 0 ""
  elif [ $rc -eq 5 ]; then record pytest 2 "(no tests collected)"
  else record pytest 1 "(exit $rc)"; fi
fi

section "python package (fresh venvs: pip install, editable install, wheel)"
if [ "${SPARGE_SKIP_PACKAGE:-0}" = "1" ]; then
  record python-package 2 "(SPARGE_SKIP_PACKAGE=1)"
elif ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
  record python-package 2 "(python3 has no venv/ensurepip: install python3-venv)"
else
  if JOBS="$JOBS" bash scripts/test_python_package.sh; then
    record python-package 0 ""
  else
    record python-package 1 ""
  fi
fi

section "cargo test (bindings/rust)"
if [ ! -f bindings/rust/Cargo.toml ]; then
  record cargo 2 "(no bindings/rust/Cargo.toml)"
elif ! command -v cargo >/dev/null 2>&1; then
  record cargo 2 "(cargo not installed)"
else
  if (cd bindings/rust && SPARGE_LIB_DIR="$BUILD_DIR" LD_LIBRARY_PATH="$BUILD_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        cargo test --offline -j "$JOBS"); then
    record cargo 0 ""
  else
    record cargo 1 ""
  fi
fi

section "summary ($(($(date +%s) - t_start)) s)"
printf '%s\n' "${results[@]}"
echo "suites: $passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
