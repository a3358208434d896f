"""Lowering: ATen FX graph -> loop IR (`ir.LoopGraph`).

A registry keyed by ATen `OpOverload` maps each op to a lowering function. Pointwise ops
become `ComputeNode`s, views become index functions (no copy), and every op without a
lowering becomes an `ExternNode` that the wrapper runs through eager ATen: that is logged,
never an error.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes
from torch.utils._sympy.functions import FloatTrueDiv, IntTrueDiv, ToFloat, TruncToInt

from gjit import ir
from gjit.ir import Const, Expr, Index, Op, Read

log = logging.getLogger("gjit.lowering")
aten = torch.ops.aten

LOWERINGS: dict[torch._ops.OpOverload, Callable] = {}

# Ops that are always externs, with the reason shown in `gjit.explain(...).externs`.
EXTERN_REASONS: dict[torch._ops.OpOverload, str] = {
    aten.mm.default: "matmul runs as an ATen extern",
    aten.addmm.default: "matmul runs as an ATen extern",
    aten.bmm.default: "matmul runs as an ATen extern",
    aten.baddbmm.default: "matmul runs as an ATen extern",
    aten.convolution.default: "convolution runs as an ATen extern",
    aten.scaled_dot_product_attention.default: "attention runs as an ATen extern",
}

# Ops that only check metadata in the graph: guards already cover what they assert.
EXTERN_REASONS[torch.ops.higher_order.cond] = (
    "torch.cond: both branches are compiled as their own programs; the predicate picks one at run time"
)

IGNORED = {
    aten._assert_tensor_metadata.default,
    aten._assert_scalar.default,
    aten.sym_constrain_range_for_size.default,
}
SYM_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)


class Unsupported(Exception):
    """Raised by a lowering for arguments it cannot handle; the node becomes an extern."""


def register_lowering(*ops: torch._ops.OpOverload) -> Callable:
    def decorator(fn: Callable) -> Callable:
        for op in ops:
            LOWERINGS[op] = fn
        return fn

    return decorator


# ----------------------------------------------------------------------------------------------
# Values seen while lowering: something that can be read at a logical index.
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class TensorValue:
    name: str
    size: Index
    dtype: torch.dtype

    def load(self, index: Sequence[sympy.Expr]) -> Expr:
        return Read(self.dtype, self.name, tuple(index))


@dataclasses.dataclass
class ViewValue(TensorValue):
    base: TensorValue
    reindex: Callable[[Index], Index]

    def load(self, index: Sequence[sympy.Expr]) -> Expr:
        return self.base.load(self.reindex(tuple(index)))


@dataclasses.dataclass
class ExternResults:
    """The tuple an extern returns; its elements become buffers at their getitem nodes."""

    name: str


def to_sympy(value: Any) -> sympy.Expr:
    if isinstance(value, torch.SymInt):
        return value.node.expr
    if isinstance(value, (bool, int)):
        return sympy.Integer(int(value))
    if isinstance(value, sympy.Expr):
        return value
    raise Unsupported(f"cannot use {type(value).__name__} {value!r} as a size")


def contiguous_layout(size: Index, dtype: torch.dtype) -> ir.Layout:
    stride = []
    step = sympy.Integer(1)
    for s in reversed(size):
        stride.append(step)
        step = step * s
    return ir.Layout(tuple(size), tuple(reversed(stride)), sympy.Integer(0), dtype)


def to_sympy_any(value: Any) -> sympy.Expr:
    """Like to_sympy, also for SymFloat/SymBool and plain numbers."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return value.node.expr
    return sympy.sympify(value)


FLOAT_SIZE_FUNCTIONS = (ToFloat, TruncToInt, FloatTrueDiv, IntTrueDiv, sympy.Float)


def _float_size_reason(val: Any) -> str | None:
    """Kernels print sizes as integer index math; a size computed through floats (1-D nearest
    upsampling by 1.5: int(1.5 * float(s))) makes the op an extern, which ATen sizes itself."""
    for t in val if isinstance(val, (list, tuple)) else [val]:
        if isinstance(t, torch.Tensor):
            for s in (*t.shape, *t.stride(), t.storage_offset()):
                if isinstance(s, torch.SymInt) and s.node.expr.atoms(*FLOAT_SIZE_FUNCTIONS):
                    return f"a size computed through floats: {s.node.expr}"
    return None


def _complex_reason(node: torch.fx.Node) -> str | None:
    """Kernels have no complex type: an op that reads or makes a complex tensor runs in ATen."""
    vals = [a.meta.get("val") for a in node.all_input_nodes] + [node.meta.get("val")]
    for v in vals:
        for t in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(t, torch.Tensor) and t.dtype.is_complex:
                return f"complex tensors run in ATen ({t.dtype})"
    return None


def meta_layout(val: torch.Tensor) -> ir.Layout:
    return ir.Layout(
        size=tuple(to_sympy(s) for s in val.shape),
        stride=tuple(to_sympy(s) for s in val.stride()),
        offset=to_sympy(val.storage_offset()),
        dtype=val.dtype,
    )


# ----------------------------------------------------------------------------------------------
# The lowering context: builds the LoopGraph while walking the FX graph.
# ----------------------------------------------------------------------------------------------


