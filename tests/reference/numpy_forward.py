#!/usr/bin/env python3
"""An independent float64 NumPy forward of SmolLM2-135M-Instruct from its GGUF (weights
dequantised by the `gguf` package of llama.cpp), to cross-check kvreplay's native capture.

Usage: numpy_forward.py MODEL.gguf TRACE.safetensors
The trace must be captured with --dtype f32. Runs the trace's token ids through the float64
forward and prints, per layer, the largest |q|, |k|, |v| differences against the trace, and the
top-5 next-token logits after the last position. Needs numpy and gguf (pip install numpy gguf).
"""
import json
import struct
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def weights(path):
    reader = GGUFReader(path)
    out = {}
    for t in reader.tensors:
        out[t.name] = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(
            [int(x) for x in reversed(t.shape)]
        )
    fields = {f.name: f for f in reader.fields.values()}

    def scalar(name):
        f = fields[name]
        return f.parts[f.data[0]][0]

    return out, scalar


def reverse_permute(w, n_head):
    # transformers' GGUF loader: undo llama.cpp's q/k row permutation.
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def load_trace(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    meta = header.pop("__metadata__")
    data = raw[8 + n :]

    def tensor(name):
        info = header[name]
        assert info["dtype"] in ("F32", "I64", "I32"), "capture the trace with --dtype f32"
        dtype = {"F32": np.float32, "I64": np.int64, "I32": np.int32}[info["dtype"]]
        a, b = info["data_offsets"]
        return np.frombuffer(data[a:b], dtype=dtype).reshape(info["shape"])

    return meta, tensor


def main():
    model_path, trace_path = sys.argv[1], sys.argv[2]
    w, scalar = weights(model_path)
    meta, tensor = load_trace(trace_path)
    layers = int(scalar("llama.block_count"))
    n_head = int(scalar("llama.attention.head_count"))
    n_kv = int(scalar("llama.attention.head_count_kv"))
    eps = float(scalar("llama.attention.layer_norm_rms_epsilon"))
    theta = float(scalar("llama.rope.freq_base"))
    ids = tensor("tokens").astype(np.int64)
    t = len(ids)
    x = w["token_embd.weight"][ids]
    d = x.shape[1] // n_head
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    angles = np.arange(t)[:, None] * inv[None, :]
    cos, sin = np.cos(np.concatenate([angles, angles], 1)), np.sin(np.concatenate([angles, angles], 1))

    def rms(v, g):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * g

    def rope(v):  # v [heads, t, d]; rotate_half
        half = np.concatenate([-v[..., d // 2 :], v[..., : d // 2]], -1)
        return v * cos + half * sin

    mask = np.triu(np.full((t, t), -np.inf), 1)
    worst = {"q": 0.0, "k": 0.0, "v": 0.0}
    for l in range(layers):
        p = f"blk.{l}."
        h = rms(x, w[p + "attn_norm.weight"])
        q = h @ reverse_permute(w[p + "attn_q.weight"], n_head).T
        k = h @ reverse_permute(w[p + "attn_k.weight"], n_kv).T
        v = h @ w[p + "attn_v.weight"].T
        q = rope(q.reshape(t, n_head, d).transpose(1, 0, 2))
        k = rope(k.reshape(t, n_kv, d).transpose(1, 0, 2))
        v = v.reshape(t, n_kv, d).transpose(1, 0, 2)
        diffs = {}
        for name, ours in (("q", q), ("k", k), ("v", v)):
            diffs[name] = float(np.abs(tensor(f"layers.{l}.{name}") - ours).max())
            worst[name] = max(worst[name], diffs[name])
        print(f"layer {l:2d}: max |Δq| {diffs['q']:.2e}  |Δk| {diffs['k']:.2e}  |Δv| {diffs['v']:.2e}  (max |q| {np.abs(q).max():.1f})")
        kr = np.repeat(k, n_head // n_kv, 0)
        vr = np.repeat(v, n_head // n_kv, 0)
        s = q @ kr.transpose(0, 2, 1) / np.sqrt(d) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = (s @ vr).transpose(1, 0, 2).reshape(t, -1)
        x = x + o @ w[p + "attn_output.weight"].T
        h = rms(x, w[p + "ffn_norm.weight"])
        g = h @ w[p + "ffn_gate.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * (h @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
    logits = rms(x[-1], w["output_norm.weight"]) @ w["token_embd.weight"].T
    top = np.argsort(-logits)[:5]
    print("worst over layers:", {k: f"{v:.2e}" for k, v in worst.items()})
    print("top-5 next tokens after the trace:", [(int(i), round(float(logits[i]), 4)) for i in top])


if __name__ == "__main__":
    main()
