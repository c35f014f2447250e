"""Scorers written in Python: the examples keep what the Rust scorers keep, under every timing, in
replay and live, stateless or through the incremental protocol; bad scorers fail with a message
naming them."""

import pathlib
import runpy

import numpy as np
import pytest

import kvreplay

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples" / "python"


def example(name, cls):
    return runpy.run_path(str(EXAMPLES / f"{name}.py"))[cls]


@pytest.mark.parametrize(
    "file, cls, rust, settings",
    [
        ("snapkv", "SnapKV", "snapkv", {}),
        ("snapkv", "SnapKV", "snapkv", {"gqa": "query-head", "window": 16}),
        ("knorm", "Knorm", "knorm", {}),
        ("knorm", "Knorm", "knorm", {"heads": "adakv", "sinks": 4}),
        ("h2o", "H2O", "true-query", {"gqa": "query-head", "allocator": "pyramid"}),
    ],
)
@pytest.mark.parametrize("budget", [32, 128])
def test_examples_keep_what_rust_keeps(trace, file, cls, rust, settings, budget):
    scorer = example(file, cls)()
    ours = kvreplay.kept(trace, scorer=scorer, budget=budget, **settings)["mask"]
    theirs = kvreplay.kept(trace, scorer=rust, budget=budget, **settings)["mask"]
    assert ours.shape == theirs.shape
    assert np.array_equal(ours, theirs)


def test_reselecting_timings(trace):
    knorm = example("knorm", "Knorm")()
    for timing in ["per-step-prompt", "per-step"]:
        ours = kvreplay.kept(trace, scorer=knorm, budget=48, timing=timing, steps=True)["mask"]
        theirs = kvreplay.kept(trace, scorer="knorm", budget=48, timing=timing, steps=True)["mask"]
        assert np.array_equal(ours, theirs), timing


def test_metrics_equal_the_rust_scorers(trace):
    snapkv = example("snapkv", "SnapKV")()
    ours = kvreplay.replay(trace, scorer=snapkv, budget=64).runs
    theirs = kvreplay.replay(trace, scorer="snapkv", budget=64).runs
    assert ours["policy"][0] == "flat+snapkv-numpy@prefill"
    for metric in ["retained_mass", "topk_recall", "output_error", "mean_kept", "kv_entries"]:
        assert ours[metric][0] == theirs[metric][0], metric


def test_two_python_scorers_of_one_name_are_not_confused(trace):
    class Fixed:
        name = "fixed"

        def __init__(self, sign):
            self.sign = sign

        def score(self, cache):
            return self.sign * cache.positions.astype(np.float32)

    runs = kvreplay.replay(
        trace, budget=32, policies=[{"scorer": Fixed(1.0), "name": "late"}, {"scorer": Fixed(-1.0), "name": "early"}]
    ).runs
    recency = kvreplay.replay(trace, budget=32, scorer="recency").runs
    assert runs["retained_mass"][0] == recency["retained_mass"][0]
    assert runs["retained_mass"][1] != runs["retained_mass"][0]


def test_what_a_python_scorer_sees(trace):
    seen = []

    def record(cache):
        seen.append(cache)
        return np.zeros(len(cache.positions), dtype=np.float32)

    kvreplay.kept(trace, scorer=record, budget=64, window=4, sinks=2)
    assert len(seen) == 30 * 3
    first = seen[0]
    assert first.queries.shape == (3, trace.prompt_len, 64) and first.queries.dtype == np.float32
    assert first.keys.shape == (trace.prompt_len, 64)
    assert first.values is None
    assert first.positions.tolist() == list(range(trace.prompt_len))
    assert (first.newest, first.prompt_len, first.sinks, first.window) == (trace.prompt_len - 1, trace.prompt_len, 2, 4)
    assert (first.n_heads, first.n_kv_heads, first.layer_window, first.rope_theta) == (9, 3, 0, 100000.0)
    assert first.scale == pytest.approx(64 ** -0.5)
    layer, head = seen[-1].layer, seen[-1].kv_head
    assert np.array_equal(seen[-1].keys, trace.k(layer, dtype="float32")[head, : trace.prompt_len])


