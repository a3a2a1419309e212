"""Raw ctypes binding of ``include/sparge/sparge.h``.

Everything in this module mirrors the C header one-to-one: the enums, the three
structs that cross the ABI, the prototypes, the library loader and the status
check. Nothing here knows about numpy or torch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import re
import sys
import threading
from typing import List, Optional, Tuple

__all__ = [
    "SpargeError",
    "InvalidArgumentError",
    "UnsupportedError",
    "WorkspaceTooSmallError",
    "NoDeviceError",
    "CudaError",
    "OutOfMemoryError",
    "InternalError",
    "LibraryNotFoundError",
    "VersionMismatchError",
    "SpargeTensor",
    "SpargeProblem",
    "SpargePredictParams",
    "lib",
    "check",
    "library_path",
    "PACKAGE_VERSION",
]

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))


def _package_version() -> Tuple[int, int, int]:
    """The version CMake generated into the installed package (sparge/_version.py), or, in a
    source checkout used through PYTHONPATH, the one project(sparge VERSION ...) states."""
    try:
        from ._version import VERSION  # type: ignore[import-not-found]

        return tuple(VERSION)  # type: ignore[return-value]
    except ImportError:
        pass
    cmake = os.path.join(_PKG_DIR, os.pardir, os.pardir, os.pardir, "CMakeLists.txt")
    try:
        with open(cmake, encoding="utf-8") as f:
            m = re.search(r"project\(sparge VERSION ([0-9]+)\.([0-9]+)\.([0-9]+)", f.read())
    except OSError:
        m = None
    if m is None:
        raise ImportError("sparge: no generated sparge/_version.py and no CMakeLists.txt at %s; "
                          "install the package with pip (it builds the library)" % os.path.normpath(cmake))
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


#: The package version (generated from CMake). The loaded library must have the same major.minor.
PACKAGE_VERSION = _package_version()

# ------------------------------------------------------------------ enums
SPARGE_OK = 0
SPARGE_ERR_INVALID_ARGUMENT = 1
SPARGE_ERR_UNSUPPORTED = 2
SPARGE_ERR_WORKSPACE_TOO_SMALL = 3
SPARGE_ERR_NO_DEVICE = 4
SPARGE_ERR_CUDA = 5
SPARGE_ERR_OUT_OF_MEMORY = 6
SPARGE_ERR_INTERNAL = 7

DTYPE_FLOAT16 = 0
DTYPE_BFLOAT16 = 1
DTYPE_FLOAT32 = 2
DTYPE_UINT8 = 3
DTYPE_INT32 = 4

DEVICE_CPU = 0
DEVICE_CUDA = 1

PRECISION_INT8_FP8 = 0
PRECISION_FP16 = 1
PRECISION_EXACT = 2
PRECISION_INT8_FP8_SPLIT_V = 3
PRECISION_INT8_FP16 = 4
PRECISION_AUTO = 5

SELECT_TOPK = 0
SELECT_CDF = 1

MAX_DIMS = 4


# ------------------------------------------------------------------ errors
class SpargeError(RuntimeError):
    """Base class of every error raised by the sparge package.

    ``status`` is the library's numeric status code (``None`` for errors
    raised by the Python layer before the library was called).
    """

    status: Optional[int] = None

    def __init__(self, message: str, status: Optional[int] = None) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status


class InvalidArgumentError(SpargeError, ValueError):
    """A NULL pointer, a bad shape, stride, dtype or parameter value."""

    status = SPARGE_ERR_INVALID_ARGUMENT


class UnsupportedError(SpargeError, NotImplementedError):
    """A valid request that this build or device cannot do."""

    status = SPARGE_ERR_UNSUPPORTED


class WorkspaceTooSmallError(SpargeError):
    """The workspace passed to the library is smaller than the plan needs."""

    status = SPARGE_ERR_WORKSPACE_TOO_SMALL


class NoDeviceError(SpargeError):
    """A CUDA problem, but no usable GPU or the library has no CUDA backend."""

    status = SPARGE_ERR_NO_DEVICE


class CudaError(SpargeError):
    """A CUDA runtime or driver call failed inside the library."""

    status = SPARGE_ERR_CUDA


class OutOfMemoryError(SpargeError, MemoryError):
    """A host allocation failed during plan creation."""

    status = SPARGE_ERR_OUT_OF_MEMORY


class InternalError(SpargeError):
    """A bug in the library."""

    status = SPARGE_ERR_INTERNAL


class LibraryNotFoundError(SpargeError, ImportError):
    """libsparge could not be found or loaded."""


class VersionMismatchError(SpargeError, ImportError):
    """The loaded libsparge has a different major.minor than this package."""


_STATUS_TO_ERROR = {
    SPARGE_ERR_INVALID_ARGUMENT: InvalidArgumentError,
    SPARGE_ERR_UNSUPPORTED: UnsupportedError,
    SPARGE_ERR_WORKSPACE_TOO_SMALL: WorkspaceTooSmallError,
    SPARGE_ERR_NO_DEVICE: NoDeviceError,
    SPARGE_ERR_CUDA: CudaError,
    SPARGE_ERR_OUT_OF_MEMORY: OutOfMemoryError,
    SPARGE_ERR_INTERNAL: InternalError,
}


# ------------------------------------------------------------------ structs
class SpargeTensor(ctypes.Structure):
    """Mirror of ``sparge_tensor_t`` (a borrowed strided view, strides in elements)."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device_type", ctypes.c_int),
        ("device_id", ctypes.c_int32),
        ("dtype", ctypes.c_int),
        ("ndim", ctypes.c_int32),
        ("shape", ctypes.c_int64 * MAX_DIMS),
        ("strides", ctypes.c_int64 * MAX_DIMS),
    ]


