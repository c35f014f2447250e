"""Line-by-line transcription of kvpress's SnapKV, for kvreplay's `snapkv-kvpress` preset parity
test.

Source: github.com/NVIDIA/kvpress, commit 8bb29b9c3078452a86d692f29123fa6c793e2b05:
  - kvpress/presses/snapkv_press.py, SnapKVPress: window_size 64, kernel_size 5 (lines 37-39),
    compute_window_attention (lines 41-69) and score (lines 71-100);
  - kvpress/presses/scorer_press.py, ScorerPress.compress (lines 76-102): keep the top
    `n_kept = int(k_len * (1 - compression_ratio))` scores per KV head.
Deviations, marked `# deviation`: the queries are the trace's (already rotated) instead of
re-projected from hidden states (`get_prerope_query_states` + RoPE gives the same vectors);
`n_kept` is given (the budget) instead of derived from a compression ratio; positions are
returned instead of gathered K/V; `topk` becomes `topk_stable` (kvtrace.py); float32.

Usage: kvpress_snapkv.py TRACE BUDGET...; prints {"BUDGET": {"layers": [{"kept": [[positions] per
KV head], "scores": [[score per position] per KV head]}]}} as JSON.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from kvtrace import repeat_kv, run_budgets, top_positions

WINDOW_SIZE = 64
KERNEL_SIZE = 5


def compute_window_attention(query_states, keys, window_size, num_key_value_groups):
    """compute_window_attention, lines 41-69, from the window queries on (# deviation: given)."""
    bsz, _, k_len, head_dim = keys.shape
    key_states = repeat_kv(keys, num_key_value_groups)
    attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(head_dim)
    attention_mask = torch.ones_like(attn_weights) * float("-inf")
    attention_mask = torch.triu(attention_mask, diagonal=k_len - window_size + 1)
    attn_weights += attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
    attn_weights = attn_weights[..., :-window_size]
    return attn_weights


def score(query_states, keys, window_size, kernel_size):
    """SnapKVPress.score, lines 71-100."""
    bsz, num_key_value_heads, k_len, _ = keys.shape
    num_key_value_groups = query_states.shape[1] // num_key_value_heads
    attn_weights = compute_window_attention(query_states[:, :, -window_size:, :], keys, window_size, num_key_value_groups)
    scores = attn_weights.mean(dim=-2)
    scores = F.avg_pool1d(scores, kernel_size=kernel_size, padding=kernel_size // 2, stride=1)
    # Average per group (https://github.com/FasterDecoding/SnapKV/issues/22)
    scores = scores.view(bsz, num_key_value_heads, num_key_value_groups, k_len - window_size)
    scores = scores.mean(2)
    # Add back the observation window. Use max score to make sure the window is not pruned.
    scores = F.pad(scores, (0, window_size), value=scores.max().item() + 1)
    return scores


def run(layers, prompt_len, n_kept):
    out = []
    for q, k in layers:
        queries = q[:, :, :prompt_len, :]
        keys = k[:, :, :prompt_len, :]
        window_size = min(WINDOW_SIZE, n_kept)  # deviation: the preset's window, min(64, budget)
        scores = score(queries, keys, window_size, KERNEL_SIZE)
        kept = top_positions(scores, n_kept, prompt_len)  # deviation: stable ties
        out.append({"kept": kept, "scores": scores[0].tolist()})
    return {"layers": out}




if __name__ == "__main__":
    run_budgets(run)
