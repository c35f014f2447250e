"""kvpress 0.5.5's presses that compress while decoding, their own forward hooks run on a trace's
tensors, open loop: for the bridge's parity test (python/tests/test_kvpress.py), what
`DecodingPress` and `PrefillDecodingPress` hold at each decode step, to compare with what
`kvreplay.kvpress.policy(press)` keeps replaying the same trace.

Per layer, the stand-in attention module of kvpress_package.py (the layer's heads, transformers'
`LlamaRotaryEmbedding` from the trace's `rope_theta`, an identity `q_proj` fed the pre-rotary
queries), a cache holding the prompt's keys and values in one `[1, KV heads, n, d]` tensor each,
and the press's `forward_hook` called as transformers calls it after the attention: once over the
prompt (`cache_position` 0..n: the prefill, where `PrefillDecodingPress` runs its prefilling
press), then after each decode token's key and value are appended (`cache_position` [p], the
token's `hidden_states` and `position_embeddings`, and, for a press that reads them
(ObservedAttentionPress, which needs eager attention), the token's attention weights over the
cache, `[1, H, 1, len]`, as the attention's output holds them; the other presses get None, as
under transformers' default `sdpa` attention). Each step's held positions are read
before its hook (the query attends, then the hook compresses), found back among the trace's keys
row for row, whatever order the compressions left them in.
"""

import types

import torch

from kvpress_package import Attention, hidden_states
from kvtrace import load, load_values


def held_steps(path, press):
    """[layer][step][kv head] -> sorted positions the decode step's query attends over."""
    meta, layers = load(path)
    values = load_values(path)
    n = int(meta["prompt_len"])
    found = []
    for layer, ((q, k), v) in enumerate(zip(layers, values)):
        module = Attention(meta, layer)
        scale = float(meta.get("scale", 1.0 / module.head_dim**0.5))
        h = hidden_states(module, q)
        cached = types.SimpleNamespace(keys=k[:, :, :n].clone(), values=v[:, :, :n].clone())
        cache = types.SimpleNamespace(layers={layer: cached})
        rows = [{row.numpy().tobytes(): j for j, row in enumerate(k[0, head])} for head in range(k.shape[1])]
        hook(press, module, cache, h, range(n), None)
        steps = []
        for p in range(n, k.shape[2]):
            cached.keys = torch.cat([cached.keys, k[:, :, p : p + 1]], dim=2)
            cached.values = torch.cat([cached.values, v[:, :, p : p + 1]], dim=2)
            steps.append([sorted(rows[head][row.numpy().tobytes()] for row in cached.keys[0, head]) for head in range(k.shape[1])])
            weights = step_attention(q[:, :, p : p + 1], cached.keys, scale) if reads_attentions(press) else None
            hook(press, module, cache, h, range(p, p + 1), weights)
        found.append(steps)
    return found


def reads_attentions(press):
    """Whether the press that scores (a decoding press's base press) reads attention weights."""
    inner = getattr(press, "decoding_press", None) or press
    return type(getattr(inner, "base_press", inner)).__name__ == "ObservedAttentionPress"


def hook(press, module, cache, h, positions, attentions):
    """The press's forward hook after the attention of the tokens at `positions`."""
    at = torch.tensor(list(positions))
    step = h[:, at]
    kwargs = {
        "hidden_states": step,
        "past_key_values": cache,
        "cache_position": at,
        "position_embeddings": module.rotary_emb(step, at[None]),
    }
    with torch.no_grad():
        press.forward_hook(module, [], kwargs, [None, attentions])


def step_attention(query, keys, scale):
    """[1, H, 1, len]: the step's eager attention weights over the cache (keys repeated per
    query head, `repeat_kv`), softmaxed in float32."""
    group = query.shape[1] // keys.shape[1]
    logits = (query @ keys.repeat_interleave(group, dim=1).transpose(-1, -2)).float() * scale
    return torch.softmax(logits, dim=-1)
