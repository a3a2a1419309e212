"""Oracle yardstick for predicted block masks (docs/ACCURACY.md, "Predicted masks"); numpy only.

From captured Q, K, V of one attention layer (an .npz written by tools/accuracy/capture.py or
``sparge.tune.capture``) it computes, in float64:

- the exact per-block softmax mass M[h, qb, kb]: the mean over the rows of query block qb of the
  dense softmax probability that falls on the keys of key block kb;
- for a block mask: density (kept / visible blocks), captured mass (mean over rows of the dense
  probability on the kept keys), cosine and relative L1 (sum|o - ref| / sum|ref|) of the output
  against dense attention, and the number of query rows left without any kept key;
- the oracle mask of a mask: per row, the same number of blocks, taken by largest exact mass;
- masks of several block-importance estimators (``ESTIMATORS``) under the library's selection rule
  (top-k or CDF, sink and local window counted in the budget, causal diagonal block always kept),
  and the library's own mask (``sparge.predict_mask`` on the CPU backend) for the library's
  estimators (``LIBRARY_ESTIMATORS``). ``"auto"`` is the library's default of the capture's mode
  (``default_estimator``).

Restricting softmax to a subset of keys renormalises the dense probabilities, so every mask is
evaluated from per-block partial sums of one dense pass: sum_kb keep * (P_kb V_kb) / sum_kb keep * l_kb.

    python3 tools/accuracy/yardstick.py CAPTURE.npz [...] [--topk 0.2 0.5] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence

import numpy as np

BQ, BK = 128, 64


# ------------------------------------------------------------------ captures
@dataclass
class Capture:
    q: np.ndarray  # [Hq, L, D]
    k: np.ndarray  # [Hkv, Lkv, D]
    v: np.ndarray  # [Hkv, Lkv, D]
    causal: bool
    name: str = ""
    scale: Optional[float] = None

    @property
    def Hq(self) -> int:
        return self.q.shape[0]

    @property
    def group(self) -> int:
        return self.q.shape[0] // self.k.shape[0]

    @property
    def sc(self) -> float:
        return self.scale if self.scale else 1.0 / math.sqrt(self.q.shape[2])


def load(path: str) -> Capture:
    z = np.load(path, allow_pickle=False)
    scale = float(z["scale"]) if "scale" in z.files else None
    name = str(z["name"]) if "name" in z.files else path
    return Capture(z["q"], z["k"], z["v"], bool(z["causal"]), name, scale)


def save(path: str, cap: Capture, **meta) -> None:
    np.savez_compressed(path, q=cap.q.astype(np.float16), k=cap.k.astype(np.float16),
                        v=cap.v.astype(np.float16), causal=np.bool_(cap.causal), name=np.str_(cap.name),
                        scale=np.float64(cap.sc), **{k: np.asarray(v) for k, v in meta.items()})


def visible(Lq: int, Lkv: int, causal: bool) -> np.ndarray:
    nqb, nkb = -(-Lq // BQ), -(-Lkv // BK)
    if not causal:
        return np.full(nqb, nkb, dtype=np.int64)
    last = np.minimum(np.arange(nqb) * BQ + BQ - 1, Lq - 1) + (Lkv - Lq)
    return np.where(last < 0, 0, np.minimum(last, Lkv - 1) // BK + 1)


# ------------------------------------------------------------------ dense pass
@dataclass
class HeadPass:
    """Per-block partial sums of one head's dense attention (float64)."""
    l: np.ndarray     # [L, nKB]  dense probability mass of row i on key block kb
    pv: np.ndarray    # [L, nKB, D]  sum_{j in kb} P_ij v_j
    mass: np.ndarray  # [nQB, nKB] mean over the rows of qb of l
    ref: np.ndarray = None   # [L, D] dense output
    sees: np.ndarray = None  # [L] rows that see a key

    def __post_init__(self):
        self.ref = self.pv.sum(axis=1)
        self.sees = self.l.sum(axis=1) > 0
        self.ref_l1 = float(np.abs(self.ref).sum())
        self.ref_n2 = float((self.ref * self.ref).sum())


