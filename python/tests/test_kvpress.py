"""Every ScorerPress of kvpress 0.5.5 that can be built with default arguments, replayed through
`kvreplay.kvpress.PressScorer`: those kvreplay has a Rust scorer for keep the same sets; those that
cannot run from a trace fail on the probe, naming the press.

kvpress is the package the Rust parity tests fetch (`pip download --no-deps` into
$KVREPLAY_HOME/kvpress-0.5.5); its press modules are imported without `kvpress/__init__.py`, which
pulls the evaluation pipeline's dependencies."""

import importlib
import inspect
import os
import pathlib
import sys
import types

import numpy as np
import pytest

import kvreplay
from kvreplay.kvpress import PressScorer

HOME = pathlib.Path(os.environ.get("KVREPLAY_HOME", pathlib.Path.home() / ".cache" / "kvreplay"))
KVPRESS = pathlib.Path(os.environ.get("KVPRESS_PATH", HOME / "kvpress-0.5.5"))

METRICS = ["retained_mass", "topk_recall", "output_error", "value_weighted_mass"]

# Presses with a Rust scorer: its name, the policy's settings, and the Rust scorer's own settings
# that equal the press's defaults.
EQUIVALENT = {
    "KnormPress": ("knorm", {}, {}),
    "KeyDiffPress": ("keydiff", {}, {}),
    "LagKVPress": ("lagkv", {}, {"lag_size": 128, "n_sink": 4, "cross_scoring": False}),
    "ExpectedAttentionPress": ("expected-attention", {}, {"n_future_positions": 512, "n_sink": 4}),
    "SnapKVPress": ("snapkv", {"window": 64}, {"kernel": 5, "pool": "avg", "agg": "mean"}),
    "TOVAPress": ("tova", {}, {}),
    "StreamingLLMPress": ("recency", {"sinks": 4}, {}),
}

# kvpress's ScorerPress protects nothing beyond what its scores keep (PressScorer's defaults).
AS_KVPRESS = {"window": 0, "sinks": 0}

# The other presses that replay from a trace, those that replay from a trace holding attention
# inputs (test_kvpress_live.py compares them with kvpress run live), and those that cannot: they
# need a component fetched from the hub (the README's table).
ALSO_RUN = {"PyramidKVPress", "ObservedAttentionPress", "NonCausalAttnPress", "CURPress", "CapPress", "RandomPress"}
READ_INPUTS = {"LeverageScorePress", "CompactorPress", "CriticalKVPress"}
CANNOT = {"QFilterPress", "KVzapPress"}
# Presses that wrap another, built over KnormPress.
WRAPPERS = {"CriticalKVPress"}
# Modules whose imports kvreplay does not install; of their presses only ExpectedAttentionStatsPress
# is a ScorerPress, and it loads query statistics from the hub.
NOT_IMPORTED = {"duo_attention_press", "expected_attention_with_stats", "lukv_press"}


def scorer_presses():
    """Every ScorerPress subclass in kvpress.presses, by class name, or the import error."""
    sys.path.insert(0, str(KVPRESS))
    root = KVPRESS / "kvpress"
    for name, path in [("kvpress", root), ("kvpress.presses", root / "presses")]:
        module = types.ModuleType(name)
        module.__path__ = [str(path)]
        sys.modules.setdefault(name, module)
    base = importlib.import_module("kvpress.presses.scorer_press").ScorerPress
    found = {}
    for file in sorted((root / "presses").glob("*.py")):
        try:
            module = importlib.import_module(f"kvpress.presses.{file.stem}")
        except Exception as err:  # an optional dependency kvreplay does not install
            found[file.stem] = err
            continue
        for name, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, base) and cls is not base and cls.__module__ == module.__name__:
                found[name] = cls
    return found


PRESSES = scorer_presses() if KVPRESS.is_dir() else {}


