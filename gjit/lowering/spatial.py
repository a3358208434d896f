"""Spatial lowerings: pooling windows (max, average) as reductions, resampling and flips as index math.

A window op is a reduction over the window's own dims.

max_pool2d's iteration space is the output's dims plus (kh, kw); each element reads the input at
(oh * stride - padding + kh * dilation, ...), and a read outside the input (padding, or a
ceil_mode window past the edge) is -inf, as in eager. So the op is one ReduceNode that fusion
treats like any other: the BatchNorm + ReLU before it becomes its prologue, one kernel.

Adaptive pooling (and area interpolation, which is adaptive average pooling) is the same with
each output element's own window, [floor(i * n / m), ceil((i + 1) * n / m)), inside a space as
long as the longest window.

Nearest upsampling by a whole factor reads input element (i // factor) for output element i,
flip reads (size - 1 - i), and constant padding reads (i - before) where that is inside the
input: pointwise reads at other indices, fused into their consumers.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import sympy
import torch
from torch.utils._sympy.functions import FloorDiv

from gjit.ir import Const, Expr, Index, IndexValue, Masked
from gjit.lowering.pointwise import op
from gjit.lowering.reductions import acc_dtype
from gjit.lowering.registry import (
    TensorValue,
    Unsupported,
    cast,
    meta_layout,
    python_scalar,
    register_lowering,
    to_sympy,
)

if TYPE_CHECKING:  # the walk that calls the lowerings; it imports this module
    from gjit.lowering.graph import Lowering

aten = torch.ops.aten


def _tuple(value, default: tuple[int, ...]) -> tuple[int, ...]:
    """A pooling argument as one int per spatial dim (`default`'s length)."""
    nd = len(default)
    if value is None or (isinstance(value, (list, tuple)) and len(value) == 0):
        return default
    if isinstance(value, int):
        return (value,) * nd
    return (value[0],) * nd if len(value) == 1 else tuple(value[:nd])


def _window_read(x: TensorValue, idx: Index, step, pad, dil, acc: torch.dtype, outside: float) -> Expr:
    """Element (kh, kw) of output (.., oh, ow)'s window: the input at oh * stride - padding +
    kh * dilation (and the same for w, and d in 3-D), or `outside` where that is not in the input."""
    rank, nd = len(x.size), len(step)
    lead = rank - nd
    at = [idx[lead + d] * step[d] - pad[d] + idx[rank + d] * dil[d] for d in range(nd)]
    inside = sympy.And(
        *[c for d in range(nd) for c in (sympy.Ge(at[d], 0), sympy.Lt(at[d], x.size[lead + d]))]
    )
    return Masked(acc, inside, cast(x.load(tuple(idx[:lead]) + tuple(at)), acc), outside)


def _indices_used(node) -> bool:
    """Does anything read a max pool's indices (output 1)? A deserialized program keeps a getitem
    of them that nothing reads."""
    return any(u.target is operator.getitem and u.args[1] == 1 and u.users for u in node.users)


@register_lowering(aten.max_pool2d_with_indices.default, aten.max_pool3d_with_indices.default)
def max_pool(
    ctx: Lowering, x: TensorValue, kernel_size, stride=(), padding=0, dilation=1, ceil_mode: bool = False
):
    """The max of each window (2-D or 3-D); NaN propagates, as in eager. The indices output is
    lowered only when nothing reads it (eager picks the last NaN of a window, an argmax the first)."""
    if _indices_used(ctx.node):
        raise Unsupported("max_pool's indices are used")
    out, indices = ctx.out_val
    if not x.dtype.is_floating_point:
        raise Unsupported(f"max_pool of {x.dtype}")
    nd = 3 if ctx.node.target is aten.max_pool3d_with_indices.default else 2
    kernel = _tuple(kernel_size, (1,) * nd)
    step, pad, dil = _tuple(stride, kernel), _tuple(padding, (0,) * nd), _tuple(dilation, (1,) * nd)
    rank = len(x.size)
    acc = acc_dtype(x.dtype)
    window = lambda idx: _window_read(x, idx, step, pad, dil, acc, float("-inf"))
    full = tuple(to_sympy(s) for s in out.shape) + tuple(sympy.Integer(k) for k in kernel)
    reduced = tuple(range(rank, rank + nd))
    values = ctx.reduction(window, full, reduced, "max", out.dtype, False, layout=meta_layout(out))
    unused = ctx.pointwise(lambda idx: Const(torch.int64, 0), meta_layout(indices), suffix="_indices")
    return [values, unused]


@register_lowering(aten.avg_pool2d.default, aten.avg_pool3d.default)
def avg_pool(
    ctx: Lowering,
    x: TensorValue,
    kernel_size,
    stride=(),
    padding=0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override=None,
):
    """The sum of each window's elements inside the input (2-D or 3-D), over eager's divisor: the
    window clipped to the padded input (count_include_pad), to the input itself, or the override."""
    out = ctx.out_val
    if not x.dtype.is_floating_point:
        raise Unsupported(f"avg_pool of {x.dtype}")
    nd = 3 if ctx.node.target is aten.avg_pool3d.default else 2
    kernel = _tuple(kernel_size, (1,) * nd)
    step, pad = _tuple(stride, kernel), _tuple(padding, (0,) * nd)
    rank = len(x.size)
    lead = rank - nd
    acc = acc_dtype(x.dtype)
    window = lambda idx: _window_read(x, idx, step, pad, (1,) * nd, acc, 0.0)
    full = tuple(to_sympy(s) for s in out.shape) + tuple(sympy.Integer(k) for k in kernel)
    total = ctx.reduction(window, full, tuple(range(rank, rank + nd)), "sum", acc, False, suffix="_sum")

    def divisor(idx: Index) -> Expr:
        if divisor_override:
            return Const(acc, float(divisor_override))
        padded, clipped = sympy.Integer(1), sympy.Integer(1)
        for d in range(nd):
            start = idx[lead + d] * step[d] - pad[d]
            end = sympy.Min(start + kernel[d], x.size[lead + d] + pad[d])
            padded *= end - start
            clipped *= sympy.Min(end, x.size[lead + d]) - sympy.Max(start, 0)
        # a window wholly in the padding sums nothing: 0 / 1, eager's 0
        count = padded if count_include_pad else sympy.Max(clipped, 1)
        return cast(IndexValue(torch.int64, count), acc)

    return ctx.pointwise(lambda idx: op("truediv", total.load(idx), divisor(idx)))


def _adaptive_window(ctx: Lowering, x: TensorValue, output_size, acc: torch.dtype, outside: float):
    """Adaptive pooling's windows as a reduction space: output element i of a spatial dim pools
    input [floor(i * n / m), ceil((i + 1) * n / m)) (n in, m out), so the space is the output's
    dims plus, per spatial dim, the longest window; a window position past its own window's end
    reads `outside`. Returns (full space, reduced dims, window read, window element count)."""
    spatial = len(output_size)
    rank = len(x.size)
    lead = rank - spatial
    n_in = [x.size[lead + d] for d in range(spatial)]
    out = ctx.out_val[0] if isinstance(ctx.out_val, (list, tuple)) else ctx.out_val  # max: (values, indices)
    n_out = [to_sympy(s) for s in out.shape[lead:]]
    if not all(s.is_Integer for s in n_out):
        raise Unsupported("adaptive pooling to a dynamic size")
    n_out = [int(s) for s in n_out]
    # the longest window: exact for a static input size, else ceil(n / m) + 1, which bounds it
    longest = [
        sympy.Integer(max([-(-(i + 1) * int(n) // m) - (i * int(n)) // m for i in range(m)], default=1))
        if n.is_Integer
        else FloorDiv(n + m - 1, m) + 1
        for n, m in zip(n_in, n_out)
    ]

    def bounds(i: sympy.Expr, d: int) -> tuple[sympy.Expr, sympy.Expr]:
        n, m = n_in[d], n_out[d]
        return FloorDiv(i * n, m), FloorDiv((i + 1) * n + m - 1, m)

    def read(idx: Index) -> Expr:
        at, inside = [], []
        for d in range(spatial):
            start, end = bounds(idx[lead + d], d)
            at.append(start + idx[rank + d])
            inside.append(sympy.Lt(start + idx[rank + d], end))
        load = cast(x.load(tuple(idx[:lead]) + tuple(at)), acc)
        return Masked(acc, sympy.And(*inside), load, outside)

    def count(idx: Index) -> sympy.Expr:
        total = sympy.Integer(1)
        for d in range(spatial):
            start, end = bounds(idx[lead + d], d)
            total *= end - start
        return total

    out_shape = tuple(x.size[:lead]) + tuple(sympy.Integer(m) for m in n_out)
    full = out_shape + tuple(longest)
    return full, tuple(range(rank, rank + spatial)), read, count


@register_lowering(aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool3d.default)
def adaptive_avg_pool(ctx: Lowering, x: TensorValue, output_size):
    """The mean of each adaptive window (static sizes; a dynamic one stays an extern)."""
    if not x.dtype.is_floating_point:
        raise Unsupported(f"adaptive_avg_pool of {x.dtype}")
    acc = acc_dtype(x.dtype)
    full, reduced, read, count = _adaptive_window(ctx, x, output_size, acc, 0.0)
    total = ctx.reduction(read, full, reduced, "sum", acc, False, suffix="_sum")
    return ctx.pointwise(
        lambda idx: op("truediv", total.load(idx), cast(IndexValue(torch.int64, count(idx)), acc))
    )


@register_lowering(aten.adaptive_max_pool2d.default, aten.adaptive_max_pool3d.default)
def adaptive_max_pool(ctx: Lowering, x: TensorValue, output_size):
    """The max of each adaptive window, NaN propagating; the indices output is lowered only when
    nothing reads it (as max_pool2d's)."""
    if _indices_used(ctx.node):
        raise Unsupported("adaptive_max_pool's indices are used")
    if not x.dtype.is_floating_point:
        raise Unsupported(f"adaptive_max_pool of {x.dtype}")
    out, indices = ctx.out_val
    acc = acc_dtype(x.dtype)
    full, reduced, read, _ = _adaptive_window(ctx, x, output_size, acc, float("-inf"))
    values = ctx.reduction(read, full, reduced, "max", out.dtype, False, layout=meta_layout(out))
    unused = ctx.pointwise(lambda idx: Const(torch.int64, 0), meta_layout(indices), suffix="_indices")
    return [values, unused]


@register_lowering(aten.upsample_nearest2d.vec)  # 1-D and 3-D decompose into index math
def upsample_nearest(ctx: Lowering, x: TensorValue, output_size, scale_factors):
    """Whole-factor scales only (output = k * input along each dim, no scale_factors that would
    make eager's float index rounding differ from integer division); others stay externs."""
    out = ctx.out_val
    spatial = len(out.shape) - 2
    factors = []
    for d in range(spatial):
        size_in, size_out = x.size[2 + d], to_sympy(out.shape[2 + d])
        ratio = sympy.cancel(size_out / size_in)
        if not (ratio.is_Integer and ratio > 0):
            raise Unsupported(f"nearest upsampling by {ratio}: not a whole factor")
        if scale_factors is not None and float(scale_factors[d]) != int(ratio):
            raise Unsupported(f"nearest upsampling with scale factor {scale_factors[d]}")
        factors.append(int(ratio))
    return ctx.pointwise(
        lambda idx: x.load(
            (*idx[:2], *[FloorDiv(idx[2 + d], f) if f != 1 else idx[2 + d] for d, f in enumerate(factors)])
        )
    )


@register_lowering(aten.flip.default)
def flip(ctx: Lowering, x: TensorValue, dims):
    rank = len(x.size)
    flipped = {d + rank if d < 0 else d for d in dims}
    return ctx.pointwise(
        lambda idx: x.load(tuple(x.size[d] - 1 - i if d in flipped else i for d, i in enumerate(idx)))
    )


@register_lowering(aten.constant_pad_nd.default)
def constant_pad_nd(ctx: Lowering, x: TensorValue, pad, value=0):
    """F.pad(mode="constant"): element i reads x at i - before where that is inside x, else
    `value`; pairs (before, after) from the last dim back; a negative pad crops."""
    rank = len(x.size)
    if len(pad) % 2 or len(pad) // 2 > rank:
        raise Unsupported(f"constant_pad_nd with {len(pad)} pad values for {rank} dims")
    dtype = ctx.out_val.dtype
    before = [sympy.Integer(0)] * rank
    after = [sympy.Integer(0)] * rank
    for k in range(len(pad) // 2):
        before[rank - 1 - k], after[rank - 1 - k] = to_sympy(pad[2 * k]), to_sympy(pad[2 * k + 1])

    def body(idx: Index) -> Expr:
        at = tuple(i - b for i, b in zip(idx, before))
        inside = [sympy.Ge(a, 0) for a, b in zip(at, before) if not b.is_nonpositive]
        inside += [sympy.Lt(a, n) for a, n, e in zip(at, x.size, after) if not e.is_nonpositive]
        if not inside:  # only cropped
            return x.load(at)
        return Masked(dtype, sympy.And(*inside), x.load(at), python_scalar(value, dtype))

    return ctx.pointwise(body)
