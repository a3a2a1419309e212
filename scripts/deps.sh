#!/usr/bin/env bash
# Installs what building and testing libsparge needs, only where it is missing:
# cmake, ninja, g++, Catch2 v2 (Debian: catch2), binutils (nm, for the export
# check), clang with its sanitizer/libFuzzer runtimes (scripts/sanitize.sh),
# and numpy + pytest for the Python tests. Debian/Ubuntu; run as root
# (or with sudo available). The CUDA toolkit is not installed here: the CUDA
# backend is built when nvcc is found (/usr/local/cuda/bin is added to PATH).
set -euo pipefail

SUDO=""
if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi

missing=()
have_pkg() { dpkg -s "$1" >/dev/null 2>&1; }
command -v cmake >/dev/null 2>&1 || missing+=(cmake)
command -v ninja >/dev/null 2>&1 || missing+=(ninja-build)
command -v g++ >/dev/null 2>&1 || missing+=(g++)
command -v nm >/dev/null 2>&1 || missing+=(binutils)
command -v git >/dev/null 2>&1 || missing+=(git)
command -v clang++ >/dev/null 2>&1 || missing+=(clang)
if command -v dpkg >/dev/null 2>&1; then
  have_pkg catch2 || [ -f /usr/include/catch2/catch.hpp ] || missing+=(catch2)
  # libFuzzer and the sanitizer runtimes (a Recommends of clang, not installed with --no-install-recommends)
  have_pkg libclang-rt-dev || ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1 ||
    missing+=(libclang-rt-dev)
fi

if [ ${#missing[@]} -gt 0 ]; then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "deps: missing ${missing[*]} and no apt-get here: install them by hand" >&2
    exit 1
  fi
  echo "deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  echo "deps: cmake, ninja, g++, binutils, catch2, clang present"
fi

# Python test dependencies, for the python3 on PATH.
PY=${PYTHON:-python3}
if command -v "$PY" >/dev/null 2>&1; then
  if "$PY" -c 'import numpy, pytest' >/dev/null 2>&1; then
    echo "deps: numpy and pytest present for $("$PY" -c 'import sys; print(sys.executable)')"
  else
    echo "deps: installing numpy and pytest for $PY"
    "$PY" -m pip install -q numpy pytest 2>/dev/null ||
      "$PY" -m pip install -q --break-system-packages numpy pytest 2>/dev/null ||
      { export DEBIAN_FRONTEND=noninteractive; $SUDO apt-get update -q &&
        $SUDO apt-get install -y -q --no-install-recommends python3-numpy python3-pytest; } ||
      echo "deps: could not install numpy/pytest; the Python tests will be skipped" >&2
  fi
else
  echo "deps: no $PY; the Python tests will be skipped" >&2
fi
