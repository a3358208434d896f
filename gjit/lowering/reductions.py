"""Reduction lowerings: sum/mean/amax/amin/prod/any, var/var_mean, softmax, log_softmax,
layer_norm, group_norm and vector norms become ReduceNodes plus pointwise nodes around them;
fusion puts each into one kernel (group_norm into two: its output is not in the grouped space).
Reduced-precision inputs accumulate in float32, as eager does; variance is the mean, then the sum
of squared deviations from it (two levels; a looped kernel folds them into one pass, Welford).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import sympy
import torch
from torch.utils._sympy.functions import FloorDiv

from gjit.ir import Const, Expr, Index, IndexValue
from gjit.lowering.pointwise import op
from gjit.lowering.registry import (
    TensorValue,
    Unsupported,
    ViewValue,
    cast,
    contiguous_layout,
    meta_layout,
    register_lowering,
)

if TYPE_CHECKING:  # the walk that calls the lowerings; it imports this module
    from gjit.lowering.graph import Lowering

aten = torch.ops.aten


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype eager accumulates `dtype` in."""
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    if dtype == torch.bool or not dtype.is_floating_point:
        return torch.int64
    return dtype


def reduced_dims(dims, rank: int) -> tuple[int, ...]:
    if rank == 0:  # a 0-d tensor reduces over dim 0 or -1 as over nothing: it is its own result
        return ()
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return tuple(range(rank))
    if isinstance(dims, int):
        dims = [dims]
    return tuple(sorted({d + rank if d < 0 else d for d in dims}))


def count(x: TensorValue, dims: tuple[int, ...], dtype: torch.dtype) -> Expr:
    n = sympy.Mul(*[x.size[d] for d in dims]) if dims else sympy.Integer(1)
    return cast(IndexValue(torch.int64, n), dtype)


def keep_index(dims: tuple[int, ...], idx: Index) -> Index:
    """Index of a keepdim reduction result read from full-space index `idx` (broadcast)."""
    return tuple(sympy.Integer(0) if k in dims else v for k, v in enumerate(idx))


def _reduce(ctx: Lowering, x: TensorValue, dims, keepdim: bool, reduce_type: str, dtype=None) -> TensorValue:
    dims = reduced_dims(dims, len(x.size))
    out = ctx.out_val
    acc = acc_dtype(dtype or out.dtype) if reduce_type in ("sum", "prod") else acc_dtype(x.dtype)
    if reduce_type in ("max", "min"):
        acc = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.bool: torch.int32}.get(
            x.dtype, x.dtype
        )
    if not x.size:  # a 0-d tensor is its own sum, product, max and min
        return ctx.pointwise(lambda idx: cast(x.load(()), acc))
    return ctx.reduction(
        lambda idx: cast(x.load(idx), acc),
        x.size,
        dims,
        reduce_type,
        out.dtype,
        keepdim,
        layout=meta_layout(out),
    )


# The no-dim overloads (sum.default, ...) reduce everything: dims=None.
@register_lowering(aten.sum.dim_IntList, aten.sum.default)
def sum_(ctx: Lowering, x: TensorValue, dims=None, keepdim: bool = False, *, dtype=None):
    return _reduce(ctx, x, dims, keepdim, "sum", dtype)


@register_lowering(aten.prod.dim_int, aten.prod.default)
def prod(ctx: Lowering, x: TensorValue, dim=None, keepdim: bool = False, *, dtype=None):
    return _reduce(ctx, x, dim, keepdim, "prod", dtype)


@register_lowering(aten.amax.default)
def amax(ctx: Lowering, x: TensorValue, dims=(), keepdim: bool = False):
    return _reduce(ctx, x, dims, keepdim, "max")


@register_lowering(aten.amin.default)
def amin(ctx: Lowering, x: TensorValue, dims=(), keepdim: bool = False):
    return _reduce(ctx, x, dims, keepdim, "min")


@register_lowering(aten.max.default, aten.min.default)
def max_all(ctx: Lowering, x: TensorValue):
    """max()/min() without a dim: the extreme of every element (eager refuses an empty tensor)."""
    return _reduce(ctx, x, None, False, "max" if ctx.node.target is aten.max.default else "min")


def _any(ctx: Lowering, x: TensorValue, dims, keepdim: bool, negate: bool) -> TensorValue:
    dims = reduced_dims(dims, len(x.size))

    def truth(idx: Index) -> Expr:
        v = x.load(idx)
        t = v if v.dtype == torch.bool else op("ne", v, Const(v.dtype, 0), dtype=torch.bool)
        return cast(op("logical_not", t) if negate else t, torch.int32)

    # an empty row's max is the identity (INT_MIN): compare with > 0, so any() of nothing is False
    # and all() of nothing is True, as in eager
    suffix = "_any_false" if negate else "_any_true"
    found = ctx.reduction(truth, x.size, dims, "max", torch.int32, keepdim, suffix=suffix)
    name = "le" if negate else "gt"
    return ctx.pointwise(lambda idx: op(name, found.load(idx), Const(torch.int32, 0), dtype=torch.bool))


