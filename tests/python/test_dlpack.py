"""Generic producers: objects that only offer __dlpack__ (versioned and legacy capsules)."""

import sys

import numpy as np
import pytest

import sparge
from helpers import make_qkv


class Versioned:
    """Only the DLPack protocol, backed by a numpy array (numpy >= 2.1 emits versioned capsules)."""

    def __init__(self, a):
        self.a = a
        self.calls = []

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()

    def __dlpack__(self, **kw):
        self.calls.append(kw)
        return self.a.__dlpack__(**kw)


class Legacy(Versioned):
    """A producer that predates max_version."""

    def __dlpack__(self, stream=None):
        self.calls.append({"stream": stream})
        return self.a.__dlpack__()


def _numpy_versioned_ok():
    try:
        np.zeros(1).__dlpack__(max_version=(1, 0))
        return True
    except TypeError:
        return False


@pytest.mark.parametrize("wrap", [Versioned, Legacy])
def test_dlpack_inputs_equal_numpy(rng, wrap):
    if wrap is Versioned and not _numpy_versioned_ok():
        pytest.skip("numpy too old for versioned DLPack")
    q, k, v = make_qkv(rng, B=1, Hq=2, Hkv=1, Lq=200, Lkv=300, D=32, layout="NHD")
    want = sparge.attention(q, k, v, topk=0.5, is_causal=True, layout="NHD", precision="exact")
    before = [sys.getrefcount(x) for x in (q, k, v)]
    wq, wk, wv = wrap(q), wrap(k), wrap(v)
    got = sparge.attention(wq, wk, wv, topk=0.5, is_causal=True, layout="NHD", precision="exact")
    assert isinstance(got, np.ndarray)
    np.testing.assert_array_equal(got, want)
    if wrap is Versioned:
        assert wq.calls and "max_version" in wq.calls[0]
    del wq, wk, wv
    # the capsules were consumed and their deleters called: no leaked references
    assert [sys.getrefcount(x) for x in (q, k, v)] == before


def test_dlpack_mask_and_strided(rng):
    qkv = rng.standard_normal((1, 192, 3, 2, 32)).astype(np.float32)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    m = (rng.random((1, 2, 2, 3)) < 0.6).astype(np.uint8)
    m[..., 0] = 1
    want = sparge.block_sparse_attention(q, k, v, m, layout="NHD", precision="exact")
    got = sparge.block_sparse_attention(Legacy(q), Legacy(k), Legacy(v), Legacy(m), layout="NHD",
                                        precision="exact")
    np.testing.assert_array_equal(got, want)


def test_dlpack_bad_dtype(rng):
    q, k, v = make_qkv(rng, B=1, Hq=1, Hkv=1, Lq=64, Lkv=64, D=16)
    with pytest.raises(sparge.InvalidArgumentError, match="q"):
        sparge.attention(Legacy(q.astype(np.float64)), k, v)
