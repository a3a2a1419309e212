"""Drop-in replacements for the original SpargeAttn Python API.

Change one import::

    # from spas_sage_attn import spas_sage2_attn_meansim_topk_cuda
    from sparge.compat import spas_sage2_attn_meansim_topk_cuda   # or: from spas_sage_attn import ...

The signatures follow the original functions (including the positional
``attn_mask`` and ``dropout_p`` after ``v``, as in
``torch.nn.functional.scaled_dot_product_attention``). Differences, all
deliberate:

* ``pvthreshd`` (the PV skip) is the original's threshold in base-2 units of the
  scaled scores (its kernels skip a block when its max is at least ``pvthreshd``
  below the running max, both in log2 units); libsparge's ``pv_threshold`` is in
  nats, so a value maps to ``pvthreshd * ln 2`` (:func:`pv_threshold_of`). The
  default here is None, off, where the original's was 50: at 50 (34.7 nats) a
  skipped block's weights are below 2**-50 of the row's largest, far below
  float32's resolution of the row's sum (fp8 and fp16 P round them to 0), so the
  original's default changes practically no output while its check would run in
  every step; pass 50 to get it anyway.
  One threshold per call: per-head values that differ run with the largest (the
  fewest skips; a one-time ``UserWarning`` says so). The original decides the
  skip per block of query rows, libsparge per row.
* ``output_dtype``: by default the output has the dtype the computation ran in,
  as in the original (float16 and bfloat16 inputs keep their dtype; float32
  CUDA tensors are computed in float16). Pass a dtype explicitly to cast.
* ``return_sparsity`` returns the fraction of causally visible blocks that were
  *skipped* (``1 - kept/visible``), as the original did (with the exact visible
  count instead of the original's causal approximation).
* Causality is exact at token level and bottom-right aligned.
* Block importance is the original's mean rule (``estimator="mean"``), not
  libsparge's default ``"auto"``. Key block 0 (the attention sink) is kept
  also with ``attention_sink=False``, and the local window is 2 blocks when
  causal, off otherwise (``ATTENTION_SINK``, ``LOCAL_WINDOW``), whatever the
  library's defaults.
* ``attn_mask`` (a dense mask) and ``dropout_p > 0`` are not supported
  (:class:`sparge.UnsupportedError`); head dims and sequence lengths are not
  restricted to the original's 64/128 and >= 128.
* numpy arrays (and CPU torch tensors) run on the CPU backend.
"""

from __future__ import annotations

import math
import sys
import warnings
from typing import Any, Optional

import numpy as np

from . import _capi as C
from ._api import _is_torch, _torch, attention

__all__ = [
    "pv_threshold_of",
    "spas_sage2_attn_meansim_topk_cuda",
    "spas_sage2_attn_meansim_cuda",
    "spas_sage_attn_meansim_topk_cuda",
    "spas_sage_attn_meansim_cuda",
    "block_sparse_sage2_attn_cuda",
]


class _AsComputed:
    """Default of ``output_dtype``: keep the dtype the attention was computed in."""

    def __repr__(self) -> str:
        return "<as computed>"


AS_COMPUTED: Any = _AsComputed()

#: ``pv_threshold = pvthreshd * LN2``: the original's PV threshold is in base-2 units, libsparge's in nats
LN2 = math.log(2.0)
#: block-importance estimator of the predicting functions: the original's rule (mean-pooled Q and K)
ESTIMATOR = "mean"
#: attention sink and local window of the predicting functions (causal, non-causal), fixed here so
#: that the library's defaults, chosen for its own estimator, do not move these names
ATTENTION_SINK = True
LOCAL_WINDOW = {True: 2, False: 0}
_pv_warned = False
_F32_TRUE_MIN = 2.0 ** -149  # the smallest positive float32
_F32_MAX = float(np.finfo(np.float32).max)


def _compiling() -> bool:
    t = sys.modules.get("torch")
    try:
        return bool(t is not None and t.compiler.is_compiling())
    except AttributeError:
        return False


_pv_cuda_warned = False


def _pv_on(q: Any, pv: float) -> float:
    """``pv`` for a call on ``q``'s device: the CUDA kernels have no PV skip in this release (a CUDA
    plan refuses ``pv_threshold > 0``), so on a CUDA input the threshold is dropped, with a one-time
    ``UserWarning``, and the attention runs without the skip (as the original at a threshold that
    skips nothing)."""
    global _pv_cuda_warned
    on_cuda = bool(getattr(q, "is_cuda", False)) or hasattr(q, "__cuda_array_interface__")
    if pv <= 0.0 or not on_cuda:
        return pv
    if not _pv_cuda_warned and not _compiling():
        _pv_cuda_warned = True
        warnings.warn("pvthreshd is not applied to CUDA inputs: libsparge's CUDA kernels have no PV skip in this "
                      "release (its CPU backend has); the attention is computed without it", UserWarning,
                      stacklevel=3)
    return 0.0