@pytest.mark.parametrize(
    "score, message",
    [
        (lambda c: np.zeros(3, dtype=np.float32), "returned 3 scores for a cache of"),
        (lambda c: np.full(len(c.positions), np.nan), "returned a non-finite score \\(NaN\\) at index 0"),
        (lambda c: np.zeros(len(c.positions), dtype=np.int64), "returned an array of dtype int64"),
        (lambda c: [0.0] * len(c.positions), "returned list"),
        (lambda c: 1 / 0, "raised ZeroDivisionError: division by zero"),
    ],
)
def test_bad_scorers_are_named(trace, score, message):
    with pytest.raises(kvreplay.KvreplayError, match=f"Python scorer `function` at layer 0, cache 0: {message}"):
        kvreplay.replay(trace, scorer=score, budget=32, threads=1)


@pytest.mark.parametrize(
    "settings",
    [
        {"timing": "streaming"},
        {"timing": "streaming", "interval": 4},
        {"timing": "prefill-then-stream", "order": "attend-first"},
        {"timing": "decoding", "interval": 3, "trigger": "steps", "budget": 560},
    ],
)
def test_a_stateless_scorer_runs_under_the_streaming_timings(trace, settings):
    knorm = example("knorm", "Knorm")()
    settings = {"budget": 64, **settings}
    ours = kvreplay.kept(trace, scorer=knorm, steps=True, **settings)["mask"]
    theirs = kvreplay.kept(trace, scorer="knorm", steps=True, **settings)["mask"]
    assert np.array_equal(ours, theirs)
    # The decoding budget is below the prompt plus the decode: its compressions evict.
    assert not ours[:, :, -1].all()


class Age:
    """The incremental protocol's bookkeeping, checked as it runs: each state counts the tokens
    that arrived after each entry it holds (from `append` and `evict` alone) and ranks the
    youngest first, which is `recency`'s ranking."""

    name = "age"
    calls = {"append": 0, "evict": 0, "score": 0}

    def start(self):
        return Age.State()

    class State:
        def __init__(self):
            self.age = {}

        def append(self, token):
            assert isinstance(token, kvreplay.Token) and token.value is None
            assert token.queries.shape == (3, 64) and token.key.shape == (64,)
            Age.calls["append"] += 1
            self.age = {p: a + 1 for p, a in self.age.items()}
            self.age[token.position] = 0

        def evict(self, positions):
            Age.calls["evict"] += 1
            for p in positions.tolist():
                del self.age[p]

        def score(self, cache):
            Age.calls["score"] += 1
            assert sorted(self.age) == cache.positions.tolist()
            return np.array([-self.age[p] for p in cache.positions.tolist()], dtype=np.float32)


@pytest.mark.parametrize("timing", ["streaming", "prefill-then-stream", "prefill", "per-step"])
def test_the_incremental_protocol(trace, timing):
    Age.calls.update(append=0, evict=0, score=0)
    ours = kvreplay.kept(trace, scorer=Age(), budget=64, steps=True, timing=timing)["mask"]
    theirs = kvreplay.kept(trace, scorer="recency", budget=64, steps=True, timing=timing)["mask"]
    assert np.array_equal(ours, theirs)
    caches = trace.n_layers * trace.n_kv_heads
    # A one-shot cut streams the prompt only and evicts nothing its state sees again; the other
    # timings stream every position.
    positions = trace.prompt_len if timing == "prefill" else len(trace.tokens)
    assert Age.calls["append"] == caches * positions
    assert Age.calls["score"] > 0 and (Age.calls["evict"] > 0) == (timing in ("streaming", "prefill-then-stream"))


def test_the_streaming_h2o_example_keeps_what_the_h2o_preset_keeps(trace):
    h2o = example("h2o_streaming", "H2OStreaming")()
    ours = kvreplay.kept(trace, scorer=h2o, preset="h2o", budget=48, steps=True)["mask"]
    theirs = kvreplay.kept(trace, preset="h2o", budget=48, steps=True)["mask"]
    assert np.array_equal(ours, theirs)


def test_a_stateful_scorer_runs_live(recipe):
    results = kvreplay.live(recipe, budget=64, timing="streaming", policies=[{"scorer": Age()}, {"scorer": "recency"}])
    runs = results.runs
    for column in ["kl", "top1", "live_retained_mass", "answer_score", "text", "retained_mass"]:
        assert runs[column][0] == runs[column][1], column


