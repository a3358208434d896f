"""Triton codegen of a matmul region: the template of kernels/matmul.py filled with the region.

The region (fusion) is one `MatmulNode` over (batch..., M, N, K) and the pointwise nodes over
its output space (batch..., M, N) that consume the product. Its body `mul(lhs, rhs)` gives the
two operand expressions: each is printed, under its tile's mask, with the index variables of
its tile (m and k as [BLOCK_M, 1] and [1, BLOCK_K], k and n as [BLOCK_K, 1] and [1, BLOCK_N]):
views and inlined producers become the loads' index math and the work on the loaded tile. A
float32 cast around a 16-bit operand is left to the dot (tensor cores multiply 16-bit values
exactly into the float32 accumulator). The epilogue is printed with m and n as the output tile's
rows and columns; the product is the accumulator, rounded to the node's dtype as eager rounds it.
"""

from __future__ import annotations

import re
from typing import Any

import sympy
import torch

from gjit import ir
from gjit.codegen.common import KernelSource, hint
from gjit.codegen.triton.pointwise import TL_DTYPES, KernelWriter, comment
from gjit.config import CompileOptions
from gjit.fusion.regions import Region
from gjit.fusion.rows import node_placement, row_placement, value_index
from gjit.fusion.statistics import row_index, statistics_row
from gjit.ir import Expr, MatmulNode, Op, Read, ReduceNode, dot_operands
from gjit.kernels.matmul import fit_stages, matmul_configs, row_blocks, shared_lhs, template, tile_order
from gjit.kernels.triton_helpers import HELPERS


def operands(body: Expr) -> tuple[Expr, Expr]:
    """The two factors of a MatmulNode's body, as the dot loads them (`dot_operands`)."""
    assert isinstance(body, Op) and body.name == "mul", body
    return dot_operands(*body.args)[1]


# the header's note on a float32 product's precision, by the TF32 setting it was compiled under
PRECISION_NOTES = {False: " (IEEE float32, no TF32)", True: " (TF32: torch allows it, allow_tf32)"}


