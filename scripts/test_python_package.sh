#!/usr/bin/env bash
# The Python user's path, as on a fresh machine: in fresh virtual environments,
#   1. pip install ./bindings/python (scikit-build-core builds the library with CMake) + tests/python;
#   2. pip install -e ./bindings/python (editable) + a smoke test;
#   3. the wheel (pip wheel) installed into another fresh venv + tests/python;
#   4. a missing compiler must fail the build with CMake's error, not install without a library.
# The three builds share one CMake build folder, so only the first compiles. PyPI must be reachable
# (scikit-build-core, numpy, pytest). The CUDA backend is left out (SPARGE_CUDA=OFF) unless set.
#   WORK=/tmp/sparge-pkg SPARGE_CUDA=OFF scripts/test_python_package.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY=${PYTHON:-python3}
WORK=${WORK:-$(mktemp -d /tmp/sparge-pkg.XXXXXX)}
export SPARGE_CUDA=${SPARGE_CUDA:-OFF}
export CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-2}
BUILD="$WORK/cmake-build"
CFG=(-C "build-dir=$BUILD")
mkdir -p "$WORK"
step() { printf '\n---- %s\n' "$*"; }
fresh_venv() {  # dir
  rm -rf "$1"
  "$PY" -m venv "$1"
  "$1/bin/python" -m pip install -q --disable-pip-version-check numpy pytest
}
run_tests() {  # venv, extra pytest args...
  local venv=$1; shift
  (cd "$WORK" && env -u SPARGE_LIBRARY -u PYTHONPATH SPARGE_TEST_INSTALLED=1 \
     "$venv/bin/python" -m pytest "$ROOT/tests/python" -q -p no:cacheprovider "$@")
}
check_import() {  # venv: the package's own library copy, the generated version
  (cd "$WORK" && env -u SPARGE_LIBRARY -u PYTHONPATH "$1/bin/python" - <<'PYEOF'
import os, sparge, numpy as np
path = sparge.library_path()
print("sparge", sparge.__version__, "from", os.path.dirname(sparge.__file__), "library", path)
assert os.path.isfile(path) and os.sep + "_lib" + os.sep in path, path
assert sparge.library_version()[:2] == sparge._capi.PACKAGE_VERSION[:2]
rng = np.random.default_rng(1)
q, k, v = (rng.standard_normal((1, 2, 130, 16)).astype(np.float32) for _ in range(3))
out = sparge.sdpa(q, k, v, is_causal=True, topk=1.0, precision="exact")
assert out.shape == q.shape and np.isfinite(out).all()
PYEOF
  )
}

t0=$(date +%s)
step "1. fresh venv: pip install ./bindings/python (SPARGE_CUDA=$SPARGE_CUDA, build folder $BUILD)"
fresh_venv "$WORK/venv-install"
"$WORK/venv-install/bin/python" -m pip install --disable-pip-version-check -v "${CFG[@]}" "$ROOT/bindings/python" \
  2>&1 | grep -E '^\s*(\*\*\*|-- libsparge|-- Install|\[[0-9]+/[0-9]+\]|Successfully|ERROR|CMake Error)' | cut -c1-160
check_import "$WORK/venv-install"
run_tests "$WORK/venv-install"

step "2. fresh venv: pip install -e ./bindings/python (editable)"
fresh_venv "$WORK/venv-editable"
"$WORK/venv-editable/bin/python" -m pip install -q --disable-pip-version-check "${CFG[@]}" -e "$ROOT/bindings/python"
check_import "$WORK/venv-editable"
(cd "$WORK" && env -u SPARGE_LIBRARY -u PYTHONPATH "$WORK/venv-editable/bin/python" -c '
import os, sparge, sys
src = os.path.realpath(os.path.dirname(sparge.__file__))
want = os.path.realpath(os.path.join(sys.argv[1], "bindings", "python", "sparge"))
assert src == want, (src, want)
print("editable: Python files from", src)' "$ROOT")
run_tests "$WORK/venv-editable"

step "3. pip wheel, installed into another fresh venv"
rm -rf "$WORK/dist"
"$WORK/venv-install/bin/python" -m pip wheel -q --disable-pip-version-check --no-deps "${CFG[@]}" \
  -w "$WORK/dist" "$ROOT/bindings/python"
whl=$(ls "$WORK"/dist/sparge-*.whl)
echo "wheel: $(basename "$whl") ($(du -k "$whl" | cut -f1) KiB)"
case "$(basename "$whl")" in
  *-py3-none-*) ;;
  *) echo "wheel is not tagged py3-none-<platform>" >&2; exit 1 ;;
esac
"$PY" -m zipfile -l "$whl" | awk 'NR>1 {print "  " $1}'
fresh_venv "$WORK/venv-wheel"
"$WORK/venv-wheel/bin/python" -m pip install -q --disable-pip-version-check "$whl"
check_import "$WORK/venv-wheel"
run_tests "$WORK/venv-wheel"

step "4. a missing C++ compiler is a build error"
log="$WORK/no-compiler.log"
if "$WORK/venv-install/bin/python" -m pip wheel --disable-pip-version-check --no-deps \
     -C "build-dir=$WORK/cmake-nocxx" -C cmake.define.CMAKE_CXX_COMPILER=/nonexistent/c++ \
     -w "$WORK/dist-nocxx" "$ROOT/bindings/python" >"$log" 2>&1; then
  echo "a build without a C++ compiler succeeded" >&2; exit 1
fi
grep -m1 -A3 "CMake Error" "$log"
echo "python package: all steps passed in $(($(date +%s) - t0)) s"
