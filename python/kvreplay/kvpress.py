"""kvpress's presses as kvreplay scorers: a press's own ``score()`` ranks each cache of a trace, and
kvreplay applies its allocators, head splits, cache layouts, protections, metrics and closed loop.

kvpress (NVIDIA/kvpress) is not a dependency: install it yourself, without its dependencies, since
kvpress 0.5.5 pins ``transformers<5.3`` and its model hooks are not used here::

    pip install --no-deps kvpress==0.5.5   # plus torch and transformers for the stand-in module

A press scores one cache (one KV head of one layer) at the end of the prompt, through a stand-in
attention module that hands it what a Llama attention layer would: ``config`` (the cache's query
heads over one KV head), ``head_dim``, ``layer_idx``, transformers' own ``LlamaRotaryEmbedding``
built from the trace's ``rope_theta``, and an identity ``q_proj``, so that ``hidden_states`` carries
the pre-rotary queries (the trace's queries turned back with that rotary embedding): for a bias-free
Llama projection these are what ``q_proj(hidden_states)`` would give. ``position_embeddings`` is
in the keyword arguments; ``attentions`` (the prompt's causal attention weights, as eager attention
returns them) is given to the presses that read them (``ObservedAttentionPress``).

A press runs as kvpress runs it: kvpress's ``ScorerPress`` keeps the top scores and nothing else,
so a :class:`PressScorer` declares ``defaults = {"window": 0, "sinks": 0}``: a policy given it as
``scorer=`` protects no recent or first tokens beyond what the press's own scores keep (SnapKV's
window, StreamingLLM's sinks), unless the call sets ``window`` or ``sinks`` itself.

A press that reads what a trace does not hold (the real hidden states, a model's other weights, a
component fetched from the hub, extra forward passes) fails on a small probe when it is wrapped,
before any work, with a ``KvreplayError`` naming the press and what it tried to read.
"""

import numpy as np

from ._native import KvreplayError

# Presses that read the attention weights they are given rather than computing their own.
READS_ATTENTIONS = {"ObservedAttentionPress"}

# Presses that compress while decoding, every few generated tokens.
DECODING_PRESSES = {"DecodingPress", "PrefillDecodingPress", "CAMPress"}

# The presses a decoding press may wrap in a replay: kvreplay's own scorer runs under kvpress's
# schedule, checked against kvpress's DecodingPress and CAMPress hooks (tests/parity.rs).
DECODING_SCORERS = {"KnormPress": "knorm"}


class PressScorer:
    """A kvpress press as a kvreplay scorer (one-shot: kvpress compresses at the end of the prompt)."""

    timings = ("prefill",)
    needs_values = True
    # kvpress's ScorerPress protects nothing of its own: no recent window, no sinks.
    defaults = {"window": 0, "sinks": 0}

    def __init__(self, press, name=None, probe=True):
        import torch  # noqa: F401  (the stand-in needs torch and transformers)
        from transformers import LlamaConfig  # noqa: F401

        self.press = press
        self.name = name or f"kvpress:{type(press).__name__}"
        self.reads_attentions = type(press).__name__ in READS_ATTENTIONS
        self._modules = {}
        if probe:
            self._probe()

    def score(self, cache):
        import torch

        if cache.rope_theta is None:
            raise ValueError(f"{self.name} needs the trace's rope_theta to rebuild the pre-rotary queries")
        if cache.values is None:
            raise ValueError(f"{self.name} needs the trace's values")
        module = self._module(cache)
        queries = torch.from_numpy(np.ascontiguousarray(cache.queries))[None]  # [1, g, n, d]
        keys = torch.from_numpy(np.ascontiguousarray(cache.keys))[None, None]  # [1, 1, n, d]
        values = torch.from_numpy(np.ascontiguousarray(cache.values))[None, None]
        n = queries.shape[2]
        positions = torch.arange(n).unsqueeze(0)
        cos, sin = module.rotary_emb(queries, positions)
        hidden = _prerotary(queries, cos, sin).transpose(1, 2).reshape(1, n, -1)
        attentions = _eager_attentions(queries, keys, cache.scale, cache.softcap) if self.reads_attentions else None
        with torch.no_grad():
            scores = self.press.score(module, hidden, keys, values, attentions, {"position_embeddings": (cos, sin)})
        scores = scores[0, 0].float().numpy()
        if scores.shape != (n,):
            raise ValueError(f"{self.name} scored {scores.shape} for {n} positions")
        return scores[cache.positions]

    def _module(self, cache):
        key = (cache.layer, cache.query_heads[1] - cache.query_heads[0], cache.keys.shape[1], cache.rope_theta)
        if key not in self._modules:
            self._modules[key] = _StandIn(*key)
        return self._modules[key]

    def _probe(self):
        """Scores a small synthetic cache, so a press that cannot be replayed fails here, by name."""
        rng = np.random.default_rng(0)
        n, d, g = 96, 64, 2
        probe = _Probe(
            queries=rng.standard_normal((g, n, d), dtype=np.float32),
            keys=rng.standard_normal((n, d), dtype=np.float32),
            values=rng.standard_normal((n, d), dtype=np.float32),
            positions=np.arange(n),
            layer=0,
            query_heads=(0, g),
            rope_theta=10000.0,
            scale=d**-0.5,
            softcap=None,
        )
        try:
            scores = self.score(probe)
        except Exception as err:  # what the press tried to read, in its own words
            raise KvreplayError(f"{self.name} cannot be replayed from a trace: {type(err).__name__}: {err}") from err
        if not np.isfinite(scores).all():
            raise KvreplayError(f"{self.name} cannot be replayed from a trace: it scores a probe with non-finite values")


