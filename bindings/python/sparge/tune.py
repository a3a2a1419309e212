"""``sparge tune``: per-head prediction settings that meet an accuracy target at the lowest density.

From Q, K, V captured from a model's attention layers (``capture`` below, or tools/accuracy/capture.py),
for each layer it searches, with the yardstick (``sparge.yardstick``: float64 dense attention as the
reference, masks from ``sparge.predict_mask`` on the CPU backend):

- per layer: the attention sink and local window (one value per call in the C ABI), the mode (top-k or
  CDF) and the block-importance estimator (keys_lse, keys_lse_adaptive, keys_lse_split2 or mean);
- per query head: the top-k fraction or CDF threshold and the self-similarity threshold,

the combination of lowest block density whose output meets the target on every capture of the
layer: relative L1 ``sum|o - ref| / sum|ref| <= target`` or cosine ``>= target``. A head that meets it
with no candidate keeps every block (top-k 1). The result is a text file (format below) that the
Python package (``load_tuned``) and the Rust crate (``sparge::tuned``) read.

File format (UTF-8 text, one item per line, ``#`` starts a comment)::

    sparge-tune 1
    layer NAME heads HQ causal 0|1 mode topk|cdf sink 0|1 window W estimator keys_lse|keys_lse_adaptive|keys_lse_split2|mean
    topk V1 ... VHQ                  (mode topk; or: cdf_threshold V1 ... VHQ)
    sim_threshold V1 ... VHQ
    measured rel_l1|cosine VALUE density VALUE target VALUE
    end

NAME has no spaces; layers appear in any order, each once. A layer line without the ``estimator``
pair (as written before ``sparge tune`` chose the estimator) means ``mean``. The file always names a
concrete estimator, never ``auto`` (a ``TunedLayer`` whose estimator is ``"auto"``, the library's default,
is written as the estimator that resolves to for its ``causal`` flag).

    python3 -m sparge tune CAPTURES.npz ... --rel-l1 0.05 --out tuned.txt     (or: sparge tune ...)
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from . import yardstick as Y

TOPK_GRID = (0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
CDF_GRID = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995)
SIM_GRID = (-0.1, 0.5)


# ------------------------------------------------------------------ file format
@dataclass
class TunedLayer:
    name: str
    heads: int
    causal: bool
    mode: str  # "topk" or "cdf"
    sink: bool
    window: int
    values: List[float]  # per head: top-k fraction or CDF threshold
    sim_threshold: List[float]
    estimator: str = "auto"  # the library's default; written as the estimator it resolves to for `causal`
    metric: str = "rel_l1"
    measured: float = float("nan")
    density: float = float("nan")
    target: float = float("nan")

    def kwargs(self) -> Dict[str, Any]:
        """Keyword arguments of sparge.attention / sparge.predict_mask."""
        kw: Dict[str, Any] = dict(attention_sink=self.sink, local_window=self.window,
                                  sim_threshold=list(self.sim_threshold), estimator=self.estimator)
        if self.mode == "topk":
            kw.update(mode="topk", topk=list(self.values))
        else:
            kw.update(mode="cdf", cdf_threshold=list(self.values))
        return kw


def write_tuned(path: str, layers: Sequence[TunedLayer]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write("sparge-tune 1\n")
        for t in layers:
            if not t.name or any(c.isspace() for c in t.name):
                raise ValueError("layer name %r: expected a non-empty name without spaces" % t.name)
            f.write("layer %s heads %d causal %d mode %s sink %d window %d estimator %s\n"
                    % (t.name, t.heads, int(t.causal), t.mode, int(t.sink), t.window,
                       Y.resolve_estimator(t.estimator, t.causal)))
            f.write("%s %s\n" % ("topk" if t.mode == "topk" else "cdf_threshold", " ".join("%.6g" % v for v in t.values)))
            f.write("sim_threshold %s\n" % " ".join("%.6g" % v for v in t.sim_threshold))
            f.write("measured %s %.6g density %.6g target %.6g\n" % (t.metric, t.measured, t.density, t.target))
            f.write("end\n")


class TunedFileError(ValueError):
    pass


def load_tuned(path: str) -> Dict[str, TunedLayer]:
    """Reads a ``sparge tune`` file: {layer name: TunedLayer}; ``.kwargs()`` gives the call's arguments."""
    with open(path, encoding="utf-8") as f:
        lines = [(i + 1, ln.split("#", 1)[0].split()) for i, ln in enumerate(f)]
    lines = [(i, w) for i, w in lines if w]

    def err(i: int, msg: str) -> TunedFileError:
        return TunedFileError("%s:%d: %s" % (path, i, msg))

    if not lines or lines[0][1] != ["sparge-tune", "1"]:
        raise err(lines[0][0] if lines else 1, "expected the header 'sparge-tune 1'")
    out: Dict[str, TunedLayer] = {}
    cur: Optional[Dict[str, Any]] = None
    for i, w in lines[1:]:
        key = w[0]
        if key == "layer":
            if cur is not None:
                raise err(i, "'layer' before the previous layer's 'end'")
            if len(w) == 12:  # written before the estimator was chosen: the default then, mean
                w = w + ["estimator", "mean"]
            if len(w) != 14 or w[2::2] != ["heads", "causal", "mode", "sink", "window", "estimator"]:
                raise err(i, "expected 'layer NAME heads H causal 0|1 mode topk|cdf sink 0|1 window W "
                             "estimator keys_lse|keys_lse_adaptive|keys_lse_split2|mean'")
            try:
                heads, causal, sink, window = int(w[3]), int(w[5]), int(w[9]), int(w[11])
            except ValueError:
                raise err(i, "heads, causal, sink and window must be integers") from None
            if heads < 1 or causal not in (0, 1) or sink not in (0, 1) or not 0 <= window <= 1024:
                raise err(i, "heads >= 1, causal and sink 0 or 1, window in [0, 1024] expected")
            if w[7] not in ("topk", "cdf"):
                raise err(i, "mode must be topk or cdf, got %r" % w[7])
            if w[13] not in ("keys_lse", "keys_lse_adaptive", "keys_lse_split2", "mean"):
                raise err(i, "estimator must be keys_lse, keys_lse_adaptive, keys_lse_split2 or mean, got %r"
                          % w[13])
            if w[1] in out:
                raise err(i, "layer %r appears twice" % w[1])
            cur = dict(name=w[1], heads=heads, causal=bool(causal), mode=w[7], sink=bool(sink), window=window,
                       estimator=w[13])
        elif cur is None:
            raise err(i, "%r outside a layer" % key)
        elif key in ("topk", "cdf_threshold", "sim_threshold"):
            want = "sim_threshold" if key == "sim_threshold" else ("topk" if cur["mode"] == "topk" else "cdf_threshold")
            if key != want:
                raise err(i, "%r in a layer of mode %s" % (key, cur["mode"]))
            try:
                vals = [float(x) for x in w[1:]]
            except ValueError:
                raise err(i, "%s: expected numbers" % key) from None
            if len(vals) != cur["heads"]:
                raise err(i, "%s has %d values, expected %d (heads)" % (key, len(vals), cur["heads"]))
            if key != "sim_threshold" and not all(0.0 < v <= 1.0 for v in vals):
                raise err(i, "%s values must be in (0, 1]" % key)
            if any(v != v for v in vals):
                raise err(i, "%s: NaN" % key)
            cur["sim_threshold" if key == "sim_threshold" else "values"] = vals
        elif key == "measured":
            if len(w) != 7 or w[3] != "density" or w[5] != "target" or w[1] not in ("rel_l1", "cosine"):
                raise err(i, "expected 'measured rel_l1|cosine V density V target V'")
            cur.update(metric=w[1], measured=float(w[2]), density=float(w[4]), target=float(w[6]))
        elif key == "end":
            if "values" not in cur or "sim_threshold" not in cur:
                raise err(i, "layer %r lacks its per-head values" % cur["name"])
            out[cur["name"]] = TunedLayer(**cur)
            cur = None
        else:
            raise err(i, "unknown item %r" % key)
    if cur is not None:
        raise err(lines[-1][0], "layer %r has no 'end'" % cur["name"])
    return out