def test_the_press_list_is_complete():
    assert KVPRESS.is_dir(), f"{KVPRESS}: run cargo test first (the parity tests fetch kvpress)"
    names = {name for name, cls in PRESSES.items() if inspect.isclass(cls)}
    assert names == set(EQUIVALENT) | ALSO_RUN | READ_INPUTS | CANNOT, sorted(names)
    assert {name for name, found in PRESSES.items() if not inspect.isclass(found)} == NOT_IMPORTED


@pytest.mark.parametrize("press_name", sorted(EQUIVALENT))
@pytest.mark.parametrize("budget", [72, 160])  # above SnapKVPress's window of 64
def test_presses_keep_what_rust_keeps(trace, press_name, budget):
    cls = PRESSES[press_name]
    # StreamingLLMPress keeps int(n * (1 - ratio)) tokens: aim half a token above the budget.
    ratio = 1 - (budget + 0.5) / trace.prompt_len
    press = cls(compression_ratio=ratio) if press_name == "StreamingLLMPress" else cls()
    rust, common, own = EQUIVALENT[press_name]
    ours = kvreplay.kept(trace, scorer=PressScorer(press), budget=budget, **common)["mask"]
    theirs = kvreplay.kept(trace, scorer=rust, budget=budget, **{**AS_KVPRESS, **common}, **own)["mask"]
    differ = (ours != theirs).any(axis=-1).sum()
    assert differ == 0, f"{press_name}: {differ} of {ours.shape[0] * ours.shape[1]} caches differ"


def outcome(cls):
    """`runs` or why not: each press built with default arguments (a wrapper over KnormPress) and
    wrapped."""
    try:
        press = cls(PRESSES["KnormPress"]()) if cls.__name__ in WRAPPERS else cls()
    except Exception as err:
        return f"cannot be built with default arguments: {err}"
    try:
        PressScorer(press)
    except kvreplay.KvreplayError as err:
        return str(err)
    return "runs"


def test_every_scorer_press_runs_or_says_why(trace):
    outcomes = {name: outcome(cls) for name, cls in PRESSES.items() if inspect.isclass(cls)}
    assert {name for name, why in outcomes.items() if why == "runs"} == set(EQUIVALENT) | ALSO_RUN | READ_INPUTS
    for name in CANNOT:
        assert name in outcomes[name], (name, outcomes[name])
    for name in READ_INPUTS:  # this trace holds no attention inputs: the error names them and the option
        press = PRESSES[name](PRESSES["KnormPress"]()) if name in WRAPPERS else PRESSES[name]()
        with pytest.raises(kvreplay.KvreplayError, match=r"kvpress:%s` reads each layer's attention inputs.*--attention-inputs" % name):
            kvreplay.kept(trace, budget=64, scorer=PressScorer(press))
    running = [name for name, why in outcomes.items() if why == "runs" and name not in READ_INPUTS]
    results = kvreplay.replay(trace, budget=64, policies=[{"scorer": PressScorer(PRESSES[n]())} for n in running])
    mass = results.runs["retained_mass"].to_list()
    assert all(0.0 < m <= 1.0 for m in mass), dict(zip(running, mass))
    report = "\n".join(f"{name}: {why}" for name, why in sorted(outcomes.items()))
    print(f"\nkvpress 0.5.5 ScorerPresses:\n{report}")


