"""Every pointwise lowering against eager: dtypes, Tensor/Scalar overloads, NaN/Inf, layouts.

Capture (torch.export) dominates the cost of a check, so one compiled call covers an op's
whole dtype set (and usually its NaN/Inf inputs): `each(*ops)` applies every op to every
argument, `pairwise(*ops)` to every pair of arguments. A failure names the output that differs.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

import gjit
from helpers import assert_same, check, run_compiled, upcast

# NaN/Inf inputs make the interpreter's numpy math warn (overflow, invalid value): intended here
pytestmark = [pytest.mark.cpu, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

NAN, INF = math.nan, math.inf
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
I64, I32, BOOL = torch.int64, torch.int32, torch.bool
FLOATS = (F32, F16, BF16)
INTS = (I64, I32)
SHAPE = (5, 7)
# NaN, infinities, signed zeros, halves (rounding ties), tiny and huge values
SPECIALS = [NAN, INF, -INF, 0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 1.5, 2.5, -2.5, 1e-30, -1e-30, 88.0, -100.0]
SPECIALS.append(3e38)  # last: overflows many intermediate results


def make(dtype: torch.dtype, shape=SHAPE, low: float = -3.0, high: float = 3.0) -> torch.Tensor:
    """Random data in [low, high] (integers: the integers in it; bool: coin flips)."""
    if dtype == BOOL:
        return torch.rand(shape) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(math.ceil(low), math.floor(high) + 1, shape, dtype=dtype)
    return (torch.rand(shape, dtype=torch.float64) * (high - low) + low).to(dtype)


def nonzero(dtype: torch.dtype, low: float = 1.0, high: float = 4.0) -> torch.Tensor:
    """Divisors: magnitude in [low, high] with random signs."""
    sign = torch.where(torch.rand(SHAPE) > 0.5, 1, -1).to(dtype)
    return make(dtype, low=low, high=high) * sign


def specials(dtype: torch.dtype = F32) -> torch.Tensor:
    return torch.tensor(SPECIALS, dtype=dtype)


def each(*ops, names: list[str] | None = None):
    """fn(*xs) -> (op(x) for x in xs for op in ops); outputs are labelled for failure messages."""

    def fn(*xs):
        return tuple(op(x) for x in xs for op in ops)

    fn.labels = lambda xs: [
        f"{n} of input {k} {_desc(x)}" for k, x in enumerate(xs) for n in _names(ops, names)
    ]
    return fn


def pairwise(*ops, names: list[str] | None = None):
    """fn(a0, b0, a1, b1, ...) -> (op(a, b) for each pair for op in ops)."""

    def fn(*xs):
        return tuple(op(a, b) for a, b in zip(xs[::2], xs[1::2]) for op in ops)

    def labels(xs):
        pairs = list(zip(xs[::2], xs[1::2]))
        return [
            f"{n} of pair {k} {_desc(a)}, {_desc(b)}"
            for k, (a, b) in enumerate(pairs)
            for n in _names(ops, names)
        ]

    fn.labels = labels
    return fn


def _names(ops, names) -> list[str]:
    return names or [getattr(op, "__name__", repr(op)) for op in ops]


def _desc(x) -> str:
    return f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}" if isinstance(x, torch.Tensor) else repr(x)


def check_lowered(fn, *args, kernels: int | None = None) -> gjit.CompiledFunction:
    """`check`, and every op of the graph became kernel code (no eager externs)."""
    cm = gjit.compile(fn)
    try:
        check(cm, *args, kernels=kernels)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{_first_difference(cm, fn, args)}") from None
    report = gjit.explain(cm, *args)
    assert not report.externs, str(report)
    return cm


def _first_difference(cm: gjit.CompiledFunction, fn, args) -> str:
    out = pytree.tree_leaves(run_compiled(cm, *args)[0])
    expected = pytree.tree_leaves(fn(*args))
    reference = pytree.tree_leaves(fn(*upcast(args))) if any(a.dtype in (F16, BF16) for a in args) else None
    reference = reference or [None] * len(expected)
    labels = fn.labels(args) if hasattr(fn, "labels") else []
    for k, (a, e, r) in enumerate(zip(out, expected, reference)):
        try:
            assert_same(a, e, r)
        except AssertionError:
            label = labels[k] if len(labels) == len(expected) else ""
            return f"first differing output: #{k} {label}\n  gjit:  {a}\n  eager: {e}"
    return "(no single output differs when compared alone)"


# ----------------------------------------------------------------------------------------------
# Unary ops: name -> (fn, float domain, integer inputs allowed)
# ----------------------------------------------------------------------------------------------

ANY, POS, UNIT = (-3.0, 3.0), (0.05, 8.0), (-0.97, 0.97)
UNARY = {
    "exp": (torch.exp, ANY, True),
    "exp2": (torch.exp2, ANY, True),
    "expm1": (torch.expm1, ANY, True),
    "log": (torch.log, POS, True),
    "log1p": (torch.log1p, (-0.9, 8.0), True),
    "log2": (torch.log2, POS, True),
    "log10": (torch.log10, POS, True),
    "sqrt": (torch.sqrt, POS, True),
    "rsqrt": (torch.rsqrt, POS, True),
    "sin": (torch.sin, (-6.0, 6.0), True),
    "cos": (torch.cos, (-6.0, 6.0), True),
    "tan": (torch.tan, (-1.4, 1.4), True),
    "tanh": (torch.tanh, ANY, True),
    "sinh": (torch.sinh, (-5.0, 5.0), True),
    "cosh": (torch.cosh, (-5.0, 5.0), True),
    "asin": (torch.asin, UNIT, True),
    "acos": (torch.acos, UNIT, True),
    "atan": (torch.atan, (-6.0, 6.0), True),
    "asinh": (torch.asinh, (-6.0, 6.0), True),
    "acosh": (torch.acosh, (1.0, 8.0), True),
    "atanh": (torch.atanh, UNIT, True),
    "sigmoid": (torch.sigmoid, (-8.0, 8.0), True),
    "erf": (torch.erf, ANY, True),
    "erfinv": (torch.erfinv, UNIT, True),
    "digamma": (torch.digamma, ANY, True),
    "erfc": (torch.erfc, ANY, True),
    "erfcx": (torch.special.erfcx, ANY, True),
    "lgamma": (torch.lgamma, ANY, True),
    "ndtri": (torch.special.ndtri, (0.01, 0.99), False),
    "i0": (torch.i0, ANY, True),
    "i1": (torch.special.i1, ANY, True),
    "bessel_j0": (torch.special.bessel_j0, (-8.0, 8.0), True),
    "bessel_j1": (torch.special.bessel_j1, (-8.0, 8.0), True),
    "bessel_y0": (torch.special.bessel_y0, POS, True),
    "bessel_y1": (torch.special.bessel_y1, POS, True),
    "reciprocal": (torch.reciprocal, ANY, False),
    "abs": (torch.abs, ANY, True),
    "neg": (torch.neg, ANY, True),
    "sign": (torch.sign, ANY, True),
    "floor": (torch.floor, (-4.0, 4.0), True),
    "ceil": (torch.ceil, (-4.0, 4.0), True),
    "round": (torch.round, (-4.0, 4.0), True),
    "trunc": (torch.trunc, (-4.0, 4.0), True),
    "frac": (torch.frac, (-4.0, 4.0), False),
    "isnan": (torch.isnan, ANY, True),
    "isinf": (torch.isinf, ANY, True),
    "isfinite": (torch.isfinite, ANY, True),
    "signbit": (torch.signbit, ANY, True),
    "logical_not": (torch.logical_not, ANY, True),
    "relu": (torch.relu, ANY, True),
    "square": (torch.square, ANY, True),
    "nan_to_num": (torch.nan_to_num, ANY, True),
}
# eager CPU has these in float32 and float64 only
NO_HALF = {"erfcx", "ndtri", "bessel_j0", "bessel_j1", "bessel_y0", "bessel_y1"}
# eager's float64 Bessel functions of the first and second kind are off by up to 1e-5 (relatively)
# near their zeros: float64 is checked against mpmath (test_bessel_float64_is_accurate)
BESSEL = {"bessel_j0": 0, "bessel_j1": 1, "bessel_y0": 0, "bessel_y1": 1}
BOOL_INPUTS = {"exp", "sigmoid", "sign", "signbit", "isnan", "isinf", "isfinite", "logical_not", "nan_to_num"}


def unary_inputs(name: str) -> list[torch.Tensor]:
    """The op's domain in every float dtype (and integers, bools), then NaN/Inf/edge values."""
    _, (low, high), ints = UNARY[name]
    floats = (F32,) if name in BESSEL else (F32, torch.float64) if name in NO_HALF else FLOATS
    args = [make(dtype, low=low, high=high) for dtype in floats]
    if ints:
        args += [make(I64, low=low, high=high), make(I32, low=low, high=high)]
    if name == "reciprocal":  # integer inputs promote to float; keep zero out of them
        args += [make(I64, low=1, high=5), -make(I32, low=1, high=5)]
    if name in BOOL_INPUTS:
        args.append(make(BOOL))
    return args + [specials(dtype) for dtype in floats]


