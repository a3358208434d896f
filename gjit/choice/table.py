"""The choice where nothing is measured (tuning off, not on a GPU, gjit.aot for a card that is not
there): the library, but where kernels/template_wins.py's table, measured on such a card, has
the very region."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import sympy
import torch

from gjit.choice.regions import PRODUCT_OPS, hint, product_names, table_key, template_regions
from gjit.fusion.regions import Step
from gjit.ir import LoopGraph
from gjit.kernels import template_wins
from gjit.lowering.templates import RegionChoice, TemplateChoice
from gjit.tuning import log


def may_match(node: torch.fx.Node, candidates: set, hints: dict[sympy.Symbol, int]) -> bool:
    """Whether a product node could be part of a region the table has: its operands' dtype is an
    entry's, and each of their dims one of the entry's sizes."""
    tensors = [a.meta.get("val") for a in node.all_input_nodes]
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    if not tensors or not candidates:
        return False
    dims = {hint(d, hints) for t in tensors for d in t.shape}
    return any(dtype == tensors[0].dtype and dims <= {*sizes, 1} for dtype, sizes in candidates)


def unmeasured(schedule: Callable[[TemplateChoice], tuple[LoopGraph, list[Step]]], gm: torch.fx.GraphModule,
               hints: dict[sympy.Symbol, int], capability: int | None, tf32: bool | None,
               why: str) -> tuple[LoopGraph, list[Step], TemplateChoice]:  # fmt: skip
    """The schedule with each product in ATen but the regions kernels/template_wins.py's table
    has for a card of `capability` (`why`: why nothing is measured)."""
    default = f"the library: nothing measured ({why})"
    if capability is not None:
        default += f", and kernels/template_wins.py has no such region for sm_{capability}"
    candidates = template_wins.candidate_sizes(capability)
    allowed = {
        n.name
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target in PRODUCT_OPS and may_match(n, candidates, hints)
    }
    while True:
        chosen = []
        templates = TemplateChoice(frozenset(allowed), default)
        loop_graph, steps = schedule(templates)
        dropped: set[str] = set()
        for region in template_regions(steps):
            names = product_names(region)
            win = template_wins.lookup(capability, *table_key(region, hints, tf32))
            if win is None:
                dropped |= set(names)
                continue
            region.config = win.config
            detail = f"{win.provenance()}; tiles {win.tiles}"
            figures = (win.template_ms, win.aten_ms, detail, win.config)
            chosen.append(RegionChoice(names, True, "table", *figures))
        if not dropped:
            for c in chosen:
                log.info("%s: %s", ", ".join(c.nodes), c.text())
            library = [n.name for n in gm.graph.nodes if n.target in PRODUCT_OPS and n.name not in allowed]
            if library:
                log.info("%s: ATen (%s)", ", ".join(library), default)
            return loop_graph, steps, dataclasses.replace(templates, regions=tuple(chosen))
        allowed -= dropped
