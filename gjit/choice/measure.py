"""The measured choice (gjit/choice/__init__.py): each template kernel timed in its
configurations within the tuning budget, or its record taken, weighed against the library's
side, the program compiled with the choice, regions that fuse otherwise beside the library
measured again."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable

import sympy
import torch

from gjit import progress, stats, tuning
from gjit.choice import row_kernels
from gjit.choice.library import Call, LibrarySide
from gjit.choice.regions import (
    claims_of,
    modeled_ms,
    operand_dtype,
    product_names,
    signature,
    table_key,
    template_regions,
)
from gjit.codegen.common import KernelSource
from gjit.fusion.regions import Region, Step
from gjit.ir import LoopGraph
from gjit.kernels import template_wins
from gjit.lowering.templates import EVERY_TEMPLATE, RegionChoice, TemplateChoice
from gjit.runtime import tuning_store
from gjit.runtime.graph import ROW_KERNEL, CompiledGraph

log = tuning.log  # GJIT_LOGS=tuning

MAX_ROUNDS = 3
EVERY_EXTERN = TemplateChoice(frozenset(), "every product an ATen extern: the library's side of the choice")


@dataclasses.dataclass
class Builder:
    """How the driver compiles its graph again, under another choice (it is not imported here)."""

    schedule: Callable[[TemplateChoice], tuple[LoopGraph, list[Step]]]  # lower ... products
    build: Callable[[LoopGraph, list[Step], TemplateChoice], CompiledGraph]  # codegen, wrapper, write
    emit: Callable[[LoopGraph, list[Step], Region, int], KernelSource]  # one region in a configuration
    hints: dict[sympy.Symbol, int]
    tf32: bool | None
    budget: tuning.Budget = dataclasses.field(default_factory=lambda: tuning.Budget(math.inf, 0.0))
    capability: int | None = None  # the card, for kernels/template_wins.py past the budget


@dataclasses.dataclass
class Decision:
    """The choice for the template regions that launch one kernel at these sizes (the layers of a
    model), measured on the first of them."""

    regions: list[Region]
    key: str  # tuning.same_kernel_key of their kernel (a region's own name when it never ran)
    modeled_ms: float
    config: int = 0
    template_ms: float | None = None
    line: str = ""  # the tile configurations' figures
    kernel: KernelSource | None = None
    launch: tuning.Launch | None = None  # kept while configurations are left to try
    explored: tuning.Explored | None = None
    record: str = ""  # its key in gjit/runtime/tuning_store.py ("": not kept)
    found: tuning_store.Tuned | None = None  # what an earlier compile measured
    over_budget: bool = False  # not measured: the tuning budget was spent
    library: tuple[float, str] | None = None  # the library's ms and pieces, once weighed

    def settle(self) -> None:
        if self.explored is not None:
            explored = self.explored
            self.config, self.template_ms, self.line = explored.config, explored.ms, explored.line
            if self.found is not None:
                self.line += " (an earlier compile's measurements)"


@dataclasses.dataclass
class Chosen:
    loop_graph: LoopGraph
    steps: list[Step]
    graph: CompiledGraph


def template_decisions(program: tuple[LoopGraph, list[Step], CompiledGraph], regions: list[Region],
                       builder: Builder, call: Call, first: bool) -> list[Decision]:  # fmt: skip
    """`regions` of the program grouped by kernel, in order of modeled time, each group's kernel
    timed in the configuration it was emitted in (or its record taken); `first`: the program's
    first run, whose kernels the user's call builds either way, is not tuning's time."""
    loop_graph, steps, graph = program
    budget = builder.budget
    if not first and not budget.left():  # a later round past the budget: the table's, without a run
        keys, launches = {}, {}
    else:
        with budget.not_tuning() if first else contextlib.nullcontext():
            names = {r.name for r in regions}
            keys, launches = tuning.record(graph, names, call.inputs, call.sizes, call.values)
    by_name = {k.name: k for k in graph.kernels}
    emit = functools.partial(builder.emit, loop_graph, steps)
    groups: dict[str, Decision] = {}
    for region in regions:
        key = keys.get(region.name, region.name)  # never launched: a decision of its own
        if key in groups:
            groups[key].regions.append(region)
        else:
            estimate = modeled_ms(region, by_name[region.name], builder.hints, builder.tf32)
            groups[key] = Decision([region], key, estimate, kernel=by_name[region.name])
    decisions = sorted(groups.values(), key=lambda d: -d.modeled_ms)
    # heaviest first: what a budget leaves unmeasured takes kernels/template_wins.py's choice
    for done, d in enumerate(decisions):
        progress.tuning(done, len(decisions))
        first_region = d.regions[0]
        launch = launches.pop(d.key, None)  # measured once: its tensors go when it has been
        if launch is None and not keys:
            d.over_budget = True
            d.line = f"{first_region.name}: not measured: over the tuning budget"
            continue
        if launch is None:
            d.line = f"{first_region.name}: not launched at these sizes, or it writes what it reads"
            d.line += ": not measured"
            continue
        code, sizes = tuning.same_kernel_parts(d.kernel, launch.sizes)
        d.record = tuning_store.record_key(code, sizes, tuning.device_name(launch))
        d.found = tuning_store.lookup(d.record)
        if d.found is not None and d.found.configs != d.kernel.configs:  # another configuration table
            d.found = None
        if d.found is not None and d.found.config != 0:
            differs = tuning.computes_the_same(first_region, d.kernel, launch, emit, d.found.config)
            if differs:  # at these sizes (another of its bucket's, say) the record does not hold
                log.info("%s: configuration %d of an earlier compile's record %s here: measured again",
                         d.kernel.name, d.found.config, differs)  # fmt: skip
                d.found = None
        if d.found is not None:
            stats.count("tuning_records_reused")
            d.explored = tuning.Explored(d.found.config, d.found.template_ms, d.found.tried, d.found.line)
        elif not budget.left():
            d.over_budget = True
            d.line = f"{first_region.name}: not measured: over the tuning budget"
            continue
        else:
            ms, line = tuning.first_time(d.kernel, launch, label(first_region))
            if ms is None:
                d.line = line
                continue
            d.explored = tuning.Explored(0, ms, 1, line)
        if d.explored.tried < d.kernel.configs and d.explored.ms >= tuning.MIN_KERNEL_MS:
            if budget.left():
                d.launch = launch  # else its tensors go now, before the library's program runs
            else:
                d.explored.line += ", the rest not tried: over the tuning budget"
        d.settle()
        if d.found is not None:
            log.info("%s", d.line)
    progress.tuning(len(decisions), len(decisions))
    return decisions


def needs_library(d: Decision, tf32: bool | None) -> bool:
    """Whether a decision is weighed against a library time it has no record of."""
    if d.template_ms is None or (d.found is not None and d.found.compared):
        return False
    ieee = operand_dtype(d.regions[0]) == torch.float32 and not tf32
    return ieee or d.template_ms >= tuning.MIN_KERNEL_MS  # else "too short to matter" (decide)


def label(region: Region) -> str:
    return f"template {','.join(product_names(region))} {region.name}"


def explore_configurations(decisions: list[Decision], emit: Callable, budget: tuning.Budget) -> None:
    """Each decision's configurations not yet tried, heaviest first, while the budget lasts."""
    for d in decisions:
        if d.launch is not None and d.explored is not None:
            first, kept = d.regions[0], (d.kernel, d.launch, emit, label(d.regions[0]), d.explored)
            d.explored = tuning.explore(first, *kept, more=budget.left)
            d.launch = None
            d.settle()
            log.info("%s", d.line)