@pytest.mark.parametrize("name", list(UNARY), ids=list(UNARY))
def test_unary(name):
    check_lowered(each(UNARY[name][0], names=[name]), *unary_inputs(name))


def test_bessel_float64_is_accurate():
    import mpmath

    x = torch.cat([torch.linspace(0.05, 40.0, 97, dtype=torch.float64), torch.tensor([5.52007811, 1e-3])])
    fns = [UNARY[name][0] for name in BESSEL]
    out, _ = run_compiled(lambda a: tuple(fn(a) for fn in fns), x)
    for name, got in zip(BESSEL, out):
        exact = mpmath.besselj if name.startswith("bessel_j") else mpmath.bessely
        want = torch.tensor([float(exact(BESSEL[name], v)) for v in x.tolist()], dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-15, msg=name)


def test_digamma_polygamma_zeta_are_accurate():
    """float64 against mpmath (eager's own float64 trigamma is good to 1e-10 only)."""
    import mpmath

    x = torch.cat(
        [
            torch.linspace(-7.9, 25.0, 101, dtype=torch.float64),
            torch.tensor([1e-8, 0.5, 1.4616321449683622, 100.0, 1e5, -0.5, -2.25], dtype=torch.float64),
        ]
    )
    s = torch.linspace(1.5, 12.0, len(x), dtype=torch.float64)
    q = torch.linspace(0.05, 30.0, len(x), dtype=torch.float64)
    s[:3], q[:3] = torch.tensor([3.0, 2.0, 4.0]), torch.tensor([-2.5, -7.25, -0.5])

    def fn(a, s, q):
        return torch.digamma(a), torch.polygamma(1, a), torch.polygamma(3, a), torch.special.zeta(s, q)

    out, _ = run_compiled(fn, x, s, q)
    exact = [
        [mpmath.digamma(v) for v in x.tolist()],
        [mpmath.psi(1, v) for v in x.tolist()],
        [mpmath.psi(3, v) for v in x.tolist()],
        [mpmath.zeta(a, b) for a, b in zip(s.tolist(), q.tolist())],
    ]
    for got, want in zip(out, exact):
        want = torch.tensor([float(v) for v in want], dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)


def test_digamma_polygamma_zeta_special_values_as_eager():
    x = torch.tensor([0.0, -0.0, -1.0, -2.0, INF, -INF, NAN, -3.0, -1e-300], dtype=torch.float64)
    s = torch.tensor([1.0, 0.5, 2.0, 2.0, 2.5, 3.0, NAN, 2.0, 2.0, 4.0], dtype=torch.float64)
    q = torch.tensor([2.0, 2.0, 0.0, -1.0, -1.5, -1.5, 1.0, NAN, INF, -2e6], dtype=torch.float64)

    def fn(x, s, q):
        return torch.digamma(x), torch.polygamma(1, x), torch.special.zeta(s, q), torch.digamma(x.float())

    check_lowered(fn, x, s, q)