class _Probe:
    def __init__(self, **fields):
        self.__dict__.update(fields)


def _StandIn(layer, group, head_dim, rope_theta):
    """What a press reads of a Llama attention layer, for one KV head and its `group` query heads."""
    from torch import nn
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    module = nn.Module()
    module.head_dim = head_dim
    module.layer_idx = layer
    module.config = LlamaConfig(
        hidden_size=group * head_dim,
        num_attention_heads=group,
        num_key_value_heads=1,
        head_dim=head_dim,
        rope_theta=float(rope_theta),
        max_position_embeddings=1 << 16,
    )
    module.rotary_emb = LlamaRotaryEmbedding(module.config)
    module.q_proj = nn.Identity()
    return module


def _prerotary(queries, cos, sin):
    from transformers.models.llama.modeling_llama import rotate_half

    return queries * cos.unsqueeze(1) - rotate_half(queries) * sin.unsqueeze(1)


def _eager_attentions(queries, keys, scale, softcap):
    import torch

    logits = (queries @ keys.transpose(-1, -2)).float() * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    n = queries.shape[2]
    future = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)
    return torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)


def policy(press):
    """The kvreplay policy settings that run `press` as kvpress runs it, as keyword arguments for
    `replay`, `kept`, `live` or a policy dict: its scorer through :class:`PressScorer`, and a
    wrapping or scheduling press mapped onto kvreplay's own axes where one exists:

    - ``AdaKVPress(press, alpha_safeguard)``: the ``adakv`` head split with ``alpha`` the
      safeguard and no score normalisation (kvpress compares raw scores across heads);
    - ``PyramidKVPress``: the ``pyramid-kvpress`` allocator (kvpress's own schedule, flat below
      ``beta * window_size`` tokens) with the press's ``beta`` and its ``window_size`` as the
      protected window (its scores are SnapKV's);
    - ``TOVAPress``: one kept set per layer (``gqa="layer"``), since the press averages the last
      query's attention over every head of the layer;
    - ``DMSPress(press, threshold, sliding_window_size)`` (``decoding=False``): the ``threshold``
      head split with the window as its protected window; pass a budget at or above the prompt's
      length, since kvreplay's budget caps each cache and DMS has none;
    - ``PerLayerCompressionPress(press, compression_ratios)``: a per-layer budget of
      ``int(prompt_len * (1 - ratio))``, kvpress's own count, as a Python allocator (the trace's
      compressed layers must be the press's layers, one ratio each);
    - ``ThinKPress(key_channel_compression_ratio, window_size)``: the ``think`` key channels with
      ``key_channel_ratio`` and ``query_window``; alone it evicts nothing, so pass a budget at or
      above the prompt's length;
    - ``ComposedPress([press, ThinKPress(...)])``: the press's policy with the ``think`` channels
      (ThinK last, so it scores the kept keys, as kvpress composes them);
    - ``MergingPress(press, similarity_threshold, merge_fraction)``: the press's policy with the
      ``similarity`` merge, the values it evicts at the cut folded into the kept ones.

    - ``DecodingPress(KnormPress(), compression_interval, target_size)``: the ``knorm`` scorer
      under ``timing="decoding"``, ``order="attend-first"``, ``interval`` the press's, nothing
      protected, ``budget`` its ``target_size`` (so pass no other budget);
    - ``CAMPress(KnormPress(), ...)``: the same with ``gqa="layer"``, ``merge="cam"`` and its
      ``merge_budget`` (kvreplay draws CaM's Bernoulli merges from ``merge_seed``, kvpress from
      torch's global generator).

    Over another press, and ``PrefillDecodingPress``, the decoding presses raise
    :class:`KvreplayError` (a press is scored from Python at the prompt's end only); other
    wrapping presses (``ChunkKVPress``, ``ChunkPress``, other compositions) have no counterpart
    and raise it too.
    """
    kind = type(press).__name__
    if kind in ("DecodingPress", "CAMPress"):
        return _decoding(press, kind)
    if kind in DECODING_PRESSES:
        raise KvreplayError(
            f"kvpress:{kind} compresses while decoding, and a press is scored from Python at the prompt's end only: "
            "use timing='decoding' (or 'prefill-then-stream'), order='attend-first', trigger='steps' with a registered "
            "scorer (and merge='cam', gqa='layer' for CAMPress; docs/python.md)"
        )
    if kind == "AdaKVPress":
        return {**policy(press.press), "heads": "adakv", "alpha": float(press.alpha_safeguard), "normalize": False}
    if kind == "DMSPress":
        if press.decoding or press.threshold is None:
            raise KvreplayError("kvpress:DMSPress replays with a threshold and decoding=False (kvreplay's `threshold` head split); it evicts only at the prompt's end")
        window = {"window": int(press.sliding_window_size), "sinks": 0}
        return {**policy(press.press), "heads": "threshold", "threshold": float(press.threshold), **window}
    if kind == "ThinKPress":
        ratio, window = float(press.key_channel_compression_ratio), int(press.window_size)
        return {"channels": "think", "key_channel_ratio": ratio, "query_window": window}
    if kind == "ComposedPress":
        inner = list(press.presses)
        if len(inner) == 2 and type(inner[1]).__name__ == "ThinKPress" and type(inner[0]).__name__ != "ThinKPress":
            return {**policy(inner[0]), **policy(inner[1])}
        raise KvreplayError("kvpress:ComposedPress replays as [a press, ThinKPress]: ThinK last, scoring the kept keys")
    if kind == "MergingPress":
        merge = {"similarity_threshold": float(press.similarity_threshold), "merge_fraction": float(press.merge_fraction)}
        return {**policy(press.press), "merge": "similarity", **merge}
    if kind == "PerLayerCompressionPress":
        return {**policy(press.press), "allocator": _RatioBudgets(list(press.compression_ratios))}
    if hasattr(press, "score") and not hasattr(press, "press"):
        settings = {"scorer": PressScorer(press)}
        if kind == "PyramidKVPress":
            settings.update(allocator="pyramid-kvpress", beta=float(press.beta), window=int(press.window_size))
        if kind == "TOVAPress":
            settings.update(gqa="layer")
        return settings
    raise KvreplayError(f"kvpress:{kind} has no kvreplay counterpart: wrap its inner press's scorer instead")


