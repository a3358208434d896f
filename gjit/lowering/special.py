"""Special functions: those libdevice (and CUDA's math library) implement (erfc, erfcx, lgamma,
ndtri, hypot, nextafter, the Bessel functions of order 0 and 1), digamma, trigamma and the Hurwitz
zeta function (gjit/kernels/special_math.py, in float64), polygamma built from them, ldexp, and
the orthogonal polynomials (Chebyshev, Hermite, Laguerre, Legendre: gjit/kernels/polynomials.py)
and the Bessel functions i0e, i1e, K0, K1 (scaled too) and spherical j0 (gjit/kernels/bessel.py).
Eager's special values are kept where libdevice differs: its Bessel functions of +-inf are NaN.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as KIND

from gjit.ir import POLYNOMIAL_OPS, Const, Expr, Op
from gjit.lowering.pointwise import const, op, pointwise, unary, where
from gjit.lowering.registry import TensorValue, Unsupported, cast, promote, register_lowering

if TYPE_CHECKING:  # the walk that calls the lowerings; it imports this module
    from gjit.lowering.graph import Lowering

aten = torch.ops.aten


# Special functions libdevice (and CUDA's math library) implement: ATen op -> IR op.
_SPECIAL_UNARY = {
    aten.erfc.default: "erfc",
    aten.lgamma.default: "lgamma",
    aten.special_erfcx.default: "erfcx",
    aten.special_ndtri.default: "ndtri",
}
for _target, _name in _SPECIAL_UNARY.items():
    register_lowering(_target)(unary(_name))


def _bessel(name: str):
    def lower(ctx: Lowering, a):
        def fn(x: Expr) -> Expr:  # eager's Bessel functions of +-inf are NaN (limits in libdevice)
            return where(op("isinf", x, dtype=torch.bool), const(math.nan, x), op(name, x))

        return pointwise(ctx, [a], fn, KIND.INT_TO_FLOAT)

    return lower


for _target, _name in {
    aten.i0.default: "bessel_i0",
    aten.special_modified_bessel_i0.default: "bessel_i0",
    aten.special_i1.default: "bessel_i1",
    aten.special_modified_bessel_i1.default: "bessel_i1",
    aten.special_bessel_j0.default: "bessel_j0",
    aten.special_bessel_j1.default: "bessel_j1",
    aten.special_bessel_y0.default: "bessel_y0",
    aten.special_bessel_y1.default: "bessel_y1",
}.items():
    register_lowering(_target)(_bessel(_name))


@register_lowering(aten.hypot.default)
def hypot(ctx: Lowering, a, b):
    return pointwise(ctx, [a, b], lambda x, y: op("hypot", x, y))


def _in_float64(name: str, *xs: Expr) -> Expr:
    """IR op `name` computed in float64 (digamma, zeta), the result in the first operand's dtype."""
    return cast(op(name, *(cast(x, torch.float64) for x in xs)), xs[0].dtype)


@register_lowering(aten.digamma.default)
def digamma(ctx: Lowering, a):
    return pointwise(ctx, [a], lambda x: _in_float64("digamma", x), KIND.INT_TO_FLOAT)


@register_lowering(aten.special_zeta.default, aten.special_zeta.self_scalar, aten.special_zeta.other_scalar)
def zeta(ctx: Lowering, a, b):
    return pointwise(ctx, [a, b], lambda x, q: _in_float64("zeta", x, q), KIND.INT_TO_FLOAT)


@register_lowering(aten.polygamma.default)
def polygamma(ctx: Lowering, n: int, a):
    """The n-th derivative of digamma: trigamma for n = 1 (as eager), else (-1)^(n+1) n! zeta(n + 1, x)."""
    if not isinstance(n, int) or n < 0:
        raise Unsupported(f"polygamma of order {n!r}")

    def fn(x: Expr) -> Expr:
        if n <= 1:
            return _in_float64("trigamma" if n else "digamma", x)
        scale = Const(torch.float64, (-1.0) ** (n + 1) * float(math.factorial(n)))
        wide = op("mul", scale, op("zeta", Const(torch.float64, n + 1.0), cast(x, torch.float64)))
        return cast(wide, x.dtype)

    return pointwise(ctx, [a], fn, KIND.INT_TO_FLOAT)