def decide(d: Decision, side: LibrarySide | None, claims: collections.Counter, builder: Builder
           ) -> RegionChoice:  # fmt: skip
    """One decision's choice, from the template's time and the library side's (or an earlier
    compile's record of both); past the budget, kernels/template_wins.py's."""
    first = d.regions[0]
    names = product_names(first)
    ieee = operand_dtype(first) == torch.float32 and not builder.tf32  # the template on the FMA units
    if d.template_ms is None:
        if d.over_budget:
            return table_choice(d, builder, "not measured: over the tuning budget")
        return RegionChoice(names, False, "not measured: the template did not run on the example")
    if d.template_ms < tuning.MIN_KERNEL_MS and not ieee:
        return RegionChoice(names, True, "too short to matter", d.template_ms, config=d.config)
    if d.found is not None and d.found.compared:
        library = d.found.library_ms, d.found.library
    else:
        library = side.cost(first, claims) if side is not None else None
    if library is None:
        return RegionChoice(names, False, "the library's side could not be measured", d.template_ms)
    ms, pieces = d.library = library
    template = d.template_ms < ms  # a tie goes to the library
    why = "measured" + (", float32 without TF32" if ieee else "")
    config = d.config if template else 0
    return RegionChoice(names, template, why, d.template_ms, ms, f"ATen: {pieces}", config)