# ------------------------------------------------------------------ capture helper
def capture(q: Any, k: Any, v: Any, path: str, *, is_causal: bool = False, scale: Optional[float] = None,
            layout: str = "HND", name: str = "", batch: int = 0) -> str:
    """Saves one attention call's inputs (numpy arrays or torch tensors, [B, H, L, D] for HND or
    [B, L, H, D] for NHD) for ``sparge tune``; one batch entry (``batch``). Returns the path."""
    def host(x):
        if hasattr(x, "detach"):
            x = x.detach().float().cpu().numpy()
        x = np.asarray(x, dtype=np.float32)
        if x.ndim != 4:
            raise ValueError("expected 4-D tensors, got shape %s" % (x.shape,))
        return x[batch] if layout == "HND" else x[batch].transpose(1, 0, 2)
    qh, kh, vh = host(q), host(k), host(v)
    if qh.shape[0] % kh.shape[0] or kh.shape != vh.shape or qh.shape[2] != kh.shape[2]:
        raise ValueError("inconsistent shapes q %s, k %s, v %s" % (qh.shape, kh.shape, vh.shape))
    cap = Y.Capture(qh, kh, vh, bool(is_causal), name or os.path.splitext(os.path.basename(path))[0], scale)
    Y.save(path, cap)
    return path


