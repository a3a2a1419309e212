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
    dt = getattr(torch, case.get("dtype", "float32"))
    # Clustered keys (runs of similar tokens) so that the predicted masks are not trivial.
    def make(h):
        base = torch.randn(B, h, N // 64, D, generator=g).repeat_interleave(64, dim=2)
        return (base + 0.7 * torch.randn(B, h, N, D, generator=g)).to(dt).to(device)
    return make(Hq), make(Hkv), torch.randn(B, Hkv, N, D, generator=g).to(dt).to(device)


def main():
    rank, world, store, cases_json, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    device = sys.argv[6] if len(sys.argv) > 6 else "cpu"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method="file://" + store,
                            rank=rank, world_size=world)
    with open(cases_json) as f:
        cases = json.load(f)
    for case in cases:
        q, k, v = global_inputs(case, device)
        causal = case["causal"]
        zig = case.get("zigzag", causal)
        layout = case.get("layout", "HND")
        if layout == "NHD":
            q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        dim = 2 if layout == "HND" else 1
        ql, kl, vl = (sd.shard_sequence(t, rank, world, dim=dim, zigzag=zig).contiguous() for t in (q, k, v))
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
