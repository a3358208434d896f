"""The loop IR: what lowering produces and fusion and codegen consume.

A value is an expression DAG over index variables. Each lowered FX node that computes
something becomes a `ComputeNode` whose `body` is the value of one element at the
logical index ``(i0, i1, ...)``; reads of other nodes name them with the index they are
read at, so views (expand, permute, slice, reshape, ...) are index expressions, not copies.
Nodes that must exist in memory before or after the graph runs (inputs, extern results)
are `Buffer`s with a symbolic layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import sympy
import torch

Index = tuple[sympy.Expr, ...]


def index_vars(rank: int, prefix: str = "i") -> Index:
    return tuple(sympy.Symbol(f"{prefix}{k}", integer=True, nonnegative=True) for k in range(rank))


def statically_known_equal(a: sympy.Expr, b: sympy.Expr) -> bool:
    """True when `a == b` for every value of the size symbols: their difference expands to 0.
    Sizes are polynomials in the symbols (FloorDiv and friends expand as atoms), so this never
    guards and never says equal wrongly; False means "not known equal". Much cheaper than
    sympy.simplify, which a reshape of every layer would otherwise pay a few times."""
    return a == b or sympy.expand(a - b) == 0


def at_values(expr: sympy.Expr | int, values: dict[sympy.Symbol, int]) -> sympy.Expr:
    """`expr` with the size symbols of `values` replaced by their values (the example's, for
    choices): a number where `values` has every symbol it reads. Only its own symbols are put in,
    by `xreplace`: `subs` with a shape environment's every symbol sorted them on each call (1-2 ms
    a call; a decode step's codegen spent 1.9 s of 2.1 there)."""
    expr = sympy.sympify(expr)
    return expr.xreplace({s: sympy.Integer(values[s]) for s in expr.free_symbols if s in values})


# ----------------------------------------------------------------------------------------------
# Expressions: one element's value. Frozen, so equal sub-expressions hash equal (CSE in codegen).
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Expr:
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class Read(Expr):
    """The element of buffer or node `name` at logical index `index`.

    An indirect read (embedding, gather, advanced indexing) has index expressions that use
    symbols bound to data: each `indirect` entry is (symbol, the Expr whose value it is, the
    size of the dim it indexes, for bounds checks).
    """

    name: str
    index: Index
    indirect: tuple[tuple[sympy.Symbol, Expr, sympy.Expr], ...] = ()


@dataclasses.dataclass(frozen=True)
class Const(Expr):
    value: bool | int | float


@dataclasses.dataclass(frozen=True)
class IndexValue(Expr):
    """An index expression used as data (arange, iota, masks of cat)."""

    expr: sympy.Expr


@dataclasses.dataclass(frozen=True)
class Op(Expr):
    """Pointwise operation `name` (one of OPS) on `args`."""

    name: str
    args: tuple[Expr, ...]
    # Non-Expr parameters of the op (target dtype of a cast, ...), hashable.
    params: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        if self.name not in OPS:
            raise ValueError(f"gjit: {self.name!r} is not an IR op (gjit.ir.OPS)")


# torch.special's orthogonal polynomials p_n(x) (gjit/kernels/polynomials.py): Op(float64, name,
# (x, n as int64), params=(Hermite's degree cap, whether each step rounds to float32)).
POLYNOMIAL_OPS = (
    *("chebyshev_t", "chebyshev_u", "chebyshev_v", "chebyshev_w", "legendre_p", "laguerre_l"),
    *("shifted_chebyshev_t", "shifted_chebyshev_u", "shifted_chebyshev_v", "shifted_chebyshev_w"),
    *("hermite_h", "hermite_he"),
)

# Bessel functions libdevice lacks, float64 helpers (gjit/kernels/bessel.py): Op(float64, name, (x,)).
BESSEL_OPS = (
    "bessel_i0e",
    "bessel_i1e",
    "bessel_k0",
    "bessel_k0e",
    "bessel_k1",
    "bessel_k1e",
    "spherical_j0",
)

