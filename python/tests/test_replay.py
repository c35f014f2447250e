"""Replays from Python equal the command line's, take its settings by the same names and fail
with its messages."""

import _thread
import json
import signal
import threading
import time

import numpy as np
import polars as pl
import pytest

import kvreplay
from conftest import run_cli

METRICS = ["retained_mass", "topk_recall", "output_error", "value_weighted_mass", "value_gap"]


def test_compare_equals_the_command_line(cli, trace, trace_path):
    results = kvreplay.compare(trace, budget=64, presets=["snapkv", "tova", "streamingllm"])
    code, out, err = run_cli(
        cli, "compare", trace_path, "--budget", 64, "--presets", "snapkv,tova,streamingllm",
        "--format", "json", "--no-layers",
    )
    assert code == 0, err
    expected = json.loads(out)
    runs = results.runs
    assert runs["policy"].to_list() == [r["policy"] for r in expected]
    for metric in METRICS:
        assert runs[metric].to_list() == [r[metric] for r in expected], metric
    assert runs["mean_kept"].to_list() == [r["mean_kept"] for r in expected]
    assert runs["kv_entries"].to_list() == [r["kv_entries"] for r in expected]


def test_compare_leaves_out_and_names_what_the_trace_cannot_run(trace):
    # The session's trace has no attention inputs, which DefensiveKV reads: every other preset
    # runs, and a warning says which one was left out and how to capture what it needs.
    with pytest.warns(UserWarning, match=r"left out `defensivekv`.*--attention-inputs"):
        runs = kvreplay.compare(trace, budget=64).runs
    names = [name.split(" (")[0] for name in runs["policy"].to_list()]
    assert names[0] == "snapkv" and "snapkv-d" in names and names[-1] == "oracle", names
    assert "defensivekv" not in names
    with pytest.raises(kvreplay.KvreplayError, match="scorer `defensivekv`.*--attention-inputs"):
        kvreplay.compare(trace, budget=64, presets=["defensivekv"])


def test_settings_by_the_command_lines_names(cli, trace, trace_path):
    ours = kvreplay.replay(trace, scorer="snapkv", budget=48, window=4, kernel=5, pool="max", gqa="query-head")
    code, out, err = run_cli(
        cli, "replay", trace_path, "--scorer", "snapkv", "--budget", 48, "--window", 4,
        "--kernel", 5, "--pool", "max", "--gqa", "query-head", "--format", "json", "--no-layers",
    )
    assert code == 0, err
    expected = json.loads(out)
    expected = expected[0] if isinstance(expected, list) else expected
    row = ours.runs.row(0, named=True)
    assert row["policy"] == expected["policy"] == "flat+snapkv@prefill"
    for metric in METRICS:
        assert row[metric] == expected[metric], metric


def test_a_setting_qualified_by_its_axis_is_a_keyword(cli, trace, trace_path):
    # Two chosen methods declare `threshold`: each gets its own, spelled `axis.key`.
    apart = {"scorer.threshold": 0.7, "heads.threshold": -1.0}
    ours = kvreplay.replay(trace, scorer="rkv", heads="threshold", budget=48, **apart)
    code, out, err = run_cli(
        cli, "replay", trace_path, "--scorer", "rkv", "--heads", "threshold", "--budget", 48,
        "--scorer.threshold", 0.7, "--heads.threshold", -1.0, "--format", "json", "--no-layers",
    )
    assert code == 0, err
    expected = json.loads(out)
    expected = expected[0] if isinstance(expected, list) else expected
    row = ours.runs.row(0, named=True)
    for metric in METRICS:
        assert row[metric] == expected[metric], metric


