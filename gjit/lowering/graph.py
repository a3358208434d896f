"""Lowering: ATen FX graph -> loop IR (`ir.LoopGraph`).

The walk looks each node's op up in the registry (gjit/lowering/registry.py). Pointwise ops
become `ComputeNode`s, views become index functions (no copy), and every op without a
lowering becomes an `ExternNode` that the wrapper runs through eager ATen: that is logged,
never an error.
"""

from __future__ import annotations

import functools
import logging
import operator
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch

from gjit import ir
from gjit.ir import Expr, Index

# the lowering modules register their functions on import
from gjit.lowering import (  # noqa: F401 - each registers its lowerings
    attention,
    copies,
    indexing,
    matmul,
    pointwise,
    reductions,
    scans,
    scatters,
    spatial,
    special,
    split,
    views,
)
from gjit.lowering.registry import (
    EXTERN_REASONS,
    IGNORED,
    LOWERINGS,
    SYM_TYPES,
    ExternResults,
    TensorValue,
    Unsupported,
    ViewValue,
    cast,
    complex_reason,
    contiguous_layout,
    meta_layout,
    scalar_reason,
    size_reason,
    to_sympy,
    to_sympy_any,
)
from gjit.lowering.templates import NO_TEMPLATES, TemplateChoice

log = logging.getLogger("gjit.lowering")
aten = torch.ops.aten