# Every pointwise op of the IR. Each has an emitter in both kernel languages (TritonOverrides in
# codegen/triton/pointwise.py, CudaOverrides in codegen/cuda/pointwise.py), except `to_dtype`, a
# cast to params[0] that each printer spells with its own conversion rules.
OPS = frozenset(
    {
        *("add", "sub", "mul", "truediv", "truncdiv", "floordiv", "remainder", "fmod", "pow"),
        *("neg", "abs", "maximum", "minimum", "fmax", "fmin", "atan2", "copysign"),
        *("exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "sigmoid"),
        *("sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh"),
        *("erf", "erfinv", "floor", "ceil", "trunc", "round", "frac", "signbit"),
        *("erfc", "erfcx", "lgamma", "ndtri", "hypot", "nextafter"),
        *("digamma", "trigamma", "zeta"),
        *POLYNOMIAL_OPS,
        *BESSEL_OPS,
        *("bessel_i0", "bessel_i1", "bessel_j0", "bessel_j1", "bessel_y0", "bessel_y1"),
        *("isnan", "isinf", "isfinite", "eq", "ne", "lt", "le", "gt", "ge"),
        *("logical_and", "logical_or", "logical_xor", "logical_not"),
        *("bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "lshift", "rshift"),
        *("where", "to_dtype"),
    }
)


@dataclasses.dataclass(frozen=True)
class Masked(Expr):
    """`body` where `mask` holds, else `other`; reads inside `body` are masked too (cat, pad)."""

    mask: sympy.Expr  # a sympy boolean over index variables
    body: Expr
    other: bool | int | float


@dataclasses.dataclass(frozen=True)
class Score(Expr):
    """In an `Attention`'s score: the product q . k of the current query and key (float32)."""


@dataclasses.dataclass(frozen=True)
class Attention(Expr):
    """The body of an `AttentionNode`, over its full index (batch..., i, e, j, d): the query's
    element at (batch..., i, d), the key's at (batch..., j, d), the value's at (batch..., j, e)
    and the score at (batch..., i, j) as a function of `Score()` (scaling, masks, biases)."""

    query: Expr
    key: Expr
    value: Expr
    score: Expr


@dataclasses.dataclass(frozen=True)
class WriteAt(Expr):
    """The body of a `ScatterNode`: `value` written at element `index` of the node, whose index
    expressions may use symbols bound to data (`indirect`, as in `Read`: the scatter's index)."""

    value: Expr
    index: Index
    indirect: tuple[tuple[sympy.Symbol, Expr, sympy.Expr], ...] = ()


def free_symbols(expr: Expr) -> set[sympy.Symbol]:
    """Size symbols an expression uses (in indices, masks, scalar operands such as `.item()`)."""
    out: set[sympy.Symbol] = set()

    def collect(value: Any) -> None:
        if isinstance(value, sympy.Basic):
            out.update(value.free_symbols)
        elif isinstance(value, (tuple, list)):
            for v in value:
                collect(v)
        elif hasattr(value, "node") and hasattr(value.node, "expr"):  # a SymInt / SymFloat operand
            out.update(value.node.expr.free_symbols)

    for e in walk(expr):
        for field in dataclasses.fields(e):
            if isinstance(getattr(e, field.name), Expr):
                continue  # sub-expressions: walk visits them
            collect(getattr(e, field.name))
    return out


def walk(expr: Expr) -> Iterator[Expr]:
    """Every sub-expression once, producers before consumers."""
    seen: set[int] = set()
    order: list[Expr] = []

    def visit(e: Expr) -> None:
        if id(e) in seen:
            return
        seen.add(id(e))
        for child in children(e):
            visit(child)
        order.append(e)

    visit(expr)
    return iter(order)


def children(e: Expr) -> tuple[Expr, ...]:
    if isinstance(e, Read):
        return tuple(value for _, value, _ in e.indirect)
    if isinstance(e, Op):
        return e.args
    if isinstance(e, Masked):
        return (e.body,)
    if isinstance(e, WriteAt):
        return (e.value, *(value for _, value, _ in e.indirect))
    if isinstance(e, Attention):
        return (e.query, e.key, e.value, e.score)
    return ()


def reads(expr: Expr) -> list[Read]:
    return [e for e in walk(expr) if isinstance(e, Read)]


def substitute(
    expr: Expr, on_read: Callable[[Read], Expr], on_index: Callable[[sympy.Expr], sympy.Expr]
) -> Expr:
    """Rebuild `expr` with reads replaced by `on_read(read)` and index expressions mapped."""
    memo: dict[int, Expr] = {}

    def go(e: Expr) -> Expr:
        if id(e) in memo:
            return memo[id(e)]
        if isinstance(e, Read):
            indirect = tuple((sym, go(value), size) for sym, value, size in e.indirect)
            out = on_read(Read(e.dtype, e.name, tuple(on_index(i) for i in e.index), indirect))
        elif isinstance(e, IndexValue):
            out = IndexValue(e.dtype, on_index(e.expr))
        elif isinstance(e, Op):
            out = Op(e.dtype, e.name, tuple(go(a) for a in e.args), e.params)
        elif isinstance(e, Masked):
            out = Masked(e.dtype, on_index(e.mask), go(e.body), e.other)
        elif isinstance(e, WriteAt):
            indirect = tuple((sym, go(value), size) for sym, value, size in e.indirect)
            out = WriteAt(e.dtype, go(e.value), tuple(on_index(i) for i in e.index), indirect)
        elif isinstance(e, Attention):
            out = Attention(e.dtype, go(e.query), go(e.key), go(e.value), go(e.score))
        else:
            out = e
        memo[id(e)] = out
        return out

    return go(expr)


def bind(expr: Expr, bindings: Sequence[tuple[sympy.Symbol, Expr, sympy.Expr]]) -> Expr:
    """Attach the data each indirect symbol stands for to the reads that index with it. A binding
    no read indexes with (a gather of a broadcast value) goes to the first read, so that its
    bounds check is still made."""

    def on_read(r: Read) -> Expr:
        used = set().union(*(sympy.sympify(i).free_symbols for i in r.index)) if r.index else set()
        extra = tuple(b for b in bindings if b[0] in used and b not in r.indirect)
        return Read(r.dtype, r.name, r.index, r.indirect + extra) if extra else r

    out = substitute(expr, on_read, lambda e: e)
    bound = {b for r in reads(out) for b in r.indirect}
    unused = tuple(b for b in bindings if b not in bound)
    first = next(iter(reads(out)), None)
    if not unused or first is None:
        return out
    with_checks = Read(first.dtype, first.name, first.index, first.indirect + unused)
    return substitute(out, lambda r: with_checks if r == first else r, lambda e: e)


def format_expr(expr: Expr) -> str:
    """One-line readable form, used in IR dumps and error messages."""
    if isinstance(expr, Read):
        bound = "".join(f", {sym}={format_expr(value)}" for sym, value, _ in expr.indirect)
        return f"{expr.name}[{', '.join(map(str, expr.index))}{bound}]"
    if isinstance(expr, Const):
        return repr(expr.value)
    if isinstance(expr, IndexValue):
        return f"index({expr.expr})"
    if isinstance(expr, Op):
        params = "".join(f", {p}" for p in expr.params)
        return f"{expr.name}({', '.join(format_expr(a) for a in expr.args)}{params})"
    if isinstance(expr, Masked):
        return f"masked({expr.mask}, {format_expr(expr.body)}, {expr.other!r})"
    if isinstance(expr, WriteAt):
        bound = "".join(f", {sym}={format_expr(value)}" for sym, value, _ in expr.indirect)
        return f"at[{', '.join(map(str, expr.index))}{bound}] {format_expr(expr.value)}"
    if isinstance(expr, Score):
        return "score"
    if isinstance(expr, Attention):
        parts = ("query", "key", "value", "score")
        return "attention(" + ", ".join(f"{p}={format_expr(getattr(expr, p))}" for p in parts) + ")"
    raise TypeError(type(expr))


# ----------------------------------------------------------------------------------------------
# Graph nodes
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Layout:
    size: Index
    stride: Index
    offset: sympy.Expr
    dtype: torch.dtype

    def offset_of(self, index: Sequence[sympy.Expr]) -> sympy.Expr:
        return self.offset + sum((i * s for i, s in zip(index, self.stride)), sympy.Integer(0))


def same_layout(a: Layout, b: Layout, equal: Callable[[Any, Any], bool] = statically_known_equal) -> bool:
    """Whether two layouts are the same memory: dtype, sizes, strides and offset (by `equal`)."""
    sides = [(*x.size, *x.stride, x.offset) for x in (a, b)]
    return a.dtype == b.dtype and len(a.size) == len(b.size) and all(map(equal, *sides))


@dataclasses.dataclass
class Buffer:
    """Memory that exists outside generated kernels: a graph input or an extern's result."""

    name: str
    layout: Layout
    kind: str  # "input" | "extern"


@dataclasses.dataclass
class ComputeNode:
    """One FX node's pointwise computation; `body` is its element at `index_vars(len(size))`."""

    name: str
    layout: Layout  # where it lives if it is stored (export's strides for that node)
    body: Expr
    fx_node: torch.fx.Node
    aten: str  # the ATen op, for kernel names and headers

    @property
    def size(self) -> Index:
        return self.layout.size

    @property
    def dtype(self) -> torch.dtype:
        return self.layout.dtype


@dataclasses.dataclass
class ReduceNode(ComputeNode):
    """A reduction: `body` is one element of the reduced input at `index_vars(len(full_size))`;
    the node's value at an output index is the reduction over the dims in `reduced`."""

    full_size: Index = ()
    reduced: tuple[int, ...] = ()
    reduce_type: str = "sum"  # "sum" | "max" | "min" | "prod" | "any"
    keepdim: bool = False

    def output_index(self, full_index: Index) -> Index:
        """The output index that full-space index `full_index` reduces into."""
        if self.keepdim:
            return tuple(sympy.Integer(0) if k in self.reduced else v for k, v in enumerate(full_index))
        return tuple(v for k, v in enumerate(full_index) if k not in self.reduced)


def dot_operands(*operands: Expr) -> tuple[torch.dtype, tuple[Expr, ...]]:
    """The dtype a tensor-core dot multiplies `operands` in, and the operands to load: 16-bit when
    each is that dtype or a float32 cast of it (the cast is left to the dot: tensor cores multiply
    16-bit values exactly into the float32 accumulator), else float32."""
    inner = [e.args[0] if isinstance(e, Op) and e.name == "to_dtype" else e for e in operands]
    dtypes = {e.dtype for e in inner}
    if len(dtypes) == 1 and dtypes <= {torch.float16, torch.bfloat16}:
        return dtypes.pop(), tuple(inner)
    return torch.float32, operands


@dataclasses.dataclass
class MatmulNode(ReduceNode):
    """A matrix product, a sum over k like any reduction: `full_size` is (batch..., M, N, K), the
    last dim reduced, and `body` is `mul(lhs, rhs)` with the left operand's element at
    (batch..., m, k) and the right one's at (batch..., k, n), each already in the accumulator's
    dtype (float32). Its region is a template (kernels/matmul.py): tiles of the output
    accumulated with tensor-core dots over k, the operands read through their views and cheap
    producers (the prologue), the pointwise nodes that consume the product applied to the tile
    before its store (the epilogue)."""


@dataclasses.dataclass
class AttentionNode(MatmulNode):
    """softmax(score(Q @ K^T)) @ V without the score matrix in memory: `full_size` is
    (batch..., L, Ev, S, D), the key (S) and head (D) dims reduced, and `body` an `Attention` with
    the query, key, value and score expressions over that index. Its region is the attention
    template (kernels/attention.py): a tile of queries against blocks of keys with an online
    softmax, the operands read through their views (a grouped-query head through index math),
    the score's masks and biases on the score tile, the consumers of the output as epilogue.
    `empty_rows`: what a row whose scores are all -inf gives: "nan" (softmax's 0/0) or "zero"
    (scaled_dot_product_attention's). `absorbed`: the nodes of a written-out attention it replaces
    (lowering/attention_pattern.py), named in its kernel's header. `causal`: the score keeps only
    keys at or before the query's own index (top-left, as sdpa's is_causal), so the kernel stops
    its key loop at its query tile's last row."""

    empty_rows: str = "nan"
    absorbed: tuple[ComputeNode, ...] = ()
    causal: bool = False


@dataclasses.dataclass
class ScanNode(ComputeNode):
    """An inclusive scan along `dim` (cumsum, cumprod, logcumsumexp, cummax/cummin's values or
    indices: argmax/argmin scans give the index, int64): `body` is one element of the
    scanned input at `index_vars(len(size))`; the node's element at index i combines the body's
    elements at i with the dim's index <= i[dim], in order. Same size as its input."""

    dim: int = 0
    scan_type: str = "sum"  # "sum" | "prod" | "logsumexp" | "max" | "min" | "argmax" | "argmin"


@dataclasses.dataclass
class ScatterNode(ComputeNode):
    """A write through indices (scatter, scatter_add, scatter_reduce, index_put): the node is the
    memory of `base` after, for each element of `space` (index variables `index_vars(len(space))`),
    the body's (a `WriteAt`) value is combined into the element it names. `reduce`: "store" (of
    duplicate indices, one value wins, unspecified which, as in eager), "sum", "max", "min"
    (atomics), "nan" (stores only NaN values: the pass after a float max/min, whose atomics skip
    NaN, makes NaN win as in eager). The kernel writes into `base`'s buffer in place: lowering makes
    `base` a stored value that nothing else reads (a copy of the tensor written into, or a fresh
    tensor an in-place op writes into)."""

    space: Index = ()
    base: str = ""
    reduce: str = "store"  # "store" | "sum" | "max" | "min" | "nan"
    # (condition over size symbols, why): relations between sizes the writes assume (index
    # tensors broadcast together), checked by the entry's guards like a kernel's assumptions
    assumptions: tuple[tuple[sympy.Basic, str], ...] = ()


@dataclasses.dataclass
class ExternNode:
    """An op run by eager ATen inside the compiled program (matmul, conv, unsupported ops)."""

    name: str
    fx_node: torch.fx.Node
    reason: str
    tensor_args: list[str]  # names of the values (buffers, nodes, views) it reads


@dataclasses.dataclass
class ViewNode:
    """An FX view op kept so the wrapper can build the real strided view (outputs, extern args)."""

    name: str
    fx_node: torch.fx.Node
    base: str
    element: int | None = None  # for ops returning several views (split): which one


@dataclasses.dataclass
class LoopGraph:
    """The lowered program: buffers, compute/extern nodes in FX order, and the outputs."""

    buffers: dict[str, Buffer]
    nodes: list[ComputeNode | ExternNode]
    views: dict[str, ViewNode]
    outputs: list[str | None]  # value name per FX output (None: a non-tensor output)
    fx_graph: torch.fx.Graph
    # names of graph values whose memory the wrapper must have (outputs, extern args, view bases)
    needed_in_memory: set[str]
    # FX node name -> the value it names, where they differ (elements of multi-output lowerings)
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)

    def node(self, name: str) -> ComputeNode | ExternNode:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def compute_nodes(self) -> dict[str, ComputeNode]:
        return {n.name: n for n in self.nodes if isinstance(n, ComputeNode)}

    def format(self) -> str:
        lines = []
        for b in self.buffers.values():
            lay = b.layout
            lines.append(
                f"buffer {b.name}: {b.kind} {dtype_str(lay.dtype)}{list(lay.size)} stride={list(lay.stride)}"
            )
        for n in self.nodes:
            if isinstance(n, ReduceNode):
                iv = ", ".join(map(str, index_vars(len(n.full_size))))
                dims = list(n.reduced)
                kind = "matmul sum" if isinstance(n, MatmulNode) else n.reduce_type
                lines.append(
                    f"{n.name} = {kind}[{iv}] over dims {dims} of {format_expr(n.body)}"
                    f"  # {dtype_str(n.dtype)}{list(n.size)}"
                )
            elif isinstance(n, ScatterNode):
                iv = ", ".join(map(str, index_vars(len(n.space))))
                lines.append(
                    f"{n.name} = {n.base} with {n.reduce} for [{iv}] in {list(n.space)}: "
                    f"{format_expr(n.body)}  # {dtype_str(n.dtype)}{list(n.size)}"
                )
            elif isinstance(n, ComputeNode):
                iv = ", ".join(map(str, index_vars(len(n.size))))
                lines.append(f"{n.name}[{iv}] = {format_expr(n.body)}  # {dtype_str(n.dtype)}{list(n.size)}")
            else:
                lines.append(
                    f"{n.name} = extern {n.fx_node.target}({', '.join(n.tensor_args)})  # {n.reason}"
                )
        for v in self.views.values():
            lines.append(f"{v.name} = view {v.fx_node.target} of {v.base}")
        lines.append(f"return {self.outputs}")
        return "\n".join(lines)


_SHORT = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "b8",
}


