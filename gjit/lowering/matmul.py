"""Matmul lowerings: mm, bmm, addmm and baddbmm become a `MatmulNode` (the product, a sum over k
accumulated in float32) and, for the add forms, the pointwise node that scales and adds the
input to it; fusion puts both, and whatever else consumes the product, into one template kernel
(kernels/matmul.py). Operands are read through their views, so a transpose or the `clone`
export puts before `bmm` costs no copy. A matmul the template does not take stays an ATen extern,
with the reason `explain` shows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from gjit.ir import Const, Index
from gjit.lowering.pointwise import op
from gjit.lowering.registry import (
    TensorValue,
    Unsupported,
    cast,
    contiguous_layout,
    load_as,
    meta_layout,
    register_lowering,
    to_sympy,
)

if TYPE_CHECKING:  # the walk that calls the lowerings; it imports this module
    from gjit.lowering.graph import Lowering

aten = torch.ops.aten
TEMPLATE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def template_reason(ctx: Lowering, a: TensorValue, b: TensorValue) -> str | None:
    """Why this product stays an ATen extern, or None when the template takes it."""
    why = ctx.templates.reason(ctx.node.name)
    if why is not None:
        return f"matmul runs as an ATen extern ({why})"
    if a.dtype != b.dtype or a.dtype not in TEMPLATE_DTYPES:
        return (
            f"the matmul template takes float16, bfloat16 or float32 operands, not {a.dtype} x {b.dtype} "
            "(ATen runs it)"
        )
    return None


def product(
    ctx: Lowering, a: TensorValue, b: TensorValue, dtype: torch.dtype, suffix: str = ""
) -> TensorValue:
    """The MatmulNode of a @ b (rank 2, or rank 3 with a batch dim), stored as `dtype`."""
    reason = template_reason(ctx, a, b)
    if reason is not None:
        raise Unsupported(reason)
    *batch, m, k = a.size
    n = b.size[-1]
    full = (*batch, m, n, k)

    def body(idx: Index):
        *bi, i, j, kk = idx
        lhs = cast(a.load((*bi, i, kk)), torch.float32)
        rhs = cast(b.load((*bi, kk, j)), torch.float32)
        return op("mul", lhs, rhs)

    if suffix:
        layout = contiguous_layout((*batch, m, n), dtype)
    else:
        layout = meta_layout(ctx.out_val)
    return ctx.matmul(body, full, layout, suffix)


@register_lowering(aten.mm.default, aten.bmm.default)
def mm(ctx: Lowering, a: TensorValue, b: TensorValue) -> TensorValue:
    return product(ctx, a, b, ctx.out_val.dtype)


@register_lowering(aten.addmm.default, aten.baddbmm.default)
def addmm(ctx: Lowering, bias, a: TensorValue, b: TensorValue, *, beta=1, alpha=1) -> TensorValue:
    """beta * bias + alpha * (a @ b), in float32, rounded once to the result's dtype; with beta 0
    the bias is not read (its NaN and inf do not propagate, as in eager)."""
    out = ctx.out_val
    if not isinstance(beta, (int, float)) or not isinstance(alpha, (int, float)):
        raise Unsupported("a symbolic beta or alpha")
    if alpha == 0:  # BLAS does not read the operands then: their NaN and inf do not propagate
        size = tuple(to_sympy(s) for s in ctx.out_val.shape)
        if beta == 0:
            return ctx.pointwise(lambda idx: Const(torch.float32, 0.0))
        scale = Const(torch.float32, float(beta))
        return ctx.pointwise(
            lambda idx: op("mul", load_as(bias, torch.float32, idx, size, ctx.known_one), scale)
        )
    mm_value = product(ctx, a, b, torch.float32, suffix="_mm")
    size = mm_value.size

    def body(idx: Index):
        value = mm_value.load(idx)
        if alpha != 1:
            value = op("mul", value, Const(torch.float32, float(alpha)))
        if beta == 0:
            return value
        term = load_as(bias, torch.float32, idx, size, ctx.known_one)
        if beta != 1:
            term = op("mul", term, Const(torch.float32, float(beta)))
        return op("add", term, value)

    return ctx.pointwise(body, meta_layout(out))
