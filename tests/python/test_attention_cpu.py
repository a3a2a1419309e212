"""sparge.attention / block_sparse_attention on the CPU backend vs a float64 numpy reference."""

import numpy as np
import pytest

import ref
import sparge
from helpers import TOL, make_qkv

PRECISION_DTYPES = [("exact", np.float32), ("fp16", np.float16), ("int8_fp8", np.float16),
                    ("int8_fp8_split_v", np.float16), ("int8_fp16", np.float16)]


def assert_close(out, expect, precision, what="out"):
    out = np.asarray(out, dtype=np.float64)
    assert np.all(np.isfinite(out)), what + " has non-finite values"
    t = TOL[precision]
    if precision == "exact":
        np.testing.assert_allclose(out, expect, atol=t["atol"], rtol=t["rtol"], err_msg=what)
    else:
        err = ref.rel_l1(out, expect)
        bar = t["rel_l1"]
        if out.size < 1024 and precision.startswith("int8"):
            # A few output rows carry the e4m3 rounding of P and V without averaging:
            # Lq=1, two heads of D=32 (64 values) measured rel-L1 up to 0.064 over 8000
            # seeds (median 0.036), against <= 0.036 for 8K values. int8_fp16 (the int8
            # Q.K^T error alone): up to 0.021 over 800 seeds (median 0.009).
            bar = 0.04 if precision == "int8_fp16" else 0.09
        assert err <= bar, "%s rel-L1 %.4g > %.4g" % (what, err, bar)
        if "cos" in t:
            c = ref.cosine(out, expect)
            assert c >= t["cos"], "%s cosine %.6f < %.4f" % (what, c, t["cos"])


def check_lse(lse, expect, precision):
    assert lse.dtype == np.float32 and lse.shape == expect.shape
    lse = np.asarray(lse, dtype=np.float64)
    fin = np.isfinite(expect)
    assert np.array_equal(np.isfinite(lse), fin), "LSE -inf rows differ"
    assert np.all(lse[~fin] == -np.inf)
    # int8 Q·K: a row with few keys has the quantization error of a single dot product
    atol, rtol = {"exact": (1e-4, 1e-4), "fp16": (1e-2, 1e-2), "int8_fp8": (6e-2, 2e-2),
                  "int8_fp8_split_v": (6e-2, 2e-2), "int8_fp16": (6e-2, 2e-2)}[precision]
    np.testing.assert_allclose(lse[fin], expect[fin], atol=atol, rtol=rtol)


