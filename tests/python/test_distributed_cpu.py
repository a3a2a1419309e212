"""sparge.merge_states and sparge.distributed on the CPU backend.

The sharding and ring-schedule logic and merge_states need only numpy. The sequence-parallel
runs (ulysses_attention, ring_attention over 2 and 4 gloo processes against one process) need
torch with torch.distributed and are skipped without it.
"""

import importlib.util

import numpy as np
import pytest

import sparge
from sparge import distributed as sd

HAVE_TORCH = importlib.util.find_spec("torch") is not None


# ------------------------------------------------------------------ merge_states
def _ref_merge(outs, lses):
    L = np.stack([x.astype(np.float64) for x in lses])
    O = np.stack([o.astype(np.float64) for o in outs])
    m = np.max(L, axis=0)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    w = np.where(np.isneginf(L), 0.0, np.exp(L - m_safe))
    tot = w.sum(axis=0)
    O = np.where(np.isneginf(L)[..., None], 0.0, O)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(tot[..., None] > 0, (w[..., None] * O).sum(axis=0) / tot[..., None], 0.0)
        lse = np.where(tot > 0, m_safe + np.log(tot), -np.inf)
    return out, lse


def test_merge_states_matches_float64(rng):
    for _ in range(10):
        B, H, L, D = rng.integers(1, 3), rng.integers(1, 4), rng.integers(1, 40), rng.integers(1, 65)
        n = int(rng.integers(1, 8))
        outs = [rng.standard_normal((B, H, L, D)).astype(rng.choice([np.float32, np.float16])) for _ in range(n)]
        lses = [(rng.uniform(-6, 6, (B, H, L)) + i).astype(np.float32) for i in range(n)]
        for o, l in zip(outs, lses):
            empty = rng.random((B, H, L)) < 0.25
            l[empty] = -np.inf
            o[empty] = np.nan  # never read
        out, lse = sparge.merge_states(outs, lses, dtype="float32")
        ref, ref_lse = _ref_merge(outs, lses)
        np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)
        assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
        fin = np.isfinite(ref_lse)
        np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=1e-6, atol=1e-6)
        assert np.all(out[np.isneginf(ref_lse)] == 0)


