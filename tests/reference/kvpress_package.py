"""kvpress 0.5.5 itself, from PyPI, for kvreplay's parity tests: each press's own `score` (and
ChunkKV's own `compress`) run on a trace's tensors through a stand-in attention module.

The package is installed without its dependencies into `$KVPRESS_PATH` (`pip install --no-deps
--target`; kvpress 0.5.5 declares transformers<5.3, and its model hooks are not used here), and
its press modules are imported without running `kvpress/__init__.py`, which pulls the pipeline's
dependencies (datasets, ...). The stand-in module hands the press what a Llama attention layer
would: `config` (head counts), `head_dim`, `layer_idx`, transformers' own `LlamaRotaryEmbedding`
built from the trace's `rope_theta`, and an identity `q_proj`, so that `hidden_states` can carry
the pre-rotary queries (the trace's queries turned back with that rotary embedding): for a
bias-free Llama projection these are the vectors `q_proj(hidden_states)` would give.

Selection: the top `budget` scores per KV head with `topk_stable` (kvtrace.py) in place of
torch.topk (ScorerPress.compress, scorer_press.py lines 92-95); ChunkKV selects in its own
`compress`, with the compression ratio set so that it keeps budget // chunk_length chunks.

Usage: kvpress_package.py TRACE METHOD [SETTING...] BUDGET...
  knorm | keydiff                       no settings
  lagkv LAG_SIZE N_SINK CROSS           CROSS true|false
  expected-attention N_FUTURE N_SINK USE_COV USE_VNORM
  chunkkv CHUNK_LENGTH                  over KnormPress
  qfilter                               filters from the prompt queries, as the official
                                        make_filters.py computes them (see `qfilters`)
  observed-attention                    given the prompt's eager attention weights (see
                                        `eager_attentions`)
  dms THRESHOLD WINDOW                  DMSPress over KnormPress (decoding=False): its own
                                        forward_hook on the prompt's keys; BUDGET is ignored
                                        (it keeps what scores at least THRESHOLD, and the
                                        last WINDOW positions)
  think RATIO WINDOW                    ThinKPress(RATIO, WINDOW) composed after KnormPress
                                        (kvpress's ComposedPress order): its own `compress` on
                                        the kept keys; adds "pruned": [[channels] per KV head],
                                        the channels it zeroed
  merging THRESHOLD FRACTION            MergingPress(KnormPress, THRESHOLD, FRACTION): its own
                                        `merge` given the Knorm selection; adds "merged":
                                        [[value rows of the kept positions] per KV head]
  cam INTERVAL MERGE_BUDGET SEED        CAMPress(KnormPress, INTERVAL, BUDGET, MERGE_BUDGET):
                                        as decoding, its own hook computing the step's
                                        attention from the queries (`hidden_states`, their
                                        rotary in `position_embeddings`); torch.bernoulli drawn
                                        as kvreplay draws (see `cam_draw`); adds "values":
                                        [[[value rows, in position order] per KV head] per
                                        decode step], what each step's query reads
  decoding INTERVAL                     DecodingPress(KnormPress, INTERVAL, BUDGET): the prompt
                                        prefilled whole, then its own forward_hook after each
                                        decode token; "steps": [[[positions] per KV head] per
                                        decode step], what each step's query attends over (the
                                        hook compresses after the attention)
Prints {"BUDGET": {"layers": [{"kept": [[positions] per KV head], "scores": [[...] per KV head]}]}}.
"""

import os
import sys
import types

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, rotate_half

from kvtrace import emit, load, load_values, top_positions

SETTINGS = {
    "knorm": 0,
    "keydiff": 0,
    "lagkv": 3,
    "expected-attention": 4,
    "chunkkv": 1,
    "qfilter": 0,
    "observed-attention": 0,
    "dms": 2,
    "think": 2,
    "merging": 2,
    "decoding": 1,
    "cam": 3,
}


def without_init():
    """Makes kvpress's press modules importable from `$KVPRESS_PATH` without running the
    package's __init__ (which pulls the pipeline's dependencies)."""
    sys.path.insert(0, os.environ["KVPRESS_PATH"])
    root = os.path.join(os.environ["KVPRESS_PATH"], "kvpress")
    for name, path in [("kvpress", root), ("kvpress.presses", os.path.join(root, "presses"))]:
        module = types.ModuleType(name)
        module.__path__ = [path]
        sys.modules[name] = module


