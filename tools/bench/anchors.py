#!/usr/bin/env python3
"""Anchors for sparge_bench, measured on the same GPU in the same run.

1. Ceilings: bf16 GEMM 8192^3 (TFLOPS), fp8 GEMM (torch._scaled_mm, where
   available), device-to-device copy (GB/s, bytes read + written).
2. torch SDPA in bf16 with the cuDNN backend and the FLASH_ATTENTION backend
   (torch.nn.attention.sdpa_kernel) on sparge_bench's workloads: B=1, H=32,
   D in {128, 64}, N in {8K, 16K, 32K}, causal and not; median of per-iteration
   CUDA event times; TFLOPS = 4*B*H*N*N*D, halved for causal.
3. Accuracy at N=8K (H=32, D=128), causal and not: libsparge int8_fp8 and fp16
   (all blocks kept) and int8_fp8 at topk 0.5 (mask predicted), and cuDNN bf16
   SDPA, each against SDPA computed in float32: cosine similarity and relative L1.
   libsparge is called through a minimal ctypes binding of the C API.
4. With --ours CSV (sparge_bench output): a side-by-side table.

Usage: anchors.py --lib build/libsparge.so [--ours bench.csv] [--csv anchors.csv]
                  [--n 8k,16k,32k] [--d 128,64] [--skip-sdpa] [--skip-accuracy] [--seed N]
"""
import argparse
import csv
import ctypes
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F

# ----------------------------------------------------------------- C API (ctypes)
SPARGE_DTYPE_FLOAT16, SPARGE_DTYPE_BFLOAT16, SPARGE_DTYPE_FLOAT32, SPARGE_DTYPE_UINT8, SPARGE_DTYPE_INT32 = range(5)
SPARGE_DEVICE_CUDA = 1
SPARGE_PRECISION_INT8_FP8, SPARGE_PRECISION_FP16, SPARGE_PRECISION_INT8_FP8_SPLIT_V, SPARGE_PRECISION_INT8_FP16 = 0, 1, 3, 4


class Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int), ("device_id", ctypes.c_int32),
                ("dtype", ctypes.c_int), ("ndim", ctypes.c_int32), ("shape", ctypes.c_int64 * 4),
                ("strides", ctypes.c_int64 * 4)]


