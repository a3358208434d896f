"""gjit: a kernel-generating JIT for PyTorch programs captured with torch.export.

cm = gjit.compile(model)      # or @gjit.compile on a function
out = cm(x, y)
print(gjit.explain(cm, x, y)) # kernels, externs, guards
gjit.mark_dynamic(x, 0, min=2, max=64)  # before the first call: dim 0 of x dynamic in [2, 64]
gjit.stats(); gjit.reset()
gjit.save(cm, "model.gjit"); fn = gjit.load("model.gjit", model=model)  # no export in a new process
"""

from gjit import api as _api
from gjit import logs as _logs
from gjit import stats as _stats
from gjit.aot import aot
from gjit.api import CompiledFunction, RecompileError, compile, explain
from gjit.config import config
from gjit.debug.report import Report
from gjit.guards import mark_dynamic
from gjit.logs import set_logs
from gjit.packaging import load, save
from gjit.runtime import tuning_store as _tuning_store
from gjit.runtime.package import PackageError

__version__ = "0.1.0"


def stats() -> dict:
    """Counters: compiles (recompiles included), recompiles, cache_hits, eager_runs, kernels, stage times."""
    return _stats.snapshot()


def reset() -> None:
    """Forget every compiled entry (of every live compiled callable), the tuning records held in
    memory (those on disk stay) and every counter."""
    with _api.LIVE_LOCK:
        live = list(_api.LIVE)
    for cm in live:
        cm.reset()
    _tuning_store.forget()
    _stats.clear()


__all__ = [
    "CompiledFunction",
    "PackageError",
    "RecompileError",
    "Report",
    "aot",
    "compile",
    "config",
    "explain",
    "load",
    "mark_dynamic",
    "reset",
    "save",
    "set_logs",
    "stats",
]

_logs.init_from_env()