def presses():
    """kvpress's press modules, imported from `$KVPRESS_PATH` without the package's __init__."""
    without_init()
    from kvpress.presses import chunkkv_press, expected_attention_press, keydiff_press, knorm_press, lagkv_press, qfilter_press
    from kvpress.presses import cam_press, decoding_press, dms_press, merging_press, observed_attention_press, think_press

    return types.SimpleNamespace(
        CAM=cam_press.CAMPress,
        ChunkKV=chunkkv_press.ChunkKVPress,
        Decoding=decoding_press.DecodingPress,
        DMS=dms_press.DMSPress,
        ExpectedAttention=expected_attention_press.ExpectedAttentionPress,
        KeyDiff=keydiff_press.KeyDiffPress,
        Knorm=knorm_press.KnormPress,
        LagKV=lagkv_press.LagKVPress,
        ObservedAttention=observed_attention_press.ObservedAttentionPress,
        QFilter=qfilter_press.QFilterPress,
        ThinK=think_press.ThinKPress,
        Merging=merging_press.MergingPress,
    )


def qfilters(layers, n, n_kv_heads):
    """[layers, KV heads, d]: github.com/NathanGodey/qfilters, commit cda5c38, make_filters.py
    lines 86-94, on one sequence: each layer's post-rotary prompt queries (what the script's
    patched model returns), every row instead of 3,000 random ones (deviation), SVD in float32."""
    filters = []
    for q, _ in layers:
        stacked_el = q[0, :, :n]  # [heads, n, d]: torch.stack(el, 1).flatten(1, 2) of one sequence
        u, s, vh = torch.linalg.svd(stacked_el.float())
        svd_sign = ((u[..., 0] > 0).float().mean(-1) > 0.5).float() * 2 - 1
        svd_filter_q = -svd_sign[:, None] * vh[..., 0, :]
        filters.append(svd_filter_q.reshape(n_kv_heads, -1, svd_filter_q.shape[-1]).mean(-2))
    return torch.stack(filters)


def eager_attentions(meta, q, k, n):
    """[1, H, n, n]: the prompt's causal attention weights as transformers' eager attention
    returns them to a press (`output_attentions`): the trace's post-rotary queries against its keys
    repeated per query head (`repeat_kv`), times the trace's scale, masked above the diagonal,
    softmaxed in float32."""
    group = q.shape[1] // k.shape[1]
    keys = k[:, :, :n].repeat_interleave(group, dim=1)
    scale = float(meta.get("scale", 1.0 / q.shape[-1] ** 0.5))
    logits = (q[:, :, :n] @ keys.transpose(-1, -2)).float() * scale
    future = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)
    return torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)


class Attention(nn.Module):
    """What a press reads of a Llama attention layer."""

    def __init__(self, meta, layer_idx):
        super().__init__()
        self.head_dim = int(meta["head_dim"])
        self.layer_idx = layer_idx
        self.config = LlamaConfig(
            hidden_size=int(meta["n_heads"]) * self.head_dim,
            num_attention_heads=int(meta["n_heads"]),
            num_key_value_heads=int(meta["n_kv_heads"]),
            head_dim=self.head_dim,
            rope_theta=float(meta.get("rope_theta", 10000.0)),
            max_position_embeddings=1 << 16,
        )
        self.rotary_emb = LlamaRotaryEmbedding(self.config)
        self.q_proj = nn.Identity()


def hidden_states(module, queries):
    """[1, T, H * d]: the pre-rotary queries, laid out as q_proj's output."""
    t = queries.shape[2]
    cos, sin = module.rotary_emb(queries, torch.arange(t).unsqueeze(0))
    prerope = queries * cos.unsqueeze(1) - rotate_half(queries) * sin.unsqueeze(1)
    return prerope.transpose(1, 2).reshape(1, t, -1)


def dms_kept(ns, settings, module, h, keys, vals):
    """The positions DMSPress leaves unmasked per KV head after its prefill hook."""
    threshold, window = settings
    press = ns.DMS(press=ns.Knorm(), threshold=float(threshold), sliding_window_size=int(window))
    n = keys.shape[2]
    layer = types.SimpleNamespace(keys=keys, values=vals)
    cache = types.SimpleNamespace(layers={module.layer_idx: layer})
    module.masked_key_indices = None
    kwargs = {"hidden_states": h, "past_key_values": cache, "cache_position": torch.arange(n)}
    press.forward_hook(module, [], kwargs, None)
    masked = module.masked_key_indices or [torch.tensor([], dtype=torch.long)] * 3
    gone = [set() for _ in range(keys.shape[1])]
    for head, token in zip(masked[1].tolist(), masked[2].tolist()):
        gone[head].add(token)
    return [[p for p in range(n) if p not in gone[head]] for head in range(keys.shape[1])]


