"""kvpress 0.5.5 run live, as its pipeline runs a press: the model in transformers (eager
attention), the press's forward hooks on every attention layer (`with press(model):`), one
prefill of the prompt, and the compressed cache read back. For the bridge's parity test
(python/tests/test_kvpress.py): what each press keeps live, to compare with what
`kvreplay.kvpress.policy(press)` keeps replaying a trace of the same prompt.

kvpress 0.5.5 declares transformers<5.3 and its hook reads `past_key_values` and
`cache_position`, which transformers 5.3 onwards no longer passes; this script runs in the
test's own venv with transformers 5.2.0 (python/tests/requirements-kvpress.txt) and the
package installed without its dependencies at $KVPRESS_PATH.

Kept positions: kvpress gathers the kept keys (ScorerPress.compress, scorer_press.py lines
91-101); each kept key row is matched to the prompt position whose key it is, from a prefill
without the press (prefill compresses after each layer's attention, so every layer sees the
same inputs as without the press and the rows are bit-identical). Scores: the press's own
`score()` output, recorded as it returns.

The presses of INPUT_PRESSES read the layer's hidden states through its projections and may draw
random numbers (LeverageScorePress's Gaussian sketch): each prefill with a press runs after
`torch.manual_seed(SEED)`, the seed the bridge's `PressScorer` starts its layers from.

KVzipPress (KVZIP) runs its own way: see `kvzip`.

Usage: kvpress_live.py MODEL_DIR GGUF_FILE TOKENS.npy BUDGET OUT.npz PRESS...
Writes `<press>.kept` (bool [layers, kv_heads, n]) and `<press>.scores` (float32, same shape;
absent for presses that do not score through `score()`).
"""

import importlib
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from kvpress_package import without_init

without_init()

# Each press's module, and arguments beyond its defaults: a PyramidKVPress whose schedule is not
# flat on a short prompt (kvpress's is flat unless the budget reaches beta * window_size).
PRESSES = {
    "KnormPress": ("knorm_press", {}),
    "KeyDiffPress": ("keydiff_press", {}),
    "LagKVPress": ("lagkv_press", {}),
    "ExpectedAttentionPress": ("expected_attention_press", {}),
    "SnapKVPress": ("snapkv_press", {}),
    "TOVAPress": ("tova_press", {}),
    "StreamingLLMPress": ("streaming_llm_press", {}),
    "PyramidKVPress": ("pyramidkv_press", {"window_size": 8, "beta": 4}),
    "ObservedAttentionPress": ("observed_attention_press", {}),
    "NonCausalAttnPress": ("non_causal_attention_press", {}),
    "CURPress": ("cur_press", {}),
    "CapPress": ("cap_press", {}),
}


# Presses that read each layer's hidden states and projections (a trace with attention inputs);
# CriticalKVPress over SnapKVPress, the inner press its paper pairs it with.
INPUT_PRESSES = {
    "LeverageScorePress": ("leverage_press", {}),
    "CompactorPress": ("compactor_press", {}),
    "CriticalKVPress": ("criticalkv_press", {"press": ("snapkv_press", "SnapKVPress")}),
}

# Presses that select in their own `compress` and mask the keys they evict (`masked_key_indices`)
# instead of dropping them; they read each layer's inputs too. CriticalAdaKVPress over
# SnapKVPress, as CriticalKVPress.
MASKING = {"CriticalAdaKVPress": ("criticalkv_press", {"press": ("snapkv_press", "SnapKVPress")})}

# The torch seed every prefill with a press starts from.
SEED = 0

# KVzipPress is no ScorerPress: after the prefill it scores by a reconstruction pass and masks
# the keys it evicts instead of removing them (`compress_post`), one top-k per layer with
# `layerwise`, or one over every layer first under its default `layerwise=False` (asked for as
# `KVzipPress-global`); its chunk size is the recipe's `reconstruction_chunk`
# (python/tests/test_kvpress_live.py).
KVZIP = {"KVzipPress": ("kvzip_press", {"layerwise": True, "chunk_size": 256})}
KVZIP_GLOBAL = "KVzipPress-global"


def build(name, budget, n):
    """Press `name` set to keep `budget` of `n` positions: ScorerPress keeps
    int(n * (1 - ratio)) (half a token above the budget), PyramidKVPress's schedule reads
    n * (1 - ratio) as the budget itself."""
    module, arguments = {**PRESSES, **INPUT_PRESSES, **MASKING}[name]
    arguments = {key: inner(*value) if isinstance(value, tuple) else value for key, value in arguments.items()}
    press = getattr(importlib.import_module(f"kvpress.presses.{module}"), name)(**arguments)
    press.compression_ratio = 1 - (budget + (0 if name == "PyramidKVPress" else 0.5)) / n
    return press


def inner(module, name):
    """A press given to a wrapping press, with its defaults."""
    return getattr(importlib.import_module(f"kvpress.presses.{module}"), name)()


def prefill(model, ids, press=None):
    cache = DynamicCache()
    with torch.no_grad():
        if press is None:
            model(input_ids=ids, past_key_values=cache, use_cache=True)
        else:
            torch.manual_seed(SEED)
            with press(model):
                model(input_ids=ids, past_key_values=cache, use_cache=True)
    return [layer.keys[0].float() for layer in cache.layers]


