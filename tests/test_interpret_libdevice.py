"""The interpreter's stand-ins for libdevice (gjit/runtime/interpret.py) are as precise as libdevice:
every symbol the lowerings emit, through a compiled kernel that calls it, against a float64
reference, over the op's domain and its extremes (signed zeros, infinities, NaN, domain edges,
values past float32's range)."""

from __future__ import annotations

import contextlib
import inspect
import math
import re
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

import gjit
from gjit.codegen.triton.pointwise import TritonOverrides
from gjit.runtime import interpret
from helpers import run_compiled

# NaN/Inf inputs make the interpreter's numpy math warn (overflow, invalid value): intended here
pytestmark = [pytest.mark.cpu, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

NAN, INF = math.nan, math.inf
# everywhere: signed zeros, infinities, NaN, the smallest normal/subnormal float32, the largest
EXTREMES = [0.0, -0.0, INF, -INF, NAN, 1.2e-38, -1.2e-38, 1e-45, 3.4e38, -3.4e38]
REL = 2.4e-7  # ~2 ulp of float32
ABS = 1e-38  # below float32's smallest normal: subnormal results round coarser than REL


def _mpmath(fn):
    """A float64 reference from mpmath (torch's float64 Bessel functions lose up to 1e-5 near
    their zeros); +-inf and complex values give NaN, as eager's do."""

    def value(v: float) -> float:
        if math.isinf(v):
            return math.nan
        r = complex(fn(v))
        return r.real if r.imag == 0 else math.nan

    def reference(x: torch.Tensor) -> torch.Tensor:
        return torch.tensor([value(v) for v in x.tolist()], dtype=torch.float64)

    return reference


def _bessel(kind: str, order: int):
    import mpmath

    exact = getattr(mpmath, kind)
    return _mpmath(lambda v: exact(order, v) if v == v else math.nan)


# libdevice symbol -> (fn, domain [lo, hi], values to add: domain edges and just past them[,
# the float64 reference when it is not fn itself])
UNARY = {
    "tan": (torch.tan, (-1.57, 1.57), [1.5707963, -1.5707963, 100.0, 1e4]),
    "tanh": (torch.tanh, (-12, 12), [20.0, -20.0, 1e-20]),
    "sinh": (torch.sinh, (-89, 89), [89.5, -89.5, 100.0, 1e-20]),
    "cosh": (torch.cosh, (-89, 89), [89.5, -89.5, 100.0]),
    "asin": (torch.asin, (-1, 1), [1.0, -1.0, 1.0000001, -1.5]),
    "acos": (torch.acos, (-1, 1), [1.0, -1.0, 1.0000001, -1.5]),
    "atan": (torch.atan, (-50, 50), [1e10, -1e10]),
    "asinh": (torch.asinh, (-50, 50), [1e20, -1e20]),
    "acosh": (torch.acosh, (1, 50), [1.0, 0.99, 1e20]),
    "atanh": (torch.atanh, (-1, 1), [1.0, -1.0, 0.9999999, 1.5]),
    "erfinv": (torch.erfinv, (-1, 1), [1.0, -1.0, 0.9999999, -0.9999999, 1.5]),
    "expm1": (torch.expm1, (-20, 88), [88.8, -104.0, 1e-10]),
    "log1p": (torch.log1p, (-0.999, 1e4), [-1.0, -1.5, 1e-10]),
    "log10": (torch.log10, (1e-3, 1e4), [1.0, 10.0, -1.0]),
    "rsqrt": (torch.rsqrt, (1e-3, 1e4), [1.0, 4.0, -1.0]),
    "trunc": (torch.trunc, (-50, 50), [0.5, -0.5, 2.5, -2.5, 8388607.5]),
    "rint": (torch.round, (-50, 50), [0.5, -0.5, 1.5, 2.5, -2.5, 8388607.5]),
    "signbit": (torch.signbit, (-50, 50), []),
    "erfc": (torch.erfc, (-10, 10), [9.19, 10.06, -4.0]),
    "erfcx": (torch.special.erfcx, (-9, 50), [-9.4, 1e10, 30.0]),
    "lgamma": (torch.lgamma, (-20, 50), [1.0, 2.0, -1.0, -2.5, 1e30, 4e36]),
    "normcdfinv": (torch.special.ndtri, (0, 1), [1e-30, 1e-10, 0.999999, 1.0, -0.1, 1.1]),
    "cyl_bessel_i0": (torch.special.i0, (-30, 30), [88.0, 92.0, -92.0, 1e-20]),
    "cyl_bessel_i1": (torch.special.i1, (-30, 30), [88.0, 92.0, -92.0, 1e-20]),
    "j0": (torch.special.bessel_j0, (-40, 40), [2.4048255, 5.5200781, 1e5], _bessel("besselj", 0)),
    "j1": (torch.special.bessel_j1, (-40, 40), [3.8317060, 7.0155867, 1e5], _bessel("besselj", 1)),
    "y0": (torch.special.bessel_y0, (1e-3, 40), [0.8935770, 3.9576784, 1e5], _bessel("bessely", 0)),
    "y1": (torch.special.bessel_y1, (1e-3, 40), [2.1971413, 5.4296810, 1e5], _bessel("bessely", 1)),
}


def unary_points(name: str) -> torch.Tensor:
    _, (lo, hi), edges, *_ = UNARY[name]
    return torch.cat([torch.linspace(lo, hi, 3001), torch.tensor(EXTREMES + edges)]).float()


def pair_points() -> tuple[torch.Tensor, torch.Tensor]:
    """Every pair of a grid with both signs, zeros, infinities and NaN."""
    values = torch.cat([torch.linspace(-5, 5, 41), torch.tensor([0.0, -0.0, INF, -INF, NAN, 1e-30, 3e38])])
    return values.repeat_interleave(len(values)).float(), values.repeat(len(values)).float()


def assert_close_to_reference(out: torch.Tensor, reference: torch.Tensor) -> None:
    """Within REL * |reference| + ABS where float32 can hold the reference; where it cannot
    (overflow, NaN), exactly what rounding the reference to float32 gives."""
    rounded = reference.to(out.dtype)
    exact = ~torch.isfinite(rounded)
    assert torch.equal(out[exact].isnan(), rounded[exact].isnan()), "NaN where the reference has none"
    finite = exact & ~rounded.isnan()
    assert torch.equal(out[finite], rounded[finite]), "wrong infinity"
    err = (out.double() - reference).abs()[~exact]
    bound = REL * reference.abs()[~exact] + ABS
    worst = int((err - bound).argmax())
    assert (err <= bound).all(), (
        f"error {float(err[worst]):.3g} at reference {float(reference[~exact][worst])}"
    )


def assert_calls_libdevice(fn, symbol: str, *args) -> None:
    sources = "".join(k.source for k in gjit.explain(fn, *args).kernels)
    assert f"libdevice.{symbol}(" in sources, sources


@pytest.mark.parametrize("name", list(UNARY), ids=list(UNARY))
def test_unary_stand_in(name):
    fn, _, _, *reference = UNARY[name]
    x = unary_points(name)
    out, cm = run_compiled(fn, x)
    assert_calls_libdevice(cm, name, x)
    if name == "signbit":
        assert torch.equal(out, torch.signbit(x))
    else:
        assert_close_to_reference(out, (reference[0] if reference else fn)(x.double()))


def test_pow_scalar_exponents():
    x = torch.cat([torch.linspace(1e-3, 20, 3001), torch.tensor(EXTREMES + [1.0, -1.0, -2.0])]).float()

    def fn(a):
        return a**2.5, a**-1.5, a**0.3

    out, cm = run_compiled(fn, x)
    assert_calls_libdevice(cm, "pow", x)
    for o, e in zip(out, (2.5, -1.5, 0.3)):
        # the kernel's exponent is a float32 (as on a GPU): 0.3 there is 0.30000001192...
        assert_close_to_reference(o, x.double() ** torch.tensor(e, dtype=torch.float32).item())


@pytest.mark.parametrize(
    "name,fn",
    [("pow", torch.pow), ("atan2", torch.atan2), ("copysign", torch.copysign), ("hypot", torch.hypot)],
    ids=["pow", "atan2", "copysign", "hypot"],
)
def test_binary_stand_in(name, fn):
    a, b = pair_points()
    out, cm = run_compiled(fn, a, b)
    assert_calls_libdevice(cm, name, a, b)
    assert_close_to_reference(out, fn(a.double(), b.double()))


@pytest.mark.parametrize("name", ["tanh", "erfinv", "rint", "log1p"], ids=str)
def test_float64_stand_in(name):
    fn = UNARY[name][0]
    x = unary_points(name).double()
    out, cm = run_compiled(fn, x)
    assert_calls_libdevice(cm, name, x)
    expected = fn(x)
    assert torch.equal(out.isnan(), expected.isnan())
    torch.testing.assert_close(out, expected, rtol=1e-15, atol=0, equal_nan=True)


def test_nextafter_steps_in_the_arguments_precision():
    a, b = pair_points()
    for x, y in ((a, b), (a.double(), b.double())):
        out, cm = run_compiled(torch.nextafter, x, y)
        assert_calls_libdevice(cm, "nextafter", x, y)
        assert torch.equal(out.isnan(), torch.nextafter(x, y).isnan())
        assert torch.equal(out.nan_to_num(), torch.nextafter(x, y).nan_to_num())


def emitted_symbols() -> set[str]:
    """The libdevice functions the Triton emitter table can produce (for float and int results)."""
    symbols = set()
    for name, emit in TritonOverrides.items():
        params = inspect.signature(emit).parameters.values()
        arity = sum(p.default is inspect.Parameter.empty for p in params) - 1  # the last is the dtype
        dtypes = (torch.int64,) if name in ("lshift", "rshift") else (torch.float32, torch.int64)
        for dtype in dtypes:
            symbols |= set(re.findall(r"libdevice\.(\w+)\(", emit(*["a"] * arity, dtype)))
    return symbols


def test_every_emitted_symbol_has_a_tested_stand_in():
    emitted = emitted_symbols()
    assert emitted <= set(interpret.LIBDEVICE), emitted - set(interpret.LIBDEVICE)
    assert emitted == set(UNARY) | {"pow", "atan2", "copysign", "hypot", "nextafter"}


def test_lookup_resolves_precision_suffix():
    assert interpret._lookup("__nv_tanhf", float32=True) is interpret.LIBDEVICE["tanh"]
    assert interpret._lookup("__nv_tanh", float32=False) is interpret.LIBDEVICE["tanh"]
    assert interpret._lookup("__nv_erfinvf", float32=True) is interpret.LIBDEVICE["erfinv"]


def test_unknown_symbol_is_named():
    with pytest.raises(NotImplementedError, match="__nv_frobnicatef"):
        interpret._lookup("__nv_frobnicatef", float32=True)


def test_bfloat16_casts_round_to_nearest_even():
    """float32 and float16 -> bfloat16 round as on a GPU; the interpreter's own conversion
    truncated (1.3711 -> 1.3672, 0.1686 -> 0.1680)."""
    x = torch.tensor(
        [1.37109375, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8 + 2**-12), 3e38, NAN, INF, -0.0]
    )
    h = torch.tensor([0.1686, -1.4316, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 65504.0, -0.0], dtype=torch.float16)
    out, _ = run_compiled(lambda x, h: (x.bfloat16(), h.bfloat16()), x, h)
    assert torch.equal(out[0].view(torch.int16), x.bfloat16().view(torch.int16))
    assert torch.equal(out[1].view(torch.int16), h.bfloat16().view(torch.int16))


