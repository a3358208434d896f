"""Scans: cumsum, cumprod, logcumsumexp, cummax and cummin (two scans: values, indices) become
ScanNodes, one kernel each, their input's producers computed inside it (fusion inlines what
only the scan reads). Accumulation is in
the dtype eager accumulates in (float32 for 16-bit floats, int64 for integers and bools); the
kernel scans a block of each row at a time and carries the running value to the next block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from gjit.ir import Const
from gjit.lowering.reductions import acc_dtype
from gjit.lowering.registry import TensorValue, Unsupported, cast, meta_layout, register_lowering

if TYPE_CHECKING:  # the walk that calls the lowerings; it imports this module
    from gjit.lowering.graph import Lowering

aten = torch.ops.aten


def _scan(ctx: Lowering, x: TensorValue, dim: int, scan_type: str, acc: torch.dtype) -> TensorValue:
    if acc.is_complex:
        raise Unsupported(f"a scan of a {acc} tensor")
    rank = len(x.size)
    if rank == 0:  # a 0-d tensor is its own scan along dim 0 or -1
        return ctx.pointwise(lambda idx: cast(x.load(()), acc))
    dim = dim + rank if dim < 0 else dim
    return ctx.scan(lambda idx: cast(x.load(idx), acc), dim, scan_type, meta_layout(ctx.out_val))


@register_lowering(aten.cumsum.default)
def cumsum(ctx: Lowering, x: TensorValue, dim: int, *, dtype=None):
    return _scan(ctx, x, dim, "sum", acc_dtype(ctx.out_val.dtype))


@register_lowering(aten.cumprod.default)
def cumprod(ctx: Lowering, x: TensorValue, dim: int, *, dtype=None):
    return _scan(ctx, x, dim, "prod", acc_dtype(ctx.out_val.dtype))


@register_lowering(aten.cummax.default, aten.cummin.default)
def cummax(ctx: Lowering, x: TensorValue, dim: int):
    """The running max (min) and its index: two scans of the input, values and indices. The
    index is the latest position of the extreme, and NaN wins once seen, as in eager."""
    if x.dtype == torch.bool or x.dtype.is_complex:
        raise Unsupported(f"cummax/cummin of {x.dtype}")
    kind = "max" if ctx.node.target is aten.cummax.default else "min"
    out_values, out_indices = ctx.out_val
    acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    if not x.size:  # the element and its index
        return [
            ctx.pointwise(lambda idx: x.load(()), meta_layout(out_values), "_values"),
            ctx.pointwise(lambda idx: Const(torch.int64, 0), meta_layout(out_indices), "_indices"),
        ]
    dim = dim + len(x.size) if dim < 0 else dim
    body = lambda idx: cast(x.load(idx), acc)  # noqa: E731
    return [
        ctx.scan(body, dim, kind, meta_layout(out_values), "_values"),
        ctx.scan(body, dim, f"arg{kind}", meta_layout(out_indices), "_indices"),
    ]


@register_lowering(aten.logcumsumexp.default)
def logcumsumexp(ctx: Lowering, x: TensorValue, dim: int):
    dtype = ctx.out_val.dtype
    if not dtype.is_floating_point:
        raise Unsupported(f"logcumsumexp of {dtype}")
    return _scan(ctx, x, dim, "logsumexp", acc_dtype(dtype))
