"""Cases of the sequence-parallel tests and the comparison with one process (shared by the CPU
gloo test and the GPU snippet)."""

import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def cases(world, seed, precisions=("exact", "fp16"), dtype="float32", dims=(32, 16), gpu=False):
    """Both methods, causal (zig-zag) and not, GQA, top-k / CDF / sim_threshold + sink, a given
    mask, per-head top-k, both layouts, head-chunked prediction, int8_fp8 on bf16.
    gpu: the CUDA backend's mask blocks (128, 64) and head dims (pass dims=(128, 64))."""
    blk = [128, 64] if world == 2 or gpu else [64, 64]
    N = 512 if not gpu else 256 * world
    out = []
    i = 0
    for method in ("ulysses", "ring"):
        for causal in (False, True):
            for prec in precisions:
                i += 1
                out.append(dict(name="%s-c%d-%s" % (method, causal, prec), method=method, causal=causal,
                                B=1, Hq=4, Hkv=2, N=N, D=dims[0], seed=seed + i, dtype=dtype,
                                kw=dict(precision=prec, topk=0.4, block_size=blk)))
        i += 1
        out.append(dict(name="%s-cdf-nhd" % method, method=method, causal=True, layout="NHD", B=2, Hq=4,
                        Hkv=1, N=N, D=dims[1], seed=seed + i, dtype=dtype,
                        kw=dict(precision=precisions[0], mode="cdf", cdf_threshold=0.6, block_size=blk)))
        i += 1
        out.append(dict(name="%s-sim-sink" % method, method=method, causal=False, B=1, Hq=4, Hkv=4, N=N,
                        D=dims[0], seed=seed + i, dtype=dtype,
                        kw=dict(precision=precisions[0], topk=0.3, sim_threshold=0.45, attention_sink=True,
                                smooth_k=False, block_size=blk)))
        i += 1
        out.append(dict(name="%s-given-mask" % method, method=method, causal=True, B=1, Hq=4, Hkv=2, N=N,
                        D=dims[0], seed=seed + i, dtype=dtype, given_mask=True,
                        kw=dict(precision=precisions[0], topk=0.5, block_size=blk)))
        i += 1
        out.append(dict(name="%s-perhead-contig" % method, method=method, causal=True, zigzag=False, B=1,
                        Hq=4, Hkv=2, N=N, D=dims[0], seed=seed + i, dtype=dtype,
                        topk_per_head=[0.2, 0.4, 0.6, 0.8], gather_bytes=1,
                        kw=dict(precision=precisions[0], block_size=blk)))
        i += 1
        out.append(dict(name="%s-c0-zigzag-strided" % method, method=method, causal=False, zigzag=True,
                        shuffle_layout=True, B=1, Hq=4, Hkv=2, N=N, D=dims[0], seed=seed + i, dtype=dtype,
                        kw=dict(precision=precisions[0], topk=0.5, block_size=blk)))
        for causal in (False, True):
            i += 1
            out.append(dict(name="%s-c%d-int8-bf16" % (method, causal), method=method, causal=causal, B=1, Hq=4,
                            Hkv=2, N=N, D=64, seed=seed + i, dtype="bfloat16", gather_bytes=1 if causal else 1 << 30,
                            kw=dict(precision="int8_fp8", topk=0.5, block_size=blk)))
    i += 1
    out.append(dict(name="ulysses-cross", method="ulysses", causal=False, B=1, Hq=4, Hkv=2, N=N, Nkv=N // 2,
                    D=dims[0], seed=seed + i, dtype=dtype, kw=dict(precision=precisions[0], topk=0.5,
                                                                    block_size=blk)))
    return out


