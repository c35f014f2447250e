"""Line-by-line transcription of StreamingLLM's cache, for kvreplay's `streamingllm` preset parity
test.

Source: github.com/mit-han-lab/streaming-llm, commit 2e5042606d69933d88fbf909bd77907456b9b4dd:
  - streaming_llm/kv_cache.py, StartRecentKVCache.__call__, lines 40-64: a cache longer than
    start_size + recent_size keeps its first start_size and last recent_size entries;
  - examples/eval_long_ppl.py, lines 80-93: the text runs one token at a time, each token attending
    over the cache and itself, then the cache is cut (`kv_cache(past_key_values)`);
  - start_size 4 (the default, kv_cache.py line 26); recent_size = budget - 4.
Every head keeps the same positions. Deviations, marked `# deviation`: positions are tracked
instead of K/V tensors; original positions are kept (the official pos-shift option re-numbers
them, which a replay of the full model's vectors does not do).

Usage: streaming_llm.py TRACE BUDGET...; prints {"BUDGET": {"layers": [{"steps": [[positions a
decode query attends over] per step]}]}} as JSON.
"""

from kvtrace import run_budgets


class StartRecentKVCache:
    def __init__(self, start_size=4, recent_size=512):
        self.start_size = start_size
        self.recent_size = recent_size
        self.cache_size = start_size + recent_size

    def __call__(self, positions):
        # deviation: `positions` stands for past_key_values
        seq_len = len(positions)
        if seq_len <= self.cache_size:
            return positions
        return positions[0:self.start_size] + positions[seq_len - self.recent_size:seq_len]


def run(layers, prompt_len, budget):
    total = layers[0][0].shape[2]
    start_size = min(4, budget)
    kv_cache = StartRecentKVCache(start_size=start_size, recent_size=budget - start_size)
    positions, steps = [], []
    for idx in range(total):
        positions = positions + [idx]
        if idx >= prompt_len:
            steps.append(list(positions))
        positions = kv_cache(positions)
    # Recency does not depend on the layer's vectors: every layer keeps the same.
    return {"layers": [{"steps": steps} for _ in layers]}




if __name__ == "__main__":
    run_budgets(run)
