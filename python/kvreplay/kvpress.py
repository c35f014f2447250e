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

A press that reads the layer's hidden states through its projections (``LeverageScorePress``,
``CompactorPress``, ``CriticalKVPress``, which reads ``o_proj``) needs a trace that holds each
layer's attention inputs (``docs/trace-format.md``, "Attention inputs"). It then scores a whole
layer at once, as kvpress does: the module is the layer's own (its real ``q_proj``, ``k_proj``,
``v_proj`` and ``o_proj`` with their biases, its heads and rotary), ``hidden_states`` the real
normed hidden states, ``keys`` and ``values`` every KV head's. Such a press may draw random numbers
(LeverageScorePress's Gaussian sketch): each layer runs on torch's global generator seeded with
``seed`` before the first compressed layer and carried from layer to layer, as in a kvpress run
after ``torch.manual_seed(seed)``; the caller's generator state is left as it was.

A press runs as kvpress runs it: kvpress's ``ScorerPress`` keeps the top scores and nothing else,
so a :class:`PressScorer` declares ``defaults = {"window": 0, "sinks": 0}``: a policy given it as
``scorer=`` protects no recent or first tokens beyond what the press's own scores keep (SnapKV's
window, StreamingLLM's sinks), unless the call sets ``window`` or ``sinks`` itself.

While decoding (``DecodingPress``, ``PrefillDecodingPress``; :func:`policy` maps them), a press
scores each compression as ``DecodingPress.forward_hook`` hands its base press the cache
(decoding_press.py lines 123-178): the keys and values in the order kvpress's cache holds them
(a compression gathers its kept entries in ``torch.topk``'s order, each step appends one at the
end; a per-cache state of the :class:`PressScorer` follows it), as ``hidden_states`` the pre-rotary
queries of the decode steps since the last compression (at most ``hidden_states_buffer_size +
1``), as ``position_embeddings`` the current step's rotary only (which the press applies to every
buffered query, as kvpress does), ``cache_position`` the step, and for ``ObservedAttentionPress``
the current query's attention over the cache.