@register_lowering(aten.any.dim, aten.any.dims, aten.any.default)
def any_(ctx: Lowering, x: TensorValue, dim=None, keepdim: bool = False):
    return _any(ctx, x, dim, keepdim, negate=False)


@register_lowering(aten.all.dim, aten.all.dims, aten.all.default)
def all_(ctx: Lowering, x: TensorValue, dim=None, keepdim: bool = False):
    return _any(ctx, x, dim, keepdim, negate=True)


@register_lowering(aten.argmax.default, aten.argmin.default)
def argmax(ctx: Lowering, x: TensorValue, dim=None, keepdim: bool = False):
    """Index of the first max (min); NaN counts as the max, as in eager. dim=None: flattened."""
    if len(x.size) == 0:  # the one element is the extreme
        return ctx.pointwise(lambda idx: Const(torch.int64, 0))
    dims = reduced_dims(dim, len(x.size))
    acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    kind = "argmax" if ctx.node.target is aten.argmax.default else "argmin"
    keep = keepdim and dim is not None
    layout = meta_layout(ctx.out_val)
    return ctx.reduction(
        lambda idx: cast(x.load(idx), acc), x.size, dims, kind, torch.int64, keep, layout=layout
    )


@register_lowering(aten.max.dim, aten.min.dim)
def max_dim(ctx: Lowering, x: TensorValue, dim: int, keepdim: bool = False):
    """Values and indices of the max (min) along `dim`: two reductions over the same rows, which
    fusion puts in one kernel. The index is the first extreme's, and NaN counts as the max (and
    the min), as in eager."""
    if x.dtype == torch.bool:
        raise Unsupported("max/min of a bool tensor along a dim")
    out_values, out_indices = ctx.out_val
    if len(x.size) == 0:  # the one element and its index
        return [
            ctx.pointwise(lambda idx: x.load(()), meta_layout(out_values), "_values"),
            ctx.pointwise(lambda idx: Const(torch.int64, 0), meta_layout(out_indices), "_indices"),
        ]
    dims = reduced_dims(dim, len(x.size))
    acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    kind = "max" if ctx.node.target is aten.max.dim else "min"
    values = ctx.reduction(
        lambda idx: cast(x.load(idx), acc),
        x.size,
        dims,
        kind,
        out_values.dtype,
        keepdim,
        layout=meta_layout(out_values),
        suffix="_values",
    )
    indices = ctx.reduction(
        lambda idx: cast(x.load(idx), acc),
        x.size,
        dims,
        f"arg{kind}",
        torch.int64,
        keepdim,
        layout=meta_layout(out_indices),
        suffix="_indices",
    )
    return [values, indices]


@register_lowering(aten.mean.dim, aten.mean.default)
def mean(ctx: Lowering, x: TensorValue, dims=None, keepdim: bool = False, *, dtype=None):
    out = ctx.out_val
    acc = acc_dtype(dtype or out.dtype)
    dims = reduced_dims(dims, len(x.size))
    total = ctx.reduction(
        lambda idx: cast(x.load(idx), acc), x.size, dims, "sum", acc, keepdim, suffix="_sum"
    )
    return ctx.pointwise(lambda idx: op("truediv", total.load(idx), count(x, dims, acc)))


def _mean_and_var(
    ctx: Lowering, x: TensorValue, dims: tuple[int, ...], correction
) -> tuple[TensorValue, TensorValue]:
    """The mean, then the mean squared deviation from it, in the accumulation dtype, both keepdim
    (so full-space reads broadcast). Two levels in the IR; a looped kernel computes both in one
    pass over the row (Welford, codegen/online.py)."""
    acc = acc_dtype(x.dtype)
    if not acc.is_floating_point:
        raise Unsupported("variance of an integer tensor")
    n = count(x, dims, acc)
    total = ctx.reduction(lambda idx: cast(x.load(idx), acc), x.size, dims, "sum", acc, True, suffix="_sum")
    keep = contiguous_layout(total.size, acc)
    mean_ = ctx.pointwise(lambda idx: op("truediv", total.load(idx), n), keep, suffix="_mean")

    def square_dev(idx: Index) -> Expr:
        d = op("sub", cast(x.load(idx), acc), mean_.load(keep_index(dims, idx)))
        return op("mul", d, d)

    sq = ctx.reduction(square_dev, x.size, dims, "sum", acc, True, suffix="_m2")
    denom = op("sub", n, Const(acc, float(correction)))
    denom = op("maximum", denom, Const(acc, 0.0))
    var = ctx.pointwise(lambda idx: op("truediv", sq.load(idx), denom), keep, suffix="_var")
    return mean_, var


