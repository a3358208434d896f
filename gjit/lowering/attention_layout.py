"""The layout of an SDPA call's output where the compile chooses it (ANY_LAYOUT): the one ATen's kernel
will return, where the program only permutes the output before it copies or reads it.

export traces a masked call in the layout of the kernel it picked for the mask: on a GPU, for a
boolean mask, the math path's contiguous [B, H, L, Ev]; a written-out attention's value is its last
product's, contiguous too. Once gjit/lowering/proved_masks.py or grouped_kv.py drop the mask, or
attention_library.py makes the written-out form one call, ATen runs a fused kernel, which returns
[B, L, H, Ev] in memory (the memory-efficient kernel always; FlashAttention and cuDNN in the
query's own order where the query is dense, and a query laid out so is the common case: a
`view(B, L, H, E).transpose(1, 2)` of a linear layer's output). The wrapper copied that into the
traced layout (`written_out`), and the program's `transpose(1, 2).contiguous()` (or the reshape
after it) copied it back: two copies of the output a layer, one of them a kernel launch.

Here the call's value takes the order the kernel returns (`returned_order`), the values of the
permutes that read it are traced again, and a contiguous clone of one that is now laid out as the
clone's own value reads the call's output in place. Only permutes are traced again: they add no
guard to the shape environment, and every layout is theirs to take. Any other op reading the
output or a permute of it (a `view(B * H, L, E)`, a slice, a product, an extern) keeps the traced
layout for the call: in eager and in the fallback interpreter, which runs ATen, such an op lays its
output out by its input's, and its traced value holds the traced one; so does the program's output.
Where the kernel returns another layout after all, the wrapper's copy puts it in this one: a
missed guess costs the copy it saves.
"""

from __future__ import annotations

import logging

import torch
from torch._subclasses.fake_tensor import maybe_get_fake_mode
from torch.fx.experimental.symbolic_shapes import statically_known_true

from gjit.compat import optimization_hint
from gjit.lowering.attention_library import ANY_LAYOUT
from gjit.lowering.grouped_kv import fits_flash
from gjit.lowering.proved_masks import PARAMETERS, SDPA, dense_in, dense_order

log = logging.getLogger("gjit.lowering")
aten = torch.ops.aten
PERMUTES = (aten.permute.default, aten.transpose.int)
RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
HEADS_INSIDE = (0, 2, 1, 3)  # [B, L, H, Ev] in memory: the memory-efficient kernel's output
CONTIGUOUS = (0, 1, 2, 3)
SIZES = (aten.sym_size.int, aten.sym_numel.default)  # read a value's sizes alone


def attention_layouts(gm: torch.fx.GraphModule, flash: bool) -> int:
    """Each SDPA call of `gm` whose output the wrapper lays out (ANY_LAYOUT) in the order ATen's
    kernel returns it, where the program allows (`flash`: whether FlashAttention runs on the card the
    compile is for: gjit/driver.py's `flash_attention_runs`); the clones that then copy a layout
    into itself read the output in place. How many calls changed."""
    done, changed = 0, False
    for node in gm.graph.find_nodes(op="call_function", target=SDPA):
        order = node.meta.get(ANY_LAYOUT)
        if order is None:  # a call of the program's own, its mask kept
            order = _traced_order(node)
            if order is None:
                continue
            changed = True
        changed |= _round_trips(node)
        new = returned_order(node, flash)
        if new is None or new == order or not _relayout(node, new):
            continue
        clones = _clones_in_place(node)
        log.info("attention %s: output laid out in the order %s that ATen's kernel returns (traced: %s); "
                 "%d clone(s) of it read it in place", node.name, new, order, clones)  # fmt: skip
        done, changed = done + 1, True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return done


def _traced_order(node: torch.fx.Node) -> tuple[int, ...] | None:
    """For a call of the program's own (its mask, if any, kept): the order of dims its value was
    traced in, which the wrapper now puts its output in (ANY_LAYOUT), where that is dense; its
    arguments after the value as keywords, as the wrapper's call takes them. None: not dense, the
    call stays as it is."""
    order = dense_order(node.meta["val"])
    if order is not None:
        q, k, v, *rest = node.args
        node.args, node.kwargs = (q, k, v), dict(zip(PARAMETERS, rest)) | dict(node.kwargs)
        node.meta[ANY_LAYOUT] = order
    return order


def returned_order(node: torch.fx.Node, flash: bool) -> tuple[int, ...] | None:
    """The order of dims (outermost first) ATen's kernel returns the 4-dim output of the SDPA call
    `node` in, by the rules of its kernels: on the CPU and in FlashAttention (and cuDNN), the
    query's where it is dense, else [B, L, H, Ev]; in the memory-efficient kernel (a mask, float32,
    a card before sm_80) [B, L, H, Ev]; in the math path (an operand whose last dim is strided, on
    the CPU a value head dim of its own) [B, H, L, Ev]. None: not 4 dims, keep the traced order."""
    q, k, v, *rest = node.args
    kwargs = dict(zip(PARAMETERS, rest)) | dict(node.kwargs)
    vals = [t.meta["val"] for t in (q, k, v)]
    if node.meta["val"].dim() != 4 or any(t.dim() != 4 for t in vals):
        return None
    if not _fused(*vals):
        return CONTIGUOUS  # the math path: its last product's [B, H, L, Ev]
    follows_query = vals[0].device.type == "cpu" or (
        flash and fits_flash(*vals) and kwargs.get("attn_mask") is None and not kwargs.get("dropout_p")
    )
    order = dense_order(vals[0]) if follows_query else None
    return order if order is not None else HEADS_INSIDE


