"""Plans (cached), argument checking, and the calls into the library.

Framework-neutral: works on :class:`~sparge._arrays.View` objects plus an
allocator that creates outputs/workspaces in the inputs' framework.
"""

from __future__ import annotations

import collections
import ctypes
import math
import struct
import threading
import weakref
from typing import Any, Dict, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np

from . import _capi as C
from ._arrays import View, as_view, dtype_name

LAYOUTS = {"HND": 0, "NHD": 1}
MODES = {"topk": C.SELECT_TOPK, "cdf": C.SELECT_CDF}
PRECISIONS = {"auto": C.PRECISION_AUTO, "int8_fp8": C.PRECISION_INT8_FP8, "fp16": C.PRECISION_FP16, "exact": C.PRECISION_EXACT,
              "int8_fp8_split_v": C.PRECISION_INT8_FP8_SPLIT_V, "int8_fp16": C.PRECISION_INT8_FP16}

# logical [B, H, L, D] dim i is dim PERM[layout][i] of the user's tensor
PERM = {0: (0, 1, 2, 3), 1: (0, 2, 1, 3)}

PerHead = Union[float, Sequence[float], Any]


class Options(NamedTuple):
    """Resolved, validated options of one call (hashable apart from per-head values)."""

    layout: int
    causal: bool
    scale: float  # 0 = library default 1/sqrt(D)
    mode: int
    topk: float
    cdf: float
    sim: float
    smooth_k: bool
    sink: int    # -1 = default of the mode, 0 off, 1 on
    window: int  # -1 = default of the mode, 0 off, >= 1 blocks
    estimator: int
    precision: int
    block_q: int
    block_k: int
    pv: float = 0.0  # pv_threshold: 0 = off, else the PV skip's threshold in nats


# ------------------------------------------------------------------ argument checking
# "auto" (SPARGE_ESTIMATOR_AUTO, the default): keys_lse_adaptive when not causal, keys_lse when causal,
# resolved by the library.
ESTIMATORS = {"mean": 0, "keys_lse": 1, "keys_lse_split2": 2, "keys_lse_adaptive": 3, "auto": 4}


def parse_estimator(e: Any) -> int:
    if e not in ESTIMATORS:
        raise _arg_error("estimator must be one of %s, got %r" % (", ".join(sorted(ESTIMATORS)), e))
    return ESTIMATORS[e]


def parse_local_window(w: Any) -> int:
    if w is None:
        return -1
    if isinstance(w, bool) or not hasattr(w, "__index__") or not 0 <= w.__index__() <= 1024:
        raise _arg_error("local_window must be None or an integer in [0, 1024], got %r" % (w,))
    return w.__index__()


def parse_pv_threshold(t: Any) -> float:
    """pv_threshold as the float the library reads. The library checks the value itself (0 = off;
    NaN, negative and infinite values are invalid; a positive one with precision "exact" is
    unsupported), its message naming ``params->pv_threshold``. Checked here: a real number, and a
    positive finite value that float32 holds (1e-50 would reach the library as 0, off; 1e39 as inf).
    None is 0, off."""
    if t is None:
        return 0.0
    if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, float, np.integer, np.floating)):
        raise _arg_error("pv_threshold must be a number (0 = off, else the PV skip's threshold in nats), "
                         "got %r (%s)" % (t, type(t).__name__))
    x = float(t)
    if math.isfinite(x) and x > 0.0 and not 0.0 < ctypes.c_float(x).value < math.inf:
        raise _arg_error("pv_threshold is %r, expected 0 (off) or a finite positive value (natural-log units) "
                         "that float32 holds (about 1.4e-45 .. 3.4e38)" % (t,))
    return x


def _arg_error(msg: str) -> C.InvalidArgumentError:
    return C.InvalidArgumentError(msg)


