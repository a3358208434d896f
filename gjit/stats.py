"""Process-wide counters: `gjit.stats()` reads them, `gjit.reset()` clears them.

Each thread counts into its own tally (a `Counter +=` shared by threads loses updates: the read
and the write are separate steps, and another thread may count in between), and a snapshot adds
the tallies up. Counting takes no lock: a cached call counts its hit on every call.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
import weakref
from collections.abc import Iterator

from gjit import progress


class _Tally:
    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.seconds: collections.Counter[str] = collections.Counter()
        self.thread = weakref.ref(threading.current_thread())


_lock = threading.Lock()  # the list of tallies, and the folding of ended threads' tallies
_tallies: list[_Tally] = []
_ended = _Tally()  # what threads that have ended counted
_local = threading.local()


def _mine() -> _Tally:
    tally = getattr(_local, "tally", None)
    if tally is None:
        tally = _local.tally = _Tally()
        with _lock:
            _tallies.append(tally)
            if len(_tallies) > 2 * threading.active_count() + 8:  # threads come and go: fold the ended
                _fold_ended()
    return tally


def _fold_ended() -> None:
    for tally in [t for t in _tallies if t.thread() is None or not t.thread().is_alive()]:
        _tallies.remove(tally)
        _ended.counts.update(dict(tally.counts))
        _ended.seconds.update(dict(tally.seconds))


def count(key: str, n: int = 1) -> None:
    """Add `n` to the counter `key` (this thread's tally)."""
    try:
        _local.tally.counts[key] += n
    except AttributeError:
        _mine().counts[key] += n


def add_seconds(stage: str, seconds: float) -> None:
    _mine().seconds[stage] += seconds


def totals() -> tuple[collections.Counter[str], collections.Counter[str]]:
    """(counters, stage seconds) of every thread."""
    counts, seconds = collections.Counter(), collections.Counter()
    with _lock:
        for tally in [_ended, *_tallies]:
            counts.update(dict(tally.counts))  # one C-level copy: the owner may be counting
            seconds.update(dict(tally.seconds))
    return counts, seconds


def snapshot() -> dict:
    counters, seconds = totals()
    out = {
        key: counters.get(key, 0) for key in ("compiles", "recompiles", "cache_hits", "eager_runs", "kernels")
    }
    out.update({k: v for k, v in counters.items() if k not in out})
    out["compile_seconds"] = dict(seconds)
    return out


def clear() -> None:
    """Zero every tally (a count another thread makes meanwhile may survive)."""
    with _lock:
        for tally in [_ended, *_tallies]:
            tally.counts.clear()
            tally.seconds.clear()


@contextlib.contextmanager
def timed(name: str, timings: dict[str, float]) -> Iterator[None]:
    """Time a compile stage into `timings` (this compile) and the process's stage seconds; the
    progress line (gjit/progress.py) shows it."""
    progress.stage(name)
    start = time.perf_counter()
    try:
        yield
    finally:
        elapsed = time.perf_counter() - start
        timings[name] = timings.get(name, 0.0) + elapsed
        add_seconds(name, elapsed)
