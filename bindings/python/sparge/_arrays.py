"""Zero-copy views of array objects as ``sparge_tensor_t`` descriptors.

Supported producers: numpy arrays, torch tensors, any object with
``__cuda_array_interface__`` (v2/v3) and any object with ``__dlpack__``
(versioned capsules ``dltensor_versioned`` when the producer offers them, else
the legacy ``dltensor`` capsule). Also the allocators that create outputs and
workspaces in the same framework and memory space as the inputs.
"""

from __future__ import annotations

import collections
import ctypes
import sys
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import _capi as C

# ------------------------------------------------------------------ view
_DTYPE_NAMES = {
    C.DTYPE_FLOAT16: "float16",
    C.DTYPE_BFLOAT16: "bfloat16",
    C.DTYPE_FLOAT32: "float32",
    C.DTYPE_UINT8: "uint8",
    C.DTYPE_INT32: "int32",
}


def dtype_name(code: int) -> str:
    return _DTYPE_NAMES.get(code, "dtype#%d" % code)


class View:
    """A borrowed strided view. ``keep`` holds whatever must outlive the call."""

    __slots__ = ("ptr", "device_type", "device_id", "dtype", "shape", "strides",
                 "keep", "kind", "stream", "readonly", "src_dtype")

    def __init__(self, ptr: int, device_type: int, device_id: int, dtype: Optional[int],
                 shape: Sequence[int], strides: Sequence[int], keep: Any, kind: str,
                 stream: Optional[int] = None, readonly: bool = False, src_dtype: Any = "") -> None:
        # Hot path: no conversions here; producers pass tuples of ints.
        self.ptr = ptr or 0
        self.device_type = device_type
        self.device_id = device_id
        self.dtype = dtype
        self.shape = shape
        self.strides = strides
        self.keep = keep
        self.kind = kind
        self.stream = stream
        self.readonly = readonly
        self.src_dtype = src_dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def nbytes(self) -> int:
        """Size of a 1-D contiguous buffer (a workspace) in bytes."""
        size = _ITEMSIZE.get(self.dtype) if self.dtype is not None else None
        if size is None or len(self.shape) != 1 or (self.shape[0] > 1 and self.strides[0] != 1):
            raise C.InvalidArgumentError(
                "workspace must be a 1-D contiguous buffer (e.g. uint8), got dtype %s, shape %s, strides %s"
                % (self.src_dtype, tuple(self.shape), tuple(self.strides)))
        return int(self.shape[0]) * size

    def device_str(self) -> str:
        return "cpu" if self.device_type == C.DEVICE_CPU else "cuda:%d" % self.device_id

    def descriptor(self, perm: Optional[Sequence[int]] = None) -> C.SpargeTensor:
        """The C descriptor, with dims reordered by ``perm`` (logical dim i = view dim perm[i])."""
        shape, strides = self.shape, self.strides
        if perm is not None:
            shape = [shape[p] for p in perm]
            strides = [strides[p] for p in perm]
        n = len(shape)
        if n > C.MAX_DIMS:
            raise C.InvalidArgumentError("tensor has %d dims; at most %d supported" % (n, C.MAX_DIMS))
        return C.SpargeTensor(self.ptr, self.device_type, self.device_id,
                              self.dtype if self.dtype is not None else -1, n,
                              _I64x4(*shape), _I64x4(*strides))


_I64x4 = ctypes.c_int64 * C.MAX_DIMS
_ITEMSIZE = {C.DTYPE_FLOAT16: 2, C.DTYPE_BFLOAT16: 2, C.DTYPE_FLOAT32: 4, C.DTYPE_UINT8: 1, C.DTYPE_INT32: 4}


# ------------------------------------------------------------------ numpy
def _np_dtype_code(dt: np.dtype) -> Optional[int]:
    if dt == np.float16:
        return C.DTYPE_FLOAT16
    if dt == np.float32:
        return C.DTYPE_FLOAT32
    if dt == np.uint8 or dt == np.bool_:
        return C.DTYPE_UINT8
    if dt == np.int32:
        return C.DTYPE_INT32
    if dt.name == "bfloat16":  # ml_dtypes / jax numpy extension type
        return C.DTYPE_BFLOAT16
    return None


