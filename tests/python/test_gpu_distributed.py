"""merge_states and sparge.distributed on CUDA. Skipped (visibly) without torch + a CUDA device;
the multi-GPU runs also with fewer than two GPUs."""

import os

import pytest

torch = pytest.importorskip("torch")

import sparge  # noqa: E402
from helpers import cuda_generator, torch_cuda_marks  # noqa: E402
from sparge import distributed as sd  # noqa: E402

HAVE_CUDA = bool(torch.cuda.is_available())
pytestmark = torch_cuda_marks(torch)


@pytest.fixture
def gen(rng):
    return cuda_generator(torch, rng)


def test_merge_states_cuda_matches_float64_and_cpu(gen):
    B, H, L, D = 2, 8, 1000, 128
    dts = [torch.bfloat16, torch.float16, torch.float32, torch.bfloat16, torch.float32]
    outs = [torch.randn(B, H, L, D, generator=gen, device="cuda").to(dt) for dt in dts]
    outs[1] = outs[1].transpose(1, 2).contiguous().transpose(1, 2)  # NHD memory, HND view
    lses = [torch.rand(B, H, L, generator=gen, device="cuda") * 20 - 10 for _ in dts]
    for i, l in enumerate(lses):
        empty = torch.rand(B, H, L, generator=gen, device="cuda") < 0.2
        empty[:, :, 7::11] = True  # rows that no state covers
        l[empty] = -float("inf")
        outs[i][empty] = float("nan")  # never read
    out, lse = sparge.merge_states(outs, lses, dtype="float32")
    torch.cuda.synchronize()
    L64 = torch.stack([x.double().cpu() for x in lses])
    O64 = torch.stack([o.double().cpu() for o in outs])
    m = L64.max(0).values
    ms = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.where(torch.isinf(L64), torch.zeros_like(L64), torch.exp(L64 - ms))
    O64 = torch.where(torch.isinf(L64)[..., None], torch.zeros_like(O64), O64)
    tot = w.sum(0)
    ref = torch.where(tot[..., None] > 0, (w[..., None] * O64).sum(0) / tot.clamp_min(1e-300)[..., None],
                      torch.zeros_like(O64[0]))
    ref_lse = torch.where(tot > 0, ms + torch.log(tot.clamp_min(1e-300)), torch.full_like(tot, -float("inf")))
    assert (out.double().cpu() - ref).abs().max().item() < 2e-5
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), fin)
    assert (lse.double().cpu()[fin] - ref_lse[fin]).abs().max().item() < 2e-5
    assert torch.all(out.cpu()[~fin] == 0)
    # The CPU backend on the same states; in place on the GPU.
    cpu_out, cpu_lse = sparge.merge_states([o.cpu() for o in outs], [x.cpu() for x in lses], dtype="float32")
    assert (cpu_out - out.cpu()).abs().max().item() < 2e-5
    acc, acc_lse = outs[2].clone(), lses[2].clone()
    sparge.merge_states([outs[0], outs[1], acc, outs[3], outs[4]], [lses[0], lses[1], acc_lse, lses[3], lses[4]],
                        out=acc, lse_out=acc_lse)
    torch.cuda.synchronize()
    assert torch.equal(acc, out) and torch.equal(acc_lse, lse)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("fn", [sd.ulysses_attention, sd.ring_attention])
def test_single_rank_paths_on_cuda(fn, causal, gen):
    q = torch.randn(1, 8, 4096, 128, generator=gen, device="cuda").to(torch.bfloat16)
    k = torch.randn(1, 2, 4096, 128, generator=gen, device="cuda").to(torch.bfloat16)
    v = torch.randn(1, 2, 4096, 128, generator=gen, device="cuda").to(torch.bfloat16)
    out, lse, mask = fn(q, k, v, is_causal=causal, topk=0.3, return_lse=True, return_mask=True)
    m1 = sparge.predict_mask(q, k, is_causal=causal, topk=0.3)
    o1, l1 = sparge.attention(q, k, v, is_causal=causal, mask=m1, return_lse=True)
    assert torch.equal(mask, m1) and torch.equal(out, o1) and torch.equal(lse, l1)
    assert torch.equal(fn(q, k, v, is_causal=causal, topk=0.3), sparge.attention(q, k, v, is_causal=causal, topk=0.3))