def parse_layout(layout: str) -> int:
    key = layout.upper() if isinstance(layout, str) else layout
    if key not in LAYOUTS:
        raise _arg_error("layout must be 'HND' ([B, H, L, D]) or 'NHD' ([B, L, H, D]), any case, got %r"
                         % (layout,))
    return LAYOUTS[key]


def parse_mode(mode: str) -> int:
    if mode not in MODES:
        raise _arg_error("mode must be 'topk' or 'cdf', got %r" % (mode,))
    return MODES[mode]


def precision_name(code: int) -> str:
    for name, c in PRECISIONS.items():
        if c == code:
            return name
    return "?"


def parse_precision(precision: str) -> int:
    if precision not in PRECISIONS:
        raise _arg_error("precision must be 'auto', 'int8_fp8', 'int8_fp8_split_v', 'int8_fp16', 'fp16' or 'exact', "
                         "got %r"
                         % (precision,))
    return PRECISIONS[precision]


_INT32_MAX = 2 ** 31 - 1


def _block_int(x: Any) -> Optional[int]:
    """An exact integer (int or an integer numpy scalar, not bool), else None."""
    if isinstance(x, (bool, np.bool_)):
        return None
    if isinstance(x, (int, np.integer)):
        return int(x)
    return None


def parse_block_size(block_size: Any) -> Tuple[int, int]:
    try:
        bq, bk = block_size
    except (TypeError, ValueError):
        raise _arg_error("block_size must be a pair (block_q, block_k) of ints, got %r" % (block_size,)) from None
    vals = []
    for name, x in (("block_q", bq), ("block_k", bk)):
        n = _block_int(x)
        if n is None:  # 1.9 or True would silently become 1
            raise _arg_error("block_size %s must be an int, got %r (%s)" % (name, x, type(x).__name__))
        if n < 0 or n > _INT32_MAX:  # the C field is int32: 2**32 + 16 must not wrap to 16
            raise _arg_error("block_size %s is %d, expected 0 (library default) .. %d" % (name, n, _INT32_MAX))
        vals.append(n)
    return vals[0], vals[1]


def parse_scale(scale: Optional[float]) -> float:
    if scale is None:
        return 0.0
    s = float(scale)
    if not math.isfinite(s) or s <= 0.0:
        raise _arg_error("scale must be a positive finite number or None (1/sqrt(D)), got %r" % (scale,))
    return s


def _is_seq(x: Any) -> bool:
    return not isinstance(x, (int, float)) and (hasattr(x, "__len__") or hasattr(x, "shape"))


def split_per_head(name: str, value: Any, lo: float, hi: float, lo_open: bool, default: float
                   ) -> Tuple[float, Optional[Any]]:
    """A scalar or per-head value -> (scalar, per-head-or-None). Checks the range when possible."""
    if value is None:
        return default, None
    if _is_seq(value):
        shape = getattr(value, "shape", None)
        if shape is not None and len(shape) != 1:
            raise _arg_error("%s given per head must be 1-D, got shape %s" % (name, tuple(shape)))
        if not hasattr(value, "device") or getattr(getattr(value, "device", None), "type", "cpu") == "cpu":
            vals = [float(x) for x in (value.tolist() if hasattr(value, "tolist") else value)]
            for x in vals:
                _check_range(name, x, lo, hi, lo_open)
        return default, value
    x = float(value)
    _check_range(name, x, lo, hi, lo_open)
    return x, None


def _check_range(name: str, x: float, lo: float, hi: float, lo_open: bool) -> None:
    bad = not math.isfinite(x) or x > hi or (x <= lo if lo_open else x < lo)
    if bad:
        raise _arg_error("%s must be in %s%g, %g], got %r" % (name, "(" if lo_open else "[", lo, hi, x))


def per_head_len(value: Any) -> int:
    shape = getattr(value, "shape", None)
    return int(shape[0]) if shape is not None else len(value)


class Shapes(NamedTuple):
    B: int
    Hq: int
    Hkv: int
    Lq: int
    Lkv: int
    D: int


