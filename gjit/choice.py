"""Library or template, per region (gjit.config.matmul "auto", the default): each matmul and
attention region runs its template kernel (with the prologue and epilogue it fused) or ATen's
kernels (cuBLAS; SDPA's flash or memory-efficient kernel) plus generated kernels for what the
template would have fused, whichever is faster for that region at the call's sizes.

Measured (a GPU, tuning on: `measured`):

1. The program with every product a template (the driver's first compile): each distinct
   template kernel (the layers of a model share one: decided once) timed in its tile
   configurations (gjit/tuning.py), the decisions in order of modeled time, heaviest first.
2. The program with every product an ATen extern, run once, its extern calls of products and its
   kernels kept. A region's library side is the extern calls of its products plus, of each
   kernel there that computes nodes the template fused (a bias, an activation, a residual, a
   post-norm, the statistics of the norm its prologue applies; every product of a q/k/v group),
   the share those nodes are of the kernel's nodes (a node fused by several templates split
   between them). Only those pieces are timed, each once.
3. The template where it is faster, else the library. A template under MIN_KERNEL_MS keeps its
   one launch without the library being tried (launch-bound either way), but a float32 product
   without TF32 (the template on the FMA units: 6x cuBLAS on an H200) is always compared.
4. The program compiled with that choice. A template region next to one that went to the
   library may fuse otherwise there (an activation left in a kernel of its own joins the next
   template's prologue): such a region is measured again as it now fuses, at most MAX_ROUNDS
   times; a choice that does not settle runs every product in ATen.

The whole-program comparison of earlier versions is gone: per region is finer, costs two program
timings less, and on the H200 a tie of whole programs (0.266 against 0.257 ms) overrode the Llama
down projection's kernel, 7% faster than cuBLAS's GEMM plus the add.

Not measured (tuning off, not on a GPU, `gjit.aot` for a card that is not there: `unmeasured`):
the library, and the template only where kernels/template_wins.py's table, measured on such a
card, has this very region. The choice (`TemplateChoice`, each region's figures with it) is part
of the compiled entry: a warm start lowers by it and measures nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import sympy
import torch

from gjit import progress, tuning
from gjit.codegen.common import KernelSource
from gjit.fusion.regions import Region, Step
from gjit.ir import AttentionNode, ExternNode, LoopGraph, MatmulNode, dot_operands
from gjit.kernels import template_wins
from gjit.lowering.templates import EVERY_TEMPLATE, RegionChoice, TemplateChoice
from gjit.runtime.graph import CompiledGraph

log = tuning.log  # GJIT_LOGS=tuning
aten = torch.ops.aten

PRODUCT_OPS = (
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten.baddbmm.default,
    aten.scaled_dot_product_attention.default,
)
MAX_ROUNDS = 3
# nominal figures of a current GPU: the order decisions are measured in, never a decision
NOMINAL_FLOPS = {"16-bit": 8e14, "tf32": 4e14, "float32": 5e13}
NOMINAL_BYTES_PER_S = 3e12
EVERY_EXTERN = TemplateChoice(frozenset(), "every product an ATen extern: the library's side of the choice")


def card_of(flat: list[Any], aot_target: int | None) -> int | None:
    """The GPU a compile for these inputs is for (CompileOptions.target): the compute capability
    of the call's device (sm_90: 90), else gjit.aot's arch, else None."""
    device = next((v.device for v in flat if isinstance(v, torch.Tensor) and v.is_cuda), None)
    if device is None:
        return aot_target
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


# ----------------------------------------------------------------------------------------------
# Regions
# ----------------------------------------------------------------------------------------------


def template_regions(steps: list[Step]) -> list[Region]:
    return [s for s in steps if isinstance(s, Region) and s.matmul]


def products(region: Region) -> list[MatmulNode]:
    """The products a template region computes: its own (each of a group's parts), and those of
    a written-out attention its attention node stands for."""
    own = [n for n in region.nodes if isinstance(n, MatmulNode)]
    return own + [a for n in own for a in getattr(n, "absorbed", ()) if isinstance(a, MatmulNode)]


def product_names(region: Region) -> tuple[str, ...]:
    """The FX nodes the choice of `region` is for (what lowering keys templates on)."""
    return tuple(sorted({n.fx_node.name for n in products(region)}))


def members(region: Region) -> frozenset[str]:
    """Every node the region's kernel computes, products and what it fused."""
    return frozenset(n.name for n in region.fused_nodes())


def signature(region: Region) -> tuple[frozenset[str], frozenset[str]]:
    """What a region's kernel is, across compiles of one graph: what it computes and stores."""
    return members(region), frozenset(region.stores)


def hint(size: Any, hints: dict[sympy.Symbol, int]) -> int | None:
    """A size's example value (None: a data-dependent size)."""
    expr = size.node.expr if isinstance(size, torch.SymInt) else sympy.sympify(size)
    value = sympy.sympify(sympy.sympify(expr).xreplace(hints))
    return int(value) if value.is_Integer else None


def operand_dtype(region: Region) -> torch.dtype:
    """The dtype the region's dot multiplies in."""
    node = next(n for n in region.nodes if isinstance(n, MatmulNode))
    if isinstance(node, AttentionNode):
        return node.body.dtype
    return dot_operands(*region.bodies[node.name].args)[0]


def table_key(region: Region, hints: dict[sympy.Symbol, int], tf32: bool | None) -> tuple:
    """(kind, dtype, sizes, ops, causal, tf32): what kernels/template_wins.py's entries name."""
    node = next(n for n in region.nodes if isinstance(n, MatmulNode))
    dtype = operand_dtype(region)
    kind = "attention" if isinstance(node, AttentionNode) else "matmul"
    sizes = tuple(hint(s, hints) for s in node.full_size)
    ops = tuple(sorted(n.aten for n in region.fused_nodes()))
    causal = bool(getattr(node, "causal", False))
    return kind, dtype, sizes, ops, causal, (bool(tf32) if dtype == torch.float32 else None)


def modeled_ms(
    region: Region, kernel: KernelSource, hints: dict[sympy.Symbol, int], tf32: bool | None
) -> float:
    """A roofline estimate of the template kernel's time on a nominal GPU: the order in which a
    model's decisions are measured (a budget measures the heaviest first)."""
    flops = 0
    for node in products(region):
        sizes = [hint(s, hints) or 0 for s in node.full_size]
        if isinstance(node, AttentionNode):  # (batch..., L, Ev, S, D)
            *batch, length, dim_v, keys, dim = sizes
            flops += 2 * math.prod(batch) * length * keys * (dim + dim_v)
        elif not any(isinstance(n, AttentionNode) for n in region.nodes):
            flops += 2 * math.prod(sizes)
    dtype = operand_dtype(region)
    peak = NOMINAL_FLOPS["16-bit" if dtype != torch.float32 else "tf32" if tf32 else "float32"]
    moved = hint(kernel.bytes_read + kernel.bytes_written, hints) or 0
    return 1e3 * max(flops / peak, moved / NOMINAL_BYTES_PER_S)


# ----------------------------------------------------------------------------------------------
# Measured: templates against the library, per region
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Builder:
    """How the driver compiles its graph again, under another choice (it is not imported here)."""

    schedule: Callable[[TemplateChoice], tuple[LoopGraph, list[Step]]]  # lower ... products
    build: Callable[[LoopGraph, list[Step], TemplateChoice], CompiledGraph]  # codegen, wrapper, write
    emit: Callable[[LoopGraph, list[Step], Region, int], KernelSource]  # one region in a configuration
    hints: dict[sympy.Symbol, int]
    tf32: bool | None


@dataclasses.dataclass
class Call:
    """The example call the measurements run: the graph's inputs, the sizes the wrapper takes
    and every size symbol's value."""

    inputs: list[Any]
    sizes: tuple
    values: dict[sympy.Symbol, int]


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


@dataclasses.dataclass
class Chosen:
    loop_graph: LoopGraph
    steps: list[Step]
    graph: CompiledGraph


def template_decisions(program: tuple[LoopGraph, list[Step], CompiledGraph], regions: list[Region],
                       builder: Builder, call: Call) -> list[Decision]:  # fmt: skip
    """`regions` of the program grouped by kernel, each group's kernel timed in its
    configurations, in order of modeled time."""
    loop_graph, steps, graph = program
    keys, launches = tuning.record(graph, {r.name for r in regions}, call.inputs, call.sizes, call.values)
    by_name = {k.name: k for k in graph.kernels}
    groups: dict[str, Decision] = {}
    for region in regions:
        key = keys.get(region.name, region.name)  # never launched: a decision of its own
        if key in groups:
            groups[key].regions.append(region)
        else:
            estimate = modeled_ms(region, by_name[region.name], builder.hints, builder.tf32)
            groups[key] = Decision([region], key, estimate)
    decisions = sorted(groups.values(), key=lambda d: -d.modeled_ms)
    emit = functools.partial(builder.emit, loop_graph, steps)
    # heaviest first: the place for a tuning budget, which would stop this loop; a decision left
    # unmeasured (template_ms None) takes the library in `decide`
    for done, d in enumerate(decisions):
        progress.tuning(done, len(decisions))
        first = d.regions[0]
        launch = launches.pop(d.key, None)  # measured once: its tensors go when it has been
        if launch is None:
            d.line = f"{first.name}: not launched at these sizes, or it writes what it reads: not measured"
            continue
        label = f"template {','.join(product_names(first))} {first.name}"
        d.config, d.template_ms, d.line = tuning.choose(first, by_name[first.name], launch, emit, label)
        log.info("%s", d.line)
    progress.tuning(len(decisions), len(decisions))
    return decisions


class LibrarySide:
    """The program with every product an ATen extern, run once on the example: its extern calls
    of products and its kernels kept, each timed once when a region's choice needs it."""

    def __init__(self, steps: list[Step], graph: CompiledGraph, call: Call):
        self.kernels = {s.name: s for s in steps if isinstance(s, Region)}
        self.externs: dict[str, tuple] = {}  # FX name -> its call's key
        self.calls: dict[tuple, tuple] = {}  # call key -> (op, args, kwargs), the first such call
        self.times: dict[Any, float | None] = {}
        order: dict[Any, list[str]] = {}  # the wrapper calls each product's extern in schedule order
        for step in steps:
            if isinstance(step, ExternNode) and step.fx_node.target in PRODUCT_OPS:
                order.setdefault(step.fx_node.target, []).append(step.name)

        def seen(op: Any) -> Callable[[tuple, dict], None]:
            names = iter(order.get(op, []))

            def on_call(args: tuple, kwargs: dict) -> None:
                key = call_key(op, args, kwargs)
                name = next(names, None)
                if name is not None:
                    self.externs[name] = key
                self.calls.setdefault(key, (op, args, kwargs))

            return on_call

        calls = {op: seen(op) for op in order}
        self.keys, self.launches = tuning.record(
            graph, set(self.kernels), call.inputs, call.sizes, call.values, calls
        )

    def extern_ms(self, name: str) -> float | None:
        key = self.externs.get(name)
        if key is None:
            return None
        if key not in self.times:
            op, args, kwargs = self.calls[key]
            self.times[key] = timed(lambda: op(*args, **kwargs), f"ATen {name}")
        return self.times[key]

    def kernel_ms(self, name: str) -> float | None:
        """A kernel's time; 0 when it never launched (empty), None when it could not be timed."""
        key = self.keys.get(name)
        if key is None:
            return 0.0
        if key not in self.times:
            launch = self.launches.get(key)
            if launch is None:  # it writes what it reads: not run again on kept arguments
                self.times[key] = None
            else:
                self.times[key] = timed(lambda: tuning.replay(launch), f"ATen-side kernel {name}")
        return self.times[key]

    def cost(self, region: Region, claims: collections.Counter) -> tuple[float, str] | None:
        """The library's time for what `region` computes, and its pieces; None when a piece could
        not be timed. `claims`: how many template regions fused each node."""
        total, pieces = 0.0, []
        for name in product_names(region):
            ms = self.extern_ms(name)
            if ms is None:
                return None
            total += ms
            pieces.append(f"{name} {ms:.3f}")
        fused = members(region) - {n.name for n in products(region)}
        for name, kernel in self.kernels.items():
            nodes = [n.name for n in kernel.fused_nodes()]
            share = sum(1 / claims[n] for n in nodes if n in fused) / max(len(nodes), 1)
            if share == 0:
                continue
            ms = self.kernel_ms(name)
            if ms is None:
                return None
            total += share * ms
            pieces.append(f"{name} {ms:.3f}" + ("" if share == 1 else f" x {share:.2f}"))
        return total, " + ".join(pieces)


def call_key(op: Any, args: tuple, kwargs: dict) -> tuple:
    """What two extern calls that cost alike share: the op, each tensor's sizes, strides and
    dtype, the other arguments."""

    def describe(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return ("tensor", tuple(a.shape), tuple(a.stride()), str(a.dtype))
        if isinstance(a, (list, tuple)):
            return tuple(describe(x) for x in a)
        return repr(a)

    return str(op), describe(args), tuple(sorted((k, describe(v)) for k, v in kwargs.items()))


def timed(fn: Callable[[], Any], what: str) -> float | None:
    try:
        return tuning.bench(fn, what)
    except Exception as e:  # not runnable again on its kept arguments: not measured
        log.info("%s: not timed (%s)", what, tuning.first_line(e))
        return None


def decide(
    d: Decision, side: LibrarySide | None, claims: collections.Counter, tf32: bool | None
) -> RegionChoice:
    """One decision's choice, from the template's time and the library side's."""
    first = d.regions[0]
    names = product_names(first)
    ieee = operand_dtype(first) == torch.float32 and not tf32  # the template on the FMA units
    if d.template_ms is None:
        return RegionChoice(names, False, "not measured: the template did not run on the example")
    if d.template_ms < tuning.MIN_KERNEL_MS and not ieee:
        return RegionChoice(names, True, "too short to matter", d.template_ms, config=d.config)
    library = side.cost(first, claims) if side is not None else None
    if library is None:
        return RegionChoice(names, False, "the library's side could not be measured", d.template_ms)
    ms, pieces = library
    template = d.template_ms < ms  # a tie goes to the library
    why = "measured" + (", float32 without TF32" if ieee else "")
    config = d.config if template else 0
    return RegionChoice(names, template, why, d.template_ms, ms, f"ATen: {pieces}", config)


def claims_of(regions: list[Region]) -> collections.Counter:
    return collections.Counter(n for r in regions for n in members(r) - {p.name for p in products(r)})


def measured(first: tuple[LoopGraph, list[Step], CompiledGraph], builder: Builder, call: Call,
             compare: bool) -> Chosen:  # fmt: skip
    """The program with each template region's choice (above) and each template kernel in its
    fastest configuration; `compare` False (GJIT_MATMUL=template): the configurations only. The
    lines of every decision go to the graph's `tuning`. Torch's random number generators are left
    as they were: the user's call draws what eager would."""
    devices = [t.device for t in call.inputs if isinstance(t, torch.Tensor) and t.is_cuda][:1]
    with torch.random.fork_rng(devices=devices):
        return choose_measured(first, builder, call, compare)


def choose_measured(first: tuple[LoopGraph, list[Step], CompiledGraph], builder: Builder, call: Call,
                    compare: bool) -> Chosen:  # fmt: skip
    loop_graph, steps, graph = first
    lines: list[str] = []
    chosen: dict[tuple[str, ...], RegionChoice] = {}  # by the products' FX names
    by_signature: dict[tuple, RegionChoice] = {}
    side: LibrarySide | None = None
    library: tuple[LoopGraph, list[Step], CompiledGraph] | None = None
    todo = template_regions(steps)
    templates = EVERY_TEMPLATE
    for _ in range(MAX_ROUNDS):
        decisions = template_decisions((loop_graph, steps, graph), todo, builder, call)
        lines += [d.line for d in decisions]
        if compare and side is None and any(d.template_ms is not None for d in decisions):
            library_steps = builder.schedule(EVERY_EXTERN)
            library = (*library_steps, builder.build(*library_steps, EVERY_EXTERN))
            side = LibrarySide(library[1], library[2], call)
        claims = claims_of(template_regions(steps))
        went_to_library = False
        for d in decisions:
            if compare:
                choice = decide(d, side, claims, builder.tf32)
            else:
                choice = RegionChoice(product_names(d.regions[0]), True, "gjit.config.matmul is 'template'",
                                      d.template_ms, config=d.config)  # fmt: skip
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
            templates = TemplateChoice(None, regions=tuple(chosen.values()))
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


# ----------------------------------------------------------------------------------------------
# Not measured: the library, but where the table says the template wins
# ----------------------------------------------------------------------------------------------


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
