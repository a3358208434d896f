"""On a GPU, the measurements of a compile: a template kernel in each of its tile configurations,
and the pieces of the library's alternative (gjit/choice/ decides with them).

Codegen emits a template kernel (kernels/matmul.py, kernels/attention.py) in the first of its
configurations: the table's pick for the example sizes. With CUDA example inputs and
`gjit.config.tune` on, the compile

1. runs the program once on the example inputs (`record`), keeping the arguments of the first
   launch of each distinct kernel and what it wrote (the graph's inputs as they are: no copies
   of the weights), and, in the program with every matmul an ATen extern, the arguments of each
   extern call of a product;
2. per distinct template kernel (the layers of a model share theirs), times the first
   configuration on the kept arguments (`first_time`); later (`explore`, from where an earlier
   compile's record stopped), one that runs for at least MIN_KERNEL_MS is emitted in each other
   configuration while the budget lasts (`Budget`: a share of the cold compile), launched on the
   same arguments, rejected where its output differs from the first's beyond rounding (or it does
   not build), else timed; the fastest is kept. An extern call or a kernel of the library's side
   is timed the same way, on its kept arguments.

Kernel times are medians of triton.testing.do_bench (`bench`); on the CPU nothing is measured
(kernel times there would be the interpreter's; tests/test_tuning.py and tests/test_choice.py
run the decisions there with given times). Figures from an H200: docs/bench.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import sympy
import torch

from gjit import ir, logs
from gjit.codegen.common import KernelSource
from gjit.codegen.share import code_text
from gjit.fusion.regions import Region
from gjit.runtime import interpret as interpret_libdevice
from gjit.runtime.graph import CompiledGraph, load_kernel, write_kernel
from gjit.wrapper import BINDINGS, PADDED_PRODUCTS, WRITTEN_OUT, binding

log = logs.logger("tuning")

MIN_KERNEL_MS = 0.02  # below this a kernel is launch-bound: its tiles, and the library, hardly matter


def bench(fn: Callable[[], Any], what: str) -> float:
    """Median milliseconds of `fn` on the GPU (tests replace this; `what` names the kernel or
    extern call and its configuration, for them and for nothing else)."""
    from triton.testing import do_bench

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
    # the launch as the wrapper made it (`replay`): the kernel it launched, its grid, the
    # arguments after the sizes (xnumel, rnumel) and the keywords (blocks, warps, stages)
    kernel: Any = None
    grid: Any = None
    rest: list = dataclasses.field(default_factory=list)
    keywords: dict = dataclasses.field(default_factory=dict)


def same_kernel_key(kernel: KernelSource, sizes: list[int]) -> str:
    """What two kernels that compute alike at these sizes (of their size arguments) share: the
    code (not its comments, which name the nodes) with the kernel and size-symbol names replaced
    by positions, and the sizes."""
    code, ordered = same_kernel_parts(kernel, sizes)
    return code + str(ordered)


def same_kernel_parts(kernel: KernelSource, sizes: list[int]) -> tuple[str, list[int]]:
    """same_kernel_key's code and its sizes, in the order the code names them."""
    values = dict(zip(map(str, kernel.size_args), sizes))
    # comments (the header, a statistics loop's) name nodes; the def line lists sizes by name
    body = "\n".join(ln for ln in code_text(kernel.source, {}).splitlines() if not ln.startswith("def "))
    order = list(dict.fromkeys(t for t in re.findall(r"\w+", body) if t in values))
    names = {s: f"size{i}" for i, s in enumerate(order)}
    return code_text(body, names), [values[s] for s in order]


class Budget:
    """The seconds tuning may take in one compile: `share` of the cold compile (0.2: tuning at most
    a fifth of it, so a quarter of what the compile took without it; `math.inf`: no limit,
    mode="max-autotune"). `compiled`: the compile's seconds before tuning; the program's first run
    (`not_tuning`: its kernels build for the user's call either way) adds to them and costs nothing."""

    def __init__(self, share: float, compiled: float):
        self.share, self.compiled = share, compiled
        self.start, self.excluded = clock(), 0.0

    @property
    def seconds(self) -> float:
        return math.inf if self.share >= 1 else self.share / (1 - self.share) * self.compiled

    def spent(self) -> float:
        return clock() - self.start - self.excluded

    def left(self) -> bool:
        return self.spent() < self.seconds

    @contextlib.contextmanager
    def not_tuning(self) -> Iterator[None]:
        start = clock()
        try:
            yield
        finally:
            took = clock() - start
            self.excluded += took
            self.compiled += took

    def text(self) -> str:
        if math.isinf(self.seconds):
            return f"{self.spent():.2f} s, without a budget (mode max-autotune, or GJIT_TUNE_BUDGET 1)"
        share = f"{self.share:.0%} of the cold compile"
        return f"{self.spent():.2f} s of a budget of {self.seconds:.2f} s ({share})"


