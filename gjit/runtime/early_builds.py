"""On a GPU: each kernel's build started as codegen writes it, before the program is whole.

The first call's prebuild (gjit/runtime/prebuild.py) knows each launch exactly, but only once the
whole program is written: codegen of every region, the wrapper, the guards and, where a choice is
measured, tuning all come before it. Here each Triton kernel is taken as codegen emits it:

1. written to its file (content-addressed: the path `CompiledGraph.write` gives it later) and
   imported;
2. launched in thought at the example's sizes: each pointer 16-byte aligned unless its tensor's
   traced storage offset says otherwise (the caching allocator aligns every allocation), each size
   its example value; Triton's launcher specializes that launch as it would the real one
   (`prebuild.specializations`);
3. what Triton's on-disk cache lacks is fetched from the fleet's remote cache, or handed to
   `gjit.config.compile_workers` forked workers, which write it into Triton's cache.

A kernel whose code an earlier kernel of the graph has (codegen/share.py: a transformer's later
layers) is that kernel's function launched with its own arguments: one more build only where they
specialize it otherwise.

Nothing here decides a result. The first call's prebuild specializes the real launches, waits for
an early build of the same specialization still running instead of starting it again, and builds
what was predicted wrong; what neither foresaw builds at its launch, as without either.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

import sympy
import torch

from gjit import logs, stats
from gjit.codegen.common import KernelSource
from gjit.codegen.share import code_key
from gjit.codegen.triton.pointwise import POINTER_TYPES
from gjit.config import config
from gjit.ir import LoopGraph
from gjit.lowering.registry import Unsupported, to_sympy
from gjit.runtime import prebuild, remote_cache, triton_binaries
from gjit.runtime.graph import load_kernel, write_kernel
from gjit.wrapper import graph_device

log = logs.logger("cache")

_DTYPES = {name: dtype for dtype, name in POINTER_TYPES.items()}  # Triton's pointee -> torch's dtype


def wanted(graph: LoopGraph) -> bool:
    """Whether `graph`'s kernels will run on a GPU through Triton's launcher, with workers to build
    them (or a remote cache to fetch them from)."""
    device = graph_device(graph.fx_graph.nodes)
    return device.type == "cuda" and not config.interpret


def start(graph: LoopGraph, hints: dict[sympy.Symbol, int], kernels: int) -> EarlyBuilds | None:
    """The early builds of `graph`'s `kernels` kernels at the example's sizes `hints`, or None
    where there is nothing to start (not on a GPU, one worker and no remote cache, prebuilds
    off). Its workers are at most one per kernel: a forked pool starts them all at its first
    build, and a torch.cond branch's or tuning's program of a few kernels opens a pool of its own."""
    if not wanted(graph) or prebuild.unavailable():
        return None
    remote = remote_cache.current()
    if config.compile_workers < 2 and remote is None:
        return None
    workers = max(1, min(config.compile_workers, prebuild.MAX_WORKERS, kernels))
    return EarlyBuilds(graph, hints, workers, remote)


class EarlyBuilds:
    """`add(kernel)` for each kernel codegen emits, `close()` after the last."""

    def __init__(
        self,
        graph: LoopGraph,
        hints: dict[sympy.Symbol, int],
        workers: int,
        remote: remote_cache.RemoteCache | None,
    ):
        self.hints, self.workers, self.remote = hints, workers, remote
        # the traced tensors by the wrapper's names: their storage offsets say their alignment
        self.traced = {graph.aliases.get(n.name, n.name): n.meta.get("val") for n in graph.fx_graph.nodes}
        self.first: dict[tuple, tuple[str, str]] = {}  # code -> (the first kernel with it, its file)
        self.pool: concurrent.futures.ProcessPoolExecutor | None = None
        self.futures: list[concurrent.futures.Future] = []
        self.failed = ""  # why early builds stopped for this graph ('' while they go on)

    def add(self, kernel: KernelSource) -> None:
        """Start `kernel`'s build, unless Triton's cache has it, another build is making it, or its
        launch cannot be foreseen. Never fails the compile."""
        if kernel.backend != "triton" or self.failed:
            return
        try:
            self._add(kernel)
        except Exception as e:  # noqa: BLE001 - an optimization: the first call's prebuild remains
            self.failed = f"{type(e).__name__}: {e}"
            log.info("gjit: early builds stop at %s (%s); the first call prebuilds", kernel.name, self.failed)

    def _add(self, kernel: KernelSource) -> None:
        key = code_key(kernel)
        if key not in self.first:
            self.first[key] = (kernel.name, write_kernel(kernel))
        name, path = self.first[key]
        launch = self.launch(kernel)
        if launch is None:
            return
        fn = load_kernel(path, name, interpret=False)
        for build in prebuild.specializations([launch], {kernel.name: fn}):
            if build.cached or build.entry is None or prebuild.is_building(build.entry):
                continue
            if self.remote is not None and triton_binaries.fetch(self.remote, *build.entry, build.target):
                continue
            if self.pool is None:
                self.pool = prebuild.open_pool(self.workers)
                if self.pool is None:
                    self.failed = "no build worker can start"
                    return
            future = prebuild.submit(self.pool, build, path, self.remote)
            if future is None:
                self.failed = "the build workers did not start"
                return
            self.futures.append(future)
            stats.count("kernels_built_early")

    def launch(self, kernel: KernelSource) -> prebuild.Launch | None:
        """`kernel`'s launch as the wrapper will make it at the example's sizes (pointers as
        stand-ins with their alignment), or None where an argument is not foreseeable."""
        params = [p for p in kernel.signature if p not in kernel.blocks]
        tensors = [*kernel.in_args, *kernel.out_args]
        numels = [e for e in (kernel.numel, kernel.rnumel, kernel.ynumel) if e is not None]
        sizes = [self.size(e) for e in [*kernel.size_args, *numels]]
        if len(params) != len(tensors) + len(sizes) or None in sizes:
            return None
        args: list[Any] = []
        for param, name in zip(params, tensors):
            kind = kernel.signature[param]
            if not kind.startswith("*") or kind[1:] not in _DTYPES:
                return None
            args.append(prebuild.Pointer(_DTYPES[kind[1:]], self.offset(name)))
        kwargs: dict[str, Any] = dict(kernel.blocks, **kernel.launch_options())
        return prebuild.Launch(kernel.name, (1,), args + sizes, kwargs)

    def size(self, expr: Any) -> int | None:
        """`expr` (a size, a SymInt) at the example's sizes; None where it is not a known integer."""
        try:
            value = sympy.sympify(to_sympy(expr).xreplace(self.hints))
        except Unsupported:
            return None
        return int(value) if value.is_Integer else None

    def offset(self, name: str) -> int:
        """The bytes from an aligned address at which the wrapper's tensor `name` starts: its traced
        storage offset (0 for what the wrapper allocates)."""
        val = self.traced.get(name)
        if not isinstance(val, torch.Tensor):
            return 0
        at = self.size(val.storage_offset())
        return 0 if at is None else at * val.element_size()

    def close(self, cancel: bool = False) -> None:
        """After the graph's last kernel: the workers exit once their queue is built (`cancel`: a
        compile that failed drops the builds not started)."""
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=cancel)
        if self.futures:
            log.info("gjit: %d kernel build(s) started during codegen", len(self.futures))

    def wait(self) -> None:
        """Until every build started here is done (tests, benchmarks)."""
        concurrent.futures.wait(self.futures)
