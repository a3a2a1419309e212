# Sourced by the scripts: common settings. Not meant to be run on its own.
# BUILD_DIR  build folder (default: build)
# SPARGE_CUDA AUTO|ON|OFF (default AUTO: the CUDA backend when nvcc is found)
# JOBS       parallel build jobs (default: 2 under CI, else the number of cores)
# BUILD_TYPE CMake build type (default Release)
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$ROOT/build}"
case "$BUILD_DIR" in /*) ;; *) BUILD_DIR="$ROOT/$BUILD_DIR" ;; esac
SPARGE_CUDA="${SPARGE_CUDA:-AUTO}"
BUILD_TYPE="${BUILD_TYPE:-Release}"
if [ -z "${JOBS:-}" ]; then
  if [ "${CI:-}" = "true" ]; then JOBS=2; else JOBS="$(nproc 2>/dev/null || echo 2)"; fi
fi
if [ -d /usr/local/cuda/bin ]; then
  case ":$PATH:" in *:/usr/local/cuda/bin:*) ;; *) export PATH="$PATH:/usr/local/cuda/bin" ;; esac
fi
if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
  export PATH="$PATH:$HOME/.cargo/bin"
fi

# sparge_step NAME CMD...: runs CMD; when it fails, says which step of which
# script failed and exits with its status.
SPARGE_SCRIPT="$(basename "$0")"
sparge_step() {
  local name=$1 rc=0
  shift
  "$@" || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "$SPARGE_SCRIPT: step '$name' failed (exit $rc)" >&2
    exit "$rc"
  fi
}

# The suite scripts' tally (test.sh, sanitize.sh): record NAME STATUS NOTE with
# STATUS 0 ok, 1 failed, 2 skipped; the summary prints ${results[@]}.
passed=0 failed=0 skipped=0
results=()
record() {
  case "$2" in
    0) passed=$((passed + 1)); results+=("  PASS  $1 $3") ;;
    1) failed=$((failed + 1)); results+=("  FAIL  $1 $3") ;;
    *) skipped=$((skipped + 1)); results+=("  SKIP  $1 $3") ;;
  esac
}
section() { printf '\n==== %s\n' "$*"; }

# GPU architectures of the scripts' builds (CMake's own default is every
# supported one, see docs/BUILDING.md): SPARGE_CUDA_ARCHS if set, else this
# machine's GPU (9.0 -> 90a), else 90a; PTX compute_80 for the rest.
sparge_cuda_archs() {
  if [ -n "${SPARGE_CUDA_ARCHS+x}" ]; then echo "$SPARGE_CUDA_ARCHS"; return; fi
  local cc
  cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' .')
  case "$cc" in
    90) echo "90a" ;;
    [0-9][0-9] | [0-9][0-9][0-9]) echo "$cc" ;;
    *) echo "90a" ;;
  esac
}

sparge_configure() {
  local gen=()
  if command -v ninja >/dev/null 2>&1; then gen=(-G Ninja); fi
  if [ -f "$BUILD_DIR/CMakeCache.txt" ]; then gen=(); fi  # keep the existing generator
  cmake -S "$ROOT" -B "$BUILD_DIR" "${gen[@]}" -DCMAKE_BUILD_TYPE="$BUILD_TYPE" -DSPARGE_CUDA="$SPARGE_CUDA" \
    -DSPARGE_CUDA_ARCHS="$(sparge_cuda_archs)" -DSPARGE_CUDA_PTX="${SPARGE_CUDA_PTX-80}" "$@"
}
