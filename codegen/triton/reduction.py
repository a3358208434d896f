"""Triton codegen for reduction regions: one kernel per (outer rows x reduced elements) space.

Programs own XBLOCK outer rows; RBLOCK lanes walk the reduced elements. Members of the
region are either full-space values ([XBLOCK, RBLOCK]) or outer values ([XBLOCK, 1]).
Reductions are ordered in levels (a reduction reading another's result is one level later):

  persistent (RBLOCK >= row length): everything in one pass over registers, the input read once;
  looped: one loop over the row per level, accumulating [XBLOCK, RBLOCK] partials, then a last
          loop for full-space values that leave the kernel (e.g. softmax's output). Softmax's sum
          and a variance's sum of squares share the loop of the level before (codegen/online.py).
"""

from __future__ import annotations

import sympy
import torch

from gjit import ir
from gjit.codegen import online
from gjit.codegen.common import KernelSource, hint, next_power_of_2
from gjit.codegen.plan import ReductionPlan
from gjit.codegen.triton.pointwise import TL_DTYPES, KernelWriter, comment, to_dtype
from gjit.codegen.triton.tiles import TILE, measured_persistent, reduction_tiles
from gjit.config import CompileOptions
from gjit.fusion.regions import Region
from gjit.ir import ReduceNode
from gjit.kernels.triton_helpers import HELPERS

# a variance's accumulators per lane (kernels/triton_helpers.py, welford_add): no count, which
# follows from the lane's position and the row's length
WELFORD = ("half_first", "mean", "m2")


def _identity(reduce_type: str, dtype: torch.dtype) -> str:
    if reduce_type == "sum":
        return "0"
    if reduce_type == "prod":
        return "1"
    if reduce_type in ("argmax", "argmin"):
        reduce_type = "max" if reduce_type == "argmax" else "min"
    if dtype == torch.bool:
        return "False" if reduce_type == "max" else "True"
    big = "float('inf')" if dtype.is_floating_point else str(torch.iinfo(dtype).max)
    small = "float('-inf')" if dtype.is_floating_point else str(torch.iinfo(dtype).min)
    return small if reduce_type == "max" else big


