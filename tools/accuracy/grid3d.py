#!/usr/bin/env python3
"""A video-like attention workload: tokens on a T x H x W grid, flattened frame by frame (as video
diffusion transformers order them), non-causal. Queries and keys are a shared 3-D positional part
(random Fourier features of the grid position: the score of a pair falls off with its 3-D distance,
so each token attends to its neighbours in the frame and in the next frames, which are far apart in
the flattened order) plus a content part (a few clusters of tokens that attend to one another
wherever they are) and noise. Deterministic for a seed; synthetic, not a model's activations.

    python3 tools/accuracy/grid3d.py --grid 16 16 16 --out grid3d.npz
"""
from __future__ import annotations

import argparse
import math
import sys

import numpy as np

sys.path.insert(0, __import__("os").path.dirname(__file__))
import yardstick  # noqa: E402


def make(T: int = 16, H: int = 16, W: int = 16, heads: int = 4, D: int = 64, seed: int = 0) -> yardstick.Capture:
    rng = np.random.default_rng(seed)
    t, y, x = np.meshgrid(np.arange(T), np.arange(H), np.arange(W), indexing="ij")
    pos = np.stack([t.ravel() / 1.5, y.ravel() / 2.0, x.ravel() / 2.0], axis=1)  # anisotropic: time decorrelates faster
    L = pos.shape[0]
    qs, ks, vs = [], [], []
    for h in range(heads):
        nf = D // 2
        freq = rng.standard_normal((3, nf)) * (0.4 + 0.3 * h)  # heads differ in their spatial reach
        ph = pos @ freq
        fpos = np.concatenate([np.cos(ph), np.sin(ph)], axis=1) * math.sqrt(2.0 / nf) * 6.0
        nclu = 8
        cent = rng.standard_normal((nclu, D))
        lab = rng.integers(0, nclu, L)
        content = cent[lab] * 0.6
        q = fpos + content + 0.3 * rng.standard_normal((L, D))
        k = fpos + content + 0.3 * rng.standard_normal((L, D))
        v = rng.standard_normal((L, D)) + cent[lab]
        qs.append(q)
        ks.append(k)
        vs.append(v)
    return yardstick.Capture(np.stack(qs), np.stack(ks), np.stack(vs), False,
                             "grid3d %dx%dx%d" % (T, H, W), 1.0 / math.sqrt(D))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grid", type=int, nargs=3, default=[16, 16, 16])
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    cap = make(*a.grid, heads=a.heads, D=a.dim, seed=a.seed)
    yardstick.save(a.out, cap)
    return 0


if __name__ == "__main__":
    sys.exit(main())