class Lowering:
    def __init__(self, gm: torch.fx.GraphModule):
        self.gm = gm
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
        idx = ir.index_vars(len(full_size))
        body = body_fn(idx)
        name = self.node.name + suffix
        node = ir.ReduceNode(
            name, layout, body, self.node, self.aten_name, tuple(full_size), reduced, reduce_type, keepdim
        )
        self.nodes.append(node)
        return TensorValue(name, layout.size, layout.dtype)

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
            layout = meta_layout(val)
            self.buffers[node.name] = ir.Buffer(node.name, layout, "input")
            return TensorValue(node.name, layout.size, layout.dtype)
        return val  # SymInt / constants: used as scalars

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
        reason = EXTERN_REASONS.get(target) or _float_size_reason(val) or _complex_reason(node)
        if fn is not None and reason is None:
            try:
                return fn(self, *args, **kwargs)
            except Unsupported as e:
                reason = f"lowering refused: {e}"
        if reason is None:
            reason = f"no lowering for {target}"
        return self.extern(node, reason)

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
            layout = meta_layout(val)
            self.buffers[node.name] = ir.Buffer(node.name, layout, "extern")
            return TensorValue(node.name, layout.size, layout.dtype)
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
        layout = meta_layout(val)
        self.buffers[node.name] = ir.Buffer(node.name, layout, "extern")
        self.nodes.append(
            ir.ExternNode(node.name, node, "element of an extern's result", [node.args[0].name])
        )
        return TensorValue(node.name, layout.size, layout.dtype)


# ----------------------------------------------------------------------------------------------
# dtype handling shared by pointwise lowerings
# ----------------------------------------------------------------------------------------------


def cast(expr: Expr, dtype: torch.dtype) -> Expr:
    if expr.dtype == dtype:
        return expr
    if isinstance(expr, Const):
        return Const(dtype, python_scalar(expr.value, dtype))
    return Op(dtype, "to_dtype", (expr,), (dtype,))


def python_scalar(value: Any, dtype: torch.dtype) -> bool | int | float:
    if dtype == torch.bool:
        return bool(value)
    if dtype.is_floating_point:
        return float(value)
    return int(value)


def promote(
    node_args: Sequence[Any], kind: ELEMENTWISE_TYPE_PROMOTION_KIND
) -> tuple[torch.dtype, torch.dtype]:
    """(compute dtype, result dtype) exactly as ATen's elementwise type promotion gives them."""
    metas = []
    for a in node_args:
        if isinstance(a, TensorValue):
            metas.append(torch.empty([1] * len(a.size), dtype=a.dtype, device="meta"))
        elif isinstance(a, torch.SymInt):
            metas.append(1)
        elif isinstance(a, torch.SymFloat):
            metas.append(1.0)
        else:
            metas.append(a)
    return elementwise_dtypes(*metas, type_promotion_kind=kind)


def broadcast_index(
    value: TensorValue,
    out_index: Index,
    out_size: Index,
    known_one: Callable[[sympy.Expr], bool] | None = None,
) -> Index:
    """The index of `value` that broadcasting reads for output element `out_index`; `known_one`
    (Lowering.known_one) also recognizes a symbolic size that the shape env knows is 1."""
    known_one = known_one or (lambda size: size == 1)
    rank = len(value.size)
    lead = len(out_size) - rank
    idx = []
    for k, size in enumerate(value.size):
        out_k = lead + k
        if out_size[out_k] != 1 and size != out_size[out_k] and known_one(size):
            idx.append(sympy.Integer(0))
        else:
            idx.append(out_index[out_k])
    return tuple(idx)


def load_as(
    arg: Any,
    dtype: torch.dtype,
    index: Index,
    out_size: Index,
    known_one: Callable | None = None,
    via: torch.dtype | None = None,
) -> Expr:
    """Read a tensor argument (broadcast) or make a scalar constant, in the compute dtype; with
    `via`, converted to that dtype first (a comparison's operands are rounded to their common
    dtype: bfloat16 x == 0.3 compares x with bfloat16(0.3) = 0.30078125)."""
    if via is not None:
        if isinstance(arg, (bool, int, float)):
            wrapped = torch.tensor(arg, dtype=torch.float64 if isinstance(arg, float) else None)
            arg = wrapped.to(via).item()
        else:
            return cast(load_as(arg, via, index, out_size, known_one), dtype)
    if isinstance(arg, TensorValue):
        return cast(arg.load(broadcast_index(arg, index, out_size, known_one)), dtype)
    if isinstance(arg, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return cast(ir.IndexValue(torch.int64, to_sympy(arg)), dtype)
    if isinstance(arg, (bool, int, float)):
        return Const(dtype, python_scalar(arg, dtype))
    raise Unsupported(f"unsupported pointwise argument {type(arg).__name__}")


def lower_graph(gm: torch.fx.GraphModule) -> ir.LoopGraph:
    # the op tables register themselves on import
    from gjit import (  # noqa: F401
        lowering_indexing,
        lowering_pointwise,
        lowering_reductions,
        lowering_spatial,
        lowering_views,
    )

    return Lowering(gm).run()
