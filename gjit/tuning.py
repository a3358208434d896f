"""On a GPU, a measured choice at compile time: each template kernel's tile configuration, then the
template program against the same graph with every matmul an ATen extern.

Codegen emits a template kernel (kernels/matmul.py, kernels/attention.py) in the first of its
configurations: the table's pick for the example sizes. With CUDA example inputs and
`gjit.config.tune` on, the compile then

1. runs the program once on the example inputs, keeping the arguments of the first launch of
   each distinct template kernel and what it wrote (the tensors themselves: no copies);
2. per distinct kernel (the layers of a model share theirs), times the first configuration on the
   kept arguments; one that runs for at least MIN_KERNEL_MS is emitted in each other configuration,
   launched on the same arguments, rejected where its output differs from the first's beyond
   rounding (or it does not build), else timed; the fastest is kept;
3. rebuilds the program with each kernel's fastest configuration and, where its template kernels
   (every layer's) run for at least MIN_PROGRAM_MS together, times it against the program compiled with every
   matmul an ATen extern (each replayed from a CUDA graph where it can be captured: kernel time,
   not launch overhead), keeping the faster.

The figures go to GJIT_LOGS=tuning and to `explain`'s matmul lines; the on-disk cache stores the
tuned program (its key names the device), so a warm start measures nothing. Kernel times are
medians of triton.testing.do_bench; on the CPU nothing is measured (kernel times there would be
the interpreter's; tests/test_tuning.py runs the decisions there with given times). Figures from
an H200: docs/bench.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import sympy
import torch

from gjit import logs, progress
from gjit.codegen.common import KernelSource
from gjit.codegen.share import code_text
from gjit.fusion import Region, Step
from gjit.runtime import interpret as interpret_libdevice
from gjit.runtime.graph import KERNEL_PRELUDE, CompiledGraph, load_kernel, write_source

log = logs.logger("tuning")

MIN_KERNEL_MS = 0.02  # below this a kernel is launch-bound: its tiles hardly matter
MIN_PROGRAM_MS = 0.05  # template kernels' time (all of a call's) below which ATen is not tried


def bench(fn: Callable[[], Any], program: bool = False) -> float:
    """Median milliseconds of `fn` on the GPU (tests replace this). A `program` (a whole graph,
    several launches) is timed replayed from a CUDA graph where it can be captured: its kernels'
    time, not the host's time to launch them, which a cached call pays either way."""
    from triton.testing import do_bench, do_bench_cudagraph

    if program:
        try:
            return float(do_bench_cudagraph(fn, rep=10, return_mode="median"))
        except Exception as e:  # not capturable (a host sync, say): timed launch by launch
            torch.cuda.synchronize()
            log.info("timing the program without a CUDA graph: %s", first_line(e))
    # a few milliseconds each: every template kernel of a cold compile is timed at least once
    return float(do_bench(fn, warmup=1, rep=5, return_mode="median"))


@dataclasses.dataclass
class Launch:
    """One launch of a kernel, kept: the tensors it read, fresh tensors a configuration writes, its
    size arguments, and what it wrote (the reference a configuration's result is compared with)."""

    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    sizes: list[int]  # the kernel's size arguments
    written: list[torch.Tensor]
    values: dict[sympy.Symbol, int]  # every size symbol's value in this call


@dataclasses.dataclass
class Tuned:
    """The outcome: the graph to run, the schedule it came from, and one line per decision."""

    graph: CompiledGraph
    analysis: tuple[Any, list[Step]] | None  # (loop graph, schedule) of the ATen program; None: the given
    lines: list[str]


def tune(
    graph: CompiledGraph,
    steps: list[Step],
    emit: Callable[[Region, int], KernelSource],
    rebuild: Callable[[], CompiledGraph],
    aten: Callable[[], tuple[Any, list[Step], CompiledGraph]] | None,
    graph_inputs: list[Any],
    sizes: tuple,
    symbols: list[sympy.Symbol],
) -> Tuned:
    """The measured choice for `graph` (its template regions in `steps`) run on `graph_inputs`
    with `sizes` (the values of `symbols`): `emit(region, index)` is the region's kernel in
    configuration `index`, `rebuild()` the program over the regions' chosen configurations,
    `aten()` the graph compiled with matmuls as externs (None: no such alternative). Torch's
    random number generators are left as they were: the user's call draws what eager would."""
    regions = [s for s in steps if isinstance(s, Region) and s.matmul]
    devices = [t.device for t in graph_inputs if isinstance(t, torch.Tensor) and t.is_cuda][:1]
    with torch.random.fork_rng(devices=devices):
        keys, launches = record(
            graph, {r.name for r in regions}, graph_inputs, sizes, dict(zip(symbols, sizes))
        )
        lines, total = configure(regions, graph, keys, launches, emit)
        if any(r.config for r in regions):
            graph = rebuild()
        if aten is None or total < MIN_PROGRAM_MS:
            return Tuned(graph, None, lines)
        return against_aten(graph, aten, graph_inputs, sizes, lines)