def test_ldexp_is_a_times_two_to_the_n():
    """Overflow to inf, underflow to (sub)normals and 0, as eager's a * 2.0**n."""
    n = torch.tensor([-150, -140, -126, -1, 0, 1, 10, 127, 130, 3, -3, 2, 0, 5, 1, 0, -1], dtype=I32)

    def fn(x, n, h, e):
        return torch.ldexp(x, n), torch.ldexp(h, n), torch.ldexp(x, e), torch.ldexp(x.double(), n)

    check_lowered(fn, specials(), n, specials(F16), make(F32, shape=(17,), low=-4, high=4).round())


def test_round_half_to_even():
    ties = torch.arange(-12, 13, dtype=F32) * 0.5
    check_lowered(each(torch.round), ties, ties.half(), ties.bfloat16(), ties.double())


POLYNOMIALS = [
    *(f"{s}chebyshev_polynomial_{k}" for s in ("", "shifted_") for k in "tuvw"),
    "hermite_polynomial_h", "hermite_polynomial_he", "laguerre_polynomial_l", "legendre_polynomial_p",
]  # fmt: skip


@pytest.mark.parametrize("name", POLYNOMIALS)
def test_orthogonal_polynomials_as_eager(name):
    """torch.special's polynomials: the recurrence for degrees a block does not share, the closed
    forms (edges +-1 and 0 of the shifted forms, the trigonometric form of high degrees), negative
    degrees, fractional degrees truncated, Hermite's cap (NaN past 128 in float32), scalar
    operands; float32 computed in float64 a step at a time: as close to float64 as eager or closer."""
    f = getattr(torch.special, name)
    edges = torch.tensor([1.0, -1.0, 0.0, 0.5, 1.0, -1.0, 0.0, 0.25])
    x = torch.cat([make(F32, shape=(40,), low=-1.5, high=1.5), edges])
    n = torch.cat([make(I64, shape=(40,), low=-2, high=14), torch.tensor([3, 4, 9, 12, 10, 11, 7, 2])])
    n[:3] = torch.tensor([129, 700, 500])  # past Hermite's caps, long recurrences elsewhere
    nf = n.float() + 0.5

    def polys(x, n, nf):
        return f(x, n), f(x, nf), f(x, 5), f(torch.tensor(0.3, dtype=x.dtype), n)

    out, cm = run_compiled(polys, x, n, nf)
    reference = polys(x.double(), n, nf.double())  # long recurrences: judged against float64
    for got, want, exact in zip(out, polys(x, n, nf), reference):
        assert_same(got, want, exact)
    assert not gjit.explain(cm, x, n, nf).externs
    check_lowered(lambda x, n: f(x, n), x.double(), n)


BESSEL_SERIES = ["i0e", "i1e", "modified_bessel_k0", "modified_bessel_k1", "scaled_modified_bessel_k0",
          "scaled_modified_bessel_k1", "spherical_bessel_j0"]  # fmt: skip


@pytest.mark.parametrize("name", BESSEL_SERIES)
def test_bessel_series_as_eager(name):
    """Chebyshev series in float64 (coefficients computed with mpmath, kernels/bessel.py) across
    both branches of each (|x| about 8 for I, 2 for K), tiny and huge arguments, 0, negative
    numbers (K: NaN), +-inf and NaN; float32 judged against float64, float64 against eager."""
    f = getattr(torch.special, name)
    special = [0.0, -0.0, 1e-30, 1e-8, 2.0, 8.0, -8.0, 1e4, -1e4, 700.0, 710.0, math.inf, -math.inf, math.nan]
    special = torch.tensor(special)
    x = torch.cat([make(F32, shape=(60,), low=-12, high=12), make(F32, shape=(20,), low=0, high=60), special])
    out, cm = run_compiled(lambda x: f(x), x)
    assert_same(out, f(x), f(x.double()))
    assert not gjit.explain(cm, x).externs
    check_lowered(lambda x: f(x), x.double())


def test_polynomials_under_a_mask_nan_stops_and_shifted_edges():
    """A polynomial computed under a narrower mask (pad) is not reused outside it; a recurrence
    stops at NaN as ATen's does (a degree of 2**40 returns at once); shifted W's closed form at
    the last float below 1 falls back to the parity, as ATen's."""
    y = make(F32, shape=(10,), low=-0.9, high=0.9)
    cheb = torch.special.chebyshev_polynomial_t
    check_lowered(lambda y: y + F.pad(cheb(y, 3)[:8], (0, 2)) + cheb(y, 3), y)
    check_lowered(lambda x, n: cheb(x, n), torch.tensor([2.0, math.nan, -3.0]), torch.full((3,), 2**40))
    w = torch.tensor([1 - 2**-24, 0.5, 2**-25])
    check_lowered(lambda x: torch.special.shifted_chebyshev_polynomial_w(x, 9), w)


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_16_bit_specials_eager_has_no_kernel_for_raise_as_eager(dtype):
    """ATen's CPU kernels of the polynomials, K Bessel functions and j0 refuse 16-bit floats: gjit
    leaves them to ATen, which raises the same error in the compiled program."""
    x = make(F32, shape=(6,), low=0.1, high=0.9).to(dtype)
    for fn in (
        lambda x: torch.special.chebyshev_polynomial_t(x, 3) + 1,
        lambda x: torch.special.spherical_bessel_j0(x) * 2,
    ):
        with pytest.raises(RuntimeError, match="not implemented for"):
            fn(x)
        with pytest.raises(RuntimeError, match="not implemented for"):
            run_compiled(fn, x)
    check_lowered(lambda x: torch.special.i0e(x) + 1, x)  # ATen has these in 16 bits: a kernel


