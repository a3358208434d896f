"""A budget on the symbolic size reasoning of an export with dynamic dims.

torch.export with dynamic dims reasons about every size symbolically. On most models an op costs
well under a millisecond of it (a tiny Llama's whole export: 0.6 s). On some, one op's size check
takes seconds: Swin pads its feature map to a multiple of the window, then splits and merges
windows through views whose sizes are nested floor divisions and modulos, and torch checks each
view's sizes with sympy. A Swin-T at 224x224 exports in 1.2 s with static shapes and in 247 s with
dynamic image sizes.

`export_budget(seconds)` wraps such an export. A watchdog thread samples the exporting thread's
Python stack every POLL seconds from GRACE seconds in: the op being dispatched is the innermost
`__torch_dispatch__` frame, and the sample is symbolic when one of the innermost frames is sympy's
or torch's shape code. An op whose own symbolic samples add up to more than SLOW_OP seconds is the
reasoning gone nonlinear; once such ops have taken `seconds` in all, the watchdog raises ExportTooSlow in the
exporting thread, and only while it is inside such an op's symbolic code, so the exception lands
in sympy or torch's shape code (almost always: it arrives at the thread's next check for one),
not in torch's code that restores process-wide state. Capture then exports again
with fewer dynamic dims. Fast ops never count, nor does an op's time in the ops it decomposes into
(nn.LSTM's one lstm op traces thousands), so a model that exports slowly because it has many ops
is never interrupted. A raise that lands in a __del__ is swallowed by Python: the watchdog raises
again after RETRY seconds while the op is still slow. Nothing runs in the exporting thread itself
(a TorchFunctionMode would: Dynamo traces modes, and torch.cond's branches go through Dynamo).

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

# an op of a fake-tensor trace with this many seconds of its own in symbolic code is slow
SLOW_OP = 0.5
POLL = 0.05
RETRY = 1.0  # seconds before raising again in an op the first raise did not leave
# seconds before the first sample: an export done by then (nearly every one) is never sampled.
# CPython 3.11's sys._current_frames() can crash the process (a segfault in CI, in the
# watchdog's sample, while a test exported); the fewer samples, the fewer chances. An op slow
# from the start is billed from then: the budget fires at most this much later
GRACE = 1.0
# where symbolic size reasoning runs: sympy, torch's shape environment and its sympy functions
SYMBOLIC_MODULES = ("sympy.", "torch.fx.experimental.symbolic_shapes", "torch.fx.experimental.sym_node",
                    "torch.utils._sympy.")  # fmt: skip
INNERMOST = 4  # frames at the top of the stack that decide whether a sample is symbolic


class ExportTooSlow(BaseException):
    """The export's symbolic size reasoning ran past its budget."""


def _stack(frame: FrameType | None) -> tuple[list[int], bool]:
    """The ops in dispatch on a stack (the ids of their `__torch_dispatch__` frames, innermost
    first), and whether the stack's innermost frames are symbolic size reasoning. Frames are
    not kept: a frame the watchdog holds keeps the trace's tensors alive past their time, and
    export then finds a fake tensor among its constants."""
    ops, symbolic, depth = [], False, 0
    # another thread's stack changes while it is read: a frame's f_back can be popped and its
    # memory reused (a `cell` was seen there in CI); the walk stops at anything not a frame
    while isinstance(frame, FrameType):
        if depth < INNERMOST and frame.f_globals.get("__name__", "").startswith(SYMBOLIC_MODULES):
            symbolic = True
        if frame.f_code.co_name == "__torch_dispatch__":
            ops.append(id(frame))
        frame, depth = frame.f_back, depth + 1
    return ops, symbolic


class _SlowOps:
    """Seconds the sampled thread has spent in symbolic code of its own in slow ops."""

    def __init__(self, thread_id: int) -> None:
        self.thread_id = thread_id
        self.last = time.monotonic()
        self.ops: dict[int, float] = {}  # ops in dispatch (frame ids) -> their own symbolic seconds
        self.finished = 0.0  # seconds of slow ops that have returned

    def sample(self) -> tuple[float, bool]:
        """(seconds of slow ops so far, whether the thread is in a slow op's symbolic code now)."""
        try:
            ops, symbolic = _stack(sys._current_frames().get(self.thread_id))
        except Exception:  # noqa: BLE001 - the stack changed under the walk: this sample is skipped
            return self.finished + sum(t for t in self.ops.values() if t > SLOW_OP), False
        now = time.monotonic()
        # a sample the GIL delayed (a long C call) bills at most a few polls to the op it finds
        step, self.last = min(now - self.last, 4 * POLL), now
        live = set(ops)
        for op in [op for op in self.ops if op not in live]:  # returned since the last sample
            spent = self.ops.pop(op)
            self.finished += spent if spent > SLOW_OP else 0.0
        innermost = ops[0] if ops else None
        if innermost is not None:
            self.ops[innermost] = self.ops.get(innermost, 0.0) + (step if symbolic else 0.0)
        total = self.finished + sum(t for t in self.ops.values() if t > SLOW_OP)
        return total, symbolic and innermost is not None and self.ops[innermost] > SLOW_OP


def _raise_in(thread_id: int, exc: type[BaseException] | None) -> None:
    """Schedule `exc` in that thread at its next bytecode (None: cancel one not raised yet)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc is not None else None
    )


@contextlib.contextmanager
def export_budget(seconds: float) -> Iterator[None]:
    """Raise ExportTooSlow in this thread once the export inside has spent `seconds` in slow
    ops' symbolic code (0 or less: no budget)."""
    if seconds <= 0:
        yield
        return
    target = threading.get_ident()
    slow = _SlowOps(target)
    done = threading.Event()

    fired: list[float] = []  # when the watchdog raised

    def watch() -> None:
        if done.wait(GRACE):
            return
        slow.last = time.monotonic()
        while not done.wait(POLL):
            total, in_slow_op = slow.sample()
            if total > seconds and in_slow_op and (not fired or time.monotonic() - fired[-1] >= RETRY):
                _raise_in(target, ExportTooSlow)
                fired.append(time.monotonic())

    def stop() -> None:
        """Stop the watchdog, then cancel a raise it made that has not landed yet; one that
        lands meanwhile is dropped (the export finished, or is already being interrupted)."""
        while True:
            try:
                done.set()
                watcher.join()
                _raise_in(target, None)
                return
            except ExportTooSlow:
                continue

    watcher = threading.Thread(target=watch, name="gjit-export-budget", daemon=True)
    stacks = mode_stacks()
    watcher.start()
    try:
        yield
    except BaseException as e:
        stop()
        if fired or isinstance(e, ExportTooSlow):  # another exception may carry it (a __del__'s)
            restore_mode_stacks(stacks)
        if fired and isinstance(e, Exception):  # a KeyboardInterrupt stays one
            raise ExportTooSlow from e  # the budget ran out; what it interrupted failed otherwise
        raise
    else:
        stop()


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
            left.append(f"{key.name}: {type(now).__name__ if now is not None else 'none'}")
            torch._C._unset_dispatch_mode(key)
            if mode is not None:
                torch._C._set_dispatch_mode(mode)
    while torch._C._len_torch_dispatch_stack() > dispatches:
        left.append(type(torch._C._pop_torch_dispatch_stack()).__name__)
    if left:
        log.warning("the interrupted export left torch modes behind; removed: %s", ", ".join(left))
