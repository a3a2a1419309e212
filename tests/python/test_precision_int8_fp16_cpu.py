"""precision="int8_fp16" (int8 Q.K^T as int8_fp8; P in the input's 16-bit type, V as given) on the CPU backend."""

import numpy as np
import pytest

import ref
import sparge
from helpers import check_accepted_and_close, check_bad_precision_named, make, make_qkv, mask_and_lse_vs_int8_fp8


def test_accepted_and_close_to_reference(rng):
    check_accepted_and_close(rng, "int8_fp16", 2e-2, 0.999)


@pytest.mark.parametrize("D", [32, 64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_head_dims_on_predicted_mask(rng, D, causal):
    """D=64 steps over three 64-key tiles at a time, other head dims over two: both against float64,
    on a sparse mask and a key count that leaves a partial last step."""
    q, k, v = make_qkv(rng, B=1, Hq=2, Hkv=1, Lq=300, Lkv=700, D=D, dtype=np.float16)
    opts = dict(topk=0.6, is_causal=causal, precision="int8_fp16")
    mask = sparge.predict_mask(q, k, **opts)
    out = sparge.attention(q, k, v, **opts)
    expect, _ = ref.attention(q, k, v, mask=mask, causal=causal)
    assert np.all(np.isfinite(out))
    assert ref.rel_l1(out, expect) <= 2e-2
    assert ref.cosine(out, expect) >= 0.999
    np.testing.assert_array_equal(sparge.block_sparse_attention(q, k, v, mask, is_causal=causal,
                                                                precision="int8_fp16"), out)


def test_qk_path_is_that_of_int8_fp8(rng):
    """Q.K^T quantization and mask prediction are those of int8_fp8: the same mask, and an LSE
    that differs only by the float32 rounding of the running sum (the key steps differ)."""
    m16, m8, lse16, lse8 = mask_and_lse_vs_int8_fp8(rng, "int8_fp16")
    np.testing.assert_array_equal(m16, m8)
    np.testing.assert_allclose(lse16, lse8, atol=1e-5, rtol=1e-5)


def test_v_used_as_given(rng):
    """Q = 0: every score is 0 and every P is exactly 1, so the output is the mean of V's rows
    in fp32, off float64 only by the fp16 rounding of the result. int8_fp8 rounds V to e4m3."""
    B, H, Lq, Lkv, D = 1, 2, 128, 384, 64
    q = np.zeros((B, H, Lq, D), np.float16)
    k = make(rng, B, H, Lkv, D, np.float16)
    v = make(rng, B, H, Lkv, D, np.float16)
    expect = np.broadcast_to(v.astype(np.float64).mean(axis=2, keepdims=True), (B, H, Lq, D))
    out16 = sparge.attention(q, k, v, topk=1.0, precision="int8_fp16")
    out8 = sparge.attention(q, k, v, topk=1.0, precision="int8_fp8")
    err16, err8 = ref.rel_l1(out16, expect), ref.rel_l1(out8, expect)
    print("rel-L1 of the mean of V: int8_fp16 %.2e, int8_fp8 %.2e" % (err16, err8))
    assert err16 <= 1e-3
    assert err16 <= 0.2 * err8


def test_smaller_error_than_int8_fp8_on_long_rows(rng):
    """Long rows (2048 keys, all blocks kept): with P in fp16 and V as given only the int8 Q.K^T
    error remains, relative L1 about 0.010 against float64 vs 0.037 for int8_fp8 on normal inputs."""
    B, H, Lq, Lkv, D = 1, 2, 256, 2048, 64
    q = make(rng, B, H, Lq, D, np.float16)
    k = make(rng, B, H, Lkv, D, np.float16)
    v = make(rng, B, H, Lkv, D, np.float16)
    expect, _ = ref.attention(q, k, v)
    err = {}
    for precision in ("int8_fp8", "int8_fp8_split_v", "int8_fp16"):
        out = sparge.attention(q, k, v, topk=1.0, precision=precision)
        assert np.all(np.isfinite(out))
        err[precision] = ref.rel_l1(out, expect)
    print("rel-L1 vs float64: int8_fp8 %.4f, int8_fp8_split_v %.4f, int8_fp16 %.4f"
          % (err["int8_fp8"], err["int8_fp8_split_v"], err["int8_fp16"]))
    assert err["int8_fp16"] <= 2e-2
    assert err["int8_fp16"] <= 0.5 * err["int8_fp8"]
    assert err["int8_fp16"] < err["int8_fp8_split_v"]


def test_float32_inputs(rng):
    """float32 inputs are accepted (the CPU backend's own type); the error stays about the int8 Q.K^T one."""
    q, k, v = make_qkv(rng, B=1, Hq=2, Hkv=2, Lq=256, Lkv=1024, D=64, dtype=np.float32)
    out = sparge.attention(q, k, v, topk=1.0, precision="int8_fp16")
    assert out.dtype == np.float32
    expect, _ = ref.attention(q, k, v)
    assert ref.rel_l1(out, expect) <= 2e-2


@pytest.mark.parametrize("bad", ["int8fp16", "INT8_FP16", "int8_f16", "int8_fp16 ", 4])
def test_bad_precision_names_the_argument(rng, bad):
    check_bad_precision_named(rng, bad, "int8_fp16")


def test_plan_reports_the_int8_twin_step():
    # The CPU twin steps as the GPU kernels (core/kernel_traits.hpp): three
    # listed 64-key blocks at D = 64, two at 96 and 128, one at 256.
    from sparge import _core, _capi as C

    for d, keys in ((64, 192), (96, 128), (128, 128), (256, 64)):
        plan = _core.Plan((1, 2, 1, 300, 300, d, C.DTYPE_BFLOAT16, C.DEVICE_CPU, 0, C.PRECISION_INT8_FP16,
                           False, 0.0, 0, 0))
        info = plan.kernel_info()
        assert info["family"] == "cpu"
        assert info["head_dim"] == d
        assert info["keys_per_step"] == keys
        plan.destroy()