class SpargeProblem(ctypes.Structure):
    """Mirror of ``sparge_problem_t``; ``struct_size`` is set by the constructor."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("batch", ctypes.c_int64),
        ("heads_q", ctypes.c_int64),
        ("heads_kv", ctypes.c_int64),
        ("len_q", ctypes.c_int64),
        ("len_kv", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("dtype", ctypes.c_int),
        ("device_type", ctypes.c_int),
        ("device_id", ctypes.c_int32),
        ("precision", ctypes.c_int),
        ("causal", ctypes.c_int32),
        ("scale", ctypes.c_float),
        ("block_q", ctypes.c_int32),
        ("block_k", ctypes.c_int32),
    ]

    def __init__(self, **kw: object) -> None:
        # Same defaults as SPARGE_PROBLEM_INIT.
        defaults = dict(
            batch=1, heads_q=1, heads_kv=1, len_q=0, len_kv=0, head_dim=128,
            dtype=DTYPE_BFLOAT16, device_type=DEVICE_CPU, device_id=0,
            precision=PRECISION_AUTO, causal=0, scale=0.0, block_q=0, block_k=0,
        )
        defaults.update(kw)
        super().__init__(struct_size=ctypes.sizeof(SpargeProblem), **defaults)


class SpargePredictParams(ctypes.Structure):
    """Mirror of ``sparge_predict_params_t``; ``struct_size`` is set by the constructor."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("mode", ctypes.c_int),
        ("topk", ctypes.c_float),
        ("cdf_threshold", ctypes.c_float),
        ("sim_threshold", ctypes.c_float),
        ("smooth_k", ctypes.c_int32),
        ("attention_sink", ctypes.c_int32),
        ("topk_per_head", ctypes.c_void_p),
        ("cdf_threshold_per_head", ctypes.c_void_p),
        ("sim_threshold_per_head", ctypes.c_void_p),
        ("pv_threshold", ctypes.c_float),
        ("local_window", ctypes.c_int32),
        ("estimator", ctypes.c_int),
    ]

    def __init__(self, **kw: object) -> None:
        # Same defaults as SPARGE_PREDICT_PARAMS_INIT.
        defaults = dict(
            mode=SELECT_TOPK, topk=0.5, cdf_threshold=0.9, sim_threshold=-0.1,
            smooth_k=1, attention_sink=-1, topk_per_head=None,
            cdf_threshold_per_head=None, sim_threshold_per_head=None, pv_threshold=0.0,
            local_window=-1, estimator=4,
        )
        defaults.update(kw)
        super().__init__(struct_size=ctypes.sizeof(SpargePredictParams), **defaults)


