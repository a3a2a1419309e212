"""pv_threshold (the PV skip) through the Python API on the CPU backend, and sparge.compat's pvthreshd."""

import math
import warnings

import numpy as np
import pytest

import sparge
from helpers import make_qkv, pv_skip_inputs

SKIPPING = ("int8_fp8", "int8_fp8_split_v", "int8_fp16", "fp16")
# Listed 64-key blocks per online-softmax step at D = 64 on the CPU backend (docs/DESIGN-NOTES.md: the
# int8 twins step as the GPU kernels do; the FP16 mode steps one block at a time)
STEP_BLOCKS = {"int8_fp8": 2, "int8_fp8_split_v": 2, "int8_fp16": 3, "fp16": 1}


def changed_rows(a, b):
    return float(np.mean(np.any(a != b, axis=-1)))


@pytest.mark.parametrize("precision", SKIPPING)
def test_skip_changes_rows_far_threshold_changes_none(rng, precision):
    q, k, v = pv_skip_inputs(rng)
    base = sparge.attention(q, k, v, topk=1.0, precision=precision)
    on = sparge.attention(q, k, v, topk=1.0, precision=precision, pv_threshold=1.0)
    far = sparge.attention(q, k, v, topk=1.0, precision=precision, pv_threshold=60.0)
    again = sparge.attention(q, k, v, topk=1.0, precision=precision)  # (no resolved options mixed up)
    assert changed_rows(on, base) > 0.75
    np.testing.assert_array_equal(far, base)
    np.testing.assert_array_equal(again, base)
    assert np.all(np.isfinite(on))


@pytest.mark.parametrize("precision", SKIPPING)
def test_skip_drops_the_later_steps(rng, precision):
    # Each row's maximum comes from key block 0, which lies in the first step; every later step is
    # more than 1 nat below it, so with pv_threshold=1 the result is that of a mask that keeps only
    # the first step's blocks, bit for bit (a skipped step leaves the row's max, sum and output as they were).
    q, k, v = pv_skip_inputs(rng)
    ones = np.ones((1, 2, 2, 10), np.uint8)
    first = np.zeros_like(ones)
    first[..., :STEP_BLOCKS[precision]] = 1
    on, lse_on = sparge.attention(q, k, v, mask=ones, precision=precision, pv_threshold=1.0, return_lse=True)
    cut, lse_cut = sparge.attention(q, k, v, mask=first, precision=precision, return_lse=True)
    np.testing.assert_array_equal(on, cut)
    np.testing.assert_array_equal(lse_on, lse_cut)
    dense = sparge.attention(q, k, v, topk=1.0, precision=precision, pv_threshold=1.0)  # the dense call too
    np.testing.assert_array_equal(dense, on)
    full = sparge.attention(q, k, v, mask=ones, precision=precision)
    assert changed_rows(full, on) > 0.75


def test_every_entry_point_passes_it(rng):
    q, k, v = pv_skip_inputs(rng)
    kw = dict(topk=1.0, precision="int8_fp8")
    want = sparge.attention(q, k, v, pv_threshold=1.0, **kw)
    assert changed_rows(want, sparge.attention(q, k, v, **kw)) > 0.75
    np.testing.assert_array_equal(sparge.sdpa(q, k, v, pv_threshold=1.0, **kw), want)
    ones = np.ones((1, 2, 2, 10), np.uint8)
    np.testing.assert_array_equal(
        sparge.block_sparse_attention(q, k, v, ones, precision="int8_fp8", pv_threshold=1.0), want)
    with sparge.Plan.for_inputs(q, k, precision="int8_fp8") as plan:
        np.testing.assert_array_equal(plan.run(q, k, v, topk=1.0, pv_threshold=1.0), want)
        np.testing.assert_array_equal(plan.predict(q, k, topk=0.5, pv_threshold=1.0),
                                      sparge.predict_mask(q, k, topk=0.5, precision="int8_fp8"))
    # NHD, a predicted mask: the same rows skip
    qn, kn, vn = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v))
    got = sparge.attention(qn, kn, vn, layout="NHD", topk=0.5, precision="int8_fp8", pv_threshold=1.0)
    np.testing.assert_array_equal(got.transpose(0, 2, 1, 3),
                                  sparge.attention(q, k, v, topk=0.5, precision="int8_fp8", pv_threshold=1.0))