class ReductionWriter(ReductionPlan, KernelWriter):
    """Prints a reduction region's kernel in Triton (the plan: codegen/plan.py's ReductionPlan)."""

    def __init__(
        self, region: Region, graph: ir.LoopGraph, hints: dict[sympy.Symbol, int], options: CompileOptions
    ):
        super().__init__(region, graph, hints, options)
        self.block_zeros = "tl.zeros([XBLOCK, RBLOCK], tl.int32)"
        self.base_masks = {"xmask", "xrmask"}

    # -- loops -----------------------------------------------------------------------------------------

    def enter_loop(self) -> None:
        self.pass_id += 1
        self.scopes.append((self.lines, self.cse, self.values, self.mask))
        self.lines, self.cse, self.values = [], dict(self.cse), dict(self.values)
        self.lines += [
            "rindex = roffset + tl.arange(0, RBLOCK)[None, :]",
            "rmask = rindex < rnumel",
            "xrmask = xmask & rmask",
        ] + self.var_lines("rindex", list(self.space.reduced))
        self.mask = "xrmask"

    def exit_loop(self) -> None:
        body = self.lines
        self.lines, self.cse, self.values, self.mask = self.scopes.pop()
        self.lines.append("for roffset in range(0, rnumel, RBLOCK):")
        self.lines += [f"    {ln}" for ln in body]

    def load_mask(self, used: set, r: ir.Read) -> str:
        """A load of one value a row (its offset uses no reduced variable) under the block's own
        mask loads [XBLOCK, 1] under the rows' mask: once a row, not once a lane, and an index it
        feeds (an embedding's row) stays the same along the row, so that gather is contiguous and
        vectorizes. Not under a narrower mask (a `Masked` body's), which may vary along the row, nor
        where rows are empty (rnumel 0: such a read has no element to read), nor for a gather whose
        index varies along the row (torch.gather's index tensor, an arange): its offset is then a
        full block, and a lane past the row's end holds a masked load's undefined index, or one
        past the row (gathered from another row's or outside the buffer), read unmasked."""
        per_row = not used & self.rvars and not any(ir.free_symbols(v) & self.rvars for _, v, _ in r.indirect)
        if self.mask == "xrmask" and "xrmask" in self.base_masks and per_row:
            return "xmask"
        return self.mask

    def index_line(self, name: str, expr: str) -> str:
        return f"{name} = {expr}"

    # -- reductions --------------------------------------------------------------------------------------

    def combine(self, node: ReduceNode, acc: str, value: str) -> str:
        dtype = self.bodies[node.name].dtype
        if node.reduce_type == "sum":
            return f"{acc} + {value}"
        if node.reduce_type == "prod":
            return f"{acc} * {value}"
        fn = "tl.maximum" if node.reduce_type == "max" else "tl.minimum"
        nan = ", tl.PropagateNan.ALL" if dtype.is_floating_point else ""
        return f"{fn}({acc}, {value}{nan})"

    def final(self, node: ReduceNode, partial: str) -> str:
        dtype = self.bodies[node.name].dtype
        if node.reduce_type == "sum":
            return f"tl.sum({partial}, 1)[:, None]"
        if node.reduce_type == "prod":
            self.helpers.add("mul")
            return f"tl.reduce({partial}, 1, _mul)[:, None]"
        if dtype.is_floating_point:
            helper = f"{node.reduce_type}_nan"
            self.helpers.add(helper)
            return f"tl.reduce({partial}, 1, _{helper})[:, None]"
        if dtype == torch.bool:
            return f"tl.{node.reduce_type}({partial}, 1)[:, None]"
        # rows past xnumel reduce no element and hold the identity (INT_MIN / INT_MAX): integer
        # math on them (x - amax) would overflow, which Triton's debug mode traps
        return f"tl.where(xmask, tl.{node.reduce_type}({partial}, 1)[:, None], 0)"

    def finish(self, node: ReduceNode, reduced: str) -> None:
        """Cast the reduced [XBLOCK, 1] value to the node's dtype; later reads use it."""
        acc = self.bodies[node.name].dtype
        if acc == node.dtype:
            self.values[node.name] = reduced
        else:
            self.values[node.name] = self.tmp(("reduced", node.name), to_dtype(reduced, acc, node.dtype))

    def arg_partial(self, node: ReduceNode) -> tuple[str, str]:
        """(value, index) blocks of an argmax/argmin with masked lanes that can never win."""
        acc = self.bodies[node.name].dtype
        value = self.emit(self.bodies[node.name])
        identity = _identity(node.reduce_type, acc)
        masked = self.tmp(("rmasked", value, identity), f"tl.where(xrmask, {value}, {identity})")
        index = self.tmp(("rindex",), "tl.where(xrmask, rindex, 2147483647)")
        self.helpers.add(node.reduce_type)
        return masked, index

    def reduce_persistent(self, node: ReduceNode) -> None:
        if node.reduce_type in ("argmax", "argmin"):
            value, index = self.arg_partial(node)
            final = f"tl.reduce(({value}, {index}), 1, _{node.reduce_type})[1][:, None]"
            self.finish_arg(node, self.tmp(("final", node.name), final))
            return
        masked = self.rmasked(self.bodies[node.name], node.reduce_type)
        self.finish(node, self.tmp(("final", node.name), self.final(node, masked)))

    def rmasked(self, body: ir.Expr, reduce_type: str) -> str:
        """`body`'s value with lanes outside the row holding `reduce_type`'s identity."""
        value = self.emit(body)
        identity = _identity(reduce_type, body.dtype)
        return self.tmp(("rmasked", value, identity), f"tl.where(xrmask, {value}, {identity})")

    def finish_arg(self, node: ReduceNode, index: str) -> None:
        self.values[node.name] = self.tmp(("reduced", node.name), f"{index}.to(tl.int64)")

    def reduce_looped(self, nodes: list[ReduceNode]) -> None:
        accs = {}
        for node in nodes:
            acc = self.bodies[node.name].dtype
            accs[node.name] = self.acc(node.name)
            if node.name in self.online:
                self.online_init(node)
                continue
            init = f"tl.full([XBLOCK, RBLOCK], {_identity(node.reduce_type, acc)}, {TL_DTYPES[acc]})"
            self.lines.append(f"{accs[node.name]} = {init}")
            if node.reduce_type in ("argmax", "argmin"):
                self.lines.append(
                    f"{self.acc(node.name, 'idx')} = tl.full([XBLOCK, RBLOCK], 2147483647, tl.int32)"
                )
        self.enter_loop()
        # folded sums first: a softmax sum reads its max's running value before this pass moves it
        for node in sorted(nodes, key=lambda n: n.name not in self.online):
            if node.name in self.online:
                self.online_step(node)
                continue
            if node.reduce_type in ("argmax", "argmin"):
                value, index = self.arg_partial(node)
                a, i = accs[node.name], self.acc(node.name, "idx")
                self.lines.append(f"{a}, {i} = _{node.reduce_type}({a}, {i}, {value}, {index})")
                continue
            masked = self.rmasked(self.bodies[node.name], node.reduce_type)
            self.lines.append(f"{accs[node.name]} = {self.combine(node, accs[node.name], masked)}")
        self.exit_loop()
        for node in sorted(nodes, key=lambda n: n.name in self.online):  # folded ones need the rest
            if node.name in self.online:
                self.online_final(node)
                continue
            if node.reduce_type in ("argmax", "argmin"):
                a, i = accs[node.name], self.acc(node.name, "idx")
                final = f"tl.reduce(({a}, {i}), 1, _{node.reduce_type})[1][:, None]"
                self.finish_arg(node, self.tmp(("final", node.name), final))
                continue
            self.finish(node, self.tmp(("final", node.name), self.final(node, accs[node.name])))

    # -- folded sums (codegen/online.py) -----------------------------------------------------------------

    def online_init(self, node: ReduceNode) -> None:
        zeros = f"tl.zeros([XBLOCK, RBLOCK], {TL_DTYPES[self.bodies[node.name].dtype]})"
        if self.online[node.name].kind == "softmax":
            self.lines.append(f"{self.acc(node.name)} = {zeros}")
        else:
            self.lines += [f"{self.acc(node.name, acc)} = {zeros}" for acc in WELFORD]

    def online_step(self, node: ReduceNode) -> None:
        fold, n = self.online[node.name], node.name
        if fold.kind == "softmax":
            masked = self.rmasked(fold.value, "max")
            self.helpers.add("online_sum_exp")
            acc, shift = self.acc(n), self.acc(fold.shift.name)
            self.lines.append(f"{acc} = _online_sum_exp({acc}, {shift}, {masked})")
        else:
            value = self.emit(fold.value)
            self.helpers.add("welford_add")
            accs = ", ".join(self.acc(n, acc) for acc in WELFORD)
            self.lines.append(f"{accs} = _welford_add({accs}, {value}, xrmask, roffset // RBLOCK)")

    def online_final(self, node: ReduceNode) -> None:
        fold, n = self.online[node.name], node.name
        shift = self.emit(fold.shift)
        if fold.kind == "softmax":
            self.helpers.add("online_sum_exp_final")
            final = f"_online_sum_exp_final({self.acc(n)}, {self.acc(fold.shift.name)}, {shift})"
        else:
            self.helpers.add("welford_final")
            final = (
                f"_welford_final({', '.join(self.acc(n, acc) for acc in WELFORD)}, {shift}, rnumel, RBLOCK)"
            )
        self.finish(node, self.tmp(("final", n), final))

    # -- stores ------------------------------------------------------------------------------------------

    def store(self, name: str) -> None:
        value = self.node_value(name)
        arg = self.out_args.setdefault(name, f"out_ptr{len(self.out_args)}")
        node = self.nodes[name]
        offset_expr = self.layout(name).offset_of(self.space.value_index(node))
        offset = self.index(offset_expr)
        mask = "xrmask" if self.is_full(name) else "xmask"
        if not sympy.sympify(offset_expr).free_symbols & set(self.vars):
            offset += ") + (tl.zeros([XBLOCK, 1], tl.int32)"  # a one-row result still needs a block pointer
        value = f"tl.where({mask}, {value}, {value})"  # a block even when the value is per-row or scalar
        self.lines.append(f"tl.store({arg} + ({offset}), {value}, {mask})")

    # -- the kernel --------------------------------------------------------------------------------------

    def generate(self, name: str) -> KernelSource:
        space = self.space
        xnumel, rnumel, rhint, persistent = self.row_shape()
        xhint = hint(xnumel, self.hints)
        walk, r_static = self.walk(), not rnumel.free_symbols
        configs = 2 if measured_persistent(walk, rhint, persistent, r_static, self.options) else 1
        persistent |= configs == 2 and self.region.config == 1  # gjit/choice/row_kernels.py measures both
        tiles = reduction_tiles(walk, xhint, rhint, persistent, r_static, self.narrowest(), self.options)
        persistent = tiles.persistent
        launch_blocks = {}
        if persistent and rnumel.free_symbols:
            # the row length varies between calls: the block is sized at launch (same source,
            # Triton specializes the constexpr), valid while a row fits one block
            limit = max(self.options.persistent_max, tiles.rblock)
            launch_blocks = {
                "RBLOCK": "next_power_of_2(rnumel)",
                "XBLOCK": f"max(1, min({next_power_of_2(xhint)}, {TILE} // RBLOCK))",
            }
            self.assumptions.append(
                (sympy.Le(rnumel, limit), f"persistent reduction: a row fits one block: {rnumel} <= {limit}")
            )
        if rnumel == 0:  # no lane is ever active: a var-free load under xrmask must stay masked
            self.base_masks = {"xmask"}
        index_dtype = self.pick_index_dtype(xnumel * rnumel)
        pid = "tl.program_id(0)" if index_dtype == "int32" else "tl.program_id(0).to(tl.int64)"
        self.lines = [
            f"xoffset = {pid} * XBLOCK",
            "xindex = xoffset + tl.arange(0, XBLOCK)[:, None]",
            "xmask = xindex < xnumel",
        ] + self.var_lines("xindex", self.kept)
        full_stores = [s for s in self.region.stores if self.is_full(s)]
        outer_stores = [s for s in self.region.stores if not self.is_full(s)]
        if persistent:
            self.lines += [
                "rindex = tl.arange(0, RBLOCK)[None, :]",
                "rmask = rindex < rnumel",
                "xrmask = xmask & rmask",
            ]
            self.lines += self.var_lines("rindex", list(space.reduced))
            for level in self.reductions_by_level():
                for node in level:
                    self.mask = "xrmask"
                    self.reduce_persistent(node)
            for s in full_stores:
                self.mask = "xrmask"
                self.store(s)
        else:
            self.online = online.fold(self)  # may move a folded sum's level: group after it
            for level in self.reductions_by_level():
                self.reduce_looped(level)
            if full_stores:
                self.enter_loop()
                for s in full_stores:
                    self.store(s)
                self.exit_loop()
        self.mask = "xmask"
        for s in outer_stores:
            self.store(s)
        return self.finish_source(name, xnumel, rnumel, tiles, index_dtype, launch_blocks, configs)

    def finish_source(
        self, name, xnumel, rnumel, tiles, index_dtype, launch_blocks, configs=1
    ) -> KernelSource:
        persistent = tiles.persistent
        shape = "persistent" if persistent else "looped"
        reduction = [f"reduction: {rnumel} elements per row, {shape}", tiles.text(), *self.online_header()]
        if not persistent:
            reduction.append(self.running_values_header())
        if configs > 1:
            which = f"configuration {self.region.config}"
            reduction.append(f"{which}: looped (0, the table's) or persistent (1), timed on a GPU")
        header = comment(self.header(name, xnumel, reduction))
        helpers = [HELPERS[h] for h in sorted(self.helpers)]
        return self.kernel_source(
            name,
            header=header,
            helpers=helpers,
            body=self.lines,
            sizes={"xnumel": xnumel, "rnumel": rnumel},
            blocks={"XBLOCK": tiles.xblock, "RBLOCK": tiles.rblock},
            index_dtype=index_dtype,
            rnumel=rnumel,
            persistent=persistent,
            passes=1 if persistent else self.pass_id,
            launch_blocks=launch_blocks,
            num_warps=tiles.num_warps,
            configs=configs,
        )
