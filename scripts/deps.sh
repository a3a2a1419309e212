#!/usr/bin/env bash
# Checks what building and testing libsparge needs, and installs what is missing.
#
#   scripts/deps.sh [build|test] [--check]
#
# build  the library and the sparge tool (scripts/run.sh): CMake >= 3.22, a C
#        compiler, a C++17 compiler, Ninja or make.
# test   (default) build, plus what scripts/test.sh (and scripts/sanitize.sh) needs: Catch2 v2 or v3 as CMake
#        finds it (the question the test configure asks, through cmake/catch2-probe:
#        an installed package that CMake does not accept counts as missing) and nm
#        (binutils, for the export check). Optional: numpy + pytest for the Python
#        tests, cargo for the Rust tests (their suites are SKIPPED without them).
#
# Nothing is downloaded when everything is present. Otherwise, without --check
# (or SPARGE_NO_INSTALL=1), the missing packages are installed with apt-get
# (Debian/Ubuntu, as root or through sudo) and pip. Exits 1 when something
# required is still missing, after naming it with the Debian/Ubuntu and conda
# commands that install it. The CUDA toolkit is not installed here: the CUDA
# backend is built when nvcc is found (/usr/local/cuda/bin is added to PATH).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

MODE=test
CHECK_ONLY=${SPARGE_NO_INSTALL:-0}
for a in "$@"; do
  case "$a" in
    build | test) MODE=$a ;;
    --check) CHECK_ONLY=1 ;;
    -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "deps: unknown argument '$a' (usage: scripts/deps.sh [build|test] [--check])" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
CMAKE_MIN=3.22