def numpy_view(a: np.ndarray) -> View:
    item = a.itemsize
    strides = []
    for s in a.strides:
        if s % item:
            raise C.InvalidArgumentError("array strides %s are not multiples of its itemsize %d" % (a.strides, item))
        strides.append(s // item)
    ptr = a.__array_interface__["data"][0]
    return View(ptr, C.DEVICE_CPU, 0, _np_dtype_code(a.dtype), a.shape, tuple(strides), a, "numpy",
                readonly=not a.flags.writeable, src_dtype=a.dtype)


# ------------------------------------------------------------------ torch
def torch_module() -> Any:
    """torch if it is already imported (never imports it: torch stays optional)."""
    return sys.modules.get("torch")


def is_torch_tensor(x: Any) -> bool:
    torch = torch_module()
    return torch is not None and isinstance(x, torch.Tensor)


_TORCH_DTYPES: Optional[Dict[Any, int]] = None


def _torch_dtype_code(torch: Any, dt: Any) -> Optional[int]:
    global _TORCH_DTYPES
    if _TORCH_DTYPES is None:
        _TORCH_DTYPES = {
            torch.float16: C.DTYPE_FLOAT16,
            torch.bfloat16: C.DTYPE_BFLOAT16,
            torch.float32: C.DTYPE_FLOAT32,
            torch.uint8: C.DTYPE_UINT8,
            torch.bool: C.DTYPE_UINT8,
            torch.int32: C.DTYPE_INT32,
        }
    return _TORCH_DTYPES.get(dt)


def torch_view(t: Any) -> View:
    # t.is_cuda and t.get_device() are plain attribute reads; t.device builds a torch.device object.
    if t.is_cuda:
        dtype_dev, did = C.DEVICE_CUDA, t.get_device()
    else:
        dev = t.device
        if dev.type != "cpu":
            raise C.UnsupportedError("tensors on device %r are not supported (cpu or cuda only)" % str(dev))
        dtype_dev, did = C.DEVICE_CPU, 0
    dt = t.dtype
    codes = _TORCH_DTYPES
    code = codes.get(dt) if codes is not None else _torch_dtype_code(torch_module(), dt)
    return View(t.data_ptr(), dtype_dev, did, code, tuple(t.shape), t.stride(), t, "torch", src_dtype=dt)


# ------------------------------------------------------------------ DLPack
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


# PYFUNCTYPE: call deleters with the GIL held (numpy's and torch's take it anyway).
_DELETER = ctypes.PYFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [
    ("dl_tensor", _DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _DELETER),
]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    pass


_DELETER_V = ctypes.PYFUNCTYPE(None, ctypes.POINTER(_DLManagedTensorVersioned))
_DLManagedTensorVersioned._fields_ = [
    ("version", _DLPackVersion),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _DELETER_V),
    ("flags", ctypes.c_uint64),
    ("dl_tensor", _DLTensor),
]

_DLPACK_FLAG_READ_ONLY = 1 << 0

_kDLCPU, _kDLCUDA, _kDLCUDAHost, _kDLCUDAManaged = 1, 2, 3, 13
_kDLInt, _kDLUInt, _kDLFloat, _kDLBfloat, _kDLBool = 0, 1, 2, 4, 6

# Capsule names live for the whole process: PyCapsule_SetName keeps the pointer.
_NAME_LEGACY = b"dltensor"
_NAME_VERSIONED = b"dltensor_versioned"
_NAME_USED = b"used_dltensor"
_NAME_USED_VERSIONED = b"used_dltensor_versioned"

_py = ctypes.pythonapi
_py.PyCapsule_IsValid.restype = ctypes.c_int
_py.PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_py.PyCapsule_GetPointer.restype = ctypes.c_void_p
_py.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_py.PyCapsule_SetName.restype = ctypes.c_int
_py.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]


class _DLPackOwner:
    """Owns a consumed DLPack tensor: calls its deleter exactly once."""

    __slots__ = ("_mt", "_producer", "_capsule", "__weakref__")

    def __init__(self, managed: Any, producer: Any, capsule: Any) -> None:
        self._mt = managed
        self._producer = producer  # keep the producer alive while we use its memory
        self._capsule = capsule

    def release(self) -> None:
        mt, self._mt = self._mt, None
        if mt is not None:
            deleter = mt.contents.deleter
            if deleter:
                deleter(mt)
        self._producer = None
        self._capsule = None

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # never raise from a finalizer
            pass


