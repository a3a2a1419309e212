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
          smooth_k: bool, sink: bool, precision: int, block_q: int, block_k: int) -> core.Options:
    return core.Options(layout, bool(causal), float(scale), int(mode), float(topk), float(cdf), float(sim),
                        bool(smooth_k), bool(sink), int(precision), int(block_q), int(block_k))


def _per_head(t: Optional[Tensor], lst: Optional[List[float]]) -> Any:
    return t if t is not None else lst


class _DeviceGuard:
    """Makes q's CUDA device current for the call (kernels launch on the current device)."""

    def __init__(self, t: Tensor) -> None:
        self.ctx = torch.cuda.device(t.device) if t.is_cuda else None

    def __enter__(self) -> int:
        if self.ctx is None:
            return 0
        self.ctx.__enter__()
        return torch.cuda.current_stream().cuda_stream

    def __exit__(self, *exc: Any) -> None:
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


def attention_impl(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
                   topk_t: Optional[Tensor], cdf_t: Optional[Tensor], sim_t: Optional[Tensor],
                   topk_l: Optional[List[float]], cdf_l: Optional[List[float]], sim_l: Optional[List[float]],
                   layout: int, causal: bool, scale: float, mode: int, topk: float, cdf: float, sim: float,
                   smooth_k: bool, sink: bool, precision: int, block_q: int, block_k: int,
                   want_lse: bool, want_kept: bool) -> Tuple[Tensor, Tensor, Tensor]:
    opts = _opts(layout, causal, scale, mode, topk, cdf, sim, smooth_k, sink, precision, block_q, block_k)
    qv, kv, vv = torch_view(q), torch_view(k), torch_view(v)
    s = core.check_qkv(qv, kv, vv, layout)
    mv = torch_view(mask) if mask is not None else None
    with _DeviceGuard(q) as stream:
        out, lse, kept, _ = core.attention(
            torch_allocator(), qv, kv, vv, s, opts, stream, mask=mv,
            topk_h=_per_head(topk_t, topk_l), cdf_h=_per_head(cdf_t, cdf_l), sim_h=_per_head(sim_t, sim_l),
            want_lse=want_lse, want_kept=want_kept and mask is None)
    if lse is None:
        lse = q.new_empty((0,), dtype=torch.float32)
    if kept is None:
        kept = q.new_empty((0,), dtype=torch.int32)
    return out, lse, kept


def attention_fake(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
                   topk_t: Optional[Tensor], cdf_t: Optional[Tensor], sim_t: Optional[Tensor],
                   topk_l: Optional[List[float]], cdf_l: Optional[List[float]], sim_l: Optional[List[float]],
                   layout: int, causal: bool, scale: float, mode: int, topk: float, cdf: float, sim: float,
                   smooth_k: bool, sink: bool, precision: int, block_q: int, block_k: int,
                   want_lse: bool, want_kept: bool) -> Tuple[Tensor, Tensor, Tensor]:
    p = core.PERM[layout]
    B, Hq, Lq = q.shape[p[0]], q.shape[p[1]], q.shape[p[2]]
    out = q.new_empty(q.shape)
    lse = q.new_empty((B, Hq, Lq) if want_lse else (0,), dtype=torch.float32)
    kept = q.new_empty((B, Hq) if (want_kept and mask is None) else (0,), dtype=torch.int32)
    return out, lse, kept


def predict_impl(q: Tensor, k: Tensor,
                 topk_t: Optional[Tensor], cdf_t: Optional[Tensor], sim_t: Optional[Tensor],
                 topk_l: Optional[List[float]], cdf_l: Optional[List[float]], sim_l: Optional[List[float]],
                 layout: int, causal: bool, scale: float, mode: int, topk: float, cdf: float, sim: float,
                 smooth_k: bool, sink: bool, precision: int, block_q: int, block_k: int
                 ) -> Tuple[Tensor, Tensor]:
    opts = _opts(layout, causal, scale, mode, topk, cdf, sim, smooth_k, sink, precision, block_q, block_k)
    qv, kv = torch_view(q), torch_view(k)
    s = core.check_qkv(qv, kv, None, layout)
    with _DeviceGuard(q) as stream:
        mask, kept, _ = core.predict(torch_allocator(), qv, kv, s, opts, stream,
                                     _per_head(topk_t, topk_l), _per_head(cdf_t, cdf_l), _per_head(sim_t, sim_l),
                                     want_kept=True)
    return mask, kept


def predict_fake(q: Tensor, k: Tensor,
                 topk_t: Optional[Tensor], cdf_t: Optional[Tensor], sim_t: Optional[Tensor],
                 topk_l: Optional[List[float]], cdf_l: Optional[List[float]], sim_l: Optional[List[float]],
                 layout: int, causal: bool, scale: float, mode: int, topk: float, cdf: float, sim: float,
                 smooth_k: bool, sink: bool, precision: int, block_q: int, block_k: int
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

__all__ = ["attention_call", "predict_call", "HAS_CUSTOM_OP", "C"]
