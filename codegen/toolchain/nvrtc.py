"""Compile generated CUDA C kernels with NVRTC, to PTX and an sm_<arch> cubin, without a GPU.

NVRTC 13 has no built-in cuda_fp16.h / cuda_bf16.h: they come from the `nvidia-cuda-runtime`
wheel (nvidia/cu13/include), found through its installed files, never a machine path.
Registers and spills come from ptxas's own report (-Xptxas=-v) in the NVRTC log: the cuobjdump
that gjit.aot.resource_usage runs (Triton's, CUDA 13.1) cannot read NVRTC 13.5 cubins.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
import re

from cupy_backends.cuda.libs import nvrtc

from gjit.codegen.common import numbered

OPTIONS = ["--std=c++17", "-Xptxas=-v"]  # -v: ptxas reports registers and spills in the log


class CudaCompileError(RuntimeError):
    pass


@dataclasses.dataclass
class CudaBinary:
    ptx: str
    cubin: bytes
    log: str


@functools.cache
def cuda_include_dir() -> str:
    """The include folder of the `nvidia-cuda-runtime` wheel (cuda_fp16.h and its friends)."""
    try:
        files = importlib.metadata.distribution("nvidia-cuda-runtime").files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.name == "cuda_fp16.h":
            return os.path.dirname(str(file.locate()))
    raise CudaCompileError(
        "cuda_fp16.h not found: pip install nvidia-cuda-runtime (the version of nvidia-cuda-nvrtc)"
    )


def compile_cuda(source: str, name: str, arch: int = 90) -> CudaBinary:
    """Compile `source` (whose kernel is `name`, used for the file name in messages) for sm_<arch>."""
    options = [f"-arch=sm_{arch}", *OPTIONS, f"-I{cuda_include_dir()}"]
    program = nvrtc.createProgram(source, f"{name}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as error:
            log = nvrtc.getProgramLog(program).rstrip("\0")
            message = f"NVRTC failed on {name} ({error}), options {' '.join(options)}:\n{log}"
            raise CudaCompileError(f"{message}\n{name}.cu:\n{numbered(source)}") from None
        ptx = nvrtc.getPTX(program).rstrip(b"\0").decode()
        return CudaBinary(
            ptx=ptx, cubin=nvrtc.getCUBIN(program), log=nvrtc.getProgramLog(program).rstrip("\0")
        )
    finally:
        nvrtc.destroyProgram(program)


def resource_usage(binary: CudaBinary) -> dict[str, int]:
    """Registers, spill stores / loads, stack and shared bytes of the kernel, from ptxas's report."""
    fields = {
        "registers": r"Used (\d+) registers",
        "spill_stores": r"(\d+) bytes spill stores",
        "spill_loads": r"(\d+) bytes spill loads",
        "stack": r"(\d+) bytes stack frame",
        "shared": r"(\d+) bytes smem",
    }
    if not re.search(fields["registers"], binary.log):
        raise RuntimeError(f"no ptxas report in the NVRTC log:\n{binary.log}")
    usage = {}
    for key, pattern in fields.items():
        match = re.search(pattern, binary.log)
        usage[key] = int(match.group(1)) if match else 0
    return usage
