"""A written-out attention that gjit/lowering/attention_library.py matched, as one call of ATen's
scaled_dot_product_attention in the program (`rewrite`), and the pass that makes every such one so
(`written_out_as_sdpa`: on a GPU, gjit/driver.py's `library_attention`).
"""

from __future__ import annotations

import functools
import logging
import operator
from collections.abc import Callable

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import maybe_get_fake_mode
from torch.fx.experimental.symbolic_shapes import statically_known_true

from gjit.lowering.attention_library import (
    ANY_LAYOUT,
    MASK_FILL,
    SIZE,
    STANDS_FOR,
    Fill,
    WrittenOut,
    match,
    tensor_val,
)
from gjit.lowering.causal import Proofs
from gjit.lowering.held_masks import Held

log = logging.getLogger("gjit.lowering")
aten = torch.ops.aten
RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _attention_value(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The SDPA call's value: [1, N, L, Ev] or [B, H, L, Ev], contiguous, as the product it replaces
    was [N, L, Ev], so the values export traced for the nodes that read it hold. Not traced through
    the op: its backend choice would add guards to the shape environment (the head dims equal, a
    layout) that no input checks. ATen's fused kernels on a GPU return [B, L, H, Ev] in memory
    (FlashAttention, cuDNN, the memory-efficient kernel): the wrapper copies such an output into
    these strides (ANY_LAYOUT), until gjit/lowering/attention_layout.py gives the call the layout
    its kernel returns."""
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


def _call(graph: torch.fx.Graph, op, args: tuple, kwargs: dict, *, like: torch.fx.Node) -> torch.fx.Node:
    """A new node computing `op`, its value traced on the graph's fake tensors (an SDPA call's: see
    `_attention_value`), `like`'s source line."""
    node = graph.call_function(op, args, kwargs)
    fake = pytree.tree_map_only(torch.fx.Node, lambda a: a.meta["val"], args)
    mode = maybe_get_fake_mode(tensor_val(like))
    with mode if mode is not None else torch._subclasses.FakeTensorMode():
        if op is aten.scaled_dot_product_attention.default:
            node.meta["val"] = _attention_value(*fake[:3])
            node.meta[ANY_LAYOUT], node.meta[STANDS_FOR] = tuple(range(node.meta["val"].dim())), True
        else:
            node.meta["val"] = op(*fake, **kwargs)
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in like.meta:
            node.meta[key] = like.meta[key]
    return node


def _fill_mask(call: Callable, fill: Fill, dtype: torch.dtype, built: dict) -> torch.fx.Node:
    """The additive mask of `fill` in `dtype` (SDPA's: the operands'): 0 where a key is kept and
    the fill's value where not; one node per condition, value and dtype (`built`), which the
    attentions that read it share, as the wrapper shares its rows that keep no key."""
    key = (fill.cond, fill.keep, fill.value, dtype)
    if key not in built:
        device = tensor_val(fill.cond).device
        zero, hide = (call(aten.scalar_tensor.default, (x,), {"dtype": dtype, "device": device})
                      for x in (0.0, fill.value))  # fmt: skip
        args = (fill.cond, zero, hide) if fill.keep else (fill.cond, hide, zero)
        built[key] = call(aten.where.self, args, {})
    return built[key]


