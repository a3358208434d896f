"""Whether a mask the program builds from its sizes is the causal one: a key j kept for query i
exactly where j <= i (SDPA's `is_causal`, aligned to the top left), for every size.

A program that writes `torch.triu(torch.ones(T, T, dtype=torch.bool), 1)`, `torch.tril(torch.ones(T,
T)) == 0` or `arange(S)[None] <= arange(L)[:, None]` hands SDPA (or a fill) a tensor that is the
causal mask; export decomposes each into aranges, broadcasts, differences and comparisons. Proved
causal, the attention runs ATen's causal kernel (FlashAttention where L == S) or the template's
causal loop bound, where a mask of that tensor is read from memory for every tile.

The proof evaluates the mask's nodes symbolically (`_Value`: a predicate for a bool tensor, a
number for others, over one integer symbol per dim its element varies along), puts d = j - i for
the last two dims, and requires every comparison in the result to be linear in d alone: the
predicate then changes only at the roots of those comparisons, and agreeing with d <= 0 at each
root, around it and past the outermost ones proves it for every integer d. What each node's value
may be is its dtype's: index arithmetic in int64 only (linear, small coefficients: no overflow),
any other number a select of constants each exact in its dtype, bool a predicate; arithmetic and
comparisons take their operands (Python numbers too) in the promoted dtype they run in, and no
arithmetic touches an infinity (sympy makes -inf * 0 zero, torch NaN). Anything else (a
tensor input, a size-dependent offset, a cast that rounds, an op not below) is no proof, and the
mask stays as it is.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers

import sympy
import torch
from sympy.core.relational import Relational
from sympy.logic.boolalg import BooleanAtom, BooleanFunction
from torch.fx.experimental.symbolic_shapes import statically_known_true

log = logging.getLogger("gjit.lowering")
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
MAX_NODES = 32  # a mask built from more nodes than this is not looked into (the proof's time)
MAX_OPS = 200  # nor a value of more operations than this
MAX_COEFFICIENT = 2**20  # index arithmetic's constants: sums of a few terms stay far from 2**63


def _predicate(expr: sympy.Basic) -> bool:
    return isinstance(expr, (Relational, BooleanFunction, BooleanAtom))


def _as_number(expr: sympy.Basic) -> sympy.Basic:
    """A predicate as the 1 or 0 torch makes of a bool in arithmetic; a number as it is."""
    return sympy.Piecewise((1, expr), (0, True)) if _predicate(expr) else expr


def _as_predicate(expr: sympy.Basic) -> sympy.Basic:
    return expr if _predicate(expr) else sympy.Ne(expr, 0)


@dataclasses.dataclass(frozen=True)
class _Value:
    """A tensor's element as a function of its indices: `expr` over the symbols in `dims` (one per
    dim; None where it does not vary along that dim)."""

    expr: sympy.Basic
    dims: tuple[sympy.Symbol | None, ...]

    def fresh(self) -> _Value:
        """The same value over new symbols (a node read twice is two reads: never one index)."""
        new = {s: sympy.Dummy(integer=True, nonnegative=True) for s in self.dims if s is not None}
        return _Value(
            self.expr.xreplace(new), tuple(new.get(s) if s is not None else None for s in self.dims)
        )


def _number(x: object) -> sympy.Basic | None:
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
        return all(value.is_number and _exact(value, dtype) for value, _ in expr.args)
    if dtype != torch.int64 or expr.atoms(sympy.Piecewise) or not expr.is_polynomial(*expr.free_symbols):
        return False
    poly = sympy.Poly(expr, *expr.free_symbols)
    return poly.total_degree() <= 1 and all(c.is_integer and abs(c) <= MAX_COEFFICIENT for c in poly.coeffs())


class _Evaluator:
    def __init__(self) -> None:
        self.memo: dict[torch.fx.Node, _Value | None] = {}

    def __call__(self, arg: object) -> _Value | None:
        if not isinstance(arg, torch.fx.Node):
            number = _number(arg)
            return None if number is None else _Value(number, ())
        if arg not in self.memo:
            val = arg.meta.get("val")
            ok = arg.op == "call_function" and isinstance(val, torch.Tensor) and len(self.memo) < MAX_NODES
            self.memo[arg] = None  # (a node being evaluated reads no value of its own)
            self.memo[arg] = _checked(self.node(arg), val) if ok else None
        value = self.memo[arg]
        return None if value is None else value.fresh()

    def node(self, node: torch.fx.Node) -> _Value | None:
        target, args = node.target, node.args
        if target in ARANGES:
            return _arange(node)
        if target is aten.full.default:
            number = _number(args[1])
            return None if number is None else _Value(number, (None,) * len(args[0]))
        if target is aten.scalar_tensor.default:
            number = _number(args[0])
            return None if number is None else _Value(number, ())
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
        if target in ARITHMETIC:
            if node.kwargs.get("alpha", 1) != 1:
                return None
            return self.numeric(lambda a, b: _arithmetic(ARITHMETIC[target], a, b), *args[:2])
        if target is aten.neg.default:
            x = self(args[0])
            return None if x is None else _Value(-_as_number(x.expr), x.dims)
        if target in COMPARISONS:
            return self.numeric(lambda a, b: _compare(COMPARISONS[target], a, b), *args[:2])
        if target in LOGICAL:
            op = LOGICAL[target]
            return self.combine(lambda a, b: op(_as_predicate(a), _as_predicate(b)), *args[:2])
        if target in BITWISE:
            op = BITWISE[target]
            return self.combine(lambda a, b: op(a, b) if _predicate(a) and _predicate(b) else None, *args[:2])
        if target is aten.logical_not.default or target is aten.bitwise_not.default:
            x = self(args[0])
            if x is None or (target is aten.bitwise_not.default and not _predicate(x.expr)):
                return None
            return _Value(sympy.Not(_as_predicate(x.expr)), x.dims)
        if target is aten.where.self:
            return self.where(*args)
        return None

    def cast(self, node: torch.fx.Node) -> _Value | None:
        """A cast to bool (x != 0), or to another dtype the value must fit (`_checked`)."""
        x = self(node.args[0])
        if x is None or set(node.kwargs) - {"dtype", "layout", "device"} or len(node.args) > 2:
            return None
        if node.meta["val"].dtype == torch.bool:
            return _Value(_as_predicate(x.expr), x.dims)
        return _Value(_as_number(x.expr), x.dims)

    def unsqueeze(self, arg: object, dim: int) -> _Value | None:
        x = self(arg)
        if x is None:
            return None
        dim = dim + len(x.dims) + 1 if dim < 0 else dim
        return _Value(x.expr, x.dims[:dim] + (None,) + x.dims[dim:])

    def expand(self, arg: object, sizes: list) -> _Value | None:
        x = self(arg)
        if x is None:
            return None
        return _Value(x.expr, (None,) * (len(sizes) - len(x.dims)) + x.dims)  # size-1 dims: index 0 already

    def view(self, arg: object, val: torch.Tensor) -> _Value | None:
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
        return _Value(x.expr, tuple(dims))

    def slice(self, node: torch.fx.Node) -> _Value | None:
        arg, dim, start, _, step = (list(node.args) + [0, 0, None, None, 1][len(node.args) :])[:5]
        x = self(arg)
        start = 0 if start is None else start
        if x is None or not isinstance(start, int) or not isinstance(step, int) or start < 0 or step < 1:
            return None
        dim = dim + len(x.dims) if dim < 0 else dim
        symbol = x.dims[dim]
        if symbol is None:
            return x
        fresh = sympy.Dummy(integer=True, nonnegative=True)
        dims = x.dims[:dim] + (fresh,) + x.dims[dim + 1 :]
        return _Value(x.expr.xreplace({symbol: start + step * fresh}), dims)

    def numeric(self, op, a: object, b: object) -> _Value | None:
        """`op` on two numbers as torch computes it: in their promoted dtype, which each operand
        (a Python number too) must fit as it is (a constant exact there, index arithmetic in int64
        only); a bool as 1 or 0."""
        operands = [x.meta["val"] if isinstance(x, torch.fx.Node) else x for x in (a, b)]
        if not all(isinstance(x, (torch.Tensor, numbers.Number)) for x in operands):
            return None
        dtype = torch.result_type(*operands)

        def checked(x: sympy.Basic, y: sympy.Basic) -> sympy.Basic | None:
            x, y = _as_number(x), _as_number(y)
            return op(x, y) if _fits(x, dtype) and _fits(y, dtype) else None

        return self.combine(checked, a, b)

    def combine(self, op, a: object, b: object) -> _Value | None:
        aligned = _aligned([self(a), self(b)])
        if aligned is None:
            return None
        (x, y), dims = aligned
        expr = op(x, y)
        return None if expr is None else _Value(expr, dims)

    def where(self, cond: object, a: object, b: object) -> _Value | None:
        aligned = _aligned([self(cond), self(a), self(b)])
        if aligned is None:
            return None
        (c, x, y), dims = aligned
        if not _predicate(c):
            return None
        if _predicate(x) and _predicate(y):
            return _Value(sympy.Or(sympy.And(c, x), sympy.And(sympy.Not(c), y)), dims)
        return _Value(sympy.Piecewise((_as_number(x), c), (_as_number(y), True)), dims)


def _checked(value: _Value | None, val: torch.Tensor) -> _Value | None:
    """`value` as the node's dtype and sizes hold it: a dim of size 1 indexed by 0 only (it may
    broadcast), a bool a predicate, any other dtype a value it holds as it is (`_fits`)."""
    if value is None or len(value.dims) != val.dim():
        return None
    expr, dims = value.expr, list(value.dims)
    for k, size in enumerate(val.shape):
        if dims[k] is not None and statically_known_true(size == 1):
            expr, dims[k] = expr.xreplace({dims[k]: sympy.Integer(0)}), None
    if sympy.count_ops(expr) > MAX_OPS:
        return None  # (a select of selects doubles with each one)
    if val.dtype == torch.bool:
        return _Value(expr, tuple(dims)) if _predicate(expr) else None
    if _predicate(expr) or not _fits(expr, val.dtype):
        return None
    if not val.dtype.is_floating_point:  # its constants exact integers: compared as such, not as floats
        expr = expr.xreplace({f: sympy.Integer(int(f)) for f in expr.atoms(sympy.Float)})
    return _Value(expr, tuple(dims))


def _aligned(values: list[_Value | None]) -> tuple[list[sympy.Basic], tuple] | None:
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


def _compare(op, x: sympy.Basic, y: sympy.Basic) -> sympy.Basic:
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


def _arithmetic(op, x: sympy.Basic, y: sympy.Basic) -> sympy.Basic | None:
    """`op` on numbers, None where one is infinite (sympy makes -inf * 0 and -inf - -inf 0, torch
    NaN)."""
    if x.has(sympy.oo, -sympy.oo) or y.has(sympy.oo, -sympy.oo):
        return None
    return op(x, y)


def _arange(node: torch.fx.Node) -> _Value | None:
    args = list(node.args)
    start = 0 if node.target is aten.arange.default else args[0]
    step = args[2] if len(args) > 2 else 1
    if not isinstance(start, int) or not isinstance(step, int) or step == 0:
        return None
    symbol = sympy.Dummy(integer=True, nonnegative=True)
    return _Value(start + step * symbol, (symbol,))


def is_causal(node: torch.fx.Node, keep: bool = True) -> bool:
    """Whether the boolean tensor `node` is, wherever it is `keep`, exactly the keys j <= i of its
    last two dims (rows i, keys j), for every size: SDPA's `is_causal` mask. False when unproved."""
    try:
        value = _Evaluator()(node)
        return value is not None and _causal(value, keep)
    except Exception as e:  # sympy on an expression it cannot take apart: unproved
        log.debug("mask %s: not proved causal (%s: %s)", node.name, type(e).__name__, e)
        return False


