"""Convolutions channels-last, and the layout flowing on from them (gjit/lowering/convolutions.py
decides where; this module lays the program out).

cuDNN's tensor-core kernels read and write channels-last (NHWC) memory; given contiguous (NCHW)
tensors, ATen's call transposes the input in and the output out around them. Here each 2-D (3-D)
convolution's input is cloned channels-last (NDHWC) where it is not already, one clone per value
(ATen then converts the weight, as it does for a channels-last input), and the layout flows on:
every node that reads a value whose layout changed gets a new value. Elementwise nodes, pads and
nearest upsamplings that gjit lowers take their inputs' order; any other is traced again on the
new values in export's fake mode, which lays out each op's output as ATen will (gjit's kernels
write what the value says; an ATen extern returns it). An op that may depend on its input's
strides (a `view` that cannot take the new ones, `as_strided`, a stride read, a library's op, a
higher-order op) and the program's outputs are boundaries: they get the value in its traced
layout again (a copy, or a view replayed on its source given back), so what they see and what
the caller gets are unchanged. A write into a changed value keeps the traced layout for the whole
program. Tracing on the new layout may guard a size (that a convolution's output is wider than 1,
where channels-last and contiguous would be one layout): such guards are the entry's (the driver
stores them with it, as decomposition's), so a call that breaks one compiles again.
"""

from __future__ import annotations

import contextlib
import logging
import operator

import torch
from torch._subclasses.fake_tensor import maybe_get_fake_mode
from torch.fx.experimental.symbolic_shapes import statically_known_true

from gjit.capture.export import shape_env_of
from gjit.compat import optimization_hint
from gjit.lowering.attention_layout import same_layout
from gjit.lowering.attention_library import ANY_LAYOUT
from gjit.lowering.proved_masks import dense_in, in_order
from gjit.lowering.registry import EXTERN_REASONS, LOWERINGS

log = logging.getLogger("gjit.lowering")
aten = torch.ops.aten
CONVOLUTION = aten.convolution.default
# ops whose result depends on their input's strides: never traced on a new layout
STRIDED = frozenset(
    {
        aten.as_strided.default,
        aten.as_strided_copy.default,
        aten.as_strided_scatter.default,
        aten.sym_stride.int,
        aten.sym_storage_offset.default,
        aten.view.dtype,
    }
)
SPLITS = (aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int)  # views, piece by piece
# ops traced on a new layout over symbolic sizes too (with the pointwise ones): what a convolutional
# network does between its convolutions, whose traces guard at most that a size is not 1
LAYOUT_FLOWS = frozenset(
    {
        CONVOLUTION,
        aten._native_batch_norm_legit_no_training.default,
        aten._native_batch_norm_legit.no_stats,
        aten._native_batch_norm_legit_functional.default,
        aten.native_group_norm.default,
        aten.native_layer_norm.default,
        aten._to_copy.default,
        aten.max_pool2d_with_indices.default,
        aten.avg_pool2d.default,
        aten._adaptive_avg_pool2d.default,
        aten.adaptive_max_pool2d.default,
        aten.max_pool3d_with_indices.default,
        aten.avg_pool3d.default,
        aten._adaptive_avg_pool3d.default,
        aten.adaptive_max_pool3d.default,
        aten.cat.default,
        *SPLITS,
        aten.sum.dim_IntList,
        aten.mean.dim,
        aten.amax.default,
        aten.amin.default,
        aten.var_mean.correction,
        aten.var.correction,
        aten.permute.default,
        aten.view.default,
        aten._unsafe_view.default,
        aten.expand.default,
        aten.slice.Tensor,
        aten.select.int,
        aten.squeeze.dims,
        aten.unsqueeze.default,
        aten.alias.default,
        aten.sym_size.int,
        aten.sym_numel.default,
    }
)
# one input resized (a pad, a nearest upsampling): gjit's kernel writes its input's order
RESIZES = frozenset({aten.constant_pad_nd.default, aten.upsample_nearest2d.vec})
# elementwise ops that are not tagged pointwise: their (first) output laid out as their input
ELEMENTWISE = frozenset({aten._native_batch_norm_legit_no_training.default, aten._to_copy.default})
# by the rank of a convolution's value: its dims in memory, outermost first, channels-last, and the
# memory format that lays it out so
CHANNELS_LAST = {4: ((0, 2, 3, 1), torch.channels_last), 5: ((0, 2, 3, 4, 1), torch.channels_last_3d)}


