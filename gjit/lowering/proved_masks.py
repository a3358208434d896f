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

The call's value keeps the strides export traced for it with its mask; the kernel ATen picks
without one may return others, so the wrapper copies its output into them where they differ
(ANY_LAYOUT: gjit/runtime/attention_masks.py's `written_out`, which also gives zeros where there
are no keys or no queries, as eager's math does).
"""

from __future__ import annotations

import itertools
import logging

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from gjit.lowering.attention_library import ANY_LAYOUT
from gjit.lowering.causal import adds_nothing, is_causal, is_causal_additive, keeps_every_key

log = logging.getLogger("gjit.lowering")
SDPA = torch.ops.aten.scaled_dot_product_attention.default
ASSERT = torch.ops.aten._assert_tensor_metadata.default  # export's check of a cast's result
PARAMETERS = ("attn_mask", "dropout_p", "is_causal")  # after query, key and value, in order
CAUSAL, EVERY_KEY = "causal", "to keep every key"  # what a mask is proved


def _proved(mask: torch.fx.Node) -> str | None:
    """What `mask` is proved to be: CAUSAL, EVERY_KEY, or None (unproved)."""
    if mask.meta["val"].dtype == torch.bool:
        return EVERY_KEY if keeps_every_key(mask) else CAUSAL if is_causal(mask) else None
    return EVERY_KEY if adds_nothing(mask) else CAUSAL if is_causal_additive(mask) else None


def _sizes_match(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> bool:
    """The mask's last two dims are the queries' and the keys' (not broadcast to them)."""
    return mask.dim() >= 2 and all(
        statically_known_true(a == b) for a, b in zip(mask.shape[-2:], (q.shape[-2], k.shape[-2]))
    )


def _dense_order(val: torch.Tensor) -> tuple[int, ...] | None:
    """The order of `val`'s dims in memory, outermost first, where it is dense in one for every size
    (ATen's kernels return the contiguous layout or [B, L, H, Ev]; a dim of size 1 may have any
    stride); None where it is not."""
    for order in itertools.permutations(range(val.dim())):
        step, same = 1, True
        for dim in reversed(order):
            size, stride = val.shape[dim], val.stride()[dim]
            same = same and (statically_known_true(size == 1) or statically_known_true(stride == step))
            step = step * size
        if same:
            return order
    return None


def proved_masks(gm: torch.fx.GraphModule) -> int:
    """Each SDPA call of `gm` whose mask is proved causal or to keep every key, called causal or
    without a mask, in place; how many."""
    done, proofs = 0, {}  # mask -> what it is proved (the layers of a model share one)
    for node in gm.graph.find_nodes(op="call_function", target=SDPA):
        q, k, v, *rest = node.args
        kwargs = dict(zip(PARAMETERS, rest)) | dict(node.kwargs)
        mask = kwargs.get("attn_mask")
        if not isinstance(mask, torch.fx.Node) or kwargs.get("dropout_p", 0.0) != 0.0:
            continue
        if kwargs.get("is_causal"):  # (and a mask: SDPA raises)
            continue
        if not _sizes_match(mask.meta["val"], q.meta["val"], k.meta["val"]):
            continue
        order = _dense_order(node.meta["val"])
        if order is None:
            continue
        if mask not in proofs:
            proofs[mask] = _proved(mask)
        proved = proofs[mask]
        if proved is None:
            continue
        log.info("attention %s: its mask %s is proved %s: called %s", node.name, mask.name, proved,
                 "with is_causal=True" if proved == CAUSAL else "without it")  # fmt: skip
        del kwargs["attn_mask"]
        if proved == CAUSAL:
            kwargs["is_causal"] = True
        node.args, node.kwargs = (q, k, v), kwargs
        node.meta[ANY_LAYOUT] = order
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
