"""Convolutions as the library runs them fastest on a GPU: the bias added by the kernel after
them, and 2-D and 3-D convolutions in the channels-last layout where the program's convolutions
favor it.

Both are the driver's `convolutions` pass, before lowering, on the FX graph.

**The bias.** ATen's cuDNN convolution computes without the bias and then adds it in a kernel of its
own (`output.add_(bias)`): the output read and written once more, and a launch. A convolution is
nearly always followed by pointwise work (a batch norm, an activation, a residual add), so here the
call runs without its bias and an `add` of the bias viewed as [C, 1, ...] follows it, which fusion
puts into that work's kernel. Only where the add keeps the convolution's layout and dtype.

**The layout.** cuDNN's tensor-core kernels read and write channels-last (NHWC) memory; given
contiguous (NCHW) tensors, ATen's call transposes the input in and the output out around them. Here
each 2-D (3-D) convolution's input is cloned channels-last (NDHWC) where it is not already (ATen then converts
the weight, as it does for a channels-last input), and the layout flows on: every node that reads
a value whose layout changed is traced again on the new values in export's fake mode, which lays
out each op's output as ATen will (a batch norm, an activation, a residual add, a pooling keep
channels-last; gjit's kernels write what the trace says). An op that may depend on its input's
strides (a `view` that cannot take the new ones, `as_strided`, a stride read, a write into its
input, a higher-order op) and the program's outputs are boundaries: they get the value in its
traced layout again (a copy), so what they see and what the caller gets are unchanged. The pass
keeps the traced layout where a trace fails. Tracing on the new layout may guard a size (that a
convolution's output is wider than 1, where channels-last and contiguous would be one layout): such
guards are the entry's (the driver stores them with it, as decomposition's), so a call that breaks
one compiles again.

Which programs: where 2-D and 3-D convolutions are at least two and the dense ones (groups 1) do at least
half of their work (grouped and depthwise convolutions gain less, or lose, channels-last). A
program with one convolution (a vision transformer's patch embedding) keeps its layout: two copies
for one call's gain.
"""

from __future__ import annotations

import contextlib
import logging
import math
import operator

import torch
from torch._subclasses.fake_tensor import maybe_get_fake_mode
from torch.fx.experimental.symbolic_shapes import statically_known_true

from gjit.lowering.attention_layout import same_layout
from gjit.lowering.attention_library import ANY_LAYOUT
from gjit.lowering.proved_masks import dense_order
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
        aten.split.Tensor,
        aten.split_with_sizes.default,
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
# by the rank of a convolution's value: its dims in memory, outermost first, channels-last, and the
# memory format that lays it out so
# one input resized (a pad, a nearest upsampling): gjit's kernel writes its input's order
RESIZES = frozenset({aten.constant_pad_nd.default, aten.upsample_nearest2d.vec})
NHWC_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # cuDNN keeps float64 NCHW
# elementwise ops that are not tagged pointwise: their (first) output laid out as their input
ELEMENTWISE = frozenset({aten._native_batch_norm_legit_no_training.default, aten._to_copy.default})
CHANNELS_LAST = {4: ((0, 2, 3, 1), torch.channels_last), 5: ((0, 2, 3, 4, 1), torch.channels_last_3d)}


def library_convolutions(
    gm: torch.fx.GraphModule, setting: str, on_gpu: bool, cudnn: bool = False
) -> tuple[int, int]:
    """The pass: on a GPU (or everywhere under "channels_last"), each convolution's bias peeled off
    and the program's 2-D and 3-D convolutions channels-last where `cudnn` runs them (a GPU with
    cuDNN on: the kernels that return channels-last for such inputs) and `worth_channels_last`
    (always under "channels_last"); nothing under "traced". How many biases and convolutions
    changed."""
    if setting == "traced" or not (on_gpu or setting == "channels_last"):
        return 0, 0
    peeled = peel_biases(gm)
    convs = [c for c in spatial_convolutions(gm) if c.meta["val"].dtype in NHWC_DTYPES]
    laid = 0
    if convs and (setting == "channels_last" or (cudnn and worth_channels_last(convs))):
        laid = channels_last(gm, convs)
    if peeled or laid:
        gm.graph.lint()
        gm.recompile()
    return peeled, laid


