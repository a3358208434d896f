"""Triton codegen of an attention region: the template of kernels/attention.py filled with it.

The region (fusion) is one `AttentionNode` over (batch..., L, Ev, S, D) and the pointwise nodes
over its output (batch..., L, Ev) that consume it. Its `Attention` body gives four expressions,
each printed with the index variables of its tile: the query with i and d as [BLOCK_M, 1] and
[1, BLOCK_D], the key with d and j as [BLOCK_D, 1] and [1, BLOCK_N], the score with i and j as
the score block's rows and columns (`Score()` is the dot `qk`), the value with j and e as
[BLOCK_N, 1] and [1, BLOCK_E]. Views and inlined producers (a rotary embedding, the copy that
repeats grouped key/value heads) become the loads' index math and the work on the loaded tile.
The epilogue is printed with i and e as the output tile's rows and columns.
"""

from __future__ import annotations

import math

import sympy
import torch

from gjit import ir
from gjit.codegen.common import KernelSource, hint
from gjit.codegen.triton.matmul import MatmulWriter
from gjit.codegen.triton.pointwise import TL_DTYPES
from gjit.ir import Const, Expr, IndexValue, Op, Read, Score, dot_operands, walk
from gjit.kernels.attention import attention_configs, template, tile_order

LOG2E = 1.4426950408889634  # log2(e): the template's softmax is in base 2 (exp2: one instruction)
# dtypes whose finite values pass float32's largest / log2(e) (finfo(float32).min: HF's masks)
WIDE_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
FAR = 2.0**100  # a constant past this stands for minus infinity (finfo.min), finite in eager


def stays_finite_in_base_2(score: Expr) -> bool:
    """Whether the score is finite in base 2 wherever it is finite. HF's masks add finfo.min,
    -3.4e38 in float32 and bfloat16: finite in eager, -inf times log2(e). A row masked to the end
    that way has equal scores, and eager's softmax averages its values; -inf made it empty (NaN,
    or zeros). A score that reads a float32 or bfloat16 tensor (a mask, a bias) or holds a
    constant past 2**100 keeps base e; q . k itself is taken to stay below 2.3e38."""
    for e in walk(score):
        if isinstance(e, Read) and e.dtype in WIDE_DTYPES:
            return False
        if isinstance(e, Const) and math.isfinite(float(e.value)) and abs(float(e.value)) > FAR:
            return False
    return True


def in_base_2(score: Expr) -> Expr:
    """`score` times log2(e), the factor folded into the score's own float32 scale where it has
    one (q.k * scale: one multiply by scale * log2(e)), passed through float32 where, add, sub and
    neg (a bias is multiplied, -inf stays -inf), else one multiply at the end. Nothing below a cast
    or another op changes: the score rounds where eager's does."""
    f32 = torch.float32
    if isinstance(score, Const) and score.dtype == f32:
        return Const(f32, float(score.value) * LOG2E)
    if isinstance(score, Op) and score.dtype == f32:
        if score.name == "where":
            cond, a, b = score.args
            return Op(f32, "where", (cond, in_base_2(a), in_base_2(b)))
        if score.name in ("add", "sub"):
            return Op(f32, score.name, tuple(in_base_2(a) for a in score.args))
        if score.name == "neg":
            return Op(f32, "neg", (in_base_2(score.args[0]),))
        if score.name in ("mul", "truediv"):
            a, b = score.args
            if score.name == "mul" and b.dtype == f32 and not any(isinstance(x, Score) for x in walk(b)):
                return Op(f32, "mul", (a, in_base_2(b)))  # the scale: folded once, out of the loop
            if a.dtype == f32:  # a / b or a * b: the numerator, or the factor that holds the score
                return Op(f32, score.name, (in_base_2(a), b))
    return Op(f32, "mul", (score, Const(f32, LOG2E)))


