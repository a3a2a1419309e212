"""sparge.sdpa (SDPA's signature and semantics), sparge.Plan and out= on the CPU backend (numpy).

References are float64 implementations of torch's scaled_dot_product_attention rules (top-left
causal mask, GQA by head repetition, default scale 1/sqrt(E)), written here independently of the
library."""

import inspect
import math

import numpy as np
import pytest

import sparge


def sdpa_ref(q, k, v, is_causal=False, scale=None):
    """float64 torch-SDPA semantics: [..., L, E] x [..., S, E]; GQA by repeating key heads."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    if q.ndim == 4 and k.shape[1] != q.shape[1]:
        g = q.shape[1] // k.shape[1]
        k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    L, S = q.shape[-2], k.shape[-2]
    s = np.einsum("...le,...se->...ls", q, k) * (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if is_causal:
        s = np.where(np.tril(np.ones((L, S), dtype=bool)), s, -np.inf)
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    return np.einsum("...ls,...se->...le", p, v)


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def test_signature_is_sdpa():
    params = list(inspect.signature(sparge.sdpa).parameters.values())
    names = [p.name for p in params]
    assert names[:8] == ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
    assert all(p.kind == p.POSITIONAL_OR_KEYWORD for p in params[:8])
    defaults = [p.default for p in params[3:8]]
    assert defaults == [None, 0.0, False, None, False]
    assert all(p.kind == p.KEYWORD_ONLY for p in params[8:])
    assert {"topk", "out", "precision", "block_size"} <= set(names[8:])


@pytest.mark.parametrize("L,S", [(96, 96), (70, 200), (200, 70), (1, 130), (130, 1)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_matches_sdpa_rules(rng, L, S, is_causal):
    """topk=1.0 and the exact precision: every argument combination within float32 rounding."""
    q, k, v = rand(rng, 2, 4, L, 16), rand(rng, 2, 2, S, 16), rand(rng, 2, 2, S, 16)
    scale = float(rng.uniform(0.05, 0.5))
    # positional, as torch code calls it
    out = sparge.sdpa(q, k, v, None, 0.0, is_causal, scale, True, topk=1.0, precision="exact")
    ref = sdpa_ref(q, k, v, is_causal, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    np.testing.assert_allclose(out, ref, atol=2e-6, rtol=0)
    default = sparge.sdpa(q, k, v, is_causal=is_causal, enable_gqa=True, topk=1.0, precision="exact")
    np.testing.assert_allclose(default, sdpa_ref(q, k, v, is_causal), atol=2e-6, rtol=0)


def test_three_dim_inputs_and_out(rng):
    q, k, v = rand(rng, 3, 50, 8), rand(rng, 3, 90, 8), rand(rng, 3, 90, 8)
    out = sparge.sdpa(q, k, v, is_causal=True, topk=1.0, precision="exact")
    assert out.shape == (3, 50, 8)
    np.testing.assert_allclose(out, sdpa_ref(q, k, v, True), atol=2e-6, rtol=0)
    buf = np.full_like(q, np.nan)
    got = sparge.sdpa(q, k, v, is_causal=True, topk=1.0, precision="exact", out=buf)
    assert got is buf
    np.testing.assert_allclose(buf, out, atol=0, rtol=0)


def test_out_split_causal_writes_every_row(rng):
    q, k, v = rand(rng, 1, 2, 300, 16), rand(rng, 1, 2, 100, 16), rand(rng, 1, 2, 100, 16)
    buf = np.full_like(q, np.nan)
    sparge.sdpa(q, k, v, is_causal=True, topk=1.0, precision="exact", out=buf)
    assert np.isfinite(buf).all()
    np.testing.assert_allclose(buf, sdpa_ref(q, k, v, True), atol=2e-6, rtol=0)


def test_sparse_keywords_pass_through(rng):
    q, k, v = rand(rng, 1, 2, 512, 32), rand(rng, 1, 2, 512, 32), rand(rng, 1, 2, 512, 32)
    a = sparge.sdpa(q, k, v, is_causal=True, topk=0.3, precision="exact")
    b = sparge.attention(q, k, v, is_causal=True, topk=0.3, precision="exact")
    np.testing.assert_array_equal(a, b)


def test_refusals_name_the_argument(rng):
    q, k, v = rand(rng, 1, 4, 64, 16), rand(rng, 1, 2, 64, 16), rand(rng, 1, 2, 64, 16)
    with pytest.raises(sparge.UnsupportedError, match="attn_mask"):
        sparge.sdpa(q, k, v, np.ones((64, 64), dtype=bool), enable_gqa=True)
    with pytest.raises(sparge.UnsupportedError, match="attn_mask"):
        sparge.sdpa(q, k, v, attn_mask=np.zeros((64, 64), dtype=np.float32), enable_gqa=True)
    with pytest.raises(sparge.UnsupportedError, match="dropout_p"):
        sparge.sdpa(q, k, v, dropout_p=0.1, enable_gqa=True)
    with pytest.raises(sparge.InvalidArgumentError, match="enable_gqa"):
        sparge.sdpa(q, k, v)
    with pytest.raises(sparge.UnsupportedError, match="head dim"):
        sparge.sdpa(q[..., :8].copy(), k[..., :8].copy(), v, enable_gqa=True)
    with pytest.raises(sparge.InvalidArgumentError, match="query must be"):
        sparge.sdpa(q[0, 0], k[0, 0], v[0, 0])
    with pytest.raises(sparge.InvalidArgumentError, match="out must have shape"):
        sparge.sdpa(q, k, v, enable_gqa=True, out=np.empty((1, 4, 63, 16), np.float32), precision="exact")
    with pytest.raises(sparge.InvalidArgumentError, match="out has dtype"):
        sparge.sdpa(q, k, v, enable_gqa=True, out=np.empty(q.shape, np.float64), precision="exact")


@pytest.mark.parametrize("layout", ["hnd", "nhd", "Nhd"])
def test_lower_case_layouts_and_out(rng, layout):
    shape = (1, 2, 200, 16) if layout.upper() == "HND" else (1, 200, 2, 16)
    q, k, v = rand(rng, *shape), rand(rng, *shape), rand(rng, *shape)
    want = sparge.attention(q, k, v, layout=layout.upper(), topk=0.5, precision="exact", is_causal=True)
    buf = np.full_like(q, np.nan)
    got = sparge.attention(q, k, v, layout=layout, topk=0.5, precision="exact", is_causal=True, out=buf)
    assert got is buf
    np.testing.assert_array_equal(buf, want)
    m = sparge.predict_mask(q, k, layout=layout, topk=0.5, is_causal=True)
    mbuf = np.full(m.shape, 7, dtype=np.uint8)
    assert sparge.predict_mask(q, k, layout=layout, topk=0.5, is_causal=True, out=mbuf) is mbuf
    np.testing.assert_array_equal(mbuf, m)
    bbuf = np.full_like(q, np.nan)
    sparge.block_sparse_attention(q, k, v, m, layout=layout, precision="exact", is_causal=True, out=bbuf)
    np.testing.assert_array_equal(bbuf, want)
    with pytest.raises(sparge.InvalidArgumentError, match="layout"):
        sparge.attention(q, k, v, layout="hdn")


def test_out_may_be_strided(rng):
    q, k, v = rand(rng, 1, 2, 150, 16), rand(rng, 1, 2, 150, 16), rand(rng, 1, 2, 150, 16)
    big = np.full((1, 2, 150, 48), np.nan, dtype=np.float32)
    view = big[..., 16:32]
    sparge.attention(q, k, v, topk=1.0, precision="exact", out=view)
    np.testing.assert_allclose(view, sdpa_ref(q, k, v), atol=2e-6, rtol=0)
    assert np.isnan(big[..., :16]).all() and np.isnan(big[..., 32:]).all()


# ---------------------------------------------------------------- Plan
def test_plan_run_with_own_workspace(rng):
    B, Hq, Hkv, L, S, D = 2, 4, 2, 190, 260, 16
    plan = sparge.Plan(B, Hq, L, D, heads_kv=Hkv, len_kv=S, dtype="float32", device="cpu", precision="exact",
                       is_causal=True)
    assert plan.workspace_size > 0 and plan.block_size == (128, 64)
    assert plan.mask_shape == (B, Hq, 2, 5) and abs(plan.scale - 0.25) < 1e-7
    ws = plan.allocate_workspace()
    assert ws.nbytes >= plan.workspace_size
    for _ in range(2):  # a serving loop: fresh inputs, the same plan and workspace
        q, k, v = rand(rng, B, Hq, L, D), rand(rng, B, Hkv, S, D), rand(rng, B, Hkv, S, D)
        out = np.full_like(q, np.nan)
        got = plan.run(q, k, v, topk=1.0, workspace=ws, out=out)
        assert got is out
        ref = sparge.attention(q, k, v, topk=1.0, is_causal=True, precision="exact")
        np.testing.assert_array_equal(out, ref)
        m = plan.predict(q, k, topk=0.4, workspace=ws)
        np.testing.assert_array_equal(m, sparge.predict_mask(q, k, topk=0.4, is_causal=True, precision="exact"))
        o2, lse = plan.run(q, k, v, mask=m, workspace=ws, return_lse=True)
        assert lse.shape == (B, Hq, L) and not np.isnan(lse).any()  # -inf: a row whose kept blocks it cannot see
        np.testing.assert_array_equal(o2, sparge.block_sparse_attention(q, k, v, m, is_causal=True,
                                                                          precision="exact"))


def test_plan_for_inputs_and_errors(rng):
    q, k, v = rand(rng, 1, 2, 100, 16), rand(rng, 1, 2, 100, 16), rand(rng, 1, 2, 100, 16)
    plan = sparge.Plan.for_inputs(q, k, precision="exact")
    assert "Hq=2" in repr(plan) and plan.device == "cpu"
    with pytest.raises(sparge.InvalidArgumentError, match="do not match the plan: Lq 99"):
        plan.run(q[:, :, :99], k, v)
    with pytest.raises(sparge.WorkspaceTooSmallError, match="workspace_size"):
        plan.run(q, k, v, workspace=np.empty(8, np.uint8))
    with pytest.raises(sparge.InvalidArgumentError, match="1-D contiguous"):
        plan.run(q, k, v, workspace=np.empty((4, plan.workspace_size), np.uint8))
    with pytest.raises(sparge.InvalidArgumentError, match="dtype"):
        sparge.Plan(1, 1, 10, 16, dtype="int8", device="cpu")
    with pytest.raises(sparge.InvalidArgumentError, match="device"):
        sparge.Plan(1, 1, 10, 16, dtype="float32", device="tpu")
    with pytest.raises(sparge.InvalidArgumentError, match="head_dim"):
        sparge.Plan(1, 1, 10, 0, dtype="float32", device="cpu")
    with sparge.Plan.for_inputs(q, k, precision="exact") as p2:
        p2.run(q, k, v)
    with pytest.raises(sparge.InvalidArgumentError, match="closed"):
        p2.run(q, k, v)
    plan.close()
    plan.close()  # idempotent


@pytest.mark.parametrize("shape_q,shape_kv", [((0, 2, 5, 16), (0, 2, 7, 16)), ((1, 2, 0, 16), (1, 2, 7, 16)),
                                              ((1, 0, 5, 16), (1, 0, 7, 16)), ((1, 2, 5, 16), (1, 2, 0, 16)),
                                              ((2, 5, 16), (2, 0, 16))])
@pytest.mark.parametrize("is_causal", [False, True])
def test_empty_problems_give_torch_results(rng, shape_q, shape_kv, is_causal):
    """No batch, head or query: an empty output; no key: zeros (what torch's SDPA returns), also
    into out=, whose old values are overwritten."""
    q, k, v = rand(rng, *shape_q), rand(rng, *shape_kv), rand(rng, *shape_kv)
    got = sparge.sdpa(q, k, v, is_causal=is_causal)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert not np.any(got)
    out = np.full(q.shape, np.nan, np.float32)
    assert sparge.sdpa(q, k, v, is_causal=is_causal, out=out) is out
    assert not np.any(out)
    with pytest.raises(sparge.InvalidArgumentError, match="out"):
        sparge.sdpa(q, k, v, out=np.empty(q.shape[:-1] + (q.shape[-1] + 1,), np.float32))


def test_broadcast_and_strided_inputs_as_torch_takes_them(rng):
    """K and V expanded over their heads (stride 0, multi-query attention without enable_gqa), a
    broadcast query and a head dim read with a stride: the results of the same values in dense
    arrays (torch's SDPA takes all of them)."""
    q, k1, v1 = rand(rng, 2, 4, 70, 16), rand(rng, 2, 1, 90, 16), rand(rng, 2, 1, 90, 16)
    k, v = np.broadcast_to(k1, (2, 4, 90, 16)), np.broadcast_to(v1, (2, 4, 90, 16))
    assert k.strides[1] == 0
    for is_causal in (False, True):
        want = sparge.sdpa(q, np.ascontiguousarray(k), np.ascontiguousarray(v), is_causal=is_causal,
                           precision="exact", topk=1.0)
        got = sparge.sdpa(q, k, v, is_causal=is_causal, precision="exact", topk=1.0)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_allclose(got, sdpa_ref(q, k, v, is_causal), atol=2e-6, rtol=0)
    # only k broadcast (v differs per head), a broadcast query row, a strided head dim
    v4 = rand(rng, 2, 4, 90, 16)
    qb = np.broadcast_to(rand(rng, 2, 4, 1, 16), (2, 4, 70, 16))
    wide = rand(rng, 2, 4, 70, 32)
    for qq, vv in ((q, v4), (qb, v4), (wide[..., ::2], v4)):
        got = sparge.sdpa(qq, k, vv, precision="exact", topk=1.0)
        np.testing.assert_array_equal(got, sparge.sdpa(np.ascontiguousarray(qq), np.ascontiguousarray(k),
                                                       vv, precision="exact", topk=1.0))


def test_head_dim_of_one_and_head_counts_that_do_not_divide(rng):
    # E = 1 read with any stride (the stride of an extent-1 dim means nothing); K/V expanded over a
    # head count that does not divide the query heads is refused, as torch refuses it.
    q = rand(rng, 1, 2, 50, 1)
    qs = np.lib.stride_tricks.as_strided(q, q.shape, q.strides[:-1] + (q.itemsize * 7,))
    k, v = rand(rng, 1, 2, 60, 1), rand(rng, 1, 2, 60, 1)
    np.testing.assert_array_equal(sparge.sdpa(qs, k, v, precision="exact", topk=1.0),
                                  sparge.sdpa(q, k, v, precision="exact", topk=1.0))
    k1, v1 = rand(rng, 1, 1, 7, 16), rand(rng, 1, 1, 7, 16)
    with pytest.raises(sparge.InvalidArgumentError, match="heads"):
        sparge.sdpa(rand(rng, 1, 4, 5, 16), np.broadcast_to(k1, (1, 3, 7, 16)), np.broadcast_to(v1, (1, 3, 7, 16)),
                    enable_gqa=True)
