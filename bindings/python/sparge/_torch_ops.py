"""torch custom ops ``sparge::attention`` and ``sparge::predict_mask``.

Registered through ``torch.library.custom_op`` (torch >= 2.4) with fake
(meta) implementations, so ``torch.compile(fullgraph=True)`` traces them as
single opaque nodes and CUDA graph capture records the library's kernels. The
real implementations call the C library on torch's current stream, with
workspaces from torch's caching allocator. This module imports torch, so it is
only imported once torch is.

(No ``from __future__ import annotations`` here: custom_op reads the real
annotations to infer the operator schema.)
"""

import ctypes
import threading
import weakref
from typing import Any, List, Optional, Tuple

import torch
from torch import Tensor

from . import _capi as C
from . import _core as core
from ._arrays import torch_allocator, torch_view

HAS_CUSTOM_OP = hasattr(torch.library, "custom_op") and hasattr(torch.library, "register_fake")


def _opts(layout: int, causal: bool, scale: float, mode: int, topk: float, cdf: float, sim: float,
          smooth_k: bool, sink: int, window: int, estimator: int, precision: int, block_q: int, block_k: int) -> core.Options:
    return core.Options(layout, bool(causal), float(scale), int(mode), float(topk), float(cdf), float(sim),
                        bool(smooth_k), int(sink), int(window), int(estimator), int(precision), int(block_q),
                        int(block_k))


def _per_head(t: Optional[Tensor], lst: Optional[List[float]]) -> Any:
    return t if t is not None else lst


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


_get_device = getattr(torch._C, "_cuda_getDevice", None)


def _current_device() -> int:
    """torch.cuda.current_device() (which is this call after its lazy-init check; a CUDA tensor
    exists here, so CUDA is initialized)."""
    if _get_device is not None:
        return _get_device()
    return torch.cuda.current_device()


def _current_stream(index: int) -> int:
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


def _on_device(q: Tensor, fn: Any) -> Any:
    """Runs fn(stream) with q's CUDA device current (kernels launch on the current device)."""
    if not q.is_cuda:
        return fn(0)
    index = q.get_device()
    if index == _current_device():
        return fn(_current_stream(index))
    with torch.cuda.device(index):
        return fn(_current_stream(index))


def run_attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], heads: Tuple[Any, Any, Any],
                  opts: core.Options, want_lse: bool, want_kept: bool, out: Optional[Tensor] = None,
                  plan: Any = None, workspace: Any = None) -> Tuple[Tensor, Any, Any]:
    """The library call on torch tensors: (out, lse or None, kept or None). ``out``: write into
    this tensor; ``plan``/``workspace``: a caller's plan (core.Plan) and workspace view."""
    qv, kv, vv = torch_view(q), torch_view(k), torch_view(v)
    s = core.check_qkv(qv, kv, vv, opts.layout)
    mv = torch_view(mask) if mask is not None else None
    ov = (out, torch_view(out)) if out is not None else None

    def call(stream: int) -> Tuple[Tensor, Any, Any]:
        res, lse, kept, _ = core.attention(
            torch_allocator(), qv, kv, vv, s, opts, stream, mask=mv, topk_h=heads[0], cdf_h=heads[1],
            sim_h=heads[2], want_lse=want_lse, want_kept=want_kept and mask is None, plan=plan,
            workspace=workspace, out=ov)
        return res, lse, kept

    return _on_device(q, call)


def attention_impl(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
                   topk_t: Optional[Tensor], cdf_t: Optional[Tensor], sim_t: Optional[Tensor],
                   topk_l: Optional[List[float]], cdf_l: Optional[List[float]], sim_l: Optional[List[float]],
                   layout: int, causal: bool, scale: float, mode: int, topk: float, cdf: float, sim: float,
                   smooth_k: bool, sink: int, window: int, estimator: int, precision: int, block_q: int, block_k: int,
                   want_lse: bool, want_kept: bool) -> Tuple[Tensor, Tensor, Tensor]:
    opts = _opts(layout, causal, scale, mode, topk, cdf, sim, smooth_k, sink, window, estimator, precision, block_q, block_k)
    heads = (_per_head(topk_t, topk_l), _per_head(cdf_t, cdf_l), _per_head(sim_t, sim_l))
    out, lse, kept = run_attention(q, k, v, mask, heads, opts, want_lse, want_kept)
    if lse is None:
        lse = q.new_empty((0,), dtype=torch.float32)
    if kept is None:
        kept = q.new_empty((0,), dtype=torch.int32)
    return out, lse, kept


