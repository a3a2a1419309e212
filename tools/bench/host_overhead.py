#!/usr/bin/env python3
"""Host CPU time of one attention call: Python (eager sparge.attention on torch CUDA tensors) and C
(sparge_attention_run through ctypes with prebuilt arguments), with the GPU work made negligible
(an empty mask) or real (an all-ones mask, the dense call without a mask and with topk=1.0, or the
predicted mask of the default call with the estimator keys_lse named).

For each shape and mask it times batches of calls with time.perf_counter (wall) and time.thread_time
(CPU time of the calling thread, read outside the wall window), synchronizing the device only between
batches, and prints the median over the batches, in microseconds per call:

  py wall / py cpu   sparge.attention(q, k, v, mask=...) (the eager direct path; its arguments repeat, so
                     after the first call it is a hit of the prepared-call cache)
  py gen             py wall with that cache off (the general path: every check and descriptor per call)
  C warm             sparge_attention_run, the same arguments every call (the plan's setup cache hits)
  C miss             sparge_attention_run cycling through more output buffers than the cache holds
                     (every call runs the pointer queries and the tensor-map setup)
  ctypes             a call of sparge_has_cuda(): the floor of any ctypes call
  gpu                device time per call (CUDA events around a batch)

Needs torch with CUDA and a CUDA build of libsparge (SPARGE_LIBRARY, or the installed package);
runs offline. Example:

  SPARGE_LIBRARY=build/libsparge.so PYTHONPATH=bindings/python python3 tools/bench/host_overhead.py

--positions N times each of the first N calls after a device synchronization on its own (median over --repeats
batches, wall µs by position in the batch): the eager call, `sparge_attention_run` (C, warm) and, as a control that
involves no libsparge code, a torch op of the same kind of host work (an output allocated with `torch.empty_like`
and a one-element add) — to tell whether a cost that only the first calls after an idle device pay is the
library's:

  SPARGE_LIBRARY=build/libsparge.so PYTHONPATH=bindings/python python3 tools/bench/host_overhead.py --positions 6

--noop-c times the Python layer alone, on any machine: CPU torch tensors (--noop-shape, bf16), and the
library call replaced by a C function that does nothing (sparge_has_cuda of a CPU-only build, which
returns 0, called through the same ctypes prototype). It prints the best over --repeats batches of
--noop-calls calls, the cached and the general path alternating, for sparge.attention with a block
mask, without one, with return_lse, and sparge.sdpa; "ctypes" is the no-op called directly with the
prepared arguments (the floor: what remains of a call when the Python layer costs nothing), through
the prototype of the general path (integer arguments) and, where the package has it, without one
(prebuilt ctypes arguments: what the cached path calls):

  SPARGE_LIBRARY=build-cpu/libsparge.so PYTHONPATH=bindings/python python3 tools/bench/host_overhead.py --noop-c
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time

SHAPES = {"1x32x1Kx128": (1, 32, 1024, 128), "8x32x2Kx128": (8, 32, 2048, 128), "64x12x1Kx64": (64, 12, 1024, 64)}


def batches(fn, calls: int, repeats: int, sync) -> tuple:
    """Median (wall, cpu) seconds per call of fn() over `repeats` batches of `calls` calls."""
    walls, cpus = [], []
    for _ in range(repeats):
        sync()
        # The calling thread's CPU clock, read outside the wall window: the process's
        # (time.process_time) sums every thread's time, torch's and the driver's
        # included, and costs tens of microseconds in a process with many threads.
        c0 = time.thread_time()
        w0 = time.perf_counter()
        for _ in range(calls):
            fn()
        w1 = time.perf_counter()
        c1 = time.thread_time()
        sync()
        walls.append((w1 - w0) / calls)
        cpus.append((c1 - c0) / calls)
    return statistics.median(walls), statistics.median(cpus)


def by_position(fn, n: int, repeats: int, sync) -> list:
    """Median wall seconds of the i-th call after a synchronization, i = 0 .. n-1, over `repeats` batches."""
    per = [[] for _ in range(n)]
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        for i in range(n):
            fn()
            t1 = time.perf_counter()
            per[i].append(t1 - t)
            t = t1
        sync()
    return [statistics.median(x) for x in per]


def gpu_per_call(torch, fn, calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e-3 / calls


class CCall:
    """sparge_attention_run with every argument built once (HND, bf16, a caller's mask or none)."""

    def __init__(self, torch, sparge_core, C, q, k, v, mask, precision: int, n_out: int) -> None:
        from sparge._arrays import torch_view

        B, H, L, D = q.shape
        s = sparge_core.Shapes(B, H, H, L, L, D)
        qv = torch_view(q)
        opts = sparge_core.Options(0, False, 0.0, C.SELECT_TOPK, 0.5, 0.9, -0.1, True, -1, -1, 0, precision, 0, 0)
        self.plan = sparge_core.get_plan(s, qv, opts)
        self.C = C
        self.ws = torch.empty(self.plan.workspace_bytes + 256, dtype=torch.uint8, device=q.device)
        base = self.ws.data_ptr()
        self.ws_ptr = ctypes.c_void_p((base + 255) // 256 * 256)
        self.keep = [q, k, v, mask]
        self.qd, self.kd, self.vd = (torch_view(t).descriptor() for t in (q, k, v))
        self.md = torch_view(mask).descriptor() if mask is not None else None
        self.outs = [torch.empty_like(q) for _ in range(n_out)]
        self.ods = [torch_view(o).descriptor() for o in self.outs]
        self.params = sparge_core._make_params(opts, (None, None, None))
        self.stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream or None)
        self.fn = C.lib.sparge_attention_run
        self.i = 0
        self.mref = ctypes.byref(self.md) if self.md is not None else None
        self.refs = (ctypes.byref(self.qd), ctypes.byref(self.kd), ctypes.byref(self.vd))
        self.prm = ctypes.byref(self.params)
        self.orefs = [ctypes.byref(o) for o in self.ods]

    def __call__(self) -> None:
        o = self.orefs[self.i]
        self.i = (self.i + 1) % len(self.orefs)
        st = self.fn(self.plan.handle, self.refs[0], self.refs[1], self.refs[2], self.mref, self.prm, o, None,
                     self.ws_ptr, self.plan.workspace_bytes, self.stream)
        if st != 0:
            self.C.check(st, "sparge_attention_run")


def noop_main(args) -> int:
    """--noop-c: the Python layer of an eager call with the library call replaced by a no-op."""
    import timeit

    import torch
    import sparge
    from sparge import _api, _capi as C, _core

    if sparge.has_cuda():
        print("host_overhead --noop-c: needs a CPU-only build of libsparge (its no-op, sparge_has_cuda, returns 0 "
              "there)", file=sys.stderr)
        return 2
    vp = ctypes.c_void_p
    noop = C.lib.raw("sparge_has_cuda", [vp] * 9 + [ctypes.c_size_t, vp])  # sparge_attention_run's prototype
    _core._RUN_FN = noop  # what the general path calls
    if hasattr(_core, "_RUN_FN_NOPROTO"):  # what the cached path calls: no prototype, prebuilt arguments
        _core._RUN_FN_NOPROTO = C.lib.raw("sparge_has_cuda", None)
    B, H, L, D = (int(x) for x in args.noop_shape.lower().split("x"))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, dtype=torch.bfloat16, generator=g) for _ in range(3))
    mask = torch.ones(B, H, -(-L // 128), -(-L // 64), dtype=torch.uint8)
    cases = [
        ("attention mask", lambda: sparge.attention(q, k, v, mask=mask)),
        ("attention", lambda: sparge.attention(q, k, v)),
        ("attention lse", lambda: sparge.attention(q, k, v, mask=mask, return_lse=True)),
        ("sdpa", lambda: sparge.sdpa(q, k, v)),
    ]
    print("libsparge %s (%s), torch %s, CPU tensors %s bf16, library call: no-op"
          % (".".join(map(str, sparge.library_version())), C.library_path(), torch.__version__, args.noop_shape))
    _api._ops()  # imports the torch ops (and the cached path) as the first torch call would
    fast = getattr(_api, "_FAST", None)
    if fast is None:
        print("(this sparge package has no prepared-call cache: both columns time its one path)")
    args0 = (0, 0, 0, 0, 0, 0, 0, 0, None, 0, None)
    floor = min(timeit.repeat(lambda: noop(*args0), number=args.noop_calls, repeat=args.repeats))
    print("ctypes (the no-op with prepared arguments): %.2f us" % (floor / args.noop_calls * 1e6))
    if hasattr(_core, "_RUN_FN_NOPROTO"):
        raw = _core._RUN_FN_NOPROTO
        args1 = tuple(ctypes.c_void_p(1 + i) for i in range(9)) + (ctypes.c_size_t(0), None)
        floor = min(timeit.repeat(lambda: raw(*args1), number=args.noop_calls, repeat=args.repeats))
        print("ctypes, no prototype (prebuilt ctypes arguments, as the cached path calls): %.2f us"
              % (floor / args.noop_calls * 1e6))
    print("%-16s %10s %10s   (us per call, best of %d batches of %d)" % ("call", "cached", "general", args.repeats,
                                                                        args.noop_calls))
    for name, fn in cases:
        best = {"cached": float("inf"), "general": float("inf")}
        for _ in range(args.repeats):
            for mode in ("cached", "general"):
                _api._FAST = fast if mode == "cached" else None
                for _ in range(args.warmup):
                    fn()
                t = timeit.timeit(fn, number=args.noop_calls) / args.noop_calls
                best[mode] = min(best[mode], t)
        _api._FAST = fast
        print("%-16s %10.2f %10.2f" % (name, best["cached"] * 1e6, best["general"] * 1e6))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of: " + ", ".join(SHAPES))
    ap.add_argument("--masks", default="empty,dense,predicted",
                    help="comma-separated: empty, dense, predicted, full (no mask, topk=1.0: the dense call)")
    ap.add_argument("--precision", default="int8_fp8", help="int8_fp8 (this script's default; the library's is auto), int8_fp16, fp16, ...")
    ap.add_argument("--calls", type=int, default=200, help="calls per batch with an empty mask (others: --work-calls)")
    ap.add_argument("--work-calls", type=int, default=16,
                    help="calls per batch of the masks with real GPU work (default 16: a short launch queue)")
    ap.add_argument("--repeats", type=int, default=7, help="batches; the median is printed")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--positions", type=int, default=0,
                    help="time the first N calls after a synchronization one by one (see the description)")
    ap.add_argument("--noop-c", action="store_true", help="time the Python layer alone (CPU tensors, no-op library "
                    "call; needs a CPU-only build)")
    ap.add_argument("--noop-shape", default="1x4x256x64", help="BxHxLxD of --noop-c")
    ap.add_argument("--noop-calls", type=int, default=2000, help="calls per batch of --noop-c")
    args = ap.parse_args()
    if args.noop_c:
        return noop_main(args)

    import torch
    import sparge
    from sparge import _api
    from sparge import _capi as C
    from sparge import _core

    if not torch.cuda.is_available() or not sparge.has_cuda():
        print("host_overhead: needs a CUDA device and a CUDA build of libsparge", file=sys.stderr)
        return 2
    prec = _core.parse_precision(args.precision)
    sync = torch.cuda.synchronize
    print("libsparge %s (%s), torch %s, %s, precision %s" % (".".join(map(str, sparge.library_version())),
          C.library_path(), torch.__version__, torch.cuda.get_device_name(), args.precision))
    has_cuda = C.lib.sparge_has_cuda
    _, ct = batches(has_cuda, 2000, args.repeats, lambda: None)
    print("ctypes floor (sparge_has_cuda): %.2f us cpu" % (ct * 1e6))
    hdr = ("shape", "mask", "py wall", "py cpu", "py gen", "C warm", "C miss", "gpu")
    print("%-12s %-9s %9s %9s %9s %9s %9s %10s   (us per call, median of %d batches)" % (hdr + (args.repeats,)))
    g = torch.Generator(device="cuda").manual_seed(0)
    for name in args.shapes.split(","):
        B, H, L, D = SHAPES[name]
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        nqb, nkb = -(-L // 128), -(-L // 64)
        for mname in args.masks.split(","):
            if mname == "empty":
                mask = torch.zeros(B, H, nqb, nkb, dtype=torch.uint8, device="cuda")
            elif mname == "dense":
                mask = torch.ones(B, H, nqb, nkb, dtype=torch.uint8, device="cuda")
            elif mname in ("predicted", "full"):
                mask = None
            else:
                raise SystemExit("unknown mask %r" % mname)
            calls = args.calls if mname == "empty" else args.work_calls  # real GPU work: a short launch queue

            topk = 1.0 if mname == "full" else 0.5

            def py() -> None:  # keys_lse named: the measured call does not follow the library's default
                sparge.attention(q, k, v, mask=mask, topk=topk, precision=args.precision, estimator="keys_lse")

            for _ in range(args.warmup):
                py()
            sync()
            if args.positions > 0:
                one = torch.ones(1, device="cuda")

                def torch_op() -> None:  # the control: no libsparge code
                    torch.empty_like(q).view(-1)[:1].add_(one)

                rows = [("sparge.attention", py), ("torch control", torch_op)]
                if mask is not None:
                    rows.append(("C warm", CCall(torch, _core, C, q, k, v, mask, prec, 1)))
                for label, fn in rows:
                    for _ in range(args.warmup):
                        fn()
                    pos = by_position(fn, args.positions, args.repeats, sync)
                    print("%-12s %-9s %-17s by position: %s us" % (name, mname, label,
                                                                   " ".join("%.1f" % (t * 1e6) for t in pos)))
                del mask
                continue
            pw, pc = batches(py, calls, args.repeats, sync)
            fast, _api._FAST = getattr(_api, "_FAST", None), None  # the general path
            try:
                for _ in range(args.warmup):
                    py()
                pg, _ = batches(py, calls, args.repeats, sync)
            finally:
                _api._FAST = fast
            gpu = gpu_per_call(torch, py, calls)
            c_warm = c_miss = float("nan")
            if mask is not None:
                warm = CCall(torch, _core, C, q, k, v, mask, prec, 1)
                miss = CCall(torch, _core, C, q, k, v, mask, prec, 40)  # > the plan cache's 32 entries
                for fn in (warm, miss):
                    for _ in range(args.warmup):
                        fn()
                sync()
                _, c_warm = batches(warm, calls, args.repeats, sync)
                _, c_miss = batches(miss, calls, args.repeats, sync)
                del warm, miss
            print("%-12s %-9s %9.1f %9.1f %9.1f %9.1f %9.1f %10.1f" % (name, mname, pw * 1e6, pc * 1e6, pg * 1e6,
                                                                    c_warm * 1e6, c_miss * 1e6, gpu * 1e6))
            del mask
        del q, k, v
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