def channels_last(gm: torch.fx.GraphModule, convs: list[torch.fx.Node]) -> int:
    """`convs` reading channels-last inputs and the layout flowing on from them (the module's
    docstring); how many convolutions changed (0: the graph as it was)."""
    shape_env = shape_env_of([convs[0].meta["val"]])
    before = len(shape_env.guards) if shape_env is not None else 0
    try:
        plan = _Plan(gm.graph, convs)
    except _TakeBack as e:
        log.info("convolutions: layout kept as traced: %s", e)
        return 0
    if shape_env is not None and len(shape_env.guards) > before:
        added = ", ".join(str(g.expr) for g in shape_env.guards[before:])
        log.info("convolutions: the new layout's trace guards %s (the entry's guards check them)", added)
    plan.apply()
    log.info(
        "convolutions: %d of %d convolution(s) read channels-last inputs; %d value(s) laid out "
        "again, %d copied back for %d boundary reader(s)",
        len(plan.inputs), len(convs), len(plan.values), len(plan.restored), len(plan.boundaries),
    )  # fmt: skip
    return len(plan.inputs)


class _TakeBack(Exception):
    """The layout stays as traced (why)."""


class _Plan:
    """The new layout, worked out before the graph changes: the channels-last clone each convolution
    reads (one per value, however many convolutions read it), the new value of every node traced
    again, and the boundaries (a node and the inputs it gets back in their traced layout)."""

    def __init__(self, graph: torch.fx.Graph, convs: list[torch.fx.Node]):
        self.graph = graph
        self.inputs: dict[torch.fx.Node, torch.fx.Node] = {}  # conv -> the value it reads a clone of
        self.clones: dict[torch.fx.Node, torch.Tensor] = {}  # value -> its channels-last clone's
        self.values: dict[torch.fx.Node, object] = {}  # node -> its value in the new layout
        self.boundaries: dict[torch.fx.Node, list[torch.fx.Node]] = {}  # reader -> inputs given back
        self.restored: dict[torch.fx.Node, tuple] = {}  # input -> how: ("copy", ...) or ("view", base)
        self.convs = set(convs)
        self._flow()

    def value(self, node: torch.fx.Node, reader: torch.fx.Node | None = None):
        if reader is not None and self.inputs.get(reader) is node:
            return self.clones[node]
        return self.values.get(node, node.meta.get("val"))

    def _changed(self, node: torch.fx.Node) -> list[torch.fx.Node]:
        """The inputs of `node` whose value it would read in a new layout."""
        moved = [a for a in node.all_input_nodes if a in self.values]
        if node in self.inputs and node.args[0] not in moved:
            moved.append(node.args[0])
        return moved

    def _flow(self) -> None:
        for node in self.graph.nodes:
            if node in self.convs:
                self._clone_input(node)
            new = self._new_value(node)
            if node in self.inputs and not _channels_last(new):
                # ATen's kernel would not return channels-last (no cuDNN for it): a copy for nothing
                del self.inputs[node]
                new = self._new_value(node)
            if new is not None and not _exactly(new, node.meta["val"]):
                self.values[node] = new

    def _clone_input(self, conv: torch.fx.Node) -> None:
        x = conv.args[0]
        xval = self.value(x)
        order, memory_format = CHANNELS_LAST[xval.dim()]
        if in_order(xval, order):
            return
        if x not in self.clones:
            with fake_mode_of(xval):
                self.clones[x] = aten.clone.default(xval, memory_format=memory_format)
        self.inputs[conv] = x

    def _new_value(self, node: torch.fx.Node):
        """The value of `node` on its inputs' new values; None where it reads none (or reads them
        as traced: a boundary, whose inputs are given back)."""
        moved = self._changed(node)
        if not moved:
            return None
        if _writes(node):  # a copy would take the write
            raise _TakeBack(f"{node.name} ({node.target}) writes a value whose layout would change")
        new = self._kept(node)
        if new is None and _traceable(node):
            new = self._trace(node)
        if new is None:
            if node in self.inputs:
                raise _TakeBack(f"{node.name} does not trace on a channels-last input")
            self.boundaries[node] = [a for a in moved if a in self.values]
            for a in self.boundaries[node]:
                self._restore(a, node)
        return new

    def _kept(self, node: torch.fx.Node):
        """The value of an elementwise node gjit lowers (a pointwise op, a batch norm's output) whose
        inputs of its own sizes are all laid out densely in one order, in that order, as ATen's
        TensorIterator lays it out: no trace (a batch norm's costs 10-90 ms over symbolic sizes);
        of a padding or an upsampling gjit lowers, in its input's order (a trace over symbolic sizes
        would specialize them). None where that does not decide it."""
        target = node.target
        elementwise = target in ELEMENTWISE or (
            isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags
        )
        resized = target in RESIZES
        if not (elementwise or resized) or target not in LOWERINGS or target in EXTERN_REASONS:
            return None
        if node.kwargs.get("memory_format", torch.preserve_format) != torch.preserve_format:
            return None  # a clone or cast into a layout of its own (`.contiguous()`): traced
        old = node.meta.get("val")
        out = old[0] if isinstance(old, (list, tuple)) and old else old
        if not isinstance(out, torch.Tensor):
            return None
        if any(statically_known_true(n == 1) for n in out.shape):
            return None  # ATen's strides on dims of size 1 decide the next convolution's layout
        orders = set()
        for a in node.all_input_nodes:
            value = self.value(a, node)
            if not isinstance(value, torch.Tensor):
                continue
            if resized or _same_sizes(value, out):
                orders.add(_order(value))
            elif sum(not statically_known_true(n == 1) for n in value.shape) > 1:
                return None  # a broadcast input whose strides TensorIterator weighs too: traced
        if len(orders) != 1 or None in orders:
            return None
        with fake_mode_of(out):
            new = dense_in(out, orders.pop())
        return (new, *old[1:]) if out is not old else new

    def _trace(self, node: torch.fx.Node):
        """The value of `node` traced on its inputs' new values; None where the op refuses them (a
        view that cannot take the new strides)."""
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: self.value(a, node))
        if node.target is operator.getitem:
            return args[0][args[1]]
        try:
            with fake_mode_of(node.meta.get("val")):
                return _over(node.target(*args, **kwargs), node.meta.get("val"))
        except Exception as e:  # noqa: BLE001 - the op reads the traced layout instead
            log.debug("convolutions: %s (%s) does not trace on the new layout: %s", node.name, node.target, e)
            return None

    def _restore(self, a: torch.fx.Node, reader: torch.fx.Node) -> None:
        """How `a` is given back in its traced layout: a dense value copied into it, a view of a dense
        one (a slice of a feature map) replayed on its base given back. One per value."""
        if a in self.restored:
            return
        old = a.meta["val"]
        order = _order(old) if isinstance(old, torch.Tensor) else None
        if order is not None and statically_known_true(old.storage_offset() == 0):
            inverse = [order.index(d) for d in range(len(order))]
            with fake_mode_of(old):
                into = aten.permute.default(self.values[a], list(order))
                copy = aten.clone.default(into, memory_format=torch.contiguous_format)
                back = aten.permute.default(copy, inverse)
            if same_layout(back, old):
                self.restored[a] = ("copy", order, inverse, (into, copy, back))
                return
        source = _view_source(a)  # a view (a slice, a split's piece): replayed on its source given back
        if source is None or source not in self.values:
            raise _TakeBack(f"{reader.name} reads {a.name}, which cannot be given back its traced layout")
        self._restore(source, reader)
        split = a.args[0] if a.target is operator.getitem else None
        self.restored[a] = ("view", source, old, split.meta["val"] if split is not None else None)

    def apply(self) -> None:
        graph = self.graph
        clones = {}
        for x in dict.fromkeys(self.inputs.values()):  # one clone per value, after it
            value = self.clones[x]
            with graph.inserting_after(x):
                memory_format = CHANNELS_LAST[value.dim()][1]
                clones[x] = graph.call_function(aten.clone.default, (x,), {"memory_format": memory_format})
            _meta(clones[x], x, value)
        for conv, x in self.inputs.items():
            conv.replace_input_with(x, clones[x])
        for node, value in self.values.items():
            node.meta["val"] = value
        given_back: dict[torch.fx.Node, torch.fx.Node] = {}
        for a in self.restored:
            self._give_back(a, given_back)
        for node, moved in self.boundaries.items():
            for a in moved:
                node.replace_input_with(a, given_back[a])

    def _give_back(self, a: torch.fx.Node, given_back: dict) -> torch.fx.Node:
        """The node of `a` in its traced layout, made after `a` (so before every reader of it)."""
        if a in given_back:
            return given_back[a]
        graph, how = self.graph, self.restored[a]
        if how[0] == "view":
            source = self._give_back(how[1], given_back)
            with graph.inserting_after(a):
                if how[3] is not None:  # a piece of a split: the split replayed, its piece
                    split = a.args[0]
                    pieces = graph.call_function(split.target, (source, *split.args[1:]), dict(split.kwargs))
                    _meta(pieces, split, how[3])
                    with graph.inserting_after(pieces):
                        view = graph.call_function(operator.getitem, (pieces, a.args[1]))
                else:
                    view = graph.call_function(a.target, (source, *a.args[1:]), dict(a.kwargs))
            _meta(view, a, how[2])  # its traced value
            given_back[a] = view
            return view
        _, order, inverse, vals = how
        with graph.inserting_after(a):
            into = graph.call_function(aten.permute.default, (a, list(order)))
        with graph.inserting_after(into):
            contiguous = {"memory_format": torch.contiguous_format}
            copy = graph.call_function(aten.clone.default, (into,), contiguous)
        with graph.inserting_after(copy):
            back = graph.call_function(aten.permute.default, (copy, inverse))
        for new, value in zip((into, copy, back), vals):
            _meta(new, a, value)
        given_back[a] = back
        return back