def test_bessel_coefficients_in_a_damaged_cache_file_are_computed_again(tmp_path):
    from gjit.kernels import bessel, triton_helpers

    def forget():  # this process may have the series already: read them from tmp_path
        bessel.coefficients.cache_clear()
        triton_helpers.HELPERS.pop("bessel_i0e", None)

    forget()
    with gjit.config.scope(cache_dir=str(tmp_path)):
        check_lowered(lambda x: torch.special.i0e(x) + 1, make(F32))
        files = list((tmp_path / "bessel").glob("*.json"))
        assert files
        for f in files:
            f.write_text("null")  # valid JSON, not a list of numbers
        forget()
        check_lowered(lambda x: torch.special.i0e(x) * 2, make(F32))


def test_round_to_decimals_as_eager():
    """x * 10**d rounded half to even, over 10**d (negative d: divided first), in the opmath dtype."""
    x = torch.cat([torch.randn(64) * 100, torch.arange(-12, 13, dtype=F32) * 0.125, torch.tensor([1e30])])
    for d in (0, 2, 3, -1, -3):
        check_lowered(each(lambda t, d=d: torch.round(t, decimals=d)), x, x.half(), x.double())


def test_bitwise_not():
    check_lowered(
        each(torch.bitwise_not), make(I64, low=-100, high=100), make(I32, low=-9, high=9), make(BOOL)
    )


def test_nan_to_num_values():
    def fn(x, h):
        return (
            torch.nan_to_num(x, nan=1.5, posinf=100.0, neginf=-100.0),
            torch.nan_to_num(x, posinf=7.0),
            torch.nan_to_num(h),
            torch.nan_to_num(h, neginf=0.0),
        )

    check_lowered(fn, specials(), specials(F16))


# ----------------------------------------------------------------------------------------------
# Binary ops: Tensor-Tensor over the dtype set and every pair of special values
# ----------------------------------------------------------------------------------------------

# name -> (fn, integer inputs allowed)
BINARY = {
    "add": (torch.add, True),
    "add_alpha": (lambda a, b: torch.add(a, b, alpha=2), True),
    "sub": (torch.sub, True),
    "sub_alpha": (lambda a, b: torch.sub(a, b, alpha=3), True),
    "mul": (torch.mul, True),
    "div": (torch.div, True),
    "div_floor": (lambda a, b: torch.div(a, b, rounding_mode="floor"), True),
    "div_trunc": (lambda a, b: torch.div(a, b, rounding_mode="trunc"), True),
    "floor_divide": (torch.floor_divide, True),
    "remainder": (torch.remainder, True),
    "fmod": (torch.fmod, True),
    "maximum": (torch.maximum, True),
    "minimum": (torch.minimum, True),
    "fmax": (torch.fmax, True),
    "fmin": (torch.fmin, True),
    "pow": (torch.pow, False),
    "atan2": (torch.atan2, True),
    "copysign": (torch.copysign, True),
    "hypot": (torch.hypot, False),
    "eq": (torch.eq, True),
    "ne": (torch.ne, True),
    "lt": (torch.lt, True),
    "le": (torch.le, True),
    "gt": (torch.gt, True),
    "ge": (torch.ge, True),
    "logical_and": (torch.logical_and, True),
    "logical_or": (torch.logical_or, True),
    "logical_xor": (torch.logical_xor, True),
}
DIVISIONS = ("div", "div_floor", "div_trunc", "floor_divide", "remainder", "fmod")


def binary_inputs(name: str) -> list[torch.Tensor]:
    """Pairs in every dtype (divisors non-zero), then every pair of special values but 3e38:
    eager's own results there depend on its SIMD path (fused multiply-add for alpha, a
    vectorized fmod that overflows x / y to NaN)."""
    ints = BINARY[name][1]
    args = []
    for dtype in FLOATS + (INTS if ints else ()):
        if name == "pow":
            a, b = make(dtype, low=0.1, high=3.0), make(dtype)
        elif name in DIVISIONS:
            a, b = make(dtype, low=-20, high=20), nonzero(dtype)
        else:
            a, b = make(dtype, low=-4, high=4), make(dtype, low=-4, high=4)
        args += [a, b]
    values = specials()[:-1]
    return args + [values.repeat_interleave(len(values)), values.repeat(len(values))]


@pytest.mark.parametrize("name", list(BINARY), ids=list(BINARY))
def test_binary(name):
    check_lowered(pairwise(BINARY[name][0], names=[name]), *binary_inputs(name))


def test_float_floor_division_rounding():
    """ATen's floor division of floats is not floor(a / b): 1 // 0.1 == 9."""
    a = torch.tensor([1.0, 1.0, -1.0, 0.3, 7.0, -7.0, 5.0, 0.0, -0.0, 1e-30, 1.0, -1.0])
    b = torch.tensor([0.1, -0.1, 0.1, 0.1, 0.7, 0.7, -0.25, 3.0, 3.0, -3.0, 0.0, -0.0])

    def fn(x, y):
        return (
            torch.floor_divide(x, y),
            torch.remainder(x, y),
            x // 0.1,
            torch.div(x, y, rounding_mode="trunc"),
        )

    check_lowered(fn, a, b, kernels=1)
    check_lowered(fn, a.half(), b.half())


def test_integer_division_signs():
    a = torch.tensor([7, -7, 7, -7, 0, 1, -1, 6, -6, 2**40 + 3], dtype=I64)
    b = torch.tensor([2, 2, -2, -2, 3, -3, 3, 3, -3, -7], dtype=I64)

    def fn(x, y, p, q):
        return (
            torch.floor_divide(x, y),
            torch.div(x, y, rounding_mode="trunc"),
            torch.remainder(x, y),
            torch.fmod(x, y),
            x // 3,
            x % -3,
            torch.div(x, y),
            torch.floor_divide(p, q),
            torch.remainder(p, q),
            torch.fmod(p, q),
            p // -4,
        )

    check_lowered(fn, a, b, a.clamp(-100, 100).int(), b.int())


