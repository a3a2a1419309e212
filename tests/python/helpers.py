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


def spike_inputs(rng):
    """q, k, v where the two estimators disagree: one key of block 5 that the pooled query of block 0 hits
    hard, while the block's mean points away from that query (its mean score is the row's lowest): the mean
    rule drops the block at top-k 0.25, the per-key rule keeps it."""
    q, k, v = make_qkv(rng, B=1, Hq=2, Hkv=1, Lq=512, Lkv=2048, D=32)
    pq = q[0, 0, :128].mean(axis=0)
    # the spike key scores scale * pq . spike = 12 above its own key, for any seed (log 64 = 4.2 is what a
    # block of 64 ordinary keys reaches)
    spike = pq * (12.0 * np.sqrt(q.shape[-1]) / float(pq @ pq))
    delta = 20.0  # block mean = -delta * spike / 64
    k[0, 0, 64 * 5:64 * 6] -= (1 + delta) * spike / 63
    k[0, 0, 64 * 5 + 7] += (1 + delta) * spike / 63 + spike
    return q, k, v


def pv_skip_inputs(rng, B=1, H=2, Lq=256, Lkv=640, D=64, gap=10.0, dtype=np.float16):
    """Every query and the first 64 keys share a unit direction u: those keys score about ``gap``
    nats above the others (scale 1/sqrt(D)), so once a row has seen key block 0 its later steps
    lie many nats below its running maximum."""
    u = rng.standard_normal(D)
    u /= np.linalg.norm(u)
    a = np.sqrt(gap * np.sqrt(D))
    q = a * u + rng.standard_normal((B, H, Lq, D))
    k = rng.standard_normal((B, H, Lkv, D))
    k[:, :, :64] += a * u
    v = rng.standard_normal((B, H, Lkv, D))
    return tuple(x.astype(dtype) for x in (q, k, v))


# tolerance per precision (CPU backend vs float64 reference)
TOL = {
    "exact": dict(atol=2e-5, rtol=1e-4),
    "fp16": dict(rel_l1=6e-3),
    "int8_fp8": dict(rel_l1=6e-2, cos=0.995),
    "int8_fp8_split_v": dict(rel_l1=6e-2, cos=0.995),
    "int8_fp16": dict(rel_l1=2e-2, cos=0.999),
}


def check_accepted_and_close(rng, precision, rel_l1, cos):
    """fp16 inputs, all blocks kept: output of the input's shape and dtype, finite, close to float64;
    LSE close too."""
    import ref
    import sparge
    q, k, v = make_qkv(rng, B=1, Hq=4, Hkv=2, Lq=256, Lkv=384, D=64, dtype=np.float16)
    out, lse = sparge.attention(q, k, v, topk=1.0, precision=precision, return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))
    expect, lse_expect = ref.attention(q, k, v)
    assert ref.rel_l1(out, expect) <= rel_l1
    assert ref.cosine(out, expect) >= cos
    np.testing.assert_allclose(lse, lse_expect, atol=6e-2, rtol=2e-2)


def check_bad_precision_named(rng, bad, valid_name):
    """A bad precision value is an InvalidArgumentError from every entry point, naming the argument,
    the value and the valid names."""
    import pytest
    import sparge
    q, k, v = make_qkv(rng, B=1, Hq=2, Hkv=2, Lq=64, Lkv=64, D=32)
    for call in (lambda: sparge.attention(q, k, v, precision=bad),
                 lambda: sparge.predict_mask(q, k, precision=bad),
                 lambda: sparge.block_sparse_attention(q, k, v, np.ones((1, 2, 1, 1), np.uint8), precision=bad)):
        with pytest.raises(sparge.InvalidArgumentError) as ei:
            call()
        msg = str(ei.value)
        assert "precision" in msg and valid_name in msg and repr(bad) in msg, msg


def mask_and_lse_vs_int8_fp8(rng, precision):
    """The predicted mask and the LSE of `precision` next to int8_fp8's on the same causal inputs:
    (mask, int8_fp8 mask, lse, int8_fp8 lse)."""
    import sparge
    q, k, v = make_qkv(rng, B=1, Hq=4, Hkv=2, Lq=320, Lkv=320, D=64, dtype=np.float16)
    opts = dict(topk=0.5, is_causal=True)
    m8 = sparge.predict_mask(q, k, precision="int8_fp8", **opts)
    m = sparge.predict_mask(q, k, precision=precision, **opts)
    _, lse8 = sparge.attention(q, k, v, precision="int8_fp8", return_lse=True, **opts)
    _, lse = sparge.attention(q, k, v, precision=precision, return_lse=True, **opts)
    return m, m8, lse, lse8


def torch_cuda_marks(torch):
    """pytest marks that skip (visibly) a CUDA test module without a CUDA device or a CUDA build of libsparge."""
    import pytest

    import sparge

    have_cuda = bool(torch.cuda.is_available())
    try:
        lib_cuda = sparge.has_cuda()
    except sparge.SpargeError:
        lib_cuda = False
    return [
        pytest.mark.skipif(not have_cuda, reason="no CUDA device visible to torch"),
        pytest.mark.skipif(have_cuda and not lib_cuda, reason="libsparge was built without its CUDA backend"),
    ]


def cuda_generator(torch, rng):
    """A torch CUDA generator seeded from the test's rng (fresh seed, printed on failure)."""
    g = torch.Generator(device="cuda")
    g.manual_seed(int(rng.integers(2**62)))
    return g


def assert_backward_raises(out):
    """out (a torch result of a call with inputs that require grad) is recorded by autograd, and its
    backward raises: the library is inference only."""
    import pytest

    import sparge

    assert out.requires_grad and out.grad_fn is not None
    with pytest.raises(sparge.UnsupportedError, match="inference only"):
        out.float().sum().backward()
