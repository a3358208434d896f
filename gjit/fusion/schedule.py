"""The schedule as the passes after fusion see it (gjit/fusion/rows.py, gjit/fusion/products.py move a region
to an earlier step): what each step reads, and what is in memory when each step starts."""

from __future__ import annotations

import sympy

from gjit import ir
from gjit.fusion.regions import Step
from gjit.fusion.symbols import extern_symbols
from gjit.ir import ExternNode, LoopGraph


def step_reads(step: Step, graph: LoopGraph, producers: dict[sympy.Symbol, str]) -> set[str]:
    """What must be in memory (or have run) before `step`: the stored values and inputs it reads,
    its prologue statistics' too, and the externs that bind the data-dependent sizes it uses
    (`producers`: data_dependent_symbols)."""
    if isinstance(step, ExternNode):
        out = {ir.resolve(graph, a) for a in step.tensor_args}
        return out | {producers[s] for s in extern_symbols(step) if s in producers} - {step.name}
    own = {n.name for n in step.fused_nodes()}
    bodies = list(step.bodies.values())
    for part in step.parts or [step]:
        if part.row_statistics is not None:
            bodies += list(part.row_statistics.bodies.values())
    out = {ir.resolve(graph, r.name) for b in bodies for r in ir.reads(b) if r.name not in own}
    used = set().union(*(ir.free_symbols(b) for b in bodies))
    for n in step.fused_nodes():
        for s in (*n.layout.size, *getattr(n, "full_size", ())):
            used |= sympy.sympify(s).free_symbols
    return out | {producers[s] for s in used if s in producers}


def in_memory_before(steps: list[Step], graph: LoopGraph) -> list[set[str]]:
    """Per step: the inputs, stored values and extern results in memory when it starts."""
    available = {name for name, b in graph.buffers.items() if b.kind == "input"}
    out = []
    for step in steps:
        out.append(set(available))
        if isinstance(step, ExternNode):
            available.add(step.name)
        else:
            available |= {ir.resolve(graph, s) for s in step.stores}
    return out
