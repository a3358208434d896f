"""SDPA calls whose mask the program builds from its sizes, called without it where it is proved
(gjit/lowering/causal.py) causal, as `is_causal=True`, or to keep every key, as no mask at all.

transformers builds its masks in the program, and under torch.export (as under torch.compile) it
hands them to SDPA whole: a causal LM's is `kv_idx <= q_idx` on position ids gathered by index
tensors, and-ed with a check that no sequence is packed (a running sum of the position ids' steps);
a bidirectional model without padding gets `q_idx >= 0`. Eager skips such masks. With one, ATen
runs the memory-efficient kernel reading the mask on every tile (the wrapper makes a boolean mask
additive once per call first: gjit/runtime/attention_masks.py), after the mask's own kernels have
written B x L x S of it; causal, it runs FlashAttention with the causal loop bound, and unmasked
the flash or cuDNN kernel, and the mask's kernels are gone. The template takes the causal bound
too, where it read the mask.

The call's value keeps the strides export traced for it with its mask (until
gjit/lowering/attention_layout.py gives it the layout the kernel returns); the kernel ATen picks
may return others, so the wrapper copies its output into them where they differ (ANY_LAYOUT:
gjit/runtime/attention_masks.py's `written_out`, which also gives zeros where there are no keys or
no queries, as eager's math does).
"""

from __future__ import annotations

import itertools
import logging

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from gjit.lowering.attention_library import ANY_LAYOUT
from gjit.lowering.causal import CAUSAL, Proofs
from gjit.lowering.held_masks import Held

log = logging.getLogger("gjit.lowering")
SDPA = torch.ops.aten.scaled_dot_product_attention.default
ASSERT = torch.ops.aten._assert_tensor_metadata.default  # export's check of a cast's result
PARAMETERS = ("attn_mask", "dropout_p", "is_causal")  # after query, key and value, in order


def _sizes_match(
    out: torch.Tensor, mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> bool:
    """The mask's last two dims are the queries' and the keys' (not broadcast to them), and it
    broadcasts to the output the queries give, which it does not widen (eager raises where it
    would: without the mask the call would give fewer batches than the program's value has)."""
    if mask.dim() < 2 or mask.dim() > q.dim() or not _same(out.shape, (*q.shape[:-1], v.shape[-1])):
        return False
    leading = zip(reversed(mask.shape[:-2]), reversed(q.shape[:-2]))
    return _same(mask.shape[-2:], (q.shape[-2], k.shape[-2])) and all(
        statically_known_true(a == 1) or statically_known_true(a == b) for a, b in leading
    )


def _same(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def dense_order(val: torch.Tensor) -> tuple[int, ...] | None:
    """The order of `val`'s dims in memory, outermost first, where it is dense in one for every size
    (ATen's kernels return the contiguous layout or [B, L, H, Ev]; a dim of size 1 may have any
    stride); None where it is not."""
    return next((o for o in itertools.permutations(range(val.dim())) if in_order(val, o)), None)


def in_order(val: torch.Tensor, order: tuple[int, ...]) -> bool:
    """Whether `val` is dense with its dims in memory in `order`, outermost first, for every size (a
    dim of size 1 may have any stride). Adds no guard."""
    step = 1
    for dim in reversed(order):
        size, stride = val.shape[dim], val.stride()[dim]
        if not (statically_known_true(size == 1) or statically_known_true(stride == step)):
            return False
        step = step * size
    return True


def dense_in(val: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """A tensor of `val`'s sizes, dtype and device, dense in `order` (outermost first); in the
    current fake mode."""
    strides, step = [0] * val.dim(), 1
    for dim in reversed(order):
        strides[dim], step = step, step * val.shape[dim]
    return torch.empty_strided(val.shape, strides, dtype=val.dtype, device=val.device)


def proved_masks(gm: torch.fx.GraphModule, held: Held | None = None) -> int:
    """Each SDPA call of `gm` whose mask is proved causal or to keep every key, called causal or
    without a mask, in place; how many. `held`: the buffers and constants whose contents a proof
    may read (gjit/lowering/held_masks.py)."""
    done, proofs = 0, Proofs(held)  # (the layers of a model share one mask: proved once)
    for node in gm.graph.find_nodes(op="call_function", target=SDPA):
        q, k, v, *rest = node.args
        kwargs = dict(zip(PARAMETERS, rest)) | dict(node.kwargs)
        mask = kwargs.get("attn_mask")
        if not isinstance(mask, torch.fx.Node) or kwargs.get("dropout_p", 0.0) != 0.0:
            continue
        if kwargs.get("is_causal"):  # (and a mask: SDPA raises)
            continue
        if not _sizes_match(node.meta["val"], *(t.meta["val"] for t in (mask, q, k, v))):
            continue
        order = dense_order(node.meta["val"])
        if order is None:
            continue
        proofs.discard()
        found = proofs(mask)
        if found is None:
            continue
        log.info("attention %s: its mask %s is proved %s: called %s", node.name, mask.name, found,
                 "with is_causal=True" if found == CAUSAL else "without it")  # fmt: skip
        del kwargs["attn_mask"]
        if found == CAUSAL:
            kwargs["is_causal"] = True
        node.args, node.kwargs = (q, k, v), kwargs
        node.meta[ANY_LAYOUT] = order
        proofs.commit()  # the held tensors this proof read: the entry's guard checks them
        done += 1
    if done:
        _unread(gm.graph)
        gm.graph.lint()
        gm.recompile()
    return done


def _unread(graph: torch.fx.Graph) -> None:
    """Erase the nodes nothing reads (the masks'), and export's checks of a cast's result where
    nothing else reads it (FX keeps those checks: they may raise)."""
    while True:
        graph.eliminate_dead_code()
        checks = [
            n for n in graph.find_nodes(op="call_function", target=ASSERT)
            if n.args[0].op == "call_function" and all(u.target is ASSERT for u in n.args[0].users)
        ]  # fmt: skip
        if not checks:
            return
        for n in checks:
            graph.erase_node(n)
