#!/usr/bin/env python3
"""Runs the yardstick over captures for the tables and the plot of docs/ACCURACY.md ("Predicted
masks"): estimators x densities x sink / window settings, each beside the oracle of the same per-row
counts, and the oracle curve at uniform densities. Writes JSON (read by tools/accuracy/plot.py).

    python3 tools/accuracy/sweep.py CAPTURES.npz ... --json sweep.json [--heads N]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import yardstick as Y  # noqa: E402

CURVE = [0.05, 0.1, 0.2, 0.3, 0.5, 0.7]


def settings(causal: bool, full: bool):
    """The 0.1 defaults (no sink, no window), the current defaults (sink; window 2 when causal, 1
    otherwise) and sink / window variants with the mean rule; every estimator with the current defaults,
    among them "auto" (the default estimator of the mode: keys_lse when causal, keys_lse_adaptive
    otherwise); keys_lse with the other windows 0-3; top-k combined with top-p."""
    dens = CURVE if full else [0.2, 0.5]
    out = []
    sw = [(False, 0), (True, 0), (True, 1), (True, 2)] if causal else [(False, 0), (True, 0), (True, 1)]
    for t in dens:
        for s, w in sw:
            out.append(Y.Setting(topk=t, sink=s, window=w, estimator="mean"))
    for est in ["auto", "keys_lse", "pooledq_max", "rows4", "antidiag8", "keys_lse_split2", "keys_lse_adaptive"]:
        for t in dens if est in ("auto", "keys_lse") else [0.2, 0.5]:
            out.append(Y.Setting(topk=t, sink=None, window=None, estimator=est))
    for t in [0.2, 0.5]:
        for w in range(4):
            if w != Y.default_window(causal):
                out.append(Y.Setting(topk=t, sink=None, window=w, estimator="keys_lse"))
    for t in [0.2, 0.5]:
        for p in [0.9, 0.95]:
            out.append(Y.Setting(topk=t, topp=p, sink=None, window=None, estimator="mean"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("captures", nargs="+")
    ap.add_argument("--json", required=True)
    ap.add_argument("--heads", type=int, default=0)
    ap.add_argument("--full", action="store_true", help="every density of the curve for every estimator")
    a = ap.parse_args()
    out = []
    for path in a.captures:
        cap = Y.load(path)
        heads = range(min(a.heads, cap.Hq)) if a.heads else None
        t0 = time.time()
        st = settings(cap.causal, a.full)
        res = Y.evaluate(cap, st, heads, use_library=True,
                         progress=lambda i, n: print("\r  %s: head %d/%d" % (cap.name, i, n), end="", flush=True))
        curve = Y.oracle_curve(cap, CURVE, heads)
        print("\r  %s: %d settings in %.0f s" % (cap.name, len(st), time.time() - t0))
        z = __import__("numpy").load(path)
        out.append(dict(capture=cap.name, file=os.path.basename(path), causal=cap.causal,
                        model=str(z["model"]) if "model" in z.files else "",
                        layer=int(z["layer"]) if "layer" in z.files else -1,
                        layers=int(z["layers"]) if "layers" in z.files else -1,
                        L=int(cap.q.shape[1]), Hq=cap.Hq, Hkv=int(cap.k.shape[0]), D=int(cap.q.shape[2]),
                        rows=[dict(r.row(), estimator=r.setting.estimator, topk=r.setting.topk, topp=r.setting.topp,
                                   sink=r.setting.sink, window=r.setting.window) for r in res],
                        oracle_curve=[dict(s.as_dict(), target=d) for d, s in zip(CURVE, curve)]))
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
