"""The standard figures of a set of runs with matplotlib (imported only when asked for), as a
report draws them, from `Results.runs` and `Results.layers`."""


def standard(runs, layers):
    """Two matplotlib Figures: the mean retained mass against the budget, one line per policy
    (mean over the runs' traces), and the tokens each layer's caches get at the largest budget,
    one line per policy (mean over traces)."""
    import matplotlib.pyplot as plt
    import polars as pl

    mass, axes = plt.subplots(figsize=(7, 4.5))
    for (policy,), group in runs.group_by("policy", maintain_order=True):
        points = group.group_by("budget").agg(pl.col("retained_mass").mean()).sort("budget")
        axes.plot(points["budget"].to_list(), points["retained_mass"].to_list(), marker="o", label=policy)
    axes.set_xscale("log", base=2)
    axes.set(xlabel="budget (tokens per cache)", ylabel="mean retained mass", title="retained attention mass")
    axes.legend(fontsize=8)

    largest = runs["budget"].max()
    at_largest = layers.filter(pl.col("id").is_in(runs.filter(pl.col("budget") == largest)["id"].to_list()))
    schedule, axes = plt.subplots(figsize=(7, 4.5))
    for (policy,), group in at_largest.group_by("policy", maintain_order=True):
        points = group.group_by("layer").agg(pl.col("budget").mean()).sort("layer")
        axes.plot(points["layer"].to_list(), points["budget"].to_list(), label=policy)
    axes.set(xlabel="layer", ylabel="tokens per cache", title=f"budget per layer at {largest}")
    axes.legend(fontsize=8)
    return [mass, schedule]
