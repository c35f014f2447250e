"""SnapKV in NumPy: the last `window` prompt queries vote for the keys before them.

Li et al., 2024 (arXiv:2404.14469), as kvreplay's `snapkv` scorer computes it: each query head's
causal attention from the observation window (the policy's protected `window`), summed over the
window, average-pooled along positions (kernel 7, zero padding counted), averaged over the GQA
group. Run: python examples/python/snapkv.py TRACE [BUDGET]
"""

import sys

import numpy as np

import kvreplay


class SnapKV:
    name = "snapkv-numpy"
    timings = ("prefill",)

    def __init__(self, kernel=7):
        self.kernel = kernel

    def score(self, cache):
        n, w = cache.prompt_len, max(cache.window, 1)
        q, k = cache.queries[:, n - w : n], cache.keys[:n]
        logits = (q @ k.T) * cache.scale  # [heads, w, n]
        if cache.softcap is not None:
            logits = cache.softcap * np.tanh(logits / cache.softcap)
        causal = np.arange(n)[None, :] > np.arange(n - w, n)[:, None]
        logits = np.where(causal, -np.inf, logits)
        weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        votes = weights[:, :, : n - w].sum(axis=1)  # [heads, n - w]
        box = np.ones(self.kernel, dtype=votes.dtype) / self.kernel
        pooled = np.stack([np.convolve(v, box, mode="same") for v in votes])
        scores = np.append(pooled.mean(axis=0), np.zeros(w, dtype=pooled.dtype))
        return scores[cache.positions].astype(np.float32)


if __name__ == "__main__":
    trace, budget = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 128
    ours = kvreplay.kept(trace, scorer=SnapKV(), budget=budget)["mask"]
    rust = kvreplay.kept(trace, scorer="snapkv", budget=budget)["mask"]
    print(f"kept sets equal to the Rust scorer's: {np.array_equal(ours, rust)}")
    print(kvreplay.replay(trace, scorer=SnapKV(), budget=budget).runs)
