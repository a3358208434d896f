"""A norm after a linear in the linear's epilogue: when one tile of the product covers a whole
output row (N up to ROW_TILE), the row's sums are a `tl.sum` over the tile in registers, so a
post-norm (BERT's and nn.TransformerEncoderLayer's LayerNorm of the projection plus the residual)
needs no kernel of its own and the un-normed sum is never stored.

The pass runs on the schedule after the statistics pass (`fold_rows`): a reduction region whose
members are sums over its last dim, per-row pointwise nodes and pointwise nodes over its space
(`row_region`) moves into the matmul template region it reads when it reads that region's values
only element for element on the output tile (`row_placement`: its last dim is the product's N, its
other dims a reshape of the rows), N is at most ROW_TILE (1024, or 512 for float32 products; a
dynamic N is guarded to the tile codegen picks for it: a wider one recompiles), and everything
else it reads is in memory before the template runs. The template region keeps it as `row_epilogue`;
codegen (codegen/triton/matmul.py) takes BLOCK_N >= N (kernels/matmul.py `row_blocks`) and prints
its members after the product's own stores.
"""

from __future__ import annotations

import logging
import types

import sympy
import torch

from gjit import ir
from gjit.fusion.regions import Region, Step
from gjit.fusion.schedule import in_memory_before, step_reads
from gjit.fusion.symbols import data_dependent_symbols
from gjit.ir import ReduceNode

log = logging.getLogger("gjit.fusion")

# the widest output row one tile covers (kernels/matmul.py row_blocks): 16 rows of 1024 16-bit
# products, or of 512 float32 ones (IEEE dots on the FMA units: operands and the accumulator in
# registers), build for sm_90 without spills
ROW_TILE = {True: 1024, False: 512}  # by: are the dot's operands 16-bit?


def row_region(region: Region) -> bool:
    """A region of sums over its last dim, per-row pointwise nodes and pointwise nodes over its
    whole space (a layer or RMS norm, with its normalized output)."""
    space = region.reduction
    if (
        space is None
        or region.matmul
        or region.scan
        or region.scatter
        or space.reduced != (len(space.full) - 1,)
    ):
        return False
    kept = tuple(space.full[:-1])
    for node in region.nodes:
        if isinstance(node, ReduceNode):
            if type(node) is not ReduceNode or node.reduce_type != "sum":
                return False
            if not region.bodies[node.name].dtype.is_floating_point:
                return False
        elif tuple(node.size) not in (kept, (*kept, 1), tuple(space.full)):
            return False
    return True


def node_placement(rows: Region, node: ir.ComputeNode, mapping: dict) -> dict:
    """`node`'s index variables in the template's, from the row region's full-space `mapping`."""
    full = rows.reduction.full
    iv = ir.index_vars(len(full))
    if isinstance(node, ReduceNode) or tuple(node.size) == tuple(full):
        return mapping
    if len(node.size) == len(full):  # per row, keepdim: its last index is 0
        return {**{v: mapping[v] for v in iv[:-1]}, iv[-1]: sympy.Integer(0)}
    return {v: mapping[v] for v in iv[:-1]}


def value_index(rows: Region, node: ir.ComputeNode, mapping: dict) -> ir.Index:
    """Where `node`'s value for the tile's element lives, in the template's variables: a sum's and
    a per-row node's at its row (0 in a kept last dim), a full-row node's at the element."""
    full = rows.reduction.full
    iv = ir.index_vars(len(full))
    row = [mapping[v] for v in iv[:-1]]
    if not isinstance(node, ReduceNode) and tuple(node.size) == tuple(full):
        return tuple(mapping[v] for v in iv)
    return (*row, sympy.Integer(0)) if len(node.size) == len(full) else tuple(row)


