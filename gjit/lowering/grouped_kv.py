"""SDPA calls whose keys and values are repeated for each query head of a group (grouped-query
attention: transformers' `repeat_kv`, `x[:, :, None].expand(B, KV, n, S, D).reshape(B, KV * n, S,
D)`) take the groups' own keys and values, with `enable_gqa=True`.

transformers hands SDPA the groups' tensors with `enable_gqa` only where the call has no mask; under
torch.export every call has one (the mask the program builds), so each layer copies its keys and
values n times, a kernel each, and the attention reads n times their bytes: a decode step copies the
whole cache so. Once gjit/lowering/proved_masks.py has dropped the mask, the call reads them
in place, as eager's unmasked call would: FlashAttention takes groups (ATen's memory-efficient
kernel does not, so the call keeps the copies where a mask stays), and so does gjit's attention
template. Taken where the operands are 16-bit (FlashAttention's dtypes; float32 would go to the math
path) with one head dim of at most 256.

The call's value keeps the layout it was traced in (ANY_LAYOUT, as for a dropped mask: the
wrapper's `written_out` copies the output into it where the kernel returns another), until
gjit/lowering/attention_layout.py gives it the kernel's.

One query a head (a decode step) needs no FlashAttention (`packed_queries`): the query heads of a
group are the rows of one query block of that group, `q.view(B, KV, n, D)`, against the group's keys
and values, under a mask that broadcasts over heads and rows as it did (or one per head, viewed the
same way), and the output is viewed back as [B, H, 1, Ev]. Every kernel takes that, the
memory-efficient one and its mask too: the static cache's decode steps, whose mask is an input, and
float32, read the cache in place (transformers' `pack_gqa` does the same for its own kernels).
"""

from __future__ import annotations

import logging

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import maybe_get_fake_mode
from torch.fx.experimental.symbolic_shapes import statically_known_true

from gjit.lowering.attention_library import ANY_LAYOUT, MASK_FILL, STANDS_FOR
from gjit.lowering.proved_masks import PARAMETERS, SDPA, dense_order

log = logging.getLogger("gjit.lowering")
aten = torch.ops.aten
SIZE = aten.sym_size.int
VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
MAX_HEADS = 65535  # gjit/runtime/attention_masks.py's MAX_HEADS: more run in parts of the query's
END = 2**62  # a slice's end at least this takes its dim to the end (export writes `x[:, :]` to 2**63 - 1)


def grouped_kv(gm: torch.fx.GraphModule) -> int:
    """Each unmasked SDPA call of `gm` whose keys and values are repeated per group, on the
    groups' tensors with enable_gqa=True, in place; how many."""
    done = 0
    for node in gm.graph.find_nodes(op="call_function", target=SDPA):
        q, k, v, *rest = node.args
        kwargs = dict(zip(PARAMETERS, rest)) | dict(node.kwargs)
        if kwargs.get("attn_mask") is not None or kwargs.get("dropout_p", 0.0) != 0.0:
            continue  # (a mask: ATen's memory-efficient kernel, which takes no groups)
        if kwargs.get("enable_gqa"):
            continue
        if not fits_flash(*(t.meta["val"] for t in (q, k, v))):
            continue
        heads = q.meta["val"].shape[-3]
        if not statically_known_true(heads <= MAX_HEADS):
            continue  # (the wrapper's call cuts more heads in parts, the query's alone)
        groups = [_groups(t, heads) for t in (k, v)]
        if None in groups or groups[0][1] != groups[1][1]:
            continue
        order = dense_order(node.meta["val"])
        if order is None:
            continue
        (k_groups, n), (v_groups, _) = groups
        log.info("attention %s: keys %s and values %s repeated %s times per group: called on %s and %s with "
                 "enable_gqa=True", node.name, k.name, v.name, n, k_groups.name, v_groups.name)  # fmt: skip
        node.args, node.kwargs = (q, k_groups, v_groups), kwargs | {"enable_gqa": True}
        node.meta[ANY_LAYOUT] = order
        done += 1
    if done:
        _tidy(gm)
    return done


