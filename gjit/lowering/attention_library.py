"""Written-out attention as ATen's scaled_dot_product_attention, on a GPU, where its score is the
product of queries and keys scaled, and masked by one float32 tensor added (a vision transformer's
`(q @ k.T * scale).softmax(-1) @ v`, transformers' eager attention with its additive mask):

    scores = bmm(Q, K^T)                   Q: [N, L, D], K^T: [N, D, S] (N: batch x heads)
    x      = scores * c (+ M)              mul / div by numbers, then one tensor added; float casts;
                                           a view to [..., L, S] after the product
    probs  = softmax(x, -1)                its input and output cast between float dtypes or not
    out    = bmm(probs, V)                 probs through views back to [N, L, S]; V: [N, S, Ev]
 -> out    = sdpa(Q, K, V, attn_mask=M, scale=c) on [1, N, ...], or with a mask on the [B, H, ...]
             of the scores' view (the mask broadcasts over those), viewed back as [N, L, Ev]

On a GPU the library's side of the choice for such an attention was then two products and a softmax
kernel that writes and reads the score matrix; ATen's fused kernels (FlashAttention, cuDNN, the
memory-efficient kernel) keep it on chip, and torch.compile makes the same replacement. gjit's
attention template takes an SDPA call as it takes the written-out form, so the template's side keeps
its kernel. What differs from eager is rounding: eager rounds the 16-bit scores, their scaling and
the mask's sum to 16 bits, the fused kernels keep them in float32.

A query every key of which the mask hides: with -inf, eager's softmax gives NaN, and so does the
call (the wrapper's, gjit/runtime/attention_masks.py: fused kernels give zeros; the template, as it
does for the written-out form); with a finite fill, eager adds it to the float32 scores as SDPA does:
the values' mean under finfo.min (handed to SDPA as -2**100: the memory-efficient kernel's base-2
exponent overflows finfo.min), the scores' softmax under -1e4. A 16-bit mask (eager's 16-bit sum
rounds the scores away under -1e4, SDPA's float32 one does not), the scores cast to a narrower float
after the mask, a mask of another dtype than the operands', a mask added before the scale, two
masks, a fill (masked_fill, where) or a negative scale keep the written-out form (lowering's
attention_pattern.py makes it one attention node for the template; the library's side is its two
products and softmax kernel).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import numbers

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import maybe_get_fake_mode
from torch.fx.experimental.symbolic_shapes import statically_known_true

log = logging.getLogger("gjit.lowering")
aten = torch.ops.aten

SCALES = (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar)
CASTS = (aten._to_copy.default, torch.ops.prims.convert_element_type.default)
# the element order of a view is its input's: a view from [..., L, S] to [N, L, S] or back, an expand
# to its own sizes, a copy
SAME_ELEMENTS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
                 aten.clone.default, aten.alias.default)  # fmt: skip
FLOATS = (torch.float16, torch.bfloat16, torch.float32)
SIZE = aten.sym_size.int
ASSERT = aten._assert_tensor_metadata.default  # export's check of a cast's result: goes with it
METADATA = (SIZE, aten.sym_stride.int, aten.sym_numel.default, ASSERT)  # a node's sizes, not its data


# an SDPA call whose output the wrapper puts in its value's strides, whatever kernel ATen picks
ANY_LAYOUT = "gjit_attention_any_layout"


def _attention_value(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The SDPA call's value: [1, N, L, Ev] or [B, H, L, Ev], contiguous, as the product it replaces
    was [N, L, Ev], so the values export traced for the nodes that read it hold. Not traced through
    the op: its backend choice would add guards to the shape environment (the head dims equal, a
    layout) that no input checks. ATen's fused kernels on a GPU return [B, L, H, Ev] in memory
    (FlashAttention, cuDNN, the memory-efficient kernel): the wrapper copies such an output into
    these strides (ANY_LAYOUT), a copy of the output the program's next kernels could read in place
    (a later step: the values of those nodes traced again)."""
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@dataclasses.dataclass
class WrittenOut:
    """One match: the products, the scale, the mask, and the nodes the SDPA call replaces."""

    scores: torch.fx.Node  # bmm(Q, K^T)
    out: torch.fx.Node  # bmm(probs, V)
    scale: float
    mask: torch.fx.Node | None  # the tensor added to the scaled score (None: none)
    view: torch.fx.Node | None  # the scores' view to [..., L, S] (None: none, they are [N, L, S])
    replaced: list[torch.fx.Node]  # from the output's side back to the scores
    # each size read of a replaced node -> (an earlier node with that size, its dim)
    sizes: dict[torch.fx.Node, tuple[torch.fx.Node, int]] = dataclasses.field(default_factory=dict)
    asserts: list[torch.fx.Node] = dataclasses.field(default_factory=list)  # of replaced nodes


