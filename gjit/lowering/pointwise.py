"""Pointwise lowerings: each ATen op becomes an expression over its (broadcast) inputs.

Arguments are read in the compute dtype that ATen's type promotion gives (fp16/bf16 math in
fp32) and the result is cast to the node's dtype once, at the store. Op names used here are
`gjit.ir.OPS`, which both kernel languages' emitter tables cover. Copies, casts, constants and
`cat` are in gjit/lowering/copies.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as KIND

from gjit.ir import Const, Expr, Op
from gjit.lowering.registry import (
    TensorValue,
    Unsupported,
    cast,
    load_as,
    promote,
    python_scalar,
    register_lowering,
    to_sympy,
)

if TYPE_CHECKING:  # the walk that calls the lowerings; it imports this module
    from gjit.lowering.graph import Lowering

aten = torch.ops.aten


def op(name: str, *args: Expr, dtype: torch.dtype | None = None) -> Op:
    return Op(dtype or args[0].dtype, name, tuple(args))


def const(value, like: Expr) -> Const:
    return Const(like.dtype, python_scalar(value, like.dtype))


def where(cond: Expr, a: Expr, b: Expr) -> Op:
    return Op(a.dtype, "where", (cond, a, b))


def pointwise(
    ctx: Lowering, args: list, fn: Callable[..., Expr], kind=KIND.DEFAULT, via_common: bool = False
) -> TensorValue:
    """Lower the current node as `fn(*args)` with ATen's promotion `kind`; `via_common`: the
    operands are first converted to their common dtype, as eager's comparisons do."""
    compute, _ = promote(args, kind)
    via = promote(args, KIND.DEFAULT)[1] if via_common else None
    out_size = tuple(to_sympy(s) for s in ctx.out_val.shape)
    return ctx.pointwise(
        lambda idx: fn(*(load_as(a, compute, idx, out_size, ctx.known_one, via) for a in args))
    )


def _is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point


# ----------------------------------------------------------------------------------------------
# Arithmetic
# ----------------------------------------------------------------------------------------------


@register_lowering(aten.add.Tensor, aten.add.Scalar)
def add(ctx: Lowering, a, b, *, alpha=1):
    def fn(x: Expr, y: Expr) -> Expr:
        if x.dtype == torch.bool:  # ATen's bool addition saturates: True + True is True
            return op("logical_or", x, op("logical_and", y, const(alpha, y)))
        if alpha == 1:
            return op("add", x, y)
        return op("add", x, op("mul", y, const(alpha, y)))

    return pointwise(ctx, [a, b], fn)


@register_lowering(aten.sub.Tensor, aten.sub.Scalar)
def sub(ctx: Lowering, a, b, *, alpha=1):
    if alpha == 1:
        return pointwise(ctx, [a, b], lambda x, y: op("sub", x, y))
    return pointwise(ctx, [a, b], lambda x, y: op("sub", x, op("mul", y, const(alpha, y))))


@register_lowering(aten.rsub.Scalar, aten.rsub.Tensor)
def rsub(ctx: Lowering, a, b, *, alpha=1):
    return pointwise(ctx, [a, b], lambda x, y: op("sub", y, op("mul", x, const(alpha, x))))


@register_lowering(aten.mul.Tensor, aten.mul.Scalar)
def mul(ctx: Lowering, a, b):
    return pointwise(ctx, [a, b], lambda x, y: op("mul", x, y))


@register_lowering(aten.div.Tensor, aten.div.Scalar)
def div(ctx: Lowering, a, b):
    return pointwise(ctx, [a, b], lambda x, y: op("truediv", x, y), KIND.INT_TO_FLOAT)


@register_lowering(aten.div.Tensor_mode, aten.div.Scalar_mode)
def div_mode(ctx: Lowering, a, b, *, rounding_mode=None):
    if rounding_mode is None:
        return div(ctx, a, b)

    def fn(x: Expr, y: Expr) -> Expr:
        if not _is_float(x.dtype):
            return op("floordiv" if rounding_mode == "floor" else "truncdiv", x, y)
        if rounding_mode == "trunc":
            return op("trunc", op("truediv", x, y))
        return _float_floordiv(x, y)

    return pointwise(ctx, [a, b], fn)