def table_choice(d: Decision, builder: Builder, why: str) -> RegionChoice:
    """Where nothing decides by measurement: the template if kernels/template_wins.py has the region
    for this card (in the configuration tried fastest, else the table's), else the library."""
    first = d.regions[0]
    names = product_names(first)
    win = template_wins.lookup(builder.capability, *table_key(first, builder.hints, builder.tf32))
    if win is None:
        return RegionChoice(names, False, f"{why}; the library: kernels/template_wins.py has no such region")
    config = d.config if d.template_ms is not None else win.config
    detail = f"{win.provenance()}; tiles {win.tiles}"
    return RegionChoice(names, True, f"{why}; the table", win.template_ms, win.aten_ms, detail, config)


def keep(d: Decision) -> None:
    """A decision's measurements, for later compiles (gjit/runtime/tuning_store.py), when this one
    measured something its record did not have."""
    if not d.record or d.explored is None or d.kernel is None:
        return
    library_ms, pieces = d.library if d.library is not None else (None, "")
    found = d.found
    if found is not None and d.explored.tried <= found.tried and (found.compared or library_ms is None):
        return
    if found is not None and found.compared:
        library_ms, pieces = found.library_ms, found.library
    explored = d.explored
    tuned = tuning_store.Tuned(explored.config, explored.ms, explored.tried, d.kernel.configs, explored.line,
                               library_ms, pieces)  # fmt: skip
    tuning_store.store(d.record, tuned, replace=found is not None)


def measured(first: tuple[LoopGraph, list[Step], CompiledGraph], builder: Builder, call: Call,
             compare: bool) -> Chosen:  # fmt: skip
    """The program with each template region's choice (above) and each template kernel in its
    fastest configuration, then each row kernel looped or persistent (row_kernels.py); `compare`
    False (GJIT_MATMUL=template): the templates' configurations only. The
    lines of every decision go to the graph's `tuning`. Torch's random number generators are left
    as they were: the user's call draws what eager would."""
    devices = [t.device for t in call.inputs if isinstance(t, torch.Tensor) and t.is_cuda][:1]
    with torch.random.fork_rng(devices=devices):
        templates = bool(template_regions(first[1]))
        chosen = choose_measured(first, builder, call, compare) if templates else Chosen(*first)
        # then each row kernel looped or persistent, on the program chosen (row_kernels.py); a
        # failure there keeps that program, its row kernels looped
        program = (chosen.loop_graph, chosen.steps, chosen.graph)
        try:
            chosen = Chosen(*row_kernels.measured(program, builder, call, first=not templates))
        except Exception as e:  # noqa: BLE001 - measuring is an optimization
            line = f"{ROW_KERNEL}tuning failed ({tuning.first_line(e)}): every row kernel looped"
            log.warning("gjit: %s", line)
            chosen.graph.tuning = [*chosen.graph.tuning, line]
            for region in row_kernels.row_regions(chosen.steps, chosen.graph.kernels):
                region.config = 0  # as its kernel was emitted
    line = f"tuning took {builder.budget.text()}"
    chosen.graph.tuning = [*chosen.graph.tuning, line]
    log.info("%s", line)
    return chosen


