"""Lowerings of copies, casts, constants, `cat` and `repeat`: a clone or `_to_copy` is a pointwise
read, a `full`/`arange` an expression of the index, `cat` a masked read of each input, `repeat`
(and `tile`, which export turns into it) a read at the index modulo the input's size, and
slice/select/diagonal_scatter a read of the source inside the view, of the input elsewhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import sympy
import torch
from torch.utils._sympy.functions import FloorDiv, ModularIndexing

from gjit.ir import Const, Expr, Index, IndexValue, Masked
from gjit.lowering.pointwise import op, where
from gjit.lowering.registry import (
    TensorValue,
    Unsupported,
    cast,
    load_as,
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


@register_lowering(aten.copy.default)
def copy(ctx: Lowering, x, src, non_blocking: bool = False):
    """The functional copy_ (what export makes of x[...] = y): src broadcast to x's shape, in x's dtype."""
    out_size = tuple(to_sympy(s) for s in ctx.out_val.shape)
    return ctx.pointwise(lambda idx: load_as(src, src.dtype, idx, out_size, ctx.known_one))


@register_lowering(aten.repeat.default)
def repeat(ctx: Lowering, a, repeats):
    """Output element i reads the input at i mod its size, dim by dim (the input's dims align
    with the last ones of the output; leading output dims only repeat)."""
    lead = len(repeats) - len(a.size)
    if lead < 0:
        raise Unsupported(f"repeat with {len(repeats)} repeats for {len(a.size)} dims")

    def at(i: sympy.Expr, size: sympy.Expr, times) -> sympy.Expr:
        if size == 1:
            return sympy.Integer(0)
        return i if to_sympy(times) == 1 else ModularIndexing(i, 1, size)

    return ctx.pointwise(
        lambda idx: a.load(tuple(at(i, n, r) for i, n, r in zip(idx[lead:], a.size, repeats[lead:])))
    )


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


# ----------------------------------------------------------------------------------------------
# Writes into a view of a copy (what export makes of x[:, 1:3] = y): element i reads the source
# where i is in the view, else the input. Index math, fused like any pointwise read.
# ----------------------------------------------------------------------------------------------


def _replaced(ctx: Lowering, x, src, inside, src_index: Index, idx: Index) -> Expr:
    dtype = ctx.out_val.dtype
    part = Masked(dtype, inside, cast(src.load(src_index), dtype), python_scalar(0, dtype))
    return where(IndexValue(torch.bool, inside), part, cast(x.load(idx), dtype))


def _dim(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


@register_lowering(aten.slice_scatter.default)
def slice_scatter(ctx: Lowering, x, src, dim: int = 0, start=None, end=None, step: int = 1):
    dim = _dim(dim, len(x.size))
    start = 0 if start is None else start
    if not (isinstance(start, int) and isinstance(step, int) and step > 0):
        raise Unsupported(f"slice_scatter with start {start!r}, step {step!r}")
    begin = sympy.Max(x.size[dim] + start, 0) if start < 0 else sympy.Integer(start)
    count = src.size[dim]  # the slice's length: end and the clamping are in it

    def body(idx: Index) -> Expr:
        offset = idx[dim] - begin
        at = offset if step == 1 else FloorDiv(offset, step)
        conds = [sympy.Ge(offset, 0), sympy.Lt(at, count)]
        if step != 1:
            conds.append(sympy.Eq(ModularIndexing(offset, 1, step), 0))
        return _replaced(ctx, x, src, sympy.And(*conds), idx[:dim] + (at,) + idx[dim + 1 :], idx)

    return ctx.pointwise(body)


@register_lowering(aten.select_scatter.default)
def select_scatter(ctx: Lowering, x, src, dim: int, index):
    dim = _dim(dim, len(x.size))
    if not isinstance(index, int):
        raise Unsupported(f"select_scatter at index {index!r}")
    at = x.size[dim] + index if index < 0 else sympy.Integer(index)

    def body(idx: Index) -> Expr:
        return _replaced(ctx, x, src, sympy.Eq(idx[dim], at), idx[:dim] + idx[dim + 1 :], idx)

    return ctx.pointwise(body)


@register_lowering(aten.diagonal_scatter.default)
def diagonal_scatter(ctx: Lowering, x, src, offset: int = 0, dim1: int = 0, dim2: int = 1):
    """The diagonal (i[dim2] - i[dim1] == offset) replaced: src's last dim walks it."""
    rank = len(x.size)
    dim1, dim2 = _dim(dim1, rank), _dim(dim2, rank)
    if not isinstance(offset, int) or dim1 == dim2:
        raise Unsupported(f"diagonal_scatter of dims {dim1}, {dim2} at offset {offset!r}")

    def body(idx: Index) -> Expr:
        rest = tuple(i for k, i in enumerate(idx) if k not in (dim1, dim2))
        along = idx[dim1] if offset >= 0 else idx[dim2]
        inside = sympy.Eq(idx[dim2] - idx[dim1], offset)
        return _replaced(ctx, x, src, inside, rest + (along,), idx)

    return ctx.pointwise(body)
