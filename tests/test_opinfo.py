"""torch's OpInfo database through gjit (tests/opinfo.py): every sample of an op compiled, run
through the generated kernels and compared with eager; no sample may be wrong or crash.

Every tenth op of op_db (sorted by name) runs in the default suite, in float32, float16 and
bfloat16 (the low-precision ones against a float64 reference); the other ops are marked `opinfo`
and run when GJIT_TEST_OPINFO=1 (CI's own step). The kernel rate per op family:

    .venv/bin/python tests/opinfo.py --report docs/opinfo.md
"""

from __future__ import annotations

import pytest
import torch

import opinfo

pytestmark = [pytest.mark.cpu, pytest.mark.filterwarnings("ignore")]

OPS = opinfo.op_db()
QUICK = {opinfo.op_name(op) for op in OPS[::10]}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def params(quick: bool) -> list:
    return [
        pytest.param(op, dtype, id=f"{opinfo.op_name(op)}-{str(dtype).removeprefix('torch.')}")
        for op in OPS
        if (opinfo.op_name(op) in QUICK) == quick
        for dtype in DTYPES
    ]


def check_op(op, dtype: torch.dtype) -> None:
    outcome = opinfo.run_op(op, dtype)
    assert outcome.kind not in ("wrong", "crash"), f"{outcome.op} [{dtype}]: {outcome.kind}: {outcome.detail}"


@pytest.mark.parametrize("op, dtype", params(quick=True))
def test_opinfo_subset_matches_eager(op, dtype):
    check_op(op, dtype)


@pytest.mark.opinfo
@pytest.mark.parametrize("op, dtype", params(quick=False))
def test_opinfo_matches_eager(op, dtype):
    check_op(op, dtype)
