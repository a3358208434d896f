"""Which sums a looped reduction kernel folds into the pass before theirs (both backends).

A looped kernel reads the row once per level of reductions. Two common second levels need
only a per-row value of the first level in a form that can be carried along instead:

  softmax: sum(exp(a - max(a))). Each lane keeps a running max and the sum of exp(a - that
      max), rescaling the sum when its max grows (online softmax); at the end every lane's sum
      is rescaled to the row's max.
  variance: sum((a - mu)**2) for mu = sum(a) / n, the row's mean. Each lane keeps Welford's
      mean and M2 (of its values minus its first one, halved so that no difference
      overflows) and knows its count; sum over lanes of M2 + count * (mean - mu)**2 is the
      row's sum, so mu is only needed after the pass.

Either way the row is read once less (softmax and layer_norm: two passes instead of three).
The match is on the region's IR, so a softmax or variance written out by hand folds too.
"""

from __future__ import annotations

import dataclasses

import sympy

from gjit import ir
from gjit.ir import Expr, IndexValue, Op, Read, ReduceNode, statically_known_equal


@dataclasses.dataclass(frozen=True)
class Online:
    kind: str  # "softmax" | "welford"
    shift: Expr  # the per-row value subtracted: a read of the max node (softmax), or mu (welford)
    value: Expr  # `a`, the row's element, in the region's space


def resolved(writer, e: Expr, per_row_too: bool = False) -> Expr:
    """`e` with reads of full-row members (and with `per_row_too`, of per-row members that are
    not reductions) replaced by their bodies, so that a chain of members (a softmax written as
    amax, sub, exp, sum) matches like one body."""

    def on_read(r: Read) -> Expr:
        if not writer.in_registers(r) or isinstance(writer.nodes[r.name], ReduceNode):
            return r
        if writer.is_full(r.name) or per_row_too:
            return resolved(writer, writer.bodies[r.name], per_row_too)
        return r

    return ir.substitute(e, on_read, lambda i: i)


def is_row_mean(writer, shift: Expr, value: Expr) -> bool:
    """Is `shift` sum(value) / (the row's length), the mean of the same row? Welford's values
    are relative to each lane's own first element, so an infinite element is NaN there: right
    only when the shift is the mean (then eager's x - mean is NaN too)."""
    shift = resolved(writer, shift, per_row_too=True)
    if not (isinstance(shift, Op) and shift.name == "truediv" and isinstance(shift.args[0], Read)):
        return False
    total, n = shift.args
    node = writer.nodes.get(total.name)
    if not (isinstance(node, ReduceNode) and node.reduce_type == "sum" and writer.in_registers(total)):
        return False
    if node.dtype != shift.dtype or resolved(writer, writer.bodies[total.name]) != value:
        return False
    if isinstance(n, Op) and n.name == "to_dtype":
        n = n.args[0]
    row = sympy.Mul(*[writer.space.full[k] for k in writer.space.reduced])
    return isinstance(n, IndexValue) and statically_known_equal(n.expr, row)


def expr_level(writer, e: Expr) -> int:
    """The first pass after which `e` can be computed (0: any time)."""
    return max((writer.level[r.name] for r in ir.reads(e) if r.name in writer.bodies), default=0)


def per_row(writer, e: Expr) -> bool:
    """Is `e` one value per row (no reduced index in it, no full-row member read)?"""
    if ir.free_symbols(e) & writer.rvars:
        return False
    return not any(writer.in_registers(r) and writer.is_full(r.name) for r in ir.reads(e))


def match(writer, node: ReduceNode) -> Online | None:
    """How sum `node` folds into the pass before its own, or None if it does not."""
    body = writer.bodies[node.name]
    if node.reduce_type != "sum" or not body.dtype.is_floating_point:
        return None
    body = resolved(writer, body)
    if not isinstance(body, Op):
        return None
    if body.name == "exp":
        kind, diff = "softmax", body.args[0]
    elif body.name == "mul" and body.args[0] == body.args[1]:
        kind, diff = "welford", body.args[0]
    else:
        return None
    if not (isinstance(diff, Op) and diff.name == "sub" and diff.args[0].dtype == diff.args[1].dtype):
        return None
    value, shift = diff.args
    if not per_row(writer, shift):
        return None
    if kind == "softmax":
        # the shift must be the row's max of the same values: the final rescale is to it
        if not (isinstance(shift, Read) and writer.in_registers(shift)):
            return None
        peak = writer.nodes[shift.name]
        if not (isinstance(peak, ReduceNode) and peak.reduce_type == "max" and peak.dtype == shift.dtype):
            return None
        if resolved(writer, writer.bodies[shift.name]) != value:
            return None
    elif not is_row_mean(writer, shift, value):
        return None
    if max(expr_level(writer, value) + 1, expr_level(writer, shift)) >= writer.level[node.name]:
        return None
    return Online(kind, shift, value)


def fold(writer) -> dict[str, Online]:
    """Find the foldable sums of `writer`'s region and move each to its earlier level."""
    found: dict[str, Online] = {}
    for node in writer.region.nodes:  # in order: a member's level follows from earlier ones'
        if node.name not in writer.bodies:
            continue
        writer.level[node.name] = writer.node_level(node.name)
        if isinstance(node, ReduceNode) and (online := match(writer, node)):
            found[node.name] = online
            level = max(expr_level(writer, online.value) + 1, expr_level(writer, online.shift))
            # online softmax rescales with its max's running value: both in the same loop
            assert online.kind != "softmax" or writer.level[online.shift.name] == level, node.name
            writer.level[node.name] = level
    return found
