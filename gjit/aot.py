"""Ahead-of-time: every kernel of a compiled program built for a real GPU target, no GPU needed.

    report = gjit.aot(model, x, arch="sm_90")    # PTX + cubin per kernel, written to disk
    print(report)                                # registers, spills, shared memory, vector loads

Triton compiles each kernel for the target through its whole NVIDIA pipeline (ptxas ships
with Triton), specialized as Triton's launcher on the card would specialize it for this call (its
sizes divisible by 16 or equal to 1, its pointers aligned or not: `first_launches`), and NVRTC
each CUDA C kernel of the cupy backend; the resource usage comes from the cubin itself, read with
the `cuobjdump` that ships with Triton. A kernel with local memory or stack use spills registers.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import subprocess
from typing import Any

import triton

from gjit import logs
from gjit.codegen.toolchain.compile_only import (
    build_pool,
    compile_kernel,
    finish_warm_up,
    quiet_forks,
    start_warm_up,
)
from gjit.config import config

log = logs.logger("output_code")
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


@dataclasses.dataclass
class KernelBinary:
    name: str
    ptx_path: str
    cubin_path: str
    registers: int
    stack: int  # bytes per thread
    local: int  # bytes per thread of local memory (register spills)
    shared: int  # bytes per block (what a Triton kernel's launch asks for)
    vector_loads: int  # ld.global.v2/.v4 instructions in the PTX
    scalar_loads: int  # ld.global without a vector width

    @property
    def spills(self) -> bool:
        return self.local > 0 or self.stack > 0


@dataclasses.dataclass
class AotReport:
    arch: str
    kernels: list[KernelBinary]

    def __str__(self) -> str:
        lines = [f"gjit.aot: {len(self.kernels)} kernel(s) for {self.arch}"]
        width = max([6] + [len(k.name) for k in self.kernels])
        head = f"{'regs':>5} {'local':>6} {'shared':>7} {'v-loads':>8} {'loads':>6}"
        lines.append(f"  {'kernel':<{width}} {head}")
        for k in self.kernels:
            flag = "  SPILLS" if k.spills else ""
            lines.append(
                f"  {k.name:<{width}} {k.registers:>5} {k.local:>6} {k.shared:>7} {k.vector_loads:>8} "
                f"{k.scalar_loads:>6}{flag}"
            )
        return "\n".join(lines)


def resource_usage(cubin_path: str) -> dict[str, int]:
    """REG / STACK / SHARED / LOCAL of the (single) function in a cubin, from cuobjdump."""
    out = subprocess.run(
        [CUOBJDUMP, "--dump-resource-usage", cubin_path], capture_output=True, text=True, check=True
    ).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if match is None:
        raise RuntimeError(f"cuobjdump reported no resource usage for {cubin_path}:\n{out}")
    reg, stack, shared, local = map(int, match.groups())
    return {"registers": reg, "stack": stack, "shared": shared, "local": local}


def build(
    kernel: Any, path: str, arch: int, out_dir: str, file_name: str | None = None, launch: dict | None = None
) -> KernelBinary:
    """PTX and cubin of one kernel: Triton's pipeline (specialized for `launch`'s arguments where
    given: compile_only.compile_kernel), or NVRTC for a CUDA C kernel. They are written as
    `file_name` (default the kernel's name) .ptx and .cubin in `out_dir`."""
    if kernel.backend == "cuda":  # CuPy's NVRTC binding, needed for this backend only
        from gjit.codegen.toolchain import nvrtc

        with open(path, encoding="utf-8") as f:
            binary = nvrtc.compile_cuda(f.read(), kernel.name, arch)
        ptx, cubin = binary.ptx, binary.cubin
        # Triton's cuobjdump cannot read NVRTC 13.5 cubins: ptxas's own report of the same build
        ptxas = nvrtc.resource_usage(binary)
        local = ptxas["spill_stores"] + ptxas["spill_loads"]
        usage = {"registers": ptxas["registers"], "stack": ptxas["stack"], "shared": ptxas["shared"]}
        usage["local"] = local
    else:
        binary = compile_kernel(kernel, path, arch=arch, launch=launch)
        ptx, cubin = binary.asm["ptx"], binary.asm["cubin"]
        usage = None
    os.makedirs(out_dir, exist_ok=True)
    file_name = file_name or kernel.name
    ptx_path = os.path.join(out_dir, f"{file_name}.ptx")
    cubin_path = os.path.join(out_dir, f"{file_name}.cubin")
    with open(ptx_path, "w") as f:
        f.write(ptx)
    with open(cubin_path, "wb") as f:
        f.write(cubin)
    loads = re.findall(r"\bld\.global[\w.]*", ptx)
    vector = sum(1 for op in loads if ".v2." in op or ".v4." in op)
    scalar = len(loads) - vector
    if usage is None:  # Triton's launch asks for the kernel's dynamic shared memory (pipelined tiles) too
        usage = resource_usage(cubin_path)
        usage["shared"] = max(usage["shared"], binary.metadata.shared)
    return KernelBinary(kernel.name, ptx_path, cubin_path, **usage, vector_loads=vector, scalar_loads=scalar)


def aot(
    model: Any,
    *args: Any,
    arch: str = "sm_90",
    out_dir: str | None = None,
    workers: int | None = None,
    **kwargs: Any,
) -> AotReport:
    """Compile `model` for this call (capture, lower, fuse, codegen; nothing runs) and build every
    kernel, torch.cond branches included, for `arch`; PTX and cubins go to `out_dir`. `workers`
    processes build at once (default `gjit.config.compile_workers`, the CPU count). The call is
    compiled for that card: nothing measured there, its matmuls and attention are ATen's but where
    kernels/template_wins.py, measured on such a card, says the template wins (gjit/choice/)."""
    from gjit.api import CompiledFunction

    number = int(arch.removeprefix("sm_"))
    start_warm_up()  # Triton's one-time start beside capture, not after it
    cm = model if isinstance(model, CompiledFunction) else CompiledFunction(model)
    if cm.target is None:  # what runs on that card where nothing is measured (gjit/choice/)
        cm.target = number
    entry, sizes = cm.entry_for(args, kwargs)  # CaptureError (a RuntimeError) when capture fails
    out_dir = out_dir or os.path.join(config.cache_dir, "aot", arch)
    launches = first_launches(cm, entry, args, kwargs, sizes)
    jobs = []
    graphs = [entry.program.graph]
    while graphs:
        graph = graphs.pop(0)
        own = [k for k in graph.kernels if k.code_of is None]
        # the launches are the outer graph's: a branch's kernel may bear the name of one of them
        mine = launches if graph is entry.program.graph else {}
        jobs += [(k, graph.kernel_paths[k.name], mine.get(k.name)) for k in own]
        graphs += list(graph.subgraphs.values())
    workers = config.compile_workers if workers is None else workers
    return AotReport(arch, build_all(jobs, number, out_dir, workers))


def first_launches(cm: Any, entry: Any, args: tuple, kwargs: dict, sizes: tuple) -> dict[str, dict[str, Any]]:
    """Each kernel's arguments (name -> value; a tensor as its dtype and address) in its first
    launch of this call, from a run of the wrapper on fake tensors (gjit/runtime/prebuild.py), so
    that it is built as Triton's launcher would specialize it on the card: a size argument of 16
    or 1 lets Triton vectorize or drop what the same kernel built for any size could not. A kernel
    shares its code's launch (`code_of`). Kernels the fake run does not reach (a torch.cond
    branch's, those after an op fake tensors cannot run) are not in it."""
    from torch.utils import _pytree as pytree

    from gjit.runtime.prebuild import record_launches

    graph = entry.program.graph
    args, kwargs = cm._normalize(args, kwargs)
    flat, _ = pytree.tree_flatten((args, kwargs))
    try:
        call = graph.call_fn(interpret=False)
        names = [k.name for k in graph.kernels if k.backend != "cuda"]
        others = [k.name for k in graph.kernels if k.backend == "cuda"]
        recorded, _ = record_launches(
            call, names, others, list(graph.subgraphs), entry.program.captured.graph_inputs(flat), sizes
        )
    except Exception as e:  # noqa: BLE001 - built as for any size, as before
        log.info("gjit.aot: kernels built for any size: the fake run failed: %s", logs.error_line(e))
        return {}
    code = {k.name: k.code_of or k.name for k in graph.kernels}
    params = {k.name: [p for p in k.signature if p not in k.blocks] for k in graph.kernels}
    launches: dict[str, dict[str, Any]] = {}
    for launch in recorded:
        owner = code.get(launch.name, launch.name)
        if owner not in launches and owner in params and len(params[owner]) == len(launch.args):
            launches[owner] = dict(zip(params[owner], launch.args))
    return launches


def build_all(
    jobs: list[tuple[Any, str, dict[str, Any] | None]], arch: int, out_dir: str, workers: int
) -> list[KernelBinary]:
    """Every (kernel, source path, one launch's arguments or None) built for sm_<arch>, in order:
    in `workers` processes at once (each kernel's Triton pipeline and ptxas run in its own
    process: `build_pool`), or in this process when there is one worker or one kernel."""
    seen: collections.Counter[str] = collections.Counter()
    builds = []  # two torch.cond branches may hold kernels of one name: one file each
    for kernel, path, launch in jobs:
        seen[kernel.name] += 1
        suffix = f"_{seen[kernel.name]}" if seen[kernel.name] > 1 else ""
        builds.append((kernel, path, arch, out_dir, kernel.name + suffix, launch))
    workers = max(1, min(workers, len(builds)))
    pool = build_pool(workers) if workers > 1 else None
    if pool is None:
        if workers > 1:
            log.info("gjit.aot: building in process (a daemonic process cannot start workers)")
        return [build(*job) for job in builds]
    finish_warm_up()  # once here, inherited by every fork, instead of once per worker per call
    with pool, quiet_forks():
        # the longest first (its source's length as the measure), so no worker is left with
        # a big template at the end while the others are idle
        order = sorted(range(len(builds)), key=lambda i: -len(builds[i][0].source))
        futures = {i: pool.submit(build, *builds[i]) for i in order}
        try:
            return [futures[i].result() for i in range(len(builds))]
        except BaseException:
            for future in futures.values():  # the first failure is the error: do not wait for the rest
                future.cancel()
            raise
