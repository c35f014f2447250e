"""Shared by the parity transcriptions: reads a kvtrace/1 file (safetensors) into the tensor
layout of Hugging Face attention code, and the one tie rule the transcriptions substitute for
torch.topk.

torch.topk (and a non-stable torch.sort) leave the order of equal values unspecified; torch's CPU
topk returns them in heap order, which differs from run to run of the same sizes. Equal scores are
common after SnapKV's max pooling, so a parity test needs one rule: `topk_stable` keeps the lower
index among equal values (a stable descending sort), the rule kvreplay documents for every
selection.
"""
import json
import sys

import torch
from safetensors import safe_open


def load(path):
    """(meta, layers): meta is the header's `__metadata__`; layers[l] = (q [1, H, T, d],
    k [1, K, T, d]) in float32."""
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
        layers = []
        for layer in range(int(meta["n_layers"])):
            q = f.get_tensor(f"layers.{layer}.q").float().unsqueeze(0)
            k = f.get_tensor(f"layers.{layer}.k").float().unsqueeze(0)
            layers.append((q, k))
    return meta, layers


def load_values(path):
    """Per layer, v [1, K, T, d] in float32 (for methods that score values)."""
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
        return [
            f.get_tensor(f"layers.{layer}.v").float().unsqueeze(0)
            for layer in range(int(meta["n_layers"]))
        ]


def repeat_kv(hidden_states, n_rep):
    """transformers' `repeat_kv` (as copied into KVCache-Factory, pyramidkv_utils.py lines
    121-130): [b, K, T, d] -> [b, K * n_rep, T, d], query head h reading KV head h // n_rep."""
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def topk_stable(x, k):
    """The indices of the k largest values along the last dim, equal values in index order: the
    stand-in for `x.topk(k).indices`."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def causal_attention(q, k):
    """Softmax of q k^T / sqrt(d) with the causal mask of a prefill ([b, H, T, T], float32)."""
    head_dim = q.shape[-1]
    t = q.shape[-2]
    logits = torch.matmul(q, k.transpose(2, 3)) / (head_dim ** 0.5)
    mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
    logits = logits.masked_fill(mask, float("-inf"))
    return torch.softmax(logits, dim=-1, dtype=torch.float32)


def emit(result):
    print(json.dumps(result))


def new_query_attention(query, keys):
    """The softmax of one new query per head over that head's cached keys, in the layout of HF
    attention weights: query [H, d], keys [H, n, d] -> [1, H, 1, n] (float32)."""
    logits = torch.einsum("hd,hnd->hn", query, keys) / (query.shape[-1] ** 0.5)
    return torch.softmax(logits, dim=-1, dtype=torch.float32)[None, :, None, :]


def top_positions(scores, n_kept, prompt_len):
    """ScorerPress.compress's selection (kvpress scorer_press.py lines 92-95) as sorted positions
    per KV head: the top `n_kept` of `scores` [1, K, n] (stable ties), or the whole prompt."""
    if n_kept >= prompt_len:
        return [list(range(prompt_len))] * scores.shape[1]
    indices = topk_stable(scores, n_kept)
    return [sorted(head.tolist()) for head in indices[0]]


def run_budgets(run):
    """A transcription's command line: TRACE BUDGET... -> {BUDGET: run(layers, prompt_len,
    budget)} as JSON on stdout."""
    meta, layers = load(sys.argv[1])
    prompt_len = int(meta["prompt_len"])
    emit({budget: run(layers, prompt_len, int(budget)) for budget in sys.argv[2:]})
