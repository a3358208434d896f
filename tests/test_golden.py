"""Golden kernels: the generated sources of tests/golden.py's programs match the checked-in files.

A failure shows the diff. If the change is on purpose, regenerate with `python tests/golden.py` and
commit the new files on their own, saying why they changed."""

import os

import pytest

from golden import BACKENDS, diff, generate, path_of
from golden_programs import PROGRAMS

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: p.name)
def test_generated_sources_match_golden(program, backend):
    path = path_of(program, backend)
    assert os.path.exists(path), f"no golden file {path}: run python tests/golden.py"
    with open(path, encoding="utf-8") as f:
        expected = f.read()
    actual = generate(program, backend)
    assert actual == expected, "generated sources differ from the golden file:\n" + diff(
        expected, actual, os.path.relpath(path)
    )


def test_every_golden_file_has_a_program():
    """A program renamed or removed leaves no stale golden file behind."""
    expected = {os.path.relpath(path_of(p, b)) for p in PROGRAMS for b in BACKENDS}
    root = os.path.dirname(path_of(PROGRAMS[0], BACKENDS[0]))
    present = {
        os.path.relpath(os.path.join(root, "..", b, f))
        for b in BACKENDS
        for f in os.listdir(os.path.join(root, "..", b))
    }
    assert present == expected