def _view_source(node: torch.fx.Node) -> torch.fx.Node | None:
    """The tensor `node` is a view of (an ATen view's first argument, a split's input for one of
    its pieces), or None."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem and node.args[0].target in SPLITS:
        return node.args[0].args[0]
    target = node.target
    if isinstance(target, torch._ops.OpOverload) and target.is_view and node.args:
        return node.args[0] if isinstance(node.args[0], torch.fx.Node) else None
    return None


def _channels_last(value) -> bool:
    """Whether a convolution's new value is channels-last (what cuDNN returns for such an input)."""
    return isinstance(value, torch.Tensor) and in_order(value, CHANNELS_LAST[value.dim()][0])


def _exactly(a, b) -> bool:
    """The same sizes and strides, those of dims of size 1 too (ATen's kernels read them: a
    convolution decides its output's memory format by them), or values alike."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (
            a.dim() == b.dim()
            and a.dtype == b.dtype
            and statically_known_true(a.storage_offset() == b.storage_offset())
            and all(
                statically_known_true(x == y)
                for x, y in zip((*a.shape, *a.stride()), (*b.shape, *b.stride()))
            )
        )
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_exactly(x, y) for x, y in zip(a, b))
    return True


def _same_sizes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dim() == b.dim() and all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape))


def _order(val: torch.Tensor) -> tuple[int, ...] | None:
    """The order `val` is dense in (outermost first; its strides at the example's sizes decide
    between the orders of dims of size 1), or None."""
    order = tuple(
        sorted(range(val.dim()), key=lambda d: (-optimization_hint(val.stride()[d], fallback=1), d))
    )
    return order if in_order(val, order) else None


def _meta(new: torch.fx.Node, like: torch.fx.Node, value) -> None:
    new.meta.update({k: v for k, v in like.meta.items() if k in ("stack_trace", "nn_module_stack")})
    new.meta["val"] = value


def _traceable(node: torch.fx.Node) -> bool:
    """Whether `node` is traced on its inputs' new layout: a getitem, an op of LAYOUT_FLOWS or tagged
    pointwise, or any other functional ATen op whose inputs have static sizes (tracing an upsampling
    over symbolic sizes again specializes them); every other node (the output, a higher-order op,
    `as_strided`, a stride read, an SDPA call whose output the wrapper lays out) reads its inputs
    as traced."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    if not isinstance(node.target, torch._ops.OpOverload) or node.target in STRIDED:
        return False
    if ANY_LAYOUT in node.meta:  # an SDPA call the wrapper lays out as its value says
        return False
    if node.target in LAYOUT_FLOWS or torch.Tag.pointwise in node.target.tags:
        return True
    if node.target.namespace not in ("aten", "prims"):  # a library's op: its fake may not say
        return False  # how its kernel lays out what it returns
    return all(not _symbolic(a.meta.get("val")) for a in node.all_input_nodes)


