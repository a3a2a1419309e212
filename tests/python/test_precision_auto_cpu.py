"""precision="auto" (the default): the plan picks int8_fp8 or fp16 by head dim and effective length
3 Lq Lkv / (Lq + 2 Lkv) (CPU plans follow the compute capability 9.0 rule), and computes exactly
what its choice computes."""

import numpy as np
import pytest

import sparge
from helpers import make_qkv


@pytest.mark.parametrize("lq,lkv,d,want", [
    (1024, 1024, 128, "fp16"), (8192, 8192, 128, "fp16"), (16384, 16384, 128, "int8_fp8"),
    (16384, 16384, 96, "int8_fp8"), (16384, 16384, 64, "fp16"), (32768, 32768, 64, "fp16"), (65536, 65536, 64, "fp16"),
    (32768, 32768, 256, "fp16"), (32768, 16384, 128, "int8_fp8"), (1, 1 << 20, 128, "fp16"),
])
def test_choice(lq, lkv, d, want):
    with sparge.Plan(1, 2, lq, d, heads_kv=1, len_kv=lkv, dtype="bfloat16", device="cpu") as plan, \
            sparge.Plan(1, 2, lq, d, heads_kv=1, len_kv=lkv, dtype="bfloat16", device="cpu", precision=want) as twin:
        assert plan.precision == want
        assert want in repr(plan)
        assert plan.workspace_size == twin.workspace_size


def test_explicit_precision_is_kept():
    with sparge.Plan(1, 2, 256, 64, dtype="float16", device="cpu", precision="int8_fp8") as plan:
        assert plan.precision == "int8_fp8"


@pytest.mark.parametrize("causal", [False, True])
def test_default_equals_its_choice(rng, causal):
    q, k, v = make_qkv(rng, B=1, Hq=2, Hkv=1, Lq=300, Lkv=500, D=64, dtype=np.float16)
    out = sparge.attention(q, k, v, topk=0.6, is_causal=causal)
    ref = sparge.attention(q, k, v, topk=0.6, is_causal=causal, precision="fp16")
    assert np.all(np.isfinite(out))
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(sparge.attention(q, k, v, topk=0.6, is_causal=causal, precision="auto"), ref)


def test_bad_precision_lists_auto():
    with pytest.raises(sparge.InvalidArgumentError, match="'auto'"):
        sparge.Plan(1, 2, 256, 64, dtype="float16", device="cpu", precision="int8")