def check_qkv(q: View, k: View, v: Optional[View], layout: int, need_float: bool = True) -> Shapes:
    """Shape/dtype/device checks with messages naming the argument."""
    lname = "HND" if layout == 0 else "NHD"
    form = "[B, H, L, D]" if layout == 0 else "[B, L, H, D]"
    views = [("q", q), ("k", k)] + ([("v", v)] if v is not None else [])
    for name, t in views:
        if t.ndim != 4:
            raise _arg_error("%s must be 4-D %s (layout %r), got shape %s" % (name, form, lname, t.shape))
        if t.dtype not in (C.DTYPE_FLOAT16, C.DTYPE_BFLOAT16, C.DTYPE_FLOAT32):
            raise _arg_error("%s has dtype %s; expected float16, bfloat16 or float32" % (name, t.src_dtype))
        if t.strides[3] != 1 and t.shape[3] > 1:
            raise _arg_error("%s must have unit stride on the head dimension D, got strides %s"
                             % (name, t.strides))
    for name, t in views[1:]:
        if t.dtype != q.dtype:
            raise _arg_error("%s has dtype %s but q has %s; q, k and v must share one dtype"
                             % (name, t.src_dtype, q.src_dtype))
        if (t.device_type, t.device_id) != (q.device_type, q.device_id):
            raise _arg_error("%s is on %s but q is on %s; all tensors must be on one device"
                             % (name, t.device_str(), q.device_str()))
    p = PERM[layout]
    B, Hq, Lq, D = (q.shape[i] for i in p)
    Bk, Hkv, Lkv, Dk = (k.shape[i] for i in p)
    if Bk != B:
        raise _arg_error("k has batch %d but q has %d" % (Bk, B))
    if Dk != D:
        raise _arg_error("k has head_dim %d but q has %d" % (Dk, D))
    if Hkv <= 0 or Hq % Hkv:
        raise _arg_error("q has %d heads, k has %d: q heads must be a multiple of k heads (GQA/MQA)" % (Hq, Hkv))
    if v is not None:
        vs = tuple(v.shape[i] for i in p)
        if vs != (B, Hkv, Lkv, D):
            raise _arg_error("v has logical shape %s [B, H, L, D] but k has %s; they must match"
                             % (vs, (B, Hkv, Lkv, D)))
    return Shapes(B, Hq, Hkv, Lq, Lkv, D)


# ------------------------------------------------------------------ plans
def _destroy_plan(handle: int) -> None:
    try:
        C.lib.sparge_destroy_plan(handle)
    except Exception:  # interpreter shutdown: the library may already be gone
        pass