def run_ranks(world, case_list, device="cpu", timeout=600):
    """Runs dist_worker.py in `world` processes; returns {case: [per-rank dict]}."""
    import torch

    tmp = tempfile.mkdtemp(prefix="sparge-dist-")
    cj = os.path.join(tmp, "cases.json")
    with open(cj, "w") as f:
        json.dump(case_list, f)
    store = os.path.join(tmp, "store")
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "dist_worker.py"), str(r), str(world), store, cj,
                               tmp, device], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(world)]
    logs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        logs.append(out.decode("utf-8", "replace"))
    for r, p in enumerate(procs):
        if p.returncode != 0:
            raise RuntimeError("rank %d exited %d:\n%s" % (r, p.returncode, logs[r][-4000:]))
    res = {"errors": [torch.load(os.path.join(tmp, "errors-%d.pt" % r)) for r in range(world)]}
    for c in case_list:
        res[c["name"]] = [torch.load(os.path.join(tmp, "%s-%d.pt" % (c["name"], r))) for r in range(world)]
    return res


def reference(case, device="cpu"):
    """One process: (out, lse, mask) over the global sequence, natural order, HND."""
    sys.path.insert(0, HERE)
    import torch

    import sparge
    from dist_worker import global_inputs

    q, k, v = global_inputs(case, device)
    kw = dict(case.get("kw", {}))
    if "block_size" in kw:
        kw["block_size"] = tuple(kw["block_size"])
    if "topk_per_head" in case:
        kw["topk"] = case["topk_per_head"]
    mask = sparge.predict_mask(q, k, is_causal=case["causal"], **kw)
    out, lse = sparge.attention(q, k, v, is_causal=case["causal"], mask=mask, return_lse=True,
                                precision=kw["precision"], block_size=kw.get("block_size", (128, 64)))
    return out.cpu(), lse.cpu(), mask.cpu()


def quantization_errors(case, out, device="cpu"):
    """(relative L1 of `out`, relative L1 of one process) against float64 attention on the same
    mask: for the int8 precisions, whose rounding depends on how K/V are split."""
    import torch

    import sparge
    from dist_worker import global_inputs

    ref_out, _, ref_mask = reference(case, device)
    q, k, v = (t.float() for t in global_inputs(case, "cpu"))
    exact = sparge.attention(q, k, v, is_causal=case["causal"], mask=ref_mask, precision="exact",
                             block_size=tuple(case["kw"].get("block_size", (128, 64))))
    den = exact.abs().sum().item()
    return ((out.float() - exact).abs().sum().item() / den, (ref_out.float() - exact).abs().sum().item() / den)


def gathered_out(case, shards):
    from sparge import distributed as sd

    zig = case.get("zigzag", case["causal"])
    layout = case.get("layout", "HND")
    outs = [s["out"] if layout == "HND" else s["out"].transpose(1, 2) for s in shards]
    return sd.unshard_sequence(outs, dim=2, zigzag=zig)