def peel_biases(gm: torch.fx.GraphModule) -> int:
    """Each convolution with a bias as the convolution without it plus an add of the bias viewed
    over the output's channels, where the add keeps the output's layout and dtype; how many."""
    done = 0
    for node in list(gm.graph.find_nodes(op="call_function", target=CONVOLUTION)):
        bias = node.args[2]
        val = node.meta.get("val")
        bval = bias.meta.get("val") if isinstance(bias, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor) or not isinstance(bval, torch.Tensor):
            continue
        if bval.dim() != 1 or bval.dtype != val.dtype or not isinstance(bval.shape[0], int):
            continue
        shape = [bval.shape[0]] + [1] * (val.dim() - 2)
        with _fake_mode(val):
            view_val = aten.view.default(bval, shape)
            add_val = aten.add.Tensor(val, view_val)
        if not same_layout(add_val, val):
            continue
        graph = gm.graph
        with graph.inserting_after(node):
            conv = graph.call_function(CONVOLUTION, (node.args[0], node.args[1], None, *node.args[3:]))
        with graph.inserting_after(conv):
            view = graph.call_function(aten.view.default, (bias, shape))
        with graph.inserting_after(view):
            add = graph.call_function(aten.add.Tensor, (conv, view))
        node.replace_all_uses_with(add)
        for new, value in ((conv, val), (view, view_val), (add, add_val)):
            new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
            new.meta["val"] = value
        graph.erase_node(node)
        done += 1
    if done:
        log.info("convolutions: %d bias(es) added by the kernel after the convolution", done)
    return done


def spatial_convolutions(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The convolutions over 4-D and 5-D tensors (images, volumes) with a floating-point value."""
    convs = []
    for node in gm.graph.find_nodes(op="call_function", target=CONVOLUTION):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() in CHANNELS_LAST and val.dtype.is_floating_point:
            convs.append(node)
    return convs


def worth_channels_last(convs: list[torch.fx.Node]) -> bool:
    """At least two such convolutions, the dense ones (groups 1) doing at least half of their
    multiply-adds at the example's sizes."""
    if len(convs) < 2:
        return False
    dense = grouped = 0
    for node in convs:
        work = _multiply_adds(node)
        if node.args[8] == 1:
            dense += work
        else:
            grouped += work
    return dense >= grouped


def _multiply_adds(node: torch.fx.Node) -> int:
    """Output elements times the input channels and kernel elements each reads (a transposed
    convolution's weight is [in, out / groups, ...]), at the example's sizes."""
    out, weight = node.meta["val"], node.args[1].meta["val"]
    transposed, groups = node.args[6], node.args[8]
    channels = _hint(weight.shape[0]) // groups if transposed else _hint(weight.shape[1])
    per_output = channels * math.prod(_hint(s) for s in weight.shape[2:])
    return math.prod(_hint(s) for s in out.shape) * per_output


def _hint(size) -> int:
    if isinstance(size, torch.SymInt):
        return size.node.hint if size.node.hint is not None else 1
    return int(size)


def channels_last(gm: torch.fx.GraphModule, convs: list[torch.fx.Node]) -> int:
    """`convs` reading channels-last inputs and the layout flowing on from them (the module's
    docstring); how many convolutions changed (0: the graph as it was)."""
    shape_env = _shape_env(convs[0].meta["val"])
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
            with _fake_mode(xval):
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
        orders = set()
        for a in node.all_input_nodes:
            value = self.value(a, node)
            if isinstance(value, torch.Tensor) and (resized or _same_sizes(value, out)):
                orders.add(_order(value))
        if len(orders) != 1 or None in orders:
            return None
        with _fake_mode(out):
            new = _laid_out(out, orders.pop())
        return (new, *old[1:]) if out is not old else new

    def _trace(self, node: torch.fx.Node):
        """The value of `node` traced on its inputs' new values; None where the op refuses them (a
        view that cannot take the new strides)."""
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: self.value(a, node))
        if node.target is operator.getitem:
            return args[0][args[1]]
        try:
            with _fake_mode(node.meta.get("val")):
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
        order = dense_order(old) if isinstance(old, torch.Tensor) else None
        if order is None:
            base = a.args[0] if _is_view(a) else None
            if base not in self.values:
                raise _TakeBack(f"{reader.name} reads {a.name}, whose traced layout is not dense")
            self._restore(base, reader)
            self.restored[a] = ("view", base, old)
            return
        inverse = [order.index(d) for d in range(len(order))]
        with _fake_mode(old):
            into = aten.permute.default(self.values[a], list(order))
            copy = aten.clone.default(into, memory_format=torch.contiguous_format)
            back = aten.permute.default(copy, inverse)
        if not same_layout(back, old):
            raise _TakeBack(f"{a.name} cannot be copied back into its traced layout")
        self.restored[a] = ("copy", order, inverse, (into, copy, back))

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
            base = self._give_back(how[1], given_back)
            with graph.inserting_after(a):
                view = graph.call_function(a.target, (base, *a.args[1:]), dict(a.kwargs))
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


