"""sparge.predict_mask on the CPU backend: structural properties and the float64 reference."""

import math

import numpy as np
import pytest

import ref
import sparge
from helpers import make_qkv, spike_inputs


def assert_masks_match(mask, expect, margin, tol=1e-5):
    """Equal, except rows whose reference decision is within tol of flipping."""
    assert mask.shape == expect.shape and mask.dtype == np.uint8
    diff = np.any(mask != expect, axis=-1)
    bad = diff & (margin > tol)
    assert not bad.any(), "mask rows differ from the reference at %s" % (np.argwhere(bad)[:5].tolist(),)


@pytest.mark.parametrize("causal,Lq,Lkv", [(False, 320, 512), (True, 320, 512), (True, 512, 320),
                                          (True, 100, 700), (False, 1, 64)])
@pytest.mark.parametrize("topk", [0.05, 0.3, 0.5, 0.999, 1.0])
def test_topk_count_per_row(rng, causal, Lq, Lkv, topk):
    q, k, _ = make_qkv(rng, B=2, Hq=4, Hkv=2, Lq=Lq, Lkv=Lkv, D=32)
    mask, kept = sparge.predict_mask(q, k, topk=topk, is_causal=causal, return_kept=True)
    vis = ref.visible_blocks(Lq, Lkv, 128, 64, causal)
    nkb = -(-Lkv // 64)
    assert mask.shape == (2, 4, len(vis), nkb) and mask.dtype == np.uint8
    assert set(np.unique(mask)) <= {0, 1}
    for qb, nv in enumerate(vis):
        want = 0 if nv == 0 else max(1, min(nv, math.floor(float(np.float32(topk)) * nv + 1e-4)))
        if nv:  # the mode's default sink and window count in the budget and are always kept
            want = max(want, int(ref.budget_forced(qb, nv, Lq, Lkv, 128, 64, causal, None, None).sum()))
        rows = mask[:, :, qb]
        assert np.all(rows.sum(-1) == want), (qb, nv, rows.sum(-1))
        assert np.all(rows[..., nv:] == 0), "invisible blocks kept"
    assert kept.dtype == np.int32 and kept.shape == (2, 4)
    np.testing.assert_array_equal(kept, mask.sum(axis=(2, 3)))


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("opts", [
    dict(topk=0.3),
    dict(topk=0.5, is_causal=True),
    dict(topk=0.25, smooth_k=False),
    dict(topk=0.2, attention_sink=True, is_causal=True),
    dict(topk=0.3, sim_threshold=0.3),
    dict(mode="cdf", cdf_threshold=0.6),
    dict(mode="cdf", cdf_threshold=0.9, is_causal=True),
    dict(topk=[0.1, 0.2, 0.5, 0.9], sim_threshold=[-0.1, 0.2, 0.3, 0.0]),
    dict(mode="cdf", cdf_threshold=[0.3, 0.5, 0.8, 0.95]),
    dict(topk=0.4, scale=0.02),
    dict(topk=0.3, attention_sink=False, local_window=0, is_causal=True),
    dict(topk=0.3, attention_sink=True, local_window=2),
    dict(mode="cdf", cdf_threshold=0.7, local_window=1, is_causal=True),
])
def test_matches_reference(rng, layout, opts):
    # structured inputs (a shared direction per block) so pooled scores are well separated
    q, k, _ = make_qkv(rng, B=1, Hq=4, Hkv=2, Lq=384, Lkv=640, D=32, layout=layout)
    shift = rng.standard_normal((1, 1, 10, 1, 32)).astype(np.float32) * 2
    if layout == "HND":
        k = (k.reshape(1, 2, 10, 64, 32) + shift).reshape(k.shape)
    else:
        k = (k.reshape(1, 10, 64, 2, 32) + shift.transpose(0, 2, 1, 3, 4)).reshape(k.shape)
    mask = sparge.predict_mask(q, k, layout=layout, estimator="mean", **opts)  # ref.predict is the mean rule
    o = dict(opts)
    expect, margin = ref.predict(
        q, k, topk=o.get("topk", 0.5), mode=o.get("mode", "topk"), cdf=o.get("cdf_threshold", 0.9),
        sim_threshold=o.get("sim_threshold", -0.1), smooth_k=o.get("smooth_k", True),
        sink=o.get("attention_sink"), window=o.get("local_window"), causal=o.get("is_causal", False),
        scale=o.get("scale"), layout=layout)
    assert_masks_match(mask, expect, margin)


def test_full_and_forced(rng):
    q, k, _ = make_qkv(rng, B=1, Hq=2, Hkv=2, Lq=300, Lkv=500, D=32)
    vis = ref.visible_blocks(300, 500, 128, 64, True)
    full = np.zeros((3, 8), dtype=np.uint8)
    for qb, nv in enumerate(vis):
        full[qb, :nv] = 1
    # topk 1.0 keeps every visible block
    m = sparge.predict_mask(q, k, topk=1.0, is_causal=True)
    assert np.all(m == full)
    # a similarity threshold above 1 makes every block non-compressible
    m = sparge.predict_mask(q, k, topk=0.01, is_causal=True, sim_threshold=1.5)
    assert np.all(m == full)
    # the attention sink keeps key block 0 in every row that sees a key
    m = sparge.predict_mask(q, k, topk=0.01, is_causal=True, attention_sink=True)
    assert np.all(m[..., 0] == 1)
    # causal: the first diagonal block of each row is always kept, whatever the options
    for sink in (False, True, None):
        for window in (0, 1, 3, None):
            m = sparge.predict_mask(q, k, topk=0.01, is_causal=True, attention_sink=sink, local_window=window)
            for qb in range(3):
                first = min(499, max(0, qb * 128 + 500 - 300)) // 64  # block of the first row's diagonal key
                assert np.all(m[..., qb, first] == 1)


def test_causal_defaults_no_zero_row(rng):
    for L in (256, 1024):
        q, k, v = make_qkv(rng, B=1, Hq=2, Hkv=1, Lq=L, Lkv=L, D=32)
        out, lse = sparge.attention(q, k, v, is_causal=True, return_lse=True)
        assert np.all(np.abs(out).max(axis=-1) > 0), "a query row without any kept key"
        assert np.all(np.isfinite(lse))


def test_estimator_option(rng):
    q, k, _ = spike_inputs(rng)
    a = sparge.predict_mask(q, k, topk=0.25, estimator="mean")
    b = sparge.predict_mask(q, k, topk=0.25, estimator="keys_lse")
    assert a.sum() == b.sum()
    assert a[0, 0, 0, 5] == 0 and b[0, 0, 0, 5] == 1  # the spike's block
    assert not np.array_equal(a, b)
    with pytest.raises(sparge.InvalidArgumentError, match="estimator"):
        sparge.predict_mask(q, k, estimator="max")


def two_cluster_inputs(rng, B=1, Hq=2, Hkv=1, Lq=1024, Lkv=2048, D=64):
    """q, k, v whose query blocks (128 rows) hold two clusters of rows 120 degrees apart, interleaved: each
    block's mean row is about half its rows' length, inside keys_lse_adaptive's [0.25, 0.75), so every block
    is split and keys_lse_adaptive ranks with two rows where keys_lse ranks with one. Keys: per 64-key block
    a random centre plus noise."""
    q = np.empty((B, Hq, Lq, D), np.float32)
    for b in range(B):
        for h in range(Hq):
            for r0 in range(0, Lq, 128):
                c1 = 0.4 * rng.standard_normal(D)
                c2 = -0.5 * c1 + 0.866 * 0.4 * rng.standard_normal(D)
                n = min(128, Lq - r0)
                rows = np.where((np.arange(n) % 2 == 1)[:, None], c2, c1)
                q[b, h, r0:r0 + n] = rows + 0.05 * rng.standard_normal((n, D))
    centres = np.repeat(rng.standard_normal((B, Hkv, -(-Lkv // 64), D)), 64, axis=2)[:, :, :Lkv]
    k = (centres + 0.3 * rng.standard_normal((B, Hkv, Lkv, D))).astype(np.float32)
    v = rng.standard_normal((B, Hkv, Lkv, D)).astype(np.float32)
    return q, k, v


def test_default_estimator_is_auto(rng):
    """The default estimator "auto" is keys_lse_adaptive when not causal and keys_lse when causal (the
    library resolves it): the same masks and outputs as naming them, in every entry point."""
    import inspect

    from sparge import _plan, distributed

    for fn in (sparge.attention, sparge.predict_mask, sparge.sdpa, _plan.Plan.run, _plan.Plan.predict,
               distributed.ring_attention, distributed.ulysses_attention):
        assert inspect.signature(fn).parameters["estimator"].default == "auto", fn
    q, k, v = two_cluster_inputs(rng)
    for causal in (False, True):
        lse = sparge.predict_mask(q, k, is_causal=causal, estimator="keys_lse")
        adaptive = sparge.predict_mask(q, k, is_causal=causal, estimator="keys_lse_adaptive")
        assert not np.array_equal(lse, adaptive), "the inputs must tell the two estimators apart"
        want = lse if causal else adaptive
        np.testing.assert_array_equal(sparge.predict_mask(q, k, is_causal=causal), want)
        np.testing.assert_array_equal(sparge.predict_mask(q, k, is_causal=causal, estimator="auto"), want)
        with sparge.Plan(1, 2, 1024, 64, heads_kv=1, len_kv=2048, dtype="float32", device="cpu",
                         is_causal=causal) as plan:
            np.testing.assert_array_equal(np.asarray(plan.predict(q, k)), want)
        out = sparge.attention(q, k, v, is_causal=causal, precision="exact")
        np.testing.assert_array_equal(out, sparge.attention(q, k, v, is_causal=causal, mask=want, precision="exact"))
    # the spike inputs: the default is not the mean rule
    q, k, v = spike_inputs(rng)
    out = sparge.attention(q, k, v, topk=0.25, precision="exact")
    assert not np.array_equal(out, sparge.attention(q, k, v, topk=0.25, precision="exact", estimator="mean"))
    with pytest.raises(sparge.InvalidArgumentError, match="auto"):
        sparge.predict_mask(q, k, estimator="AUTO")


def test_keys_lse_rounds_the_pooled_row_to_the_key_type():
    # docs/SEMANTICS.md, "Mask prediction" 3: with 16-bit keys the pooled query row is rounded once to their
    # type. Channel 0 alternates 1 and 1 + ulp: its mean 1 + ulp/2 rounds (to even) to 1. Block 0's keys are
    # (2, 0, 0), block 1's (0, 2, 1) against q_1 = 1, q_2 = ulp/2: unrounded block 0 scores higher, rounded
    # block 1 does. float32 keys are not rounded.
    ulp = 2.0 ** -10
    for dt, want in ((np.float16, [0, 1]), (np.float32, [1, 0])):
        q = np.zeros((1, 1, 64, 16), dt)
        k = np.zeros((1, 1, 128, 16), dt)
        q[0, 0, :, 0] = np.where(np.arange(64) % 2 == 1, 1 + ulp, 1.0)
        q[0, 0, :, 1] = 1.0
        q[0, 0, :, 2] = ulp / 2
        k[0, 0, :64, 0] = 2.0
        k[0, 0, 64:, 1] = 2.0
        k[0, 0, 64:, 2] = 1.0
        m = sparge.predict_mask(q, k, topk=0.5, estimator="keys_lse", attention_sink=False, local_window=0,
                                block_size=(64, 64), precision="exact")
        assert np.asarray(m)[0, 0, 0].tolist() == want, dt


@pytest.mark.parametrize("bad", [-1, 1025, 1.5, True, "2"])
def test_local_window_checked(rng, bad):
    q, k, _ = make_qkv(rng, B=1, Hq=1, Hkv=1, Lq=128, Lkv=128, D=16)
    with pytest.raises(sparge.InvalidArgumentError, match="local_window"):
        sparge.predict_mask(q, k, local_window=bad)


def test_cdf_monotone(rng):
    q, k, _ = make_qkv(rng, B=1, Hq=2, Hkv=1, Lq=256, Lkv=1024, D=32)
    prev = None
    for thr in (0.2, 0.5, 0.8, 0.95, 1.0):
        m = sparge.predict_mask(q, k, mode="cdf", cdf_threshold=thr).astype(np.int64)
        assert np.all(m.sum(-1) >= 1)
        if prev is not None:
            assert np.all(m >= prev), "a larger cdf_threshold dropped a block"
        prev = m


def test_visible_key_blocks_matches_library(rng):
    from sparge import _core
    from sparge._arrays import numpy_view

    for Lq, Lkv, causal in [(300, 500, True), (500, 300, True), (1, 1000, True), (256, 256, False)]:
        q, k, _ = make_qkv(rng, B=1, Hq=1, Hkv=1, Lq=Lq, Lkv=Lkv, D=16)
        qv, kv = numpy_view(q), numpy_view(k)
        s = _core.check_qkv(qv, kv, None, 0)
        opts = _core.Options(0, causal, 0.0, 0, 0.5, 0.9, -0.1, True, 0, 0, 0, 2, 0, 0)
        plan = _core.get_plan(s, qv, opts)
        assert plan.visible_per_head == sum(sparge.visible_key_blocks(Lq, Lkv, 128, 64, causal))
        assert list(ref.visible_blocks(Lq, Lkv, 128, 64, causal)) == sparge.visible_key_blocks(Lq, Lkv, 128, 64, causal)


def test_topk_decimal_fraction(rng):
    """topk=0.9 with 10 visible blocks should keep floor(0.9 * 10) = 9 blocks."""
    q, k, _ = make_qkv(rng, B=1, Hq=1, Hkv=1, Lq=128, Lkv=640, D=32)
    for topk, want in ((0.9, 9), (0.7, 7)):
        m = sparge.predict_mask(q, k, topk=topk)
        assert int(m.sum()) == want, (topk, int(m.sum()))
