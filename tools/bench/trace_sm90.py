#!/usr/bin/env python3
"""Where an sm_90a attention CTA's time goes: reads the stamps a trace build writes.

Build with -DSPARGE_SM90_TRACE=ON (CMake), run with SPARGE_SM90_TRACE_OUT=FILE and
SPARGE_GRAPHS=0 (e.g. `sparge_bench --modes fp16full ... --warmup 1 --min-iters 3 --max-iters 3`;
the last launch of the process is the one in FILE; replayed graphs write none), then
`trace_sm90.py FILE [FILE ...]`.
The slot layout is documented in src/cuda/attention/sm90/trace.cuh. Figures are medians
over the CTAs, in SM clock cycles.
"""
import statistics
import struct
import sys
from collections import defaultdict

SLOTS = 32


def load(path):
    data = open(path, "rb").read()
    n = struct.unpack("<I", data[:4])[0]
    v = struct.unpack("<%dQ" % (n * SLOTS), data[4:4 + n * SLOTS * 8])
    return [v[i * SLOTS:(i + 1) * SLOTS] for i in range(n)]


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def sums(rows):
    for wg in (0, 1):
        b = 16 + 8 * wg
        rs = [r for r in rows if r[b + 3]]
        if not rs:
            continue
        wait, turn, epi, steps, nrows = (sum(r[b + k] for r in rs) for k in range(5))
        epi_txt = f"  epilogue {epi / nrows:.0f}/row" if epi else ""
        print(f"  warpgroup {wg}: data waits {wait / steps:.0f}/step  turns {turn / steps:.0f}/step{epi_txt}"
              f"  ({steps} steps, {nrows} rows)")


def events(rows):
    ok = [r for r in rows if r[1] and r[3] and r[8]]
    if not ok:
        return False
    print(f"  steps per CTA {med([r[2] >> 32 for r in ok]):.0f}")
    names = ["start -> Q", "Q -> first K", "first K -> first QK", "loop", "last PV", "epilogue"]
    for wg in (0, 1):
        b = 3 + 6 * wg
        prev = [1] + [b + e for e in range(5)]
        cols = []
        for e, name in enumerate(names):
            xs = [r[b + e] - r[prev[e]] for r in ok if r[b + e] and r[prev[e]]]
            cols.append(f"{name} {med(xs):.0f}")
        per_step = med([(r[b + 3] - r[b + 2]) / max(1, (r[2] >> 32) - 1) for r in ok if r[b + 3] and r[b + 2]])
        print(f"  warpgroup {wg}: " + "  ".join(cols) + f"  ({per_step:.0f}/step)")
    by_sm = defaultdict(list)
    for r in ok:
        by_sm[r[2] & 0xFFFFFFFF].append(r)
    gaps, rates = [], []
    for rs in by_sm.values():
        rs.sort(key=lambda r: r[1])
        ends = [max(r[8], r[14]) for r in rs]
        gaps += [b2[1] - e for e, b2 in zip(ends, rs[1:])]
        g_span = max(r[15] for r in rs) - rs[0][0]
        if g_span > 0:
            rates.append((max(ends) - rs[0][1]) / g_span)
    print(f"  previous CTA's end -> next CTA's start on an SM: {med(gaps):.0f}  (SM clock ≈ {med(rates):.2f} GHz)")
    return True


def main(paths):
    for path in paths:
        rows = load(path)
        print(f"== {path}: {len(rows)} CTAs")
        if not events(rows):
            print("  persistent CTAs (no per-row events)")
        sums(rows)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
