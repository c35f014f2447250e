"""Line-by-line transcription of H2O's own generation-time eviction, for kvreplay's `h2o` preset
parity test.

Source: github.com/FMInference/H2O, commit ac75c2a8a9e76832b2a4139b9363373b56336bfb,
h2o_hf/utils_real_drop/modify_llama.py:
  - H2OKVCache_LayerWise.__call__ and _update_hh_score, lines 258-287 and 317-326;
  - its use in H2OLlamaAttention.forward, line 509: after attention, `kv_cache(past_key_value,
    attn_weights)` with the cache already holding the new token, so a decode query attends over
    the kept tokens and itself, then one is evicted;
  - the model predates GQA: every query head has its own cache (K/V repeated per query head).
The prompt runs in one pass with full (causal) attention; its heavy-hitter scores are the column
sums of all prompt queries' attention. Budget B: hh_size = B // 2, recent_size = B - B // 2.
Deviations, marked `# deviation`: positions are tracked instead of K/V tensors; `torch.topk`
becomes `topk_stable` (kvtrace.py); float32.

Usage: h2o_real_drop.py TRACE BUDGET...; prints {"BUDGET": {"layers": [{"steps": [[[positions a decode query
attends over] per step] per query head]}]}} as JSON.
"""

import torch

from kvtrace import causal_attention, new_query_attention, repeat_kv, run_budgets, topk_stable


class H2OKVCache_LayerWise:
    def __init__(self, hh_size=4, recent_size=512, k_seq_dim=2, v_seq_dim=2):
        self.hh_size = hh_size
        self.recent_size = recent_size
        self.cache_size = hh_size + recent_size
        self.k_seq_dim = k_seq_dim
        self.v_seq_dim = v_seq_dim
        self.hh_score = None

    def __call__(self, positions, attn_score_cache):
        # deviation: `positions` [num_heads, seq_len] stands for past_key_values
        self._update_hh_score(attn_score_cache)

        seq_len = positions.size(-1)
        if seq_len <= self.cache_size:
            return positions

        # hh-selection
        num_heads = positions.shape[0]

        select_hh_scores = self.hh_score[:, :seq_len - self.recent_size]
        keep_topk = topk_stable(select_hh_scores, self.hh_size)  # deviation: stable ties
        keep_topk = keep_topk.sort().values

        keep_recent = torch.arange(seq_len - self.recent_size, seq_len, device=keep_topk.device).repeat(keep_topk.shape[0], 1)
        keep_idx = torch.cat([keep_topk, keep_recent], dim=-1)

        mask = torch.zeros(self.hh_score.shape, dtype=torch.bool)
        mask = mask.scatter(-1, keep_idx, 1)

        positions = positions[mask].view(num_heads, -1)

        self.hh_score = self.hh_score[mask].view(num_heads, self.cache_size)

        return positions

    def _update_hh_score(self, attn_score_cache):
        num_new_tokens = attn_score_cache.shape[2]

        if self.hh_score is None:
            self.hh_score = attn_score_cache.sum(0).sum(1)
        else:
            attn_score_cache = attn_score_cache.sum(0).sum(1)
            attn_score_cache[:, :-num_new_tokens] += self.hh_score
            self.hh_score = attn_score_cache




def run(layers, prompt_len, budget):
    out = []
    for q, k in layers:
        num_heads, total = q.shape[1], q.shape[2]
        keys = repeat_kv(k, num_heads // k.shape[1])[0]  # [H, T, d]
        cache = H2OKVCache_LayerWise(hh_size=budget // 2, recent_size=budget - budget // 2)
        # Prefill: the whole prompt with full causal attention.
        attn = causal_attention(q[:, :, :prompt_len, :], keys[None, :, :prompt_len, :])
        positions = torch.arange(prompt_len).repeat(num_heads, 1)
        positions = cache(positions, attn)
        steps = [[] for _ in range(num_heads)]
        for position in range(prompt_len, total):
            positions = torch.cat([positions, torch.full((num_heads, 1), position)], dim=-1)
            cached_keys = torch.stack([keys[h, positions[h]] for h in range(num_heads)])  # [H, n, d]
            attn = new_query_attention(q[0, :, position, :], cached_keys)
            for h in range(num_heads):
                steps[h].append(positions[h].tolist())
            positions = cache(positions, attn)
        out.append({"steps": steps})
    return {"layers": out}


if __name__ == "__main__":
    run_budgets(run)
