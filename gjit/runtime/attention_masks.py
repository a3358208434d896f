"""ATen's scaled_dot_product_attention as the wrapper calls it: a boolean attention mask handed to it
as an additive one (below), and the call that stands for an attention written out (`written_out`).

torch.export hands transformers' padding mask to SDPA as a bool tensor expanded from [B, 1, L, 1]
or [1, 1, L, 1] (zero strides on the key dim). For such a mask ATen runs its math path: float32
GEMMs, a softmax and half a dozen elementwise kernels. On an H200 (bench/sdpa_masks.py,
2026-11-28, BERT-base's bf16 32 x 12 x 128 x 64) that took 0.282 ms a layer; the same mask as an
additive bf16 tensor (0 where kept, -inf where not) ran cuDNN's flash kernel in 0.022 ms.

The wrapper (`gjit.wrapper.converts_mask`) converts each such mask once per call and dtype
(`additive`) and gives every attention extern that reads it the additive form. The math path gives
zeros for a query whose every key is masked; a fused kernel handed -inf need not, so the output is
zeroed there (`dead`), as eager's math path would give. (Not quite: where such a row's query, or the
keys or values, hold NaN or inf, the math path gives NaN in it; these rows are padding positions,
and a check would cost three reductions a layer.) The fused kernels return another layout than the
math path export traced (on the H200 cuDNN's output is [B, L, H, D] in memory, the math path's [B,
H, L, D]; the program's kernels read the traced one: the first try, without `traced_layout`, gave
BERT wrong outputs there), so the output is copied into the traced strides where they differ.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._prims_common import make_contiguous_strides_for

from gjit.lowering.attention_library import ANY_LAYOUT, FAR, STANDS_FOR


def additive(mask: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(0 where `mask` keeps a score and -inf where not, in `dtype`; whether a query keeps no key)."""
    scores = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return scores, ~mask.any(-1, keepdim=True)


def traced_layout(out: torch.Tensor, dead: torch.Tensor | None, stride: tuple[int, ...]) -> torch.Tensor:
    """The attention output with the rows of queries that keep no key zeroed (`dead`; None: none),
    in `stride` (the layout export traced, or gjit/lowering/attention_library.py gave it): copied
    where its memory order differs, restrided where only the strides of dims of size 1 do."""
    if tuple(out.stride()) != tuple(stride):
        if all(n == 1 or a == b for n, a, b in zip(out.shape, out.stride(), stride)):
            out = out.as_strided(out.shape, stride)
        else:
            out = torch.empty_strided(out.shape, stride, dtype=out.dtype, device=out.device).copy_(out)
    return out if dead is None else out.masked_fill_(dead, 0)