class Lowering:
    def __init__(self, gm: torch.fx.GraphModule, templates: TemplateChoice = NO_TEMPLATES):
        self.gm = gm
        self.templates = templates  # which matmuls become MatmulNodes (the others externs)
        self.values: dict[torch.fx.Node, Any] = {}
        self.buffers: dict[str, ir.Buffer] = {}
        self.nodes: list[ir.ComputeNode | ir.ExternNode] = []
        self.views: dict[str, ir.ViewNode] = {}
        self.needed: set[str] = set()
        self.node: torch.fx.Node | None = None  # the FX node being lowered
        self.known_symbols: set[sympy.Symbol] = set()  # symbols bound by inputs or earlier externs
        self.aliases: dict[str, str] = {}

    # -- helpers used by the lowering functions ------------------------------------------------

    @property
    def out_val(self) -> torch.Tensor:
        return self.node.meta["val"]

    @functools.cached_property
    def shape_env(self):
        """The ShapeEnv behind the graph's symbolic sizes (None when every size is static)."""
        for node in self.gm.graph.nodes:
            val = node.meta.get("val")
            for s in getattr(val, "shape", None) or [val]:
                if isinstance(s, torch.SymInt):
                    return s.node.shape_env
        return None

    def known_one(self, size: sympy.Expr) -> bool:
        """Is `size` 1 for every size the shape env admits (its ranges and export's guards)? A
        broadcast dim can be symbolic, e.g. x[:, : x.shape[1] // 2] + x with x.shape[1] in [2, 3].
        Never adds a guard."""
        if size == 1:
            return True
        if sympy.sympify(size).is_number or self.shape_env is None:
            return False
        return bool(self.shape_env._maybe_evaluate_static(sympy.Eq(size, 1)))

    @property
    def aten_name(self) -> str:
        return getattr(self.node.target, "__name__", str(self.node.target)).split(".")[0]

    def pointwise(
        self, body_fn: Callable[[Index], Expr], layout: ir.Layout | None = None, suffix: str = ""
    ) -> TensorValue:
        """Make a ComputeNode whose element at index `i` is `body_fn(i)`: the current node's
        result, or (with `layout` and `suffix`) an intermediate value of a multi-node lowering."""
        layout = layout or meta_layout(self.out_val)
        idx = ir.index_vars(len(layout.size))
        body = cast(body_fn(idx), layout.dtype)
        name = self.node.name + suffix
        self.nodes.append(ir.ComputeNode(name, layout, body, self.node, self.aten_name))
        return TensorValue(name, layout.size, layout.dtype)

    def reduction(
        self,
        body_fn: Callable[[Index], Expr],
        full_size: Index,
        reduced: Sequence[int],
        reduce_type: str,
        dtype: torch.dtype,
        keepdim: bool,
        layout: ir.Layout | None = None,
        suffix: str = "",
    ) -> TensorValue:
        """Make a ReduceNode: `reduce_type` of `body_fn(full index)` over the dims `reduced`."""
        reduced = tuple(sorted(reduced))
        if layout is None:
            size = tuple(
                1 if k in reduced else s for k, s in enumerate(full_size) if keepdim or k not in reduced
            )
            layout = contiguous_layout(tuple(sympy.sympify(s) for s in size), dtype)
        name = self.node.name + suffix
        two_levels = split.maybe_split(self, body_fn, full_size, reduced, reduce_type, layout, keepdim, name)
        if two_levels is not None:  # few long rows: partial results of chunks, then their reduction
            return two_levels
        idx = ir.index_vars(len(full_size))
        body = body_fn(idx)
        node = ir.ReduceNode(
            name, layout, body, self.node, self.aten_name, tuple(full_size), reduced, reduce_type, keepdim
        )
        self.nodes.append(node)
        return TensorValue(name, layout.size, layout.dtype)

    def matmul(
        self, body_fn: Callable[[Index], Expr], full_size: Index, layout: ir.Layout, suffix: str = ""
    ) -> TensorValue:
        """Make a MatmulNode: the sum over the last dim of `full_size` of `body_fn(full index)`."""
        name = self.node.name + suffix
        body = body_fn(ir.index_vars(len(full_size)))
        reduced = (len(full_size) - 1,)
        node = ir.MatmulNode(
            name, layout, body, self.node, self.aten_name, tuple(full_size), reduced, "sum", False
        )
        self.nodes.append(node)
        return TensorValue(name, layout.size, layout.dtype)

    def attention(
        self, body: ir.Attention, full_size: Index, layout: ir.Layout, empty_rows: str, causal: bool = False
    ) -> TensorValue:
        """Make an AttentionNode over (batch..., L, Ev, S, D): `body` over `index_vars` of that."""
        reduced = (len(full_size) - 2, len(full_size) - 1)
        node = ir.AttentionNode(
            self.node.name, layout, body, self.node, self.aten_name, tuple(full_size), reduced, "sum", False,
            empty_rows, causal=causal,
        )  # fmt: skip
        self.nodes.append(node)
        return TensorValue(node.name, layout.size, layout.dtype)

    def scan(
        self, body_fn: Callable[[Index], Expr], dim: int, scan_type: str, layout: ir.Layout, suffix: str = ""
    ) -> TensorValue:
        """Make a ScanNode: the inclusive `scan_type` scan of `body_fn(index)` along `dim`."""
        body = body_fn(ir.index_vars(len(layout.size)))
        name = self.node.name + suffix
        self.nodes.append(ir.ScanNode(name, layout, body, self.node, self.aten_name, dim, scan_type))
        return TensorValue(name, layout.size, layout.dtype)

    def scatter(
        self,
        base: TensorValue,
        space: Index,
        write_fn: Callable[[Index], ir.WriteAt],
        reduce: str,
        suffix: str = "",
        in_place: bool = False,
    ) -> TensorValue:
        """Make a ScatterNode: `base` with `write_fn(index)` combined in by `reduce` for each index
        of `space`. The kernel writes into a copy of `base` in the node's layout, or, `in_place`,
        into `base` itself (a value computed here that nothing else reads)."""
        layout = meta_layout(self.out_val)
        if not in_place:
            base = self.pointwise(base.load, layout, suffix=f"{suffix}_base")
        self.needed.add(base.name)
        write = write_fn(ir.index_vars(len(space)))
        write = ir.WriteAt(layout.dtype, cast(write.value, layout.dtype), write.index, write.indirect)
        name = self.node.name + suffix
        self.nodes.append(
            ir.ScatterNode(name, layout, write, self.node, self.aten_name, tuple(space), base.name, reduce)
        )
        return TensorValue(name, layout.size, layout.dtype)

    def hint(self, size: sympy.Expr) -> int:
        """The example value of a size (what export traced with)."""
        env, value = self.shape_env, sympy.sympify(size)
        if env is not None:
            values = getattr(env, "backed_var_to_val", None) or env.var_to_val
            value = value.xreplace(values)
        return int(value)

    def is_computed(self, value: TensorValue) -> bool:
        """Is `value` a node a kernel computes here (not an input, an extern's result or a view)?"""
        return type(value) is TensorValue and any(n.name == value.name for n in self.nodes
                                                  if isinstance(n, ir.ComputeNode))  # fmt: skip

    def is_input(self, value: TensorValue) -> bool:
        """Is `value` a graph input itself (not a view of one)?"""
        buffer = self.buffers.get(value.name) if type(value) is TensorValue else None
        return buffer is not None and buffer.kind == "input"

    def writable_in_place(self, value: TensorValue) -> bool:
        """Can the node being lowered (an in-place write) be `value`'s memory in the layout export
        traced for the node: `value` a graph input or a node a kernel computes here, in that layout
        (what reads the node, views and externs, reads it in that layout)?"""
        if self.is_input(value):
            lay = self.buffers[value.name].layout
        elif self.is_computed(value):
            lay = next(n.layout for n in self.nodes if n.name == value.name)
        else:
            return False
        env = self.shape_env

        def equal(a: sympy.Expr, b: sympy.Expr) -> bool:  # under the ranges: 32*Max(1, s) is 32*s
            return ir.statically_known_equal(a, b) or (env is not None and env.simplify(a - b) == 0)

        return ir.same_layout(lay, meta_layout(self.out_val), equal)

    def view(
        self, base: TensorValue, reindex: Callable[[Index], Index], element: int | None = None
    ) -> ViewValue:
        """A view of `base`; `element` picks one view of an op that returns several (split)."""
        val = self.out_val if element is None else self.out_val[element]
        name = self.node.name if element is None else f"{self.node.name}_piece{element}"
        self.views[name] = ir.ViewNode(name, self.node, base.name, element)
        return ViewValue(name, tuple(to_sympy(s) for s in val.shape), val.dtype, base, reindex)

    # -- the walk ------------------------------------------------------------------------------

    def run(self) -> ir.LoopGraph:
        outputs: list[str | None] = []
        for node in self.gm.graph.nodes:
            self.node = node
            if node.op == "placeholder":
                self.values[node] = self.placeholder(node)
            elif node.op == "get_attr":
                self.values[node] = None  # a torch.cond branch: compiled on its own by the compiler
            elif node.op == "call_function":
                self.values[node] = self.call_function(node)
                value = self.values[node]
                if isinstance(value, TensorValue) and value.name != node.name:
                    self.aliases[node.name] = value.name
            elif node.op == "output":
                for out in node.args[0]:
                    value = self.values.get(out) if isinstance(out, torch.fx.Node) else None
                    if isinstance(value, TensorValue):
                        self.require(value)
                        outputs.append(value.name)
                    else:
                        outputs.append(None)
            else:
                raise NotImplementedError(f"FX op {node.op} ({node.format_node()})")
        return ir.LoopGraph(
            self.buffers, self.nodes, self.views, outputs, self.gm.graph, self.needed, self.aliases
        )

    def placeholder(self, node: torch.fx.Node) -> Any:
        val = node.meta.get("val")
        self.know(val)
        if isinstance(val, torch.Tensor):
            return self.buffer(node.name, val, "input")
        return val  # SymInt / constants: used as scalars

    def buffer(self, name: str, val: torch.Tensor, kind: str) -> TensorValue:
        """A value that lives in memory before the kernels read it (an input, an extern's result)."""
        layout = meta_layout(val)
        self.buffers[name] = ir.Buffer(name, layout, kind)
        return TensorValue(name, layout.size, layout.dtype)

    def call_function(self, node: torch.fx.Node) -> Any:
        target = node.target
        if target is operator.getitem:
            base = self.values[node.args[0]]
            if isinstance(base, ExternResults):
                return self.extern_output(node)
            return base[node.args[1]]
        if target in IGNORED:
            return None
        val = node.meta.get("val")
        if isinstance(val, SYM_TYPES) and not (to_sympy_any(val).free_symbols - self.known_symbols):
            return val  # size arithmetic (sym_size, operator.mul, ...): a sympy expression, no op to run
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: self.values[n])
        fn = LOWERINGS.get(target)
        reason = (
            EXTERN_REASONS.get(target)
            or size_reason([val, *(a.meta.get("val") for a in node.all_input_nodes)])  # read or written
            or scalar_reason(node)
            or complex_reason(node)
        )
        if fn is not None and reason is None:
            mark = (len(self.nodes), set(self.views), set(self.buffers), set(self.needed))
            try:
                return fn(self, *args, **kwargs)
            except Unsupported as e:
                reason = f"lowering refused: {e}"
                self._roll_back(mark)
            except Exception as e:  # noqa: BLE001 - a lowering's bug is an extern, never a crash
                self._roll_back(mark)
                reason = f"lowering failed ({type(e).__name__}: {e}); ATen runs it"
                log.warning(
                    "gjit's lowering of %s failed, running it in ATen: %s: %s", target, type(e).__name__, e
                )
        if reason is None:
            reason = f"no lowering for {target}"
        return self.extern(node, reason)

    def _roll_back(self, mark: tuple[int, set[str], set[str], set[str]]) -> None:
        """Drop what a lowering made before it refused or failed: its node is an extern now."""
        node_count, view_names, buffer_names, needed = mark
        self.needed = needed
        del self.nodes[node_count:]
        for name in set(self.views) - view_names:
            del self.views[name]
        for name in set(self.buffers) - buffer_names:
            del self.buffers[name]

    def require(self, value: TensorValue) -> None:
        """The wrapper needs this value as a real tensor: mark it (and a view's bases) in memory."""
        self.needed.add(value.name)
        if isinstance(value, ViewValue):
            self.require(value.base)

    def extern(self, node: torch.fx.Node, reason: str) -> Any:
        tensor_args = []

        def visit(a: Any) -> Any:
            value = self.values.get(a) if isinstance(a, torch.fx.Node) else None
            if isinstance(value, TensorValue):
                self.require(value)
                tensor_args.append(value.name)
            return a

        torch.fx.node.map_arg((node.args, node.kwargs), visit)
        self.nodes.append(ir.ExternNode(node.name, node, reason, tensor_args))
        log.info("extern %s = %s: %s", node.name, node.target, reason)
        val = node.meta.get("val")
        self.know(val)
        if isinstance(val, torch.Tensor):
            return self.buffer(node.name, val, "extern")
        if isinstance(val, (list, tuple)):
            return ExternResults(node.name)  # read through getitem nodes, each its own buffer
        return val

    def know(self, val: Any) -> None:
        """Record the size symbols a runtime value binds (inputs, extern results, .item())."""
        if isinstance(val, torch.Tensor):
            for s in (*val.shape, *val.stride()):
                self.known_symbols |= to_sympy_any(s).free_symbols
        elif isinstance(val, SYM_TYPES):
            self.known_symbols |= to_sympy_any(val).free_symbols
        elif isinstance(val, (list, tuple)):
            for v in val:
                self.know(v)

    def extern_output(self, node: torch.fx.Node) -> Any:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return val
        self.nodes.append(
            ir.ExternNode(node.name, node, "element of an extern's result", [node.args[0].name])
        )
        return self.buffer(node.name, val, "extern")


def lower_graph(gm: torch.fx.GraphModule, templates: TemplateChoice = NO_TEMPLATES) -> ir.LoopGraph:
    return Lowering(gm, templates).run()