def is_causal_additive(node: torch.fx.Node) -> bool:
    """Whether the float tensor `node` is 0 where j <= i and -inf elsewhere (an additive causal mask
    SDPA takes: triu of a -inf fill, say), for every size."""
    try:
        value = _Evaluator()(node)
        if value is None or _predicate(value.expr):
            return False
        zero = _Value(_compare(sympy.Eq, value.expr, sympy.Integer(0)), value.dims)
        hidden = _Value(_compare(sympy.Eq, value.expr, -sympy.oo), value.dims)
        return _causal(zero, True) and _causal(hidden, False)
    except Exception as e:  # sympy on an expression it cannot take apart: unproved
        log.debug("mask %s: not proved causal (%s: %s)", node.name, type(e).__name__, e)
        return False


def _causal(value: _Value, keep: bool) -> bool:
    if len(value.dims) < 2 or any(s is not None for s in value.dims[:-2]):
        return False  # it varies over batch or heads
    rows, keys = value.dims[-2:]
    if rows is None or keys is None or not _predicate(value.expr):
        return False  # the same for every row or every key
    d = sympy.Dummy("d", integer=True)
    predicate = value.expr.xreplace({keys: rows + d})
    if not keep:
        predicate = sympy.Not(predicate)
    roots = [sympy.Integer(0), sympy.Integer(1)]
    for atom in predicate.atoms(Relational):
        difference = sympy.expand(atom.lhs - atom.rhs)
        if not difference.free_symbols <= {d}:
            return False  # it depends on the row or the key alone
        if not difference.free_symbols:
            continue
        if not difference.is_polynomial(d):
            return False
        poly = sympy.Poly(difference, d)
        if poly.degree() != 1 or not all(c.is_integer for c in poly.all_coeffs()):
            return False
        a, c = poly.all_coeffs()
        roots.append(sympy.Rational(-c, a))
    points: set[int] = set()
    for r in roots:
        points.update(range(math.floor(r) - 1, math.ceil(r) + 2))
    points.update({min(points) - 1, max(points) + 1})
    points.update({p + 1 for p in list(points)})
    for p in points:
        truth = predicate.xreplace({d: sympy.Integer(p)})
        truth = sympy.simplify(truth) if truth not in (sympy.true, sympy.false) else truth
        if truth not in (sympy.true, sympy.false) or bool(truth) != (p <= 0):
            return False
    return True