def clock() -> float:
    """Seconds, for budgets (tests replace it)."""
    return time.perf_counter()


def first_time(kernel: KernelSource, launch: Launch, label: str) -> tuple[float | None, str]:
    """(ms, the line) of a template kernel in the configuration it was emitted in (its table's)
    on its kept launch; ms None when it could not be timed."""
    try:
        fn = loaded(kernel, launch)
        first = bench(launcher(kernel, launch, fn), f"{label} configuration 0")
    except Exception as e:  # its sizes not all known here, say: the table's configuration runs
        return None, f"{kernel.name}: not tuned ({first_line(e)})"
    if kernel.configs <= 1 or first < MIN_KERNEL_MS:
        why = "its one configuration" if kernel.configs <= 1 else "too short to tune"
        return first, f"{kernel.name}: {describe(kernel)} {first:.3f} ms ({why})"
    return first, f"{kernel.name}: ms by tiles: {describe(kernel)} {first:.3f}"


@dataclasses.dataclass
class Explored:
    """How far a template kernel's configurations were tried: 0 .. tried-1, the best of them."""

    config: int
    ms: float
    tried: int
    line: str


def explore(region: Region, kernel: KernelSource, launch: Launch, emit: Callable, label: str,
            start: Explored, more: Callable[[], bool]) -> Explored:  # fmt: skip
    """The configurations after `start.tried` on the kept launch while `more()`: each emitted,
    launched, rejected where its output differs from configuration 0's beyond rounding (or it
    does not build), else timed; the fastest kept. A kernel under MIN_KERNEL_MS is not tuned."""
    if start.ms < MIN_KERNEL_MS:
        return dataclasses.replace(start, tried=kernel.configs)
    best, notes = dataclasses.replace(start), []
    for index in range(start.tried, kernel.configs):
        if not more():
            notes.append("the rest not tried: over the tuning budget")
            break
        candidate = kernel
        try:
            candidate = emit(region, index)
            differs, ms = other_arguments(candidate, kernel), math.inf
            if not differs:
                fn, differs = run_checked(candidate, launch)
            if not differs:
                ms = bench(launcher(candidate, launch, fn), f"{label} configuration {index}")
        except Exception as e:  # a configuration that does not build (shared memory, registers)
            differs, ms = f"does not build: {first_line(e)}", math.inf
        name = describe(candidate) if candidate is not kernel else f"configuration {index}"
        notes.append(f"{name} " + (differs or f"{ms:.3f}"))
        if differs == "computes something else":  # a codegen bug in that configuration
            log.warning("gjit: %s %s %s; not used", kernel.name, describe(candidate), differs)
        best.tried = index + 1
        if ms < best.ms:
            best.config, best.ms = index, ms
    region.config = 0
    if notes:
        best.line = f"{start.line}, {', '.join(notes)}"
    if best.tried >= kernel.configs and kernel.configs > 1 and "chose" not in best.line:
        best.line += f"; chose configuration {best.config}"
    return best


def computes_the_same(
    region: Region, kernel: KernelSource, launch: Launch, emit: Callable, index: int
) -> str:
    """'' when configuration `index` of the region's kernel (`kernel`: as emitted) writes, on the
    kept launch, what the emitted one wrote (up to rounding); else why not (an earlier compile's
    choice checked here)."""
    try:
        candidate = emit(region, index)
        return other_arguments(candidate, kernel) or run_checked(candidate, launch)[1]
    except Exception as e:  # noqa: BLE001 - it does not build here: not used
        return f"does not build: {first_line(e)}"
    finally:
        region.config = 0


def other_arguments(candidate: KernelSource, kernel: KernelSource) -> str:
    """'' when a configuration takes the arguments the emitted kernel takes, in its order (a kept
    launch passes those); else why it is not launched. A template's configurations differ in tile
    constants only; a row kernel's persistent one is other code, whose pointers follow its loads."""
    mine = (candidate.in_args, candidate.out_args, candidate.size_args)
    if mine != (kernel.in_args, kernel.out_args, kernel.size_args):
        return "takes other arguments"
    return ""


