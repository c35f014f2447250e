"""Line-by-line transcription of R-KV's compression at the end of the prompt and of its decode
loop, for kvreplay's `rkv` scorer parity tests.

Source: github.com/Zefan-Cai/R-KV, commit d15c9767e67c2bd9807128fecc35223fa2484a69:
  - rkv/utils.py, compute_attention_scores, lines 8-38 (pooling="max", R1KV's call);
  - rkv/utils.py, cal_similarity, lines 42-94 (retain_direction="last");
  - rkv/compression/r1_kv.py, R1KV.update_kv, lines 43-82 and 168-179;
  - rkv/modeling.py, LlamaAttention_forward, lines 105-113 and 128-135: at the prefill the query
    cache is the prompt's last `window_size` queries, and update_kv compresses the prompt's keys;
    lines 114-125 and 152-172: while decoding each query joins the query cache (the last
    `window_size` kept), its key and value join the cache, the step attends over the whole cache,
    and, when the step's compression flag is set, update_kv compresses the cache after it;
  - rkv/modeling.py, LlamaForCausalLM_forward, lines 560-563 and 598-610: the flag for the next
    step is `length % divide_length == 0` (`divide_method = "step_length"`), `length` the tokens
    run so far.
With `--snapkv`, R-KV's `SnapKV` compression (SnapKV-D) in the same loop:
  - rkv/compression/snapkv.py, SnapKV.update_kv, lines 35-61 and 131-142: the same importance,
    its top `budget - window_size` entries by it alone, then the window.
Deviations, marked `# deviation`: positions are returned instead of gathered K/V (a compressed
cache keeps `topk`'s order, then its window, as the gathered tensors do); `topk` keeps ties at
the lower position and gathers equal scores in cache order (`topk_by_position`: torch leaves
them unspecified); float32 throughout (the code casts the mean attention to the model's dtype);
the unused `retain_ratio` branches and the kept-index recording are left out.

Usage: rkv.py [--snapkv] TRACE BUDGET...; prints {"BUDGET": {"layers": [{"kept": [[positions]
per KV head], "scores": [[score per position] per KV head]}]}} as JSON. rkv.py --decode
DIVIDE_LENGTH TRACE BUDGET... prints {"BUDGET": {"layers": [{"steps": [[[positions a decode query
attends over] per step] per KV head]}]}}. `--snapkv` may stand anywhere.
"""

import sys

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from kvtrace import run_budgets

WINDOW_SIZE = 8
KERNEL_SIZE = 7
MIX_LAMBDA = 0.07
THRESHOLD = 0.5
SNAPKV = "--snapkv" in sys.argv  # R-KV's SnapKV compression instead of R1KV's
if SNAPKV:
    sys.argv.remove("--snapkv")


def compute_attention_scores(query_states, key_states, pooling="max"):
    batch_size, q_heads, q_len, head_dim = query_states.shape
    kv_heads = key_states.shape[1]
    query_group_size = q_heads // kv_heads

    if query_group_size == 1:
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(head_dim)
    else:
        query_states = query_states.view(batch_size, kv_heads, query_group_size, q_len, head_dim)
        key_states = key_states.unsqueeze(2)
        attn_weights = torch.matmul(query_states, key_states.transpose(3, 4)) / math.sqrt(head_dim)
        if pooling == "mean":
            attn_weights = attn_weights.mean(dim=2)
        elif pooling == "max":
            attn_weights = attn_weights.max(dim=2).values
        else:
            raise ValueError("Pooling method not supported")

    return attn_weights


def cal_similarity(key_states, threshold=0.5, retain_ratio=0.2, retain_direction="last"):
    k = key_states[0]
    num_heads = k.shape[0]

    k_norm = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    similarity_cos = torch.matmul(k_norm, k_norm.transpose(-1, -2))

    for h in range(num_heads):
        similarity_cos[h].fill_diagonal_(0.0)

    similarity_mask = similarity_cos > threshold

    indices = torch.where(
        similarity_mask,
        torch.arange(similarity_mask.size(-1), device=similarity_mask.device),
        torch.zeros_like(similarity_mask, dtype=torch.long),
    )

    if retain_direction == "last":
        similarity_retain = torch.max(indices, dim=-1)[0]
    elif retain_direction == "first":
        similarity_retain = torch.min(indices, dim=-1)[0]
    else:  # deviation: the *_percent directions are not transcribed
        raise ValueError(retain_direction)

    batch_idx = torch.arange(num_heads).unsqueeze(1).repeat(1, similarity_retain.size(1))
    seq_idx = torch.arange(similarity_retain.size(1)).unsqueeze(0).repeat(num_heads, 1)

    similarity_cos[batch_idx, seq_idx, similarity_retain] = 0

    return similarity_cos.mean(dim=1).softmax(dim=-1)


