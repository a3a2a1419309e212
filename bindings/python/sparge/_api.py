"""The public functions: attention, predict_mask, block_sparse_attention."""

from __future__ import annotations

import math
import sys
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _capi as C
from . import _core as core
from ._arrays import allocator_for, as_view

ArrayLike = Any
PerHead = Union[float, Sequence[float], Any]

_TORCH: Any = None

#: Eager calls on plain torch tensors (not compiling, no dispatch mode active) call the library
#: directly instead of dispatching through ``torch.ops.sparge.attention``; same result, less host
#: time. Set to False to always dispatch through the custom op.
EAGER_DIRECT = True


def _torch() -> Any:
    """torch if the program imported it (sparge never imports torch by itself)."""
    global _TORCH
    if _TORCH is None:
        _TORCH = sys.modules.get("torch")
    return _TORCH


def _records_grad(*ts: Any) -> bool:
    """True for torch tensors of a call that autograd records (grad mode on, one requires grad)."""
    return _is_torch(ts[0]) and _ops().needs_grad(*ts)


def _is_torch(x: Any) -> bool:
    t = _torch()
    return t is not None and isinstance(x, t.Tensor)


FUNC_TRANSFORMS = ("torch.func transforms (vmap, grad, jacrev, ...) are not supported: libsparge's attention is an "
                   "inference op with neither a batching rule nor a backward. Call it on the batched tensors "
                   "directly (it takes a batch dimension), under torch.no_grad() or torch.inference_mode()")


def _under_func_transform(*ts: Any) -> bool:
    """True when a torch tensor among ``ts`` is a torch.func (functorch) wrapper (vmap's batched
    tensors, grad's tracking tensors)."""
    t = _torch()
    wrapped = getattr(getattr(getattr(t, "_C", None), "_functorch", None), "is_functorch_wrapped_tensor", None)
    return wrapped is not None and any(isinstance(x, t.Tensor) and wrapped(x) for x in ts)


_OPS: Any = None
#: ``_torch_ops.fast_attention`` once torch tensors have been seen (None until then).
_FAST: Any = None


def _ops() -> Any:
    global _OPS, _FAST
    if _OPS is None:
        from . import _torch_ops

        _OPS = _torch_ops
        _FAST = _torch_ops.fast_attention
    return _OPS