def row_placement(template: Region, rows: Region) -> dict | None:
    """The row region's full-space index variables in the template's tile variables, or None when
    it does not read the template's values only on their own element of the output tile."""
    space = template.reduction
    own = {n.name for n in rows.nodes}  # (the template may hold them already: codegen asks too)
    members = {n.name: n for n in template.nodes if n.name not in own}
    for node in members.values():  # the template's members over reshapes of its output, placed
        space.placement(node, template.bodies[node.name])
    full = rows.reduction.full
    iv = ir.index_vars(len(full))
    out_dims = [k for k in range(len(space.full)) if k not in space.reduced]
    if tuple(full) == tuple(space.full[k] for k in out_dims):
        mapping = {v: space.vars[k] for v, k in zip(iv, out_dims)}
    else:
        reduce = next(n for n in rows.nodes if isinstance(n, ReduceNode))
        mapping = space.reshape_placement(types.SimpleNamespace(size=tuple(full)), rows.bodies[reduce.name])
    n_var, k_var = space.vars[-2], space.vars[-1]
    if mapping is None or mapping.get(iv[-1]) != n_var:
        return None
    if any({n_var, k_var} & sympy.sympify(mapping[v]).free_symbols for v in iv[:-1]):
        return None
    for node in rows.nodes:
        placed = node_placement(rows, node, mapping)
        per_row = not isinstance(node, ReduceNode) and tuple(node.size) != tuple(full)
        for r in ir.reads(rows.bodies[node.name]):
            if r.name not in members:
                continue
            at = tuple(sympy.sympify(i).xreplace(placed) for i in r.index)
            if per_row or r.indirect or at != space.value_index(members[r.name]):
                return None
    return mapping


def fits(template: Region, rows: Region, hints: dict[sympy.Symbol, int]) -> bool:
    """One tile covers the row: the product's N is the row's and at most ROW_TILE (a dynamic N
    at this call's size; codegen guards it to its tile, a wider one recompiles)."""
    n = sympy.sympify(template.reduction.full[-2])
    value = ir.at_values(n, hints)
    node = template.lone_product
    wide = ir.dot_operands(*template.bodies[node.name].args)[0] != torch.float32
    if not value.is_Integer or not 0 < int(value) <= ROW_TILE[wide]:
        return False
    return ir.statically_known_equal(n, rows.reduction.full[-1])


def fold_rows(steps: list[Step], graph: ir.LoopGraph, hints: dict[sympy.Symbol, int]) -> list[Step]:
    """Move each qualifying row region into the epilogue of the matmul template it reads (above)."""
    needed = {ir.resolve(graph, n) for n in graph.needed_in_memory}
    producers = data_dependent_symbols(graph)
    stored_before = in_memory_before(steps, graph)
    reads = [step_reads(step, graph, producers) for step in steps]
    current: dict[int, Region] = {}  # a template's index -> the template with its row epilogue
    folded: set[int] = set()
    for j, rows in enumerate(steps):
        if not isinstance(rows, Region) or not row_region(rows):
            continue
        producers = [
            i
            for i in range(j)
            if isinstance(steps[i], Region) and {ir.resolve(graph, s) for s in steps[i].stores} & reads[j]
        ]
        if not producers or producers[-1] in current:  # the last kernel it reads: a template?
            continue
        i = producers[-1]
        template = steps[i]
        if template.lone_product is None or not fits(template, rows, hints):
            continue
        members = {n.name for n in template.nodes}
        if not reads[j] - members <= stored_before[i] or row_placement(template, rows) is None:
            continue
        # what only the row region read of the template is no longer stored
        elsewhere = set().union(*(reads[k] for k in range(len(steps)) if k not in (i, j)))
        kept = [s for s in template.stores if ir.resolve(graph, s) in needed | elsewhere]
        current[i] = Region(
            nodes=template.nodes + rows.nodes,
            bodies={**template.bodies, **rows.bodies},
            stores=kept + rows.stores,
            inlined=template.inlined + [n for n in rows.inlined if n not in template.inlined],
            reduction=template.reduction,
            row_statistics=template.row_statistics,
            row_epilogue=rows,
        )
        folded.add(j)
        log.info(
            "compute %s in the epilogue of %s: one tile covers its rows",
            [n.name for n in rows.nodes],
            template.lone_product.name,
        )
    return [current.get(k, step) for k, step in enumerate(steps) if k not in folded]