def _val(node: torch.fx.Node) -> torch.Tensor | None:
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


def _only_user(node: torch.fx.Node, user: torch.fx.Node) -> bool:
    """`user` is the one node that reads `node`'s data, and reads it once (others may read its
    sizes)."""
    if [u for u in node.users if u.target not in METADATA] != [user]:
        return False
    reads = [a for a in pytree.tree_leaves((user.args, user.kwargs)) if a is node]
    return len(reads) == 1


def _same_sizes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dim() == b.dim() and all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape))


def _rows_and_keys(node: torch.fx.Node, rows_keys: tuple) -> bool:
    """`node` has a batch dim or more and its last two dims are (L, S)."""
    val = _val(node)
    if val is None or val.dim() < 3:
        return False
    return all(statically_known_true(x == y) for x, y in zip(val.shape[-2:], rows_keys))


def _through(node: torch.fx.Node, kinds: tuple, user: torch.fx.Node, visited: list) -> torch.fx.Node:
    """Back from `node` (read only by `user`) through nodes of `kinds` read only by what follows."""
    while node.op == "call_function" and node.target in kinds and _only_user(node, user):
        if node.target is aten.expand.default:
            sizes = _val(node), _val(node.args[0])
            if None in sizes or not _same_sizes(*sizes):
                break  # a broadcast: not the same elements
        visited.append(node)
        user, node = node, node.args[0]
    return node


def _float_cast(node: torch.fx.Node) -> bool:
    """A cast between float dtypes only (no layout, device or memory format change)."""
    if node.target is torch.ops.prims.convert_element_type.default:
        return node.args[1] in FLOATS
    kwargs, source = node.kwargs, _val(node.args[0])
    return (
        len(node.args) == 1
        and kwargs.get("dtype") in FLOATS
        and kwargs.get("layout", torch.strided) == torch.strided
        and source is not None
        and torch.device(kwargs.get("device", source.device)) == source.device
        and kwargs.get("memory_format", torch.preserve_format) == torch.preserve_format
        and set(kwargs) <= {"dtype", "layout", "device", "memory_format"}
    )


def match(out: torch.fx.Node) -> WrittenOut | None:
    """The written-out attention `out` ends, or None."""
    if out.target is not aten.bmm.default:
        return None
    probs, values = out.args
    val = _val(out)
    if val is None or val.dtype not in FLOATS or _val(probs) is None:
        return None
    replaced: list[torch.fx.Node] = []
    rows_keys = tuple(_val(probs).shape[-2:])
    node, user = probs, out
    while True:  # views back to the softmax's rows, casts between float dtypes
        before = _through(node, SAME_ELEMENTS, user, replaced)
        if before is not node:
            user = replaced[-1]
        node = before
        if (
            node.op == "call_function"
            and node.target in CASTS
            and _float_cast(node)
            and _only_user(node, user)
        ):
            replaced.append(node)
            user, node = node, node.args[0]
            continue
        break
    softmax = node
    if softmax.target is not aten._softmax.default or not _only_user(softmax, user):
        return None
    x, dim = softmax.args[:2]
    if not _rows_and_keys(softmax, rows_keys) or dim not in (-1, _val(softmax).dim() - 1):
        return None
    replaced.append(softmax)
    scale, mask, narrowed, node, user = 1.0, None, False, x, softmax
    while True:  # the score's scalings, mask and casts back to the view of the product
        if node.op != "call_function" or not _only_user(node, user):
            return None
        chain = None
        if node.target in CASTS and _float_cast(node):
            narrowed |= mask is None and _narrows(node)
        elif node.target is aten.add.Tensor and len(node.args) == 2 and not node.kwargs:
            if mask is not None or scale != 1.0:
                return None  # a second term, or a term added before a scale (which scales it too)
            if narrowed:
                return None  # a fill rounded to a narrower float after the add (finfo.min to -inf)
            lhs, rhs = node.args
            leads = [isinstance(a, torch.fx.Node) and _leads_to_product(a, node) for a in (lhs, rhs)]
            if leads.count(True) != 1:
                return None
            chain, mask = (lhs, rhs) if leads[0] else (rhs, lhs)
            if not isinstance(mask, torch.fx.Node) or _val(mask) is None or _val(chain) is None:
                return None
            if not _same_sizes(_val(node), _val(chain)):
                return None  # the mask broadcasts the scores up
        elif node.target in SCALES and len(node.args) == 2 and not node.kwargs:
            lhs, rhs = node.args
            number = rhs if isinstance(lhs, torch.fx.Node) else lhs
            if not isinstance(number, numbers.Real) or isinstance(number, bool) or not math.isfinite(number):
                return None
            if node.target in (aten.div.Tensor, aten.div.Scalar):
                if not isinstance(lhs, torch.fx.Node) or number == 0:
                    return None  # a number divided by the score is not a scale
                number = 1.0 / number
            scale *= float(number)
        else:
            break
        replaced.append(node)
        user, node = node, chain if chain is not None else _tensor_arg(node)
    scores = _through(node, SAME_ELEMENTS, user, replaced)
    if scores.target is not aten.bmm.default or not _only_user(scores, replaced[-1] if replaced else user):
        return None
    if scores is not node and not _rows_and_keys(node, rows_keys):
        return None
    queries, keys = scores.args
    tensors = [_val(n) for n in (queries, keys, values)]
    if (
        any(t is None for t in tensors)
        or len({t.dtype for t in tensors}) != 1
        or tensors[0].dtype not in FLOATS
    ):
        return None
    # a scale below 0 reverses the softmax's order: FlashAttention takes a row's max before scaling
    if not _rows_and_keys(scores, rows_keys) or not scale > 0:
        return None
    replaced.append(scores)
    if {queries, keys, values, mask} & set(replaced):
        return None  # an operand is what the call replaces (probabilities as values: bmm(p, p))
    view = node if scores is not node else None
    why = _mask_reason(_val(mask), tensors[0].dtype, view) if mask is not None else None
    if why is not None:
        log.debug("attention %s: stays written out: %s", out.name, why)
        return None
    m = WrittenOut(scores, out, scale, mask, view, replaced)
    return m if _size_sources(m) else None


