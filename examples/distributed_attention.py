"""Sequence-parallel sparse attention with libsparge: Ulysses and ring attention over torch.distributed.

    torchrun --nproc_per_node=2 examples/distributed_attention.py                 # GPUs, NCCL
    torchrun --nproc_per_node=2 examples/distributed_attention.py -N 65536 --causal --check
    torchrun --nproc_per_node=2 examples/distributed_attention.py --device cpu -N 2048 -H 4 --kv-heads 2 \\
        -D 64 --precision fp16 --check                                             # CPU backend, gloo

Every rank builds the same global q, k, v (one seed), keeps its shard of the sequence (zig-zag when
causal), and runs sparge.distributed.ulysses_attention and ring_attention on it. It prints the time of
each method (the slowest rank), and with --check also the one-device result computed on rank 0: the
time, whether the gathered masks are the one-device mask, and the output difference.

NCCL's NVLink multicast (NVLS) is turned off (NCCL_NVLS_ENABLE=0) unless the environment sets it.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "bindings", "python"))

import sparge  # noqa: E402
from sparge import distributed as sd  # noqa: E402


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("-B", "--batch", type=int, default=1)
    p.add_argument("-N", "--seq", type=int, default=32768, help="global sequence length")
    p.add_argument("-H", "--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=None, help="K/V heads (GQA); default = heads")
    p.add_argument("-D", "--dim", type=int, default=128)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--topk", type=float, default=0.5)
    p.add_argument("--precision", default=None, help="default: int8_fp8 on CUDA, fp16 on CPU")
    p.add_argument("--method", choices=("both", "ulysses", "ring"), default="both")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--check", action="store_true", help="compare with one device (rank 0)")
    return p.parse_args()


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def main():
    a = parse()
    dev = a.device
    if dev == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if dev == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dev == "cuda" else torch.device("cpu")
    prec = a.precision or ("int8_fp8" if dev == "cuda" else "fp16")
    hkv = a.kv_heads or a.heads
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(1234)
    q = torch.randn(a.batch, a.heads, a.seq, a.dim, generator=g, device=device, dtype=dtype)
    k = torch.randn(a.batch, hkv, a.seq, a.dim, generator=g, device=device, dtype=dtype)
    v = torch.randn(a.batch, hkv, a.seq, a.dim, generator=g, device=device, dtype=dtype)
    zig = a.causal
    ql, kl, vl = (sd.shard_sequence(t, rank, world, dim=2, zigzag=zig).contiguous() for t in (q, k, v))
    if not a.check:
        del q, k, v
    kw = dict(is_causal=a.causal, topk=a.topk, precision=prec)
    if rank == 0:
        print("sparge %s, %d ranks (%s), B=%d N=%d Hq=%d Hkv=%d D=%d %s, %s, topk %g, precision %s"
              % (sparge.__version__, world, dist.get_backend(), a.batch, a.seq, a.heads, hkv, a.dim,
                 str(dtype).replace("torch.", ""), "causal (zig-zag shards)" if a.causal else "non-causal",
                 a.topk, prec), flush=True)

    methods = [m for m in ("ulysses", "ring") if a.method in ("both", m)]
    results = {}
    for m in methods:
        fn = sd.ulysses_attention if m == "ulysses" else sd.ring_attention
        (out, mask), ms = timed_reduce(lambda: fn(ql, kl, vl, None, return_mask=True, **kw), a.iters, dev, device)
        results[m] = (out, mask, ms)
        if rank == 0:
            print("%-8s %10.3f ms per call" % (m, ms), flush=True)

    if a.check:
        one = None
        if rank == 0:
            m1 = sparge.predict_mask(q, k, **{x: kw[x] for x in ("is_causal", "topk", "precision")})
            o1 = sparge.attention(q, k, v, mask=m1, is_causal=a.causal, precision=prec)
            sync(dev)
            t0 = time.perf_counter()
            for _ in range(a.iters):
                sparge.attention(q, k, v, is_causal=a.causal, topk=a.topk, precision=prec)
            sync(dev)
            print("%-8s %10.3f ms per call (one device, predict + attention)"
                  % ("single", (time.perf_counter() - t0) * 1e3 / a.iters), flush=True)
            one = (o1, m1)
        for m in methods:
            out, mask, _ = results[m]
            outs = [torch.empty_like(out) for _ in range(world)]
            dist.all_gather(outs, out.contiguous())
            masks = [torch.empty_like(mask) for _ in range(world)]
            dist.all_gather(masks, mask.contiguous())
            if rank == 0:
                full = sd.unshard_sequence(outs, dim=2, zigzag=zig)
                gm = torch.cat(masks, dim=1) if m == "ulysses" else sd.unshard_sequence(masks, dim=2, zigzag=zig)
                o1, m1 = one
                d = (full.float() - o1.float()).abs()
                print("%-8s mask %s one device's; max |diff| %.3e, relative L1 %.3e"
                      % (m, "==" if torch.equal(gm, m1) else "!=", d.max().item(),
                         d.sum().item() / o1.float().abs().sum().item()), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def timed_reduce(fn, iters, dev, device):
    fn()
    sync(dev)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        res = fn()
    sync(dev)
    ms = (time.perf_counter() - t0) * 1e3 / iters
    t = torch.tensor([ms], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return res, t.item()


if __name__ == "__main__":
    main()
