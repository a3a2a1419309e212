"""The benchmark grid script (tools/bench/grid.py) without a GPU: the grid and its skip rules, the
input-set and batch rules, the float32 row reference, and one shape run end to end on the CPU with
torch's CPU SDPA and a stand-in for sparge (a correct one and a broken one), so that a wrong output is
seen to fail its check and to stay out of the ratios. The library itself is not called."""

import math
import os
import sys
import time

import numpy as np
import pytest

import sparge

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools", "bench"))
import grid as G  # noqa: E402


def test_default_grid_and_skips():
    args = G.parse_args([])
    shapes = G.build_grid(args.b, args.n, args.d, args.causal, args.heads, args.max_tokens)
    assert len(shapes) == 3 * 5 * 2 * 2
    run = [s for s in shapes if not s.skip]
    skipped = [s for s in shapes if s.skip]
    assert len(run) == 52 and len(skipped) == 8
    assert all(s.B == 64 and s.N >= 8192 for s in skipped)
    assert all("--max-tokens" in s.skip for s in skipped)
    assert {(s.D, s.H) for s in shapes} == {(128, 32), (64, 12)}
    assert all(s.B * s.N <= 262144 for s in run)
    # order: D, then B, then N, then causal
    assert [(s.D, s.B, s.N, s.causal) for s in shapes[:3]] == [(128, 1, 1024, False), (128, 1, 1024, True),
                                                              (128, 1, 2048, False)]
    assert G.build_grid([64], [32768], [64], [False], {0: 4}, 0)[0].skip == ""


def test_options():
    a = G.parse_args(["--b", "2", "--n", "1k,3000", "--d", "96", "--heads", "96:8", "--causal", "1",
                      "--max-tokens", "2048"])
    shapes = G.build_grid(a.b, a.n, a.d, a.causal, a.heads, a.max_tokens)
    assert [(s.B, s.H, s.N, s.D, s.causal, bool(s.skip)) for s in shapes] == [
        (2, 8, 1024, 96, True, False), (2, 8, 3000, 96, True, True)]
    assert G.parse_heads("16") == {0: 16} and G.heads_for(256, {0: 16}) == 16
    with pytest.raises(SystemExit):
        G.parse_args(["--d", "96"])           # no head count for D = 96
    with pytest.raises(SystemExit):
        G.parse_args(["--densities", "0.5,1.5"])
    assert "H = 32 at D = 128, H = 12 at D = 64" in G.heads_text([128, 64], G.parse_heads(G.DEFAULT_HEADS))


def test_input_sets_and_batches():
    l2 = 60 * 10 ** 6
    assert G.input_sets(3 * 1 * 12 * 1024 * 64 * 2, l2) == 4
    assert G.input_sets(200 * 10 ** 6, l2) == 3
    assert G.input_sets(1 << 30, l2) == 2
    assert G.input_sets(2 << 30, l2) == 1
    o = G.TimingOpts(batches=7, batch_ms=25.0, max_calls=200, measure_ms=1500.0)
    assert G.plan_calls(0.01, o) == (200, 7)
    assert G.plan_calls(1.0, o) == (25, 7)
    assert G.plan_calls(30.0, o) == (1, 7)
    assert G.plan_calls(400.0, o) == (1, 3)
    assert G.plan_calls(300.0, o) == (1, 5)


@pytest.mark.parametrize("causal", [False, True])
def test_visible_blocks_match_the_package(causal):
    for n in (64, 100, 128, 1000, 4096):
        assert G.visible_blocks(n, causal) == sum(sparge.visible_key_blocks(n, n, 128, 64, causal))


def test_dry_run_lists_skips(capsys):
    assert G.main(["--dry-run", "--sparse", "--pred"]) == 0
    out = capsys.readouterr().out
    assert out.count("skipped: B*N") == 8
    assert "52 shapes to run, 8 skipped" in out
    assert "H = 32 at D = 128, H = 12 at D = 64" in out
    assert "d0.1" in out and "pred" in out


try:
    import torch
except ImportError:  # the tests above need no torch
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="needs torch")


def _token_mask(n, causal, block_mask):
    """[B, H, n, n] bool: key j used by query i."""
    m = block_mask.bool().repeat_interleave(128, dim=2)[:, :, :n].repeat_interleave(64, dim=3)[..., :n]
    if causal:
        m = m & torch.ones(n, n, dtype=torch.bool).tril()
    return m


