#!/usr/bin/env python3
"""The PV skip (``sparge_predict_params_t.pv_threshold``) on captured activations: its output error
and how much work it would save (docs/ACCURACY.md, "PV skip").

For each capture, precision (INT8_FP8, FP16), mask (every visible block; the default predicted
mask at top-k 0.5) and threshold tau (off and the list of --taus, natural-log units):

- the output of the library's CPU backend (float16 inputs and output; the CPU twin is the
  specification of the skip), with the relative L1 error ``sum|o - ref| / sum|ref|`` against float64
  attention on the same mask, and the error the skip adds, ``sum|o_tau - o_off| / sum|ref|``
  (o_off: the same precision with the skip off);
- the skip statistics, emulated in numpy in float32 with the kernels' rule (not bit for bit: the
  int8 kernels take the row max on quantized scores, this emulation on float32 scores). Per query
  row the listed 64-key tiles of its 128-row block are visited in ascending order, S tiles per step;
  a row skips a step when the step's max of t = scale*log2(e)*q.k is below m - tau*log2(e), m the
  running max of the earlier steps (a row without a usable key in the step skips it once m is
  finite). Counted: (row, step) pairs where the row has a key, and (16-row warp, step) and (64-row
  warpgroup, step) pairs where some row of the group has a key; "skipped" for a warp or a warpgroup
  means every row of it skips (on sm_90a: the exponentials of a warp, the P.V product of a
  warpgroup). Rows past the end of Q (the last block's padding) never skip. The steps S: INT8_FP8
  2 tiles; FP16 3 tiles (the sm_90a two-consumer kernel at D = 64, which masked calls run), and
  with --fp16-steps also 1 (the short-row kernel) and 2 (dense calls of the three-consumer kernel);
- the error the skip adds, emulated in float64 from the same float32 scores and skips, on the CPU
  backend's steps (a check of the emulated rule against the library) and on the GPU's steps (FP16:
  3 tiles where the CPU backend steps one).

    python3 tools/accuracy/pv_sweep.py [CAPTURES.npz ...] [--json out.json] [--markdown out.md]

Without captures it reads tests/data/captures/*.npz (under a minute on two cores). It prints the tables of
docs/ACCURACY.md, then one row per (capture, mask, precision, tau) with every column. The 4K captures
of docs/ACCURACY.md (tools/accuracy/capture.py smollm2 --tokens 4096 --layers 3 15 27, dinov2
--image-size 896 --layers 2 6 10) take about 4 minutes each. The library is $SPARGE_LIBRARY, else
build-cpu/libsparge.so of this checkout (cmake -S . -B build-cpu -G Ninja -DSPARGE_CUDA=OFF &&
ninja -C build-cpu). Deterministic: no random input.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import time
from typing import Dict, List, Sequence

import numpy as np

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BQ, BK = 128, 64
LOG2E = math.log2(math.e)
TAUS = [1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 16.0]
STEPS = {"int8_fp8": 2, "fp16": 3}  # listed 64-key tiles per step of the sm_90a kernels at D = 64 (masked calls)
CPU_STEPS = {"int8_fp8": 2, "fp16": 1}  # the CPU backend's steps (FP16: one tile)


def _library():
    if not os.environ.get("SPARGE_LIBRARY"):
        lib = os.path.join(ROOT, "build-cpu", "libsparge.so")
        if os.path.isfile(lib):
            os.environ["SPARGE_LIBRARY"] = lib
    sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))
    import sparge  # noqa: F401
    from sparge import _capi as C
    return sparge, C


sparge, C = _library()


# ------------------------------------------------------------------ captures and masks
class Cap:
    def __init__(self, path: str):
        z = np.load(path, allow_pickle=False)
        self.path = path
        self.q = np.ascontiguousarray(z["q"].astype(np.float16))  # [Hq, L, D]
        self.k = np.ascontiguousarray(z["k"].astype(np.float16))  # [Hkv, Lkv, D]
        self.v = np.ascontiguousarray(z["v"].astype(np.float16))
        self.causal = bool(z["causal"])
        self.Hq, self.L, self.D = self.q.shape
        self.Hkv, self.Lkv = self.k.shape[:2]
        self.scale = float(z["scale"]) if "scale" in z.files else 1.0 / math.sqrt(self.D)
        self.model = str(z["model"]) if "model" in z.files else ""
        self.layer = int(z["layer"]) if "layer" in z.files else -1
        self.layers = int(z["layers"]) if "layers" in z.files else -1
        self.name = str(z["name"]) if "name" in z.files else os.path.basename(path)
        self.nqb, self.nkb = -(-self.L // BQ), -(-self.Lkv // BK)

    def label(self) -> str:
        m = {"smollm2": "SmolLM2-135M", "dinov2": "DINOv2 ViT-S/14"}.get(self.model, self.model or self.name)
        lay = " layer %d/%d" % (self.layer, self.layers) if self.layer >= 0 else ""
        return "%s%s, L=%d" % (m, lay, self.L)

    def visible_until(self, i: np.ndarray) -> np.ndarray:
        """Last key (exclusive bound) that rows i see."""
        if not self.causal:
            return np.full(i.shape, self.Lkv)
        return np.clip(i + (self.Lkv - self.L) + 1, 0, self.Lkv)


def dense_mask(cap: Cap) -> np.ndarray:
    """Every visible block: [Hq, nQB, nKB] uint8."""
    last = np.minimum(np.arange(cap.nqb) * BQ + BQ, cap.L) - 1
    n = -(-cap.visible_until(last) // BK)
    m = (np.arange(cap.nkb)[None, :] < n[:, None]).astype(np.uint8)
    return np.ascontiguousarray(np.broadcast_to(m, (cap.Hq, cap.nqb, cap.nkb)))


def predicted_mask(cap: Cap, topk: float) -> np.ndarray:
    """The library's mask (CPU backend) with the defaults but top-k: [Hq, nQB, nKB] uint8."""
    m = sparge.predict_mask(cap.q[None], cap.k[None], topk=topk, is_causal=cap.causal, scale=cap.scale)
    return np.ascontiguousarray(np.asarray(m)[0].astype(np.uint8))


