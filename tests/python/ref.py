"""float64 numpy references written from docs/SEMANTICS.md, independent of the library."""

import math

import numpy as np


def to_hnd(x, layout):
    return x if layout == "HND" else np.swapaxes(x, 1, 2)


def visible_blocks(Lq, Lkv, bq, bk, causal):
    nqb, nkb = -(-Lq // bq), -(-Lkv // bk)
    vis = []
    for qb in range(nqb):
        if not causal:
            vis.append(nkb)
            continue
        last_row = min(qb * bq + bq - 1, Lq - 1)
        last_key = last_row + Lkv - Lq
        vis.append(0 if last_key < 0 else min(last_key, Lkv - 1) // bk + 1)
    return np.array(vis, dtype=np.int64)


def token_allowed(Lq, Lkv, causal, mask_bh=None, bq=128, bk=64):
    """[Lq, Lkv] bool: key j is used by query i (causal rule and block mask)."""
    allowed = np.ones((Lq, Lkv), dtype=bool)
    if causal:
        i = np.arange(Lq)[:, None]
        j = np.arange(Lkv)[None, :]
        allowed &= j <= i + (Lkv - Lq)
    if mask_bh is not None:
        m = np.asarray(mask_bh).astype(bool)
        full = np.repeat(np.repeat(m, bq, axis=0), bk, axis=1)[:Lq, :Lkv]
        allowed &= full
    return allowed


def attention(q, k, v, *, mask=None, causal=False, scale=None, layout="HND", bq=128, bk=64):
    """Dense softmax attention restricted to a block mask. Returns (out [layout], lse [B,Hq,Lq])."""
    q = to_hnd(np.asarray(q, dtype=np.float64), layout)
    k = to_hnd(np.asarray(k, dtype=np.float64), layout)
    v = to_hnd(np.asarray(v, dtype=np.float64), layout)
    B, Hq, Lq, D = q.shape
    Hkv, Lkv = k.shape[1], k.shape[2]
    g = Hq // Hkv
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    out = np.zeros((B, Hq, Lq, D))
    lse = np.full((B, Hq, Lq), -np.inf)
    for b in range(B):
        for h in range(Hq):
            s = (q[b, h] @ k[b, h // g].T) * scale
            allowed = token_allowed(Lq, Lkv, causal, None if mask is None else mask[b, h], bq, bk)
            s = np.where(allowed, s, -np.inf)
            m = s.max(axis=1, keepdims=True)
            has = np.isfinite(m[:, 0])
            m = np.where(np.isfinite(m), m, 0.0)
            p = np.where(allowed, np.exp(s - m), 0.0)
            l = p.sum(axis=1, keepdims=True)
            o = (p @ v[b, h // g]) / np.where(l > 0, l, 1.0)
            out[b, h] = np.where(has[:, None], o, 0.0)
            lse[b, h] = np.where(has, m[:, 0] + np.log(np.where(l[:, 0] > 0, l[:, 0], 1.0)), -np.inf)
    if layout == "NHD":
        out = np.swapaxes(out, 1, 2)
    return out, lse


def _pool_sim(x, bs):
    """x [L, D] -> pooled [n, D], sim [n]."""
    L, D = x.shape
    n = -(-L // bs)
    pooled = np.zeros((n, D))
    sim = np.zeros(n)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    xh = np.where(norms > 0, x / np.where(norms > 0, norms, 1.0), 0.0)
    for i in range(n):
        blk = x[i * bs:(i + 1) * bs]
        cnt = blk.shape[0]
        pooled[i] = blk.mean(axis=0)
        ssum = xh[i * bs:(i + 1) * bs].sum(axis=0)
        sim[i] = float(ssum @ ssum) / (cnt * cnt)
    return pooled, sim


def budget_forced(qb, nv, Lq, Lkv, bq, bk, causal, sink, window):
    """Key blocks of row qb kept before the ranking and counted in its budget: the sink (block 0),
    the local window (blocks holding the diagonal keys i + Lkv - Lq of the rows, and window - 1 more
    on each side) and, causal, the first diagonal block. sink / window None: the mode's defaults."""
    if sink is None:
        sink = True
    if window is None:
        window = 2 if causal else 1
    rows = np.arange(qb * bq, min(Lq, qb * bq + bq))
    diag = np.clip(rows + (Lkv - Lq), 0, Lkv - 1) // bk
    first, last = int(diag.min()), int(diag.max())
    f = np.zeros(nv, dtype=bool)
    if sink:
        f[0] = True
    if window > 0:
        f[max(0, first - (window - 1)):max(0, min(nv, last + window))] = True
    elif causal and first < nv:
        f[first] = True
    return f


def predict(q, k, *, topk=0.5, mode="topk", cdf=0.9, sim_threshold=-0.1, smooth_k=True, sink=None,
            causal=False, scale=None, layout="HND", bq=128, bk=64, window=None):
    """Returns (mask [B,Hq,nQB,nKB] uint8, margin [B,Hq,nQB]).

    margin: how far the row's selection is from flipping (probability gap at the
    top-k cut, or distance of the CDF prefix sum from the threshold); rows with a
    tiny margin may legitimately differ from a float32 implementation.
    """
    q = to_hnd(np.asarray(q, dtype=np.float64), layout)
    k = to_hnd(np.asarray(k, dtype=np.float64), layout)
    B, Hq, Lq, D = q.shape
    Hkv, Lkv = k.shape[1], k.shape[2]
    g = Hq // Hkv
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    vis = visible_blocks(Lq, Lkv, bq, bk, causal)
    nqb, nkb = len(vis), -(-Lkv // bk)
    mask = np.zeros((B, Hq, nqb, nkb), dtype=np.uint8)
    margin = np.full((B, Hq, nqb), np.inf)

    def per_head(x, h):
        return float(x[h]) if np.ndim(x) else float(x)

    for b in range(B):
        for h in range(Hq):
            kk = k[b, h // g]
            if smooth_k:
                kk = kk - kk.mean(axis=0, keepdims=True)
            pq, sq = _pool_sim(q[b, h], bq)
            pk, sk = _pool_sim(kk, bk)
            th = per_head(sim_threshold, h)
            for qb in range(nqb):
                nv = int(vis[qb])
                if nv == 0:
                    continue
                s = scale * (pk[:nv] @ pq[qb])
                p = np.exp(s - s.max())
                p /= p.sum()
                fb = budget_forced(qb, nv, Lq, Lkv, bq, bk, causal, sink, window)
                nf = int(fb.sum())
                # (in float64 the probabilities order like the scores, which top-k ranks: docs/SEMANTICS.md)
                order = sorted(range(nv), key=lambda j: (not fb[j], 0.0 if fb[j] else -p[j], j))
                if mode == "topk":
                    # topk crosses the ABI as a float32 (0.9 arrives as 0.89999998)
                    n = max(1, min(nv, int(math.floor(float(np.float32(per_head(topk, h))) * nv + 1e-4))))
                    n = max(n, nf)
                    if nf <= n - 1 and n < nv:
                        margin[b, h, qb] = p[order[n - 1]] - p[order[n]]
                else:
                    thr = per_head(cdf, h)
                    acc, n = 0.0, 0
                    best = np.inf
                    for j in order:
                        acc += p[j]
                        n += 1
                        if n >= nf:
                            best = min(best, abs(acc - thr))
                        if n >= nf and acc >= thr:
                            break
                    margin[b, h, qb] = best
                sel = np.zeros(nkb, dtype=bool)
                sel[order[:n]] = True
                if sq[qb] < th:
                    sel[:nv] = True
                sel[:nv] |= sk[:nv] < th
                sel[nv:] = False
                mask[b, h, qb] = sel
    return mask, margin


def cosine(a, b):
    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-300))


def rel_l1(a, ref):
    a = np.asarray(a, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    return float(np.abs(a - ref).sum() / (np.abs(ref).sum() + 1e-300))