# ------------------------------------------------------------------ search
@dataclass
class _Cand:
    sink: bool
    window: int
    mode: str
    value: float
    sim: float
    estimator: str
    metric: np.ndarray = field(default=None)   # [captures, heads]
    density: np.ndarray = field(default=None)  # [captures, heads]


def _meets(metric: str, value: float, target: float) -> bool:
    return value <= target if metric == "rel_l1" else value >= target


def tune_layer(name: str, caps: Sequence[Y.Capture], metric: str, target: float, progress=None,
               topk_grid=TOPK_GRID, cdf_grid=CDF_GRID, sim_grid=SIM_GRID) -> TunedLayer:
    causal = caps[0].causal
    Hq = caps[0].Hq
    if any(c.causal != causal or c.Hq != Hq for c in caps):
        raise ValueError("layer %s: captures differ in causality or head count" % name)
    sw = [(True, 1), (True, 2), (False, 1)] if causal else [(False, 0), (True, 0), (False, 1), (True, 1)]
    # the cheapest first: keys_lse wins ties; keys_lse_adaptive before keys_lse_split2, so that where the two
    # give the same density (adaptive splits the blocks that matter) the cheaper one wins. The file names the
    # concrete estimator, never "auto"
    ests = ("keys_lse", "keys_lse_adaptive", "keys_lse_split2", "mean")
    cands = [_Cand(s, w, "topk", t, sim, e) for e in ests for s, w in sw for t in topk_grid for sim in sim_grid]
    cands += [_Cand(s, w, "cdf", c, sim, e) for e in ests for s, w in sw for c in cdf_grid for sim in sim_grid]
    for c in cands:
        c.metric = np.zeros((len(caps), Hq))
        c.density = np.zeros((len(caps), Hq))
    steps, done = len(caps) * Hq, 0
    for ci, cap in enumerate(caps):
        Lq, Lkv = cap.q.shape[1], cap.k.shape[1]
        vis = Y.visible(Lq, Lkv, cap.causal)
        masks = []
        for c in cands:
            st = Y.Setting(topk=c.value if c.mode == "topk" else None, cdf=c.value, sink=c.sink, window=c.window,
                           estimator=c.estimator)
            masks.append(_library_mask(cap, st, c.sim))
        for h in range(Hq):
            hp = Y.head_pass(cap, h)
            for c, m in zip(cands, masks):
                s = Y.score_mask(hp, m[h], vis)
                c.metric[ci, h] = s.rel_l1 if metric == "rel_l1" else s.cosine
                c.density[ci, h] = s.density
            done += 1
            if progress:
                progress(name, done, steps)
    best: Optional[tuple] = None
    # estimator outermost: every keys_lse group is visited before any other, so that a tie (equal
    # density, the first minimum wins) goes to keys_lse whatever the sink, window and mode
    for est, (s, w), mode in ((e, x, m) for e in ests for x in sw for m in ("topk", "cdf")):
        group = [c for c in cands if c.sink == s and c.window == w and c.mode == mode and c.estimator == est]
        vals, sims, dens = [], [], []
        for h in range(Hq):
            worst = [c.metric[:, h].max() if metric == "rel_l1" else c.metric[:, h].min() for c in group]
            ok = [(c.density[:, h].mean(), i) for i, c in enumerate(group) if _meets(metric, worst[i], target)]
            if ok:
                d, i = min(ok)
                vals.append(group[i].value)
                sims.append(group[i].sim)
                dens.append(d)
            else:  # nothing meets the target: keep every block
                vals.append(1.0)
                sims.append(-0.1)
                dens.append(1.0)
        total = float(np.mean(dens))
        if best is None or total < best[0] - 1e-12:
            best = (total, s, w, mode, vals, sims, est)
    total, s, w, mode, vals, sims, est = best
    layer = TunedLayer(name, Hq, causal, mode, s, w, vals, sims, est, metric, target=target)
    # the chosen per-head settings, measured on every capture in one library call each
    worst, dsum, n = None, 0.0, 0
    for cap in caps:
        res = _evaluate_layer(cap, layer)
        v = res.rel_l1 if metric == "rel_l1" else res.cosine
        worst = v if worst is None else (max(worst, v) if metric == "rel_l1" else min(worst, v))
        dsum += res.density
        n += 1
    layer.measured, layer.density = float(worst), dsum / n
    return layer


