"""Triton codegen for scan regions (cumsum, cumprod, logcumsumexp): one kernel per scan.

Programs own XBLOCK rows; each step of the loop over the scanned dim loads RBLOCK elements of
every row (the scan's inlined producers computed in place), scans them with
`tl.associative_scan`, combines the running value carried from the steps before, stores, and
carries the block's total on. A row that fits one block is one step.
"""

from __future__ import annotations

from gjit.codegen.common import KernelSource, hint, next_power_of_2
from gjit.codegen.triton.pointwise import TL_DTYPES, comment, to_dtype
from gjit.codegen.triton.reduction import ReductionWriter
from gjit.ir import ScanNode
from gjit.kernels.triton_helpers import HELPERS

# scan_type -> (combine helper, identity as a Python scalar)
COMBINE = {"sum": ("add", "0"), "prod": ("mul", "1"), "logsumexp": ("logaddexp", "float('-inf')")}


class ScanWriter(ReductionWriter):
    """Prints a scan region's kernel in Triton (the plan: codegen/plan.py's ReductionPlan over
    (rows x the scanned dim))."""

    def generate(self, name: str) -> KernelSource:
        (node,) = self.region.nodes
        assert isinstance(node, ScanNode)
        xnumel, rnumel, rhint, persistent = self.row_shape()
        rblock = next_power_of_2(max(rhint, 1)) if persistent else self.options.rblock
        xhint = next_power_of_2(hint(xnumel, self.hints))
        xblock = max(1, min(xhint, max(1, 1024 // rblock)))
        index_dtype = self.pick_index_dtype(xnumel * rnumel)
        pid = "tl.program_id(0)" if index_dtype == "int32" else "tl.program_id(0).to(tl.int64)"
        self.lines = [
            f"xoffset = {pid} * XBLOCK",
            "xindex = xoffset + tl.arange(0, XBLOCK)[:, None]",
            "xmask = xindex < xnumel",
        ] + self.var_lines("xindex", self.kept)
        acc = self.bodies[node.name].dtype
        helper, identity = COMBINE[node.scan_type]
        self.helpers.add(helper)
        fn = f"_{helper}"
        self.lines.append(f"carry = tl.full([XBLOCK, 1], {identity}, {TL_DTYPES[acc]})")
        self.enter_loop()
        value = self.emit(self.bodies[node.name])
        masked = self.tmp(("scan_in", value), f"tl.where(xrmask, {value}, {identity})")
        scanned = self.tmp(("scan", masked), f"tl.associative_scan({masked}, 1, {fn})")
        total = self.tmp(("scan_total", masked), f"tl.reduce({masked}, 1, {fn})[:, None]")
        result = self.tmp(("scan_carried", scanned), f"{fn}(carry, {scanned})")
        if acc == node.dtype:
            self.values[node.name] = result
        else:
            self.values[node.name] = self.tmp(("scan_cast", result), to_dtype(result, acc, node.dtype))
        self.store(node.name)
        self.lines.append(f"carry = {fn}(carry, {total})")
        self.exit_loop()
        steps = "one block" if persistent else "blocks of RBLOCK"
        scan = [f"scan: {node.scan_type} along dim {node.dim}, {rnumel} elements per row in {steps}"]
        header = comment(self.header(name, xnumel, scan))
        return self.kernel_source(
            name,
            header=header,
            helpers=[HELPERS[h] for h in sorted(self.helpers)],
            body=self.lines,
            sizes={"xnumel": xnumel, "rnumel": rnumel},
            blocks={"XBLOCK": xblock, "RBLOCK": rblock},
            index_dtype=index_dtype,
            rnumel=rnumel,
            persistent=False,
            passes=1,
            launch_blocks={},
        )
