"""gjit: a kernel-generating JIT for PyTorch programs captured with torch.export.

cm = gjit.compile(model)      # or @gjit.compile on a function
out = cm(x, y)
print(gjit.explain(cm, x, y)) # kernels, externs, guards
gjit.stats(); gjit.reset()
"""

from gjit import api as _api
from gjit import stats as _stats
from gjit.api import CompiledFunction, Report, compile, explain
from gjit.config import config

__version__ = "0.1.0"


def stats() -> dict:
    """Counters: compiles (recompiles included), recompiles, cache_hits, eager_runs, kernels, stage times."""
    return _stats.snapshot()


def reset() -> None:
    """Forget every compiled entry (of every live compiled callable) and every counter."""
    for cm in list(_api.LIVE):
        cm.reset()
    _stats.clear()


__all__ = ["CompiledFunction", "Report", "compile", "config", "explain", "reset", "stats"]