def _dl_dtype_code(dt: _DLDataType) -> Optional[int]:
    if dt.lanes != 1:
        return None
    key = (dt.code, dt.bits)
    return {
        (_kDLFloat, 16): C.DTYPE_FLOAT16,
        (_kDLFloat, 32): C.DTYPE_FLOAT32,
        (_kDLBfloat, 16): C.DTYPE_BFLOAT16,
        (_kDLUInt, 8): C.DTYPE_UINT8,
        (_kDLBool, 8): C.DTYPE_UINT8,
        (_kDLInt, 32): C.DTYPE_INT32,
    }.get(key)


def dlpack_view(obj: Any, name: str, stream: Optional[int] = None) -> View:
    """Consume ``obj.__dlpack__`` (versioned when offered) into a View.

    ``stream`` is the consumer stream handed to the producer for CUDA arrays
    (None: the legacy default stream, per the protocol).
    """
    dev_type, dev_id = 1, 0
    if hasattr(obj, "__dlpack_device__"):
        dev_type, dev_id = (int(x) for x in obj.__dlpack_device__())
    kwargs: Dict[str, Any] = {}
    if dev_type in (_kDLCUDA, _kDLCUDAManaged):
        kwargs["stream"] = 1 if stream is None or stream == 0 else int(stream)
    try:
        capsule = obj.__dlpack__(max_version=(1, 0), **kwargs)
    except TypeError:
        capsule = obj.__dlpack__(**kwargs)
    if _py.PyCapsule_IsValid(capsule, _NAME_VERSIONED):
        ptr = _py.PyCapsule_GetPointer(capsule, _NAME_VERSIONED)
        mt: Any = ctypes.cast(ptr, ctypes.POINTER(_DLManagedTensorVersioned))
        if mt.contents.version.major != 1:
            raise C.UnsupportedError(
                "%s: DLPack version %d.%d is not supported (1.x expected)"
                % (name, mt.contents.version.major, mt.contents.version.minor))
        readonly = bool(mt.contents.flags & _DLPACK_FLAG_READ_ONLY)
        if _py.PyCapsule_SetName(capsule, _NAME_USED_VERSIONED) != 0:
            raise C.InternalError("%s: could not mark the DLPack capsule as used" % name)
    elif _py.PyCapsule_IsValid(capsule, _NAME_LEGACY):
        ptr = _py.PyCapsule_GetPointer(capsule, _NAME_LEGACY)
        mt = ctypes.cast(ptr, ctypes.POINTER(_DLManagedTensor))
        readonly = False
        if _py.PyCapsule_SetName(capsule, _NAME_USED) != 0:
            raise C.InternalError("%s: could not mark the DLPack capsule as used" % name)
    else:
        raise C.InvalidArgumentError("%s: __dlpack__() did not return a DLPack capsule" % name)
    owner = _DLPackOwner(mt, obj, capsule)
    t = mt.contents.dl_tensor
    ndim = int(t.ndim)
    shape = [t.shape[i] for i in range(ndim)]
    if t.strides:
        strides = [t.strides[i] for i in range(ndim)]
    else:  # legacy producers: NULL strides = compact row-major
        strides, acc = [0] * ndim, 1
        for i in range(ndim - 1, -1, -1):
            strides[i] = acc
            acc *= shape[i]
    code = _dl_dtype_code(t.dtype)
    nbytes = max(1, (t.dtype.bits * t.dtype.lanes) // 8)
    data = (t.data or 0) + int(t.byte_offset)
    dt = int(t.device.device_type)
    if dt in (_kDLCPU, _kDLCUDAHost):
        sdev, sid = C.DEVICE_CPU, 0
    elif dt in (_kDLCUDA, _kDLCUDAManaged):
        sdev, sid = C.DEVICE_CUDA, int(t.device.device_id)
    else:
        owner.release()
        raise C.UnsupportedError("%s: DLPack device type %d is not supported (CPU or CUDA only)" % (name, dt))
    src = "dl(code=%d,bits=%d,lanes=%d)" % (t.dtype.code, t.dtype.bits, t.dtype.lanes)
    del nbytes
    return View(data, sdev, sid, code, tuple(shape), tuple(strides), owner, "dlpack", readonly=readonly,
                src_dtype=src)


# ------------------------------------------------------------------ CUDA array interface
_CAI_TYPES = {"f2": C.DTYPE_FLOAT16, "f4": C.DTYPE_FLOAT32, "u1": C.DTYPE_UINT8, "b1": C.DTYPE_UINT8,
              "i4": C.DTYPE_INT32}


def _cai_device(obj: Any) -> int:
    dev = getattr(obj, "device", None)
    for attr in ("id", "index"):
        v = getattr(dev, attr, None)
        if isinstance(v, int):
            return v
    if isinstance(dev, int):
        return dev
    torch = torch_module()
    if torch is not None and torch.cuda.is_available():
        return torch.cuda.current_device()
    return 0


def cai_view(obj: Any, name: str) -> View:
    d = obj.__cuda_array_interface__
    typestr = d["typestr"]
    code = _CAI_TYPES.get(typestr[1:])
    if typestr[0] == ">":
        code = None
    itemsize = int(typestr[2:])
    shape = tuple(d["shape"])
    if d.get("strides") is None:
        strides, acc = [0] * len(shape), 1
        for i in range(len(shape) - 1, -1, -1):
            strides[i] = acc
            acc *= shape[i]
    else:
        strides = []
        for s in d["strides"]:
            if s % itemsize:
                raise C.InvalidArgumentError("%s: strides %s are not multiples of the itemsize" % (name, d["strides"]))
            strides.append(s // itemsize)
    ptr, ro = d["data"]
    stream = d.get("stream") if int(d.get("version", 0)) >= 3 else None
    return View(ptr or 0, C.DEVICE_CUDA, _cai_device(obj), code, tuple(shape), tuple(strides), obj, "cai",
                stream=stream, readonly=bool(ro), src_dtype=typestr)


# ------------------------------------------------------------------ dispatch
def as_view(obj: Any, name: str, stream: Optional[int] = None) -> View:
    """A zero-copy View of ``obj``; raises InvalidArgumentError naming ``name`` otherwise."""
    if isinstance(obj, np.ndarray):
        return numpy_view(obj)
    if is_torch_tensor(obj):
        return torch_view(obj)
    if hasattr(obj, "__cuda_array_interface__"):
        return cai_view(obj, name)
    if hasattr(obj, "__dlpack__"):
        return dlpack_view(obj, name, stream)
    if hasattr(obj, "__array_interface__") or hasattr(obj, "__array__"):
        return numpy_view(np.asarray(obj))
    raise C.InvalidArgumentError(
        "%s must be a numpy array, a torch tensor, or an object with __dlpack__ or "
        "__cuda_array_interface__; got %s" % (name, type(obj).__name__))


def framework_of(obj: Any) -> str:
    """'numpy', 'torch', 'cupy' or 'other' (decides where outputs are allocated)."""
    if isinstance(obj, np.ndarray):
        return "numpy"
    if is_torch_tensor(obj):
        return "torch"
    mod = type(obj).__module__ or ""
    if mod.startswith("cupy"):
        return "cupy"
    return "other"


# ------------------------------------------------------------------ allocators
_ALIGN = 256


class _ThreadBuffers:
    """One host workspace buffer per thread, in a registry that :meth:`clear` can empty
    for all threads at once (a ``threading.local`` can only be reached by its own
    thread). Entries of finished threads are dropped when a thread adds its own."""

    def __init__(self) -> None:
        self._bufs: Dict[int, Any] = {}
        self._lock = threading.Lock()

    def get(self, need: int, size_of: Any, make: Any) -> Any:
        tid = threading.get_ident()
        with self._lock:
            buf = self._bufs.get(tid)
        if buf is not None and size_of(buf) >= need:
            return buf
        buf = make(need)
        with self._lock:
            alive = {t.ident for t in threading.enumerate()}
            for t in [t for t in self._bufs if t not in alive]:
                del self._bufs[t]
            self._bufs[tid] = buf
        return buf

    def clear(self) -> None:
        with self._lock:
            self._bufs.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._bufs)


class _StreamBuffers:
    """Workspace buffers per (device, stream), least recently used evicted beyond
    ``capacity`` entries. Dropping a buffer is safe while work that uses it is still
    queued: each buffer is allocated on the stream it serves, and the caching
    allocators (torch, cupy) reuse a freed block for that stream only in stream order."""

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self._d: "collections.OrderedDict[Tuple[int, int], Any]" = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Tuple[int, int], need: int, size_of: Any, make: Any) -> Any:
        with self._lock:
            d = self._d
            buf = d.get(key)
            if buf is not None and size_of(buf) >= need:
                d.move_to_end(key)
                return buf
            buf = make(need)
            d[key] = buf
            d.move_to_end(key)
            while len(d) > self.capacity:
                d.popitem(last=False)
            return buf

    def clear(self) -> None:
        with self._lock:
            self._d.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._d)