def _float_floordiv(x: Expr, y: Expr) -> Expr:
    """ATen's `div_floor_floating`: exact where floor(x / y) is not (1 // 0.1 == 9), NaN for
    infinite x, the signed zero of x / y for a zero quotient, and IEEE x / y for y == 0."""
    zero = const(0, x)
    quotient = op("truediv", x, y)
    mod = op("fmod", x, y)
    div = op("truediv", op("sub", x, mod), y)
    signs_differ = op(
        "ne", op("lt", y, zero, dtype=torch.bool), op("lt", mod, zero, dtype=torch.bool), dtype=torch.bool
    )
    adjust = op("logical_and", op("ne", mod, zero, dtype=torch.bool), signs_differ, dtype=torch.bool)
    div = where(adjust, op("sub", div, const(1, x)), div)
    floor = op("floor", div)
    floor = where(
        op("gt", op("sub", div, floor), const(0.5, x), dtype=torch.bool), op("add", floor, const(1, x)), floor
    )
    floor = where(op("ne", div, zero, dtype=torch.bool), floor, op("copysign", zero, quotient))
    return where(op("eq", y, zero, dtype=torch.bool), quotient, floor)


@register_lowering(aten.floor_divide.default, aten.floor_divide.Scalar)
def floor_divide(ctx: Lowering, a, b):
    return div_mode(ctx, a, b, rounding_mode="floor")


@register_lowering(aten.remainder.Tensor, aten.remainder.Scalar, aten.remainder.Scalar_Tensor)
def remainder(ctx: Lowering, a, b):
    return pointwise(ctx, [a, b], lambda x, y: op("remainder", x, y))


@register_lowering(aten.fmod.Tensor, aten.fmod.Scalar)
def fmod(ctx: Lowering, a, b):
    return pointwise(ctx, [a, b], lambda x, y: op("fmod", x, y))


@register_lowering(aten.neg.default)
def neg(ctx: Lowering, a):
    return pointwise(ctx, [a], lambda x: op("neg", x))


@register_lowering(aten.abs.default)
def abs_(ctx: Lowering, a):
    return pointwise(ctx, [a], lambda x: op("abs", x))


@register_lowering(aten.reciprocal.default)
def reciprocal(ctx: Lowering, a):
    return pointwise(ctx, [a], lambda x: op("truediv", const(1, x), x), KIND.INT_TO_FLOAT)


@register_lowering(aten.maximum.default, aten.minimum.default, aten.fmax.default, aten.fmin.default)
def max_min(ctx: Lowering, a, b):
    name = {"maximum": "maximum", "minimum": "minimum", "fmax": "fmax", "fmin": "fmin"}
    return pointwise(ctx, [a, b], lambda x, y: op(name[ctx.node.target.__name__.split(".")[0]], x, y))


@register_lowering(aten.pow.Tensor_Scalar)
def pow_tensor_scalar(ctx: Lowering, a, exponent):
    if isinstance(exponent, (torch.SymInt, torch.SymFloat)):
        return pow_tensor_tensor(ctx, a, exponent)
    e = float(exponent)

    def fn(x: Expr) -> Expr:
        if e == int(e) and 0 <= e <= 4:
            result: Expr = const(1, x)
            for _ in range(int(e)):
                result = x if isinstance(result, Const) else op("mul", result, x)
            return result
        if not _is_float(x.dtype):
            if e == int(e) and e < 0:
                raise Unsupported("integer tensor to a negative integer power")
            return op("pow", cast(x, torch.float64), Const(torch.float64, e), dtype=torch.float64)
        if e == 0.5:
            return op("sqrt", x)
        if e == -0.5:
            return op("rsqrt", x)
        if e == -1:
            return op("truediv", const(1, x), x)
        if e == -2:
            return op("truediv", const(1, x), op("mul", x, x))
        return op("pow", x, const(e, x))

    return pointwise(ctx, [a], fn, KIND.BOOL_TO_LONG)


