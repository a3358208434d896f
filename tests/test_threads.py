"""Threads that use gjit at once, as a server's workers do.

The threads of every test meet at a barrier, so they really collide.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

import gjit

pytestmark = pytest.mark.cpu


def run_threads(count: int, work: Callable[[int], Any], timeout: float = 300.0) -> list[Any]:
    """Run work(0) ... work(count - 1) on their own threads, under torch.no_grad(); each thread's
    result or exception."""
    results: list[Any] = [None] * count

    def run(i: int) -> None:
        try:
            with torch.no_grad():  # grad mode is per thread
                results[i] = work(i)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,), name=f"worker-{i}") for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), f"{t.name} did not finish in {timeout} s"
    return results


def test_counters_from_threads_add_up():
    """gjit.stats() counts every count of every thread: a Counter shared by threads loses the ones
    whose key two threads create at once (Counter.__missing__ is Python, where a thread switches)."""
    import importlib
    import sys

    stats = importlib.import_module("gjit.stats")  # (`from gjit import stats` is gjit.stats())
    barrier = threading.Barrier(8)

    def work(i: int) -> None:
        barrier.wait()
        for k in range(5000):
            stats.count(f"recompile_reason:{k}")

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        results = run_threads(8, work)
    finally:
        sys.setswitchinterval(interval)
    assert results == [None] * 8, results
    counts = gjit.stats()
    assert sum(v for k, v in counts.items() if k.startswith("recompile_reason:")) == 8 * 5000
