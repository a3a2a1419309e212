#!/usr/bin/env bash
# The main job in one command: installs missing build dependencies, builds the
# library and the sparge tool, and runs it. The tool picks the GPU when the
# library has the CUDA backend and a device is present, else a small CPU
# workload. Arguments go to the tool (see ./build/tools/sparge --help), e.g.
#   scripts/run.sh -L 32768 --causal
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
if [ "${SPARGE_SKIP_DEPS:-0}" != "1" ]; then bash "$ROOT/scripts/deps.sh"; fi
sparge_configure >/dev/null
cmake --build "$BUILD_DIR" -j "$JOBS" --target sparge_cli
exec "$BUILD_DIR/tools/sparge" "$@"
