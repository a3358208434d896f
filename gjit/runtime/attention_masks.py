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


MAX_HEADS = 65535  # a CUDA grid's y and z dims


def written_out(sdpa: Callable, stride: tuple[int, ...], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                **kwargs: Any) -> torch.Tensor:  # fmt: skip
    """`sdpa` (ATen's scaled_dot_product_attention) for an attention written out in the program
    (gjit/lowering/attention_library.py), its output in `stride` (the value the compile gave it;
    ATen's fused kernels on a GPU return another layout). With no queries or no keys: zeros, as
    eager's products over them give (the fused kernels refuse some empty sizes); over MAX_HEADS
    heads (batch x heads of the program's attention), in parts. With a mask (`attn_mask`), a query
    every key of which it masks with -inf gives NaN, as eager's softmax over them does (the fused
    kernels give zeros or NaN)."""
    mask = kwargs.get("attn_mask")
    if q.numel() == 0 or k.shape[-2] == 0:
        out = q.new_zeros((*q.shape[:-1], v.shape[-1]))
    elif q.shape[1] > MAX_HEADS:  # the fused kernels launch a grid dim per head, at most 65535
        heads = q.shape[1]
        out = torch.cat([sdpa(*(t[:, i : i + MAX_HEADS] for t in (q, k, v)), **_part(kwargs, heads, i))
                         for i in range(0, heads, MAX_HEADS)], 1)  # fmt: skip
    else:
        out = sdpa(q, k, v, **kwargs)
    if mask is not None and out.numel():  # a row every key of which is masked with -inf: NaN, as eager's
        out = out.masked_fill(mask.amax(-1, keepdim=True) == float("-inf"), float("nan"))
    return traced_layout(out, None, stride)


def _part(kwargs: dict[str, Any], heads: int, i: int) -> dict[str, Any]:
    mask = kwargs.get("attn_mask")
    if mask is None or mask.dim() < 3 or mask.shape[-3] != heads:
        return kwargs
    return kwargs | {"attn_mask": mask[..., i : i + MAX_HEADS, :, :]}