def run_checked(kernel: KernelSource, launch: Launch) -> tuple[Any, str]:
    """`kernel` (a configuration) loaded and run once on the kept launch into poisoned outputs (what
    it leaves unwritten shows): its function, and '' or how its output differs from the first's."""
    fn = loaded(kernel, launch)
    for out in launch.outputs:
        out.fill_(math.nan if out.dtype.is_floating_point else -1)
    run_kernel(kernel, launch, fn)
    return fn, mismatch(launch)


def device_name(launch: Launch) -> str:
    """The GPU a kept launch ran on, by name (a tuning record's)."""
    tensor = next(iter(launch.inputs or launch.outputs), None)
    if tensor is None or not tensor.is_cuda:
        return "cpu"
    return torch.cuda.get_device_name(tensor.device)


def first_line(e: Exception) -> str:
    return str(e).splitlines()[0][:80] if str(e) else type(e).__name__


def describe(kernel: KernelSource) -> str:
    """A configuration in a few characters: the tile sizes, warps and stages (a row kernel's: looped
    or persistent, rows by elements)."""
    if kernel.rnumel is not None and "RBLOCK" in kernel.blocks:
        shape = "persistent" if kernel.persistent else "looped"
        return f"[{shape} {kernel.blocks.get('XBLOCK', 1)}x{kernel.blocks['RBLOCK']} w{kernel.num_warps}]"
    tiles = "x".join(str(v) for b, v in kernel.blocks.items() if b in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
    stages = f"/s{kernel.num_stages}" if kernel.num_stages is not None else ""
    return f"[{tiles} w{kernel.num_warps}{stages}]"


def loaded(kernel: KernelSource, launch: Launch) -> Any:
    """The kernel's @triton.jit function: compiled for the launch's device, else interpreted."""
    path = write_kernel(kernel)
    return load_kernel(path, kernel.name, interpret=not launch.inputs[0].is_cuda)


def run_kernel(kernel: KernelSource, launch: Launch, fn: Any) -> None:
    """Launch `fn` (`kernel`, in some configuration) on the kept arguments once."""
    launcher(kernel, launch, fn)()


def launcher(kernel: KernelSource, launch: Launch, fn: Any) -> Callable[[], None]:
    """The launch of `fn` (`kernel`, in some configuration) on the kept arguments, its grid and
    arguments computed here, once: what `bench` times is the launch alone. (Evaluating the
    kernel's size expressions with sympy takes 0.1-0.4 ms of host time; inside the timed call
    the GPU waited for it, and a 0.05 ms attention kernel measured 0.26 ms on an H200.) Its
    output tensors are the launch's own each time: the kept inputs never change."""
    values = launch.values | dict(zip(kernel.size_args, launch.sizes))
    xnumel = int(ir.at_values(kernel.numel, values))
    options = dict(kernel.blocks, **kernel.launch_options())
    grid = (math.ceil(xnumel / kernel.blocks.get("XBLOCK", 1)),)
    numels = [xnumel]
    if kernel.ynumel is not None:  # a 2-D tile's programs, in one grid dim
        ynumel = int(ir.at_values(kernel.ynumel, values))
        grid = (grid[0] * math.ceil(ynumel / kernel.blocks["YBLOCK"]),)
        numels.append(ynumel)
    elif kernel.rnumel is not None and "RBLOCK" in kernel.blocks:  # a row kernel's row length
        numels.append(int(ir.at_values(kernel.rnumel, values)))
    args = (*launch.inputs, *launch.outputs, *launch.sizes, *numels)
    if launch.inputs[0].is_cuda:
        return functools.partial(fn[grid], *args, **options)

    def interpreted() -> None:
        with interpret_libdevice.stdlib_interpreted():
            fn[grid](*args, **options)

    return interpreted


def replay(launch: Launch) -> None:
    """The kept launch again, as the wrapper made it, writing fresh outputs."""
    on_device = launch.inputs[0].is_cuda if launch.inputs else launch.outputs[0].is_cuda
    with contextlib.nullcontext() if on_device else interpret_libdevice.stdlib_interpreted():
        args = (*launch.inputs, *launch.outputs, *launch.sizes, *launch.rest)
        launch.kernel[launch.grid](*args, **launch.keywords)


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
    graph: CompiledGraph,
    names: set[str],
    graph_inputs: list[Any],
    sizes: tuple,
    values: dict,
    calls: dict[Any, Callable[[Callable, tuple, dict], None]] | None = None,
) -> tuple[dict[str, str], dict[str, Launch]]:
    """Run `graph` once; of the kernels in `names`, (each one's same_kernel_key, the first launch
    per key whose outputs share no memory with its inputs). A launch keeps the graph's inputs it
    reads as they are (the model's weights are not duplicated: the program only reads them, but
    for gjit's in-place index writes, which write the same values each run) and copies of the
    intermediates it reads and of what it wrote (the reference a configuration is compared with).
    `calls`: ATen ops -> a function each of the wrapper's calls of that op is handed to, in
    order, as (the function called, args, kwargs)."""
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
                    rest = list(args[ins + outs + len(source.size_args) :])  # xnumel (rnumel)
                    key = keys.setdefault(name, same_kernel_key(source, size_args) + str(rest))
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
                        made = (kernel, grid, rest, kwargs)
                        kept[key] = Launch(inputs, fresh, size_args, written, values, *made)
                    return result

                return launch

        return Probe()

    if graph.on_cuda and not graph.prebuilt:  # the builds start before the probes wrap the kernels
        graph.prebuild(graph.call_fn(interpret=False), graph_inputs, sizes)
    with kernels_wrapped(graph, probe), aten_calls_recorded(graph, calls or {}):
        graph.run(graph_inputs, sizes)
    return keys, kept


