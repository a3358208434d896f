"""A reduction of few, long rows as two reductions: each row cut into `parts` chunks reduced side by
side (the partial results, in the accumulation dtype), then the partials reduced.

A kernel runs a program per row (or per tile of rows); a sum of everything, or a sum over the
first dim of a tall, narrow tensor, is then one or a few programs walking millions of elements on
one SM each while the rest of the card idles. Two levels give the card `TARGET_PROGRAMS` programs
for the price of one more launch (and a softmax's or a variance's levels their own kernels). Only
where that pays: rows of at least `SPLIT_FROM` elements, fewer programs than `ENOUGH_PROGRAMS`
(`ENOUGH_PROGRAMS_LEVELS` for an op of several levels), chunks of at least `LEAST_CHUNK` elements.
The example sizes decide (a dynamic row keeps its number of chunks, their length follows the row);
the result is exact for every size (a chunk's lanes past the row hold the identity). None of this
is measured on a card yet.

Sums, products, maxima and minima split (a partial of each combines as its elements do); an
argmax, or a row whose length has no example value (data-dependent), stays one.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import sympy
from torch.utils._sympy.functions import FloorDiv, ModularIndexing

from gjit import ir
from gjit.lowering.registry import TensorValue, contiguous_layout, reduction_identity

if TYPE_CHECKING:  # the walk that calls this; it imports this module
    from gjit.lowering.graph import Lowering

log = logging.getLogger("gjit.lowering")

SPLIT_FROM = 16384  # elements a row at least
# at least this many programs: no split. One program streams a row at a fraction of the card's
# bandwidth (the bytes its warps keep in flight), so a one-level reduction (a sum, a max) splits
# below about two programs a SM; a softmax's or a variance's levels, each split, cost two or three
# passes and more launches: they split only where a few programs would walk everything
ENOUGH_PROGRAMS = 256
ENOUGH_PROGRAMS_LEVELS = 16
ONE_LEVEL = {"sum", "mean", "amax", "amin", "prod", "max", "min", "any", "all", "linalg_vector_norm"}
TARGET_PROGRAMS = 1024
LEAST_CHUNK = 2048
MOST_PARTS = 1024
OUTER_ROWS = 16  # rows an outer tile spans at least (codegen/triton/tiles.py: 64 bytes of float32)
SPLITS = ("sum", "prod", "max", "min")
ALIGN = 16


def parts(rows: int, row: int, kept_innermost: bool, one_level: bool = True) -> int:
    """How many chunks a row of `row` elements is cut into, `rows` rows at the example sizes;
    `kept_innermost`: the last dim is kept (a sum over a leading dim: tiles span rows);
    `one_level`: the op is one reduction (a sum), not levels of them (a softmax)."""
    if row < SPLIT_FROM:
        return 1
    programs = max(1, rows // OUTER_ROWS) if kept_innermost else rows
    if programs >= (ENOUGH_PROGRAMS if one_level else ENOUGH_PROGRAMS_LEVELS):
        return 1
    n = 1
    while n < MOST_PARTS and programs * n < TARGET_PROGRAMS and row // (2 * n) >= LEAST_CHUNK:
        n *= 2
    return n


def maybe_split(
    ctx: Lowering,
    body_fn,
    full_size: ir.Index,
    reduced: tuple[int, ...],
    reduce_type: str,
    layout: ir.Layout,
    keepdim: bool,
    name: str,
) -> TensorValue | None:
    """The reduction as two ReduceNodes (the second named `name`, with `layout`), or None where
    one pays better."""
    if reduce_type not in SPLITS or not reduced:
        return None
    kept = [k for k in range(len(full_size)) if k not in reduced]
    row = sympy.Mul(*[sympy.sympify(full_size[k]) for k in reduced])
    rows = sympy.Mul(*[sympy.sympify(full_size[k]) for k in kept])
    try:
        kept_innermost = bool(kept) and kept[-1] == len(full_size) - 1
        n = parts(ctx.hint(rows), ctx.hint(row), kept_innermost, ctx.aten_name in ONE_LEVEL)
    except TypeError:  # a size without an example value (data-dependent)
        return None
    if n == 1:
        return None
    # chunks of a multiple of 16 elements: each starts 16-aligned, so its loads stay vectors
    chunk = FloorDiv(row + ALIGN * n - 1, ALIGN * n) * ALIGN
    space = (sympy.Integer(n), *[full_size[k] for k in kept], chunk)
    iv = ir.index_vars(len(space))
    flat = iv[0] * chunk + iv[-1]
    index: list = [None] * len(full_size)
    for j, k in enumerate(kept):
        index[k] = iv[1 + j]
    inner = sympy.Integer(1)
    for k in reversed(reduced):  # the row-major digits of the flat position in the row
        size = sympy.sympify(full_size[k])
        index[k] = FloorDiv(flat, inner) if k == reduced[0] else ModularIndexing(flat, inner, size)
        inner = inner * size
    element = body_fn(tuple(index))
    acc = element.dtype
    body = ir.Masked(acc, sympy.Lt(flat, row), element, reduction_identity(reduce_type, acc))
    partial_layout = contiguous_layout(space[:-1], acc)
    partial = ir.ReduceNode(
        f"{name}_split", partial_layout, body, ctx.node, ctx.aten_name, space, (len(space) - 1,),
        reduce_type, False,
    )  # fmt: skip
    ctx.nodes.append(partial)
    final_size = tuple(n if k == reduced[0] else 1 if k in reduced else s for k, s in enumerate(full_size))
    fv = ir.index_vars(len(final_size))
    read = TensorValue(partial.name, partial_layout.size, acc).load((fv[reduced[0]], *[fv[k] for k in kept]))
    final = ir.ReduceNode(
        name, layout, read, ctx.node, ctx.aten_name, final_size, reduced, reduce_type, keepdim
    )
    ctx.nodes.append(final)
    log.debug("%s: a %s over %s elements a row in %d chunks of %s, then over the chunks", name,
              reduce_type, row, n, chunk)  # fmt: skip
    return TensorValue(name, layout.size, layout.dtype)
