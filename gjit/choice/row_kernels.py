"""Looped or persistent, per row kernel, measured: a reduction over rows a little longer than a
tile (past `persistent_max`, at most codegen/triton/tiles.py's MEASURED_PERSISTENT elements, of a
static length) is emitted looped, its table's choice (chunks of 2048 over 8 warps; the second pass
over a row finds it in L2), and tuning times it persistent too (the whole row in registers over up
to 16 warps: one pass over memory, but fewer rows in flight a multiprocessor). Which wins depends on
the card, the row and what the kernel computes: on an H200 (docs/bench.md, 2026-11-28) a float32
layer norm over rows of 8192 took 0.322 ms looped and 0.262 persistent (torch.compile's 0.254),
and a table that made every row up to 8192 persistent would change softmaxes and RMS norms that
were never measured so.

After the template choice (`measure.measured`), on the program it chose: the program is run once,
keeping each distinct row kernel's first launch (the layers of a model share one); each, heaviest
first while the tuning budget lasts, is timed looped, then persistent (checked to compute the
same), and the faster kept, or an earlier compile's record of both taken
(gjit/runtime/tuning_store.py, shared through the remote cache as template records are; its key
has the launch's rows and row length, which a static row kernel's code does not name). A kernel
under MIN_KERNEL_MS stays looped: launch-bound, its loop hardly matters. Where a configuration
other than the table's won, the program is built again with it; the kernels are what the entry
stores (disk cache, package, remote cache), and each decision's line is in the entry's tuning lines
(`gjit.explain`'s `row_kernels`). A failure here (a configuration that does not build is only not
chosen; this is the rest: memory for the kept launches, say) leaves every row kernel looped and the
template choice as it was made.

Not done: the template choice before this step weighs a template against the library's side with
that side's row kernels looped (gjit/choice/library.py); a norm that goes persistent afterwards
makes the library's side a little faster than it was weighed."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

from gjit import stats, tuning
from gjit.choice.library import Call
from gjit.codegen.common import KernelSource
from gjit.fusion.regions import Region, Step
from gjit.ir import LoopGraph
from gjit.runtime import tuning_store
from gjit.runtime.graph import ROW_KERNEL, CompiledGraph

log = tuning.log
Program = tuple[LoopGraph, list[Step], CompiledGraph]


def row_regions(steps: list[Step], kernels: list[KernelSource]) -> list[Region]:
    """The regions whose kernel tuning may emit looped or persistent (a reduction's, configs > 1)."""
    by_name = {k.name: k for k in kernels}
    rows = [by_name.get(s.name) if isinstance(s, Region) else None for s in steps]
    return [s for s, k in zip(steps, rows) if k is not None and k.configs > 1 and k.rnumel is not None]


def measured(program: Program, builder: Any, call: Call, first: bool) -> Program:
    """`program` with each row kernel (above) in its measured configuration; the decisions' lines
    added to its graph's tuning lines. `builder`: gjit/choice/measure.py's (its budget, `emit` and
    `build`); `first`: the program has not run yet, so its run here builds the kernels the user's
    call would build anyway, which is not tuning's time."""
    loop_graph, steps, graph = program
    regions = row_regions(steps, graph.kernels)
    if not regions:
        return program
    budget = builder.budget
    if not budget.left():
        names = ", ".join(r.name for r in regions)
        line = f"{ROW_KERNEL}{names}: looped (the table's): not measured: over the tuning budget"
        log.info("%s", line)
        graph.tuning = [*graph.tuning, line]
        return program
    with budget.not_tuning() if first else contextlib.nullcontext():
        keys, launches = tuning.record(graph, {r.name for r in regions}, call.inputs, call.sizes, call.values)
    by_name = {k.name: k for k in graph.kernels}
    emit = functools.partial(builder.emit, loop_graph, steps)
    alike: dict[str | None, list[Region]] = {}  # same_kernel_key (code, sizes, numels) -> its regions
    for region in regions:
        alike.setdefault(keys.get(region.name), []).append(region)
    unlaunched = alike.pop(None, [])
    lines = [f"{ROW_KERNEL}{r.name}: not launched at these sizes: looped (the table's)" for r in unlaunched]
    # heaviest first: the elements each one's launch reads, as a measure of its time
    for key, group in sorted(alike.items(), key=lambda kv: -_elements(launches.get(kv[0]))):
        head = group[0]
        config, line = _decide(head, by_name[head.name], launches.pop(key, None), emit, budget)
        more = f" (and {len(group) - 1} more alike)" if len(group) > 1 else ""
        lines.append(f"{ROW_KERNEL}{line}{more}")
        log.info("%s", lines[-1])
        for region in group:
            region.config = config
    if not any(r.config for r in regions):
        graph.tuning = [*graph.tuning, *lines]
        return program
    rebuilt = builder.build(loop_graph, steps, graph.templates)  # (its lines only once it is built)
    rebuilt.tuning = [*graph.tuning, *lines]
    return loop_graph, steps, rebuilt


def _elements(launch: tuning.Launch | None) -> int:
    return sum(t.numel() for t in launch.inputs) if launch is not None else 0


def _decide(region: Region, kernel: KernelSource, launch: tuning.Launch | None, emit: Callable,
            budget: tuning.Budget) -> tuple[int, str]:  # fmt: skip
    """(the configuration, the line saying why) for one distinct row kernel. Its record's key has
    the launch's rows and row length besides its size arguments: a row kernel's code names
    neither where they are static, and the choice depends on both."""
    name = region.name
    if launch is None:
        return 0, f"{name}: it writes what it reads: looped (the table's), not measured"
    code, sizes = tuning.same_kernel_parts(kernel, launch.sizes)
    numels = [int(n) for n in launch.rest]  # xnumel, rnumel
    record = tuning_store.record_key(code, [*sizes, *numels], tuning.device_name(launch))
    found = tuning_store.lookup(record)
    if found is not None and found.configs == kernel.configs and found.complete:
        differs = tuning.computes_the_same(region, kernel, launch, emit, found.config) if found.config else ""
        if not differs:
            stats.count("tuning_records_reused")
            measured_as = found.line.partition(": ")[2] or found.line  # it names the kernel it measured
            return found.config, f"{name}: {measured_as} (an earlier compile's measurements)"
    if not budget.left():
        stats.count("tuning_over_budget")
        return 0, f"{name}: looped (the table's): not measured: over the tuning budget"
    ms, line = tuning.first_time(kernel, launch, f"{ROW_KERNEL}{name}")
    if ms is None:
        return 0, line
    start = tuning.Explored(0, ms, 1, line.replace("ms by tiles", "ms looped or persistent"))
    explored = tuning.explore(region, kernel, launch, emit, f"{ROW_KERNEL}{name}", start, more=budget.left)
    if explored.tried >= kernel.configs and ms >= tuning.MIN_KERNEL_MS:
        tuned = (explored.config, explored.ms, explored.tried, kernel.configs, explored.line)
        tuning_store.store(record, tuning_store.Tuned(*tuned), replace=found is not None)
    return explored.config, explored.line