def test_comparison_of_a_scalar_is_boolean():
    """A comparison of a scalar load, splatted to a block, stays int1 (the interpreter tagged it
    float32, so `block_cmp | scalar_cmp` failed in numpy)."""
    a, b = torch.randn(6), torch.tensor(0.5)
    out, _ = run_compiled(lambda a, b: (torch.logical_or(a, b), (a > 0) & (b > 0)), a, b)
    assert torch.equal(out[0], torch.logical_or(a, b)) and torch.equal(out[1], (a > 0) & (b > 0))


def _language_attributes() -> dict:
    import triton.language as tl
    from triton.language.extra import libdevice

    modules = [tl, tl.core, tl.math, tl.core.tensor, libdevice]
    # not what each read makes anew (a class's __dict__, its bound classmethods)
    return {(id(m), n): getattr(m, n) for m in modules for n in dir(m) if getattr(m, n) is getattr(m, n)}


@contextlib.contextmanager
def _language_put_back() -> Iterator[None]:
    """What Triton's interpreter patches in `triton.language` as it was, after the block, and no
    interpreted launch in progress."""
    import triton.language as tl
    from triton.language.extra import libdevice

    core = tl.core
    patched = [tl, core, tl.math, libdevice, core.tensor, core.dtype, core.condition]
    patched.append(core.tensor_descriptor_base)
    saved = [(m, dict(vars(m))) for m in patched]
    try:
        yield
    finally:
        interpret._launches.current = None
        interpret._RUNNING.clear()
        for m, attributes in saved:
            for name, value in list(vars(m).items()):
                if name not in attributes and isinstance(m, type):
                    delattr(m, name)
                elif name in attributes and attributes[name] is not value:
                    setattr(m, name, attributes[name])


