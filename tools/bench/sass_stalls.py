#!/usr/bin/env python3
"""Summarize Nsight Compute's per-SASS-instruction view (sass_source.csv) of one kernel: where the warps stall.

Input: the CSV that `ncu -i report.ncu-rep --page source --csv --print-source sass` prints (the `ncusrc` stage of
tools/gpu_check.sh writes it as sass_source.csv): a "Kernel Name" line, a header, one row per instruction with its
address, source text, executed count, "Warp Stall Sampling (All Samples)" and one column per stall reason
(stall_wait, stall_barrier, ...). It prints

  loop     the instructions that share the execution count (within --loop-tol) with the most executed
           instructions in all (count x instructions: the body of the kernel's main loop, rather than a spin loop of
           a few instructions that runs more often or straight-line code that runs once per warp): how many per
           warp and iteration, and their share of the samples;
  opcodes  samples per opcode (the mnemonic before the first dot) over the whole kernel, with instruction counts;
  reasons  samples per stall reason over the whole kernel;
  top      the --top instructions with the most samples, each with the reasons that hold >= 10 % of its samples.

Runs without a GPU:

  python3 tools/bench/sass_stalls.py sass_source.csv --top 25
"""

from __future__ import annotations

import argparse
import csv
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def number(text: str) -> float:
    """A CSV cell as a number ('-' and empty cells are 0; thousands separators dropped)."""
    text = (text or "").replace(",", "").strip()
    if text in ("", "-"):
        return 0.0
    try:
        return float(text)
    except ValueError:
        return 0.0


def opcode(source: str) -> str:
    """The mnemonic of one SASS line ('@!P0 BRA 0x10' -> 'BRA', 'HGMMA.64x128x16.F32' -> 'HGMMA')."""
    words = [w for w in source.split() if not w.startswith("@")]
    return words[0].split(".")[0] if words else "?"


def load(path: str) -> tuple:
    """(kernel name, [row dicts]) from an ncu source-page CSV."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    kernel = ""
    start = 0
    if rows and rows[0] and rows[0][0] == "Kernel Name":
        kernel = rows[0][1] if len(rows[0]) > 1 else ""
        start = 1
    if len(rows) <= start or "Address" not in rows[start] or "Source" not in rows[start]:
        raise ValueError("%s: no 'Address' / 'Source' header (not ncu --page source --csv output)" % path)
    header = rows[start]
    out = []
    for r in rows[start + 1:]:
        if len(r) != len(header):
            continue
        out.append(dict(zip(header, r)))
    if not out:
        raise ValueError("%s: no instruction rows" % path)
    if SAMPLES not in header:
        raise ValueError("%s: no '%s' column (profile with --set full or the source counters)" % (path, SAMPLES))
    return kernel, out


def summarize(rows: list, loop_tol: float = 0.01, top: int = 20) -> dict:
    """The numbers the report prints (also what the tests check)."""
    reasons = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    total = sum(number(r[SAMPLES]) for r in rows)
    executed = [number(r.get(EXECUTED, "")) for r in rows]
    # The execution count whose instructions execute the most in all (ties: the larger count).
    sizes: dict = {}
    for e in executed:
        if e > 0:
            sizes[e] = sizes.get(e, 0) + 1
    anchor = 0.0
    best = -1.0
    for e in sorted(sizes):
        weight = sum(c * n for c, n in sizes.items() if abs(c - e) <= loop_tol * e)
        if weight >= best:
            best, anchor = weight, e
    group = {c: n for c, n in sizes.items() if abs(c - anchor) <= loop_tol * anchor}
    # Reported: the count most of the group's instructions have (ties: the smaller).
    most = min(group, key=lambda c: (-group[c], c)) if group else 0.0
    loop = [r for r, e in zip(rows, executed) if e in group]
    by_op: dict = {}
    for r in rows:
        op = opcode(r["Source"])
        n, s = by_op.get(op, (0, 0.0))
        by_op[op] = (n + 1, s + number(r[SAMPLES]))
    by_reason = {k: sum(number(r[k]) for r in rows) for k in reasons}
    hot = sorted(rows, key=lambda r: -number(r[SAMPLES]))[:top]
    return {
        "total": total,
        "loop_count": len(loop),
        "loop_executions": most,
        "loop_samples": sum(number(r[SAMPLES]) for r in loop),
        "by_op": by_op,
        "by_reason": by_reason,
        "hot": hot,
        "reasons": reasons,
    }


def pct(x: float, total: float) -> str:
    return "%5.1f %%" % (100.0 * x / total) if total > 0 else "    - "


def report(kernel: str, s: dict, out=sys.stdout) -> None:
    total = s["total"]
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p("kernel: %s" % (kernel or "(unnamed)"))
    p("stall samples: %d" % total)
    p("loop: %d instructions executed %d times each (per warp and iteration), %s of the samples"
      % (s["loop_count"], s["loop_executions"], pct(s["loop_samples"], total).strip()))
    p("\nopcodes (whole kernel):")
    for op, (n, smp) in sorted(s["by_op"].items(), key=lambda kv: -kv[1][1])[:20]:
        p("  %-14s %5d instr  %s" % (op, n, pct(smp, total)))
    p("\nstall reasons (whole kernel):")
    for k, v in sorted(s["by_reason"].items(), key=lambda kv: -kv[1]):
        if v > 0:
            p("  %-22s %s" % (k[len("stall_"):], pct(v, total)))
    p("\ntop instructions:")
    for r in s["hot"]:
        smp = number(r[SAMPLES])
        why = " ".join("%s=%d" % (k[len("stall_"):], number(r[k])) for k in s["reasons"] if number(r[k]) >= 0.1 * smp > 0)
        p("  %-14s %s  x%-10d %-58s %s" % (r["Address"][-8:], pct(smp, total), number(r.get(EXECUTED, "")),
                                           r["Source"].strip()[:58], why))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="sass_source.csv (ncu --page source --csv --print-source sass)")
    ap.add_argument("--top", type=int, default=20, help="instructions to list (20)")
    ap.add_argument("--loop-tol", type=float, default=0.01,
                    help="the loop: instructions executed at least (1 - tol) x the largest count (0.01)")
    a = ap.parse_args()
    if a.top < 0 or not 0.0 <= a.loop_tol < 1.0:
        ap.error("--top must be >= 0 and --loop-tol in [0, 1)")
    try:
        kernel, rows = load(a.csv)
    except (OSError, ValueError) as e:
        print("sass_stalls: %s" % e, file=sys.stderr)
        return 2
    report(kernel, summarize(rows, a.loop_tol, a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
