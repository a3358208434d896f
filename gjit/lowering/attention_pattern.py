"""Attention written out, as the eager attention of Hugging Face models writes it, becomes one
`AttentionNode`: a product of probabilities with values (`bmm`) whose probabilities are a softmax
over the key dim of a score that is a pointwise function of a product of queries with keys:

    scores = bmm(q, k^T)                                 MatmulNode S over (batch', L, S, D)
    x      = f(scores, masks, biases)                    pointwise: scale, mask, bias, casts
    probs  = softmax(x, dim=-1)                          max, sum of exp (ReduceNodes), truediv
    out    = bmm(cast(probs), v)                         MatmulNode O over (batch, L, Ev, S)

The pass runs on the loop IR after lowering, so views between the steps (the reshapes `matmul`
decomposes to, head transposes, a repeated key/value head's expand) are already index math. It
matches only when nothing else reads the scores, the probabilities or anything between them (a
model that returns its attention probabilities keeps its two matmuls and its softmax kernel),
when the probabilities' and the scores' rows and columns are the output's query rows and key
columns, the softmax runs over exactly the keys the product sums, and each cast of the
probabilities is exact or rounds to the values' dtype (as the template does). The score matrix
then never reaches memory; f becomes the score expression of the node with `Score()` for the
product, rounded to the scores' dtype as eager rounds it.
"""

from __future__ import annotations

import logging

import sympy
import torch
from torch.utils._sympy.functions import FloorDiv, ModularIndexing

from gjit import ir
from gjit.ir import (
    AttentionNode,
    ComputeNode,
    Expr,
    LoopGraph,
    MatmulNode,
    Op,
    Read,
    ReduceNode,
    Score,
    statically_known_equal,
)
from gjit.lowering.attention import head_dim_reason

log = logging.getLogger("gjit.lowering")

POINTWISE = ComputeNode  # exactly: a subclass computes something else (a reduction, a scan, a write)
WIDENS = (torch.float16, torch.bfloat16)  # exact in float32


def fold_digits(expr: sympy.Expr) -> sympy.Expr:
    """An index split into digits and put back together again, as the reshapes around `matmul`
    leave a batch index (a * (x // a) + x % a), is x again; x % a % a is x % a."""

    def fold(e: sympy.Basic) -> sympy.Basic:
        if not e.args:
            return e
        e = e.func(*(fold(a) for a in e.args))
        if isinstance(e, ModularIndexing) and isinstance(e.args[0], ModularIndexing):
            inner = e.args[0]
            if e.args[1] == inner.args[1] == 1 and e.args[2] == inner.args[2]:
                return inner
        if isinstance(e, sympy.Add):
            terms = list(e.args)
            for t in terms:
                if isinstance(t, ModularIndexing) and t.args[1] == 1:
                    x, a = t.args[0], t.args[2]
                    partner = a * FloorDiv(x, a)
                    if partner in terms:
                        rest = [u for u in terms if u != t and u != partner]
                        return fold(sympy.Add(x, *rest))
        return e

    return fold(sympy.sympify(expr))


def operand_dtype(e: Expr) -> torch.dtype:
    """The dtype a matmul operand is loaded in (its body casts 16-bit operands to float32)."""
    return e.args[0].dtype if isinstance(e, Op) and e.name == "to_dtype" else e.dtype