def test_an_interpreted_launch_puts_back_every_patch_of_triton_language(monkeypatch):
    """A launch holds what its programs' device functions (tl.sum, tl.zeros, gjit's helpers) patch until
    it ends, where each call patched and restored for itself: after it, `triton.language` (tl,
    tl.core, tl.math, the tensor class, libdevice's stubs) is as Triton has it, or a later GPU
    compile in the process would take the interpreter's functions; also when a launch fails."""
    before = _language_attributes()
    x, wide = torch.randn(5, 37), torch.randn(3, 1500)  # rows past a block: gjit's looped helpers

    def fn(x, wide):
        return torch.softmax(torch.tanh(x), -1), x.sum(0), F.layer_norm(wide, (1500,)), wide.softmax(-1)

    out, _ = run_compiled(fn, x, wide)
    for got, want in zip(out, fn(x, wide)):
        torch.testing.assert_close(got, want)
    assert interpret._RUNNING == [] and getattr(interpret._launches, "current", None) is None
    changed = [key for key, value in _language_attributes().items() if before.get(key, value) is not value]
    assert changed == [] and set(_language_attributes()) == set(before)

    monkeypatch.delitem(interpret.LIBDEVICE, "tanh")  # the launch fails after its tl.sum
    with pytest.raises(Exception, match="__nv_tanhf"):
        run_compiled(lambda x: torch.tanh(x.sum(-1)), x, expect_eager=None)
    assert interpret._RUNNING == [] and getattr(interpret._launches, "current", None) is None
    assert all(before.get(key, value) is value for key, value in _language_attributes().items())


