"""Library loading, version check, declarations and struct layouts."""

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

import sparge
from sparge import _capi

PKG = os.path.dirname(os.path.dirname(os.path.abspath(sparge.__file__)))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_py(code, env_extra):
    env = dict(os.environ)
    env.update(env_extra)
    env["PYTHONPATH"] = PKG + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=120)


def test_loads_and_reports_version():
    assert sparge.library_version()[:2] == _capi.PACKAGE_VERSION[:2]
    assert os.path.exists(sparge.library_path()) or "libsparge" in sparge.library_path()
    assert sparge.has_cuda() in (True, False)


def test_missing_library_lists_places_tried():
    r = run_py("""
        import sparge
        try:
            sparge.library_version()
        except sparge.LibraryNotFoundError as e:
            print("ERR", e)
        """, {"SPARGE_LIBRARY": "/nonexistent/libsparge.so"})
    assert r.returncode == 0, r.stderr
    assert "ERR" in r.stdout and "/nonexistent/libsparge.so" in r.stdout and "SPARGE_LIBRARY" in r.stdout


def test_search_order_without_env():
    r = run_py("""
        import os
        os.environ.pop("SPARGE_LIBRARY", None)
        from sparge import _capi
        for where, name in _capi._candidates():
            print(where, "|", name)
        """, {"SPARGE_LIBRARY": ""})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("package copy")
    assert any("find_library" in l for l in lines) and any("libsparge.so.0.1" in l for l in lines)


def test_version_mismatch_refused():
    r = run_py("""
        from sparge import _capi
        _capi.PACKAGE_VERSION = (9, 9, 0)
        try:
            _capi.lib.load()
        except _capi.VersionMismatchError as e:
            print("ERR", e)
        """, {})
    assert r.returncode == 0, r.stderr
    assert "ERR" in r.stdout and "major.minor" in r.stdout and "9.9.0" in r.stdout


def test_every_header_function_declared():
    lib = _capi.lib.load()
    for name, (restype, argtypes) in _capi._PROTOTYPES.items():
        fn = getattr(lib, name)
        assert fn.argtypes == argtypes and fn.restype == restype
    # every sparge_* prototype in the header has an entry
    import re

    hdr = open(os.path.join(ROOT, "include", "sparge", "sparge.h")).read()
    names = set(re.findall(r"SPARGE_API\s+[\w\s\*]+?\b(sparge_\w+)\s*\(", hdr))
    assert names == set(_capi._PROTOTYPES), names ^ set(_capi._PROTOTYPES)


def test_status_strings_and_last_error():
    for st in range(8):
        assert _capi.status_string(st)
    with pytest.raises(sparge.InvalidArgumentError):
        _capi.check(1, "ctx")
    st = _capi.lib.sparge_create_plan(None, ctypes.byref(ctypes.c_void_p()))
    assert st == 1 and _capi.last_error()
    with pytest.raises(sparge.InvalidArgumentError) as ei:
        _capi.check(st)
    assert ei.value.status == 1


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_struct_layout_matches_header():
    cc = shutil.which("cc") or shutil.which("gcc")
    fields = {
        "sparge_tensor_t": _capi.SpargeTensor,
        "sparge_problem_t": _capi.SpargeProblem,
        "sparge_predict_params_t": _capi.SpargePredictParams,
    }
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "sparge/sparge.h"', "int main(void){"]
    for cname, py in fields.items():
        lines.append('printf("%s sizeof %%zu\\n", sizeof(%s));' % (cname, cname))
        for f, _ in py._fields_:
            lines.append('printf("%s %s %%zu\\n", offsetof(%s, %s));' % (cname, f, cname, f))
    lines.append("return 0;}")
    with tempfile.TemporaryDirectory() as d:
        src, exe = os.path.join(d, "t.c"), os.path.join(d, "t")
        open(src, "w").write("\n".join(lines))
        subprocess.run([cc, "-std=c99", "-I", os.path.join(ROOT, "include"), src, "-o", exe], check=True)
        out = subprocess.run([exe], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        cname, f, val = line.split()
        py = fields[cname]
        got = ctypes.sizeof(py) if f == "sizeof" else getattr(py, f).offset
        assert got == int(val), "%s.%s: python %d, C %s" % (cname, f, got, val)


def test_struct_defaults_match_init_macros():
    p = _capi.SpargeProblem()
    assert p.struct_size == ctypes.sizeof(_capi.SpargeProblem)
    assert (p.batch, p.heads_q, p.heads_kv, p.head_dim, p.block_q, p.block_k) == (1, 1, 1, 128, 0, 0)
    pp = _capi.SpargePredictParams()
    assert pp.struct_size == ctypes.sizeof(_capi.SpargePredictParams)
    assert abs(pp.topk - 0.5) < 1e-7 and abs(pp.cdf_threshold - 0.9) < 1e-7 and pp.smooth_k == 1
    assert pp.pv_threshold == 0.0 and not pp.topk_per_head
