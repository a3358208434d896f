"""The driver: one compile of a graph, every pass in order, each timed under its name."""

from __future__ import annotations

import dataclasses
from typing import Any

import sympy
import torch

from gjit import logs, stats
from gjit.capture import CapturedProgram, size_hints
from gjit.codegen.common import KernelSource, kernel_name
from gjit.codegen.generate import BACKENDS, generate_kernel
from gjit.config import config
from gjit.debug.check import RegionChecker
from gjit.fusion import Region, Step, fuse
from gjit.guards.builder import input_symbols
from gjit.ir import LoopGraph
from gjit.lowering.graph import lower_graph
from gjit.runtime import disk_cache as cache
from gjit.runtime.graph import CompiledGraph
from gjit.stats import timed
from gjit.wrapper import WrapperWriter

output_code_log = logs.logger("output_code")
fusion_log = logs.logger("fusion")


@dataclasses.dataclass
class CompiledProgram:
    """Everything one compile produced, kept for running, explaining and dumping.

    The loop IR and the schedule are kept from a cold compile; an entry loaded from the on-disk
    cache has only kernels and wrapper, and lowers and fuses again (no codegen) when a report,
    dump or check asks for them."""

    captured: CapturedProgram
    graph: CompiledGraph
    timings: dict[str, float]
    _analysis: tuple[LoopGraph, list[Step]] | None = None

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
        if self._analysis is None:
            loop_graph = lower_graph(self.captured.graph_module)
            steps = fuse(loop_graph)
            regions = [s for s in steps if isinstance(s, Region)]
            for index, region in enumerate(regions):
                region.name = kernel_name(region, index)  # as codegen named it
            if [r.name for r in regions] != [k.name for k in self.kernels]:
                raise RuntimeError("gjit: lowering and fusion did not reproduce the cached entry's kernels")
            self._analysis = loop_graph, steps
        return self._analysis


def backend() -> str:
    name = config.backend
    if name not in BACKENDS:
        raise ValueError(f"gjit: unknown backend {name!r} (GJIT_BACKEND): expected one of {BACKENDS}")
    return name


def compile_program(
    captured: CapturedProgram, timings: dict[str, float], check: bool = False
) -> CompiledProgram:
    """Kernels + wrapper for a captured program: from the on-disk cache when an entry with the
    same key is there (gjit/runtime/disk_cache.py), else compiled and stored. `check` compiles fresh: the
    per-kernel checker needs the schedule, and a check exists to test what codegen emits now."""
    gm = captured.graph_module
    symbols = input_symbols(captured.user_vals)
    key = None
    if config.cache and not check:
        with timed("cache", timings):
            key = cache.graph_key(gm, symbols, size_hints(gm), captured.program.range_constraints)
            graph = cache.load(key, gm)
        if graph is not None:
            for k in graph.kernels:
                output_code_log.info("kernel %s from the cache: %s", k.name, graph.kernel_paths[k.name])
            return CompiledProgram(captured, graph, timings)
    loop_graph, steps, graph = compile_graph(gm, timings, symbols, check)
    if key is not None:
        with timed("cache_store", timings):
            cache.store(key, graph)
    return CompiledProgram(captured, graph, timings, (loop_graph, steps))


def compile_graph(
    gm: torch.fx.GraphModule, timings: dict[str, float], symbols: list[sympy.Symbol], check: bool = False
) -> tuple[LoopGraph, list[Step], CompiledGraph]:
    """One FX graph -> kernels + wrapper; `symbols` are the sizes the caller passes in bound.
    The branches of a torch.cond are compiled the same way (binding their sizes themselves)."""
    # lower: ATen FX graph -> loop IR (views become index expressions, unsupported ops externs)
    with timed("lower", timings):
        loop_graph = lower_graph(gm)
    # fuse: loop IR -> regions (one kernel each) and externs, in execution order
    with timed("fuse", timings):
        steps = fuse(loop_graph)
    for step in steps:
        if isinstance(step, Region):
            fusion_log.info(
                "region: %s (stores %s)", ", ".join(n.name for n in step.inlined + step.nodes), step.stores
            )
    # codegen: each region -> one Triton (or CUDA C) kernel, sizes as arguments
    with timed("codegen", timings):
        hints = size_hints(gm)
        regions = [s for s in steps if isinstance(s, Region)]
        kernels = [generate_kernel(r, loop_graph, hints, k, backend()) for k, r in enumerate(regions)]
    # wrapper: the schedule -> one Python call function
    with timed("wrapper", timings):
        by_name = {k.name: k for k in kernels}
        wrapper = WrapperWriter(
            loop_graph, steps, by_name, poison=config.debug, input_symbols=symbols, check=check
        ).generate()
    # write: sources to the cache dir (content-addressed)
    with timed("write", timings):
        graph = CompiledGraph(gm, kernels, wrapper)
        graph.write()
    if check:
        graph.checker = region_checker(gm, loop_graph, steps)
    stats.COUNTERS["kernels"] += len(kernels)
    for k in kernels:
        output_code_log.info("kernel %s written to %s\n%s", k.name, graph.kernel_paths[k.name], k.source)
    output_code_log.info("wrapper written to %s\n%s", graph.wrapper_path, wrapper)
    for node in gm.graph.nodes:
        if node.op == "get_attr" and isinstance(getattr(gm, node.target), torch.fx.GraphModule):
            graph.subgraphs[node.target] = compile_graph(getattr(gm, node.target), timings, [], check)[2]
    return loop_graph, steps, graph


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


def run_program(program: CompiledProgram, flat_user: list[Any], sizes: tuple) -> Any:
    """Run one call: `sizes` are the size symbols' values the entry's guard bound."""
    captured = program.captured
    flat_out = program.graph.run(captured.graph_inputs(flat_user), sizes)
    return captured.finish(flat_user, flat_out)