@pytest.mark.parametrize(
    "method, message",
    [
        ("append", r"append\(\) raised ValueError: no"),
        ("evict", r"evict\(\) raised ValueError: no"),
        ("score", "raised ValueError: no"),
    ],
)
def test_a_failing_state_is_named(trace, method, message):
    class Failing(Age.State):
        pass

    def fail(self, *args):
        raise ValueError("no")

    setattr(Failing, method, fail)

    class Scorer:
        def start(self):
            return Failing()

    with pytest.raises(kvreplay.KvreplayError, match=f"Python scorer `Scorer` at layer 0, cache 0: {message}"):
        kvreplay.replay(trace, scorer=Scorer(), budget=32, timing="streaming", threads=1)


def test_bad_stateful_scorers_are_named(trace):
    class Unknown:
        timings = ("eventually",)

        def score(self, cache):
            return np.zeros(len(cache.positions))

    with pytest.raises(kvreplay.KvreplayError, match="Python scorer `Unknown`: unknown timing `eventually`; valid: prefill, streaming"):
        kvreplay.replay(trace, scorer=Unknown())

    class Stateless:
        def start(self):
            return object()

    with pytest.raises(kvreplay.KvreplayError, match=r"at layer 0, cache 0: start\(\) raised TypeError: it returned a state without a `score\(cache\)` method"):
        kvreplay.replay(trace, scorer=Stateless(), budget=32, threads=1)
    with pytest.raises(kvreplay.KvreplayError, match="scorer `knorm-numpy` \\(timings: prefill\\)"):
        class OneShot:
            name = "knorm-numpy"
            timings = ("prefill",)
            score = example("knorm", "Knorm").score

        kvreplay.replay(trace, scorer=OneShot(), timing="streaming")


def test_a_scorers_defaults_apply_unless_the_call_sets_them(trace):
    class Windowless:
        defaults = {"window": 0}

        def score(self, cache):
            return -cache.positions.astype(np.float32)  # the earliest positions first

    kept = lambda **settings: kvreplay.kept(trace, budget=16, **settings)["mask"]
    first = kept(scorer=Windowless())
    assert first[..., :16].all() and not first[..., 16:].any(), "no recent window: the first 16"
    windowed = kept(scorer=Windowless(), window=8)
    assert windowed[..., :8].all() and windowed[..., -8:].all()
    assert np.array_equal(windowed, kept(scorer=Windowless(), **{"window": 8, "sinks": 0}))

    class Broken(Windowless):
        defaults = [("window", 0)]

    with pytest.raises(kvreplay.KvreplayError, match="Python scorer `Broken`: `defaults` must be a dict of policy settings"):
        kept(scorer=Broken())
    Broken.defaults = {"window": -1}
    with pytest.raises(kvreplay.KvreplayError, match="setting `window` = -1: invalid value"):
        kept(scorer=Broken())


def test_live_with_a_python_scorer(recipe):
    snapkv = example("snapkv", "SnapKV")()
    results = kvreplay.live(
        recipe, budget=64, policies=[{"scorer": snapkv}, {"scorer": "snapkv"}, {"preset": "streamingllm", "name": "sl"}]
    )
    runs = results.runs
    closed = ["kl", "top1", "live_retained_mass", "logprob_lost", "answer_ok", "answer_score",
              "full_answer_ok", "full_answer_score", "text"]
    assert runs.columns[-len(closed):] == closed
    assert runs["policy"].to_list() == ["flat+snapkv-numpy@prefill", "flat+snapkv@prefill", "sl"]
    for column in closed + ["retained_mass", "output_error"]:
        assert runs[column][0] == runs[column][1], column
    assert runs["kl"][2] != runs["kl"][1]
    # Decoded in one batch or alone: the same numbers, bit for bit.
    alone = kvreplay.live(recipe, scorer="snapkv", budget=64)
    for column in closed:
        assert alone.runs[column][0] == runs[column][1], column
    report = results.reports[2]
    assert report["policy"] == "flat+recency@streaming" and report["kl"] == runs["kl"][2]
    assert len(report["steps"]) == 8  # streaming evicts in the prompt: step 0 is compared too
    assert report["open_loop"]["retained_mass"] == runs["retained_mass"][2]


