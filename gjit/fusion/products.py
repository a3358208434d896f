"""Products that share their left operand launch as one kernel: q, k and v of one input, a gated
MLP's gate and up projections. Each is a matmul template region of its own after fusion (a
template computes one product); this pass puts them in one region whose `parts` are those
regions. Its kernel (codegen/triton/matmul.py) walks the output tiles of the first product, then
those of the next: a program computes one tile of one product, with that product's prologue,
k loop and epilogue, so no program holds more than one accumulator and the tile sizes are the
ones each product would have had (taken for the widest). What it saves: a launch per product, and
the kernel that would store the shared operand: fusion inlines an operand that only such a group
reads into their prologue (`Fusion.shared_left_operands`), where a norm's statistics follow it
(gjit/fusion/statistics.py), once per program as before.

The pass runs on the schedule after the statistics pass (`group_products`): matmul regions (not
attention) with equal batch, M and K sizes, the same left operand expression, the same dtype
of the dot and the same prologue statistics form a group when each later one can run where the
first runs (everything it reads is stored before that step).
"""

from __future__ import annotations

import logging

from gjit import ir
from gjit.fusion.regions import Region, Step
from gjit.fusion.schedule import in_memory_before, step_reads
from gjit.fusion.symbols import data_dependent_symbols

log = logging.getLogger("gjit.fusion")

# At most this many products in one kernel: each branch's pipelined k loop keeps its own shared
# memory buffers (Triton does not share them across branches), and three of the table's largest
# 16-bit tiles fit kernels/matmul.py's SHARED_MEMORY with two k steps in flight.
MAX_PRODUCTS = 3


def sharing_key(region: Region) -> tuple | None:
    """What regions launched together agree on: (batch..., M, K), the left operand (as the
    region computes it), the dtype the dot multiplies in (one table of tiles), the statistics
    its prologue computes."""
    node = region.lone_product
    if node is None:
        return None
    lhs, rhs = region.bodies[node.name].args
    stats = id(region.row_statistics) if region.row_statistics is not None else None
    return (*node.full_size[:-2], node.full_size[-1], lhs, ir.dot_operands(lhs, rhs)[0], stats)


def combined(parts: list[Region]) -> Region:
    """One region launching `parts` (matmul regions sharing their left operand) in one kernel."""
    inlined = {n.name: n for p in parts for n in p.inlined}
    return Region(
        nodes=[n for p in parts for n in p.nodes],
        bodies={k: v for p in parts for k, v in p.bodies.items()},
        stores=[s for p in parts for s in p.stores],
        inlined=list(inlined.values()),
        reduction=parts[0].reduction,
        parts=parts,
    )


def group_products(steps: list[Step], graph: ir.LoopGraph) -> list[Step]:
    """Group the matmul regions that share their left operand (above) into one region each."""
    producers = data_dependent_symbols(graph)
    stored_before = in_memory_before(steps, graph)  # per step: what is in memory when it starts
    groups: list[list[int]] = []
    open_groups: dict[tuple, list[int]] = {}
    for i, step in enumerate(steps):
        key = sharing_key(step) if isinstance(step, Region) else None
        if key is None:
            continue
        group = open_groups.get(key)
        if (
            group is not None
            and len(group) < MAX_PRODUCTS
            and step_reads(step, graph, producers) <= stored_before[group[0]]
        ):
            group.append(i)
        else:  # the first of a group: no earlier region can take it
            open_groups[key] = [i]
            groups.append(open_groups[key])
    out: list[Step] = []
    moved = {i for members in groups for i in members[1:]}
    firsts = {members[0]: members for members in groups if len(members) > 1}
    for i, step in enumerate(steps):
        if i in moved:
            continue
        if i in firsts:
            parts = [steps[j] for j in firsts[i]]
            step = combined(parts)
            log.info(
                "launch %s as one kernel: they share their left operand",
                [p.lone_product.name for p in parts],
            )
        out.append(step)
    return out