@pytest.mark.parametrize("precision,dtype", PRECISION_DTYPES)
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("causal", [False, True])
def test_dense_equals_reference(rng, precision, dtype, layout, causal):
    q, k, v = make_qkv(rng, dtype=dtype, layout=layout)
    out, lse = sparge.attention(q, k, v, topk=1.0, is_causal=causal, layout=layout, precision=precision,
                                return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype and isinstance(out, np.ndarray)
    expect, else_ = ref.attention(q, k, v, causal=causal, layout=layout)
    assert_close(out, expect, precision)
    check_lse(lse, else_, precision)


@pytest.mark.parametrize("precision,dtype", PRECISION_DTYPES)
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("topk", [0.2, 0.5])
def test_sparse_equals_reference_on_predicted_mask(rng, precision, dtype, layout, topk):
    q, k, v = make_qkv(rng, Lq=384, Lkv=512, dtype=dtype, layout=layout)
    opts = dict(topk=topk, layout=layout, precision=precision)
    mask = sparge.predict_mask(q, k, **opts)
    out = sparge.attention(q, k, v, **opts)
    expect, _ = ref.attention(q, k, v, mask=mask, layout=layout)
    assert_close(out, expect, precision)
    # the same mask passed explicitly gives the same bits
    out2 = sparge.block_sparse_attention(q, k, v, mask, layout=layout, precision=precision)
    np.testing.assert_array_equal(out2, out)


@pytest.mark.parametrize("Lq,Lkv", [(100, 300), (300, 100), (129, 64), (1, 257), (200, 200)])
@pytest.mark.parametrize("precision,dtype", [("exact", np.float32), ("int8_fp8", np.float16),
                                             ("int8_fp8_split_v", np.float16), ("int8_fp16", np.float16)])
def test_causal_bottom_right_lq_ne_lkv(rng, Lq, Lkv, precision, dtype):
    q, k, v = make_qkv(rng, B=1, Hq=2, Hkv=1, Lq=Lq, Lkv=Lkv, D=32, dtype=dtype)
    out, lse = sparge.attention(q, k, v, topk=1.0, is_causal=True, precision=precision, return_lse=True)
    expect, else_ = ref.attention(q, k, v, causal=True)
    assert_close(out, expect, precision)
    check_lse(lse, else_, precision)
    if Lq > Lkv:  # leading rows see no key: zeros and -inf
        dead = Lq - Lkv
        assert np.all(np.asarray(out)[:, :, :dead] == 0)
        assert np.all(np.asarray(lse)[:, :, :dead] == -np.inf)


@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_mqa(rng, Hq, Hkv, causal):
    q, k, v = make_qkv(rng, B=1, Hq=Hq, Hkv=Hkv, Lq=256, Lkv=320, D=48)
    mask = sparge.predict_mask(q, k, topk=0.4, is_causal=causal, precision="exact")
    out = sparge.attention(q, k, v, topk=0.4, is_causal=causal, precision="exact")
    expect, _ = ref.attention(q, k, v, mask=mask, causal=causal)
    assert_close(out, expect, "exact")


def test_scale(rng):
    q, k, v = make_qkv(rng, B=1, Hq=2, Hkv=2, Lq=200, Lkv=200, D=64)
    for scale in (0.05, 0.3):
        mask = sparge.predict_mask(q, k, topk=0.6, scale=scale, precision="exact")
        out = sparge.attention(q, k, v, topk=0.6, scale=scale, precision="exact")
        expect, _ = ref.attention(q, k, v, mask=mask, scale=scale)
        assert_close(out, expect, "exact")


def test_block_size_option(rng):
    q, k, v = make_qkv(rng, B=1, Hq=2, Hkv=2, Lq=200, Lkv=300, D=32)
    try:
        mask = sparge.predict_mask(q, k, topk=0.5, block_size=(64, 32), precision="exact")
    except sparge.UnsupportedError as e:
        pytest.skip("block_size (64, 32) unsupported by this build: %s" % e)
    assert mask.shape == (1, 2, 4, 10)
    out = sparge.attention(q, k, v, topk=0.5, block_size=(64, 32), precision="exact")
    expect, _ = ref.attention(q, k, v, mask=mask, bq=64, bk=32)
    assert_close(out, expect, "exact")


@pytest.mark.parametrize("extra", [
    dict(mode="cdf", cdf_threshold=0.7),
    dict(mode="cdf"),
    dict(sim_threshold=0.5),
    dict(attention_sink=True, topk=0.1),
    dict(smooth_k=False),
    dict(topk=[0.1, 0.3, 0.6, 1.0]),
    dict(mode="cdf", cdf_threshold=np.array([0.5, 0.7, 0.9, 0.99])),
    dict(sim_threshold=(0.0, 0.2, 0.4, 2.0)),
])
def test_prediction_options_end_to_end(rng, extra):
    q, k, v = make_qkv(rng, B=1, Hq=4, Hkv=2, Lq=256, Lkv=448, D=32)
    opts = dict(extra, precision="exact", is_causal=True)
    mask = sparge.predict_mask(q, k, **opts)
    out, density = sparge.attention(q, k, v, return_sparsity=True, **opts)
    expect, _ = ref.attention(q, k, v, mask=mask, causal=True)
    assert_close(out, expect, "exact")
    vis = ref.visible_blocks(256, 448, 128, 64, True)
    assert density == pytest.approx(mask.sum() / (vis.sum() * 4))


def test_given_mask_dtypes(rng):
    q, k, v = make_qkv(rng, B=1, Hq=2, Hkv=2, Lq=256, Lkv=256, D=32)
    m = rng.random((1, 2, 2, 4)) < 0.5
    m[..., 0] = True
    expect, _ = ref.attention(q, k, v, mask=m)
    for mm in (m, m.astype(np.uint8), m.astype(np.int64), m.tolist()):
        out = sparge.block_sparse_attention(q, k, v, mm, precision="exact")
        assert_close(out, expect, "exact")


def test_empty_mask_rows_give_zero_and_neg_inf(rng):
    q, k, v = make_qkv(rng, B=1, Hq=1, Hkv=1, Lq=256, Lkv=128, D=16)
    m = np.zeros((1, 1, 2, 2), dtype=np.uint8)
    m[0, 0, 1, 1] = 1
    out, lse = sparge.block_sparse_attention(q, k, v, m, precision="exact", return_lse=True)
    assert np.all(out[0, 0, :128] == 0) and np.all(lse[0, 0, :128] == -np.inf)
    expect, else_ = ref.attention(q, k, v, mask=m)
    assert_close(out, expect, "exact")
    check_lse(lse, else_, "exact")


def test_return_tuple_order(rng):
    q, k, v = make_qkv(rng, B=1, Hq=2, Hkv=2, Lq=128, Lkv=128, D=16)
    out = sparge.attention(q, k, v, precision="exact")
    a = sparge.attention(q, k, v, precision="exact", return_lse=True)
    b = sparge.attention(q, k, v, precision="exact", return_sparsity=True)
    c = sparge.attention(q, k, v, precision="exact", return_sparsity=True, return_lse=True)
    assert isinstance(a, tuple) and len(a) == 2 and a[1].shape == (1, 2, 128)
    assert isinstance(b, tuple) and isinstance(b[1], float) and 0 < b[1] <= 1
    assert len(c) == 3 and isinstance(c[1], float) and c[2].shape == (1, 2, 128)
    for r in (a[0], b[0], c[0]):
        np.testing.assert_array_equal(r, out)
    assert b[1] == c[1]


def test_packed_qkv_strides(rng):
    """q, k, v as views into one packed [B, L, 3, H, D] array (NHD, non-contiguous)."""
    B, L, H, D = 1, 192, 2, 32
    qkv = rng.standard_normal((B, L, 3, H, D)).astype(np.float32)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    assert not q.flags.c_contiguous
    out = sparge.attention(q, k, v, topk=1.0, layout="NHD", precision="exact")
    expect, _ = ref.attention(q, k, v, layout="NHD")
    assert_close(out, expect, "exact")
    out2 = sparge.attention(np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v),
                            topk=1.0, layout="NHD", precision="exact")
    np.testing.assert_allclose(out, out2, atol=1e-6)