def _narrows(cast: torch.fx.Node) -> bool:
    """A cast to a float of fewer bits (or bfloat16's other rounding) than its input's."""
    target = cast.args[1] if len(cast.args) > 1 else cast.kwargs.get("dtype")
    return _val(cast.args[0]).dtype != target and target != torch.float32


def _tensor_arg(node: torch.fx.Node) -> torch.fx.Node | None:
    return next((a for a in node.args if isinstance(a, torch.fx.Node)), None)


def _leads_to_product(node: torch.fx.Node, user: torch.fx.Node, steps: int = 16) -> bool:
    """`node`, read only by `user`, is a product (bmm) through views, casts, scalings and sums."""
    while steps > 0 and node.op == "call_function" and _only_user(node, user):
        if node.target is aten.bmm.default:
            return True
        if node.target is aten.add.Tensor:
            tensors = [a for a in node.args if isinstance(a, torch.fx.Node)]
            return any(_leads_to_product(a, node, steps - 1) for a in tensors)
        source = _tensor_arg(node)
        if node.target not in (*SAME_ELEMENTS, *CASTS, *SCALES) or source is None:
            return False
        user, node, steps = node, source, steps - 1
    return False


def _mask_reason(mask: torch.Tensor, dtype: torch.dtype, view: torch.fx.Node | None) -> str | None:
    """Why a mask added to the scores does not go to SDPA as its attn_mask, or None. Its dtype is
    the operands' (SDPA takes no other float mask), float32: in a row every key of which is masked
    with a finite fill, eager adds it in the scores' dtype, and SDPA in float32. In float32 the two
    agree (the values' average under finfo.min, the scores' softmax under -1e4); in bfloat16 or
    float16 eager's sum rounds the scores away under a fill of -1e4 and averages the values. A row
    masked with -inf is NaN in eager, and the wrapper makes it NaN; a fill below -2**100 goes in as
    -2**100, which the memory-efficient kernel's base-2 exponent does not overflow (both:
    gjit/runtime/attention_masks.py). The scores' batch dims are one (N) or two ([B, H]: from their
    view, each a size, not -1), the mask's dims no more."""
    if mask.dtype != dtype or dtype != torch.float32:
        return f"a {mask.dtype} mask on {dtype} operands"
    if mask.dim() < 2:
        return "a mask of fewer dims than rows and keys (SDPA reads both)"
    if view is None:
        return None if mask.dim() <= 3 else "a mask of more dims than the scores"
    sizes = view.args[1] if len(view.args) > 1 else None
    if _val(view).dim() != 4 or not isinstance(sizes, (list, tuple)) or len(sizes) != 4:
        return "scores not viewed as [B, H, L, S]"
    if any(isinstance(s, int) and s < 0 for s in sizes[:2]) or mask.dim() > 4:
        return "batch and heads not sizes"
    return None


