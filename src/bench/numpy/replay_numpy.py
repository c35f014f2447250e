#!/usr/bin/env python3
"""The NumPy replay a researcher would write, for `kvreplay bench`: same trace, same metric (mean
retained mass over layers, query heads and decode steps), same policies, written independently
from the method descriptions (docs/policies.md) with NumPy only.

Usage: replay_numpy.py TRACE --budgets 64,128 --policies snapkv,pyramidkv,... > results.json
Prints {"results": {policy: {budget: mass}}, "seconds": s} as JSON.

Policies (KV-head caches, group scores averaged; ties keep the lower position):
  snapkv        flat, W=8, avg-pool kernel 7 (zero padding counted), prefill
  pyramidkv     official schedule (beta 20, floor rounding), W=8, max-pool kernel 7, prefill
  streamingllm  4 sinks + most recent, streaming
  h2o           cumulative true-query attention, recent budget//2 protected, streaming
  key-proxy     the seed library's H2O-adapted: new key as query over the stored keys, token 0
                starts at 1, new tokens at 0, 4 sinks, streaming
  oracle        per decode step, the top-budget of the current query's full attention (group mean)
"""
import argparse
import json
import struct
import sys
import time

import numpy as np


def load(path):
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    meta = header.pop("__metadata__")
    data = memoryview(raw)[8 + n :]
    dtypes = {"F16": np.float16, "BF16": None, "F32": np.float32}

    def tensor(name):
        info = header[name]
        start, end = info["data_offsets"]
        dtype = dtypes[info["dtype"]]
        return np.frombuffer(data[start:end], dtype=dtype).reshape(info["shape"]).astype(np.float32)

    layers = int(meta["n_layers"])
    scale = float(meta.get("scale", 1.0 / np.sqrt(int(meta["head_dim"]))))
    return meta, [(tensor(f"layers.{l}.q"), tensor(f"layers.{l}.k")) for l in range(layers)], scale


def softmax(x, axis=-1):
    x = x - x.max(axis=axis, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=axis, keepdims=True)


def decode_attention(q, k, n, scale):
    """[H, D, T] full causal attention of the decode queries."""
    heads, t, _ = q.shape
    group = heads // k.shape[0]
    kk = np.repeat(k, group, axis=0)
    logits = np.einsum("hsd,htd->hst", q[:, n:], kk) * scale
    mask = np.arange(t)[None, :] > np.arange(n, t)[:, None]
    logits[:, mask] = -np.inf
    return softmax(logits)


def top(scores, budget, protected):
    """Indices kept: protected first, then by score (stable: lower position first on ties)."""
    order = np.lexsort((np.arange(len(scores)), -scores, ~protected))
    return np.sort(order[:budget])


def pyramid_budgets(cap, n, layers, window=8, beta=20):
    b = cap - window
    if n < cap or n < 2 * b:
        return [cap] * layers
    lo = b // beta
    hi = 2 * b - lo
    if hi >= n - window:
        hi = n - window
        lo = 2 * b - hi
    steps = (hi - lo) // (layers - 1)
    return [hi - l * steps + window for l in range(layers)]


def snapkv_kept(q, k, n, scale, budget, kv, group, pool):
    window, kernel = 8, 7
    if budget >= n:
        return np.arange(n)
    heads = range(kv * group, (kv + 1) * group)
    logits = np.einsum("hwd,td->hwt", q[list(heads), n - window : n], k[kv, :n]) * scale
    mask = np.arange(n)[None, :] > np.arange(n - window, n)[:, None]
    logits[:, mask] = -np.inf
    votes = softmax(logits).sum(axis=1)[:, : n - window]  # [group, n - W]
    pad = kernel // 2
    if pool == "avg":
        padded = np.pad(votes, ((0, 0), (pad, pad)))
        pooled = np.stack([padded[:, i : i + n - window] for i in range(kernel)]).sum(0) / kernel
    else:
        padded = np.pad(votes, ((0, 0), (pad, pad)), constant_values=-np.inf)
        pooled = np.stack([padded[:, i : i + n - window] for i in range(kernel)]).max(0)
    scores = np.concatenate([pooled.mean(0), np.full(window, np.inf)])
    protected = np.arange(n) >= n - window
    return top(scores.astype(np.float32), budget, protected)