def test_wrapping_presses_map_onto_kvreplays_axes(trace):
    from kvreplay.kvpress import policy

    wrapper = importlib.import_module("kvpress.presses.adakv_press").AdaKVPress
    ours = kvreplay.kept(trace, budget=96, **policy(wrapper(PRESSES["KnormPress"](), alpha_safeguard=0.3)))["mask"]
    theirs = kvreplay.kept(trace, budget=96, scorer="knorm", heads="adakv", alpha=0.3, normalize=False, **AS_KVPRESS)["mask"]
    assert np.array_equal(ours, theirs)

    pyramid = policy(PRESSES["PyramidKVPress"](window_size=8, beta=4))
    ours = kvreplay.kept(trace, budget=128, **pyramid)
    theirs = kvreplay.kept(trace, budget=128, allocator="pyramid-kvpress", beta=4.0, window=8, kernel=5, pool="avg", sinks=0)
    assert len(set(ours["budgets"])) > 1, "a pyramid, not flat"
    assert ours["budgets"] == theirs["budgets"] and np.array_equal(ours["mask"], theirs["mask"])

    per_layer = importlib.import_module("kvpress.presses.per_layer_compression_press").PerLayerCompressionPress
    ratios = [0.5 + 0.01 * layer for layer in range(trace.n_layers)]
    kept = kvreplay.kept(trace, budget=64, **policy(per_layer(PRESSES["KnormPress"](), compression_ratios=ratios)))
    assert kept["budgets"] == [int(trace.prompt_len * (1 - r)) for r in ratios]

    dms = importlib.import_module("kvpress.presses.dms_press").DMSPress
    ours = kvreplay.kept(trace, budget=trace.prompt_len, **policy(dms(PRESSES["KnormPress"](), threshold=-15.0, sliding_window_size=32)))
    theirs = kvreplay.kept(trace, budget=trace.prompt_len, scorer="knorm", heads="threshold", threshold=-15.0, window=32, sinks=0)
    assert ours["budgets"] == theirs["budgets"] and np.array_equal(ours["mask"], theirs["mask"])
    assert 32 < ours["mask"].sum(axis=-1).mean() < trace.prompt_len  # it evicts, and keeps more than its window
    with pytest.raises(kvreplay.KvreplayError, match="decoding=False"):
        policy(dms(PRESSES["KnormPress"](), threshold=-15.0, decoding=True))

    think = importlib.import_module("kvpress.presses.think_press").ThinKPress
    composed = importlib.import_module("kvpress.presses.composed_press").ComposedPress
    pruned = policy(composed([PRESSES["KnormPress"](), think(key_channel_compression_ratio=0.25, window_size=16)]))
    ours = kvreplay.replay(trace, budget=96, **pruned).runs.row(0, named=True)
    theirs = kvreplay.replay(trace, budget=96, scorer="knorm", channels="think", key_channel_ratio=0.25, query_window=16, **AS_KVPRESS).runs.row(0, named=True)
    plain = kvreplay.replay(trace, budget=96, scorer="knorm", **AS_KVPRESS).runs.row(0, named=True)
    assert [ours[m] for m in METRICS] == [theirs[m] for m in METRICS] and ours["kv_bytes"] == theirs["kv_bytes"]
    assert ours["kv_bytes"] < plain["kv_bytes"] and ours["retained_mass"] < plain["retained_mass"]
    with pytest.raises(kvreplay.KvreplayError, match="ThinK last"):
        policy(composed([think(key_channel_compression_ratio=0.25), PRESSES["KnormPress"]()]))

    merging = importlib.import_module("kvpress.presses.merging_press").MergingPress
    folded = policy(merging(press=PRESSES["KnormPress"](), similarity_threshold=0.1, merge_fraction=0.5))
    ours = kvreplay.replay(trace, budget=96, **folded).runs.row(0, named=True)
    theirs = kvreplay.replay(trace, budget=96, scorer="knorm", merge="similarity", similarity_threshold=0.1, merge_fraction=0.5, **AS_KVPRESS).runs.row(0, named=True)
    assert [ours[m] for m in METRICS] == [theirs[m] for m in METRICS]
    assert ours["kv_bytes"] == plain["kv_bytes"] and ours["retained_mass"] == plain["retained_mass"]

    chunked = importlib.import_module("kvpress.presses.chunk_press").ChunkPress
    with pytest.raises(kvreplay.KvreplayError, match="kvpress:ChunkPress has no kvreplay counterpart"):
        policy(chunked(PRESSES["KnormPress"]()))

    # DecodingPress and CAMPress run their press through PressScorer on kvreplay's decoding
    # schedule (checked against kvpress's hooks below; CaM's merges are Rust's `cam`, checked
    # against CAMPress's hooks in tests/integration/parity.rs). Over what cannot score while decoding they say
    # why not.
    cam_press = importlib.import_module("kvpress.presses.cam_press").CAMPress
    decoding_press = importlib.import_module("kvpress.presses.decoding_press").DecodingPress
    schedule = dict(timing="decoding", order="attend-first", interval=4, trigger="steps", sinks=0, window=0, budget=96)
    decoding = kvreplay.replay(trace, scorer="knorm", **schedule).runs.row(0, named=True)
    mapped = policy(decoding_press(base_press=PRESSES["KnormPress"](), compression_interval=4, target_size=96))
    assert isinstance(mapped.pop("scorer"), PressScorer) and mapped == {"timing": "decoding", **schedule}
    mapped = kvreplay.replay(trace, **policy(decoding_press(base_press=PRESSES["KnormPress"](), compression_interval=4, target_size=96))).runs.row(0, named=True)
    assert [mapped[m] for m in METRICS] == [decoding[m] for m in METRICS]
    cam = kvreplay.replay(trace, scorer="knorm", gqa="layer", merge="cam", merge_budget=4, **schedule).runs.row(0, named=True)
    mapped = policy(cam_press(base_press=PRESSES["KnormPress"](), compression_interval=4, target_size=96, merge_budget=4))
    assert isinstance(mapped.pop("scorer"), PressScorer)
    assert mapped == {"timing": "decoding", **schedule, "gqa": "layer", "merge": "cam", "merge_budget": 4}
    mapped = policy(cam_press(base_press=PRESSES["KnormPress"](), compression_interval=4, target_size=96, merge_budget=4))
    assert kvreplay.replay(trace, **mapped).runs.row(0, named=True)["output_error"] == cam["output_error"]
    assert cam["kv_bytes"] == decoding["kv_bytes"] and cam["output_error"] != decoding["output_error"]
    assert policy(decoding_press(base_press=PRESSES["KnormPress"](), compression_interval=1, target_size=96))["trigger"] == "growth"
    with pytest.raises(kvreplay.KvreplayError, match="kvpress:DecodingPress over PyramidKVPress: the press selects in its own `compress`"):
        policy(decoding_press(base_press=PRESSES["PyramidKVPress"](), compression_interval=4, target_size=96))
    with pytest.raises(kvreplay.KvreplayError, match="kvpress:DecodingPress over AdaKVPress: a decoding press replays over a scorer press"):
        policy(decoding_press(base_press=wrapper(PRESSES["KnormPress"]()), compression_interval=4, target_size=96))
    with pytest.raises(kvreplay.KvreplayError, match="kvpress:DecodingPress over LeverageScorePress: the press scores a whole layer at once"):
        policy(decoding_press(base_press=PRESSES["LeverageScorePress"](), compression_interval=4, target_size=96))
    prefill_decoding = importlib.import_module("kvpress.presses.prefill_decoding_press").PrefillDecodingPress
    alone = decoding_press(base_press=PRESSES["KnormPress"](), compression_interval=4, target_size=96)
    assert policy(prefill_decoding(decoding_press=alone))["timing"] == "decoding"
    prefill_only = policy(prefill_decoding(prefilling_press=PRESSES["KnormPress"]()))
    assert isinstance(prefill_only.pop("scorer"), PressScorer) and prefill_only == {}
    with pytest.raises(kvreplay.KvreplayError, match="TOVA keeps one set per layer"):
        policy(prefill_decoding(prefilling_press=PRESSES["TOVAPress"](), decoding_press=alone))


