"""Line-by-line transcription of DefensiveKV's press, for kvreplay's `defensivekv` parity test.

Source: github.com/FFY0/DefensiveKV, commit 9251b95e7e282a6c18dd98ef6318dd489e639a58 (kvpress/presses/):
  - efficient_defensivekv_press.py, EfficientDefensiveKVPress.compute_window_attention, lines
    116-156: the last `window_size` queries' softmax over the keys up to each, cut to the keys
    before the window, and `window_bias`;
  - the same file, EfficientDefensiveKVPress.score, lines 158-227: the group-and-window mean,
    pooling rescaled to each row's sum, the defensive max clamped at its mean, the window padded
    with the maximum;
  - the same file, EfficientDefensiveKVPress.vwl1norm, lines 32-75 (the pure-torch twin of the
    Triton `vwl1norm_triton` that `score` calls, lines 78-112: the same arithmetic): the value
    norms through o_proj normalised across KV heads, CriticalKV's stage 1;
  - efficient_ada_scorer_press.py, EfficientAdaScorerPress.compress, lines 46-96: one top-k of
    `int(q_len * (1 - compression_ratio) * num_key_value_heads)` over the layer's flattened
    scores, counted per head;
  - with --layer, Layer-DefensiveKV (efficient_layer_defensivekv_press.py: the same `score`) over
    efficient_ada_global_scorer_press.py, EfficientAdaGlobalScorerPress.compress, lines 123-197:
    one top-k of `int(q_len * (1 - compression_ratio) * num_key_value_heads * num_layers)` over
    every layer's flattened scores, counted per layer, then `layer_compress`, lines 44-120: each
    layer's top-k of its count over its flattened scores.
Deviations, marked `# deviation`: the window's queries are the trace's (the queries the model's
q_proj and rotary gave, which compute_window_attention recomputes from the hidden states); the
compression ratio is `1 - BUDGET / prompt_len` (budgets chosen so that it is exact); `topk` and
stage 1's `sort` keep ties at the lower index (`topk_stable`; torch leaves them unspecified);
positions are returned instead of gathered keys and values; float32 throughout; batch size 1.

Usage: defensivekv.py TRACE [--layer] WINDOW BUDGET...; prints {"BUDGET": {"layers": [{"kept": [[positions]
per KV head], "scores": [[score per position] per KV head]}]}} as JSON.
"""

import math
import sys

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from kvtrace import emit, load, load_values, repeat_kv, topk_stable

KERNEL_SIZE = 5


def compute_window_attention(query_states, keys, window_size, q_len):
    # deviation: query_states [1, H, window, d] are the trace's last `window_size` queries.
    head_dim = query_states.shape[-1]
    num_key_value_groups = query_states.shape[1] // keys.shape[1]
    key_states = repeat_kv(keys, num_key_value_groups)
    attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(head_dim)
    attention_mask = torch.ones_like(attn_weights) * float("-inf")
    attention_mask = torch.triu(attention_mask, diagonal=q_len - window_size + 1)
    attn_weights += attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
    attn_weights = attn_weights[..., :-window_size]

    window_bias = attn_weights[..., -window_size:].sum(dim=-1).mean().item()

    return attn_weights, window_bias


def vwl1norm(values, o_proj_weight, num_attention_heads, scores, window_bias, ave_attn_weights,
             compression_ratio, window_size):
    bsz, num_key_value_heads, q_len, head_dim = values.shape
    num_key_value_groups = num_attention_heads // num_key_value_heads
    Wo = o_proj_weight.transpose(0, 1)
    Wo = Wo.view(num_attention_heads, head_dim, o_proj_weight.shape[0])

    V = repeat_kv(values, num_key_value_groups)

    head_WoV_norm_list = []
    for head in range(V.size(1)):
        head_WoV = V[:, head, :, ...].matmul(Wo[head, ...].unsqueeze(0))
        head_WoV_norm = torch.norm(head_WoV, p=1, dim=-1)
        head_WoV_norm_list.append(head_WoV_norm)

    WoV_norm = torch.stack(head_WoV_norm_list, dim=1)
    WoV_norm = WoV_norm.view(bsz, num_key_value_heads, num_key_value_groups, q_len).mean(dim=2)

    projected_norm_normalization = WoV_norm / WoV_norm.sum(dim=-2, keepdim=True)
    scores = scores * projected_norm_normalization

    threshold = 0.9 - window_bias
    normalized_scores = ave_attn_weights / ave_attn_weights.sum(dim=-1, keepdim=True)
    batch_size, num_heads = normalized_scores.shape[:2]
    score_mask = torch.zeros_like(normalized_scores, dtype=torch.bool)
    # deviation: a stable sort (ties at the lower index).
    sorted_scores, sorted_indices = torch.sort(normalized_scores, dim=-1, descending=True, stable=True)
    cumsum = torch.cumsum(sorted_scores, dim=-1)
    mask = cumsum >= threshold
    count = torch.argmax(mask.to(torch.int32), dim=-1)
    count.clamp_(max=int(q_len * (1 - compression_ratio) - window_size))
    for b in range(batch_size):
        for h in range(num_heads):
            k = count[b, h].item()
            indices = sorted_indices[b, h, :k]
            score_mask[b, h, indices] = True
    scores = torch.where(score_mask, scores.max().item(), scores)

    return scores


