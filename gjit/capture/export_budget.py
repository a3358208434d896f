"""A budget on the symbolic size reasoning of an export with dynamic dims.

torch.export with dynamic dims reasons about every size symbolically. On most models an op costs
well under a millisecond of it (a tiny Llama's whole export: 0.6 s). On some, one op's size check
takes seconds: Swin pads its feature map to a multiple of the window, then splits and merges
windows through views whose sizes are nested floor divisions and modulos, and torch checks each
view's sizes with sympy. A Swin-T at 224x224 exports in 1.2 s with static shapes and in 247 s with
dynamic image sizes.

`export_budget(seconds)` wraps such an export. A timer signal (SIGALRM) interrupts the exporting
thread every POLL seconds from GRACE seconds in, and its handler, which Python runs in that thread
between two bytecodes, reads the thread's own stack: the op being dispatched is the innermost
`__torch_dispatch__` frame, and the sample is symbolic when one of the innermost frames is sympy's
or torch's shape code. An op whose own symbolic samples add up to more than SLOW_OP seconds is the
reasoning gone nonlinear; once such ops have taken `seconds` in all, the handler raises
ExportTooSlow, and only while the thread is inside such an op's symbolic code, so the exception
lands in sympy or torch's shape code, not in torch's code that restores process-wide state.
Capture then exports again with fewer dynamic dims. Fast ops never count, nor does an op's time in
the ops it decomposes into (nn.LSTM's one lstm op traces thousands), so a model that exports
slowly because it has many ops is never interrupted. A raise that lands in a __del__ is swallowed
by Python: the handler raises again after RETRY seconds while the op is still slow.

The stack is the thread's own: a thread that walks another thread's frames can crash the process
on CPython 3.11 (the frames are popped under the walk; it crashed a CI test worker, as it crashes
profilers that sample that way). Python runs signal handlers in the main thread only, and the
timer is the process's: an export in another thread, or while the process has a SIGALRM handler
or timer of its own, has no budget (logged once). Nothing else runs in the exporting thread (a
TorchFunctionMode would: Dynamo traces modes, and torch.cond's branches go through Dynamo; Dynamo
is told to skip the handler).

ExportTooSlow is a BaseException, as KeyboardInterrupt is: torch's `except Exception` fallbacks
must not swallow it. Torch's context managers unwind as for any exception; `restore_mode_stacks`
is a safety net for a mode whose __exit__ the exception interrupted.
"""

from __future__ import annotations

import contextlib
import logging
import signal
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
# seconds before the first sample: an export done by then (nearly every one) never sees a signal.
# An op slow from the start is billed from then: the budget fires at most this much later
GRACE = 1.0
# where symbolic size reasoning runs: sympy, torch's shape environment and its sympy functions
SYMBOLIC_MODULES = ("sympy.", "torch.fx.experimental.symbolic_shapes", "torch.fx.experimental.sym_node",
                    "torch.utils._sympy.")  # fmt: skip
INNERMOST = 4  # frames at the top of the stack that decide whether a sample is symbolic
_told: set[str] = set()  # why an export had no budget, logged once each


class ExportTooSlow(BaseException):
    """The export's symbolic size reasoning ran past its budget."""


def _stack(frame: FrameType | None) -> tuple[list[int], bool]:
    """The ops in dispatch on the stack that ends in `frame` (the ids of their
    `__torch_dispatch__` frames, innermost first), and whether the stack's innermost frames are
    symbolic size reasoning. Frames are not kept: a frame kept keeps the trace's tensors alive past
    their time, and export then finds a fake tensor among its constants."""
    ops, symbolic, depth = [], False, 0
    while frame is not None:
        if depth < INNERMOST and frame.f_globals.get("__name__", "").startswith(SYMBOLIC_MODULES):
            symbolic = True
        if frame.f_code.co_name == "__torch_dispatch__":
            ops.append(id(frame))
        frame, depth = frame.f_back, depth + 1
    return ops, symbolic