def attention_fake(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
                   topk_t: Optional[Tensor], cdf_t: Optional[Tensor], sim_t: Optional[Tensor],
                   topk_l: Optional[List[float]], cdf_l: Optional[List[float]], sim_l: Optional[List[float]],
                   layout: int, causal: bool, scale: float, mode: int, topk: float, cdf: float, sim: float,
                   smooth_k: bool, sink: int, window: int, estimator: int, precision: int, block_q: int, block_k: int,
                   want_lse: bool, want_kept: bool) -> Tuple[Tensor, Tensor, Tensor]:
    p = core.PERM[layout]
    B, Hq, Lq = q.shape[p[0]], q.shape[p[1]], q.shape[p[2]]
    out = q.new_empty(q.shape)
    lse = q.new_empty((B, Hq, Lq) if want_lse else (0,), dtype=torch.float32)
    kept = q.new_empty((B, Hq) if (want_kept and mask is None) else (0,), dtype=torch.int32)
    return out, lse, kept


def run_predict(q: Tensor, qv: Any, kv: Any, s: core.Shapes, opts: core.Options, heads: Tuple[Any, Any, Any],
                plan: Any, workspace: Any, out: Any) -> Tuple[Tensor, Tensor]:
    """sparge_predict_mask on torch tensors with a caller's plan, workspace or output."""

    def call(stream: int) -> Tuple[Tensor, Tensor]:
        mask, kept, _ = core.predict(torch_allocator(), qv, kv, s, opts, stream, heads[0], heads[1], heads[2],
                                     want_kept=True, plan=plan, workspace=workspace, out=out)
        return mask, kept

    return _on_device(q, call)


def predict_impl(q: Tensor, k: Tensor,
                 topk_t: Optional[Tensor], cdf_t: Optional[Tensor], sim_t: Optional[Tensor],
                 topk_l: Optional[List[float]], cdf_l: Optional[List[float]], sim_l: Optional[List[float]],
                 layout: int, causal: bool, scale: float, mode: int, topk: float, cdf: float, sim: float,
                 smooth_k: bool, sink: int, window: int, estimator: int, precision: int, block_q: int, block_k: int
                 ) -> Tuple[Tensor, Tensor]:
    opts = _opts(layout, causal, scale, mode, topk, cdf, sim, smooth_k, sink, window, estimator, precision, block_q, block_k)
    qv, kv = torch_view(q), torch_view(k)
    s = core.check_qkv(qv, kv, None, layout)

    def call(stream: int) -> Tuple[Tensor, Tensor]:
        mask, kept, _ = core.predict(torch_allocator(), qv, kv, s, opts, stream,
                                     _per_head(topk_t, topk_l), _per_head(cdf_t, cdf_l),
                                     _per_head(sim_t, sim_l), want_kept=True)
        return mask, kept

    return _on_device(q, call)


