"""Whether a mask the program builds from its sizes is the causal one: a key j kept for query i
exactly where j <= i (SDPA's `is_causal`, aligned to the top left), for every size.

A program that writes `torch.triu(torch.ones(T, T, dtype=torch.bool), 1)`, `torch.tril(torch.ones(T,
T)) == 0` or `arange(S)[None] <= arange(L)[:, None]` hands SDPA (or a fill) a tensor that is the
causal mask; export decomposes each into aranges, broadcasts, differences and comparisons. Proved
causal, the attention runs ATen's causal kernel (FlashAttention) or the template's causal loop
bound, where a mask of that tensor is read from memory for every tile.

The proof evaluates the mask's nodes symbolically (`_Value`: a sympy expression or predicate over
one integer symbol per indexed dim), puts d = j - i for the last two dims, and requires every
comparison in the result to be linear in d alone: the predicate then changes only at the roots of
those comparisons, and agreeing with d <= 0 at each root, around it and past the outermost ones
proves it for every integer d. Anything else (a tensor input, a size-dependent offset, an op not
below) is no proof, and the mask stays as it is.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import sympy
import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten = torch.ops.aten

ARANGES = (aten.arange.default, aten.arange.start, aten.arange.start_step)
SAME = (aten.alias.default, aten.clone.default, aten.lift_fresh_copy.default)
ARITHMETIC = {aten.add.Tensor: sympy.Add, aten.sub.Tensor: None, aten.mul.Tensor: sympy.Mul}
COMPARISONS = {
    aten.ge.Scalar: sympy.Ge, aten.ge.Tensor: sympy.Ge, aten.gt.Scalar: sympy.Gt, aten.gt.Tensor: sympy.Gt,
    aten.le.Scalar: sympy.Le, aten.le.Tensor: sympy.Le, aten.lt.Scalar: sympy.Lt, aten.lt.Tensor: sympy.Lt,
    aten.eq.Scalar: sympy.Eq, aten.eq.Tensor: sympy.Eq, aten.ne.Scalar: sympy.Ne, aten.ne.Tensor: sympy.Ne,
}  # fmt: skip
LOGICAL = {
    aten.logical_and.default: sympy.And, aten.bitwise_and.Tensor: sympy.And,
    aten.logical_or.default: sympy.Or, aten.bitwise_or.Tensor: sympy.Or,
    aten.logical_xor.default: sympy.Xor, aten.bitwise_xor.Tensor: sympy.Xor,
}  # fmt: skip
NOT = (aten.logical_not.default, aten.bitwise_not.default)
MAX_NODES = 64  # a mask built from more nodes than this is not looked into


@dataclasses.dataclass(frozen=True)
class _Value:
    """A tensor's element as a function of its indices: `expr` over the symbols in `dims` (one per
    dim; None where it does not vary along that dim)."""

    expr: sympy.Basic
    dims: tuple[sympy.Symbol | None, ...]


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


class _Evaluator:
    def __init__(self) -> None:
        self.memo: dict[torch.fx.Node, _Value | None] = {}

    def __call__(self, arg: object) -> _Value | None:
        if not isinstance(arg, torch.fx.Node):
            number = _number(arg)
            return None if number is None else _Value(number, ())
        if arg not in self.memo:
            self.memo[arg] = self.node(arg) if len(self.memo) < MAX_NODES else None
        return self.memo[arg]

    def node(self, node: torch.fx.Node) -> _Value | None:
        if node.op != "call_function":
            return None
        target, args = node.target, node.args
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return None
        if target in ARANGES:
            return _arange(node, val)
        if target is aten.full.default:
            number = _number(args[1])
            return None if number is None else _Value(number, (None,) * len(args[0]))
        if target is aten.scalar_tensor.default:
            number = _number(args[0])
            return None if number is None else _Value(number, ())
        if target in SAME:
            return self(args[0])
        if target in (aten._to_copy.default, torch.ops.prims.convert_element_type.default):
            return self.cast(node, val)
        if target is aten.unsqueeze.default:
            return self.unsqueeze(args[0], args[1])
        if target is aten.expand.default:
            return self.expand(args[0], args[1])
        if target is aten.slice.Tensor:
            return self.slice(node)
        if target in ARITHMETIC:
            return self.arithmetic(node)
        if target is aten.neg.default:
            x = self(args[0])
            return None if x is None else _Value(-x.expr, x.dims)
        if target in COMPARISONS:
            return self.combine(COMPARISONS[target], args[0], args[1])
        if target in LOGICAL:
            return self.combine(LOGICAL[target], args[0], args[1])
        if target in NOT:
            x = self(args[0])
            return (
                None
                if x is None or not isinstance(x.expr, sympy.logic.boolalg.Boolean)
                else _Value(sympy.Not(x.expr), x.dims)
            )
        if target is aten.where.self:
            return self.where(*args)
        return None

    def cast(self, node: torch.fx.Node, val: torch.Tensor) -> _Value | None:
        x = self(node.args[0])
        if x is None or set(node.kwargs) - {"dtype", "layout", "device"} or len(node.args) > 2:
            return None
        boolean = isinstance(x.expr, sympy.logic.boolalg.Boolean)
        if val.dtype == torch.bool:
            return x if boolean else _Value(sympy.Ne(x.expr, 0), x.dims)
        if boolean:
            return _Value(sympy.Piecewise((1, x.expr), (0, True)), x.dims)
        return x  # index values and masks' constants are exact in any dtype used here

    def unsqueeze(self, arg: object, dim: int) -> _Value | None:
        x = self(arg)
        if x is None:
            return None
        dim = dim + len(x.dims) + 1 if dim < 0 else dim
        return _Value(x.expr, x.dims[:dim] + (None,) + x.dims[dim:])

    def expand(self, arg: object, sizes: list) -> _Value | None:
        x = self(arg)
        if x is None or not isinstance(arg, torch.fx.Node):
            return None
        old = arg.meta["val"].shape
        lead = len(sizes) - len(x.dims)
        expr, dims = x.expr, list(x.dims)
        for k, symbol in enumerate(x.dims):
            if symbol is not None and statically_known_true(old[k] == 1):
                expr, dims[k] = expr.subs(symbol, 0), None  # a dim of one index: broadcast
        return _Value(expr, (None,) * lead + tuple(dims))

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
        return _Value(x.expr.subs(symbol, start + step * fresh), dims)

    def arithmetic(self, node: torch.fx.Node) -> _Value | None:
        alpha = node.kwargs.get("alpha", 1)
        if set(node.kwargs) - {"alpha"} or alpha != 1:
            return None
        if node.target is aten.sub.Tensor:
            return self.combine(lambda a, b: a - b, *node.args)
        return self.combine(ARITHMETIC[node.target], *node.args)

    def combine(self, op, a: object, b: object) -> _Value | None:
        aligned = _aligned([self(a), self(b)])
        if aligned is None:
            return None
        (x, y), dims = aligned
        try:
            return _Value(_distribute(op, x, y), dims)
        except (TypeError, ValueError):  # sympy refuses: arithmetic on a predicate, say
            return None

    def where(self, cond: object, a: object, b: object) -> _Value | None:
        aligned = _aligned([self(cond), self(a), self(b)])
        if aligned is None:
            return None
        (c, x, y), dims = aligned
        if not isinstance(c, sympy.logic.boolalg.Boolean):
            return None
        if isinstance(x, sympy.logic.boolalg.Boolean) and isinstance(y, sympy.logic.boolalg.Boolean):
            return _Value(sympy.Or(sympy.And(c, x), sympy.And(sympy.Not(c), y)), dims)
        if isinstance(x, sympy.logic.boolalg.Boolean) or isinstance(y, sympy.logic.boolalg.Boolean):
            return None
        return _Value(sympy.Piecewise((x, c), (y, True)), dims)


def _aligned(values: list[_Value | None]) -> tuple[list[sympy.Basic], tuple] | None:
    """The values' expressions broadcast together (from the last dim), a dim's symbols made one."""
    if any(v is None for v in values):
        return None
    n = max(len(v.dims) for v in values)
    dims: list[sympy.Symbol | None] = [None] * n
    exprs = []
    for v in values:
        expr = v.expr
        for k, symbol in enumerate(v.dims, start=n - len(v.dims)):
            if symbol is None:
                continue
            if dims[k] is None:
                dims[k] = symbol
            elif dims[k] != symbol:
                expr = expr.subs(symbol, dims[k])  # one dim, indexed alike
        exprs.append(expr)
    return exprs, tuple(dims)


def _distribute(op, x: sympy.Basic, y: sympy.Basic):
    """`op(x, y)`, a comparison of a select (Piecewise) of constants taken branch by branch, so the
    result holds comparisons of indices only."""
    if op in (sympy.Ge, sympy.Gt, sympy.Le, sympy.Lt, sympy.Eq, sympy.Ne):
        for a, b, swap in ((x, y, False), (y, x, True)):
            if isinstance(a, sympy.Piecewise) and b.is_number:
                terms = [(op(b, value) if swap else op(value, b), cond) for value, cond in a.args]
                return sympy.Or(*(sympy.And(t, c) for t, c in _exclusive(terms)))
    return op(x, y)


def _exclusive(terms: list) -> list:
    """Piecewise branches as mutually exclusive conditions (each branch's, and no earlier one's)."""
    out, earlier = [], sympy.false
    for value, cond in terms:
        out.append((value, sympy.And(cond, sympy.Not(earlier))))
        earlier = sympy.Or(earlier, cond)
    return out


def _arange(node: torch.fx.Node, val: torch.Tensor) -> _Value | None:
    if val.dtype.is_floating_point or val.dtype == torch.bool or val.dim() != 1:
        return None
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
    value = _Evaluator()(node)
    return value is not None and _causal(value, keep)


def is_causal_additive(node: torch.fx.Node) -> bool:
    """Whether the float tensor `node` is 0 where j <= i and -inf elsewhere (an additive causal mask
    SDPA takes: triu of a -inf fill, say), for every size."""
    value = _Evaluator()(node)
    if value is None or isinstance(value.expr, sympy.logic.boolalg.Boolean):
        return False
    zero = _Value(_distribute(sympy.Eq, value.expr, sympy.Integer(0)), value.dims)
    hidden = _Value(_distribute(sympy.Eq, value.expr, -sympy.oo), value.dims)
    return _causal(zero, True) and _causal(hidden, False)


def _causal(value: _Value, keep: bool) -> bool:
    if len(value.dims) < 2 or any(s is not None for s in value.dims[:-2]):
        return False  # it varies over batch or heads
    rows, keys = value.dims[-2:]
    d = sympy.Dummy("d", integer=True)
    i = rows if rows is not None else sympy.Dummy(integer=True, nonnegative=True)
    predicate = value.expr
    if not isinstance(predicate, sympy.logic.boolalg.Boolean):
        return False
    if keys is not None:
        predicate = predicate.subs(keys, i + d)
    if not keep:
        predicate = sympy.Not(predicate)
    roots = [sympy.Integer(0), sympy.Integer(1)]
    for atom in predicate.atoms(sympy.core.relational.Relational):
        difference = sympy.expand(atom.lhs - atom.rhs)
        if not difference.free_symbols <= {d}:
            return False  # it depends on the row or key alone, or on something else
        poly = sympy.Poly(difference, d) if difference.free_symbols else None
        if poly is None:
            continue
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
        truth = predicate.subs(d, p)
        if truth not in (sympy.true, sympy.false) or bool(truth) != (p <= 0):
            return False
    return True
