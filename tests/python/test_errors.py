"""Bad input -> the right SpargeError subclass, with a message that names the argument."""

import numpy as np
import pytest

import sparge
from helpers import make_qkv


@pytest.fixture
def qkv(rng):
    return make_qkv(rng, B=1, Hq=4, Hkv=2, Lq=128, Lkv=192, D=32)


def expect(exc, words, fn, *a, **kw):
    with pytest.raises(exc) as ei:
        fn(*a, **kw)
    msg = str(ei.value)
    for w in words:
        assert w in msg, "%r not in %r" % (w, msg)
    assert isinstance(ei.value, sparge.SpargeError)
    return ei.value


@pytest.mark.parametrize("kw,words", [
    (dict(layout="BHLD"), ["layout"]),
    (dict(mode="topp"), ["mode"]),
    (dict(precision="int4"), ["precision"]),
    (dict(topk=0.0), ["topk"]),
    (dict(topk=1.5), ["topk"]),
    (dict(topk=float("nan")), ["topk"]),
    (dict(topk=[0.5, 0.5, 2.0, 0.5]), ["topk"]),
    (dict(mode="cdf", cdf_threshold=0.0), ["cdf_threshold"]),
    (dict(mode="cdf", cdf_threshold=1.01), ["cdf_threshold"]),
    (dict(sim_threshold=float("inf")), ["sim_threshold"]),
    (dict(block_size="big"), ["block_size"]),
    (dict(block_size=(128,)), ["block_size"]),
    (dict(block_size=(2 ** 32 + 16, 64)), ["block_size", "block_q", str(2 ** 32 + 16)]),
    (dict(block_size=(64, -(2 ** 32) + 16)), ["block_size", "block_k"]),
    (dict(block_size=(1.9, 64)), ["block_size", "block_q", "1.9"]),
    (dict(block_size=(True, 64)), ["block_size", "block_q", "True"]),
    (dict(block_size=(64, np.float32(32))), ["block_size", "block_k"]),
    (dict(block_size=(64, "32")), ["block_size", "block_k"]),
    (dict(scale=-1.0), ["scale"]),
    (dict(scale=float("nan")), ["scale"]),
])
def test_bad_options(qkv, kw, words):
    q, k, v = qkv
    err = expect(sparge.InvalidArgumentError, words, sparge.attention, q, k, v, **kw)
    assert isinstance(err, ValueError)


def test_per_head_length(qkv):
    q, k, v = qkv
    expect(sparge.InvalidArgumentError, ["topk", "4 heads"], sparge.attention, q, k, v, topk=[0.5, 0.5])
    expect(sparge.InvalidArgumentError, ["sim_threshold"], sparge.predict_mask, q, k, sim_threshold=[0.1] * 3)


def test_bad_shapes(rng, qkv):
    q, k, v = qkv
    expect(sparge.InvalidArgumentError, ["q", "4-D"], sparge.attention, q[0], k, v)
    expect(sparge.InvalidArgumentError, ["k", "4-D"], sparge.attention, q, k[0], v)
    expect(sparge.InvalidArgumentError, ["v"], sparge.attention, q, k, v[:, :, :100])
    expect(sparge.InvalidArgumentError, ["k", "head_dim"], sparge.attention, q, k[..., :16], v)
    expect(sparge.InvalidArgumentError, ["k", "batch"], sparge.attention, q, np.concatenate([k, k]), v)
    q3 = make_qkv(rng, B=1, Hq=3, Hkv=2, Lq=128, Lkv=192, D=32)[0]
    expect(sparge.InvalidArgumentError, ["heads"], sparge.attention, q3, k, v)


def test_bad_dtypes(qkv):
    q, k, v = qkv
    expect(sparge.InvalidArgumentError, ["q", "int64"], sparge.attention, q.astype(np.int64), k, v)
    expect(sparge.InvalidArgumentError, ["k", "dtype"], sparge.attention, q, k.astype(np.float16), v)
    expect(sparge.InvalidArgumentError, ["v", "dtype"], sparge.attention, q, k, v.astype(np.float16))
    expect(sparge.InvalidArgumentError, ["q", "float64"], sparge.attention, q.astype(np.float64), k, v)


def test_non_unit_head_stride(qkv):
    q, k, v = qkv
    qs = np.asfortranarray(q)
    expect(sparge.InvalidArgumentError, ["q", "stride"], sparge.attention, qs, k, v)


def test_bad_mask(qkv):
    q, k, v = qkv
    expect(sparge.InvalidArgumentError, ["mask"], sparge.block_sparse_attention, q, k, v,
           np.ones((1, 4, 1, 2), np.uint8))
    expect(sparge.InvalidArgumentError, ["mask"], sparge.block_sparse_attention, q, k, v, None)


def test_not_an_array():
    expect(sparge.InvalidArgumentError, ["q"], sparge.attention, object(), object(), object())


def test_library_validation_maps_to_exception(rng):
    """An error found by the library itself: the status maps to the class, text from sparge_last_error."""
    q, k, v = make_qkv(rng, B=1, Hq=1, Hkv=1, Lq=16, Lkv=16, D=512)
    with pytest.raises(sparge.SpargeError) as ei:
        sparge.attention(q, k, v, precision="exact")
    e = ei.value
    assert type(e) in (sparge.InvalidArgumentError, sparge.UnsupportedError)
    assert e.status in (1, 2)
    assert "sparge_create_plan" in str(e) and len(str(e)) > len("sparge_create_plan: ")


def test_compat_unsupported(qkv):
    q, k, v = qkv
    expect(sparge.UnsupportedError, ["attn_mask"], sparge.spas_sage2_attn_meansim_topk_cuda, q, k, v,
           np.ones((128, 192), bool))
    expect(sparge.UnsupportedError, ["dropout_p"], sparge.spas_sage2_attn_meansim_topk_cuda, q, k, v,
           None, 0.1)
    expect(sparge.InvalidArgumentError, ["layout"], sparge.spas_sage2_attn_meansim_topk_cuda, q, k, v,
           tensor_layout="LHD")
    expect(sparge.InvalidArgumentError, ["tensor_layout"], sparge.block_sparse_sage2_attn_cuda, q, k, v,
           tensor_layout="LHD")


def test_block_size_exact_ints_accepted(qkv):
    """numpy integers are ints; the values reach the plan unchanged."""
    q, k, v = qkv
    a = sparge.predict_mask(q, k, topk=0.5, block_size=(np.int64(64), 32), precision="exact")
    b = sparge.predict_mask(q, k, topk=0.5, block_size=(64, np.int32(32)), precision="exact")
    assert a.shape == b.shape == (1, 4, 2, 6)
    np.testing.assert_array_equal(a, b)