def think_pruned(ns, settings, module, h, keys, vals, kept):
    """The channels ThinKPress zeroes per KV head, run on the keys the Knorm selection `kept`."""
    ratio, window = settings
    press = ns.ThinK(key_channel_compression_ratio=float(ratio), window_size=int(window))
    gathered = [keys[0, head, kept[head]] for head in range(keys.shape[1])]
    kept_keys = torch.stack(gathered).unsqueeze(0).clone()
    t = h.shape[1]
    kwargs = {"hidden_states": h, "position_embeddings": module.rotary_emb(h, torch.arange(t).unsqueeze(0))}
    pruned_keys, _ = press.compress(module, h, kept_keys, vals, None, kwargs)
    zero = (pruned_keys[0] == 0).all(dim=1)  # [KV heads, d]: a channel zeroed in every kept key
    return [torch.nonzero(row).flatten().tolist() for row in zero]


def merged_values(ns, settings, keys, vals, kept):
    """The values of the kept positions after MergingPress.merge folds the others into them."""
    threshold, fraction = settings
    press = ns.Merging(press=ns.Knorm(), similarity_threshold=float(threshold), merge_fraction=float(fraction))
    indices = torch.tensor(kept).unsqueeze(0)
    _, merged = press.merge(keys, vals, indices)
    return [merged[0, head, kept[head]].tolist() for head in range(keys.shape[1])]


MASK64 = (1 << 64) - 1


def splitmix_hash(x):
    """kvreplay's SplitMix64 hash (crates/kvreplay-core/src/splitmix.rs): the generator's first output seeded with x."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def cam_draw(seed, layer, cache, position, candidate):
    """The uniform draw kvreplay's `cam` merge makes (`DecodeMerge::draw`) for a candidate."""
    h = splitmix_hash
    stream = h(h(h(seed ^ ((layer << 32) & MASK64)) ^ cache) ^ position)
    return (h(stream ^ candidate) >> 11) / float(1 << 53)


class SeededBernoulli:
    """torch.bernoulli for CAMPress.compress, drawn as kvreplay draws: the candidates (indices
    into the cache) are read off the `torch.searchsorted(kept_indices, merge_indices)` call that
    precedes the draw and turned into positions by `cached` (the position of each cache row), set
    with the layer and the triggering position before each hook."""

    def __init__(self, seed):
        self.seed, self.layer, self.position, self.cached, self.candidates = seed, 0, 0, [], None
        self.searchsorted, self.bernoulli = torch.searchsorted, torch.bernoulli

    def __enter__(self):
        def searchsorted(sorted_sequence, values, **kwargs):
            self.candidates = [self.cached[i] for i in values[0].tolist()]
            return self.searchsorted(sorted_sequence, values, **kwargs)

        def bernoulli(p):
            out = torch.zeros_like(p)
            for head in range(p.shape[1]):
                for i, candidate in enumerate(self.candidates):
                    u = cam_draw(self.seed, self.layer, head, self.position, candidate)
                    out[0, head, i] = float(u < float(p[0, head, i]))
            return out

        torch.searchsorted, torch.bernoulli = searchsorted, bernoulli
        return self

    def __exit__(self, *_):
        torch.searchsorted, torch.bernoulli = self.searchsorted, self.bernoulli


def decoding_steps(ns, method, settings, module, q, k, v, n, budget):
    """Per decode step, per KV head, the positions the step's query attends over under
    DecodingPress(KnormPress, INTERVAL, target_size=BUDGET) (or CAMPress, which also merges):
    the prompt's keys and values in the cache, then per decode token its key and value appended
    and the press's own forward_hook called after the step (as after the attention); the cache's
    rows found back among the trace's keys (distinct random rows), whatever order the compression
    left them in. For `cam`, also the values of those positions, in position order."""
    if method == "cam":
        interval, merge_budget, seed = (int(x) for x in settings)
        press = ns.CAM(base_press=ns.Knorm(), compression_interval=interval, target_size=budget, merge_budget=merge_budget)
    else:
        press = ns.Decoding(base_press=ns.Knorm(), compression_interval=int(settings[0]), target_size=budget)
        seed = 0
    h = hidden_states(module, q)
    layer = types.SimpleNamespace(keys=k[:, :, :n].clone(), values=v[:, :, :n].clone())
    cache = types.SimpleNamespace(layers={module.layer_idx: layer})
    heads = range(k.shape[1])
    rows = [{tuple(row.tolist()): j for j, row in enumerate(k[0, head])} for head in heads]
    steps, values = [], []
    with SeededBernoulli(seed) as draws:
        draws.layer = module.layer_idx
        for p in range(n, k.shape[2]):
            layer.keys = torch.cat([layer.keys, k[:, :, p : p + 1]], dim=2)
            layer.values = torch.cat([layer.values, v[:, :, p : p + 1]], dim=2)
            held = [[rows[head][tuple(row.tolist())] for row in layer.keys[0, head]] for head in heads]
            steps.append([sorted(positions) for positions in held])
            order = [sorted(range(len(positions)), key=positions.__getitem__) for positions in held]
            values.append([layer.values[0, head, order[head]].tolist() for head in heads])
            draws.position, draws.cached = p, held[0]
            step_h = h[:, p : p + 1]
            kwargs = {
                "hidden_states": step_h,
                "past_key_values": cache,
                "cache_position": torch.tensor([p]),
                "position_embeddings": module.rotary_emb(step_h, torch.tensor([[p]])),
            }
            press.forward_hook(module, [], kwargs, [None, None])
    return steps, values


