"""Line-by-line transcription of KVCache-Factory's prompt compression (the code the PyramidKV
paper ran), for kvreplay's preset parity tests.

Source: github.com/Zefan-Cai/KVCache-Factory, commit c97f9d706d63d1b56e980f8b81b2a924c21162b3,
pyramidkv/pyramidkv_utils.py:
  - SnapKVCluster.update_kv, lines 494-539 (query-head path: K/V repeated before compression by
    `maybe_repeat_kv_before_cache`, lines 133-139, the default `kv_cache_granularity`);
  - PyramidKVCluster.update_kv, lines 348-438 (beta 20, the class default, line 324);
  - H2OKVCluster.update_kv, lines 815-862;
  - AdaKVCluster.calcul_attn_sore and update_kv, lines 971-1091 (floor 0.2 and normalize True
    from init_adakv, lines 1408-1438);
  - settings of run_longbench.py lines 267-284: window 8, kernel 7, max pooling.
Deviations, each marked `# deviation` where it happens:
  - the kept token *positions* are returned instead of the gathered K/V tensors;
  - `topk(...)`/`sort(descending=True)` become `topk_stable`/a stable sort (see kvtrace.py): ties
    go to the lower index;
  - float32 throughout (the paper's runs used fp16 attention with a float32 softmax), as the trace
    stores float32.

Usage: kvcache_factory.py TRACE METHOD:BUDGET..., METHOD in snapkv, pyramidkv, h2o, adakv; prints
{"METHOD:BUDGET": {"layers": [{"kept": [[positions] per query head], "scores": [[score per
position before the window] per query head]}]}} as JSON (scores: what the selection ranks).
"""
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

from kvtrace import emit, load, repeat_kv, topk_stable

WINDOW = 8
KERNEL = 7
POOLING = "maxpool"