# kvpress's presses compressing while decoding, against their own hooks on the same trace
# (tests/reference/kvpress_decoding.py): a chat prompt whose answer runs 96 tokens, the cache
# compressed back to 32 entries every 16 decode steps.
DECODE_RECIPE = """\
kind = "chat"
message = "Write a long story about a lighthouse keeper who finds a message in a bottle."
generate = 96
"""
INTERVAL, TARGET = 16, 32
# Each press's arguments beyond its defaults: SnapKV's window must be shorter than the decode
# steps DecodingPress buffers (it asserts so), LagKV's lag shorter than the cache.
DECODING_ARGS = {"SnapKVPress": {"window_size": 8}, "LagKVPress": {"lag_size": 8}}
# NonCausalAttnPress asserts it runs in prefill only; RandomPress draws per layer, the bridge per
# cache.
DECODES = sorted((set(EQUIVALENT) | ALSO_RUN) - {"NonCausalAttnPress", "RandomPress", "PyramidKVPress"})


@pytest.fixture(scope="session")
def decode_trace(tmp_path_factory):
    recipe = tmp_path_factory.mktemp("decode") / "story.toml"
    recipe.write_text(DECODE_RECIPE)
    trace = kvreplay.Trace(kvreplay.capture(recipe).path)
    assert len(trace.tokens) - trace.prompt_len >= 64 and trace.prompt_len > TARGET
    return trace


