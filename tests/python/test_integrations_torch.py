"""torch-level tests of sparge.sdpa, sparge.Plan and the framework integrations, on every device
torch and libsparge share: the CPU backend (float32, precision "exact": equal to float64 SDPA
within float32 rounding) and CUDA (bf16/fp16, when a CUDA device and a CUDA build exist).
Skipped without torch; transformers / diffusers tests skip without those packages."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import sparge  # noqa: E402
import sparge.integrations as integ  # noqa: E402
from helpers import assert_backward_raises, pv_skip_inputs  # noqa: E402

try:
    LIB_CUDA = sparge.has_cuda()
except sparge.SpargeError:
    LIB_CUDA = False
CUDA = bool(torch.cuda.is_available() and LIB_CUDA)
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device and a libsparge CUDA build")


@pytest.fixture
def gen(rng):
    torch.manual_seed(int(rng.integers(2**62)))
    return rng


def cfg(device):
    """(dtype, precision, head dim, tolerance on relative L1 vs float64) per device."""
    if device == "cpu":
        return torch.float32, "exact", 32, 1e-5
    return torch.bfloat16, "fp16", 64, 0.012


def rel_l1(a, b):
    a, b = a.double(), b.double()
    return float((a - b).abs().sum() / b.abs().sum())


def sdpa64(q, k, v, is_causal=False, scale=None, enable_gqa=False):
    """torch's own SDPA in float64 on the CPU: the reference."""
    q, k, v = (t.detach().double().cpu() for t in (q, k, v))
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        r = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(r, dim=-3), v.repeat_interleave(r, dim=-3)
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)


