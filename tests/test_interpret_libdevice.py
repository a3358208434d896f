"""The interpreter's stand-ins for libdevice (codegen/interpret.py) are as precise as libdevice:
each function used by the lowerings, through a compiled kernel, against a float64 reference."""

import pytest
import torch

from gjit.codegen import interpret
from helpers import run_compiled

pytestmark = pytest.mark.cpu

CASES = {
    "tanh": (torch.tanh, (-12, 12)),
    "expm1": (torch.expm1, (-5, 5)),
    "log1p": (torch.log1p, (-0.9, 50)),
    "log10": (torch.log10, (1e-3, 1e4)),
    "rsqrt": (torch.rsqrt, (1e-3, 1e4)),
    "tan": (torch.tan, (-1.5, 1.5)),
    "sinh": (torch.sinh, (-8, 8)),
    "cosh": (torch.cosh, (-8, 8)),
    "asin": (torch.asin, (-0.99, 0.99)),
    "acos": (torch.acos, (-0.99, 0.99)),
    "atan": (torch.atan, (-50, 50)),
    "asinh": (torch.asinh, (-50, 50)),
    "erfinv": (torch.erfinv, (-0.99, 0.99)),
    "trunc": (torch.trunc, (-50, 50)),
    # the exponent as float32 holds it, so the reference differs from the kernel only in the pow
    "pow": (lambda x: torch.pow(x, torch.tensor(2.7).item()), (1e-3, 20)),
    "atan2": (lambda x: torch.atan2(x, x.flip(0)), (-5, 5)),
}


@pytest.mark.parametrize("name", list(CASES), ids=list(CASES))
def test_stand_in_precision(name):
    fn, (lo, hi) = CASES[name]
    x = torch.linspace(lo, hi, 2001, dtype=torch.float32)
    x = x[(x != 0) | (lo > 0)]
    out, _ = run_compiled(fn, x)
    reference = fn(x.double())
    err = (out.double() - reference).abs()
    # within ~2 ulp of float32 (relative 2.4e-7) plus a tiny absolute term near zero
    assert (err <= 2.4e-7 * reference.abs() + 1e-30).all(), float(err.max())


def test_unknown_symbol_is_named():
    with pytest.raises(NotImplementedError, match="__nv_frobnicatef"):
        interpret._lookup("__nv_frobnicatef", float32=True)
