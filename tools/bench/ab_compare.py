#!/usr/bin/env python3
"""A/B of two libsparge builds on the same GPU in one run: runs each build's
sparge_bench (each linked to its own build's library) on the same workloads, alternating A, B, A, B ... (`--rounds`), so
clock and thermal drift fall on both alike, and prints per workload the median
of each side's medians, the change, and the spread between a side's own rounds
(a difference smaller than that spread is noise).

  python3 tools/bench/ab_compare.py --a OLD/tools/bench/sparge_bench \\
      --b NEW/tools/bench/sparge_bench --rounds 3 --csv ab.csv -- --modes dense,i8f16 --n 8k,32k

Arguments after `--` go to both sparge_bench runs unchanged.
"""
import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile


def run(bench, args, tag, out_csv):
    cmd = [bench, "--csv", out_csv, "--tag", tag] + args
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        sys.stdout.write(r.stdout[-4000:])
        raise SystemExit(f"{bench} exited {r.returncode}")
    rows = {}
    with open(out_csv) as f:
        for row in csv.DictReader(f):
            key = (row["mode"], row["precision"], int(row["N"]), int(row["D"]), int(row["causal"]), row["density"])
            try:
                ms = float(row["ms"])
            except ValueError:
                continue
            if ms == ms:  # not NaN
                rows[key] = ms
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True, help="sparge_bench of build A (the baseline)")
    ap.add_argument("--b", required=True, help="sparge_bench of build B")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--csv", help="write the comparison as CSV")
    ap.add_argument("bench_args", nargs=argparse.REMAINDER)
    o = ap.parse_args()
    args = o.bench_args[1:] if o.bench_args[:1] == ["--"] else o.bench_args
    res = {"A": [], "B": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(o.rounds):
            for side, bench in (("A", o.a), ("B", o.b)):
                res[side].append(run(bench, args, f"{side}{r}", os.path.join(tmp, f"{side}{r}.csv")))
                print(f"round {r + 1}/{o.rounds} {side} done", flush=True)
    keys = sorted(set().union(*[set(x) for x in res["A"] + res["B"]]))
    out = []
    print("\n| mode | precision | N | D | causal | density | A ms | B ms | B/A - 1 | spread A | spread B |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for k in keys:
        a = [x[k] for x in res["A"] if k in x]
        b = [x[k] for x in res["B"] if k in x]
        if not a or not b:
            continue
        ma, mb = statistics.median(a), statistics.median(b)
        sa = (max(a) - min(a)) / ma if ma else 0.0
        sb = (max(b) - min(b)) / mb if mb else 0.0
        d = mb / ma - 1.0
        out.append(list(k) + [ma, mb, d, sa, sb])
        print(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {k[4]} | {k[5]} | {ma:.4f} | {mb:.4f} | {100 * d:+.2f} % |"
              f" {100 * sa:.2f} % | {100 * sb:.2f} % |")
    if out:
        ds = [r[8] for r in out]
        print(f"\n{len(out)} workloads: median change {100 * statistics.median(ds):+.2f} %, "
              f"worst {100 * max(ds):+.2f} %, best {100 * min(ds):+.2f} %")
    if o.csv:
        with open(o.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["mode", "precision", "N", "D", "causal", "density", "a_ms", "b_ms", "change", "spread_a",
                        "spread_b"])
            w.writerows(out)


if __name__ == "__main__":
    main()