def _squeeze_to(ctx: Lowering, value: TensorValue, dims, keepdim: bool, out: torch.Tensor, suffix: str):
    """The keepdim value `value` as the node's own output (dropping reduced dims, casting)."""
    layout = meta_layout(out)

    def body(idx: Index) -> Expr:
        full = list(idx)
        if not keepdim:
            it = iter(idx)
            full = [sympy.Integer(0) if k in dims else next(it) for k in range(len(value.size))]
        return cast(value.load(tuple(full)), layout.dtype)

    return ctx.pointwise(body, layout, suffix=suffix)


@register_lowering(aten.var.correction)
def var(ctx: Lowering, x: TensorValue, dims=None, *, correction=None, keepdim: bool = False):
    dims = reduced_dims(dims, len(x.size))
    _, v = _mean_and_var(ctx, x, dims, 1 if correction is None else correction)
    return _squeeze_to(ctx, v, dims, keepdim, ctx.out_val, "")


@register_lowering(aten.var_mean.correction)
def var_mean(ctx: Lowering, x: TensorValue, dims=None, *, correction=None, keepdim: bool = False):
    dims = reduced_dims(dims, len(x.size))
    m, v = _mean_and_var(ctx, x, dims, 1 if correction is None else correction)
    out_var, out_mean = ctx.out_val
    return [
        _squeeze_to(ctx, v, dims, keepdim, out_var, "_out_var"),
        _squeeze_to(ctx, m, dims, keepdim, out_mean, "_out_mean"),
    ]


def _softmax_parts(ctx: Lowering, x: TensorValue, dim: int, what: str):
    """The max-subtracted input and the sum of its exponentials, shared by softmax and log_softmax."""
    if len(x.size) == 0:
        raise Unsupported(f"{what} of a 0-d tensor")
    acc = acc_dtype(x.dtype)
    dims = reduced_dims(dim, len(x.size))
    if not dims:
        dims = ()
    peak = ctx.reduction(lambda idx: cast(x.load(idx), acc), x.size, dims, "max", acc, True, suffix="_max")

    def shifted(idx: Index) -> Expr:
        return op("sub", cast(x.load(idx), acc), peak.load(keep_index(dims, idx)))

    total = ctx.reduction(lambda idx: op("exp", shifted(idx)), x.size, dims, "sum", acc, True, suffix="_sum")
    return dims, shifted, total


@register_lowering(aten._softmax.default)
def softmax(ctx: Lowering, x: TensorValue, dim: int, half_to_float: bool):
    dims, shifted, total = _softmax_parts(ctx, x, dim, "softmax")
    return ctx.pointwise(
        lambda idx: op("truediv", op("exp", shifted(idx)), total.load(keep_index(dims, idx)))
    )


@register_lowering(aten._log_softmax.default)
def log_softmax(ctx: Lowering, x: TensorValue, dim: int, half_to_float: bool):
    dims, shifted, total = _softmax_parts(ctx, x, dim, "log_softmax")
    return ctx.pointwise(lambda idx: op("sub", shifted(idx), op("log", total.load(keep_index(dims, idx)))))


@register_lowering(aten.native_layer_norm.default)
def layer_norm(ctx: Lowering, x: TensorValue, normalized_shape, weight, bias, eps: float):
    rank = len(x.size)
    dims = tuple(range(rank - len(normalized_shape), rank))
    lead = rank - len(normalized_shape)
    m, rstd, normalized = _normalize(ctx, x, x, dims, eps, lambda idx: keep_index(dims, idx), weight, bias,
                                     lambda idx: idx[lead:])  # fmt: skip
    out, out_mean, out_rstd = ctx.out_val
    return [
        ctx.pointwise(normalized, meta_layout(out), suffix=""),
        _squeeze_to(ctx, m, dims, True, out_mean, "_out_mean"),
        _squeeze_to(ctx, rstd, dims, True, out_rstd, "_out_rstd"),
    ]


def _normalize(
    ctx: Lowering, x: TensorValue, seen: TensorValue, dims, eps: float, at, weight, bias, param_at
):
    """layer_norm and group_norm: the moments of `seen` (x, or a view of it) over `dims`, rstd,
    and the body of the normalized x; `at` maps x's index to the statistics', `param_at` to
    weight's and bias'."""
    acc = acc_dtype(x.dtype)
    m, v = _mean_and_var(ctx, seen, dims, 0)
    keep = contiguous_layout(m.size, acc)
    rstd = ctx.pointwise(
        lambda idx: op("rsqrt", op("add", v.load(idx), Const(acc, float(eps)))), keep, "_rstd"
    )

    def normalized(idx: Index) -> Expr:
        y = op("mul", op("sub", cast(x.load(idx), acc), m.load(at(idx))), rstd.load(at(idx)))
        if weight is not None:
            y = op("mul", y, cast(weight.load(param_at(idx)), acc))
        if bias is not None:
            y = op("add", y, cast(bias.load(param_at(idx)), acc))
        return y

    return m, rstd, normalized