def kept_positions(full, compressed):
    """[kv_heads, n] bool: which prompt positions' keys the compressed cache holds."""
    heads, n, _ = full.shape
    mask = np.zeros((heads, n), dtype=bool)
    for head in range(heads):
        distance = torch.cdist(compressed[head], full[head], compute_mode="donot_use_mm_for_euclid_dist")
        nearest = distance.argmin(dim=-1)
        exact = distance.gather(-1, nearest[:, None]).max().item()
        if exact > 0:
            raise SystemExit(f"a kept key matches no prompt position exactly (distance {exact})")
        mask[head, nearest.numpy()] = True
    return mask


def masked(model, ids, press):
    """A masking press run live on `ids`: the kept mask [layers, kv_heads, n] read from the keys
    it masks. Its `compress` asserts a non-eager attention (for the patch that reads its masks in
    later forward passes), so it is shown `sdpa` while it runs; every forward runs eager."""
    own = press.compress

    def compress(module, *args, **kwargs):
        model.config._attn_implementation = "sdpa"
        try:
            return own(module, *args, **kwargs)
        finally:
            model.config._attn_implementation = "eager"

    object.__setattr__(press, "compress", compress)
    config = model.config
    kept = np.ones((config.num_hidden_layers, config.num_key_value_heads, ids.shape[1]), dtype=bool)
    torch.manual_seed(SEED)
    with torch.no_grad(), press(model):
        model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True)
    for layer in model.model.layers:
        _, heads, positions = layer.self_attn.masked_key_indices
        kept[layer.self_attn.layer_idx, heads.numpy(), positions.numpy()] = False
    return kept


def recorded(press, scores):
    """Records the press's `score()` output per layer as it returns it."""
    own = press.score

    def score(module, *args, **kwargs):
        result = own(module, *args, **kwargs)
        scores[module.layer_idx] = result[0].float().numpy()
        return result

    object.__setattr__(press, "score", score)


class GivenTokenizer:
    """Stands for `AutoTokenizer` in kvzip_press: the press loads the tokenizer from the model's
    `name_or_path`, a directory that holds only the GGUF, so it is handed the GGUF's."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def from_pretrained(self, *args, **kwargs):
        return self.tokenizer


def kvzip(model, tokenizer, ids, budget, layerwise=True):
    """KVzipPress run live on `ids` (the context, its cut), set to keep `budget` tokens per KV
    head on average in every layer (`n_pruned = int(kv * n * ratio)` per layer, kvzip_press.py
    lines 381-382) or, not `layerwise`, over all layers together (`int(layers * kv * n * ratio)`,
    lines 384-387): the kept mask [layers, kv_heads, n] read from the indices it masks, and its
    scores before the sinks are raised (`score_val`, read just before `compress_post` uses it).
    Every forward runs eager; `compress_post` asserts a non-eager implementation, for the
    attention patch that later reads its masks, so it is shown `sdpa` while it runs."""
    module_name, arguments = KVZIP["KVzipPress"]
    module = importlib.import_module(f"kvpress.presses.{module_name}")
    module.AutoTokenizer = GivenTokenizer(tokenizer)
    kv, n = model.config.num_key_value_heads, ids.shape[1]
    caches = kv if layerwise else kv * model.config.num_hidden_layers
    ratio = (caches * (n - budget) + 0.5) / (caches * n)
    press = module.KVzipPress(compression_ratio=ratio, **{**arguments, "layerwise": layerwise})
    seen = {}
    own = press.compress_post

    def compress_post(model):
        seen["scores"] = press.score_val[:, 0].float().numpy().copy()
        model.config._attn_implementation = "sdpa"
        try:
            own(model)
        finally:
            model.config._attn_implementation = "eager"

    object.__setattr__(press, "compress_post", compress_post)
    with torch.no_grad(), press(model):
        model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True)
    kept = np.ones(seen["scores"].shape, dtype=bool)
    for layer in model.model.layers:
        _, heads, positions = layer.self_attn.masked_key_indices
        kept[layer.self_attn.layer_idx, heads.numpy(), positions.numpy()] = False
    return kept, seen["scores"]


def main():
    model_dir, gguf, tokens, budget, out, *names = sys.argv[1:]
    ids = torch.from_numpy(np.load(tokens)).long()[None]
    n = ids.shape[1]
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, gguf_file=gguf, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    full = prefill(model, ids)
    found = {}
    if "KVzipPress" in names:
        names.remove("KVzipPress")
        tokenizer = AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf)
        found["KVzipPress.kept"], found["KVzipPress.scores"] = kvzip(model, tokenizer, ids, int(budget))
    if KVZIP_GLOBAL in names:
        names.remove(KVZIP_GLOBAL)
        tokenizer = AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf)
        found[f"{KVZIP_GLOBAL}.kept"], _ = kvzip(model, tokenizer, ids, int(budget), layerwise=False)
    for name in names:
        press = build(name, int(budget), n)
        scores = {}
        if name in MASKING:
            # The inner press's scores, which set the heads' budgets and stage 1.
            recorded(press.press, scores)
            found[f"{name}.kept"] = masked(model, ids, press)
        else:
            recorded(press, scores)
            compressed = prefill(model, ids, press)
            found[f"{name}.kept"] = np.stack([kept_positions(f, c) for f, c in zip(full, compressed)])
        if len(scores) == len(full):
            found[f"{name}.scores"] = np.stack([scores[layer] for layer in range(len(full))])
    np.savez(out, **found)


if __name__ == "__main__":
    main()