@register_lowering(aten.pow.Tensor_Tensor, aten.pow.Scalar)
def pow_tensor_tensor(ctx: Lowering, a, b):
    def fn(x: Expr, y: Expr) -> Expr:
        if not _is_float(x.dtype):
            raise Unsupported("integer pow with a tensor exponent")
        return op("pow", x, y)

    return pointwise(ctx, [a, b], fn, KIND.BOOL_TO_LONG)


@register_lowering(aten.atan2.default)
def atan2(ctx: Lowering, a, b):
    return pointwise(ctx, [a, b], lambda x, y: op("atan2", x, y), KIND.INT_TO_FLOAT)


@register_lowering(aten.copysign.Tensor, aten.copysign.Scalar)
def copysign(ctx: Lowering, a, b):
    return pointwise(ctx, [a, b], lambda x, y: op("copysign", x, y), KIND.INT_TO_FLOAT)


# ----------------------------------------------------------------------------------------------
# Unary math: same-named IR ops; ints promote to float where ATen does.
# ----------------------------------------------------------------------------------------------

_FLOAT_UNARY = [
    "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "sin", "cos", "tan",
    "tanh", "sinh", "cosh", "asin", "acos", "atan", "asinh", "acosh", "atanh", "sigmoid", "erf",
    "erfinv",
]  # fmt: skip


def unary(name: str, kind=KIND.INT_TO_FLOAT):
    def lower(ctx: Lowering, a):
        return pointwise(ctx, [a], lambda x: op(name, x), kind)

    return lower


for _name in _FLOAT_UNARY:
    register_lowering(getattr(aten, _name).default)(unary(_name))


def _rounding(name: str):
    def lower(ctx: Lowering, a):
        # integer inputs round to themselves
        return pointwise(ctx, [a], lambda x: op(name, x) if _is_float(x.dtype) else x)

    return lower


for _name in ("floor", "ceil", "trunc", "round", "frac"):
    register_lowering(getattr(aten, _name).default)(_rounding(_name))


@register_lowering(aten.round.decimals)
def round_decimals(ctx: Lowering, a, *, decimals: int = 0):
    """Eager's formula in its opmath dtype: rint(x * 10**d) / 10**d, or rint(x / 10**-d) * 10**-d
    for negative d (ties to even, like round)."""
    if not _is_float(a.dtype):
        raise Unsupported(f"round(decimals=) of {a.dtype}")
    compute = torch.float64 if a.dtype == torch.float64 else torch.float32
    scale = Const(compute, float(torch.tensor(10.0 ** abs(decimals), dtype=compute).item()))

    def fn(x: Expr) -> Expr:
        x = cast(x, compute)
        if decimals < 0:
            return op("mul", op("round", op("truediv", x, scale)), scale)
        return op("truediv", op("round", op("mul", x, scale)), scale)

    return pointwise(ctx, [a], fn)


@register_lowering(aten.sign.default)
def sign(ctx: Lowering, a):
    def fn(x: Expr) -> Expr:
        if x.dtype == torch.bool:
            return x
        # (0 < x) - (x < 0): NaN has sign 0 in ATen
        zero = const(0, x)
        pos = cast(op("gt", x, zero, dtype=torch.bool), x.dtype)
        neg_ = cast(op("lt", x, zero, dtype=torch.bool), x.dtype)
        return op("sub", pos, neg_)

    return pointwise(ctx, [a], fn)


@register_lowering(aten.isnan.default, aten.isinf.default, aten.signbit.default, aten.isfinite.default)
def float_predicate(ctx: Lowering, a):
    name = ctx.node.target.__name__.split(".")[0]
    if not a.dtype.is_floating_point:
        value = name == "isfinite"
        return ctx.pointwise(
            lambda idx: (
                Const(torch.bool, value)
                if name != "signbit"
                else op("lt", a.load(idx), Const(a.dtype, 0), dtype=torch.bool)
            )
        )
    return pointwise(ctx, [a], lambda x: op(name, x, dtype=torch.bool), KIND.ALWAYS_BOOL)


# ----------------------------------------------------------------------------------------------
# Comparisons, logical and bitwise ops
# ----------------------------------------------------------------------------------------------