def rewrite(gm: torch.fx.GraphModule, m: WrittenOut, built: dict | None = None) -> None:
    """`m` as one SDPA call, in place; `built`: the masks built for fills so far (`_fill_mask`)."""
    graph = gm.graph
    queries, keys_t = m.scores.args
    values = m.out.args[1]
    call = functools.partial(_call, graph, like=m.out)
    mask = m.mask

    @functools.cache
    def size(node: torch.fx.Node, dim: int) -> int | torch.fx.Node:
        """A dim of `node`: the number, or one size node read wherever the rewrite needs it."""
        n = tensor_val(node).shape[dim]
        if isinstance(n, torch.SymInt) and n.node.expr.is_number:
            n = int(n.node.expr)
        return n if isinstance(n, int) else call(SIZE, (node, dim), {})

    with graph.inserting_before(m.out):
        if m.fill is not None:
            mask = _fill_mask(call, m.fill, tensor_val(queries).dtype, {} if built is None else built)
        kwargs: dict = {"scale": m.scale}
        if m.causal:
            kwargs["is_causal"] = True
        heads = _heads_of(queries, keys_t, values, mask, m.view)
        if heads is not None:  # [B, H]: the tensors matmul merged the dims of (and copied)
            q, k_t, v = heads
            k = call(aten.permute.default, (k_t, [0, 1, 3, 2]), {})
            if mask is not None:
                kwargs["attn_mask"] = mask
        elif mask is not None and m.view is not None:  # [B, H] from the scores' view: the mask's
            batch = list(m.view.args[1][:2])
            q, k, v = (call(aten.view.default, (t, [*batch, size(t, 1), size(t, 2)]), {})
                       for t in (queries, keys_t, values))  # fmt: skip
            k = call(aten.permute.default, (k, [0, 1, 3, 2]), {})
            kwargs["attn_mask"] = mask
        else:  # [1, N]
            q = call(aten.unsqueeze.default, (queries, 0), {})
            k = call(aten.permute.default, (keys_t, [0, 2, 1]), {})
            k = call(aten.unsqueeze.default, (k, 0), {})
            v = call(aten.unsqueeze.default, (values, 0), {})
            if mask is not None:
                if tensor_val(mask).dim() == 3:
                    mask = call(aten.unsqueeze.default, (mask, 0), {})
                kwargs["attn_mask"] = mask
        sdpa = call(aten.scaled_dot_product_attention.default, (q, k, v), kwargs)
        if m.fill is not None:
            sdpa.meta[MASK_FILL] = m.fill.value
        if heads is not None:  # (no size of the merged operands: nothing reads them now)
            batch, per_batch = size(heads[0], 0), size(heads[0], 1)
            if isinstance(batch, int) and isinstance(per_batch, int):
                merged = batch * per_batch
            else:
                merged = call(operator.mul, (batch, per_batch), {})
            sizes = [merged, size(heads[0], 2), size(heads[2], 3)]
        else:
            sizes = [size(queries, 0), size(queries, 1), size(values, 2)]
    # the product's node becomes the view of the call as [N, L, Ev], under its name (the program's
    # signature may name it an output) and with its value (contiguous, as the call's)
    m.out.target, m.out.args, m.out.kwargs = aten.view.default, (sdpa, sizes), {}
    for node in m.asserts:
        graph.erase_node(node)
    for user, (source, dim) in m.sizes.items():
        user.args = (source, dim)
    for node in m.replaced:  # from the softmax's readers back to the scores
        graph.erase_node(node)


def _heads_of(
    queries: torch.fx.Node,
    keys_t: torch.fx.Node,
    values: torch.fx.Node,
    mask: torch.fx.Node | None,
    view: torch.fx.Node | None,
) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node] | None:
    """The [B, H, ...] tensors whose batch and head dims the products' operands merge (`_heads`),
    where all three have the same B and H and the mask broadcasts to [B, H, L, S] as it did to the
    scores (it has at most 2 dims, or it was the scores' view's [B, H, L, S]); None otherwise."""
    heads = [_heads(t) for t in (queries, keys_t, values)]
    if None in heads:
        return None
    lead = [tensor_val(t).shape[:2] for t in heads]
    if not all(_same(a, lead[0]) for a in lead[1:]):
        return None
    if mask is not None and tensor_val(mask).dim() > 2:
        if view is None or not _same(tensor_val(view).shape[:2], lead[0]):
            return None
    return heads[0], heads[1], heads[2]


def _heads(node: torch.fx.Node) -> torch.fx.Node | None:
    """The [B, H, a, b] tensor the products' operand `node` ([B * H, a, b]) holds the elements of,
    where matmul's decomposition made it so: a view (or reshape) of a clone of an expand to the
    tensor's own sizes, of a clone, or of the tensor itself; None otherwise."""
    if node.target not in RESHAPES:
        return None
    source = node.args[0]
    if isinstance(source, torch.fx.Node) and source.target is aten.clone.default:
        source = source.args[0]
    if isinstance(source, torch.fx.Node) and source.target is aten.expand.default:
        expanded, inner = tensor_val(source), tensor_val(source.args[0])
        if expanded is None or inner is None or not _same(expanded.shape, inner.shape):
            return None  # (a broadcast: matmul's operand repeats the tensor's elements)
        source = source.args[0]
    val, merged = tensor_val(source), tensor_val(node)
    if val is None or merged is None or val.dim() != 4 or merged.dim() != 3:
        return None
    if not statically_known_true(val.shape[0] * val.shape[1] == merged.shape[0]):
        return None
    return source if _same(val.shape[2:], merged.shape[1:]) else None


def _same(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def written_out_as_sdpa(gm: torch.fx.GraphModule, held: Held | None = None) -> int:
    """Each written-out attention of `gm` whose score is scaled and at most masked (the module's
    docstring) as one SDPA call, in place; how many. The caller runs it on graphs for a GPU;
    `held`: the buffers and constants whose contents a proof may read (held_masks.py)."""
    done, gone, built, proofs = 0, set(), {}, Proofs(held)
    for node in [n for n in gm.graph.nodes if n.target is aten.bmm.default]:
        if node in gone:  # the scores of an attention replaced already
            continue
        m = match(node, proofs)
        if m is None:
            proofs.discard()  # (nothing its proofs read is read by the program now)
            continue
        log.info("attention %s: %s as ATen's scaled_dot_product_attention (scale %g)",
                 node.name, ", ".join(n.name for n in reversed(m.replaced)), m.scale)  # fmt: skip
        rewrite(gm, m, built)
        proofs.commit()
        gone.update(m.replaced)
        done += 1
    if done:  # what only the replaced nodes read (a fill's constants, a mask left for a causal call)
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return done
