#!/usr/bin/env python3
"""Plot and tables of docs/ACCURACY.md ("Predicted masks") from the JSON of tools/accuracy/sweep.py:
relative L1 against dense attention versus block density, per model and layer depth — the oracle
curve, the mean rule with the default sink and window, the same rule without sink or window
(the 0.1 defaults), the default estimator ("auto": keys_lse when causal, keys_lse_adaptive otherwise),
keys_lse and the other estimators.

    python3 tools/accuracy/plot.py sweep.json --png docs/accuracy-masks.png --markdown tables.md
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import yardstick as Y  # noqa: E402


def series(cap, estimator, sink, window):
    """The rows of one setting (sink / window None: the defaults of the mode), by density."""
    pts = [r for r in cap["rows"] if r["estimator"] == estimator and r["topp"] is None
           and r["sink"] == sink and r["window"] == window]
    pts.sort(key=lambda r: r["pred_density"])
    return [r["pred_density"] for r in pts], [r["pred_rel_l1"] for r in pts]


def plot(data, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(data)
    cols = min(3, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.6 * rows), squeeze=False)
    for ax, cap in zip(axes.ravel(), data):
        causal = cap["causal"]
        oc = sorted(cap["oracle_curve"], key=lambda r: r["density"])
        ax.plot([r["density"] for r in oc], [r["rel_l1"] for r in oc], "k-", lw=2, label="oracle")
        x, y = series(cap, "mean", False, 0)
        ax.plot(x, y, "r--o", ms=3, label="mean, no sink/window (0.1 defaults)")
        x, y = series(cap, "mean", True, Y.default_window(causal))
        ax.plot(x, y, "b-o", ms=3, label="mean, defaults")
        x, y = series(cap, "keys_lse", None, None)
        ax.plot(x, y, "g-s", ms=3, label="keys_lse, defaults")
        x, y = series(cap, "auto", None, None)
        if x:
            ax.plot(x, y, "m:^", ms=3, label="default estimator (auto), defaults")
        ax.set_yscale("log")
        ax.set_xlim(0, 0.75)
        ax.set_title(cap["capture"], fontsize=9)
        ax.set_xlabel("block density")
        ax.set_ylabel("rel. L1 vs dense")
        ax.grid(alpha=0.3)
    for ax in axes.ravel()[n:]:
        ax.axis("off")
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=90)


def _find(cap, est, topk, sink, window, topp=None):
    for r in cap["rows"]:
        if r["estimator"] == est and r["topk"] == topk and r["sink"] == sink and r["window"] == window \
                and r["topp"] == topp:
            return r
    return None


def _find_default(cap, topk):
    """The default estimator's row ("auto"; sweeps without it: the estimator it resolves to)."""
    return _find(cap, "auto", topk, None, None) or _find(cap, Y.default_estimator(cap["causal"]), topk, None, None)


def tables(data):
    """Three markdown tables: the defaults against the oracle, the estimators, keys_lse's windows."""
    out = ["| capture | top-k | mean, no sink, no window: density / rel. L1 / ×oracle | mean, default sink and "
           "window: density / rel. L1 / oracle / ×oracle | the default estimator (auto): rel. L1 / ×oracle "
           "| zero rows |",
           "|---|---:|---|---|---|---:|"]
    for cap in data:
        s, w = Y.default_sink(cap["causal"]), Y.default_window(cap["causal"])
        for t in (0.2, 0.5):
            old, new, lse = _find(cap, "mean", t, False, 0), _find(cap, "mean", t, s, w), _find_default(cap, t)
            if not (old and new and lse):
                continue
            zero = old["pred_zero_rows"] + new["pred_zero_rows"] + lse["pred_zero_rows"]
            out.append("| %s | %.1f | %.3f / %.3f / %.2f× | %.3f / %.4f / %.4f / **%.2f×** | %.4f / **%.2f×** | %d |" % (
                cap["capture"], t, old["pred_density"], old["pred_rel_l1"], old["ratio_l1"], new["pred_density"],
                new["pred_rel_l1"], new["oracle_rel_l1"], new["ratio_l1"], lse["pred_rel_l1"], lse["ratio_l1"], zero))
    out += ["", "| capture | top-k | mean | keys_lse | pooled Q vs keys, max | 4 sampled rows | antidiagonal, stride 8 "
            "| keys_lse_split2 | keys_lse_adaptive | mean, top-p 0.9 (density) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for cap in data:
        s, w = Y.default_sink(cap["causal"]), Y.default_window(cap["causal"])
        for t in (0.2, 0.5):
            cells = []
            for est in ("mean", "keys_lse", "pooledq_max", "rows4", "antidiag8", "keys_lse_split2", "keys_lse_adaptive"):
                r = _find(cap, est, t, s, w) if est == "mean" else _find(cap, est, t, None, None)
                cells.append("%.2f×" % r["ratio_l1"] if r else "—")
            r = _find(cap, "mean", t, None, None, 0.9)
            cells.append("%.2f× (%.3f)" % (r["ratio_l1"], r["pred_density"]) if r else "—")
            out.append("| %s | %.1f | %s |" % (cap["capture"], t, " | ".join(cells)))
    out += ["", "| capture | top-k | keys_lse, window 0 | window 1 | window 2 | window 3 |",
            "|---|---:|---:|---:|---:|---:|"]
    for cap in data:
        dw = Y.default_window(cap["causal"])
        for t in (0.2, 0.5):
            cells = []
            for w in range(4):
                r = _find(cap, "keys_lse", t, None, None if w == dw else w)
                cells.append(("**%.3f×**" if w == dw else "%.3f×") % r["ratio_l1"] if r else "—")
            out.append("| %s | %.1f | %s |" % (cap["capture"], t, " | ".join(cells)))
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json")
    ap.add_argument("--png")
    ap.add_argument("--markdown")
    a = ap.parse_args()
    with open(a.json) as f:
        data = json.load(f)
    if a.png:
        plot(data, a.png)
    md = tables(data)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(md)
    else:
        sys.stdout.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