def streaming_kept(q, k, n, scale, budget, kv, group, rule):
    """Per decode step, the kept positions of one KV-head cache."""
    t_total = k.shape[1]
    sinks = {"streamingllm-evict-first": 4, "h2o-adapted": 4, "h2o-streaming": 0}[rule]
    window = budget // 2 if rule == "h2o-streaming" else 0
    heads = list(range(kv * group, (kv + 1) * group))
    cache, scores, steps = [], [], []
    for t in range(t_total):
        if rule == "h2o-adapted":
            if cache:
                stored = np.array(cache)
                attn = softmax(k[kv, stored] @ k[kv, t] * scale)
                scores = list(np.array(scores) + attn)
                scores.append(0.0)
            else:
                scores = [1.0]
            cache.append(t)
        elif rule == "h2o-streaming":
            cache.append(t)
            scores.append(0.0)
            idx = np.array(cache)
            attn = softmax(np.einsum("hd,cd->hc", q[heads, t], k[kv, idx]) * scale).mean(0)
            scores = list(np.array(scores) + attn)
        else:
            cache.append(t)
        if len(cache) > budget:
            values = np.array(cache, dtype=np.float64) if rule == "streamingllm-evict-first" else np.array(scores, dtype=np.float32)
            end = len(cache) - window
            candidates = np.arange(sinks, end)
            worst = candidates[np.lexsort((-np.array(cache)[candidates], values[candidates]))[0]]
            cache.pop(worst)
            if rule != "streamingllm-evict-first":
                scores.pop(worst)
        if t >= n:
            steps.append(np.array(cache))
    return steps


def replay(meta, layers, scale, policy, budget):
    n = int(meta["prompt_len"])
    heads, kv_heads = int(meta["n_heads"]), int(meta["n_kv_heads"])
    group = heads // kv_heads
    total, count = 0.0, 0
    schedule = pyramid_budgets(budget, n, len(layers)) if policy == "pyramidkv-kv-head" else [budget] * len(layers)
    for layer, (q, k) in enumerate(layers):
        t_total = k.shape[1]
        attention = decode_attention(q, k, n, scale)  # [H, D, T]
        for kv in range(kv_heads):
            if policy in ("snapkv-kv-head", "pyramidkv-kv-head"):
                prompt = snapkv_kept(q, k, n, scale, schedule[layer], kv, group, "avg" if policy == "snapkv-kv-head" else "max")
                steps = [np.concatenate([prompt, np.arange(n, n + s + 1)]) for s in range(t_total - n)]
            elif policy == "oracle":
                steps = []
                for s in range(t_total - n):
                    p = attention[kv * group : (kv + 1) * group, s, : n + s + 1].mean(0)
                    steps.append(top(p, budget, np.zeros(len(p), dtype=bool)))
            else:
                steps = streaming_kept(q, k, n, scale, budget, kv, group, policy)
            for s, kept in enumerate(steps):
                mass = attention[kv * group : (kv + 1) * group, s, kept].sum(axis=1)
                total += float(mass.sum())
                count += group
    return total / count


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("trace")
    parser.add_argument("--budgets", default="64,128,256,512,1024,2048")
    parser.add_argument("--policies", default="snapkv-kv-head,pyramidkv-kv-head,streamingllm-evict-first,h2o-streaming,h2o-adapted,oracle")
    args = parser.parse_args()
    meta, layers, scale = load(args.trace)
    started = time.perf_counter()
    results = {}
    for policy in args.policies.split(","):
        results[policy] = {}
        for budget in [int(b) for b in args.budgets.split(",")]:
            results[policy][str(budget)] = replay(meta, layers, scale, policy, budget)
    json.dump({"results": results, "seconds": time.perf_counter() - started}, sys.stdout)


if __name__ == "__main__":
    main()
