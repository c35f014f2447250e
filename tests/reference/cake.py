"""Line-by-line transcription of CAKE's cache management, for kvreplay's `cake` preset parity test.

Source: github.com/antgroup/cakekv, commit c4675ce21b1d6f62d262f9a8dc0ad1e1e8ee4edd:
  - cake/model/modify_llama.py lines 90-125 (llama_attn_forward_cake, prefill: the window
    attention, the layer preference and the token score) and lines 129-135 (decode: the newest
    query's attention handed to the decoding eviction before attention runs);
  - cake/cake_cache.py lines 218-275 (CakeprefillKVCache.__call__ and evcit_layer_kvcache) and
    lines 294-324 (CakeDecodingKVCache_LayerWise.__call__);
  - cake/utils.py lines 15-19 (calculate_entropy) and 21-68 (adjust_budgets);
  - experiments/LongBench/pred_cake.py lines 33-37: window 32, gamma 200, tau1 = tau2 = 1 (the
    defaults, for models config/model2tau.json does not list).
The cache is one per KV head; scores are computed with K repeated per query head and averaged
over the group after pooling. The kept entries are gathered in `topk` order, so the cache's
order (which decode-time pooling follows) is by descending score, the window after them.
Deviations, marked `# deviation`: positions are tracked instead of K/V tensors; `topk` becomes
`topk_stable` (kvtrace.py); float32 (the authors ran bf16 attention with a float32 softmax).

Usage: cake.py TRACE BUDGET...; prints {"BUDGET": {"layers": [{"steps": [[[positions a decode query
attends over] per step] per KV head]}]}} as JSON.
"""
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kvtrace import new_query_attention, repeat_kv, run_budgets, topk_stable

WINDOW = 32
GAMMA = 200.0
TAU1 = 1.0
TAU2 = 1.0


def calculate_entropy(attention_scores):
    attention_scores = attention_scores.to(torch.float32)
    entropy = -torch.sum(attention_scores * torch.log(attention_scores + 1e-10))
    entropy= entropy.to(dtype=torch.float32)
    return entropy


def adjust_budgets(budget_list, total_budget, seq_len, layer_nums):

    budget_list = np.array(budget_list, dtype=int)
    # Limit the budget of all layers to not exceed seq_len
    excess = np.maximum(budget_list - seq_len, 0)
    budget_list = np.minimum(budget_list, seq_len)

    # Adjust excess budget
    total_excess = np.sum(excess)

    if total_excess > 0:

        valid_indices = budget_list < seq_len
        num_valid = np.sum(valid_indices)

        if num_valid > 0:

            distribute_per_layer = total_excess // num_valid
            remainder = total_excess % num_valid

            budget_list[valid_indices] += distribute_per_layer
            budget_list[np.where(valid_indices)[0][:remainder]] += 1

    # Ensure total budget equals total_budget
    current_total_budget = np.sum(budget_list)
    budget_diff = total_budget - current_total_budget

    if budget_diff != 0:
        if budget_diff > 0:
            valid_indices = budget_list < seq_len
        else:
            valid_indices = budget_list > 1

        num_valid = np.sum(valid_indices)

        if num_valid > 0:
            adjust_per_layer = abs(budget_diff) // num_valid
            remainder = abs(budget_diff) % num_valid

            if budget_diff > 0:
                budget_list[valid_indices] += adjust_per_layer
                budget_list[np.where(valid_indices)[0][:remainder]] += 1
            else:
                budget_list[valid_indices] -= adjust_per_layer
                budget_list[np.where(valid_indices)[0][:remainder]] -= 1

    return budget_list.tolist()