class Match:
    """One attempt to match the pattern ending in the product `out` (see the module docstring)."""

    def __init__(
        self,
        graph: LoopGraph,
        out: MatmulNode,
        readers: dict[str, set[str]],
        needed: set[str],
        hints: dict[sympy.Symbol, int],
    ):
        self.graph = graph
        self.hints = hints
        self.compute = graph.compute_nodes()
        self.out = out
        self.readers = readers
        self.needed = needed
        self.absorbed: dict[str, ComputeNode] = {}  # the nodes the attention node replaces

    def absorbable(self, name: str, kind: type) -> bool:
        """`name` is a node of type `kind` that only the pattern reads."""
        node = self.compute.get(name)
        if node is None or type(node) is not kind or name in self.needed:
            return False
        return self.readers.get(name, set()) <= {*self.absorbed, self.out.name}

    def at(self, node: ComputeNode, index: ir.Index) -> Expr:
        """`node`'s body with its index variables set to `index` (a reduction's: its full index)."""
        mapping = dict(zip(ir.index_vars(len(index)), index))
        return ir.substitute(node.body, lambda r: r, lambda e: sympy.sympify(e).xreplace(mapping))

    def probabilities(self, lhs: Expr, probs_dtype: torch.dtype) -> tuple[Expr, ir.Index] | None:
        """Follow casts and single-reader pointwise nodes from the output product's left operand to
        the softmax: its body at the index the product reads it, and that index. The casts must be
        exact (16-bit to float32), or round to `probs_dtype`, the dtype the template rounds the
        probabilities to for the second dot (eager's `.to(query.dtype)`)."""
        e, index = lhs, None
        while True:
            if isinstance(e, Op) and e.name == "to_dtype":
                source, target = e.args[0].dtype, e.params[0]
                exact = source == target or (source in WIDENS and target == torch.float32)
                if not (exact or target == probs_dtype and source.is_floating_point):
                    return None  # a cast that changes values the template would not change
                e = e.args[0]
            elif isinstance(e, Read) and self.absorbable(e.name, POINTWISE):
                self.absorbed[e.name] = self.compute[e.name]
                e, index = self.at(self.compute[e.name], e.index), e.index
            else:
                return (e, index) if index is not None else None

    def softmax_input(self, probs: Expr, index: ir.Index) -> Expr | None:
        """The softmax's input x at `index`, where probs = exp(x - max(x)) / sum(exp(x - max(x)))
        over the last dim, the max and the sum read only here."""
        if not (isinstance(probs, Op) and probs.name == "truediv"):
            return None
        numerator, total = probs.args
        if not (isinstance(numerator, Op) and numerator.name == "exp" and isinstance(total, Read)):
            return None
        shifted = numerator.args[0]
        if not (isinstance(shifted, Op) and shifted.name == "sub" and isinstance(shifted.args[1], Read)):
            return None
        x, peak = shifted.args
        row = (*index[:-1], sympy.Integer(0))
        for read, kind in ((peak, "max"), (total, "sum")):
            node = self.compute.get(read.name)
            if not (isinstance(node, ReduceNode) and type(node) is ReduceNode and node.reduce_type == kind):
                return None
            if node.reduced != (len(index) - 1,) or not node.keepdim or tuple(read.index) != row:
                return None
            if not statically_known_equal(node.full_size[-1], self.out.full_size[-1]):
                return None  # a softmax over more keys than the product sums (sliced probabilities)
            allowed = {*self.absorbed, peak.name, total.name}
            if read.name in self.needed or self.readers.get(read.name, set()) - allowed:
                return None
        max_node, sum_node = self.compute[peak.name], self.compute[total.name]
        if self.at(max_node, index) != x or self.at(sum_node, index) != numerator:
            return None
        self.absorbed[max_node.name], self.absorbed[sum_node.name] = max_node, sum_node
        return x

    def score(
        self, x: Expr, rows: sympy.Symbol, cols: sympy.Symbol
    ) -> tuple[Expr, MatmulNode, ir.Index] | None:
        """x with the pointwise nodes only the pattern reads expanded and the one product of
        queries and keys it reads (at the output's rows and columns) as `Score()`."""
        found: list[tuple[MatmulNode, ir.Index]] = []

        def on_read(r: Read) -> Expr:
            if self.absorbable(r.name, MatmulNode) and tuple(r.index[-2:]) == (rows, cols):
                found.append((self.compute[r.name], r.index))
                if r.dtype == torch.float32:
                    return Score(torch.float32)
                return Op(r.dtype, "to_dtype", (Score(torch.float32),), (r.dtype,))
            if self.absorbable(r.name, POINTWISE):
                self.absorbed[r.name] = self.compute[r.name]
                return ir.substitute(self.at(self.compute[r.name], r.index), on_read, lambda e: e)
            return r

        expr = ir.substitute(x, on_read, lambda e: e)
        if len({(n.name, i) for n, i in found}) != 1:
            return None
        node, index = found[0]
        self.absorbed[node.name] = node
        return expr, node, index

    def run(self) -> AttentionNode | None:
        out = self.out
        if not (isinstance(out.body, Op) and out.body.name == "mul"):
            return None
        lhs, value = out.body.args
        *batch, length, dim_v, keys = out.full_size
        *b, i, e, j = ir.index_vars(len(out.full_size))
        # how the probabilities' and the scores' rows and columns are read: a dim of size 1 at 0
        rows = sympy.Integer(0) if length == 1 else i
        cols = sympy.Integer(0) if keys == 1 else j
        found = self.probabilities(lhs, operand_dtype(value))
        if found is None or tuple(found[1][-2:]) != (rows, cols):
            return None
        x = self.softmax_input(*found)
        scored = x and self.score(x, rows, cols)
        if not scored:
            return None
        score, scores, at = scored
        dim = scores.full_size[-1]
        dtypes = (operand_dtype(scores.body.args[0]), operand_dtype(value))
        hints = [sympy.sympify(sympy.sympify(n).xreplace(self.hints)) for n in (dim, dim_v)]
        if not all(h.is_number for h in hints) or any(
            head_dim_reason(int(h), t, "") for h, t in zip(hints, dtypes)
        ):
            return None  # the template holds whole rows of the head dims
        *sb, sm, sn, sk = ir.index_vars(len(scores.full_size))
        d = ir.index_vars(len(out.full_size) + 1)[-1]
        mapping = {**dict(zip(sb, map(fold_digits, at[:-2]))), sm: i, sn: j, sk: d}
        product = ir.substitute(
            scores.body, lambda r: r, lambda ex: fold_digits(sympy.sympify(ex).xreplace(mapping))
        )
        query, key = product.args
        body = ir.Attention(out.dtype, query, key, value, score)
        full = (*batch, length, dim_v, keys, dim)
        reduced = (len(full) - 2, len(full) - 1)
        absorbed = tuple(self.absorbed[n] for n in self.compute if n in self.absorbed)
        left = {r.name for r in ir.reads(body)} & set(self.absorbed)
        if left:  # the new node would still read what it replaces (the scores at another index, ...)
            log.debug("attention %s: not matched, it still reads %s", out.name, sorted(left))
            return None
        return AttentionNode(
            out.name, out.layout, body, out.fx_node, out.aten, full, reduced, "sum", False, "nan", absorbed
        )