def packed_queries(gm: torch.fx.GraphModule) -> int:
    """Each SDPA call of `gm` with one query a head whose keys and values are repeated per group
    (and left so by `grouped_kv`: a mask, or no FlashAttention), on the groups' tensors with the
    query heads of a group as its rows, in place; how many."""
    done = 0
    for node in list(gm.graph.find_nodes(op="call_function", target=SDPA)):
        q, k, v, *rest = node.args
        kwargs = dict(zip(PARAMETERS, rest)) | dict(node.kwargs)
        if kwargs.get("enable_gqa") or kwargs.get("is_causal") or kwargs.get("dropout_p", 0.0) != 0.0:
            continue  # (causal: one query sees the first key alone; as rows they would see more)
        query, out = q.meta["val"], node.meta["val"]
        if query.dim() != 4 or out.dim() != 4 or not statically_known_true(query.shape[2] == 1):
            continue
        groups = [_groups(t, query.shape[1]) for t in (k, v)]
        if None in groups or groups[0][1] != groups[1][1]:
            continue
        (k_groups, n), (v_groups, _) = groups
        mask = _rows_of(kwargs.get("attn_mask"), k_groups.meta["val"].shape[1], n)
        if mask is False:
            continue
        log.info("attention %s: one query a head, keys %s and values %s repeated %s times per group: "
                 "called on %s and %s, a group's heads as rows", node.name, k.name, v.name, n,
                 k_groups.name, v_groups.name)  # fmt: skip
        _pack(gm.graph, node, (k_groups, v_groups), mask, kwargs, n)
        done += 1
    if done:
        _tidy(gm)
    return done


def _tidy(gm: torch.fx.GraphModule) -> None:
    """After a rewrite: the copies nothing reads now go, and the module's code follows the graph."""
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()