def test_zero_negative_zero_and_none_are_off(rng):
    q, k, v = pv_skip_inputs(rng)
    base = sparge.attention(q, k, v, topk=1.0, precision="fp16")
    for off in (0, 0.0, -0.0, np.float32(0), None):
        np.testing.assert_array_equal(sparge.attention(q, k, v, topk=1.0, precision="fp16", pv_threshold=off), base)


@pytest.mark.parametrize("bad", [float("nan"), -1.0, -1e-30, float("inf"), -float("inf")])
def test_invalid_values_are_the_library_s_error(rng, bad):
    q, k, v = make_qkv(rng, B=1, Hq=2, Hkv=2, Lq=128, Lkv=128, D=32, dtype=np.float16)
    calls = (lambda: sparge.attention(q, k, v, precision="fp16", pv_threshold=bad),
             lambda: sparge.attention(q, k, v, mask=np.ones((1, 2, 1, 2), np.uint8), precision="int8_fp8",
                                      pv_threshold=bad),
             lambda: sparge.predict_mask(q, k, pv_threshold=bad),
             lambda: sparge.sdpa(q, k, v, pv_threshold=bad))
    for call in calls:
        with pytest.raises(sparge.InvalidArgumentError, match=r"params->pv_threshold"):
            call()


@pytest.mark.parametrize("bad", ["1.0", True, [1.0, 2.0], 1e-50, 1e39])
def test_values_float32_cannot_carry_are_refused_by_name(rng, bad):
    # not numbers, and positive values that would reach the library as 0 (off) or inf
    q, k, v = make_qkv(rng, B=1, Hq=2, Hkv=2, Lq=64, Lkv=64, D=32, dtype=np.float16)
    for call in (lambda: sparge.attention(q, k, v, precision="fp16", pv_threshold=bad),
                 lambda: sparge.predict_mask(q, k, pv_threshold=bad)):
        with pytest.raises(sparge.InvalidArgumentError, match="pv_threshold"):
            call()


def test_exact_is_unsupported(rng):
    q, k, v = make_qkv(rng, B=1, Hq=2, Hkv=2, Lq=128, Lkv=128, D=32)
    with pytest.raises(sparge.UnsupportedError, match=r"params->pv_threshold"):
        sparge.attention(q, k, v, precision="exact", pv_threshold=1.0)
    with pytest.raises(sparge.UnsupportedError, match=r"params->pv_threshold"):
        sparge.attention(q, k, v, mask=np.ones((1, 2, 1, 2), np.uint8), precision="exact", pv_threshold=0.5)
    # off is fine there
    sparge.attention(q, k, v, precision="exact", pv_threshold=0.0)


def test_torch_paths(rng):
    torch = pytest.importorskip("torch")
    from sparge import _api

    q, k, v = pv_skip_inputs(rng)
    want = sparge.attention(q, k, v, topk=1.0, precision="fp16", pv_threshold=1.0)
    base = sparge.attention(q, k, v, topk=1.0, precision="fp16")
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    for _ in range(2):  # the second call takes the cached eager path
        np.testing.assert_array_equal(sparge.attention(tq, tk, tv, topk=1.0, precision="fp16",
                                                       pv_threshold=1.0).numpy(), want)
        np.testing.assert_array_equal(sparge.attention(tq, tk, tv, topk=1.0, precision="fp16").numpy(), base)
    old = _api.EAGER_DIRECT
    _api.EAGER_DIRECT = False  # through torch.ops.sparge.attention
    try:
        np.testing.assert_array_equal(sparge.attention(tq, tk, tv, topk=1.0, precision="fp16",
                                                       pv_threshold=1.0).numpy(), want)
        with pytest.raises(sparge.InvalidArgumentError, match=r"params->pv_threshold"):
            sparge.attention(tq, tk, tv, topk=1.0, precision="fp16", pv_threshold=-2.0)
    finally:
        _api.EAGER_DIRECT = old

    def f(a, b, c):
        return sparge.attention(a, b, c, topk=1.0, precision="fp16", pv_threshold=1.0)

    got = torch.compile(f, fullgraph=True, backend="eager")(tq, tk, tv)
    np.testing.assert_array_equal(got.numpy(), want)
    if hasattr(torch.library, "opcheck"):
        # q, k, v, mask, per-head tensors and lists, layout, causal, scale, mode, topk, cdf, sim, smooth_k,
        # sink, window, estimator, precision (1: fp16), block_q, block_k, pv_threshold, want_lse, want_kept
        args = (tq, tk, tv, None, None, None, None, None, None, None, 0, False, 0.0, 0, 1.0, 0.9, -0.1,
                True, -1, -1, 4, 1, 0, 0, 1.0, True, False)
        torch.library.opcheck(torch.ops.sparge.attention.default, args)
        out, lse, _ = torch.ops.sparge.attention.default(*args)
        np.testing.assert_array_equal(out.numpy(), want)
        torch.library.opcheck(torch.ops.sparge.predict_mask.default, (tq, tk) + args[4:25])


