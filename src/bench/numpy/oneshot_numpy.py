#!/usr/bin/env python3
"""The strong NumPy reference of `kvreplay bench`'s one-shot grid: a sweep of one-shot policies
over budgets written the way a careful researcher would vectorise it. Every score that does not
depend on the budget is computed once per layer and KV group (the decode attention, SnapKV's
pooled window votes, H2O's cumulative prompt attention, the static oracle's future attention, the
per-step oracle's per-step orders), each score vector is ranked once, and the retained mass of
every budget comes from one cumulative sum along that ranking. Written from the method
descriptions (docs/policies.md), NumPy only.

Usage: oneshot_numpy.py TRACE --budgets 64,128 [--policies snapkv,...] > results.json
Prints {"results": {policy: {budget: mass}}, "seconds": s} as JSON (mean retained mass over
layers, query heads and decode steps).

Policies (KV-head caches, the group's scores averaged; ties keep the lower position; a budget
counts the protected tokens):
  snapkv                flat, window 8 protected, avg-pool kernel 7 (zero padding counted)
  pyramidkv             official schedule (beta 20, floor rounding), window 8, max-pool kernel 7
  streamingllm-oneshot  4 sinks and the window protected, then the most recent
  h2o-oneshot           each prompt token's cumulative causal attention from the prompt's
                        queries, window 8 protected
  oracle-static         each prompt token's attention from the future decode queries, summed,
                        window 8 protected
  oracle                per decode step, the top-budget of the current query's attention over
                        the whole prefix
"""
import argparse
import json
import sys
import time

import numpy as np

from replay_numpy import load, pyramid_budgets, softmax

WINDOW, KERNEL, SINKS = 8, 7, 4
POLICIES = ["snapkv-kv-head", "pyramidkv-kv-head", "streamingllm-oneshot", "h2o-oneshot", "oracle-static", "oracle"]


def decode_attention(q, k, n, scale):
    """[H, D, T] full causal attention of the decode queries."""
    heads, t, _ = q.shape
    group = heads // k.shape[0]
    logits = np.einsum("hsd,htd->hst", q[:, n:], np.repeat(k, group, axis=0)) * scale
    logits[:, np.arange(t)[None, :] > np.arange(n, t)[:, None]] = -np.inf
    return softmax(logits)


def window_votes(q, k, n, scale, heads, kv, pool):
    """SnapKV's pooled votes of the last WINDOW prompt queries, group mean, [n - WINDOW]."""
    logits = np.einsum("hwd,td->hwt", q[heads, n - WINDOW : n], k[kv, :n]) * scale
    logits[:, np.arange(n)[None, :] > np.arange(n - WINDOW, n)[:, None]] = -np.inf
    votes = softmax(logits).sum(axis=1)[:, : n - WINDOW]
    pad = KERNEL // 2
    fill = 0.0 if pool == "avg" else -np.inf
    padded = np.pad(votes, ((0, 0), (pad, pad)), constant_values=fill)
    windows = np.stack([padded[:, i : i + n - WINDOW] for i in range(KERNEL)])
    pooled = windows.sum(0) / KERNEL if pool == "avg" else windows.max(0)
    return pooled.mean(0)


def cumulative_attention(q, k, n, scale, heads, kv):
    """H2O's one-shot score: each prompt token's causal attention summed over the prompt's
    queries, group mean, [n] (one head at a time: an n x n block each)."""
    total = np.zeros(n)
    mask = np.arange(n)[None, :] > np.arange(n)[:, None]
    for h in heads:
        logits = q[h, :n] @ k[kv, :n].T * scale
        logits[mask] = -np.inf
        total += softmax(logits).sum(axis=0)
    return total / len(heads)


def ranked(scores, protected):
    """Positions in keeping order: protected first, then by score, ties to the lower position."""
    return np.lexsort((np.arange(len(scores)), -scores, ~protected))