# ---------------------------------------------------------------- checks
# Each check appends to: req (what is missing and required), opt (missing, optional),
# apt_pkgs / conda_pkgs (what installs it), ok (what is present).
version_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n 1)" = "$2" ]; }
first_cmd() { for c in "$@"; do [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && { echo "$c"; return 0; }; done; return 1; }

need() {  # need required|optional "what" apt-pkg conda-pkg ["another way to install it"]
  if [ "$1" = required ]; then req+=("$2"); else
    opt+=("$2 (Debian/Ubuntu: apt-get install -y $3; conda: conda install -c conda-forge $4${5:+; $5})")
  fi
  [ -n "$3" ] && apt_pkgs+=("$3")
  [ -n "$4" ] && conda_pkgs+=("$4")
  [ "$1" = required ] && { [ -n "$3" ] && apt_req+=("$3"); [ -n "$4" ] && conda_req+=("$4"); }
  return 0
}

CATCH2_LINE=""
probe_catch2() {  # sets CATCH2_LINE: "found MAJOR VERSION WHERE" or "missing WHY"
  local tmp out
  tmp=$(mktemp -d "${TMPDIR:-/tmp}/sparge-catch2-probe.XXXXXX") || return 1
  out=$(cmake -S "$ROOT/cmake/catch2-probe" -B "$tmp" 2>&1)
  rm -rf "$tmp"
  CATCH2_LINE=$(printf '%s\n' "$out" | sed -n 's/^-- sparge-catch2: //p' | tail -n 1)
  [ -n "$CATCH2_LINE" ] || CATCH2_LINE="missing the CMake probe failed: $(printf '%s' "$out" | tail -n 3 | tr '\n' ' ')"
}

check_all() {
  req=() opt=() apt_pkgs=() conda_pkgs=() apt_req=() conda_req=() ok=() pip_pkgs=()
  local v c
  # CMake
  if command -v cmake >/dev/null 2>&1; then
    v=$(cmake --version | sed -n '1s/^cmake version \([0-9.]*\).*/\1/p')
    if version_ge "$v" "$CMAKE_MIN"; then ok+=("cmake $v"); else
      need required "CMake >= $CMAKE_MIN (found $v; also: python3 -m pip install cmake)" cmake cmake
    fi
  else
    need required "CMake >= $CMAKE_MIN" cmake cmake
  fi
  # Compilers: what CMake would pick (CC/CXX, else cc/c++ and the usual names).
  c=$(first_cmd "${CC:-}" cc gcc clang) && ok+=("C compiler $c") || need required "a C compiler" gcc c-compiler
  if c=$(first_cmd "${CXX:-}" c++ g++ clang++); then
    if printf 'template <class T> auto f(T t) { if constexpr (sizeof(T) > 1) return t; else return 0; }\nint main() { return f(0); }\n' |
      "$c" -std=c++17 -x c++ - -o /dev/null >/dev/null 2>&1; then
      ok+=("C++17 compiler $c")
    else
      need required "a C++17 compiler ($c does not compile C++17)" g++ cxx-compiler
    fi
  else
    need required "a C++17 compiler" g++ cxx-compiler
  fi
  if command -v ninja >/dev/null 2>&1; then ok+=("ninja $(ninja --version)")
  elif command -v make >/dev/null 2>&1; then ok+=("make (ninja not found: builds use make)"); need optional "ninja: faster builds (make is used without it)" ninja-build ninja
  else need required "a build tool: ninja or make" ninja-build ninja; fi
  [ "$MODE" = test ] || return 0

  # Catch2, as CMake sees it.
  if command -v cmake >/dev/null 2>&1; then
    probe_catch2
    case "$CATCH2_LINE" in
      found*) set -- $CATCH2_LINE; ok+=("Catch2 $3 (v$2; ${*:4})") ;;
      *)
        v=""
        if command -v dpkg-query >/dev/null 2>&1; then
          v=$(dpkg-query -W -f='${Status} ${Version}' catch2 2>/dev/null | sed -n 's/^install ok installed /; the catch2 package is installed: /p')
        fi
        need required "Catch2 v2 or v3 for the tests (CMake: ${CATCH2_LINE#missing }$v)" catch2 catch2 ;;
    esac
  else
    need required "Catch2 v2 or v3 for the tests (not checked: no CMake)" catch2 catch2
  fi
  command -v nm >/dev/null 2>&1 && ok+=("nm") || need required "nm (binutils), for the exported-symbols test" binutils binutils
  # Optional suites.
  if command -v "$PY" >/dev/null 2>&1; then
    local mods=()
    "$PY" -c 'import numpy' >/dev/null 2>&1 || mods+=(numpy)
    "$PY" -c 'import pytest' >/dev/null 2>&1 || mods+=(pytest)
    if [ ${#mods[@]} -eq 0 ]; then ok+=("numpy + pytest for $("$PY" -c 'import sys; print(sys.executable)')")
    else
      for m in "${mods[@]}"; do
        need optional "$m for $PY: the Python tests are SKIPPED without it" "python3-$m" "$m" "pip: $PY -m pip install $m"
        pip_pkgs+=("$m")
      done
    fi
    # Fresh virtual environments for the package tests (scripts/test_python_package.sh).
    if "$PY" -c 'import venv, ensurepip' >/dev/null 2>&1; then ok+=("venv + ensurepip for $PY")
    else need optional "venv for $PY: the Python package install tests are SKIPPED without it" python3-venv python; fi
  else
    need optional "$PY: the Python tests are SKIPPED without it" "python3 python3-numpy python3-pytest" "python numpy pytest"
  fi
  # clang with libFuzzer and the sanitizer runtimes for scripts/sanitize.sh (the
  # runtimes are a Recommends of clang, not installed with --no-install-recommends).
  if command -v clang++ >/dev/null 2>&1 &&
     ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1; then ok+=("clang + libFuzzer")
  else need optional "clang with libFuzzer: scripts/sanitize.sh's libFuzzer job is SKIPPED without it" \
    "clang libclang-rt-dev" "clangxx compiler-rt"; fi
  if command -v cargo >/dev/null 2>&1; then ok+=("cargo"); else
    opt+=("cargo: the Rust tests are SKIPPED without it (Debian/Ubuntu: apt-get install -y cargo; conda: conda install -c conda-forge rust; or rustup)")
  fi
  return 0
}

report() {
  local c=""
  command -v nvcc >/dev/null 2>&1 && c="nvcc $(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'): CUDA backend"
  if [ ${#ok[@]} -gt 0 ]; then echo "deps ($MODE): present: $(IFS=,; echo "${ok[*]}" | sed 's/,/, /g')"; fi
  echo "deps ($MODE): ${c:-no nvcc on PATH: a CPU-only build (CUDA backend: install the CUDA toolkit >= 12.4, developed with 13.0)}"
  local m
  for m in "${opt[@]}"; do echo "deps ($MODE): optional, missing: $m"; done
}

install_missing() {
  local SUDO=""
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
      echo "deps: not root and no sudo: not installing" >&2; return 1
    fi
  fi
  local rc=0
  if [ ${#apt_pkgs[@]} -gt 0 ]; then
    if ! command -v apt-get >/dev/null 2>&1; then
      echo "deps: no apt-get on this machine: not installing" >&2; rc=1
    else
      # shellcheck disable=SC2207
      local pkgs=($(printf '%s\n' "${apt_pkgs[@]}" | tr ' ' '\n' | sort -u))
      echo "deps: installing with apt-get: ${pkgs[*]}"
      export DEBIAN_FRONTEND=noninteractive
      if ! { $SUDO apt-get update -q && $SUDO apt-get install -y -q --no-install-recommends "${pkgs[@]}"; }; then
        echo "deps: apt-get could not install ${pkgs[*]} (no network or no such package?)" >&2
        rc=1
      fi
    fi
  fi
  return $rc
}

install_python() {  # numpy/pytest for $PY where apt did not bring them (pip, e.g. in a venv)
  [ ${#pip_pkgs[@]} -gt 0 ] || return 0
  command -v "$PY" >/dev/null 2>&1 || return 0
  local left=()
  for m in "${pip_pkgs[@]}"; do "$PY" -c "import $m" >/dev/null 2>&1 || left+=("$m"); done
  [ ${#left[@]} -gt 0 ] || return 0
  echo "deps: installing with pip for $PY: ${left[*]}"
  "$PY" -m pip install -q --retries 1 --timeout 15 "${left[@]}" 2>/dev/null ||
    "$PY" -m pip install -q --retries 1 --timeout 15 --break-system-packages "${left[@]}" 2>/dev/null ||
    echo "deps: pip could not install ${left[*]}" >&2
}

check_all
if [ ${#req[@]} -gt 0 ] || [ ${#opt[@]} -gt 0 ] && [ ${#apt_pkgs[@]} -gt 0 ] && [ "$CHECK_ONLY" != 1 ]; then
  # Only now is the network used: something is missing.
  install_missing || true
  install_python
  check_all
fi
report
if [ ${#req[@]} -gt 0 ]; then
  echo "deps ($MODE): MISSING, required:" >&2
  for m in "${req[@]}"; do echo "  - $m" >&2; done
  # shellcheck disable=SC2207
  a=($(printf '%s\n' "${apt_req[@]}" | tr ' ' '\n' | sort -u))
  # shellcheck disable=SC2207
  c=($(printf '%s\n' "${conda_req[@]}" | tr ' ' '\n' | sort -u))
  echo "deps ($MODE): install with one of" >&2
  echo "  Debian/Ubuntu:  sudo apt-get install -y ${a[*]}" >&2
  echo "  conda:          conda install -c conda-forge ${c[*]}" >&2
  case " ${a[*]} " in *" catch2 "*)
    echo "  (Catch2 elsewhere: CMAKE_PREFIX_PATH=<its prefix>; a v2 single header:" \
      "SPARGE_CATCH2_INCLUDE_DIR=<directory holding catch2/catch.hpp>)" >&2 ;;
  esac
  exit 1
fi
exit 0
