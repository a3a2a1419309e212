"""The original SpargeAttn names (sparge.compat / the spas_sage_attn shim) on the CPU backend."""

import numpy as np
import pytest

import ref
import sparge
from helpers import make_qkv, spike_inputs


def test_shim_imports():
    import spas_sage_attn
    from spas_sage_attn import (block_sparse_sage2_attn_cuda, spas_sage2_attn_meansim_cuda,  # noqa: F401
                                spas_sage2_attn_meansim_topk_cuda, spas_sage_attn_meansim_cuda,
                                spas_sage_attn_meansim_topk_cuda)
    from spas_sage_attn.core import spas_sage2_attn_meansim_topk_cuda as f2

    assert spas_sage_attn.spas_sage2_attn_meansim_topk_cuda is sparge.compat.spas_sage2_attn_meansim_topk_cuda
    assert f2 is sparge.spas_sage2_attn_meansim_topk_cuda


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("causal", [False, True])
def test_topk_names(rng, layout, causal):
    q, k, v = make_qkv(rng, B=1, Hq=2, Hkv=2, Lq=256, Lkv=384, D=32, dtype=np.float16, layout=layout)
    fixed = dict(estimator="mean", attention_sink=True, local_window=2 if causal else 0)  # sparge.compat's
    for fn, prec in ((sparge.spas_sage2_attn_meansim_topk_cuda, "int8_fp8"),
                     (sparge.spas_sage_attn_meansim_topk_cuda, "int8_fp16")):
        out = fn(q, k, v, topk=0.4, is_causal=causal, tensor_layout=layout)
        same = sparge.attention(q, k, v, topk=0.4, is_causal=causal, layout=layout, precision=prec, **fixed)
        np.testing.assert_array_equal(out, same)
        mask = sparge.predict_mask(q, k, topk=0.4, is_causal=causal, layout=layout, **fixed)
        expect, _ = ref.attention(q, k, v, mask=mask, causal=causal, layout=layout)
        assert ref.cosine(out, expect) > 0.995
        assert out.dtype == np.float16


def test_cdf_names_defaults(rng):
    q, k, v = make_qkv(rng, B=1, Hq=2, Hkv=1, Lq=256, Lkv=512, D=32, dtype=np.float16)
    out = sparge.spas_sage2_attn_meansim_cuda(q, k, v)
    same = sparge.attention(q, k, v, mode="cdf", cdf_threshold=0.98, sim_threshold=0.6, estimator="mean",
                            precision="int8_fp8", attention_sink=True, local_window=0)
    np.testing.assert_array_equal(out, same)
    out = sparge.spas_sage_attn_meansim_cuda(q, k, v, cdfthreshd=0.5, simthreshd1=0.1, is_causal=True)
    same = sparge.attention(q, k, v, mode="cdf", cdf_threshold=0.5, sim_threshold=0.1, is_causal=True,
                            precision="int8_fp16", estimator="mean", attention_sink=True, local_window=2)
    np.testing.assert_array_equal(out, same)


def test_topk_none_means_cdf(rng):
    q, k, v = make_qkv(rng, B=1, Hq=2, Hkv=1, Lq=256, Lkv=512, D=32, dtype=np.float16)
    out = sparge.spas_sage2_attn_meansim_topk_cuda(q, k, v, topk=None, cdfthreshd=0.7)
    same = sparge.attention(q, k, v, mode="cdf", cdf_threshold=0.7, estimator="mean", precision="int8_fp8",
                            attention_sink=True, local_window=0)
    np.testing.assert_array_equal(out, same)


def test_the_original_mean_rule(rng):
    # the original library's block importance, not libsparge's default: inputs where the two rules keep
    # different blocks
    assert sparge.compat.ESTIMATOR == "mean"
    q, k, v = (x.astype(np.float16) for x in spike_inputs(rng))
    mean = sparge.predict_mask(q, k, topk=0.25, estimator="mean", attention_sink=True, local_window=0)
    assert not np.array_equal(mean, sparge.predict_mask(q, k, topk=0.25, attention_sink=True, local_window=0))
    for fn, prec in ((sparge.spas_sage2_attn_meansim_topk_cuda, "int8_fp8"),
                     (sparge.spas_sage_attn_meansim_topk_cuda, "int8_fp16")):
        out = fn(q, k, v, topk=0.25)
        np.testing.assert_array_equal(out, sparge.attention(q, k, v, mask=mean, precision=prec))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sink", [False, True])