def prompt_mass(attention, order, n, budgets):
    """Mean retained mass of one group's heads and steps for each budget, when the prompt
    positions `order[:B]` are kept (every generated position is kept too)."""
    generated = attention[:, :, n:].sum(-1)  # [h, D]
    along = np.cumsum(attention[:, :, order], axis=-1)  # [h, D, n]
    return {b: float((along[:, :, min(b, n) - 1] + generated).mean()) for b in budgets}


def layer_masses(q, k, n, scale, group, budgets, schedule_budget):
    """{policy: {budget: summed mean mass over the layer's KV groups}} for one layer;
    `schedule_budget(b)` is PyramidKV's budget at this layer for nominal budget b."""
    attention = decode_attention(q, k, n, scale)
    protected = np.arange(n) >= n - WINDOW
    out = {policy: dict.fromkeys(budgets, 0.0) for policy in POLICIES}
    for kv in range(k.shape[0]):
        heads = list(range(kv * group, (kv + 1) * group))
        att = attention[heads]
        scores = {
            "snapkv-kv-head": np.concatenate([window_votes(q, k, n, scale, heads, kv, "avg"), np.full(WINDOW, np.inf)]),
            "pyramidkv-kv-head": np.concatenate([window_votes(q, k, n, scale, heads, kv, "max"), np.full(WINDOW, np.inf)]),
            "streamingllm-oneshot": np.arange(n, dtype=np.float64),
            "h2o-oneshot": cumulative_attention(q, k, n, scale, heads, kv),
            "oracle-static": att[:, :, :n].mean(0).sum(0),
        }
        for policy, score in scores.items():
            keep_first = protected | (np.arange(n) < SINKS) if policy == "streamingllm-oneshot" else protected
            order = ranked(score, keep_first)
            if policy == "pyramidkv-kv-head":
                masses = prompt_mass(att, order, n, sorted({schedule_budget(b) for b in budgets}))
                for b in budgets:
                    out[policy][b] += masses[schedule_budget(b)]
            else:
                for b, mass in prompt_mass(att, order, n, budgets).items():
                    out[policy][b] += mass
        # Per-step oracle: one ranking per step of the group's mean attention, all budgets from
        # one cumulative sum along it.
        mean = att.mean(0)  # [D, T], 0 beyond each step's position
        steps, t = mean.shape
        order = np.lexsort((np.broadcast_to(np.arange(t), mean.shape), -mean), axis=-1)
        along = np.cumsum(np.take_along_axis(att, np.broadcast_to(order, att.shape), axis=-1), axis=-1)
        visible = n + np.arange(steps) + 1  # positions each step may keep
        for b in budgets:
            last = np.minimum(b, visible) - 1
            out["oracle"][b] += float(along[:, np.arange(steps), last].mean())
    return {policy: {b: v / k.shape[0] for b, v in masses.items()} for policy, masses in out.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("trace")
    parser.add_argument("--budgets", default="64,128,256,512")
    parser.add_argument("--policies", default=",".join(POLICIES), help="a subset of the grid's")
    args = parser.parse_args()
    unknown = set(args.policies.split(",")) - set(POLICIES)
    if unknown:
        sys.exit(f"unknown policies: {sorted(unknown)}")
    budgets = [int(b) for b in args.budgets.split(",")]
    meta, layers, scale = load(args.trace)
    n = int(meta["prompt_len"])
    group = int(meta["n_heads"]) // int(meta["n_kv_heads"])
    started = time.perf_counter()
    schedules = {b: pyramid_budgets(b, n, len(layers)) for b in budgets}
    totals = {policy: dict.fromkeys(budgets, 0.0) for policy in POLICIES}
    for index, (q, k) in enumerate(layers):
        masses = layer_masses(q, k, n, scale, group, budgets, lambda b: schedules[b][index])
        for policy in POLICIES:
            for b in budgets:
                totals[policy][b] += masses[policy][b]
    results = {p: {str(b): v / len(layers) for b, v in by.items()} for p, by in totals.items()}
    json.dump({"results": results, "seconds": time.perf_counter() - started}, sys.stdout)


if __name__ == "__main__":
    main()