class Problem(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("batch", ctypes.c_int64), ("heads_q", ctypes.c_int64),
                ("heads_kv", ctypes.c_int64), ("len_q", ctypes.c_int64), ("len_kv", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("dtype", ctypes.c_int), ("device_type", ctypes.c_int),
                ("device_id", ctypes.c_int32), ("precision", ctypes.c_int), ("causal", ctypes.c_int32),
                ("scale", ctypes.c_float), ("block_q", ctypes.c_int32), ("block_k", ctypes.c_int32)]


class PredictParams(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("mode", ctypes.c_int), ("topk", ctypes.c_float),
                ("cdf_threshold", ctypes.c_float), ("sim_threshold", ctypes.c_float), ("smooth_k", ctypes.c_int32),
                ("attention_sink", ctypes.c_int32), ("topk_per_head", ctypes.c_void_p),
                ("cdf_threshold_per_head", ctypes.c_void_p), ("sim_threshold_per_head", ctypes.c_void_p),
                ("pv_threshold", ctypes.c_float), ("local_window", ctypes.c_int32), ("estimator", ctypes.c_int)]


SPARGE_ESTIMATOR_KEYS_LSE = 1


class Sparge:
    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        L = self.lib
        L.sparge_create_plan.argtypes = [ctypes.POINTER(Problem), ctypes.POINTER(ctypes.c_void_p)]
        L.sparge_plan_workspace_size.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
        L.sparge_attention_run.argtypes = [ctypes.c_void_p] + [ctypes.POINTER(Tensor)] * 4 + [
            ctypes.POINTER(PredictParams), ctypes.POINTER(Tensor), ctypes.POINTER(Tensor), ctypes.c_void_p,
            ctypes.c_size_t, ctypes.c_void_p]
        L.sparge_destroy_plan.argtypes = [ctypes.c_void_p]
        L.sparge_last_error.restype = ctypes.c_char_p
        L.sparge_status_string.restype = ctypes.c_char_p
        L.sparge_status_string.argtypes = [ctypes.c_int]
        for f in ("sparge_create_plan", "sparge_plan_workspace_size", "sparge_attention_run"):
            getattr(L, f).restype = ctypes.c_int

    def check(self, st, what):
        if st != 0:
            raise RuntimeError("%s: %s: %s" % (what, self.lib.sparge_status_string(st).decode(),
                                               self.lib.sparge_last_error().decode()))

    @staticmethod
    def desc(t, dtype):
        d = Tensor()
        d.data = t.data_ptr()
        d.device_type = SPARGE_DEVICE_CUDA
        d.device_id = t.device.index or 0
        d.dtype = dtype
        d.ndim = t.dim()
        for i in range(t.dim()):
            d.shape[i] = t.shape[i]
            d.strides[i] = t.stride(i)
        return d

    def attention(self, q, k, v, precision, causal, mask=None, topk=0.5):
        """q, k, v: [B, H, L, D] bf16/fp16 CUDA tensors. mask: uint8 block mask or None (predict, topk)."""
        B, Hq, Lq, D = q.shape
        Hkv, Lkv = k.shape[1], k.shape[2]
        dt = SPARGE_DTYPE_BFLOAT16 if q.dtype == torch.bfloat16 else SPARGE_DTYPE_FLOAT16
        pr = Problem(ctypes.sizeof(Problem), B, Hq, Hkv, Lq, Lkv, D, dt, SPARGE_DEVICE_CUDA, q.device.index or 0,
                     precision, 1 if causal else 0, 0.0, 0, 0)
        plan = ctypes.c_void_p()
        self.check(self.lib.sparge_create_plan(ctypes.byref(pr), ctypes.byref(plan)), "sparge_create_plan")
        try:
            wsb = ctypes.c_size_t()
            self.check(self.lib.sparge_plan_workspace_size(plan, ctypes.byref(wsb)), "workspace_size")
            ws = torch.empty(max(wsb.value, 1), dtype=torch.uint8, device=q.device)
            out = torch.full_like(q, float("nan"))
            # local window -1: the default of the mode; the estimator named (KEYS_LSE, the default before the
            # per-mode SPARGE_ESTIMATOR_AUTO), so that the anchor does not follow the library's default
            prm = PredictParams(ctypes.sizeof(PredictParams), 0, topk, 0.9, -0.1, 1, 0, None, None, None, 0.0, -1,
                                SPARGE_ESTIMATOR_KEYS_LSE)
            qd, kd, vd, od = (self.desc(t, dt) for t in (q, k, v, out))
            md = self.desc(mask, SPARGE_DTYPE_UINT8) if mask is not None else None
            stream = torch.cuda.current_stream().cuda_stream
            st = self.lib.sparge_attention_run(plan, ctypes.byref(qd), ctypes.byref(kd), ctypes.byref(vd),
                                               ctypes.byref(md) if md is not None else None, ctypes.byref(prm),
                                               ctypes.byref(od), None, ctypes.c_void_p(ws.data_ptr()), wsb.value,
                                               ctypes.c_void_p(stream))
            self.check(st, "sparge_attention_run")
            torch.cuda.synchronize()
            return out
        finally:
            self.lib.sparge_destroy_plan(plan)


# ----------------------------------------------------------------- timing
def time_median(fn, target_ms=250.0, warmup=3, min_iters=5, max_iters=50):
    for _ in range(warmup):
        fn(0)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn(0)
    b.record()
    b.synchronize()
    est = a.elapsed_time(b)
    iters = max(min_iters, min(max_iters, int(target_ms / est) if est > 0 else max_iters))
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for i, (s, e) in enumerate(ev):
        s.record()
        fn(i)
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ev), iters