def configure(
    regions: list[Region],
    graph: CompiledGraph,
    keys: dict[str, str],
    launches: dict[str, Launch],
    emit: Callable,
) -> tuple[list[str], float]:
    """Each template region's fastest configuration (set on the region, measured once per
    distinct kernel); the decisions' lines and the chosen kernels' ms, every layer's."""
    by_name = {k.name: k for k in graph.kernels}
    lines: list[str] = []
    total = 0.0
    chosen: dict[str, tuple[int, float]] = {}  # kernel code and sizes -> (configuration, ms)
    distinct = len({keys[r.name] for r in regions if keys.get(r.name) in launches})
    for region in regions:
        key = keys.get(region.name)
        if key in chosen:  # another layer's kernel
            region.config = chosen[key][0]
            total += chosen[key][1]
            continue
        launch = launches.pop(key, None)  # measured once: its tensors go when it has been
        if launch is None:  # not launched (an empty tensor), or it writes what it reads
            continue
        progress.tuning(len(chosen), distinct)
        config, ms, line = choose(region, by_name[region.name], launch, emit)
        chosen[key], region.config = (config, ms), config
        progress.tuning(len(chosen), distinct)
        total += ms
        lines.append(line)
        log.info("%s", line)
    return lines, total


def against_aten(
    graph: CompiledGraph, aten: Callable, graph_inputs: list[Any], sizes: tuple, lines: list[str]
) -> Tuned:
    """The tuned program or the one with every matmul an ATen extern, whichever runs faster."""
    aten_loop_graph, aten_steps, aten_graph = aten()
    # on the call's own inputs: a program only reads them, but for the index writes gjit makes in
    # place (a KV cache's), which write the same values each run (gjit/in_place.py)
    t_template = bench(lambda: graph.run(graph_inputs, sizes), program=True)
    t_aten = bench(lambda: aten_graph.run(graph_inputs, sizes), program=True)
    keep = t_template <= t_aten
    line = f"program: templates {t_template:.3f} ms, every matmul an ATen extern {t_aten:.3f} ms: " + (
        "kept the templates" if keep else "ATen is faster, it runs the matmuls"
    )
    log.info("%s", line)
    lines = [*lines, line]
    return Tuned(graph, None, lines) if keep else Tuned(aten_graph, (aten_loop_graph, aten_steps), lines)


def same_kernel_key(kernel: KernelSource, sizes: list[int]) -> str:
    """What two kernels that compute alike at these sizes (of their size arguments) share: the
    code (not its comments, which name the nodes) with the kernel and size-symbol names replaced
    by positions, and the sizes."""
    values = dict(zip(map(str, kernel.size_args), sizes))
    # comments (the header, a statistics loop's) name nodes; the def line lists sizes by name
    body = "\n".join(ln for ln in code_text(kernel.source, {}).splitlines() if not ln.startswith("def "))
    order = list(dict.fromkeys(t for t in re.findall(r"\w+", body) if t in values))
    names = {s: f"size{i}" for i, s in enumerate(order)}
    return code_text(body, names) + str([values[s] for s in order])


def choose(region: Region, kernel: KernelSource, launch: Launch, emit: Callable) -> tuple[int, float, str]:
    """(configuration, ms, the decision's line) of one template kernel on its kept launch."""
    try:
        fn = loaded(kernel, launch)
        first = bench(lambda: run_kernel(kernel, launch, fn))
    except Exception as e:  # its sizes not all known here, say: the table's configuration runs
        return (
            0,
            0.0,
            f"{kernel.name}: not tuned ({str(e).splitlines()[0][:80] if str(e) else type(e).__name__})",
        )
    if kernel.configs <= 1 or first < MIN_KERNEL_MS:
        return 0, first, f"{kernel.name}: {describe(kernel)} {first:.3f} ms (too short to tune)"
    best, best_ms, notes = 0, first, [f"{describe(kernel)} {first:.3f}"]
    for index in range(1, kernel.configs):
        candidate = kernel
        try:
            candidate = emit(region, index)
            fn = loaded(candidate, launch)
            for out in launch.outputs:  # what a configuration leaves unwritten shows
                out.fill_(math.nan if out.dtype.is_floating_point else -1)
            run_kernel(candidate, launch, fn)
            differs = mismatch(launch)
            ms = math.inf if differs else bench(functools.partial(run_kernel, candidate, launch, fn))
        except Exception as e:  # a configuration that does not build (shared memory, registers)
            differs, ms = f"does not build: {first_line(e)}", math.inf
        label = describe(candidate) if candidate is not kernel else f"configuration {index}"
        notes.append(f"{label} " + (differs or f"{ms:.3f}"))
        if differs == "computes something else":  # a codegen bug in that configuration
            log.warning("gjit: %s %s %s; not used", kernel.name, describe(candidate), differs)
        if ms < best_ms:
            best, best_ms = index, ms
    region.config = 0
    return best, best_ms, f"{kernel.name}: ms by tiles: {', '.join(notes)}; chose configuration {best}"


def first_line(e: Exception) -> str:
    return str(e).splitlines()[0][:80] if str(e) else type(e).__name__


