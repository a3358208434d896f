"""The choice where nothing is measured (tuning off, not on a GPU, gjit.aot for a card that is not
there): the library, but where kernels/template_wins.py's table, measured on such a card, has
the very region."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import sympy
import torch

from gjit.choice.regions import PRODUCT_OPS, hint, product_names, table_key, template_regions
from gjit.fusion.regions import Region, Step
from gjit.ir import AttentionNode, LoopGraph
from gjit.kernels import template_wins
from gjit.lowering.attention_library import STANDS_FOR
from gjit.lowering.templates import RegionChoice, TemplateChoice
from gjit.tuning import log

aten = torch.ops.aten


def may_match(node: torch.fx.Node, candidates: set, hints: dict[sympy.Symbol, int]) -> bool:
    """Whether a product node could be part of a region the table has: its operands' dtype is an
    entry's, and each of their dims one of the entry's sizes."""
    tensors = [a.meta.get("val") for a in node.all_input_nodes]
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    if not tensors or not candidates:
        return False
    dims = {hint(d, hints) for t in tensors for d in t.shape}
    return any(dtype == tensors[0].dtype and dims <= {*sizes, 1} for dtype, sizes in candidates)


# a written-out attention's products, and what its softmax decomposes to: a graph without
# such a softmax is scheduled once for mode "default" (its templates are the table's)
SCORE_PRODUCTS = (aten.bmm.default, aten.baddbmm.default, aten.mm.default)
SOFTMAX_OPS = (aten._softmax.default, aten._safe_softmax.default, aten.amax.default)


def worth_measuring(region: Region) -> bool:
    """Whether mode "default" builds a region's template to weigh it against the library: where it
    fuses a written-out attention (softmax(Q @ K^T) @ V as separate ops). The library side there
    writes and reads the score matrix, L x S per head, where the template keeps it on chip (the
    H200: bert's written-out attention 0.026 ms as a template, 0.102 ms as ATen's products and a
    softmax kernel, eager 0.043). A product with a prologue or an epilogue, or an SDPA call, saves
    at most its operands' bytes: over the six workloads of bench/models_gpu.py on the H200 the
    library won 65 of the 66 choices measured, and the stage that built and timed the templates
    was 37-59% of each cold compile (docs/bench.md). mode="max-autotune" measures every template.
    On a GPU most written-out attention is an SDPA call by now (`stands_for_written_out`): weighed
    the same, against ATen's fused kernel."""
    return any(
        isinstance(n, AttentionNode) and (n.absorbed or stands_for_written_out(n.fx_node))
        for n in region.nodes
    )


def stands_for_written_out(node: torch.fx.Node) -> bool:
    """An SDPA call that stands for a written-out attention (gjit/lowering/attention_library.py):
    weighed as the written-out form was, its library side now ATen's fused kernel."""
    return bool(node.meta.get(STANDS_FOR))


def unmeasured(schedule: Callable[[TemplateChoice], tuple[LoopGraph, list[Step]]], gm: torch.fx.GraphModule,
               hints: dict[sympy.Symbol, int], capability: int | None, tf32: bool | None,
               why: str, measure: bool = False) -> tuple[LoopGraph, list[Step], TemplateChoice]:  # fmt: skip
    """The schedule with each product in ATen but the regions kernels/template_wins.py's table
    has for a card of `capability` (`why`: why nothing is measured). With `measure`, the templates
    `worth_measuring` are kept too, for gjit/choice/measure.py to weigh against the library (the
    table's regions with them); `why` then says why the rest are not."""
    default = f"the library: {why}" if measure else f"the library: nothing measured ({why})"
    if capability is not None:
        default += f", and kernels/template_wins.py has no such region for sm_{capability}"
    candidates = template_wins.candidate_sizes(capability)
    products = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in PRODUCT_OPS]
    softmax = measure and any(n.target in SOFTMAX_OPS for n in gm.graph.nodes)
    scores = {n.name for n in products if softmax and n.target in SCORE_PRODUCTS}
    scores |= {n.name for n in products if measure and stands_for_written_out(n)}
    allowed = scores | {n.name for n in products if may_match(n, candidates, hints)}
    while True:
        chosen = []
        templates = TemplateChoice(frozenset(allowed), default)
        loop_graph, steps = schedule(templates)
        dropped: set[str] = set()
        for region in template_regions(steps):
            names = product_names(region)
            win = template_wins.lookup(capability, *table_key(region, hints, tf32))
            if win is None and measure and worth_measuring(region):
                continue  # a template to measure: the choice is measure.py's
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