def in_order(q: torch.Tensor, v: torch.Tensor, order: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of the attention output [..., L, Ev] of `q` and `v` laid out densely in the
    order of dims `order` (outermost first: gjit/lowering/attention_library.py's ANY_LAYOUT)."""
    shape, strides, step = (*q.shape[:-1], v.shape[-1]), [0] * q.dim(), 1
    for dim in reversed(order):
        strides[dim] = step
        step *= shape[dim]
    return tuple(strides)


MAX_HEADS = 65535  # a CUDA grid's y and z dims: the fused kernels launch one per batch and head


class _FromTheMask:
    """`written_out`'s default `dead`: the rows that keep no key, found from the mask it is given."""


FROM_THE_MASK = _FromTheMask()


def hidden_rows(mask: torch.Tensor) -> torch.Tensor:
    """Whether a query keeps no key under an additive mask (every one -inf): [..., L, 1]."""
    return mask.amax(-1, keepdim=True) == float("-inf")


def written_out(
    sdpa: Callable,
    stride: tuple[int, ...] | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    dead: torch.Tensor | _FromTheMask | None = FROM_THE_MASK,
    **kwargs: Any,
) -> torch.Tensor:
    """`sdpa` (ATen's scaled_dot_product_attention) for an attention written out in the program
    (gjit/lowering/attention_library.py), its output in `stride` (the value the compile gave it;
    None: contiguous; ATen's fused kernels on a GPU return another layout). With no queries or no
    keys: zeros, as eager's products over them give (the fused kernels refuse some empty sizes);
    over MAX_HEADS batches or heads, in parts. With a float mask (`attn_mask`): a fill below FAR
    goes in as FAR (the memory-efficient kernel scales scores and mask by log2(e) and finfo.min
    overflows to -inf, which makes a row every key of which it masks zeros, where eager averages
    the values), and a query every key of which it masks with -inf gives NaN, as eager's softmax
    over them does (the fused kernels give zeros). A mask the compile built from a fill holds only
    0, -inf and FAR: `dead` then says which queries keep no key (`hidden_rows`, once per call for
    the attentions that share the mask; None: none can, the fill is FAR)."""
    if stride is None:
        stride = make_contiguous_strides_for((*q.shape[:-1], v.shape[-1]))
    if q.numel() == 0 or k.shape[-2] == 0:
        return traced_layout(q.new_zeros((*q.shape[:-1], v.shape[-1])), None, stride)
    mask = kwargs.get("attn_mask")
    if mask is not None and dead is FROM_THE_MASK:
        # below FAR but not -inf: FAR (NaN stays NaN: a row it reaches is NaN in eager)
        kwargs = kwargs | {"attn_mask": mask.masked_fill((mask < FAR) & (mask != float("-inf")), FAR)}
        dead = hidden_rows(mask)
    out = traced_layout(_parts(sdpa, q, k, v, kwargs), None, stride)
    if mask is not None and dead is not None:
        out.masked_fill_(dead, float("nan"))
    return out


def interpreted(node: torch.fx.Node, args: tuple, kwargs: dict[str, Any]) -> torch.Tensor:
    """The SDPA call `node` (ANY_LAYOUT) as the wrapper makes it, on the values `args` and `kwargs`
    of its arguments: for an interpreter (the eager fallback, GJIT_CHECK's replay). A call of the
    program's own (not STANDS_FOR) keeps ATen's rows where its mask hides every key."""
    stride = in_order(args[0], args[2], node.meta[ANY_LAYOUT])
    if not node.meta.get(STANDS_FOR):
        kwargs = kwargs | {"dead": None}
    return written_out(node.target, stride, *args, **kwargs)


def _parts(
    sdpa: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict[str, Any]
) -> torch.Tensor:
    """`sdpa` over batch dim 0 and head dim 1 in parts of at most MAX_HEADS (a mask's dims that
    broadcast are not split; with grouped keys and values, `enable_gqa`, whole groups of query heads
    with their key/value heads, or parts of one group's)."""
    for dim in (0, 1):
        n = q.shape[dim]
        if n <= MAX_HEADS:
            continue
        groups = k.shape[dim] if dim == 1 and kwargs.get("enable_gqa") and k.shape[dim] not in (1, n) else 0
        size = n // groups if groups else 1  # query heads a group
        step = size * max(1, MAX_HEADS // size) if groups else MAX_HEADS
        parts = []
        for i in range(0, n, step):
            m = min(step, n - i)
            cut = [t.narrow(dim, i, m) if t.shape[dim] == n else t for t in (q, k, v)]
            if groups:  # the keys and values of the part's groups
                cut[1:] = (t.narrow(dim, i // size, m // size) for t in cut[1:])
            mask, part = kwargs.get("attn_mask"), kwargs
            at = dim - (q.dim() - mask.dim()) if mask is not None else -1  # broadcast from the right
            if at >= 0 and mask.shape[at] == n:
                part = kwargs | {"attn_mask": mask.narrow(at, i, m)}
            parts.append(_parts(sdpa, *cut, part))
        return torch.cat(parts, dim)
    return sdpa(q, k, v, **kwargs)