def test_bfloat16_numpy(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q, k, v = (x.astype(ml_dtypes.bfloat16) for x in make_qkv(rng, B=1, Hq=2, Hkv=2, Lq=128, Lkv=128, D=32))
    out = sparge.attention(q, k, v, topk=1.0, precision="fp16")
    assert out.dtype == q.dtype
    expect, _ = ref.attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32))
    assert ref.rel_l1(out.astype(np.float32), expect) < 2e-2


def test_plan_cache_reuse_and_eviction(rng):
    from sparge import _core

    sparge.clear_caches()
    q, k, v = make_qkv(rng, B=1, Hq=1, Hkv=1, Lq=64, Lkv=64, D=16)
    sparge.attention(q, k, v, precision="exact")
    sparge.attention(q + 1, k, v, precision="exact")
    assert len(_core.PLANS) == 1
    sparge.attention(q, k, v, precision="exact", is_causal=True)
    assert len(_core.PLANS) == 2
    old_cap = _core.PLANS.capacity
    try:
        _core.PLANS.capacity = 1
        plan = _core.PLANS._d[next(iter(_core.PLANS._d))]
        fin = plan._finalizer
        sparge.attention(q, k, v, precision="fp16")
        assert len(_core.PLANS) == 1
        del plan
        import gc

        gc.collect()
        assert not fin.alive, "evicted plan was not destroyed"
    finally:
        _core.PLANS.capacity = old_cap
        sparge.clear_caches()


def test_threads(rng):
    """Concurrent calls from several threads (per-thread CPU workspaces)."""
    import concurrent.futures as cf

    q, k, v = make_qkv(rng, B=1, Hq=2, Hkv=2, Lq=256, Lkv=256, D=32)
    want = sparge.attention(q, k, v, precision="exact")
    with cf.ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda _: sparge.attention(q, k, v, precision="exact"), range(8)))
    for o in outs:
        np.testing.assert_array_equal(o, want)


def test_clear_caches_drops_every_threads_workspace(rng):
    """clear_caches() releases the host workspaces of all threads, not only the caller's."""
    import threading
    from sparge import _arrays

    q, k, v = make_qkv(rng, B=1, Hq=2, Hkv=1, Lq=128, Lkv=128, D=32)
    sparge.clear_caches()
    want = sparge.attention(q, k, v, precision="exact")
    go, done = threading.Event(), threading.Event()
    outs = []

    def worker():
        outs.append(sparge.attention(q, k, v, precision="exact"))
        go.set()
        done.wait(30)  # alive (its buffer registered) until the main thread has cleared

    t = threading.Thread(target=worker)
    t.start()
    assert go.wait(30)
    assert len(_arrays.NUMPY._ws) == 2  # this thread's and the worker's
    sparge.clear_caches()
    assert len(_arrays.NUMPY._ws) == 0
    done.set()
    t.join()
    np.testing.assert_array_equal(outs[0], want)
    np.testing.assert_array_equal(sparge.attention(q, k, v, precision="exact"), want)  # reallocates
    assert len(_arrays.NUMPY._ws) == 1


def test_thread_buffers_of_finished_threads_are_dropped():
    import threading
    from sparge._arrays import _ThreadBuffers

    tb = _ThreadBuffers()
    ts = [threading.Thread(target=lambda: tb.get(16, len, bytearray)) for _ in range(5)]
    for t in ts:
        t.start()
        t.join()
    assert len(tb) <= 1  # each new thread dropped the entries of the finished ones
    tb.get(16, len, bytearray)
    assert len(tb) == 1


def test_stream_workspace_cache_is_bounded():
    """Per-stream workspaces are evicted least recently used beyond the capacity."""
    from sparge._arrays import _StreamBuffers

    sb = _StreamBuffers(capacity=3)
    made = []

    def make(n):
        made.append(n)
        return bytearray(n)

    for s in range(10):
        sb.get((0, s), 64, len, make)
    assert len(sb) == 3 and len(made) == 10
    a = sb.get((0, 9), 64, len, make)   # hit: no allocation, becomes most recent
    assert len(made) == 10
    sb.get((0, 7), 64, len, make)
    sb.get((1, 5), 64, len, make)        # evicts (0, 8), the least recently used
    assert sb.get((0, 9), 64, len, make) is a and len(made) == 11
    sb.get((0, 8), 64, len, make)
    assert len(made) == 12
    assert sb.get((0, 9), 128, len, make) is not a  # too small: replaced
    sb.clear()
    assert len(sb) == 0