def parse_ns(text):
    out = []
    for t in text.split(","):
        t = t.strip().lower()
        if t:
            out.append(int(float(t[:-1]) * 1024) if t.endswith("k") else int(t))
    return out


def ceilings(rows):
    print("\n## Ceilings\n")
    print("| what | value |\n|---|---:|")
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms, _ = time_median(lambda i: torch.mm(a, b), target_ms=200, min_iters=10)
    tf = 2 * n ** 3 / (ms * 1e-3) / 1e12
    print("| bf16 GEMM %d^3 (torch.mm) | %.0f TFLOPS (%.3f ms) |" % (n, tf, ms))
    rows.append(["ceiling", "bf16_gemm_8192", "", "", "", "torch.mm", "%.4f" % ms, "%.1f" % tf, ""])
    try:
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.to(torch.float8_e4m3fn).t().contiguous().t()
        one = torch.ones((), device="cuda", dtype=torch.float32)
        ms, _ = time_median(lambda i: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                            target_ms=200, min_iters=10)
        tf = 2 * n ** 3 / (ms * 1e-3) / 1e12
        print("| fp8 e4m3 GEMM %d^3 (torch._scaled_mm) | %.0f TFLOPS (%.3f ms) |" % (n, tf, ms))
        rows.append(["ceiling", "fp8_gemm_8192", "", "", "", "torch._scaled_mm", "%.4f" % ms, "%.1f" % tf, ""])
    except Exception as e:  # noqa: BLE001 - report and go on
        print("| fp8 GEMM | unavailable: %s |" % str(e).splitlines()[0][:80])
    del a, b
    nbytes = 1 << 31
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms, _ = time_median(lambda i: dst.copy_(src), target_ms=200, min_iters=10)
    gbs = 2 * nbytes / (ms * 1e-3) / 1e9
    print("| device copy 2 GiB (read + write) | %.0f GB/s (%.3f ms) |" % (gbs, ms))
    rows.append(["ceiling", "device_copy_2GiB", "", "", "", "copy_", "%.4f" % ms, "%.1f" % gbs, "GB/s"])
    del src, dst
    torch.cuda.empty_cache()


