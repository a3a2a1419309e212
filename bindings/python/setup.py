"""Build hook: bundle libsparge.so into sparge/_lib.

Where the library comes from, in order:
  1. $SPARGE_LIBRARY (a file path);
  2. an existing build of this checkout: ../../build*/libsparge.so* (one with the
     CUDA backend preferred, then the newest);
  3. a fresh CMake build of the checkout (unless SPARGE_PYTHON_NO_CMAKE=1);
otherwise the package installs without a bundled copy and its loader falls back
to the system library search at import time.
"""

import ctypes
import glob
import os
import shutil
import subprocess
import sys
import tempfile

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SONAME = "libsparge.so.0.1"


def _log(msg):
    print("sparge setup: " + msg, file=sys.stderr)


def _has_cuda(path):
    try:
        return bool(ctypes.CDLL(path).sparge_has_cuda())
    except (OSError, AttributeError):
        return None


def _existing_build():
    cands = [os.path.realpath(p) for p in glob.glob(os.path.join(REPO, "build*", "libsparge.so*"))]
    cands = sorted({p for p in cands if os.path.isfile(p)})
    loadable = [(bool(_has_cuda(p)), os.path.getmtime(p), p) for p in cands if _has_cuda(p) is not None]
    return max(loadable)[2] if loadable else None


def _cmake_build():
    if os.environ.get("SPARGE_PYTHON_NO_CMAKE") == "1":
        return None
    if not os.path.isfile(os.path.join(REPO, "CMakeLists.txt")) or shutil.which("cmake") is None:
        return None
    out = os.path.join(tempfile.mkdtemp(prefix="sparge-build-"))
    cfg = ["cmake", "-S", REPO, "-B", out, "-DCMAKE_BUILD_TYPE=Release",
           "-DSPARGE_BUILD_TESTS=OFF", "-DSPARGE_BUILD_TOOLS=OFF"]
    if shutil.which("ninja"):
        cfg += ["-G", "Ninja"]
    if os.environ.get("SPARGE_CUDA"):
        cfg.append("-DSPARGE_CUDA=" + os.environ["SPARGE_CUDA"])
    try:
        _log("building libsparge with CMake in " + out)
        subprocess.run(cfg, check=True)
        subprocess.run(["cmake", "--build", out, "-j", str(os.cpu_count() or 2)], check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        _log("CMake build failed (%s); the package will use the system library" % e)
        return None
    libs = [p for p in glob.glob(os.path.join(out, "libsparge.so*")) if os.path.isfile(p)]
    return os.path.realpath(libs[0]) if libs else None


def find_library():
    env = os.environ.get("SPARGE_LIBRARY")
    if env:
        if not os.path.isfile(env):
            raise SystemExit("SPARGE_LIBRARY=%s is not a file" % env)
        return os.path.realpath(env)
    return _existing_build() or _cmake_build()


class BuildPyWithLibrary(build_py):
    def run(self):
        super().run()
        dest = os.path.join(self.build_lib, "sparge", "_lib")
        lib = find_library()
        if lib is None:
            _log("no libsparge found or built; installing without a bundled library")
            return
        os.makedirs(dest, exist_ok=True)
        for old in glob.glob(os.path.join(dest, "libsparge.so*")):
            os.remove(old)
        shutil.copy2(lib, os.path.join(dest, SONAME))
        _log("bundled %s as sparge/_lib/%s" % (lib, SONAME))


class BinaryDistribution(Distribution):
    """The wheel carries a shared library: platform-specific."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildPyWithLibrary}, distclass=BinaryDistribution)
