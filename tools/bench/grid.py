#!/usr/bin/env python3
"""The benchmark grid: libsparge through its Python API against torch SDPA (cuDNN and FlashAttention-2).

One run compares, per shape, as a user calls them:

  libsparge      sparge.attention(q, k, v, topk=1.0, is_causal=...), precision auto (--precision; the
                 precision the plan resolved to is reported per shape): every visible block kept, the
                 dense call (no prediction, no index lists: docs/API.md, "Dense calls")
  empty mask     sparge.attention with an all-zeros block mask [B, H, ceil(N/128), ceil(N/64)]: the
                 fixed cost of a call (no attention work)
  cuDNN          F.scaled_dot_product_attention in bf16 under sdpa_kernel(SDPBackend.CUDNN_ATTENTION)
  FA2            the same under sdpa_kernel(SDPBackend.FLASH_ATTENTION) (FlashAttention-2)
  --sparse       libsparge on random block masks of density 0.5, 0.2, 0.1 at N >= 8K (time over own dense)
  --pred         the predicted call sparge.attention(q, k, v, is_causal=..., estimator=...) (mask=None, top-k
                 0.5, the other prediction defaults; --estimator, default keys_lse: the estimator of the
                 published numbers, named explicitly so that a change of the library's default does not move them)

Grid: B in {1, 8, 64}, N = Lq = Lkv in {1K, 2K, 4K, 8K, 32K}, D in {128, 64}, causal and not; H = 32 at
D = 128 and H = 12 at D = 64 (Hq = Hkv; --heads). Shapes with B*N above --max-tokens (262144) are listed as
skipped. Inputs are bf16 random normal numbers made on the GPU, HND layout [B, H, N, D]; when one input set
(q, k, v) is small against the L2 cache the calls rotate among 2 to 4 sets (sparge_bench's rule).

Timing, the same for every library: warm-up calls, then batches of back-to-back calls, each batch between
one pair of CUDA events with the device idle at its start (so a host-bound call costs what it costs a
user); the batches of the libraries of one shape are interleaved; the median over the batches of the
per-call time is reported. TFLOPS = 4*B*H*N*N*D (x 0.5 causal), the dense-equivalent rate.

Check, once per shape before timing: every output against float32 attention computed directly on sampled
query rows (with the block mask applied for the sparse and predicted calls), and libsparge's and cuDNN's
full outputs against FA2's (cuDNN's where FA2 did not run): cosine >= 0.99 (--min-cos), all finite; the
empty-mask output must be zeros. A failed check marks the time and keeps it out of the ratios.

Examples:
  python3 tools/bench/grid.py --lib build-gpu/libsparge.so --csv grid.csv --md grid.md
  python3 tools/bench/grid.py --dry-run                  # shapes, memory and time estimates; no GPU
  python3 tools/bench/grid.py --b 1 --n 8k,32k --d 128 --sparse --pred
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import gc
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLOCK_Q, BLOCK_K = 128, 64
GIB = float(1 << 30)
DEFAULT_HEADS = "128:32,64:12"
DEFAULT_L2_MB = 60.0
DEFAULT_MEM_GB = 139.0
SDPA_LIBS = (("cudnn", "cuDNN", "CUDNN_ATTENTION"), ("fa2", "FA2", "FLASH_ATTENTION"))


# ------------------------------------------------------------------ parsing
def parse_sizes(text: str) -> List[int]:
    """'1k,2K,32768' -> [1024, 2048, 32768] (k = 1024)."""
    out = []
    for tok in text.split(","):
        tok = tok.strip().lower()
        if not tok:
            continue
        val = int(float(tok[:-1]) * 1024) if tok.endswith("k") else int(tok)
        if val <= 0:
            raise ValueError("sizes must be positive, got %r" % tok)
        out.append(val)
    if not out:
        raise ValueError("empty list")
    return out


def parse_floats(text: str) -> List[float]:
    return [float(t) for t in text.split(",") if t.strip()]


def parse_heads(text: str) -> Dict[int, int]:
    """'128:32,64:12' -> {128: 32, 64: 12}; a plain number -> {0: H}, the count for every D."""
    text = text.strip()
    if ":" not in text:
        h = int(text)
        if h <= 0:
            raise ValueError("heads must be positive")
        return {0: h}
    out = {}
    for tok in text.split(","):
        if not tok.strip():
            continue
        d, h = tok.split(":")
        if int(h) <= 0:
            raise ValueError("heads must be positive")
        out[int(d)] = int(h)
    return out


def heads_for(d: int, heads: Dict[int, int]) -> int:
    if d in heads:
        return heads[d]
    if 0 in heads:
        return heads[0]
    raise ValueError("no head count for D=%d: give --heads %d:H (or one number for every D)" % (d, d))


def heads_text(ds: Sequence[int], heads: Dict[int, int]) -> str:
    return ", ".join("H = %d at D = %d" % (heads_for(d, heads), d) for d in ds)


def fmt_n(n: int) -> str:
    return "%dK" % (n // 1024) if n % 1024 == 0 else str(n)


# ------------------------------------------------------------------ the grid
@dataclass
class Shape:
    B: int
    H: int
    N: int
    D: int
    causal: bool
    skip: str = ""

    @property
    def flops(self) -> float:
        return 4.0 * self.B * self.H * self.N * self.N * self.D * (0.5 if self.causal else 1.0)

    @property
    def tensor_bytes(self) -> int:
        return self.B * self.H * self.N * self.D * 2

    @property
    def nqb(self) -> int:
        return -(-self.N // BLOCK_Q)

    @property
    def nkb(self) -> int:
        return -(-self.N // BLOCK_K)

    @property
    def mask_bytes(self) -> int:
        return self.B * self.H * self.nqb * self.nkb

    def label(self) -> str:
        return "B=%-2d H=%-2d N=%-5s D=%-3d %s" % (self.B, self.H, fmt_n(self.N), self.D,
                                                 "causal" if self.causal else "full  ")

    def key(self) -> Tuple[int, int, int, int, int]:
        return (self.B, self.H, self.N, self.D, int(self.causal))


def build_grid(bs: Sequence[int], ns: Sequence[int], ds: Sequence[int], causals: Sequence[bool],
               heads: Dict[int, int], max_tokens: int) -> List[Shape]:
    """Every combination, in the order D, B, N, causal; those over the B*N cap carry their skip reason."""
    out = []
    for d in ds:
        h = heads_for(d, heads)
        for b in bs:
            for n in ns:
                for c in causals:
                    sh = Shape(b, h, n, d, bool(c))
                    if max_tokens > 0 and b * n > max_tokens:
                        sh.skip = "B*N = %d > %d (--max-tokens)" % (b * n, max_tokens)
                    out.append(sh)
    return out


def input_sets(set_bytes: int, l2_bytes: int) -> int:
    """Input sets to rotate among (sparge_bench's rule): 2 to 4 when one set is under 2 GiB, enough
    for 8 x L2 together; else 1."""
    if set_bytes >= (2 << 30):
        return 1
    l2 = max(int(l2_bytes), 1)
    return max(2, min(4, -(-8 * l2 // max(set_bytes, 1))))


def visible_blocks(n: int, causal: bool) -> int:
    """Causally visible (query block, key block) pairs of one head, Lq = Lkv = n."""
    nqb, nkb = -(-n // BLOCK_Q), -(-n // BLOCK_K)
    if not causal:
        return nqb * nkb
    return sum(min(min(qb * BLOCK_Q + BLOCK_Q - 1, n - 1) // BLOCK_K + 1, nkb) for qb in range(nqb))


def workspace_bytes(sh: Shape) -> int:
    """About libsparge's int8_fp8 workspace (the regions of src/core/workspace.cpp, without alignment)."""
    b, h, d, nqb, nkb = sh.B, sh.H, sh.D, sh.nqb, sh.nkb
    nchunk = -(-sh.N // 512)
    pairs = b * h * nqb * nkb
    ws = 4 * b * h * d * 2                       # k mean, v amax
    ws += 4 * b * h * (nqb + nkb) * (d + 1)      # pooled q/k, self-similarity
    ws += pairs * (4 + 1 + 4)                    # scores, mask, indices
    ws += 4 * b * h * (2 * nqb * BLOCK_Q + nkb + 2 * nqb + 1)
    ws += b * h * nchunk * d * 12                # column statistics
    ws += b * h * (nqb * BLOCK_Q + 2 * nkb * BLOCK_K) * d   # int8 q, int8 k, fp8 v
    return ws


def memory_estimate(sh: Shape, nsets: int, n_masks: int = 2, check_rows: int = 64) -> int:
    """Peak device bytes of one shape: the input sets, the masks, three full outputs held for the
    check, libsparge's workspace and the float32 reference of the sampled rows."""
    t = sh.tensor_bytes
    ref = 8 * sh.H * sh.N * sh.D + 12 * sh.H * check_rows * sh.N
    sdpa_lse = 2 * 4 * sh.B * sh.H * sh.N
    return 3 * nsets * t + n_masks * sh.mask_bytes + 5 * sh.mask_bytes + 3 * t + workspace_bytes(sh) + ref + sdpa_lse


# ------------------------------------------------------------------ timing plan and time model
@dataclass
class TimingOpts:
    warmup_ms: float = 50.0
    min_warmup: int = 2
    batches: int = 7
    batch_ms: float = 25.0
    max_calls: int = 200
    measure_ms: float = 1500.0


def plan_calls(t_ms: float, o: TimingOpts) -> Tuple[int, int]:
    """(calls per batch, batches) for a call of about t_ms: batches of about o.batch_ms; calls that
    alone fill a batch run one per batch, and fewer batches (3 at least) when they would pass
    o.measure_ms."""
    t = max(t_ms, 1e-3)
    calls = int(max(1, min(o.max_calls, math.ceil(o.batch_ms / t))))
    nb = o.batches
    if calls == 1 and t * nb > o.measure_ms:
        nb = max(min(3, o.batches), min(o.batches, int(o.measure_ms // t)))
    return calls, nb


# Assumed rates for the time estimate only (TFLOPS, dense-equivalent; H200-like): (D >= 128, D < 128).
_RATE = {"sparge": (700.0, 430.0), "cudnn": (620.0, 480.0), "fa2": (350.0, 300.0)}
_FLOOR_MS = {"sparge": 0.05, "cudnn": 0.03, "fa2": 0.03}
_MEM_BW = 3.3e12


def model_call_ms(lib: str, sh: Shape, density: float = 1.0) -> float:
    """Estimated time of one call (ms): the work at an assumed rate, plus libsparge's preparation
    pass (reads q, k, v, writes their 8-bit copies), at least a host-bound floor."""
    base = "sparge" if lib in ("sparge", "empty", "sparse", "pred") else lib
    rate = _RATE[base][0 if sh.D >= 128 else 1] * 1e12
    work = sh.flops * density / rate * 1e3
    if base == "sparge":
        prep = 4.5 * sh.tensor_bytes / _MEM_BW * 1e3
        if lib == "empty":
            work = 0.0
        elif lib == "pred":
            prep *= 1.4
        work += prep
    return max(work, _FLOOR_MS[base])


def measure_seconds(t_ms: float, o: TimingOpts) -> float:
    calls, nb = plan_calls(t_ms, o)
    warm = max(o.warmup_ms, o.min_warmup * t_ms)
    return (warm + nb * (calls * t_ms + 0.3) + t_ms) * 1e-3


def shape_libs(sh: Shape, sparse: bool, densities: Sequence[float], sparse_min_n: int, pred: bool,
               topk: float, fa2: bool = True) -> List[Tuple[str, float]]:
    """(library, density) of every measurement of a shape."""
    libs = [("sparge", 1.0), ("empty", 0.0), ("cudnn", 1.0)]
    if fa2:
        libs.append(("fa2", 1.0))
    if sparse and sh.N >= sparse_min_n:
        libs += [("sparse", d) for d in densities]
    if pred:
        libs.append(("pred", topk))
    return libs


def estimate_seconds(sh: Shape, libs: Sequence[Tuple[str, float]], o: TimingOpts) -> float:
    """Estimated wall time of one shape: inputs and check (about 0.3 s, cuDNN's first call of a
    shape included) plus every measurement."""
    total = 0.3
    for lib, dens in libs:
        total += measure_seconds(model_call_ms(lib, sh, dens), o)
    return total


# ------------------------------------------------------------------ checks (torch, any device)
def cosine(a: Any, b: Any, chunk: int = 1 << 25) -> float:
    """Cosine similarity of two same-shaped tensors in float64 sums over float32 chunks; NaN when
    either holds a non-finite value; 1.0 when both are all zeros."""
    import torch

    x, y = a.reshape(-1), b.reshape(-1)
    dot = na = nb = 0.0
    for i in range(0, x.numel(), chunk):
        xa, ya = x[i:i + chunk].float(), y[i:i + chunk].float()
        if not bool(torch.isfinite(xa).all()) or not bool(torch.isfinite(ya).all()):
            return float("nan")
        dot += float(torch.sum(xa * ya, dtype=torch.float64))
        na += float(torch.sum(xa * xa, dtype=torch.float64))
        nb += float(torch.sum(ya * ya, dtype=torch.float64))
    if na == 0.0 and nb == 0.0:
        return 1.0
    if na == 0.0 or nb == 0.0:
        return 0.0
    return dot / math.sqrt(na * nb)


def sample_rows(n: int, count: int, seed: int) -> List[int]:
    """Sorted distinct query rows: the first, the last and random others (count in all, at most n)."""
    rnd = random.Random(seed)
    rows = {0, n - 1}
    count = min(count, n)
    while len(rows) < count:
        rows.add(rnd.randrange(n))
    return sorted(rows)


def ref_rows(q: Any, k: Any, v: Any, rows: Sequence[int], batches: Sequence[int], causal: bool,
             block_mask: Any = None, scale: Optional[float] = None) -> Any:
    """float32 attention of the given query rows of the given batch entries, computed directly:
    [len(batches), H, len(rows), D]. Lq = Lkv (causal: key j visible to query i iff j <= i);
    block_mask [B, H, ceil(N/128), ceil(N/64)] (nonzero = compute) limits the keys further. A row
    that sees no key gives zeros (the library's rule)."""
    import torch

    n, d = q.shape[2], q.shape[3]
    sc = scale if scale is not None else 1.0 / math.sqrt(d)
    ridx = torch.as_tensor(list(rows), dtype=torch.long, device=q.device)
    keys = torch.arange(k.shape[2], device=q.device)
    allowed = torch.ones(len(rows), k.shape[2], dtype=torch.bool, device=q.device)
    if causal:
        allowed = keys[None, :] <= (ridx[:, None] + (k.shape[2] - n))
    outs = []
    for b in batches:
        qb = q[b][:, ridx, :].float()
        kb, vb = k[b].float(), v[b].float()
        s = torch.matmul(qb, kb.transpose(-1, -2)) * sc            # [H, r, Lkv]
        ok = allowed[None].expand(s.shape[0], -1, -1)
        if block_mask is not None:
            bm = block_mask[b][:, ridx // BLOCK_Q, :] != 0          # [H, r, nKB]
            bm = bm.repeat_interleave(BLOCK_K, dim=-1)[..., :k.shape[2]]
            ok = ok & bm
        s = s.masked_fill(~ok, float("-inf"))
        m = s.amax(dim=-1, keepdim=True)
        has = torch.isfinite(m)
        p = torch.exp(s - torch.where(has, m, torch.zeros_like(m)))
        p = p.masked_fill(~ok, 0.0)
        den = p.sum(dim=-1, keepdim=True)
        o = torch.matmul(p, vb) / torch.where(has, den, torch.ones_like(den))
        outs.append(torch.where(has, o, torch.zeros_like(o)))
        del qb, kb, vb, s, p
    return torch.stack(outs)


def gather_rows(out: Any, rows: Sequence[int], batches: Sequence[int]) -> Any:
    import torch

    ridx = torch.as_tensor(list(rows), dtype=torch.long, device=out.device)
    return torch.stack([out[b][:, ridx, :].float() for b in batches])


def random_block_mask(torch: Any, sh: Shape, density: float, gen: Any, device: str) -> Tuple[Any, float]:
    """uint8 mask keeping each causally visible block with probability density; (mask, kept / visible)."""
    u = torch.rand(sh.B, sh.H, sh.nqb, sh.nkb, device=device, generator=gen)
    m = u < density
    del u
    if sh.causal:
        qb = torch.arange(sh.nqb, device=device)
        last = torch.clamp((qb * BLOCK_Q + BLOCK_Q - 1).clamp(max=sh.N - 1) // BLOCK_K, max=sh.nkb - 1)
        vis = torch.arange(sh.nkb, device=device)[None, :] <= last[:, None]
        m &= vis
    kept = float(m.sum())
    return m.to(torch.uint8), kept / float(sh.B * sh.H * visible_blocks(sh.N, sh.causal))


# ------------------------------------------------------------------ results
@dataclass
class Meas:
    key: str                 # sparge, empty, cudnn, fa2, d0.5 ..., pred
    label: str
    fn: Optional[Callable[[int], Any]]   # None once the shape is done (see release)
    ctx: Callable[[], Any] = contextlib.nullcontext
    density: float = 1.0
    ms: float = float("nan")
    spread: float = float("nan")
    calls: int = 0
    batches: int = 0
    times: List[float] = field(default_factory=list)
    error: str = ""
    check: str = ""          # "" = not checked yet, "ok ..." or "FAIL ..."
    cos: float = float("nan")

    @property
    def ok(self) -> bool:
        return not self.error and self.check.startswith("ok") and not math.isnan(self.ms)


@dataclass
class ShapeResult:
    shape: Shape
    status: str = "ok"       # ok, skipped, error, interrupted
    reason: str = ""
    sets: int = 0
    precision: str = ""      # the precision libsparge's plan runs (the choice of "auto")
    seconds: float = 0.0
    meas: Dict[str, Meas] = field(default_factory=dict)

    def get(self, key: str) -> Optional[Meas]:
        return self.meas.get(key)


def short(e: BaseException, width: int = 160) -> str:
    text = str(e).strip().splitlines()
    msg = text[0] if text else ""
    return ("%s: %s" % (type(e).__name__, msg))[:width]


# ------------------------------------------------------------------ running one shape
class Interrupted(BaseException):
    """SIGTERM (a time limit): stop, and write what was measured. Not an Exception, so that no
    per-library handler takes it."""


def _on_signal(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one is enough; the outputs get written
    raise Interrupted("signal %d" % signum)


def first_call(env: "Env", m: Meas) -> Any:
    """The check call (set 0); an error names the warnings torch gave (why a backend is unavailable)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with m.ctx():
                out = m.fn(0)
            env.sync()
            return out
        except Interrupted:
            raise
        except Exception as e:  # noqa: BLE001 - reported per library, the grid goes on
            why = [str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()]
            msg = short(e)
            if why:
                msg += " (" + "; ".join(dict.fromkeys(why))[:240] + ")"
            raise RuntimeError(msg) from None


def warm_up(env: "Env", m: Meas, nsets: int, o: TimingOpts) -> float:
    """Warm-up calls, each timed alone; returns the median of the last three (ms)."""
    times: List[float] = []
    t0 = time.perf_counter()
    i = 0
    with m.ctx():
        while True:
            s, e = env.event(), env.event()
            s.record()
            m.fn(i % nsets)
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
            i += 1
            if i >= o.min_warmup and (time.perf_counter() - t0) * 1e3 >= o.warmup_ms:
                break
            if i >= 1000:
                break
    return statistics.median(times[-3:])


def time_interleaved(env: "Env", ms: List[Meas], nsets: int, o: TimingOpts) -> None:
    """Warms every measurement up, then runs their batches in turn (round robin), one event pair per
    batch with the device idle at its start; sets ms (median per call), spread, calls, batches."""
    live = []
    for m in ms:
        if m.error:
            continue
        try:
            est = warm_up(env, m, nsets, o)
            m.calls, m.batches = plan_calls(est, o)
            live.append(m)
        except Interrupted:
            raise
        except Exception as e:  # noqa: BLE001
            m.error = short(e)
            env.free()
    events: Dict[str, List[Tuple[Any, Any, int]]] = {m.key: [] for m in live}
    rounds = max((m.batches for m in live), default=0)
    for r in range(rounds):
        for m in live:
            if m.error or r >= m.batches:
                continue
            try:
                with m.ctx():
                    env.sync()
                    s, e = env.event(), env.event()
                    base = r * m.calls
                    s.record()
                    for i in range(m.calls):
                        m.fn((base + i) % nsets)
                    e.record()
                events[m.key].append((s, e, m.calls))
            except Interrupted:
                raise
            except Exception as ex:  # noqa: BLE001
                m.error = short(ex)
                env.free()
    env.sync()
    for m in live:
        if m.error:
            continue
        per = [s.elapsed_time(e) / c for s, e, c in events[m.key]]
        m.times = per
        m.ms = statistics.median(per)
        m.spread = (max(per) - min(per)) / m.ms if m.ms > 0 else float("nan")


def mark(m: Meas, cos_values: Sequence[Tuple[str, float]], min_cos: float) -> None:
    """check = "ok <min cos>" or "FAIL <what> <value>"."""
    worst = min((c for _, c in cos_values), default=float("nan"))
    for what, c in cos_values:
        if math.isnan(c):
            m.check, m.cos = "FAIL non-finite or NaN (%s)" % what, float("nan")
            return
        if c < min_cos:
            m.check, m.cos = "FAIL cos %.4f (%s)" % (c, what), c
            return
    m.cos = worst
    m.check = "ok %.5f" % worst


def run_shape(env: "Env", sh: Shape, args: argparse.Namespace, o: TimingOpts) -> ShapeResult:
    torch, F, sparge = env.torch, env.F, env.sparge
    res = ShapeResult(sh)
    nsets = input_sets(3 * sh.tensor_bytes, env.l2_bytes)
    res.sets = nsets
    dev = env.device
    gen = torch.Generator(device=dev)
    gen.manual_seed(args.seed * 1000003 + hash(sh.key()) % 1000003)
    sets = []
    try:
        for _ in range(nsets):
            sets.append(tuple(torch.randn(sh.B, sh.H, sh.N, sh.D, device=dev, dtype=torch.bfloat16,
                                          generator=gen) for _ in range(3)))
        zeros = torch.zeros(sh.B, sh.H, sh.nqb, sh.nkb, dtype=torch.uint8, device=dev)
    except Interrupted:
        raise
    except Exception as e:  # noqa: BLE001
        res.status, res.reason = "error", "inputs: " + short(e)
        return res

    causal, prec = sh.causal, args.precision
    try:
        with sparge.Plan(sh.B, sh.H, sh.N, sh.D, dtype="bfloat16", device=dev, precision=prec,
                         is_causal=causal) as plan:
            res.precision = plan.precision
    except Exception as e:  # noqa: BLE001  (the calls below report it too)
        res.precision = "error: " + short(e, 60)
    rows = sample_rows(sh.N, args.check_rows, args.seed + sh.N)
    bsel = sorted({0, sh.B - 1})

    def sp(mask: Any) -> Callable[[int], Any]:
        return lambda i: sparge.attention(sets[i][0], sets[i][1], sets[i][2], mask=mask, is_causal=causal,
                                          precision=prec)

    def dense(i: int) -> Any:
        return sparge.attention(sets[i][0], sets[i][1], sets[i][2], topk=1.0, is_causal=causal, precision=prec)

    def sdpa(backend: Any) -> Tuple[Callable[[int], Any], Callable[[], Any]]:
        return (lambda i: F.scaled_dot_product_attention(sets[i][0], sets[i][1], sets[i][2], is_causal=causal),
                lambda: env.sdpa_kernel([backend]))

    meas: List[Meas] = [Meas("sparge", "libsparge", dense), Meas("empty", "libsparge empty mask", sp(zeros),
                                                                     density=0.0)]
    for key, label, be in SDPA_LIBS:
        if key == "fa2" and args.no_fa2:
            continue
        fn, ctx = sdpa(getattr(env.SDPBackend, be))
        meas.append(Meas(key, label, fn, ctx))
    res.meas = {m.key: m for m in meas}
    q0, k0, v0 = sets[0]

    # -- check: the dense outputs together, then the others one at a time
    ref = ref_rows(q0, k0, v0, rows, bsel, causal)
    outs: Dict[str, Any] = {}
    for m in meas:
        if m.key == "empty":
            continue
        try:
            outs[m.key] = first_call(env, m)
        except Interrupted:
            raise
        except Exception as e:  # noqa: BLE001
            m.error = str(e)
            env.free()
    full_ref_key = "fa2" if "fa2" in outs else ("cudnn" if "cudnn" in outs else "")
    for key, out in outs.items():
        m = res.meas[key]
        vals = [("rows vs fp32", cosine(gather_rows(out, rows, bsel), ref))]
        if full_ref_key and key != full_ref_key and key in ("sparge", "cudnn"):
            vals.append(("vs " + res.meas[full_ref_key].label, cosine(out, outs[full_ref_key])))
        mark(m, vals, args.min_cos)
    outs.clear()
    del ref
    em = res.meas["empty"]
    try:
        out = first_call(env, em)
        finite = bool(torch.isfinite(out).all())
        zero = finite and float(out.abs().amax()) == 0.0
        em.check = "ok zeros" if zero else ("FAIL non-finite" if not finite else "FAIL not zeros")
        del out
    except Interrupted:
        raise
    except Exception as e:  # noqa: BLE001
        em.error = str(e)

    extra: List[Meas] = []
    if args.sparse and sh.N >= args.sparse_min_n:
        for d in args.densities:
            mask, got = random_block_mask(torch, sh, d, gen, dev)
            m = Meas("d%g" % d, "libsparge d%g" % d, sp(mask), density=got)
            extra.append(m)
            try:
                out = first_call(env, m)
                r = ref_rows(q0, k0, v0, rows, bsel, causal, block_mask=mask)
                mark(m, [("rows vs masked fp32", cosine(gather_rows(out, rows, bsel), r))], args.min_cos)
                del out, r
            except Interrupted:
                raise
            except Exception as e:  # noqa: BLE001
                m.error = str(e)
    if args.pred:
        topk, est = args.topk, args.estimator

        def pred(i: int) -> Any:
            return sparge.attention(sets[i][0], sets[i][1], sets[i][2], is_causal=causal, topk=topk, precision=prec,
                                    estimator=est)

        m = Meas("pred", "libsparge predicted (top-k %g)" % topk, pred, density=float("nan"))
        extra.append(m)
        try:
            pm = sparge.predict_mask(q0, k0, is_causal=causal, topk=topk, precision=prec, estimator=est)
            out, dens = sparge.attention(q0, k0, v0, is_causal=causal, topk=topk, precision=prec, estimator=est,
                                         return_sparsity=True)
            m.density = float(dens)
            r = ref_rows(q0, k0, v0, rows, bsel, causal, block_mask=pm)
            mark(m, [("rows vs fp32 on the predicted mask", cosine(gather_rows(out, rows, bsel), r))], args.min_cos)
            del out, r, pm
        except Interrupted:
            raise
        except Exception as e:  # noqa: BLE001
            m.error = short(e)
    for m in extra:
        res.meas[m.key] = m
    env.free()

    # -- timing
    try:
        time_interleaved(env, list(res.meas.values()), nsets, o)
    finally:
        release(res)
    if res.meas["sparge"].error:
        res.status = "error"
    return res


def release(res: ShapeResult) -> None:
    """Drops the calls (their closures hold the shape's inputs and masks) so that the results kept for
    the tables hold no device memory."""
    for m in res.meas.values():
        m.fn = None
        m.ctx = contextlib.nullcontext


# ------------------------------------------------------------------ environment
class Env:
    """What a run uses: torch, SDPA's backend switch, the sparge package, the device, its clock
    (CUDA events) and the L2 and memory sizes."""

    def __init__(self, torch: Any, sparge: Any, device: str = "cuda", l2_bytes: int = 0, total_mem: int = 0,
                 props: Any = None) -> None:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        self.torch, self.F, self.SDPBackend, self.sdpa_kernel = torch, F, SDPBackend, sdpa_kernel
        self.sparge, self.device, self.props = sparge, device, props
        self.l2_bytes = l2_bytes or int(DEFAULT_L2_MB * 1e6)
        self.total_mem = total_mem or int(DEFAULT_MEM_GB * GIB)

    @classmethod
    def cuda(cls, args: argparse.Namespace) -> "Env":
        import torch
        import sparge

        p = torch.cuda.get_device_properties(0)
        l2 = int(args.l2_mb * 1e6) if args.l2_mb else int(getattr(p, "L2_cache_size", 0) or 0)
        return cls(torch, sparge, "cuda", l2, int(p.total_memory), p)

    def event(self) -> Any:
        return self.torch.cuda.Event(enable_timing=True)

    def sync(self) -> None:
        self.torch.cuda.synchronize()

    def free(self) -> None:
        self.torch.cuda.empty_cache()


def git_commit() -> str:
    try:
        c = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                           timeout=20)
        if c.returncode != 0:
            return "unknown"
        commit = c.stdout.strip()
        d = subprocess.run(["git", "-C", ROOT, "diff", "--quiet", "HEAD"], capture_output=True, timeout=20)
        return commit + ("+dirty" if d.returncode == 1 else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def driver_version() -> str:
    try:
        c = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        return c.stdout.strip().splitlines()[0] if c.returncode == 0 and c.stdout.strip() else "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def newest_built_library() -> Optional[str]:
    import glob

    cands = [p for p in glob.glob(os.path.join(ROOT, "build*", "libsparge.so*")) if os.path.isfile(p)]
    return max(cands, key=os.path.getmtime) if cands else None


# ------------------------------------------------------------------ output
def f3(x: float) -> str:
    return "" if x is None or math.isnan(x) else "%.3f" % x


def tflops(sh: Shape, ms: float) -> float:
    return sh.flops / (ms * 1e-3) / 1e12 if ms and not math.isnan(ms) and ms > 0 else float("nan")


def ratio(num: Optional[Meas], den: Optional[Meas]) -> float:
    if num is None or den is None or not num.ok or not den.ok or den.ms <= 0:
        return float("nan")
    return num.ms / den.ms


CSV_FIELDS = ["kind", "B", "H", "N", "D", "causal", "precision", "density", "sparge_ms", "empty_ms", "cudnn_ms", "fa2_ms",
              "x_cudnn", "x_fa2", "x_own_dense", "target", "sparge_tflops", "cudnn_tflops", "fa2_tflops",
              "sparge_spread", "cudnn_spread", "fa2_spread", "calls", "input_sets", "check", "status", "note",
              "gpu", "commit"]


def csv_rows(results: List[ShapeResult], gpu: str, commit: str) -> List[Dict[str, Any]]:
    out = []
    for r in results:
        sh = r.shape
        base = {"B": sh.B, "H": sh.H, "N": sh.N, "D": sh.D, "causal": int(sh.causal), "precision": r.precision,
                "gpu": gpu, "commit": commit, "input_sets": r.sets or ""}
        if r.status in ("skipped", "interrupted") or (r.status == "error" and not r.meas):
            out.append(dict(base, kind="dense", status=r.status, note=r.reason))
            continue
        s, e, c, fa = (r.get(k) for k in ("sparge", "empty", "cudnn", "fa2"))

        def ms_of(m: Optional[Meas]) -> str:
            return f3(m.ms) if m is not None and not m.error else ""

        notes = ["%s: %s" % (m.label, m.error) for m in (s, e, c, fa) if m is not None and m.error]
        checks = ["%s %s" % (m.key, m.check) for m in (s, e, c, fa) if m is not None and m.check]
        row = dict(base, kind="dense", density="1.000", sparge_ms=ms_of(s), empty_ms=ms_of(e), cudnn_ms=ms_of(c),
                   fa2_ms=ms_of(fa), x_cudnn=f3(ratio(c, s)), x_fa2=f3(ratio(fa, s)),
                   sparge_tflops=f3(tflops(sh, s.ms)) if s and s.ok else "",
                   cudnn_tflops=f3(tflops(sh, c.ms)) if c and c.ok else "",
                   fa2_tflops=f3(tflops(sh, fa.ms)) if fa and fa.ok else "",
                   sparge_spread=f3(s.spread) if s else "", cudnn_spread=f3(c.spread) if c else "",
                   fa2_spread=f3(fa.spread) if fa else "",
                   calls="; ".join("%s %dx%d" % (m.key, m.batches, m.calls) for m in (s, e, c, fa) if m and m.calls),
                   check="; ".join(checks), status=r.status, note="; ".join(notes))
        out.append(row)
        for key, m in r.meas.items():
            if key in ("sparge", "empty", "cudnn", "fa2"):
                continue
            kind = "pred" if key == "pred" else "sparse"
            xo = ratio(m, s)
            tgt = ""
            if kind == "sparse" and not math.isnan(xo):
                tgt = "<=%.2f %s" % (m.density + 0.05, "ok" if xo <= m.density + 0.05 else "MISS")
            out.append(dict(base, kind=kind, density="%.3f" % m.density if not math.isnan(m.density) else "",
                            sparge_ms=ms_of(m), cudnn_ms=ms_of(c), x_cudnn=f3(ratio(c, m)), x_own_dense=f3(xo),
                            target=tgt, sparge_tflops=f3(tflops(sh, m.ms)) if m.ok else "",
                            sparge_spread=f3(m.spread), calls="%dx%d" % (m.batches, m.calls) if m.calls else "",
                            check=m.check, status="error" if m.error else r.status, note=m.error))
    return out


def write_csv(path: str, rows: List[Dict[str, Any]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in CSV_FIELDS})


def md_report(results: List[ShapeResult], header: str, footer: List[str]) -> str:
    lines = [header, ""]
    notes: Dict[str, List[str]] = {}   # note text -> the shapes it applies to (in order of first use)

    def note(text: str) -> int:
        notes.setdefault(text, []).append(lbl)
        return list(notes).index(text) + 1

    def cell(m: Optional[Meas], val: str) -> str:
        if m is None:
            return "-"
        if m.error:
            return "error [%d]" % note("%s: %s" % (m.label, m.error))
        if not m.check.startswith("ok"):
            return "%s FAIL [%d]" % (val, note("%s: check %s" % (m.label, m.check or "not run")))
        return val

    lines.append("| B | H | N | D | causal | precision | libsparge ms | cuDNN ms | FA2 ms | x cuDNN | x FA2 "
                 "| libsparge TFLOPS | cuDNN TFLOPS | FA2 TFLOPS | empty-mask ms | min cos |")
    lines.append("|---:|---:|---:|---:|:---:|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    sparse_rows, pred_rows = [], []
    for r in results:
        sh = r.shape
        lbl = "B=%d H=%d N=%d D=%d %s" % (sh.B, sh.H, sh.N, sh.D, "causal" if sh.causal else "non-causal")
        head = "| %d | %d | %d | %d | %s |" % (sh.B, sh.H, sh.N, sh.D, "yes" if sh.causal else "no")
        if r.status in ("skipped", "interrupted") or not r.meas:
            lines.append("%s - | %s: %s | | | | | | | | | |" % (head, r.status, r.reason))
            continue
        s, e, c, fa = (r.get(k) for k in ("sparge", "empty", "cudnn", "fa2"))
        cos = [m.cos for m in (s, c, fa) if m is not None and not math.isnan(m.cos)]
        lines.append("%s %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            head, r.precision or "-", cell(s, f3(s.ms)), cell(c, f3(c.ms)) if c else "-", cell(fa, f3(fa.ms)) if fa else "-",
            f3(ratio(c, s)) or "-", f3(ratio(fa, s)) or "-",
            "%.0f" % tflops(sh, s.ms) if s.ok else "-", "%.0f" % tflops(sh, c.ms) if c and c.ok else "-",
            "%.0f" % tflops(sh, fa.ms) if fa and fa.ok else "-", cell(e, f3(e.ms)),
            "%.4f" % min(cos) if cos else "-"))
        for key, m in r.meas.items():
            if key.startswith("d"):
                xo = ratio(m, s)
                tgt = "-" if math.isnan(xo) else "<=%.2f %s" % (m.density + 0.05,
                                                               "ok" if xo <= m.density + 0.05 else "MISS")
                sparse_rows.append("%s %.3f | %s | %s | %s | %s | %s |" % (
                    head, m.density, cell(m, f3(m.ms)), f3(xo) or "-", tgt,
                    "%.0f" % tflops(sh, m.ms) if m.ok else "-", "%.4f" % m.cos if not math.isnan(m.cos) else "-"))
            elif key == "pred":
                pred_rows.append("%s %s | %s | %s | %s | %s | %s |" % (
                    head, "%.3f" % m.density if not math.isnan(m.density) else "-", cell(m, f3(m.ms)),
                    f3(ratio(c, m)) or "-", f3(ratio(m, s)) or "-",
                    "%.0f" % tflops(sh, m.ms) if m.ok else "-", "%.4f" % m.cos if not math.isnan(m.cos) else "-"))
    if sparse_rows:
        lines += ["", "Random block masks (density over the causally visible blocks; x own dense = ms / libsparge "
                  "dense ms; target ms <= (d + 0.05) x own dense; TFLOPS dense-equivalent):", "",
                  "| B | H | N | D | causal | density | ms | x own dense | target | TFLOPS (dense-eq.) | min cos |",
                  "|---:|---:|---:|---:|:---:|---:|---:|---:|---|---:|---:|"] + sparse_rows
    if pred_rows:
        lines += ["", "Predicted call (mask=None, the footer's top-k and estimator; density as predicted; TFLOPS "
                  "dense-equivalent):", "",
                  "| B | H | N | D | causal | density | ms | x cuDNN | x own dense | TFLOPS (dense-eq.) | min cos |",
                  "|---:|---:|---:|---:|:---:|---:|---:|---:|---:|---:|---:|"] + pred_rows
    if notes:
        lines += [""] + ["[%d] %s (%s)" % (i + 1, text, "; ".join(shapes)) for i, (text, shapes) in
                         enumerate(notes.items())]
    lines += [""] + footer
    return "\n".join(lines) + "\n"


def target_counts(timed: List[ShapeResult]) -> str:
    """The design targets the grid measures, as counts of the shapes that meet them: dense x cuDNN
    >= 1.0 (every shape) and >= 1.5 (N >= 8K), sparse time <= (d + 0.05) x own dense (--sparse)."""
    dense = [(r.shape.N, ratio(r.get("cudnn"), r.get("sparge"))) for r in timed]
    dense = [(n, x) for n, x in dense if not math.isnan(x)]
    long = [x for n, x in dense if n >= 8192]
    text = ">= 1.0x on %d of %d, >= 1.5x at N >= 8K on %d of %d" % (
        sum(1 for _, x in dense if x >= 1.0), len(dense), sum(1 for x in long if x >= 1.5), len(long))
    sparse = [(m.density, ratio(m, r.get("sparge"))) for r in timed for k, m in r.meas.items()
              if k.startswith("d")]
    sparse = [(d, x) for d, x in sparse if not math.isnan(x) and not math.isnan(d)]
    if sparse:
        text += ", sparse <= (d + 0.05)x dense on %d of %d" % (sum(1 for d, x in sparse if x <= d + 0.05),
                                                              len(sparse))
    return text


def summary_line(results: List[ShapeResult], wall: float) -> Tuple[str, int, int]:
    timed = [r for r in results if r.meas and r.status not in ("skipped", "interrupted")]
    skipped = sum(1 for r in results if r.status in ("skipped", "interrupted"))
    errors = sum(1 for r in timed if any(m.error for m in r.meas.values()))
    fails = sum(1 for r in timed for m in r.meas.values() if not m.error and not m.check.startswith("ok"))
    sp_err = sum(1 for r in timed for k, m in r.meas.items() if m.error and k not in ("cudnn", "fa2"))
    rs = [x for x in (ratio(r.get("cudnn"), r.get("sparge")) for r in timed) if not math.isnan(x)]
    tail = ""
    if rs:
        tail = "; x cuDNN median %.2f, min %.2f, max %.2f" % (statistics.median(rs), min(rs), max(rs))
        tail += "; " + target_counts(timed)
    line = "grid: %d shapes timed, %d skipped, %d with errors, %d check failures%s; %.0f s" % (
        len(timed), skipped, errors, fails, tail, wall)
    return line, fails, sp_err


# ------------------------------------------------------------------ main
def make_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", help="libsparge.so to load (sets SPARGE_LIBRARY); default: $SPARGE_LIBRARY, else the "
                                  "newest build*/libsparge.so* of this checkout, else the package's own")
    ap.add_argument("--installed", action="store_true",
                    help="use the installed sparge package, not this checkout's bindings/python")
    ap.add_argument("--b", default="1,8,64", help="batch sizes (default 1,8,64)")
    ap.add_argument("--n", default="1k,2k,4k,8k,32k", help="sequence lengths N = Lq = Lkv (default 1k,2k,4k,8k,32k)")
    ap.add_argument("--d", default="128,64", help="head dims (default 128,64)")
    ap.add_argument("--causal", default="0,1", help="0 (non-causal), 1 (causal) or both (default 0,1)")
    ap.add_argument("--heads", default=DEFAULT_HEADS,
                    help="heads per head dim, D:H,... or one H for every D (default %s)" % DEFAULT_HEADS)
    ap.add_argument("--max-tokens", type=int, default=262144,
                    help="skip shapes with B*N above this (default 262144; 0 = no cap)")
    ap.add_argument("--precision", default="auto", help="libsparge precision (default auto: the library's choice "
                    "per shape, reported in the tables)")
    ap.add_argument("--sparse", action="store_true", help="add random block masks at N >= --sparse-min-n")
    ap.add_argument("--densities", default="0.5,0.2,0.1", help="densities of --sparse (default 0.5,0.2,0.1)")
    ap.add_argument("--sparse-min-n", type=int, default=8192, help="smallest N of --sparse (default 8192)")
    ap.add_argument("--pred", action="store_true", help="add the default predicted call (mask=None) at --topk")
    ap.add_argument("--topk", type=float, default=0.5, help="top-k of --pred (default 0.5)")
    ap.add_argument("--estimator", default="keys_lse",
                    help="estimator of --pred (default keys_lse; auto: the library's default of the mode)")
    ap.add_argument("--no-fa2", action="store_true", help="leave out the FLASH_ATTENTION backend")
    ap.add_argument("--warmup-ms", type=float, default=50.0, help="warm-up per measurement (default 50 ms, 2 calls "
                                                                  "at least)")
    ap.add_argument("--batches", type=int, default=7, help="timed batches per measurement (default 7; calls over "
                                                          "--measure-ms: 3 at least)")
    ap.add_argument("--batch-ms", type=float, default=25.0, help="target time of one batch (default 25 ms)")
    ap.add_argument("--max-calls", type=int, default=200, help="most calls in one batch (default 200)")
    ap.add_argument("--measure-ms", type=float, default=1500.0,
                    help="timed time per measurement above which batches are cut (default 1500 ms)")
    ap.add_argument("--min-cos", type=float, default=0.99, help="check bar (default 0.99)")
    ap.add_argument("--check-rows", type=int, default=64, help="query rows of the float32 check (default 64)")
    ap.add_argument("--seed", type=int, default=1, help="input seed (default 1)")
    ap.add_argument("--l2-mb", type=float, default=0.0, help="L2 size for the input-set rule (default: the "
                                                             "device's; %g in --dry-run)" % DEFAULT_L2_MB)
    ap.add_argument("--mem-gb", type=float, default=DEFAULT_MEM_GB,
                    help="device memory assumed by --dry-run (default %g)" % DEFAULT_MEM_GB)
    ap.add_argument("--budget-s", type=float, default=300.0,
                    help="wall-time budget: shapes that would not fit are skipped (default 300; 0 = none)")
    ap.add_argument("--commit", help="the library's commit for the footer (default: git rev-parse of this checkout)")
    ap.add_argument("--csv", help="write the results as CSV")
    ap.add_argument("--md", help="write the markdown tables (for docs/BENCHMARKS.md)")
    ap.add_argument("--dry-run", action="store_true", help="list the shapes with memory and time estimates; no GPU")
    return ap


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = make_parser()
    args = ap.parse_args(argv)
    try:
        args.b = [int(x) for x in args.b.split(",") if x.strip()]
        args.n = parse_sizes(args.n)
        args.d = [int(x) for x in args.d.split(",") if x.strip()]
        args.causal = [bool(int(x)) for x in args.causal.split(",") if x.strip()]
        args.heads = parse_heads(args.heads)
        args.densities = parse_floats(args.densities)
        for d in args.d:
            heads_for(d, args.heads)
    except ValueError as e:
        ap.error(str(e))
    if not args.b or not args.d or not args.causal or min(args.b) <= 0 or min(args.d) <= 0:
        ap.error("--b, --d and --causal need positive values")
    if any(not 0.0 < d <= 1.0 for d in args.densities) or not 0.0 < args.topk <= 1.0:
        ap.error("densities and --topk must lie in (0, 1]")
    if args.batches < 1 or args.max_calls < 1:
        ap.error("--batches and --max-calls must be at least 1")
    return args


def timing_opts(args: argparse.Namespace) -> TimingOpts:
    return TimingOpts(warmup_ms=args.warmup_ms, batches=args.batches, batch_ms=args.batch_ms,
                      max_calls=args.max_calls, measure_ms=args.measure_ms)


def libs_of(sh: Shape, args: argparse.Namespace) -> List[Tuple[str, float]]:
    return shape_libs(sh, args.sparse, args.densities, args.sparse_min_n, args.pred, args.topk, not args.no_fa2)


def dry_run(args: argparse.Namespace, grid: List[Shape]) -> int:
    o = timing_opts(args)
    l2 = int((args.l2_mb or DEFAULT_L2_MB) * 1e6)
    mem = args.mem_gb * GIB
    print("# grid (dry run): %s; B*N <= %s; precision %s; L2 %.0f MB, device memory %.0f GiB assumed" % (
        heads_text(args.d, args.heads), args.max_tokens or "any", args.precision, l2 / 1e6, args.mem_gb))
    print("# time estimate from assumed rates (TFLOPS, D>=128 / D<128): libsparge %g/%g, cuDNN %g/%g, FA2 %g/%g"
          % (_RATE["sparge"] + _RATE["cudnn"] + _RATE["fa2"]))
    total, runs, peak = 10.0, 0, 0.0
    for sh in grid:
        if sh.skip:
            print("  %s  skipped: %s" % (sh.label(), sh.skip))
            continue
        libs = libs_of(sh, args)
        nsets = input_sets(3 * sh.tensor_bytes, l2)
        n_masks = 2 + sum(1 for k, _ in libs if k == "sparse")
        m = memory_estimate(sh, nsets, n_masks, args.check_rows)
        est = estimate_seconds(sh, libs, o)
        peak = max(peak, m)
        flag = "  (over the assumed device memory: would be skipped)" if m > mem else ""
        if m > mem:
            print("  %s  skipped: needs about %.1f GiB%s" % (sh.label(), m / GIB, flag))
            continue
        runs += 1
        total += est
        print("  %s  sets %d  memory ~%6.2f GiB  sparge %8.3f ms  cuDNN %8.3f ms  est %5.1f s  [%s]" % (
            sh.label(), nsets, m / GIB, model_call_ms("sparge", sh), model_call_ms("cudnn", sh), est,
            ",".join(k if k != "sparse" else "d%g" % d for k, d in libs)))
    skipped = len(grid) - runs
    print("%d shapes to run, %d skipped; peak memory ~%.1f GiB; estimated wall time %.0f s (with ~10 s start-up)%s"
          % (runs, skipped, peak / GIB, total, "" if not args.budget_s or total <= args.budget_s else
             "; over --budget-s %g: the last shapes would be skipped" % args.budget_s))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    grid = build_grid(args.b, args.n, args.d, args.causal, args.heads, args.max_tokens)
    if args.dry_run:
        return dry_run(args, grid)

    t0 = time.perf_counter()
    if args.lib:
        os.environ["SPARGE_LIBRARY"] = os.path.abspath(args.lib)
    elif not os.environ.get("SPARGE_LIBRARY") and not args.installed:
        lib = newest_built_library()
        if lib:
            os.environ["SPARGE_LIBRARY"] = lib
    if not args.installed:
        sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))
    try:
        import torch
    except ImportError as e:
        print("grid: needs torch (%s)" % short(e))
        return 2

    if not torch.cuda.is_available():
        print("grid: no CUDA device (torch %s)" % torch.__version__)
        return 77
    try:
        env = Env.cuda(args)
        if not env.sparge.has_cuda():
            print("grid: %s has no CUDA backend" % env.sparge.library_path())
            return 2
    except Exception as e:  # noqa: BLE001
        print("grid: cannot load libsparge: %s" % short(e, 400))
        return 2
    signal.signal(signal.SIGTERM, _on_signal)
    o = timing_opts(args)
    p = env.props
    commit = args.commit or git_commit()
    gpu = p.name
    lib_path = env.sparge.library_path()
    header = ("libsparge %s (%s, dense call: top-k 1) against torch SDPA bf16 (cuDNN, FA2); %s; bf16 HND, "
              "N = Lq = Lkv; median ms per call" % (".".join(map(str, env.sparge.library_version())), args.precision,
                                           heads_text(args.d, args.heads)))
    print("# " + header)
    print("# %s (%d SMs, L2 %.0f MB, %.0f GiB), torch %s, CUDA %s, cuDNN %s, libsparge %s, commit %s" % (
        gpu, p.multi_processor_count, env.l2_bytes / 1e6, env.total_mem / GIB, torch.__version__,
        torch.version.cuda, torch.backends.cudnn.version(), lib_path, commit))
    sys.stdout.flush()

    results: List[ShapeResult] = []
    interrupted = False
    try:
        interrupted = run_grid(env, grid, args, o, t0, results)
    except (Interrupted, KeyboardInterrupt):
        interrupted = True
    for sh in grid[len(results):]:
        results.append(ShapeResult(sh, "skipped", sh.skip or "interrupted"))
    wall = time.perf_counter() - t0
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    footer = [
        "GPU: %s (%d SMs, L2 %.0f MB, %.0f GiB), driver %s; torch %s, CUDA %s, cuDNN %s; libsparge %s (%s), "
        "commit %s; %s." % (gpu, p.multi_processor_count, env.l2_bytes / 1e6, env.total_mem / GIB, driver_version(),
                            torch.__version__, torch.version.cuda, torch.backends.cudnn.version(),
                            ".".join(map(str, env.sparge.library_version())), os.path.basename(str(lib_path)),
                            commit, date),
        "Heads: %s (Hq = Hkv). Inputs bf16 random normal, HND [B, H, N, D]; calls rotate among 2-4 input sets "
        "when one set is small against the L2. libsparge: `sparge.attention(q, k, v, topk=1.0, is_causal=...)` "
        "eager, precision %s (the dense call); empty mask: an all-zeros block mask.%s cuDNN / FA2: "
        "`F.scaled_dot_product_attention` under `sdpa_kernel(CUDNN_ATTENTION / FLASH_ATTENTION)`."
        % (heads_text(args.d, args.heads), args.precision,
           " Predicted call: top-k %g, estimator %s." % (args.topk, args.estimator) if args.pred else ""),
        "Timing: warm-up, then %d batches of back-to-back calls (about %g ms each, at most %d calls; calls over "
        "%g ms / %d: fewer batches, 3 at least), one CUDA event pair per batch with the device idle at its "
        "start, batches of the libraries interleaved; median per-call ms. x cuDNN = cuDNN ms / libsparge ms "
        "(> 1: libsparge faster). TFLOPS = 4·B·H·N²·D (× 0.5 causal) / time. Check: cosine >= %g against "
        "float32 attention on %d sampled query rows and %s; empty mask: zeros. B·N <= %s. Wall time %.0f s."
        % (args.batches, args.batch_ms, args.max_calls, args.measure_ms, args.batches, args.min_cos,
           args.check_rows, "libsparge's full output against cuDNN's" if args.no_fa2 else
           "libsparge's and cuDNN's full outputs against FA2's", args.max_tokens or "any", wall),
    ]
    title = "### %s — benchmark grid (%s, one run, commit %s)\n\n%s." % (date[:10], gpu, commit, header)
    md = md_report(results, title, footer)
    print()
    print(md)
    line, fails, sp_err = summary_line(results, wall)
    if args.csv:
        write_csv(args.csv, csv_rows(results, gpu, commit))
        print("wrote %s" % args.csv)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)
        print("wrote %s" % args.md)
    print(line)
    return 1 if (fails or sp_err or interrupted) else 0


def run_grid(env: Env, grid: List[Shape], args: argparse.Namespace, o: TimingOpts, t0: float,
             results: List[ShapeResult]) -> bool:
    """Runs the shapes in order, appending to results; True when interrupted inside a shape."""
    est_sum = act_sum = 0.0
    for sh in grid:
        if sh.skip:
            results.append(ShapeResult(sh, "skipped", sh.skip))
            print("%s  skipped: %s" % (sh.label(), sh.skip))
            continue
        libs = libs_of(sh, args)
        est = estimate_seconds(sh, libs, o)
        corr = min(4.0, max(0.5, act_sum / est_sum)) if est_sum > 0 else 1.0
        elapsed = time.perf_counter() - t0
        if args.budget_s and elapsed + est * corr > args.budget_s:
            why = "budget: about %.0f s needed, %.0f s of --budget-s %g left" % (
                est * corr, max(0.0, args.budget_s - elapsed), args.budget_s)
            results.append(ShapeResult(sh, "skipped", why))
            print("%s  skipped: %s" % (sh.label(), why))
            continue
        nsets = input_sets(3 * sh.tensor_bytes, env.l2_bytes)
        need = memory_estimate(sh, nsets, 2 + sum(1 for k, _ in libs if k == "sparse"), args.check_rows)
        if need > env.total_mem:
            why = "needs about %.1f GiB, the device has %.1f GiB" % (need / GIB, env.total_mem / GIB)
            results.append(ShapeResult(sh, "skipped", why))
            print("%s  skipped: %s" % (sh.label(), why))
            continue
        s0 = time.perf_counter()
        try:
            r = run_shape(env, sh, args, o)
        except (Interrupted, KeyboardInterrupt):
            return True
        except Exception as e:  # noqa: BLE001 - one shape failing must not end the grid
            r = ShapeResult(sh, "error", short(e, 300))
        r.seconds = time.perf_counter() - s0
        est_sum += est
        act_sum += r.seconds
        results.append(r)
        print(progress_line(r))
        sys.stdout.flush()
        gc.collect()
        try:
            env.sparge.clear_caches()
            env.free()
        except Exception:  # noqa: BLE001
            pass
    return False


def progress_line(r: ShapeResult) -> str:
    sh = r.shape
    if r.status in ("skipped", "interrupted", "error") and not r.meas:
        return "%s  %s: %s" % (sh.label(), r.status, r.reason)
    parts = []
    for key, m in r.meas.items():
        if m.error:
            parts.append("%s error (%s)" % (key, m.error[:100]))
        else:
            flag = "" if m.check.startswith("ok") else " [check %s]" % (m.check or "not run")
            parts.append("%s %.3f%s" % (key, m.ms, flag))
    xr = ratio(r.get("cudnn"), r.get("sparge"))
    return "%s  sets %d  %s  x cuDNN %s  (%.1f s)" % (sh.label(), r.sets, "  ".join(parts),
                                                     "%.2f" % xr if not math.isnan(xr) else "-", r.seconds)


if __name__ == "__main__":
    sys.exit(main())
