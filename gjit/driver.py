"""The driver: one compile of a graph, every pass in order, one line each (compile_graph), each
timed, logged (GJIT_LOGS=passes), verified under GJIT_DEBUG and dumped under its name."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import sympy
import torch

from gjit import ir, locks, logs, stats, tuning
from gjit.capture.decompose import decompose
from gjit.capture.export import (
    CapturedProgram,
    Exported,
    captured_program,
    shape_env_of,
    shape_guard_texts,
    size_hints,
)
from gjit.choice import measure, regions, table
from gjit.codegen.common import KernelSource, kernel_name
from gjit.codegen.generate import generate_kernel
from gjit.codegen.share import share_code
from gjit.config import CompileOptions, config
from gjit.debug import dump
from gjit.debug.check import RegionChecker
from gjit.fusion.products import group_products
from gjit.fusion.regions import Region, Step, fuse, verify_schedule
from gjit.fusion.rows import fold_rows
from gjit.fusion.statistics import absorb_row_statistics
from gjit.guards.builder import input_symbols
from gjit.ir import LoopGraph
from gjit.lowering.attention_call import written_out_as_sdpa
from gjit.lowering.attention_layout import attention_layouts
from gjit.lowering.attention_pattern import match_attention
from gjit.lowering.convolutions import conv_library, conv_library_as, library_convolutions
from gjit.lowering.graph import lower_graph
from gjit.lowering.grouped_kv import grouped_kv, packed_queries
from gjit.lowering.held_masks import Held, bands_from_record, held_inputs, program_bands
from gjit.lowering.proved_masks import proved_masks
from gjit.lowering.registry import EXTERN_REASONS, LOWERINGS, size_reason
from gjit.lowering.templates import EVERY_TEMPLATE, NO_TEMPLATES, TemplateChoice
from gjit.runtime import disk_cache as cache
from gjit.runtime import early_builds, program_store
from gjit.runtime.graph import CompiledGraph
from gjit.stats import timed
from gjit.wrapper import WrapperWriter, graph_device

output_code_log = logs.logger("output_code")
fusion_log = logs.logger("fusion")
passes_log = logs.logger("passes")
cache_log = logs.logger("cache")


@dataclasses.dataclass
class CompiledProgram:
    """Everything one compile produced, kept for running, explaining and dumping.

    The loop IR and the schedule are kept from a cold compile; an entry loaded from the on-disk
    cache has the decomposed graph, kernels and wrapper, and lowers and fuses again (no codegen)
    when a report, dump or check asks for them."""

    captured: CapturedProgram
    graph: CompiledGraph
    timings: dict[str, float]
    _analysis: tuple[LoopGraph, list[Step]] | None = None
    # guards decomposition added to export's shape environment, from the on-disk entry (a cold
    # compile decomposed in that environment, so its guards already hold them)
    shape_guards: list[sympy.Basic] = dataclasses.field(default_factory=list)
    # the sizes the wrapper takes, in order (the guard returns them)
    symbols: list[sympy.Symbol] = dataclasses.field(default_factory=list)

    @property
    def kernels(self) -> list[KernelSource]:
        return self.graph.kernels

    @property
    def loop_graph(self) -> LoopGraph:
        return self._analyze()[0]

    @property
    def steps(self) -> list[Step]:
        return self._analyze()[1]

    def _analyze(self) -> tuple[LoopGraph, list[Step]]:
        """Lowering and fusion again (an entry from the disk cache or a package has only their
        kernels), under the entry's own choice of templates (stored with it; for an entry without
        one, every template or none), and each setting of torch's deterministic algorithms (float
        atomics or externs): the entry may have been compiled under others than the current ones.
        Under the compile lock: the setting is process-wide, and a compile reads it while it lowers."""
        if self._analysis is not None:
            return self._analysis
        with locks.compiling():
            return self._analysis or self._reanalyze()

    def _reanalyze(self) -> tuple[LoopGraph, list[Step]]:
        current = torch.are_deterministic_algorithms_enabled()
        stored = self.graph.templates
        choices = [stored] if stored is not None else [EVERY_TEMPLATE, NO_TEMPLATES]
        settings = [(d, t) for t in choices for d in (current, not current)]
        gm = self.captured.full_graph_module
        bands = bands_from_record(self.graph.held)  # what the compile's proofs read of its buffers
        library_attention(gm, held_inputs(gm, self.captured.input_sources, bands), self.graph.grouped_kv)
        library = self.graph.conv_library
        with conv_library_as(library):  # traced as the compile traced them
            library_convolutions(gm, self.graph.conv_layout, on_gpu(gm), library)
        for deterministic, templates in settings:
            with _deterministic_algorithms(deterministic):
                loop_graph, steps = schedule_graph(gm, templates, _untimed)
            regions = [s for s in steps if isinstance(s, Region)]
            for index, region in enumerate(regions):
                region.name = kernel_name(region, index)  # as codegen named it
            if [r.name for r in regions] == [k.name for k in self.kernels]:
                self._analysis = loop_graph, steps
                break
        else:
            raise RuntimeError("gjit: lowering and fusion did not reproduce the cached entry's kernels")
        return self._analysis

    def dumped(self) -> dict[str, str]:
        """The dump folder's files of the driver's passes (DUMPED); a text stage starts with the
        pass that produced it and how long it took."""
        results = {
            "lower": self.loop_graph,
            "fuse": self.steps,
            "codegen": self.kernels,
            "wrapper": self.graph.wrapper_source,
        }
        files = {}
        for name, describe in DUMPED.items():
            for file, text in describe(results[name]).items():
                header = dump.stage_header(name, self.timings.get(name)) if file.endswith(".txt") else ""
                files[file] = header + text
        return files


@contextlib.contextmanager
def _deterministic_algorithms(mode: bool):
    before, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    if mode == before:
        yield
        return
    torch.use_deterministic_algorithms(mode)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


# What the dump folder shows of a pass: its result as files (name -> text), each file headed by
# the pass that made it and how long that took. Capture's passes (export, decompose) and the
# guards are dumped by gjit/api.py, which runs them.
DUMPED: dict[str, Callable[[Any], dict[str, str]]] = {
    "lower": lambda loop_graph: {"02_loop_ir.txt": loop_graph.format()},
    "fuse": lambda steps: {"03_regions.txt": dump.regions_text(steps)},
    "codegen": lambda kernels: {
        f"kernels/{k.name}{'.cu' if k.backend == 'cuda' else '.py'}": k.source for k in kernels
    },
    "wrapper": lambda wrapper: {"wrapper.py": wrapper},
}
# Under GJIT_DEBUG, what each pass's result must satisfy before the next pass reads it.
VERIFIED: dict[str, Callable[..., None]] = {
    "lower": lambda loop_graph, *_: ir.verify(loop_graph),
    "attention": lambda loop_graph, *_: ir.verify(loop_graph),
    "fuse": lambda steps, loop_graph: verify_schedule(steps, loop_graph),
    "statistics": lambda steps, _, loop_graph: verify_schedule(steps, loop_graph),
}


@dataclasses.dataclass
class Passes:
    """Runs passes: each timed under its name, logged, and verified under GJIT_DEBUG."""

    options: CompileOptions
    timings: dict[str, float]

    def __call__(self, name: str, fn: Callable, *args: Any) -> Any:
        start = time.perf_counter()
        with timed(name, self.timings):  # summed over the graph and its torch.cond branches
            result = fn(*args)
        passes_log.info("%s: %.1f ms", name, (time.perf_counter() - start) * 1000)
        if self.options.debug and name in VERIFIED:
            VERIFIED[name](result, *args)
        return result


def compile_program(
    exported: Exported, timings: dict[str, float], options: CompileOptions, example: list | None = None
) -> CompiledProgram:
    """Decomposed program, kernels and wrapper for an exported call: from the on-disk cache when an
    entry with the same key is there (gjit/runtime/disk_cache.py; no decomposition then), else
    decomposed, compiled (on a GPU, tuned on the call's flat inputs `example`: gjit/tuning.py)
    and stored. A checked compile is fresh: the per-kernel checker needs the schedule, and a check
    tests what codegen emits now."""
    key = None
    if not config.cache and config.remote_cache:
        cache.remote_cache.note_disabled(
            "GJIT_CACHE=0 turns the disk cache off, and the remote tier's entries with it "
            '(packages saved to "remote:<name>" still load)'
        )
    bands = program_bands(exported.program, exported.module) if options.held_masks else {}
    if config.cache and not options.check:
        gm = exported.program.graph_module
        with timed("cache", timings):
            symbols = input_symbols(exported.user_vals)
            ranges = exported.program.range_constraints
            guards = shape_guard_texts(exported.user_vals)
            held = sorted([kind, name, band.record()] for (kind, name), band in bands.items())
            key = cache.graph_key(
                gm, symbols, size_hints(gm), ranges, options, exported.program, guards, held
            )
            program = cache.load(key, lambda record: _from_entry(record, exported, timings))
        if program is not None:
            return program
    decomposed, shape_guards = decompose(exported, timings, lowered=has_lowering)
    stored = None
    if key is not None:
        try:
            # before captured_program's in-place rewrite; export's own constants are read live
            with timed("serialize", timings):  # torch.export's serializer: seconds for a large model
                stored = program_store.dump_program(decomposed, live=exported.program.constants)
        except program_store.ProgramStoreError as e:
            cache_log.info("not storing the compiled graph: %s", e)
            key = None
    captured = captured_program(exported, decomposed)
    gm = captured.graph_module
    symbols = input_symbols(captured.user_vals)  # after decomposition's replacements
    passes = Passes(options, timings)
    # sdpa: an SDPA call's mask built from sizes, proved causal or keeping every key -> is_causal or
    # none; on a GPU, written-out attention whose score is only scaled -> ATen's SDPA call; each
    # call's output in the layout ATen's kernel returns, where the program only permutes it
    held = held_inputs(gm, captured.input_sources, bands)  # what a mask's proof may read
    grouped = flash_attention_runs(gm, options.target)  # (stored: a reanalysis decides as this did)
    env = shape_env_of(exported.user_vals)
    before = len(env.guards) if env is not None else 0
    passes("sdpa", library_attention, gm, held, grouped)
    # convolutions: on a GPU, each bias added after the call; 2-D and 3-D convolutions channels-last
    library = conv_library(gm, on_gpu(gm))  # (the library flag: its value decides the layouts)
    passes("convolutions", library_convolutions, gm, options.conv_layout, on_gpu(gm), library)
    if env is not None:  # a pass's trace may guard a size (a convolution's output wider than 1)
        shape_guards = [*shape_guards, *(g.expr for g in env.guards[before:])]
    why = unmeasurable(gm, symbols, options, example)
    if options.matmul == "auto" and options.matmul_template and why is not None:  # the library,
        # but where the table of kernels/template_wins.py has the region
        loop_graph, steps, graph = compile_graph(gm, symbols, passes, unmeasured=why)
    elif options.matmul == "auto" and options.matmul_template and not options.measure_all_templates:
        # mode "default": the templates worth measuring (gjit/choice/table.py), the library elsewhere
        loop_graph, steps, graph = compile_graph(gm, symbols, passes, unmeasured=NOT_ALL, measure=True)
    else:
        loop_graph, steps, graph = compile_graph(gm, symbols, passes, initial_templates(options))
    # measured: under "auto" each template region against the library, else the configurations
    choices = regions.template_regions(steps) if options.matmul == "auto" else []
    if why is None and (choices or any(k.configs > 1 for k in graph.kernels)):
        analysis, inputs = (loop_graph, steps, graph), captured.graph_inputs(example)
        try:
            compiled = sum(timings.values())  # the compile's seconds so far: what the budget is a share of
            tune = (gm, symbols, analysis, passes, inputs, compiled)
            loop_graph, steps, graph = passes("tune", tune_graph, *tune)
        except Exception as e:  # measuring is an optimization: never a reason not to run
            tuning.log.warning("gjit: tuning failed (%s); nothing measured is used", tuning.first_line(e))
            failed = f"tuning failed: {tuning.first_line(e)}"
            if options.matmul == "auto":
                loop_graph, steps, graph = compile_graph(gm, symbols, passes, unmeasured=failed)
            else:
                loop_graph, steps, graph = compile_graph(gm, symbols, passes, initial_templates(options))
            key = None  # not stored: the next process measures again
    graph.held = held.record()  # the guard checks these keep their contents
    graph.grouped_kv = grouped
    graph.conv_layout = options.conv_layout
    graph.conv_library = library  # the entry requires it as it was
    if key is not None:
        with timed("cache_store", timings):
            extra = {"program": stored, "shape_guards": shape_guards, "symbols": symbols}
            cache.store(key, graph, extra)
    return CompiledProgram(captured, graph, timings, (loop_graph, steps), symbols=symbols)


def _from_entry(record: dict, exported: Exported, timings: dict[str, float]) -> CompiledProgram:
    """A cached entry's program: the stored decomposed graph over the live parameters."""
    live = exported.program
    decomposed = program_store.load_served(record["program"], live.state_dict, live.constants)
    captured = captured_program(exported, decomposed)
    graph = cache.graph_from_entry(record, captured.graph_module)
    for k in graph.kernels:
        output_code_log.info("kernel %s from the cache: %s", k.name, graph.kernel_paths[k.name])
    shape_guards = cache.decoded(record, "shape_guards")
    symbols = cache.decoded(record, "symbols")
    bound = set(input_symbols(captured.user_vals))
    unbound = {s for e in [*symbols, *shape_guards] for s in sympy.sympify(e).free_symbols} - bound
    if unbound:  # decomposition replaced a symbol this export's guards do not bind
        raise cache.CacheError(f"the entry uses size symbols {sorted(map(str, unbound))} no input binds")
    return CompiledProgram(captured, graph, timings, shape_guards=shape_guards, symbols=symbols)


def schedule_graph(
    gm: torch.fx.GraphModule, templates: TemplateChoice, run: Callable[..., Any]
) -> tuple[LoopGraph, list[Step]]:
    """The passes from the FX graph to the schedule, each through `run(name, fn, *args)`, with the
    matmuls and attention `templates` allows as templates (the others ATen externs); the
    compile and the re-analysis of a cached entry (`CompiledProgram._analyze`) both run these."""
    # lower: ATen FX graph -> loop IR (views become index expressions, unsupported ops externs)
    loop_graph = run("lower", lower_graph, gm, templates)
    # attention: written-out attention (bmm, scale, mask, softmax, bmm) -> one attention node
    loop_graph = run("attention", match_attention, loop_graph, size_hints(gm))
    # fuse: loop IR -> regions (one kernel each) and externs, in execution order
    steps = run("fuse", fuse, loop_graph)
    # statistics: a norm's per-row sums into the prologues of the matmuls that alone read them
    steps = run("statistics", absorb_row_statistics, steps, loop_graph)
    # rows: a norm after a linear into its epilogue when one tile covers a row
    steps = run("rows", fold_rows, steps, loop_graph, size_hints(gm))
    # products: matmuls that share their left operand (q, k, v) launched as one kernel
    steps = run("products", group_products, steps, loop_graph)
    return loop_graph, steps


def _untimed(name: str, fn: Callable, *args: Any) -> Any:
    return fn(*args)


def compile_graph(
    gm: torch.fx.GraphModule,
    symbols: list[sympy.Symbol],
    run: Passes,
    templates: TemplateChoice | None = None,
    unmeasured: str = "",
    measure: bool = False,
    branch: bool = False,
) -> tuple[LoopGraph, list[Step], CompiledGraph]:
    """One FX graph -> kernels + wrapper; `symbols` are the sizes the caller passes in bound.
    `templates`: which products are templates; None: the library but where the table of
    kernels/template_wins.py has the region (gjit/choice/; `unmeasured`: why nothing is timed),
    and with `measure` where a template is worth measuring (`unmeasured`: why the rest are not).
    The branches of a torch.cond are compiled the same way (binding their sizes themselves;
    `branch`: no guard checked their inputs)."""
    options = run.options
    # lower, attention, fuse, statistics, rows, products: ATen FX graph -> loop IR -> the schedule
    if templates is None:
        hints = size_hints(gm)
        schedule = functools.partial(schedule_graph, gm, run=run)
        loop_graph, steps, templates = table.unmeasured(
            schedule, gm, hints, options.target, options.tf32, unmeasured, measure
        )
    else:
        loop_graph, steps = schedule_graph(gm, templates, run)
    # codegen: each region -> one Triton (or CUDA C) kernel, sizes as arguments
    kernels = run("codegen", generate_kernels, steps, loop_graph, size_hints(gm), options)
    # wrapper: the schedule -> one Python call function
    wrapper = run("wrapper", write_wrapper, loop_graph, steps, kernels, symbols, options, not branch)
    # write: kernel and wrapper sources to the cache dir (content-addressed)
    graph = run("write", write_graph, gm, kernels, wrapper)
    graph.templates = templates
    if options.check:
        graph.checker = region_checker(gm, loop_graph, steps)
    for node in gm.graph.nodes:  # torch.cond branches (other higher-order ops run theirs eagerly)
        if node.op == "get_attr" and is_cond_branch(gm, node):
            branch = getattr(gm, node.target)
            if options.matmul == "auto" and options.matmul_template:  # only one branch would be timed
                sub = compile_graph(branch, [], run, unmeasured="a torch.cond branch", branch=True)
            else:
                sub = compile_graph(branch, [], run, initial_templates(options), branch=True)
            graph.subgraphs[node.target] = sub[2]
    return loop_graph, steps, graph


# why mode "default" runs a product in the library without measuring it (gjit/choice/table.py)
NOT_ALL = (
    "mode default measures templates only where they fuse a written-out attention "
    '(mode="max-autotune" or GJIT_MEASURE_ALL_TEMPLATES=1: every template)'
)


def initial_templates(options: CompileOptions) -> TemplateChoice:
    """Every product a template (GJIT_MATMUL template, and auto before it measures), or none."""
    return EVERY_TEMPLATE if options.matmul_template else NO_TEMPLATES


def on_gpu(gm: torch.fx.GraphModule) -> bool:
    return graph_device(gm.graph.nodes).type == "cuda"


def flash_attention_runs(gm: torch.fx.GraphModule, target: int | None) -> bool:
    """Whether ATen's SDPA can run FlashAttention, which takes grouped keys and values, on the card
    the compile is for (`target`, sm_80 or later: the memory-efficient kernel, which older ones run,
    takes no groups, and the math path would), or where `gm` runs on no card (the CPU: the same
    values either way)."""
    if target is not None:
        return target >= 80
    return graph_device(gm.graph.nodes).type != "cuda"


def attention_as_sdpa(gm: torch.fx.GraphModule) -> bool:
    """Whether written-out attention whose score is only scaled runs as ATen's SDPA call: on a GPU,
    where its fused kernels keep the score matrix on chip (gjit/lowering/attention_library.py)."""
    return on_gpu(gm)


def library_attention(gm: torch.fx.GraphModule, held: Held, grouped: bool) -> None:
    proved_masks(gm, held)  # exact on every device: no mask's kernels, the causal kernel or bound
    if grouped:  # then unmasked calls read grouped keys and values in place (flash_attention_runs)
        grouped_kv(gm)
    packed_queries(gm)  # one query a head: a group's query heads as rows of one call on its keys
    if attention_as_sdpa(gm):
        written_out_as_sdpa(gm, held)
    attention_layouts(gm, grouped)  # outputs in the layout ATen's kernel returns: no copies


def unmeasurable(
    gm: torch.fx.GraphModule, symbols: list[sympy.Symbol], options: CompileOptions, example: list | None
) -> str | None:
    """Why this compile measures nothing (gjit/tuning.py, gjit/choice/), or None: it measures on
    a GPU, when asked for, not under GJIT_CHECK, with the example's sizes known, and with torch's
    deterministic algorithms off (a choice made by timing is not reproducible bit for bit: tiles
    set the order of the sums)."""
    if options.backend != "triton":
        return "the cupy backend's kernels have one configuration each"
    if not config.tune:
        return "tuning off, GJIT_TUNE=0"
    if options.check:
        return "GJIT_CHECK runs the kernels as generated"
    if torch.are_deterministic_algorithms_enabled():
        return "torch's deterministic algorithms are on"
    if not on_gpu(gm):
        return "not on a GPU"
    hints = size_hints(gm)
    if example is None or not all(s in hints for s in symbols):
        return "no example sizes"
    return None


def tune_graph(
    gm: torch.fx.GraphModule,
    symbols: list[sympy.Symbol],
    analysis: tuple[LoopGraph, list[Step], CompiledGraph],
    run: Passes,
    graph_inputs: list,
    compiled: float = 0.0,
) -> tuple[LoopGraph, list[Step], CompiledGraph]:
    """The program with each template kernel in its fastest configuration and, under "auto", each
    matmul and attention region a template or the library's kernels, whichever is faster
    (gjit/choice/), measured at the example's sizes within a budget: a share of the compile,
    whose first `compiled` seconds are done."""
    hints, options = size_hints(gm), run.options
    sizes = tuple(hints[s] for s in symbols)
    branches = analysis[2].subgraphs  # compiled once: their choice is not measured

    def build(loop_graph: LoopGraph, steps: list[Step], templates: TemplateChoice) -> CompiledGraph:
        kernels = generate_kernels(steps, loop_graph, hints, options)
        graph = write_graph(gm, kernels, write_wrapper(loop_graph, steps, kernels, symbols, options))
        graph.subgraphs, graph.templates = branches, templates
        return graph

    def emit(loop_graph: LoopGraph, steps: list[Step], region: Region, config: int) -> KernelSource:
        region.config = config
        index = [s.name for s in steps if isinstance(s, Region)].index(region.name)
        return generate_kernel(region, loop_graph, hints, index, options)

    schedule = functools.partial(schedule_graph, gm, run=_untimed)
    budget = tuning.Budget(options.tune_budget, compiled)
    builder = measure.Builder(schedule, build, emit, hints, options.tf32, budget, options.target)
    call = measure.Call(graph_inputs, sizes, dict(zip(symbols, sizes)))
    chosen = measure.measured(analysis, builder, call, compare=options.matmul == "auto")
    return chosen.loop_graph, chosen.steps, chosen.graph


def has_lowering(node: torch.fx.Node) -> bool:
    """Whether gjit lowers `node`'s op, or keeps it an extern on purpose (an always-extern op, a
    result whose sizes kernels cannot print): else decomposition tries torch.compile's table."""
    op = node.target
    return op in LOWERINGS or op in EXTERN_REASONS or size_reason(node.meta.get("val")) is not None


def is_cond_branch(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    return isinstance(getattr(gm, node.target), torch.fx.GraphModule) and all(
        user.target is torch.ops.higher_order.cond for user in node.users
    )


def generate_kernels(
    steps: list[Step], loop_graph: LoopGraph, hints: dict[sympy.Symbol, int], options: CompileOptions
) -> list[KernelSource]:
    regions = [s for s in steps if isinstance(s, Region)]
    for r in regions:
        fusion_log.info("region: %s (stores %s)", ", ".join(n.name for n in r.inlined + r.nodes), r.stores)
    early = early_builds.start(loop_graph, hints, len(regions))  # on a GPU: each kernel's build starts now
    kernels = []
    try:
        for k, r in enumerate(regions):
            kernels.append(generate_kernel(r, loop_graph, hints, k, options))
            if early is not None:
                early.add(kernels[-1])
    except BaseException:
        if early is not None:
            early.close(cancel=True)  # nothing will launch them
        raise
    if early is not None:
        early.close()
    share_code(kernels)  # a layer whose kernel is an earlier layer's code launches that one
    return kernels


def write_wrapper(
    loop_graph: LoopGraph,
    steps: list[Step],
    kernels: list[KernelSource],
    symbols: list[sympy.Symbol],
    options: CompileOptions,
    guarded: bool = True,
) -> str:
    """`guarded`: the entry's guards checked the graph's inputs (not a torch.cond branch's)."""
    by_name = {k.name: k for k in kernels}
    return WrapperWriter(
        loop_graph, steps, by_name, poison=options.debug, input_symbols=symbols, check=options.check,
        guarded=guarded,
    ).generate()  # fmt: skip


def write_graph(gm: torch.fx.GraphModule, kernels: list[KernelSource], wrapper: str) -> CompiledGraph:
    graph = CompiledGraph(gm, kernels, wrapper)
    graph.write()
    stats.count("kernels", len(kernels))
    for k in kernels:
        if k.code_of is not None:
            output_code_log.info("kernel %s: the code of %s runs", k.name, k.code_of)
            continue
        output_code_log.info("kernel %s written to %s\n%s", k.name, graph.kernel_paths[k.name], k.source)
    output_code_log.info("wrapper written to %s\n%s", graph.wrapper_path, wrapper)
    return graph


def region_checker(gm: torch.fx.GraphModule, graph: LoopGraph, steps: list[Step]) -> RegionChecker:
    """What GJIT_CHECK compares per kernel: FX nodes it computes, and (FX name, wrapper name) it stores."""
    fx_names: dict[str, list[str]] = {}
    for n in gm.graph.nodes:
        fx_names.setdefault(graph.aliases.get(n.name, n.name), []).append(n.name)
    members, stores = {}, {}
    for r in steps:
        if isinstance(r, Region):
            members[r.name] = [f for n in r.inlined + r.nodes for f in fx_names.get(n.name, [n.name])]
            stores[r.name] = [(f, s) for s in r.stores for f in fx_names.get(s, [])]
    return RegionChecker(gm, members, stores)


def run_program(
    program: CompiledProgram, flat_user: list[Any], sizes: tuple, graphs: Any = None, call: Any = None
) -> Any:
    """Run one call: `sizes` are the size symbols' values the entry's guard bound; `graphs`, the
    entry's CUDA graphs (gjit/runtime/cuda_graphs.py) in mode="reduce-overhead"; `call`, the call's
    (args, kwargs), whose caches a returned cache updates."""
    captured = program.captured
    graph_inputs = captured.graph_inputs(flat_user)
    run = program.graph.run if graphs is None else graphs.run
    flat_out = run(graph_inputs, sizes)
    return captured.finish(flat_user, flat_out, graph_inputs, call)