@register_lowering(aten.ldexp.Tensor)
def ldexp(ctx: Lowering, a, b):
    """a * 2**b, as eager computes it (2**b in the result dtype: exact for integer b)."""
    dtype = ctx.out_val.dtype
    if not dtype.is_floating_point:
        raise Unsupported(f"ldexp to {dtype}")
    compute = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    return pointwise(
        ctx,
        [a, b],
        lambda x, y: op("mul", cast(x, compute), op("pow", Const(compute, 2.0), cast(y, compute))),
    )


@register_lowering(aten.nextafter.default)
def nextafter(ctx: Lowering, a, b):
    """The next representable value: of the result's own dtype, so 16-bit floats stay externs
    (gjit computes them in float32)."""
    if ctx.out_val.dtype not in (torch.float32, torch.float64):
        raise Unsupported(f"nextafter in {ctx.out_val.dtype}")
    return pointwise(ctx, [a, b], lambda x, y: op("nextafter", x, y))


def _polynomial(name: str):
    def lower(ctx: Lowering, x, n):
        """p_n(x) in x's float dtype, the degree truncated to an integer as ATen does."""
        _no_16_bit(name, x, n)
        compute, _ = promote([x, n], KIND.INT_TO_FLOAT)
        if compute not in (torch.float32, torch.float64):
            raise Unsupported(f"{name} in {compute}")
        # float32: computed in float64, each step rounded to float32 (kernels/polynomials.py)
        narrow = compute == torch.float32
        limit = 128 if narrow else 512  # ATen's cap of Hermite's degree (past it: NaN)

        def fn(a: Expr, b: Expr) -> Expr:
            args = (cast(a, torch.float64), cast(b, torch.int64))
            wide = Op(torch.float64, name, args, (limit, narrow))
            return cast(wide, a.dtype)

        return pointwise(ctx, [x, n], fn, KIND.INT_TO_FLOAT)

    return lower


for _name in POLYNOMIAL_OPS:  # chebyshev_t -> aten.special_chebyshev_polynomial_t, ...
    _family, _kind = _name.rsplit("_", 1)
    _packet = getattr(aten, f"special_{_family}_polynomial_{_kind}")
    register_lowering(_packet.default, _packet.x_scalar, _packet.n_scalar)(_polynomial(_name))


def _no_16_bit(name: str, *args) -> None:
    """ATen has no float16/bfloat16 kernel for these: it runs them (and raises, as eager does)."""
    low = [a.dtype for a in args if isinstance(a, TensorValue) and a.dtype in (torch.float16, torch.bfloat16)]
    if low:
        raise Unsupported(f"ATen has no {low[0]} kernel for {name}: it runs it, as eager does")


def _bessel_series(name: str):
    def lower(ctx: Lowering, a):
        if name not in ("bessel_i0e", "bessel_i1e"):  # the scaled I have 16-bit kernels in ATen
            _no_16_bit(name, a)
        return pointwise(ctx, [a], lambda x: _in_float64(name, x), KIND.INT_TO_FLOAT)

    return lower


for _target, _name in {  # float64 Chebyshev series (gjit/kernels/bessel.py)
    aten.special_i0e.default: "bessel_i0e",
    aten.special_i1e.default: "bessel_i1e",
    aten.special_modified_bessel_k0.default: "bessel_k0",
    aten.special_modified_bessel_k1.default: "bessel_k1",
    aten.special_scaled_modified_bessel_k0.default: "bessel_k0e",
    aten.special_scaled_modified_bessel_k1.default: "bessel_k1e",
    aten.special_spherical_bessel_j0.default: "spherical_j0",
}.items():
    register_lowering(_target)(_bessel_series(_name))
