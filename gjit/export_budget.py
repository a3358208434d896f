"""A budget on the symbolic size reasoning of an export with dynamic dims.

torch.export with dynamic dims reasons about every size symbolically. On most models an op costs
well under a millisecond of it (a tiny Llama's whole export: 0.6 s). On some, one op's size check
takes seconds: Swin pads its feature map to a multiple of the window, then splits and merges
windows through views whose sizes are nested floor divisions and modulos, and torch checks each
view's sizes with sympy. A Swin-T at 224x224 exports in 1.2 s with static shapes and in 247 s with
dynamic image sizes.

`export_budget(seconds)` wraps such an export. A watchdog thread samples the exporting thread's
Python stack every POLL seconds and finds the op being dispatched (the outermost
`__torch_dispatch__` frame, fake tensors' or the tracer's): an op still in dispatch after
SLOW_CALL seconds is the symbolic reasoning gone nonlinear. Once such ops have taken `seconds` in
all, the watchdog raises ExportTooSlow in the exporting thread at its next Python bytecode (in
sympy or torch's shape code), and capture exports again with fewer dynamic dims. Fast ops never
count, so a large model that exports slowly because it has many ops is never interrupted. Nothing
runs in the exporting thread itself (a TorchFunctionMode would: Dynamo traces modes, and
torch.cond's branches go through Dynamo).

ExportTooSlow is a BaseException, as KeyboardInterrupt is: torch's `except Exception` fallbacks
must not swallow it. Torch's context managers unwind as for any exception; `restore_mode_stacks`
is a safety net for a mode whose __exit__ the exception interrupted.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType

import torch

log = logging.getLogger("gjit.capture")

# an op of a fake-tensor trace still in dispatch after this many seconds is symbolic size reasoning
SLOW_CALL = 0.5
POLL = 0.05


class ExportTooSlow(BaseException):
    """The export's symbolic size reasoning ran past its budget."""


def _op_in_dispatch(frame: FrameType | None) -> FrameType | None:
    """The outermost `__torch_dispatch__` frame of a stack: the op being dispatched."""
    found = None
    while frame is not None:
        if frame.f_code.co_name == "__torch_dispatch__":
            found = frame
        frame = frame.f_back
    return found


class _SlowOps:
    """Seconds the sampled thread has spent in ops that were slow (longer than SLOW_CALL)."""

    def __init__(self, thread_id: int) -> None:
        self.thread_id = thread_id
        self.op: FrameType | None = None  # the op in dispatch at the last sample
        self.since = 0.0
        self.finished = 0.0  # seconds of slow ops that have returned

    def sample(self) -> float:
        frame = sys._current_frames().get(self.thread_id)
        op = _op_in_dispatch(frame)
        del frame
        now = time.monotonic()
        if op is not self.op:
            if self.op is not None and now - self.since > SLOW_CALL:
                self.finished += now - self.since
            self.op, self.since = op, now
        current = now - self.since if self.op is not None else 0.0
        return self.finished + (current if current > SLOW_CALL else 0.0)


def _raise_in(thread_id: int, exc: type[BaseException] | None) -> None:
    """Schedule `exc` in that thread at its next bytecode (None: cancel one not raised yet)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc is not None else None
    )


@contextlib.contextmanager
def export_budget(seconds: float) -> Iterator[None]:
    """Raise ExportTooSlow in this thread once the export inside has spent `seconds` in slow
    ops (0 or less: no budget)."""
    if seconds <= 0:
        yield
        return
    target = threading.get_ident()
    slow = _SlowOps(target)
    lock = threading.Lock()
    state = {"active": True, "fired": False}
    done = threading.Event()

    def watch() -> None:
        while not done.wait(POLL):
            if slow.sample() > seconds:
                with lock:
                    if state["active"]:
                        state["fired"] = True
                        _raise_in(target, ExportTooSlow)
                break
        slow.op = None  # no frame of the export kept alive

    watcher = threading.Thread(target=watch, name="gjit-export-budget", daemon=True)
    stacks = mode_stacks()
    watcher.start()
    try:
        yield
    except ExportTooSlow:
        restore_mode_stacks(stacks)
        raise
    finally:
        with lock:
            state["active"] = False
            if state["fired"]:  # raised already, or cancelled here: the export finished first
                _raise_in(target, None)
        done.set()


def mode_stacks() -> tuple[int, int, dict]:
    """The lengths of torch's function and dispatch mode stacks, and its infra dispatch modes."""
    keys = list(torch._C._TorchDispatchModeKey.__members__.values())
    return (
        torch._C._len_torch_function_stack(),
        torch._C._len_torch_dispatch_stack(),
        {k: torch._C._get_dispatch_mode(k) for k in keys},
    )


def restore_mode_stacks(before: tuple[int, int, dict]) -> None:
    """Pop what an interrupted export left on torch's mode stacks (an __exit__ the exception cut
    short), so that later torch calls in this process run as they did before."""
    functions, dispatches, infra = before
    left = []
    while torch._C._len_torch_function_stack() > functions:
        left.append(type(torch._C._pop_torch_function_stack()).__name__)
    for key, mode in infra.items():  # infra modes (fake, proxy) count in the dispatch stack's length
        now = torch._C._get_dispatch_mode(key)
        if now is not mode:
            left.append(type(now).__name__)
            torch._C._unset_dispatch_mode(key)
            if mode is not None:
                torch._C._set_dispatch_mode(mode)
    while torch._C._len_torch_dispatch_stack() > dispatches:
        left.append(type(torch._C._pop_torch_dispatch_stack()).__name__)
    if left:
        log.warning("the interrupted export left torch modes behind; removed: %s", ", ".join(left))