class Plan:
    """An owned ``sparge_plan_t``; destroyed by a finalizer when dropped from the cache."""

    def __init__(self, key: Tuple[Any, ...]) -> None:
        (B, Hq, Hkv, Lq, Lkv, D, dtype, dev_type, dev_id, precision, causal, scale, bq, bk) = key
        prob = C.SpargeProblem(batch=B, heads_q=Hq, heads_kv=Hkv, len_q=Lq, len_kv=Lkv, head_dim=D,
                               dtype=dtype, device_type=dev_type, device_id=dev_id, precision=precision,
                               causal=int(causal), scale=scale, block_q=bq, block_k=bk)
        h = ctypes.c_void_p()
        C.check(C.lib.sparge_create_plan(ctypes.byref(prob), ctypes.byref(h)), "sparge_create_plan")
        self.handle: int = h.value or 0
        self._finalizer = weakref.finalize(self, _destroy_plan, self.handle)
        nbytes = ctypes.c_size_t()
        C.check(C.lib.sparge_plan_workspace_size(self.handle, ctypes.byref(nbytes)), "sparge_plan_workspace_size")
        self.workspace_bytes: int = nbytes.value
        resolved = C.SpargeProblem()
        C.check(C.lib.sparge_plan_get_problem(self.handle, ctypes.byref(resolved)), "sparge_plan_get_problem")
        self.scale = float(resolved.scale)
        self.block_q = int(resolved.block_q)
        self.block_k = int(resolved.block_k)
        self.precision = int(resolved.precision)  # the choice of "auto"
        vis = ctypes.c_int64()
        C.check(C.lib.sparge_plan_visible_blocks(self.handle, ctypes.byref(vis)), "sparge_plan_visible_blocks")
        self.visible_per_head: int = vis.value
        self.nqb = -(-Lq // self.block_q)
        self.nkb = -(-Lkv // self.block_k)
        self.key = key

    def kernel_info(self) -> Dict[str, Any]:
        """The attention kernel this plan runs (``sparge_plan_kernel_info``)."""
        ki = C.SpargeKernelInfo()
        C.check(C.lib.sparge_plan_kernel_info(self.handle, ctypes.byref(ki)), "sparge_plan_kernel_info")
        info: Dict[str, Any] = {"family": ki.family.decode(), "name": ki.name.decode()}
        for f in ("sm_version", "head_dim", "block_q", "keys_per_step", "stages", "threads", "smem_bytes"):
            info[f] = int(getattr(ki, f))
        return info

    def destroy(self) -> None:
        self._finalizer()


class PlanCache:
    """LRU cache of plans keyed by problem (shapes, dtype, device, precision, causal, scale, blocks)."""

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self._d: "collections.OrderedDict[Tuple[Any, ...], Plan]" = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Tuple[Any, ...]) -> Plan:
        with self._lock:
            p = self._d.get(key)
            if p is not None:
                self._d.move_to_end(key)
                return p
        p = Plan(key)  # outside the lock: plan creation may query the driver
        with self._lock:
            old = self._d.get(key)
            if old is not None:
                p.destroy()
                self._d.move_to_end(key)
                return old
            self._d[key] = p
            while len(self._d) > self.capacity:
                self._d.popitem(last=False)  # the finalizer destroys it once unreferenced
            return p

    def clear(self) -> None:
        with self._lock:
            self._d.clear()

    def __len__(self) -> int:
        return len(self._d)


PLANS = PlanCache()


def plan_key(s: Shapes, q: View, opts: Options) -> Tuple[Any, ...]:
    return (s.B, s.Hq, s.Hkv, s.Lq, s.Lkv, s.D, q.dtype, q.device_type, q.device_id, opts.precision,
            bool(opts.causal), float(opts.scale), opts.block_q, opts.block_k)


def get_plan(s: Shapes, q: View, opts: Options) -> Plan:
    return PLANS.get(plan_key(s, q, opts))


# ------------------------------------------------------------------ calls
_PARAMS_CACHE: dict = {}


def _params(opts: Options, alloc: Any, like: View, Hq: int,
            topk_h: Any, cdf_h: Any, sim_h: Any) -> Tuple[C.SpargePredictParams, list]:
    if topk_h is None and cdf_h is None and sim_h is None:
        p = _PARAMS_CACHE.get(opts)
        if p is None:  # read-only for the library (const), so one struct per option set is shared
            p = _make_params(opts, (None, None, None))
            if len(_PARAMS_CACHE) > 256:
                _PARAMS_CACHE.clear()
            _PARAMS_CACHE[opts] = p
        return p, []
    keep = []
    ptrs = []
    for name, vals in (("topk", topk_h), ("cdf_threshold", cdf_h), ("sim_threshold", sim_h)):
        if vals is None:
            ptrs.append(None)
            continue
        n = per_head_len(vals)
        if n != Hq:
            raise _arg_error("%s has %d per-head values but q has %d heads" % (name, n, Hq))
        ptr, obj = alloc.per_head(vals, like)
        keep.append(obj)
        ptrs.append(ptr)
    return _make_params(opts, ptrs), keep


def _make_params(opts: Options, ptrs: Sequence[Any]) -> C.SpargePredictParams:
    return C.SpargePredictParams(mode=opts.mode, topk=opts.topk, cdf_threshold=opts.cdf,
                                 sim_threshold=opts.sim, smooth_k=int(opts.smooth_k),
                                 attention_sink=int(opts.sink), local_window=int(opts.window),
                                 estimator=int(opts.estimator),
                                 topk_per_head=ptrs[0],
                                 cdf_threshold_per_head=ptrs[1], sim_threshold_per_head=ptrs[2],
                                 pv_threshold=opts.pv)


def out_shape(s: Shapes, layout: int) -> Tuple[int, int, int, int]:
    return (s.B, s.Hq, s.Lq, s.D) if layout == 0 else (s.B, s.Lq, s.Hq, s.D)


def check_mask(m: View, s: Shapes, plan: Plan, q: View) -> None:
    want = (s.B, s.Hq, plan.nqb, plan.nkb)
    if m.ndim != 4 or m.shape != want:
        raise _arg_error("mask must have shape [B, Hq, ceil(Lq/%d), ceil(Lkv/%d)] = %s, got %s"
                         % (plan.block_q, plan.block_k, want, m.shape))
    if m.dtype != C.DTYPE_UINT8:
        raise _arg_error("mask must be uint8 or bool, got %s" % m.src_dtype)
    if (m.device_type, m.device_id) != (q.device_type, q.device_id):
        raise _arg_error("mask is on %s but q is on %s" % (m.device_str(), q.device_str()))


def check_out(o: View, want: Tuple[int, ...], dtype: int, q: View, name: str = "out") -> None:
    """A caller's output buffer: exact shape, dtype and device; unit stride on the last dim."""
    if tuple(o.shape) != tuple(want):
        raise _arg_error("%s must have shape %s, got %s" % (name, tuple(want), tuple(o.shape)))
    if o.dtype != dtype:
        raise _arg_error("%s has dtype %s; expected %s" % (name, o.src_dtype, dtype_name(dtype)))
    if (o.device_type, o.device_id) != (q.device_type, q.device_id):
        raise _arg_error("%s is on %s but q is on %s" % (name, o.device_str(), q.device_str()))
    if o.ndim and o.strides[-1] != 1 and o.shape[-1] > 1:
        raise _arg_error("%s must have unit stride on its last dimension, got strides %s" % (name, o.strides))


def _workspace(alloc: Any, plan: Plan, q: View, stream: int, workspace: Optional[View]) -> Tuple[int, int, Any]:
    """(pointer, bytes, owner): the caller's buffer, else the allocator's cached one."""
    if workspace is None:
        ws, ws_obj = alloc.workspace(plan.workspace_bytes, q, stream)
        return ws, plan.workspace_bytes, ws_obj
    if (workspace.device_type, workspace.device_id) != (q.device_type, q.device_id):
        raise _arg_error("workspace is on %s but q is on %s" % (workspace.device_str(), q.device_str()))
    nbytes = workspace.nbytes()
    if nbytes < plan.workspace_bytes:
        raise C.WorkspaceTooSmallError("workspace has %d bytes; this plan needs %d (Plan.workspace_size)"
                                       % (nbytes, plan.workspace_bytes))
    return workspace.ptr, nbytes, workspace


def _check_plan(plan: Optional[Plan], s: Shapes, q: View, opts: Options) -> Plan:
    """The cached plan for this problem, or the caller's plan after checking it fits."""
    if plan is None:
        return get_plan(s, q, opts)
    key = plan_key(s, q, opts)
    if key[:9] != plan.key[:9]:
        names = ("B", "Hq", "Hkv", "Lq", "Lkv", "D", "dtype", "device_type", "device_id")
        diff = ["%s %s (plan: %s)" % (n, a, b) for n, a, b in zip(names, key, plan.key) if a != b]
        raise _arg_error("the inputs do not match the plan: " + ", ".join(diff))
    return plan


def predict(alloc: Any, q: View, k: View, s: Shapes, opts: Options, stream: int,
            topk_h: Any = None, cdf_h: Any = None, sim_h: Any = None, want_kept: bool = False,
            plan: Optional[Plan] = None, workspace: Optional[View] = None,
            out: Optional[Tuple[Any, View]] = None) -> Tuple[Any, Optional[Any], Plan]:
    """Runs sparge_predict_mask; returns (mask, kept or None, plan). ``out``: (object, view) of a
    caller's uint8 mask buffer."""
    plan = _check_plan(plan, s, q, opts)
    if out is not None:
        check_out(out[1], (s.B, s.Hq, plan.nqb, plan.nkb), C.DTYPE_UINT8, q)
        mask, mv = out
    else:
        mask, mv = alloc.empty((s.B, s.Hq, plan.nqb, plan.nkb), "uint8", q)
    kept, kv_ = (alloc.empty((s.B, s.Hq), "int32", q) if want_kept else (None, None))
    params, keep = _params(opts, alloc, q, s.Hq, topk_h, cdf_h, sim_h)
    ws, ws_bytes, ws_obj = _workspace(alloc, plan, q, stream, workspace)
    perm = PERM[opts.layout]
    qd, kd = q.descriptor(perm), k.descriptor(perm)
    md = mv.descriptor()
    kd_ = kv_.descriptor() if kv_ is not None else None
    st = C.lib.sparge_predict_mask(plan.handle, ctypes.byref(qd), ctypes.byref(kd), ctypes.byref(params),
                                   ctypes.byref(md), ctypes.byref(kd_) if kd_ is not None else None,
                                   ws, ws_bytes, stream or None)
    del keep, ws_obj
    C.check(st, "sparge_predict_mask")
    return mask, kept, plan


# sparge_tensor_t as packed bytes (void* data; int device_type, device_id, dtype, ndim; int64 shape[4],
# strides[4]: 88 bytes, no padding), so that a call builds one buffer for all its descriptors instead of
# a ctypes struct and two arrays per tensor. Checked against the ctypes mirror at import.
_DESC_FMT = "Qiiii4q4q"
_DESC_SIZE = struct.calcsize("=" + _DESC_FMT)
assert _DESC_SIZE == ctypes.sizeof(C.SpargeTensor)
_DESC_PACK = {n: struct.Struct("=" + _DESC_FMT * n).pack for n in range(1, 7)}
_PAD = (0, 0, 0, 0)


def _desc_fields(v: View, perm: Optional[Sequence[int]]) -> tuple:
    """The descriptor fields of ``v`` (dims reordered by ``perm``), in _DESC_FMT order."""
    shape, strides = v.shape, v.strides
    n = len(shape)
    if n > C.MAX_DIMS:
        raise C.InvalidArgumentError("tensor has %d dims; at most %d supported" % (n, C.MAX_DIMS))
    if perm is not None:
        a, b, c, d = perm
        shape = (shape[a], shape[b], shape[c], shape[d])
        strides = (strides[a], strides[b], strides[c], strides[d])
    elif n != 4:
        pad = _PAD[n:]
        shape = tuple(shape) + pad
        strides = tuple(strides) + pad
    return (v.ptr, v.device_type, v.device_id, v.dtype if v.dtype is not None else -1, n) + tuple(shape) + \
        tuple(strides)


def _descriptors(items: Sequence[Tuple[Optional[View], Optional[Sequence[int]]]]) -> Tuple[Any, list]:
    """(buffer, addresses): the descriptors of ``items`` ((view, perm) or (None, _)) in one buffer,
    with the address of each (None for an absent tensor). The buffer must outlive the call."""
    fields: tuple = ()
    n = 0
    for v, perm in items:
        if v is not None:
            fields += _desc_fields(v, perm)
            n += 1
    buf = ctypes.create_string_buffer(_DESC_PACK[n](*fields), n * _DESC_SIZE)
    addr = ctypes.addressof(buf)
    addrs: list = []
    for v, _ in items:
        if v is None:
            addrs.append(None)
        else:
            addrs.append(addr)
            addr += _DESC_SIZE
    return buf, addrs


_RUN_FN: Any = None


def _run_fn() -> Any:
    """sparge_attention_run taking the descriptors' and params' addresses as integers."""
    global _RUN_FN
    if _RUN_FN is None:
        vp = ctypes.c_void_p
        _RUN_FN = C.lib.raw("sparge_attention_run", [vp, vp, vp, vp, vp, vp, vp, vp, vp, ctypes.c_size_t, vp])
    return _RUN_FN


_RUN_FN_NOPROTO: Any = None


def _run_fn_noproto() -> Any:
    """sparge_attention_run without a prototype (argtypes None), for the prepared calls of
    _torch_ops: every argument is passed as a prebuilt ctypes object (c_void_p, c_size_t) or None,
    so that a call converts nothing (about half the time of a call through the prototype)."""
    global _RUN_FN_NOPROTO
    if _RUN_FN_NOPROTO is None:
        _RUN_FN_NOPROTO = C.lib.raw("sparge_attention_run", None)
    return _RUN_FN_NOPROTO


def attention(alloc: Any, q: View, k: View, v: View, s: Shapes, opts: Options, stream: int,
              mask: Optional[View] = None, topk_h: Any = None, cdf_h: Any = None, sim_h: Any = None,
              want_lse: bool = False, want_kept: bool = False, plan: Optional[Plan] = None,
              workspace: Optional[View] = None, out: Optional[Tuple[Any, View]] = None
              ) -> Tuple[Any, Optional[Any], Optional[Any], Plan]:
    """Runs sparge_attention_run; returns (out, lse or None, kept or None, plan).

    With ``want_kept`` (and no mask) the mask is predicted first by
    sparge_predict_mask so the kept-block counts are available. ``plan``: a plan made for
    this problem (default: the cached one); ``workspace``: a view of the caller's buffer
    (default: the allocator's cached one); ``out``: (object, view) of the caller's output.
    """
    plan = _check_plan(plan, s, q, opts)
    kept = None
    mask_keep = None
    if mask is None and want_kept:
        mask_obj, kept, _ = predict(alloc, q, k, s, opts, stream, topk_h, cdf_h, sim_h, True, plan,
                                    workspace=workspace)
        mask_keep = mask_obj
        mask = as_view(mask_obj, "mask")
    if mask is not None:
        check_mask(mask, s, plan, q)
    if out is not None:
        check_out(out[1], out_shape(s, opts.layout), q.dtype, q)
        out, ov = out
    else:
        out, ov = alloc.empty(out_shape(s, opts.layout), dtype_name(q.dtype), q)
    lse, lv = (alloc.empty((s.B, s.Hq, s.Lq), "float32", q) if want_lse else (None, None))
    params, keep = _params(opts, alloc, q, s.Hq, topk_h, cdf_h, sim_h)
    ws, ws_bytes, ws_obj = _workspace(alloc, plan, q, stream, workspace)
    perm = PERM[opts.layout]
    if perm == (0, 1, 2, 3):
        perm = None
    buf, (qa, ka, va, ma, oa, la) = _descriptors(((q, perm), (k, perm), (v, perm), (mask, None), (ov, perm),
                                                  (lv, None)))
    st = _run_fn()(plan.handle, qa, ka, va, ma, ctypes.addressof(params), oa, la, ws or None, ws_bytes,
                   stream or None)
    del keep, ws_obj, mask_keep, buf
    C.check(st, "sparge_attention_run")
    return out, lse, kept, plan