def _pv_values(pvthreshd: Any, heads: Optional[int]) -> list:
    """The values of a pvthreshd given as a number, a sequence or a tensor (read on the host)."""
    if isinstance(pvthreshd, (bool, np.bool_, str, bytes)):
        raise C.InvalidArgumentError("pvthreshd must be a number or one per query head, got %r" % (pvthreshd,))
    if isinstance(pvthreshd, (int, float, np.integer, np.floating)):
        return [float(pvthreshd)]
    try:
        if _is_torch(pvthreshd):
            vals = pvthreshd.detach().reshape(-1).tolist()
        else:
            vals = np.asarray(pvthreshd, dtype=np.float64).reshape(-1).tolist()
        vals = [float(x) for x in vals]
    except (TypeError, ValueError):
        raise C.InvalidArgumentError("pvthreshd must be a number or one per query head, got %r"
                                     % (pvthreshd,)) from None
    if not vals or (heads is not None and len(vals) not in (1, heads)):
        raise C.InvalidArgumentError("pvthreshd has %d values but q has %s query heads" % (len(vals), heads))
    return vals


def pv_threshold_of(pvthreshd: Any, heads: Optional[int] = None) -> float:
    """libsparge's ``pv_threshold`` (nats) for the original's ``pvthreshd`` (base 2: the original
    skips a block whose max is at least ``pvthreshd`` below the running max, both multiplied by
    ``scale * log2(e)``): ``pvthreshd * ln 2``.

    ``pvthreshd``: one value, or one per query head (``heads``: their number, checked when given);
    None: off (0). Per-head values that differ give the largest (no head then skips a step that its
    own value would keep; a one-time ``UserWarning`` says so). +inf never skips: 0 (off). 0 skips
    every step whose max is below the running max: the smallest positive float32. A value whose
    threshold float32 cannot hold never skips: 0. NaN is ``InvalidArgumentError``; a negative
    value (skip steps that raise the running max) has no libsparge form: ``UnsupportedError``.
    """
    global _pv_warned
    if pvthreshd is None:
        return 0.0
    vals = _pv_values(pvthreshd, heads)
    if any(math.isnan(x) for x in vals):
        raise C.InvalidArgumentError("pvthreshd is NaN (%r); expected a number >= 0 or None (off)" % (pvthreshd,))
    if min(vals) < 0.0:
        raise C.UnsupportedError("pvthreshd is %g: a negative threshold (skipping steps that raise the running "
                                 "maximum) has no libsparge form; expected a number >= 0 or None (off)" % min(vals))
    t = max(vals)
    if min(vals) != t and not _pv_warned and not _compiling():
        _pv_warned = True
        warnings.warn("pvthreshd differs between heads; libsparge's PV skip takes one threshold per call, so "
                      "the largest, %g, applies to every head (this warning is shown once)" % t, UserWarning,
                      stacklevel=4)
    pv = t * LN2
    if not pv < _F32_MAX:  # (+inf too) a threshold no score difference reaches: off
        return 0.0
    return max(pv, _F32_TRUE_MIN)


def _heads(q: Any, layout: Any) -> Optional[int]:
    """q's number of heads (None where q is not 4-D or the layout unknown: the call reports that)."""
    shape = getattr(q, "shape", None)
    if shape is None or len(shape) != 4 or layout not in ("HND", "NHD"):
        return None
    return int(shape[1] if layout == "HND" else shape[2])


def _unsupported_extras(attn_mask: Any, dropout_p: float) -> None:
    if attn_mask is not None:
        raise C.UnsupportedError("attn_mask (a dense mask) is not supported; use block_sparse_sage2_attn_cuda "
                                 "with a block mask, or is_causal=True")
    if dropout_p:
        raise C.UnsupportedError("dropout_p must be 0 (inference only), got %r" % (dropout_p,))


def _prepare(q: Any, k: Any, v: Any) -> tuple:
    """float32 CUDA torch tensors are computed in float16, like the original."""
    if _is_torch(q) and q.is_cuda and q.dtype == _torch().float32:
        h = _torch().float16
        return q.to(h), k.to(h), v.to(h)
    return q, k, v