class MatmulWriter(KernelWriter):
    """Prints a matmul region's kernel from the template."""

    def __init__(
        self, region: Region, graph: ir.LoopGraph, hints: dict[sympy.Symbol, int], options: CompileOptions
    ):
        super().__init__(region, graph, hints, options)
        self.kernel_region = region  # the launched region (its parts: the products it computes)
        self.vars: list[sympy.Symbol] = []
        self.subst = lambda e: e
        self.use(region.parts[0] if region.parts else region)

    def use(self, region: Region) -> None:
        """Print `region` (the kernel's region, or one of the products it launches) from now on."""
        self.region = region
        space = region.reduction
        self.space = space
        self.nodes = {n.name: n for n in region.nodes}
        self.matmul = next(n for n in region.nodes if isinstance(n, MatmulNode))
        rows = region.row_epilogue
        self.row_bodies: dict[str, Expr] = {}  # the row epilogue's members, in the tile's variables
        self.row_indices: dict[str, ir.Index] = {}
        if rows is not None:
            mapping = row_placement(region, rows)
            for node in rows.nodes:
                placed = node_placement(rows, node, mapping)
                self.row_bodies[node.name] = ir.substitute(
                    rows.bodies[node.name], lambda r: r, lambda e, m=placed: sympy.sympify(e).xreplace(m)
                )
                self.row_indices[node.name] = value_index(rows, node, mapping)
        self.bodies = {}
        for name, body in region.bodies.items():
            if name in self.row_bodies:
                continue
            mapping = space.placement(self.nodes[name], body)
            self.bodies[name] = ir.substitute(
                body, lambda r: r, lambda e, m=mapping: sympy.sympify(e).xreplace(m)
            )
        c = space.vars
        self.batch_vars = list(c[:-3])
        self.m_var, self.n_var, self.k_var = c[-3:]
        self.vars += [self.m_var, self.n_var, self.k_var]  # the tiles' lanes; batch indices are scalars
        self.row_values: dict[str, str] = {}  # row statistics computed before the k loop
        self.row: tuple = ()

    BLOCK = ("[BLOCK_M, BLOCK_N]", "out_mask")

    def lanes_indexed(self, offset_expr: sympy.Expr) -> bool:
        return {self.m_var, self.n_var} <= offset_expr.free_symbols  # else a size-1 dim of the tile

    def kernel_size_symbols(self) -> list[sympy.Symbol]:
        return [s for s in super().kernel_size_symbols() if s not in self.batch_vars]

    # -- values -----------------------------------------------------------------------------------

    def read(self, r: Read) -> str:
        stats = self.region.row_statistics
        if r.name in self.row_values:
            node = next(n for n in stats.nodes if n.name == r.name)
            assert row_index(node, r.index, stats.reduction.reduced[0]) == self.row, r
            return self.row_values[r.name]
        return super().read(r)

    def statistics(self, index_dtype: str) -> list[str]:
        """The row statistics the left operand reads (gjit/fusion/statistics.py), before the k loop: a
        loop over each row's elements per sum, then the per-row nodes, each [BLOCK_M, 1]."""
        stats = self.region.row_statistics
        if stats is None:
            return []
        (reduced,) = stats.reduction.reduced
        members = {n.name: n for n in stats.nodes}
        placed = self.space.placement(self.matmul)  # the product's index variables -> the tiles'
        self.row = tuple(sympy.sympify(i).xreplace(placed) for i in statistics_row(self.region, stats))
        r_var = sympy.Symbol("r_stat", integer=True, nonnegative=True)
        self.vars.append(r_var)
        mv = self.m_var.name
        lines = ["# row statistics (prologue): " + ", ".join(members) + ", per row of the left operand"]
        lines += [f"{mv} = rm[:, None]", f"row_mask = {mv} < M"]
        wide = ".to(tl.int64)" if index_dtype == "int64" else ""
        for node in stats.nodes:
            iv = ir.index_vars(len(node.full_size if isinstance(node, ReduceNode) else node.size))
            kept = [v for k, v in enumerate(iv) if k != reduced]
            keep = len(iv) > len(self.row)
            mapping = dict(zip(kept if keep else iv, self.row))
            if keep:
                mapping[iv[reduced]] = r_var if isinstance(node, ReduceNode) else sympy.Integer(0)
            body = ir.substitute(
                stats.bodies[node.name], lambda r: r, lambda e, m=mapping: sympy.sympify(e).xreplace(m)
            )
            var = f"row{len(self.row_values)}"
            if isinstance(node, ReduceNode):  # accumulated in the body's dtype, stored as the node's
                cast = f".to({TL_DTYPES[node.dtype]})" if node.dtype != body.dtype else ""
                self.scope("stat_mask", "[BLOCK_M, BLOCK_K]")
                value = self.emit(body)
                lines += [
                    f"{var}_acc = tl.zeros([BLOCK_M, BLOCK_K], {TL_DTYPES[body.dtype]})",
                    f"for r0 in range(0, {self.index(node.full_size[reduced])}, BLOCK_K):",
                    f"    {mv} = rm[:, None]",
                    f"    r_stat = (r0 + tl.arange(0, BLOCK_K)){wide}[None, :]",
                    f"    stat_mask = ({mv} < M) & (r_stat < {self.index(node.full_size[reduced])})",
                    *(f"    {ln}" for ln in self.lines),
                    f"    {var}_acc += tl.where(stat_mask, {value}, 0.0)",
                    f"{var} = tl.sum({var}_acc, 1)[:, None]{cast}  # {node.name}",
                ]
            else:
                self.scope("row_mask", "[BLOCK_M, 1]")
                value = self.emit(body)
                lines += [*self.lines, f"{var} = {value}  # {node.name}"]
            self.row_values[node.name] = var
        return lines

    def batch_lines(self, batch: ir.Index) -> list[str]:
        """The batch index of this program split into the batch dims' variables."""
        lines = []
        for j, var in enumerate(self.batch_vars):
            inner = sympy.Mul(*batch[j + 1 :]) if j + 1 < len(batch) else sympy.Integer(1)
            expr = f"batch // ({self.index(inner)})" if inner != 1 else "batch"
            lines.append(f"{var} = ({expr}) % ({self.index(batch[j])})" if j > 0 else f"{var} = {expr}")
        return lines

    def store_outputs(self) -> None:
        """The epilogue's stores: each value the region stores, on the output tile (`out_mask`)."""
        for node in self.region.stores:
            if node in self.row_bodies:  # the row epilogue's (a norm's output): after the sums
                out_index, body = self.row_indices[node], self.row_bodies[node]
            else:
                out_index, body = self.space.value_index(self.nodes[node]), self.bodies[node]
            arg = self.out_args.setdefault(node, f"out_ptr{len(self.out_args)}")
            offset_expr = self.subst(self.layout(node).offset_of(out_index))
            offset, value = self.block_store(
                offset_expr, self.index(offset_expr), self.node_value(node), body
            )
            self.lines.append(f"tl.store({arg} + ({offset}), {value}, out_mask)")

    def in_registers(self, r: Read) -> bool:
        if r.name in self.row_bodies:  # gjit/fusion/rows.py checked: each reads the others on its own row
            return True
        return r.name in self.bodies and r.index == self.space.value_index(self.nodes[r.name])

    def node_value(self, name: str) -> str:
        if name not in self.values:
            node = self.nodes[name]
            if name in self.row_bodies and isinstance(node, ReduceNode):  # a sum over the row's tile
                body = self.row_bodies[name]
                cast = f".to({TL_DTYPES[node.dtype]})" if node.dtype != body.dtype else ""
                value = self.emit(body)
                self.values[name] = self.tmp(
                    ("row sum", name), f"tl.sum(tl.where(out_mask, {value}, 0.0), 1)[:, None]{cast}"
                )
            elif name in self.row_bodies:
                self.values[name] = self.emit(self.row_bodies[name])
            elif name == self.matmul.name:
                acc = (
                    "acc" if self.matmul.dtype == torch.float32 else f"acc.to({TL_DTYPES[self.matmul.dtype]})"
                )
                self.values[name] = self.tmp(("acc",), acc)
            else:
                self.values[name] = self.emit(self.bodies[name])
        return self.values[name]

    def scope(self, mask: str, shape: str) -> None:
        """A new scope of temporaries (the loop's two tiles, the epilogue): loads under `mask`."""
        self.lines, self.cse, self.values = [], {}, {}
        self.mask = mask
        self.base_masks = {mask}
        self.block_zeros = f"tl.zeros({shape}, tl.int32)"

    def traffic(self, elements: sympy.Expr, rows: sympy.Expr) -> tuple[sympy.Expr, sympy.Expr]:
        """Modeled bytes: each buffer the kernel reads once (the operands' re-reads by other
        tiles are L2 hits on a GPU), each store once."""
        read = sympy.Integer(0)
        for name in dict.fromkeys(n for n, *_ in self.loaded):
            lay = self.layout(name)
            read += (sympy.Mul(*lay.size) if lay.size else sympy.Integer(1)) * lay.dtype.itemsize
        written = sum(
            ((sympy.Mul(*self.layout(n).size) if self.layout(n).size else 1) * self.layout(n).dtype.itemsize)
            for n in self.region.stores
        )
        return read, sympy.sympify(written)

    def zero_masked(
        self, lines: list[str], value: str, operand: Expr, mask: str, dtype: torch.dtype
    ) -> tuple[list[str], str]:
        """An operand tile's lines and its value, zero where `mask` is off, in the dot's `dtype`.
        A 16-bit tile that is one load under the mask in that dtype loads zeros there itself
        (`other=0.0`): Triton then copies it from global memory straight into the shared memory
        wgmma reads, pipelined. Anything else is zeroed in registers (tl.where), which on Hopper
        costs a round trip through shared memory per k step for a tensor-core dot (float32
        products are IEEE, on the FMA units: their operands go to registers anyway)."""
        load = re.fullmatch(rf"{value} = tl\.load\((.*), {mask}\)", lines[-1]) if lines else None
        plain = isinstance(operand, Read) and not operand.indirect and operand.dtype == dtype
        if load and plain and dtype in (torch.float16, torch.bfloat16):
            return [*lines[:-1], f"{value} = tl.load({load.group(1)}, {mask}, other=0.0)"], value
        return lines, f"tl.where({mask}, {value}, 0.0).to({TL_DTYPES[dtype]})"

    # -- the kernel -----------------------------------------------------------------------------

    def generate(self, name: str) -> KernelSource:
        launched = self.kernel_region
        parts = launched.parts or [launched]
        full = self.space.full
        batch, (m, k) = full[:-3], (full[-3], full[-1])
        widths = [p.reduction.full[-2] for p in parts]  # each product's N
        out_numel = sympy.Mul(*batch, m, sympy.Add(*widths))
        lhs, _ = operands(self.bodies[self.matmul.name])
        self.region = launched
        index_dtype = self.pick_index_dtype(out_numel)
        n_hint = max(hint(n, self.hints) for n in widths)
        if launched.row_epilogue is not None:  # one tile covers each output row (gjit/fusion/rows.py)
            configs = [row_blocks(hint(m, self.hints), n_hint, hint(k, self.hints), lhs.dtype)]
            fits = (sympy.Le(widths[0], configs[0].n), f"N = {widths[0]} <= {configs[0].n} (one tile a row)")
            if not sympy.sympify(widths[0]).is_number:  # a dynamic N: a wider one recompiles
                self.assumptions.append(fits)
        else:
            configs = matmul_configs(hint(m, self.hints), n_hint, hint(k, self.hints), lhs.dtype)
        blocks = configs[min(launched.config, len(configs) - 1)]  # gjit/tuning.py measures them
        if launched.config == 0 or len(parts) > 1:  # the table's runs on any GPU (a tuning candidate
            # that does not fit the GPU it is measured on is skipped); each product's loop buffers its own
            blocks = fit_stages(blocks, lhs.dtype.itemsize, len(parts))

        printed = [self.index(n) for n in widths]
        head = [
            f"M = {self.index(m)}",
            *([f"N = {printed[0]}"] if len(parts) == 1 else []),
            f"K = {self.index(k)}",
        ]
        head += tile_order(index_dtype, bool(batch), printed)
        head += self.batch_lines(batch)
        products = []
        for part in parts:
            self.use(part)
            products.append(self.statistics(index_dtype) + self.product_lines(index_dtype))
        self.region = launched
        lines = head + (products[0] if len(parts) == 1 else shared_lhs(printed, products))

        tiles = sympy.Mul(
            *batch,
            (m + blocks.m - 1) // blocks.m,
            sympy.Add(*[(n + blocks.n - 1) // blocks.n for n in widths]),
        )  # sympy floor: printed as integer math
        fp32 = lhs.dtype == torch.float32
        extra = ["matmul template (kernels/matmul.py): " + self.products_line(parts, widths)]
        extra[0] += (
            f", tiles of {blocks.m} x {blocks.n}, k in steps of {blocks.k}, float32 accumulator, tl.dot on "
            f"{ir.dtype_str(lhs.dtype)} tiles" + (PRECISION_NOTES[bool(self.options.tf32)] if fp32 else "")
        )
        if launched.row_epilogue is not None:
            sums = [n.name for n in launched.row_epilogue.nodes if isinstance(n, ReduceNode)]
            rest = ", ".join(n for n in self.row_bodies if n not in sums)
            extra.append(
                f"row epilogue (gjit/fusion/rows.py): {', '.join(sums)} summed over each output row in "
                f"registers, then {rest}: BLOCK_N = {blocks.n} covers N"
            )
        return self.template_source(
            name, out_numel, extra, lines, tiles, blocks, index_dtype, len(configs),
            tf32=self.options.tf32 if fp32 else None,  # on the CPU None: eager's are IEEE there
        )  # fmt: skip

    def products_line(self, parts: list[Region], widths: list[sympy.Expr]) -> str:
        """The header's shapes: the product, or the products sharing the left operand."""
        full = self.space.full
        batch, m, k = full[:-3], full[-3], full[-1]
        lead = f"{', '.join(map(str, batch))}{', ' if batch else ''}{m} x {k}"
        if len(parts) == 1:
            return f"[{lead}] @ [{k} x {widths[0]}]"
        names = [p.lone_product.name for p in parts]
        each = ", ".join(f"{name} [{k} x {n}]" for name, n in zip(names, widths))
        return (
            f"{len(parts)} products of one left operand [{lead}] launched together: @ {each}; "
            "the programs walk the first's column tiles, then the next's"
        )

    def product_lines(self, index_dtype: str) -> list[str]:
        """The k loop and the epilogue of the product being printed (`use`)."""
        lhs, rhs = operands(self.bodies[self.matmul.name])
        mv, nv, kv = self.m_var.name, self.n_var.name, self.k_var.name
        self.scope("lhs_mask", "[BLOCK_M, BLOCK_K]")
        ks = "(k0 + tl.arange(0, BLOCK_K))" + (".to(tl.int64)" if index_dtype == "int64" else "")
        lhs_lines = [f"{mv} = rm[:, None]", f"{kv} = {ks}[None, :]"]
        lhs_lines.append(f"lhs_mask = ({mv} < M) & ({kv} < K)")
        lhs_value = self.emit(lhs)
        dtype = lhs.dtype  # of both tiles (a constant operand prints as a float32 tile: cast it too)
        lhs_lines, lhs_value = self.zero_masked(lhs_lines + self.lines, lhs_value, lhs, "lhs_mask", dtype)

        self.scope("rhs_mask", "[BLOCK_K, BLOCK_N]")
        rhs_lines = [f"{kv} = {ks}[:, None]", f"{nv} = rn[None, :]"]
        rhs_lines.append(f"rhs_mask = ({kv} < K) & ({nv} < N)")
        rhs_value = self.emit(rhs)
        rhs_lines, rhs_value = self.zero_masked(rhs_lines + self.lines, rhs_value, rhs, "rhs_mask", dtype)

        self.scope("out_mask", "[BLOCK_M, BLOCK_N]")
        epilogue = [f"{mv} = rm[:, None]", f"{nv} = rn[None, :]", f"out_mask = ({mv} < M) & ({nv} < N)"]
        self.store_outputs()
        epilogue += self.lines

        fp32 = lhs.dtype == torch.float32
        precision = f', input_precision="{"tf32" if self.options.tf32 else "ieee"}"' if fp32 else ""
        return template([], lhs_lines, lhs_value, rhs_lines, rhs_value, precision, epilogue)

    def template_source(
        self,
        name: str,
        out_numel: sympy.Expr,
        extra: list[str],
        lines: list[str],
        programs: sympy.Expr,
        blocks: Any,
        index_dtype: str,
        configs: int,
        **more: Any,
    ) -> KernelSource:
        """A template kernel (this or the attention template): one program per output tile,
        `programs` of them, in the tile configuration `blocks`, one of `configs`."""
        return self.kernel_source(
            name,
            header=comment(self.header(name, out_numel, extra)),
            body=lines,
            sizes={"xnumel": programs},
            blocks={"XBLOCK": 1, **blocks.as_constexprs()},
            index_dtype=index_dtype,
            helpers=[HELPERS[h] for h in sorted(self.helpers)],
            num_warps=blocks.warps,
            num_stages=blocks.stages,
            configs=configs,
            **more,
        )