A press that reads what a trace does not hold (a model's other weights, a
component fetched from the hub, extra forward passes) fails on a small probe when it is wrapped,
before any work, with a ``KvreplayError`` naming the press and what it tried to read.
"""

import hashlib
import threading

import numpy as np

from ._native import KvreplayError

# Presses that read the attention weights they are given rather than computing their own.
READS_ATTENTIONS = {"ObservedAttentionPress"}

# Presses that read the layer's hidden states and projections: they score a whole layer at once.
READS_INPUTS = {"LeverageScorePress", "CompactorPress", "CriticalKVPress", "CriticalAdaKVPress"}

# Presses that select in their own `compress` and mark what they evict (`masked_key_indices`)
# instead of scoring: the bridge runs `compress` and scores what it kept 1, the rest 0.
MASKING = {"CriticalAdaKVPress"}


class PressScorer:
    """A kvpress press as a kvreplay scorer at the prompt's end (``prefill``); given ``decoding``,
    a ``DecodingPress``, also at each of its compressions while decoding, as it runs its base
    press (``decoding``, ``prefill-then-stream``; see the module's doc). :func:`policy` builds
    them."""

    needs_values = True
    # kvpress's ScorerPress protects nothing of its own: no recent window, no sinks.
    defaults = {"window": 0, "sinks": 0}

    def __init__(self, press, name=None, probe=True, seed=0, decoding=None):
        import torch  # noqa: F401  (the stand-in needs torch and transformers)
        from transformers import LlamaConfig  # noqa: F401

        self.press = press
        self.decoding = decoding
        self.timings = ("prefill",) if decoding is None else ("prefill", "decoding", "prefill-then-stream")
        # CAMPress keeps its kept entries in sequence order and hands its base press no
        # attention weights (cam_press.py: `kept_indices` sorted, `score(..., None, kwargs)`).
        self.keeps_order = type(decoding).__name__ == "CAMPress"
        self.name = name or f"kvpress:{type(press).__name__}"
        self.reads_attentions = _innermost(press) in READS_ATTENTIONS
        self.needs_inputs = type(press).__name__ in READS_INPUTS
        self.seed = seed
        self._modules = {}
        self._layer = None  # (key, scores [kv_heads, n]) of the last whole layer scored
        self._generator = None  # (last layer scored, torch's generator state after it)
        self._lock = threading.Lock()
        if probe:
            self._probe()

    def start(self):
        """One cache's state: the order kvpress's cache holds its entries in."""
        return _CacheOrder(self)

    def score(self, cache):
        if self.needs_inputs:
            return self._layer_scores(cache)[cache.kv_head][cache.positions]
        return self._cache_scores(cache)

    def _layer_scores(self, cache):
        """Every KV head's scores of the cache's layer, scored once per layer (the engine asks
        for each cache of a layer, possibly from several threads)."""
        if cache.hidden is None:
            raise ValueError(f"{self.name} reads the layer's hidden states and projections, and the trace has none")
        digest = hashlib.blake2b(np.ascontiguousarray(cache.hidden).tobytes(), digest_size=16).digest()
        key = (cache.layer, cache.newest, digest)
        with self._lock:
            if self._layer is None or self._layer[0] != key:
                self._layer = (key, self._run_layer(cache))
            return self._layer[1]

    def _run_layer(self, cache):
        import torch

        module = _Layer(cache)
        hidden = torch.from_numpy(np.ascontiguousarray(cache.hidden))[None]
        queries = torch.from_numpy(np.ascontiguousarray(cache.layer_queries))[None]
        keys = torch.from_numpy(np.ascontiguousarray(cache.layer_keys))[None]
        values = torch.from_numpy(np.ascontiguousarray(cache.layer_values))[None]
        n = keys.shape[2]
        cos, sin = module.rotary_emb(keys, torch.arange(n).unsqueeze(0))
        attentions = _eager_attentions(queries, _repeat(keys, queries), cache.scale, cache.softcap) if self.reads_attentions else None
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            fresh = self._generator is None or cache.layer <= self._generator[0]
            if fresh:
                torch.manual_seed(self.seed)
            else:
                torch.set_rng_state(self._generator[1])
            arguments = (module, hidden, keys, values, attentions, {"position_embeddings": (cos, sin)})
            scores = self._kept(*arguments) if type(self.press).__name__ in MASKING else self.press.score(*arguments)
            self._generator = (cache.layer, torch.get_rng_state())
        scores = scores[0].float().numpy()
        if scores.shape != (cache.n_kv_heads, n):
            raise ValueError(f"{self.name} scored {scores.shape} for {cache.n_kv_heads} KV heads of {n} positions")
        return scores

    def _kept(self, module, *arguments):
        """A masking press's selection as scores `[1, kv_heads, n]`: 1 where its `compress`
        keeps the key, 0 where it masks it (all 1 when it compresses nothing). `compress` asserts
        a non-eager attention, for the patch that reads its masks in later forward passes; no
        attention runs here."""
        import torch

        keys = arguments[1]
        module.config._attn_implementation = "sdpa"
        self.press.compress(module, *arguments)
        kept = torch.ones(keys.shape[:3])
        masked = getattr(module, "masked_key_indices", None)
        if masked is not None:
            batch, heads, positions = masked
            kept[batch, heads, positions] = 0.0
        return kept

    def _cache_scores(self, cache):
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

    def _decoding_scores(self, cache, order, first):
        """The decoding press's base press's scores of the cache at a compression while decoding,
        as `DecodingPress.forward_hook` and `compress` hand them over (decoding_press.py lines
        102-110, 123-154): the keys and values in the order kvpress's cache holds them (`order`),
        as `hidden_states` the queries of the decode steps since the last compression (from
        position `first`, at most `hidden_states_buffer_size + 1` of them), the current step's
        rotary as `position_embeddings`, and the base press's `compression_ratio` set to keep
        `target_size`; in `order`."""
        import torch

        if self.needs_inputs:
            raise ValueError(
                f"{self.name} scores a whole layer at once, and while decoding each KV head's cache holds other positions: "
                "it replays at the prompt's end only"
            )
        if cache.rope_theta is None:
            raise ValueError(f"{self.name} needs the trace's rope_theta to rebuild the pre-rotary queries")
        base, module = self.decoding.base_press, self._module(cache)
        index = np.asarray(order, dtype=np.int64)
        keys = torch.from_numpy(np.ascontiguousarray(cache.keys[index]))[None, None]
        values = torch.from_numpy(np.ascontiguousarray(cache.values[index]))[None, None]
        newest, size = cache.newest, int(self.decoding.hidden_states_buffer_size)
        rows = np.arange(max(first, newest - size), newest + 1)
        queries = torch.from_numpy(np.ascontiguousarray(cache.queries[:, rows]))[None]  # [1, g, r, d]
        cos, sin = module.rotary_emb(queries, torch.from_numpy(rows)[None])
        hidden = _prerotary(queries, cos, sin).transpose(1, 2).reshape(1, len(rows), -1)
        step = torch.tensor([[newest]])
        kwargs = {"position_embeddings": module.rotary_emb(queries, step), "cache_position": step[0]}
        attentions = None
        if _innermost(base) in READS_ATTENTIONS and not self.keeps_order:
            attentions = _step_attentions(queries[:, :, -1:], keys, cache.scale, cache.softcap)
        ratio = self.decoding._find_target_compression_ratio(len(order), self.decoding.target_size)
        own, base.compression_ratio = base.compression_ratio, ratio
        try:
            with torch.no_grad():
                scores = base.score(module, hidden, keys, values, attentions, kwargs)
        finally:
            base.compression_ratio = own
        scores = scores[0, 0].float().numpy()
        if scores.shape != (len(order),):
            raise ValueError(f"{self.name} scored {scores.shape} for a cache of {len(order)} entries")
        return scores

    def _module(self, cache):
        key = (cache.layer, cache.query_heads[1] - cache.query_heads[0], cache.keys.shape[1], cache.rope_theta)
        if key not in self._modules:
            self._modules[key] = _StandIn(*key)
        return self._modules[key]

    def _probe(self):
        """Scores a small synthetic cache, so a press that cannot be replayed fails here, by name."""
        rng = np.random.default_rng(0)
        n, d, g, kv = 96, 64, 2, 2
        normal = lambda *shape: rng.standard_normal(shape, dtype=np.float32)  # noqa: E731
        width = g * kv * d
        probe = _Probe(
            queries=normal(g, n, d),
            keys=normal(n, d),
            values=normal(n, d),
            positions=np.arange(n),
            newest=n - 1,
            layer=0,
            kv_head=0,
            query_heads=(0, g),
            n_heads=g * kv,
            n_kv_heads=kv,
            rope_theta=10000.0,
            scale=d**-0.5,
            softcap=None,
            hidden=normal(n, width),
            projections={
                "q_proj.weight": normal(width, width) / width**0.5,
                "k_proj.weight": normal(kv * d, width) / width**0.5,
                "v_proj.weight": normal(kv * d, width) / width**0.5,
                "o_proj.weight": normal(width, width) / width**0.5,
            },
            layer_queries=normal(g * kv, n, d),
            layer_keys=normal(kv, n, d),
            layer_values=normal(kv, n, d),
        )
        try:
            scores = self.score(probe)
        except Exception as err:  # what the press tried to read, in its own words
            raise KvreplayError(f"{self.name} cannot be replayed from a trace: {type(err).__name__}: {err}") from err
        if not np.isfinite(scores).all():
            raise KvreplayError(f"{self.name} cannot be replayed from a trace: it scores a probe with non-finite values")


class _CacheOrder:
    """One cache's state under a :class:`PressScorer`: the order kvpress's cache holds its
    entries in, which presses that read positions within the cache depend on (SnapKV's window
    and the padding of its last ``window_size`` entries, StreamingLLM's sinks, TOVA's last
    entry). A prompt runs in position order; a compression gathers the kept entries in the order
    ``torch.topk`` returns them (``ScorerPress.compress``, scorer_press.py lines 94-101: by
    descending score, equal scores in torch's own order, so the state asks torch.topk itself), or,
    under ``CAMPress``, keeps them in their order; each decode step appends its token at the end."""

    def __init__(self, scorer):
        self.scorer = scorer
        self.ranked = []  # the entries kept by the last compression, in torch.topk's order
        self.since = None  # the newest position at the last compression

    def __deepcopy__(self, memo):
        """A fork of the stream (a live run's two continuations): its own order, the same press."""
        fork = _CacheOrder(self.scorer)
        fork.ranked, fork.since = list(self.ranked), self.since
        return fork

    def score(self, cache):
        order = self._order(cache.positions)
        if cache.newest < cache.prompt_len:
            at = {int(p): i for i, p in enumerate(cache.positions)}
            scores = self.scorer.score(cache)
            ordered = scores[[at[p] for p in order]]
        else:
            first = cache.prompt_len if self.since is None else self.since + 1
            ordered = self.scorer._decoding_scores(cache, order, first)
            at = {p: i for i, p in enumerate(order)}
            scores = ordered[[at[int(p)] for p in cache.positions]]
        if self.scorer.keeps_order:
            self.ranked = order
        elif self.scorer.decoding is not None:
            import torch

            kept = min(int(self.scorer.decoding.target_size), len(order))
            top = torch.topk(torch.from_numpy(np.ascontiguousarray(ordered)), kept).indices
            self.ranked = [order[i] for i in top.tolist()]
        self.since = cache.newest
        return scores

    def _order(self, positions):
        """`positions` (the cache's, ascending) in kvpress's order: the last compression's kept
        entries in its order, then every entry appended since."""
        held = {int(p) for p in positions}
        survivors = [p for p in self.ranked if p in held]
        ranked = set(self.ranked)
        return survivors + [int(p) for p in positions if int(p) not in ranked]


class _Probe:
    def __init__(self, **fields):
        self.__dict__.update(fields)


def _attention_module(layer, heads, kv_heads, head_dim, d_model, rope_theta):
    """A module with what a press reads of a Llama attention layer: `config`, `head_dim`,
    `layer_idx`, `num_key_value_groups` and transformers' own rotary embedding."""
    from torch import nn
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    module = nn.Module()
    module.head_dim = head_dim
    module.layer_idx = layer
    module.num_key_value_groups = heads // kv_heads
    module.config = LlamaConfig(
        hidden_size=d_model,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=float(rope_theta),
        max_position_embeddings=1 << 16,
    )
    module.rotary_emb = LlamaRotaryEmbedding(module.config)
    return module


def _StandIn(layer, group, head_dim, rope_theta):
    """One KV head and its `group` query heads, with an identity `q_proj`."""
    from torch import nn

    module = _attention_module(layer, group, 1, head_dim, group * head_dim, rope_theta)
    module.q_proj = nn.Identity()
    return module


def _Layer(cache):
    """The cache's attention layer as kvpress sees it: its real projections (with their biases),
    heads, rotary and `layer_idx`; where the model normalises each head's q and k after the
    projections (Gemma 3), `q_proj` and `k_proj` give them normed, as kvpress's
    `get_prerope_query_states` and `get_prerope_key_states` give them for such a model."""
    import torch
    from torch import nn

    head_dim, d_model = cache.layer_keys.shape[-1], cache.hidden.shape[-1]
    module = _attention_module(cache.layer, cache.n_heads, cache.n_kv_heads, head_dim, d_model, cache.rope_theta)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        weight = torch.from_numpy(np.ascontiguousarray(cache.projections[f"{name}.weight"]))
        bias = cache.projections.get(f"{name}.bias")
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
        with torch.no_grad():
            linear.weight.copy_(weight)
            if bias is not None:
                linear.bias.copy_(torch.from_numpy(np.ascontiguousarray(bias)))
        norm = cache.projections.get(f"{name[0]}_norm.weight")
        if norm is not None:
            linear = _head_normed(linear, torch.from_numpy(np.ascontiguousarray(norm)), cache.projections["qk_norm_eps"])
        setattr(module, name, linear)
    return module


def _head_normed(linear, weight, eps):
    """`linear` and then the model's RMS norm over each head (`weight` `[head_dim]`, the
    multiplier as applied), in float32 as transformers' Gemma 3 and Qwen3 norms compute it. It
    has no `weight` of its own: a press reading one would bypass the norm."""
    import torch
    from torch import nn

    class HeadNormed(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = linear
            self.register_buffer("norm", weight)

        def forward(self, hidden):
            projected = self.linear(hidden)
            heads = projected.float().unflatten(-1, (-1, self.norm.shape[0]))
            heads = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + eps) * self.norm
            return heads.flatten(-2).to(projected.dtype)

    return HeadNormed()


def _repeat(keys, queries):
    """Each KV head's keys repeated for its query heads (`repeat_kv`)."""
    return keys.repeat_interleave(queries.shape[1] // keys.shape[1], dim=1)


def _innermost(press):
    """The class name of the press that scores (a wrapper's inner press)."""
    while hasattr(press, "press"):
        press = press.press
    return type(press).__name__


def _prerotary(queries, cos, sin):
    from transformers.models.llama.modeling_llama import rotate_half

    return queries * cos.unsqueeze(1) - rotate_half(queries) * sin.unsqueeze(1)


def _step_attentions(query, keys, scale, softcap):
    """The current query's eager attention weights over the whole cache, `[1, g, 1, n]`: what
    the attention layer's output holds when `DecodingPress.forward_hook` runs."""
    import torch

    logits = (query @ keys.transpose(-1, -2)).float() * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return torch.softmax(logits, dim=-1)


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
      ``similarity`` merge, the values it evicts at the cut folded into the kept ones;
    - ``CriticalAdaKVPress(press, alpha_safeguard, epsilon, first_stage_ratio)``: the press's own
      ``compress`` run on each layer of a trace with attention inputs (its head budgets from the
      inner press's scores, CriticalKV's two stages within each head), what it keeps scored 1
      and the rest 0, under the ``adakv`` split with no floor and no normalisation, which keeps
      exactly the 1s when the budget is the press's own count: pass
      ``budget = int(prompt_len * (1 - compression_ratio))``.

    - ``DecodingPress(press, compression_interval, target_size, hidden_states_buffer_size)``: the
      press through :class:`PressScorer` under ``timing="decoding"``, ``order="attend-first"``,
      ``interval`` the press's (``trigger="steps"``), nothing protected, ``budget`` its
      ``target_size`` (so pass no other budget): the prompt stays whole, and every
      ``compression_interval`` decode steps the press scores the cache as ``DecodingPress``
      hands it over (see :class:`PressScorer`);
    - ``PrefillDecodingPress(prefilling_press, decoding_press)``: the prefilling press cuts the
      prompt and the decoding press's press scores its compressions (``timing=
      "prefill-then-stream"``, the schedule above). kvreplay has one budget per cache: the prompt
      is cut to the decoding press's ``target_size``, not to the prefilling press's
      ``compression_ratio``; with only one of the two presses, that press's mapping;
    - ``CAMPress(press, compression_interval, target_size, merge_budget)``: the ``DecodingPress``
      mapping with ``gqa="layer"`` (CaM evicts by the mean of the KV heads' scores), its kept
      entries in their order, no attention weights for the press (as CaM hands it none),
      ``merge="cam"`` and its ``merge_budget`` (kvreplay draws CaM's Bernoulli merges from
      ``merge_seed``, kvpress from torch's global generator; a press that reads values scores the
      values as captured, not as CaM's merges left them).
    - ``KVzipPress(layerwise, n_sink)``: the ``kvzip`` scorer (its scores come from the
      reconstruction pass a recipe with ``reconstruction = "kvzip"`` records, chunked as the
      recipe's ``reconstruction_chunk``, kvpress's ``chunk_size``), one top-k per layer over its
      heads (``heads="adakv"``, ``alpha=0``, no normalisation), under the press's default
      ``layerwise=False`` after one top-k over every layer (``allocator="global"``), the press's
      ``n_sink`` as ``sinks``, no window. The pass runs where the question starts: replay with
      ``protocol="question-agnostic"`` a prompt that has one. kvpress prunes
      ``int(numel * compression_ratio)`` entries of all layers together (or of each layer);
      kvreplay keeps ``budget`` per cache on average, so give the budget that leaves the same
      count. ``kvzip_plus_normalization`` raises :class:`KvreplayError`.

    A decoding press over ``AdaKVPress``, another wrapper, a press that selects in its own
    ``compress`` (``PyramidKVPress``) or a press that scores a whole layer at once
    (``LeverageScorePress``, ``CompactorPress``, ``CriticalKVPress``: while decoding each KV head's
    cache holds other positions) raises :class:`KvreplayError`; other wrapping presses
    (``ChunkKVPress``, ``ChunkPress``, other compositions) have no counterpart and raise it too.
    """
    kind = type(press).__name__
    if kind in ("DecodingPress", "CAMPress"):
        return _decoding(press, kind)
    if kind == "PrefillDecodingPress":
        return _prefill_decoding(press)
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
    if kind == "CriticalKVPress":
        return {"scorer": PressScorer(press)}
    if kind == "CriticalAdaKVPress":
        return {"scorer": PressScorer(press), "heads": "adakv", "alpha": 0.0, "normalize": False}
    if kind == "KVzipPress":
        return _kvzip(press)
    if hasattr(press, "score") and not hasattr(press, "press"):
        settings = {"scorer": PressScorer(press)}
        if kind == "PyramidKVPress":
            settings.update(allocator="pyramid-kvpress", beta=float(press.beta), window=int(press.window_size))
        if kind == "TOVAPress":
            settings.update(gqa="layer")
        return settings
    raise KvreplayError(f"kvpress:{kind} has no kvreplay counterpart: wrap its inner press's scorer instead")


def _kvzip(press):
    """`KVzipPress`: the `kvzip` scorer under AdaKV's split without a floor, after one top-k over
    every layer unless `layerwise`."""
    if press.kvzip_plus_normalization:
        raise KvreplayError(
            "kvpress:KVzipPress with kvzip_plus_normalization weighs the reconstruction pass by its hidden states and W_O V, which traces do not record: "
            "use kvzip_plus_normalization=False"
        )
    settings = {"scorer": "kvzip", "heads": "adakv", "alpha": 0.0, "normalize": False, "sinks": int(press.n_sink), "window": 0}
    return settings if press.layerwise else {**settings, "allocator": "global"}


def _schedule(press):
    """`DecodingPress`'s schedule: a compression back to its `target_size` every
    `compression_interval` decode steps, after the step's attention, nothing protected."""
    interval = int(press.compression_interval)
    return {
        "order": "attend-first",
        "interval": interval,
        "trigger": "steps" if interval > 1 else "growth",
        "sinks": 0,
        "window": 0,
        "budget": int(press.target_size),
    }


def _decoding(press, kind):
    """`DecodingPress` or `CAMPress` over a scorer press: the press scores each compression through
    :class:`PressScorer`; CaM's merges are kvreplay's `cam` merge, one kept set per layer (CaM
    evicts by the mean of the KV heads' scores)."""
    settings = {**_decoding_base(press.base_press, kind), "scorer": PressScorer(press.base_press, decoding=press)}
    settings.update(timing="decoding", **_schedule(press))
    if kind == "CAMPress":
        settings.update(gqa="layer", merge="cam", merge_budget=int(press.merge_budget))
    return settings


def _decoding_base(base, kind):
    """The settings `base`'s own mapping adds to its scorer (TOVA's one kept set per layer), once
    `base` is checked to score while decoding."""
    _check_decoding(base, kind)
    return {key: value for key, value in policy(base).items() if key == "gqa"}


def _check_decoding(base, kind):
    """Raises unless `base` can score while decoding through :class:`PressScorer`."""
    inner = type(base).__name__
    if inner == "AdaKVPress" or not hasattr(base, "score") or hasattr(base, "press"):
        raise KvreplayError(
            f"kvpress:{kind} over {inner}: a decoding press replays over a scorer press (its cache compressed per KV head); "
            "AdaKVPress and other wrappers have no counterpart while decoding"
        )
    scorer_press = next((cls for cls in type(base).__mro__ if cls.__name__ == "ScorerPress"), None)
    if scorer_press is not None and type(base).compress is not scorer_press.compress:
        raise KvreplayError(
            f"kvpress:{kind} over {inner}: the press selects in its own `compress` (PyramidKV's per-layer budgets), "
            "not by the top scores of each cache"
        )
    if inner in READS_INPUTS:
        raise KvreplayError(
            f"kvpress:{kind} over {inner}: the press scores a whole layer at once, and while decoding each KV head's cache "
            "holds other positions; it replays at the prompt's end only"
        )


def _prefill_decoding(press):
    """`PrefillDecodingPress`: its prefilling press cuts the prompt and its decoding press
    compresses while decoding (`prefill-then-stream`), one budget for both: the decoding press's
    `target_size`."""
    prefilling, decoding = press.prefilling_press, press.decoding_press
    if decoding is None:
        if prefilling is None:
            raise KvreplayError("kvpress:PrefillDecodingPress with neither press compresses nothing")
        return policy(prefilling)
    if prefilling is None or type(decoding).__name__ != "DecodingPress":
        return policy(decoding)
    settings = policy(prefilling)
    if not isinstance(settings.get("scorer"), PressScorer) or "allocator" in settings or "heads" in settings:
        raise KvreplayError(
            f"kvpress:PrefillDecodingPress over {type(prefilling).__name__}: its prefilling press must be a scorer press "
            "(kvreplay runs one scorer per cache through the prompt's cut and the decoding compressions)"
        )
    base = _decoding_base(decoding.base_press, "PrefillDecodingPress")
    if base.get("gqa") != settings.get("gqa"):
        raise KvreplayError(
            "kvpress:PrefillDecodingPress: its two presses keep their caches alike (TOVA keeps one set per layer, the others one per KV head)"
        )
    scorer = PressScorer(prefilling, decoding=decoding)
    return {**settings, "scorer": scorer, "timing": "prefill-then-stream", **_schedule(decoding)}


class _RatioBudgets:
    """kvpress's per-layer compression ratios as per-layer budgets."""

    name = "per-layer-ratios"

    def __init__(self, ratios):
        self.ratios = ratios

    def allocate(self, given):
        if given["n_layers"] != len(self.ratios):
            raise ValueError(f"{len(self.ratios)} compression ratios for {given['n_layers']} compressed layers")
        return [int(given["prompt_len"] * (1 - ratio)) for ratio in self.ratios]
