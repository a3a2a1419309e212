"""One rank of the sequence-parallel tests (test_distributed_cpu.py, test_gpu_distributed.py).

    python dist_worker.py RANK WORLD STORE_FILE CASES_JSON OUT_DIR [cpu|cuda]

Every case builds the same global q, k, v on every rank (from the case's seed), shards them,
runs ulysses_attention or ring_attention, and writes this rank's out / lse / mask shard to
OUT_DIR/<case>-<rank>.pt. The parent process compares them with one process's result.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "bindings", "python"))

import sparge  # noqa: E402
from sparge import distributed as sd  # noqa: E402


def global_inputs(case, device):
    g = torch.Generator().manual_seed(int(case["seed"]))
    B, Hq, Hkv, N, D = case["B"], case["Hq"], case["Hkv"], case["N"], case["D"]
    Nkv = case.get("Nkv", N)
    dt = getattr(torch, case.get("dtype", "float32"))
    # Clustered keys (runs of similar tokens) so that the predicted masks are not trivial.
    def make(h, n):
        base = torch.randn(B, h, n // 64, D, generator=g).repeat_interleave(64, dim=2)
        return (base + 0.7 * torch.randn(B, h, n, D, generator=g)).to(dt).to(device)
    return make(Hq, N), make(Hkv, Nkv), torch.randn(B, Hkv, Nkv, D, generator=g).to(dt).to(device)


def expected_errors(rank, world, device):
    """Bad calls: each must raise InvalidArgumentError naming the problem, on every rank alike."""
    t = lambda *shape: torch.randn(*shape).to(device)  # noqa: E731
    msgs = []
    calls = [
        (sd.ulysses_attention, (t(1, 3, 128, 64), t(1, 3, 128, 64), t(1, 3, 128, 64)), dict(), "multiple of the world"),
        (sd.ring_attention, (t(1, 2, 96, 64), t(1, 2, 96, 64), t(1, 2, 96, 64)), dict(is_causal=True), "mask blocks"),
        (sd.ring_attention, (t(1, 2, 256, 64), t(1, 2, 128, 64), t(1, 2, 128, 64)), dict(), "one length"),
        (sd.ulysses_attention, (t(1, 4, 256, 64), t(1, 4, 128, 64), t(1, 4, 128, 64)), dict(is_causal=True),
         "equal q and k shard lengths"),
        (sd.ring_attention, (t(1, 2, 256, 64), t(1, 2, 256, 64), t(1, 2, 256, 64).numpy() if device == "cpu"
                             else None), dict(), "v must be a torch tensor"),
    ]
    for fn, args, kw, needle in calls:
        try:
            fn(*args, None, **kw)
            msgs.append("no error (expected %r)" % needle)
        except sparge.InvalidArgumentError as e:
            msgs.append("ok" if needle in str(e) else "wrong message %r (expected %r)" % (str(e), needle))
    return msgs


def main():
    rank, world, store, cases_json, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    device = sys.argv[6] if len(sys.argv) > 6 else "cpu"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method="file://" + store,
                            rank=rank, world_size=world)
    with open(cases_json) as f:
        cases = json.load(f)
    torch.save(expected_errors(rank, world, device), os.path.join(out_dir, "errors-%d.pt" % rank))
    for case in cases:
        q, k, v = global_inputs(case, device)
        causal = case["causal"]
        zig = case.get("zigzag", causal)
        layout = case.get("layout", "HND")
        if layout == "NHD":
            q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        dim = 2 if layout == "HND" else 1
        ql, kl, vl = (sd.shard_sequence(t, rank, world, dim=dim, zigzag=zig).contiguous() for t in (q, k, v))
        if case.get("shuffle_layout"):  # non-contiguous shards: any strides with a unit D stride work
            ql = ql.transpose(1, 2).contiguous().transpose(1, 2)
        kw = dict(case.get("kw", {}))
        if "block_size" in kw:
            kw["block_size"] = tuple(kw["block_size"])
        if "topk_per_head" in case:
            kw["topk"] = case["topk_per_head"]
        if case.get("given_mask"):
            kw["mask"] = sparge.predict_mask(q, k, is_causal=causal, layout=layout,
                                             **{x: kw[x] for x in kw if x != "mask"})
        sd.PREDICT_GATHER_BYTES = int(case.get("gather_bytes", 1 << 30))  # small: head-chunked prediction
        fn = sd.ulysses_attention if case["method"] == "ulysses" else sd.ring_attention
        out, lse, mask = fn(ql, kl, vl, None, is_causal=causal, zigzag=zig, layout=layout,
                            return_lse=True, return_mask=True, **kw)
        torch.save({"out": out.cpu(), "lse": lse.cpu(), "mask": mask.cpu()},
                   os.path.join(out_dir, "%s-%d.pt" % (case["name"], rank)))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