def head_pass(cap: Capture, h: int) -> HeadPass:
    q = cap.q[h].astype(np.float64)
    k = cap.k[h // cap.group].astype(np.float64)
    v = cap.v[h // cap.group].astype(np.float64)
    Lq, D = q.shape
    Lkv = k.shape[0]
    nqb, nkb = -(-Lq // BQ), -(-Lkv // BK)
    pad = nkb * BK - Lkv
    kp = np.concatenate([k, np.zeros((pad, D))]) if pad else k
    vp = np.concatenate([v, np.zeros((pad, D))]) if pad else v
    vb = vp.reshape(nkb, BK, D)
    l = np.zeros((Lq, nkb))
    pv = np.zeros((Lq, nkb, D))
    mass = np.zeros((nqb, nkb))
    j = np.arange(nkb * BK)
    for qb in range(nqb):
        r0, r1 = qb * BQ, min(Lq, qb * BQ + BQ)
        s = (q[r0:r1] @ kp.T) * cap.sc
        allowed = j[None, :] < Lkv
        if cap.causal:
            allowed = allowed & (j[None, :] <= np.arange(r0, r1)[:, None] + (Lkv - Lq))
        s = np.where(allowed, s, -np.inf)
        m = s.max(axis=1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        p = np.exp(s - m)
        tot = p.sum(axis=1, keepdims=True)
        p = p / np.where(tot > 0, tot, 1.0)
        pb = p.reshape(r1 - r0, nkb, BK)
        l[r0:r1] = pb.sum(axis=2)
        pv[r0:r1] = np.einsum("rkb,kbd->rkd", pb, vb, optimize=True)
        mass[qb] = l[r0:r1].mean(axis=0)
    return HeadPass(l, pv, mass)


@dataclass
class Score:
    kept: int = 0
    vis: int = 0
    mass: float = 0.0   # sum over rows of captured dense mass
    rows: int = 0       # rows that see at least one key
    zero_rows: int = 0  # of those, rows left without a kept key
    l1: float = 0.0
    l1_ref: float = 0.0
    dot: float = 0.0
    n2: float = 0.0
    n2_ref: float = 0.0

    def add(self, o: "Score") -> None:
        for f in self.__dataclass_fields__:
            setattr(self, f, getattr(self, f) + getattr(o, f))

    @property
    def density(self) -> float:
        return self.kept / max(1, self.vis)

    @property
    def captured(self) -> float:
        return self.mass / max(1, self.rows)

    @property
    def rel_l1(self) -> float:
        return self.l1 / max(self.l1_ref, 1e-300)

    @property
    def cosine(self) -> float:
        return self.dot / max(math.sqrt(self.n2 * self.n2_ref), 1e-300)

    def as_dict(self) -> Dict[str, float]:
        return dict(density=self.density, captured=self.captured, rel_l1=self.rel_l1, cosine=self.cosine,
                    zero_rows=self.zero_rows)


def score_mask(hp: HeadPass, mask: np.ndarray, vis: np.ndarray) -> Score:
    """mask: [nQB, nKB] of one head."""
    Lq = hp.l.shape[0]
    keep = mask[np.arange(Lq) // BQ].astype(np.float64)  # [L, nKB]
    den = (hp.l * keep).sum(axis=1)
    num = np.einsum("rkd,rk->rd", hp.pv, keep, optimize=True)
    o = num / np.where(den > 0, den, 1.0)[:, None]
    ref, sees = hp.ref, hp.sees
    s = Score()
    s.kept = int(mask.sum())
    s.vis = int(vis.sum())
    s.mass = float(den[sees].sum())
    s.rows = int(sees.sum())
    s.zero_rows = int((sees & (den <= 0)).sum())
    s.l1 = float(np.abs(o - ref).sum())
    s.l1_ref = hp.ref_l1
    s.dot = float((o * ref).sum())
    s.n2 = float((o * o).sum())
    s.n2_ref = hp.ref_n2
    return s


def oracle_mask(mass: np.ndarray, counts: np.ndarray, vis: np.ndarray) -> np.ndarray:
    """Per row the `counts[qb]` visible blocks of largest exact mass."""
    m = np.zeros_like(mass, dtype=np.uint8)
    for qb in range(mass.shape[0]):
        n = int(counts[qb])
        if n <= 0:
            continue
        order = np.argsort(-mass[qb, :vis[qb]], kind="stable")
        m[qb, order[:n]] = 1
    return m


# ------------------------------------------------------------------ estimators
def _pool(x: np.ndarray, bs: int) -> np.ndarray:
    L, D = x.shape
    n = -(-L // bs)
    pad = n * bs - L
    cnt = np.full(n, bs, dtype=np.float64)
    cnt[-1] = bs - pad
    xp = np.concatenate([x, np.zeros((pad, D))]) if pad else x
    return xp.reshape(n, bs, D).sum(axis=1) / cnt[:, None]


def _blockwise(s: np.ndarray, Lkv: int, reduce: str) -> np.ndarray:
    """s: [nQB, Lkv] per-key scores -> [nQB, nKB] per block (log-sum-exp or max)."""
    nkb = -(-Lkv // BK)
    pad = nkb * BK - Lkv
    sp = np.concatenate([s, np.full((s.shape[0], pad), -np.inf)], axis=1) if pad else s
    sb = sp.reshape(s.shape[0], nkb, BK)
    if reduce == "max":
        return sb.max(axis=2)
    m = sb.max(axis=2, keepdims=True)
    mf = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return (mf + np.log(np.exp(sb - mf).sum(axis=2, keepdims=True)))[..., 0]


def _key_causal(Lq: int, Lkv: int, causal: bool) -> Optional[np.ndarray]:
    """[nQB, Lkv]: keys visible to the last row of each query block."""
    if not causal:
        return None
    nqb = -(-Lq // BQ)
    last = np.minimum(np.arange(nqb) * BQ + BQ - 1, Lq - 1) + (Lkv - Lq)
    return np.arange(Lkv)[None, :] <= last[:, None]


def est_mean(cap: Capture, h: int) -> np.ndarray:
    """SpargeAttn: scale * mean(q block) . mean(k' block), K smoothed by its mean."""
    q = cap.q[h].astype(np.float64)
    k = cap.k[h // cap.group].astype(np.float64)
    k = k - k.mean(axis=0, keepdims=True)
    return cap.sc * _pool(q, BQ) @ _pool(k, BK).T


def est_pooled_q_keys(cap: Capture, h: int, reduce: str = "lse") -> np.ndarray:
    """Pooled query block against every key, reduced per key block (log-sum-exp or max)."""
    q = cap.q[h].astype(np.float64)
    k = cap.k[h // cap.group].astype(np.float64)
    s = cap.sc * _pool(q, BQ) @ k.T
    vis = _key_causal(q.shape[0], k.shape[0], cap.causal)
    if vis is not None:
        s = np.where(vis, s, -np.inf)
    return _blockwise(s, k.shape[0], reduce)


def est_sampled_rows(cap: Capture, h: int, rows: int = 4) -> np.ndarray:
    """Exact softmax block mass of `rows` evenly spaced query rows per block (the last row of the
    block included), averaged; the estimate is their log."""
    q = cap.q[h].astype(np.float64)
    k = cap.k[h // cap.group].astype(np.float64)
    Lq, Lkv = q.shape[0], k.shape[0]
    nqb = -(-Lq // BQ)
    out = np.zeros((nqb, -(-Lkv // BK)))
    for qb in range(nqb):
        r0, r1 = qb * BQ, min(Lq, qb * BQ + BQ)
        idx = np.unique(np.linspace(r1 - 1, r0, rows).round().astype(int))
        s = cap.sc * q[idx] @ k.T
        if cap.causal:
            s = np.where(np.arange(Lkv)[None, :] <= idx[:, None] + (Lkv - Lq), s, -np.inf)
        m = s.max(axis=1, keepdims=True)
        p = np.exp(s - m)
        p /= p.sum(axis=1, keepdims=True)
        blk = _blockwise(np.log(np.maximum(p, 1e-300)), Lkv, "lse")
        out[qb] = np.log(np.maximum(np.exp(blk).mean(axis=0), 1e-300))
    return out


def est_antidiagonal(cap: Capture, h: int, stride: int = 8) -> np.ndarray:
    """XAttention-like: sums of strided anti-diagonals of each stride x stride tile (q rows
    iS + S-1-t against keys jS + t), softmax over all such pseudo keys, mass summed per block."""
    q = cap.q[h].astype(np.float64)
    k = cap.k[h // cap.group].astype(np.float64)
    Lq, Lkv, D = q.shape[0], k.shape[0], q.shape[1]
    S = stride
    nq, nk = -(-Lq // S), -(-Lkv // S)
    qp = np.concatenate([q, np.zeros((nq * S - Lq, D))])
    kp = np.concatenate([k, np.zeros((nk * S - Lkv, D))])
    qs = qp.reshape(nq, S, D)[:, ::-1].reshape(nq, S * D)  # row iS + S-1-t at slot t
    ks = kp.reshape(nk, S, D).reshape(nk, S * D)
    s = cap.sc * (qs @ ks.T) / S
    if cap.causal:
        ok = np.arange(nk)[None, :] * S <= np.arange(nq)[:, None] * S + (S - 1) + (Lkv - Lq)
        s = np.where(ok, s, -np.inf)
    m = s.max(axis=1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    p /= np.maximum(p.sum(axis=1, keepdims=True), 1e-300)
    # to blocks: BQ / S pseudo rows per query block, BK / S pseudo keys per key block
    nqb, nkb = -(-Lq // BQ), -(-Lkv // BK)
    rq, rk = BQ // S, BK // S
    pp = np.zeros((nqb * rq, nkb * rk))
    pp[:nq, :nk] = p
    mass = pp.reshape(nqb, rq, nkb, rk).sum(axis=3).mean(axis=1)
    return np.log(np.maximum(mass, 1e-300))


def _lse(x: np.ndarray, axis: int) -> np.ndarray:
    """log-sum-exp along axis; -inf where every entry is -inf."""
    m = x.max(axis=axis, keepdims=True)
    mf = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return np.squeeze(mf + np.log(np.exp(x - mf).sum(axis=axis, keepdims=True)), axis=axis)


def _group_block_scores(cap: Capture, h: int, rows: np.ndarray, weight: np.ndarray, last: np.ndarray,
                        combine: str) -> np.ndarray:
    """Block scores from G pooled query rows per query block (the keys_lse rule applied to each).

    rows [nQB, G, D]: pooled query rows; weight [nQB, G]: their share of the block (0: unused);
    last [nQB, G]: the query row whose visible keys each pooled row is scored against (causal).
    Per pooled row g, B_g[kb] = log sum_{j in kb} exp(scale * rows_g . k_j); the rows are combined by
    "lse": log sum_g w_g exp(B_g) (the unnormalized scores), or "mass": log sum_g w_g exp(B_g - lse_kb B_g)
    (the mean of each row's normalized block distribution)."""
    k = cap.k[h // cap.group].astype(np.float64)
    Lq, Lkv = cap.q.shape[1], k.shape[0]
    nqb, G, D = rows.shape
    s = cap.sc * rows.reshape(nqb * G, D) @ k.T
    ok = np.repeat((weight > 0).reshape(-1, 1), Lkv, axis=1)
    if cap.causal:
        ok &= np.arange(Lkv)[None, :] <= last.reshape(-1, 1) + (Lkv - Lq)
    b = _blockwise(np.where(ok, s, -np.inf), Lkv, "lse").reshape(nqb, G, -1)
    if combine == "mass":
        tot = _lse(b, axis=2)[..., None]
        b = np.where(np.isfinite(tot), b - np.where(np.isfinite(tot), tot, 0.0), -np.inf)
    elif combine != "lse":
        raise ValueError("combine must be lse or mass, got %r" % combine)
    with np.errstate(divide="ignore"):
        lw = np.log(weight / np.maximum(weight.sum(axis=1, keepdims=True), 1e-300))
    return _lse(b + lw[..., None], axis=1)


def est_keys_lse_sub(cap: Capture, h: int, sub: int = 2, combine: str = "lse") -> np.ndarray:
    """keys_lse with each query block pooled into `sub` consecutive sub-blocks (BQ / sub rows each)
    instead of one, combined by `combine` (see _group_block_scores). A sub-block is scored against
    the keys its last row sees (causal). `sub` times the multiply-adds of keys_lse."""
    q = cap.q[h].astype(np.float64)
    Lq, D = q.shape
    nqb, bs = -(-Lq // BQ), BQ // sub
    n = nqb * sub
    cnt = np.clip(Lq - np.arange(n) * bs, 0, bs)
    qp = np.concatenate([q, np.zeros((n * bs - Lq, D))])
    rows = qp.reshape(n, bs, D).sum(axis=1) / np.maximum(cnt, 1)[:, None]
    last = np.arange(n) * bs + np.maximum(cnt, 1) - 1
    return _group_block_scores(cap, h, rows.reshape(nqb, sub, D), cnt.reshape(nqb, sub).astype(np.float64),
                               last.reshape(nqb, sub), combine)


def est_keys_lse_var(cap: Capture, h: int, c2: float = 0.5) -> np.ndarray:
    """keys_lse with a second-order (Gaussian) correction: per key
    scale * mean(q) . k_j + c2 * scale^2 * sum_c var_c(q) k_jc^2 (c2 = 1/2: the log of the mean of
    exp(scale q_i . k_j) over the block's rows when they are Gaussian with diagonal covariance), then
    log-sum-exp per key block over the keys the block's last row sees. One more D-length product per
    key and query block (var(q) against the squared keys): twice the multiply-adds of keys_lse."""
    q = cap.q[h].astype(np.float64)
    k = cap.k[h // cap.group].astype(np.float64)
    mu = _pool(q, BQ)
    var = np.maximum(_pool(q * q, BQ) - mu * mu, 0.0)
    s = cap.sc * mu @ k.T + c2 * cap.sc * cap.sc * var @ (k * k).T
    vis = _key_causal(q.shape[0], k.shape[0], cap.causal)
    if vis is not None:
        s = np.where(vis, s, -np.inf)
    return _blockwise(s, k.shape[0], "lse")


def est_keys_lse_maxnorm(cap: Capture, h: int, combine: str = "mass") -> np.ndarray:
    """keys_lse with a second pooled row per query block: the block's row of largest norm (the most
    peaked attention of the block), the two combined with equal weights by `combine`
    (see _group_block_scores); the max-norm row sees the keys of the block's last row (causal).
    Twice the multiply-adds of keys_lse."""
    q = cap.q[h].astype(np.float64)
    Lq, D = q.shape
    nqb = -(-Lq // BQ)
    mu = _pool(q, BQ)
    qp = np.concatenate([q, np.zeros((nqb * BQ - Lq, D))]).reshape(nqb, BQ, D)
    top = qp[np.arange(nqb), np.argmax((qp * qp).sum(axis=2), axis=1)]
    last = np.minimum(np.arange(nqb) * BQ + BQ - 1, Lq - 1)
    return _group_block_scores(cap, h, np.stack([mu, top], axis=1), np.ones((nqb, 2)),
                               np.stack([last, last], axis=1), combine)


def _sum4(v: np.ndarray) -> np.ndarray:
    """The library grouping's float32 sum over axis 0: four partial sums over the indices i = k (mod 4),
    each in ascending i (np.cumsum: sequential, unlike np.sum's pairwise sums), added as
    (p0 + p1) + (p2 + p3)."""
    p = [np.cumsum(v[k::4], axis=0, dtype=np.float32)[-1] if len(v) > k else np.zeros(v.shape[1:], np.float32)
         for k in range(4)]
    return (p[0] + p[1]) + (p[2] + p[3])


def split2_groups(x: np.ndarray, iters: int, tau: float, lo: float = 0.0):
    """The two groups of est_keys_lse_split2 for the rows x [n, D], as the library forms them
    (src/cpu/predict.cpp, split2_rows; the CUDA grouping kernel alike): in float32, every operation
    rounded on its own, every sum a _sum4 (the column sums over the rows — a group's over its own rows —, the
    squared distances and lengths over the columns, the rows' lengths), means as sum / n. The rows stay one group unless
    lo * l <= |mean| < tau * l (l: the rows' mean length; the bounds rounded to float32 products as the
    library's; tau = inf, lo = 0: always split). With iters > 0 (not in the library) the Lloyd steps run
    in float64. Returns [(size, mean row)] of one group (the block kept whole) or two (a size may be 0);
    the mean rows are float32."""
    f32 = np.float32
    x = np.asarray(x, dtype=f32)
    n, D = x.shape
    mu = _sum4(x) / f32(n)

    def d2(ref: np.ndarray) -> np.ndarray:  # squared distance of every row to ref
        t = x - ref
        return _sum4((t * t).T)

    if np.isfinite(tau) or lo > 0:
        ell = _sum4(np.sqrt(d2(np.zeros(D, f32)))) / f32(n)  # the rows' mean length
        m = np.sqrt(_sum4(mu * mu))  # the mean row's length
        if not ((not np.isfinite(tau) or m < f32(tau) * ell) and m >= f32(lo) * ell):
            return [(n, mu)]
    a = int(np.argmax(d2(mu)))  # the first farthest row, as the library's strict comparison
    b = int(np.argmax(d2(x[a])))
    to_b = d2(x[b]) < d2(x[a])  # ties to a
    if iters:
        x64 = x.astype(np.float64)
        c = x64[[a, b]]
        for _ in range(iters):
            lab = ((x64[:, None, :] - c[None]) ** 2).sum(axis=2).argmin(axis=1)
            c = np.stack([x64[lab == g].mean(axis=0) if (lab == g).any() else c[g] for g in range(2)])
        to_b = ((x64[:, None, :] - c[None]) ** 2).sum(axis=2).argmin(axis=1) == 1
    sizes = [int(n - to_b.sum()), int(to_b.sum())]
    means = [_sum4(x[m]) / f32(size) if size else np.zeros(D, f32)
             for m, size in zip((~to_b, to_b), sizes)]
    return list(zip(sizes, means))


def est_keys_lse_split2(cap: Capture, h: int, combine: str = "mass", iters: int = 0,
                        tau: float = np.inf, lo: float = 0.0) -> np.ndarray:
    """keys_lse with each query block split into two groups of similar rows instead of two halves:
    seeds a (the row farthest from the block mean) and b (the row farthest from a), each row to the
    nearer seed (to b only when strictly nearer; a hyperplane split: the sign of
    (x - (a + b)/2) . (b - a)), then `iters` Lloyd steps (two-means; 0 to 4 steps measure alike on the
    captures); each group pooled into one row, the two combined by `combine` with the groups' sizes as
    weights (see _group_block_scores); both see the keys of the block's last row (causal). Twice the
    multiply-adds of keys_lse in the scores, plus about (5 + 3 * iters) * BQ * D per block for the
    grouping. The groups are the library's, bit for bit (split2_groups); the scores are float64.

    tau: split only the query blocks whose mean row is short against their rows,
    |mean(q)| < tau * mean(|q_i|) (rows that point apart); the others keep the one pooled row of
    keys_lse, the grouping's float32 mean row (tau = 0: keys_lse's masks up to near-ties; inf: every
    block split). lo: nor those whose mean row is near zero, |mean(q)| < lo * mean(|q_i|) (rows with no
    common direction, such as independent noise; 0: no such bound). The extra multiply-adds scale with
    the share of split blocks. tau = 0.75, lo = 0.25: the library's SPARGE_ESTIMATOR_KEYS_LSE_ADAPTIVE
    (ESTIMATORS["keys_lse_adaptive"])."""
    q = cap.q[h].astype(np.float64)
    Lq, D = q.shape
    nqb = -(-Lq // BQ)
    rows = np.zeros((nqb, 2, D))
    weight = np.zeros((nqb, 2))
    for qb in range(nqb):
        for g, (size, row) in enumerate(split2_groups(q[qb * BQ:min(Lq, qb * BQ + BQ)], iters, tau, lo)):
            weight[qb, g], rows[qb, g] = float(size), row
    last = np.minimum(np.arange(nqb) * BQ + BQ - 1, Lq - 1)
    return _group_block_scores(cap, h, rows, weight, np.stack([last, last], axis=1), combine)


ESTIMATORS = {
    "mean": est_mean,
    "pooledq_lse": lambda c, h: est_pooled_q_keys(c, h, "lse"),
    "keys_lse": lambda c, h: est_pooled_q_keys(c, h, "lse"),  # the library's SPARGE_ESTIMATOR_KEYS_LSE
    "pooledq_max": lambda c, h: est_pooled_q_keys(c, h, "max"),
    "rows4": lambda c, h: est_sampled_rows(c, h, 4),
    "antidiag8": lambda c, h: est_antidiagonal(c, h, 8),
    "keys_lse_sub2": lambda c, h: est_keys_lse_sub(c, h, 2, "lse"),
    "keys_lse_sub2_mass": lambda c, h: est_keys_lse_sub(c, h, 2, "mass"),
    "keys_lse_sub4": lambda c, h: est_keys_lse_sub(c, h, 4, "lse"),
    "keys_lse_sub4_mass": lambda c, h: est_keys_lse_sub(c, h, 4, "mass"),
    "keys_lse_var": lambda c, h: est_keys_lse_var(c, h),
    "keys_lse_maxnorm": lambda c, h: est_keys_lse_maxnorm(c, h, "lse"),
    "keys_lse_maxnorm_mass": lambda c, h: est_keys_lse_maxnorm(c, h, "mass"),
    # the library's SPARGE_ESTIMATOR_KEYS_LSE_SPLIT2 (the masses averaged), and its log-sum-exp variant
    "keys_lse_split2": lambda c, h: est_keys_lse_split2(c, h, "mass"),
    "keys_lse_split2_lse": lambda c, h: est_keys_lse_split2(c, h, "lse"),
    # the library's SPARGE_ESTIMATOR_KEYS_LSE_ADAPTIVE: keys_lse_split2 on the blocks whose mean row is
    # 0.25 to 0.75 of their rows' mean length (0.25 l <= |mean| < 0.75 l), keys_lse on the others
    "keys_lse_adaptive": lambda c, h: est_keys_lse_split2(c, h, "mass", tau=0.75, lo=0.25),
}


# ------------------------------------------------------------------ selection (library rule)
@dataclass
class Setting:
    topk: Optional[float] = 0.5  # None: CDF mode
    cdf: float = 0.9
    sink: Optional[bool] = None  # None: default of the mode
    window: Optional[int] = None
    topp: Optional[float] = None  # top-k combined with top-p: also stop once this mass is reached
    estimator: str = "mean"  # or "auto": the library's default of the capture's mode (default_estimator)

    def label(self) -> str:
        sel = ("topk %.3g" % self.topk) if self.topk is not None else ("cdf %.3g" % self.cdf)
        if self.topp is not None:
            sel += " & p %.3g" % self.topp
        s = "-" if self.sink is None else int(self.sink)
        w = "-" if self.window is None else self.window
        return "%s %s sink %s win %s" % (self.estimator, sel, s, w)


def default_sink(causal: bool) -> bool:
    """The library's attention_sink = -1 (None): on in both modes."""
    return True


def default_window(causal: bool) -> int:
    """The library's local_window = -1 (None): 2 when causal, 1 otherwise."""
    return 2 if causal else 1


def default_estimator(causal: bool) -> str:
    """The library's estimator "auto" (SPARGE_ESTIMATOR_AUTO, the default): keys_lse when causal,
    keys_lse_adaptive otherwise."""
    return "keys_lse" if causal else "keys_lse_adaptive"


def resolve_estimator(name: str, causal: bool) -> str:
    """An estimator name with "auto" replaced by the default of the mode."""
    return default_estimator(causal) if name == "auto" else name


def budget_forced(qb: int, nv: int, Lq: int, Lkv: int, causal: bool, sink: Optional[bool],
                  window: Optional[int]) -> np.ndarray:
    if sink is None:
        sink = default_sink(causal)
    if window is None:
        window = default_window(causal)
    rows = np.arange(qb * BQ, min(Lq, qb * BQ + BQ))
    diag = np.clip(rows + (Lkv - Lq), 0, Lkv - 1) // BK
    first, last = int(diag.min()), int(diag.max())
    f = np.zeros(nv, dtype=bool)
    if nv == 0:
        return f
    if sink:
        f[0] = True
    if window > 0:
        f[max(0, first - (window - 1)):max(0, min(nv, last + window))] = True
    elif causal and first < nv:
        f[first] = True
    return f


def select(scores: np.ndarray, st: Setting, Lq: int, Lkv: int, causal: bool) -> np.ndarray:
    """scores [nQB, nKB] (logits of the block distribution) -> mask [nQB, nKB]."""
    vis = visible(Lq, Lkv, causal)
    nqb, nkb = scores.shape
    mask = np.zeros((nqb, nkb), dtype=np.uint8)
    for qb in range(nqb):
        nv = int(vis[qb])
        if nv == 0:
            continue
        s = scores[qb, :nv].astype(np.float32).astype(np.float64)
        fin = np.isfinite(s)
        mx = s[fin].max() if fin.any() else 0.0
        p = np.where(fin, np.exp(s - mx), 0.0)
        p = (p / p.sum()).astype(np.float32).astype(np.float64)
        fb = budget_forced(qb, nv, Lq, Lkv, causal, st.sink, st.window)
        nf = int(fb.sum())
        rest = np.flatnonzero(~fb)
        # the library's order: top-k ranks the float32 scores, CDF their float32 probabilities
        key = s if st.topk is not None else p
        order = np.concatenate([np.flatnonzero(fb), rest[np.argsort(-key[rest], kind="stable")]])
        if st.topk is not None:
            n = max(1, min(nv, int(math.floor(float(np.float32(st.topk)) * nv + 1e-4))))
            n = max(n, nf)
            if st.topp is not None:
                c = np.cumsum(p[order])
                n_p = int(np.searchsorted(c, st.topp) + 1)
                n = max(nf, min(n, n_p))
        else:
            c = np.cumsum(p[order])
            n = int(np.searchsorted(c, np.float32(st.cdf)) + 1)
            n = max(nf, min(n, nv))
        mask[qb, order[:n]] = 1
    return mask


LIBRARY_ESTIMATORS = ("mean", "keys_lse", "keys_lse_split2", "keys_lse_adaptive", "auto")


def library_mask(cap: Capture, st: Setting) -> np.ndarray:
    """sparge.predict_mask (CPU backend, float32 inputs) for the library's estimators ("mean",
    "keys_lse", "keys_lse_split2", "keys_lse_adaptive", and "auto", which the library resolves by the
    capture's causality): [Hq, nQB, nKB]."""
    from . import _api as sparge

    kw = dict(is_causal=cap.causal, scale=cap.sc, precision="exact", attention_sink=st.sink,
              local_window=st.window, estimator=st.estimator)
    if st.topk is not None:
        kw.update(topk=st.topk)
    else:
        kw.update(mode="cdf", cdf_threshold=st.cdf)
    q = np.ascontiguousarray(cap.q[None].astype(np.float32))
    k = np.ascontiguousarray(cap.k[None].astype(np.float32))
    return np.asarray(sparge.predict_mask(q, k, **kw))[0]


# ------------------------------------------------------------------ evaluation
@dataclass
class Result:
    setting: Setting
    pred: Score = field(default_factory=Score)
    oracle: Score = field(default_factory=Score)
    per_head: List[Dict[str, float]] = field(default_factory=list)

    def row(self) -> Dict[str, object]:
        d = dict(setting=self.setting.label(), **{"pred_" + k: v for k, v in self.pred.as_dict().items()})
        d.update({"oracle_" + k: v for k, v in self.oracle.as_dict().items()})
        d["ratio_l1"] = self.pred.rel_l1 / max(self.oracle.rel_l1, 1e-300)
        return d


def evaluate(cap: Capture, settings: Sequence[Setting], heads: Optional[Iterable[int]] = None,
             use_library: bool = False, progress=None) -> List[Result]:
    Lq, Lkv = cap.q.shape[1], cap.k.shape[1]
    vis = visible(Lq, Lkv, cap.causal)
    results = [Result(st) for st in settings]
    lib_masks: Dict[int, np.ndarray] = {}
    if use_library:
        for i, st in enumerate(settings):
            if st.estimator in LIBRARY_ESTIMATORS and st.topp is None:
                lib_masks[i] = library_mask(cap, st)
    heads = list(range(cap.Hq)) if heads is None else list(heads)
    for n, h in enumerate(heads):
        hp = head_pass(cap, h)
        est_cache: Dict[str, np.ndarray] = {}
        for i, st in enumerate(settings):
            if i in lib_masks:
                mask = lib_masks[i][h]
            else:
                est = resolve_estimator(st.estimator, cap.causal)
                if est not in est_cache:
                    est_cache[est] = ESTIMATORS[est](cap, h)
                mask = select(est_cache[est], st, Lq, Lkv, cap.causal)
            ps = score_mask(hp, mask, vis)
            os_ = score_mask(hp, oracle_mask(hp.mass, mask.sum(axis=1), vis), vis)
            results[i].pred.add(ps)
            results[i].oracle.add(os_)
            results[i].per_head.append(dict(head=h, **{"pred_" + k: v for k, v in ps.as_dict().items()},
                                            oracle_rel_l1=os_.rel_l1))
        if progress:
            progress(n + 1, len(heads))
    return results


def oracle_curve(cap: Capture, densities: Sequence[float], heads: Optional[Iterable[int]] = None) -> List[Score]:
    """The oracle at uniform per-row density (top floor(d * visible) blocks by exact mass)."""
    Lq, Lkv = cap.q.shape[1], cap.k.shape[1]
    vis = visible(Lq, Lkv, cap.causal)
    out = [Score() for _ in densities]
    for h in (range(cap.Hq) if heads is None else heads):
        hp = head_pass(cap, h)
        for i, d in enumerate(densities):
            counts = np.where(vis > 0, np.maximum(1, np.floor(d * vis + 1e-4)), 0).astype(int)
            out[i].add(score_mask(hp, oracle_mask(hp.mass, counts, vis), vis))
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("captures", nargs="+")
    ap.add_argument("--topk", type=float, nargs="*", default=[0.2, 0.5])
    ap.add_argument("--estimators", nargs="*", default=["mean"],
                    help="names of ESTIMATORS, or auto (the library's default of the mode)")
    ap.add_argument("--sink", type=int, nargs="*", default=[-1], help="-1: default of the mode")
    ap.add_argument("--window", type=int, nargs="*", default=[-1], help="-1: default of the mode")
    ap.add_argument("--heads", type=int, default=0, help="first N heads only (0: all)")
    ap.add_argument("--library", action="store_true", help="the mean rule through sparge.predict_mask")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    settings = [Setting(topk=t, sink=None if s < 0 else bool(s), window=None if w < 0 else w, estimator=e)
                for e in a.estimators for t in a.topk for s in a.sink for w in a.window]
    rows = []
    for path in a.captures:
        cap = load(path)
        heads = range(a.heads) if a.heads else None
        res = evaluate(cap, settings, heads, use_library=a.library)
        print("%s  (Hq %d, L %d, D %d, %s)" % (cap.name, cap.Hq, cap.q.shape[1], cap.q.shape[2],
                                             "causal" if cap.causal else "non-causal"))
        print("  %-40s %8s %8s %9s %9s %7s %6s" % ("setting", "density", "mass", "relL1", "oracle", "ratio",
                                                   "zero"))
        for r in res:
            d = r.row()
            d["capture"] = cap.name
            rows.append(d)
            print("  %-40s %8.4f %8.4f %9.4f %9.4f %7.2f %6d" % (d["setting"], d["pred_density"], d["pred_captured"],
                                                               d["pred_rel_l1"], d["oracle_rel_l1"], d["ratio_l1"],
                                                               d["pred_zero_rows"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


