"""CUDA C codegen for scan regions (cumsum, cumprod, logcumsumexp, cummax/cummin's values and
indices): one block per row (a grid-stride loop over rows); each step over the scanned dim gives
every thread one element (the scan's inlined producers computed in place), scans them across the
block (gjit_block_scan in the prelude), combines the running value carried from the steps
before, stores, and carries the block's total on. Every thread takes every step, so the block's
barriers line up. An index scan scans (value, index) pairs and stores the index.
"""

from __future__ import annotations

from gjit.codegen.common import KernelSource
from gjit.codegen.cuda.pointwise import C_TYPES, threads_for
from gjit.codegen.cuda.reduction import CudaReductionWriter, identity
from gjit.ir import ScanNode

# scan_type -> combine functor (gjit/kernels/cuda_prelude.py)
COMBINE = {
    "sum": "GjitSum",
    "prod": "GjitProd",
    "logsumexp": "GjitLogAddExp",
    "max": "GjitMax",
    "min": "GjitMin",
    "argmax": "GjitScanArg<true>",
    "argmin": "GjitScanArg<false>",
}


class CudaScanWriter(CudaReductionWriter):
    """Prints a scan region's kernel in CUDA C (the plan: codegen/plan.py's ReductionPlan over
    (rows x the scanned dim))."""

    def generate(self, name: str) -> KernelSource:
        (node,) = self.region.nodes
        assert isinstance(node, ScanNode)
        xnumel, rnumel, rhint, _ = self.row_shape()
        self.persistent = False
        self.threads = threads_for(rhint)
        self.arrays, self.reads, self.prologue, self.mask_depth = 0, [], [], 0
        index_dtype = self.pick_index_dtype(xnumel * rnumel)
        it = self.index_type = "int" if index_dtype == "int32" else "long long"
        acc = self.bodies[node.name].dtype
        functor = COMBINE[node.scan_type]
        pairs = node.scan_type.startswith("arg")
        if node.scan_type == "logsumexp":
            start = self.literal(float("-inf"), acc)
        else:
            start = identity(node.scan_type, acc)
        ctype = f"GjitValueIndex<{C_TYPES[acc]}>" if pairs else C_TYPES[acc]
        init = f"{ctype}{{{start}, 0}}" if pairs else f"({ctype})({start})"
        self.lines = self.var_lines("xindex", self.kept)
        self.lines.append(f"{ctype} carry = {init};")

        # one step: the element of this thread (the identity past the row's end)
        self.pass_id += 1
        outer = self.lines, self.cse, self.values
        self.lines = [f"const {it} rindex = rbase + threadIdx.x;"]
        self.lines += self.var_lines("rindex", list(self.space.reduced))
        step, self.lines = self.lines, []
        cse, values = dict(self.cse), dict(self.values)
        value = self.emit(self.bodies[node.name])
        element, self.lines, self.cse, self.values = self.lines, step, cse, values
        if pairs:
            value = f"{ctype}{{{value}, (long long)rindex}}"
        self.lines += [f"{ctype} scan_in = {init};", "if (rindex < rnumel) {"]
        self.lines += [f"    {ln}" for ln in element] + [f"    scan_in = {value};", "}"]
        self.lines.append(f"{ctype} scan_total;")
        scanned = f"{functor}()(carry, gjit_block_scan(scan_in, {functor}(), scan_total))"
        self.lines.append(f"const {ctype} scan_out = {scanned};")
        arg = self.out_args.setdefault(node.name, f"out_ptr{len(self.out_args)}")
        offset = self.index(self.layout(node.name).offset_of(self.space.value_index(node)))
        out, src = ("scan_out.i", node.dtype) if pairs else ("scan_out", acc)
        store = self.store_line(arg, offset, out, src, self.layout(node.name).dtype)
        self.lines += [f"if (rindex < rnumel) {store}", f"carry = {functor}()(carry, scan_total);"]
        loop, (self.lines, self.cse, self.values) = self.lines, outer
        self.lines.append(f"for ({it} rbase = 0; rbase < rnumel; rbase += blockDim.x) {{")
        self.lines += [f"    {ln}" for ln in loop] + ["}"]

        body = (
            [f"for ({it} xindex = blockIdx.x; xindex < xnumel; xindex += gridDim.x) {{"]
            + [f"    {ln}" for ln in self.prologue + self.lines]
            + ["}"]
        )
        scan = f"scan: {node.scan_type} along dim {node.dim}, {rnumel} elements per row"
        scan += f", {self.threads} per step"
        return self.cuda_source(
            name,
            header=self.header(name, xnumel, [scan]),
            body=body,
            sizes={"xnumel": xnumel, "rnumel": rnumel},
            threads=self.threads,
            index_dtype=index_dtype,
            blocks={"XBLOCK": 1, "RBLOCK": self.threads},
            rnumel=rnumel,
            persistent=False,
            passes=1,
            launch_blocks={},
        )