def test_a_quantized_cache_equals_the_command_line_and_reports_its_bytes(cli, trace, trace_path):
    settings = dict(scorer="snapkv", budget=64, quantizer="kivi", bits=4, residual=32, interval=1)
    ours = kvreplay.replay(trace, **settings).runs.row(0, named=True)
    code, out, err = run_cli(
        cli, "replay", trace_path, "--scorer", "snapkv", "--budget", 64, "--quantizer", "kivi",
        "--bits", 4, "--residual", 32, "--format", "json", "--no-layers",
    )
    assert code == 0, err
    expected = json.loads(out)
    expected = expected[0] if isinstance(expected, list) else expected
    assert ours["policy"] == expected["policy"] == "flat+snapkv@prefill kivi 4-bit"
    for metric in METRICS:
        assert ours[metric] == expected[metric], metric
    assert ours["kv_bytes"] == expected["kv_bytes"]
    plain = kvreplay.replay(trace, scorer="snapkv", budget=64).runs.row(0, named=True)
    assert ours["kv_bytes"] < plain["kv_bytes"]
    assert ours["output_error"] > plain["output_error"]
    # A budget in bytes: the same memory buys more tokens from the quantized cache.
    at_eighth = kvreplay.replay(trace, policies=[{}, {"quantizer": "kivi", "bits": 4, "residual": 32}], bytes="1/8").runs
    code, out, err = run_cli(cli, "replay", trace_path, "--bytes", "1/8", "--format", "json", "--no-layers")
    assert code == 0, err
    expected = json.loads(out)
    expected = expected[0] if isinstance(expected, list) else expected
    assert at_eighth["budget"][0] == expected["nominal_budget"]
    assert at_eighth["budget"][1] > at_eighth["budget"][0]
    # `compare` sets the same over every preset.
    compared = kvreplay.compare(trace, presets=["snapkv", "tova"], bytes="1/8", quantizer="kivi", bits=4, residual=32).runs
    assert compared["policy"][1] == "tova (flat+tova@prefill-then-stream kivi 4-bit at 0.125 of the bytes)"
    assert compared["budget"].to_list() == [at_eighth["budget"][1]] * 2


def test_several_policies_in_one_pass(trace):
    results = kvreplay.replay(
        trace,
        budget=64,
        policies=[{"preset": "snapkv", "name": "snap"}, {"scorer": "knorm"}, {"preset": "h2o", "budget": 32}],
    )
    runs = results.runs
    assert runs["policy"].to_list() == ["snap", "flat+knorm@prefill", "flat+true-query@prefill-then-stream"]
    assert runs["budget"].to_list() == [64, 64, 32]
    alone = kvreplay.replay(trace, preset="snapkv", budget=64).runs
    assert runs["retained_mass"][0] == alone["retained_mass"][0]


def test_layer_and_sample_frames(trace):
    results = kvreplay.replay(trace, preset="snapkv", budget=64)
    layers, samples = results.layers, results.samples
    assert layers.height == trace.n_layers
    assert layers["retained_mass"].mean() == pytest.approx(results.runs["retained_mass"][0], rel=1e-12)
    steps = trace.n_positions - trace.prompt_len
    assert samples.height == trace.n_layers * trace.n_heads * steps
    per_layer = samples.group_by("layer").agg(pl.col("retained_mass").mean()).sort("layer")
    assert per_layer["retained_mass"].to_list() == pytest.approx(layers["retained_mass"].to_list(), rel=1e-12)
    # Bytes per layer: the layers' mean is the run's (every layer global here).
    assert layers["kv_bytes"].mean() == pytest.approx(results.runs["kv_bytes"][0], rel=1e-12)