def test_distributed_passes_it(rng):
    torch = pytest.importorskip("torch")
    from sparge import distributed as sd

    q, k, v = (torch.from_numpy(x) for x in pv_skip_inputs(rng, dtype=np.float32))
    kw = dict(precision="fp16", topk=1.0)
    want = sparge.attention(q, k, v, pv_threshold=1.0, **kw)
    assert changed_rows(want.numpy(), sparge.attention(q, k, v, **kw).numpy()) > 0.75
    ones = torch.ones(1, 2, 2, 10, dtype=torch.uint8)
    for fn in (sd.ulysses_attention, sd.ring_attention):  # one rank (no process group): sparge.attention
        assert torch.equal(fn(q, k, v, pv_threshold=1.0, **kw), want)
        assert torch.equal(fn(q, k, v, mask=ones, pv_threshold=1.0, precision="fp16"), want)
    # the ring's per-step calls (on a given mask) carry it too
    skw = sd._sparse_kw(0.5, "topk", None, -0.1, True, None, None, "auto", "fp16", (128, 64), None, 1.5)
    assert skw["pv_threshold"] == 1.5 and sd._attn_kw(skw)["pv_threshold"] == 1.5


# ---------------------------------------------------------------- sparge.compat: pvthreshd
def test_pvthreshd_units_are_base_2():
    from sparge.compat import pv_threshold_of

    assert pv_threshold_of(None) == 0.0
    assert pv_threshold_of(20) == pytest.approx(20 * math.log(2.0), rel=1e-15)
    assert pv_threshold_of(50.0) == pytest.approx(34.657359, rel=1e-7)
    assert pv_threshold_of(np.float32(1.5)) == pytest.approx(1.5 * math.log(2.0), rel=1e-7)
    assert pv_threshold_of(float("inf")) == 0.0   # never skips: off
    assert pv_threshold_of(1e300) == 0.0          # beyond float32: no score difference reaches it
    tiny = pv_threshold_of(0)                     # skip every step below the running maximum
    assert 0.0 < tiny < 1e-44
    assert pv_threshold_of([3.0, 3.0], heads=2) == pytest.approx(3 * math.log(2.0))
    with pytest.raises(sparge.InvalidArgumentError, match="pvthreshd"):
        pv_threshold_of(float("nan"))
    with pytest.raises(sparge.UnsupportedError, match="pvthreshd"):
        pv_threshold_of(-1.0)
    with pytest.raises(sparge.InvalidArgumentError, match="pvthreshd has 3 values"):
        pv_threshold_of([1.0, 2.0, 3.0], heads=2)
    with pytest.raises(sparge.InvalidArgumentError, match="pvthreshd"):
        pv_threshold_of("20")


def test_pvthreshd_per_head_takes_the_largest_and_warns_once():
    from sparge import compat

    compat._pv_warned = False
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert compat.pv_threshold_of(np.array([10.0, 30.0, 20.0, 10.0]), heads=4) == \
            pytest.approx(30 * math.log(2.0))
        assert compat.pv_threshold_of([5.0, 7.0], heads=2) == pytest.approx(7 * math.log(2.0))
        assert compat.pv_threshold_of([4.0, 4.0], heads=2) == pytest.approx(4 * math.log(2.0))
    assert len(w) == 1 and "pvthreshd" in str(w[0].message) and "largest" in str(w[0].message)


