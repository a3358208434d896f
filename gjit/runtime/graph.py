"""Runtime: generated sources on disk, their loading, buffer allocation, and the fallback.

Kernel and wrapper sources are content-addressed files (Triton's interpreter and JIT read
kernel source from a real file). Which way a compiled graph runs is decided per call:
CUDA tensors launch the kernels, CPU tensors run them through Triton's interpreter when
`gjit.config.interpret` is set, and otherwise the eager fallback interpreter runs the graph.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from gjit import logs
from gjit.codegen.common import KernelSource, next_power_of_2
from gjit.codegen.toolchain.files import write_source
from gjit.codegen.triton.pointwise import KERNEL_PRELUDE
from gjit.config import config
from gjit.kernels import column_copy
from gjit.lowering.attention_library import ANY_LAYOUT
from gjit.lowering.templates import TemplateChoice
from gjit.runtime import attention_masks, padded_mm, prebuild
from gjit.runtime import cuda as runtime_cuda
from gjit.runtime import interpret as interpret_libdevice
from gjit.runtime.launch import Launcher
from gjit.wrapper import COLUMN_COPY, HIDDEN_ROWS, WRITTEN_OUT, graph_device

cache_log = logs.logger("cache")

# ----------------------------------------------------------------------------------------------
# Sources on disk
# ----------------------------------------------------------------------------------------------


load_module = interpret_libdevice.load_module  # a generated file imported, for a GPU or interpreted


# ----------------------------------------------------------------------------------------------
# Allocation helpers the wrappers call
# ----------------------------------------------------------------------------------------------


def gjit_alloc(size: tuple, stride: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty_strided(size, stride, dtype=dtype, device=device)


def as_strided(base: torch.Tensor, size: tuple, stride: tuple, offset: int) -> torch.Tensor:
    """A strided view of `base`'s memory, `offset` elements past `base`'s own start."""
    return base.as_strided(size, stride, base.storage_offset() + offset)


def _reinterpret_tensor() -> Callable:
    """as_strided's view without ATen's dispatch or a bounds check: torch's C++ helper for
    Inductor's wrappers (as_strided itself where this torch lacks it)."""
    guards = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
    return getattr(guards, "_reinterpret_tensor", as_strided)


reinterpret_tensor = _reinterpret_tensor()


