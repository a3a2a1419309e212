#!/usr/bin/env bash
# Configures and builds libsparge, its tests and the sparge tool into ./build
# (BUILD_DIR to change it). Extra arguments go to the CMake configure step.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
sparge_configure "$@"
cmake --build "$BUILD_DIR" -j "$JOBS"