FIXED = dict(estimator="mean", attention_sink=True, local_window=0)  # sparge.compat's, non-causal


@pytest.mark.parametrize("fn,prec", [("spas_sage2_attn_meansim_topk_cuda", "int8_fp8"),
                                     ("spas_sage_attn_meansim_topk_cuda", "int8_fp16")])
def test_compat_names_run_the_skip(rng, fn, prec):
    f = getattr(sparge.compat, fn)
    q, k, v = pv_skip_inputs(rng)
    pvthreshd = 1.5  # base 2: 1.04 nats
    got = f(q, k, v, topk=1.0, pvthreshd=pvthreshd)
    want = sparge.attention(q, k, v, topk=1.0, precision=prec, pv_threshold=pvthreshd * math.log(2.0), **FIXED)
    np.testing.assert_array_equal(got, want)
    off = f(q, k, v, topk=1.0)  # default: off
    np.testing.assert_array_equal(off, sparge.attention(q, k, v, topk=1.0, precision=prec, **FIXED))
    assert changed_rows(got, off) > 0.75
    # the original's default, given: on, 34.7 nats, far above these inputs' score range
    np.testing.assert_array_equal(f(q, k, v, topk=1.0, pvthreshd=50), off)
    # per head (one value per query head), as the original's tuned parameters are
    np.testing.assert_array_equal(f(q, k, v, topk=1.0, pvthreshd=np.full(2, pvthreshd)), got)


def test_compat_passes_the_mapped_value(rng, monkeypatch):
    seen = []
    monkeypatch.setattr(sparge.compat, "attention", lambda *a, **kw: seen.append(kw) or a[0])
    q, k, v = make_qkv(rng, B=1, Hq=2, Hkv=2, Lq=128, Lkv=128, D=32, dtype=np.float16)
    for fn in (sparge.spas_sage2_attn_meansim_topk_cuda, sparge.spas_sage2_attn_meansim_cuda,
               sparge.spas_sage_attn_meansim_topk_cuda, sparge.spas_sage_attn_meansim_cuda,
               sparge.block_sparse_sage2_attn_cuda):
        fn(q, k, v)
        fn(q, k, v, pvthreshd=20)
    assert [kw["pv_threshold"] for kw in seen] == [0.0, pytest.approx(20 * math.log(2.0))] * 5


def test_compat_block_sparse_runs_the_skip(rng):
    q, k, v = pv_skip_inputs(rng)
    mask_id = np.ones((1, 2, 2, 10), np.int32)
    got = sparge.block_sparse_sage2_attn_cuda(q, k, v, mask_id=mask_id, pvthreshd=2.0)
    want = sparge.attention(q, k, v, mask=mask_id, precision="int8_fp8", pv_threshold=2.0 * math.log(2.0))
    np.testing.assert_array_equal(got, want)
    assert changed_rows(got, sparge.block_sparse_sage2_attn_cuda(q, k, v, mask_id=mask_id)) > 0.75
    with pytest.raises(sparge.InvalidArgumentError, match="pvthreshd has 3 values"):
        sparge.block_sparse_sage2_attn_cuda(q, k, v, mask_id=mask_id, pvthreshd=[1.0, 2.0, 3.0])


def test_compat_drops_pvthreshd_on_cuda_inputs_with_one_warning():
    # CUDA plans refuse pv_threshold > 0 in this release: the compat names drop it on CUDA inputs.
    import warnings

    from sparge import compat

    class FakeCuda:
        is_cuda = True

    compat._pv_cuda_warned = False
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert compat._pv_on(FakeCuda(), 2.5) == 0.0
        assert compat._pv_on(FakeCuda(), 2.5) == 0.0
    assert sum("not applied to CUDA inputs" in str(x.message) for x in w) == 1
    assert compat._pv_on(object(), 2.5) == 2.5  # host inputs keep it
    assert compat._pv_on(FakeCuda(), 0.0) == 0.0
