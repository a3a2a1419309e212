"""pytest setup: finds the sparge package (bindings/python) and libsparge.

The library comes from $SPARGE_LIBRARY when set, else the newest
build*/libsparge.so* of this checkout, else the package's own copy or the
system (the loader's normal search).

SPARGE_TEST_INSTALLED=1 tests the installed package instead (pip install,
editable or wheel): the checkout is not put on sys.path and the library is the
package's own copy.
"""

import glob
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = os.path.join(ROOT, "bindings", "python")
HERE = os.path.dirname(os.path.abspath(__file__))

INSTALLED = os.environ.get("SPARGE_TEST_INSTALLED") == "1"

if PKG not in sys.path and not INSTALLED:
    sys.path.insert(0, PKG)
if HERE not in sys.path:
    sys.path.insert(0, HERE)


def _find_built_library():
    cands = [p for p in glob.glob(os.path.join(ROOT, "build*", "libsparge.so*")) if os.path.isfile(p)]
    if not cands:
        return None
    return max(cands, key=os.path.getmtime)


if not os.environ.get("SPARGE_LIBRARY") and not INSTALLED:
    _lib = _find_built_library()
    if _lib:
        os.environ["SPARGE_LIBRARY"] = _lib


@pytest.fixture
def rng(request):
    """A generator with a fresh seed; the seed is printed (shown on failure) to reproduce."""
    seed = int(np.random.SeedSequence().entropy % (2**63))
    env = os.environ.get("SPARGE_TEST_SEED")
    if env:
        seed = int(env)
    print("SPARGE_TEST_SEED=%d" % seed)
    request.node.user_properties.append(("seed", seed))
    return np.random.default_rng(seed)


def pytest_report_header(config):
    lib = os.environ.get("SPARGE_LIBRARY", "(loader search)")
    if INSTALLED:
        import sparge

        return "sparge %s installed at %s; libsparge: %s" % (
            sparge.__version__, os.path.dirname(sparge.__file__), sparge.library_path())
    return "libsparge: %s" % lib
