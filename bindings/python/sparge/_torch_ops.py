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

_len_modes = getattr(torch._C, "_len_torch_dispatch_mode", None)
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

__all__ = ["attention_call", "predict_call", "run_attention", "run_predict", "eager_direct_ok", "HAS_CUSTOM_OP", "C"]