def dtype_str(dtype: torch.dtype) -> str:
    return _SHORT.get(dtype, str(dtype).replace("torch.", ""))


class IRError(RuntimeError):
    """A pass made an ill-formed IR or schedule (GJIT_DEBUG checks between passes)."""


def resolve(graph: LoopGraph, name: str) -> str:
    """The value `name` stands for: through aliases and views to the node or buffer it reads."""
    name = graph.aliases.get(name, name)
    while name in graph.views:
        name = graph.aliases.get(graph.views[name].base, graph.views[name].base)
    return name


def verify(graph: LoopGraph) -> None:
    """The loop IR is well formed (GJIT_DEBUG runs this after lowering): each read names an input
    or an earlier node, with as many indices as that value has dims; each extern reads values that
    exist before it (an extern's result exists once it ran); each output is a value."""
    dims = {name: len(b.layout.size) for name, b in graph.buffers.items()}
    known = {name for name, b in graph.buffers.items() if b.kind == "input"}
    for node in graph.nodes:
        if isinstance(node, ExternNode):
            missing = [a for a in node.tensor_args if resolve(graph, a) not in known]
            if missing:
                raise IRError(f"gjit IR: extern {node.name} reads {missing}: nothing defines them before it")
        else:
            if isinstance(node, ScatterNode) and node.base not in known:
                raise IRError(f"gjit IR: {node.name} writes into {node.base}: nothing defines it before it")
            for r in reads(node.body):
                if resolve(graph, r.name) not in known:
                    raise IRError(f"gjit IR: {node.name} reads {r.name}: nothing defines it before it")
                if r.name in dims and len(r.index) != dims[r.name]:
                    raise IRError(
                        f"gjit IR: {node.name} reads {r.name} with {len(r.index)} indices, "
                        f"it has {dims[r.name]} dims"
                    )
            dims[node.name] = len(node.size)
        known.add(node.name)
    for out in graph.outputs:
        if out is not None and resolve(graph, out) not in known:
            raise IRError(f"gjit IR: output {out} is not a value of the graph")
