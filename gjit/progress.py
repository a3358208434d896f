"""One line of progress on stderr while a long compile runs, drawn as tqdm draws one.

A compile that has run for `gjit.config.progress_after` seconds (3) shows, when stderr is a
terminal and `gjit.config.progress` is on (GJIT_PROGRESS=0 turns it off), one line rewritten in
place a few times a second, cleared when the compile ends:

    gjit: compiling GPT2LMHeadModel, 12 s: codegen, kernels built 41/68, tuned 3/10

Nothing otherwise: not a terminal (a pipe, a file, pytest's capture), the knob off, or a compile
shorter than that. The compile's stages say where it is (`stage`: every stage the driver times,
through `stats.timed`), the kernel builds how many are done (`building`, `built`: from any thread,
as the workers finish; one an earlier compile started is not counted), tuning how far it is
(`tuning`). A thread draws the line (so a long stage, export, shows too), under one lock with
everything else here. One line per process: a compile inside another, or in another thread, shares
the line, which goes when the last ends.
gjit's log handler clears it before a record (the next tick draws it again), so logs read as ever.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

from gjit.config import config

TICK_SECONDS = 0.25


class _Line:
    """The process's progress line: what it says, and whether and how wide it is on screen."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.depth = 0  # compiles running (nested, or in other threads)
        self.label = ""
        self.start = 0.0
        self.stage = ""
        self.built = self.builds = 0
        self.tuned = self.tunings = 0
        # the compiles the counts are of (one more each time a first one starts): a build started
        # under another, earlier one (a torch.cond branch not taken, a choice tuning dropped) and
        # ending now is not counted
        self.session = 0
        self.stream: TextIO | None = None  # stderr when it is a terminal and the knob is on
        self.drawn = 0  # characters of the line on screen (0: none)
        self.stop: threading.Event | None = None  # the drawing thread's, while one runs

    def text(self) -> str:
        parts = [f"gjit: compiling {self.label}, {time.monotonic() - self.start:.0f} s"]
        if self.stage:
            parts[0] += f": {self.stage}"
        if self.builds:
            parts.append(f"kernels built {self.built}/{self.builds}")
        if self.tunings:
            parts.append(f"tuned {self.tuned}/{self.tunings}")
        return ", ".join(parts)

    def draw(self) -> None:
        if self.stream is None or time.monotonic() - self.start < config.progress_after:
            return
        width = shutil.get_terminal_size((80, 24)).columns - 1  # a wrapped line cannot be rewritten
        text = self.text()[:width]
        self._write("\r" + text + " " * max(0, self.drawn - len(text)))
        self.drawn = len(text)

    def clear(self) -> None:
        if self.drawn and self.stream is not None:
            self._write("\r" + " " * self.drawn + "\r")
        self.drawn = 0

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed or broken stderr: no more progress
            self.stream = None


_LINE = _Line()


def _after_fork_in_child() -> None:
    """A forked process (a build worker) starts with no compile and no drawing thread."""
    global _LINE
    _LINE = _Line()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _terminal() -> TextIO | None:
    stream = sys.stderr
    try:
        return stream if config.progress and stream is not None and stream.isatty() else None
    except (AttributeError, ValueError):  # a replaced or closed stderr
        return None


@contextlib.contextmanager
def compiling(label: str) -> Iterator[None]:
    """A compile of `label` runs in this block (the outermost one names the line)."""
    line = _LINE
    with line.lock:
        line.depth += 1
        if line.depth == 1:
            line.session += 1
            line.label, line.start, line.stage = label, time.monotonic(), ""
            line.built = line.builds = line.tuned = line.tunings = 0
            line.stream = _terminal()
            if line.stream is not None:
                line.stop = threading.Event()
                threading.Thread(
                    target=_tick, args=(line, line.stop), name="gjit-progress", daemon=True
                ).start()
    try:
        yield
    finally:
        with line.lock:
            line.depth -= 1
            if line.depth == 0:
                if line.stop is not None:
                    line.stop.set()
                    line.stop = None
                line.clear()


def _tick(line: _Line, stop: threading.Event) -> None:
    while not stop.wait(TICK_SECONDS):
        with line.lock:
            if not stop.is_set():
                line.draw()


def stage(name: str) -> None:
    """The running compile entered stage `name` (export, decompose, codegen, ...)."""
    with _LINE.lock:
        if _LINE.depth:
            _LINE.stage = name


def building(kernels: int) -> int:
    """`kernels` more kernel builds started; what to hand `built` when each ends."""
    with _LINE.lock:
        if _LINE.depth:
            _LINE.builds += kernels
        return _LINE.session


def built(session: int) -> None:
    """A kernel build started in `session` (`building`'s) finished (any thread)."""
    with _LINE.lock:
        if _LINE.depth and session == _LINE.session:
            _LINE.built += 1


def tuning(done: int, total: int) -> None:
    """Tuning measured `done` of `total` kernels."""
    with _LINE.lock:
        if _LINE.depth:
            _LINE.tuned, _LINE.tunings = done, total


def clear_line() -> None:
    """Off the screen before other output on stderr (a log record); the next tick draws it again."""
    with _LINE.lock:
        _LINE.clear()