def score(q, keys, values, o_proj_weight, window_size, compression_ratio):
    bsz, num_key_value_heads, q_len, head_dim = keys.shape
    num_attention_heads = q.shape[1]
    num_key_value_groups = num_attention_heads // num_key_value_heads

    assert q_len > window_size, "Query length should be greater than the window size"

    attn_weights, window_bias = compute_window_attention(q[:, :, -window_size:], keys, window_size, q_len)
    scores = attn_weights.view(
        bsz, num_key_value_heads, num_key_value_groups, window_size, q_len - window_size
    )
    ave_attn_weights = scores.mean(dim=2).mean(dim=-2)
    scores_base = scores.sum(dim=-1, keepdim=True)
    scores = F.avg_pool1d(
        scores.view(bsz * num_key_value_heads * num_key_value_groups, window_size, q_len - window_size),
        kernel_size=KERNEL_SIZE,
        padding=KERNEL_SIZE // 2,
        stride=1,
    ).view(bsz, num_key_value_heads, num_key_value_groups, window_size, q_len - window_size)
    scores = (scores / scores.sum(dim=-1, keepdim=True)) * scores_base

    max_scores = scores.max(dim=2).values.max(dim=-2).values
    scores = max_scores.clamp(min=max_scores.mean(dim=-1, keepdim=True))

    scores = vwl1norm(values[..., :-window_size, :], o_proj_weight, num_attention_heads, scores,
                      window_bias, ave_attn_weights, compression_ratio, window_size)

    scores = F.pad(scores, (0, window_size), value=scores.max().item())

    return scores.view(bsz, num_key_value_heads * q_len)


def compress(flatten_scores, q_len, num_key_value_heads, compression_ratio):
    """EfficientAdaScorerPress.compress's selection, as the positions each KV head keeps."""
    n_kept = int(q_len * (1 - compression_ratio) * num_key_value_heads)
    # deviation: ties at the lower flat index.
    cache_topk_idx = topk_stable(flatten_scores, n_kept)[0]
    return [
        sorted((cache_topk_idx[cache_topk_idx // q_len == head] % q_len).tolist())
        for head in range(num_key_value_heads)
    ]


def global_counts(flats, q_len, num_key_value_heads, compression_ratio):
    """EfficientAdaGlobalScorerPress.compress's inter-layer allocation: each layer's count."""
    num_layers = len(flats)
    n_kept = int(q_len * (1 - compression_ratio) * num_key_value_heads * num_layers)
    gloabl_flatten_scores = torch.stack(flats).view(-1)
    # deviation: ties at the lower flat index.
    cache_topk_idx = topk_stable(gloabl_flatten_scores, n_kept)
    cache_topk_layer_idx = cache_topk_idx // (q_len * num_key_value_heads)
    compressed_layer_lens = torch.zeros(num_layers, dtype=torch.int32)
    compressed_layer_lens.scatter_add_(
        0, cache_topk_layer_idx, torch.ones_like(cache_topk_layer_idx, dtype=torch.int32)
    )
    return compressed_layer_lens.tolist()


def layer_compress(flatten_scores, q_len, num_key_value_heads, n_kept):
    """EfficientAdaGlobalScorerPress.layer_compress's selection, as the positions each KV head
    keeps."""
    # deviation: ties at the lower flat index.
    cache_topk_idx = topk_stable(flatten_scores.view(-1), n_kept)
    return [
        sorted((cache_topk_idx[cache_topk_idx // q_len == head] % q_len).tolist())
        for head in range(num_key_value_heads)
    ]


def main():
    layerwise = "--layer" in sys.argv
    if layerwise:
        sys.argv.remove("--layer")
    path, window_size = sys.argv[1], int(sys.argv[2])
    meta, layers = load(path)
    values = load_values(path)
    prompt_len = int(meta["prompt_len"])
    with safe_open(path, framework="pt") as f:
        o_projs = [f.get_tensor(f"layers.{l}.o_proj.weight").float() for l in range(len(layers))]
    result = {}
    for budget in sys.argv[3:]:
        compression_ratio = 1 - int(budget) / prompt_len  # deviation: the ratio of a budget
        flats = []
        for (q, k), v, o_proj in zip(layers, values, o_projs):
            q, k, v = q[:, :, :prompt_len], k[:, :, :prompt_len], v[:, :, :prompt_len]
            flats.append(score(q, k, v, o_proj, window_size, compression_ratio))
        heads = layers[0][1].shape[1]
        if layerwise:
            counts = global_counts(flats, prompt_len, heads, compression_ratio)
            kept = [layer_compress(f, prompt_len, heads, c) for f, c in zip(flats, counts)]
        else:
            kept = [compress(f, prompt_len, heads, compression_ratio) for f in flats]
        out = [
            {"kept": layer_kept, "scores": flat.view(heads, prompt_len).tolist()}
            for layer_kept, flat in zip(kept, flats)
        ]
        result[budget] = {"layers": out}
    emit(result)


if __name__ == "__main__":
    main()
