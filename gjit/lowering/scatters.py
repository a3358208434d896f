"""Writes through indices as kernels: scatter, scatter_add, scatter_reduce and index_put (which
torch's decompositions make of index_add, index_copy, index_fill and put).

Each is a `ScatterNode`: a copy of the tensor written into (a pointwise kernel), then one kernel
over the source's elements that writes each at the element its index names. Where several
sources can hit one element, they combine with atomics (sum, max, min); a plain write of
duplicate indices keeps one of them, unspecified which, as eager does. Atomics exist for
float32/float64/int32/int64: any other dtype that combines stays an extern, with that reason.
A float max/min skips NaN in its atomics and stores the NaN sources in a second pass, so NaN
wins as in eager. `scatter_reduce(mean)` is a sum, a count and a division; `prod` has no atomic
and stays an extern.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import sympy
import torch

from gjit import ir
from gjit.ir import Const, Expr, Index, Op
from gjit.lowering.indexing import advanced_index, index_value, indirect_symbol
from gjit.lowering.registry import (
    TensorValue,
    Unsupported,
    broadcast_index,
    cast,
    python_scalar,
    reduction_identity,
    register_lowering,
)

if TYPE_CHECKING:  # the walk that calls the lowerings; it imports this module
    from gjit.lowering.graph import Lowering

aten = torch.ops.aten

ATOMIC_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64)
_REDUCE = {"sum": "sum", "add": "sum", "amax": "max", "amin": "min", "mean": "mean"}


def _check(reduce: str, dtype: torch.dtype) -> None:
    if reduce == "store":
        return
    if dtype not in ATOMIC_DTYPES:
        raise Unsupported(f"a write through indices that combines ({reduce}) has no {dtype} atomics")
    if dtype.is_floating_point and reduce == "sum" and torch.are_deterministic_algorithms_enabled():
        raise Unsupported("deterministic algorithms are on: float atomic sums are not deterministic")


def _combine(
    ctx: Lowering, x: TensorValue, space: Index, write_fn, reduce: str, include_self: bool = True,
    suffix: str = "",
) -> TensorValue:  # fmt: skip
    """`x` with the writes of `write_fn` over `space` combined in by `reduce` ("store", "sum",
    "max", "min", "mean"); without `include_self`, the elements written start from the
    reduction's identity instead of x's value. `suffix` names the result (the FX node's name +)."""
    dtype = ctx.out_val.dtype
    _check(reduce, dtype)
    if reduce == "mean":
        return _mean(ctx, x, space, write_fn, include_self)
    base, in_place = x, False
    if not include_self and reduce != "store":
        identity = reduction_identity(reduce, dtype)

        def fill(idx: Index) -> ir.WriteAt:
            write = write_fn(idx)
            return ir.WriteAt(dtype, Const(dtype, identity), write.index, write.indirect)

        base, in_place = ctx.scatter(x, space, fill, "store", suffix=f"{suffix}_init"), True
    if reduce in ("max", "min") and dtype.is_floating_point:
        return _float_max_min(ctx, x, base, in_place, space, write_fn, reduce, include_self, suffix)
    return ctx.scatter(base, space, write_fn, reduce, suffix=suffix, in_place=in_place)


def _float_max_min(ctx: Lowering, x: TensorValue, base: TensorValue, in_place: bool, space: Index, write_fn,
                   reduce: str, include_self: bool, suffix: str) -> TensorValue:  # fmt: skip
    """Triton's float atomic max/min compare bit patterns as integers: a NaN in memory or in a
    value loses to numbers. So the atomics see no NaN (x's own are the identity, sources' skipped),
    a second pass stores the NaN sources, and a pointwise pass puts x's NaN back (include_self)."""
    dtype = ctx.out_val.dtype
    identity = Const(dtype, reduction_identity(reduce, dtype))

    def finite(value: Expr) -> Expr:
        return Op(dtype, "where", (Op(torch.bool, "isnan", (value,)), identity, value))

    def skip_nan(idx: Index) -> ir.WriteAt:  # NaN comes in the second pass
        write = write_fn(idx)
        return ir.WriteAt(dtype, finite(cast(write.value, dtype)), write.index, write.indirect)

    if include_self:
        base, in_place = (
            ctx.pointwise(lambda i: finite(cast(x.load(i), dtype)), suffix=f"{suffix}_finite_base"),
            True,
        )
    base = ctx.scatter(base, space, skip_nan, reduce, suffix=f"{suffix}_finite", in_place=in_place)
    if not include_self:
        return ctx.scatter(base, space, write_fn, "nan", suffix=suffix, in_place=True)
    out = ctx.scatter(base, space, write_fn, "nan", suffix=f"{suffix}_nan", in_place=True)

    def restore(i: Index) -> Expr:
        own = cast(x.load(i), dtype)
        return Op(dtype, "where", (Op(torch.bool, "isnan", (own,)), own, out.load(i)))

    return ctx.pointwise(restore, suffix=suffix)


def _mean(ctx: Lowering, x: TensorValue, space: Index, write_fn, include_self: bool) -> TensorValue:
    """scatter_reduce(mean): the sum of the writes (and x, with include_self) over their count;
    an element nothing writes keeps x's value (eager divides by a count clamped to 1)."""
    dtype = ctx.out_val.dtype
    total = _combine(ctx, x, space, write_fn, "sum", include_self, suffix="_sum")
    start = Const(dtype, python_scalar(1 if include_self else 0, dtype))  # x's own element counts
    count_base = ctx.pointwise(lambda idx: start, suffix="_count_base")

    def one(idx: Index) -> ir.WriteAt:
        write = write_fn(idx)
        return ir.WriteAt(dtype, Const(dtype, python_scalar(1, dtype)), write.index, write.indirect)

    count = ctx.scatter(count_base, space, one, "sum", suffix="_count", in_place=True)
    divide = "truediv" if dtype.is_floating_point else "floordiv"

    def mean(idx: Index) -> Expr:
        clamped = Op(dtype, "maximum", (count.load(idx), Const(dtype, python_scalar(1, dtype))))
        return Op(dtype, divide, (total.load(idx), clamped))

    return ctx.pointwise(mean)


def _dim(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def _along(x: TensorValue, dim: int, index: TensorValue, value_fn):
    """The write of scatter's element `idx` of `index`: x[idx with dim replaced by index[idx]]."""
    rank = len(x.size)
    dim = _dim(dim, max(rank, 1))
    if index.dtype != torch.int64:
        raise Unsupported(f"scatter with a {index.dtype} index")

    def write(idx: Index) -> ir.WriteAt:
        sym = indirect_symbol()
        if rank == 0:  # a 0-d tensor: the index must be 0 (bound-checked as a dim of 1)
            value = index_value(index, idx, sympy.Integer(1), wrap=False)
            return ir.WriteAt(x.dtype, value_fn(idx), (), ((sym, value, sympy.Integer(1)),))
        value = index_value(index, idx, x.size[dim], wrap=False)
        at = tuple(sym if k == dim else i for k, i in enumerate(idx))
        return ir.WriteAt(x.dtype, value_fn(idx), at, ((sym, value, x.size[dim]),))

    return write


def _source(src, idx: Index, dtype: torch.dtype) -> Expr:
    if isinstance(src, TensorValue):
        return cast(src.load(idx if src.size else ()), dtype)
    if isinstance(src, (bool, int, float)):
        return Const(dtype, python_scalar(src, dtype))
    raise Unsupported(f"scatter of a {type(src).__name__} value")


@register_lowering(aten.scatter.src, aten.scatter.value, aten.scatter.reduce, aten.scatter.value_reduce)
def scatter(ctx: Lowering, x: TensorValue, dim: int, index: TensorValue, src, *, reduce: str | None = None):
    if reduce not in (None, "add"):
        raise Unsupported(f"scatter(reduce={reduce!r}) has no atomic")
    dtype = ctx.out_val.dtype
    write = _along(x, dim, index, lambda idx: _source(src, idx, dtype))
    return _combine(ctx, x, index.size, write, "store" if reduce is None else "sum")


@register_lowering(aten.scatter_add.default)
def scatter_add(ctx: Lowering, x: TensorValue, dim: int, index: TensorValue, src: TensorValue):
    dtype = ctx.out_val.dtype
    return _combine(ctx, x, index.size, _along(x, dim, index, lambda idx: _source(src, idx, dtype)), "sum")


@register_lowering(aten.scatter_reduce.two)
def scatter_reduce(ctx: Lowering, x: TensorValue, dim: int, index: TensorValue, src: TensorValue, reduce: str,
                   *, include_self: bool = True):  # fmt: skip
    if reduce not in _REDUCE:
        raise Unsupported(f"scatter_reduce({reduce!r}) has no atomic")
    dtype = ctx.out_val.dtype
    write = _along(x, dim, index, lambda idx: _source(src, idx, dtype))
    return _combine(ctx, x, index.size, write, _REDUCE[reduce], include_self)


@register_lowering(aten.index_add.default)
def index_add(ctx: Lowering, x: TensorValue, dim: int, index: TensorValue, source: TensorValue, *, alpha=1):
    """x with alpha * source[..., j, ...] added at x[..., index[j], ...] along dim."""
    dim = _dim(dim, max(len(x.size), 1))
    if index.dtype not in (torch.int64, torch.int32):
        raise Unsupported(f"index_add with a {index.dtype} index")
    dtype = ctx.out_val.dtype
    if not x.size:  # a 0-d tensor: each of the index's (zero) entries adds the 0-d source
        value = Op(dtype, "mul", (_source(source, (), dtype), Const(dtype, python_scalar(alpha, dtype))))

        def add_to_0d(idx: Index) -> ir.WriteAt:
            sym, one = indirect_symbol(), sympy.Integer(1)
            at = index_value(index, idx if index.size else (), one, wrap=False)
            return ir.WriteAt(dtype, value, (), ((sym, at, one),))

        return _combine(ctx, x, index.size, add_to_0d, "sum")

    def write(idx: Index) -> ir.WriteAt:
        sym = indirect_symbol()
        value = index_value(index, (idx[dim],) if index.size else (), x.size[dim], wrap=False)
        scaled = _source(source, idx, dtype)
        if alpha != 1:
            scaled = Op(dtype, "mul", (scaled, Const(dtype, python_scalar(alpha, dtype))))
        at = tuple(sym if k == dim else i for k, i in enumerate(idx))
        return ir.WriteAt(dtype, scaled, at, ((sym, value, x.size[dim]),))

    return _combine(ctx, x, source.size, write, "sum")


def _index_put(ctx: Lowering, x: TensorValue, indices: list, values, accumulate: bool, in_place: bool):
    """x[indices] = values (or +=): the write space is the shape x[indices] has, with the
    broadcast index dims where advanced indexing puts them."""
    positions = [k for k, t in enumerate(indices) if t is not None]
    tensors = [indices[k] for k in positions]
    if not tensors or not all(isinstance(t, TensorValue) for t in tensors):
        raise Unsupported("index_put with a non-tensor index")
    if any(t.dtype in (torch.bool, torch.uint8) for t in tensors):  # uint8: a mask too, as in eager
        if len(tensors) > 1:
            raise Unsupported("index_put with a boolean mask and other indices has a data-dependent size")
        return _masked_put(ctx, x, positions, tensors, values, accumulate)
    bshape, assumed = _broadcast(ctx, [t.size for t in tensors])
    adjacent = positions == list(range(positions[0], positions[-1] + 1))
    start = positions[0] if adjacent else 0
    rest = [s for k, s in enumerate(x.size) if k not in positions]
    space = tuple(rest[:start]) + bshape + tuple(rest[start:])
    if isinstance(values, TensorValue):  # values broadcast to the write's shape
        assumed += _broadcast(ctx, [values.size, space], "values")[1]
    dtype = ctx.out_val.dtype

    def write(idx: Index) -> ir.WriteAt:
        at, bindings = advanced_index(ctx, x, indices, idx, start, bshape)
        if isinstance(values, TensorValue):
            value = cast(values.load(broadcast_index(values, idx, space, ctx.known_one)), dtype)
        else:
            value = _source(values, idx, dtype)
        return ir.WriteAt(dtype, value, tuple(at), tuple(bindings))

    reduce = "sum" if accumulate else "store"
    first = len(ctx.nodes)
    if in_place:
        _check(reduce, dtype)
        out = ctx.scatter(x, space, write, reduce, in_place=True)
    else:
        out = _combine(ctx, x, space, write, reduce)
    for node in ctx.nodes[first:]:  # the writes' kernels rely on the sizes being related
        if isinstance(node, ir.ScatterNode):
            node.assumptions = tuple(assumed)
    return out


def _broadcast(ctx: Lowering, shapes: list[Index], what: str = "index tensors") -> tuple[Index, list]:
    """The broadcast of `shapes` and the size relations it assumes. Export does not relate the
    sizes of tensors index_put broadcasts (its meta function checks none), so sizes that are
    not known to be 1 and differ as expressions are assumed equal, guarded: they are equal in the
    call being compiled (eager broadcasts them, and a symbolic size is at least 2), and a later
    call where they are not recompiles."""
    out, assumed = [], []
    for k in range(1, max(len(s) for s in shapes) + 1):
        sizes = list(dict.fromkeys(s[-k] for s in shapes if len(s) >= k and not ctx.known_one(s[-k])))
        if not sizes:
            out.append(sympy.Integer(1))
            continue
        first = next((s for s in sizes if sympy.sympify(s).is_number), sizes[0])  # a static size if any
        for other in sizes:
            if other == first:
                continue
            try:
                related = ctx.hint(other) == ctx.hint(first)
            except TypeError:  # a data-dependent size has no example value to compare
                raise Unsupported(f"{what} of data-dependent sizes {[list(s) for s in shapes]}") from None
            if not related:
                raise Unsupported(f"{what} of sizes {[list(s) for s in shapes]} do not broadcast")
            assumed.append((sympy.Eq(other, first), f"{what} broadcast: {other} == {first}"))
        out.append(first)
    return tuple(reversed(out)), assumed


def _masked_put(ctx: Lowering, x: TensorValue, positions: list, tensors: list, values, accumulate: bool):
    """x[mask] = v (or +=) with one value for every masked element: a where over x's elements
    (the write's size, the mask's count, is data-dependent, the result's is not)."""
    if len(tensors) != 1 or any(not ctx.known_one(s) for s in getattr(values, "size", ())):
        raise Unsupported("index_put with a boolean mask and many values has a data-dependent size")
    (mask,), start, dtype = tensors, positions[0], ctx.out_val.dtype

    def body(idx: Index) -> Expr:
        hit = cast(mask.load(idx[start : start + len(mask.size)]), torch.bool)
        value = _source(values, (sympy.Integer(0),) * len(values.size), dtype) if isinstance(
            values, TensorValue) else _source(values, (), dtype)  # fmt: skip
        old = cast(x.load(idx), dtype)
        add = "logical_or" if dtype == torch.bool else "add"  # bools saturate, as eager's add
        new = Op(dtype, add, (old, value)) if accumulate else value
        return Op(dtype, "where", (hit, new, old))

    return ctx.pointwise(body)


@register_lowering(aten.index_put.default)
def index_put(ctx: Lowering, x: TensorValue, indices: list, values, accumulate: bool = False):
    return _index_put(ctx, x, indices, values, accumulate, in_place=False)


@register_lowering(aten.index_put_.default)
def index_put_(ctx: Lowering, x: TensorValue, indices: list, values, accumulate: bool = False):
    """In place (gjit/capture/in_place.py made it so: nothing else reads x's old value): into x's own
    memory when x is a value a kernel computes here or a graph input (the caller's KV cache, in
    the strides the entry's guard checked), laid out as export traced the write's result; an
    extern's result, a view, or memory in another layout is written by ATen."""
    if not ctx.writable_in_place(x):
        raise Unsupported("index_put_ into an extern's result, a view or another layout runs in ATen")
    return _index_put(ctx, x, indices, values, accumulate, in_place=True)
