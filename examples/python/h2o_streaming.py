"""H2O as its generation code runs it, in NumPy, through the incremental protocol: each cache's
state adds every arriving query's attention to the scores of the keys it holds, and forgets the
keys evicted, instead of recomputing the history at each choice.

Zhang et al., NeurIPS 2023 (arXiv:2306.14048): the heavy-hitter score is the attention a key has
received from every query since it arrived, its own included. kvreplay's `h2o` preset runs the
`true-query` scorer this way: the prompt scored whole and cut at its end, then one eviction per
generated token after the token's attention (`prefill-then-stream`, `attend-first`), one cache
per query head.
Run: python examples/python/h2o_streaming.py TRACE [BUDGET]
"""

import sys

import numpy as np

import kvreplay


class H2OStreaming:
    name = "h2o-streaming-numpy"
    timings = ("prefill-then-stream", "streaming")

    def start(self):
        return HeavyHitters()


class HeavyHitters:
    """One cache: its keys in arrival order and the attention each has received."""

    def __init__(self):
        self.positions = np.zeros(0, dtype=np.int64)
        self.keys = None  # [capacity, d]; the first len(positions) rows are held
        self.received = np.zeros(0, dtype=np.float32)

    def append(self, token):
        n = len(self.positions)
        if self.keys is None or n == len(self.keys):
            grown = np.zeros((max(2 * n, 64), len(token.key)), dtype=np.float32)
            grown[:n] = self.keys[:n] if self.keys is not None else grown[:0]
            self.keys = grown
        self.keys[n] = token.key
        self.positions = np.append(self.positions, token.position)
        logits = (token.queries @ self.keys[: n + 1].T) * token.scale  # [heads, cached]
        if token.softcap is not None:
            logits = token.softcap * np.tanh(logits / token.softcap)
        weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        self.received = np.append(self.received, np.float32(0)) + weights.mean(axis=0)

    def evict(self, positions):
        kept = ~np.isin(self.positions, positions)
        n = int(kept.sum())
        self.keys[:n] = self.keys[: len(kept)][kept]
        self.positions, self.received = self.positions[kept], self.received[kept]

    def score(self, cache):
        at = np.searchsorted(self.positions, cache.positions)
        return self.received[at]


if __name__ == "__main__":
    trace, budget = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 128
    ours = kvreplay.kept(trace, scorer=H2OStreaming(), budget=budget, preset="h2o", steps=True)["mask"]
    rust = kvreplay.kept(trace, preset="h2o", budget=budget, steps=True)["mask"]
    print(f"kept sets equal to the h2o preset's: {np.array_equal(ours, rust)}")
