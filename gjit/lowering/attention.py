"""scaled_dot_product_attention as an `AttentionNode`: one flash-attention style kernel
(kernels/attention.py) with the query, key and value read through their views, the scale, the
causal or given mask and a grouped-query head mapping as index math, and no score matrix in
memory. What the template does not take stays an ATen extern, with the reason `explain` shows.
The eager form of attention (bmm, scale, mask, softmax, bmm) becomes the same node in
attention_pattern.py.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import sympy
import torch
from torch.utils._sympy.functions import FloorDiv

from gjit import ir
from gjit.ir import Const, Index, Score, statically_known_equal
from gjit.lowering.attention_library import STANDS_FOR
from gjit.lowering.pointwise import op, where
from gjit.lowering.registry import (
    TensorValue,
    Unsupported,
    broadcast_index,
    cast,
    meta_layout,
    register_lowering,
)

if TYPE_CHECKING:  # the walk that calls the lowerings; it imports this module
    from gjit.lowering.graph import Lowering

aten = torch.ops.aten
# the widest head dim the template takes: a query tile holds whole rows of it (wider float32
# tiles spill on sm_90, kernels/attention.py)
MAX_HEAD_DIM = {torch.float16: 256, torch.bfloat16: 256, torch.float32: 128}


def head_dim_reason(hint: int, dtype: torch.dtype, what: str) -> str | None:
    """Why a head dim (its example size `hint`) keeps the attention an extern. A dynamic head dim
    is a kernel argument; the kernel assumes it fits the tile it was built for."""
    if not 1 <= hint <= MAX_HEAD_DIM[dtype]:
        return (
            f"the {what} head dim is {hint}: the {dtype} attention template takes 1 to {MAX_HEAD_DIM[dtype]}"
        )
    return None


def template_reason(ctx: Lowering, q: TensorValue, k: TensorValue, v: TensorValue) -> str | None:
    """Why this attention stays an ATen extern, or None when the template takes it."""
    why = ctx.templates.reason(ctx.node.name)
    if why is not None:
        return f"attention runs as an ATen extern ({why})"
    dtypes = {q.dtype, k.dtype, v.dtype}
    if len(dtypes) != 1 or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"the attention template takes float16, bfloat16 or float32, not {sorted(map(str, dtypes))}"
    return head_dim_reason(ctx.hint(q.size[-1]), q.dtype, "query/key") or head_dim_reason(
        ctx.hint(v.size[-1]), q.dtype, "value"
    )


def kv_index(ctx: Lowering, q: TensorValue, kv: TensorValue, batch: Index, gqa: bool) -> Index:
    """The batch index of a key or value for the query batch index `batch`: equal dims, a
    broadcast dim of size 1, or (enable_gqa) the head dim of a group of query heads, h // group."""
    out = []
    for k, (qs, ks) in enumerate(zip(q.size[:-2], kv.size[:-2])):
        if statically_known_equal(qs, ks):
            out.append(batch[k])
        elif ctx.known_one(ks):
            out.append(sympy.Integer(0))
        elif gqa and k == len(batch) - 1:
            # eager checks that the key/value heads divide the query heads (export keeps the check)
            out.append(FloorDiv(batch[k], FloorDiv(qs, ks)))
        else:
            raise Unsupported(f"query batch dims {list(q.size[:-2])} and key/value {list(kv.size[:-2])}")
    return tuple(out)


@register_lowering(aten.scaled_dot_product_attention.default)
def sdpa(
    ctx: Lowering,
    q: TensorValue,
    k: TensorValue,
    v: TensorValue,
    attn_mask=None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> TensorValue:
    """softmax(q @ k^T * scale + mask) @ v; a boolean mask keeps the scores where it is True; a
    row with every score masked gives zeros (as eager's scaled_dot_product_attention does)."""
    if dropout_p != 0.0:
        raise Unsupported("attention with dropout (ATen runs it)")
    if len(q.size) < 2 or len(k.size) != len(q.size) or len(v.size) != len(q.size):
        raise Unsupported("attention operands of different ranks")
    reason = template_reason(ctx, q, k, v)
    if reason is not None:
        raise Unsupported(reason)
    if is_causal and attn_mask is not None:
        raise Unsupported("both is_causal and attn_mask")
    *batch_size, length, dim = q.size
    keys, dim_v = k.size[-2], v.size[-1]
    if scale is not None:
        factor = Const(torch.float32, float(scale))
    elif sympy.sympify(dim).is_number:
        factor = Const(torch.float32, 1.0 / math.sqrt(int(dim)))
    else:  # a dynamic head dim: 1/sqrt(D) in the kernel
        root = op("sqrt", cast(ir.IndexValue(torch.int64, dim), torch.float32))
        factor = op("truediv", Const(torch.float32, 1.0), root)
    full = (*batch_size, length, dim_v, keys, dim)
    *b, i, e, j, d = ir.index_vars(len(full))
    kb, vb = kv_index(ctx, q, k, b, enable_gqa), kv_index(ctx, q, v, b, enable_gqa)

    score = op("mul", Score(torch.float32), factor)
    if is_causal:  # the top-left aligned lower triangle, as eager's is_causal
        keep = ir.IndexValue(torch.bool, sympy.Le(j, i))
        score = where(keep, score, Const(torch.float32, float("-inf")))
    elif isinstance(attn_mask, TensorValue):
        scores_size = (*batch_size, length, keys)
        at = broadcast_index(attn_mask, (*b, i, j), scores_size, ctx.known_one)
        mask = attn_mask.load(at)
        if attn_mask.dtype == torch.bool:
            score = where(mask, score, Const(torch.float32, float("-inf")))
        else:
            score = op("add", score, cast(mask, torch.float32))
    elif attn_mask is not None:
        raise Unsupported(f"an attention mask of type {type(attn_mask).__name__}")

    body = ir.Attention(
        q.dtype,
        q.load((*b, i, d)),
        k.load((*kb, j, d)),
        v.load((*vb, j, e)),
        score,
    )
    # a query that keeps no key: zeros, as eager's SDPA; NaN where the call stands for a written-out
    # attention (gjit/lowering/attention_library.py), as eager's softmax there
    empty_rows = "nan" if ctx.node.meta.get(STANDS_FOR) else "zero"
    return ctx.attention(body, full, meta_layout(ctx.out_val), empty_rows=empty_rows, causal=is_causal)
