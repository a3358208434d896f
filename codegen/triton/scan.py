"""Triton codegen for scan regions (cumsum, cumprod, logcumsumexp, cummax/cummin's values and
indices): one kernel per scan.

Programs own XBLOCK rows; each step of the loop over the scanned dim loads RBLOCK elements of
every row (the scan's inlined producers computed in place), scans them with
`tl.associative_scan`, combines the running value carried from the steps before, stores, and
carries the block's total on. A row that fits one block is one step. An index scan (cummax's
indices) scans (value, index) pairs and stores the index.
"""

from __future__ import annotations

import torch

from gjit.codegen.common import KernelSource, hint, next_power_of_2
from gjit.codegen.triton.pointwise import TL_DTYPES, comment, to_dtype
from gjit.codegen.triton.reduction import ReductionWriter
from gjit.codegen.triton.tiles import OUTER_PROGRAMS, OUTER_TILE, RowTiles, outer_xblock
from gjit.ir import ScanNode
from gjit.kernels.triton_helpers import HELPERS

# scan_type -> combine helper (gjit/kernels/triton_helpers.py)
COMBINE = {
    "sum": "add",
    "prod": "mul",
    "logsumexp": "logaddexp",
    "max": "scan_max",
    "min": "scan_min",
    "argmax": "scan_argmax",
    "argmin": "scan_argmin",
}


def identity(scan_type: str, dtype: torch.dtype) -> str:
    """The value a lane past the row's end holds (a Python scalar's text)."""
    if scan_type in ("sum", "prod"):
        return "0" if scan_type == "sum" else "1"
    if scan_type == "logsumexp":
        return "float('-inf')"
    low = scan_type.endswith("max")  # the identity of a max is the lowest value
    if dtype.is_floating_point:
        return "float('-inf')" if low else "float('inf')"
    info = torch.iinfo(dtype)
    return str(info.min if low else info.max)


LOOPED_CHUNK = 1024  # elements of a looped scan's chunk where GJIT_RBLOCK leaves it to the writer
OUTER_SCAN_PROGRAMS = OUTER_PROGRAMS  # the least programs of a scan down contiguous rows' wide tile


class ScanWriter(ReductionWriter):
    """Prints a scan region's kernel in Triton (the plan: codegen/plan.py's ReductionPlan over
    (rows x the scanned dim))."""

    def generate(self, name: str) -> KernelSource:
        (node,) = self.region.nodes
        assert isinstance(node, ScanNode)
        xnumel, rnumel, rhint, persistent = self.row_shape()
        rblock = next_power_of_2(max(rhint, 1)) if persistent else self.options.rblock or LOOPED_CHUNK
        rows = hint(xnumel, self.hints)
        xblock = max(1, min(next_power_of_2(rows), max(1, 1024 // rblock)))
        tile = []
        wide = outer_xblock(rows, self.narrowest())
        if self.walk() == "outer" and not self.options.rblock and -(-rows // wide) >= OUTER_SCAN_PROGRAMS:
            # the kept dims are contiguous (a cumsum over the first dim) and there are rows enough:
            # a tile wide across rows and short along the scan, as an outer reduction's, so every
            # load runs along memory (a program of one row reads one element of each 32-byte sector
            # it touches). With fewer rows, programs of one row: a program's steps run one after
            # another (each adds the carry of the one before), and few wide programs would leave
            # the card idle
            xblock = wide
            rblock = max(1, min(OUTER_TILE // xblock, next_power_of_2(max(rhint, 1))))
            tile = [RowTiles(xblock, rblock, rblock >= rhint, walk="outer").text()]
        index_dtype = self.pick_index_dtype(xnumel * rnumel)
        pid = "tl.program_id(0)" if index_dtype == "int32" else "tl.program_id(0).to(tl.int64)"
        self.lines = [
            f"xoffset = {pid} * XBLOCK",
            "xindex = xoffset + tl.arange(0, XBLOCK)[:, None]",
            "xmask = xindex < xnumel",
        ] + self.var_lines("xindex", self.kept)
        acc = self.bodies[node.name].dtype
        self.helpers.add(COMBINE[node.scan_type])
        fn, start = f"_{COMBINE[node.scan_type]}", identity(node.scan_type, acc)
        pairs = node.scan_type.startswith("arg")
        self.lines.append(f"carry = tl.full([XBLOCK, 1], {start}, {TL_DTYPES[acc]})")
        if pairs:
            self.lines.append("carry_index = tl.full([XBLOCK, 1], 0, tl.int64)")
        self.enter_loop()
        value = self.emit(self.bodies[node.name])
        masked = self.tmp(("scan_in", value), f"tl.where(xrmask, {value}, {start})")
        if pairs:
            index = self.tmp(("scan_index",), "rindex + tl.zeros([XBLOCK, RBLOCK], tl.int64)")
            self.lines += [
                f"scanned, scanned_index = tl.associative_scan(({masked}, {index}), 1, {fn})",
                f"total, total_index = tl.reduce(({masked}, {index}), 1, {fn})",
                f"_, result = {fn}(carry, carry_index, scanned, scanned_index)",
            ]
            self.values[node.name] = "result"
        else:
            scanned = self.tmp(("scan", masked), f"tl.associative_scan({masked}, 1, {fn})")
            total = self.tmp(("scan_total", masked), f"tl.reduce({masked}, 1, {fn})[:, None]")
            result = self.tmp(("scan_carried", scanned), f"{fn}(carry, {scanned})")
            self.values[node.name] = result
            if acc != node.dtype:
                self.values[node.name] = self.tmp(("scan_cast", result), to_dtype(result, acc, node.dtype))
        self.store(node.name)
        if pairs:
            self.lines.append(
                f"carry, carry_index = {fn}(carry, carry_index, total[:, None], total_index[:, None])"
            )
        else:
            self.lines.append(f"carry = {fn}(carry, {total})")
        self.exit_loop()
        steps = "one block" if persistent and rblock >= rhint else "blocks of RBLOCK"
        scan = [f"scan: {node.scan_type} along dim {node.dim}, {rnumel} elements per row in {steps}", *tile]
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