def _dense_ref(q, k, v, causal, block_mask=None):
    q, k, v = q.double(), k.double(), v.double()
    n = q.shape[2]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    ok = torch.ones(n, n, dtype=torch.bool).expand(q.shape[0], q.shape[1], n, n)
    if block_mask is not None:
        ok = _token_mask(n, causal, block_mask)
    elif causal:
        ok = ok & torch.ones(n, n, dtype=torch.bool).tril()
    s = s.masked_fill(~ok, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return p @ v


@needs_torch
@pytest.mark.parametrize("causal", [False, True])
def test_reference_rows(causal):
    g = torch.Generator().manual_seed(3)
    B, H, N, D = 3, 2, 300, 32
    q, k, v = (torch.randn(B, H, N, D, generator=g) for _ in range(3))
    rows = G.sample_rows(N, 40, 5)
    assert rows[0] == 0 and rows[-1] == N - 1 and len(rows) == 40 and rows == sorted(set(rows))
    ref = _dense_ref(q, k, v, causal)
    got = G.ref_rows(q, k, v, rows, [0, 2], causal)
    assert got.shape == (2, H, len(rows), D)
    assert torch.allclose(got.double(), ref[[0, 2]][:, :, rows], atol=1e-5)
    # with a block mask; some rows keep no block at all (zeros)
    bm = (torch.rand(B, H, 3, 5, generator=g) < 0.4).to(torch.uint8)
    bm[0, 0, 0] = 0
    ref = _dense_ref(q, k, v, causal, bm)
    got = G.ref_rows(q, k, v, rows, [0, 1], causal, block_mask=bm)
    assert torch.allclose(got.double(), ref[[0, 1]][:, :, rows], atol=1e-5)
    assert float(got[0, 0, 0].abs().max()) == 0.0


@needs_torch
def test_cosine():
    a = torch.randn(1000)
    assert G.cosine(a, a, chunk=64) == pytest.approx(1.0)
    assert G.cosine(a, -a, chunk=64) == pytest.approx(-1.0)
    assert G.cosine(torch.zeros(5), torch.zeros(5)) == 1.0
    b = a.clone()
    b[7] = float("nan")
    assert math.isnan(G.cosine(a, b, chunk=64))


@needs_torch
def test_random_mask_density_and_visibility():
    sh = G.Shape(2, 3, 1000, 64, True)
    g = torch.Generator().manual_seed(1)
    m, got = G.random_block_mask(torch, sh, 0.3, g, "cpu")
    assert m.dtype == torch.uint8 and tuple(m.shape) == (2, 3, sh.nqb, sh.nkb)
    vis = sparge.visible_key_blocks(1000, 1000, 128, 64, True)
    for qb, nv in enumerate(vis):
        assert int(m[:, :, qb, nv:].sum()) == 0
    assert got == pytest.approx(float(m.sum()) / (6 * sum(vis)))
    assert 0.2 < got < 0.4


# ------------------------------------------------------------------ one shape end to end on the CPU
class _Event:
    def record(self):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


class _CpuEnv(G.Env):
    def event(self):
        return _Event()

    def sync(self):
        pass

    def free(self):
        pass


class _FakeSparge:
    """sparge's call signatures on the CPU: exact attention on the block mask (mask=None: a mask of
    the first ceil(topk * visible) visible blocks per row); broken=True returns v instead."""

    def __init__(self, broken=False):
        self.broken = broken
        self.estimators = set()  # of the predicted calls (top-k < 1; the dense call predicts nothing)

    def predict_mask(self, q, k, *, is_causal=False, topk=0.5, precision="int8_fp8", estimator="auto"):
        if topk < 1.0:
            self.estimators.add(estimator)
        B, H, N = q.shape[0], q.shape[1], q.shape[2]
        vis = sparge.visible_key_blocks(N, N, 128, 64, is_causal)
        m = torch.zeros(B, H, len(vis), -(-N // 64), dtype=torch.uint8)
        for qb, nv in enumerate(vis):
            m[:, :, qb, :max(1, int(topk * nv))] = 1
        return m

    def attention(self, q, k, v, *, mask=None, is_causal=False, topk=0.5, precision="int8_fp8", estimator="auto",
                  return_sparsity=False):
        if self.broken:
            out = v.clone()
        else:
            m = mask if mask is not None else self.predict_mask(q, k, is_causal=is_causal, topk=topk,
                                                                estimator=estimator)
            out = _dense_ref(q.float(), k.float(), v.float(), is_causal, m).to(q.dtype)
        if return_sparsity:
            return out, 0.5
        return out

    def clear_caches(self):
        pass

    class Plan:
        """The plan of a shape: its resolved precision."""

        def __init__(self, *shape, precision="auto", **kw):
            self.precision = "fp16" if precision == "auto" else precision

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass


def _args(**kw):
    a = G.parse_args(["--sparse", "--sparse-min-n", "256", "--pred", "--check-rows", "16"])
    for key, val in kw.items():
        setattr(a, key, val)
    return a


@needs_torch
@pytest.mark.parametrize("broken", [False, True])
def test_one_shape_on_the_cpu(broken, tmp_path):
    fake = _FakeSparge(broken)
    env = _CpuEnv(torch, fake, "cpu")
    o = G.TimingOpts(warmup_ms=0.0, min_warmup=1, batches=3, batch_ms=1.0, max_calls=2)
    sh = G.Shape(2, 2, 256, 64, True)
    r = G.run_shape(env, sh, _args(), o)
    # the predicted call names its estimator (--estimator, default keys_lse), whatever the library's default
    assert G.parse_args([]).estimator == "keys_lse"
    assert fake.estimators == {"keys_lse"}
    s, e, c, fa = (r.get(k) for k in ("sparge", "empty", "cudnn", "fa2"))
    # cuDNN does not run on the CPU: an error with its reason, the shape goes on
    assert c.error and "RuntimeError" in c.error and math.isnan(c.ms)
    assert fa.check.startswith("ok") and fa.ms > 0 and fa.batches == 3 and len(fa.times) == 3
    assert e.check == ("FAIL not zeros" if broken else "ok zeros")
    assert set(r.meas) == {"sparge", "empty", "cudnn", "fa2", "d0.5", "d0.2", "d0.1", "pred"}
    assert s.ms > 0
    assert all(m.fn is None for m in r.meas.values())   # no inputs kept alive by the results
    if broken:
        assert s.check.startswith("FAIL cos") and not s.ok
        assert math.isnan(G.ratio(fa, s))
        assert all(r.meas[k].check.startswith("FAIL") for k in ("d0.5", "d0.2", "d0.1", "pred"))
    else:
        assert s.check.startswith("ok") and s.cos > 0.99
        assert G.ratio(fa, s) > 0
        assert all(r.meas[k].check.startswith("ok") for k in ("d0.5", "d0.2", "d0.1", "pred"))
        assert r.meas["pred"].density == 0.5
    skipped = G.ShapeResult(G.Shape(64, 2, 8192, 64, False), "skipped", "B*N = 524288 > 262144 (--max-tokens)")
    md = G.md_report([r, skipped], "### title", ["footer line"])
    assert "skipped: B*N = 524288" in md and md.rstrip().endswith("footer line")
    assert ("FAIL [" in md) == broken
    assert "error [" in md and "cuDNN" in md
    rows = G.csv_rows([r, skipped], "cpu", "abc")
    path = tmp_path / "grid.csv"
    G.write_csv(str(path), rows)
    import csv

    got = list(csv.DictReader(open(path)))
    assert [x["kind"] for x in got] == ["dense", "sparse", "sparse", "sparse", "pred", "dense"]
    assert got[-1]["status"] == "skipped"
    assert r.precision == "fp16" and got[0]["precision"] == "fp16" and "| yes | fp16 |" in md
    assert got[0]["x_cudnn"] == "" and ("cuDNN" in got[0]["note"])
    assert (got[0]["sparge_tflops"] == "") == broken and (got[0]["x_fa2"] == "") == broken
    line, fails, sp_err = G.summary_line([r, skipped], 1.0)
    assert line.startswith("grid: 1 shapes timed, 1 skipped, 1 with errors")
    assert (fails > 0) == broken and sp_err == 0


@needs_torch
def test_sdpa_reference_when_fa2_is_left_out():
    env = _CpuEnv(torch, _FakeSparge(), "cpu")
    o = G.TimingOpts(warmup_ms=0.0, min_warmup=1, batches=2, batch_ms=1.0, max_calls=1)
    r = G.run_shape(env, G.Shape(1, 2, 200, 64, False), _args(no_fa2=True, sparse=False, pred=False), o)
    assert set(r.meas) == {"sparge", "empty", "cudnn"}
    assert r.get("sparge").check.startswith("ok") and r.get("cudnn").error


def test_estimates_are_positive():
    a = G.parse_args(["--sparse", "--pred"])
    o = G.timing_opts(a)
    for sh in G.build_grid(a.b, a.n, a.d, a.causal, a.heads, a.max_tokens):
        assert G.estimate_seconds(sh, G.libs_of(sh, a), o) > 0
        assert G.memory_estimate(sh, G.input_sets(3 * sh.tensor_bytes, 60 * 10 ** 6)) > 3 * sh.tensor_bytes
    assert np.isfinite(G.model_call_ms("sparge", G.Shape(1, 32, 32768, 128, False)))


@needs_torch
def test_budget_and_interrupt(monkeypatch):
    a = _args(sparse=False, pred=False, budget_s=0.001)
    o = G.TimingOpts(warmup_ms=0.0, min_warmup=1, batches=2, batch_ms=1.0, max_calls=1)
    shapes = G.build_grid([1, 2], [256], [64], [False], {0: 2}, 256)
    env = _CpuEnv(torch, _FakeSparge(), "cpu")
    results = []
    assert G.run_grid(env, shapes, a, o, time.perf_counter() - 1.0, results) is False
    assert [r.status for r in results] == ["skipped", "skipped"]
    assert results[0].reason.startswith("budget") and "--max-tokens" in results[1].reason

    class Stop(_FakeSparge):
        def attention(self, *args, **kw):
            raise G.Interrupted("signal 15")

    a.budget_s = 0
    results = []
    assert G.run_grid(_CpuEnv(torch, Stop(), "cpu"), shapes, a, o, time.perf_counter(), results) is True
    assert results == []


@needs_torch
def test_no_device_exit_code(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("SPARGE_LIBRARY", os.environ.get("SPARGE_LIBRARY", ""))
    assert G.main(["--b", "1", "--n", "1k", "--d", "64"]) == 77


def test_sigterm_handler_raises_once():
    import signal

    old = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(G.Interrupted):
            G._on_signal(signal.SIGTERM, None)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        assert not issubclass(G.Interrupted, Exception)
    finally:
        signal.signal(signal.SIGTERM, old)


def test_target_counts():
    """The summary's counts of the design targets: dense x cuDNN >= 1.0 on every shape, >= 1.5 at
    N >= 8K, sparse time <= (d + 0.05) x own dense; failed checks and missing anchors count nowhere."""

    def meas(key, ms, density=1.0, check="ok cos 0.9999"):
        return G.Meas(key, key, None, ms=ms, density=density, check=check)

    def shape(n, sparge_ms, cudnn_ms, sparse=()):
        r = G.ShapeResult(G.Shape(1, 32, n, 128, False))
        r.meas = {"sparge": meas("sparge", sparge_ms), "cudnn": meas("cudnn", cudnn_ms)}
        for d, ms in sparse:
            r.meas["d%g" % d] = meas("d%g" % d, ms, density=d)
        return r

    timed = [shape(1024, 1.0, 0.9),                                 # 0.90x
             shape(1024, 1.0, 1.2),                                 # 1.20x
             shape(8192, 1.0, 1.6, [(0.5, 0.54), (0.1, 0.2)]),      # 1.60x; 0.54 ok, 0.20 > 0.15
             shape(32768, 1.0, 1.4, [(0.2, 0.25)])]                 # 1.40x; 0.25 <= 0.25
    failed = shape(8192, 1.0, 3.0)
    failed.meas["sparge"].check = "FAIL cos 0.5"
    assert G.target_counts(timed + [failed]) == ">= 1.0x on 3 of 4, >= 1.5x at N >= 8K on 1 of 2, " \
                                                "sparse <= (d + 0.05)x dense on 2 of 3"
    assert G.target_counts(timed[:2]) == ">= 1.0x on 1 of 2, >= 1.5x at N >= 8K on 0 of 0"
    line, _, _ = G.summary_line(timed, 1.0)
    assert line.startswith("grid: 4 shapes timed") and "x cuDNN median" in line and ">= 1.5x at N >= 8K on 1 of 2" in line