# ---------------------------------------------------------------- sdpa against torch SDPA
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("L,S", [(256, 256), (200, 333), (333, 200), (1, 300)])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("Hkv", [4, 2, 1])
def test_sdpa_matches_torch(gen, device, L, S, is_causal, Hkv):
    dtype, prec, D, tol = cfg(device)
    q = torch.randn(2, 4, L, D, device=device, dtype=dtype)
    k = torch.randn(2, Hkv, S, D, device=device, dtype=dtype)
    v = torch.randn(2, Hkv, S, D, device=device, dtype=dtype)
    scale = None if Hkv == 2 else 0.7 / math.sqrt(D)
    out = sparge.sdpa(q, k, v, None, 0.0, is_causal, scale, Hkv != 4, topk=1.0, precision=prec)
    assert out.shape == q.shape and out.dtype == dtype and out.device == q.device
    ref = sdpa64(q, k, v, is_causal, scale, Hkv != 4)
    assert rel_l1(out.cpu(), ref) <= tol
    # out= into a strided view (NHD storage), as the integrations use it
    store = torch.full((2, L, 4, D), float("nan"), device=device, dtype=dtype)
    got = sparge.sdpa(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=Hkv != 4, topk=1.0, precision=prec,
                      out=store.transpose(1, 2))
    assert got.data_ptr() == store.data_ptr()
    torch.testing.assert_close(store.transpose(1, 2), out, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_sdpa_default_precision_and_3d(gen, device):
    dtype, _, D, _ = cfg(device)
    q, k, v = (torch.randn(3, 300, D, device=device, dtype=dtype) for _ in range(3))
    out = sparge.sdpa(q, k, v, is_causal=True, topk=1.0)  # default precision "auto": fp16 at this length
    ref = sdpa64(q, k, v, True)
    assert out.shape == q.shape and rel_l1(out.cpu(), ref) <= 0.02
    torch.testing.assert_close(out, sparge.sdpa(q, k, v, is_causal=True, topk=1.0, precision="fp16"), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_sdpa_refusals(device):
    dtype, _, D, _ = cfg(device)
    q = torch.randn(1, 2, 64, D, device=device, dtype=dtype)
    with pytest.raises(sparge.UnsupportedError, match="attn_mask"):
        sparge.sdpa(q, q, q, torch.ones(64, 64, dtype=torch.bool, device=device))
    with pytest.raises(sparge.UnsupportedError, match="dropout_p"):
        sparge.sdpa(q, q, q, dropout_p=0.5)
    with pytest.raises(sparge.InvalidArgumentError, match="enable_gqa"):
        sparge.sdpa(q, q[:, :1], q[:, :1])


# ---------------------------------------------------------------- Plan
@pytest.mark.parametrize("device", DEVICES)
def test_plan_serving_loop(gen, device):
    dtype, prec, D, tol = cfg(device)
    plan = sparge.Plan(1, 4, 300, D, heads_kv=2, dtype=dtype, device=device, precision=prec, is_causal=True)
    ws = plan.allocate_workspace()
    assert ws.numel() >= plan.workspace_size and str(ws.device).startswith(device)
    assert isinstance(ws, torch.Tensor)  # torch is imported: a torch buffer, also on the CPU
    out = torch.empty(1, 4, 300, D, device=device, dtype=dtype)
    for _ in range(3):
        q = torch.randn(1, 4, 300, D, device=device, dtype=dtype)
        k, v = (torch.randn(1, 2, 300, D, device=device, dtype=dtype) for _ in range(2))
        assert plan.run(q, k, v, topk=1.0, out=out, workspace=ws) is out
        assert rel_l1(out.cpu(), sdpa64(q, k, v, True, enable_gqa=True)) <= tol
    mask = plan.predict(q, k, topk=0.5, workspace=ws)
    assert tuple(mask.shape) == plan.mask_shape and mask.dtype == torch.uint8
    with pytest.raises(sparge.WorkspaceTooSmallError):
        plan.run(q, k, v, workspace=ws[: max(plan.workspace_size // 2, 1)] if plan.workspace_size > 1 else ws[:0])
    plan.close()


@needs_cuda
def test_plan_cuda_graph_capture(gen):
    plan = sparge.Plan(1, 4, 512, 64, dtype=torch.bfloat16, device="cuda", precision="int8_fp8", is_causal=True)
    ws = plan.allocate_workspace()
    q, k, v = (torch.randn(1, 4, 512, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    plan.run(q, k, v, topk=0.5, out=out, workspace=ws)  # warm-up
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        plan.run(q, k, v, topk=0.5, out=out, workspace=ws)
    for _ in range(2):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        g.replay()
        torch.cuda.synchronize()
        want = sparge.attention(q, k, v, topk=0.5, is_causal=True, precision="int8_fp8")
        torch.testing.assert_close(out, want, rtol=0, atol=0)


# ---------------------------------------------------------------- transformers
def _llama(attn, device, dtype, seed):
    transformers = pytest.importorskip("transformers")
    from sparge.integrations import transformers as st

    st.register()
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      max_position_embeddings=1024)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    return model.to(device=device, dtype=dtype).eval()


@pytest.mark.parametrize("device", DEVICES)
def test_transformers_llama_matches_eager(gen, device, monkeypatch):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    prec = "exact" if device == "cpu" else "fp16"
    seed = int(gen.integers(2**31))
    eager = _llama("eager", device, dtype, seed)
    model = _llama("sparge", device, dtype, seed)
    model.load_state_dict(eager.state_dict())
    assert model.config._attn_implementation == "sparge"
    from sparge.integrations import transformers as st

    calls = []
    real = st.sdpa
    monkeypatch.setattr(st, "sdpa", lambda *a, **kw: calls.append(kw.get("topk")) or real(*a, **kw))
    integ.apply(model, topk=1.0, precision=prec, layers={1: {"topk": 1.0}})
    ids = torch.randint(0, 256, (2, 300), device=device)
    with torch.no_grad():
        want = eager(ids, use_cache=False).logits.float()
        got = model(ids, use_cache=False).logits.float()
    assert len(calls) == 2 and calls == [1.0, 1.0]
    err = rel_l1(got, want)
    assert err <= (1e-5 if device == "cpu" else 0.02), err
    # per-layer settings reach the call: layer 0 off (dense torch SDPA), layer 1 sparse
    calls.clear()
    integ.apply(model, topk=0.3, precision=prec, layers={0: {"enabled": False}})
    with torch.no_grad():
        model(ids, use_cache=False)
    assert calls == [0.3]


@pytest.mark.parametrize("device", DEVICES)
def test_transformers_padding_mask_policy(gen, device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    seed = int(gen.integers(2**31))
    model = _llama("sparge", device, dtype, seed)
    ids = torch.randint(0, 256, (2, 64), device=device)
    am = torch.ones_like(ids)
    am[0, :5] = 0  # left padding: transformers must build a dense mask
    integ.apply(model, topk=1.0)
    with pytest.raises(sparge.UnsupportedError, match="on_mask"):
        with torch.no_grad():
            model(ids, attention_mask=am, use_cache=False)
    integ.apply(model, topk=1.0, on_mask="sdpa")
    eager = _llama("sdpa", device, dtype, seed)
    with torch.no_grad():
        got = model(ids, attention_mask=am, use_cache=False).logits.float()
        want = eager(ids, attention_mask=am, use_cache=False).logits.float()
    assert rel_l1(got[:, 5:], want[:, 5:]) <= (1e-5 if device == "cpu" else 0.02)


@pytest.mark.parametrize("device", DEVICES)
def test_transformers_attention_compiles_fullgraph(gen, device):
    pytest.importorskip("transformers")
    from sparge.integrations import transformers as st

    dtype, prec, D, tol = cfg(device)
    mod = torch.nn.Module()
    mod.is_causal = True
    mod.layer_idx = 0
    mod.sparge_settings = {"topk": 1.0, "precision": prec}
    q = torch.randn(1, 4, 300, 64, device=device, dtype=dtype)
    k, v = (torch.randn(1, 2, 300, 64, device=device, dtype=dtype) for _ in range(2))
    eager_out, _ = st.sparge_attention_forward(mod, q, k, v, None, scaling=0.125)
    fn = torch.compile(lambda a, b, c: st.sparge_attention_forward(mod, a, b, c, None, scaling=0.125)[0],
                       fullgraph=True)
    comp = fn(q, k, v)
    torch.testing.assert_close(comp, eager_out, rtol=0, atol=0)
    assert tuple(comp.shape) == (1, 300, 4, 64)
    ref = sdpa64(q, k, v, True, 0.125, True).transpose(1, 2)
    assert rel_l1(comp.cpu(), ref) <= tol


@needs_cuda
def test_transformers_layer_compiles_and_model_captures(gen):
    """A Llama decoder layer (attention through the registry) under torch.compile(fullgraph=True),
    and the whole model's forward captured in a CUDA graph and replayed on new tokens."""
    seed = int(gen.integers(2**31))
    model = _llama("sparge", "cuda", torch.bfloat16, seed)
    integ.apply(model, topk=0.5)
    n = 512
    layer = model.model.layers[0]
    h = torch.randn(1, n, 256, device="cuda", dtype=torch.bfloat16)
    pid = torch.arange(n, device="cuda")[None]
    with torch.no_grad():
        pe = model.model.rotary_emb(h, pid)
        want = layer(h, attention_mask=None, position_ids=pid, position_embeddings=pe)
        comp = torch.compile(lambda x: layer(x, attention_mask=None, position_ids=pid, position_embeddings=pe),
                             fullgraph=True)
        got = comp(h)
        assert rel_l1(got.float(), want.float()) <= 0.01
        # A fresh cache per forward: with a cache transformers skips its packed-sequence check,
        # which builds a dense mask while capturing or tracing.
        import transformers

        def fwd(x):
            return model(x, past_key_values=transformers.DynamicCache(config=model.config), use_cache=True).logits

        ids = torch.randint(0, 256, (1, n), device="cuda")
        fwd(ids)  # warm-up
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = fwd(ids)
        ids.copy_(torch.randint(0, 256, (1, n), device="cuda"))
        g.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, fwd(ids), rtol=0, atol=0)
        torch.testing.assert_close(out, model(ids, use_cache=False).logits, rtol=0, atol=0)



def test_transformers_attention_with_grad_inputs(gen):
    # A model evaluated without torch.no_grad(): the values of the no-grad call, as outputs whose
    # backward raises (not outputs cut from the graph).
    pytest.importorskip("transformers")
    from sparge.integrations import transformers as st

    mod = torch.nn.Module()
    mod.is_causal = True
    mod.layer_idx = 0
    mod.sparge_settings = {"topk": 0.5, "precision": "fp16"}
    q = torch.randn(1, 4, 300, 64)
    k, v = (torch.randn(1, 2, 300, 64) for _ in range(2))
    with torch.no_grad():
        want, _ = st.sparge_attention_forward(mod, q, k, v, None, scaling=0.125)
    got, _ = st.sparge_attention_forward(mod, q.clone().requires_grad_(), k, v, None, scaling=0.125)
    assert got.shape == want.shape == (1, 300, 4, 64)
    torch.testing.assert_close(got.detach(), want, rtol=0, atol=0)
    assert_backward_raises(got)

# ---------------------------------------------------------------- diffusers
def _block(device, dtype, seed):
    pytest.importorskip("diffusers")
    from diffusers.models.attention import BasicTransformerBlock

    torch.manual_seed(seed)
    blk = BasicTransformerBlock(dim=256, num_attention_heads=4, attention_head_dim=64, cross_attention_dim=96)
    return blk.to(device=device, dtype=dtype).eval()


@pytest.mark.parametrize("device", DEVICES)
def test_diffusers_block_matches_default_processor(gen, device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    prec = "exact" if device == "cpu" else "fp16"
    blk = _block(device, dtype, int(gen.integers(2**31)))
    x = torch.randn(2, 300, 256, device=device, dtype=dtype)
    ctx = torch.randn(2, 77, 96, device=device, dtype=dtype)
    with torch.no_grad():
        want = blk(x, encoder_hidden_states=ctx).float()
        done = integ.apply(blk, topk=1.0, precision=prec, layers={"attn2": {"topk": 1.0}})
        assert set(done) == {"attn1", "attn2"}
        from sparge.integrations.diffusers import SpargeAttnProcessor

        assert isinstance(blk.attn1.processor, SpargeAttnProcessor)
        got = blk(x, encoder_hidden_states=ctx).float()
    assert rel_l1(got, want) <= (1e-5 if device == "cpu" else 0.02)


def test_diffusers_block_with_grad_inputs(gen):
    blk = _block("cpu", torch.float32, int(gen.integers(2**31)))
    integ.apply(blk, topk=0.5, precision="fp16")
    x = torch.randn(2, 300, 256)
    ctx = torch.randn(2, 77, 96)
    with torch.no_grad():
        want = blk(x, encoder_hidden_states=ctx)
    got = blk(x, encoder_hidden_states=ctx)  # the block's parameters require grad
    torch.testing.assert_close(got.detach(), want, rtol=0, atol=0)
    assert_backward_raises(got)


@needs_cuda
def test_diffusers_processor_compiles_and_captures(gen):
    from sparge.integrations.diffusers import SpargeAttnProcessor

    blk = _block("cuda", torch.bfloat16, int(gen.integers(2**31)))
    proc = SpargeAttnProcessor(topk=0.5)
    attn = blk.attn1
    x = torch.randn(2, 1024, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want = proc(attn, x)
        comp = torch.compile(lambda h: proc(attn, h), fullgraph=True)
        torch.testing.assert_close(comp(x), want, rtol=0, atol=0)
        static = x.clone()
        proc(attn, static)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = proc(attn, static)
        static.copy_(torch.randn_like(static))
        g.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, proc(attn, static), rtol=0, atol=0)


# ---------------------------------------------------------------- spas_sage_attn.autotune
@pytest.mark.parametrize("device", DEVICES)
def test_autotune_module_state_dict_round_trip(gen, device):
    from spas_sage_attn.autotune import (SparseAttentionMeansim, extract_sparse_attention_state_dict,
                                         load_sparse_attention_state_dict)

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    net = torch.nn.Module()
    net.lin = torch.nn.Linear(4, 4).to(device)
    net.attn = SparseAttentionMeansim()
    net.attn.init_hyperparams(4, device)
    with torch.no_grad():
        net.attn.cdfthreshd.copy_(torch.tensor([0.5, 0.9, 0.99, 0.3]))
        net.attn.simthreshd1.copy_(torch.tensor([0.1, -0.2, 0.4, 0.0]))
        net.attn.is_sparse.copy_(torch.tensor([True, True, False, True]))
        net.attn.pvthreshd.fill_(9.0)
    saved = extract_sparse_attention_state_dict(net)
    assert set(saved) == {"attn." + n for n in ("is_sparse", "cdfthreshd", "simthreshd1", "simthreshd2", "pvthreshd")}
    other = torch.nn.Module()
    other.lin = torch.nn.Linear(4, 4).to(device)
    other.attn = SparseAttentionMeansim()
    load_sparse_attention_state_dict(other, saved)
    q, k, v = (torch.randn(1, 4, 256, 64, device=device, dtype=dtype) for _ in range(3))
    o, sparsity = other.attn(q, k, v, is_causal=True, return_sparsity=True)
    cdf = torch.tensor([0.5, 0.9, 1.0, 0.3], device=device)
    sim = torch.tensor([0.1, -0.2, 1.0, 0.0], device=device)
    want, wsp = sparge.spas_sage2_attn_meansim_cuda(q, k, v, is_causal=True, cdfthreshd=cdf, simthreshd1=sim,
                                                    pvthreshd=9.0, attention_sink=True, return_sparsity=True)
    torch.testing.assert_close(o, want, rtol=0, atol=0)
    assert sparsity == wsp and 0.0 <= sparsity < 1.0
    with pytest.raises(sparge.UnsupportedError, match="tuning"):
        other.attn(q, k, v, tune_mode=True)
    with pytest.raises(sparge.InvalidArgumentError, match="no tuned parameters"):
        SparseAttentionMeansim()(q, k, v)


@pytest.mark.parametrize("device", DEVICES)
def test_autotune_module_runs_its_pvthreshd(gen, device):
    # the loaded per-head pvthreshd reaches the PV skip (base 2, the largest of differing heads)
    from sparge import compat
    from spas_sage_attn.autotune import SparseAttentionMeansim

    q, k, v = (torch.from_numpy(x).to(device) for x in pv_skip_inputs(gen, H=4))
    mod = SparseAttentionMeansim()
    mod.init_hyperparams(4, device)
    with torch.no_grad():
        mod.is_sparse.fill_(False)  # every block kept: only the skip changes the result
        mod.pvthreshd.copy_(torch.tensor([1.5, 1.5, 2.0, 1.5]))
    compat._pv_warned = False
    with pytest.warns(UserWarning, match="pvthreshd differs between heads"):
        o = mod(q, k, v)
    one = torch.ones(4, device=device)
    want = sparge.spas_sage2_attn_meansim_cuda(q, k, v, cdfthreshd=one, simthreshd1=one, pvthreshd=2.0,
                                               attention_sink=True)
    torch.testing.assert_close(o, want, rtol=0, atol=0)
    off = sparge.spas_sage2_attn_meansim_cuda(q, k, v, cdfthreshd=one, simthreshd1=one, attention_sink=True)
    assert float((o != off).any(dim=-1).float().mean()) > 0.75
    with torch.no_grad():
        mod.pvthreshd.fill_(float("inf"))  # never skips
    torch.testing.assert_close(mod(q, k, v), off, rtol=0, atol=0)