def prefill_scores(query_states, key_states, num_key_value_heads, window_size):
    """modify_llama.py lines 90-121: (pref_score, hh_score [1, K, T - W])."""
    bsz, num_heads, q_len, head_dim = query_states.shape
    num_key_value_groups = num_heads // num_key_value_heads
    tmp_attn_weights = torch.matmul(query_states[..., -window_size:, :], key_states.transpose(2, 3)) / math.sqrt(head_dim)

    if q_len !=1:
        mask = torch.full((window_size, window_size), torch.finfo(tmp_attn_weights.dtype).min, device=tmp_attn_weights.device)
        mask_cond = torch.arange(mask.size(-1), device=tmp_attn_weights.device)
        mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
        mask = mask.to(tmp_attn_weights.device)
        tmp_attention_mask = mask[None, None, :, :]

        tmp_attn_weights[:, :, -window_size:, -window_size:] += tmp_attention_mask

    tmp_attn_weights = nn.functional.softmax(tmp_attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)

    disp = calculate_entropy(tmp_attn_weights[:,:,-window_size:,:-window_size])
    var = torch.var(tmp_attn_weights[:,:,-window_size:,:-window_size],dim=-2).sum(0).sum(0).sum(0)

    pref_score = (disp**(1/TAU1)*var**(1/TAU2)).cpu().numpy()

    #compute preference score and hh score
    attention_score = tmp_attn_weights[:, :, -window_size:, :]

    attn_mean = attention_score.mean(dim = -2)
    attn_var = attention_score.var(dim = -2)
    attn_cache = attn_mean + GAMMA * attn_var
    attn_cache = attn_cache[:, :, :-window_size]
    attn_cache = F.avg_pool1d(attn_cache, kernel_size=5, padding=5//2, stride=1)

    attn_cache = attn_cache.reshape(bsz, num_key_value_heads, num_key_value_groups, -1)
    hh_score = attn_cache.mean(dim=-2)
    return pref_score, hh_score


def prefill_budgets(pref_scores, cache_size, window_size, num_layers, seq_len):
    """CakeprefillKVCache.__call__, cake_cache.py lines 218-247 (not cascading): per layer the
    number of entries kept before the window, or None when the prompt is not compressed."""
    total_size = (cache_size - window_size) * num_layers
    if seq_len <= cache_size + window_size:
        return None
    layer_budgets = [pref_score / sum(pref_scores) * total_size for pref_score in pref_scores]
    layer_budgets = adjust_budgets(layer_budgets, total_size, seq_len - window_size, num_layers)
    out = []
    for budget in layer_budgets:
        if budget >= seq_len - window_size:
            budget = seq_len - window_size
        out.append(budget)
    return out


def evict_layer(positions, hh_score, budget, window_size):
    """evcit_layer_kvcache, cake_cache.py lines 249-275: positions [K, S] in cache order."""
    if budget > hh_score.shape[-1]:
        budget = hh_score.shape[-1]
    indices = topk_stable(hh_score, budget)  # deviation: stable ties
    past = positions[:, :-window_size].gather(dim=1, index=indices[0])
    return torch.cat([past, positions[:, -window_size:]], dim=1)


def decode_evict(positions, attn_score_cache, hh_size, window_size, num_key_value_heads):
    """CakeDecodingKVCache_LayerWise.__call__, cake_cache.py lines 294-324."""
    num_heads = attn_score_cache.shape[1]
    bsz = 1
    num_key_value_groups = num_heads // num_key_value_heads
    seq_len = positions.size(1)
    if seq_len <= hh_size + window_size:
        return positions

    attn_cache = attn_score_cache[:, :, :, :-window_size].mean(dim = -2)

    attn_cache = F.avg_pool1d(attn_cache, kernel_size = 5, padding=5//2, stride=1)
    attn_cache = attn_cache.reshape(bsz, num_key_value_heads, num_key_value_groups, -1)

    attn_cache = attn_cache.mean(dim=-2)

    indices = topk_stable(attn_cache, hh_size)  # deviation: stable ties
    past = positions[:, :-window_size].gather(dim=1, index=indices[0])
    return torch.cat([past, positions[:, -window_size:]], dim=1)


def run(layers, prompt_len, cache_size):
    window_size = WINDOW
    prefs, scores = [], []
    for q, k in layers:
        num_key_value_heads = k.shape[1]
        key_states = repeat_kv(k[:, :, :prompt_len, :], q.shape[1] // num_key_value_heads)
        pref, hh = prefill_scores(q[:, :, :prompt_len, :], key_states, num_key_value_heads, window_size)
        prefs.append(pref)
        scores.append(hh)
    budgets = prefill_budgets(prefs, cache_size, window_size, len(layers), prompt_len)
    out = []
    for layer, (q, k) in enumerate(layers):
        num_heads, total = q.shape[1], q.shape[2]
        num_key_value_heads = k.shape[1]
        group = num_heads // num_key_value_heads
        positions = torch.arange(prompt_len).repeat(num_key_value_heads, 1)
        if budgets is not None:
            positions = evict_layer(positions, scores[layer], budgets[layer], window_size)
        # The decoding eviction exists either way: `layer_budget` holds key_size = cache_size - W
        # per layer (modify_llama.py line 124) unless the prefill cut overwrote it.
        hh_size = budgets[layer] if budgets is not None else cache_size - window_size
        steps = [[] for _ in range(num_key_value_heads)]
        for position in range(prompt_len, total):
            positions = torch.cat([positions, torch.full((num_key_value_heads, 1), position)], dim=1)
            # The newest query's attention over the cache (K repeated per query head).
            cached = torch.stack([k[0, h // group, positions[h // group]] for h in range(num_heads)])
            attn = new_query_attention(q[0, :, position, :], cached)
            positions = decode_evict(positions, attn, hh_size, window_size, num_key_value_heads)
            for h in range(num_key_value_heads):
                steps[h].append(sorted(positions[h].tolist()))
        out.append({"steps": steps})
    return {"layers": out}




if __name__ == "__main__":
    run_budgets(run)