@contextlib.contextmanager
def aten_calls_recorded(
    graph: CompiledGraph, calls: dict[Any, Callable[[Callable, tuple, dict], None]]
) -> Iterator[None]:
    """Within, the device wrapper's calls of the ATen ops in `calls` (the wrapper calls
    `aten.<op>.<overload>(...)` or torch's binding of the op (`gjit.wrapper.BINDINGS`), or for a
    padded product gjit/runtime/padded_mm.py's function, or for written-out attention
    gjit/runtime/attention_masks.py's `written_out` with the op) are handed, as (the function
    called, args, kwargs), to the op's function first."""
    if not calls:
        yield
        return
    namespace = inspect.unwrap(graph.call_fn(interpret=not graph.on_cuda)).__globals__
    real, real_torch = namespace["aten"], namespace["torch"]
    padded = {name: (op, namespace[name]) for op, name in PADDED_PRODUCTS.items() if op in calls}
    bound = {BINDINGS[op]: op for op in calls if op in BINDINGS}  # "torch.mm": aten.mm.default
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    written_out = namespace.get(WRITTEN_OUT)

    def recorded(op: Any, fn: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[op](fn, args, kwargs)
            return fn(*args, **kwargs)

        return call

    def written_out_recorded(op: Any, *args: Any, **kwargs: Any) -> Any:
        """The whole call (the output's layout copy, its rows without keys) as the op's cost."""
        fn = functools.partial(written_out, binding(sdpa))
        calls[sdpa](fn, args, kwargs)
        return fn(*args, **kwargs)

    class Packet:
        def __init__(self, packet: Any):
            self.packet = packet

        def __getattr__(self, overload: str) -> Any:
            op = getattr(self.packet, overload)
            return recorded(op, op) if op in calls else op

    class Ops:
        def __getattr__(self, name: str) -> Any:
            return Packet(getattr(real, name))

    class Module:
        """torch (or one of its modules, at `path`) as the wrapper reads it: the bindings recorded."""

        def __init__(self, path: str, module: Any):
            self.path, self.module = path, module

        def __getattr__(self, name: str) -> Any:
            path, value = f"{self.path}.{name}", getattr(self.module, name)
            if path in bound:
                return recorded(bound[path], value)
            return Module(path, value) if any(b.startswith(f"{path}.") for b in bound) else value

    namespace["aten"] = Ops()
    namespace["torch"] = Module("torch", real_torch)
    namespace.update({name: recorded(op, fn) for name, (op, fn) in padded.items()})
    if sdpa in calls and written_out is not None:
        namespace[WRITTEN_OUT] = written_out_recorded
    try:
        yield
    finally:
        namespace["aten"], namespace["torch"] = real, real_torch
        namespace.update({name: fn for name, (_, fn) in padded.items()})
        if written_out is not None:
            namespace[WRITTEN_OUT] = written_out


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