def gjit_alloc_poisoned(size: tuple, stride: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Debug allocation: every element starts as NaN (floats) or a sentinel, so unwritten ones show."""
    return repoison(torch.empty_strided(size, stride, dtype=dtype, device=device))


def repoison(out: torch.Tensor) -> torch.Tensor:
    """A dead buffer handed to a new one (gjit/memory_plan.py) poisoned again, in debug mode."""
    dtype = out.dtype
    if dtype.is_floating_point:
        out.fill_(float("nan"))
    elif dtype == torch.bool:
        out.fill_(True)
    else:
        out.fill_(torch.iinfo(dtype).min + 7 if dtype != torch.uint8 else 0xA5)
    return out


# ----------------------------------------------------------------------------------------------
# The eager fallback
# ----------------------------------------------------------------------------------------------


class FallbackInterpreter(torch.fx.Interpreter):
    """Runs the decomposed ATen graph eagerly, re-raising errors with the node and user line.

    run()
      +-- run_node()   <- adds "While executing <node>" and the user's source line
    """

    def run_node(self, n: torch.fx.Node) -> Any:
        try:
            if n.meta.get(ANY_LAYOUT):  # the wrapper's call: its value's layout, eager's rows
                return attention_masks.interpreted(n, *self.fetch_args_kwargs_from_env(n))
            return super().run_node(n)
        except Exception as e:
            trace = (n.meta.get("stack_trace") or "").strip()
            where = f"\nUser code:\n{trace}" if trace else ""
            raise type(e)(f"{e}\nWhile executing {n.format_node()}{where}") from e


def _interpreted(call: Callable) -> Callable:
    @functools.wraps(call)
    def run(args: list[Any], sizes: tuple) -> Any:
        with interpret_libdevice.stdlib_interpreted():
            return call(args, sizes)

    return run


# hand-written kernels a wrapper hands its externs: name -> source file (the name is the kernel's)
LIBRARY_KERNELS = {COLUMN_COPY: column_copy.__file__}  # padded products' copy out (runtime/padded_mm.py)
# kernel source path (content-addressed) -> its loaded @triton.jit function, per mode: a kernel
# shared by two entries (an automatic-dynamic recompile) or two models is JIT-compiled once
_KERNELS: dict[tuple[str, bool], Any] = {}
# loads of generated modules, one at a time: two threads that load one kernel at once must get one
# JITFunction (else it is built twice), and an interpreted load sets Triton's process-wide knob
# `runtime.interpret` while it imports; also each graph's first-call work (its wrapper, a prebuild)
LOAD_LOCK = threading.RLock()


def _after_fork_in_child() -> None:
    global LOAD_LOCK
    LOAD_LOCK = threading.RLock()  # a thread of the parent's may have held it


os.register_at_fork(after_in_child=_after_fork_in_child)


def write_kernel(kernel: KernelSource) -> str:
    """`kernel`'s file in the cache dir (content-addressed: the same source, the same path)."""
    if kernel.backend == "cuda":
        return write_source("kernels", kernel.name, runtime_cuda.kernel_file_text(kernel), ".cu")
    return write_source("kernels", kernel.name, KERNEL_PRELUDE + kernel.source)


def load_kernel(path: str, name: str, interpret: bool) -> Any:
    key = (path, interpret)
    with LOAD_LOCK:
        if key in _KERNELS:
            cache_log.info(
                "in-memory hit: kernel %s already loaded (shared with another entry or model)", name
            )
        else:
            _KERNELS[key] = getattr(load_module(path, interpret=interpret), name)
        return _KERNELS[key]


# ----------------------------------------------------------------------------------------------
# A compiled graph: kernels + wrapper, runnable three ways
# ----------------------------------------------------------------------------------------------


ROW_KERNEL = "row kernel "  # how a row kernel's tuning line starts (gjit/choice/row_kernels.py)


@dataclasses.dataclass
class CompiledGraph:
    graph_module: torch.fx.GraphModule
    kernels: list[KernelSource]
    wrapper_source: str
    kernel_paths: dict[str, str] = dataclasses.field(default_factory=dict)
    wrapper_path: str = ""
    subgraphs: dict[str, CompiledGraph] = dataclasses.field(default_factory=dict)  # torch.cond branches
    checker: Any = None  # GJIT_CHECK: a gjit.debug.check.RegionChecker the wrapper reports to
    last_check: list = dataclasses.field(default_factory=list)  # its rows for the latest call
    # gjit/tuning.py's decisions, on a GPU (a row kernel's line starts with ROW_KERNEL)
    tuning: list[str] = dataclasses.field(default_factory=list)
    # which products are templates, and each region's choice with its figures (gjit/choice/);
    # None: an entry stored before it was kept
    templates: TemplateChoice | None = None
    # [kind, qualified name, band] of each buffer or constant whose contents a mask's proof read
    # (gjit/lowering/held_masks.py): the entry's guard checks they keep them
    held: list = dataclasses.field(default_factory=list)
    # whether SDPA calls took grouped keys and values (gjit/lowering/grouped_kv.py; the card's choice)
    grouped_kv: bool = False
    # the setting gjit/lowering/convolutions.py ran under (GJIT_CONV_LAYOUT): a reanalysis runs it so
    conv_layout: str = "traced"
    # the library flag its convolutions ran under and its value (gjit/lowering/convolutions.py
    # CONV_LIBRARIES: cuDNN or oneDNN on or off), which the entry's guard requires; None: none
    conv_library: tuple[str, bool] | None = None
    prebuilt: bool = False  # its first call on a GPU started its kernels' builds (gjit/runtime/prebuild.py)
    # that prebuild: its launches' entries in Triton's on-disk cache (gjit.save(binaries=True))
    prebuild_result: prebuild.Prebuild | None = None
    _calls: dict[str, Callable] = dataclasses.field(default_factory=dict)
    _check_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def write(self) -> None:
        for k in self.kernels:  # a region with another's code: that kernel's file (first in the list)
            self.kernel_paths[k.name] = write_kernel(k) if k.code_of is None else self.kernel_paths[k.code_of]
        self.wrapper_path = write_source("wrappers", "wrapper", self.wrapper_source)

    def call_fn(self, interpret: bool) -> Callable:
        """The wrapper's `call`, loaded at the first call that runs this way (once, also when
        threads make that call at once)."""
        key = "interpret" if interpret else "prebound" if config.prebound_launches else "device"
        call = self._calls.get(key)
        if call is None:
            with LOAD_LOCK:
                call = self._calls.get(key)
                if call is None:
                    call = self._calls[key] = self._load_call(interpret, key == "prebound")
        return call

    def _load_call(self, interpret: bool, prebound: bool) -> Callable:
        """Load the kernels and the wrapper module (under LOAD_LOCK)."""
        own = [k for k in self.kernels if k.code_of is None]
        cuda = [
            runtime_cuda.CudaKernel(k, self.kernel_paths[k.name], interpret)
            for k in own
            if k.backend == "cuda"
        ]
        kernels = {k.kernel.name: k for k in runtime_cuda.grouped(cuda)}
        kernels |= {
            k.name: load_kernel(self.kernel_paths[k.name], k.name, interpret)
            for k in own
            if k.backend != "cuda"
        }
        # a region whose kernel is an earlier one's code launches that kernel's object, under
        # its own name (one build; tuning's probes still see each region's launch)
        kernels |= {k.name: kernels[k.code_of] for k in self.kernels if k.code_of is not None}
        if prebound:  # each name its own launch site (gjit/runtime/launch.py)
            triton_names = {k.name for k in self.kernels if k.backend != "cuda"}
            kernels |= {name: Launcher(kernels[name]) for name in triton_names}
        # math: size expressions torch's printer writes as math.ceil(...), math.floor(...)
        extra = {
            "gjit_alloc": gjit_alloc,
            "gjit_alloc_poisoned": gjit_alloc_poisoned,
            "gjit_repoison": repoison,
            "next_power_of_2": next_power_of_2,  # a looped reduction's block (not Triton's: slow)
            "gjit_padded_mm": padded_mm.mm,  # products of misaligned output rows
            "gjit_padded_addmm": padded_mm.addmm,
            "gjit_additive_mask": attention_masks.additive,  # an attention extern's boolean mask
            "gjit_traced_layout": attention_masks.traced_layout,
            WRITTEN_OUT: attention_masks.written_out,  # gjit/lowering/attention_library.py's
            HIDDEN_ROWS: attention_masks.hidden_rows,  # of a mask it built from a fill
            "gjit_reinterpret": reinterpret_tensor,  # a view from its traced layout
            "gjit_as_strided": as_strided,  # the same, bounds checked (GJIT_DEBUG)
            "math": math,
            **kernels,
        }
        extra |= self.library_kernels(interpret)
        extra |= {name: sub.run_branch for name, sub in self.subgraphs.items()}
        extra |= self.eager_subgraphs()
        if self.checker is not None:
            extra["gjit_check"] = self.checker.check_region
        call = load_module(self.wrapper_path, extra).call
        return _interpreted(call) if interpret else call

    def library_kernels(self, interpret: bool) -> dict[str, Any]:
        """The hand-written kernels this wrapper hands its externs (LIBRARY_KERNELS), by name,
        loaded as the graph's own are."""
        used = [name for name in LIBRARY_KERNELS if name in self.wrapper_source]
        return {name: load_kernel(LIBRARY_KERNELS[name], name, interpret) for name in used}

    def all_kernels(self) -> list[KernelSource]:
        """The kernels of this graph and of its torch.cond branches, recursively."""
        return [*self.kernels, *(k for sub in self.subgraphs.values() for k in sub.all_kernels())]

    def eager_subgraphs(self) -> dict[str, torch.fx.GraphModule]:
        """The subgraphs of higher-order ops other than torch.cond (map, scan, while_loop, ...),
        by node name: the wrapper hands them to the op, which runs them eagerly."""
        gm = self.graph_module
        return {
            node.name: getattr(gm, node.target)
            for node in gm.graph.nodes
            if node.op == "get_attr"
            and node.target not in self.subgraphs
            and isinstance(getattr(gm, node.target, None), torch.fx.GraphModule)
        }

    @functools.cached_property
    def on_cuda(self) -> bool:
        return graph_device(self.graph_module.graph.nodes).type == "cuda"

    def prebuild(self, call: Callable, graph_inputs: list[Any], sizes: tuple) -> prebuild.Prebuild | None:
        """Start building this graph's Triton kernels in worker processes, for the first call of
        its device wrapper `call` (gjit/runtime/prebuild.py). Never fails the call: whatever it
        does not build, Triton's launcher builds at the launch."""
        self.prebuilt = True
        triton_kernels = [k for k in self.kernels if k.backend != "cuda"]
        paths = {k.name: self.kernel_paths[k.name] for k in triton_kernels}
        others = [k.name for k in self.kernels if k.backend == "cuda"]
        try:
            # the JITFunctions themselves: the wrapper's names may be wrapped (tuning's probes)
            kernels = {k.name: load_kernel(paths[k.name], k.code_of or k.name, False) for k in triton_kernels}
            library = self.library_kernels(interpret=False)
            kernels |= library
            paths |= {name: LIBRARY_KERNELS[name] for name in library}
            branches = list(self.subgraphs)
            self.prebuild_result = prebuild.start(call, kernels, paths, others, branches, graph_inputs, sizes)
        except Exception as e:
            prebuild.note_failure("prebuilding the kernels", e)
        return self.prebuild_result

    def all_graphs(self) -> list[CompiledGraph]:
        """This graph and its torch.cond branches', recursively."""
        return [self, *(g for sub in self.subgraphs.values() for g in sub.all_graphs())]

    def run_branch(self, operands: tuple) -> tuple:
        """A torch.cond branch called from the parent's wrapper."""
        return tuple(self.run(list(operands), ()))

    def run(self, graph_inputs: list[Any], sizes: tuple) -> list[Any]:
        """One call; threads may make calls at once. Each launch goes to the calling thread's
        current stream (Triton's launcher and CuPy read it at the launch; nothing here keeps one).
        A replay of a recorded CUDA graph (mode="reduce-overhead") must hold a lock of that
        recording from copying the inputs into its static buffers until its outputs are copied
        out, or give each thread a recording of its own: threads must not share one mid-replay."""
        if self.on_cuda or config.interpret:
            call = self.call_fn(interpret=not self.on_cuda)
            if self.on_cuda and not self.prebuilt:
                with LOAD_LOCK:
                    if not self.prebuilt:
                        self.prebuild(call, graph_inputs, sizes)
            if self.checker is not None:  # GJIT_CHECK: one call's table of errors at a time
                with self._check_lock:
                    out = list(call(graph_inputs, sizes))
                    self.last_check = self.checker.finish(os.path.basename(self.wrapper_path))
                return out
            return list(call(graph_inputs, sizes))
        return list(FallbackInterpreter(self.graph_module).run(*graph_inputs))
