#!/usr/bin/env python3
"""Compare libsparge's times between grid runs (tools/bench/grid.py --csv): A against B, shape by shape.

Each side is one or more CSV files of the same grid (e.g. alternating runs of one library with and without a
developer switch, or of two libraries); a row's time on a side is the mean of its runs. Rows are matched by kind
(dense, sparse, pred), B, H, N, D, causal and, for sparse rows, the mask density to two decimals; the empty-mask
time of each dense row is compared as its own kind (empty). It prints every matched row (the times of each run, and
B / A) and, per kind, the median, smallest and largest B / A (< 1: B faster), and writes them as CSV with --csv.
Runs without a GPU:

  python3 tools/bench/grid_compare.py --a tma1.csv tma2.csv --b direct1.csv direct2.csv --names tma,direct
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys


def load(paths: list) -> dict:
    """{key: [ms of each file]} for one side."""
    out: dict = {}
    for path in paths:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                if not row.get("sparge_ms") or row.get("status", "ok") not in ("ok", ""):
                    continue
                kind = row["kind"]
                dens = "%.2f" % float(row["density"]) if kind == "sparse" and row.get("density") else ""
                base = (row["B"], row["H"], row["N"], row["D"], row["causal"], dens)
                out.setdefault((kind,) + base, []).append(float(row["sparge_ms"]))
                if kind == "dense" and row.get("empty_ms"):
                    out.setdefault(("empty",) + base, []).append(float(row["empty_ms"]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", nargs="+", required=True, help="grid CSVs of side A (the baseline)")
    ap.add_argument("--b", nargs="+", required=True, help="grid CSVs of side B")
    ap.add_argument("--names", default="A,B", help="the two sides' names for the output (default A,B)")
    ap.add_argument("--csv", help="write the matched rows with their ratio")
    args = ap.parse_args()
    na, nb = (args.names.split(",") + ["A", "B"])[:2]
    a, b = load(args.a), load(args.b)
    keys = [k for k in a if k in b]
    if not keys:
        print("grid_compare: no row is in both sides", file=sys.stderr)
        return 1
    rows = []
    print("%-7s %-22s %-5s %-18s %-18s %7s" % ("kind", "BxHxNxD", "causal", na + " ms", nb + " ms", nb + "/" + na))
    for k in keys:
        kind, B, H, N, D, causal, dens = k
        r = statistics.mean(b[k]) / statistics.mean(a[k])
        rows.append((k, r))
        shape = "%sx%sx%sx%s%s" % (B, H, N, D, (" d=" + dens) if dens else "")
        print("%-7s %-22s %-5s %-18s %-18s %7.3f" % (kind, shape, causal, " ".join("%.3f" % t for t in a[k]),
                                                   " ".join("%.3f" % t for t in b[k]), r))
    print()
    for kind in ("dense", "sparse", "pred", "empty"):
        rs = [r for k, r in rows if k[0] == kind]
        if rs:
            print("%-7s %3d rows: %s/%s median %.3f, min %.3f, max %.3f" % (kind, len(rs), nb, na, statistics.median(rs),
                                                                      min(rs), max(rs)))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["kind", "B", "H", "N", "D", "causal", "density", na + "_ms", nb + "_ms", "ratio"])
            for k, r in rows:
                w.writerow(list(k) + [statistics.mean(a[k]), statistics.mean(b[k]), "%.4f" % r])
    return 0


if __name__ == "__main__":
    sys.exit(main())