def _library_mask(cap: Y.Capture, st: Y.Setting, sim) -> np.ndarray:
    from . import _api
    kw = dict(is_causal=cap.causal, scale=cap.sc, precision="exact", attention_sink=st.sink,
              local_window=st.window, sim_threshold=sim, estimator=st.estimator)
    if st.topk is not None:
        kw.update(topk=st.topk)
    else:
        kw.update(mode="cdf", cdf_threshold=st.cdf)
    q = np.ascontiguousarray(cap.q[None].astype(np.float32))
    k = np.ascontiguousarray(cap.k[None].astype(np.float32))
    return np.asarray(_api.predict_mask(q, k, **kw))[0]


def _evaluate_layer(cap: Y.Capture, layer: TunedLayer) -> Y.Score:
    from . import _api
    q = np.ascontiguousarray(cap.q[None].astype(np.float32))
    k = np.ascontiguousarray(cap.k[None].astype(np.float32))
    mask = np.asarray(_api.predict_mask(q, k, is_causal=cap.causal, scale=cap.sc, precision="exact",
                                        **layer.kwargs()))[0]
    vis = Y.visible(cap.q.shape[1], cap.k.shape[1], cap.causal)
    tot = Y.Score()
    for h in range(cap.Hq):
        tot.add(Y.score_mask(Y.head_pass(cap, h), mask[h], vis))
    return tot


def _progress(name: str, done: int, total: int) -> None:
    width = 30
    fill = int(width * done / max(1, total))
    sys.stderr.write("\r  %-24s [%s%s] %d/%d heads" % (name[:24], "#" * fill, "." * (width - fill), done, total))
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _clean_name(s: str) -> str:
    out = "".join(ch if ch.isalnum() or ch in "_-." else "_" for ch in s)
    while "__" in out:
        out = out.replace("__", "_")
    return out.strip("_") or "layer"


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="sparge tune", description=__doc__.split("\n\n")[0])
    ap.add_argument("captures", nargs="+", help=".npz captures (sparge.tune.capture); captures with the same "
                                                "layer name are tuned together")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--rel-l1", type=float, help="target: relative L1 vs dense attention <= this")
    g.add_argument("--cosine", type=float, help="target: cosine vs dense attention >= this")
    ap.add_argument("--out", required=True, help="the tuned-settings file to write")
    a = ap.parse_args(argv)
    metric, target = ("rel_l1", a.rel_l1) if a.rel_l1 is not None else ("cosine", a.cosine)
    groups: Dict[str, List[Y.Capture]] = {}
    for p in a.captures:
        cap = Y.load(p)
        name = _clean_name(cap.name or os.path.splitext(os.path.basename(p))[0])
        groups.setdefault(name, []).append(cap)
    t0 = time.time()
    layers = []
    for name, caps in groups.items():
        t = tune_layer(name, caps, metric, target, progress=_progress)
        layers.append(t)
        print("  %-24s %s, mode %s, sink %d, window %d: density %.3f, %s %.4f (target %g)"
              % (name[:24], t.estimator, t.mode, t.sink, t.window, t.density, metric, t.measured, target))
    write_tuned(a.out, layers)
    print("wrote %s (%d layers, %.0f s)" % (a.out, len(layers), time.time() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
