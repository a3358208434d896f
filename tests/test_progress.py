"""The progress line of a long compile (gjit/progress.py): drawn on a terminal, silent otherwise.

A child process compiles a tiny GPT-2 with its stderr on a pseudo-terminal (the pty module) and
the line's threshold lowered to 0 s (GJIT_PROGRESS_AFTER): the line must show the compile's stages
rewritten in place and be cleared at the end. Piped, or with GJIT_PROGRESS=0, nothing is written.
"""

from __future__ import annotations

import io
import os
import pty
import re
import subprocess
import sys
import threading
import time

import pytest

import gjit
from gjit import config, logs, progress

pytestmark = pytest.mark.cpu

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = f"""
import sys, torch, gjit
sys.path.insert(0, {HERE!r})
import model_zoo
model, args = model_zoo.gpt2("sdpa")
with torch.no_grad():
    gjit.compile(model)(*args)
print("compiled", gjit.stats()["compiles"])
"""


STAGES = {"export", "cache", "decompose", "lower", "attention", "fuse", "statistics", "rows", "products"}
STAGES |= {"sdpa", "codegen", "wrapper", "serialize", "write", "cache_store", "guards", "first call"}


def run_child(stderr_on_terminal: bool, **env: str) -> tuple[str, str]:
    """The child's stdout and what it wrote on stderr."""
    environ = dict(os.environ, GJIT_PROGRESS_AFTER="0", GJIT_CACHE="0", **env)
    argv = [sys.executable, "-c", CHILD]
    if not stderr_on_terminal:
        proc = subprocess.run(argv, env=environ, capture_output=True, text=True, timeout=600, check=True)
        return proc.stdout, proc.stderr
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, env=environ, stdout=subprocess.PIPE, stderr=slave, text=True)
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the child closed its end
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    stdout = proc.stdout.read()
    assert proc.wait(timeout=600) == 0
    return stdout, b"".join(chunks).decode()


@pytest.mark.slow  # (CI's sweep step: a fresh process on a terminal)
def test_a_long_compile_shows_one_line_on_a_terminal_and_clears_it():
    stdout, stderr = run_child(True)
    assert "compiled 1" in stdout
    drawn = re.findall(r"\r(gjit: compiling [^\r]*?) *(?=\r)", stderr)
    assert drawn, repr(stderr[-2000:])
    assert all(d.startswith("gjit: compiling GPT2LMHeadModel.forward, ") for d in drawn), drawn
    stages = {m.group(1) for d in drawn if (m := re.search(r" s: ([\w ]+)", d))}
    assert "export" in stages and stages <= STAGES, stages
    assert "\n" not in stderr.replace("\r\n", "")  # one line, rewritten in place: never a new line
    # cleared: the last thing written blanks the line and returns to its start
    assert re.search(r"\r +\r$", stderr), repr(stderr[-200:])
    assert len(stderr.rstrip(" \r").split("\r")[-1]) > 0


@pytest.mark.slow  # CI's sweep step: 16 s of child processes
def test_nothing_is_written_when_stderr_is_piped_or_the_knob_is_off():
    stdout, stderr = run_child(False)
    assert "compiled 1" in stdout and "gjit: compiling" not in stderr and "\r" not in stderr
    stdout, stderr = run_child(True, GJIT_PROGRESS="0")
    assert "compiled 1" in stdout and stderr == ""


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_nested_and_threaded_compiles_share_one_line_with_builds_and_tuning(monkeypatch):
    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    entered, leave = threading.Event(), threading.Event()

    def other_thread_compiles():
        with progress.compiling("Other"):
            entered.set()
            leave.wait(30)

    with config.scope(progress_after=0.0):
        with progress.compiling("Outer"):
            progress.stage("export")
            with progress.compiling("Inner"):  # a compile inside the outer one: the same line
                progress.stage("codegen")
                session = progress.building(2)
                # a build's callback, in its thread
                worker = threading.Thread(target=progress.built, args=(session,))
                worker.start()
                worker.join()
                progress.tuning(1, 3)
                time.sleep(3 * progress.TICK_SECONDS)
            line = screen.getvalue().split("\r")[-1]
            other = threading.Thread(target=other_thread_compiles)
            other.start()
            assert entered.wait(30)
        time.sleep(2 * progress.TICK_SECONDS)
        kept = screen.getvalue()  # the outer compile ended while the other thread's runs
        leave.set()
        other.join()
    assert line.startswith("gjit: compiling Outer, ") and ": codegen, kernels built 1/2, tuned 1/3" in line
    assert not kept.endswith("\r") and kept.split("\r")[-1].startswith("gjit: compiling Outer")
    assert re.search(r"\r +\r$", screen.getvalue())  # cleared when the last compile ended
    assert screen.getvalue().count("gjit: compiling") == len(re.findall(r"\rgjit", screen.getvalue()))


def test_a_log_record_clears_the_line_first(monkeypatch):
    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    gjit.set_logs("passes")  # gjit's handler, on this stderr
    try:
        with config.scope(progress_after=0.0), progress.compiling("Model"):
            time.sleep(2 * progress.TICK_SECONDS)
            logs.logger("passes").info("a record")
            time.sleep(2 * progress.TICK_SECONDS)
    finally:
        gjit.set_logs()
    text = screen.getvalue()
    assert re.search(
        r"\rgjit: compiling Model[^\r]*\r +\r\[gjit.passes\] a record\n\rgjit: compiling", text
    ), text