def make_press(ns, method, settings, budget, n):
    if method in ("knorm", "think", "merging"):
        return ns.Knorm()
    if method == "keydiff":
        return ns.KeyDiff()
    if method == "qfilter":
        return ns.QFilter()
    if method == "observed-attention":
        return ns.ObservedAttention()
    if method == "lagkv":
        lag, sink, cross = settings
        return ns.LagKV(lag_size=int(lag), n_sink=int(sink), cross_scoring=cross == "true")
    if method == "expected-attention":
        future, sink, cov, vnorm = settings
        return ns.ExpectedAttention(
            n_future_positions=int(future), n_sink=int(sink), use_covariance=cov == "true", use_vnorm=vnorm == "true"
        )
    (chunk,) = settings
    chunks = n // int(chunk) + (n % int(chunk) > 0)
    # int(chunks * (1 - ratio)) = budget // chunk: aim half a chunk above it.
    keep = (budget // int(chunk) + 0.5) / chunks
    return ns.ChunkKV(press=ns.Knorm(compression_ratio=1 - keep), chunk_length=int(chunk))


def main():
    path, method = sys.argv[1], sys.argv[2]
    settings = sys.argv[3 : 3 + SETTINGS[method]]
    budgets = [int(b) for b in sys.argv[3 + SETTINGS[method] :]]
    ns = presses()
    meta, layers = load(path)
    values = load_values(path)
    n = int(meta["prompt_len"])
    result = {}
    filters = qfilters(layers, n, int(meta["n_kv_heads"])) if method == "qfilter" else None
    for budget in budgets:
        out = []
        for layer, ((q, k), v) in enumerate(zip(layers, values)):
            module = Attention(meta, layer)
            keys, vals = k[:, :, :n].contiguous(), v[:, :, :n].contiguous()
            press = None if method in ("dms", "decoding", "cam") else make_press(ns, method, settings, budget, n)
            if filters is not None:
                press.q_filters = filters  # what post_init_from_model would load from the hub
            h = hidden_states(module, q[:, :, :n])
            with torch.no_grad():
                if method == "dms":
                    out.append({"kept": dms_kept(ns, settings, module, h, keys, vals)})
                    continue
                if method in ("decoding", "cam"):
                    steps, step_values = decoding_steps(ns, method, settings, module, q, k, v, n, budget)
                    out.append({"steps": steps, **({"values": step_values} if method == "cam" else {})})
                    continue
                if method == "chunkkv":
                    kept_keys, _ = press.compress(module, h, keys, vals, None, {})
                    # The kept rows, found back among the prompt's keys (distinct random rows).
                    rows = {tuple(row.tolist()): j for j, row in enumerate(keys[0, 0])}
                    kept = sorted(rows[tuple(row.tolist())] for row in kept_keys[0, 0])
                    out.append({"kept": [kept] * keys.shape[1]})
                    continue
                attentions = eager_attentions(meta, q, k, n) if method == "observed-attention" else None
                scores = press.score(module, h, keys, vals, attentions, {})
                kept = top_positions(scores, budget, n)
            result_layer = {"kept": kept, "scores": scores[0].tolist()}
            if method == "think":
                with torch.no_grad():
                    result_layer["pruned"] = think_pruned(ns, settings, module, h, keys, vals, kept)
            if method == "merging":
                with torch.no_grad():
                    result_layer["merged"] = merged_values(ns, settings, keys, vals, kept)
            out.append(result_layer)
        result[str(budget)] = {"layers": out}
    emit(result)


if __name__ == "__main__":
    main()