def causal_inner(score: Expr, i: sympy.Symbol, j: sympy.Symbol) -> Expr | None:
    """The score under sdpa's causal mask, where(j <= i, inner, -inf): `inner`, the score of a
    block wholly before the diagonal; None for any other form."""
    if not (isinstance(score, Op) and score.name == "where"):
        return None
    keep, inner, masked = score.args
    below = isinstance(keep, IndexValue) and keep.expr == sympy.Le(j, i)
    return inner if below and isinstance(masked, Const) and masked.value == float("-inf") else None


class AttentionWriter(MatmulWriter):
    """Prints an attention region's kernel from the template."""

    def __init__(self, region, graph, hints, options):
        super().__init__(region, graph, hints, options)
        c = self.space.vars
        self.batch_vars = list(c[:-4])
        self.i_var, self.e_var, self.j_var, self.d_var = c[-4:]
        self.vars = [self.i_var, self.e_var, self.j_var, self.d_var]
        self.tile_vars: set[sympy.Symbol] = set()  # every tile's index variables (see `tile`)

    def kernel_size_symbols(self) -> list[sympy.Symbol]:
        return [s for s in super().kernel_size_symbols() if s not in self.tile_vars]

    BLOCK = ("[BLOCK_M, BLOCK_E]", "out_mask")

    def lanes_indexed(self, offset_expr: sympy.Expr) -> bool:
        return set(self.vars) <= offset_expr.free_symbols  # the output tile's; else a size-1 dim of it

    def emit(self, e: Expr) -> str:
        if isinstance(e, Score):
            return "qk"
        return super().emit(e)

    def node_value(self, name: str) -> str:
        if name == self.matmul.name and name not in self.values:
            out = "out" if self.matmul.dtype == torch.float32 else f"out.to({TL_DTYPES[self.matmul.dtype]})"
            self.values[name] = self.tmp(("out",), out)
        return super().node_value(name)

    def tile(
        self, tag: str, shape: str, rows: tuple[sympy.Symbol, str, str], cols: tuple[sympy.Symbol, str, str]
    ):
        """A scope over a tile: `rows` and `cols` are (variable, its lanes, its bound). Its index
        variables get the tile's tag (c4_k, c4_v): Triton wants a name to keep its shape through
        the loop, and the key dim is a column of the key tile but a row of the value tile."""
        mask = f"{tag}_mask"
        self.scope(mask, shape)
        (rv, rl, rb), (cv, cl, cb) = rows, cols
        names = {v: sympy.Symbol(f"{v.name}_{tag}", integer=True, nonnegative=True) for v in (rv, cv)}
        self.subst = lambda e: sympy.sympify(e).xreplace(names)
        self.vars = [*names.values()]
        self.tile_vars |= set(self.vars)
        r, c = names[rv].name, names[cv].name
        return [f"{r} = {rl}[:, None]", f"{c} = {cl}[None, :]", f"{mask} = ({r} < {rb}) & ({c} < {cb})"]

    def generate(self, name: str) -> KernelSource:
        full = self.space.full
        batch, (length, dim_v, keys, dim) = full[:-4], full[-4:]
        out_numel = sympy.Mul(*batch, length, dim_v)
        index_dtype = self.pick_index_dtype(sympy.Mul(*batch, sympy.Max(length, keys), sympy.Max(dim, dim_v)))
        body: ir.Attention = self.bodies[self.matmul.name]
        dtype, (query_value, key_value) = dot_operands(body.query, body.key)
        value_dtype, (value_value,) = dot_operands(body.value)
        configs = attention_configs(
            hint(length, self.hints),
            hint(keys, self.hints),
            hint(dim, self.hints),
            hint(dim_v, self.hints),
            dtype,
        )
        blocks = configs[min(self.region.config, len(configs) - 1)]  # gjit/tuning.py measures them
        for size, block in ((dim, blocks.d), (dim_v, blocks.e)):
            fits = (sympy.Le(size, block), f"the head dim {size} <= {block} (one tile)")
            if not sympy.sympify(size).is_number and fits not in self.assumptions:  # a dynamic head dim
                self.assumptions.append(fits)
        wide = ".to(tl.int64)" if index_dtype == "int64" else ""
        lanes_d, lanes_e = f"tl.arange(0, BLOCK_D){wide}", f"tl.arange(0, BLOCK_E){wide}"
        i, e, j, d = self.i_var, self.e_var, self.j_var, self.d_var

        head = [f"L = {self.index(length)}", f"S = {self.index(keys)}", f"D = {self.index(dim)}"]
        head += [f"EV = {self.index(dim_v)}", *tile_order(index_dtype, self.matmul.causal)]
        if index_dtype == "int64":
            head.append("rm = rm.to(tl.int64)")
        head += self.batch_lines(batch)

        query = self.tile("q", "[BLOCK_M, BLOCK_D]", (i, "rm", "L"), (d, lanes_d, "D"))
        value = self.emit(query_value)
        query, value = self.zero_masked(query + self.lines, value, query_value, "q_mask", dtype)
        query.append(f"q = {value}")

        key = self.tile("k", "[BLOCK_D, BLOCK_N]", (d, lanes_d, "D"), (j, f"rn{wide}", "S"))
        value = self.emit(key_value)
        key, value = self.zero_masked(key + self.lines, value, key_value, "k_mask", dtype)
        key.append(f"k = {value}")

        base_2 = stays_finite_in_base_2(body.score)
        units = in_base_2 if base_2 else (lambda score: score)
        score = self.tile("s", "[BLOCK_M, BLOCK_N]", (i, "rm", "L"), (j, f"rn{wide}", "S"))
        value = self.emit(units(body.score))
        # keys past the end take no part; a query row past the end is finite garbage, not stored
        score += [*self.lines, f"s = tl.where({j.name}_s < S, {value}, float('-inf'))"]
        # the blocks before the causal diagonal and the end: the score with neither mask
        inner = causal_inner(body.score, i, j) if self.matmul.causal else body.score
        full_score = None
        if inner is not None:
            full_score = self.tile("s", "[BLOCK_M, BLOCK_N]", (i, "rm", "L"), (j, f"rn{wide}", "S"))
            value = self.emit(units(inner))
            full_score += [*self.lines, f"s = {value}"]

        vals = self.tile("v", "[BLOCK_N, BLOCK_E]", (j, f"rn{wide}", "S"), (e, lanes_e, "EV"))
        value = self.emit(value_value)
        vals, value = self.zero_masked(vals + self.lines, value, value_value, "v_mask", value_dtype)
        vals.append(f"v = {value}")

        epilogue = self.tile("out", "[BLOCK_M, BLOCK_E]", (i, "rm", "L"), (e, lanes_e, "EV"))
        self.store_outputs()
        epilogue += self.lines

        ieee = ', input_precision="ieee"'
        lines = template(
            head, query, key, score, vals,
            (ieee if dtype == torch.float32 else "", ieee if value_dtype == torch.float32 else ""),
            TL_DTYPES[value_dtype], self.matmul.empty_rows, epilogue, self.matmul.causal, full_score,
            base_2,
        )  # fmt: skip
        programs = sympy.Mul(*batch, (length + blocks.m - 1) // blocks.m)  # sympy floor: integer math
        dims = f"[{', '.join(map(str, batch))}{', ' if batch else ''}{length} x {dim}]"
        extra = [
            f"attention template (kernels/attention.py): queries {dims} against {keys} keys "
            f"(value head dim {dim_v}), {blocks.m} queries per program ({blocks.warps} warps), keys in steps "
            f"of {blocks.n}, "
            f"online softmax in float32 {'in base 2' if base_2 else '(base e: a wide mask or bias)'}, "
            f"tl.dot on {ir.dtype_str(dtype)} tiles"
            + (" (IEEE float32, no TF32)" if dtype == torch.float32 else ""),
            "a row with every score masked gives "
            + (
                "zeros (as scaled_dot_product_attention)"
                if self.matmul.empty_rows == "zero"
                else "NaN (as softmax)"
            ),
        ]
        if self.matmul.causal:
            extra.append("causal (top-left): the key loop ends at the query tile's last row")
        return self.template_source(
            name, out_numel, extra, lines, programs, blocks, index_dtype, len(configs)
        )