def describe(kernel: KernelSource) -> str:
    """A configuration in a few characters: the tile sizes, warps and stages."""
    tiles = "x".join(str(v) for b, v in kernel.blocks.items() if b in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
    stages = f"/s{kernel.num_stages}" if kernel.num_stages is not None else ""
    return f"[{tiles} w{kernel.num_warps}{stages}]"


def loaded(kernel: KernelSource, launch: Launch) -> Any:
    """The kernel's @triton.jit function: compiled for the launch's device, else interpreted."""
    path = write_source("kernels", kernel.name, KERNEL_PRELUDE + kernel.source)
    return load_kernel(path, kernel.name, interpret=not launch.inputs[0].is_cuda)


def run_kernel(kernel: KernelSource, launch: Launch, fn: Any) -> None:
    """Launch `fn` (`kernel`, in some configuration) on the kept arguments; its output tensors
    are fresh each time: the kept inputs never change."""
    values = launch.values | dict(zip(kernel.size_args, launch.sizes))
    xnumel = int(sympy.sympify(kernel.numel).subs(values))
    options = dict(kernel.blocks, num_warps=kernel.num_warps)
    if kernel.num_stages is not None:
        options["num_stages"] = kernel.num_stages
    grid = (math.ceil(xnumel / kernel.blocks.get("XBLOCK", 1)),)
    on_device = launch.inputs[0].is_cuda
    with contextlib.nullcontext() if on_device else interpret_libdevice.stdlib_interpreted():
        fn[grid](*launch.inputs, *launch.outputs, *launch.sizes, xnumel, **options)


def mismatch(launch: Launch) -> str:
    """'' when the outputs hold what the first configuration wrote, up to rounding."""
    for out, ref in zip(launch.outputs, launch.written):
        if not ref.dtype.is_floating_point:
            same = torch.equal(out, ref)
        else:
            tol = 1e-4 if ref.dtype in (torch.float32, torch.float64) else 3e-2
            scale = ref.double().nan_to_num(0, 0, 0).abs().amax().item() if ref.numel() else 0.0
            diff = (out.double() - ref.double()).nan_to_num(0, 0, 0).abs() if ref.numel() else ref.double()
            same = torch.equal(out.isnan(), ref.isnan()) and bool((diff <= tol * max(scale, 1.0)).all())
        if not same:
            return "computes something else"
    return ""


def record(
    graph: CompiledGraph, names: set[str], graph_inputs: list[Any], sizes: tuple, values: dict
) -> tuple[dict[str, str], dict[str, Launch]]:
    """Run `graph` once; of the kernels in `names`, (each one's same_kernel_key, the first launch
    per key whose outputs share no memory with its inputs). A launch keeps the graph's inputs it
    reads as they are (the model's weights are not duplicated: the program only reads them, but
    for gjit's in-place index writes, which write the same values each run) and copies of the
    intermediates it reads and of what it wrote (the reference a configuration is compared with)."""
    keys: dict[str, str] = {}
    kept: dict[str, Launch] = {}
    by_name = {k.name: k for k in graph.kernels}
    given = {storage(t) for t in graph_inputs if isinstance(t, torch.Tensor)}

    def probe(name: str, kernel: Any) -> Any:
        if name not in names:
            return kernel
        source = by_name[name]
        ins, outs = len(source.in_args), len(source.out_args)

        class Probe:
            def __getitem__(self, grid: Any) -> Callable:
                def launch(*args: Any, **kwargs: Any) -> Any:
                    inputs, outputs = list(args[:ins]), list(args[ins : ins + outs])
                    size_args = [int(a) for a in args[ins + outs : ins + outs + len(source.size_args)]]
                    key = keys.setdefault(name, same_kernel_key(source, size_args))
                    read = {storage(t) for t in inputs}
                    keep = key not in kept and not any(storage(t) in read for t in outputs)
                    # the graph's inputs (weights) as they are; intermediates copied before, outputs
                    # after: a later step may write into either in place
                    if keep:
                        inputs = [t if storage(t) in given else t.clone() for t in inputs]
                    result = kernel[grid](*args, **kwargs)
                    if keep:
                        written = [t.clone() for t in outputs]
                        fresh = [torch.empty_like(t) for t in outputs]
                        kept[key] = Launch(inputs, fresh, size_args, written, values)
                    return result

                return launch

        return Probe()

    if graph.on_cuda and not graph.prebuilt:  # the builds start before the probes wrap the kernels
        graph.prebuild(graph.call_fn(interpret=False), graph_inputs, sizes)
    with kernels_wrapped(graph, probe):
        graph.run(graph_inputs, sizes)
    return keys, kept


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@contextlib.contextmanager
def kernels_wrapped(graph: CompiledGraph, wrap: Callable[[str, Any], Any]) -> Iterator[None]:
    """Within, the device wrapper of `graph` launches `wrap(name, kernel)` for each Triton kernel."""
    call = graph.call_fn(interpret=not graph.on_cuda)
    namespace = inspect.unwrap(call).__globals__
    saved = {k.name: namespace[k.name] for k in graph.kernels if k.backend != "cuda"}
    namespace.update({name: wrap(name, kernel) for name, kernel in saved.items()})
    try:
        yield
    finally:
        namespace.update(saved)
