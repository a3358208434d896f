"""The iteration space of a reduction, scan or template region, and where each member of the
region lives in it: a reduction's input space split into kept (outer) and reduced dims, a matmul
or attention template's (batch..., M, N, K) with members over its output tile or over a reshape
of it read through the output's view. Fusion (gjit/fusion/regions.py) asks `placement` whether a node can
join a region; the writers of codegen/ print members with `value_index`.
"""

from __future__ import annotations

import dataclasses

import sympy
from torch.utils._sympy.functions import FloorDiv, ModularIndexing

from gjit import ir
from gjit.ir import ComputeNode, Expr, ReduceNode, statically_known_equal


@dataclasses.dataclass(frozen=True)
class ReductionSpace:
    """A reduction kernel's iteration space: `full` split into kept (outer) and `reduced` dims."""

    full: ir.Index
    reduced: tuple[int, ...]
    matmul: str = ""  # a matmul's (its node): members may also be reshapes of its output space
    # their placements, derived from how they read the product (see `reshape_placement`)
    reshaped: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)

    @property
    def vars(self) -> ir.Index:
        """The canonical index variables c0, c1, ... of the full space."""
        return ir.index_vars(len(self.full), prefix="c")

    def placement(self, node: ComputeNode, body: Expr | None = None) -> dict | None:
        """Map `node`'s index variables to canonical ones; None if it does not live in this space.
        `body`: the node's body with its inlined producers (what it reads of a matmul)."""
        c = self.vars
        if isinstance(node, ReduceNode):
            ok = tuple(node.full_size) == tuple(self.full) and tuple(node.reduced) == self.reduced
            return dict(zip(ir.index_vars(len(self.full)), c)) if ok else None
        size, iv = tuple(node.size), ir.index_vars(len(node.size))
        if size == tuple(self.full):
            return dict(zip(iv, c))
        kept = [k for k in range(len(self.full)) if k not in self.reduced]
        if size == tuple(1 if k in self.reduced else s for k, s in enumerate(self.full)):
            return {iv[k]: (sympy.Integer(0) if k in self.reduced else c[k]) for k in range(len(c))}
        if size == tuple(self.full[k] for k in kept):
            return {iv[j]: c[k] for j, k in enumerate(kept)}
        if self.matmul:
            if node.name not in self.reshaped:
                self.reshaped[node.name] = self.reshape_placement(node, node.body if body is None else body)
            return self.reshaped[node.name]
        return None

    def value_index(self, node: ComputeNode) -> ir.Index:
        """Where, in canonical coordinates, a member's value for the current point is read."""
        if isinstance(node, ReduceNode):
            return node.output_index(self.vars)
        mapping = self.placement(node)
        return tuple(mapping[v] for v in ir.index_vars(len(node.size)))

    def reshape_placement(self, node: ComputeNode, body: Expr) -> dict | None:
        """A member over a reshape (or a permuted reshape) of the matmul's output space: a linear's
        output viewed as [B, S, N] from the [B*S, N] product, heads split off N and moved. How the
        member reads the product says where it lives: each index of that read must be the row-major
        flattening of some of the member's dims (the view's index math), which are then that output
        dim's digits. The flattened form maps back to the output dim itself (xreplace goes top-down),
        so the member reads the accumulator, not memory."""
        size, iv = tuple(node.size), ir.index_vars(len(node.size))
        read = next((r for r in ir.reads(body) if r.name == self.matmul), None)
        if read is None:  # a member that reads a placed member of its own size element-for-element
            for r in ir.reads(body):
                placed = self.reshaped.get(r.name)
                if placed is not None and r.index == iv and len(r.index) == len(size):
                    return placed
            return None
        if len(read.index) != len(self.full) - len(self.reduced):
            return None
        kept = [k for k in range(len(self.full)) if k not in self.reduced]
        mapping: dict = {v: sympy.Integer(0) for v, n in zip(iv, size) if n == 1}
        used: set = set()
        digits: dict = {}  # member var -> [(stride, output var, size, top)]: it merges output dims
        for original, k in zip(read.index, kept):
            var, total = self.vars[k], self.full[k]
            component = sympy.sympify(original).xreplace({v: sympy.Integer(0) for v in mapping})
            digit = _digit(component, total, iv)
            if digit is not None:
                digits.setdefault(digit[0], []).append((digit[1], var, total, digit[2]))
                mapping[sympy.sympify(original)] = var
                continue
            terms = {v: component.coeff(v) for v in iv if v not in mapping and component.has(v)}
            if sympy.expand(component - sum((c * v for v, c in terms.items()), sympy.Integer(0))) != 0:
                return None
            if any(c.free_symbols & set(iv) for c in terms.values()) or used & set(terms):
                return None
            used |= set(terms)
            order, inner = [], sympy.Integer(1)  # innermost digit first
            while len(order) < len(terms):
                nxt = [v for v in terms if v not in order and statically_known_equal(terms[v], inner)]
                if len(nxt) != 1:
                    return None
                order.append(nxt[0])
                inner *= size[iv.index(nxt[0])]
            if not statically_known_equal(inner, total):
                return None
            stride = sympy.Integer(1)
            for n, v in enumerate(order):
                if n == len(order) - 1:  # the outermost digit needs no modulo
                    mapping[v] = FloorDiv(var, stride) if stride != 1 else var
                else:
                    mapping[v] = ModularIndexing(var, stride, size[iv.index(v)])
                stride *= size[iv.index(v)]
            mapping[sympy.sympify(original)] = var
        for v, found in digits.items():  # the digits must tile the member's dim exactly, inner first
            stride, value, left = sympy.Integer(1), sympy.Integer(0), list(found)
            while left:
                nxt = [d for d in left if statically_known_equal(d[0], stride)]
                if len(nxt) != 1 or v in used:
                    return None
                left.remove(nxt[0])
                _, var, total, top = nxt[0]
                if top and left:  # v // stride is the digit only when nothing is above it
                    return None
                value, stride = value + var * stride, stride * total
            if not statically_known_equal(stride, size[iv.index(v)]):
                return None
            used.add(v)
            mapping[v] = value
        return mapping if set(iv) <= used | set(mapping) else None


def _digit(component: sympy.Expr, total: sympy.Expr, iv: ir.Index) -> tuple | None:
    """(v, stride, top) when an output dim of size `total` is the digit v // stride % total of one
    member var v (heads merged back into [B, S, H*D] after attention), `top` when it is written
    v // stride (the outermost digit: its size is checked with the others): else None."""
    if isinstance(component, ModularIndexing) and component.args[0] in iv:
        v, stride, modulus = component.args
        return (v, stride, False) if statically_known_equal(modulus, total) else None
    if isinstance(component, FloorDiv) and component.args[0] in iv:
        return component.args[0], component.args[1], True
    return None