def predict_fake(q: Tensor, k: Tensor,
                 topk_t: Optional[Tensor], cdf_t: Optional[Tensor], sim_t: Optional[Tensor],
                 topk_l: Optional[List[float]], cdf_l: Optional[List[float]], sim_l: Optional[List[float]],
                 layout: int, causal: bool, scale: float, mode: int, topk: float, cdf: float, sim: float,
                 smooth_k: bool, sink: int, window: int, estimator: int, precision: int, block_q: int, block_k: int
                 ) -> Tuple[Tensor, Tensor]:
    p = core.PERM[layout]
    B, Hq, Lq = q.shape[p[0]], q.shape[p[1]], q.shape[p[2]]
    Lkv = k.shape[p[2]]
    bq = block_q if block_q > 0 else 128
    bk = block_k if block_k > 0 else 64
    mask = q.new_empty((B, Hq, (Lq + bq - 1) // bq, (Lkv + bk - 1) // bk), dtype=torch.uint8)
    kept = q.new_empty((B, Hq), dtype=torch.int32)
    return mask, kept


if HAS_CUSTOM_OP:
    attention_op = torch.library.custom_op("sparge::attention", mutates_args=())(attention_impl)
    attention_op.register_fake(attention_fake)
    predict_op = torch.library.custom_op("sparge::predict_mask", mutates_args=())(predict_impl)
    predict_op.register_fake(predict_fake)
    attention_call = torch.ops.sparge.attention.default
    predict_call = torch.ops.sparge.predict_mask.default
else:  # torch < 2.4: plain eager calls (no torch.compile integration)
    attention_call = attention_impl
    predict_call = predict_impl

# The number of active torch dispatch modes (the C function's name differs between torch versions).
_len_modes = getattr(torch._C, "_len_torch_dispatch_mode", None) or getattr(torch._C, "_len_torch_dispatch_stack",
                                                                            None)
_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)


def eager_direct_ok(*tensors: Any) -> bool:
    """True when calling the library directly is indistinguishable from the custom op: plain
    tensors, not tracing or compiling, no dispatch mode (FakeTensor, functionalization) active."""
    if _is_compiling is not None and _is_compiling():
        return False
    if _len_modes is not None and _len_modes():
        return False
    for t in tensors:
        if t is not None and type(t) is not Tensor:
            return False
    return True


# ------------------------------------------------------------------ the cached eager call
# An eager sparge.attention / sparge.sdpa call on plain torch tensors, with options of
# _resolve_cached (no per-head values), no plan or workspace of the caller and no density asked
# for, is keyed by everything that determines what the general path would check and pass to
# sparge_attention_run: the resolved options (their shared object), whether the LSE is returned,
# the thread, the stream, and data_ptr, shape, strides, dtype and device of q, k, v, the mask and
# a caller's output. The first call with a key runs the general path's checks (the same functions;
# a check that fails hands the call to the general path, which raises its usual error) and keeps
# what they produced: the plan, the predict parameters, the workspace and the packed descriptors.
# A later call with the same key allocates the output (and LSE), writes their addresses into its
# descriptors and calls the library: the checks of the first call hold again because every input
# they read is part of the key. The library still runs its own argument checks on every call.
#
# Per thread (the thread is part of the key), because a call writes its output addresses into the
# entry's descriptor buffer. The plan and the workspace are held weakly and looked up again on every
# call: an entry never keeps a plan that PLANS evicted or a workspace that the allocator replaced
# (either sends the call through the checks again). CUDA graph capture, a CUDA device that is not
# the current one, torch.compile tracing and dispatch modes take the general path.

_U8, _BOOL, _F32 = torch.uint8, torch.bool, torch.float32
_CONTIGUOUS = torch.contiguous_format
_empty_like = torch.empty_like
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
_CUDA_FAST = _raw_stream is not None and _get_device is not None and _capturing is not None
_get_ident = threading.get_ident

_CALLS: dict = {}
_CALLS_CAPACITY = 256
_CALLS_LOCK = threading.Lock()


class _Call:
    """What the checks of a key's first call produced, ready to be passed to the library again."""

    __slots__ = ("fn", "args", "buf", "params", "plan_ref", "ws_ref", "ws_get", "ws_key", "out_slot", "lse_slot",
                 "lse_shape")

    def __init__(self) -> None:
        self.out_slot: Any = None
        self.lse_slot: Any = None


def _build_call(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], out: Optional[Tensor], r: Any,
                want_lse: bool, stream: int) -> Tuple[_Call, Tensor, Optional[Tensor]]:
    """The checks of run_attention and core.attention, in their order, for a key's first call:
    (the entry, this call's output, its LSE or None), the entry's descriptors set for those two."""
    opts = r.opts
    qv, kv, vv = torch_view(q), torch_view(k), torch_view(v)
    s = core.check_qkv(qv, kv, vv, opts.layout)
    mv = torch_view(mask) if mask is not None else None  # a bool mask: the same bytes as its uint8 view
    ov = torch_view(out) if out is not None else None
    plan = core._check_plan(None, s, qv, opts)
    if mv is not None:
        core.check_mask(mv, s, plan, qv)
    if out is not None:
        core.check_out(ov, core.out_shape(s, opts.layout), qv.dtype, qv)
        res = out
    else:  # the output of every later call has the strides of this one (contiguous, q's shape)
        res = _empty_like(q, memory_format=_CONTIGUOUS)
        ov = torch_view(res)
    lshape = (s.B, s.Hq, s.Lq)
    lse = q.new_empty(lshape, dtype=_F32) if want_lse else None
    lv = torch_view(lse) if lse is not None else None
    alloc = torch_allocator()
    params, _ = core._params(opts, alloc, qv, s.Hq, None, None, None)
    ws, ws_bytes, ws_obj = core._workspace(alloc, plan, qv, stream, None)
    perm = core.PERM[opts.layout]
    if perm == (0, 1, 2, 3):
        perm = None
    buf, (qa, ka, va, ma, oa, la) = core._descriptors(((qv, perm), (kv, perm), (vv, perm), (mv, None), (ov, perm),
                                                       (lv, None)))
    c = _Call()
    c.fn = core._run_fn()
    c.args = (plan.handle, qa, ka, va, ma, ctypes.addressof(params), oa, la, ws or None, ws_bytes, stream or None)
    c.buf, c.params = buf, params
    c.plan_ref = weakref.ref(plan)
    c.ws_get = c.ws_ref = c.ws_key = None
    if ws_obj is not None:  # the allocator's buffer of this stream (CUDA) or thread (CPU)
        c.ws_ref = weakref.ref(ws_obj)
        if qv.device_type == C.DEVICE_CPU:
            c.ws_get, c.ws_key = alloc._host._bufs.get, _get_ident()
        else:
            c.ws_get, c.ws_key = alloc._ws._d.get, (qv.device_id, int(stream))
    if out is None:
        c.out_slot = ctypes.c_uint64.from_buffer(buf, oa - ctypes.addressof(buf))  # sparge_tensor_t.data
    if want_lse:
        c.lse_slot = ctypes.c_uint64.from_buffer(buf, la - ctypes.addressof(buf))
        c.lse_shape = lshape
    return c, res, lse


