"""Sweeps and reports from Python: the runs they return are the runs.parquet they write."""

import polars as pl
import pytest

import kvreplay


@pytest.fixture
def experiment(tmp_path, trace_path):
    path = tmp_path / "tiny.toml"
    path.write_text(
        f"""
description = "two policies at two budgets"
traces = ["{trace_path}"]
budgets = [32, 64]

[[policy]]
name = "snapkv"
preset = "snapkv"

[[policy]]
name = "knorm"
scorer = "knorm"
sinks = [0, 4]
"""
    )
    return path


def test_sweep_returns_what_it_stores(tmp_path, experiment):
    results = kvreplay.sweep(experiment, results=tmp_path / "results")
    assert len(results) == 6
    stored = pl.read_parquet(tmp_path / "results" / "tiny" / "runs.parquet")
    assert results.runs.equals(stored)
    assert results.runs["policy"].to_list() == [
        "snapkv", "snapkv", "knorm sinks=0", "knorm sinks=0", "knorm sinks=4", "knorm sinks=4"
    ]
    assert "| snapkv" in results.report
    again = kvreplay.report(experiment, results=tmp_path / "results")
    assert again.runs.equals(stored) and again.report == results.report
    assert results.samples.height > 0 and results.layers.height == 6 * 30


def test_experiment_errors_carry_the_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('traces = ["x.safetensors"]\nbudgets = [8]\n[[policy]]\nname = "a"\nwindoww = 3\n')
    with pytest.raises(kvreplay.KvreplayError, match="bad.toml: policy `a`: unknown key `windoww`"):
        kvreplay.sweep(bad, results=tmp_path / "results")
