"""kvreplay from Python: replay captured attention traces through KV-cache eviction policies.

Everything here is the Rust library behind the ``kvreplay`` command line, reached through one
binding layer: the same settings by the same names, checked by the same code, with the same
error messages (raised as :class:`KvreplayError`).

>>> import kvreplay
>>> trace = kvreplay.Trace("traces/niah-2k.safetensors")
>>> kvreplay.replay(trace, preset="snapkv", budget=128).runs   # a polars DataFrame
"""

from ._native import (
    Cache,
    KvreplayError,
    Page,
    Results,
    Token,
    Trace,
    capture,
    compare,
    kept,
    live,
    methods,
    replay,
    report,
    sweep,
    view,
)

__all__ = [
    "Cache",
    "KvreplayError",
    "Page",
    "Results",
    "Token",
    "Trace",
    "capture",
    "compare",
    "kept",
    "live",
    "methods",
    "replay",
    "report",
    "sweep",
    "view",
]
