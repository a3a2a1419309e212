"""torch CPU tensors and the sparge:: custom ops (skipped when torch is not installed)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import sparge  # noqa: E402
from helpers import make_qkv  # noqa: E402


def test_torch_cpu_equals_numpy(rng):
    q, k, v = make_qkv(rng, B=1, Hq=4, Hkv=2, Lq=200, Lkv=300, D=32, layout="NHD")
    want, lse_want = sparge.attention(q, k, v, topk=0.4, is_causal=True, layout="NHD", precision="exact",
                                      return_lse=True)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    got, lse = sparge.attention(tq, tk, tv, topk=0.4, is_causal=True, layout="NHD", precision="exact",
                                return_lse=True)
    assert isinstance(got, torch.Tensor) and got.shape == tq.shape
    np.testing.assert_array_equal(got.numpy(), want)
    np.testing.assert_array_equal(lse.numpy(), lse_want)
    m = sparge.predict_mask(tq, tk, topk=0.4, is_causal=True, layout="NHD")
    np.testing.assert_array_equal(m.numpy(), sparge.predict_mask(q, k, topk=0.4, is_causal=True, layout="NHD"))


def test_custom_op_registered_and_opcheck(rng):
    assert hasattr(torch.ops, "sparge") and hasattr(torch.ops.sparge, "attention")
    if not hasattr(torch.library, "opcheck"):
        pytest.skip("torch.library.opcheck unavailable")
    q, k, v = (torch.from_numpy(x) for x in make_qkv(rng, B=1, Hq=2, Hkv=1, Lq=128, Lkv=128, D=16))
    # ..., smooth_k, sink (-1: the mode's default), window (-1: default), estimator (0: mean),
    # precision (2: exact), block_q, block_k, want_lse, want_kept
    args = (q, k, v, None, None, None, None, [0.5, 0.25], None, None, 0, True, 0.0, 0, 0.5, 0.9, -0.1,
            True, -1, -1, 0, 2, 0, 0, True, True)
    torch.library.opcheck(torch.ops.sparge.attention.default, args)
    torch.library.opcheck(torch.ops.sparge.predict_mask.default, (q, k) + args[4:24])


def test_torch_compile_cpu_fullgraph(rng):
    q, k, v = (torch.from_numpy(x) for x in make_qkv(rng, B=1, Hq=2, Hkv=1, Lq=128, Lkv=128, D=16))

    def f(q, k, v):
        return sparge.attention(q * 1.0, k, v, topk=0.5, precision="exact") + 1

    want = f(q, k, v)
    got = torch.compile(f, fullgraph=True, backend="eager")(q, k, v)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_torch_compat_bool_mask(rng):
    q, k, v = (torch.from_numpy(x) for x in make_qkv(rng, B=1, Hq=2, Hkv=2, Lq=256, Lkv=256, D=16,
                                                     dtype=np.float16))
    m = torch.rand(1, 2, 2, 4) < 0.5
    m[..., 0] = True
    a = sparge.block_sparse_sage2_attn_cuda(q, k, v, mask_id=m)
    b = sparge.block_sparse_sage2_attn_cuda(q, k, v, mask_id=m.to(torch.uint8))
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_torch_per_head_values(rng):
    q, k, v = make_qkv(rng, B=1, Hq=4, Hkv=2, Lq=256, Lkv=384, D=16)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    heads = [0.2, 0.4, 0.6, 0.8]
    for kw in (dict(topk=heads), dict(topk=torch.tensor(heads)),
               dict(mode="cdf", cdf_threshold=heads), dict(sim_threshold=torch.tensor(heads))):
        want = sparge.attention(q, k, v, precision="exact",
                                **{n: (x.numpy() if isinstance(x, torch.Tensor) else x) for n, x in kw.items()})
        got = sparge.attention(tq, tk, tv, precision="exact", **kw)
        np.testing.assert_array_equal(got.numpy(), want)


def test_direct_eager_path_equals_custom_op(rng, monkeypatch):
    from sparge import _api

    q, k, v = (torch.from_numpy(x) for x in make_qkv(rng, B=1, Hq=2, Hkv=1, Lq=200, Lkv=260, D=16))
    a = sparge.attention(q, k, v, topk=[0.3, 0.7], is_causal=True, precision="exact", return_lse=True)
    monkeypatch.setattr(_api, "EAGER_DIRECT", False)
    b = sparge.attention(q, k, v, topk=[0.3, 0.7], is_causal=True, precision="exact", return_lse=True)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