def _symbolic(val) -> bool:
    if isinstance(val, (list, tuple)):
        return any(_symbolic(v) for v in val)
    if isinstance(val, torch.Tensor):
        return any(isinstance(s, torch.SymInt) for s in (*val.shape, *val.stride(), val.storage_offset()))
    return isinstance(val, torch.SymInt)


def _over(new, old):
    """The value traced on the new layout over the traced value's sizes: a trace may size its result
    with symbols of its own (an upsampling's float scale), which nothing binds. Laid out densely in
    the new value's order; a value not dense in one raises."""
    if isinstance(new, (list, tuple)) and isinstance(old, (list, tuple)) and len(new) == len(old):
        return type(new)(_over(a, b) for a, b in zip(new, old))
    if not isinstance(new, torch.Tensor) or not isinstance(old, torch.Tensor):
        return new
    if new.dim() == old.dim() and all(statically_known_true(a == b) for a, b in zip(new.shape, old.shape)):
        return new
    order = _order(new)
    if order is None:
        raise ValueError("its new value is not dense")
    return dense_in(old, order)


def _writes(node: torch.fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable


def fake_mode_of(val):
    """The fake mode `val` was made in, to make more values in (no fake mode: a null context)."""
    mode = maybe_get_fake_mode(val)
    return mode if mode is not None else contextlib.nullcontext()
