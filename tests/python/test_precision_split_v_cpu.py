"""precision="int8_fp8_split_v" (int8_fp8 with V as two e4m3 terms) on the CPU backend."""

import numpy as np
import pytest

import ref
import sparge
from helpers import check_accepted_and_close, check_bad_precision_named, make, mask_and_lse_vs_int8_fp8


def test_accepted_and_close_to_reference(rng):
    check_accepted_and_close(rng, "int8_fp8_split_v", 6e-2, 0.995)


def test_split_v_only_changes_pv(rng):
    """Q.K, softmax and mask prediction are those of int8_fp8: same mask, same LSE bits."""
    ms, m8, lses, lse8 = mask_and_lse_vs_int8_fp8(rng, "int8_fp8_split_v")
    np.testing.assert_array_equal(ms, m8)
    np.testing.assert_array_equal(lses, lse8)


def test_smaller_error_than_int8_fp8_on_long_rows(rng):
    """Long rows (2048 keys, all blocks kept): the fp8 rounding of V dominates int8_fp8's error;
    carrying V as hi + lo lowers the relative L1 error (about 0.027 vs 0.038 on normal inputs)."""
    B, H, Lq, Lkv, D = 1, 2, 256, 2048, 64
    q = make(rng, B, H, Lq, D)
    k = make(rng, B, H, Lkv, D)
    v = make(rng, B, H, Lkv, D)
    expect, _ = ref.attention(q, k, v)
    err = {}
    for precision in ("int8_fp8", "int8_fp8_split_v"):
        out = sparge.attention(q, k, v, topk=1.0, precision=precision)
        assert np.all(np.isfinite(out))
        err[precision] = ref.rel_l1(out, expect)
    print("rel-L1 vs float64: int8_fp8 %.4f, int8_fp8_split_v %.4f (ratio %.3f)"
          % (err["int8_fp8"], err["int8_fp8_split_v"], err["int8_fp8_split_v"] / err["int8_fp8"]))
    assert err["int8_fp8"] < 6e-2
    assert err["int8_fp8_split_v"] <= 0.85 * err["int8_fp8"]


@pytest.mark.parametrize("bad", ["int8_fp8_splitv", "INT8_FP8_SPLIT_V", "split_v", "", 3])
def test_bad_precision_names_the_argument(rng, bad):
    check_bad_precision_named(rng, bad, "int8_fp8_split_v")