class SpargeKernelInfo(ctypes.Structure):
    """Mirror of ``sparge_kernel_info_t``; ``struct_size`` is set by the constructor."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("family", ctypes.c_char * 16),
        ("name", ctypes.c_char * 64),
        ("sm_version", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("block_q", ctypes.c_int32),
        ("keys_per_step", ctypes.c_int32),
        ("stages", ctypes.c_int32),
        ("threads", ctypes.c_int32),
        ("smem_bytes", ctypes.c_int32),
    ]

    def __init__(self) -> None:
        super().__init__(struct_size=ctypes.sizeof(SpargeKernelInfo))


_T = ctypes.POINTER(SpargeTensor)
_plan_t = ctypes.c_void_p
_status_t = ctypes.c_int

# name -> (restype, argtypes); one entry per function in sparge.h.
_PROTOTYPES = {
    "sparge_create_plan": (_status_t, [ctypes.POINTER(SpargeProblem), ctypes.POINTER(_plan_t)]),
    "sparge_plan_workspace_size": (_status_t, [_plan_t, ctypes.POINTER(ctypes.c_size_t)]),
    "sparge_plan_get_problem": (_status_t, [_plan_t, ctypes.POINTER(SpargeProblem)]),
    "sparge_plan_visible_blocks": (_status_t, [_plan_t, ctypes.POINTER(ctypes.c_int64)]),
    "sparge_plan_kernel_info": (_status_t, [_plan_t, ctypes.POINTER(SpargeKernelInfo)]),
    "sparge_predict_mask": (
        _status_t,
        [_plan_t, _T, _T, ctypes.POINTER(SpargePredictParams), _T, _T,
         ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p],
    ),
    "sparge_attention_run": (
        _status_t,
        [_plan_t, _T, _T, _T, _T, ctypes.POINTER(SpargePredictParams), _T, _T,
         ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p],
    ),
    "sparge_destroy_plan": (None, [_plan_t]),
    "sparge_last_error": (ctypes.c_char_p, []),
    "sparge_status_string": (ctypes.c_char_p, [_status_t]),
    "sparge_version": (None, [ctypes.POINTER(ctypes.c_int)] * 3),
    "sparge_has_cuda": (ctypes.c_int, []),
    "sparge_merge_states": (_status_t, [ctypes.c_int32, _T, _T, _T, _T, ctypes.c_void_p]),
}

#: SPARGE_MERGE_MAX_STATES: most partial states one sparge_merge_states call combines.
MERGE_MAX_STATES = 32


# ------------------------------------------------------------------ loader
_SONAME = "libsparge.so.%d.%d" % PACKAGE_VERSION[:2]


def _package_dirs() -> List[str]:
    """This package's folders: its own, plus those of an editable install's package path (there
    the built library lies in site-packages/sparge/_lib, the Python files in the checkout)."""
    dirs = [_PKG_DIR]
    pkg = sys.modules.get(__name__.rpartition(".")[0])
    for d in getattr(pkg, "__path__", None) or []:
        d = os.path.abspath(d)
        if d not in dirs:
            dirs.append(d)
    return dirs


def _candidates() -> List[Tuple[str, str]]:
    """(description, path-or-name) pairs, in search order."""
    out: List[Tuple[str, str]] = []
    env = os.environ.get("SPARGE_LIBRARY")
    if env:
        out.append(("$SPARGE_LIBRARY", env))
    own = []
    for d in _package_dirs():
        own += [p for p in sorted(glob.glob(os.path.join(d, "_lib", "libsparge.so*")), key=len) if p not in own]
    if own:
        for p in own:
            out.append(("package copy", p))
    else:
        out.append(("package copy", os.path.join(_PKG_DIR, "_lib", "libsparge.so*")))
    found = ctypes.util.find_library("sparge")
    out.append(("ctypes.util.find_library('sparge')", found or ""))
    out.append(("system loader", _SONAME))
    out.append(("system loader", "libsparge.so"))
    return out


def _load() -> Tuple[ctypes.CDLL, str]:
    tried: List[str] = []
    env = os.environ.get("SPARGE_LIBRARY")
    for where, name in _candidates():
        if not name:
            tried.append("  %-36s found nothing" % where)
            continue
        if name.endswith("*"):
            tried.append("  %-36s %s: not present" % (where, name))
            continue
        if where == "$SPARGE_LIBRARY" and not os.path.isfile(name):
            tried.append("  %-36s %s: no such file" % (where, name))
            # An explicit request that fails must not silently load another copy.
            break
        try:
            handle = ctypes.CDLL(name)
        except OSError as e:
            tried.append("  %-36s %s: %s" % (where, name, e))
            if where == "$SPARGE_LIBRARY":
                break
            continue
        return handle, name
    hint = (
        "Build it (cmake -S . -B build -DSPARGE_CUDA=OFF && cmake --build build) and set "
        "SPARGE_LIBRARY=/path/to/libsparge.so, or reinstall the package from a tree where "
        "the library is built."
    )
    if env:
        hint = "SPARGE_LIBRARY is set, so no other location was tried. " + hint
    raise LibraryNotFoundError(
        "libsparge could not be loaded. Places tried, in order:\n" + "\n".join(tried) + "\n" + hint
    )


def _declare(handle: ctypes.CDLL, path: str) -> None:
    missing = []
    for name, (restype, argtypes) in _PROTOTYPES.items():
        try:
            fn = getattr(handle, name)
        except AttributeError:
            missing.append(name)
            continue
        fn.restype = restype
        fn.argtypes = argtypes
    if missing:
        raise LibraryNotFoundError(
            "%s does not export %s; it is not a compatible libsparge" % (path, ", ".join(missing))
        )


def _check_version(handle: ctypes.CDLL, path: str) -> Tuple[int, int, int]:
    ma, mi, pa = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    handle.sparge_version(ctypes.byref(ma), ctypes.byref(mi), ctypes.byref(pa))
    got = (ma.value, mi.value, pa.value)
    if got[:2] != PACKAGE_VERSION[:2]:
        raise VersionMismatchError(
            "%s is libsparge %d.%d.%d but this sparge package is %d.%d.%d; major.minor must match. "
            "Point SPARGE_LIBRARY at a matching build or reinstall the package."
            % ((path,) + got + PACKAGE_VERSION)
        )
    return got


class _Lib:
    """Lazily loaded library handle (so ``import sparge`` never fails on its own)."""

    def __init__(self) -> None:
        self._handle: Optional[ctypes.CDLL] = None
        self._path: Optional[str] = None
        self._version: Optional[Tuple[int, int, int]] = None
        self._lock = threading.Lock()

    def load(self) -> ctypes.CDLL:
        h = self._handle
        if h is not None:
            return h
        with self._lock:
            if self._handle is None:
                handle, path = _load()
                _declare(handle, path)
                self._version = _check_version(handle, path)
                self._path = path
                self._handle = handle
            return self._handle

    def __getattr__(self, name: str):  # noqa: D105 - forwards to the CDLL
        if not name.startswith("sparge_"):
            raise AttributeError(name)
        fn = getattr(self.load(), name)
        self.__dict__[name] = fn  # later look-ups are plain attribute hits (no __getattr__)
        return fn

    def raw(self, name: str, argtypes: Optional[list], restype: object = ctypes.c_int) -> object:
        """A separate function object of ``name`` with its own ``argtypes`` (the calls of the hot
        path pass descriptor addresses as integers); the one that ``lib.name`` gives keeps the
        header's prototype."""
        fn = self.load()[name]
        fn.restype = restype
        fn.argtypes = argtypes
        return fn

    @property
    def path(self) -> str:
        self.load()
        assert self._path is not None
        return self._path

    @property
    def version(self) -> Tuple[int, int, int]:
        self.load()
        assert self._version is not None
        return self._version


lib = _Lib()


def library_path() -> str:
    """The path (or name) of the loaded libsparge."""
    return lib.path


def last_error() -> str:
    """Thread-local text of the last library failure on this thread."""
    s = lib.sparge_last_error()
    return s.decode("utf-8", "replace") if s else ""


def status_string(status: int) -> str:
    s = lib.sparge_status_string(status)
    return s.decode("utf-8", "replace") if s else "unknown status %d" % status


def check(status: int, what: str = "") -> None:
    """Raise the SpargeError subclass for ``status`` with the library's last-error text."""
    if status == SPARGE_OK:
        return
    msg = last_error() or status_string(status)
    if what:
        msg = "%s: %s" % (what, msg)
    cls = _STATUS_TO_ERROR.get(status, InternalError)
    raise cls(msg, status)
