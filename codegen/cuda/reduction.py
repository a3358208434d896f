"""CUDA C codegen for reduction regions: one block per output row (a grid-stride loop over rows),
its threads striding over the row's reduced elements.

Each level of reductions (softmax: the max, then the sum that reads it) is one pass over the
row: every thread accumulates its elements, then gjit_block_reduce (warp shuffles, one partial
per warp in shared memory) gives every thread the row's result. A last pass writes full-row
values that leave the kernel (softmax's output); per-row results are written by thread 0.

  persistent (a row of at most gjit.config.persistent_max elements): each thread keeps what it
      loaded in registers (`ld0[k]`, k < elements per thread), so later passes read the row from
      registers and the input once, like the Triton persistent kernel. A dynamic row, as on the
      Triton side, gets its threads at launch (the same source for every length) and registers
      for the longest row a guard admits;
  looped (a long row): each pass reads its inputs again; softmax's sum and a variance's sum of
      squares share the pass of the level before (codegen/online.py).
"""

from __future__ import annotations

import sympy
import torch

from gjit.codegen import online
from gjit.codegen.cuda.pointwise import C_TYPES, THREADS, CudaEmitter, literal, threads_for, to_dtype
from gjit.codegen.plan import ReductionPlan
from gjit.ir import Read, ReduceNode

WELFORD = ("count", "first", "mean", "m2")  # a variance's accumulators per thread (cuda_prelude.py)
FUNCTORS = {"sum": "GjitSum", "prod": "GjitProd", "max": "GjitMax", "min": "GjitMin"}


def identity(reduce_type: str, dtype: torch.dtype) -> str:
    if reduce_type in ("argmax", "argmin"):
        reduce_type = reduce_type[3:]
    if reduce_type in ("sum", "prod"):
        return literal(0 if reduce_type == "sum" else 1, dtype)
    if dtype == torch.bool:
        return literal(reduce_type == "min", dtype)
    if dtype.is_floating_point:
        return literal(float("-inf") if reduce_type == "max" else float("inf"), dtype)
    info = torch.iinfo(dtype)
    return literal(info.min if reduce_type == "max" else info.max, dtype)