def key_ok(cap: Cap, r0: int, r1: int, mask_row: np.ndarray) -> np.ndarray:
    """[r1 - r0, Lkv] bool: the keys rows r0..r1 use under a block row of the mask."""
    cols = np.repeat(mask_row.astype(bool), BK)[: cap.Lkv]
    ok = np.broadcast_to(cols, (r1 - r0, cap.Lkv))
    if cap.causal:
        ok = ok & (np.arange(cap.Lkv)[None, :] < cap.visible_until(np.arange(r0, r1))[:, None])
    return ok


# ------------------------------------------------------------------ float64 reference
def reference(cap: Cap, mask: np.ndarray) -> np.ndarray:
    g = cap.Hq // cap.Hkv
    out = np.zeros((cap.Hq, cap.L, cap.D))
    for h in range(cap.Hq):
        q = cap.q[h].astype(np.float64)
        k = cap.k[h // g].astype(np.float64)
        v = cap.v[h // g].astype(np.float64)
        for qb in range(cap.nqb):
            r0, r1 = qb * BQ, min(cap.L, qb * BQ + BQ)
            s = (q[r0:r1] @ k.T) * cap.scale
            s = np.where(key_ok(cap, r0, r1, mask[h, qb]), s, -np.inf)
            mx = s.max(axis=1, keepdims=True)
            p = np.exp(s - np.where(np.isfinite(mx), mx, 0.0))
            tot = p.sum(axis=1, keepdims=True)
            out[h, r0:r1] = (p @ v) / np.where(tot > 0, tot, 1.0)
    return out


# ------------------------------------------------------------------ the library
def run_library(cap: Cap, mask: np.ndarray, precision: str, tau: float) -> np.ndarray:
    """The CPU backend on the mask with pv_threshold = tau (sparge.block_sparse_attention): [Hq, L, D] float32."""
    out = sparge.block_sparse_attention(cap.q[None], cap.k[None], cap.v[None], np.ascontiguousarray(mask[None]),
                                        is_causal=cap.causal, scale=cap.scale, layout="HND", precision=precision,
                                        pv_threshold=float(tau))
    return np.asarray(out)[0].astype(np.float32)


# ------------------------------------------------------------------ skip statistics (emulated)
def skip_stats(cap: Cap, mask: np.ndarray, steps: Sequence[int], taus: Sequence[float],
               emulate: Sequence[int] = ()) -> Dict:
    """{S: {tau: dict(rows, rows_skip, warps, warps_skip, groups, groups_skip[, added])}} over all heads.
    For S in emulate also "added": sum|o_tau - o_off| / sum|o_off| of the output computed in float64
    from the float32 scores with the emulated skips (o_off: no skip), the error the skip adds with
    steps of S tiles."""
    g = cap.Hq // cap.Hkv
    c = np.float32(cap.scale) * np.float32(LOG2E)
    tau2 = {t: np.float32(np.float32(t) * np.float32(LOG2E)) for t in taus}
    acc = {S: {t: dict(rows=0, rows_skip=0, warps=0, warps_skip=0, groups=0, groups_skip=0, num=0.0)
               for t in taus} for S in steps}
    den = 0.0
    pad = cap.nkb * BK - cap.Lkv
    for h in range(cap.Hq):
        q = cap.q[h].astype(np.float32)
        k = cap.k[h // g].astype(np.float32)
        v = cap.v[h // g].astype(np.float64)
        if pad:
            v = np.concatenate([v, np.zeros((pad, cap.D))])
        for qb in range(cap.nqb):
            r0, r1 = qb * BQ, min(cap.L, qb * BQ + BQ)
            nr = r1 - r0
            tiles = np.nonzero(mask[h, qb])[0]
            if tiles.size == 0:
                continue
            t = (q[r0:r1] @ k.T) * c
            t = np.where(key_ok(cap, r0, r1, mask[h, qb]), t, np.float32(-np.inf))
            if pad:
                t = np.concatenate([t, np.full((nr, pad), -np.inf, np.float32)], axis=1)
            tl = t.reshape(nr, cap.nkb, BK)[:, tiles]  # [rows, listed tiles, 64]
            tmax = tl.max(axis=2)
            if nr < BQ:  # padding rows: no key, never skip
                tmax = np.concatenate([tmax, np.full((BQ - nr, tiles.size), -np.inf, np.float32)])
            real = np.arange(BQ) < nr
            if emulate:
                t64 = tl.reshape(nr, -1).astype(np.float64)
                rmax = t64.max(axis=1, keepdims=True)
                rmax = np.where(np.isfinite(rmax), rmax, 0.0)
                vl = v.reshape(cap.nkb, BK, cap.D)[tiles].reshape(-1, cap.D)

                def out(rows, keep=None):
                    tt = t64[rows] if keep is None else np.where(keep, t64[rows], -np.inf)
                    p = np.exp2(tt - rmax[rows])
                    s = p.sum(axis=1, keepdims=True)
                    return (p @ vl) / np.where(s > 0, s, 1.0)
                o_off = out(np.arange(nr))
                den += float(np.abs(o_off).sum())
            for S in steps:
                n = -(-tiles.size // S)
                tm = np.concatenate([tmax, np.full((BQ, n * S - tiles.size), -np.inf, np.float32)], axis=1)
                sx = tm.reshape(BQ, n, S).max(axis=2)  # the step's max, -inf without a key
                mb = np.concatenate([np.full((BQ, 1), -np.inf, np.float32),
                                     np.maximum.accumulate(sx, axis=1)[:, :-1]], axis=1)  # m before the step
                used = sx > -np.inf
                for tau in taus:
                    skip = (mb > -np.inf) & (sx < mb - tau2[tau]) & real[:, None]
                    a = acc[S][tau]
                    a["rows"] += int(used.sum())
                    a["rows_skip"] += int((skip & used).sum())
                    for name, w in (("warps", 16), ("groups", 64)):
                        act = used.reshape(BQ // w, w, n).any(axis=1)
                        all_skip = skip.reshape(BQ // w, w, n).all(axis=1)
                        a[name] += int(act.sum())
                        a[name + "_skip"] += int((act & all_skip).sum())
                    if S in emulate:
                        rows = np.nonzero((skip & used)[:nr].any(axis=1))[0]
                        if rows.size:
                            keep = np.repeat(~skip[rows], S * BK, axis=1)[:, : tiles.size * BK]
                            a["num"] += float(np.abs(out(rows, keep) - o_off[rows]).sum())
    for S in steps:
        for tau in taus:
            a = acc[S][tau]
            if S in emulate:
                a["added"] = a["num"] / max(den, 1e-300)
            del a["num"]
    return acc


# ------------------------------------------------------------------ the sweep
def rel_l1(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a - ref).sum() / np.abs(ref).sum())


def sweep(cap: Cap, taus: Sequence[float], fp16_steps: Sequence[int], topk: float, log) -> List[Dict]:
    rows = []
    masks = [("dense", dense_mask(cap)), ("topk %.1f" % topk, predicted_mask(cap, topk))]
    for mname, mask in masks:
        vis = int(dense_mask(cap).sum())
        density = float(mask.sum()) / vis
        t0 = time.time()
        ref = reference(cap, mask)
        ref32 = ref.astype(np.float32)
        log("  %s, %s: density %.3f, reference %.1f s" % (cap.label(), mname, density, time.time() - t0))
        for prec in ("int8_fp8", "fp16"):
            steps = [STEPS[prec]] + ([S for S in fp16_steps if S != STEPS[prec]] if prec == "fp16" else [])
            if CPU_STEPS[prec] not in steps:
                steps.append(CPU_STEPS[prec])
            t0 = time.time()
            st = skip_stats(cap, mask, steps, taus, emulate=sorted({STEPS[prec], CPU_STEPS[prec]}))
            off = run_library(cap, mask, prec, 0.0)
            rows.append(dict(capture=cap.label(), file=os.path.basename(cap.path), causal=cap.causal, mask=mname,
                             density=density, precision=prec, tau=0.0, rel_l1=rel_l1(off, ref32), added_l1=0.0,
                             step=STEPS[prec], cpu_step=CPU_STEPS[prec]))
            for tau in taus:
                o = run_library(cap, mask, prec, tau)
                r = dict(rows[-1], tau=tau, rel_l1=rel_l1(o, ref32),
                         added_l1=float(np.abs(o - off).sum() / np.abs(ref32).sum()))
                for S in steps:
                    a = st[S][tau]
                    r["steps%d" % S] = dict(row=a["rows_skip"] / max(a["rows"], 1),
                                            warp=a["warps_skip"] / max(a["warps"], 1),
                                            group=a["groups_skip"] / max(a["groups"], 1))
                    if "added" in a:
                        r["steps%d" % S]["added"] = a["added"]
                rows.append(r)
            log("  %s, %s, %s: %d calls in %.1f s" % (cap.label(), mname, prec, len(taus) + 1, time.time() - t0))
    return rows


def pct(x: float) -> str:
    return "%.1f" % (100.0 * x)


def markdown(rows: List[Dict], fp16_steps: Sequence[int]) -> str:
    out = ["| capture | mask (density) | precision | tau | rel. L1 vs float64 | added rel. L1, library "
           "(CPU steps) | added, emulated (CPU steps) | added, emulated (GPU steps) | (row, step) skipped % | "
           "(warp, step) all skip % | (warpgroup, step) all skip % |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["tau"] == 0.0:
            out.append("| %s | %s (%.3f) | %s | off | %.5f | - | - | - | - | - | - |"
                       % (r["capture"], r["mask"], r["density"], r["precision"], r["rel_l1"]))
            continue
        s = r["steps%d" % r["step"]]
        out.append("| %s | %s (%.3f) | %s | %g | %.5f | %.2e | %.2e | %.2e | %s | %s | %s |"
                   % (r["capture"], r["mask"], r["density"], r["precision"], r["tau"], r["rel_l1"], r["added_l1"],
                      r["steps%d" % r["cpu_step"]]["added"], s["added"], pct(s["row"]), pct(s["warp"]),
                      pct(s["group"])))
    Ss = sorted(set(fp16_steps) | {STEPS["fp16"]})
    if len(Ss) > 1:
        out += ["", "FP16, (warp, step) / (warpgroup, step) all skip % by tiles per step S:", "",
                "| capture | mask | tau | " + " | ".join("S=%d" % S for S in Ss) + " |",
                "|---|---|---:|" + "---:|" * len(Ss)]
        for r in rows:
            if r["precision"] == "fp16" and r["tau"] > 0.0:
                out.append("| %s | %s | %g | %s |" % (
                    r["capture"], r["mask"], r["tau"],
                    " | ".join("%s / %s" % (pct(r["steps%d" % S]["warp"]), pct(r["steps%d" % S]["group"]))
                               for S in Ss)))
    return "\n".join(out) + "\n"


def _e(x: float) -> str:
    return "0" if x == 0.0 else ("%.1e" % x).replace("e-0", "e-")


def summary(rows: List[Dict], work_taus: Sequence[float] = (6.0, 8.0, 10.0, 12.0)) -> str:
    """The tables of docs/ACCURACY.md ("PV skip"): the added error per tau (bold: below a tenth of
    INT8_FP8's own error against float64 on the same capture and mask), and the work skipped."""
    own = {(r["capture"], r["mask"], r["precision"]): r for r in rows if r["tau"] == 0.0}
    taus = sorted({r["tau"] for r in rows if r["tau"] > 0.0})
    at = {(r["capture"], r["mask"], r["precision"], r["tau"]): r for r in rows if r["tau"] > 0.0}
    out = ["| capture | mask (density) | precision | rel. L1, skip off | " +
           " | ".join("tau %g" % t for t in taus) + " |", "|---|---|---|---:|" + "---:|" * len(taus)]
    for key, r0 in own.items():
        bar = 0.1 * own[(key[0], key[1], "int8_fp8")]["rel_l1"]
        cells = []
        for t in taus:
            x = at[key + (t,)]["added_l1"]
            cells.append("**%s**" % _e(x) if x < bar else _e(x))
        out.append("| %s | %s (%.3f) | %s | %.5f | %s |" % (key[0], key[1], r0["density"], key[2], r0["rel_l1"],
                                                          " | ".join(cells)))
    wt = [t for t in work_taus if t in taus]
    out += ["", "| capture | mask | precision (tiles per step) | " +
            " | ".join("tau %g: rows / warps / warpgroups %%" % t for t in wt) + " |",
            "|---|---|---|" + "---:|" * len(wt)]
    for key in own:
        cells = []
        for t in wt:
            r = at[key + (t,)]
            s = r["steps%d" % r["step"]]
            cells.append("%s / %s / %s" % (pct(s["row"]), pct(s["warp"]), pct(s["group"])))
        out.append("| %s | %s | %s (%d) | %s |" % (key[0], key[1], key[2], at[key + (wt[0],)]["step"],
                                                   " | ".join(cells)))
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("captures", nargs="*", help="default: tests/data/captures/*.npz")
    ap.add_argument("--taus", type=float, nargs="+", default=TAUS, help="pv_threshold values (nats)")
    ap.add_argument("--topk", type=float, default=0.5, help="top-k of the predicted mask")
    ap.add_argument("--fp16-steps", type=int, nargs="*", default=[1, 2, 3],
                    help="FP16 tiles per step for the statistics (3: the masked-call kernel)")
    ap.add_argument("--json", help="write the rows as JSON")
    ap.add_argument("--markdown", help="write the table as markdown")
    a = ap.parse_args()
    paths = a.captures or sorted(glob.glob(os.path.join(ROOT, "tests", "data", "captures", "*.npz")))
    if not paths:
        print("pv_sweep: no captures")
        return 2
    print("pv_sweep: %s" % C.library_path())
    rows: List[Dict] = []
    t0 = time.time()
    for p in paths:
        rows += sweep(Cap(p), a.taus, a.fp16_steps, a.topk, lambda s: print(s, flush=True))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=1)
    md = summary(rows) + "\n" + markdown(rows, a.fp16_steps)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(md)
    print(md)
    print("pv_sweep: %d captures in %.0f s" % (len(paths), time.time() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
