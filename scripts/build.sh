#!/usr/bin/env bash
# Configures and builds libsparge and the sparge tool into ./build (BUILD_DIR to
# change it), and the tests when Catch2 is found (SPARGE_BUILD_TESTS=AUTO; pass
# -DSPARGE_BUILD_TESTS=ON or OFF to decide). Extra arguments go to the CMake
# configure step.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
sparge_step configure sparge_configure "$@"
sparge_step build cmake --build "$BUILD_DIR" -j "$JOBS"
