"""Written-out attention as ATen's scaled_dot_product_attention, on a GPU, where its score is the
product of queries and keys scaled, and masked by one float32 tensor added or keys hidden by a fill
(a vision transformer's `(q @ k.T * scale).softmax(-1) @ v`, transformers' eager attention with its
additive mask, minGPT's `masked_fill(bias == 0, -inf)`):

    scores = bmm(Q, K^T)                   Q: [N, L, D], K^T: [N, D, S] (N: batch x heads)
    x      = scores * c (+ M)              mul / div by numbers, then one tensor added, or a fill
                                           where(C, x, f) / where(C, f, x) among the scalings; float
                                           casts; a view to [..., L, S] after the product
    probs  = softmax(x, -1)                its input and output cast between float dtypes or not
    out    = bmm(probs, V)                 probs through views back to [N, L, S]; V: [N, S, Ev]
 -> out    = sdpa(Q, K, V, attn_mask=M, scale=c) on the [B, H, ...] tensors matmul merged into Q,
             K and V (and copied: their copies go), or on [1, N, ...], or with a mask on the [B, H,
             ...] of the scores' view (the mask broadcasts over those), viewed back as [N, L, Ev];
             for a fill, M = where(C, 0, F) (or where(C, F, 0)) in the operands' dtype, F = -inf
             or FAR (the rewrite: attention_call.py)

On a GPU the library's side of the choice for such an attention was then two products and a softmax
kernel that writes and reads the score matrix; ATen's fused kernels (FlashAttention, cuDNN, the
memory-efficient kernel) keep it on chip, and torch.compile makes the same replacement. gjit's
attention template takes an SDPA call as it takes the written-out form, so the template's side keeps
its kernel. What differs from eager is rounding: eager rounds the 16-bit scores, their scaling and
the mask's sum to 16 bits, the fused kernels keep them in float32.

A query every key of which the mask hides: with -inf, eager's softmax gives NaN, and so does the
call (the wrapper's, gjit/runtime/attention_masks.py: fused kernels give zeros; the template, as it
does for the written-out form); with a finite fill, eager adds it to the float32 scores as SDPA does:
the values' mean under finfo.min (handed to SDPA as FAR: the memory-efficient kernel's base-2
exponent overflows finfo.min), the scores' softmax under -1e4. A 16-bit mask (eager's 16-bit sum
rounds the scores away under -1e4, SDPA's float32 one does not), the scores cast to a narrower float
after the mask, a mask of another dtype than the operands', a mask added before the scale, two
masks or a negative scale keep the written-out form (lowering's attention_pattern.py makes it one
attention node for the template; the library's side is its two products and softmax kernel).

A fill (`Fill`) replaces the scores of the keys a boolean condition hides by a constant, or adds
one that swamps them: masked_fill and torch.where with -inf or a finite value at most FILL_LIMIT
(the values' mean where a query keeps no key, as FAR gives in SDPA), and a mask built in the
program as where(C, 0, F) with F = -inf or at most FAR and added (transformers' eager_mask in
float32 or bfloat16: the sum is F in eager's dtype and in SDPA's float32 alike). The fill is taken
as eager computes it through the scalings and casts after it (finfo.min doubled, or cast to a
narrower float, is -inf there). The call's mask is built from C (one per condition for the
attentions that share it), so a fill below FAR needs no clamping per call, and the wrapper finds
the queries that keep no key once per mask; a fill or an added mask the program builds from its
sizes that is the causal one (gjit/lowering/causal.py: triu, tril, aranges compared) makes the
call causal, with no mask (ATen's causal kernel, FlashAttention's where L == S; the template's
causal bound), as no query then keeps no key; one that hides no key (transformers' without
padding) is no mask. Where a hidden key's score is NaN or inf (inf in the
keys), eager's fill replaces it and the call's mask, added, does not: that query's row is NaN (as
ATen's own SDPA gives). A fill near the scores, by a tensor, finite on float16 operands (FAR is no
float16; -inf is taken), or with a mask keeps the written-out form.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers

import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.symbolic_shapes import statically_known_true

from gjit.lowering.causal import CAUSAL, Proofs

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


# an SDPA call whose output the wrapper puts in its value's strides, whatever kernel ATen picks: the
# order of its dims in them, outermost first (dense: an interpreter lays the output out by it)
ANY_LAYOUT = "gjit_attention_any_layout"
# an SDPA call that stands for a written-out attention: a query that keeps no key gives NaN in it
STANDS_FOR = "gjit_attention_written_out"
# an SDPA call whose mask the rewrite built from a fill (`Fill`): the fill's value, -inf or FAR
MASK_FILL = "gjit_attention_mask_fill"
# a hidden key's score in a mask the rewrite builds for a finite fill, and what the wrapper hands SDPA
# for a fill below it: times log2(e) (the memory-efficient kernel's base-2 exponent) it stays finite
# in float32, and a score added to it rounds to it (under 2**75)
FAR = -(2.0**100)
# a finite fill at or below this replaces a score: a key it hides weighs exp(fill - m) in eager's
# softmax (m: the row's largest kept score), 0 in float32 unless every kept score of the row is below
# fill + 104 (-896 here: no attention's); SDPA gives it 0 always. -1e4 in bfloat16 is -9984
FILL_LIMIT = -1e3


@dataclasses.dataclass(frozen=True)
class Fill:
    """Keys hidden by a boolean tensor: the scores where `cond` is not `keep` are `value` (-inf, or
    FAR for a finite fill that replaces them or is added to them and swamps them)."""

    cond: torch.fx.Node
    keep: bool
    value: float


@dataclasses.dataclass
class WrittenOut:
    """One match: the products, the scale, the mask, and the nodes the SDPA call replaces."""

    scores: torch.fx.Node  # bmm(Q, K^T)
    out: torch.fx.Node  # bmm(probs, V)
    scale: float
    mask: torch.fx.Node | None  # the tensor added to the scaled score (None: none)
    fill: Fill | None  # or the keys a fill hides (the call's mask is built from it)
    causal: bool  # or a mask or fill proved causal: the call is causal, without a mask
    view: torch.fx.Node | None  # the scores' view to [..., L, S] (None: none, they are [N, L, S])
    replaced: list[torch.fx.Node]  # from the output's side back to the scores
    # each size read of a replaced node -> (an earlier node with that size, its dim)
    sizes: dict[torch.fx.Node, tuple[torch.fx.Node, int]] = dataclasses.field(default_factory=dict)
    asserts: list[torch.fx.Node] = dataclasses.field(default_factory=list)  # of replaced nodes


def tensor_val(node: torch.fx.Node) -> torch.Tensor | None:
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
    val = tensor_val(node)
    if val is None or val.dim() < 3:
        return False
    return all(statically_known_true(x == y) for x, y in zip(val.shape[-2:], rows_keys))


def _through(node: torch.fx.Node, kinds: tuple, user: torch.fx.Node, visited: list) -> torch.fx.Node:
    """Back from `node` (read only by `user`) through nodes of `kinds` read only by what follows."""
    while node.op == "call_function" and node.target in kinds and _only_user(node, user):
        if node.target is aten.expand.default:
            sizes = tensor_val(node), tensor_val(node.args[0])
            if None in sizes or not _same_sizes(*sizes):
                break  # a broadcast: not the same elements
        visited.append(node)
        user, node = node, node.args[0]
    return node


def _float_cast(node: torch.fx.Node) -> bool:
    """A cast between float dtypes only (no layout, device or memory format change)."""
    if node.target is torch.ops.prims.convert_element_type.default:
        return node.args[1] in FLOATS
    kwargs, source = node.kwargs, tensor_val(node.args[0])
    return (
        len(node.args) == 1
        and kwargs.get("dtype") in FLOATS
        and kwargs.get("layout", torch.strided) == torch.strided
        and source is not None
        and torch.device(kwargs.get("device", source.device)) == source.device
        and kwargs.get("memory_format", torch.preserve_format) == torch.preserve_format
        and set(kwargs) <= {"dtype", "layout", "device", "memory_format"}
    )


def match(out: torch.fx.Node, proofs: Proofs | None = None) -> WrittenOut | None:
    """The written-out attention `out` ends, or None; `proofs`: what masks are proved so far (the
    layers of a model share one mask)."""
    known = Proofs() if proofs is None else proofs
    if out.target is not aten.bmm.default:
        return None
    probs, values = out.args
    val = tensor_val(out)
    if val is None or val.dtype not in FLOATS or tensor_val(probs) is None:
        return None
    replaced: list[torch.fx.Node] = []
    rows_keys = tuple(tensor_val(probs).shape[-2:])
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
    if not _rows_and_keys(softmax, rows_keys) or dim not in (-1, tensor_val(softmax).dim() - 1):
        return None
    replaced.append(softmax)
    scale, mask, fill, narrowed, node, user = 1.0, None, None, False, x, softmax
    causal = False
    later: list[torch.fx.Node] = []  # the scalings and casts after a fill, back from the softmax
    while True:  # the score's scalings, mask or fill and casts back to the view of the product
        if node.op != "call_function" or not _only_user(node, user):
            return None
        chain = None
        if node.target in CASTS and _float_cast(node):
            narrowed |= mask is None and fill is None and _narrows(node)
        elif node.target is aten.add.Tensor and len(node.args) == 2 and not node.kwargs:
            if mask is not None or fill is not None or causal or scale != 1.0:
                return None  # a second term, or a term added before a scale (which scales it too)
            lhs, rhs = node.args
            leads = [isinstance(a, torch.fx.Node) and _leads_to_product(a, node) for a in (lhs, rhs)]
            if leads.count(True) != 1:
                return None
            chain, mask = (lhs, rhs) if leads[0] else (rhs, lhs)
            if not isinstance(mask, torch.fx.Node) or tensor_val(mask) is None or tensor_val(chain) is None:
                return None
            if not _same_sizes(tensor_val(node), tensor_val(chain)):
                return None  # the mask broadcasts the scores up
            fill = _added_fill(mask, tensor_val(node).dtype, later)
            # (a bool added is no mask; a float64 one makes the softmax float64, as a cast would)
            additive = (
                fill is None and tensor_val(mask).dtype.is_floating_point and tensor_val(node).dtype in FLOATS
            )
            kind = known(mask, True) if additive else None  # causal, or zeros: no mask
            if fill is not None or kind is not None:
                causal, mask = kind == CAUSAL, None
            elif narrowed:
                return None  # a fill rounded to a narrower float after the add (finfo.min to -inf)
        elif node.target is aten.where.self and len(node.args) == 3 and not node.kwargs:
            found = _where_fill(node)
            if found is None or mask is not None or fill is not None or causal or not scale > 0:
                return None  # a fill by a tensor, a second term, a scale that reverses the fill
            chain, cond, keep, value = found
            if not _same_sizes(tensor_val(node), tensor_val(chain)):
                return None  # the condition broadcasts the scores up
            value = _as_eager(value, tensor_val(node).dtype, later)
            fill = _replacing_fill(cond, keep, value)
            if fill is None:
                log.debug("attention %s: stays written out: a fill of %g", out.name, value)
                return None
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
        if node.target in CASTS or node.target in SCALES:
            later.append(node)
        replaced.append(node)
        user, node = node, chain if chain is not None else _tensor_arg(node)
    scores = _through(node, SAME_ELEMENTS, user, replaced)
    if scores.target is not aten.bmm.default or not _only_user(scores, replaced[-1] if replaced else user):
        return None
    if scores is not node and not _rows_and_keys(node, rows_keys):
        return None
    queries, keys = scores.args
    tensors = [tensor_val(n) for n in (queries, keys, values)]
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
    cond = fill.cond if fill is not None else None
    kind = known(fill.cond, fill.keep) if fill is not None else None
    if kind is not None:  # the fill's value does not matter: every query keeps key 0, or every key
        causal, fill = kind == CAUSAL, None
    if {queries, keys, values, mask, cond} & set(replaced):
        return None  # an operand is what the call replaces (probabilities as values: bmm(p, p))
    view = node if scores is not node else None
    why = None
    if mask is not None:
        why = _mask_dtype_reason(tensor_val(mask), tensors[0].dtype) or _mask_shape_reason(
            tensor_val(mask), view
        )
    elif fill is not None:
        why = _fill_reason(fill, tensors[0].dtype) or _mask_shape_reason(tensor_val(fill.cond), view)
    if why is not None:
        log.debug("attention %s: stays written out: %s", out.name, why)
        return None
    m = WrittenOut(scores, out, scale, mask, fill, causal, view, replaced)
    return m if _size_sources(m) else None


def _narrows(cast: torch.fx.Node) -> bool:
    """A cast to a float of fewer bits (or bfloat16's other rounding) than its input's."""
    target = _cast_dtype(cast)
    return tensor_val(cast.args[0]).dtype != target and target != torch.float32


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


def _mask_dtype_reason(mask: torch.Tensor, dtype: torch.dtype) -> str | None:
    """Why a mask added to the scores does not go to SDPA as its attn_mask for its dtype, or None.
    Its dtype is the operands' (SDPA takes no other float mask), float32: in a row every key of
    which is masked with a finite fill, eager adds it in the scores' dtype, and SDPA in float32. In
    float32 the two agree (the values' average under finfo.min, the scores' softmax under -1e4); in
    bfloat16 or float16 eager's sum rounds the scores away under a fill of -1e4 and averages the
    values (a mask built of 0 and a fill at or below FAR is a `Fill`: its sum is the fill in both). A
    row masked with -inf is NaN in eager, and the wrapper makes it NaN; a fill below FAR goes in as
    FAR (both: gjit/runtime/attention_masks.py)."""
    if mask.dtype != dtype or dtype != torch.float32:
        return f"a {mask.dtype} mask on {dtype} operands"
    return None


def _fill_reason(fill: Fill, dtype: torch.dtype) -> str | None:
    """Why keys hidden by a fill do not go to SDPA as a mask of the operands' dtype, or None: FAR
    is no float16 (its largest is 65504; a mask of finfo.min there leaves the scores in SDPA's
    float32 sum, where eager's replaced them)."""
    if fill.value != float("-inf") and dtype == torch.float16:
        return "a finite fill on float16 operands"
    return None


def _mask_shape_reason(mask: torch.Tensor, view: torch.fx.Node | None) -> str | None:
    """Why a mask (or a fill's condition) does not go to SDPA for its dims, or None. The scores'
    batch dims are one (N) or two ([B, H]: from their view, each a size, not -1), the mask's dims
    no more."""
    if mask.dim() < 2:
        return "a mask of fewer dims than rows and keys (SDPA reads both)"
    if view is None:
        return None if mask.dim() <= 3 else "a mask of more dims than the scores"
    sizes = view.args[1] if len(view.args) > 1 else None
    if tensor_val(view).dim() != 4 or not isinstance(sizes, (list, tuple)) or len(sizes) != 4:
        return "scores not viewed as [B, H, L, S]"
    if any(isinstance(s, int) and s < 0 for s in sizes[:2]) or mask.dim() > 4:
        return "batch and heads not sizes"
    return None


def _constant(node: object, dtype: torch.dtype) -> float | None:
    """The number a 0-dim constant node holds (scalar_tensor, full([])), rounded to its dtype and
    then to `dtype` (where it goes); None for any other node."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    val = tensor_val(node)
    if val is None or val.dim() != 0 or not val.dtype.is_floating_point:
        return None
    if node.target is aten.scalar_tensor.default:
        number = node.args[0]
    elif node.target is aten.full.default and list(node.args[0]) == []:
        number = node.args[1]
    else:
        return None
    if not isinstance(number, numbers.Real) or isinstance(number, bool):
        return None
    return torch.tensor(float(number), dtype=val.dtype).to(dtype).item()


def _where_fill(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, bool, float] | None:
    """For `where(cond, a, b)` with one side the scores and the other a constant: (the scores' side,
    cond, the value of cond where a key is kept, the constant in the where's dtype); else None."""
    cond, a, b = node.args
    if (
        not isinstance(cond, torch.fx.Node)
        or tensor_val(cond) is None
        or tensor_val(cond).dtype != torch.bool
    ):
        return None
    for chain, other, keep in ((b, a, False), (a, b, True)):
        value = _constant(other, tensor_val(node).dtype)
        if value is not None and isinstance(chain, torch.fx.Node) and _leads_to_product(chain, node):
            return chain, cond, keep, value
    return None


def _cast_dtype(cast: torch.fx.Node) -> torch.dtype:
    return cast.args[1] if len(cast.args) > 1 else cast.kwargs.get("dtype")


def _as_eager(value: float, dtype: torch.dtype, later: list[torch.fx.Node]) -> float:
    """A fill's `value` in `dtype` through the scalings and casts after it (`later`, back from the
    softmax), as eager computes them on the scores: a fill that overflows there is -inf."""
    fill = torch.tensor(value, dtype=dtype)
    for node in reversed(later):
        if node.target in CASTS:
            fill = fill.to(_cast_dtype(node))
        else:
            lhs, rhs = node.args
            fill = node.target(fill, rhs if isinstance(lhs, torch.fx.Node) else lhs)
    return fill.item()


def _replacing_fill(cond: torch.fx.Node, keep: bool, value: float) -> Fill | None:
    """Keys whose scores become `value` (as the softmax sees it) where `cond` is not `keep`: -inf,
    or a finite fill at or below FILL_LIMIT (a row every key of which it hides averages the values,
    as under FAR)."""
    if value == float("-inf"):
        return Fill(cond, keep, value)
    if math.isfinite(value) and value <= FILL_LIMIT:
        return Fill(cond, keep, FAR)
    return None


def _added_fill(mask: torch.fx.Node, dtype: torch.dtype, later: list[torch.fx.Node]) -> Fill | None:
    """A mask built as `where(cond, 0, F)` (or `where(cond, F, 0)`) and added to the scores as a
    `Fill`, where F is -inf or at most FAR: the sum in `dtype` is F, whatever the score (below
    2**75), as eager's 16-bit sum and SDPA's float32 one both give, then F through the casts after
    it (`later`: -inf where one overflows); None for any other mask."""
    if mask.op != "call_function" or mask.target is not aten.where.self or mask.kwargs:
        return None
    cond, a, b = mask.args
    if (
        not isinstance(cond, torch.fx.Node)
        or tensor_val(cond) is None
        or tensor_val(cond).dtype != torch.bool
    ):
        return None
    a, b = (_constant(x, tensor_val(mask).dtype) for x in (a, b))
    if a is None or b is None or 0.0 not in (a, b):
        return None
    keep, value = (True, b) if a == 0.0 else (False, a)
    value = torch.tensor(value, dtype=tensor_val(mask).dtype).to(dtype).item()  # in the sum's dtype
    if value != float("-inf") and not (math.isfinite(value) and value <= FAR):
        return None
    return Fill(cond, keep, FAR if math.isfinite(_as_eager(value, dtype, later)) else float("-inf"))


def _size_sources(m: WrittenOut) -> bool:
    """For each read of a replaced node's size (export reads the sizes of what a view reshapes, and
    a later view may read them too), a node before the scores with that size; False when one has
    none (or a replaced node's strides are read)."""
    gone = set(m.replaced)
    earlier: list[torch.fx.Node] = []
    for node in m.scores.graph.nodes:
        if node is m.scores:
            break
        if node not in gone and tensor_val(node) is not None:
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
            size = tensor_val(node).shape[user.args[1]]
            source = next(((n, d) for n in reversed(earlier) for d, s in enumerate(tensor_val(n).shape)
                           if statically_known_true(s == size)), None)  # fmt: skip
            if source is None:
                return False
            m.sizes[user] = source
    return True