def _cast(out: Any, output_dtype: Any) -> Any:
    if output_dtype is AS_COMPUTED or output_dtype is None:
        return out
    if _is_torch(out):
        t = _torch()
        dt = output_dtype if isinstance(output_dtype, t.dtype) else getattr(t, str(np.dtype(output_dtype)))
        return out if out.dtype == dt else out.to(dt)
    if isinstance(out, np.ndarray):
        try:
            dt = np.dtype(output_dtype)
        except TypeError:  # a torch dtype
            dt = np.dtype(str(output_dtype).replace("torch.", ""))
        return out if out.dtype == dt else out.astype(dt)
    return out


def _finish(res: Any, output_dtype: Any, return_sparsity: bool, return_lse: bool) -> Any:
    if return_sparsity:
        out, density = res
        return _cast(out, output_dtype), 1.0 - density
    if return_lse:
        out, lse = res
        return _cast(out, output_dtype), lse
    return _cast(res, output_dtype)


def _predicted(q: Any, k: Any, v: Any, *, attn_mask: Any, dropout_p: float, is_causal: bool,
               scale: Optional[float], smooth_k: bool, simthreshd1: Any, cdfthreshd: Any, topk: Any,
               pvthreshd: Any, attention_sink: bool, tensor_layout: str, output_dtype: Any,
               return_sparsity: bool, return_lse: bool, precision: str) -> Any:
    _unsupported_extras(attn_mask, dropout_p)
    pv = _pv_on(q, pv_threshold_of(pvthreshd, _heads(q, tensor_layout)))
    q, k, v = _prepare(q, k, v)
    if topk is not None:
        mode, cdf = "topk", None
    else:
        mode, cdf = "cdf", (cdfthreshd if cdfthreshd is not None else 0.98)
    res = attention(q, k, v, topk=topk if topk is not None else 0.5, is_causal=is_causal, scale=scale,
                    layout=tensor_layout, mode=mode, cdf_threshold=cdf, sim_threshold=simthreshd1,
                    smooth_k=smooth_k, attention_sink=ATTENTION_SINK, local_window=LOCAL_WINDOW[bool(is_causal)],
                    estimator=ESTIMATOR, precision=precision, pv_threshold=pv, return_sparsity=return_sparsity,
                    return_lse=return_lse and not return_sparsity)
    return _finish(res, output_dtype, return_sparsity, return_lse)


def spas_sage2_attn_meansim_topk_cuda(q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0,
                                      is_causal: bool = False, scale: Optional[float] = None,
                                      smooth_k: bool = True, simthreshd1: Any = -0.1, cdfthreshd: Any = None,
                                      topk: Any = 0.5, pvthreshd: Any = None, attention_sink: bool = False,
                                      tensor_layout: str = "HND", output_dtype: Any = AS_COMPUTED,
                                      return_sparsity: bool = False, return_lse: bool = False) -> Any:
    """SpargeAttn (int8 Q·K, fp8 P·V) with per-row top-k block selection — the recommended API.

    Keeps ``max(1, floor(topk * visible))`` key blocks of each 128-query block row (higher topk:
    more accurate, slower). ``cdfthreshd`` is ignored unless ``topk`` is None (then CDF mode).
    ``pvthreshd``: the PV skip in the original's base-2 units, run as ``pv_threshold=pvthreshd * ln 2``
    (:func:`pv_threshold_of`); None (default, where the original had 50): off.
    ``output_dtype``: default = the computed dtype; pass one to cast. Returns ``out``,
    ``(out, sparsity)`` with ``return_sparsity`` (fraction of visible blocks skipped) or
    ``(out, lse)`` with ``return_lse`` (natural log, float32 ``[B, H, L]``).
    """
    return _predicted(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                      smooth_k=smooth_k, simthreshd1=simthreshd1, cdfthreshd=cdfthreshd, topk=topk,
                      pvthreshd=pvthreshd, attention_sink=attention_sink, tensor_layout=tensor_layout,
                      output_dtype=output_dtype, return_sparsity=return_sparsity, return_lse=return_lse,
                      precision="int8_fp8")


def spas_sage2_attn_meansim_cuda(q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None, smooth_k: bool = True,
                                 simthreshd1: Any = 0.6, cdfthreshd: Any = 0.98, pvthreshd: Any = None,
                                 attention_sink: bool = False, tensor_layout: str = "HND",
                                 output_dtype: Any = AS_COMPUTED, return_sparsity: bool = False,
                                 return_lse: bool = False) -> Any:
    """SpargeAttn (int8 Q·K, fp8 P·V) with CDF block selection (keep the smallest set of blocks
    whose pooled probabilities reach ``cdfthreshd``; blocks with self-similarity below
    ``simthreshd1`` are kept whole). ``pvthreshd`` as in :func:`spas_sage2_attn_meansim_topk_cuda`.
    Returns as that function.
    """
    return _predicted(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                      smooth_k=smooth_k, simthreshd1=simthreshd1, cdfthreshd=cdfthreshd, topk=None,
                      pvthreshd=pvthreshd, attention_sink=attention_sink, tensor_layout=tensor_layout,
                      output_dtype=output_dtype, return_sparsity=return_sparsity, return_lse=return_lse,
                      precision="int8_fp8")