# ----------------------------------------------------------------------------------------------
# Scalar overloads: groups of (name, fn), with the integer inputs each group admits
# ----------------------------------------------------------------------------------------------

SCALAR_GROUPS = {
    "add_sub_mul": (
        "any",
        {
            "add_int": lambda x: x + 2,
            "add_float": lambda x: x + 1.5,
            "add_alpha": lambda x: torch.add(x, 3, alpha=2),
            "sub_alpha": lambda x: torch.sub(x, 0.5, alpha=3),
            "rsub": lambda x: 3 - x,
            "mul": lambda x: x * 2.5,
            "mul_int": lambda x: x * -3,
            "maximum_0d": lambda x: torch.maximum(x, torch.tensor(0.5)),
            "copysign": lambda x: torch.copysign(x, -1.0),
            "atan2_0d": lambda x: torch.atan2(x, torch.tensor(2.0)),
        },
    ),
    "division": (
        "any",
        {
            "div": lambda x: x / 3,
            "div_by_zero": lambda x: x / 0.0,
            "div_floor": lambda x: torch.div(x, -3, rounding_mode="floor"),
            "div_trunc": lambda x: torch.div(x, -3, rounding_mode="trunc"),
            "floordiv": lambda x: x // 2,
            "floordiv_float": lambda x: x // 0.75,
            "remainder": lambda x: x % 3,
            "remainder_neg": lambda x: x % -2.5,
            "fmod": lambda x: torch.fmod(x, 2),
            "fmod_float": lambda x: torch.fmod(x, -1.5),
        },
    ),
    "reverse_division": (
        "nonzero",
        {
            "rdiv": lambda x: 2 / x,
            "rremainder": lambda x: torch.remainder(5, x),
            "pow_neg_half": lambda x: x.abs() ** -0.5,
        },
    ),
    "pow": (
        "any",
        {
            "pow_2": lambda x: x**2,
            "pow_3": lambda x: x**3,
            "pow_0": lambda x: x**0,
            "pow_half": lambda x: x.abs() ** 0.5,
            "pow_2_5": lambda x: x.abs() ** 2.5,
            "pow_5": lambda x: x**5,
            "exp_1_5_x": lambda x: 1.5**x,
        },
    ),
    "pow_float_only": (
        None,
        {
            "pow_neg1": lambda x: x**-1,
            "pow_neg2": lambda x: x**-2,
            "exp_2_x": lambda x: 2**x,
        },
    ),
    "compare": (
        "any",
        {
            "eq": lambda x: x == 1,
            "ne": lambda x: x != 0,
            "lt": lambda x: x < 0.5,
            "le": lambda x: x <= 1,
            "gt": lambda x: x > -1,
            "ge": lambda x: x >= 2.5,
        },
    ),
}


@pytest.mark.parametrize("group", list(SCALAR_GROUPS), ids=list(SCALAR_GROUPS))
def test_scalar_overloads(group):
    ints, ops = SCALAR_GROUPS[group]
    args = [make(dtype, low=-4, high=4) for dtype in FLOATS]
    if ints == "any":
        args += [make(I64, low=-6, high=6), make(I32, low=-6, high=6)]
    elif ints == "nonzero":
        args += [nonzero(I64), nonzero(I32)]
    check_lowered(each(*ops.values(), names=list(ops)), *args, specials())


def test_integer_pow():
    def fn(x):
        return x**2, x**3, x**5, x**0, x.abs() ** 2.5

    check_lowered(fn, make(I64, low=-5, high=5))
    check_lowered(fn, make(I32, low=-5, high=5))


def test_integer_pow_tensor_exponent_runs_as_extern():
    """An integer tensor exponent is not lowered (it needs a loop): the extern must still be right."""
    args = make(I64, low=-5, high=5), make(I64, low=0, high=6)
    cm = check(lambda x, e: (2**e, x**e), *args)
    externs = gjit.explain(cm, *args).externs
    assert [e.op for e in externs] == ["aten.pow.Scalar", "aten.pow.Tensor_Tensor"], externs


def test_pow_tensor_exponent_int_base_float_exponent():
    check_lowered(torch.pow, make(I64, low=0, high=5), make(F32, low=-2, high=2), kernels=1)


def test_comparisons_convert_operands_to_their_common_dtype():
    """Eager compares bfloat16 x with bfloat16(0.3) = 0.30078125, not 0.3 (the fuzzer's find:
    bf16 > float32 0-d tensor), and an int32 tensor with 2**40 wrapped to int32, as ATen does."""
    x = torch.tensor([0.30078125, 0.298828125, 1.0], dtype=torch.bfloat16)
    h = torch.tensor([0.300048828125, 0.2998046875], dtype=torch.float16)
    i, u = torch.tensor([1, 2, 3], dtype=torch.int32), torch.tensor([1, 200], dtype=torch.uint8)
    check(lambda x, t: (x == 0.3, x > t, x <= t, x != 0.3), x, torch.tensor(0.3), kernels=1)
    check(lambda h: (h == 0.3, h < 0.3), h, kernels=1)
    check(lambda i, t: (i > 2**40, i < t, i == 2.0), i, torch.tensor(2.5), kernels=1)
    check(lambda u: (u > 300, u == -56, u > -1), u, kernels=1)


def test_integer_arithmetic_wraps_as_in_eager():
    """int32 and int16 products and sums past their range wrap (two's complement), as eager's and a
    card's do; Triton's interpreter checked each add and multiply and raised instead."""
    big = torch.full((37,), 2**30, dtype=torch.int32) + torch.arange(37, dtype=torch.int32)
    small = torch.randint(-5, 5, (37,), dtype=torch.int32)
    check(lambda x, y: (x * 3 + y, x + x - y, -x * 4), big, small, kernels=1)
    check(lambda x: x * 300 + 7, torch.arange(-200, 200, 7, dtype=torch.int16), kernels=1)


