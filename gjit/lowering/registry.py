"""The lowering registry: ATen `OpOverload` -> lowering function, the always-extern list with
reasons, the values lowerings pass around (`TensorValue`, `ViewValue`), and ATen's type promotion.

Each lowering module (pointwise, views, reductions, spatial, indexing) imports this one and
registers its functions; gjit/lowering/graph.py imports those modules and walks the FX graph.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch
import torch.utils._pytree as pytree
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes
from torch.utils._sympy.functions import (
    CeilDiv,
    CeilToInt,
    CleanDiv,
    FloorDiv,
    FloorToInt,
    IntTrueDiv,
    Max,
    Min,
    Mod,
    ModularIndexing,
    PythonMod,
)

from gjit import ir
from gjit.ir import Const, Expr, Index, Op, Read

log = logging.getLogger("gjit.lowering")
aten = torch.ops.aten

LOWERINGS: dict[torch._ops.OpOverload, Callable] = {}

# Ops that are always externs, with the reason shown in `gjit.explain(...).externs`.
EXTERN_REASONS: dict[torch._ops.OpOverload, str] = {
    aten.convolution.default: "convolution runs as an ATen extern",
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


# what kernels print as integer index math (codegen/printer.py): anything else in a size makes the op
# an extern, which ATen sizes itself
INDEX_FUNCTIONS = (
    FloorDiv,
    CleanDiv,
    CeilDiv,
    ModularIndexing,
    Mod,
    PythonMod,
    Min,
    Max,
    sympy.Min,
    sympy.Max,
)


FLOOR_LIKE = (FloorDiv, CleanDiv, CeilDiv, ModularIndexing, Mod, PythonMod)


def _index_math(expr: sympy.Basic, scalar: bool = False, env: Any = None) -> bool:
    """Whether the kernel printers print `expr` as integer math. Kernels print floor division
    and modulo as the language's, which truncate (C, Triton): exact for a size's own terms
    (non-negative), so a `scalar` operand needs a numerator known to be non-negative and divisors
    known to be positive: by sympy, or by the ranges of the shape environment `env` (which the
    entry's guards check), as a convolution's output size (s - 3) // 4 + 1 with s >= 3."""
    if isinstance(expr, (sympy.Symbol, sympy.Integer)) or expr in (sympy.true, sympy.false):
        return True
    if scalar and isinstance(expr, FLOOR_LIKE):
        if not _at_least(expr.args[0], 0, env) or not all(_at_least(d, 1, env) for d in expr.args[1:]):
            return False
    if scalar and isinstance(expr, (CeilToInt, FloorToInt)) and not _at_least(expr.args[0].args[0], 0, env):
        return False
    if isinstance(expr, (CeilToInt, FloorToInt)):  # math.ceil(n / 3): ceil/floor of an int over a
        inner = expr.args[0]  # positive literal
        return (
            isinstance(inner, IntTrueDiv)
            and inner.args[1].is_Integer
            and inner.args[1] > 0
            and _index_math(inner.args[0], scalar, env)
        )
    if isinstance(expr, sympy.Pow):
        return expr.args[1].is_Integer and expr.args[1] > 0 and _index_math(expr.args[0], scalar, env)
    if isinstance(expr, sympy.floor) and isinstance(expr.args[0], sympy.Mul):
        return not scalar and all(_index_math(a) for a in sympy.fraction(expr.args[0]))
    if isinstance(
        expr, (sympy.Add, sympy.Mul, sympy.core.relational.Relational, sympy.And, sympy.Or, sympy.Not)
    ):
        return all(_index_math(a, scalar, env) for a in expr.args)
    return isinstance(expr, INDEX_FUNCTIONS) and all(_index_math(a, scalar, env) for a in expr.args)


def _at_least(expr: sympy.Expr, bound: int, env: Any) -> bool:
    """Whether `expr` >= bound (0 or 1) for every size: by sympy, or by `env`'s ranges."""
    if getattr(expr, "is_nonnegative" if bound == 0 else "is_positive", False):
        return True
    if env is None:
        return False
    try:
        lower = env.bound_sympy(expr).lower
    except Exception:  # an expression torch's range analysis does not bound
        return False
    return bool(lower.is_number and lower >= bound)


def scalar_reason(node: torch.fx.Node) -> str | None:
    """A size-valued operand (x + round(n / 3), torch.roll(x, (n - 20) // 3)) the kernels cannot
    compute exactly as integer math makes the op an extern."""
    for arg in node.all_input_nodes:
        val = arg.meta.get("val")
        if isinstance(val, (torch.SymInt, torch.SymBool)) and not _index_math(
            val.node.expr, scalar=True, env=val.node.shape_env
        ):
            return f"a size operand kernels cannot compute as integer math: {val.node.expr}"
    return None


def size_reason(val: Any) -> str | None:
    """Kernels print sizes as integer index math. A size computed through floats (1-D nearest
    upsampling by 1.5: int(1.5 * float(s))), rounding (round(n / 3)) or any other function of
    torch's shape environment the printers do not write makes the op an extern, which ATen
    sizes itself; the wrapper prints it with torch's Python printer."""
    for t in pytree.tree_leaves(val):
        if isinstance(t, torch.Tensor):
            for s in (*t.shape, *t.stride(), t.storage_offset()):
                if isinstance(s, torch.SymInt) and not _index_math(s.node.expr):
                    return f"a size kernels cannot print as integer math: {s.node.expr}"
    return None


def complex_reason(node: torch.fx.Node) -> str | None:
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


def reduction_identity(reduce: str, dtype: torch.dtype) -> bool | int | float:
    """The value that leaves a `reduce` ("sum", "mean", "prod", "max", "min") of `dtype` values
    unchanged: what an element that is not there (a write's untouched target, a lane past a row) holds."""
    if reduce in ("sum", "mean", "prod"):
        return python_scalar(int(reduce == "prod"), dtype)
    if dtype.is_floating_point:
        return float("-inf") if reduce == "max" else float("inf")
    if dtype == torch.bool:
        return reduce == "min"
    info = torch.iinfo(dtype)
    return info.min if reduce == "max" else info.max


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
