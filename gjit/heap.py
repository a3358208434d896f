"""Full garbage collections deferred while gjit compiles.

A compile allocates hundreds of thousands of objects that live past it (FX nodes, fake tensors,
sympy expressions, the loop IR), so CPython's generational collector runs full (generation 2)
collections in the middle of it, each walking the whole heap: torch's modules and everything the
user's program holds. On the tiny Llama that is one collection of about 250 ms, a fifth of the
compile. While a compile runs, the generation-2 threshold is raised; generations 0 and 1 still
collect and refcounting still frees, so only cyclic garbage that reached generation 2 waits.
Afterwards the old threshold is back and the next full collection comes when CPython would have
run it anyway: deferred, not skipped (torch.compile's Dynamo does the same around its compiles).

Reentrant and thread-safe: nested or concurrent compiles share one adjustment, undone by the
last to finish, and only if nobody changed the thresholds meanwhile. A disabled collector, or a
generation-0 threshold of 0, is left alone.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

DEFERRED_THRESHOLD = 1_000_000  # generation-1 collections before a full one: none within a compile

_lock = threading.Lock()
_depth = 0
_saved: tuple[int, ...] | None = None  # the thresholds to restore; None: nothing was changed


@contextlib.contextmanager
def deferred_full_collections() -> Iterator[None]:
    """Run the body with generation-2 collections deferred (see the module docstring)."""
    global _depth, _saved
    with _lock:
        if _depth == 0:
            thresholds = gc.get_threshold()
            if gc.isenabled() and thresholds[0] > 0 and thresholds[2] < DEFERRED_THRESHOLD:
                _saved = thresholds
                gc.set_threshold(thresholds[0], thresholds[1], DEFERRED_THRESHOLD)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _saved is not None:
                if gc.get_threshold() == (_saved[0], _saved[1], DEFERRED_THRESHOLD):
                    gc.set_threshold(*_saved)
                _saved = None