def test_merge_states_in_place_and_nhd(rng):
    B, H, L, D = 2, 3, 17, 24
    outs = [rng.standard_normal((B, L, H, D)).astype(np.float32) for _ in range(3)]
    lses = [rng.standard_normal((B, H, L)).astype(np.float32) * 3 for _ in range(3)]
    ref, ref_lse = _ref_merge([o.transpose(0, 2, 1, 3) for o in outs], lses)
    acc, acc_lse = outs[0], lses[0]
    out, lse = sparge.merge_states(outs, lses, out=acc, lse_out=acc_lse, layout="NHD")
    assert out is acc and lse is acc_lse
    np.testing.assert_allclose(acc.transpose(0, 2, 1, 3), ref, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(acc_lse, ref_lse, rtol=2e-6, atol=2e-6)


def test_merge_states_rejects_bad_arguments(rng):
    o = [rng.standard_normal((1, 2, 5, 8)).astype(np.float32) for _ in range(2)]
    l = [rng.standard_normal((1, 2, 5)).astype(np.float32) for _ in range(2)]
    with pytest.raises(sparge.InvalidArgumentError, match="lses has 1"):
        sparge.merge_states(o, l[:1])
    with pytest.raises(sparge.InvalidArgumentError, match="1..32"):
        sparge.merge_states(o * 17, l * 17)
    with pytest.raises(sparge.InvalidArgumentError, match=r"outs\[1\]->shape\[3\] is 7"):
        sparge.merge_states([o[0], o[1][..., :7]], l)
    with pytest.raises(sparge.InvalidArgumentError, match=r"lses\[0\]->dtype is FLOAT16"):
        sparge.merge_states(o, [l[0].astype(np.float16), l[1]])
    with pytest.raises(sparge.InvalidArgumentError, match=r"lse_out->shape\[2\] is 4"):
        sparge.merge_states(o, l, lse_out=np.empty((1, 2, 4), np.float32))


# ------------------------------------------------------------------ sharding and the ring schedule
@pytest.mark.parametrize("world,zigzag", [(1, False), (2, False), (2, True), (3, True), (4, True), (8, True)])
def test_shard_unshard_roundtrip(world, zigzag, rng):
    n = 2 * world * 3
    x = rng.standard_normal((2, 3, n, 4))
    shards = [sd.shard_sequence(x, r, world, dim=2, zigzag=zigzag) for r in range(world)]
    assert all(s.shape[2] == n // world for s in shards)
    if zigzag:  # rank r holds chunks r and 2W-1-r
        c = n // (2 * world)
        for r, s in enumerate(shards):
            np.testing.assert_array_equal(s[:, :, :c], x[:, :, r * c:(r + 1) * c])
            g = 2 * world - 1 - r
            np.testing.assert_array_equal(s[:, :, c:], x[:, :, g * c:(g + 1) * c])
    np.testing.assert_array_equal(sd.unshard_sequence(shards, dim=2, zigzag=zigzag), x)
    if world > 1 or zigzag:
        with pytest.raises(sparge.InvalidArgumentError, match="not a multiple"):
            sd.shard_sequence(x[:, :, :n - 1], 0, world, dim=2, zigzag=zigzag)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("zigzag", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_schedule_covers_each_visible_chunk_pair_once(world, zigzag, causal):
    nch = 2 * world if zigzag else world
    work = []
    for rank in range(world):
        seen = []
        mine = sd.shard_chunks(rank, world, zigzag)
        for t, calls in enumerate(sd.ring_schedule(rank, world, zigzag, causal)):
            theirs = sd.shard_chunks((rank - t) % world, world, zigzag)
            for i, j, kind in calls:
                gq, gk = mine[i], theirs[j]
                assert kind == ("diag" if causal and gq == gk else "full")
                seen.append((gq, gk))
        want = [(gq, gk) for gq in mine for gk in range(nch) if not causal or gk <= gq]
        assert sorted(seen) == sorted(want)
        # diagonal calls cost about half a full one
        work.append(sum(0.5 if causal and gq == gk else 1.0 for gq, gk in seen))
    if causal and zigzag:  # load balance: every rank does the same work
        assert max(work) == min(work)


def test_chunk_order():
    assert sd.chunk_order(2, True) == [0, 3, 1, 2]
    assert sd.chunk_order(3, False) == [0, 1, 2]
    assert sorted(sd.chunk_order(4, True)) == list(range(8))


def test_single_rank_fallback_without_process_group(rng):
    if not HAVE_TORCH:
        pytest.skip("torch is not installed")
    import torch

    g = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    q, k, v = (torch.randn(1, 2, 256, 32, generator=g) for _ in range(3))
    for fn in (sd.ulysses_attention, sd.ring_attention):
        out, lse, mask = fn(q, k, v, is_causal=True, precision="fp16", return_lse=True, return_mask=True)
        m2 = sparge.predict_mask(q, k, is_causal=True, precision="fp16")
        o2, l2 = sparge.attention(q, k, v, is_causal=True, mask=m2, precision="fp16", return_lse=True)
        assert torch.equal(mask, m2) and torch.equal(out, o2) and torch.equal(lse, l2)
        assert torch.equal(fn(q, k, v, is_causal=True, precision="fp16"),
                           sparge.attention(q, k, v, is_causal=True, precision="fp16"))
        qn, kn, vn = (t.transpose(1, 2) for t in (q, k, v))
        assert torch.equal(fn(qn, kn, vn, layout="nhd", precision="fp16").transpose(1, 2),
                           sparge.attention(q, k, v, precision="fp16"))
        with pytest.raises(sparge.InvalidArgumentError, match="layout must be"):
            fn(q, k, v, layout="BHLD")
        with pytest.raises(sparge.InvalidArgumentError, match="v must be a torch tensor"):
            fn(q, k, v.numpy())


# ------------------------------------------------------------------ gloo: 2 and 4 processes
@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed (sequence-parallel runs need torch.distributed)")
@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_matches_one_process(world, rng):
    import dist_cases

    seed = int(rng.integers(1 << 30))
    cases = dist_cases.cases(world, seed)
    results = dist_cases.run_ranks(world, cases)
    report, failures = [], []
    for r, msgs in enumerate(results["errors"]):
        for m in msgs:
            if m != "ok":
                failures.append("rank %d, bad call: %s" % (r, m))
    for c in cases:
        ok, line = dist_cases.judge(c, results[c["name"]], world)
        report.append(line)
        if not ok:
            failures.append(line)
    print("\n".join(report))
    assert not failures, "\n".join(failures)


@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
@pytest.mark.parametrize("window", [None, 0, 1, 3])
def test_ring_mask_rows_non_causal(window, rng, monkeypatch):
    """Every rank's rows of the global mask (sparge.distributed._global_mask_rows, the all-gather replaced
    by the whole tensor) equal one process's mask, with and without the local window (the default has
    one, which sits at the rows' global positions)."""
    import torch

    world, N = 4, 4 * 256
    g = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    q = torch.randn(1, 4, N, 32, generator=g)
    k = torch.randn(1, 2, N, 32, generator=g)
    monkeypatch.setattr(sd, "_all_gather_seq", lambda x, world_, group: q if x.shape[1] == q.shape[1] else k)
    kw = sd._sparse_kw(0.3, "topk", None, -0.1, True, None, window, "keys_lse", "exact", (128, 64), None)
    mask = sparge.predict_mask(q, k, is_causal=False, **kw)
    qb_per = N // world // 128
    for r in range(world):
        rows = sd._global_mask_rows(sd.shard_sequence(q, r, world, dim=2), sd.shard_sequence(k, r, world, dim=2),
                                    world, None, False, False, sd.shard_chunks(r, world, False), qb_per, kw)
        assert torch.equal(rows, mask[:, :, r * qb_per:(r + 1) * qb_per])


@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
@pytest.mark.parametrize("world,causal,zigzag", [(8, True, True), (3, True, False), (5, False, False)])
def test_ring_steps_of_every_rank_in_one_process(world, causal, zigzag, rng):
    """The ring's per-rank steps, run for every rank in one process (no communication), give one
    process's attention: up to 8 ranks without 8 processes."""
    import torch

    import dist_cases

    g = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    N = 2 * world * 64 if zigzag else world * 128
    q = torch.randn(1, 4, N, 32, generator=g)
    k = torch.randn(1, 2, N, 32, generator=g)
    v = torch.randn(1, 2, N, 32, generator=g)
    kw = dict(precision="exact", topk=0.4, block_size=(64, 64))
    out, lse, rows, mask = dist_cases.simulate_ring(q, k, v, world, causal, zigzag, **kw)
    ref, ref_lse = sparge.attention(q, k, v, is_causal=causal, mask=mask, return_lse=True, precision="exact",
                                    block_size=(64, 64))
    assert torch.equal(rows, mask)
    if not causal:  # without a local window, ring_attention predicts non-causal rows from the local queries
        kw0 = dict(kw, local_window=0)
        mask0 = sparge.predict_mask(q, k, **kw0)
        for r in range(world):
            local = sparge.predict_mask(sd.shard_sequence(q, r, world, dim=2), k, **kw0)
            assert torch.equal(local, mask0[:, :, r * (N // world // 64):(r + 1) * (N // world // 64)])
    assert (out - ref).abs().max().item() <= 2e-6 * ref.abs().max().item()
    assert (lse - ref_lse).abs().max().item() <= 2e-6


@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
def test_ring_steps_with_grad_inputs(rng):
    """Queries that require grad (grad mode on): the ring merges into new tensors instead of in place,
    with the values of the no-grad run, and the result's backward raises (inference only)."""
    import torch

    import dist_cases
    from helpers import assert_backward_raises

    g = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    world, N = 3, 3 * 2 * 64
    q = torch.randn(1, 4, N, 32, generator=g)
    k = torch.randn(1, 2, N, 32, generator=g)
    v = torch.randn(1, 2, N, 32, generator=g)
    kw = dict(precision="exact", topk=0.4, block_size=(64, 64))
    with torch.no_grad():
        want, want_lse, _, _ = dist_cases.simulate_ring(q, k, v, world, True, True, **kw)
    out, lse, _, _ = dist_cases.simulate_ring(q.clone().requires_grad_(), k, v, world, True, True, **kw)
    assert torch.equal(out.detach(), want) and torch.equal(lse.detach(), want_lse)
    assert_backward_raises(out)
    # K and V that require grad on one rank: its own shard's step records, the shards it receives
    # (plain tensors off the wire) do not; the merges of the two kinds must not write in place.
    kg, vg = k.clone().requires_grad_(), v.clone().requires_grad_()
    out, lse, _, _ = dist_cases.simulate_ring(q, k, v, world, True, True, grad_rank=1, grad_kv=(kg, vg), **kw)
    assert torch.equal(out.detach(), want) and torch.equal(lse.detach(), want_lse)
    assert out.requires_grad
