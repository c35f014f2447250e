"""Line-by-line transcription of kvpress's Expected Attention, for kvreplay's
`expected-attention` scorer parity test.

Source: github.com/NVIDIA/kvpress, commit 8bb29b9c3078452a86d692f29123fa6c793e2b05:
  - kvpress/presses/expected_attention_press.py, ExpectedAttentionPress.get_query_statistics,
    apply_avg_rope and score, lines 62-165;
  - kvpress/presses/scorer_press.py, ScorerPress.compress, lines 76-102: keep the top `n_kept`
    scores per KV head.
The rotary embedding is transformers' own (`LlamaRotaryEmbedding`, `rotate_half`), built from
the trace's `rope_theta`.
Deviations, marked `# deviation`: the pre-rotary queries come from the trace's post-rotary
queries turned back (q cos - rotate_half(q) sin) instead of `get_prerope_query_states(module,
hidden_states)` (a trace has no hidden states; for a Llama-like layer the two are the same
vectors); `n_kept` is given (the budget); positions are returned instead of gathered K/V; `topk`
becomes `topk_stable` (kvtrace.py); float32.

Usage: kvpress_expected_attention.py TRACE N_FUTURE N_SINK USE_COV USE_VNORM BUDGET...; prints
{"BUDGET": {"layers": [{"kept": [[positions] per KV head], "scores": [[score per position] per KV
head]}]}} as JSON.
"""

import math
import sys

import torch
from torch.nn import functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, rotate_half

from kvtrace import emit, load, load_values, repeat_kv, top_positions


class Module:
    """What the press reads of an attention module: config, head_dim, rotary_emb."""

    def __init__(self, meta):
        self.head_dim = int(meta["head_dim"])
        self.config = LlamaConfig(
            hidden_size=int(meta["n_heads"]) * self.head_dim,
            num_attention_heads=int(meta["n_heads"]),
            num_key_value_heads=int(meta["n_kv_heads"]),
            head_dim=self.head_dim,
            rope_theta=float(meta["rope_theta"]),
            max_position_embeddings=1 << 16,
        )
        self.rotary_emb = LlamaRotaryEmbedding(self.config)


class ExpectedAttention:
    def __init__(self, n_future_positions, n_sink, use_covariance, use_vnorm, epsilon=0.0):
        self.n_future_positions = n_future_positions
        self.n_sink = n_sink
        self.use_covariance = use_covariance
        self.use_vnorm = use_vnorm
        self.epsilon = epsilon

    def get_query_statistics(self, module, queries):
        """Lines 62-86; `queries` are the post-rotary queries [b, H, q_len, d] of the prompt."""
        q_len = queries.shape[2]
        # deviation: pre-rotary queries from the stored ones, turned back by the rotary.
        cos, sin = module.rotary_emb(queries, torch.arange(q_len).unsqueeze(0))
        prerope = queries * cos.unsqueeze(1) - rotate_half(queries) * sin.unsqueeze(1)

        # Remove first hidden_states that likely contain outliers
        query_states = prerope[:, :, self.n_sink :]
        n_kept_positions = query_states.shape[2]  # h.shape[1]

        # Query mean
        mu = query_states.mean(dim=2, keepdim=True)

        # Query covariance
        cov = None
        if self.use_covariance:
            centered_states = query_states - mu
            cov = torch.einsum("bnsi,bnsj->bnij", centered_states, centered_states) / n_kept_positions
        mu = mu.squeeze(2)

        # Apply RoPE to the mean and covariance matrix of the queries
        mu, cov = self.apply_avg_rope(module, mu, cov, q_len)

        return mu, cov

    def apply_avg_rope(self, module, mu, cov, q_len):
        """Lines 88-124."""
        position_ids = torch.arange(q_len, q_len + self.n_future_positions).unsqueeze(0).to(mu.device)
        head_dim = module.head_dim
        cos, sin = module.rotary_emb(mu, position_ids)
        cos, sin = cos[0], sin[0]
        Id = torch.eye(head_dim, device=cos.device, dtype=cos.dtype)
        P = torch.zeros((head_dim, head_dim), device=cos.device, dtype=cos.dtype)
        P[head_dim // 2 :, : head_dim // 2], P[: head_dim // 2, head_dim // 2 :] = torch.eye(head_dim // 2), -torch.eye(
            head_dim // 2
        )
        R = cos.unsqueeze(1) * Id + sin.unsqueeze(1) * P
        R = R.mean(dim=0).to(mu.device)
        mu = torch.matmul(mu, R.T)
        if cov is not None:
            cov = torch.matmul(R, torch.matmul(cov, R.T))
        return mu, cov

    def score(self, module, queries, keys, values):
        """Lines 126-165 (`hidden_states` replaced by the prompt's queries)."""
        # Remove sink tokens
        assert keys.size(2) > self.n_sink, f"Input should contain more tokens than n_sink={self.n_sink}"
        keys = keys[:, :, self.n_sink :]
        values = values[:, :, self.n_sink :]

        # Compute query statistics
        mean_query, cov_query = self.get_query_statistics(module, queries)

        # Compute scores
        bsz, num_key_value_heads, q_len, d = keys.shape
        num_key_value_groups = module.config.num_attention_heads // num_key_value_heads

        keys = repeat_kv(keys, num_key_value_groups).transpose(2, 3)
        scores = torch.matmul(mean_query.unsqueeze(2), keys).squeeze(2) / math.sqrt(d)
        if self.use_covariance:
            scores += torch.einsum("bhin, bhij, bhjn->bhn", keys, cov_query, keys) / d / 2
        scores = F.softmax(scores, dim=-1)

        # Average scores across groups
        scores = scores.view(bsz, num_key_value_heads, num_key_value_groups, q_len)
        scores = scores.mean(dim=2)

        # Rescale scores by the norm of the values
        if self.use_vnorm:
            scores = (scores + self.epsilon) * values.norm(dim=-1)

        # Add back the sink tokens. Use max score to make sure they are not pruned.
        scores = F.pad(scores, (self.n_sink, 0), value=scores.max().item() + 1)

        return scores


def main():
    path = sys.argv[1]
    n_future, n_sink = int(sys.argv[2]), int(sys.argv[3])
    use_cov, use_vnorm = sys.argv[4] == "true", sys.argv[5] == "true"
    meta, layers = load(path)
    values = load_values(path)
    prompt_len = int(meta["prompt_len"])
    module = Module(meta)
    press = ExpectedAttention(n_future, n_sink, use_cov, use_vnorm)
    result = {}
    for budget in sys.argv[6:]:
        out = []
        for (q, k), v in zip(layers, values):
            scores = press.score(module, q[:, :, :prompt_len], k[:, :, :prompt_len], v[:, :, :prompt_len])
            kept = top_positions(scores, int(budget), prompt_len)  # deviation: stable ties
            out.append({"kept": kept, "scores": scores[0].tolist()})
        result[budget] = {"layers": out}
    emit(result)


if __name__ == "__main__":
    main()