def sdpa(args, rows, results):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backends = [("cuDNN", SDPBackend.CUDNN_ATTENTION), ("FA2 (FLASH_ATTENTION)", SDPBackend.FLASH_ATTENTION)]
    print("\n## torch SDPA bf16 (B=1, H=%d)\n" % args.heads)
    print("| N | D | causal | backend | ms | TFLOPS |\n|---:|---:|:---:|---|---:|---:|")
    for D in args.d:
        for N in args.n:
            for causal in (False, True):
                flop = 4.0 * args.heads * N * N * D * (0.5 if causal else 1.0)
                set_bytes = 3 * args.heads * N * D * 2
                nsets = 2 if set_bytes < (2 << 30) else 1
                sets = [[torch.randn(1, args.heads, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
                        for _ in range(nsets)]
                for name, be in backends:
                    try:
                        with sdpa_kernel([be]):
                            ms, it = time_median(lambda i: F.scaled_dot_product_attention(
                                *sets[i % nsets], is_causal=causal))
                        tf = flop / (ms * 1e-3) / 1e12
                        print("| %d | %d | %s | %s | %.3f | %.0f |" % (N, D, "yes" if causal else "no", name, ms, tf))
                        rows.append(["sdpa", "", N, D, int(causal), name, "%.4f" % ms, "%.1f" % tf, "iters=%d" % it])
                        results[(N, D, int(causal), name)] = ms
                    except Exception as e:  # noqa: BLE001
                        msg = str(e).splitlines()[0][:100]
                        print("| %d | %d | %s | %s | error | %s |" % (N, D, "yes" if causal else "no", name, msg))
                        rows.append(["sdpa", "", N, D, int(causal), name, "", "", "error: " + msg])
                    sys.stdout.flush()
                del sets
                torch.cuda.empty_cache()


def metrics(out, ref):
    a, b = out.double().flatten(), ref.double().flatten()
    nonfinite = int((~torch.isfinite(a)).sum())
    cos = float(torch.dot(a, b) / (a.norm() * b.norm()))
    rel = float((a - b).abs().sum() / b.abs().sum())
    return cos, rel, nonfinite


def accuracy(args, rows):
    sp = Sparge(args.lib)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    N, D, H = 8192, 128, args.heads
    print("\n## Accuracy vs SDPA in float32 (N=%d, H=%d, D=%d, bf16 inputs)\n" % (N, H, D))
    # A fresh seed per run unless --seed is given (the same inputs for an A/B of two libraries); printed either way.
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    print("Inputs: seed %d (--seed %d repeats them).\n" % (seed, seed))
    print("| inputs | causal | output | cosine | rel. L1 | bar |\n|---|:---:|---|---:|---:|---|")
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    for kind in ("normal", "outliers"):
        q, k, v = (torch.randn(1, H, N, D, device="cuda", generator=gen) for _ in range(3))
        if kind == "outliers":  # smooth per-channel offset on K, a few channels x20 in Q and K
            ch = torch.arange(D, device="cuda", dtype=torch.float32)
            k = k + 2.0 * torch.sin(0.37 * ch)
            idx = torch.tensor([3, 40, 77], device="cuda")
            q[..., idx] *= 20
            k[..., idx] *= 20
        q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
        nq, nk = (N + 127) // 128, (N + 63) // 64
        ones = torch.ones(1, H, nq, nk, dtype=torch.uint8, device="cuda")
        for causal in (False, True):
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
            cases = [("libsparge int8_fp8, all blocks", lambda: sp.attention(q, k, v, SPARGE_PRECISION_INT8_FP8,
                                                                              causal, ones), "cos>=0.9995, L1<=0.03"),
                     ("libsparge int8_fp8_split_v, all blocks",
                      lambda: sp.attention(q, k, v, SPARGE_PRECISION_INT8_FP8_SPLIT_V, causal, ones),
                      "cos>=0.9995, L1<=0.03"),
                     ("libsparge int8_fp16, all blocks",
                      lambda: sp.attention(q, k, v, SPARGE_PRECISION_INT8_FP16, causal, ones),
                      "cos>=0.9995, L1<=0.03"),
                     ("libsparge fp16, all blocks", lambda: sp.attention(q, k, v, SPARGE_PRECISION_FP16, causal, ones),
                      "L1<=0.005"),
                     ("libsparge int8_fp8, topk 0.5", lambda: sp.attention(q, k, v, SPARGE_PRECISION_INT8_FP8, causal,
                                                                             None, 0.5), "-")]
            for name, fn, bar in cases:
                try:
                    out = fn()
                    cos, rel, nf = metrics(out, ref)
                    note = "" if nf == 0 else " (%d non-finite)" % nf
                    print("| %s | %s | %s | %.6f | %.5f | %s%s |" % (kind, "yes" if causal else "no", name, cos, rel,
                                                                   bar, note))
                    rows.append(["accuracy", kind, N, D, int(causal), name, "", "", "cos=%.6f relL1=%.5f%s" %
                                 (cos, rel, note)])
                except Exception as e:  # noqa: BLE001
                    print("| %s | %s | %s | error | %s | |" % (kind, "yes" if causal else "no", name,
                                                            str(e).splitlines()[0][:100]))
                sys.stdout.flush()
            try:
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                cos, rel, _ = metrics(out, ref)
                print("| %s | %s | cuDNN SDPA bf16 | %.6f | %.5f | - |" % (kind, "yes" if causal else "no", cos, rel))
                rows.append(["accuracy", kind, N, D, int(causal), "cuDNN SDPA bf16", "", "",
                             "cos=%.6f relL1=%.5f" % (cos, rel)])
            except Exception as e:  # noqa: BLE001
                print("| %s | %s | cuDNN SDPA bf16 | error | %s | |" % (kind, causal, str(e).splitlines()[0][:80]))
            del ref
            torch.cuda.empty_cache()


def side_by_side(path, results):
    ours = {}
    with open(path) as f:
        for r in csv.DictReader(f):
            try:
                ours[(int(r["N"]), int(r["D"]), int(r["causal"]), r["mode"], r["precision"])] = float(r["ms"])
            except (KeyError, ValueError):
                continue
    print("\n## Side by side (ms; speed-up = cuDNN ms / libsparge ms)\n")
    print("| N | D | causal | cuDNN | FA2 | libsparge int8_fp8 dense | x cuDNN | libsparge int8_fp16 dense | x cuDNN "
          "| libsparge fp16 dense | x cuDNN | pred+attn topk | x cuDNN |")
    print("|---:|---:|:---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    keys = sorted({(n, d, c) for (n, d, c, _, _) in ours}, key=lambda t: (-t[1], t[0], t[2]))
    for n, d, c in keys:
        cud = results.get((n, d, c, "cuDNN"))
        fa = results.get((n, d, c, "FA2 (FLASH_ATTENTION)"))
        cells = []
        for key in ((n, d, c, "dense", "int8_fp8"), (n, d, c, "dense", "int8_fp16"), (n, d, c, "dense", "fp16"),
                    (n, d, c, "pred+attn", "int8_fp8")):
            ms = ours.get(key)
            if ms is None or math.isnan(ms):
                cells += ["-", "-"]
            else:
                cells += ["%.3f" % ms, ("%.2f" % (cud / ms)) if cud else "-"]
        print("| %d | %d | %s | %s | %s | %s |" % (n, d, "yes" if c else "no", "%.3f" % cud if cud else "-",
                                                   "%.3f" % fa if fa else "-", " | ".join(cells)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", default="build/libsparge.so")
    ap.add_argument("--ours", help="sparge_bench CSV for the side-by-side table")
    ap.add_argument("--csv", help="write the anchors as CSV")
    ap.add_argument("--n", default="8k,16k,32k")
    ap.add_argument("--d", default="128,64")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--skip-sdpa", action="store_true")
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--skip-ceilings", action="store_true")
    ap.add_argument("--seed", type=int, help="the accuracy inputs' seed (default: a fresh one, printed)")
    args = ap.parse_args()
    args.n = parse_ns(args.n)
    args.d = [int(x) for x in args.d.split(",") if x]
    if not torch.cuda.is_available():
        print("anchors: no CUDA device")
        return 77
    p = torch.cuda.get_device_properties(0)
    print("# anchors: torch %s, CUDA %s, cuDNN %s, %s (%d SMs)" % (torch.__version__, torch.version.cuda,
                                                                 torch.backends.cudnn.version(), p.name,
                                                                 p.multi_processor_count))
    rows, results = [], {}
    status = 0
    for name, fn in (("ceilings", None if args.skip_ceilings else lambda: ceilings(rows)),
                     ("sdpa", None if args.skip_sdpa else lambda: sdpa(args, rows, results)),
                     ("accuracy", None if args.skip_accuracy else lambda: accuracy(args, rows))):
        if fn is None:
            continue
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - one section failing must not hide the others
            print("\n%s section failed: %s" % (name, e))
            status = 1
        sys.stdout.flush()
    if args.ours and os.path.exists(args.ours) and results:
        side_by_side(args.ours, results)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["section", "name", "N", "D", "causal", "backend", "ms", "tflops_or_gbs", "note"])
            w.writerows(rows)
        print("\nwrote %s" % args.csv)
    return status


if __name__ == "__main__":
    sys.exit(main())