def test_type_promotion():
    def fn(i64, i32, f16, f32_0d, b):
        return (
            i64 + i32,
            i32 * 2.5,
            f16 + f32_0d,
            i32 / i32.abs().clamp_min(1),
            b + b,
            torch.add(b, b, alpha=True),
            b * i32,
            f16 * i64,
            torch.where(b, i32, f16),
            torch.maximum(i32, f16),
        )

    check_lowered(fn, make(I64), make(I32), make(F16), torch.tensor(1.25), make(BOOL))


def test_float64():
    """Double precision end to end: literals, libdevice's double variants, float64 compute."""

    def fn(x, y):
        return (
            x.exp(),
            x.sin(),
            x.tanh(),
            x.expm1(),
            x.sigmoid(),
            x.erf(),
            x // 0.3,
            x % 0.7,
            torch.fmod(x, y),
            x.abs() ** 2.5,
            torch.round(x),
            x.sign(),
            torch.atan2(x, y),
            torch.clamp(x, -1, 1),
            x * 1e300,
            torch.where(x > 0, x, 1e-300),
            torch.nan_to_num(x),
            x.to(F32),
        )

    f64 = torch.float64
    check_lowered(fn, make(f64), make(f64))
    check_lowered(fn, specials(f64), specials(f64).flip(0))


def test_bool_ops():
    def fn(p, q):
        return (
            torch.maximum(p, q),
            torch.minimum(p, q),
            p == q,
            p < q,
            torch.where(p, q, False),
            p * q,
            p.sign(),
            p.float() + q,
            torch.rsub(p.int(), 3, alpha=2),
        )

    check_lowered(fn, make(BOOL), make(BOOL))


def test_rsub():
    def fn(x):
        return torch.rsub(x, 3, alpha=2), torch.rsub(x, 1.5), torch.rsub(x, x * 2)

    check_lowered(each(fn), make(F32), make(BF16), make(I64))


# ----------------------------------------------------------------------------------------------
# Bitwise ops on integers (and bool)
# ----------------------------------------------------------------------------------------------


def test_bitwise():
    ops = {"and": lambda a, b: a & b, "or": lambda a, b: a | b, "xor": lambda a, b: a ^ b}
    scalar_ops = {
        "and_scalar": lambda a, b: a & 6,
        "or_scalar": lambda a, b: torch.bitwise_or(a, -8),
        "xor_scalar": lambda a, b: a ^ 5,
    }
    ints = [make(I64, low=-1000, high=1000), make(I64, low=-1000, high=1000)]
    ints += [make(I32, low=-99, high=99), make(I32, low=-99, high=99)]
    check_lowered(pairwise(*ops.values(), *scalar_ops.values(), names=[*ops, *scalar_ops]), *ints)
    check_lowered(pairwise(*ops.values(), names=list(ops)), make(BOOL), make(BOOL))


def test_shifts():
    """In range, and by a negative amount or at least the bit width, which eager defines (0 or
    the sign)."""
    ops = {
        "lshift": lambda a, b: a << b,
        "rshift": lambda a, b: a >> b,
        "bitwise_left_shift": torch.bitwise_left_shift,
        "bitwise_right_shift": torch.bitwise_right_shift,
        "lshift_scalar": lambda a, b: a << 3,
        "rshift_scalar": lambda a, b: a >> 2,
    }
    args = [make(I64, low=-1000, high=1000), make(I64, low=0, high=40)]
    args += [make(I32, low=-1000, high=1000), make(I32, low=0, high=20)]
    edge = torch.tensor([5, -5, 1, -1, 7, -7, 3, -3], dtype=I64)
    args += [edge, torch.tensor([64, 70, -1, -2, 63, 63, 100, 0], dtype=I64)]
    args += [edge.int(), torch.tensor([32, 40, -1, 31, 31, 33, 0, 5], dtype=I32)]
    check_lowered(pairwise(*ops.values(), names=list(ops)), *args)


# ----------------------------------------------------------------------------------------------
# where, clamp
# ----------------------------------------------------------------------------------------------


def test_where():
    def fn(c, a, b, h, i):
        return (
            torch.where(c, a, b),
            torch.where(c, a, 0.0),
            torch.where(c, 2.5, b),
            torch.where(c, 1, 2),
            torch.where(c, h, a),
            torch.where(c, i, 7),
            torch.where(a > 0, a, b[0]),
        )

    check_lowered(fn, make(BOOL), make(F32), make(F32), make(F16), make(I64))


def test_where_broadcast_and_nan():
    check_lowered(torch.where, make(BOOL, (5, 1)), specials()[:7], make(F32, (1, 7)), kernels=1)


CLAMP_GROUPS = {
    "scalar_bounds": {
        "min_max": lambda x, lo, hi: torch.clamp(x, -1.0, 1.5),
        "min": lambda x, lo, hi: torch.clamp(x, min=-0.5),
        "max": lambda x, lo, hi: torch.clamp(x, max=0.25),
        "int_bounds": lambda x, lo, hi: torch.clamp(x, -2, 2),
        "min_gt_max": lambda x, lo, hi: torch.clamp(x, 2.0, 1.0),
        "clamp_min": lambda x, lo, hi: torch.clamp_min(x, 0.5),
        "clamp_max": lambda x, lo, hi: torch.clamp_max(x, 0.5),
    },
    "tensor_bounds": {
        "tensor": lambda x, lo, hi: torch.clamp(x, lo, hi),
        "tensor_min": lambda x, lo, hi: torch.clamp(x, min=lo),
        "tensor_max": lambda x, lo, hi: torch.clamp(x, max=hi),
        "min_gt_max": lambda x, lo, hi: torch.clamp(x, hi, lo),
    },
}


