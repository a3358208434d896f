"""What a test run runs (tests/conftest.py): the tests it does not run are deselected, not skipped,
so its summary counts what ran; the steps that run them (CI's OpInfo and sweep steps, `-m gpu` on
a GPU) still do; a run that asks for tests it cannot run here reports them skipped, with why."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.cpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def collect(*args: str, **env: str) -> tuple[int, int]:
    """(tests collected, tests deselected) of `pytest --collect-only` with `args`."""
    environ = {k: v for k, v in os.environ.items() if k not in ("GJIT_TEST_SLOW", "GJIT_TEST_OPINFO")}
    argv = [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", *args]
    out = subprocess.run(argv, cwd=ROOT, env=environ | env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    last = out.stdout.strip().splitlines()[-1]
    match = re.search(r"(\d+)(?:/(\d+))? tests? collected(?: \((\d+) deselected\))?", last)
    assert match, last
    return int(match.group(1)), int(match.group(3) or 0)


@pytest.mark.slow  # CI's sweep step: 42 s of pytest processes in the default run's 15 minutes
def test_the_long_steps_are_deselected_unless_their_variable_is_set():
    collected, deselected = collect("tests/test_llm.py")
    assert deselected >= 1 and collect("tests/test_llm.py", GJIT_TEST_SLOW="1") == (collected + deselected, 0)
    default, left_out = collect("tests/test_opinfo.py")  # all of OpInfo: CI's own step runs it
    assert default >= 1 and left_out > 1000


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_gpu_tests_are_deselected_without_a_gpu_but_skipped_when_asked_for():
    _, deselected = collect("tests/test_prebuild.py", GJIT_TEST_SLOW="1")  # (its slow tests run: gpu's alone)
    assert deselected >= 1
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        "gpu",
        "tests/test_prebuild.py",
    ]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    # -m gpu asks for them: reported skipped, with why
    assert f"{deselected} skipped" in out.stdout and "needs a CUDA device" in out.stdout, out.stdout[-1000:]
