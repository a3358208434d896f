"""CUDA C kernels at run time, behind Triton's launch syntax (`kernel[grid](*args, XBLOCK=...)`),
so one generated wrapper serves both backends.

On CUDA tensors a kernel is compiled by NVRTC for the device's arch (the cubin cached on disk,
content-addressed) and launched through CuPy on torch's current stream, tensors passed by
pointer (no copies). On CPU tensors (`gjit.config.interpret`) the same source runs on the host
emulation of gjit/runtime/host_emulation.py. Kernels are grid-stride loops, so the launcher may cap
the grid; the host run caps it low, so that each emulated block does more of the work.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np
import torch

from gjit import logs
from gjit.codegen.common import KernelSource
from gjit.config import config
from gjit.kernels.bessel import CUDA_NAMES, cuda_bessel
from gjit.kernels.cuda_prelude import CUDA_PRELUDE

cache_log = logs.logger("cache")

HOST_GRID = 8  # blocks per launch on the host emulation
GPU_GRID = 2**31 - 1
_SCALARS = {"int": np.int32, "long long": np.int64, "float": np.float32, "double": np.float64}


def cubin_for(source: str, name: str, arch: int) -> bytes:
    """NVRTC's cubin of `source` for sm_<arch>, from the on-disk cache when it is there."""
    from gjit.codegen.toolchain.files import atomic_write
    from gjit.codegen.toolchain.nvrtc import compile_cuda

    digest = hashlib.sha256(f"{arch}\0{source}".encode()).hexdigest()[:20]
    path = os.path.join(config.cache_dir, "cubins", digest[:2], f"{name}_{digest}_sm{arch}.cubin")
    if os.path.exists(path):
        cache_log.info("on-disk hit: cubin of %s at %s", name, path)
        with open(path, "rb") as f:
            return f.read()
    cubin = compile_cuda(source, name, arch).cubin
    atomic_write(path, cubin)
    cache_log.info("on-disk store: cubin of %s written to %s", name, path)
    return cubin


class CudaKernel:
    def __init__(self, kernel: KernelSource, path: str, interpret: bool):
        self.kernel = kernel
        self.path = path
        self.interpret = interpret
        self.params = list(kernel.signature.items())
        self._host = None
        self._device_fns: dict[int, Any] = {}
        self.group = [self]  # the kernels built for the host with this one (a program's)

    def source(self) -> str:
        with open(self.path, encoding="utf-8") as f:
            return f.read()

    def __getitem__(self, grid: tuple):
        def launch(*args: Any, **blocks: int) -> None:
            threads = blocks.get("RBLOCK", blocks.get("XBLOCK"))
            self.launch(int(grid[0]), int(threads), args)

        return launch

    def launch(self, grid: int, threads: int, args: tuple) -> None:
        if self.interpret:
            if self._host is None:
                from gjit.runtime.host_emulation import host_kernels

                built = host_kernels([(k.source(), k.kernel.name, k.params) for k in self.group])
                for k, host in zip(self.group, built):
                    k._host = host
            self._host(min(grid, HOST_GRID), threads, list(args))
            return
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        fn = self._device_fn(device)
        import cupy

        packed = [self._pack(a, ctype) for a, (_, ctype) in zip(args, self.params)]
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream)
        with cupy.cuda.Device(device.index):
            fn((min(grid, GPU_GRID),), (threads,), tuple(packed), stream=stream)

    def _device_fn(self, device: torch.device) -> Any:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._device_fns:
            import cupy

            major, minor = torch.cuda.get_device_capability(index)
            with cupy.cuda.Device(index):
                module = cupy.cuda.function.Module()
                module.load(cubin_for(self.source(), self.kernel.name, major * 10 + minor))
                self._device_fns[index] = (module, module.get_function(self.kernel.name))
        return self._device_fns[index][1]

    @staticmethod
    def _pack(value: Any, ctype: str) -> Any:
        if ctype.endswith("*"):
            return np.uint64(value.data_ptr())
        return _SCALARS[ctype](value)


def grouped(kernels: list[CudaKernel]) -> list[CudaKernel]:
    """A program's kernels, built for the host together at the first launch of any of them."""
    for k in kernels:
        k.group = kernels
    return kernels


def kernel_file_text(kernel: KernelSource) -> str:
    """The prelude, the Bessel functions if the kernel calls one (kernels/bessel.py), the kernel."""
    uses_bessel = any(name in kernel.source for name in CUDA_NAMES)
    return CUDA_PRELUDE + (cuda_bessel() if uses_bessel else "") + kernel.source
