"""Whether a mask the program builds from its sizes is the causal one: a key j kept for query i
exactly where j <= i (SDPA's `is_causal`, aligned to the top left), for every size; or keeps every
key.

A program that writes `torch.triu(torch.ones(T, T, dtype=torch.bool), 1)`, `torch.tril(torch.ones(T,
T)) == 0` or `arange(S)[None] <= arange(L)[:, None]` hands SDPA (or a fill) a tensor that is the
causal mask; export decomposes each into aranges, broadcasts, differences and comparisons, and
transformers' masks under tracing gather position ids by index tensors. Proved causal, the
attention runs ATen's causal kernel (FlashAttention where L == S) or the template's causal loop
bound, where a mask of that tensor is read from memory for every tile; proved to keep every key,
it runs without one.

The mask's value (gjit/lowering/mask_values.py: an expression over its indices) proves it causal
when, with d = j - i for the last two dims, every comparison in it is linear in d alone: the
predicate then changes only at the roots of those comparisons, and agreeing with d <= 0 at each
root, around it and past the outermost ones proves it for every integer d. It keeps every key when
each comparison in it holds over its indices' ranges (each index below its dim's size). A buffer or
constant read by the mask is a value where gjit/lowering/held_masks.py reads its contents (a band:
tril, triu), and the entry's guard then checks them. Anything else (a tensor input, a
size-dependent offset, a value mask_values.py does not hold) is no proof, and the mask stays as it
is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import sympy
import torch
from sympy.core.relational import Relational

from gjit.lowering.held_masks import Held
from gjit.lowering.mask_values import (
    Evaluator,
    Value,
    compare,
    is_predicate,
    nonnegative,
    sample_points,
    size_expr,
    truth,
    value_range,
)

log = logging.getLogger("gjit.lowering")


def _always(predicate: sympy.Basic, bounds: dict[sympy.Symbol, sympy.Basic], val: torch.Tensor) -> bool:
    """Whether `predicate` holds for every value of its symbols in [0, their bounds) (sizes), and
    of the sizes in their ranges (`val`'s shape environment), as far as the range of each
    comparison shows it (False: not shown)."""
    if predicate in (sympy.true, sympy.false):
        return bool(predicate)
    if isinstance(predicate, sympy.And):
        return all(_always(p, bounds, val) for p in predicate.args)
    if isinstance(predicate, sympy.Or):
        return any(_always(p, bounds, val) for p in predicate.args)
    if not isinstance(predicate, Relational):
        return False
    found = value_range(sympy.expand(predicate.lhs - predicate.rhs), bounds)
    if found is None:
        return False
    least, greatest = found  # of lhs - rhs
    holds = {  # (what suffices, for integers or not)
        sympy.Le: lambda: nonnegative(-greatest, val),
        sympy.Lt: lambda: nonnegative(-greatest - 1, val),
        sympy.Ge: lambda: nonnegative(least, val),
        sympy.Gt: lambda: nonnegative(least - 1, val),
        sympy.Ne: lambda: nonnegative(least - 1, val) or nonnegative(-greatest - 1, val),
        sympy.Eq: lambda: least == 0 and greatest == 0,
    }.get(type(predicate))
    return holds is not None and holds()


CAUSAL, EVERY_KEY = "causal", "to keep every key"  # what `proved` finds a mask


def is_causal(node: torch.fx.Node, keep: bool = True) -> bool:
    """Whether the boolean tensor `node` is, wherever it is `keep`, exactly the keys j <= i of its
    last two dims (rows i, keys j), for every size: SDPA's `is_causal` mask. False when unproved."""
    return _proof(node, lambda value: _causal(value, keep))


def is_causal_additive(node: torch.fx.Node) -> bool:
    """Whether the float tensor `node` is 0 where j <= i and -inf elsewhere (an additive causal mask
    SDPA takes: triu of a -inf fill, say), for every size."""
    return _proof(node, _causal_additive)


def keeps_every_key(node: torch.fx.Node, keep: bool = True) -> bool:
    """Whether the boolean tensor `node` is `keep` everywhere: no mask at all (transformers' mask
    without padding, built under tracing as `arange(L) >= 0` for an encoder, as `kv_idx <=
    past + q_idx` for one query after `past` keys in a cache)."""
    return _proof(node, lambda value: _every_key(value, keep, node.meta["val"]))


def adds_nothing(node: torch.fx.Node) -> bool:
    """Whether the float tensor `node` is 0 everywhere: an additive mask that hides no key."""
    return _proof(node, _zeros)


def proved(mask: torch.fx.Node, keep: bool = True, evaluator: Evaluator | None = None) -> str | None:
    """What `mask` is proved: CAUSAL, EVERY_KEY or None; a boolean one where it is `keep`, or an
    additive one (SDPA's two kinds). Its value is evaluated once for both."""
    if mask.meta["val"].dtype == torch.bool:
        every, causal = (lambda v: _every_key(v, keep, mask.meta["val"])), (lambda v: _causal(v, keep))
    else:
        every, causal = _zeros, _causal_additive
    found = _proof(mask, lambda v: EVERY_KEY if every(v) else CAUSAL if causal(v) else None, evaluator)
    return found or None


class Proofs:
    """`proved` per (mask, keep), each once (a model's layers share one mask), reading the contents
    of the buffers and constants `held` gives (gjit/lowering/held_masks.py; None: none). What the
    proofs since the last `commit` or `discard` read goes to `held` (for the entry's guard) on a
    `commit`: the caller's, once a rewrite used them."""

    def __init__(self, held: Held | None = None):
        self.held = held
        self.memo: dict[tuple[torch.fx.Node, bool], tuple[str | None, set]] = {}
        self.pending: set[torch.fx.Node] = set()

    def __call__(self, mask: torch.fx.Node, keep: bool = True) -> str | None:
        if (mask, keep) not in self.memo:
            evaluator = Evaluator(self.held.value if self.held is not None else None)
            found = proved(mask, keep, evaluator)
            self.memo[mask, keep] = found, evaluator.read if found is not None else set()
        found, read = self.memo[mask, keep]
        self.pending |= read
        return found

    def commit(self) -> None:
        if self.held is not None:
            self.held.read_by_proof(self.pending)
        self.pending = set()

    def discard(self) -> None:
        self.pending = set()


def _proof(
    node: torch.fx.Node, check: Callable[[Value], object], evaluator: Evaluator | None = None
) -> object:
    """`check` of `node`'s value; False where it has none, or sympy raises on the way."""
    try:
        value = (evaluator or Evaluator())(node)
        return value is not None and check(value)
    except Exception as e:  # sympy on an expression it cannot take apart: unproved
        log.debug("mask %s: not proved (%s: %s)", node.name, type(e).__name__, e)
        return False


def _causal_additive(value: Value) -> bool:
    if is_predicate(value.expr):
        return False
    zero = Value(compare(sympy.Eq, value.expr, sympy.Integer(0)), value.dims)
    hidden = Value(compare(sympy.Eq, value.expr, -sympy.oo), value.dims)
    return _causal(zero, True) and _causal(hidden, False)


def _every_key(value: Value, keep: bool, val: torch.Tensor) -> bool:
    bounds = {s: size_expr(n) for s, n in zip(value.dims, val.shape) if s is not None}
    expr = value.expr if keep else sympy.Not(value.expr)
    return is_predicate(value.expr) and _always(expr, bounds, val)


def _zeros(value: Value) -> bool:
    return not is_predicate(value.expr) and value.expr.is_zero is True


def _causal(value: Value, keep: bool) -> bool:
    if len(value.dims) < 2 or any(s is not None for s in value.dims[:-2]):
        return False  # it varies over batch or heads
    rows, keys = value.dims[-2:]
    if rows is None or keys is None or not is_predicate(value.expr):
        return False  # the same for every row or every key
    d = sympy.Dummy("d", integer=True)
    predicate = value.expr.xreplace({keys: rows + d})
    if not keep:
        predicate = sympy.Not(predicate)
    points = sample_points(predicate, d)  # (d over every integer: it depends on neither index alone)
    return points is not None and all(truth(predicate, d, p) is (p <= 0) for p in points)
