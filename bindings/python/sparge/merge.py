"""``merge_states``: exact LSE-weighted combination of partial attention results.

Attention over a key set split into disjoint parts (the K/V chunks of ring
attention, a KV cache in pages, ...) is recovered exactly from the parts' outputs
and log-sum-exps: per query row, with ``M = max_i lse_i``,
``out = sum_i exp(lse_i - M) out_i / sum_i exp(lse_i - M)`` and
``lse = M + log(sum_i exp(lse_i - M))``. A part whose LSE is ``-inf`` (no key)
contributes nothing; a row that no part covers gets zeros and ``-inf``. The
library's ``sparge_merge_states`` does the arithmetic (float64 on the CPU backend,
float32 on the GPU, on the current stream).
"""

from __future__ import annotations

import ctypes
from typing import Any, Optional, Sequence, Tuple

from . import _capi as C
from ._arrays import allocator_for, as_view, is_torch_tensor, torch_module
from ._core import PERM, parse_layout

__all__ = ["merge_states"]

_NAMES = {C.DTYPE_FLOAT16: "float16", C.DTYPE_BFLOAT16: "bfloat16", C.DTYPE_FLOAT32: "float32"}


def _stream(obj: Any, stream: Optional[int]) -> int:
    if stream is not None:
        return int(stream)
    if is_torch_tensor(obj) and obj.device.type == "cuda":
        return int(torch_module().cuda.current_stream(obj.device).cuda_stream)
    return 0


def merge_states(outs: Sequence[Any], lses: Sequence[Any], *, out: Optional[Any] = None,
                 lse_out: Optional[Any] = None, want_lse: bool = True, layout: str = "HND",
                 dtype: Optional[str] = None, stream: Optional[int] = None) -> Tuple[Any, Any]:
    """Combines partial attention states exactly by their LSE.

    Args:
        outs: 1..32 partial outputs, each ``[B, H, L, D]`` (``"HND"``) or ``[B, L, H, D]``
            (``"NHD"``), float16, bfloat16 or float32 (they may differ), any strides; numpy
            arrays (CPU backend) or torch tensors (CPU or CUDA), all on one device.
        lses: their float32 log-sum-exps ``[B, H, L]`` (natural log, ``-inf``: no key).
        out: the result array (any of the three dtypes, any strides); it may be one of
            ``outs`` itself (in place). None: a new array in ``dtype`` (default: that of
            ``outs[0]``), in the framework of ``outs[0]``.
        lse_out: the merged LSE (float32 ``[B, H, L]``); may be one of ``lses``. None: a new
            array when ``want_lse``, else not computed.
        layout: ``"HND"`` or ``"NHD"`` for ``outs`` and ``out``.
        stream: CUDA stream handle for non-torch device arrays (torch: the current stream).

    Returns:
        ``(out, lse_out)`` (``lse_out`` is None when not wanted).
    """
    lay = parse_layout(layout)
    outs, lses = list(outs), list(lses)
    if len(outs) != len(lses):
        raise C.InvalidArgumentError("outs has %d states but lses has %d" % (len(outs), len(lses)))
    if not 1 <= len(outs) <= C.MERGE_MAX_STATES:
        raise C.InvalidArgumentError("merge_states takes 1..%d states, got %d" % (C.MERGE_MAX_STATES, len(outs)))
    perm = PERM[lay]
    grad = False
    if is_torch_tensor(outs[0]):
        from . import _torch_ops

        grad = _torch_ops.needs_grad(*[t for t in outs + lses if is_torch_tensor(t)])
        _torch_ops.refuse_out(grad, "merge_states: out= or lse_out=", out, lse_out)
    views = [as_view(o, "outs[%d]" % i) for i, o in enumerate(outs)]
    lviews = [as_view(x, "lses[%d]" % i) for i, x in enumerate(lses)]
    for i, v in enumerate(views):
        if v.ndim != 4:
            raise C.InvalidArgumentError("outs[%d] must be 4-D, got shape %s" % (i, tuple(v.shape)))
    B, H, L, D = (views[0].shape[p] for p in perm)
    alloc = allocator_for(outs[0], views[0])
    if out is None:
        name = dtype or _NAMES.get(views[0].dtype)
        if name not in ("float16", "bfloat16", "float32"):
            raise C.InvalidArgumentError("dtype must be 'float16', 'bfloat16' or 'float32', got %r" % (name,))
        shape = (B, H, L, D) if lay == 0 else (B, L, H, D)
        out, oview = alloc.empty(shape, name, views[0])
    else:
        oview = as_view(out, "out")
        if oview.ndim != 4:
            raise C.InvalidArgumentError("out must be 4-D, got shape %s" % (tuple(oview.shape),))
    lview = None
    if lse_out is None and want_lse:
        lse_out, lview = alloc.empty((B, H, L), "float32", views[0])
    elif lse_out is not None:
        lview = as_view(lse_out, "lse_out")
    n = len(outs)
    arr_o = (C.SpargeTensor * n)(*[v.descriptor(perm) for v in views])
    arr_l = (C.SpargeTensor * n)(*[v.descriptor() for v in lviews])
    od = oview.descriptor(perm)
    ld = lview.descriptor() if lview is not None else None
    st = C.lib.sparge_merge_states(n, arr_o, arr_l, ctypes.byref(od), ctypes.byref(ld) if ld is not None else None,
                                   ctypes.c_void_p(_stream(outs[0], stream) or None))
    C.check(st, "sparge_merge_states")
    del views, lviews, oview, lview
    if grad:  # results autograd records with a backward that raises, not silently cut from the graph
        out, lse_out = _torch_ops.no_backward(outs + lses, out, lse_out)
    return out, lse_out
