"""The compile lock: capture and compile one at a time per process, calls of cached entries free.

A call of a cached entry takes no lock: it reads the entry list without one (an entry is appended
whole once built, and never changed after), checks the guards, reads the weights and runs the
wrapper. A call that no entry admits takes `compiling()`, looks at the entries again (another
thread may have compiled the one it needs while it waited: a size several threads need first is
compiled once) and compiles only if none admits it.

The lock is torch.compile's own (Dynamo's compile lock), so gjit's compiles and Dynamo's take
turns as well: torch.export, its fake tensor modes and shape environments, the torch settings it
patches while it traces (`torch.compiler.is_compiling()`, Dynamo's config, size-oblivious
tracing) and its tracer's patches of `nn.Module.__call__` and `__getattr__` are process-wide, so
a compile of one callable must not overlap another's, nor Dynamo tracing a torch.compile'd model
in another thread (which reads those patched methods). Compiles are Python: apart, they would
only take turns for the GIL. Re-entrant: a compile runs the model, whose forward may call
another compiled callable that compiles (a compiled model within a compiled model), or a
torch.compile'd function.

Export itself traces a copy of the module tree (gjit/capture/module_copy.py), so other threads keep
calling the model, eagerly or through its entries, while it exports.
"""

from __future__ import annotations

import os
import threading

from torch._dynamo import convert_frame

COMPILE = convert_frame.compile_lock


def compiling() -> threading.RLock:
    """The process's compile lock, to hold with `with` (see the module docstring)."""
    return COMPILE


def _after_fork_in_child() -> None:
    """A fork starts with the lock as it was, maybe held by a thread it does not have."""
    global COMPILE
    if convert_frame.compile_lock is COMPILE:
        convert_frame.compile_lock = threading.RLock()
    COMPILE = convert_frame.compile_lock


os.register_at_fork(after_in_child=_after_fork_in_child)
