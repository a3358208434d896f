"""Iteration-space simplification for a kernel: drop size-1 dims and merge adjacent dims
that every memory access walks contiguously, so a contiguous kernel indexes with one flat
variable (and Triton can vectorize its loads).
"""

from __future__ import annotations

import dataclasses

import sympy
from torch.utils._sympy.functions import FloorDiv, ModularIndexing

from gjit.ir import at_values, statically_known_equal

XINDEX = sympy.Symbol("xindex", integer=True, nonnegative=True)
YINDEX = sympy.Symbol("yindex", integer=True, nonnegative=True)


def linear_coeffs(expr: sympy.Expr, variables: list[sympy.Symbol]) -> tuple[sympy.Expr, list] | None:
    """(constant, [coefficient per variable]) if `expr` is linear in `variables`, else None."""
    const = sympy.Integer(0)
    coeffs = [sympy.Integer(0)] * len(variables)
    position = {v: k for k, v in enumerate(variables)}
    for term in sympy.Add.make_args(sympy.expand(expr)):
        used = term.free_symbols & position.keys()
        if not used:
            const += term
            continue
        if len(used) > 1:
            return None
        (v,) = used
        coeff, rest = term.as_independent(v, as_Add=False)
        if rest != v:
            return None
        coeffs[position[v]] += coeff
    return const, coeffs


@dataclasses.dataclass
class IndexPlan:
    sizes: list[sympy.Expr]  # kernel dims, outermost first
    vars: list[sympy.Symbol]  # one kernel variable per dim
    var_exprs: list[sympy.Expr]  # each variable in terms of xindex
    groups: list[list[int]]  # original dims of each kernel dim
    old_vars: list[sympy.Symbol]
    old_sizes: list[sympy.Expr]

    def substitute(self, expr: sympy.Expr) -> sympy.Expr:
        """Rewrite an expression over the original index variables in kernel variables."""
        expr = sympy.sympify(expr)
        if not expr.free_symbols & set(self.old_vars):
            return expr
        linear = linear_coeffs(expr, self.old_vars) if isinstance(expr, sympy.Expr) else None
        if linear is not None and self._walks_groups(linear[1]):
            const, coeffs = linear
            return const + sum((coeffs[g[-1]] * v for g, v in zip(self.groups, self.vars)), sympy.Integer(0))
        return expr.xreplace(self._digits())

    def _walks_groups(self, coeffs: list) -> bool:
        return all(
            _contiguous(coeffs, self.old_sizes, g[j], g[j + 1])
            for g in self.groups
            for j in range(len(g) - 1)
        )

    def _digits(self) -> dict:
        mapping = {}
        for k, size in enumerate(self.old_sizes):
            if size == 1:
                mapping[self.old_vars[k]] = sympy.Integer(0)
        for g, v in zip(self.groups, self.vars):
            inner = sympy.Integer(1)
            for j in reversed(g):
                if j == g[0]:
                    mapping[self.old_vars[j]] = _floordiv(v, inner)
                else:
                    mapping[self.old_vars[j]] = _modular(v, inner, self.old_sizes[j])
                inner = inner * self.old_sizes[j]
        return mapping


def _floordiv(v: sympy.Expr, inner: sympy.Expr) -> sympy.Expr:
    # inner == 0: a static size 0 inside, so the kernel has no element and v is never used
    return v if inner in (0, 1) else FloorDiv(v, inner)


def _modular(v: sympy.Expr, inner: sympy.Expr, size: sympy.Expr) -> sympy.Expr:
    return sympy.Integer(0) if 0 in (inner, size) else ModularIndexing(v, inner, size)


def _contiguous(coeffs: list, sizes: list, outer: int, inner: int) -> bool:
    return statically_known_equal(coeffs[outer], coeffs[inner] * sizes[inner])


def loop_order(sizes: list[sympy.Expr], primary: tuple | None, hints: dict) -> list[int]:
    """Dims ordered by the primary access's stride, largest first (row-major when it is)."""
    dims = list(range(len(sizes)))
    if primary is None:
        return dims

    def stride(k: int) -> int:
        value = at_values(primary[1][k], hints)
        return int(value) if value.is_number else 0

    return sorted(dims, key=lambda k: -stride(k))


def coalesce(
    sizes: list[sympy.Expr],
    old_vars,
    accesses: list[sympy.Expr],
    primary: sympy.Expr | None = None,
    hints: dict | None = None,
) -> IndexPlan:
    """Plan a kernel's index variables: reorder dims by `primary`'s strides, drop size-1 dims,
    merge neighbours that every access walks contiguously."""
    old_vars = list(old_vars)
    linear = [linear_coeffs(a, old_vars) for a in accesses]
    order = loop_order(sizes, None if primary is None else linear_coeffs(primary, old_vars), hints or {})
    groups: list[list[int]] = [[k] for k in order if sizes[k] != 1]
    k = len(groups) - 2
    while k >= 0:
        outer, inner = groups[k], groups[k + 1]
        ok = all(lin is not None and _contiguous(lin[1], sizes, outer[-1], inner[0]) for lin in linear)
        if ok:
            groups[k] = outer + inner
            del groups[k + 1]
        k -= 1
    dims = [sympy.Mul(*[sizes[j] for j in g]) for g in groups]
    n = len(dims)
    new_vars = [sympy.Symbol(f"x{n - 1 - k}", integer=True, nonnegative=True) for k in range(n)]
    xindex = XINDEX
    var_exprs = []
    for k in range(n):
        inner = sympy.Mul(*dims[k + 1 :]) if k + 1 < n else sympy.Integer(1)
        if k == 0:
            var_exprs.append(_floordiv(xindex, inner))
        else:
            var_exprs.append(_modular(xindex, inner, dims[k]))
    return IndexPlan(dims, new_vars, var_exprs, groups, old_vars, list(sizes))


def tile_exprs(sizes: list[sympy.Expr], split: int) -> list[sympy.Expr]:
    """A 2-D tile's index variables: kernel dims up to `split` (inclusive) are digits of yindex,
    the rest digits of xindex (each side row-major)."""
    out = []
    for side, index in ((sizes[: split + 1], YINDEX), (sizes[split + 1 :], XINDEX)):
        for k in range(len(side)):
            inner = sympy.Mul(*side[k + 1 :]) if k + 1 < len(side) else sympy.Integer(1)
            out.append(_floordiv(index, inner) if k == 0 else _modular(index, inner, side[k]))
    return out