def _is_view(node: torch.fx.Node) -> bool:
    """An ATen view of one tensor (its first argument), whose other arguments are not tensors."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or not target.is_view:
        return False
    return bool(node.args) and isinstance(node.args[0], torch.fx.Node)


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


def _same_sizes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dim() == b.dim() and all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape))


def _order(val: torch.Tensor) -> tuple[int, ...] | None:
    """The order `val` is dense in (outermost first; its strides at the example's sizes decide
    between the orders of dims of size 1), or None."""
    order = tuple(sorted(range(val.dim()), key=lambda d: (-_hint(val.stride()[d]), d)))
    return order if in_order(val, order) else None


def _laid_out(val: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """A tensor of `val`'s sizes and dtype, dense in `order` (outermost first)."""
    strides, step = [0] * val.dim(), 1
    for dim in reversed(order):
        strides[dim], step = step, step * val.shape[dim]
    return torch.empty_strided(val.shape, strides, dtype=val.dtype, device=val.device)


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
    the new value's order (at the example's sizes); a value not dense so raises."""
    if isinstance(new, (list, tuple)) and isinstance(old, (list, tuple)) and len(new) == len(old):
        return type(new)(_over(a, b) for a, b in zip(new, old))
    if not isinstance(new, torch.Tensor) or not isinstance(old, torch.Tensor):
        return new
    if new.dim() == old.dim() and all(statically_known_true(a == b) for a, b in zip(new.shape, old.shape)):
        return new
    order = sorted(range(new.dim()), key=lambda d: (-_hint(new.stride()[d]), d))  # outermost first
    strides, step, hinted = [0] * new.dim(), 1, 1
    for dim in reversed(order):
        if _hint(new.shape[dim]) != 1 and _hint(new.stride()[dim]) != hinted:
            raise ValueError("its new value is not dense")
        strides[dim], step, hinted = step, step * old.shape[dim], hinted * _hint(new.shape[dim])
    return torch.empty_strided(old.shape, strides, dtype=new.dtype, device=new.device)


def _writes(node: torch.fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable


def _shape_env(val):
    mode = maybe_get_fake_mode(val)
    return mode.shape_env if mode is not None else None


def _fake_mode(val):
    mode = maybe_get_fake_mode(val)
    return mode if mode is not None else contextlib.nullcontext()