def window_vote(query_states, key_states, window_size, kernel_size, pooling, reduce="sum"):
    """Lines 509-525 (SnapKV; PyramidKV lines 408-424 are the same; AdaKV lines 975-1001 take the
    mean over the window instead of the sum)."""
    bsz, num_heads, q_len, head_dim = query_states.shape
    attn_weights = torch.matmul(query_states[..., -window_size:, :], key_states.transpose(2, 3)) / math.sqrt(head_dim)
    mask = torch.full((window_size, window_size), torch.finfo(attn_weights.dtype).min, device=attn_weights.device)
    mask_cond = torch.arange(mask.size(-1), device=attn_weights.device)
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
    mask = mask.to(attn_weights.device)
    attention_mask = mask[None, None, :, :]

    attn_weights[:, :, -window_size:, -window_size:] += attention_mask

    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
    if reduce == "sum":
        attn_weights_sum = attn_weights[:, :, -window_size:, : -window_size].sum(dim = -2)
    else:
        attn_weights_sum = attn_weights[:, :, -window_size:, : -window_size].mean(dim=-2)
    if pooling == 'avgpool':
        attn_cache = F.avg_pool1d(attn_weights_sum, kernel_size = kernel_size, padding=kernel_size//2, stride=1)
    elif pooling == 'maxpool':
        attn_cache = F.max_pool1d(attn_weights_sum, kernel_size = kernel_size, padding=kernel_size//2, stride=1)
    else:
        raise ValueError('Pooling method not supported')
    return attn_cache


def keep(indices, q_len, window_size):
    """Lines 533-538: the selected past plus the window (`k_cur`), as positions (# deviation)."""
    heads = []
    for head in indices[0]:
        heads.append(sorted(head.tolist()) + list(range(q_len - window_size, q_len)))
    return heads


def snapkv(query_states, key_states, max_capacity_prompt, num_hidden_layers, layer_idx):
    bsz, num_heads, q_len, head_dim = query_states.shape
    if q_len < max_capacity_prompt:
        return [list(range(q_len))] * num_heads, None
    attn_cache = window_vote(query_states, key_states, WINDOW, KERNEL, POOLING)
    indices = topk_stable(attn_cache, max_capacity_prompt - WINDOW)  # deviation: stable ties
    return keep(indices, q_len, WINDOW), attn_cache


def pyramidkv(query_states, key_states, max_capacity_prompt_, num_hidden_layers, layer_idx, beta=20):
    window_size = WINDOW
    bsz, num_heads, q_len, head_dim = query_states.shape
    min_num = (max_capacity_prompt_ - window_size) // beta
    max_num = (max_capacity_prompt_ - window_size) * 2 - min_num
    if max_num >= q_len - window_size:
        max_num = q_len - window_size
        min_num = (max_capacity_prompt_ - window_size) * 2 - max_num
    steps = (max_num - min_num) // (num_hidden_layers - 1)
    max_capacity_prompt = max_num - layer_idx * steps
    if q_len < max_capacity_prompt_:
        return [list(range(q_len))] * num_heads, None
    elif q_len < (max_capacity_prompt_ - window_size) * 2:
        attn_cache = window_vote(query_states, key_states, window_size, KERNEL, POOLING)
        indices = topk_stable(attn_cache, max_capacity_prompt_ - window_size)  # deviation
    else:
        attn_cache = window_vote(query_states, key_states, window_size, KERNEL, POOLING)
        indices = topk_stable(attn_cache, max_capacity_prompt)  # deviation
    return keep(indices, q_len, window_size), attn_cache


def h2o(query_states, key_states, max_capacity_prompt, num_hidden_layers, layer_idx):
    window_size = WINDOW
    bsz, num_heads, q_len, head_dim = query_states.shape
    if q_len < max_capacity_prompt:
        return [list(range(q_len))] * num_heads, None
    attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(head_dim)
    mask = torch.full((q_len, q_len), torch.finfo(attn_weights.dtype).min, device=attn_weights.device)
    mask_cond = torch.arange(mask.size(-1), device=attn_weights.device)
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
    mask = mask.to(attn_weights.device)
    attention_mask = mask[None, None, :, :]

    attn_weights += attention_mask

    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
    attn_weights_sum = attn_weights[:, :, :, : -window_size].sum(dim = -2)
    attn_cache = attn_weights_sum
    indices = topk_stable(attn_cache, max_capacity_prompt - window_size)  # deviation
    return keep(indices, q_len, window_size), attn_cache


def adakv(query_states, key_states, max_capacity_prompt, num_hidden_layers, layer_idx, floor=0.2, normalize=True):
    window_size = WINDOW
    base_capacity = max_capacity_prompt - window_size
    floor_capacity = int(base_capacity * floor)
    bsz, _, q_len, head_dim = query_states.shape
    num_heads = key_states.shape[1]
    attn_score = window_vote(query_states, key_states, window_size, KERNEL, POOLING, reduce="mean")
    if base_capacity > attn_score.size(-1):
        return [list(range(q_len))] * num_heads, None
    # deviation: a stable sort, so equal scores keep index order
    sorted_attn_score, sorted_attn_score_indices = torch.sort(attn_score, dim=-1, descending=True, stable=True)
    adaptive_attn_score = sorted_attn_score
    length = adaptive_attn_score.size(dim=-1)
    if normalize:
        ratio_weight = sorted_attn_score[..., :base_capacity].sum(dim=-1, keepdim=True) / sorted_attn_score.sum(dim=-1, keepdim=True)
        adaptive_attn_score = adaptive_attn_score * ratio_weight
    adaptive_attn_score = adaptive_attn_score.reshape(bsz, length * num_heads)
    sorted_indices = topk_stable(adaptive_attn_score, num_heads * base_capacity)  # deviation
    sorted_indices = sorted_indices // length
    head_adaptive_capacity = torch.zeros((bsz, num_heads), dtype=sorted_indices.dtype)
    head_adaptive_capacity.scatter_add_(-1, sorted_indices, torch.ones_like(sorted_indices, dtype=head_adaptive_capacity.dtype))
    assert head_adaptive_capacity.sum().item() == num_heads * base_capacity
    head_adaptive_capacity = torch.round(head_adaptive_capacity * (1 - floor) + floor_capacity).int()
    sorted_attn_score_indices = sorted_attn_score_indices.split(1, dim=1)
    heads = []
    for head_idx in range(num_heads):
        cache_index = sorted_attn_score_indices[head_idx][..., :head_adaptive_capacity[0][head_idx]]
        heads.append(sorted(cache_index.flatten().tolist()) + list(range(q_len - window_size, q_len)))
    return heads, attn_score


METHODS = {"snapkv": snapkv, "pyramidkv": pyramidkv, "h2o": h2o, "adakv": adakv}


def run(layers, prompt_len, method, budget):
    out = []
    for layer_idx, (q, k) in enumerate(layers):
        group = q.shape[1] // k.shape[1]
        # The prefill: the prompt's queries and keys, K repeated per query head.
        query_states = q[:, :, :prompt_len, :]
        key_states = repeat_kv(k[:, :, :prompt_len, :], group)
        kept, scores = METHODS[method](query_states, key_states, budget, len(layers), layer_idx)
        out.append({
            "kept": kept,
            "scores": None if scores is None else scores[0].tolist(),
        })
    return {"layers": out}


def main():
    meta, layers = load(sys.argv[1])
    prompt_len = int(meta["prompt_len"])
    results = {}
    for spec in sys.argv[2:]:
        method, budget = spec.split(":")
        results[spec] = run(layers, prompt_len, method, int(budget))
    emit(results)


if __name__ == "__main__":
    main()