class _SlowOps:
    """Seconds the exporting thread has spent in symbolic code of its own in slow ops."""

    def __init__(self) -> None:
        self.last = time.monotonic()
        self.ops: dict[int, float] = {}  # ops in dispatch (frame ids) -> their own symbolic seconds
        self.finished = 0.0  # seconds of slow ops that have returned

    def sample(self, frame: FrameType | None) -> tuple[float, bool]:
        """(seconds of slow ops so far, whether the thread is in a slow op's symbolic code now),
        from the thread's stack at `frame`."""
        ops, symbolic = _stack(frame)
        now = time.monotonic()
        # a sample a long C call delayed bills at most a few polls to the op it finds
        step, self.last = min(max(now - self.last, 0.0), 4 * POLL), now
        live = set(ops)
        for op in [op for op in self.ops if op not in live]:  # returned since the last sample
            spent = self.ops.pop(op)
            self.finished += spent if spent > SLOW_OP else 0.0
        innermost = ops[0] if ops else None
        if innermost is not None:
            self.ops[innermost] = self.ops.get(innermost, 0.0) + (step if symbolic else 0.0)
        total = self.finished + sum(t for t in self.ops.values() if t > SLOW_OP)
        return total, symbolic and innermost is not None and self.ops[innermost] > SLOW_OP


def no_timer() -> str | None:
    """Why this thread cannot time an export with SIGALRM, or None when it can."""
    if not hasattr(signal, "setitimer"):
        return "the platform has no interval timer"
    if threading.current_thread() is not threading.main_thread():
        return "Python runs signal handlers in the main thread only, and this export is in another"
    if signal.getsignal(signal.SIGALRM) not in (signal.SIG_DFL, signal.SIG_IGN):
        return "the process has a SIGALRM handler of its own"
    if signal.getitimer(signal.ITIMER_REAL) != (0.0, 0.0):
        return "the process has a timer (ITIMER_REAL) of its own"
    return None


@contextlib.contextmanager
def export_budget(seconds: float) -> Iterator[None]:
    """Raise ExportTooSlow in this thread once the export inside has spent `seconds` in slow
    ops' symbolic code (0 or less: no budget)."""
    if seconds <= 0:
        yield
        return
    why = no_timer()
    if why is not None:
        if why not in _told:
            _told.add(why)
            log.info("exports with dynamic dims have no time budget here: %s", why)
        yield
        return
    slow = _SlowOps()
    fired: list[float] = []  # when the handler raised
    busy: list[bool] = []  # a handler running: Python may call it again inside itself

    def on_alarm(signum: int, frame: FrameType | None) -> None:
        if busy:
            return
        busy.append(True)
        try:
            total, in_slow_op = slow.sample(frame)
        finally:
            busy.clear()
        if total > seconds and in_slow_op and (not fired or time.monotonic() - fired[-1] >= RETRY):
            fired.append(time.monotonic())
            raise ExportTooSlow

    stacks = mode_stacks()
    previous = signal.getsignal(signal.SIGALRM)
    try:
        signal.signal(signal.SIGALRM, torch._dynamo.disable(on_alarm))
        signal.siginterrupt(signal.SIGALRM, False)  # a system call the signal interrupts resumes
        slow.last = time.monotonic() + GRACE
        signal.setitimer(signal.ITIMER_REAL, GRACE, POLL)
        yield
    except BaseException as e:
        _stop(previous)
        if fired or isinstance(e, ExportTooSlow):  # another exception may carry it (a __del__'s)
            restore_mode_stacks(stacks)
        if fired and isinstance(e, Exception):  # a KeyboardInterrupt stays one
            raise ExportTooSlow from e  # the budget ran out; what it interrupted failed otherwise
        raise
    else:
        _stop(previous)


def _stop(previous: signal.Handlers) -> None:
    """The timer off, then the handler the process had back. A raise the handler makes meanwhile
    is dropped (the export finished, or is already being interrupted); none is made outside
    symbolic code, where this runs."""
    while True:
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            return
        except ExportTooSlow:
            continue


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