@pytest.mark.parametrize("group", list(CLAMP_GROUPS), ids=list(CLAMP_GROUPS))
def test_clamp(group):
    """Every dtype, then NaN/Inf inputs against finite, NaN and special bounds (eager: a NaN
    input or bound gives NaN)."""
    ops = CLAMP_GROUPS[group]
    args = []
    for dtype in FLOATS + INTS:
        lo = make(dtype, low=-3, high=0)
        args += [make(dtype, low=-4, high=4), lo, lo + make(dtype, low=0, high=3)]
    n = len(SPECIALS)
    args.append(specials().repeat(3))
    args.append(torch.cat([torch.full((n,), -1.0), torch.full((n,), NAN), specials()]))
    args.append(torch.cat([torch.full((n,), 1.0), torch.full((n,), 2.0), torch.full((n,), NAN)]))

    def fn(*xs):
        return tuple(op(*xs[k : k + 3]) for k in range(0, len(xs), 3) for op in ops.values())

    fn.labels = lambda xs: [f"{name} of triple {k // 3}" for k in range(0, len(xs), 3) for name in ops]
    check_lowered(fn, *args)


# ----------------------------------------------------------------------------------------------
# Activations (and what the nn.functional ones decompose to)
# ----------------------------------------------------------------------------------------------

ACTIVATION_GROUPS = {
    "relu_like": {
        "relu": F.relu,
        "relu6": F.relu6,
        "leaky_relu": F.leaky_relu,
        "leaky_relu_0.2": lambda x: F.leaky_relu(x, 0.2),
        "hardtanh": F.hardtanh,
        "hardtanh_bounds": lambda x: F.hardtanh(x, -2.0, 0.5),
    },
    "gelu": {"gelu": F.gelu},
    "smooth": {
        "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "silu": F.silu,
        "mish": F.mish,
        "sigmoid": torch.sigmoid,
        "tanh": torch.tanh,
        "hardsigmoid": F.hardsigmoid,
        "hardswish": F.hardswish,
        "softsign": F.softsign,
    },
    "exponential": {
        "elu": F.elu,
        "elu_alpha": lambda x: F.elu(x, alpha=0.5),
        "selu": F.selu,
        "celu": lambda x: F.celu(x, alpha=2.0),
        "softplus": F.softplus,
        "softplus_beta": lambda x: F.softplus(x, beta=2.0, threshold=1.0),
    },
}


@pytest.mark.parametrize("group", list(ACTIVATION_GROUPS), ids=list(ACTIVATION_GROUPS))
def test_activation(group):
    ops = ACTIVATION_GROUPS[group]
    wide = torch.cat([specials(), make(F32, (40,), -25, 25)])
    if group == "gelu":
        # eager's SIMD erf gives gelu(+inf) = NaN and gelu(3e38) = inf, its scalar path (and
        # float64) gives inf and 3e38; gjit gives the latter, so those two are left out
        wide = wide[(wide < 1e38) | wide.isnan()]
    args = [make(dtype, low=-6, high=6) for dtype in FLOATS]
    check_lowered(each(*ops.values(), names=list(ops)), *args, wide)


# ----------------------------------------------------------------------------------------------
# Casts and constants
# ----------------------------------------------------------------------------------------------

CAST_TARGETS = (F32, F16, BF16, torch.float64, I32, I64, BOOL)


