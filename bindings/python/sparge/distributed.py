"""Sequence parallelism over ``torch.distributed``: Ulysses and ring attention with sparse blocks.

Every rank of a process group holds a shard of the sequence: ``q`` ``[B, Hq, S, D]`` and ``k``,
``v`` ``[B, Hkv, S, D]`` (``layout="HND"``; ``"NHD"``: ``[B, S, H, D]``), the global sequence
being ``N = world * S`` tokens long. Two ways to attend over all ``N`` tokens:

- :func:`ulysses_attention`: an all-to-all turns sequence shards into head shards (each rank
  gets all ``N`` tokens of ``Hq / world`` heads), libsparge runs sparse attention over the
  whole sequence for those heads, and a second all-to-all turns the result back. The mask and
  the output are those of one GPU, bit for bit (the same library calls on the same data).
- :func:`ring_attention`: every rank keeps its queries; the K/V shards travel around the ring
  (the transfer of the next shard overlaps the attention on the current one) and the partial
  results are merged exactly by their LSE (:func:`sparge.merge_states`). The block mask is the
  global one: predicted from all of K (and, causal or with a local window, the default, all of Q),
  so every rank keeps exactly the blocks one GPU would keep.

Causal attention needs the load-balanced *zig-zag* sharding: the sequence is cut into
``2 * world`` chunks and rank ``r`` holds chunks ``r`` and ``2 * world - 1 - r`` (concatenated),
so that every rank has the same amount of causal work. :func:`shard_sequence` and
:func:`unshard_sequence` produce and undo it; ``zigzag`` defaults to ``is_causal``.

With one rank (or without an initialized process group) both functions are
:func:`sparge.attention` on the local tensors. Communication uses the group's backend (NCCL
for CUDA tensors, gloo for CPU tensors with libsparge's CPU backend). docs/DISTRIBUTED.md has
the details, including ``NCCL_NVLS_ENABLE=0``.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import _capi as C
from ._api import _records_grad, attention, predict_mask
from .merge import merge_states

__all__ = [
    "ulysses_attention",
    "ring_attention",
    "shard_sequence",
    "unshard_sequence",
    "shard_chunks",
    "chunk_order",
    "ring_schedule",
]


# ------------------------------------------------------------------ sharding (no torch needed)
def shard_chunks(rank: int, world: int, zigzag: bool) -> List[int]:
    """Global chunk indices held by ``rank``: ``[rank]`` of ``world`` chunks, or, zig-zag,
    ``[rank, 2 * world - 1 - rank]`` of ``2 * world`` chunks (in that order)."""
    if not 0 <= rank < world:
        raise C.InvalidArgumentError("rank %d is not in [0, %d)" % (rank, world))
    return [rank, 2 * world - 1 - rank] if zigzag else [rank]


def chunk_order(world: int, zigzag: bool) -> List[int]:
    """Global chunk indices in the order the shards of ranks ``0 .. world-1`` list them."""
    out: List[int] = []
    for r in range(world):
        out.extend(shard_chunks(r, world, zigzag))
    return out


def _concat(parts: Sequence[Any], dim: int) -> Any:
    first = parts[0]
    mod = type(first).__module__ or ""
    if mod.startswith("torch"):
        import torch

        return torch.cat(list(parts), dim=dim)
    import numpy as np

    return np.concatenate(list(parts), axis=dim)


def _narrow(x: Any, dim: int, start: int, length: int) -> Any:
    idx = (slice(None),) * dim + (slice(start, start + length),)
    return x[idx]


def shard_sequence(x: Any, rank: int, world: int, *, dim: int = 2, zigzag: bool = False) -> Any:
    """The shard of the full-sequence array ``x`` (numpy or torch) that ``rank`` holds.

    ``dim``: the sequence dimension (2 for HND ``[B, H, L, D]``, 1 for NHD). The length must be a
    multiple of ``world`` (zig-zag: ``2 * world``)."""
    n = x.shape[dim]
    nchunks = 2 * world if zigzag else world
    if n % nchunks:
        raise C.InvalidArgumentError("sequence length %d is not a multiple of %d (%s sharding over %d ranks)"
                                     % (n, nchunks, "zig-zag" if zigzag else "contiguous", world))
    c = n // nchunks
    return _concat([_narrow(x, dim, g * c, c) for g in shard_chunks(rank, world, zigzag)], dim)


def unshard_sequence(shards: Sequence[Any], *, dim: int = 2, zigzag: bool = False) -> Any:
    """The full sequence from the shards of ranks ``0 .. world-1`` (inverse of shard_sequence)."""
    world = len(shards)
    per = 2 if zigzag else 1
    pieces: Dict[int, Any] = {}
    for r, s in enumerate(shards):
        c = s.shape[dim] // per
        for i, g in enumerate(shard_chunks(r, world, zigzag)):
            pieces[g] = _narrow(s, dim, i * c, c)
    return _concat([pieces[g] for g in range(per * world)], dim)


def ring_schedule(rank: int, world: int, zigzag: bool, causal: bool) -> List[List[Tuple[int, int, str]]]:
    """The attention calls of ``rank`` at each ring step.

    Step ``t`` holds the K/V shard of rank ``(rank - t) % world``. Each call is
    ``(q_piece, kv_piece, kind)``: indices into the local query chunks and the visiting K/V
    chunks (see :func:`shard_chunks`), ``kind`` ``"full"`` (every key visible) or ``"diag"``
    (the chunk against itself, causal). Chunk pairs that causality hides are left out."""
    steps = []
    mine = shard_chunks(rank, world, zigzag)
    for t in range(world):
        src = (rank - t) % world
        theirs = shard_chunks(src, world, zigzag)
        calls = []
        for i, gq in enumerate(mine):
            for j, gk in enumerate(theirs):
                if not causal:
                    calls.append((i, j, "full"))
                elif gk < gq:
                    calls.append((i, j, "full"))
                elif gk == gq:
                    calls.append((i, j, "diag"))
        steps.append(calls)
    return steps


# ------------------------------------------------------------------ helpers
def _torch() -> Any:
    import torch

    return torch


def _group_info(group: Any) -> Tuple[int, int]:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _layout(layout: Any) -> str:
    lay = layout.upper() if isinstance(layout, str) else layout
    if lay not in ("HND", "NHD"):
        raise C.InvalidArgumentError("layout must be 'HND' ([B, H, L, D]) or 'NHD' ([B, L, H, D]), got %r"
                                     % (layout,))
    return lay


def _to_hnd(x: Any, layout: str) -> Any:
    return x if layout == "HND" else x.permute(0, 2, 1, 3)


def _from_hnd(x: Any, layout: str) -> Any:
    return x if layout == "HND" else x.permute(0, 2, 1, 3).contiguous()


def _check_inputs(q: Any, k: Any, v: Any) -> None:
    torch = _torch()
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise C.InvalidArgumentError("%s must be a torch tensor, got %s" % (name, type(t).__name__))
        if t.dim() != 4:
            raise C.InvalidArgumentError("%s must be 4-D, got shape %s" % (name, tuple(t.shape)))
        if t.device != q.device:
            raise C.InvalidArgumentError("%s is on %s but q is on %s" % (name, t.device, q.device))


def _is_scalar(x: Any) -> bool:
    return x is None or isinstance(x, (int, float))


def _slice_heads(x: Any, h0: int, h1: int) -> Any:
    if _is_scalar(x):
        return x
    return x[h0:h1]


def _sparse_kw(topk: Any, mode: str, cdf_threshold: Any, sim_threshold: Any, smooth_k: bool,
               attention_sink: Optional[bool], local_window: Optional[int], estimator: str, precision: str,
               block_size: Tuple[int, int], scale: Optional[float], pv_threshold: Any = 0.0) -> Dict[str, Any]:
    return dict(topk=topk, mode=mode, cdf_threshold=cdf_threshold, sim_threshold=sim_threshold,
                smooth_k=smooth_k, attention_sink=attention_sink, local_window=local_window, estimator=estimator,
                precision=precision, block_size=block_size, scale=scale, pv_threshold=pv_threshold)


def _attn_kw(kw: Dict[str, Any]) -> Dict[str, Any]:
    return dict(precision=kw["precision"], block_size=kw["block_size"], scale=kw["scale"],
                pv_threshold=kw["pv_threshold"])


def _single(q: Any, k: Any, v: Any, is_causal: bool, layout: str, mask: Any, return_lse: bool,
            return_mask: bool, kw: Dict[str, Any]) -> Any:
    """One rank: plain sparge.attention (prediction inside unless the mask is wanted or given)."""
    if mask is None and return_mask:
        mask = predict_mask(q, k, is_causal=is_causal, layout=layout, **kw)
    if mask is None:
        res = attention(q, k, v, is_causal=is_causal, layout=layout, return_lse=return_lse, **kw)
    else:
        res = attention(q, k, v, is_causal=is_causal, layout=layout, mask=mask, return_lse=return_lse,
                        **_attn_kw(kw))
    out, lse = (res if return_lse else (res, None))
    return _result(out, lse, mask, return_lse, return_mask)


def _result(out: Any, lse: Any, mask: Any, return_lse: bool, return_mask: bool) -> Any:
    if not return_lse and not return_mask:
        return out
    res = [out]
    if return_lse:
        res.append(lse)
    if return_mask:
        res.append(mask)
    return tuple(res)


def _natural_index(world: int, zigzag: bool, s: int, device: Any) -> Tuple[Any, Any]:
    """Token permutations between shard order (ranks' shards concatenated) and natural order:
    natural = shard_ordered[:, :, to_natural], shard_ordered = natural[:, :, to_shard]."""
    torch = _torch()
    per = 2 if zigzag else 1
    c = s // per
    order = chunk_order(world, zigzag)  # position p of the shard-ordered sequence holds chunk order[p]
    to_shard = torch.cat([torch.arange(g * c, (g + 1) * c) for g in order])
    to_natural = torch.empty_like(to_shard)
    to_natural[to_shard] = torch.arange(to_shard.numel())
    return to_natural.to(device), to_shard.to(device)


# ------------------------------------------------------------------ Ulysses
def _seq_to_heads(x: Any, world: int, group: Any) -> Any:
    """[B, H, S, ...] sequence shard -> [B, H/world, world*S, ...] (shard order): all-to-all."""
    import torch.distributed as dist

    torch = _torch()
    B, H = x.shape[0], x.shape[1]
    rest = tuple(x.shape[2:])
    send = x.reshape((B, world, H // world) + rest).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[j]: rank j's sequence shard of my heads
    full = recv.permute((1, 2, 0) + tuple(range(3, recv.dim())))  # [B, H/w, world, S, ...]
    return full.reshape((B, H // world, world * rest[0]) + rest[1:])


def _heads_to_seq(x: Any, world: int, group: Any) -> Any:
    """[B, H/world, world*S, ...] (shard order) -> [B, H, S, ...] sequence shard: all-to-all."""
    import torch.distributed as dist

    torch = _torch()
    B, h = x.shape[0], x.shape[1]
    n = x.shape[2]
    rest = tuple(x.shape[3:])
    s = n // world
    send = x.reshape((B, h, world, s) + rest).permute((2, 0, 1, 3) + tuple(range(4, x.dim() + 1))).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[j]: my sequence shard of rank j's heads
    return recv.transpose(0, 1).reshape((B, world * h, s) + rest)


def ulysses_attention(q: Any, k: Any, v: Any, group: Any = None, *, is_causal: bool = False,
                      zigzag: Optional[bool] = None, layout: str = "HND", mask: Any = None,
                      topk: Any = 0.5, mode: str = "topk", cdf_threshold: Any = None, sim_threshold: Any = -0.1,
                      smooth_k: bool = True, attention_sink: Optional[bool] = None,
                      local_window: Optional[int] = None, estimator: str = "auto", precision: str = "auto",
                      block_size: Tuple[int, int] = (128, 64), scale: Optional[float] = None,
                      pv_threshold: float = 0.0, return_lse: bool = False, return_mask: bool = False) -> Any:
    """Sparse attention over the whole sequence, Ulysses style (all-to-all over heads).

    Args:
        q, k, v: this rank's sequence shards (torch tensors, one device), ``[B, Hq, S, D]`` /
            ``[B, Hkv, S_kv, D]`` (``"HND"``) or ``[B, S, H, D]`` (``"NHD"``). ``Hq`` must be a
            multiple of the world size; ``Hkv`` too, or else K/V heads are repeated until it is
            (GQA with fewer K/V heads than ranks). Non-causal calls may have ``S_kv != S``.
        group: the process group (None: the default group).
        is_causal: bottom-right causal over the global sequence.
        zigzag: the shards are zig-zag (:func:`shard_sequence`); default ``is_causal``.
        mask: optional global uint8/bool block mask ``[B, Hq, ceil(N/BQ), ceil(N_kv/BK)]`` in
            natural token order (no prediction then), the same on every rank.
        topk, mode, cdf_threshold, sim_threshold, smooth_k, attention_sink, local_window,
            estimator, precision, block_size, scale, pv_threshold: as in :func:`sparge.attention` (per-head
            values: for all ``Hq`` heads; each rank uses those of its heads).
        return_lse: also return the float32 LSE of the local rows ``[B, Hq, S]``.
        return_mask: also return the mask this rank used: the global mask's rows of all query
            blocks for this rank's heads, ``[B, Hq / world, nQB, nKB]``.

    Returns:
        ``out`` (q's shard shape, layout and dtype), or a tuple with ``lse`` and/or ``mask``.
    """
    _check_inputs(q, k, v)
    layout = _layout(layout)
    zig = bool(is_causal) if zigzag is None else bool(zigzag)
    kw = _sparse_kw(topk, mode, cdf_threshold, sim_threshold, smooth_k, attention_sink, local_window, estimator,
                    precision, block_size, scale, pv_threshold)
    rank, world = _group_info(group)
    if world == 1:
        return _single(q, k, v, is_causal, layout, mask, return_lse, return_mask, kw)
    qh, kh, vh = _to_hnd(q, layout), _to_hnd(k, layout), _to_hnd(v, layout)
    B, Hq, S, D = qh.shape
    Hkv, Skv = kh.shape[1], kh.shape[2]
    if Hq % world:
        raise C.InvalidArgumentError("ulysses_attention: heads_q (%d) must be a multiple of the world size (%d)"
                                     % (Hq, world))
    if Hq % Hkv:
        raise C.InvalidArgumentError("heads_q (%d) must be a multiple of heads_kv (%d)" % (Hq, Hkv))
    if (zig or is_causal) and Skv != S:
        raise C.InvalidArgumentError("causal or zig-zag sharding needs equal q and k shard lengths, got %d and %d"
                                     % (S, Skv))
    if zig and S % 2:
        raise C.InvalidArgumentError("zig-zag shards have an even length (two chunks), got %d" % S)
    rep = 1
    if Hkv % world:
        rep = world // math.gcd(Hkv, world)
        if (Hq // Hkv) % rep:
            raise C.InvalidArgumentError(
                "ulysses_attention: heads_kv (%d) cannot be spread over %d ranks with heads_q = %d "
                "(repeating K/V heads %d times breaks the GQA grouping)" % (Hkv, world, Hq, rep))
        kh = kh.repeat_interleave(rep, dim=1)
        vh = vh.repeat_interleave(rep, dim=1)
    h0, h1 = rank * (Hq // world), (rank + 1) * (Hq // world)

    qf = _seq_to_heads(qh, world, group)
    kf = _seq_to_heads(kh, world, group)
    vf = _seq_to_heads(vh, world, group)
    to_nat_q = to_shard_q = None
    if zig:
        to_nat_q, to_shard_q = _natural_index(world, True, S, q.device)
        qf, kf, vf = (t.index_select(2, to_nat_q) for t in (qf, kf, vf))

    local_kw = dict(kw)
    for key in ("topk", "cdf_threshold", "sim_threshold"):
        local_kw[key] = _slice_heads(kw[key], h0, h1)
    m = None
    if mask is not None:
        m = mask[:, h0:h1]
    elif return_mask:
        m = predict_mask(qf, kf, is_causal=is_causal, **local_kw)
    if m is None:
        res = attention(qf, kf, vf, is_causal=is_causal, return_lse=return_lse, **local_kw)
    else:
        res = attention(qf, kf, vf, is_causal=is_causal, mask=m, return_lse=return_lse, **_attn_kw(kw))
    of, lf = (res if return_lse else (res, None))
    del qf, kf, vf
    if zig:
        of = of.index_select(2, to_shard_q)
        if lf is not None:
            lf = lf.index_select(2, to_shard_q)
    out = _heads_to_seq(of, world, group)
    lse = _heads_to_seq(lf, world, group) if lf is not None else None
    return _result(_from_hnd(out, layout), lse, m, return_lse, return_mask)


# ------------------------------------------------------------------ ring
def _all_gather_seq(x: Any, world: int, group: Any) -> Any:
    """[B, H, S, D] shards of every rank -> [B, H, world*S, D] in shard order."""
    import torch.distributed as dist

    torch = _torch()
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=2)


#: Bytes of all-gathered Q and K that one prediction call may hold; larger problems predict the
#: mask a few K/V heads (with their query heads) at a time. The mask of a head depends on that
#: head only, so the result is the same.
PREDICT_GATHER_BYTES = 1 << 30


def _global_mask_rows(qh: Any, kh: Any, world: int, group: Any, zig: bool, causal: bool, mine: List[int],
                      qb_per: int, kw: Dict[str, Any]) -> Any:
    """Rows of the global block mask for this rank's query blocks (shard order).

    Non-causal with ``local_window=0``: this rank's queries against all of K (a query block's row
    depends on that block and on all of K only). Causal, or with a local window (whose blocks sit
    at the global query positions; None, the default, is one in both modes): all of Q and all of K,
    as one GPU would see them."""
    torch = _torch()
    B, Hq, S, D = qh.shape
    Hkv = kh.shape[1]
    G = Hq // Hkv
    full_q = causal or kw.get("local_window") != 0
    per_kv_head = world * S * D * qh.element_size() * (1 + (G if full_q else 0)) * B
    step = max(1, min(Hkv, PREDICT_GATHER_BYTES // max(1, per_kv_head)))
    to_nat = _natural_index(world, zig, S, qh.device)[0] if zig else None
    parts = []
    for k0 in range(0, Hkv, step):
        k1 = min(Hkv, k0 + step)
        h0, h1 = k0 * G, k1 * G
        sub_kw = dict(kw)
        for key in ("topk", "cdf_threshold", "sim_threshold"):
            sub_kw[key] = _slice_heads(kw[key], h0, h1)
        kfull = _all_gather_seq(kh[:, k0:k1], world, group)
        if zig:
            kfull = kfull.index_select(2, to_nat)
        if full_q:
            qfull = _all_gather_seq(qh[:, h0:h1], world, group)
            if zig:
                qfull = qfull.index_select(2, to_nat)
            mfull = predict_mask(qfull, kfull, is_causal=causal, **sub_kw)
            del qfull
            parts.append(torch.cat([mfull[:, :, g * qb_per:(g + 1) * qb_per] for g in mine], dim=2))
            del mfull
        else:
            parts.append(predict_mask(qh[:, h0:h1], kfull, is_causal=False, **sub_kw))
        del kfull
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def ring_attention(q: Any, k: Any, v: Any, group: Any = None, *, is_causal: bool = False,
                   zigzag: Optional[bool] = None, layout: str = "HND", mask: Any = None,
                   topk: Any = 0.5, mode: str = "topk", cdf_threshold: Any = None, sim_threshold: Any = -0.1,
                   smooth_k: bool = True, attention_sink: Optional[bool] = None,
                      local_window: Optional[int] = None, estimator: str = "auto", precision: str = "auto",
                   block_size: Tuple[int, int] = (128, 64), scale: Optional[float] = None,
                   pv_threshold: float = 0.0, return_lse: bool = False, return_mask: bool = False) -> Any:
    """Sparse attention over the whole sequence, ring style (K/V shards travel around the ring).

    Args:
        q, k, v: this rank's sequence shards (torch tensors, one device), ``[B, Hq, S, D]`` /
            ``[B, Hkv, S, D]`` (``"HND"``) or ``[B, S, H, D]`` (``"NHD"``); GQA as in
            :func:`sparge.attention`. Each chunk of a shard (the shard, or zig-zag each half)
            must be a whole number of mask blocks: a multiple of both ``block_size`` entries.
        group: the process group (None: the default group).
        is_causal: bottom-right causal over the global sequence (the sequence of N tokens, so
            top-left as well).
        zigzag: the shards are zig-zag (:func:`shard_sequence`); default ``is_causal``
            (load balance). Contiguous causal shards work too, unbalanced.
        mask: optional global uint8/bool block mask ``[B, Hq, N/BQ, N/BK]`` in natural token
            order, the same on every rank (no prediction then).
        topk, mode, cdf_threshold, sim_threshold, smooth_k, attention_sink, local_window,
            estimator, precision, block_size, scale: as in :func:`sparge.attention`. The mask is predicted once per
            call with these over the global sequence: from this rank's queries and all of K
            (all-gathered), causal from all of Q and K, so each rank keeps exactly the rows of
            the mask one GPU would predict.
        pv_threshold: the PV skip of :func:`sparge.attention`, applied in each ring step's call: a
            row's running maximum there covers the keys of the visiting K/V shard only, so the
            steps it skips can differ from one GPU's (mostly fewer).
        return_lse: also return the float32 LSE of the local rows ``[B, Hq, S]``.
        return_mask: also return the mask rows this rank used, ``[B, Hq, nQB_local, N/BK]``
            (its query blocks in shard order).

    Returns:
        ``out`` (q's shard shape, layout and dtype), or a tuple with ``lse`` and/or ``mask``.

    With the int8 precisions each K/V shard is quantized on its own (its own K mean and V
    scales), so the result matches one GPU within the quantization error, not bit for bit;
    with ``precision="fp16"`` or ``"exact"`` it matches within the rounding of the partial
    outputs.
    """
    _check_inputs(q, k, v)
    layout = _layout(layout)
    zig = bool(is_causal) if zigzag is None else bool(zigzag)
    kw = _sparse_kw(topk, mode, cdf_threshold, sim_threshold, smooth_k, attention_sink, local_window, estimator,
                    precision, block_size, scale, pv_threshold)
    rank, world = _group_info(group)
    if world == 1:
        return _single(q, k, v, is_causal, layout, mask, return_lse, return_mask, kw)
    import torch.distributed as dist

    torch = _torch()
    qh, kh, vh = _to_hnd(q, layout), _to_hnd(k, layout), _to_hnd(v, layout)
    B, Hq, S, D = qh.shape
    if kh.shape[2] != S or vh.shape[2] != S:
        raise C.InvalidArgumentError("ring_attention: q, k and v shards must have one length, got %d, %d, %d"
                                     % (S, kh.shape[2], vh.shape[2]))
    try:
        bq, bk = (int(block_size[0]), int(block_size[1]))
    except (TypeError, ValueError, IndexError):
        raise C.InvalidArgumentError("block_size must be a pair (BQ, BK), got %r" % (block_size,))
    per = 2 if zig else 1
    if S % per:
        raise C.InvalidArgumentError("zig-zag shards have an even length (two chunks), got %d" % S)
    c = S // per
    if bq < 1 or bk < 1 or c % bq or c % bk:
        raise C.InvalidArgumentError(
            "ring_attention: each chunk of a shard (%d tokens: %s) must be a multiple of the mask blocks %r; "
            "pad the sequence or choose another world size" % (c, "half a zig-zag shard" if zig else "the shard",
                                                                (bq, bk)))
    mine = shard_chunks(rank, world, zig)
    qb_per, kb_per = c // bq, c // bk

    # ---- the global mask rows of this rank's query blocks
    if mask is not None:
        rows = torch.cat([mask[:, :, g * qb_per:(g + 1) * qb_per] for g in mine], dim=2)
    else:
        rows = _global_mask_rows(qh, kh, world, group, zig, is_causal, mine, qb_per, kw)
    rows = rows.contiguous()

    # ---- the ring
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    g_nxt = dist.get_global_rank(group, nxt) if group is not None else nxt
    g_prv = dist.get_global_rank(group, prv) if group is not None else prv
    kv = (kh.contiguous(), vh.contiguous())
    acc: List[Any] = [None] * per   # per local query chunk: (float32 out, lse)
    akw = _attn_kw(kw)
    for t in range(world):
        reqs = None
        if t + 1 < world:  # start the transfer of the next shard before computing on this one
            nk, nv = torch.empty_like(kv[0]), torch.empty_like(kv[1])
            ops = [dist.P2POp(dist.isend, kv[0], g_nxt, group), dist.P2POp(dist.isend, kv[1], g_nxt, group),
                   dist.P2POp(dist.irecv, nk, g_prv, group), dist.P2POp(dist.irecv, nv, g_prv, group)]
            reqs = dist.batch_isend_irecv(ops)
        _ring_step(qh, kv[0], kv[1], rows, acc, rank, world, t, zig, is_causal, c, qb_per, kb_per, akw)
        if reqs is not None:
            for r in reqs:
                r.wait()
            kv = (nk, nv)
    return _ring_finish(acc, q.dtype, layout, is_causal, rows, return_lse, return_mask)


def _ring_step(qh: Any, k: Any, v: Any, rows: Any, acc: List[Any], rank: int, world: int, t: int, zig: bool,
               causal: bool, c: int, qb_per: int, kb_per: int, akw: Dict[str, Any]) -> None:
    """Ring step t of `rank`: attention of the local queries on the visiting K/V shard (that of rank
    (rank - t) % world), merged into `acc` (one (float32 out, lse) per local query chunk)."""
    torch = _torch()
    theirs = shard_chunks((rank - t) % world, world, zig)
    calls = ring_schedule(rank, world, zig, causal)[t]
    if not causal:  # one call: all local queries against the whole visiting shard
        calls = [(None, None, "full")]
    for i, j, kind in calls:
        qs = qh if i is None else qh[:, :, i * c:(i + 1) * c]
        ks = k if j is None else k[:, :, j * c:(j + 1) * c]
        vs = v if j is None else v[:, :, j * c:(j + 1) * c]
        r_sel = rows if i is None else rows[:, :, i * qb_per:(i + 1) * qb_per]
        cols = theirs if j is None else [theirs[j]]
        sub = torch.cat([r_sel[:, :, :, g * kb_per:(g + 1) * kb_per] for g in cols], dim=3).contiguous()
        o, l = attention(qs, ks, vs, mask=sub, is_causal=(kind == "diag"), return_lse=True, **akw)
        slot = 0 if i is None else i
        if acc[slot] is None:
            acc[slot] = (o.float(), l)
        elif _records_grad(acc[slot][0], acc[slot][1], o, l):  # new tensors (merge_states refuses out= there)
            acc[slot] = merge_states([acc[slot][0], o], [acc[slot][1], l], dtype="float32")
        else:
            merge_states([acc[slot][0], o], [acc[slot][1], l], out=acc[slot][0], lse_out=acc[slot][1])


def _ring_finish(acc: List[Any], dtype: Any, layout: str, causal: bool, rows: Any, return_lse: bool,
                 return_mask: bool) -> Any:
    torch = _torch()
    if causal:
        out_f = torch.cat([a[0] for a in acc], dim=2)
        lse = torch.cat([a[1] for a in acc], dim=2)
    else:
        out_f, lse = acc[0]
    out = _from_hnd(out_f.to(dtype), layout)
    return _result(out, lse, rows, return_lse, return_mask)