# ------------------------------------------------------------------ visibility (docs/SEMANTICS.md)
def visible_key_blocks(len_q: int, len_kv: int, block_q: int = 128, block_k: int = 64,
                       is_causal: bool = False) -> List[int]:
    """Number of causally visible key blocks of each query block (bottom-right causal rule)."""
    nqb, nkb = -(-len_q // block_q), -(-len_kv // block_k)
    if not is_causal:
        return [nkb] * nqb
    out = []
    for qb in range(nqb):
        last_row = min(qb * block_q + block_q - 1, len_q - 1)
        last_key = last_row + (len_kv - len_q)
        out.append(0 if last_key < 0 else min(last_key, len_kv - 1) // block_k + 1)
    return out


def _visibility_matrix(len_q: int, len_kv: int, bq: int, bk: int, causal: bool) -> np.ndarray:
    vis = visible_key_blocks(len_q, len_kv, bq, bk, causal)
    nkb = -(-len_kv // bk)
    return (np.arange(nkb)[None, :] < np.asarray(vis)[:, None]).astype(np.int64)


def _to_numpy(x: Any) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    if _is_torch(x):
        return x.detach().cpu().numpy()
    if hasattr(x, "get"):  # cupy
        return x.get()
    return np.asarray(x)


def _density_from_mask(mask: Any, s: core.Shapes, bq: int, bk: int, causal: bool) -> float:
    vm = _visibility_matrix(s.Lq, s.Lkv, bq, bk, causal)
    total = int(vm.sum()) * s.B * s.Hq
    if total == 0:
        return 0.0
    if _is_torch(mask):
        t = _torch()
        kept = (mask.to(t.bool) & t.as_tensor(vm.astype(bool), device=mask.device)).sum().item()
    else:
        kept = int(((_to_numpy(mask) != 0) & vm.astype(bool)).sum())
    return float(kept) / total


def _density_from_kept(kept: Any, s: core.Shapes, bq: int, bk: int, causal: bool) -> float:
    total = sum(visible_key_blocks(s.Lq, s.Lkv, bq, bk, causal)) * s.B * s.Hq
    if total == 0:
        return 0.0
    k = kept.sum().item() if _is_torch(kept) else int(_to_numpy(kept).astype(np.int64).sum())
    return float(k) / total


# ------------------------------------------------------------------ option handling
class _Resolved:
    """Resolved options. ``shared``: this object is the one ``_resolve_cached`` returns for its
    option values (scalars only, no per-head values), so its identity stands for those values."""

    __slots__ = ("opts", "topk_h", "cdf_h", "sim_h", "bq", "bk", "shared")

    def __init__(self, opts: core.Options, topk_h: Any, cdf_h: Any, sim_h: Any) -> None:
        self.opts, self.topk_h, self.cdf_h, self.sim_h = opts, topk_h, cdf_h, sim_h
        self.bq = opts.block_q or 128
        self.bk = opts.block_k or 64
        self.shared = False


def _resolve(*, topk: PerHead, is_causal: bool, scale: Optional[float], layout: str, mode: str,
             cdf_threshold: Optional[PerHead], sim_threshold: PerHead, smooth_k: bool,
             attention_sink: Optional[bool], local_window: Optional[int], precision: str,
             block_size: Any, estimator: str = "auto", pv_threshold: Any = 0.0) -> _Resolved:
    lay = core.parse_layout(layout)
    md = core.parse_mode(mode)
    prec = core.parse_precision(precision)
    bq, bk = core.parse_block_size(block_size)
    sc = core.parse_scale(scale)
    topk_s, topk_h = core.split_per_head("topk", topk, 0.0, 1.0, True, 0.5)
    cdf_s, cdf_h = core.split_per_head("cdf_threshold", cdf_threshold, 0.0, 1.0, True, 0.9)
    sim_s, sim_h = core.split_per_head("sim_threshold", sim_threshold, -math.inf, math.inf, False, -0.1)
    sink = -1 if attention_sink is None else int(bool(attention_sink))
    window = core.parse_local_window(local_window)
    est = core.parse_estimator(estimator)
    pv = core.parse_pv_threshold(pv_threshold)
    opts = core.Options(lay, bool(is_causal), sc, md, topk_s, cdf_s, sim_s, bool(smooth_k),
                        sink, window, est, prec, bq, bk, pv)
    return _Resolved(opts, topk_h, cdf_h, sim_h)


# Resolved options of earlier calls whose option values were all plain scalars (exact types float,
# int, bool, str or None, block_size a tuple of ints): the key holds each value with its type, so
# 1, 1.0 and True stay apart and a value that failed validation is never stored. Per-head
# sequences and tensors are never cached (a tensor can change in place).
_RESOLVED: dict = {}
_PLAIN = frozenset((float, int, bool, str, type(None)))


def _resolve_cached(topk: Any, is_causal: Any, scale: Any, layout: Any, mode: Any, cdf_threshold: Any,
                    sim_threshold: Any, smooth_k: Any, attention_sink: Any, local_window: Any,
                    estimator: Any, precision: Any, block_size: Any, pv_threshold: Any = 0.0) -> _Resolved:
    key = None
    if type(block_size) is tuple and len(block_size) == 2:
        vals = (topk, is_causal, scale, layout, mode, cdf_threshold, sim_threshold, smooth_k, attention_sink,
                local_window, estimator, precision, pv_threshold) + block_size
        types = tuple(map(type, vals))
        if _PLAIN.issuperset(types):  # (before hashing: a list or an array is not hashable)
            key = (vals, types)
            r = _RESOLVED.get(key)
            if r is not None:
                return r
    r = _resolve(topk=topk, is_causal=is_causal, scale=scale, layout=layout, mode=mode,
                 cdf_threshold=cdf_threshold, sim_threshold=sim_threshold, smooth_k=smooth_k,
                 attention_sink=attention_sink, local_window=local_window, estimator=estimator,
                 precision=precision, block_size=block_size, pv_threshold=pv_threshold)
    if key is not None:
        if len(_RESOLVED) > 256:
            _RESOLVED.clear()
        r.shared = r.topk_h is None and r.cdf_h is None and r.sim_h is None
        _RESOLVED[key] = r
    return r


# The resolved options of the latest option sets, by identity: (topk, is_causal, scale, layout, mode,
# cdf_threshold, sim_threshold, smooth_k, attention_sink, local_window, estimator, precision,
# block_size, pv_threshold, resolved) tuples, the newest first, at most _MEMO_SIZE of them, each made from a
# shared _Resolved (all values plain immutable scalars, block_size a tuple of them). A memo holds its
# values, so a call that passes the very same objects passes the same values of the same types and
# gets the same resolved options, without building and hashing _RESOLVED's key (the objects of the
# defaults and of literals are the same on every call).
_MEMO: tuple = ()
_MEMO_SIZE = 4


def _resolve_memo(topk: Any, is_causal: Any, scale: Any, layout: Any, mode: Any, cdf_threshold: Any,
                  sim_threshold: Any, smooth_k: Any, attention_sink: Any, local_window: Any, estimator: Any,
                  precision: Any, block_size: Any, pv_threshold: Any = 0.0) -> _Resolved:
    """_resolve_cached through the identity memo (a shared result is memoized)."""
    global _MEMO
    for m in _MEMO:
        if (topk is m[0] and is_causal is m[1] and scale is m[2] and layout is m[3] and mode is m[4]
                and cdf_threshold is m[5] and sim_threshold is m[6] and smooth_k is m[7]
                and attention_sink is m[8] and local_window is m[9] and estimator is m[10]
                and precision is m[11] and block_size is m[12] and pv_threshold is m[13]):
            return m[14]
    r = _resolve_cached(topk, is_causal, scale, layout, mode, cdf_threshold, sim_threshold, smooth_k,
                        attention_sink, local_window, estimator, precision, block_size, pv_threshold)
    if r.shared:
        _MEMO = ((topk, is_causal, scale, layout, mode, cdf_threshold, sim_threshold, smooth_k, attention_sink,
                  local_window, estimator, precision, block_size, pv_threshold, r),) + _MEMO[:_MEMO_SIZE - 1]
    return r


def _split_torch_heads(r: _Resolved) -> Tuple[Any, ...]:
    """Per-head values -> (topk_t, cdf_t, sim_t, topk_l, cdf_l, sim_l) for the custom op schema."""
    tensors: List[Any] = []
    lists: List[Any] = []
    for h in (r.topk_h, r.cdf_h, r.sim_h):
        if h is None:
            tensors.append(None)
            lists.append(None)
        elif _is_torch(h):
            tensors.append(h)
            lists.append(None)
        else:
            vals = h.tolist() if hasattr(h, "tolist") else h
            tensors.append(None)
            lists.append([float(x) for x in vals])
    return tuple(tensors) + tuple(lists)


def _op_scalars(r: _Resolved) -> Tuple[Any, ...]:
    o = r.opts
    return (o.layout, o.causal, o.scale, o.mode, o.topk, o.cdf, o.sim, o.smooth_k, o.sink, o.window, o.estimator,
            o.precision,
            o.block_q, o.block_k, o.pv)


def _normalize_mask(mask: Any) -> Any:
    """A uint8 block mask (zero-copy for uint8/bool inputs)."""
    if mask is None:
        return None
    if _is_torch(mask):
        t = _torch()
        if mask.dtype == t.uint8:
            return mask
        if mask.dtype == t.bool:
            return mask.view(t.uint8)
        return (mask != 0).to(t.uint8)
    if isinstance(mask, (np.ndarray, list, tuple)):
        a = np.asarray(mask)
        if a.dtype == np.uint8:
            return a
        if a.dtype == np.bool_:
            return a.view(np.uint8)
        return (a != 0).astype(np.uint8)
    return mask


def _shapes_torch(q: Any, k: Any, layout: int) -> core.Shapes:
    p = core.PERM[layout]
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4:
            raise C.InvalidArgumentError("%s must be 4-D, got shape %s" % (name, tuple(t.shape)))
    return core.Shapes(q.shape[p[0]], q.shape[p[1]], k.shape[p[1]], q.shape[p[2]], k.shape[p[2]], q.shape[p[3]])


def _views(stream: Optional[int], **arrays: Any) -> List[Any]:
    return [as_view(a, name, stream) for name, a in arrays.items()]


def _stream_of(stream: Optional[int], qv: Any) -> int:
    if stream is not None:
        return int(stream)
    return int(qv.stream or 0)


def _pack(out: Any, sparsity: Optional[float], lse: Any, return_sparsity: bool, return_lse: bool) -> Any:
    if not return_sparsity and not return_lse:
        return out
    res: List[Any] = [out]
    if return_sparsity:
        res.append(sparsity)
    if return_lse:
        res.append(lse)
    return tuple(res)


# ------------------------------------------------------------------ public API
def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, topk: PerHead = 0.5, is_causal: bool = False,
              scale: Optional[float] = None, layout: str = "HND", mask: Optional[ArrayLike] = None,
              mode: str = "topk", cdf_threshold: Optional[PerHead] = None, sim_threshold: PerHead = -0.1,
              smooth_k: bool = True, attention_sink: Optional[bool] = None,
              local_window: Optional[int] = None, estimator: str = "auto", precision: str = "auto",
              block_size: Tuple[int, int] = (128, 64), pv_threshold: float = 0.0, return_sparsity: bool = False,
              return_lse: bool = False, stream: Optional[int] = None, out: Optional[ArrayLike] = None) -> Any:
    """Block-sparse attention with a predicted (or given) block mask.

    Args:
        q: ``[B, Hq, Lq, D]`` (layout ``"HND"``) or ``[B, Lq, Hq, D]`` (``"NHD"``); float16, bfloat16
            or float32 (float32: CPU backend only). numpy arrays run on the CPU backend; torch
            tensors on CPU or CUDA; other objects through ``__dlpack__`` or
            ``__cuda_array_interface__``. Any strides with a unit stride on D, no copies.
        k, v: ``[B, Hkv, Lkv, D]`` in the same layout, dtype and device; ``Hq % Hkv == 0``.
        topk: fraction of causally visible key blocks kept per query-block row, in (0, 1]
            (``max(1, floor(topk * visible))`` blocks); a float or one value per query head.
        is_causal: bottom-right aligned token-exact causality (query i sees key j iff
            ``j <= i + Lkv - Lq``).
        scale: softmax scale; None = ``1/sqrt(D)``.
        layout: ``"HND"`` or ``"NHD"`` (any case).
        mask: optional uint8/bool block mask ``[B, Hq, ceil(Lq/BQ), ceil(Lkv/BK)]`` (1 = compute);
            given, no prediction runs.
        mode: ``"topk"`` or ``"cdf"`` (keep the smallest set of blocks whose pooled-score
            probabilities sum to at least ``cdf_threshold``).
        cdf_threshold: in (0, 1] (CDF mode); None = 0.9. Scalar or per head.
        sim_threshold: blocks whose self-similarity is below it are kept whole; the default
            -0.1 disables this. Scalar or per head.
        smooth_k: subtract the per-head mean of K before prediction and quantization.
        attention_sink: keep key block 0 in every row, counted in the top-k / CDF budget; None: the
            default (on; docs/ACCURACY.md, "Predicted masks").
        local_window: w >= 1 keeps the key blocks on the diagonal and w - 1 more on each side, counted
            in the budget; 0: off; None: the default of the mode (2 when causal, 1 otherwise). With
            ``is_causal`` the first diagonal block is always kept, so no query row is left without a key.
        estimator: block importance: "auto" (default: "keys_lse_adaptive" when not causal, "keys_lse"
            when causal, the closest to the oracle mask in each mode, docs/ACCURACY.md, "Estimators"),
            "keys_lse" (mean-pooled Q against every key, log-sum-exp per key block), "keys_lse_split2"
            (keys_lse for two groups of similar rows per query block, their block distributions averaged:
            closer on vision transformers at about twice the prediction cost), "keys_lse_adaptive"
            (keys_lse_split2 on the query blocks whose mean row is short against their rows but not near
            zero, 0.25 <= |mean| / the rows' mean length < 0.75: rows that share a direction but spread;
            keys_lse on the others, so the cost follows the share of split blocks)
            or "mean" (mean-pooled Q and K, the original SpargeAttn rule).
        precision: ``"auto"`` (default: ``"int8_fp8"`` on compute capability 9.0 when 64 < head_dim <= 128
            and the sequence is long enough for its preparation passes to pay off, an effective length
            3 Lq Lkv / (Lq + 2 Lkv) >= 16384; ``"fp16"`` otherwise;
            CPU plans follow the compute capability 9.0 rule),
            ``"int8_fp8"`` (on CPU the exact quantization twin, slow),
            ``"int8_fp8_split_v"`` (int8_fp8 with V carried as two e4m3 terms, hi + lo: V's
            rounding error nearly vanishes, output relative L1 ~0.028 instead of ~0.038 on random
            normal inputs, for one more fp8 P.V product per key tile),
            ``"int8_fp16"`` (Q, K int8 as in int8_fp8, P in the input's 16-bit type, V used as
            given: only the int8 Q.K^T error remains, output relative L1 ~0.011 on random normal
            inputs, and no V preparation pass),
            ``"fp16"`` (16-bit tensor-core math) or ``"exact"`` (float64, CPU only).
        block_size: mask block ``(BQ, BK)``; default (128, 64).
        pv_threshold: the PV skip, in nats (natural log of the softmax weights); 0 (default): off.
            With ``t > 0`` a query row skips a step of the online softmax (its keys get weight 0, no
            P.V for them) when the step's largest score is below the row's running maximum minus
            ``t``: those weights are below ``exp(-t)`` of the row's largest. Applies to predicted,
            given and dense (``topk=1``) masks alike, in every precision but ``"exact"`` (a positive
            value there is ``UnsupportedError``), on CPU tensors: CUDA plans refuse it in this release
            (``UnsupportedError``); NaN, negative or infinite values are ``InvalidArgumentError``. A
            scalar for all heads.
        return_sparsity: also return the block density ``kept / visible`` over all heads (a
            Python float: this synchronizes the host with the device).
        return_lse: also return the float32 log-sum-exp ``[B, Hq, Lq]`` (natural log).
        stream: CUDA stream handle for non-torch CUDA inputs (default: the
            ``__cuda_array_interface__`` stream of q, else the default stream). torch tensors
            always use ``torch.cuda.current_stream()``.
        out: write the result into this array (q's shape, layout, dtype and device; any strides
            with a unit stride on D) instead of a new one; it is returned.

    Returns:
        ``out`` (q's shape and layout, q's dtype), or a tuple ``(out, density)``,
        ``(out, lse)`` or ``(out, density, lse)``.

    Raises:
        InvalidArgumentError, UnsupportedError, NoDeviceError, CudaError, ... (SpargeError).
    """
    r = _resolve_memo(topk, is_causal, scale, layout, mode, cdf_threshold, sim_threshold, smooth_k,
                      attention_sink, local_window, estimator, precision, block_size, pv_threshold)
    return _attention(q, k, v, r, mask, out, return_sparsity, return_lse, stream)


def _attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, r: _Resolved, mask: Any, out: Any,
               return_sparsity: bool, return_lse: bool, stream: Optional[int],
               plan: Optional[core.Plan] = None, workspace: Any = None) -> Any:
    """attention() after option resolution; ``plan``/``workspace`` from a :class:`sparge.Plan`."""
    try:
        fast = _FAST
        if fast is not None and plan is None and workspace is None and not return_sparsity and EAGER_DIRECT:
            # Eager torch call whose arguments were seen before: one cache hit (_torch_ops.fast_attention).
            res = fast(q, k, v, r, mask, out, return_lse)
            if res is not None:
                return res
        mask = _normalize_mask(mask)
        if _is_torch(q):
            extra = (("mask", mask),) if mask is not None else ()
            extra += (("out", out),) if out is not None else ()
            extra += (("workspace", workspace),) if workspace is not None else ()
            for name, t in (("k", k), ("v", v)) + extra:
                if not _is_torch(t):
                    raise C.InvalidArgumentError("%s must be a torch tensor like q, got %s" % (name, type(t).__name__))
            want_kept = return_sparsity and mask is None
            ops = _ops()
            grad = ops.needs_grad(q, k, v)
            ops.refuse_out(grad, "out=", out)
            if plan is not None or (EAGER_DIRECT and not grad and ops.eager_direct_ok(q, k, v, mask, out)):
                # Plain eager call: skip the custom-op dispatch (same library call, less host time).
                if plan is not None and not ops.eager_direct_ok(q, k, v, mask, out, workspace):
                    raise C.UnsupportedError("Plan.run calls the library directly (eager only); under "
                                             "torch.compile or a dispatch mode use sparge.attention or sparge.sdpa")
                wv = _arrays_view(workspace, "workspace") if workspace is not None else None
                res, lse, kept = ops.run_attention(q, k, v, mask, (r.topk_h, r.cdf_h, r.sim_h), r.opts,
                                                   bool(return_lse), bool(want_kept), out=out, plan=plan,
                                                   workspace=wv)
                if grad:  # Plan.run: the library's results as outputs of a node whose backward raises
                    res, lse = ops.no_backward((q, k, v), res, lse)
            else:
                res, lse, kept = ops.attention_call(q, k, v, mask, *_split_torch_heads(r), *_op_scalars(r),
                                                    bool(return_lse), bool(want_kept))
                if grad and not ops.HAS_CUSTOM_OP:  # (the custom op's outputs carry its raising backward)
                    res, lse = ops.no_backward((q, k, v), res, lse)
                if out is not None:
                    if tuple(out.shape) != tuple(res.shape) or out.dtype != res.dtype or out.device != res.device:
                        raise C.InvalidArgumentError("out must have shape %s, dtype %s on %s, got %s, %s on %s"
                                                     % (tuple(res.shape), res.dtype, res.device, tuple(out.shape),
                                                        out.dtype, out.device))
                    out.copy_(res)
                    res = out
            density = None
            if return_sparsity:
                s = _shapes_torch(q, k, r.opts.layout)
                density = (_density_from_kept(kept, s, r.bq, r.bk, r.opts.causal) if mask is None
                           else _density_from_mask(mask, s, r.bq, r.bk, r.opts.causal))
            return _pack(res, density, lse if return_lse else None, return_sparsity, return_lse)

        qv, kv, vv = _views(stream, q=q, k=k, v=v)
        s = core.check_qkv(qv, kv, vv, r.opts.layout)
        alloc = allocator_for(q, qv)
        mv = as_view(mask, "mask", stream) if mask is not None else None
        ov = (out, as_view(out, "out", stream)) if out is not None else None
        wv = as_view(workspace, "workspace", stream) if workspace is not None else None
        want_kept = return_sparsity and mask is None
        res, lse, kept, plan = core.attention(alloc, qv, kv, vv, s, r.opts, _stream_of(stream, qv), mask=mv,
                                              topk_h=r.topk_h, cdf_h=r.cdf_h, sim_h=r.sim_h,
                                              want_lse=return_lse, want_kept=want_kept, plan=plan,
                                              workspace=wv, out=ov)
        del qv, kv, vv, mv, ov, wv  # releases consumed DLPack capsules
        density = None
        if return_sparsity:
            density = (_density_from_kept(kept, s, plan.block_q, plan.block_k, r.opts.causal) if mask is None
                       else _density_from_mask(mask, s, plan.block_q, plan.block_k, r.opts.causal))
        return _pack(res, density, lse, return_sparsity, return_lse)
    except RuntimeError as e:
        # (no cost on the way in: only a failed call asks what its tensors are)
        if _under_func_transform(q, k, v):
            raise C.UnsupportedError(FUNC_TRANSFORMS) from e
        raise


def _arrays_view(x: Any, name: str) -> Any:
    from ._arrays import torch_view

    return torch_view(x)


def predict_mask(q: ArrayLike, k: ArrayLike, *, topk: PerHead = 0.5, is_causal: bool = False,
                 scale: Optional[float] = None, layout: str = "HND", mode: str = "topk",
                 cdf_threshold: Optional[PerHead] = None, sim_threshold: PerHead = -0.1,
                 smooth_k: bool = True, attention_sink: Optional[bool] = None,
              local_window: Optional[int] = None, estimator: str = "auto", precision: str = "auto",
                 block_size: Tuple[int, int] = (128, 64), pv_threshold: float = 0.0, return_kept: bool = False,
                 stream: Optional[int] = None, out: Optional[ArrayLike] = None) -> Any:
    """Predicts the block mask that :func:`attention` would use.

    Same arguments as :func:`attention` (v is not needed; ``pv_threshold`` does not change the
    mask, but is checked as for :func:`attention`). Returns the uint8 mask
    ``[B, Hq, ceil(Lq/BQ), ceil(Lkv/BK)]`` in q's framework and memory space (written into
    ``out`` when given: a uint8 array of that shape), or ``(mask, kept)`` with ``return_kept``
    (int32 ``[B, Hq]`` kept-block counts).
    """
    r = _resolve(topk=topk, is_causal=is_causal, scale=scale, layout=layout, mode=mode,
                 cdf_threshold=cdf_threshold, sim_threshold=sim_threshold, smooth_k=smooth_k,
                 attention_sink=attention_sink, local_window=local_window, estimator=estimator,
                 precision=precision, block_size=block_size, pv_threshold=pv_threshold)
    return _predict(q, k, r, return_kept, stream, out)


def _predict(q: ArrayLike, k: ArrayLike, r: _Resolved, return_kept: bool, stream: Optional[int], out: Any,
             plan: Optional[core.Plan] = None, workspace: Any = None) -> Any:
    if _is_torch(q):
        for name, t in (("k", k), ("out", out), ("workspace", workspace)):
            if t is not None and not _is_torch(t):
                raise C.InvalidArgumentError("%s must be a torch tensor like q, got %s" % (name, type(t).__name__))
        ops = _ops()
        if plan is not None or (out is not None and ops.eager_direct_ok(q, k, out)):
            if not ops.eager_direct_ok(q, k, out, workspace):
                raise C.UnsupportedError("Plan.predict and predict_mask(out=...) call the library directly "
                                         "(eager only); under torch.compile use sparge.predict_mask")
            from ._arrays import torch_view

            qv, kv = torch_view(q), torch_view(k)
            s = core.check_qkv(qv, kv, None, r.opts.layout)
            ov = (out, torch_view(out)) if out is not None else None
            wv = torch_view(workspace) if workspace is not None else None
            mask, kept = ops.run_predict(q, qv, kv, s, r.opts, (r.topk_h, r.cdf_h, r.sim_h), plan, wv, ov)
        else:
            mask, kept = ops.predict_call(q, k, *_split_torch_heads(r), *_op_scalars(r))
            if out is not None:
                out.copy_(mask)
                mask = out
    else:
        qv, kv = _views(stream, q=q, k=k)
        s = core.check_qkv(qv, kv, None, r.opts.layout)
        ov = (out, as_view(out, "out", stream)) if out is not None else None
        wv = as_view(workspace, "workspace", stream) if workspace is not None else None
        mask, kept, _ = core.predict(allocator_for(q, qv), qv, kv, s, r.opts, _stream_of(stream, qv),
                                     r.topk_h, r.cdf_h, r.sim_h, want_kept=return_kept, plan=plan,
                                     workspace=wv, out=ov)
        del qv, kv, ov, wv
    return (mask, kept) if return_kept else mask


def block_sparse_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, mask: ArrayLike, *,
                           is_causal: bool = False, scale: Optional[float] = None, layout: str = "HND",
                           precision: str = "auto", block_size: Tuple[int, int] = (128, 64),
                           pv_threshold: float = 0.0, return_sparsity: bool = False, return_lse: bool = False,
                           stream: Optional[int] = None, out: Optional[ArrayLike] = None) -> Any:
    """Attention restricted to the blocks of a given mask (no prediction).

    ``mask``: uint8 or bool ``[B, Hq, ceil(Lq/BQ), ceil(Lkv/BK)]``, 1 = compute, in q's memory
    space. Blocks that causality hides are skipped whatever the mask says. Other arguments and
    the return value as in :func:`attention`.
    """
    if mask is None:
        raise C.InvalidArgumentError("mask is required (use attention() to predict one)")
    return attention(q, k, v, mask=mask, is_causal=is_causal, scale=scale, layout=layout,
                     precision=precision, block_size=block_size, pv_threshold=pv_threshold,
                     return_sparsity=return_sparsity, return_lse=return_lse, stream=stream, out=out)
