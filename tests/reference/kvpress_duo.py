"""DuoAttention's on-the-fly head scores and streaming heads, transcribed from kvpress 0.5.5
(`kvpress/presses/duo_attention_press.py`, `duo_attention_on_the_fly` lines 177-212 and
`DuoAttentionPress.post_init_from_model` lines 86-90) onto a trace: the model's `q_proj` / `k_proj`
outputs of the calibration text are the trace's prompt queries and keys turned back before the
rotary (transformers' own `LlamaRotaryEmbedding` from the trace's `rope_theta`, as
kvpress_package.py's stand-in does), one text in place of 50 BookSum chapters, in float64 where the
model runs its dtype (kvreplay's deviation, so that the ranking is compared exactly).

Usage: kvpress_duo.py TRACE HEAD_COMPRESSION_RATIO Q_LEN
Prints {"scores": [[score per KV head] per layer], "streaming": [[bool per KV head] per layer]}.
"""

import sys

import numpy as np
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb, rotate_half

from kvtrace import emit, load


def main():
    path, ratio, q_len = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    meta, layers = load(path)
    n = int(meta["prompt_len"])
    num_heads, num_key_value_heads = int(meta["n_heads"]), int(meta["n_kv_heads"])
    num_key_value_groups = num_heads // num_key_value_heads
    d = int(meta["head_dim"])
    config = LlamaConfig(
        hidden_size=num_heads * d,
        num_attention_heads=num_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=d,
        rope_theta=float(meta.get("rope_theta", 10000.0)),
        max_position_embeddings=1 << 16,
    )
    rotary_emb = LlamaRotaryEmbedding(config)
    position_ids = torch.arange(q_len).unsqueeze(0)
    scores = torch.zeros((len(layers), num_key_value_heads), dtype=torch.float64)  # kvpress: float32
    for layer_idx, (q_post, k_post) in enumerate(layers):
        with torch.no_grad():
            # q_proj(h), k_proj(h) viewed as [1, T, heads, d]: the prompt's pre-rotary vectors.
            cos_t, sin_t = rotary_emb(q_post, torch.arange(n).unsqueeze(0))
            unrotate = lambda x: x * cos_t.unsqueeze(1) - rotate_half(x) * sin_t.unsqueeze(1)
            q = unrotate(q_post[:, :, :n].double()).transpose(1, 2)
            k = unrotate(k_post[:, :, :n].double()).transpose(1, 2)

            # Mean query (lines 182-188)
            q = q.mean(dim=1, keepdim=True)
            q = q.repeat(1, q_len, 1, 1).transpose(1, 2)

            # Mean key (lines 190-196)
            k = k.mean(dim=1, keepdim=True)
            k = k.repeat(1, q_len, 1, 1).transpose(1, 2)

            # Apply RoPE (lines 198-201)
            cos, sin = rotary_emb(q, position_ids)
            q, k = apply_rotary_pos_emb(q, k, cos.double(), sin.double())
            k = k.repeat_interleave(num_key_value_groups, dim=1)

            # Attention weights of the last token (lines 203-205)
            attn_weights = torch.matmul(q[:, :, -1:, :], k.transpose(2, 3)) / (d**0.5)
            attn_weights = attn_weights.softmax(dim=-1, dtype=torch.float64).squeeze()

            # Area under the cumulated attention curve (lines 207-209)
            s = torch.cumsum(attn_weights, dim=1).mean(1)
            s = s.view(-1, num_key_value_groups).mean(1)
            scores[layer_idx] += s.cpu()
    head_scores = scores.numpy()
    # post_init_from_model, lines 86-90 (a stable argsort: kvreplay's rule for equal scores)
    n_pruned = round(head_scores.size * ratio)
    streaming = np.zeros(head_scores.shape, dtype=bool)
    if n_pruned > 0:
        indices = np.argsort(head_scores, axis=None, kind="stable")[:n_pruned]
        streaming[np.unravel_index(indices, head_scores.shape)] = True
    emit({"scores": head_scores.tolist(), "streaming": streaming.tolist()})


if __name__ == "__main__":
    main()
