"""Indexing lowerings as indirect loads inside kernels: embedding, index_select, gather and
advanced indexing (index.Tensor with integer index tensors).

An indirect read indexes with a symbol bound to data (the index tensor's element); in debug
mode the generated kernel asserts every such index is in bounds, so an out-of-range index is a
clear error instead of a silent garbage read. Writes through indices are in scatters.py.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import sympy
import torch

from gjit import ir
from gjit.ir import Const, Expr, Index, Op
from gjit.lowering.registry import (
    TensorValue,
    Unsupported,
    broadcast_index,
    cast,
    register_lowering,
    to_sympy,
)

if TYPE_CHECKING:  # the walk that calls the lowerings; it imports this module
    from gjit.lowering.graph import Lowering

aten = torch.ops.aten
_symbols = itertools.count()


def indirect_symbol() -> sympy.Symbol:
    return sympy.Symbol(f"ind{next(_symbols)}", integer=True)


def index_value(index: TensorValue, at: Index, size: sympy.Expr, wrap: bool) -> Expr:
    if index.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise Unsupported(f"indexing with a {index.dtype} tensor (boolean masks have data-dependent sizes)")
    value = cast(index.load(at), torch.int64)
    if wrap:  # negative indices count from the end, as in Python
        size_value = cast(ir.IndexValue(torch.int64, size), torch.int64)
        negative = Op(torch.bool, "lt", (value, Const(torch.int64, 0)))
        value = Op(torch.int64, "where", (negative, Op(torch.int64, "add", (value, size_value)), value))
    return value


def gather_from(x: TensorValue, src: list, bindings: list) -> Expr:
    return ir.bind(x.load(tuple(src)), bindings)


@register_lowering(aten.embedding.default)
def embedding(ctx: Lowering, weight: TensorValue, indices: TensorValue, padding_idx=-1, scale_grad=False,
              sparse=False):  # fmt: skip
    def body(idx: Index) -> Expr:
        sym = indirect_symbol()
        value = index_value(indices, idx[:-1], weight.size[0], wrap=False)
        return gather_from(weight, [sym, idx[-1]], [(sym, value, weight.size[0])])

    return ctx.pointwise(body)


def _take_along(ctx: Lowering, x: TensorValue, dim: int, index: TensorValue, index_at) -> TensorValue:
    """out[idx] = x[idx with dim replaced by index[index_at(idx)]] (index_select, gather)."""
    dim = dim + len(x.size) if dim < 0 else dim

    def body(idx: Index) -> Expr:
        sym = indirect_symbol()
        value = index_value(index, index_at(idx, dim), x.size[dim], wrap=False)
        src = list(idx)
        src[dim] = sym
        return gather_from(x, src, [(sym, value, x.size[dim])])

    return ctx.pointwise(body)


@register_lowering(aten.index_select.default)
def index_select(ctx: Lowering, x: TensorValue, dim: int, index: TensorValue):
    return _take_along(ctx, x, dim, index, lambda idx, d: (idx[d],) if index.size else ())


@register_lowering(aten.gather.default)
def gather(ctx: Lowering, x: TensorValue, dim: int, index: TensorValue, *, sparse_grad: bool = False):
    return _take_along(ctx, x, dim, index, lambda idx, d: idx)


@register_lowering(aten.index.Tensor)
def index_tensor(ctx: Lowering, x: TensorValue, indices: list):
    positions = [k for k, t in enumerate(indices) if t is not None]
    tensors = [indices[k] for k in positions]
    if not all(isinstance(t, TensorValue) for t in tensors):
        raise Unsupported("index.Tensor with a non-tensor index")
    if any(t.dtype in (torch.bool, torch.uint8) for t in tensors):  # uint8 indexes as a mask too
        raise Unsupported("boolean mask indexing has a data-dependent size")
    out_size = tuple(to_sympy(s) for s in ctx.out_val.shape)
    nb = len(out_size) - (len(x.size) - len(positions))
    adjacent = positions == list(range(positions[0], positions[-1] + 1))
    start = positions[0] if adjacent else 0  # where the broadcast index dims sit in the output
    bshape = out_size[start : start + nb]

    def body(idx: Index) -> Expr:
        src, bindings = advanced_index(ctx, x, indices, idx, start, bshape)
        return gather_from(x, src, bindings)

    return ctx.pointwise(body)


def advanced_index(
    ctx: Lowering, x: TensorValue, indices: list, idx: Index, start: int, bshape: Index
) -> tuple[list, list]:
    """The element of x that advanced indexing maps index `idx` of x[indices] to (index.Tensor
    reads it, index_put writes it): the broadcast index dims sit at `start` of `idx`; each
    indexed dim of x takes its index tensor's value there (negative counts from the end), the
    other dims the remaining entries of `idx` in order. Returns (x's index, its bindings)."""
    nb = len(bshape)
    b = idx[start : start + nb]
    rest = iter(list(idx[:start]) + list(idx[start + nb :]))
    src, bindings = [], []
    for k in range(len(x.size)):
        t = indices[k] if k < len(indices) else None
        if t is None:
            src.append(next(rest))
            continue
        sym = indirect_symbol()
        value = index_value(t, broadcast_index(t, b, bshape, ctx.known_one), x.size[k], wrap=True)
        bindings.append((sym, value, x.size[k]))
        src.append(sym)
    return src, bindings
