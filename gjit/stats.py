"""Process-wide counters: `gjit.stats()` reads them, `gjit.reset()` clears them."""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Iterator

from gjit import progress

COUNTERS: collections.Counter[str] = collections.Counter()
STAGE_SECONDS: collections.Counter[str] = collections.Counter()


def snapshot() -> dict:
    counters = dict(COUNTERS)  # one C-level copy: the remote cache's writer thread adds keys
    out = {
        key: counters.get(key, 0) for key in ("compiles", "recompiles", "cache_hits", "eager_runs", "kernels")
    }
    out.update({k: v for k, v in counters.items() if k not in out})
    out["compile_seconds"] = dict(STAGE_SECONDS)
    return out


def clear() -> None:
    COUNTERS.clear()
    STAGE_SECONDS.clear()


@contextlib.contextmanager
def timed(name: str, timings: dict[str, float]) -> Iterator[None]:
    """Time a compile stage into `timings` (this compile) and STAGE_SECONDS (the process); the
    progress line (gjit/progress.py) shows it."""
    progress.stage(name)
    start = time.perf_counter()
    try:
        yield
    finally:
        elapsed = time.perf_counter() - start
        timings[name] = timings.get(name, 0.0) + elapsed
        STAGE_SECONDS[name] += elapsed