def choose_measured(first: tuple[LoopGraph, list[Step], CompiledGraph], builder: Builder, call: Call,
                    compare: bool) -> Chosen:  # fmt: skip
    loop_graph, steps, graph = first
    lines: list[str] = []
    chosen: dict[tuple[str, ...], RegionChoice] = {}  # by the products' FX names
    by_signature: dict[tuple, RegionChoice] = {}
    side: LibrarySide | None = None
    library: tuple[LoopGraph, list[Step], CompiledGraph] | None = None
    todo = template_regions(steps)
    # what may be a template at all (mode "default": gjit/choice/table.py's `unmeasured`), kept
    # through the rounds; the per-region choices are this module's
    initial = templates = graph.templates or EVERY_TEMPLATE
    for round_ in range(MAX_ROUNDS):
        decisions = template_decisions((loop_graph, steps, graph), todo, builder, call, first=round_ == 0)
        # the library's side, whenever a timed template needs it (a timed template without it decides
        # nothing: one program past the budget, at most); not for one too short to matter
        weigh = [d for d in decisions if needs_library(d, builder.tf32)]
        if compare and side is None and weigh:
            library_steps = builder.schedule(EVERY_EXTERN)
            library = (*library_steps, builder.build(*library_steps, EVERY_EXTERN))
            side = LibrarySide(library[1], library[2], call)
        explore_configurations(decisions, functools.partial(builder.emit, loop_graph, steps), builder.budget)
        lines += [d.line for d in decisions]
        stats.count("tuning_over_budget", sum(d.over_budget for d in decisions))
        claims = claims_of(template_regions(steps))
        went_to_library = False
        for d in decisions:
            if compare:
                choice = decide(d, side, claims, builder)
            else:
                choice = RegionChoice(product_names(d.regions[0]), True, "gjit.config.matmul is 'template'",
                                      d.template_ms, config=d.config)  # fmt: skip
            keep(d)
            for region in d.regions:
                own = dataclasses.replace(choice, nodes=product_names(region))
                chosen[own.nodes] = by_signature[signature(region)] = own
            went_to_library |= not choice.template
            if compare:
                more = f" (and {len(d.regions) - 1} more alike)" if len(d.regions) > 1 else ""
                line = f"{', '.join(choice.nodes)}{more}: {choice.text()}"
                lines.append(line)
                log.info("%s", line)
        if compare:
            templates = dataclasses.replace(initial, regions=tuple(chosen.values()))
        if not went_to_library:  # every region as measured: each in its configuration
            return finish(loop_graph, steps, by_signature, builder, templates, lines)
        if library is not None and all(not c.template for c in chosen.values()):
            graph = library[2]  # every product in ATen: the library's program is the choice
            graph.templates, graph.tuning = templates, lines
            return Chosen(library[0], library[1], graph)
        loop_graph, steps = builder.schedule(templates)
        todo = [r for r in template_regions(steps) if signature(r) not in by_signature]
        if not todo:
            return finish(loop_graph, steps, by_signature, builder, templates, lines)
        names = ", ".join(n for r in todo for n in product_names(r))
        line = f"{names}: fused otherwise beside the library's kernels: measured again"
        lines.append(line)
        log.info("%s", line)
        for region in template_regions(steps):
            known = by_signature.get(signature(region))
            region.config = known.config if known is not None else 0
        graph = builder.build(loop_graph, steps, templates)
    # the choice did not settle: every product in ATen
    line = f"the choice did not settle in {MAX_ROUNDS} rounds: every product runs in ATen"
    lines.append(line)
    log.info("%s", line)
    if library is None:
        library_steps = builder.schedule(EVERY_EXTERN)
        library = (*library_steps, builder.build(*library_steps, EVERY_EXTERN))
    library[2].tuning = lines
    return Chosen(*library)


def finish(loop_graph: LoopGraph, steps: list[Step], by_signature: dict, builder: Builder,
           templates: TemplateChoice, lines: list[str]) -> Chosen:  # fmt: skip
    """The program of `steps`, each template region in its chosen configuration."""
    for region in template_regions(steps):
        region.config = by_signature[signature(region)].config
    graph = builder.build(loop_graph, steps, templates)
    graph.tuning = lines
    return Chosen(loop_graph, steps, graph)
