"""A trace from Python: its header, and q, k, v as NumPy views of the mapped file."""

import numpy as np
import pytest

import kvreplay


def resident_kb():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def test_header(trace):
    assert trace.model.startswith("SmolLM2-135M-Instruct")
    assert (trace.n_layers, trace.n_heads, trace.n_kv_heads, trace.head_dim) == (30, 9, 3, 64)
    assert trace.n_positions == trace.prompt_len + 8
    assert 590 <= trace.prompt_len <= 610
    assert trace.dtype == "F16"
    assert trace.layer_windows == [0] * 30
    assert trace.global_layers == list(range(30))
    assert trace.rope_thetas == [100000.0] * 30
    names = [name for name, _, _ in trace.spans]
    assert "needle" in names and "question" in names
    start, end = next((s, e) for name, s, e in trace.spans if name == "needle")
    assert 0 < start < end <= trace.prompt_len
    assert "San Francisco" in trace.text
    assert trace.tokens.dtype == np.int64 and trace.tokens.shape == (trace.n_positions,)
    assert trace.meta["format"] == "kvtrace/1"


def test_tensors_view_the_file(trace):
    k = trace.k(3)
    assert k.dtype == np.float16 and k.shape == (3, trace.n_positions, 64)
    assert not k.flags.owndata and not k.flags.writeable
    assert isinstance(k.base, kvreplay.Trace)
    wide = trace.k(3, dtype="float32")
    assert wide.dtype == np.float32 and np.array_equal(wide, k.astype(np.float32))
    assert trace.q(0).shape == (9, trace.n_positions, 64)
    assert trace.v(29).shape == (3, trace.n_positions, 64)
    # The views outlive every other reference to the trace.
    alone = kvreplay.Trace(trace.path).q(1)
    assert np.isfinite(alone.astype(np.float32)).all()


def test_opening_maps_without_reading(trace_path):
    before = resident_kb()
    opened = kvreplay.Trace(trace_path)
    views = [opened.q(layer) for layer in range(opened.n_layers)]
    grown = resident_kb() - before
    assert grown < 10 * 1024, f"opening and viewing grew the resident set by {grown} kB"
    assert sum(v.nbytes for v in views) > 10 * 1024 * 1024


def test_bad_trace_and_layer(tmp_path, trace):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a trace")
    with pytest.raises(kvreplay.KvreplayError, match="bad.safetensors"):
        kvreplay.Trace(bad)
    with pytest.raises(kvreplay.KvreplayError, match="layer 30"):
        trace.k(30)


def test_a_trace_of_arrays_replays_as_its_file(trace):
    layers = range(trace.n_layers)
    arrays = kvreplay.Trace.from_arrays(
        [trace.q(layer) for layer in layers],
        [trace.k(layer) for layer in layers],
        [trace.v(layer) for layer in layers],
        prompt_len=trace.prompt_len,
        tokens=trace.tokens.tolist(),
        model=trace.model,
        scale=trace.scale,
        rope_theta=trace.rope_thetas[0],
        dtype=trace.dtype.lower(),
    )
    assert str(arrays.path) == "<arrays>"
    assert (arrays.n_layers, arrays.n_positions, arrays.prompt_len) == (
        trace.n_layers,
        trace.n_positions,
        trace.prompt_len,
    )
    assert np.array_equal(arrays.k(3), trace.k(3))
    ours = kvreplay.replay(arrays, scorer="snapkv", budget=48).runs.row(0, named=True)
    theirs = kvreplay.replay(trace, scorer="snapkv", budget=48).runs.row(0, named=True)
    for metric in ["retained_mass", "topk_recall", "output_error", "value_weighted_mass"]:
        assert ours[metric] == theirs[metric], metric


def test_arrays_that_are_not_a_trace_say_which(trace):
    q, k = [trace.q(0), trace.q(1)], [trace.k(0), trace.k(1)[:, :5]]
    with pytest.raises(kvreplay.KvreplayError, match=r"<arrays>: .*layers\.1\.k has shape"):
        kvreplay.Trace.from_arrays(q, k, prompt_len=trace.prompt_len)
    with pytest.raises(kvreplay.KvreplayError, match=r"k\[0\]: must be a 3-D array"):
        kvreplay.Trace.from_arrays(q, [trace.k(0)[0]], prompt_len=trace.prompt_len)
    with pytest.raises(kvreplay.KvreplayError, match="dtype `f64`: valid: f16, bf16, f32"):
        kvreplay.Trace.from_arrays(q, k, prompt_len=trace.prompt_len, dtype="f64")