def test_sink_and_window_are_fixed(rng, monkeypatch, causal, sink):
    # the predicting names pass their own sink and window (not the library's defaults of the mode, -1)
    seen = []
    monkeypatch.setattr(sparge.compat, "attention", lambda *a, **kw: seen.append(kw) or a[0])
    q, k, v = make_qkv(rng, B=1, Hq=1, Hkv=1, Lq=128, Lkv=128, D=32, dtype=np.float16)
    for fn in (sparge.spas_sage2_attn_meansim_topk_cuda, sparge.spas_sage2_attn_meansim_cuda,
               sparge.spas_sage_attn_meansim_topk_cuda, sparge.spas_sage_attn_meansim_cuda):
        fn(q, k, v, is_causal=causal, attention_sink=sink)
    assert len(seen) == 4
    for kw in seen:
        assert kw["attention_sink"] is True and kw["local_window"] == (2 if causal else 0)
        assert kw["estimator"] == "mean"


def test_return_sparsity_is_skipped_fraction(rng):
    q, k, v = make_qkv(rng, B=1, Hq=2, Hkv=2, Lq=256, Lkv=640, D=32, dtype=np.float16)
    out, sp = sparge.spas_sage2_attn_meansim_topk_cuda(q, k, v, topk=0.3, is_causal=True, return_sparsity=True)
    _, density = sparge.attention(q, k, v, topk=0.3, is_causal=True, return_sparsity=True, estimator="mean",
                                  attention_sink=True, local_window=2)
    assert sp == pytest.approx(1.0 - density) and 0.0 < sp < 1.0


def test_return_lse(rng):
    q, k, v = make_qkv(rng, B=1, Hq=2, Hkv=2, Lq=128, Lkv=192, D=32, dtype=np.float16)
    out, lse = sparge.spas_sage_attn_meansim_topk_cuda(q, k, v, topk=1.0, return_lse=True)
    _, expect = ref.attention(q, k, v)
    np.testing.assert_allclose(lse, expect, atol=2e-2)


def test_output_dtype(rng):
    q, k, v = make_qkv(rng, B=1, Hq=1, Hkv=1, Lq=128, Lkv=128, D=32, dtype=np.float32)
    assert sparge.spas_sage_attn_meansim_topk_cuda(q, k, v).dtype == np.float32
    assert sparge.spas_sage_attn_meansim_topk_cuda(q, k, v, output_dtype=np.float16).dtype == np.float16
    assert sparge.spas_sage_attn_meansim_topk_cuda(q, k, v, output_dtype="float16").dtype == np.float16


def test_block_sparse_name(rng):
    q, k, v = make_qkv(rng, B=1, Hq=2, Hkv=2, Lq=256, Lkv=256, D=32, dtype=np.float16)
    mask_id = (rng.random((1, 2, 2, 4)) < 0.5).astype(np.int32)
    mask_id[..., 0] = 1
    out = sparge.block_sparse_sage2_attn_cuda(q, k, v, mask_id=mask_id)
    expect, _ = ref.attention(q, k, v, mask=mask_id)
    assert ref.cosine(out, expect) > 0.995
    full = sparge.block_sparse_sage2_attn_cuda(q, k, v)  # None: every block
    dense, _ = ref.attention(q, k, v)
    assert ref.cosine(full, dense) > 0.995
    out, sp = sparge.block_sparse_sage2_attn_cuda(q, k, v, mask_id=mask_id, return_sparsity=True)
    assert sp == pytest.approx(1.0 - mask_id.sum() / mask_id.size)


def test_positional_like_sdpa(rng):
    """The original signature: (q, k, v, attn_mask, dropout_p, is_causal, scale, ...)."""
    q, k, v = make_qkv(rng, B=1, Hq=1, Hkv=1, Lq=128, Lkv=128, D=32, dtype=np.float16)
    a = sparge.spas_sage2_attn_meansim_topk_cuda(q, k, v, None, 0.0, True, 0.1)
    b = sparge.attention(q, k, v, is_causal=True, scale=0.1, precision="int8_fp8")
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("cdf", [0.3, 0.5, 0.7])
def test_the_original_mean_rule_cdf(rng, cdf):
    # the CDF-mode names and the autotune module's predicted path use the mean rule too: inputs where
    # the two rules keep different blocks at this threshold
    q, k, v = (x.astype(np.float16) for x in spike_inputs(rng))
    kw = dict(mode="cdf", cdf_threshold=cdf, sim_threshold=-0.1, attention_sink=True, local_window=0)
    mean = sparge.predict_mask(q, k, estimator="mean", **kw)
    if np.array_equal(mean, sparge.predict_mask(q, k, **kw)):
        pytest.skip("the estimators agree at cdf %g on these inputs" % cdf)
    for fn, prec in ((sparge.spas_sage2_attn_meansim_cuda, "int8_fp8"),
                     (sparge.spas_sage_attn_meansim_cuda, "int8_fp16")):
        out = fn(q, k, v, simthreshd1=-0.1, cdfthreshd=cdf)
        np.testing.assert_array_equal(out, sparge.attention(q, k, v, mask=mean, precision=prec))
