"""Runtime: generated sources on disk, their loading, buffer allocation, and the fallback.

Kernel and wrapper sources are content-addressed files (Triton's interpreter and JIT read
kernel source from a real file). Which way a compiled graph runs is decided per call:
CUDA tensors launch the kernels, CPU tensors run them through Triton's interpreter when
`gjit.config.interpret` is set, and otherwise the eager fallback interpreter runs the graph.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import os
import sys
import tempfile
import types
from collections.abc import Callable
from typing import Any

import torch
import triton

from gjit import logs, runtime_cuda
from gjit.codegen import interpret as interpret_libdevice
from gjit.codegen.triton import KERNEL_PRELUDE, KernelSource
from gjit.config import config

cache_log = logs.logger("cache")

# ----------------------------------------------------------------------------------------------
# Sources on disk
# ----------------------------------------------------------------------------------------------


def atomic_write(path: str, data: str | bytes) -> None:
    """Write through a temp file in the same folder, then rename: readers see all of it or nothing."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def write_source(kind: str, name: str, source: str, ext: str = ".py") -> str:
    """Write `source` under the cache dir, content-addressed, atomically. A file already there is
    reused only if its content still matches its name; a damaged one is logged and rewritten."""
    digest = _digest(source)
    path = os.path.join(config.cache_dir, kind, digest[:2], f"{name}_{digest}{ext}")
    try:
        with open(path, encoding="utf-8") as f:
            intact = _digest(f.read()) == digest
    except FileNotFoundError:
        cache_log.info("on-disk miss: writing %s %s to %s", kind, name, path)
    except (OSError, UnicodeDecodeError) as e:
        cache_log.warning("gjit: unreadable cached %s %s (%s); rewriting it", kind, path, e)
    else:
        if intact:
            cache_log.info("on-disk hit: %s %s is already at %s", kind, name, path)
            return path
        cache_log.warning("gjit: the cached %s %s does not match its content hash; rewriting it", kind, path)
    atomic_write(path, source)
    return path


def load_module(path: str, extra: dict[str, Any] | None = None, interpret: bool = False) -> types.ModuleType:
    """Import a generated file; with `interpret`, its @triton.jit kernels become interpreted."""
    name = "gjit_generated_" + os.path.basename(path)[:-3] + ("_interp" if interpret else "")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    module.__dict__.update(extra or {})
    sys.modules[name] = module  # inspect.getsource needs the module registered
    if interpret:
        interpret_libdevice.install()
        with triton.knobs.runtime.scope():
            triton.knobs.runtime.interpret = True
            spec.loader.exec_module(module)
    else:
        spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------------------------
# Allocation helpers the wrappers call
# ----------------------------------------------------------------------------------------------


def gjit_alloc(size: tuple, stride: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty_strided(size, stride, dtype=dtype, device=device)


def gjit_alloc_poisoned(size: tuple, stride: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Debug allocation: every element starts as NaN (floats) or a sentinel, so unwritten ones show."""
    out = torch.empty_strided(size, stride, dtype=dtype, device=device)
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
            return super().run_node(n)
        except Exception as e:
            trace = (n.meta.get("stack_trace") or "").strip()
            where = f"\nUser code:\n{trace}" if trace else ""
            raise type(e)(f"{e}\nWhile executing {n.format_node()}{where}") from e


def _interpreted(call: Callable) -> Callable:
    def run(args: list[Any], sizes: tuple) -> Any:
        with interpret_libdevice.stdlib_interpreted():
            return call(args, sizes)

    return run


# kernel source path (content-addressed) -> its loaded @triton.jit function, per mode: a kernel
# shared by two entries (an automatic-dynamic recompile) or two models is JIT-compiled once
_KERNELS: dict[tuple[str, bool], Any] = {}


def load_kernel(path: str, name: str, interpret: bool) -> Any:
    key = (path, interpret)
    if key in _KERNELS:
        cache_log.info("in-memory hit: kernel %s already loaded (shared with another entry or model)", name)
    else:
        _KERNELS[key] = getattr(load_module(path, interpret=interpret), name)
    return _KERNELS[key]


# ----------------------------------------------------------------------------------------------
# A compiled graph: kernels + wrapper, runnable three ways
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class CompiledGraph:
    graph_module: torch.fx.GraphModule
    kernels: list[KernelSource]
    wrapper_source: str
    kernel_paths: dict[str, str] = dataclasses.field(default_factory=dict)
    wrapper_path: str = ""
    subgraphs: dict[str, CompiledGraph] = dataclasses.field(default_factory=dict)  # torch.cond branches
    checker: Any = None  # GJIT_CHECK: a gjit.check.RegionChecker the wrapper reports to
    last_check: list = dataclasses.field(default_factory=list)  # its rows for the latest call
    _calls: dict[str, Callable] = dataclasses.field(default_factory=dict)

    def write(self) -> None:
        for k in self.kernels:
            if k.backend == "cuda":
                path = write_source("kernels", k.name, runtime_cuda.kernel_file_text(k), ".cu")
            else:
                path = write_source("kernels", k.name, KERNEL_PRELUDE + k.source)
            self.kernel_paths[k.name] = path
        self.wrapper_path = write_source("wrappers", "wrapper", self.wrapper_source)

    def call_fn(self, interpret: bool) -> Callable:
        key = "interpret" if interpret else "device"
        if key not in self._calls:
            cuda = [
                runtime_cuda.CudaKernel(k, self.kernel_paths[k.name], interpret)
                for k in self.kernels
                if k.backend == "cuda"
            ]
            kernels = {k.kernel.name: k for k in runtime_cuda.grouped(cuda)}
            kernels |= {
                k.name: load_kernel(self.kernel_paths[k.name], k.name, interpret)
                for k in self.kernels
                if k.backend != "cuda"
            }
            extra = {"gjit_alloc": gjit_alloc, "gjit_alloc_poisoned": gjit_alloc_poisoned, **kernels}
            extra |= {name: sub.run_branch for name, sub in self.subgraphs.items()}
            if self.checker is not None:
                extra["gjit_check"] = self.checker.check_region
            call = load_module(self.wrapper_path, extra).call
            self._calls[key] = _interpreted(call) if interpret else call
        return self._calls[key]

    @functools.cached_property
    def on_cuda(self) -> bool:
        """The graph's device, from export's example inputs (guards keep an entry on it)."""
        for node in self.graph_module.graph.nodes:
            val = node.meta.get("val") if node.op == "placeholder" else None
            if isinstance(val, torch.Tensor):
                return val.device.type == "cuda"
        return False

    def run_branch(self, operands: tuple) -> tuple:
        """A torch.cond branch called from the parent's wrapper."""
        return tuple(self.run(list(operands), ()))

    def run(self, graph_inputs: list[Any], sizes: tuple) -> list[Any]:
        if self.on_cuda or config.interpret:
            out = list(self.call_fn(interpret=not self.on_cuda)(graph_inputs, sizes))
            if self.checker is not None:
                self.last_check = self.checker.finish(os.path.basename(self.wrapper_path))
            return out
        return list(FallbackInterpreter(self.graph_module).run(*graph_inputs))
