"""View lowerings: each view is an index function into its base, never a copy.

`ctx.view(base, reindex)` records the FX view node, so when the wrapper needs the view as
a real tensor (a graph output, an extern's argument) it builds it with the same ATen view
op on the base buffer: zero-copy, with eager's strides.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import sympy
import torch
from torch.utils._sympy.functions import FloorDiv, ModularIndexing
from torch.utils._sympy.value_ranges import bound_sympy

from gjit.ir import Index, statically_known_equal
from gjit.lowering.registry import (
    TensorValue,
    Unsupported,
    ViewValue,
    broadcast_index,
    register_lowering,
    to_sympy,
)

if TYPE_CHECKING:  # the walk that calls the lowerings; it imports this module
    from gjit.lowering.graph import Lowering

aten = torch.ops.aten
ZERO = sympy.Integer(0)
ONE = sympy.Integer(1)


def _norm_dim(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def _statically_known_nonnegative(ctx: Lowering, expr: sympy.Expr) -> bool | None:
    """Whether `expr` >= 0 for every size the shape env admits (its ranges and export's guards);
    None when that depends on the sizes. Never adds a guard."""
    if expr.is_number:
        return bool(expr >= 0)
    vals = [a.meta.get("val") for a in ctx.node.args if isinstance(a, torch.fx.Node)]
    syms = [s for v in vals for s in (getattr(v, "shape", None) or [v])]
    env = next((s.node.shape_env for s in syms if isinstance(s, torch.SymInt)), None)
    if env is None:
        return None
    known = env._maybe_evaluate_static(sympy.Ge(expr, 0))
    if known is None:
        bounds = bound_sympy(expr, env.var_to_range)
        known = True if bounds.lower >= 0 else (False if bounds.upper < 0 else None)
    return None if known is None else bool(known)


def _from_end(ctx: Lowering, pos: sympy.Expr, size: sympy.Expr, what: str) -> sympy.Expr:
    """A start or index counted from the end when negative (also a symbolic one, like -s1)."""
    nonnegative = _statically_known_nonnegative(ctx, pos)
    if nonnegative is None:
        raise Unsupported(f"{what} {pos} whose sign depends on the sizes")
    return pos if nonnegative else pos + size


@register_lowering(aten.alias.default, aten.lift_fresh_copy.default)
def alias(ctx: Lowering, x: TensorValue) -> TensorValue:
    return ctx.view(x, lambda idx: idx)


@register_lowering(aten.permute.default)
def permute(ctx: Lowering, x: TensorValue, dims: list[int]) -> TensorValue:
    dims = [_norm_dim(d, len(x.size)) for d in dims]

    def reindex(idx: Index) -> Index:
        src = [ZERO] * len(dims)
        for k, d in enumerate(dims):
            src[d] = idx[k]
        return tuple(src)

    return ctx.view(x, reindex)


@register_lowering(aten.transpose.int)
def transpose(ctx: Lowering, x: TensorValue, dim0: int, dim1: int) -> TensorValue:
    rank = len(x.size)
    dims = list(range(rank))
    a, b = _norm_dim(dim0, rank), _norm_dim(dim1, rank)
    dims[a], dims[b] = dims[b], dims[a]
    return permute(ctx, x, dims)


@register_lowering(aten.expand.default)
def expand(ctx: Lowering, x: TensorValue, sizes: list, *, implicit: bool = False) -> TensorValue:
    out_size = tuple(to_sympy(s) for s in ctx.out_val.shape)
    return ctx.view(x, lambda idx: broadcast_index(x, idx, out_size, ctx.known_one))


@register_lowering(aten.unsqueeze.default)
def unsqueeze(ctx: Lowering, x: TensorValue, dim: int) -> TensorValue:
    dim = _norm_dim(dim, len(x.size) + 1)
    return ctx.view(x, lambda idx: idx[:dim] + idx[dim + 1 :])


@register_lowering(aten.squeeze.dims, aten.squeeze.dim, aten.squeeze.default)
def squeeze(ctx: Lowering, x: TensorValue, dims: int | list[int] | None = None) -> TensorValue:
    rank = len(x.size)
    if dims is None:
        dims = list(range(rank))
    elif isinstance(dims, int):
        dims = [dims]
    removed = {d for d in (_norm_dim(d, rank) for d in dims) if ctx.known_one(x.size[d])}

    def reindex(idx: Index) -> Index:
        it = iter(idx)
        return tuple(ZERO if k in removed else next(it) for k in range(rank))

    return ctx.view(x, reindex)


@register_lowering(aten.slice.Tensor)
def slice_(ctx: Lowering, x: TensorValue, dim: int = 0, start=None, end=None, step: int = 1) -> TensorValue:
    dim = _norm_dim(dim, len(x.size))
    begin = _from_end(ctx, to_sympy(0 if start is None else start), x.size[dim], "slice start")
    # a start before the beginning clamps to 0, also when the size is symbolic: x[-100:] of s0
    # rows starts at max(0, s0 - 100), where export knows s0 < 100
    known = _statically_known_nonnegative(ctx, begin)
    begin = sympy.Max(0, begin) if known is None else (begin if known else ZERO)
    stride = to_sympy(step)

    def reindex(idx: Index) -> Index:
        return idx[:dim] + (begin + stride * idx[dim],) + idx[dim + 1 :]

    return ctx.view(x, reindex)


@register_lowering(aten.select.int)
def select(ctx: Lowering, x: TensorValue, dim: int, index) -> TensorValue:
    dim = _norm_dim(dim, len(x.size))
    pos = _from_end(ctx, to_sympy(index), x.size[dim], "select index")
    return ctx.view(x, lambda idx: idx[:dim] + (pos,) + idx[dim:])


@register_lowering(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def view(ctx: Lowering, x: TensorValue, sizes: list) -> TensorValue:
    new_size = tuple(to_sympy(s) for s in ctx.out_val.shape)
    return ctx.view(x, reshape_indexer(x.size, new_size))


def _product(sizes) -> sympy.Expr:
    return sympy.Mul(*sizes) if sizes else sympy.Integer(1)


def _divides(a: sympy.Expr, b: sympy.Expr) -> bool:
    """True when b / a is known to be an integer polynomial (a divides b for every size)."""
    quotient = sympy.cancel(b / a)
    _, denominator = sympy.fraction(quotient)
    return denominator == 1


def _unflatten(flat: sympy.Expr, sizes: list[sympy.Expr]) -> list[sympy.Expr]:
    """Row-major digits of `flat` in `sizes`: the outermost needs no modulo, the innermost no division."""
    if any(s == 0 for s in sizes):
        # an empty tensor: no element is read, so any digits do (and no division by 0); they keep
        # depending on `flat`, so the kernel masks the load
        return [flat] + [ZERO] * (len(sizes) - 1)
    out = []
    for k, size in enumerate(sizes):
        inner = _product(sizes[k + 1 :])
        if k == 0:
            out.append(FloorDiv(flat, inner) if inner != 1 else flat)
        else:
            out.append(ModularIndexing(flat, inner, size))
    return out


def _flatten(index: list[sympy.Expr], sizes: list[sympy.Expr]) -> sympy.Expr:
    return sum((i * _product(sizes[k + 1 :]) for k, i in enumerate(index)), ZERO)


def reshape_indexer(old: Index, new: Index):
    """Index function of a row-major reshape old -> new, grouping dims whose products match.

    Dims are grouped where both sides' partial products are provably equal, so common
    reshapes (split/merge of heads) stay simple; otherwise the whole view goes through one
    flat index, which is always right.
    """
    old_keep = [k for k, s in enumerate(old) if s != 1]
    new_keep = [k for k, s in enumerate(new) if s != 1]
    groups: list[tuple[list[int], list[int]]] | None = []
    i = j = 0
    while i < len(old_keep) and j < len(new_keep):
        og, ng = [old_keep[i]], [new_keep[j]]
        po, pn = old[old_keep[i]], new[new_keep[j]]
        i, j = i + 1, j + 1
        while not statically_known_equal(po, pn):
            if _divides(po, pn) and i < len(old_keep):
                og.append(old_keep[i])
                po = po * old[old_keep[i]]
                i += 1
            elif _divides(pn, po) and j < len(new_keep):
                ng.append(new_keep[j])
                pn = pn * new[new_keep[j]]
                j += 1
            else:
                groups = None
                break
        if groups is None:
            break
        groups.append((og, ng))
    if groups is not None and (i < len(old_keep) or j < len(new_keep)):
        groups = None

    def reindex(idx: Index) -> Index:
        src = [ZERO] * len(old)
        if groups is None:
            flat = _flatten(list(idx), list(new))
            return tuple(_unflatten(flat, list(old)))
        for og, ng in groups:
            flat = _flatten([idx[k] for k in ng], [new[k] for k in ng])
            for k, value in zip(og, _unflatten(flat, [old[k] for k in og])):
                src[k] = value
        return tuple(src)

    return reindex


@register_lowering(aten.as_strided.default)
def as_strided(ctx: Lowering, x: TensorValue, size: list, stride: list, storage_offset=None) -> TensorValue:
    """as_strided of a value the graph computes densely (row-major, as eager lays it out): element
    idx is storage element offset + sum(idx * stride) of `x`, which is that element of `x`
    flattened. Decompositions make these (adaptive_avg_pool1d's squeeze as a restride). The storage
    of an input, a view or an alias (it may hold more memory) is not this graph's to index: an extern."""
    source = ctx.node.args[0]
    val = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    computed = source.op == "call_function" and x.name == source.name and not isinstance(x, ViewValue)
    if not computed or not isinstance(val, torch.Tensor):
        raise Unsupported("as_strided of an input or a view: its storage is not the graph's to index")
    x_size = [to_sympy(s) for s in val.shape]
    dense = ONE
    for s, st in reversed(list(zip(x_size, val.stride()))):
        if not (ctx.known_one(s) or statically_known_equal(to_sympy(st), dense)):
            raise Unsupported("as_strided of a value eager does not lay out row-major")
        dense = dense * s
    base = to_sympy(val.storage_offset())
    begin = base if storage_offset is None else to_sympy(storage_offset)
    steps = [to_sympy(st) for st in stride]
    out_size = [to_sympy(n) for n in size]
    # eager reads only the value's own elements, or refuses (out of the storage's bounds): the
    # kernel must never read past them, so the first and the last element read are proven in it
    last = begin - base + sum(((n - 1) * st for n, st in zip(out_size, steps)), ZERO)
    empty = any(n == 0 for n in out_size)
    inside = [begin - base, dense - 1 - last, *steps]
    if not empty and not all(_statically_known_nonnegative(ctx, e) for e in inside):
        raise Unsupported("as_strided whose elements are not provably inside the value")

    def reindex(idx: Index) -> Index:
        flat = begin - base + sum((i * st for i, st in zip(idx, steps)), ZERO)
        return tuple(_unflatten(flat, x_size))

    return ctx.view(x, reindex)


@register_lowering(aten.split_with_sizes.default, aten.split.Tensor)
def split(ctx: Lowering, x: TensorValue, sizes, dim: int = 0) -> list[TensorValue]:
    """Each piece is a slice view of `x` along `dim`."""
    dim = _norm_dim(dim, len(x.size))
    views = []
    start = ZERO
    for k, piece in enumerate(ctx.out_val):
        begin = start

        def reindex(idx: Index, begin=begin) -> Index:
            return idx[:dim] + (begin + idx[dim],) + idx[dim + 1 :]

        views.append(ctx.view(x, reindex, element=k))
        start = start + to_sympy(piece.shape[dim])
    return views