for _name in ("eq", "ne", "lt", "le", "gt", "ge"):

    def _cmp(ctx: Lowering, a, b, _name=_name):
        return pointwise(
            ctx, [a, b], lambda x, y: op(_name, x, y, dtype=torch.bool), KIND.ALWAYS_BOOL, via_common=True
        )

    register_lowering(getattr(aten, _name).Tensor, getattr(aten, _name).Scalar)(_cmp)


def _truth(x: Expr) -> Expr:
    return x if x.dtype == torch.bool else op("ne", x, const(0, x), dtype=torch.bool)


@register_lowering(aten.logical_and.default, aten.logical_or.default, aten.logical_xor.default)
def logical_binary(ctx: Lowering, a, b):
    name = ctx.node.target.__name__.split(".")[0]
    return pointwise(
        ctx, [a, b], lambda x, y: op(name, _truth(x), _truth(y), dtype=torch.bool), KIND.ALWAYS_BOOL
    )


@register_lowering(aten.logical_not.default)
def logical_not(ctx: Lowering, a):
    return pointwise(ctx, [a], lambda x: op("logical_not", _truth(x), dtype=torch.bool), KIND.ALWAYS_BOOL)


_BITWISE = {
    "bitwise_and": "bitwise_and",
    "bitwise_or": "bitwise_or",
    "bitwise_xor": "bitwise_xor",
    "__and__": "bitwise_and",
    "__or__": "bitwise_or",
    "__xor__": "bitwise_xor",
    "__lshift__": "lshift",
    "__rshift__": "rshift",
    "bitwise_left_shift": "lshift",
    "bitwise_right_shift": "rshift",
}


def _bitwise(ctx: Lowering, a, b):
    name = _BITWISE[ctx.node.target.__name__.split(".")[0]]

    def fn(x: Expr, y: Expr) -> Expr:
        if _is_float(x.dtype):
            raise Unsupported(f"{name} on floating point")
        if x.dtype == torch.bool and name in ("lshift", "rshift"):
            raise Unsupported("shift of bool")
        return op(name, x, y)

    return pointwise(ctx, [a, b], fn)


for _base, _overloads in {
    "bitwise_and": ("Tensor", "Scalar"),
    "bitwise_or": ("Tensor", "Scalar"),
    "bitwise_xor": ("Tensor", "Scalar"),
    "__lshift__": ("Tensor", "Scalar"),
    "__rshift__": ("Tensor", "Scalar"),
    "bitwise_left_shift": ("Tensor",),
    "bitwise_right_shift": ("Tensor",),
}.items():
    for _ov in _overloads:
        register_lowering(getattr(getattr(aten, _base), _ov))(_bitwise)


@register_lowering(aten.bitwise_not.default)
def bitwise_not(ctx: Lowering, a):
    return pointwise(ctx, [a], lambda x: op("logical_not" if x.dtype == torch.bool else "bitwise_not", x))


# ----------------------------------------------------------------------------------------------
# Selection and clamping (NaN propagates as in eager)
# ----------------------------------------------------------------------------------------------


