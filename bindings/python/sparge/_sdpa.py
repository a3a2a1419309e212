"""``sparge.sdpa``: ``torch.nn.functional.scaled_dot_product_attention``'s signature and semantics."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from . import _capi as C
from ._api import PerHead, _attention, _is_torch, _records_grad, _resolve_memo


def _unsqueeze_heads(x: Any) -> Any:
    return x.unsqueeze(1) if _is_torch(x) else x[:, None]


def _empty_like(q: Any) -> Any:
    if _is_torch(q):
        return q.new_empty(q.shape)
    if isinstance(q, np.ndarray):
        return np.empty(q.shape, dtype=q.dtype)
    return None  # other frameworks: let the library allocate (no split needed there)


def _strides(t: Any) -> Tuple[int, ...]:
    """Strides of a torch tensor (elements) or a numpy array (bytes): compared with 0 and 1 only."""
    return t.stride() if _is_torch(t) else t.strides


def _unit(t: Any, st: Tuple[int, ...]) -> bool:
    return st[-1] == (1 if _is_torch(t) else t.itemsize)


def _has_zero_stride(t: Any) -> bool:
    return any(s == 0 and n > 1 for s, n in zip(_strides(t), t.shape))


def _dense_heads(k: Any, v: Any) -> Tuple[Any, Any]:
    """K and V broadcast over their heads (stride 0: one head expanded, as for multi-query
    attention) as that one head, which the library's GQA reads for every query head; other
    zero strides (the library reads no broadcast input) as copies."""
    if int(k.shape[1]) > 1 and _strides(k)[1] == 0 and _strides(v)[1] == 0:
        k, v = k[:, :1], v[:, :1]
    return (_copy(k) if _has_zero_stride(k) else k), (_copy(v) if _has_zero_stride(v) else v)


def _copy(t: Any) -> Any:
    return t.contiguous() if _is_torch(t) else np.ascontiguousarray(t)


def _unit_last(t: Any) -> Any:
    """t with unit stride on the head dim (torch's SDPA takes any strides; the library reads rows)."""
    st = _strides(t)
    if _unit(t, st):
        return t
    if int(t.shape[-1]) == 1:  # (the library wants stride 1 there too; an extent-1 dim's stride is free)
        if _is_torch(t):
            return t.as_strided(t.shape, st[:-1] + (1,))
        return np.lib.stride_tricks.as_strided(t, t.shape, st[:-1] + (t.itemsize,), writeable=False)
    return _copy(t)


def _broadcast_or_strided(q: Any, k: Any, v: Any) -> bool:
    """A zero stride or a head dim without unit stride in q, k or v (torch or numpy)."""
    if _is_torch(q):
        sq, sk, sv, one = q.stride(), k.stride(), v.stride(), 1
    else:
        sq, sk, sv, one = q.strides, k.strides, v.strides, q.itemsize
    return 0 in sq or 0 in sk or 0 in sv or sq[-1] != one or sk[-1] != one or sv[-1] != one


def _join_rows(a: Any, b: Any, nd: int) -> Any:
    """The query rows of two results [B, H, L_i, D] as one (autograd sees the join)."""
    import torch  # (already imported: a and b are torch tensors)

    res = torch.cat((a, b), dim=2)
    return res[:, 0] if nd == 3 else res


def sdpa(query: Any, key: Any, value: Any, attn_mask: Optional[Any] = None, dropout_p: float = 0.0,
         is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False, *,
         topk: PerHead = 0.5, mode: str = "topk", cdf_threshold: Optional[PerHead] = None,
         sim_threshold: PerHead = -0.1, smooth_k: bool = True, attention_sink: Optional[bool] = None,
         local_window: Optional[int] = None, estimator: str = "auto",
         precision: str = "auto", block_size: Tuple[int, int] = (128, 64), pv_threshold: float = 0.0,
         out: Optional[Any] = None, stream: Optional[int] = None) -> Any:
    """Block-sparse attention with the signature and semantics of
    ``torch.nn.functional.scaled_dot_product_attention``.

    ``query`` is ``[B, Hq, L, E]`` (or ``[B, L, E]``), ``key``/``value`` ``[B, Hkv, S, E]``; torch
    tensors (CPU or CUDA), numpy arrays (CPU backend) or DLPack / CUDA-array-interface arrays.
    Semantics as in torch:

    - ``is_causal``: the top-left aligned causal rule of torch (query i sees key j iff ``j <= i``).
      For ``L == S`` this is the library's rule; for ``L < S`` keys ``S..`` that no query sees are
      dropped; for ``L > S`` queries ``0..S-1`` run causal and queries ``S..`` see every key (two
      library calls writing into one output).
    - ``scale``: default ``1/sqrt(E)``.
    - ``enable_gqa``: ``Hq != Hkv`` (with ``Hq % Hkv == 0``) only when True, as in torch.
    - ``attn_mask``: dense masks are not supported by the library; any non-None value raises
      :class:`UnsupportedError` (use ``is_causal`` or a block ``mask`` with
      :func:`sparge.attention`). ``dropout_p > 0`` raises :class:`UnsupportedError` (inference only).
    - value's head dim must equal query's (``Ev == E``).

    The keywords after ``*`` are :func:`sparge.attention`'s sparsity options (``topk=1.0`` keeps
    every block; ``pv_threshold`` the PV skip); ``out`` receives the result (query's shape, dtype and device).
    """
    if attn_mask is not None:
        raise C.UnsupportedError(
            "attn_mask: dense attention masks are not supported by libsparge; pass attn_mask=None "
            "(with is_causal=True for causal attention) or give a block mask to sparge.attention(mask=...)")
    if dropout_p != 0.0:
        raise C.UnsupportedError("dropout_p=%r: dropout is not supported (inference only); pass dropout_p=0.0"
                                 % (dropout_p,))
    qs = query.shape
    nd = len(qs)
    if nd not in (3, 4):
        raise C.InvalidArgumentError("query must be [B, H, L, E] or [B, L, E], got shape %s" % (tuple(qs),))
    ks = key.shape
    if len(ks) != nd:
        raise C.InvalidArgumentError("key has %d dims but query has %d" % (len(ks), nd))
    vs = value.shape
    if len(vs) != nd:
        raise C.InvalidArgumentError("value has %d dims but query has %d" % (len(vs), nd))
    if out is not None and len(out.shape) != nd:
        raise C.InvalidArgumentError("out has %d dims but query has %d" % (len(out.shape), nd))
    if nd == 3:
        q4, k4, v4 = _unsqueeze_heads(query), _unsqueeze_heads(key), _unsqueeze_heads(value)
        o4 = _unsqueeze_heads(out) if out is not None else None
        qs, ks, vs = q4.shape, k4.shape, v4.shape
    else:
        q4, k4, v4, o4 = query, key, value, out
    Hq, Hkv = int(qs[1]), int(ks[1])
    if Hq != Hkv and not enable_gqa:
        raise C.InvalidArgumentError("query has %d heads but key has %d: pass enable_gqa=True for grouped-query "
                                     "attention (as torch's scaled_dot_product_attention requires)" % (Hq, Hkv))
    E, Ev = int(qs[-1]), int(vs[-1])
    if Ev != E:
        raise C.UnsupportedError("value has head dim %d but query has %d: libsparge needs Ev == E" % (Ev, E))
    L, S = int(qs[2]), int(ks[2])
    if int(vs[2]) != S:
        raise C.InvalidArgumentError("value has %d keys but key has %d" % (int(vs[2]), S))
    causal = bool(is_causal)
    tq = _is_torch(q4)
    if tq or isinstance(q4, np.ndarray):
        if not (L and S and Hq and qs[0]):
            # torch's results where the library has no problem to run (its problems have at least one
            # batch, head, query and key): an empty output, or zeros where there is no key.
            grad = _records_grad(query, key, value)
            if tq:
                from . import _torch_ops

                _torch_ops.refuse_out(grad, "out=", out)
            if out is not None:
                if tuple(out.shape) != tuple(query.shape) or out.dtype != query.dtype:
                    raise C.InvalidArgumentError("out must have shape %s and dtype %s, got %s, %s"
                                                 % (tuple(query.shape), query.dtype, tuple(out.shape), out.dtype))
                out[...] = 0
                return out
            if not tq:
                return np.zeros(query.shape, query.dtype)
            res = query.new_zeros(query.shape)
            if grad:  # as for every call autograd records: a node whose backward raises, not a cut graph
                res = _torch_ops.no_backward((query, key, value), res)[0]
            return res
        if tq and E > 1 and q4.is_contiguous() and k4.is_contiguous() and v4.is_contiguous():
            pass  # (the common case: no broadcast dimension, unit stride on E; torch's is_contiguous
            #      ignores the stride of an extent-1 dim, hence E > 1)
        elif _broadcast_or_strided(q4, k4, v4):
            if Hq % Hkv:  # (K/V expanded over heads run as one head, which would hide this)
                raise C.InvalidArgumentError("query has %d heads but key has %d: the key/value heads must divide "
                                             "the query heads (as in torch's scaled_dot_product_attention)"
                                             % (Hq, Hkv))
            k4, v4 = _dense_heads(k4, v4)
            if _has_zero_stride(q4):
                q4 = _copy(q4)
            q4, k4, v4 = (_unit_last(t) for t in (q4, k4, v4))

    if not causal or L == S or S == 0:
        r = _resolve_memo(topk, causal and S > 0, scale, "HND", mode, cdf_threshold, sim_threshold, smooth_k,
                          attention_sink, local_window, estimator, precision, block_size, pv_threshold)
        res = _attention(q4, k4, v4, r, None, o4, False, False, stream)
    else:
        def resolved(c: bool) -> Any:
            return _resolve_memo(topk, c, scale, "HND", mode, cdf_threshold, sim_threshold, smooth_k,
                                 attention_sink, local_window, estimator, precision, block_size, pv_threshold)

        if L < S:
            # Top-left rule: query i sees keys 0..i <= L-1; keys L.. are never seen.
            res = _attention(q4, k4[:, :, :L], v4[:, :, :L], resolved(True), None, o4, False, False, stream)
        else:
            # L > S: queries 0..S-1 causal over all S keys, queries S..L-1 see every key.
            if o4 is None and _records_grad(q4, k4, v4):  # two outputs joined where autograd sees them
                return _join_rows(_attention(q4[:, :, :S], k4, v4, resolved(True), None, None, False, False, stream),
                                  _attention(q4[:, :, S:], k4, v4, resolved(False), None, None, False, False, stream),
                                  nd)
            res = o4 if o4 is not None else _empty_like(q4)
            if res is None:
                raise C.UnsupportedError("is_causal with more queries than keys needs torch or numpy inputs "
                                         "(or out=)")
            _attention(q4[:, :, :S], k4, v4, resolved(True), None, res[:, :, :S], False, False, stream)
            _attention(q4[:, :, S:], k4, v4, resolved(False), None, res[:, :, S:], False, False, stream)
    if out is not None:
        return out
    if nd == 3:
        return res[:, 0]
    return res
