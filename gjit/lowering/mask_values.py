"""The value of a tensor the program builds from its sizes, as a function of its indices: a mask
built from aranges, broadcasts, comparisons, selects, index tensors, a cat or a running sum, its
element an expression over one integer symbol per dim it varies along (`Value`: a predicate for a
bool tensor, a number for others), for gjit/lowering/causal.py's proofs.

What each node's value may be is its dtype's: index arithmetic in int64 only (linear, small
coefficients: no overflow), any other number a select of constants (or, in int64, of index
arithmetic) each exact in its dtype, bool a predicate; arithmetic and comparisons take their
operands (Python numbers and sizes too) in the promoted dtype they run in, and no arithmetic
touches an infinity (sympy makes -inf * 0 zero, torch NaN). An index tensor must be in bounds for
every size (eager raises, or counts a negative index from the end), a cat's parts before the last
of sizes that are numbers, a running sum zero or the same along its dim. Anything else (a tensor
input, a cast that rounds, an op not below) has no value (None), and the proofs fail.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Callable

import sympy
import torch
from sympy.core.relational import Relational
from sympy.logic.boolalg import BooleanAtom, BooleanFunction
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten = torch.ops.aten

ARANGES = (aten.arange.default, aten.arange.start, aten.arange.start_step)
SAME = (aten.alias.default, aten.clone.default, aten.lift_fresh_copy.default)
CASTS = (aten._to_copy.default, torch.ops.prims.convert_element_type.default)
VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
ARITHMETIC = {aten.add.Tensor: lambda a, b: a + b, aten.sub.Tensor: lambda a, b: a - b,
              aten.mul.Tensor: lambda a, b: a * b}  # fmt: skip
COMPARISONS = {
    aten.ge.Scalar: sympy.Ge, aten.ge.Tensor: sympy.Ge, aten.gt.Scalar: sympy.Gt, aten.gt.Tensor: sympy.Gt,
    aten.le.Scalar: sympy.Le, aten.le.Tensor: sympy.Le, aten.lt.Scalar: sympy.Lt, aten.lt.Tensor: sympy.Lt,
    aten.eq.Scalar: sympy.Eq, aten.eq.Tensor: sympy.Eq, aten.ne.Scalar: sympy.Ne, aten.ne.Tensor: sympy.Ne,
}  # fmt: skip
LOGICAL = {aten.logical_and.default: sympy.And, aten.logical_or.default: sympy.Or,
           aten.logical_xor.default: sympy.Xor}  # fmt: skip
BITWISE = {
    aten.bitwise_and.Tensor: sympy.And,
    aten.bitwise_or.Tensor: sympy.Or,
    aten.bitwise_xor.Tensor: sympy.Xor,
}  # fmt: skip (on bool tensors only)
INDEXES = (torch.int64, torch.int32)  # an index tensor's dtypes (a boolean one is a mask: not taken)
MAX_NODES = 32  # a mask that computes with more nodes than this is not looked into (the proof's time)
MAX_VIEWS = 96  # nor one of more nodes that only place its elements (views, slices, index tensors)
PLACING = {aten.unsqueeze.default, aten.expand.default, aten.slice.Tensor, aten.index.Tensor,
           aten.cat.default, *SAME, *VIEWS}  # fmt: skip
MAX_OPS = 200  # nor a value of more operations than this
MAX_COEFFICIENT = 2**20  # index arithmetic's constants: sums of a few terms stay far from 2**63


def is_predicate(expr: sympy.Basic) -> bool:
    return isinstance(expr, (Relational, BooleanFunction, BooleanAtom))


def _as_number(expr: sympy.Basic) -> sympy.Basic:
    """A predicate as the 1 or 0 torch makes of a bool in arithmetic; a number as it is."""
    return sympy.Piecewise((1, expr), (0, True)) if is_predicate(expr) else expr


def _as_predicate(expr: sympy.Basic) -> sympy.Basic:
    return expr if is_predicate(expr) else sympy.Ne(expr, 0)


@dataclasses.dataclass(frozen=True)
class Value:
    """A tensor's element as a function of its indices: `expr` over the symbols in `dims` (one per
    dim; None where it does not vary along that dim)."""

    expr: sympy.Basic
    dims: tuple[sympy.Symbol | None, ...]

    def fresh(self) -> Value:
        """The same value over new symbols (a node read twice is two reads: never one index)."""
        new = {s: sympy.Dummy(integer=True, nonnegative=True) for s in self.dims if s is not None}
        return Value(self.expr.xreplace(new), tuple(new.get(s) if s is not None else None for s in self.dims))


def number_of(x: object) -> sympy.Basic | None:
    """A Python number as sympy holds it exactly (a bool: true or false; inf: oo); None for NaN."""
    if isinstance(x, bool):
        return sympy.true if x else sympy.false
    if isinstance(x, numbers.Integral):
        return sympy.Integer(int(x))
    if isinstance(x, numbers.Real):
        x = float(x)
        if math.isnan(x):
            return None
        return sympy.oo if x == math.inf else -sympy.oo if x == -math.inf else sympy.Float(x)
    return None


def _exact(number: sympy.Basic, dtype: torch.dtype) -> bool:
    """Whether `number` is a value of `dtype` exactly (a constant torch keeps as it is), compared
    as rationals: no rounding, overflow or underflow on the way (2**53 + 1 is no float64)."""
    if number in (sympy.oo, -sympy.oo):
        return dtype.is_floating_point
    if not number.is_number or not number.is_real or dtype == torch.bool:
        return False
    exact = sympy.Rational(number)
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        return exact.q == 1 and info.min <= exact.p <= info.max
    x = float(exact)
    if not math.isfinite(x) or sympy.Rational(x) != exact:
        return False
    return torch.tensor(x, dtype=torch.float64).to(dtype).double().item() == x


def _fits(expr: sympy.Basic, dtype: torch.dtype) -> bool:
    """Whether torch holds `expr` in `dtype` as it is: a number exact there, a select of such
    numbers, or (int64 only) index arithmetic, linear with small integer coefficients."""
    if expr.is_number:
        return _exact(expr, dtype)
    if isinstance(expr, sympy.Piecewise):
        return all(_fits(value, dtype) for value, _ in expr.args)
    if dtype != torch.int64 or expr.atoms(sympy.Piecewise) or not expr.is_polynomial(*expr.free_symbols):
        return False
    poly = sympy.Poly(expr, *expr.free_symbols)
    return poly.total_degree() <= 1 and all(c.is_integer and abs(c) <= MAX_COEFFICIENT for c in poly.coeffs())


class Evaluator:
    """Node values, each evaluated once. `held`: a placeholder's value where its contents are known
    (a buffer's: gjit/lowering/held_masks.py), or None; `read` keeps the placeholders it gave."""

    def __init__(self, held: Callable[[torch.fx.Node], Value | None] | None = None) -> None:
        self.memo: dict[torch.fx.Node, Value | None] = {}
        self.computing = 0  # nodes read so far that compute (the rest place elements: PLACING)
        self.held = held
        self.read: set[torch.fx.Node] = set()

    def __call__(self, arg: object) -> Value | None:
        if not isinstance(arg, torch.fx.Node):
            number = number_of(arg)
            return None if number is None else Value(number, ())
        if arg not in self.memo and isinstance(arg.meta.get("val"), torch.SymInt):
            size = sympy.sympify(arg.meta["val"].node.expr)  # a size computed: its expression
            ok = size.is_integer and positive_sizes(size, arg.meta["val"])
            self.memo[arg] = Value(size, ()) if ok else None
        if arg not in self.memo and arg.op == "placeholder":
            value = self.held(arg) if self.held is not None else None
            self.memo[arg] = None if value is None else _checked(value, arg.meta.get("val"))
            self.read.update([arg] if self.memo[arg] is not None else [])
        if arg not in self.memo:
            val = arg.meta.get("val")
            self.computing += arg.target not in PLACING
            ok = arg.op == "call_function" and isinstance(val, torch.Tensor)
            ok = ok and self.computing <= MAX_NODES and len(self.memo) < MAX_NODES + MAX_VIEWS
            self.memo[arg] = None  # (a node being evaluated reads no value of its own)
            self.memo[arg] = _checked(self.node(arg), val) if ok else None
        value = self.memo[arg]
        return None if value is None else value.fresh()

    def node(self, node: torch.fx.Node) -> Value | None:
        target, args = node.target, node.args
        if target in ARANGES:
            return _arange(node)
        if target is aten.full.default:
            number = number_of(args[1])
            return None if number is None else Value(number, (None,) * len(args[0]))
        if target is aten.scalar_tensor.default:
            number = number_of(args[0])
            return None if number is None else Value(number, ())
        if target in SAME:
            return self(args[0])
        if target in CASTS:
            return self.cast(node)
        if target is aten.unsqueeze.default:
            return self.unsqueeze(args[0], args[1])
        if target is aten.expand.default:
            return self.expand(args[0], args[1])
        if target in VIEWS:
            return self.view(args[0], node.meta["val"])
        if target is aten.slice.Tensor:
            return self.slice(node)
        if target is aten.index.Tensor:
            return self.index(node)
        if target is aten.cat.default:
            return self.cat(node)
        if target is aten.cumsum.default:
            return self.cumsum(node)
        if target in ARITHMETIC:
            if node.kwargs.get("alpha", 1) != 1:
                return None
            return self.numeric(lambda a, b: _arithmetic(ARITHMETIC[target], a, b), *args[:2])
        if target is aten.neg.default:
            x = self(args[0])
            return None if x is None else Value(-_as_number(x.expr), x.dims)
        if target in COMPARISONS:
            return self.numeric(lambda a, b: compare(COMPARISONS[target], a, b), *args[:2])
        if target in LOGICAL:
            op = LOGICAL[target]
            return self.combine(lambda a, b: op(_as_predicate(a), _as_predicate(b)), *args[:2])
        if target in BITWISE:
            return self.combine(functools.partial(_on_predicates, BITWISE[target]), *args[:2])
        if target is aten.logical_not.default or target is aten.bitwise_not.default:
            x = self(args[0])
            if x is None or (target is aten.bitwise_not.default and not is_predicate(x.expr)):
                return None
            return Value(sympy.Not(_as_predicate(x.expr)), x.dims)
        if target is aten.where.self:
            return self.where(*args)
        return None

    def cast(self, node: torch.fx.Node) -> Value | None:
        """A cast to bool (x != 0), or to another dtype the value must fit (`_checked`)."""
        x = self(node.args[0])
        if x is None or set(node.kwargs) - {"dtype", "layout", "device"} or len(node.args) > 2:
            return None
        if node.meta["val"].dtype == torch.bool:
            return Value(_as_predicate(x.expr), x.dims)
        return Value(_as_number(x.expr), x.dims)

    def unsqueeze(self, arg: object, dim: int) -> Value | None:
        x = self(arg)
        if x is None:
            return None
        dim = dim + len(x.dims) + 1 if dim < 0 else dim
        return Value(x.expr, x.dims[:dim] + (None,) + x.dims[dim:])

    def expand(self, arg: object, sizes: list) -> Value | None:
        x = self(arg)
        if x is None:
            return None
        return Value(x.expr, (None,) * (len(sizes) - len(x.dims)) + x.dims)  # size-1 dims: index 0 already

    def view(self, arg: object, val: torch.Tensor) -> Value | None:
        """A view that only adds or drops dims of size 1 (`tril(...).view(1, 1, T, T)`)."""
        x = self(arg)
        if x is None or not isinstance(arg, torch.fx.Node):
            return None
        old, new = arg.meta["val"].shape, val.shape
        kept = [(size, symbol) for size, symbol in zip(old, x.dims) if not statically_known_true(size == 1)]
        wide = [k for k, size in enumerate(new) if not statically_known_true(size == 1)]
        same = all(statically_known_true(new[k] == size) for k, (size, _) in zip(wide, kept))
        if len(wide) != len(kept) or not same:
            return None
        dims: list[sympy.Symbol | None] = [None] * len(new)
        for k, (_, symbol) in zip(wide, kept):
            dims[k] = symbol
        return Value(x.expr, tuple(dims))

    def slice(self, node: torch.fx.Node) -> Value | None:
        """From a start that is a number or a size (a cache's past length: `mask[past:past + L]`),
        at least 0 (a negative one counts from the end)."""
        arg, dim, start, _, step = (list(node.args) + [0, 0, None, None, 1][len(node.args) :])[:5]
        x = self(arg)
        start = 0 if start is None else start
        if isinstance(start, torch.fx.Node):
            size = self(start)
            start = size.expr if size is not None and not size.dims else None
            start = start if start is not None and nonnegative(start, node.meta["val"]) else None
        if x is None or not isinstance(step, int) or step < 1 or start is None:
            return None
        if isinstance(start, int) and start < 0:
            return None
        dim = dim + len(x.dims) if dim < 0 else dim
        symbol = x.dims[dim]
        if symbol is None:
            return x
        fresh = sympy.Dummy(integer=True, nonnegative=True)
        dims = x.dims[:dim] + (fresh,) + x.dims[dim + 1 :]
        return Value(x.expr.xreplace({symbol: start + step * fresh}), dims)

    def index(self, node: torch.fx.Node) -> Value | None:
        """`source[i0, i1, ...]` with an int64 or int32 index tensor for each of its first dims:
        the source's element at the indices' values, which must be in its bounds (eager raises
        elsewhere, or counts a negative index from the end)."""
        source, indices = node.args[:2]
        x = self(source)
        if x is None or not indices or len(indices) > len(x.dims):
            return None
        if not all(isinstance(i, torch.fx.Node) and i.meta["val"].dtype in INDEXES for i in indices):
            return None  # a None (a dim taken whole) or a boolean index
        aligned = _aligned([self(i) for i in indices])
        if aligned is None:
            return None
        exprs, dims = aligned
        out, sizes = node.meta["val"].shape, source.meta["val"].shape
        bounds = {s: size_expr(out[k]) for k, s in enumerate(dims) if s is not None}
        if not all(_within(e, bounds, size_expr(n), node.meta["val"]) for e, n in zip(exprs, sizes)):
            return None
        at = {s: e for s, e in zip(x.dims, exprs) if s is not None}
        return Value(x.expr.xreplace(at), dims + x.dims[len(indices) :])

    def cat(self, node: torch.fx.Node) -> Value | None:
        """Tensors one after another along a dim: a select over its index, by the sizes before
        (numbers: a select on a size symbol is no proof)."""
        tensors, dim = node.args[0], node.args[1] if len(node.args) > 1 else 0
        values = [self(t) for t in tensors]
        rank = node.meta["val"].dim()
        if any(v is None or len(v.dims) != rank for v in values):
            return None
        dim = dim + rank if dim < 0 else dim
        at = sympy.Dummy(integer=True, nonnegative=True)
        dims = [sympy.Dummy(integer=True, nonnegative=True) for _ in range(rank)]
        dims[dim] = at
        branches, start = [], 0
        for k, (t, v) in enumerate(zip(tensors, values)):
            renamed = {s: dims[d] - (start if d == dim else 0) for d, s in enumerate(v.dims) if s is not None}
            last = k == len(values) - 1
            if not last:
                start += t.meta["val"].shape[dim]
                if not isinstance(start, int):
                    return None
            branches.append((v.expr.xreplace(renamed), sympy.true if last else sympy.Lt(at, start)))
        if all(is_predicate(value) for value, _ in branches):  # booleans: a predicate, as where's
            terms, earlier = [], sympy.false
            for value, cond in branches:
                terms.append(sympy.And(value, cond, sympy.Not(earlier)))
                earlier = sympy.Or(earlier, cond)
            return Value(sympy.Or(*terms), tuple(dims))
        return Value(sympy.Piecewise(*((_as_number(value), cond) for value, cond in branches)), tuple(dims))

    def cumsum(self, node: torch.fx.Node) -> Value | None:
        """A running sum along a dim of a value that is the same along it (c: c * (k + 1)) or 0
        along it at every index (`_zero`: 0)."""
        x = self(node.args[0])
        if x is None or set(node.kwargs) - {"dtype"} or len(node.args) > 2:
            return None
        dim = node.args[1] + len(x.dims) if node.args[1] < 0 else node.args[1]
        symbol, number = x.dims[dim], _as_number(x.expr)
        if symbol is None:
            k = sympy.Dummy(integer=True, nonnegative=True)
            return Value(number * (k + 1), x.dims[:dim] + (k,) + x.dims[dim + 1 :])
        if not _zero(number, symbol):
            return None
        return Value(sympy.Integer(0), x.dims[:dim] + (None,) + x.dims[dim + 1 :])

    def numeric(self, op, a: object, b: object) -> Value | None:
        """`op` on two numbers as torch computes it: in their promoted dtype, which each operand
        (a Python number too) must fit as it is (a constant exact there, index arithmetic in int64
        only); a bool as 1 or 0."""
        operands = [x.meta["val"] if isinstance(x, torch.fx.Node) else x for x in (a, b)]
        operands = [0 if isinstance(x, torch.SymInt) else x for x in operands]  # a size: an int
        if not all(isinstance(x, (torch.Tensor, numbers.Number)) for x in operands):
            return None
        dtype = torch.result_type(*operands)

        def checked(x: sympy.Basic, y: sympy.Basic) -> sympy.Basic | None:
            x, y = _as_number(x), _as_number(y)
            return op(x, y) if _fits(x, dtype) and _fits(y, dtype) else None

        return self.combine(checked, a, b)

    def combine(self, op, a: object, b: object) -> Value | None:
        aligned = _aligned([self(a), self(b)])
        if aligned is None:
            return None
        (x, y), dims = aligned
        expr = op(x, y)
        return None if expr is None else Value(expr, dims)

    def where(self, cond: object, a: object, b: object) -> Value | None:
        aligned = _aligned([self(cond), self(a), self(b)])
        if aligned is None:
            return None
        (c, x, y), dims = aligned
        if not is_predicate(c):
            return None
        if is_predicate(x) and is_predicate(y):
            return Value(sympy.Or(sympy.And(c, x), sympy.And(sympy.Not(c), y)), dims)
        return Value(sympy.Piecewise((_as_number(x), c), (_as_number(y), True)), dims)


def _checked(value: Value | None, val: torch.Tensor) -> Value | None:
    """`value` as the node's dtype and sizes hold it: a dim of size 1 indexed by 0 only (it may
    broadcast), a bool a predicate, any other dtype a value it holds as it is (`_fits`)."""
    if value is None or len(value.dims) != val.dim():
        return None
    expr, dims = value.expr, list(value.dims)
    for k, size in enumerate(val.shape):
        if dims[k] is not None and statically_known_true(size == 1):
            expr, dims[k] = expr.xreplace({dims[k]: sympy.Integer(0)}), None
    if not is_predicate(expr) and expr.has(sympy.Piecewise):
        expr = sympy.piecewise_fold(expr)  # arithmetic on selects: one select of its branches
    dims = [s if s in expr.free_symbols else None for s in dims]  # (an index it does not vary along)
    if sympy.count_ops(expr) > MAX_OPS:
        return None  # (a select of selects doubles with each one)
    if val.dtype == torch.bool:
        return Value(expr, tuple(dims)) if is_predicate(expr) else None
    if is_predicate(expr) or not _fits(expr, val.dtype):
        return None
    if not val.dtype.is_floating_point:  # its constants exact integers: compared as such, not as floats
        expr = expr.xreplace({f: sympy.Integer(int(f)) for f in expr.atoms(sympy.Float)})
    return Value(expr, tuple(dims))


def _aligned(values: list[Value | None]) -> tuple[list[sympy.Basic], tuple] | None:
    """The values' expressions broadcast together (from the last dim), each dim's index one symbol
    in all of them."""
    if any(v is None for v in values):
        return None
    n = max(len(v.dims) for v in values)
    dims: list[sympy.Symbol | None] = [None] * n
    for v in values:
        for k, symbol in enumerate(v.dims, start=n - len(v.dims)):
            if symbol is not None and dims[k] is None:
                dims[k] = sympy.Dummy(integer=True, nonnegative=True)
    exprs = []
    for v in values:
        renamed = {s: dims[k] for k, s in enumerate(v.dims, start=n - len(v.dims)) if s is not None}
        exprs.append(v.expr.xreplace(renamed))  # at once: a symbol renamed is not renamed again
    return exprs, tuple(dims)


def compare(op, x: sympy.Basic, y: sympy.Basic) -> sympy.Basic:
    """`op(x, y)` on numbers (a bool as 1 or 0), a select of constants compared branch by branch,
    so that the result holds comparisons of indices only."""
    x, y = _as_number(x), _as_number(y)
    for a, b, swap in ((x, y, False), (y, x, True)):
        if isinstance(a, sympy.Piecewise) and b.is_number:
            terms, earlier = [], sympy.false
            for value, cond in a.args:  # each branch's condition, and no earlier branch's
                terms.append(sympy.And(op(b, value) if swap else op(value, b), cond, sympy.Not(earlier)))
                earlier = sympy.Or(earlier, cond)
            return sympy.Or(*terms)
    return op(x, y)


def _on_predicates(op, x: sympy.Basic, y: sympy.Basic) -> sympy.Basic | None:
    """A bitwise op on bools as the logical one; None on numbers."""
    return op(x, y) if is_predicate(x) and is_predicate(y) else None


def _arithmetic(op, x: sympy.Basic, y: sympy.Basic) -> sympy.Basic | None:
    """`op` on numbers, None where one is infinite (sympy makes -inf * 0 and -inf - -inf 0, torch
    NaN)."""
    if x.has(sympy.oo, -sympy.oo) or y.has(sympy.oo, -sympy.oo):
        return None
    return op(x, y)


def size_expr(n: int | torch.SymInt) -> sympy.Basic:
    return sympy.Integer(n) if isinstance(n, int) else n.node.expr


def value_range(expr: sympy.Basic, bounds: dict[sympy.Symbol, sympy.Basic]) -> tuple | None:
    """The least and greatest value of index arithmetic `expr` over symbols each in [0, its bound)
    (a size): linear in them with integer coefficients; None where it is not so."""
    if not expr.free_symbols & set(bounds):
        return expr, expr
    if not expr.is_polynomial(*bounds):
        return None
    poly = sympy.Poly(expr, *bounds)
    if poly.total_degree() > 1:
        return None
    least = greatest = expr.xreplace({s: 0 for s in bounds})
    for s, bound in bounds.items():
        c = poly.coeff_monomial(s)
        if not c.is_integer:
            return None
        if c > 0:
            greatest += c * (bound - 1)
        else:
            least += c * (bound - 1)
    return least, greatest


def _within(expr: sympy.Basic, bounds: dict[sympy.Symbol, sympy.Basic], size: sympy.Basic, val) -> bool:
    """Whether index arithmetic `expr`, over symbols each below its bound (a size), is in [0, size)
    for every value of them and of the sizes (in their ranges: `nonnegative`, `val` a tensor of
    the program)."""
    found = value_range(expr, bounds)
    if found is None:
        return False
    least, greatest = found
    return nonnegative(least, val) and nonnegative(size - 1 - greatest, val)


def nonnegative(expr: sympy.Basic, val: torch.Tensor) -> bool:
    """Whether `expr`, over indices (dummies, at least 0) and sizes, is at least 0 for every value
    of them; its sizes must be at least 1 in the shape environment of `val` (a tensor of the
    program: `positive_sizes`)."""
    return positive_sizes(expr, val) and bool(expr.is_nonnegative)


def positive_sizes(expr: sympy.Basic, val: object) -> bool:
    """Whether each size in `expr` is at least 1 in the range the shape environment of `val` (a
    tensor or size of the program) gives it. sympy takes export's size symbols as positive,
    whatever their range; a size that may be 0 (`Dim(min=0)`) is no proof's."""
    sizes = [s for s in expr.free_symbols if not isinstance(s, sympy.Dummy)]
    if not sizes:
        return True
    if isinstance(val, torch.SymInt):
        env = val.node.shape_env
    else:
        env = getattr(getattr(val, "fake_mode", None), "shape_env", None)
    ranges = [env.var_to_range.get(s) if env is not None else None for s in sizes]
    return all(r is not None and bool(r.lower >= 1) for r in ranges)


def sample_points(predicate: sympy.Basic, symbol: sympy.Symbol) -> set[int] | None:
    """Integers at which `predicate`, over `symbol` alone, takes each value it takes anywhere:
    every comparison in it is linear in `symbol`, so between their roots it is one value; None
    where it is not so."""
    roots = [sympy.Integer(0), sympy.Integer(1)]
    for atom in predicate.atoms(Relational):
        difference = sympy.expand(atom.lhs - atom.rhs)
        if not difference.free_symbols <= {symbol}:
            return None  # it depends on another index
        if not difference.free_symbols:
            continue
        if not difference.is_polynomial(symbol):
            return None
        poly = sympy.Poly(difference, symbol)
        if poly.degree() != 1 or not all(c.is_integer for c in poly.all_coeffs()):
            return None
        a, c = poly.all_coeffs()
        roots.append(sympy.Rational(-c, a))
    points: set[int] = set()
    for r in roots:
        points.update(range(math.floor(r) - 1, math.ceil(r) + 2))
    points.update({min(points) - 1, max(points) + 1})
    points.update({p + 1 for p in list(points)})
    return points


def truth(predicate: sympy.Basic, symbol: sympy.Symbol, at: int) -> bool | None:
    truth = predicate.xreplace({symbol: sympy.Integer(at)})
    truth = sympy.simplify(truth) if truth not in (sympy.true, sympy.false) else truth
    return bool(truth) if truth in (sympy.true, sympy.false) else None


def _zero(number: sympy.Basic, symbol: sympy.Symbol) -> bool:
    """Whether `number`, over the index `symbol` (0 and up) alone, is 0 at every index."""
    nonzero = compare(sympy.Ne, number, sympy.Integer(0))
    points = sample_points(nonzero, symbol)
    return points is not None and all(truth(nonzero, symbol, p) is False for p in points | {0} if p >= 0)


def _arange(node: torch.fx.Node) -> Value | None:
    args = list(node.args)
    start = 0 if node.target is aten.arange.default else args[0]
    step = args[2] if len(args) > 2 else 1
    if not isinstance(start, int) or not isinstance(step, int) or step == 0:
        return None
    symbol = sympy.Dummy(integer=True, nonnegative=True)
    return Value(start + step * symbol, (symbol,))