@pytest.mark.skipif(HAVE_CUDA and torch.cuda.device_count() < 2, reason="needs two or more GPUs")
@pytest.mark.parametrize("world", [2])
def test_sequence_parallel_nccl_matches_one_gpu(world, rng):
    import dist_cases

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    cases = dist_cases.cases(world, int(rng.integers(1 << 30)), precisions=("int8_fp8", "fp16"), dtype="bfloat16",
                             dims=(128, 64), gpu=True)
    results = dist_cases.run_ranks(world, cases, device="cuda")
    report, failures = [], []
    for r, msgs in enumerate(results["errors"]):
        failures.extend("rank %d, bad call: %s" % (r, m) for m in msgs if m != "ok")
    for c in cases:
        ok, line = dist_cases.judge(c, results[c["name"]], world, device="cuda")
        report.append(line)
        if not ok:
            failures.append(line)
    print("\n".join(report))
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("precision", ["int8_fp8", "fp16"])
def test_ring_steps_on_one_gpu(causal, precision, gen):
    """The ring's per-rank steps for 4 ranks (zig-zag when causal) on one GPU, fed the shards each
    rank would receive, against one GPU's attention on the same mask: fp16 within the 16-bit
    rounding of P, int8_fp8 with the same error against float32 SDPA-style math."""
    import dist_cases

    world, N = 4, 4096
    q = torch.randn(1, 8, N, 128, generator=gen, device="cuda").to(torch.bfloat16)
    k = torch.randn(1, 2, N, 128, generator=gen, device="cuda").to(torch.bfloat16)
    v = torch.randn(1, 2, N, 128, generator=gen, device="cuda").to(torch.bfloat16)
    kw = dict(precision=precision, topk=0.4)
    out, lse, rows, mask = dist_cases.simulate_ring(q, k, v, world, causal, causal, **kw)
    ref, ref_lse = sparge.attention(q, k, v, is_causal=causal, mask=mask, return_lse=True, precision=precision)
    assert torch.equal(rows, mask)
    if not causal:
        # Without a local window (whose blocks sit at global query positions) a non-causal row depends
        # on its query block and all of K only: ring_attention then predicts from the local queries.
        mask0 = sparge.predict_mask(q, k, topk=0.4, precision=precision, local_window=0)
        for r in range(world):
            ql = sd.shard_sequence(q, r, world, dim=2, zigzag=False)
            local = sparge.predict_mask(ql, k, topk=0.4, precision=precision, local_window=0)
            assert torch.equal(local, mask0[:, :, r * (N // world // 128):(r + 1) * (N // world // 128)])
    # float64 attention on the mask (every used key of a kept block, the causal rule)
    qd, kd, vd = (t.double() for t in (q, k, v))
    kd, vd = kd.repeat_interleave(4, dim=1), vd.repeat_interleave(4, dim=1)
    s = (qd @ kd.transpose(-1, -2)) / 128 ** 0.5
    used = mask.bool().repeat_interleave(128, dim=2).repeat_interleave(64, dim=3)[:, :, :N, :N]
    if causal:
        used &= torch.ones(N, N, dtype=torch.bool, device="cuda").tril()
    s = s.masked_fill(~used, -float("inf"))
    exact = torch.softmax(s, dim=-1).nan_to_num(0.0) @ vd
    den = exact.abs().sum().item()
    e_ring = (out.double() - exact).abs().sum().item() / den
    e_one = (ref.double() - exact).abs().sum().item() / den
    assert e_ring <= 1.25 * e_one + 2e-3, (e_ring, e_one)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert (lse[fin] - ref_lse[fin]).abs().max().item() < (0.1 if precision == "int8_fp8" else 1e-2)