class NumpyAllocator:
    """Host outputs and workspaces (CPU backend)."""

    def __init__(self) -> None:
        self._ws = _ThreadBuffers()

    def empty(self, shape: Sequence[int], dtype: str, like: View) -> Tuple[Any, View]:
        if dtype == "bfloat16":
            src = like.keep if isinstance(like.keep, np.ndarray) else None
            if src is None or src.dtype.name != "bfloat16":
                raise C.UnsupportedError("bfloat16 host outputs need an ml_dtypes bfloat16 input array")
            a = np.empty(shape, dtype=src.dtype)
        else:
            a = np.empty(shape, dtype=dtype)
        return a, numpy_view(a)

    def workspace(self, nbytes: int, like: View, stream: int) -> Tuple[int, Any]:
        if nbytes == 0:
            return 0, None
        # Per thread: the CPU backend runs synchronously, so a thread's buffer is free again
        # when its call returns.
        buf = self._ws.get(nbytes + _ALIGN, lambda b: b.nbytes, lambda n: np.empty(n, dtype=np.uint8))
        base = buf.__array_interface__["data"][0]
        return (base + _ALIGN - 1) // _ALIGN * _ALIGN, buf

    def clear(self) -> None:
        self._ws.clear()

    def per_head(self, values: Sequence[float], like: View) -> Tuple[int, Any]:
        a = np.ascontiguousarray(np.asarray(values, dtype=np.float32))
        return a.__array_interface__["data"][0], a