def _remember(key: tuple, c: _Call) -> None:
    with _CALLS_LOCK:
        if key not in _CALLS and len(_CALLS) >= _CALLS_CAPACITY:
            for old in _CALLS:  # the oldest entry (dicts keep insertion order)
                break
            del _CALLS[old]
        _CALLS[key] = c


def clear_calls() -> None:
    with _CALLS_LOCK:
        _CALLS.clear()


def fast_attention(q: Any, k: Any, v: Any, r: Any, mask: Any, out: Any, return_lse: Any) -> Any:
    """``sparge.attention``'s result for an eager torch call through the cache above, or None when
    this call is not one for it (the caller then takes the general path)."""
    if _is_compiling is not None and _is_compiling():
        return None
    if _len_modes is not None and _len_modes():
        return None
    if not r.shared or type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor:
        return None
    want_lse = bool(return_lse)
    try:
        if q.is_cuda:
            if not _CUDA_FAST:
                return None
            index = q.get_device()
            if index != _get_device() or _capturing():
                return None
            stream = _raw_stream(index)
        else:
            stream = 0
        if mask is None:
            mk = None
        else:
            if type(mask) is not Tensor:
                return None
            md = mask.dtype
            if md is not _U8 and md is not _BOOL:  # other dtypes are converted by the general path
                return None
            mk = (mask.data_ptr(), mask.shape, mask.stride(), md, mask.device)
        if out is None:
            ok = None
        else:
            if type(out) is not Tensor:
                return None
            ok = (out.data_ptr(), out.shape, out.stride(), out.dtype, out.device)
        key = (r, want_lse, _get_ident(), stream,
               q.data_ptr(), q.shape, q.stride(), q.dtype, q.device,
               k.data_ptr(), k.shape, k.stride(), k.dtype, k.device,
               v.data_ptr(), v.shape, v.stride(), v.dtype, v.device, mk, ok)
    except Exception:  # whatever the general path makes of these tensors
        return None
    c = _CALLS.get(key)
    if c is not None:
        plan = c.plan_ref()
        if c.ws_get is None:
            ws = None
        else:
            ws = c.ws_ref()
            if ws is None or c.ws_get(c.ws_key) is not ws:
                c = None  # the allocator replaced the workspace: check again
        if plan is None:
            c = None  # PLANS evicted the plan: check again
    if c is None:
        try:
            c, res, lse = _build_call(q, k, v, mask, out, r, want_lse, stream)
        except Exception:
            return None  # the general path raises its error
        plan = c.plan_ref()
        ws = c.ws_ref() if c.ws_ref is not None else None
        if plan is None or (c.ws_ref is not None and ws is None):
            return None
        _remember(key, c)
    else:
        if c.out_slot is not None:
            res = _empty_like(q, memory_format=_CONTIGUOUS)
            c.out_slot.value = res.data_ptr()
        else:
            res = out
        if want_lse:
            lse = q.new_empty(c.lse_shape, dtype=_F32)
            c.lse_slot.value = lse.data_ptr()
    # plan and ws stay referenced until the call has returned (the workspace is not freed meanwhile).
    st = c.fn(*c.args)
    if st:
        C.check(st, "sparge_attention_run")
    return (res, lse) if want_lse else res


__all__ = ["attention_call", "predict_call", "run_attention", "run_predict", "eager_direct_ok", "fast_attention",
           "clear_calls", "HAS_CUSTOM_OP", "C"]