def test_one_top_k_over_every_layer_gives_layers_totals(trace):
    kept = kvreplay.kept(trace, budget=64, scorer="knorm", allocator="global", heads="adakv", alpha=0.0, normalize=False)
    totals, caches = kept["totals"], kept["mask"].shape[1]
    assert sum(totals) == 30 * caches * 64 and len(set(totals)) > 1
    assert kept["mask"].sum(axis=(1, 2)).tolist() == totals
    assert kept["budgets"] == [total // caches for total in totals]


def test_kept_masks(trace):
    kept = kvreplay.kept(trace, preset="snapkv", budget=64)
    mask = kept["mask"]
    assert mask.shape == (30, 9, trace.prompt_len)  # snapkv's preset keeps one set per query head
    assert kept["layers"] == list(range(30)) and kept["budgets"] == [64] * 30 and kept["totals"] == [9 * 64] * 30
    assert (mask.sum(axis=-1) == 64).all()
    assert mask[:, :, -8:].all()  # the observation window is protected
    streaming = kvreplay.kept(trace, preset="streamingllm", budget=32, steps=True)["mask"]
    steps = trace.n_positions - trace.prompt_len
    assert streaming.shape == (30, 3, steps, trace.n_positions)
    for step in range(steps):
        now = trace.prompt_len + step
        kept_now = streaming[0, 0, step]
        # attend-first: the step's query sees the 32 kept tokens and itself, 4 sinks + 29 recent
        assert kept_now[:4].all() and kept_now[now - 28 : now + 1].all()
        assert kept_now.sum() == 33


@pytest.mark.parametrize(
    "settings, flags",
    [
        ({"scorer": "nope"}, ["--scorer", "nope"]),
        ({"scorer": "knorm", "kernel": 3}, ["--scorer", "knorm", "--kernel", "3"]),
        ({"budget": 4, "window": 8}, ["--budget", "4", "--window", "8"]),
        ({"scorer": "snapkv", "timing": "streaming"}, ["--scorer", "snapkv", "--timing", "streaming"]),
        ({"scorer": "snapkv", "kernel": 4}, ["--scorer", "snapkv", "--kernel", "4"]),
        (
            {"scorer": "rkv", "heads": "threshold", "threshold": 0.7},
            ["--scorer", "rkv", "--heads", "threshold", "--threshold", "0.7"],
        ),
    ],
)
def test_errors_carry_the_command_lines_message(cli, trace, trace_path, settings, flags):
    code, _, err = run_cli(cli, "replay", trace_path, *flags)
    assert code == 2
    with pytest.raises(kvreplay.KvreplayError) as raised:
        kvreplay.replay(trace, **settings)
    assert err.strip() == f"error: {raised.value}"


def test_unknown_preset_and_bad_value(trace):
    with pytest.raises(kvreplay.KvreplayError, match="unknown preset `nope`; valid: snapkv"):
        kvreplay.replay(trace, preset="nope")
    with pytest.raises(kvreplay.KvreplayError, match="setting `window` = \\[1\\]"):
        kvreplay.replay(trace, window=[1])


def test_the_gil_is_released_while_rust_works(trace):
    done = threading.Event()
    worker = threading.Thread(target=lambda: (kvreplay.compare(trace, budget=64, presets=["oracle", "quest"]), done.set()))
    worker.start()
    spins = 0
    while not done.is_set() and worker.is_alive():
        spins += 1
    worker.join()
    assert done.is_set()
    assert spins > 1000, f"the main thread ran {spins} times while the replay ran"


def test_ctrl_c_stops_a_replay(trace):
    calls = []

    def slow(cache):  # 0.05 s a call, 90 caches x 8 steps: a minute if nothing stopped it
        calls.append(cache.layer)
        time.sleep(0.05)
        return np.zeros(len(cache.positions), dtype=np.float32)

    # The handler this relies on: a suite started with SIGINT ignored (a background job, nohup)
    # has none, and interrupt_main would then do nothing.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.5, _thread.interrupt_main)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            kvreplay.replay(trace, scorer=slow, timing="per-step-prompt", budget=64)
    finally:
        timer.join()
        signal.signal(signal.SIGINT, previous)
    assert len(calls) < 30 * 3 * 8 / 2, f"{len(calls)} scorer calls before it stopped"
    # The interpreter and the trace are fine afterwards.
    assert kvreplay.replay(trace, scorer="knorm", budget=64).runs.height == 1


def test_ctrl_c_stops_a_capture(tmp_path):
    # A ~3,000-token prompt prefilled 16 tokens at a time: many seconds if nothing stopped it.
    recipe = tmp_path / "long.toml"
    recipe.write_text('kind = "niah"\nprompt_tokens = 3000\ndepth_percent = 50.0\nneedle = "The code is 1234."\nquestion = "What is the code?"\ngenerate = 8\n')
    out = tmp_path / "long.safetensors"
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(1.0, _thread.interrupt_main)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            kvreplay.capture(recipe, out=out, chunk=16)
    finally:
        timer.join()
        signal.signal(signal.SIGINT, previous)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["long.toml"]  # nothing written, nothing half-written


def test_ctrl_c_stops_a_live_run(tmp_path):
    # The full run of a ~3,000-token prompt prefilled 16 tokens at a time, then the policy's.
    recipe = tmp_path / "long.toml"
    recipe.write_text('kind = "niah"\nprompt_tokens = 3000\ndepth_percent = 50.0\nneedle = "The code is 1234."\nquestion = "What is the code?"\ngenerate = 8\n')
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(1.0, _thread.interrupt_main)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            kvreplay.live(recipe, chunk=16, scorer="knorm", budget=128)
    finally:
        timer.join()
        signal.signal(signal.SIGINT, previous)