def compare(case, shards, world, device="cpu"):
    """(mask_equal, max |out - ref| / max |ref|, max |lse - ref|, relative L1) of the gathered shards
    vs one process."""
    import torch

    from sparge import distributed as sd

    ref_out, ref_lse, ref_mask = reference(case, device)
    causal = case["causal"]
    zig = case.get("zigzag", causal)
    layout = case.get("layout", "HND")
    outs = [s["out"] if layout == "HND" else s["out"].transpose(1, 2) for s in shards]
    out = sd.unshard_sequence(outs, dim=2, zigzag=zig)
    lse = sd.unshard_sequence([s["lse"] for s in shards], dim=2, zigzag=zig)
    if case["method"] == "ulysses":
        mask = torch.cat([s["mask"] for s in shards], dim=1)        # head shards
    else:
        mask = sd.unshard_sequence([s["mask"] for s in shards], dim=2, zigzag=zig)  # query-block rows
    same_mask = bool(torch.equal(mask.to(torch.uint8), ref_mask.to(torch.uint8)))
    scale = ref_out.abs().max().item()
    diff = (out.float() - ref_out.float()).abs()
    err = diff.max().item() / scale
    rel_l1 = diff.sum().item() / max(ref_out.float().abs().sum().item(), 1e-30)
    fin = torch.isfinite(ref_lse)
    lse_ok = bool(torch.equal(fin, torch.isfinite(lse)))
    lse_err = (lse[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
    return same_mask, err, (lse_err if lse_ok else float("inf")), rel_l1


def judge(case, shards, world, device="cpu"):
    """(ok, report line): the same mask as one process, and outputs within what the method allows.

    Ulysses runs the very same calls as one process: the same bits. Ring merges partial outputs:
    float32 rounding (exact; fp16 on float32 CPU inputs), the 16-bit rounding of P over other
    softmax steps (fp16 on 16-bit inputs), or, int8_fp8, each K/V shard quantized on its own,
    judged against float64 (its error no larger than one process's)."""
    same_mask, err, lse_err, rel_l1 = compare(case, shards, world, device)
    line = "%-24s mask %s  out rel.max %.2e  rel.L1 %.2e  lse max %.2e" % (case["name"], same_mask, err, rel_l1,
                                                                           lse_err)
    prec = case["kw"]["precision"]
    ok = same_mask
    if case["method"] == "ulysses":
        ok = ok and err == 0.0 and lse_err == 0.0
    elif prec == "int8_fp8":
        mine, one = quantization_errors(case, gathered_out(case, shards), device)
        line += "  vs f64: rel.L1 %.4f (one process %.4f)" % (mine, one)
        ok = ok and mine <= 1.25 * one + 0.005 and lse_err <= 0.1
    elif case.get("dtype", "float32") == "float32":
        ok = ok and err <= (2e-6 if prec == "exact" else 1e-5) and lse_err <= 1e-5
    else:
        ok = ok and rel_l1 <= 5e-3 and lse_err <= 1e-3
    return ok, line


def simulate_ring(q, k, v, world, causal, zigzag, grad_rank=None, grad_kv=None, **kw):
    """The ring's per-rank computation (sparge.distributed._ring_step) for every rank in one process,
    each step fed the K/V shard it would receive; the global mask from one process's prediction.
    grad_kv: K and V (same values) that rank grad_rank uses for its own shard only, as a rank whose
    K and V require grad receives the other shards as plain tensors.
    Returns (out, lse, mask) gathered in natural order (HND), for comparison with one device."""
    import torch

    import sparge
    from sparge import distributed as sd

    bq, bk = kw.get("block_size", (128, 64))
    mask = sparge.predict_mask(q, k, is_causal=causal, **kw)
    akw = dict(precision=kw.get("precision", "int8_fp8"), block_size=(bq, bk), scale=kw.get("scale"))
    S = q.shape[2] // world
    per = 2 if zigzag else 1
    c = S // per
    shards = [tuple(sd.shard_sequence(t, r, world, dim=2, zigzag=zigzag) for t in (q, k, v)) for r in range(world)]
    outs, lses, rows_all = [], [], []
    for r in range(world):
        qh = shards[r][0]
        mine = sd.shard_chunks(r, world, zigzag)
        rows = torch.cat([mask[:, :, g * (c // bq):(g + 1) * (c // bq)] for g in mine], dim=2).contiguous()
        acc = [None] * per
        for t in range(world):
            src = (r - t) % world
            ks, vs = shards[src][1], shards[src][2]
            if grad_kv is not None and r == grad_rank and src == r:
                ks, vs = (sd.shard_sequence(x, r, world, dim=2, zigzag=zigzag) for x in grad_kv)
            sd._ring_step(qh, ks, vs, rows, acc, r, world, t, zigzag, causal, c, c // bq, c // bk, akw)
        out, lse, rows = sd._ring_finish(acc, q.dtype, "HND", causal, rows, True, True)
        outs.append(out)
        lses.append(lse)
        rows_all.append(rows)
    return (sd.unshard_sequence(outs, dim=2, zigzag=zigzag), sd.unshard_sequence(lses, dim=2, zigzag=zigzag),
            sd.unshard_sequence(rows_all, dim=2, zigzag=zigzag), mask)
