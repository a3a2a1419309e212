"""CUDA tests against torch SDPA in float32. Skipped (visibly) without torch + a CUDA device."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import sparge  # noqa: E402
from helpers import assert_backward_raises, cuda_generator, torch_cuda_marks  # noqa: E402

pytestmark = torch_cuda_marks(torch)


@pytest.fixture
def gen(rng):
    return cuda_generator(torch, rng)


def rand(gen, shape, dtype):
    return torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)


def qkv(gen, B=2, Hq=8, Hkv=8, Lq=1024, Lkv=1024, D=128, dtype=torch.bfloat16, layout="HND"):
    def shp(H, L):
        return (B, H, L, D) if layout == "HND" else (B, L, H, D)

    return rand(gen, shp(Hq, Lq), dtype), rand(gen, shp(Hkv, Lkv), dtype), rand(gen, shp(Hkv, Lkv), dtype)


def sdpa_ref(q, k, v, *, causal=False, layout="HND", block_mask=None, bq=128, bk=64, scale=None):
    """float32 SDPA with the bottom-right causal rule and an optional block mask."""
    if layout == "NHD":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    q, k, v = (t.float() for t in (q, k, v))
    Hq, Hkv = q.shape[1], k.shape[1]
    if Hq != Hkv:
        k = k.repeat_interleave(Hq // Hkv, dim=1)
        v = v.repeat_interleave(Hq // Hkv, dim=1)
    Lq, Lkv = q.shape[2], k.shape[2]
    allowed = torch.ones(Lq, Lkv, dtype=torch.bool, device=q.device)
    if causal:
        i = torch.arange(Lq, device=q.device)[:, None]
        j = torch.arange(Lkv, device=q.device)[None, :]
        allowed = j <= i + (Lkv - Lq)
    allowed = allowed[None, None]
    if block_mask is not None:
        full = block_mask.bool().repeat_interleave(bq, 2).repeat_interleave(bk, 3)[:, :, :Lq, :Lkv]
        allowed = allowed & full
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    out = torch.where(allowed.any(-1, keepdim=True), out, torch.zeros_like(out))
    if layout == "NHD":
        out = out.transpose(1, 2)
    return out


def cos(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def rel_l1(a, b):
    a, b = a.double(), b.double()
    return float((a - b).abs().sum() / b.abs().sum())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 128])
def test_dense_accuracy(gen, dtype, layout, causal, D):
    q, k, v = qkv(gen, D=D, dtype=dtype, layout=layout)
    ref = sdpa_ref(q, k, v, causal=causal, layout=layout)
    out8 = sparge.attention(q, k, v, topk=1.0, is_causal=causal, layout=layout, precision="int8_fp8")
    assert out8.shape == q.shape and out8.dtype == dtype and out8.device == q.device
    c = cos(out8, ref)
    assert c >= 0.999, "int8_fp8 cosine %.5f" % c
    out16 = sparge.attention(q, k, v, topk=1.0, is_causal=causal, layout=layout, precision="fp16")
    e = rel_l1(out16, ref)
    assert e <= 0.01, "fp16 rel-L1 %.5f" % e


@pytest.mark.parametrize("Lq,Lkv", [(512, 1536), (1536, 512), (1000, 1000), (77, 4096)])
def test_causal_lq_ne_lkv_gqa(gen, Lq, Lkv):
    q, k, v = qkv(gen, B=1, Hq=8, Hkv=2, Lq=Lq, Lkv=Lkv, D=128, dtype=torch.float16)
    out, lse = sparge.attention(q, k, v, topk=1.0, is_causal=True, precision="fp16", return_lse=True)
    ref = sdpa_ref(q, k, v, causal=True)
    assert rel_l1(out, ref) <= 0.01
    assert lse.dtype == torch.float32 and lse.shape == (1, 8, Lq)


@pytest.mark.parametrize("precision,check", [("int8_fp8", "cos"), ("int8_fp16", "cos"), ("fp16", "l1")])
def test_sparse_accuracy_on_predicted_mask(gen, precision, check):
    q, k, v = qkv(gen, B=1, Hq=8, Hkv=4, Lq=2048, Lkv=2048, D=128, dtype=torch.bfloat16)
    mask = sparge.predict_mask(q, k, topk=0.3, is_causal=True)
    assert mask.dtype == torch.uint8 and mask.device == q.device and mask.shape == (1, 8, 16, 32)
    out, density = sparge.attention(q, k, v, topk=0.3, is_causal=True, precision=precision,
                                    return_sparsity=True)
    ref = sdpa_ref(q, k, v, causal=True, block_mask=mask)
    if check == "cos":
        assert cos(out, ref) >= 0.999
    else:
        assert rel_l1(out, ref) <= 0.01
    assert 0.0 < density < 1.0


def test_gpu_matches_cpu_backend_mask(gen):
    """Mask prediction on CUDA equals the CPU reference backend on the same inputs (well separated)."""
    q, k, _ = qkv(gen, B=1, Hq=4, Hkv=4, Lq=1024, Lkv=1024, D=64, dtype=torch.float16)
    mg = sparge.predict_mask(q, k, topk=0.25, is_causal=True)
    mc = sparge.predict_mask(q.cpu().float().numpy(), k.cpu().float().numpy(), topk=0.25, is_causal=True)
    agree = float((mg.cpu().numpy() == mc).mean())
    assert agree >= 0.995, agree


@pytest.mark.parametrize("name,dtype", [
    ("spas_sage2_attn_meansim_topk_cuda", torch.bfloat16),
    ("spas_sage2_attn_meansim_topk_cuda", torch.float32),
    ("spas_sage2_attn_meansim_cuda", torch.float16),
    ("spas_sage_attn_meansim_topk_cuda", torch.float16),
    ("spas_sage_attn_meansim_cuda", torch.bfloat16),
])
def test_compat_names(gen, name, dtype):
    from spas_sage_attn import __dict__ as shim

    fn = shim[name]
    q, k, v = qkv(gen, B=1, Hq=4, Hkv=4, Lq=1024, Lkv=1024, D=128, dtype=dtype)
    out = fn(q, k, v, is_causal=True)
    assert out.shape == q.shape
    assert out.dtype == (torch.float16 if dtype == torch.float32 else dtype)
    if "topk" in name:
        dense = fn(q, k, v, topk=1.0, is_causal=True)
        assert cos(dense, sdpa_ref(q, k, v, causal=True)) >= 0.999
    out, sp = fn(q, k, v, is_causal=True, return_sparsity=True)
    assert 0.0 <= sp < 1.0
    out = fn(q, k, v, is_causal=True, output_dtype=torch.float32)
    assert out.dtype == torch.float32


def test_block_sparse_compat(gen):
    from spas_sage_attn import block_sparse_sage2_attn_cuda

    q, k, v = qkv(gen, B=1, Hq=4, Hkv=4, Lq=1024, Lkv=1024, D=128, dtype=torch.float16)
    mask = torch.rand(1, 4, 8, 16, device="cuda", generator=gen) < 0.4
    mask[..., 0] = True
    out = block_sparse_sage2_attn_cuda(q, k, v, mask_id=mask.to(torch.int32))
    assert cos(out, sdpa_ref(q, k, v, block_mask=mask)) >= 0.999


def test_torch_compile_fullgraph(gen):
    q, k, v = qkv(gen, B=1, Hq=4, Hkv=2, Lq=1024, Lkv=1024, D=128, dtype=torch.bfloat16, layout="NHD")

    def f(q, k, v):
        return sparge.attention(q, k, v, topk=[0.3, 0.4, 0.5, 0.6], is_causal=True, layout="NHD") * 2

    want = f(q, k, v)
    explain = torch._dynamo.explain(f)(q, k, v)
    assert explain.graph_break_count == 0, explain.break_reasons
    got = torch.compile(f, fullgraph=True)(q, k, v)
    torch.testing.assert_close(got, want, rtol=0, atol=0)



def test_grad_inputs_give_a_backward_that_raises(gen):
    # A model evaluated without torch.no_grad() on the GPU: the no-grad call's values through the
    # custom op, whose backward raises (inference only), for the default predicted call and sdpa.
    q, k, v = qkv(gen, B=1, Hq=4, Hkv=2, Lq=1024, Lkv=1024, D=128, dtype=torch.bfloat16)
    with torch.no_grad():
        want = sparge.attention(q, k, v, is_causal=True)
        want_sdpa = sparge.sdpa(q, k, v, is_causal=True, enable_gqa=True, topk=1.0)
    qg = q.clone().requires_grad_()
    for _ in range(2):
        got = sparge.attention(qg, k, v, is_causal=True)
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=0)
        got_sdpa = sparge.sdpa(qg, k, v, is_causal=True, enable_gqa=True, topk=1.0)
        torch.testing.assert_close(got_sdpa.detach(), want_sdpa, rtol=0, atol=0)
        for out in (got, got_sdpa):
            assert_backward_raises(out)

def test_cuda_graph_capture_replay(gen):
    q, k, v = qkv(gen, B=1, Hq=4, Hkv=4, Lq=1024, Lkv=1024, D=128, dtype=torch.float16)
    sq, sk, sv = q.clone(), k.clone(), v.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm up: plans, per-head arrays
            sparge.attention(sq, sk, sv, topk=[0.5] * 4, is_causal=True)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sout = sparge.attention(sq, sk, sv, topk=[0.5] * 4, is_causal=True)
    for _ in range(3):
        nq, nk, nv = qkv(gen, B=1, Hq=4, Hkv=4, Lq=1024, Lkv=1024, D=128, dtype=torch.float16)
        sq.copy_(nq)
        sk.copy_(nk)
        sv.copy_(nv)
        graph.replay()
        want = sparge.attention(nq, nk, nv, topk=[0.5] * 4, is_causal=True)
        torch.cuda.synchronize()
        torch.testing.assert_close(sout, want, rtol=0, atol=0)


def test_no_host_sync_per_call(gen):
    q, k, v = qkv(gen, B=1, Hq=4, Hkv=4, Lq=1024, Lkv=1024, D=128, dtype=torch.bfloat16)
    sparge.attention(q, k, v, topk=[0.5] * 4, is_causal=True)  # plan, per-head array
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            sparge.attention(q, k, v, topk=[0.5] * 4, is_causal=True, return_lse=True)
            sparge.predict_mask(q, k, topk=0.5)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_side_stream(gen):
    q, k, v = qkv(gen, B=1, Hq=4, Hkv=4, Lq=2048, Lkv=2048, D=128, dtype=torch.float16)
    want = sparge.attention(q, k, v, topk=0.5)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = sparge.attention(q, k, v, topk=0.5)
    torch.cuda.current_stream().wait_stream(s)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


class _OnlyDLPack:
    def __init__(self, t):
        self.t = t

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()

    def __dlpack__(self, **kw):
        return self.t.__dlpack__(**kw)


class _OnlyCAI:
    def __init__(self, t):
        self.t = t
        self.device = t.device

    @property
    def __cuda_array_interface__(self):
        return self.t.__cuda_array_interface__


@pytest.mark.parametrize("wrap", [_OnlyDLPack, _OnlyCAI])
def test_generic_cuda_producers(gen, wrap):
    q, k, v = qkv(gen, B=1, Hq=4, Hkv=4, Lq=512, Lkv=512, D=64, dtype=torch.float16)
    want = sparge.attention(q, k, v, topk=0.5)
    got = sparge.attention(wrap(q), wrap(k), wrap(v), topk=0.5,
                           stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert isinstance(got, torch.Tensor) and got.is_cuda
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_cuda_errors(gen):
    q, k, v = qkv(gen, B=1, Hq=2, Hkv=2, Lq=256, Lkv=256, D=64, dtype=torch.float16)
    with pytest.raises(sparge.UnsupportedError):
        sparge.attention(q, k, v, precision="exact")
    with pytest.raises(sparge.InvalidArgumentError, match="mask"):
        sparge.block_sparse_attention(q, k, v, torch.ones(1, 2, 2, 4, dtype=torch.uint8))
    with pytest.raises(sparge.InvalidArgumentError, match="k"):
        sparge.attention(q, k.cpu(), v)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_second_device(gen):
    q, k, v = (t.to("cuda:1") for t in qkv(gen, B=1, Hq=2, Hkv=2, Lq=512, Lkv=512, D=64,
                                             dtype=torch.float16))
    out = sparge.attention(q, k, v, topk=1.0, precision="fp16")
    assert out.device == q.device
    assert rel_l1(out, sdpa_ref(q, k, v)) <= 0.01