class CudaReductionWriter(ReductionPlan, CudaEmitter):
    """Prints a reduction region's kernel in CUDA C (the plan: codegen/plan.py's ReductionPlan)."""

    INT_DIV = "/"

    # -- loops over the row ------------------------------------------------------------------------

    def index_line(self, name: str, expr: str) -> str:
        return f"{self.index_type} {name} = {expr};"

    def enter_loop(self) -> None:
        self.pass_id += 1
        self.scopes.append((self.lines, self.cse, self.values, self.mask))
        self.lines, self.cse, self.values = [], dict(self.cse), dict(self.values)
        if self.persistent:
            self.lines.append(f"{self.index_type} rindex = threadIdx.x + k * {self.step};")
        self.lines += self.var_lines("rindex", list(self.space.reduced))

    def exit_loop(self) -> None:
        body = self.lines
        self.lines, self.cse, self.values, self.mask = self.scopes.pop()
        if self.persistent:
            self.lines.append("#pragma unroll")
            self.lines.append(f"for (int k = 0; k < {self.per_thread}; ++k) {{")
            self.lines.append(f"    if (threadIdx.x + k * {self.step} >= rnumel) break;")
        else:
            it = self.index_type
            self.lines.append(f"for ({it} rindex = threadIdx.x; rindex < rnumel; rindex += blockDim.x) {{")
        self.lines += [f"    {ln}" for ln in body] + ["}"]

    def read(self, r: Read) -> str:
        """In a persistent kernel a pass's unmasked read comes from memory once, in the first
        pass, so the byte model counts it once (as pass 0); `load` keys its registers by `r`."""
        self.reads.append(r)
        saved = self.pass_id
        if self.persistent and self.in_pass() and not self.mask_depth:
            self.pass_id = 0
        try:
            return super().read(r)
        finally:
            self.pass_id = saved
            self.reads.pop()

    def in_pass(self) -> bool:
        return bool(self.scopes) and self.lines is not self.scopes[-1][0]

    def load(self, arg: str, offset: str, dtype: torch.dtype) -> str:
        """In a persistent kernel, what a pass loads stays in registers (`ld0[k]`) for the later
        passes over the row, keyed by the IR read (the same element of the row in every pass,
        whatever its offset's temps are called there). Masked reads and per-row values load as
        usual."""
        if not (self.persistent and self.in_pass()) or self.mask_depth:
            return super().load(arg, offset, dtype)
        key = ("registers", self.reads[-1])
        row_scope_cse = self.scopes[-1][1]  # the passes after this one start from a copy of it
        array = row_scope_cse.get(key)
        if array is None:
            array = row_scope_cse[key] = f"ld{self.arrays}"
            self.arrays += 1
            self.prologue.append(f"{C_TYPES[dtype]} {array}[{self.per_thread}];")
            self.lines.append(f"{array}[k] = {arg}[{offset}];")
        return self.tmp(("load", arg, offset), f"{array}[k]", dtype)

    def masked(self, e):
        self.mask_depth += 1
        try:
            return super().masked(e)
        finally:
            self.mask_depth -= 1

    # -- reductions ----------------------------------------------------------------------------------

    def reduce_level(self, nodes: list[ReduceNode]) -> None:
        for node in nodes:
            acc = self.bodies[node.name].dtype
            if node.name in self.online:
                zero, n = literal(0, acc), node.name
                names = ("acc",) if self.online[n].kind == "softmax" else WELFORD
                self.lines.append(f"{C_TYPES[acc]} {', '.join(f'{self.acc(n, a)} = {zero}' for a in names)};")
                continue
            init = identity(node.reduce_type, acc)
            self.lines.append(f"{C_TYPES[acc]} {self.acc(node.name)} = {init};")
            if node.reduce_type in ("argmax", "argmin"):
                self.lines.append(f"long long {self.acc(node.name, 'idx')} = 0x7fffffffffffffffLL;")
        self.enter_loop()
        # folded sums first: a softmax sum reads its max's running value before this pass moves it
        for node in sorted(nodes, key=lambda n: n.name not in self.online):
            if node.name in self.online:
                fold, n = self.online[node.name], node.name
                value = self.emit(fold.value)
                if fold.kind == "softmax":
                    running, peak = self.acc(n), self.acc(fold.shift.name)
                    self.lines.append(f"{running} = gjit_online_sum_exp({running}, {peak}, {value});")
                else:
                    accs = ", ".join(self.acc(n, acc) for acc in WELFORD)
                    self.lines.append(f"gjit_welford_add({accs}, {value});")
                continue
            value = self.emit(self.bodies[node.name])
            a = self.acc(node.name)
            if node.reduce_type in ("argmax", "argmin"):
                i, is_max = self.acc(node.name, "idx"), str(node.reduce_type == "argmax").lower()
                self.lines.append(
                    f"if (gjit_arg_better({value}, (long long)rindex, {a}, {i}, {is_max})) "
                    f"{{ {a} = {value}; {i} = rindex; }}"
                )
            else:
                self.lines.append(f"{a} = {FUNCTORS[node.reduce_type]}()({a}, {value});")
        self.exit_loop()
        for node in sorted(nodes, key=lambda n: n.name in self.online):  # folded ones need the rest
            acc = self.bodies[node.name].dtype
            a, init = self.acc(node.name), f"({C_TYPES[acc]})({identity(node.reduce_type, acc)})"
            if node.name in self.online:
                fold, n = self.online[node.name], node.name
                shift = self.emit(fold.shift)
                if fold.kind == "softmax":
                    reduced = f"gjit_online_sum_exp_final({a}, {self.acc(fold.shift.name)}, {shift})"
                else:
                    accs = ", ".join(self.acc(n, acc) for acc in WELFORD)
                    reduced = f"gjit_welford_final({accs}, {shift})"
            elif node.reduce_type in ("argmax", "argmin"):
                is_max = str(node.reduce_type == "argmax").lower()
                call = f"gjit_block_argreduce({a}, {self.acc(node.name, 'idx')}, {is_max}, {init})"
                self.values[node.name] = self.tmp(("final", node.name), call, torch.int64)
                continue
            else:
                reduced = f"gjit_block_reduce({a}, {FUNCTORS[node.reduce_type]}(), {init})"
            value = self.tmp(("final", node.name), reduced, acc)
            cast = to_dtype(value, acc, node.dtype)
            self.values[node.name] = self.tmp(("cast", node.name), cast, node.dtype)

    def store(self, name: str) -> None:
        value = self.node_value(name)
        arg = self.out_args.setdefault(name, f"out_ptr{len(self.out_args)}")
        node = self.nodes[name]
        offset = self.index(self.layout(name).offset_of(self.space.value_index(node)))
        line = self.store_line(arg, offset, value, node.dtype, self.layout(name).dtype)
        self.lines.append(line if self.is_full(name) else f"if (threadIdx.x == 0) {line}")

    # -- the kernel ------------------------------------------------------------------------------------

    def generate(self, name: str):
        xnumel, rnumel, rhint, self.persistent = self.row_shape()
        self.threads = threads_for(rhint)
        launch_blocks = {}
        if rnumel.free_symbols:
            self.step = "blockDim.x"
            if self.persistent:
                # the threads are sized at launch (a row of up to THREADS gets one element per
                # thread); the registers hold the longest row the guard admits
                limit = max(self.options.persistent_max, rhint)
                self.per_thread = -(-limit // THREADS)
                launch_blocks = {"RBLOCK": f"max(32, min({THREADS}, next_power_of_2(rnumel)))"}
                row_max = self.per_thread * THREADS
                why = f"persistent reduction: a row fits {self.per_thread} per thread: {rnumel} <= {row_max}"
                self.assumptions.append((sympy.Le(rnumel, row_max), why))
        else:
            self.step = str(self.threads)
            self.per_thread = -(-int(rnumel) // self.threads)
        self.arrays = 0
        self.reads: list[Read] = []  # the reads being emitted, innermost last
        self.prologue: list[str] = []
        self.mask_depth = 0
        index_dtype = self.pick_index_dtype(xnumel * rnumel)
        self.index_type = "int" if index_dtype == "int32" else "long long"
        self.lines = self.var_lines("xindex", self.kept)
        if not self.persistent:
            self.online = online.fold(self)
        for level in self.reductions_by_level():
            self.reduce_level(level)
        full_stores = [s for s in self.region.stores if self.is_full(s)]
        if full_stores:
            self.enter_loop()
            for s in full_stores:
                self.store(s)
            self.exit_loop()
        for s in self.region.stores:
            if not self.is_full(s):
                self.store(s)
        it = self.index_type
        body = (
            [f"for ({it} xindex = blockIdx.x; xindex < xnumel; xindex += gridDim.x) {{"]
            + [f"    {ln}" for ln in self.prologue + self.lines]
            + ["}"]
        )
        shape = "looped"
        if self.persistent:
            at_most = "up to " if launch_blocks else ""
            shape = f"persistent ({at_most}{self.per_thread} per thread in registers)"
        threads = f"{self.threads} threads per row"
        if launch_blocks:
            threads = f"up to {THREADS} threads per row, sized at launch"
        reduction = [f"reduction: {rnumel} elements per row, {shape}, {threads}", *self.online_header()]
        reduction.append(self.running_values_header())
        return self.cuda_source(
            name,
            header=self.header(name, xnumel, reduction),
            body=body,
            sizes={"xnumel": xnumel, "rnumel": rnumel},
            threads=THREADS if launch_blocks else self.threads,
            index_dtype=index_dtype,
            blocks={"XBLOCK": 1, "RBLOCK": self.threads},
            rnumel=rnumel,
            persistent=self.persistent,
            passes=1 if self.persistent else self.pass_id,
            launch_blocks=launch_blocks,
        )