def _rows_of(mask: torch.fx.Node | None, kv: int, n: int) -> torch.fx.Node | tuple | None | bool:
    """The mask of the packed call: `mask` itself where it broadcasts over heads (its head dim 1 or
    absent), None for none, ("heads", mask) where it has one per head (viewed as [B, KV, n, S] by
    `_pack`); False where it can be neither (not a tensor, or a head dim that is neither)."""
    if mask is None:
        return None
    val = mask.meta.get("val") if isinstance(mask, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() > 4:
        return False
    if val.dim() < 3 or statically_known_true(val.shape[-3] == 1):
        return mask
    per_head = statically_known_true(val.shape[-3] == kv * n) and statically_known_true(val.shape[-2] == 1)
    if val.dim() == 4 and per_head:
        return ("heads", mask)
    return False


def _pack(
    graph: torch.fx.Graph,
    node: torch.fx.Node,
    groups: tuple[torch.fx.Node, torch.fx.Node],
    mask: torch.fx.Node | tuple | None,
    kwargs: dict,
    n: int,
) -> None:
    """`node` (SDPA over [B, H, 1, D]) as the view [B, H, 1, Ev] of one call over [B, KV, n, ...]."""
    q = node.args[0]
    mode = maybe_get_fake_mode(node.meta["val"])

    def call(op, args: tuple, kw: dict) -> torch.fx.Node:
        new = graph.call_function(op, args, kw)
        fake = pytree.tree_map_only(torch.fx.Node, lambda a: a.meta["val"], (args, kw))
        with mode if mode is not None else torch._subclasses.FakeTensorMode():
            if op is SDPA:  # (not traced through the op: its backend choice would add guards)
                query, _, value = fake[0][:3]
                new.meta["val"] = query.new_empty((*query.shape[:-1], value.shape[-1]))
            else:
                new.meta["val"] = op(*fake[0], **fake[1])
        for key in ("stack_trace", "nn_module_stack"):
            if key in node.meta:
                new.meta[key] = node.meta[key]
        return new

    def size(t: torch.fx.Node, dim: int) -> int | torch.fx.Node:
        value = t.meta["val"].shape[dim]
        if isinstance(value, torch.SymInt) and value.node.expr.is_number:
            value = int(value.node.expr)
        return value if isinstance(value, int) else call(SIZE, (t, dim), {})

    with graph.inserting_before(node):
        kv = size(groups[0], 1)
        rows = call(aten.view.default, (q, [size(q, 0), kv, n, size(q, 3)]), {})
        packed = {key: value for key, value in kwargs.items() if key != "attn_mask"}
        if isinstance(mask, tuple):  # one mask a head: the heads of a group are its rows too
            m = mask[1]
            packed["attn_mask"] = call(aten.view.default, (m, [size(m, 0), kv, n, size(m, 3)]), {})
        elif mask is not None:
            packed["attn_mask"] = mask
        sdpa = call(SDPA, (rows, *groups), packed)
        sdpa.meta[ANY_LAYOUT] = tuple(range(4))  # (the view back merges KV and n: contiguous)
        back = [size(q, 0), size(q, 1), 1, size(groups[1], 3)]
        view = call(aten.view.default, (sdpa, back), {})
    # the call's node becomes the view, under its name (the program's signature may name it an output)
    node.target, node.args, node.kwargs, node.meta["val"] = view.target, view.args, {}, view.meta["val"]
    for key in (ANY_LAYOUT, STANDS_FOR, MASK_FILL):
        node.meta.pop(key, None)
    graph.erase_node(view)


def fits_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """16-bit operands of 4 dims, one head dim (a number) of at most MAX_HEAD_DIM."""
    dims = [t.shape[-1] for t in (q, k, v)]
    return (
        all(t.dim() == 4 and t.dtype == q.dtype for t in (q, k, v))
        and q.dtype in DTYPES
        and all(isinstance(d, int) and d == dims[0] for d in dims)
        and dims[0] <= MAX_HEAD_DIM
    )


def _groups(node: torch.fx.Node, heads: int | torch.SymInt) -> tuple[torch.fx.Node, int] | None:
    """(x [B, KV, S, D], n) where `node` is x with each of its KV heads repeated n times in a row
    (KV * n = `heads`): a view of a contiguous clone (for one head, of no clone) of x unsqueezed at
    dim 2 and expanded there to n (through slices that take whole dims), as export decomposes
    `repeat_kv`; None where it is not so."""
    if node.op != "call_function" or node.target not in VIEWS:
        return None
    clone = node.args[0]  # (one key/value head: the view of the expand needs none)
    if clone.op == "call_function" and clone.target is aten.clone.default:
        if clone.kwargs.get("memory_format", torch.contiguous_format) != torch.contiguous_format:
            return None
        clone = clone.args[0]
    expand = _whole(clone)
    if expand.op != "call_function" or expand.target is not aten.expand.default:
        return None
    unsqueezed = _whole(expand.args[0])
    if unsqueezed.op != "call_function" or unsqueezed.target is not aten.unsqueeze.default:
        return None
    if unsqueezed.args[1] not in (2, -3):
        return None
    x = _whole(unsqueezed.args[0])
    out, wide, source = (t.meta["val"] for t in (node, expand, x))
    if source.dim() != 4 or wide.dim() != 5 or out.dim() != 4:
        return None
    n = wide.shape[2]
    batch, kv, length, dim = source.shape
    pairs = [*zip(wide.shape, (batch, kv, n, length, dim)), *zip(out.shape, (batch, heads, length, dim))]
    if not isinstance(n, int) or n < 2 or not all(statically_known_true(a == b) for a, b in pairs):
        return None
    if not statically_known_true(kv * n == heads):
        return None
    return x, n


def _whole(node: torch.fx.Node) -> torch.fx.Node:
    """`node` through slices that take their dim whole (export writes `x[:, :, None]` so)."""
    while node.op == "call_function" and node.target is aten.slice.Tensor:
        t, dim, start, end, step = (list(node.args) + [0, None, None, 1][len(node.args) - 1 :])[:5]
        size = t.meta["val"].shape[dim]
        end = end.meta.get("val") if isinstance(end, torch.fx.Node) else end
        to_the_end = end is None or (type(end) is int and end >= END) or statically_known_true(end >= size)
        if start not in (None, 0) or step != 1 or not to_the_end:
            return node
        node = t
    return node
