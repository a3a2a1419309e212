"""The oracle yardstick (tools/accuracy/yardstick.py) on the CPU backend: its evaluation against a
direct float64 computation, its mean-rule selection against sparge.predict_mask, oracle optimality,
and the default settings on the committed captures of real models (tests/data/captures)."""

import glob
import os
import sys

import numpy as np
import pytest

import ref
import sparge

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools", "accuracy"))
import grid3d  # noqa: E402
import yardstick as Y  # noqa: E402

CAPTURES = sorted(glob.glob(os.path.join(ROOT, "tests", "data", "captures", "*.npz")))


def _random_capture(rng, Hq, Hkv, L, D, causal):
    # clustered tokens: runs sharing a direction, so blocks differ in mass
    base = rng.standard_normal((Hkv, L // 64 + 1, D)) * 1.5
    k = np.repeat(base, 64, axis=1)[:, :L] + rng.standard_normal((Hkv, L, D))
    q = np.repeat(np.repeat(base, 64, axis=1)[:, :L], Hq // Hkv, axis=0) + rng.standard_normal((Hq, L, D))
    v = rng.standard_normal((Hkv, L, D))
    return Y.Capture(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), causal, "random", None)


@pytest.mark.parametrize("causal", [False, True])
def test_scores_match_direct_attention(rng, causal):
    cap = _random_capture(rng, 4, 2, 700, 32, causal)
    st = Y.Setting(topk=0.3)
    mask = np.stack([Y.select(Y.est_mean(cap, h), st, 700, 700, causal) for h in range(4)])
    res = Y.evaluate(cap, [st])[0]
    dense, _ = ref.attention(cap.q[None], cap.k[None], cap.v[None], causal=causal)
    sparse, _ = ref.attention(cap.q[None], cap.k[None], cap.v[None], mask=mask[None], causal=causal)
    assert res.pred.rel_l1 == pytest.approx(ref.rel_l1(sparse, dense), rel=1e-9)
    assert res.pred.cosine == pytest.approx(ref.cosine(sparse, dense), rel=1e-9)
    vis = ref.visible_blocks(700, 700, 128, 64, causal)
    assert res.pred.density == pytest.approx(mask.sum() / (4 * vis.sum()))
    # captured mass: dense probability on the kept keys, averaged over rows
    q, k = cap.q.astype(np.float64), cap.k.astype(np.float64)
    tot = 0.0
    for h in range(4):
        s = q[h] @ k[h // 2].T / np.sqrt(32)
        allowed = ref.token_allowed(700, 700, causal)
        s = np.where(allowed, s, -np.inf)
        p = np.exp(s - s.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        keep = np.repeat(np.repeat(mask[h], 128, 0), 64, 1)[:700, :700]
        tot += (p * keep).sum()
    assert res.pred.captured == pytest.approx(tot / (4 * 700), rel=1e-9)


@pytest.mark.parametrize("causal", [False, True])
def test_mean_rule_matches_the_library(rng, causal):
    cap = _random_capture(rng, 4, 2, 900, 32, causal)
    for st in (Y.Setting(topk=0.2), Y.Setting(topk=0.5, sink=True, window=2), Y.Setting(topk=None, cdf=0.8),
               Y.Setting(topk=0.1, sink=False, window=0), Y.Setting(topk=None, cdf=0.5, window=1, sink=False)):
        lib = Y.library_mask(cap, st)
        mine = np.stack([Y.select(Y.est_mean(cap, h), st, 900, 900, causal) for h in range(4)])
        assert np.array_equal(lib, mine), st.label()
        # the per-key estimator: float32 rounding of the per-key scores may flip a near-tie row
        st.estimator = "keys_lse"
        lib = Y.library_mask(cap, st)
        mine = np.stack([Y.select(Y.ESTIMATORS["keys_lse"](cap, h), st, 900, 900, causal) for h in range(4)])
        assert (lib != mine).any(axis=-1).sum() <= 1, st.label()


@pytest.mark.parametrize("causal", [False, True])
def test_split2_rule_matches_the_library(rng, causal):
    # rows of two clusters per 128-row query block, so that the two groups differ
    cap = _random_capture(rng, 4, 2, 900, 32, causal)
    centres = rng.standard_normal((4, 8, 2, 32)) * 1.5
    lab = rng.integers(0, 2, size=(4, 900))
    blk = np.arange(900) // 128
    cap.q[...] = centres[np.arange(4)[:, None], blk[None, :], lab] + 0.3 * rng.standard_normal((4, 900, 32))
    differs = 0
    for st in (Y.Setting(topk=0.2, estimator="keys_lse_split2"), Y.Setting(topk=0.5, estimator="keys_lse_split2"),
               Y.Setting(topk=None, cdf=0.8, estimator="keys_lse_split2")):
        lib = Y.library_mask(cap, st)
        mine = np.stack([Y.select(Y.ESTIMATORS["keys_lse_split2"](cap, h), st, 900, 900, causal) for h in range(4)])
        # float32 rounding of the group means and scores may flip a near-tie row
        assert (lib != mine).any(axis=-1).sum() <= 1, st.label()
        st.estimator = "keys_lse"
        differs += int((Y.library_mask(cap, st) != lib).any(axis=-1).sum())
    assert differs > 0  # the split rule is not the single pooled row's


@pytest.mark.parametrize("causal", [False, True])
def test_adaptive_split_spans_keys_lse_and_split2(rng, causal):
    # blocks of two clusters (split by any tau > 0.5 or so) and blocks of one (kept whole by tau < 0.9)
    cap = _random_capture(rng, 2, 1, 900, 32, causal)
    centres = rng.standard_normal((2, 8, 2, 32)) * 1.5
    lab = rng.integers(0, 2, size=(2, 900)) * (np.arange(900) // 128 % 2 == 0)
    blk = np.arange(900) // 128
    cap.q[...] = centres[np.arange(2)[:, None], blk[None, :], lab] + 0.3 * rng.standard_normal((2, 900, 32))
    for st in (Y.Setting(topk=0.3), Y.Setting(topk=None, cdf=0.8)):
        for h in range(2):
            lse = Y.select(Y.ESTIMATORS["keys_lse"](cap, h), st, 900, 900, causal)
            split = Y.select(Y.ESTIMATORS["keys_lse_split2"](cap, h), st, 900, 900, causal)
            none = Y.select(Y.est_keys_lse_split2(cap, h, tau=0.0), st, 900, 900, causal)
            every = Y.select(Y.est_keys_lse_split2(cap, h, tau=np.inf), st, 900, 900, causal)
            some = Y.select(Y.est_keys_lse_split2(cap, h, tau=0.9), st, 900, 900, causal)
            assert (none != lse).any(axis=-1).sum() <= 1  # near-ties only
            assert np.array_equal(every, split)
            # the blocks whose mean row is short follow split2, the others keys_lse
            q = cap.q[h].astype(np.float64)
            short = np.array([np.linalg.norm(q[i:i + 128].mean(axis=0)) < 0.9 * np.linalg.norm(q[i:i + 128], axis=1).mean()
                              for i in range(0, 900, 128)])
            assert short[0::2].all() and not short[1::2].any()  # the clustered (even) blocks
            assert np.array_equal(some[short], split[short])
            assert (some[~short] != lse[~short]).any(axis=-1).sum() <= 1


def _adaptive_capture(rng, causal, Hq=2, nqb=12, D=32):
    """Query blocks of four kinds (qb % 4), each with three key blocks of its own (key blocks 3 qb..3 qb + 2,
    visible to it when causal), 2 * (c_1, c_2, the unit bisector of c_1 and c_2) in a random order, scale 1:
    0: two clusters 4 c_1, 4 c_2 at 120 degrees (|mean| = 0.5 of the rows' length: split);
    1: the same at 70 degrees (|mean| = 0.82 of it, long: kept whole);
    2: independent random rows (|mean| about 1/sqrt(128) = 0.09 of it, near zero: kept whole);
    3: two clusters at 160 degrees (|mean| = 0.17 of it, below 0.25: kept whole, though its two groups are
       as tight as kind 0's).
    The pooled row of keys_lse ranks the bisector's block first, each group of split2 its own cluster's."""
    nkb = 3 * nqb + 3
    q = np.zeros((Hq, nqb * 128, D))
    kb = 0.5 * rng.standard_normal((nkb, D))
    for qb in range(nqb):
        u, v = np.linalg.qr(rng.standard_normal((D, 2)))[0].T
        ang = np.deg2rad((120, 70, 0, 160)[qb % 4])
        c = np.stack([u, np.cos(ang) * u + np.sin(ang) * v])
        for h in range(Hq):
            if qb % 4 == 2:
                x = 3.0 * rng.standard_normal((128, D))
            else:
                x = 4.0 * c[rng.permutation(np.arange(128) % 2)] + 0.1 * rng.standard_normal((128, D))
            q[h, qb * 128:(qb + 1) * 128] = x
        bis = (c[0] + c[1]) / np.linalg.norm(c[0] + c[1])
        kb[3 * qb:3 * qb + 3] = 2.0 * np.stack([c[0], c[1], bis])[rng.permutation(3)]
    k = np.repeat(kb[None], 64, axis=1) + 0.2 * rng.standard_normal((1, nkb * 64, D))
    v = rng.standard_normal((1, nkb * 64, D))
    return Y.Capture(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), causal, "adaptive", 1.0)


@pytest.mark.parametrize("causal", [False, True])
def test_adaptive_rule_matches_the_library(rng, causal):
    cap = _adaptive_capture(rng, causal)
    Lq, Lkv = cap.q.shape[1], cap.k.shape[1]
    kind = np.arange(Lq // 128) % 4
    # the twin's grouping: kind 0 splits; kind 1 fails the upper bound (|mean| < 0.75 l), kinds 2 and 3 the
    # lower one (|mean| >= 0.25 l)
    for h in range(cap.Hq):
        x = cap.q[h].astype(np.float64)
        for qb in range(Lq // 128):
            rows = x[qb * 128:(qb + 1) * 128]
            assert len(Y.split2_groups(rows, 0, 0.75, 0.25)) == (2 if kind[qb] == 0 else 1)
            assert len(Y.split2_groups(rows, 0, 0.75, 0.0)) == (1 if kind[qb] == 1 else 2)
            assert len(Y.split2_groups(rows, 0, np.inf, 0.25)) == (1 if kind[qb] in (2, 3) else 2)
    differs = np.zeros(4, dtype=int)
    for st in (Y.Setting(topk=0.05, sink=False, window=0), Y.Setting(topk=None, cdf=0.5, sink=False, window=0),
               Y.Setting(topk=0.3), Y.Setting(topk=None, cdf=0.9)):
        lib = {}
        for est in ("keys_lse", "keys_lse_split2", "keys_lse_adaptive"):
            st.estimator = est
            lib[est] = Y.library_mask(cap, st)
        mine = np.stack([Y.select(Y.ESTIMATORS["keys_lse_adaptive"](cap, h), st, Lq, Lkv, causal)
                         for h in range(cap.Hq)])
        # float32 rounding of the group means and scores may flip a near-tie row
        assert (lib["keys_lse_adaptive"] != mine).any(axis=-1).sum() <= 1, st.label()
        # the library's masks: split2's rows on the split blocks, keys_lse's on the others (their mean row is
        # the grouping's float32 mean, keys_lse's pooled row the float64 mean rounded: a near-tie row may flip)
        adaptive, split2, lse = lib["keys_lse_adaptive"], lib["keys_lse_split2"], lib["keys_lse"]
        assert np.array_equal(adaptive[:, kind == 0], split2[:, kind == 0]), st.label()
        assert (adaptive[:, kind != 0] != lse[:, kind != 0]).any(axis=-1).sum() <= 1, st.label()
        for t in range(4):
            differs[t] += int((split2[:, kind == t] != lse[:, kind == t]).any(axis=-1).sum())
    assert (differs > 0).all(), differs  # on every kind of block, split2's masks are not keys_lse's


@pytest.mark.skipif(not CAPTURES, reason="no committed captures")
@pytest.mark.parametrize("path", CAPTURES, ids=[os.path.basename(p) for p in CAPTURES])
def test_adaptive_twin_on_real_captures(path):
    cap = Y.load(path)
    Lq, Lkv = cap.q.shape[1], cap.k.shape[1]
    split = [len(Y.split2_groups(cap.q[h, i:i + 128].astype(np.float64), 0, 0.75, 0.25)) == 2
             for h in range(cap.Hq) for i in range(0, Lq, 128)]
    if "dinov2" in os.path.basename(path):
        assert 0 < sum(split) < len(split)  # a vision transformer: some blocks split, some not
    for st in (Y.Setting(topk=0.2), Y.Setting(topk=0.5), Y.Setting(topk=None, cdf=0.9)):
        st.estimator = "keys_lse_adaptive"
        lib = Y.library_mask(cap, st)
        mine = np.stack([Y.select(Y.ESTIMATORS["keys_lse_adaptive"](cap, h), st, Lq, Lkv, cap.causal)
                         for h in range(cap.Hq)])
        assert (lib != mine).any(axis=-1).sum() <= 1, st.label()


@pytest.mark.parametrize("causal", [False, True])
def test_auto_is_the_default_estimator_of_the_mode(rng, causal):
    """Setting(estimator="auto") is the library's default: keys_lse when causal, keys_lse_adaptive
    otherwise, through the library (which resolves it) and through the numpy twins."""
    assert Y.default_estimator(causal) == ("keys_lse" if causal else "keys_lse_adaptive")
    assert Y.resolve_estimator("auto", causal) == Y.default_estimator(causal)
    assert Y.resolve_estimator("mean", causal) == "mean"
    cap = _random_capture(rng, 2, 1, 640, 32, causal)
    auto, named = Y.Setting(topk=0.3, estimator="auto"), Y.Setting(topk=0.3, estimator=Y.default_estimator(causal))
    np.testing.assert_array_equal(Y.library_mask(cap, auto), Y.library_mask(cap, named))
    for lib in (False, True):
        a, b = Y.evaluate(cap, [auto, named], use_library=lib)
        assert a.pred.as_dict() == b.pred.as_dict() and a.oracle.as_dict() == b.oracle.as_dict()


def test_oracle_is_optimal_and_meets_counts(rng):
    cap = _random_capture(rng, 2, 1, 640, 32, True)
    for est in Y.ESTIMATORS:
        res = Y.evaluate(cap, [Y.Setting(topk=0.3, estimator=est)])[0]
        assert res.oracle.kept == res.pred.kept
        assert res.oracle.captured >= res.pred.captured - 1e-12, est
        assert res.pred.zero_rows == 0 and res.oracle.zero_rows == 0


def test_oracle_curve_monotone(rng):
    cap = grid3d.make(4, 8, 16, heads=2, D=32)
    curve = Y.oracle_curve(cap, [0.1, 0.3, 0.6, 1.0])
    l1 = [s.rel_l1 for s in curve]
    assert all(a >= b - 1e-12 for a, b in zip(l1, l1[1:]))
    assert l1[-1] < 1e-12 and curve[-1].captured == pytest.approx(1.0)


@pytest.mark.skipif(not CAPTURES, reason="no committed captures")
@pytest.mark.parametrize("path", CAPTURES, ids=[os.path.basename(p) for p in CAPTURES])
def test_real_captures_defaults(path):
    """Real activations: the library's default rule (the default estimator "auto", and the mean rule of
    SpargeAttn) never leaves a row without a kept key, and keeps its documented distance to the oracle
    (docs/ACCURACY.md) on these small slices."""
    cap = Y.load(path)
    res = Y.evaluate(cap, [Y.Setting(topk=t, estimator=e) for e in ("auto", "mean") for t in (0.2, 0.5)],
                     use_library=True)
    for r in res:
        assert r.pred.zero_rows == 0
        assert r.pred.rel_l1 <= 3.0 * r.oracle.rel_l1 + 0.02, r.row()
