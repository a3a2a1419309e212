#!/usr/bin/env python3
"""Error budget of the int8_fp8 recipe, term by term, on random inputs.

Emulates (in float64 numpy, with ml_dtypes for e4m3) the quantization steps of
docs/SEMANTICS.md one at a time and measures each variant against exact
softmax attention: cosine similarity and relative L1 over the whole output.
Used to decide where the accuracy of the fast mode is lost and what would
recover it; see docs/ACCURACY.md.

    pip install numpy ml_dtypes && python3 tools/accuracy/fp8_recipes.py
"""
import argparse

import ml_dtypes
import numpy as np

E4M3 = ml_dtypes.float8_e4m3fn


def e4m3(x):
    return np.clip(x, -448, 448).astype(E4M3).astype(np.float64)


def metrics(out, ref):
    cos = float((out * ref).sum() / np.linalg.norm(out) / np.linalg.norm(ref))
    l1 = float(np.abs(out - ref).sum() / np.abs(ref).sum())
    return cos, l1


def inputs(n, d, seed, outliers):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((n, d)) for _ in range(3))
    if outliers:
        q[:, :3] *= 20
        k[:, :3] *= 20
        k += rng.standard_normal(d) * 2  # per-channel offset on K
    return q, k, v


def scores_int8(q, k, scale):
    """Per-token int8 Q, per-64-key-block int8 K after smoothing (the mean shift cancels in the softmax)."""
    ks = k - k.mean(0)
    sq = np.abs(q).max(1, keepdims=True) / 127
    qi = np.rint(q / sq)
    s = np.empty((q.shape[0], k.shape[0]))
    for j0 in range(0, k.shape[0], 64):
        kb = ks[j0:j0 + 64]
        sk = np.abs(kb).max() / 127
        s[:, j0:j0 + 64] = (qi @ np.rint(kb / sk).T) * sq * sk * scale
    return s


def attention(q, k, v, int8_qk, p_fp8, v_mode):
    scale = 1 / np.sqrt(q.shape[1])
    s = scores_int8(q, k, scale) if int8_qk else q @ k.T * scale
    p = np.exp(s - s.max(1, keepdims=True))
    l = p.sum(1, keepdims=True)
    if p_fp8:
        p = e4m3(p * 448) / 448
    sv = np.abs(v).max(0) / 448
    if v_mode == "fp8":
        vq = e4m3(v / sv) * sv
    elif v_mode == "fp8+residual":  # a second e4m3 term holds the rounding residual of the first
        hi = e4m3(v / sv)
        vq = (hi + e4m3(v / sv - hi)) * sv
    else:
        vq = v
    return p @ vq / l


VARIANTS = [
    ("int8 Q.K^T only", True, False, "exact"),
    ("e4m3 P only", False, True, "exact"),
    ("e4m3 V only", False, False, "fp8"),
    ("int8_fp8 (specified)", True, True, "fp8"),
    ("int8_fp8, V as two e4m3 terms", True, True, "fp8+residual"),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--seeds", type=int, default=2)
    args = ap.parse_args()
    print(f"| inputs | variant | cosine | rel. L1 |  (N={args.n}, D={args.d}, {args.seeds} seeds, worst shown)")
    print("|---|---|---:|---:|")
    for outliers in (False, True):
        for name, int8_qk, p_fp8, v_mode in VARIANTS:
            worst = (1.0, 0.0)
            for seed in range(args.seeds):
                q, k, v = inputs(args.n, args.d, seed, outliers)
                s = q @ k.T / np.sqrt(args.d)
                p = np.exp(s - s.max(1, keepdims=True))
                ref = p @ v / p.sum(1, keepdims=True)
                cos, l1 = metrics(attention(q, k, v, int8_qk, p_fp8, v_mode), ref)
                worst = (min(worst[0], cos), max(worst[1], l1))
            print(f"| {'outliers' if outliers else 'normal'} | {name} | {worst[0]:.6f} | {worst[1]:.4f} |")


if __name__ == "__main__":
    main()
