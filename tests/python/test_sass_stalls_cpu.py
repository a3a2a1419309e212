"""tools/bench/sass_stalls.py without a GPU: an ncu source-page CSV parsed, the main loop found by its dynamic
instruction count (not a spin loop that runs more often, not straight-line code), samples per opcode and reason,
the hottest instructions, and refusals of what is not such a CSV."""

import csv
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "bench", "sass_stalls.py")
sys.path.insert(0, os.path.join(ROOT, "tools", "bench"))

import sass_stalls  # noqa: E402

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
          "Instructions Executed", "stall_barrier", "stall_wait", "stall_long_sb", "stall_wait (Not Issued)"]


def _write(path, rows, kernel="void k<(int)128>(Params)"):
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["Kernel Name", kernel, ""])
        w.writerow(HEADER)
        for i, (src, samples, executed, barrier, wait, long_sb) in enumerate(rows):
            w.writerow(["0x%x" % (0x1000 + 16 * i), "      " + src, samples, samples // 2, executed, barrier, wait,
                        long_sb, wait // 2])
    return str(path)


ROWS = [
    # prologue: 6 instructions once per warp (weight 6 x 10 = 60)
    ("LDC R1, c[0x0][0x28]", 5, 10, 0, 5, 0),
    ("S2R R0, SR_TID.X", 3, 10, 0, 3, 0),
    ("ULDC.64 UR6, c[0x0][0x500]", 2, 10, 0, 2, 0),
    ("IMAD R2, R0, 0x4, RZ", 1, 10, 0, 1, 0),
    ("ISETP.NE.AND P0, PT, R0, RZ, PT", 1, 10, 0, 1, 0),
    ("BAR.SYNC.DEFER_BLOCKING 0x0", 8, 10, 8, 0, 0),
    # the main loop: 4 instructions, 1000 and 1001 times (weight 4004)
    ("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR16], RZ, !UPT", 120, 1000, 100, 20, 0),
    ("WARPGROUP.DEPBAR.LE gsb0, 0x1", 300, 1000, 290, 10, 0),
    ("FMNMX R13, R12, R13, !PT", 60, 1001, 0, 60, 0),
    ("MUFU.EX2 R43, R43", 90, 1000, 0, 80, 10),
    # a producer's spin: 2 instructions, 1500 times (weight 3000)
    ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR8+0x38018], R3", 10, 1500, 0, 10, 0),
    ("@!P0 BRA 0x1000", 400, 1500, 0, 0, 400),
]


def test_summary_numbers(tmp_path):
    kernel, rows = sass_stalls.load(_write(tmp_path / "s.csv", ROWS))
    assert kernel == "void k<(int)128>(Params)"
    assert len(rows) == len(ROWS)
    s = sass_stalls.summarize(rows, loop_tol=0.01, top=3)
    assert s["total"] == 1000
    assert s["loop_count"] == 4 and s["loop_executions"] == 1000
    assert s["loop_samples"] == 120 + 300 + 60 + 90
    assert s["by_op"]["HGMMA"] == (1, 120) and s["by_op"]["BRA"] == (1, 400) and s["by_op"]["WARPGROUP"] == (1, 300)
    assert s["by_reason"] == {"stall_barrier": 398, "stall_wait": 192, "stall_long_sb": 410}
    assert [r["Source"].strip() for r in s["hot"]] == ["@!P0 BRA 0x1000", "WARPGROUP.DEPBAR.LE gsb0, 0x1",
                                                        "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR16], RZ, !UPT"]
    # With no tolerance the 1001-times FMNMX is a loop of its own and the 3-instruction set (3000) ties the spin:
    # the larger count wins.
    s0 = sass_stalls.summarize(rows, loop_tol=0.0, top=3)
    assert s0["loop_count"] == 2 and s0["loop_executions"] == 1500


def test_report_and_refusals(tmp_path):
    good = _write(tmp_path / "s.csv", ROWS)
    r = subprocess.run([sys.executable, TOOL, good, "--top", "2"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "loop: 4 instructions executed 1000 times each" in r.stdout
    assert "57.0 % of the samples" in r.stdout
    assert "long_sb=400" in r.stdout and "barrier=290" in r.stdout
    top = r.stdout.split("top instructions:")[1].strip().splitlines()
    assert len(top) == 2

    bad = tmp_path / "bad.csv"
    bad.write_text("kind,B,H\ndense,1,2\n")
    r = subprocess.run([sys.executable, TOOL, str(bad)], capture_output=True, text=True)
    assert r.returncode == 2 and "no 'Address' / 'Source' header" in r.stderr
    r = subprocess.run([sys.executable, TOOL, str(tmp_path / "missing.csv")], capture_output=True, text=True)
    assert r.returncode == 2 and "sass_stalls:" in r.stderr
    r = subprocess.run([sys.executable, TOOL, good, "--loop-tol", "1.5"], capture_output=True, text=True)
    assert r.returncode == 2 and "--loop-tol" in r.stderr
