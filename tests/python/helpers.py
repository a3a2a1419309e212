"""Input builders shared by the tests."""

import numpy as np


def make(rng, B, H, L, D, dtype=np.float32, layout="HND", scale=1.0):
    """Random normal tensor in the given layout (never all zeros)."""
    shape = (B, H, L, D) if layout == "HND" else (B, L, H, D)
    x = rng.standard_normal(shape) * scale
    return x.astype(dtype)


def make_qkv(rng, B=2, Hq=4, Hkv=2, Lq=320, Lkv=320, D=64, dtype=np.float32, layout="HND"):
    q = make(rng, B, Hq, Lq, D, dtype, layout)
    k = make(rng, B, Hkv, Lkv, D, dtype, layout)
    v = make(rng, B, Hkv, Lkv, D, dtype, layout)
    return q, k, v


# tolerance per precision (CPU backend vs float64 reference)
TOL = {
    "exact": dict(atol=2e-5, rtol=1e-4),
    "fp16": dict(rel_l1=6e-3),
    "int8_fp8": dict(rel_l1=6e-2, cos=0.995),
    "int8_fp8_split_v": dict(rel_l1=6e-2, cos=0.995),
    "int8_fp16": dict(rel_l1=2e-2, cos=0.999),
}
