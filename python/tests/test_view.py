"""`kvreplay.view`: the page `kvreplay view` writes, from Python; its data holds the kept sets
`kvreplay.kept` gives, and the prompt's text where the model that made the trace is fetched."""

import base64
import json

import numpy as np
import pytest

import kvreplay


def data(page):
    """The JSON a page draws."""
    start = page.html.index('<script type="application/json" id="view-data">')
    start = page.html.index(">", start) + 1
    return json.loads(page.html[start : page.html.index("</script>", start)].replace("<\\/", "</"))


def cells(policy, bins):
    """A policy's kept cells, `[steps, layers, caches, bins]`, as 0/1 or fractions."""
    raw = np.frombuffer(base64.b64decode(policy["kept"]), dtype=np.uint8)
    shape = (policy["steps"], len(policy["layers"]), policy["caches"], bins["count"])
    if policy["packed"]:
        return np.unpackbits(raw, bitorder="little")[: np.prod(shape)].reshape(shape)
    return raw.reshape(shape) / 255


def test_a_page_holds_what_kept_gives(trace, tmp_path):
    page = kvreplay.view(trace, preset="snapkv", budget=64, compare={"preset": "h2o", "budget": 64})
    assert page._repr_html_() == page.html
    page.save(tmp_path / "view.html")
    assert (tmp_path / "view.html").read_text() == page.html
    shown = data(page)
    assert shown["bins"] == {"size": 1, "count": trace.prompt_len}
    assert [p["steps"] for p in shown["policies"]] == [1, trace.n_positions - trace.prompt_len]
    kept = kvreplay.kept(trace, preset="snapkv", budget=64)["mask"]
    assert np.array_equal(cells(shown["policies"][0], shown["bins"])[0], kept)
    streamed = kvreplay.kept(trace, preset="h2o", budget=64, steps=True)["mask"][..., : trace.prompt_len]
    assert np.array_equal(cells(shown["policies"][1], shown["bins"]), streamed.transpose(2, 0, 1, 3))
    # The prompt's text, one entry a position (SmolLM2's tokenizer, read from the fetched GGUF).
    assert "Dolores Park" in "".join(shown["texts"])
    assert len(shown["mass"]) == trace.n_layers
    assert 0.0 < sum(shown["mass"][0]) <= 1.0


def test_a_page_of_a_policy_the_trace_cannot_run_is_an_error(trace):
    with pytest.raises(kvreplay.KvreplayError, match="unknown scorer `knorms`"):
        kvreplay.view(trace, scorer="knorms")


def test_results_plot_draws_the_standard_figures(trace):
    import matplotlib
    matplotlib.use("Agg")
    results = kvreplay.replay(trace, policies=[{"preset": p, "budget": b} for p in ("snapkv", "pyramidkv") for b in (32, 64)])
    mass, schedule = results.plot()
    lines = {line.get_label(): line for line in mass.axes[0].get_lines()}
    runs = results.runs
    for policy, line in lines.items():
        mine = runs.filter(runs["policy"] == policy).sort("budget")
        assert list(line.get_xdata()) == mine["budget"].to_list()
        assert list(line.get_ydata()) == mine["retained_mass"].to_list()
    assert len(lines) == 2
    pyramid = [line for line in schedule.axes[0].get_lines() if "pyramid" in line.get_label()][0]
    assert len(set(pyramid.get_ydata())) > 1, "PyramidKV's budgets fall with depth"