def _fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a fused kernel will likely take the operands (else ATen runs the math path): each
    with its last dim's stride 1, and on the CPU the value's head dim the query's. By the sizes of
    the example the compile traced where they are symbolic: a guess, never a guard (a wrong one
    costs the copy `written_out` makes)."""
    if not all(optimization_hint(t.stride()[-1], fallback=0) == 1 for t in (q, k, v)):
        return False
    return q.device.type != "cpu" or optimization_hint(q.shape[-1], fallback=0) == optimization_hint(
        v.shape[-1], fallback=-1
    )


def _round_trips(node: torch.fx.Node) -> bool:
    """Reshapes of `node` back to its own sizes and layout (a written-out attention's output, [B, H,
    L, Ev] to [B * H, L, Ev] and back: gjit/lowering/attention_call.py) read as `node` itself by
    what reads them (the program's output keeps its node); whether there were any."""
    found, todo = False, [u for u in node.users if u.target in RESHAPES]
    while todo:
        view = todo.pop()
        todo += [u for u in view.users if u.target in RESHAPES]
        if same_layout(view.meta["val"], node.meta["val"]):
            view.replace_all_uses_with(node, delete_user_cb=lambda user: user.op != "output")
            found = True
    for view in reversed(list(node.graph.nodes)):  # the reshapes nothing reads now
        if found and view.target in RESHAPES and not view.users and _reshape_of(view, node):
            node.graph.erase_node(view)
    return found


def _reshape_of(view: torch.fx.Node, node: torch.fx.Node) -> bool:
    """Whether `view` is a reshape of `node`, or of one of it, and so on."""
    while view.target in RESHAPES:
        view = view.args[0]
    return view is node


def _relayout(node: torch.fx.Node, order: tuple[int, ...]) -> bool:
    """The value of `node` laid out densely in `order`, and those of the permutes that read it traced
    again; False (nothing changed) where another view reads it or the program returns it."""
    chain = _permutes(node)
    if chain is None:
        return False
    val = node.meta["val"]
    mode = maybe_get_fake_mode(val)
    with mode if mode is not None else torch._subclasses.FakeTensorMode():
        new = {node: dense_in(val, order)}
        for p in chain:
            new[p] = p.target(new[p.args[0]], *p.args[1:], **p.kwargs)
    for n, value in new.items():
        n.meta["val"] = value
    node.meta[ANY_LAYOUT] = order
    return True


def _permutes(node: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The permutes that read `node`, and those that read them (in the graph's order); None where
    anything but a permute, a contiguous clone or a read of sizes reads one of them: any other op
    lays out its output by its input's in eager (and in the fallback interpreter, which runs
    ATen), and its traced value holds the traced layout."""
    chain, todo = [], [node]
    while todo:
        for user in todo.pop().users:
            if user.target in PERMUTES:
                chain.append(user)
                todo.append(user)
            elif not (user.target in SIZES or _contiguous_clone(user)):
                return None
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(chain, key=order.__getitem__)


def _contiguous_clone(node: torch.fx.Node) -> bool:
    """A clone into the contiguous layout (`.contiguous()`, or a reshape's copy), whatever its input's."""
    return node.target is aten.clone.default and node.kwargs.get("memory_format") == torch.contiguous_format


def _aliases(target: object) -> bool:
    """Whether an op's output may share its input's memory (gjit lowers view, reshape and
    _unsafe_view as views: gjit/lowering/views.py)."""
    if target in (aten._unsafe_view.default, aten.reshape.default):
        return True
    return not isinstance(target, torch._ops.OpOverload) or target.is_view


def _clones_in_place(node: torch.fx.Node) -> int:
    """Replace each clone of `node` or of a permute of it whose value is laid out as its input's now
    by its input; how many. Not where an op that writes its input (index_put_: gjit's in-place
    capture) reads either, or a view of either: the two would be one tensor."""
    done = 0
    if _written(node):
        return 0
    for source in [node, *(u for u in _permutes(node) or [])]:
        for user in list(source.users):
            if not _contiguous_clone(user) or _written(user) or _returned(user):
                continue  # (a clone the program returns stays its own tensor)
            if same_layout(user.meta["val"], source.meta["val"]):
                user.replace_all_uses_with(source)
                source.graph.erase_node(user)
                done += 1
    return done


def _returned(node: torch.fx.Node) -> bool:
    """Whether the program returns `node` or a view of it."""
    todo = [node]
    while todo:
        for user in todo.pop().users:
            if user.op == "output":
                return True
            if _aliases(user.target):
                todo.append(user)
    return False


def _written(node: torch.fx.Node) -> bool:
    """Whether an op that writes its input reads `node` or a view of it."""
    todo = [node]
    while todo:
        for user in todo.pop().users:
            if isinstance(user.target, torch._ops.OpOverload) and user.target._schema.is_mutable:
                return True
            if user.op != "output" and _aliases(user.target):
                todo.append(user)
    return False


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same sizes, dtype and offset, and the same strides on every dim not of size 1."""
    if (
        a.dtype != b.dtype
        or a.dim() != b.dim()
        or not statically_known_true(a.storage_offset() == b.storage_offset())
    ):
        return False
    dims = zip(a.shape, b.shape, a.stride(), b.stride())
    return all(
        statically_known_true(n == m) and (statically_known_true(n == 1) or statically_known_true(s == t))
        for n, m, s, t in dims
    )