def _numel(b: Any) -> int:
    return b.numel()


class TorchAllocator:
    """Outputs and workspaces from torch's allocator, on the inputs' device."""

    def __init__(self) -> None:
        self._ws = _StreamBuffers()
        self._host = _ThreadBuffers()
        self._heads: Dict[Tuple[str, Tuple[float, ...]], Any] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _torch_dtype(dtype: str) -> Any:
        return getattr(torch_module(), dtype)

    @staticmethod
    def _device(like: View) -> Any:
        torch = torch_module()
        return torch.device("cpu") if like.device_type == C.DEVICE_CPU else torch.device("cuda", like.device_id)

    @classmethod
    def _device_of(cls, like: View) -> Any:
        return like.keep.device if is_torch_tensor(like.keep) else cls._device(like)

    def empty(self, shape: Sequence[int], dtype: str, like: View) -> Tuple[Any, View]:
        torch = torch_module()
        if is_torch_tensor(like.keep):
            # Same as torch.empty on like's device (contiguous, no grad), without building a device.
            t = like.keep.new_empty(shape, dtype=getattr(torch, dtype))
        else:
            t = torch.empty(shape, dtype=getattr(torch, dtype), device=self._device(like))
        return t, torch_view(t)

    def workspace(self, nbytes: int, like: View, stream: int) -> Tuple[int, Any]:
        if nbytes == 0:
            return 0, None
        torch = torch_module()
        need = nbytes + _ALIGN
        if like.device_type == C.DEVICE_CPU:
            buf = self._host.get(need, _numel, lambda n: torch.empty(n, dtype=torch.uint8))
        elif torch.cuda.is_current_stream_capturing():
            # Inside a CUDA graph capture: a fresh buffer from the graph's private pool,
            # owned by the graph for its lifetime.
            buf = torch.empty(need, dtype=torch.uint8, device=self._device_of(like))
        else:
            # Reused per (device, stream): work on one stream is ordered, so a buffer is free
            # for the next call on the same stream once this one is enqueued. Allocated on
            # that stream (the current one), so evicting it is stream-safe.
            buf = self._ws.get((like.device_id, int(stream)), need, _numel,
                               lambda n: torch.empty(n, dtype=torch.uint8, device=self._device_of(like)))
        base = buf.data_ptr()
        return (base + _ALIGN - 1) // _ALIGN * _ALIGN, buf

    def per_head(self, values: Sequence[float], like: View) -> Tuple[int, Any]:
        torch = torch_module()
        if is_torch_tensor(values):
            t = values.to(device=self._device(like), dtype=torch.float32).contiguous()
            return t.data_ptr(), t
        vals = tuple(float(x) for x in values)
        device = self._device(like)
        key = (str(device), vals)
        with self._lock:
            t = self._heads.get(key)
            if t is None:
                # Cached: the host-to-device copy happens once per distinct list (so later
                # calls, including ones inside a CUDA graph capture, copy nothing).
                t = torch.tensor(vals, dtype=torch.float32).to(device)
                if len(self._heads) > 256:
                    self._heads.clear()
                self._heads[key] = t
        return t.data_ptr(), t

    def clear(self) -> None:
        self._ws.clear()
        self._host.clear()
        with self._lock:
            self._heads.clear()


