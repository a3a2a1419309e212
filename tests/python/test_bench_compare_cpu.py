"""tools/bench/grid_compare.py without a GPU: rows matched across grid CSVs (sparse rows by density to two
decimals, each dense row's empty-mask time as a kind of its own), each side's runs averaged, rows that were
skipped or failed their check left out, and the per-kind summary."""

import csv
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "bench", "grid_compare.py")
COLS = ["kind", "B", "H", "N", "D", "causal", "precision", "density", "sparge_ms", "empty_ms", "status"]


def _write(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLS)
        w.writeheader()
        for r in rows:
            w.writerow(dict(zip(COLS, r)))
    return str(path)


def _row(kind, density, ms, empty="", status="ok", N="256"):
    return [kind, "1", "2", N, "64", "0", "fp16", density, ms, empty, status]


def test_matches_averages_and_summarises(tmp_path):
    a = _write(tmp_path / "a.csv", [
        _row("dense", "1.000", "1.0", "0.10"),
        _row("sparse", "0.499", "0.60"),
        _row("pred", "0.500", "0.70"),
        _row("dense", "1.000", "", status="skipped", N="8192"),
        _row("dense", "1.000", "0.50", "0.20", status="FAIL", N="512"),
    ])
    b1 = _write(tmp_path / "b1.csv", [_row("dense", "1.000", "1.1", "0.05"), _row("sparse", "0.501", "0.30"),
                                      _row("dense", "1.000", "0.40", "0.10", N="512")])
    b2 = _write(tmp_path / "b2.csv", [_row("dense", "1.000", "1.3", "0.05"), _row("sparse", "0.500", "0.30")])
    out = tmp_path / "cmp.csv"
    r = subprocess.run([sys.executable, TOOL, "--a", a, "--b", b1, b2, "--names", "base,new", "--csv", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    got = {(x["kind"], x["N"], x["density"]): float(x["ratio"]) for x in csv.DictReader(open(out))}
    # dense: (1.1 + 1.3) / 2 against 1.0; its empty mask 0.05 against 0.10; sparse 0.499 ~ 0.501 ~ 0.500;
    # pred only in A, the skipped and the failed rows nowhere.
    assert got == {("dense", "256", ""): 1.2, ("empty", "256", ""): 0.5, ("sparse", "256", "0.50"): 0.5}
    assert "dense     1 rows: new/base median 1.200" in r.stdout
    assert "pred" not in r.stdout.split("\n\n")[-1]


def test_no_common_row_is_an_error(tmp_path):
    a = _write(tmp_path / "a.csv", [_row("dense", "1.000", "1.0")])
    b = _write(tmp_path / "b.csv", [_row("dense", "1.000", "1.0", N="512")])
    r = subprocess.run([sys.executable, TOOL, "--a", a, "--b", b], capture_output=True, text=True)
    assert r.returncode == 1 and "no row is in both sides" in r.stderr