@register_lowering(aten._native_batch_norm_legit_no_training.default)
def batch_norm_inference(
    ctx: Lowering, x: TensorValue, weight, bias, running_mean, running_var, momentum, eps
):
    """Eval-mode batch norm is pointwise: per-channel (dim 1) statistics are inputs."""
    if len(x.size) < 2:
        raise Unsupported("batch norm of a tensor without a channel dim")
    acc = acc_dtype(x.dtype)
    out, save_mean, save_rstd = ctx.out_val

    def channel(t: TensorValue, idx: Index) -> Expr:
        return cast(t.load((idx[1],)), acc)

    def body(idx: Index) -> Expr:
        rstd = op("rsqrt", op("add", channel(running_var, idx), Const(acc, float(eps))))
        y = op("mul", op("sub", cast(x.load(idx), acc), channel(running_mean, idx)), rstd)
        if weight is not None:
            y = op("mul", y, channel(weight, idx))
        if bias is not None:
            y = op("add", y, channel(bias, idx))
        return y

    empty = [ctx.pointwise(lambda idx, v=v: Const(v.dtype, 0), meta_layout(v), suffix=f"_empty{k}")
             for k, v in enumerate((save_mean, save_rstd))]  # fmt: skip
    return [ctx.pointwise(body, meta_layout(out)), *empty]


@register_lowering(aten.native_group_norm.default)
def group_norm(ctx: Lowering, x: TensorValue, weight, bias, n, c, hxw, groups: int, eps: float):
    """Statistics per (sample, group of channels): the input seen as [N, G, C/G, *spatial], reduced
    over all but the first two dims, like layer_norm; weight and bias are per channel."""
    rank = len(x.size)
    if rank < 2:
        raise Unsupported("group_norm of a tensor without a channel dim")
    per = FloorDiv(x.size[1], groups)  # the op's meta checked that the groups divide the channels
    grouped = ViewValue(
        x.name, (x.size[0], sympy.Integer(groups), per, *x.size[2:]), x.dtype, x,
        lambda idx: (idx[0], idx[1] * per + idx[2], *idx[3:]),
    )  # fmt: skip
    dims = tuple(range(2, rank + 1))
    at = lambda idx: (idx[0], FloorDiv(idx[1], per), *[sympy.Integer(0)] * (rank - 1))
    m, rstd, normalized = _normalize(ctx, x, grouped, dims, eps, at, weight, bias, lambda idx: (idx[1],))
    out, out_mean, out_rstd = ctx.out_val
    return [
        ctx.pointwise(normalized, meta_layout(out)),
        _squeeze_to(ctx, m, dims, False, out_mean, "_out_mean"),
        _squeeze_to(ctx, rstd, dims, False, out_rstd, "_out_rstd"),
    ]


@register_lowering(aten.linalg_vector_norm.default)
def vector_norm(ctx: Lowering, x: TensorValue, ord=2, dim=None, keepdim: bool = False, *, dtype=None):
    """ord 2 (sqrt of the sum of squares), 1, inf, -inf, 0 (the count of nonzeros) and any other p
    (the sum of |x|**p, to the power 1/p), as eager computes them. A 0-d tensor is one element."""
    out = ctx.out_val
    acc = acc_dtype(dtype or out.dtype)
    if not acc.is_floating_point or not isinstance(ord, (int, float)):
        raise Unsupported(f"vector_norm of ord {ord} for {x.dtype}")
    size, load = x.size, x.load
    if len(x.size) == 0:  # one element, reduced over a dim of 1
        size, load = (sympy.Integer(1),), lambda idx: x.load(())
    dims = reduced_dims(dim, len(size))

    def term(idx: Index) -> Expr:
        value = cast(load(idx), acc)
        if ord == 0:
            return cast(op("ne", value, Const(acc, 0.0), dtype=torch.bool), acc)
        a = op("abs", value)
        if ord in (1, float("inf"), float("-inf")):
            return a
        return op("mul", a, a) if ord == 2 else op("pow", a, Const(acc, float(ord)))

    kind = {float("inf"): "max", float("-inf"): "min"}.get(ord, "sum")
    total = ctx.reduction(term, size, dims, kind, acc, keepdim and bool(x.size), suffix="_total")
    if ord in (0, 1, float("inf"), float("-inf")):
        return ctx.pointwise(lambda idx: total.load(idx))
    if ord == 2:
        return ctx.pointwise(lambda idx: op("sqrt", total.load(idx)))
    return ctx.pointwise(lambda idx: op("pow", total.load(idx), Const(acc, 1.0 / ord)))