def topk_by_position(scores, k, positions):
    """Per KV head the indices `topk` keeps, ties to the lower position, as kvreplay's selection
    breaks them, gathered by descending score with equal scores in their cache order (a stable
    sort over the cache, as kvreplay's `topk_order`). `x.topk(k).indices` leaves ties unspecified;
    SnapKV's max-pooled importance has many."""
    kept = []
    for head, row in enumerate(scores[0].tolist()):
        chosen = sorted(range(len(row)), key=lambda i: (-row[i], positions[head][i]))[:k]
        kept.append(sorted(sorted(chosen), key=lambda i: -row[i]))
    return torch.tensor(kept)[None]


def update_kv(key_states, query_states, budget, positions=None):
    """R1KV.update_kv (SnapKV.update_kv with `--snapkv`): per KV head the cache entries it
    keeps, in the order it gathers them (`topk`'s, then the window), and the final scores;
    `positions` are each head's cache entries' positions (for ties)."""
    kv_cache_len = key_states.shape[-2]
    if kv_cache_len < budget:
        everything = list(range(kv_cache_len))
        return [everything] * key_states.shape[1], None  # deviation: entries
    attn_weights = compute_attention_scores(query_states, key_states)
    attn_weights_sum = nn.functional.softmax(
        attn_weights[:, :, -WINDOW_SIZE:, :-WINDOW_SIZE], dim=-1, dtype=torch.float32
    ).mean(dim=-2)  # deviation: no cast to the model's dtype
    attn_cache = F.max_pool1d(
        attn_weights_sum, kernel_size=KERNEL_SIZE, padding=KERNEL_SIZE // 2, stride=1
    )
    if SNAPKV:  # SnapKV.update_kv: the importance alone
        final_score = attn_cache
    else:
        similarity_cos = cal_similarity(key_states, threshold=THRESHOLD, retain_direction="last")[
            :, :-WINDOW_SIZE
        ]
        final_score = attn_cache * MIX_LAMBDA - similarity_cos * (1 - MIX_LAMBDA)
    if positions is None:  # the prompt: the cache in position order
        positions = [list(range(kv_cache_len))] * key_states.shape[1]
    indices = topk_by_position(final_score, budget - WINDOW_SIZE, positions)  # deviation: ties
    window = list(range(kv_cache_len - WINDOW_SIZE, kv_cache_len))
    kept = [head.tolist() + window for head in indices[0]]  # deviation: entries
    return kept, final_score[0].tolist()


def run(layers, prompt_len, budget):
    out = []
    for q, k in layers:
        query_cache = q[:, :, prompt_len - WINDOW_SIZE : prompt_len, :]
        kept, scores = update_kv(k[:, :, :prompt_len, :], query_cache, budget)
        out.append({"kept": [sorted(head) for head in kept], "scores": scores})
    return {"layers": out}


def run_decoding(layers, prompt_len, budget, divide_length):
    out = []
    for q, k in layers:
        kv_heads, total = k.shape[1], q.shape[2]
        # prefill: the query cache and the prompt's compression
        query_cache = q[:, :, prompt_len - WINDOW_SIZE : prompt_len, :]
        kept, _ = update_kv(k[:, :, :prompt_len, :], query_cache, budget)
        cached = [list(head) for head in kept]  # deviation: positions per KV head, cache order
        length = prompt_len
        compression = length % divide_length == 0
        steps = [[] for _ in range(kv_heads)]
        for position in range(prompt_len, total):
            query_cache = torch.cat((query_cache, q[:, :, position : position + 1, :]), dim=2)
            if query_cache.shape[-2] > WINDOW_SIZE:
                query_cache = query_cache[:, :, -WINDOW_SIZE:, :]
            cached = [head + [position] for head in cached]  # past_key_value.update
            for head, step in zip(cached, steps):
                step.append(sorted(head))  # the step attends over the whole cache
            if compression:
                key_states = torch.stack([k[0, h, cached[h], :] for h in range(kv_heads)])[None]
                kept, _ = update_kv(key_states, query_cache, budget, cached)
                cached = [[cached[h][i] for i in kept[h]] for h in range(kv_heads)]
            length += 1
            compression = length % divide_length == 0
        out.append({"steps": steps})
    return {"layers": out}


if __name__ == "__main__":
    if sys.argv[1] == "--decode":
        divide_length = int(sys.argv.pop(2))
        sys.argv.pop(1)
        run_budgets(lambda layers, prompt_len, budget: run_decoding(layers, prompt_len, budget, divide_length))
    else:
        run_budgets(run)
