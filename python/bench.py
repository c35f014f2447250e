"""Side-by-side speed of the Python package, in one process on one trace:

1. the binding's overhead: `kvreplay.compare` from Python against the `kvreplay compare` command
   line (same presets, same build), wall time of each and the ratio;
2. a scorer written in NumPy (examples/python/snapkv.py) against the Rust `snapkv` scorer at the
   same settings, wall time of each and the ratio.

Usage: python python/bench.py TRACE [KVREPLAY_BINARY] [REPEATS]
"""

import pathlib
import runpy
import subprocess
import sys
import time

import numpy as np

import kvreplay

ROOT = pathlib.Path(__file__).resolve().parents[1]


def best_of(repeats, work):
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return min(times)


def main():
    trace_path = sys.argv[1]
    binary = sys.argv[2] if len(sys.argv) > 2 else "kvreplay"
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    trace = kvreplay.Trace(trace_path)
    trace.k(0).astype(np.float32)  # the file in the page cache for both sides
    presets = "snapkv,h2o,tova"
    cli = best_of(repeats, lambda: subprocess.run(
        [binary, "compare", trace_path, "--budget", "128", "--presets", presets, "--format", "json"],
        check=True, capture_output=True,
    ))
    python = best_of(repeats, lambda: kvreplay.compare(trace, budget=128, presets=presets.split(",")).runs)
    snapkv = runpy.run_path(str(ROOT / "examples" / "python" / "snapkv.py"))["SnapKV"]()
    rust = best_of(repeats, lambda: kvreplay.replay(trace, scorer="snapkv", budget=128))
    numpy = best_of(repeats, lambda: kvreplay.replay(trace, scorer=snapkv, budget=128))
    rows = [
        ("compare snapkv,h2o,tova at 128: command line", cli, 1.0),
        ("compare snapkv,h2o,tova at 128: from Python", python, python / cli),
        ("replay snapkv at 128: Rust scorer", rust, 1.0),
        ("replay snapkv at 128: NumPy scorer (examples/python/snapkv.py)", numpy, numpy / rust),
    ]
    print(f"{trace_path}, best of {repeats}\n")
    print("| run | wall (s) | ratio |\n|---|---|---|")
    for name, seconds, ratio in rows:
        print(f"| {name} | {seconds:.2f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