class CupyAllocator:
    """Outputs and workspaces from cupy's memory pool (inputs that are cupy arrays)."""

    def __init__(self) -> None:
        self._ws = _StreamBuffers()

    def empty(self, shape: Sequence[int], dtype: str, like: View) -> Tuple[Any, View]:
        import cupy  # noqa: WPS433 - optional

        if dtype == "bfloat16":
            raise C.UnsupportedError("cupy has no bfloat16 arrays; use torch or fp16")
        with cupy.cuda.Device(like.device_id):
            a = cupy.empty(tuple(shape), dtype=dtype)
        return a, cai_view(a, "out")

    def workspace(self, nbytes: int, like: View, stream: int) -> Tuple[int, Any]:
        if nbytes == 0:
            return 0, None
        import cupy

        def make(n: int) -> Any:
            with cupy.cuda.Device(like.device_id):
                return cupy.empty(n, dtype=cupy.uint8)

        buf = self._ws.get((like.device_id, int(stream)), nbytes + _ALIGN, lambda b: b.nbytes, make)
        base = int(buf.data.ptr)
        return (base + _ALIGN - 1) // _ALIGN * _ALIGN, buf

    def per_head(self, values: Sequence[float], like: View) -> Tuple[int, Any]:
        import cupy

        with cupy.cuda.Device(like.device_id):
            a = cupy.asarray(np.asarray(values, dtype=np.float32))
        return int(a.data.ptr), a

    def clear(self) -> None:
        self._ws.clear()


NUMPY = NumpyAllocator()
_TORCH: Optional[TorchAllocator] = None
_CUPY: Optional[CupyAllocator] = None


def torch_allocator() -> TorchAllocator:
    global _TORCH
    if _TORCH is None:
        _TORCH = TorchAllocator()
    return _TORCH


def cupy_allocator() -> CupyAllocator:
    global _CUPY
    if _CUPY is None:
        _CUPY = CupyAllocator()
    return _CUPY


def allocator_for(obj: Any, view: View) -> Any:
    """Where outputs for inputs like ``obj`` are allocated."""
    fw = framework_of(obj)
    if fw == "torch":
        return torch_allocator()
    if fw == "cupy":
        return cupy_allocator()
    if view.device_type == C.DEVICE_CPU:
        return NUMPY
    if torch_module() is not None or _importable("torch"):
        import torch  # noqa: F401 - needed to allocate CUDA outputs

        return torch_allocator()
    if _importable("cupy"):
        return cupy_allocator()
    raise C.UnsupportedError(
        "CUDA inputs of type %s need torch or cupy installed to allocate outputs and workspace"
        % type(obj).__name__)


def _importable(mod: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(mod) is not None
