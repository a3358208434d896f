"""Lowerings of copies, casts, constants and `cat`: a clone or `_to_copy` is a pointwise read, a
`full`/`arange` an expression of the index, `cat` a masked read of each input.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import sympy
import torch

from gjit.ir import Const, Expr, Index, IndexValue, Masked
from gjit.lowering.pointwise import op, where
from gjit.lowering.registry import (
    TensorValue,
    Unsupported,
    cast,
    python_scalar,
    register_lowering,
    to_sympy,
)

if TYPE_CHECKING:  # the walk that calls the lowerings; it imports this module
    from gjit.lowering.graph import Lowering

aten = torch.ops.aten


@register_lowering(aten.clone.default)
def clone(ctx: Lowering, a, *, memory_format=None):
    return ctx.pointwise(lambda idx: a.load(idx))


@register_lowering(aten._to_copy.default)
def to_copy(
    ctx: Lowering,
    a,
    *,
    dtype=None,
    layout=None,
    device=None,
    pin_memory=None,
    non_blocking=False,
    memory_format=None,
):
    if device is not None and torch.device(device) != ctx.out_val.device:
        raise Unsupported("device copy")
    if ctx.node.args[0].meta["val"].device != ctx.out_val.device:
        raise Unsupported("device copy")
    target = ctx.out_val.dtype
    return ctx.pointwise(lambda idx: cast(a.load(idx), target))


def _full(ctx: Lowering, value) -> TensorValue:
    dtype = ctx.out_val.dtype
    if isinstance(value, (torch.SymInt, torch.SymFloat)):
        return ctx.pointwise(lambda idx: cast(IndexValue(torch.int64, to_sympy(value)), dtype))
    return ctx.pointwise(lambda idx: Const(dtype, python_scalar(value, dtype)))


@register_lowering(aten.full.default)
def full(ctx: Lowering, size, fill_value, **kwargs):
    return _full(ctx, fill_value)


@register_lowering(aten.full_like.default)
def full_like(ctx: Lowering, a, fill_value, **kwargs):
    return _full(ctx, fill_value)


@register_lowering(aten.scalar_tensor.default)
def scalar_tensor(ctx: Lowering, value, **kwargs):
    return _full(ctx, value)


@register_lowering(aten.zeros_like.default, aten.zeros.default)
def zeros(ctx: Lowering, *args, **kwargs):
    return _full(ctx, 0)


@register_lowering(aten.ones_like.default, aten.ones.default)
def ones(ctx: Lowering, *args, **kwargs):
    return _full(ctx, 1)


@register_lowering(aten.arange.start_step, aten.arange.start, aten.arange.default)
def arange(ctx: Lowering, *args, **kwargs):
    numbers = [a for a in args]
    start, step = (0, 1)
    if len(numbers) >= 2:
        start = numbers[0]
    if len(numbers) >= 3:
        step = numbers[2]
    dtype = ctx.out_val.dtype
    if not all(isinstance(v, (int, torch.SymInt)) for v in (start, step)):
        if not dtype.is_floating_point:
            raise Unsupported("arange with float bounds and an integer dtype")
        return ctx.pointwise(
            lambda idx: op(
                "add",
                Const(torch.float64, float(start)),
                op(
                    "mul",
                    cast(IndexValue(torch.int64, idx[0]), torch.float64),
                    Const(torch.float64, float(step)),
                ),
            )
        )
    return ctx.pointwise(
        lambda idx: cast(IndexValue(torch.int64, to_sympy(start) + to_sympy(step) * idx[0]), dtype)
    )


@register_lowering(aten.cat.default)
def cat(ctx: Lowering, tensors: list, dim: int = 0):
    out = ctx.out_val
    rank = out.dim()
    dim = dim + rank if dim < 0 else dim
    parts = [t for t in tensors if not (len(t.size) == 1 and t.size[0] == 0)]  # legacy empty 1-D inputs
    dtype = out.dtype

    def body(idx: Index) -> Expr:
        offsets = []
        start = sympy.Integer(0)
        for t in parts:
            offsets.append(start)
            start = start + t.size[dim]
        value: Expr | None = None
        for t, begin in reversed(list(zip(parts, offsets))):
            end = begin + t.size[dim]
            shifted = idx[:dim] + (idx[dim] - begin,) + idx[dim + 1 :]
            inside = sympy.And(sympy.Ge(idx[dim], begin), sympy.Lt(idx[dim], end))
            part = Masked(dtype, inside, cast(t.load(shifted), dtype), python_scalar(0, dtype))
            value = (
                part if value is None else where(IndexValue(torch.bool, sympy.Lt(idx[dim], end)), part, value)
            )
        return value

    if not parts:
        raise Unsupported("cat of only empty tensors")
    return ctx.pointwise(body)
