"""torch CPU tensors and the sparge:: custom ops (skipped when torch is not installed)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import sparge  # noqa: E402
from helpers import assert_backward_raises, make_qkv  # noqa: E402


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
    # precision (2: exact), block_q, block_k, pv_threshold (0: off), want_lse, want_kept
    args = (q, k, v, None, None, None, None, [0.5, 0.25], None, None, 0, True, 0.0, 0, 0.5, 0.9, -0.1,
            True, -1, -1, 0, 2, 0, 0, 0.0, True, True)
    torch.library.opcheck(torch.ops.sparge.attention.default, args)
    torch.library.opcheck(torch.ops.sparge.predict_mask.default, (q, k) + args[4:25])


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


# ------------------------------------------------------------------ inputs that require grad
# The library has no backward. Calls that autograd records must not return outputs silently cut
# from the graph (a model trained through them would get zero gradients upstream of attention
# without a word): their outputs carry a node whose backward raises. Forward values are those of
# the same call under torch.no_grad().


def test_grad_inputs_forward_values_and_a_backward_that_raises(rng):
    q, k, v = (torch.from_numpy(x) for x in make_qkv(rng, B=1, Hq=2, Hkv=1, Lq=200, Lkv=260, D=16))
    with torch.no_grad():
        want, want_lse = sparge.attention(q, k, v, topk=0.5, is_causal=True, precision="fp16", return_lse=True)
    qg = q.clone().requires_grad_()
    for _ in range(3):  # the first call and the repeated (cached) ones
        got, lse = sparge.attention(qg, k, v, topk=0.5, is_causal=True, precision="fp16", return_lse=True)
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=0)
        torch.testing.assert_close(lse.detach(), want_lse, rtol=0, atol=0)
        assert_backward_raises(got)
    with torch.no_grad():
        assert not sparge.attention(qg, k, v, precision="fp16").requires_grad
    with torch.inference_mode():
        assert not sparge.attention(qg, k, v, precision="fp16").requires_grad
    vg = v.clone().requires_grad_()  # any input
    assert_backward_raises(sparge.sdpa(q, k, vg, enable_gqa=True))


def test_grad_inputs_sdpa_more_queries_than_keys(rng):
    # Top-left causal with L > S runs two calls; with grad their rows are joined where autograd sees them.
    q, k, v = (torch.from_numpy(x) for x in make_qkv(rng, B=1, Hq=2, Hkv=2, Lq=300, Lkv=120, D=16))
    with torch.no_grad():
        want = sparge.sdpa(q, k, v, is_causal=True, precision="fp16")
    got = sparge.sdpa(q.clone().requires_grad_(), k, v, is_causal=True, precision="fp16")
    torch.testing.assert_close(got.detach(), want, rtol=0, atol=0)
    assert_backward_raises(got)
    got3 = sparge.sdpa(q[0].clone().requires_grad_(), k[0], v[0], is_causal=True, precision="fp16")
    assert got3.shape == q[0].shape
    assert_backward_raises(got3)


def test_grad_inputs_out_refused_and_plan_run(rng):
    q, k, v = (torch.from_numpy(x) for x in make_qkv(rng, B=1, Hq=2, Hkv=1, Lq=128, Lkv=128, D=16))
    qg = q.clone().requires_grad_()
    with pytest.raises(sparge.UnsupportedError, match="out="):
        sparge.attention(qg, k, v, precision="fp16", out=torch.empty_like(q))
    with sparge.Plan(1, 2, 128, 16, heads_kv=1, dtype="float32", device="cpu", precision="fp16") as plan:
        got, lse = plan.run(qg, k, v, return_lse=True)  # the library directly, then a node that raises
        want, want_lse = plan.run(q, k, v, return_lse=True)
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=0)
        torch.testing.assert_close(lse.detach(), want_lse, rtol=0, atol=0)
        assert_backward_raises(got)
        assert_backward_raises(lse)
        with pytest.raises(sparge.UnsupportedError, match="out="):
            plan.run(qg, k, v, out=torch.empty_like(q))
    with torch.no_grad():
        sparge.attention(qg, k, v, precision="fp16", out=torch.empty_like(q))


def test_grad_inputs_merge_states(rng):
    q, k, v = (torch.from_numpy(x) for x in make_qkv(rng, B=1, Hq=2, Hkv=2, Lq=128, Lkv=256, D=16))
    qg = q.clone().requires_grad_()
    parts = [sparge.attention(qg, k[:, :, s], v[:, :, s], topk=1.0, precision="fp16", return_lse=True)
             for s in (slice(0, 128), slice(128, 256))]
    out, lse = sparge.merge_states([p[0] for p in parts], [p[1] for p in parts])
    with torch.no_grad():
        want, want_lse = sparge.merge_states([p[0] for p in parts], [p[1] for p in parts])
    torch.testing.assert_close(out.detach(), want, rtol=0, atol=0)
    torch.testing.assert_close(lse.detach(), want_lse, rtol=0, atol=0)
    assert_backward_raises(out)
    assert_backward_raises(lse)
    with pytest.raises(sparge.UnsupportedError, match="out="):
        sparge.merge_states([p[0] for p in parts], [p[1] for p in parts], out=torch.empty_like(q))


def test_grad_inputs_under_torch_compile(rng):
    q, k, v = (torch.from_numpy(x) for x in make_qkv(rng, B=1, Hq=2, Hkv=1, Lq=128, Lkv=128, D=16))

    def f(q, k, v):
        return sparge.attention(q * 1.0, k, v, topk=0.5, precision="exact") + 1

    with torch.no_grad():
        want = f(q, k, v)
    got = torch.compile(f, fullgraph=True, backend="eager")(q.clone().requires_grad_(), k, v)
    torch.testing.assert_close(got.detach(), want, rtol=0, atol=0)
    assert_backward_raises(got)


def test_grad_inputs_under_the_default_compile_backends(rng):
    # AOTAutograd (aot_eager, inductor) traces the backward at the first call with inputs that require
    # grad: the trace must succeed and the backward raise only when it runs.
    q, k, v = (torch.from_numpy(x) for x in make_qkv(rng, B=1, Hq=2, Hkv=1, Lq=128, Lkv=128, D=16))

    def f(q, k, v):
        return sparge.sdpa(q, k, v, enable_gqa=True, precision="exact", topk=0.5) * 2

    with torch.no_grad():
        want = f(q, k, v)
    got = torch.compile(f, backend="aot_eager")(q.clone().requires_grad_(), k, v)
    torch.testing.assert_close(got.detach(), want, rtol=0, atol=0)
    assert_backward_raises(got)


def test_grad_outputs_allow_in_place_ops(rng):
    q, k, v = (torch.from_numpy(x) for x in make_qkv(rng, B=1, Hq=2, Hkv=1, Lq=128, Lkv=128, D=16))
    qg = q.clone().requires_grad_()
    with sparge.Plan(1, 2, 128, 16, heads_kv=1, dtype="float32", device="cpu", precision="fp16") as plan:
        o = plan.run(qg, k, v)
        o.mul_(2)  # as on the custom op's outputs and torch's
        torch.testing.assert_close(o.detach(), 2 * plan.run(q, k, v), rtol=0, atol=0)
    a = sparge.attention(qg, k, v, precision="fp16", return_lse=True)
    m, lse = sparge.merge_states([a[0]], [a[1]])
    m.add_(1)
    assert_backward_raises(m)


def test_grad_inputs_empty_problem_and_parameter_inputs(rng):
    qg = torch.randn(1, 2, 5, 16, requires_grad=True)
    z = sparge.sdpa(qg, torch.randn(1, 2, 0, 16), torch.randn(1, 2, 0, 16))
    assert not z.detach().any()
    assert_backward_raises(z)
    with pytest.raises(sparge.UnsupportedError, match="out="):
        sparge.sdpa(qg, torch.randn(1, 2, 0, 16), torch.randn(1, 2, 0, 16), out=torch.empty(1, 2, 5, 16))
    # nn.Parameter inputs take the direct path (no grad) and Plan.run
    q, k, v = (torch.nn.Parameter(torch.from_numpy(x)) for x in make_qkv(rng, B=1, Hq=2, Hkv=1, Lq=128, Lkv=128,
                                                                          D=16))
    with torch.no_grad(), sparge.Plan(1, 2, 128, 16, heads_kv=1, dtype="float32", device="cpu",
                                      precision="fp16") as plan:
        torch.testing.assert_close(plan.run(q, k, v), sparge.attention(q.data, k.data, v.data, precision="fp16"),
                                   rtol=0, atol=0)


def test_out_that_requires_grad_is_refused(rng):
    # torch's out= functions refuse an out that requires grad (grad mode on); so do these.
    q, k, v = (torch.from_numpy(x) for x in make_qkv(rng, B=1, Hq=2, Hkv=1, Lq=128, Lkv=128, D=16))
    out = torch.empty_like(q).requires_grad_()
    for _ in range(2):  # also once a call with these arguments but a plain out has been seen
        with pytest.raises(sparge.UnsupportedError, match="out="):
            sparge.attention(q, k, v, precision="fp16", out=out)
        with torch.no_grad():
            sparge.attention(q, k, v, precision="fp16", out=out)
    with pytest.raises(sparge.UnsupportedError, match="out="):
        sparge.sdpa(q, k[:, :, :0], v[:, :, :0], enable_gqa=True, out=out)
    o, lse = sparge.attention(q, k, v, precision="fp16", return_lse=True)
    with pytest.raises(sparge.UnsupportedError, match="out="):
        sparge.merge_states([o], [lse], out=out)
    with torch.no_grad():
        sparge.attention(q, k, v, precision="fp16", out=out)
        torch.testing.assert_close(out, o, rtol=0, atol=0)


def test_torch_func_transforms_get_a_clear_error(rng):
    # torch.func's wrapped tensors (vmap's batched ones, grad's tracking ones) cannot reach the
    # library: the error says what to do instead of torch's message about data pointers or
    # setup_context. Also after plain calls with the same arguments (the cached eager path).
    q, k, v = (torch.from_numpy(x) for x in make_qkv(rng, B=2, Hq=2, Hkv=2, Lq=128, Lkv=128, D=16))
    for _ in range(2):
        with pytest.raises(sparge.UnsupportedError, match="torch.func transforms"):
            torch.func.vmap(lambda qi, ki, vi: sparge.sdpa(qi, ki, vi))(q, k, v)
        with pytest.raises(sparge.UnsupportedError, match="torch.func transforms"):
            torch.func.vmap(lambda qi: sparge.attention(qi, k[0], v[0], precision="fp16"))(q)
        with pytest.raises(sparge.UnsupportedError, match="torch.func transforms"):
            torch.func.grad(lambda qq: sparge.sdpa(qq, k, v).sum())(q)
        sparge.sdpa(q, k, v)
        sparge.attention(q, k, v, precision="fp16")