def spas_sage_attn_meansim_topk_cuda(q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0,
                                     is_causal: bool = False, scale: Optional[float] = None,
                                     smooth_k: bool = True, simthreshd1: Any = -0.1, cdfthreshd: Any = None,
                                     topk: Any = 0.5, pvthreshd: Any = None, attention_sink: bool = False,
                                     tensor_layout: str = "HND", output_dtype: Any = AS_COMPUTED,
                                     return_sparsity: bool = False, return_lse: bool = False) -> Any:
    """As :func:`spas_sage2_attn_meansim_topk_cuda`, with 16-bit P·V, the original's format for
    these names: runs libsparge's ``int8_fp16`` precision (Q, K int8 as ``int8_fp8``; P in the
    input's 16-bit type, V as given, fp32 accumulation)."""
    return _predicted(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                      smooth_k=smooth_k, simthreshd1=simthreshd1, cdfthreshd=cdfthreshd, topk=topk,
                      pvthreshd=pvthreshd, attention_sink=attention_sink, tensor_layout=tensor_layout,
                      output_dtype=output_dtype, return_sparsity=return_sparsity, return_lse=return_lse,
                      precision="int8_fp16")


def spas_sage_attn_meansim_cuda(q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0,
                                is_causal: bool = False, scale: Optional[float] = None, smooth_k: bool = True,
                                simthreshd1: Any = 0.6, cdfthreshd: Any = 0.98, pvthreshd: Any = None,
                                attention_sink: bool = False, tensor_layout: str = "HND",
                                output_dtype: Any = AS_COMPUTED, return_sparsity: bool = False,
                                return_lse: bool = False) -> Any:
    """As :func:`spas_sage2_attn_meansim_cuda` (CDF selection), with 16-bit P·V: libsparge's
    ``int8_fp16`` precision."""
    return _predicted(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                      smooth_k=smooth_k, simthreshd1=simthreshd1, cdfthreshd=cdfthreshd, topk=None,
                      pvthreshd=pvthreshd, attention_sink=attention_sink, tensor_layout=tensor_layout,
                      output_dtype=output_dtype, return_sparsity=return_sparsity, return_lse=return_lse,
                      precision="int8_fp16")


def block_sparse_sage2_attn_cuda(q: Any, k: Any, v: Any, mask_id: Any = None, dropout_p: float = 0.0,
                                 scale: Optional[float] = None, smooth_k: bool = True, pvthreshd: Any = None,
                                 attention_sink: bool = False, tensor_layout: str = "HND",
                                 output_dtype: Any = AS_COMPUTED, return_sparsity: bool = False,
                                 return_lse: bool = False, is_causal: bool = False) -> Any:
    """Attention on a user block mask (int8 Q·K, fp8 P·V).

    ``mask_id``: ``[B, H, ceil(Lq/128), ceil(Lkv/64)]`` of 0/1 (any integer or bool dtype; uint8
    and bool are used without a copy); None = all blocks. ``smooth_k`` and ``attention_sink`` are
    accepted for compatibility (K smoothing is always applied to the quantization; a given mask is
    used as is). ``is_causal`` is an addition (default False, as the original had no causality
    here). ``pvthreshd`` as in :func:`spas_sage2_attn_meansim_topk_cuda` (the skip applies to
    masked calls too).
    """
    _unsupported_extras(None, dropout_p)
    if tensor_layout not in ("HND", "NHD"):
        raise C.InvalidArgumentError("tensor_layout must be 'HND' or 'NHD', got %r" % (tensor_layout,))
    pv = _pv_on(q, pv_threshold_of(pvthreshd, _heads(q, tensor_layout)))
    q, k, v = _prepare(q, k, v)
    # no mask: every block, as the dense call (top-k 1: no prediction, no index lists on CUDA)
    res = attention(q, k, v, mask=mask_id, topk=1.0, is_causal=is_causal, scale=scale, layout=tensor_layout,
                    precision="int8_fp8", pv_threshold=pv, return_sparsity=return_sparsity,
                    return_lse=return_lse and not return_sparsity)
    return _finish(res, output_dtype, return_sparsity, return_lse)