def match_attention(graph: LoopGraph, hints: dict[sympy.Symbol, int]) -> LoopGraph:
    """Each written-out attention of `graph` as one AttentionNode (in place of its output
    product); the nodes it absorbs leave the graph. `hints`: the example value of each size."""
    readers: dict[str, set[str]] = {}
    for n in graph.nodes:
        names = {r.name for r in ir.reads(n.body)} if isinstance(n, ComputeNode) else set(n.tensor_args)
        for name in names:
            readers.setdefault(ir.resolve(graph, name), set()).add(n.name)
    needed = {ir.resolve(graph, n) for n in graph.needed_in_memory}
    for name in [n.name for n in graph.nodes if type(n) is MatmulNode]:
        if name not in graph.compute_nodes():
            continue  # absorbed by an earlier match
        attention = Match(graph, graph.node(name), readers, needed, hints).run()
        if attention is None:
            continue
        gone = {n.name for n in attention.absorbed}
        log.info("attention %s: %s as one attention kernel", name, ", ".join(sorted(gone)))
        graph.nodes[[n.name for n in graph.nodes].index(name)] = attention
        graph.nodes[:] = [n for n in graph.nodes if n.name not in gone]
        graph.views = {v: view for v, view in graph.views.items() if ir.resolve(graph, v) not in gone}
    return graph
