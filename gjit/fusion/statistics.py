"""Row statistics in a matmul's prologue: a norm before a linear (layer_norm, rms_norm) is a small
reduction kernel (each row's sums, then its mean and rstd) and the linear's template, which
applies the norm to each operand tile it loads. When nothing but matmul prologues reads those
statistics, each matmul computes them itself: a loop over each row's elements per reduction
level before its k loop (the sum, then the sum of squared deviations from the mean), the
per-row values in registers, and the statistics kernel is gone. What it costs: every program of
the matmul reads its rows once more per level (from L2 on a GPU: the k loop reads them too).

The pass runs on the schedule fusion made (`absorb_row_statistics`): a statistics region
qualifies when its members are sums over the last dim and pointwise nodes per row, and each of
its stored values is read only by the left operands of matmul templates, per row (the index of
the read names the operand tile's row, never its k). Such a region moves into each of them as
`Region.row_statistics`.
"""

from __future__ import annotations

import logging

import sympy

from gjit import ir
from gjit.fusion.regions import Region, Step
from gjit.ir import ExternNode, MatmulNode, Op, ReduceNode

log = logging.getLogger("gjit.fusion")


def row_index(node: ir.ComputeNode, index: ir.Index, reduced: int) -> tuple | None:
    """The kept components of a read of a statistics member at `index` (its reduced position 0
    where the member keeps the dim), or None when it is not a per-row read."""
    if isinstance(node, ReduceNode):
        keep = node.keepdim
    else:
        keep = len(node.size) > reduced
    if not keep:
        return tuple(index)
    if sympy.sympify(index[reduced]) != 0:
        return None
    return tuple(i for k, i in enumerate(index) if k != reduced)


def statistics_region(region: Region) -> int | None:
    """The reduced dim of a region of per-row sums and per-row pointwise nodes, else None."""
    space = region.reduction
    if space is None or region.matmul or region.scan or region.scatter or len(space.reduced) != 1:
        return None
    (reduced,) = space.reduced
    if reduced != len(space.full) - 1:
        return None
    kept = tuple(s for k, s in enumerate(space.full) if k != reduced)
    for node in region.nodes:
        if isinstance(node, ReduceNode):
            if type(node) is not ReduceNode or node.reduce_type != "sum":
                return None
            if not region.bodies[node.name].dtype.is_floating_point:
                return None  # an integer count: its own kernel
        elif tuple(node.size) not in (kept, (*kept, 1)):
            return None  # a member over the full space: its values are stored for others
    return reduced


def statistics_row(consumer: Region, stats: Region) -> tuple | None:
    """The row at which the left operand of matmul region `consumer` reads the values of `stats`
    (the kept components of each read, in the product's index variables), or None when it does
    not read them only there: the right operand or the epilogue reads them, a read depends on k,
    reads name different rows, a row is gathered (indirect) or under a mask (cat, pad: the row
    may be past the ends where the mask is off)."""
    (reduced,) = stats.reduction.reduced
    members = {n.name: n for n in stats.nodes}
    node = next(n for n in consumer.nodes if isinstance(n, MatmulNode))
    body = consumer.bodies[node.name]
    assert isinstance(body, Op) and body.name == "mul"
    lhs, rhs = body.args
    others = {r.name for name, b in consumer.bodies.items() if name != node.name for r in ir.reads(b)}
    others |= {r.name for r in ir.reads(rhs)}
    masked = {r.name for e in ir.walk(lhs) if isinstance(e, ir.Masked) for r in ir.reads(e.body)}
    reads = [r for r in ir.reads(lhs) if r.name in members]
    if set(stats.stores) & others or masked & set(members) or any(r.indirect for r in reads):
        return None
    rows = {row_index(members[r.name], r.index, reduced) for r in reads}
    row = next(iter(rows)) if len(rows) == 1 else None
    k_var = ir.index_vars(len(node.full_size))[-1]  # the product's k, as its body names it
    if row is None or any(k_var in sympy.sympify(i).free_symbols for i in row):
        return None
    return row


def absorb_row_statistics(steps: list[Step], graph: ir.LoopGraph) -> list[Step]:
    """Move each qualifying statistics region into the matmul templates that read it (above)."""
    needed = {ir.resolve(graph, n) for n in graph.needed_in_memory}
    readers: dict[str, list[Step]] = {}
    for step in steps:
        names = (
            {ir.resolve(graph, a) for a in step.tensor_args}
            if isinstance(step, ExternNode)
            else {r.name for b in step.bodies.values() for r in ir.reads(b)}
        )
        for name in names:
            readers.setdefault(name, []).append(step)
    out = list(steps)
    for stats in steps:
        if not isinstance(stats, Region):
            continue
        reduced = statistics_region(stats)
        if reduced is None or set(stats.stores) & needed:
            continue
        consumers = {id(s): s for name in stats.stores for s in readers.get(name, []) if s is not stats}
        ok = bool(consumers) and all(
            isinstance(c, Region)
            and c.matmul
            and not c.attention
            and c.row_statistics is None  # one statistics region per matmul
            and statistics_row(c, stats) is not None
            for c in consumers.values()
        )
        if not ok:
            continue
        for consumer in consumers.values():
            consumer.row_statistics = stats
        out.remove(stats)
        log.info(
            "compute %s in the prologue of %s: only their left operands read it per row",
            [n.name for n in stats.nodes],
            [c.name or [n.name for n in c.nodes] for c in consumers.values()],
        )
    return out