HELPER_AND_KERNEL = """
import triton
import triton.language as tl


@triton.jit
def twice_plus_one(x):
    return x * 2 + 1


@triton.jit
def kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    lanes = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + lanes, lanes < n, other=0.0)
    tl.store(out_ptr + lanes, twice_plus_one(tl.sum(x, 0) + x), lanes < n)
"""


def test_a_device_function_called_outside_a_launch_leaves_no_launch_in_progress(tmp_path):
    """Review of 555fd87: a @triton.jit helper called outside any launch (Triton's InterpretedFunction,
    which never puts back its patches) was taken for a kernel launch that never ended: every later
    launch in the thread held its patches for it, and none was put back."""
    path = tmp_path / "helper_and_kernel.py"
    path.write_text(HELPER_AND_KERNEL)
    module = interpret.load_module(str(path), interpret=True)
    x, out = torch.randn(5), torch.empty(5)
    with _language_put_back():  # `tl` as Triton has it for the tests after this one
        with interpret.stdlib_interpreted():
            module.twice_plus_one(3)  # patches `tl` as Triton does (and leaves them)
        assert interpret._RUNNING == [] and getattr(interpret._launches, "current", None) is None
        before = _language_attributes()
        with interpret.stdlib_interpreted():
            module.kernel[(1,)](x, out, 5, BLOCK=8)
        torch.testing.assert_close(out, (x.sum() + x) * 2 + 1)
        assert interpret._RUNNING == [] and getattr(interpret._launches, "current", None) is None
        assert all(before.get(key, value) is value for key, value in _language_attributes().items())
