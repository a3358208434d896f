"""Ahead-of-time compilation of generated kernels for a real GPU target, without a GPU.

`triton.compile` with `GPUTarget("cuda", 90, 32)` runs the whole NVIDIA pipeline (TTIR,
TTGIR, LLVM IR, PTX, and a cubin through the ptxas that ships with Triton), so a kernel
that compiles here is real sm_90 code. Pointer arguments and `xnumel` are marked 16-divisible,
as Triton's launcher specializes them on a GPU when the sizes allow.
"""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget

from gjit.codegen.common import KernelSource
from gjit.codegen.toolchain.files import import_file


def compile_kernel(kernel: KernelSource, path: str, arch: int = 90, aligned: bool = True):
    """Compile `kernel` (its source file at `path`) for sm_<arch>; returns Triton's CompiledKernel."""
    fn = getattr(import_file(path), kernel.name)
    params = [p for p in kernel.signature if p not in kernel.blocks]
    attrs = {}
    if aligned:
        for k, p in enumerate(params):
            if kernel.signature[p].startswith("*") or p in ("xnumel", "rnumel"):
                attrs[(k,)] = [["tt.divisibility", 16]]
    source = triton.compiler.ASTSource(
        fn=fn, signature=dict(kernel.signature), constexprs=dict(kernel.blocks), attrs=attrs
    )
    return triton.compile(source, target=GPUTarget("cuda", arch, 32))