@register_lowering(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def where_self(ctx: Lowering, cond, a, b):
    compute, _ = promote([a, b], KIND.NO_OPMATH)
    out_size = tuple(to_sympy(s) for s in ctx.out_val.shape)
    return ctx.pointwise(
        lambda idx: where(
            _truth(load_as(cond, torch.bool, idx, out_size, ctx.known_one)),
            load_as(a, compute, idx, out_size, ctx.known_one),
            load_as(b, compute, idx, out_size, ctx.known_one),
        )
    )


def _clamp_expr(x: Expr, lo: Expr | None, hi: Expr | None) -> Expr:
    # min(max(x, lo), hi) with NaN-propagating max/min: a NaN input or bound gives NaN, as in
    # eager, and lo > hi gives hi
    if lo is not None:
        x = op("maximum", x, lo)
    if hi is not None:
        x = op("minimum", x, hi)
    return x


@register_lowering(aten.clamp.default, aten.clamp.Tensor)
def clamp(ctx: Lowering, a, min=None, max=None):
    args = [a] + [v for v in (min, max) if v is not None]

    def fn(x: Expr, *bounds: Expr) -> Expr:
        it = iter(bounds)
        return _clamp_expr(x, next(it) if min is not None else None, next(it) if max is not None else None)

    return pointwise(ctx, args, fn)


@register_lowering(aten.clamp_min.default, aten.clamp_min.Tensor)
def clamp_min(ctx: Lowering, a, bound):
    return clamp(ctx, a, min=bound)


@register_lowering(aten.clamp_max.default, aten.clamp_max.Tensor)
def clamp_max(ctx: Lowering, a, bound):
    return clamp(ctx, a, max=bound)


@register_lowering(aten.relu.default)
def relu(ctx: Lowering, a):
    return pointwise(ctx, [a], lambda x: where(op("lt", x, const(0, x), dtype=torch.bool), const(0, x), x))


@register_lowering(aten.hardtanh.default)
def hardtanh(ctx: Lowering, a, min_val=-1.0, max_val=1.0):
    return pointwise(ctx, [a], lambda x: _clamp_expr(x, const(min_val, x), const(max_val, x)))


@register_lowering(aten.nan_to_num.default)
def nan_to_num(ctx: Lowering, a, nan=0.0, posinf=None, neginf=None):
    if not a.dtype.is_floating_point:
        return pointwise(ctx, [a], lambda x: x)
    info = torch.finfo(a.dtype)
    posinf = info.max if posinf is None else posinf
    neginf = info.min if neginf is None else neginf

    def fn(x: Expr) -> Expr:
        x = where(op("isnan", x, dtype=torch.bool), const(nan, x), x)
        x = where(op("eq", x, const(math.inf, x), dtype=torch.bool), const(posinf, x), x)
        return where(op("eq", x, const(-math.inf, x), dtype=torch.bool), const(neginf, x), x)

    return pointwise(ctx, [a], fn)


# ----------------------------------------------------------------------------------------------
# Activations that core ATen keeps as single ops
# ----------------------------------------------------------------------------------------------


@register_lowering(aten.gelu.default)
def gelu(ctx: Lowering, a, *, approximate="none"):
    def fn(x: Expr) -> Expr:
        half = op("mul", x, const(0.5, x))
        if approximate == "tanh":
            cube = op("mul", op("mul", x, x), x)
            inner = op(
                "mul", op("add", x, op("mul", cube, const(0.044715, x))), const(math.sqrt(2 / math.pi), x)
            )
            return op("mul", half, op("add", const(1, x), op("tanh", inner)))
        return op("mul", half, op("add", const(1, x), op("erf", op("mul", x, const(math.sqrt(0.5), x)))))

    return pointwise(ctx, [a], fn)


@register_lowering(aten.silu.default)
def silu(ctx: Lowering, a):
    return pointwise(ctx, [a], lambda x: op("mul", x, op("sigmoid", x)))


@register_lowering(aten.leaky_relu.default)
def leaky_relu(ctx: Lowering, a, negative_slope=0.01):
    return pointwise(
        ctx,
        [a],
        lambda x: where(
            op("gt", x, const(0, x), dtype=torch.bool), x, op("mul", x, const(negative_slope, x))
        ),
    )


@register_lowering(aten.elu.default)
def elu(ctx: Lowering, a, alpha=1.0, scale=1.0, input_scale=1.0):
    def fn(x: Expr) -> Expr:
        negative = op("mul", op("expm1", op("mul", x, const(input_scale, x))), const(alpha * scale, x))
        return where(op("gt", x, const(0, x), dtype=torch.bool), op("mul", x, const(scale, x)), negative)

    return pointwise(ctx, [a], fn)


@register_lowering(aten.softplus.default)
def softplus(ctx: Lowering, a, beta=1.0, threshold=20.0):
    def fn(x: Expr) -> Expr:
        scaled = op("mul", x, const(beta, x))
        soft = op("truediv", op("log1p", op("exp", scaled)), const(beta, x))
        return where(op("gt", scaled, const(threshold, x), dtype=torch.bool), x, soft)

    return pointwise(ctx, [a], fn)
