"""Knorm in NumPy: keep the keys of smallest L2 norm.

Devoto et al., 2024 (arXiv:2406.11430; kvpress's `KnormPress` scores `-keys.norm(dim=-1)`), as
kvreplay's `knorm` scorer computes it. Keys only, so it serves every timing a Python scorer can.
Run: python examples/python/knorm.py TRACE [BUDGET]
"""

import sys

import numpy as np

import kvreplay


class Knorm:
    name = "knorm-numpy"

    def score(self, cache):
        keys = cache.keys[cache.positions]
        return -np.sqrt(np.einsum("pd,pd->p", keys, keys))


if __name__ == "__main__":
    trace, budget = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 128
    ours = kvreplay.kept(trace, scorer=Knorm(), budget=budget)["mask"]
    rust = kvreplay.kept(trace, scorer="knorm", budget=budget)["mask"]
    print(f"kept sets equal to the Rust scorer's: {np.array_equal(ours, rust)}")
    print(kvreplay.replay(trace, scorer=Knorm(), budget=budget).runs)
