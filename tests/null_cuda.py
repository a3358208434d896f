"""Triton's own CUDA driver on a machine without a GPU, over a libcuda that launches nothing.

`null_driver()` builds tests/null_cuda.c as libcuda.so.1 (once per source, in the temp folder),
loads it, and returns Triton's `CudaDriver` whose module (Triton's driver.c: its C launcher,
argument packing, pointer checks) is linked against it, with the device, stream and target
answered without torch.cuda: an sm_90 device 0 with stream 0. Set active
(`triton.runtime.driver.driver.set_active`), kernels compile for sm_90 as on an H100 and every
launch runs Triton's whole host path, CPU tensors as arguments, up to a cuLaunchKernelEx that
counts it (`launches()`) and computes nothing. The tests' and benches' measure of host time per
launch (bench/launch_overhead.py) and of what a launch passes.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "null_cuda.c")


@functools.cache
def library() -> ctypes.CDLL:
    """The stub libcuda.so.1, built and loaded globally (Triton's driver module dlopens it by name)."""
    import triton

    with open(SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    folder = os.path.join(tempfile.gettempdir(), f"gjit_null_cuda_{digest}")
    path = os.path.join(folder, "libcuda.so.1")
    if not os.path.exists(path):
        os.makedirs(folder, exist_ok=True)
        include = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "include")
        partial = f"{path}.{os.getpid()}"
        flags = ["-O2", "-shared", "-fPIC", f"-I{include}", "-Wl,-soname,libcuda.so.1"]
        subprocess.check_call(["gcc", *flags, "-o", partial, SOURCE])
        os.replace(partial, path)  # atomic: parallel test workers may build it at once
    lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    lib.gjit_null_launches.restype = ctypes.c_ulonglong
    triton.knobs.nvidia.libcuda_path = folder  # where Triton's driver module links libcuda from
    return lib


def launches() -> int:
    """Kernel launches that reached the stub's cuLaunchKernelEx so far in this process."""
    return int(library().gjit_null_launches())


@functools.cache
def null_driver():
    """Triton's CUDA driver over the stub (one per process: its module is built once)."""
    library()
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver, CudaLauncher, CudaUtils

    class NullDriver(CudaDriver):
        def __init__(self) -> None:  # CudaDriver's asks torch.cuda for the device and stream
            self.utils = CudaUtils()
            self.launcher_cls = CudaLauncher

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", 90, 32)

        def get_device_capability(self, device: int = 0) -> tuple[int, int]:
            return (9, 0)

    return NullDriver()