def cast_input(dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        # fractions (truncation toward zero), zeros, values that round differently per format
        x = torch.cat([make(F32, (20,), -100, 100), torch.tensor([0.0, -0.0, 0.5, -0.5, 2.9, -2.9, 1000.6])])
        return x.to(dtype)
    if dtype == BOOL:
        return make(BOOL, (20,))
    return torch.cat([make(dtype, (20,), -2000, 2000), torch.tensor([0, 1, -1, 2049, 65519], dtype=dtype)])


@pytest.mark.parametrize("src", CAST_TARGETS, ids=[str(d).removeprefix("torch.") for d in CAST_TARGETS])
def test_cast(src):
    def fn(x):
        return tuple(x.to(dst) for dst in CAST_TARGETS if dst != src)

    check_lowered(fn, cast_input(src), kernels=1)


def test_cast_to_half_rounds_through_float32():
    """ATen converts float64 and int64 to float16/bfloat16 through float32 (rounding twice)."""
    x = torch.tensor(
        [1 + 2**-11 + 2**-40, 1 + 2**-8 + 2**-40, -(1 + 2**-11 + 2**-40), 2**24 + 1.5], dtype=torch.float64
    )
    i = torch.tensor([2**24 + 1, 2**62 + 2**39 + 1, -(2**40) - 2**16 - 1, 65519], dtype=I64)
    check_lowered(lambda a, b: (a.half(), a.bfloat16(), b.half(), b.bfloat16()), x, i)


def test_cast_float_nan_inf():
    def fn(x, h):
        return x.half(), x.bfloat16(), x.bool(), x.double(), h.float(), h.bfloat16(), h.bool()

    check_lowered(fn, specials(), specials(F16))


def test_float_of_ints_and_bools():
    check_lowered(each(lambda x: x.float()), cast_input(I64), cast_input(I32), cast_input(BOOL))


def test_cast_then_math():
    def fn(x, i):
        return (x.half() * 3).float() + i.float(), (x * 100).int() // 3, (x > 0).float() - i

    check_lowered(fn, make(F32), make(I64))


def test_constants():
    def fn(x, i):
        return (
            torch.zeros_like(x),
            torch.ones_like(i),
            torch.full_like(x, 2.5),
            torch.full_like(i, -7),
            torch.full_like(x, NAN),
            torch.full_like(x, -INF),
            torch.full((3, 4), 1.5),
            torch.full((2, 3), 2**40, dtype=I64),
            torch.full((2, 2), True),
            torch.zeros(4, dtype=F16),
            torch.ones(2, 3, dtype=BF16),
            x + torch.scalar_tensor(3.0),
            torch.zeros_like(x, dtype=I32),
        )

    check_lowered(fn, make(F32), make(I64))


def test_cast_of_constant_members():
    """A fill value, or an arange over a size-1 dim, is a Python number in the kernel: a cast of
    it is computed at codegen (was `0.5.to(tl.float16)`), rounded as ATen rounds it."""

    def fn(x):
        return (
            torch.full_like(x, 0.1).half(),
            torch.full_like(x, 3).float() * x,
            x + torch.arange(x.shape[-1]),
        )

    check_lowered(fn, make(F32, (3, 1)))


def test_arange():
    def fn(x):
        return (
            torch.arange(10),
            torch.arange(2, 11, 3),
            torch.arange(10, 0, -2),
            torch.arange(0.0, 1.0, 0.1),
            torch.arange(6, dtype=F32),
            torch.arange(-3, 5, dtype=I32),
            torch.arange(0, 3, 0.25, dtype=F16),
            torch.arange(x.shape[0]) * x.shape[1],
            x + torch.arange(x.shape[1]),
        )

    check_lowered(fn, make(F32))


# ----------------------------------------------------------------------------------------------
# Layouts: representative ops over broadcast, non-contiguous, size-1, zero-size and 0-d inputs
# ----------------------------------------------------------------------------------------------


def unbased(view: torch.Tensor) -> torch.Tensor:
    """The same strided memory as `view`, but not a view (no `_base`): export's guards on a
    view's base make capture fall back to static shapes, this keeps the sizes dynamic."""
    out = torch.empty(0, dtype=view.dtype)
    return out.set_(view.untyped_storage(), view.storage_offset(), view.size(), view.stride())


LAYOUTS = {
    "contiguous": lambda dt: (make(dt, (5, 7)), make(dt, (5, 7))),
    "bcast_row": lambda dt: (make(dt, (5, 7)), make(dt, (7,))),
    "bcast_col": lambda dt: (make(dt, (5, 7)), make(dt, (5, 1))),
    "bcast_both": lambda dt: (make(dt, (5, 1)), make(dt, (1, 7))),
    "transposed": lambda dt: (make(dt, (7, 5)).t(), make(dt, (5, 7))),
    "both_transposed": lambda dt: (make(dt, (7, 5)).t(), make(dt, (7, 5)).t()),
    "stepped": lambda dt: (make(dt, (5, 14))[:, ::2], make(dt, (5, 7))),
    "offset": lambda dt: (make(dt, (6, 7))[1:], unbased(make(dt, (5, 15))[:, 1::2])),
    "last_dim_slice": lambda dt: (unbased(make(dt, (5, 9))[:, 2:]), unbased(make(dt, (5, 8))[:, :7])),
    "size1": lambda dt: (make(dt, (1, 7)), make(dt, (1, 1))),
    "3d_size1": lambda dt: (make(dt, (5, 1, 3)), make(dt, (1, 4, 1))),
    "permuted_3d": lambda dt: (make(dt, (3, 4, 5)).permute(2, 0, 1), make(dt, (3, 1))),
    "zero_size": lambda dt: (make(dt, (0, 7)), make(dt, (7,))),
    "zero_inner_size": lambda dt: (make(dt, (5, 0, 3)), make(dt, (1, 0, 1))),  # was a ZeroDivisionError
    "with_0d": lambda dt: (make(dt, (5, 7)), make(dt, ())),
    "0d": lambda dt: (make(dt, ()), make(dt, ())),
}


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_layouts(layout):
    """Representative ops, each reading both layouts (a float32 pair and an int64 pair)."""

    def fn(a, b, i, j):
        return (
            a + b,
            torch.sub(a, b, alpha=2) * a,
            torch.maximum(a, b),
            torch.where(a > b, a, b),
            (a.sin() + b.exp()).relu(),
            torch.atan2(a, b).clamp(-1, 1),
            a // b,
            torch.div(i, j.abs() + 1, rounding_mode="floor") + i % 3,
            i * j - (i > j).int(),
        )

    check_lowered(fn, *LAYOUTS[layout](F32), *LAYOUTS[layout](I64))


@pytest.mark.parametrize("layout", ["transposed", "stepped", "bcast_col", "zero_size"], ids=str)
def test_layouts_low_precision(layout):
    def fn(a, b, c, d):
        return a * b + a, torch.maximum(c, d).sigmoid()

    check_lowered(fn, *LAYOUTS[layout](F16), *LAYOUTS[layout](BF16))


@pytest.mark.parametrize(
    "layout", ["transposed", "stepped", "offset", "last_dim_slice", "zero_size"], ids=str
)
def test_unary_layouts(layout):
    a, _ = LAYOUTS[layout](F32)
    check_lowered(lambda x: (x.exp(), x.abs().sqrt(), torch.round(x), x.to(F16), x > 0), a)


def test_input_view_sliced_along_last_dim():
    """A view input whose base export guards on (capture falls back to static shapes)."""
    x = make(F32, (5, 9))
    check_lowered(lambda a, b: (a + 1, a * b), x[:, 2:], x[:, :7], kernels=1)


def test_compile_builtin_directly():
    check_lowered(torch.sin, make(F32), kernels=1)


@pytest.mark.compile_only
def test_eager_semantics_fixes_compile_for_sm90():
    """The emitters written for eager semantics (shift guards, ATen float floor division,
    NaN-propagating clamp, conversions through float32, libdevice calls) are valid GPU code."""
    from gjit.codegen.toolchain.compile_only import compile_kernel

    def fn(x, i, j, b, h, d):
        return (
            i << j,
            i >> j,
            x // 0.3,
            torch.clamp(x, x * 0, x * 0 + 1),
            x.sign(),
            b + b,
            h.to(I32),
            i.to(BF16),
            d.to(BF16),
            d.half(),
            torch.copysign(x, -1.0),
            x.erfinv(),
            torch.round(x),
            x.signbit(),
            x.frac(),
            torch.atan2(x, x),
            d.abs().sqrt(),
        )

    args = (
        make(F32),
        make(I64, low=-9, high=9),
        make(I64, low=0, high=70),
        make(BOOL),
        make(BF16),
        make(torch.float64),
    )
    cm = check_lowered(fn, *args)
    program = cm.entries[-1].program
    for kernel in program.kernels:
        binary = compile_kernel(kernel, program.graph.kernel_paths[kernel.name])
        assert ".target sm_90" in binary.asm["ptx"] and binary.asm["cubin"], kernel.name