def held(trace, press, policy_of):
    """What kvpress's own hooks hold at each decode step, and what the bridge keeps, both
    [layer, KV head, step, position]."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests" / "reference"))
    import kvpress_decoding

    steps = kvpress_decoding.held_steps(str(trace.path), press())
    theirs = np.zeros((trace.n_layers, trace.n_kv_heads, len(steps[0]), len(trace.tokens)), dtype=bool)
    for layer, layer_steps in enumerate(steps):
        for step, heads in enumerate(layer_steps):
            for head, positions in enumerate(heads):
                theirs[layer, head, step, positions] = True
    ours = kvreplay.kept(trace, steps=True, **policy_of(press()))["mask"]
    return np.broadcast_to(ours, theirs.shape), theirs


@pytest.mark.parametrize("name", DECODES)
def test_decoding_press_keeps_what_kvpress_keeps(decode_trace, name):
    from kvreplay.kvpress import policy

    decoding_press = importlib.import_module("kvpress.presses.decoding_press").DecodingPress
    press = lambda: decoding_press(PRESSES[name](**DECODING_ARGS.get(name, {})), compression_interval=INTERVAL, target_size=TARGET)  # noqa: E731
    ours, theirs = held(decode_trace, press, policy)
    assert np.array_equal(ours, theirs)
    compressed = theirs.sum(axis=-1) < decode_trace.prompt_len + np.arange(1, theirs.shape[2] + 1)
    assert compressed.any(axis=(0, 1)).sum() == theirs.shape[2] - INTERVAL, "every step after the first compression"


def test_prefill_decoding_press_keeps_what_kvpress_keeps(decode_trace):
    from kvreplay.kvpress import policy

    module = lambda name: importlib.import_module(f"kvpress.presses.{name}")  # noqa: E731
    n = decode_trace.prompt_len
    press = lambda: module("prefill_decoding_press").PrefillDecodingPress(  # noqa: E731
        prefilling_press=PRESSES["SnapKVPress"](window_size=8, compression_ratio=1 - (TARGET + 0.5) / n),
        decoding_press=module("decoding_press").DecodingPress(PRESSES["StreamingLLMPress"](), compression_interval=INTERVAL, target_size=TARGET),
    )
    ours, theirs = held(decode_trace, press, policy)
    assert np.array_equal(ours, theirs)
    assert (theirs.sum(axis=-1) <= TARGET + INTERVAL).all(), "the prompt is cut"


# CAMPress's kept sets: a press that reads keys only (CaM's merges change the values, which the
# bridge's press sees as captured).
CAM_DECODES = ["KeyDiffPress", "KnormPress", "SnapKVPress", "StreamingLLMPress", "TOVAPress"]


@pytest.mark.parametrize("name", CAM_DECODES)
def test_cam_press_keeps_what_kvpress_keeps(decode_trace, name):
    from kvreplay.kvpress import policy

    cam_press = importlib.import_module("kvpress.presses.cam_press").CAMPress
    press = lambda: cam_press(PRESSES[name](**DECODING_ARGS.get(name, {})), compression_interval=INTERVAL, target_size=TARGET, merge_budget=4)  # noqa: E731
    ours, theirs = held(decode_trace, press, policy)
    assert np.array_equal(ours, theirs)
    # One kept set per layer, as CaM's mean over the KV heads chooses.
    assert (theirs == theirs[:, :1]).all()


def test_cam_keeps_its_entries_in_their_order(decode_trace, monkeypatch):
    # CaM keeps its kept entries in sequence order: gathered in topk's order as DecodingPress does,
    # StreamingLLM's sinks leave kvpress's sets.
    from kvreplay import kvpress as bridge

    original = bridge.PressScorer.__init__

    def topk_ordered(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.keeps_order = False

    monkeypatch.setattr(bridge.PressScorer, "__init__", topk_ordered)
    cam_press = importlib.import_module("kvpress.presses.cam_press").CAMPress
    press = lambda: cam_press(PRESSES["StreamingLLMPress"](), compression_interval=INTERVAL, target_size=TARGET, merge_budget=4)  # noqa: E731
    ours, theirs = held(decode_trace, press, bridge.policy)
    assert not np.array_equal(ours, theirs)


def test_the_cache_order_is_what_makes_them_equal(decode_trace, monkeypatch):
    # SnapKV pads the last entries of kvpress's cache order and StreamingLLM keeps its first:
    # taken in position order instead, their sets leave kvpress's.
    from kvreplay import kvpress as bridge

    monkeypatch.setattr(bridge._CacheOrder, "_order", lambda self, positions: [int(p) for p in positions])
    decoding_press = importlib.import_module("kvpress.presses.decoding_press").DecodingPress
    for name in ["SnapKVPress", "StreamingLLMPress"]:
        press = lambda: decoding_press(PRESSES[name](**DECODING_ARGS.get(name, {})), compression_interval=INTERVAL, target_size=TARGET)  # noqa: E731
        ours, theirs = held(decode_trace, press, bridge.policy)
        assert not np.array_equal(ours, theirs), name


def test_pruning_merging_and_quantizing_presses_run_live(recipe):
    # ThinK's pruned keys, kvpress's merge and a KIVI cache: the model runs on what each stores.
    from kvreplay.kvpress import policy

    think = importlib.import_module("kvpress.presses.think_press").ThinKPress
    composed = importlib.import_module("kvpress.presses.composed_press").ComposedPress
    merging = importlib.import_module("kvpress.presses.merging_press").MergingPress
    knorm = PRESSES["KnormPress"]
    results = kvreplay.live(
        recipe,
        budget=64,
        policies=[
            {"scorer": "knorm"},
            policy(composed([knorm(), think(key_channel_compression_ratio=0.5, window_size=16)])),
            policy(merging(press=knorm())),
            {"scorer": "knorm", "quantizer": "kivi", "bits": 2, "group_size": 16, "residual": 32},
        ],
    )
    runs = results.runs
    plain = runs.row(0, named=True)
    for row in runs.iter_rows(named=True):
        assert row["mean_kept"] == plain["mean_kept"]
    assert len(set(runs["kl"].to_list())) == 4, "each storage changes what the model does"


def test_a_decoding_press_runs_live(tmp_path):
    # The bridge's per-cache order forks with the live run's streams: in one batch with another
    # policy or alone, the same closed loop, bit for bit.
    from kvreplay.kvpress import policy

    recipe = tmp_path / "story.toml"
    recipe.write_text(DECODE_RECIPE.replace("generate = 96", "generate = 40"))
    decoding_press = importlib.import_module("kvpress.presses.decoding_press").DecodingPress
    press = lambda: decoding_press(PRESSES["SnapKVPress"](window_size=4), compression_interval=8, target_size=TARGET)  # noqa: E731
    both = kvreplay.live(recipe, policies=[policy(press()), {"scorer": "knorm", "budget": TARGET}]).runs
    alone = kvreplay.live(recipe, **policy(press())).runs
    for column in ["kl", "top1", "live_retained_mass", "answer_score", "text", "retained_mass"]:
        assert both[column][0] == alone[column][0], column
    assert both["kl"][0] > 0 and both["kl"][0] != both["kl"][1]


@pytest.fixture(scope="module")
def gemma_trace(tmp_path_factory):
    """A ~300-token needle prompt captured natively from Gemma 3 270M with its attention inputs,
    its per-head q/k norms among them."""
    from conftest import RECIPE

    path = tmp_path_factory.mktemp("gemma") / "niah-gemma.toml"
    path.write_text('model = "gemma3-270m"\n' + RECIPE.replace("prompt_tokens = 600", "prompt_tokens = 300"))
    trace = kvreplay.Trace(kvreplay.capture(path, dtype="f32", attention_inputs=True).path)
    assert trace.has_inputs
    return trace


class PrerotaryProbe:
    """Scores by key norm and checks, in each layer it is shown, that the bridge's module gives
    the trace's queries and keys as a press reads them: kvpress's `get_prerope_query_states` and
    `get_prerope_key_states` of the module and the hidden states, turned by the module's rotary.
    `norms=False` shows the module the projections without the q/k norms."""

    needs_inputs = True

    def __init__(self, norms=True):
        self.norms = norms
        self.worst = {}

    def score(self, cache):
        import torch
        from kvpress.utils import get_prerope_key_states, get_prerope_query_states
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        from kvreplay.kvpress import _Layer

        shown = {name: value for name, value in cache.projections.items() if self.norms or "norm" not in name}
        fields = ["layer", "n_heads", "n_kv_heads", "layer_keys", "hidden", "rope_theta"]
        module = _Layer(types.SimpleNamespace(projections=shown, **{f: getattr(cache, f) for f in fields}))
        hidden = torch.from_numpy(cache.hidden)[None]
        with torch.no_grad():
            pre = get_prerope_query_states(module, hidden), get_prerope_key_states(module, hidden)
            cos, sin = module.rotary_emb(hidden, torch.arange(hidden.shape[1])[None])
            turned = apply_rotary_pos_emb(*pre, cos, sin)
        for ours, stored in zip(turned, [cache.layer_queries, cache.layer_keys]):
            gap = np.abs(ours[0].numpy() - stored).max() / np.abs(stored).max()
            self.worst[cache.layer] = max(self.worst.get(cache.layer, 0.0), float(gap))
        return np.linalg.norm(cache.keys, axis=-1)


def test_the_bridge_gives_gemma_3s_queries_and_keys_through_its_qk_norms(gemma_trace):
    # Gemma 3 normalises each head's q and k after the projections: the module's q_proj and
    # k_proj carry the trace's norms, so a press reading them gets the model's queries and keys.
    probe, bare = PrerotaryProbe(), PrerotaryProbe(norms=False)
    for scorer in (probe, bare):
        kvreplay.kept(gemma_trace, budget=64, scorer=scorer, window=0, sinks=0)
    assert sorted(probe.worst) == [5, 11, 17], "the global layers (sliding ones are kept whole)"
    assert max(probe.worst.values()) < 1e-3, probe.worst
    assert min(bare.worst.values()) > 0.1, bare.worst
    print(f"\nGemma 3 through the bridge: worst |Δ| / max |x| of q and k per layer {probe.worst}; without the norms {bare.worst}")


def test_the_presses_that_read_attention_inputs_run_on_gemma_3(gemma_trace):
    presses = [PRESSES[n](PRESSES["KnormPress"]()) if n in WRAPPERS else PRESSES[n]() for n in sorted(READ_INPUTS)]
    policies = [{"scorer": PressScorer(press)} for press in presses] + [{"preset": "layer-defensivekv"}]
    mass = kvreplay.replay(gemma_trace, budget=64, policies=policies).runs["retained_mass"].to_list()
    assert all(0.0 < m <= 1.0 for m in mass), mass
    print(f"\nGemma 3, budget 64: retained mass {dict(zip([*sorted(READ_INPUTS), 'layer-defensivekv'], mass))}")
