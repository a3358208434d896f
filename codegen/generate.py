"""Codegen's entry: one region -> one kernel, by the writer of its backend and kind."""

from __future__ import annotations

import sympy

from gjit import ir
from gjit.codegen.common import KernelSource, kernel_name
from gjit.codegen.cuda.pointwise import CudaKernelWriter
from gjit.codegen.cuda.reduction import CudaReductionWriter
from gjit.codegen.cuda.scan import CudaScanWriter
from gjit.codegen.cuda.scatter import CudaScatterWriter
from gjit.codegen.triton.attention import AttentionWriter
from gjit.codegen.triton.matmul import MatmulWriter
from gjit.codegen.triton.pointwise import KernelWriter
from gjit.codegen.triton.reduction import ReductionWriter
from gjit.codegen.triton.scan import ScanWriter
from gjit.codegen.triton.scatter import ScatterWriter
from gjit.config import CompileOptions
from gjit.fusion.regions import Region

WRITERS = {  # (backend, region kind) -> writer class
    ("triton", "pointwise"): KernelWriter,
    ("triton", "reduction"): ReductionWriter,
    ("triton", "scan"): ScanWriter,
    ("triton", "scatter"): ScatterWriter,
    ("triton", "matmul"): MatmulWriter,
    ("triton", "attention"): AttentionWriter,
    ("cupy", "pointwise"): CudaKernelWriter,
    ("cupy", "reduction"): CudaReductionWriter,
    ("cupy", "scan"): CudaScanWriter,
    ("cupy", "scatter"): CudaScatterWriter,
}


def generate_kernel(
    region: Region, graph: ir.LoopGraph, hints: dict[sympy.Symbol, int], index: int, options: CompileOptions
) -> KernelSource:
    """The kernel of `region`, the `index`-th of its graph; names the region after it."""
    region.name = kernel_name(region, index)
    if region.scatter or region.scan:
        kind = "scatter" if region.scatter else "scan"
    elif region.matmul:
        kind = "attention" if region.attention else "matmul"
    else:
        kind = "reduction" if region.reduction is not None else "pointwise"
    writer = WRITERS[options.backend, kind]
    return writer(region, graph, hints, options).generate(region.name)