def _size_sources(m: WrittenOut) -> bool:
    """For each read of a replaced node's size (export reads the sizes of what a view reshapes, and
    a later view may read them too), a node before the scores with that size; False when one has
    none (or a replaced node's strides are read)."""
    gone = set(m.replaced)
    earlier: list[torch.fx.Node] = []
    for node in m.scores.graph.nodes:
        if node is m.scores:
            break
        if node not in gone and _val(node) is not None:
            earlier.append(node)
    for node in m.replaced:
        for user in node.users:
            if user.target not in METADATA:
                continue
            if user.target is ASSERT:
                m.asserts.append(user)
                continue
            if user.target is not SIZE:
                return False
            size = _val(node).shape[user.args[1]]
            source = next(((n, d) for n in reversed(earlier) for d, s in enumerate(_val(n).shape)
                           if statically_known_true(s == size)), None)  # fmt: skip
            if source is None:
                return False
            m.sizes[user] = source
    return True


def _call(graph: torch.fx.Graph, op, args: tuple, kwargs: dict, *, like: torch.fx.Node) -> torch.fx.Node:
    """A new node computing `op`, its value traced on the graph's fake tensors (an SDPA call's: see
    `_attention_value`), `like`'s source line."""
    node = graph.call_function(op, args, kwargs)
    fake = pytree.tree_map_only(torch.fx.Node, lambda a: a.meta["val"], args)
    mode = maybe_get_fake_mode(_val(like))
    with mode if mode is not None else torch._subclasses.FakeTensorMode():
        if op is aten.scaled_dot_product_attention.default:
            node.meta["val"] = _attention_value(*fake[:3])
            node.meta[ANY_LAYOUT] = True
        else:
            node.meta["val"] = op(*fake, **kwargs)
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in like.meta:
            node.meta[key] = like.meta[key]
    return node


def rewrite(gm: torch.fx.GraphModule, m: WrittenOut) -> None:
    graph = gm.graph
    queries, keys_t = m.scores.args
    values = m.out.args[1]
    call = functools.partial(_call, graph, like=m.out)

    @functools.cache
    def size(node: torch.fx.Node, dim: int) -> int | torch.fx.Node:
        """A dim of `node`: the number, or one size node read wherever the rewrite needs it."""
        n = _val(node).shape[dim]
        return n if isinstance(n, int) else call(SIZE, (node, dim), {})

    with graph.inserting_before(m.out):
        kwargs: dict = {"scale": m.scale}
        if m.mask is not None and m.view is not None:  # [B, H] from the scores' view: the mask's
            batch = list(m.view.args[1][:2])
            q, k, v = (call(aten.view.default, (t, [*batch, size(t, 1), size(t, 2)]), {})
                       for t in (queries, keys_t, values))  # fmt: skip
            k = call(aten.permute.default, (k, [0, 1, 3, 2]), {})
            kwargs["attn_mask"] = m.mask
        else:  # [1, N]
            q = call(aten.unsqueeze.default, (queries, 0), {})
            k = call(aten.permute.default, (keys_t, [0, 2, 1]), {})
            k = call(aten.unsqueeze.default, (k, 0), {})
            v = call(aten.unsqueeze.default, (values, 0), {})
            if m.mask is not None:
                mask = m.mask
                if _val(mask).dim() == 3:
                    mask = call(aten.unsqueeze.default, (mask, 0), {})
                kwargs["attn_mask"] = mask
        sdpa = call(aten.scaled_dot_product_attention.default, (q, k, v), kwargs)
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


def written_out_as_sdpa(gm: torch.fx.GraphModule) -> int:
    """Each written-out attention of `gm` whose score is scaled and at most masked (the module's
    docstring) as one SDPA call, in place; how many. The caller runs it on graphs for a GPU."""
    done, gone = 0, set()
    for node in [n for n in gm.graph.nodes if n.target is aten.bmm.default]:
        if node in gone:  # the scores of an attention replaced already
            continue
        m = match(node)
        if m is None:
            continue
        log.info("attention %s: %s as ATen's scaled_dot_product_attention (scale %g)",
                 node.name, ", ".join(n.name for n in reversed(m.replaced)), m.scale)  # fmt: skip
        rewrite(gm, m)
        gone.update(m.replaced)
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done
