"""One-shot H2O in NumPy: keep the heavy hitters, the keys the prompt's queries attended most.

Zhang et al., NeurIPS 2023 (arXiv:2306.14048), cut once at the end of the prompt as the PyramidKV
paper's H2O baseline does (kvreplay's `true-query` scorer under `--timing prefill`): every prompt
query's causal attention, averaged over the GQA group, summed per key.
Run: python examples/python/h2o.py TRACE [BUDGET]
"""

import sys

import numpy as np

import kvreplay


class H2O:
    name = "h2o-numpy"
    timings = ("prefill",)

    def score(self, cache):
        n = cache.prompt_len
        q, k = cache.queries[:, :n], cache.keys[:n]
        logits = (q @ k.T) * cache.scale  # [heads, n, n]
        if cache.softcap is not None:
            logits = cache.softcap * np.tanh(logits / cache.softcap)
        logits = np.where(np.triu(np.ones((n, n), dtype=bool), 1), -np.inf, logits)
        weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        received = weights.mean(axis=0).sum(axis=0)  # [n]
        return received[cache.positions].astype(np.float32)


if __name__ == "__main__":
    trace, budget = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 128
    ours = kvreplay.kept(trace, scorer=H2O(), budget=budget)["mask"]
    rust = kvreplay.kept(trace, scorer="true-query", budget=budget)["mask"]
    print(f"kept sets equal to the Rust scorer's: {np.array_equal(ours, rust)}")
    print(kvreplay.replay(trace, scorer=H2O(), budget=budget).runs)
