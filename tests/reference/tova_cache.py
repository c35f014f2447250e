"""Line-by-line transcription of TOVA's cache reduction, for kvreplay's `tova` preset parity
test.

Source: github.com/schwartz-lab-NLP/TOVA, commit 9c7d09bfff64cfc92cfb5f9d7e138cb04866e5a7,
src/tova_cache.py, TOVACache.reduce, lines 32-53: after a layer's attention, if the cache holds
more than `cache_size` keys, the last query's attention averaged over all heads of the layer ranks
them and the top `cache_size` are kept, one set for every KV head. It runs after the prompt's
forward (keeping the last prompt query's choice) and after every decode step, whose query has
attended over the kept keys and its own.
Deviations, marked `# deviation`: positions are tracked instead of K/V tensors; `torch.topk`
becomes `topk_stable` (kvtrace.py); float32.

Usage: tova_cache.py TRACE BUDGET...; prints {"BUDGET": {"layers": [{"steps": [[positions a decode query
attends over] per step]}]}} as JSON.
"""

import torch

from kvtrace import causal_attention, new_query_attention, repeat_kv, run_budgets, topk_stable


def reduce(cache_size, positions, attn_weights):
    # deviation: `positions` [num_keys] stands for key_cache/value_cache
    bsz, _, _, num_keys = attn_weights.size()

    if num_keys <= cache_size:
        return positions
    # Utilize the average attention weights to select the top-k keys and values
    mean_attn_weights = torch.mean(attn_weights[:, :, -1, :], dim=1).clone().detach()
    ind = topk_stable(mean_attn_weights, cache_size)  # deviation: stable ties
    ind = torch.sort(ind).values        # stabelizes some things for some reason
    return positions[ind[0]]




def run(layers, prompt_len, budget):
    out = []
    for q, k in layers:
        num_heads, total = q.shape[1], q.shape[2]
        keys = repeat_kv(k, num_heads // k.shape[1])[0]  # [H, T, d]
        attn = causal_attention(q[:, :, :prompt_len, :], keys[None, :, :prompt_len, :])
        positions = reduce(budget, torch.arange(prompt_len), attn)
        steps = []
        for position in range(prompt_len, total):
            positions = torch.cat([positions, torch.tensor([position])])
            attn = new_query_attention(q[0, :, position, :], keys[:, positions, :])
            steps.append(positions.tolist())
            positions = reduce(budget, positions, attn)
        out.append({"steps": steps})
    return {"layers": out}


if __name__ == "__main__":
    run_budgets(run)
