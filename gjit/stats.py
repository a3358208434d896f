"""Process-wide counters: `gjit.stats()` reads them, `gjit.reset()` clears them."""

from __future__ import annotations

import collections

COUNTERS: collections.Counter[str] = collections.Counter()
STAGE_SECONDS: collections.Counter[str] = collections.Counter()


def snapshot() -> dict:
    out = {key: COUNTERS[key] for key in ("compiles", "recompiles", "cache_hits", "eager_runs", "kernels")}
    out.update({k: v for k, v in COUNTERS.items() if k not in out})
    out["compile_seconds"] = dict(STAGE_SECONDS)
    return out


def clear() -> None:
    COUNTERS.clear()
    STAGE_SECONDS.clear()