def test_a_python_allocator(trace):
    seen = []

    class Tapered:  # more tokens to the early layers, the same total
        needs_profile = True

        def allocate(self, given):
            seen.append(given)
            n, budget = given["n_layers"], given["budget"]
            return [budget + (n // 2 - layer) * 2 for layer in range(n)]

    kept = kvreplay.kept(trace, allocator=Tapered(), budget=64)
    expected = [64 + (15 - layer) * 2 for layer in range(30)]
    assert kept["budgets"] == expected
    assert kept["mask"].sum(axis=-1)[:, 0].tolist() == expected
    given = seen[0]
    assert (given["n_layers"], given["budget"], given["prompt_len"], given["window"]) == (30, 64, trace.prompt_len, 8)
    assert len(given["profiles"]) == 30 and all(p["entropy"] > 0 for p in given["profiles"])
    runs = kvreplay.replay(trace, allocator=Tapered(), scorer=example("knorm", "Knorm")(), budget=64)
    assert runs.runs["policy"][0] == "Tapered+knorm-numpy@prefill"
    assert runs.layers["budget"].to_list() == expected


class Counting:
    """Scores by key norm and counts the caches it is asked to score."""

    def __init__(self):
        self.calls = 0

    def score(self, cache):
        self.calls += 1
        return np.linalg.norm(cache.keys, axis=-1)


def test_the_global_allocators_scores_are_computed_once_for_every_budget(trace):
    # Its ranking pass scores each cache of each layer at the prompt's end; the policies of one
    # scorer at three budgets, and the measuring pass after them, take those scores.
    counting, alone = Counting(), Counting()
    policies = [{"scorer": counting, "allocator": "global", "budget": b} for b in (32, 64, 96)]
    together = kvreplay.replay(trace, policies=policies).runs
    caches = trace.n_layers * trace.n_kv_heads
    assert counting.calls == caches, (counting.calls, caches)
    single = kvreplay.replay(trace, scorer=alone, allocator="global", budget=64).runs
    assert alone.calls == caches
    assert together["retained_mass"][1] == single["retained_mass"][0]


def test_a_python_allocator_equal_to_a_registered_one(trace):
    class Flat:
        def allocate(self, given):
            return [given["budget"]] * given["n_layers"]

    ours = kvreplay.replay(trace, allocator=Flat(), preset="snapkv", budget=48).runs
    theirs = kvreplay.replay(trace, preset="snapkv", budget=48).runs
    assert ours["retained_mass"][0] == theirs["retained_mass"][0]


@pytest.mark.parametrize(
    "allocate, message",
    [
        (lambda given: [64] * 3, "returned 3 budgets for 30 layers"),
        (lambda given: [1.5] * given["n_layers"], "returned something other than a sequence of whole numbers"),
        (lambda given: {}["missing"], "raised KeyError: 'missing'"),
    ],
)
def test_bad_allocators_are_named(trace, allocate, message):
    with pytest.raises(kvreplay.KvreplayError, match=f"Python allocator `function`: {message}"):
        kvreplay.replay(trace, allocator=allocate, scorer="knorm", budget=64)


def test_several_questions_of_one_context(tmp_path):
    recipe = tmp_path / "two.toml"
    recipe.write_text('kind = "ruler-niah"\nprompt_tokens = 400\nnum_needle_k = 4\nquestions = 2\ngenerate = 8\n')
    traces = kvreplay.capture(recipe)
    assert [t.path.name for t in traces] == ["two.q1.safetensors", "two.q2.safetensors"]
    results = kvreplay.live(recipe, scorer="snapkv", budget=48, protocol="question-agnostic")
    runs = results.runs
    assert [p.split("/")[-1] for p in runs["trace"].to_list()] == ["two.q1.safetensors", "two.q2.safetensors"]
    # Each question's own full run answers it; the two ask different keys.
    assert runs["full_answer_score"].to_list() == [1.0, 1.0]
    assert results.reports[0]["full_text"] != results.reports[1]["full_text"]
    # Both traces hold the same context: their questions start at the same token.
    starts = [[start for name, start, _ in t.spans if name == "question"] for t in traces]
    assert starts[0] == starts[1] and starts[0][0] > 0


@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_each_example_runs_as_its_docstring_says(trace, script):
    # `python examples/python/X.py TRACE BUDGET`: each reports that it keeps what kvreplay's own
    # method keeps.
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(EXAMPLES / script), str(trace.path), "48"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "kept sets equal to the" in done.stdout and ": True" in done.stdout, done.stdout
