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
          smooth_k: bool, sink: int, window: int, estimator: int, precision: int, block_q: int, block_k: int,
          pv: float) -> core.Options:
    return core.Options(layout, bool(causal), float(scale), int(mode), float(topk), float(cdf), float(sim),
                        bool(smooth_k), int(sink), int(window), int(estimator), int(precision), int(block_q),
                        int(block_k), float(pv))


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
                   pv: float, want_lse: bool, want_kept: bool) -> Tuple[Tensor, Tensor, Tensor]:
    opts = _opts(layout, causal, scale, mode, topk, cdf, sim, smooth_k, sink, window, estimator, precision, block_q,
                 block_k, pv)
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
                   pv: float, want_lse: bool, want_kept: bool) -> Tuple[Tensor, Tensor, Tensor]:
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
                 smooth_k: bool, sink: int, window: int, estimator: int, precision: int, block_q: int, block_k: int,
                 pv: float) -> Tuple[Tensor, Tensor]:
    opts = _opts(layout, causal, scale, mode, topk, cdf, sim, smooth_k, sink, window, estimator, precision, block_q,
                 block_k, pv)
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
                 smooth_k: bool, sink: int, window: int, estimator: int, precision: int, block_q: int, block_k: int,
                 pv: float) -> Tuple[Tensor, Tensor]:
    p = core.PERM[layout]
    B, Hq, Lq = q.shape[p[0]], q.shape[p[1]], q.shape[p[2]]
    Lkv = k.shape[p[2]]
    bq = block_q if block_q > 0 else 128
    bk = block_k if block_k > 0 else 64
    mask = q.new_empty((B, Hq, (Lq + bq - 1) // bq, (Lkv + bk - 1) // bk), dtype=torch.uint8)
    kept = q.new_empty((B, Hq), dtype=torch.int32)
    return mask, kept


# ------------------------------------------------------------------ no backward
# The library computes attention for inference only. A call that autograd records (grad mode on and
# an input that requires grad: a model evaluated without torch.no_grad) returns outputs whose
# backward raises, instead of outputs silently cut from the graph (which would train everything
# upstream of attention on zero gradients without a word).
NO_BACKWARD = ("libsparge computes attention for inference only: it has no backward. Run the forward under "
               "torch.no_grad() or torch.inference_mode(), or use torch's scaled_dot_product_attention where "
               "gradients are needed")
_grad_enabled = torch.is_grad_enabled


def needs_grad(*tensors: Any) -> bool:
    """True when autograd records a call on these torch tensors (None entries skipped)."""
    for t in tensors:
        if t is not None and t.requires_grad:
            return _grad_enabled()
    return False


def refuse_out(grad: bool, what: str, *outs: Any) -> None:
    """torch's out= rule: a caller's output (``outs``, None entries skipped) is refused when the call
    records (``grad``) or an output itself requires grad, in grad mode."""
    given = [o for o in outs if isinstance(o, Tensor)]
    if given and (grad or needs_grad(*given)):
        raise C.UnsupportedError("%s with arguments that require grad (grad mode on): %s" % (what, NO_BACKWARD))


def no_backward(inputs: Any, *results: Any) -> Tuple[Any, ...]:
    """``results`` (None entries kept) as outputs of a node on those of ``inputs`` that require grad,
    whose backward raises."""
    ins = [t for t in inputs if t.requires_grad]
    return tuple(None if r is None else NoBackward.apply(r, *ins) for r in results)


class NoBackward(torch.autograd.Function):
    """``NoBackward.apply(res, *inputs)``: ``res`` as the output of a node on ``inputs`` whose
    backward raises (for calls that bypass the custom op: torch < 2.4, merge_states)."""

    @staticmethod
    def forward(ctx: Any, res: Tensor, *inputs: Any) -> Tensor:
        return res.detach()  # (not a view: in-place ops on the result stay allowed, as on the custom op's)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise C.UnsupportedError(NO_BACKWARD)


def no_backward_impl(grad: Tensor, q_shape: List[int], k_shape: List[int], v_shape: List[int]
                     ) -> Tuple[Tensor, Tensor, Tensor]:
    raise C.UnsupportedError("sparge.attention: " + NO_BACKWARD)


def no_backward_fake(grad: Tensor, q_shape: List[int], k_shape: List[int], v_shape: List[int]
                     ) -> Tuple[Tensor, Tensor, Tensor]:
    return grad.new_empty(q_shape), grad.new_empty(k_shape), grad.new_empty(v_shape)


def _attention_backward(ctx: Any, *grads: Any) -> Any:
    # Raises when the backward runs, not when torch.compile's AOTAutograd traces it (the default
    # backends trace the joint graph at the first call with inputs that require grad).
    gq, gk, gv = no_backward_call(grads[0], *ctx.qkv_shapes)
    return (gq, gk, gv) + (None,) * (ctx.n_inputs - 3)


def _attention_setup_context(ctx: Any, inputs: Any, output: Any) -> None:
    ctx.qkv_shapes = tuple(list(t.shape) for t in inputs[:3])  # (shapes only: no input kept alive)
    ctx.n_inputs = len(inputs)


if HAS_CUSTOM_OP:
    attention_op = torch.library.custom_op("sparge::attention", mutates_args=())(attention_impl)
    attention_op.register_fake(attention_fake)
    no_backward_op = torch.library.custom_op("sparge::no_backward", mutates_args=())(no_backward_impl)
    no_backward_op.register_fake(no_backward_fake)
    no_backward_call = torch.ops.sparge.no_backward.default
    if hasattr(attention_op, "register_autograd"):
        attention_op.register_autograd(_attention_backward, setup_context=_attention_setup_context)
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


_Parameter = torch.nn.Parameter  # (a plain tensor to dispatch: no __torch_function__ of its own)


def eager_direct_ok(*tensors: Any) -> bool:
    """True when calling the library directly is indistinguishable from the custom op: plain
    tensors, not tracing or compiling, no dispatch mode (FakeTensor, functionalization) active."""
    if _is_compiling is not None and _is_compiling():
        return False
    if _len_modes is not None and _len_modes():
        return False
    for t in tensors:
        if t is not None and type(t) is not Tensor and type(t) is not _Parameter:
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
#
# A hit costs what it must read (five properties of each tensor, the thread, the stream), one dict
# look-up, the output allocation and the library call, little more:
# - the key is a flat tuple of the values that are cheap to hash (options, thread, stream, q's
#   device, the data pointers); the tensors' other properties (``meta``: shapes, strides, dtypes,
#   devices) are compared with the entry's, not hashed. A caller's output, rare, nests both. An
#   entry whose meta differs is built again and replaces the old one;
# - an entry is a plain tuple, unpacked at once;
# - the output is torch.empty_like(q) when q is dense with the output's strides (a contiguous q:
#   empty_like then takes torch's cheapest allocation path, empty_strided with q's strides, which
#   the meta fixes), else, like the LSE, torch.empty_like of a template: one element expanded to
#   the output's shape, which is not dense, so empty_like makes a new contiguous tensor. Either is
#   checked against new_empty(shape, dtype=...), the general path's allocation, when the entry is
#   built;
# - the library function has no prototype (argtypes None) and the entry's arguments are prebuilt
#   ctypes objects (c_void_p, c_size_t), so a call converts nothing.

_U8, _BOOL, _F32 = torch.uint8, torch.bool, torch.float32
_empty_like = torch.empty_like
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
_CUDA_FAST = _raw_stream is not None and _get_device is not None and _capturing is not None
_get_ident = threading.get_ident
_VP, _SIZE_T = ctypes.c_void_p, ctypes.c_size_t
# torch.empty_like propagates dimension names (torch versions with named tensors): a q template
# would then give a named output where new_empty gives none.
_NAMED = hasattr(Tensor, "refine_names")


def _false() -> bool:
    return False


def _zero() -> int:
    return 0


# (the fast path calls these unconditionally; torch.compiler.is_compiling itself, so that dynamo
# recognizes it while tracing)
_is_compiling_fast = _is_compiling if _is_compiling is not None else _false
_len_modes_fast = _len_modes if _len_modes is not None else _zero

_CALLS: dict = {}
_CALLS_CAPACITY = 256
_CALLS_LOCK = threading.Lock()
# One-element tensors per (device, dtype), expanded into the entries' output templates (a template
# costs no memory of its own).
_BASES: dict = {}


def _template(like: Tensor, shape: Tuple[int, ...], dtype: Any) -> Tuple[Any, Tensor]:
    """(template, first): ``first`` is like.new_empty(shape, dtype=dtype), the general path's output,
    and torch.empty_like(template) makes a tensor with its shape, strides, dtype and device. The
    template is False when empty_like of the expanded tensor would not (then the entry allocates
    with new_empty)."""
    first = like.new_empty(shape, dtype=dtype)
    key = (first.device, dtype)
    base = _BASES.get(key)
    if base is None:
        base = _BASES[key] = like.new_empty((1,), dtype=dtype)
    tmpl = base.expand(shape)
    t = _empty_like(tmpl)
    if (t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype
            or t.device != first.device or t.requires_grad or first.requires_grad):
        tmpl = False
    return tmpl, first


def _build_call(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], out: Optional[Tensor], r: Any,
                want_lse: bool, stream: int) -> Tuple[tuple, Tensor, Optional[Tensor]]:
    """The checks of run_attention and core.attention, in their order, for a key's first call:
    (the entry, this call's output, its LSE or None), the entry's descriptors set for those two.

    An entry is the tuple (fn, args, plan_ref, ws_ref, ws_get, ws_key, out_slot, out_tmpl, lse_slot,
    lse_tmpl, keep): ``fn(*args)`` is the library call; ``plan_ref``/``ws_ref`` weak references to
    the plan and the workspace buffer (``ws_ref`` None: no workspace), ``ws_get(ws_key)`` the
    allocator's current buffer; ``out_slot``/``lse_slot`` the descriptors' data fields of the output
    and the LSE (None: the caller's output / no LSE), ``out_tmpl``/``lse_tmpl`` their templates
    (_template; for the output None: empty_like(q), False: new_empty); ``keep`` what the arguments
    point into and the shapes of the output and the LSE. fast_attention stores it with the key's
    meta in front."""
    opts = r.opts
    qv, kv, vv = torch_view(q), torch_view(k), torch_view(v)
    s = core.check_qkv(qv, kv, vv, opts.layout)
    mv = torch_view(mask) if mask is not None else None  # a bool mask: the same bytes as its uint8 view
    ov = torch_view(out) if out is not None else None
    plan = core._check_plan(None, s, qv, opts)
    if mv is not None:
        core.check_mask(mv, s, plan, qv)
    oshape = core.out_shape(s, opts.layout)
    out_tmpl = lse_tmpl = None
    if out is not None:
        core.check_out(ov, oshape, qv.dtype, qv)
        res = out
    else:  # the general path's output: contiguous, q's shape and dtype
        out_tmpl, res = _template(q, oshape, q.dtype)
        if not _NAMED and tuple(oshape) == tuple(q.shape) and q.stride() == res.stride():
            # q itself: dense with those strides (the common case: a contiguous q), so empty_like(q)
            # is the same allocation through torch's cheapest path (empty_strided with q's strides,
            # which the entry's meta fixes)
            t = _empty_like(q)
            if (t.shape == res.shape and t.stride() == res.stride() and t.dtype == res.dtype and t.device == res.device
                    and not t.requires_grad):
                out_tmpl = None  # (not q itself: an entry must not keep q's memory)
        ov = torch_view(res)
    lshape = (s.B, s.Hq, s.Lq)
    lse = lv = None
    if want_lse:
        lse_tmpl, lse = _template(q, lshape, _F32)
        lv = torch_view(lse)
    alloc = torch_allocator()
    params, _ = core._params(opts, alloc, qv, s.Hq, None, None, None)
    ws, ws_bytes, ws_obj = core._workspace(alloc, plan, qv, stream, None)
    perm = core.PERM[opts.layout]
    if perm == (0, 1, 2, 3):
        perm = None
    buf, (qa, ka, va, ma, oa, la) = core._descriptors(((qv, perm), (kv, perm), (vv, perm), (mv, None), (ov, perm),
                                                       (lv, None)))

    def vp(x: Optional[int]) -> Any:
        return _VP(x) if x else None

    args = (vp(plan.handle), vp(qa), vp(ka), vp(va), vp(ma), vp(ctypes.addressof(params)), vp(oa), vp(la), vp(ws),
            _SIZE_T(ws_bytes), vp(stream))
    ws_ref = ws_get = ws_key = None
    if ws_obj is not None:  # the allocator's buffer of this stream (CUDA) or thread (CPU)
        ws_ref = weakref.ref(ws_obj)
        if qv.device_type == C.DEVICE_CPU:
            ws_get, ws_key = alloc._host._bufs.get, _get_ident()
        else:
            ws_get, ws_key = alloc._ws._d.get, (qv.device_id, int(stream))
    out_slot = lse_slot = None
    if out is None:
        out_slot = ctypes.c_uint64.from_buffer(buf, oa - ctypes.addressof(buf))  # sparge_tensor_t.data
    if want_lse:
        lse_slot = ctypes.c_uint64.from_buffer(buf, la - ctypes.addressof(buf))
    c = (core._run_fn_noproto(), args, weakref.ref(plan), ws_ref, ws_get, ws_key, out_slot, out_tmpl, lse_slot,
         lse_tmpl, (buf, params, oshape, lshape))
    return c, res, lse


def _remember(key: tuple, c: tuple) -> None:
    with _CALLS_LOCK:
        if key not in _CALLS and len(_CALLS) >= _CALLS_CAPACITY:
            for old in _CALLS:  # the oldest entry (dicts keep insertion order)
                break
            del _CALLS[old]
        _CALLS[key] = c


def clear_calls() -> None:
    with _CALLS_LOCK:
        _CALLS.clear()
        _BASES.clear()


def fast_attention(q: Any, k: Any, v: Any, r: Any, mask: Any, out: Any, return_lse: Any) -> Any:
    """``sparge.attention``'s result for an eager torch call through the cache above, or None when
    this call is not one for it (the caller then takes the general path)."""
    if _is_compiling_fast() or _len_modes_fast():
        return None
    if type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor or not r.shared:
        return None
    if (q.requires_grad or k.requires_grad or v.requires_grad) and _grad_enabled():
        return None  # the custom op's path: its outputs' backward raises (NO_BACKWARD)
    want_lse = True if return_lse else False
    # The key: the options, the thread, the stream, q's device and the data pointers (cheap to hash);
    # the entry's ``meta``: shapes, strides, dtypes and devices, compared, not hashed. An entry whose
    # meta differs is built again and replaces the old one (one entry per key).
    try:
        if q.is_cuda:
            if not _CUDA_FAST:
                return None
            dev = q.get_device()  # an int: never equal to the torch.device of a key of another device
            if dev != _get_device() or _capturing():
                return None
            stream = _raw_stream(dev)
        else:
            dev = q.device
            stream = 0
        if mask is None:
            key = (r, want_lse, _get_ident(), stream, dev, q.data_ptr(), k.data_ptr(), v.data_ptr())
            meta = (q.shape, q.stride(), q.dtype, k.shape, k.stride(), k.dtype, k.device,
                    v.shape, v.stride(), v.dtype, v.device)
        else:
            if type(mask) is not Tensor:
                return None
            md = mask.dtype
            if md is not _U8 and md is not _BOOL:  # other dtypes are converted by the general path
                return None
            key = (r, want_lse, _get_ident(), stream, dev, q.data_ptr(), k.data_ptr(), v.data_ptr(), mask.data_ptr())
            meta = (q.shape, q.stride(), q.dtype, k.shape, k.stride(), k.dtype, k.device,
                    v.shape, v.stride(), v.dtype, v.device, mask.shape, mask.stride(), md, mask.device)
        if out is not None:
            if type(out) is not Tensor or out.requires_grad:  # (the general path refuses the latter)
                return None
            key = (key, out.data_ptr())
            meta = (meta, out.shape, out.stride(), out.dtype, out.device)
    except Exception:  # whatever the general path makes of these tensors
        return None
    c = _CALLS.get(key)
    if c is not None and c[0] == meta:
        _, fn, args, plan_ref, ws_ref, ws_get, ws_key, out_slot, out_tmpl, lse_slot, lse_tmpl, keep = c
        # plan and ws stay referenced until the call has returned (the workspace is not freed meanwhile).
        plan = plan_ref()
        if ws_ref is None:
            ws = None
        else:
            ws = ws_ref()
            if ws is None or ws_get(ws_key) is not ws:
                plan = None  # the allocator replaced the workspace: check again
        if plan is not None:  # (else PLANS evicted the plan: check again)
            if out_slot is None:
                res = out
            else:
                if out_tmpl is None:
                    res = _empty_like(q)
                elif out_tmpl is not False:
                    res = _empty_like(out_tmpl)
                else:
                    res = q.new_empty(keep[2])
                out_slot.value = res.data_ptr()
            if lse_slot is not None:
                lse = _empty_like(lse_tmpl) if lse_tmpl is not False else q.new_empty(keep[3], dtype=_F32)
                lse_slot.value = lse.data_ptr()
            st = fn(*args)
            if st:
                C.check(st, "sparge_attention_run")
            return res if lse_slot is None else (res, lse)
    try:
        c, res, lse = _build_call(q, k, v, mask, out, r, want_lse, stream)
    except Exception:
        return None  # the general path raises its error
    plan = c[2]()
    ws = c[3]() if c[3] is not None else None
    if plan is None or (c[3] is not None and ws is None):
        return None
    _remember(key, (meta,) + c)
    st = c[0](*c[1])
    if st:
        C.check(st, "sparge_attention_run")
    return (res, lse) if want_lse else res


__all__ = ["attention_call", "predict_call", "run_attention", "run_predict", "eager_direct_ok", "fast_attention",
           "needs_grad", "refuse_out", "no_backward", "NoBackward", "NO_BACKWARD",
           "clear_calls", "HAS_CUSTOM_OP", "C"]
