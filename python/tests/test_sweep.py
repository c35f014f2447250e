"""Sweeps and reports from Python: the runs they return are the runs.parquet they write."""

import pathlib
import runpy

import polars as pl
import pytest

import kvreplay

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples" / "python"


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


def python_experiment(tmp_path, trace_path):
    path = tmp_path / "python.toml"
    path.write_text(
        f"""
traces = ["{trace_path}"]
budgets = [32, 64]

[[policy]]
name = "numpy"
scorer = "my-snapkv"

[[policy]]
name = "rust"
scorer = "snapkv"

[[policy]]
name = "flat in python"
scorer = "knorm"
allocator = "my-flat"
"""
    )
    return path


class Flat:
    def allocate(self, given):
        return [given["budget"]] * given["n_layers"]


def test_sweeps_run_python_methods(tmp_path, trace_path):
    snapkv = runpy.run_path(str(EXAMPLES / "snapkv.py"))["SnapKV"]()
    experiment = python_experiment(tmp_path, trace_path)
    methods = {"my-snapkv": snapkv, "my-flat": Flat()}
    results = kvreplay.sweep(experiment, results=tmp_path / "results", methods=methods)
    runs = results.runs
    assert runs["policy"].to_list() == ["numpy", "numpy", "rust", "rust", "flat in python", "flat in python"]
    assert runs["retained_mass"][0:2].to_list() == runs["retained_mass"][2:4].to_list()
    knorm = kvreplay.replay(trace_path, scorer="knorm", budget=32).runs
    assert runs["retained_mass"][4] == knorm["retained_mass"][0]
    again = kvreplay.report(experiment, results=tmp_path / "results", methods=methods)
    assert again.runs.equals(runs)
    with pytest.raises(kvreplay.KvreplayError, match="unknown scorer `my-snapkv`"):
        kvreplay.report(experiment, results=tmp_path / "results")

    class SnapKV(type(snapkv)):  # other code under the same name: other runs
        kernel_note = "changed"

    other = kvreplay.sweep(experiment, results=tmp_path / "results", methods={**methods, "my-snapkv": SnapKV()})
    assert other.runs["id"][0] != runs["id"][0] and other.runs["id"][2] == runs["id"][2]
    assert other.runs["retained_mass"][0] == runs["retained_mass"][0]


def test_sweeps_run_stateful_python_scorers(tmp_path, trace_path):
    # H2O through the incremental protocol, as its generation code runs it: the h2o preset's runs.
    h2o = runpy.run_path(str(EXAMPLES / "h2o_streaming.py"))["H2OStreaming"]()
    experiment = tmp_path / "stateful.toml"
    experiment.write_text(
        f"""
traces = ["{trace_path}"]
budgets = [48]

[[policy]]
name = "numpy"
preset = "h2o"
scorer = "my-h2o"

[[policy]]
name = "rust"
preset = "h2o"
"""
    )
    runs = kvreplay.sweep(experiment, results=tmp_path / "results", methods={"my-h2o": h2o}).runs
    for metric in ["retained_mass", "topk_recall", "output_error", "kv_entries"]:
        assert runs[metric][0] == runs[metric][1], metric


def test_a_failing_python_method_fails_alone(tmp_path, trace_path):
    experiment = python_experiment(tmp_path, trace_path)
    broken = {"my-snapkv": lambda cache: 1 / 0, "my-flat": Flat()}
    raised = "2 of 6 runs failed .* policy `numpy` .* Python scorer `function` at layer 0, cache 0: raised ZeroDivisionError"
    with pytest.raises(kvreplay.KvreplayError, match=raised):
        kvreplay.sweep(experiment, results=tmp_path / "results", methods=broken)
    runs = tmp_path / "results" / "python"
    assert list((runs / "runs").glob("numpy*.json")) == []
    assert len(list((runs / "runs").glob("*.json"))) == 4
    errors = sorted((runs / "failed").glob("*.txt"))
    assert [e.name.split("-")[0] for e in errors] == ["numpy", "numpy"]
    assert "raised ZeroDivisionError" in errors[0].read_text()
