"""Triton codegen for writes through indices (scatter, scatter_add, scatter_reduce, index_put):
one pointwise kernel over the source's elements (codegen/plan.py's ScatterPlan), each storing its
value at the element its index names, or combining it there with an atomic (`tl.atomic_add`,
`tl.atomic_max`, `tl.atomic_min`, relaxed: only the final values matter, the kernel reads none
back). An index out of bounds skips the write (debug mode asserts instead; a write into a graph
input, the caller's tensor, always asserts, as eager raises).
"""

from __future__ import annotations

from gjit import ir
from gjit.codegen.common import KernelSource
from gjit.codegen.plan import ScatterPlan
from gjit.codegen.triton.pointwise import HELPERS, KernelWriter, comment, xblock_for
from gjit.ir import ScatterNode

ATOMICS = {"sum": "tl.atomic_add", "max": "tl.atomic_max", "min": "tl.atomic_min"}


class ScatterWriter(ScatterPlan, KernelWriter):
    def generate(self, name: str) -> KernelSource:
        for node, _ in self.writes():
            self.assumptions += list(node.assumptions)  # sizes the writes rely on (guarded)
        numel, idx, plan, index_dtype = self.pointwise_space()
        setup = self.index_setup(plan, index_dtype)
        for node, write in self.writes():
            self.store(node, write)
        return self.kernel_source(
            name,
            header=comment(self.header(name, numel, self.scatter_header())),
            body=setup + self.lines,
            sizes={"xnumel": numel},
            blocks={"XBLOCK": xblock_for(numel, self.hints, self.options.xblock)},
            index_dtype=index_dtype,
            nondeterministic=self.nondeterministic(),
            helpers=[HELPERS[h] for h in sorted(self.helpers)],
        )

    def store(self, node: ScatterNode, write: ir.WriteAt) -> None:
        value = self.emit(write.value)
        names = self.indirect(write, f"writing {node.name}", check=self.asserts(node))
        arg = self.out_args.setdefault(node.name, f"out_ptr{len(self.out_args)}")
        offset_expr = self.subst(self.layout(node.name).offset_of(write.index))
        offset, value = self.block_store(offset_expr, self.index(offset_expr, names), value, write.value)
        conds = ["xmask"]
        for sym, _, size in write.indirect:
            conds.append(f"({names[sym]} >= 0) & ({names[sym]} < {self.index(self.subst(size))})")
        if node.reduce == "nan":
            conds.append(f"({value} != {value})")
        mask = self.tmp(("write mask", *conds), " & ".join(conds)) if len(conds) > 1 else "xmask"
        if node.reduce in ATOMICS:
            self.lines.append(f"{ATOMICS[node.reduce]}({arg} + ({offset}), {value}, {mask}, sem='relaxed')")
        else:
            self.lines.append(f"tl.store({arg} + ({offset}), {value}, {mask})")
