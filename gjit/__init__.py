"""gjit: a kernel-generating JIT for PyTorch programs captured with torch.export.

cm = gjit.compile(model)      # or @gjit.compile on a function
out = cm(x, y)
print(gjit.explain(cm, x, y)) # kernels, externs, guards
gjit.stats(); gjit.reset()
"""

from gjit import stats as _stats
from gjit.api import CompiledFunction, Report, compile, explain
from gjit.config import config

__version__ = "0.1.0"


def stats() -> dict:
    """Counters: compiles (recompiles included), recompiles, cache_hits, eager_runs, kernels, stage times."""
    return _stats.snapshot()


def reset() -> None:
    """Forget every compiled entry's counters. Compiled callables made before keep their entries
    only if still referenced; new `gjit.compile` calls start empty."""
    _stats.clear()


__all__ = ["CompiledFunction", "Report", "compile", "config", "explain", "reset", "stats"]