def _decoding(press, kind):
    """`DecodingPress` or `CAMPress` over a press with a kvreplay scorer: its schedule."""
    inner = type(press.base_press).__name__
    if inner not in DECODING_SCORERS:
        raise KvreplayError(
            f"kvpress:{kind} over {inner}: a press is scored from Python at the prompt's end only; a decoding press "
            f"replays over {', '.join(sorted(DECODING_SCORERS))} (kvreplay's scorer under kvpress's schedule)"
        )
    interval = int(press.compression_interval)
    settings = {
        "scorer": DECODING_SCORERS[inner],
        "timing": "decoding",
        "order": "attend-first",
        "interval": interval,
        "trigger": "steps" if interval > 1 else "growth",
        "sinks": 0,
        "window": 0,
        "budget": int(press.target_size),
    }
    if kind == "CAMPress":
        settings.update(gqa="layer", merge="cam", merge_budget=int(press.merge_budget))
    return settings


class _RatioBudgets:
    """kvpress's per-layer compression ratios as per-layer budgets."""

    name = "per-layer-ratios"

    def __init__(self, ratios):
        self.ratios = ratios

    def allocate(self, given):
        if given["n_layers"] != len(self.ratios):
            raise ValueError(f"{len(self.ratios)} compression ratios for {given['n_layers']} compressed layers")
        return [int(given["prompt_len"] * (1 - ratio)) for ratio in self.ratios]
