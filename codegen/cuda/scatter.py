"""CUDA C codegen for writes through indices (scatter, scatter_add, scatter_reduce, index_put):
a grid-stride loop over the source's elements (codegen/plan.py's ScatterPlan), each storing its
value at the element its index names, or combining it there atomically (gjit_atomic_add/max/min
in the prelude). An index out of bounds skips the write; in debug mode, and for a write into a
graph input (the caller's tensor: a static KV cache), it is a device assert (the prelude's
GJIT_ASSERT: CUDA's device-side assert, the host emulation's launch error), as eager raises.
"""

from __future__ import annotations

from gjit import ir
from gjit.codegen.common import KernelSource, hint
from gjit.codegen.cuda.pointwise import CudaKernelWriter, threads_for
from gjit.codegen.plan import ScatterPlan
from gjit.ir import ScatterNode

ATOMICS = {"sum": "gjit_atomic_add", "max": "gjit_atomic_max", "min": "gjit_atomic_min"}


class CudaScatterWriter(ScatterPlan, CudaKernelWriter):
    def generate(self, name: str) -> KernelSource:
        for node, _ in self.writes():
            self.assumptions += list(node.assumptions)  # sizes the writes rely on (guarded)
        numel, idx, plan, index_dtype = self.pointwise_space()
        it = "int" if index_dtype == "int32" else "long long"
        for node, write in self.writes():
            self.store(node, write)
        setup = [f"{it} {v.name} = {self.index(e)};" for v, e in zip(plan.vars, plan.var_exprs)]
        loop = (
            f"for ({it} xindex = ({it})blockIdx.x * blockDim.x + threadIdx.x; "
            f"xindex < xnumel; xindex += ({it})blockDim.x * gridDim.x) {{"
        )
        threads = threads_for(hint(numel, self.hints))
        return self.cuda_source(
            name,
            header=self.header(name, numel, self.scatter_header()),
            body=[loop] + [f"    {ln}" for ln in setup + self.lines] + ["}"],
            sizes={"xnumel": numel},
            threads=threads,
            index_dtype=index_dtype,
            nondeterministic=self.nondeterministic(),
            blocks={"XBLOCK": threads},
        )

    def store(self, node: ScatterNode, write: ir.WriteAt) -> None:
        value = self.emit(write.value)
        names = {sym: self.emit(v) for sym, v, _ in write.indirect}
        arg = self.out_args.setdefault(node.name, f"out_ptr{len(self.out_args)}")
        offset = self.index(self.subst(self.layout(node.name).offset_of(write.index)), names)
        conds = [f"{names[sym]} >= 0 && {names[sym]} < {self.index(self.subst(size))}"
                 for sym, _, size in write.indirect]  # fmt: skip
        if self.asserts(node):
            self.lines += [
                f'GJIT_ASSERT({cond} && "index out of bounds writing {node.name}");' for cond in conds
            ]
        if node.reduce == "nan":
            conds.append(f"{value} != {value}")
        dtype = self.layout(node.name).dtype
        if node.reduce in ATOMICS:
            line = f"{ATOMICS[node.reduce]}(&{arg}[{offset}], {value});"
        else:
            line = self.store_line(arg, offset, value, write.value.dtype, dtype)
        self.lines += [f"if ({' && '.join(conds)}) {line}"] if conds else [line]
