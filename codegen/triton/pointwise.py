"""Triton codegen: one fused region -> one readable @triton.jit kernel.

Sizes and symbolic strides are kernel arguments, so the same source serves every size an
entry admits; Triton's own launcher then specializes each call on 16-divisibility and
alignment. Math that core `tl` lacks goes through libdevice (on the CPU interpreter,
`gjit.runtime.interpret` gives libdevice's symbols numpy implementations).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import sympy
import torch

from gjit import ir
from gjit.codegen.common import DEBUG_DECORATOR, INFIX, KernelSource, constant, hint, next_power_of_2
from gjit.codegen.indexing import tile_exprs
from gjit.codegen.plan import RegionPlan
from gjit.codegen.printer import TritonPrinter
from gjit.config import CompileOptions
from gjit.fusion.regions import Region
from gjit.ir import Expr, IndexValue, Masked, Op, Read
from gjit.kernels.polynomials import POLYNOMIALS
from gjit.kernels.triton_helpers import HELPERS

TILE_2D = 4096  # elements of a 2-D tile (a transpose's)
TILE_SIDE = 64  # its side along the stores, where the tensor is that wide

TL_DTYPES = {
    torch.float32: "tl.float32",
    torch.float16: "tl.float16",
    torch.bfloat16: "tl.bfloat16",
    torch.float64: "tl.float64",
    torch.int64: "tl.int64",
    torch.int32: "tl.int32",
    torch.int16: "tl.int16",
    torch.int8: "tl.int8",
    torch.uint8: "tl.uint8",
    torch.bool: "tl.int1",
}


POINTER_TYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float64: "fp64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "i1",
}


def _floordiv(a: str, b: str, dtype: torch.dtype) -> str:
    return f"({a} // {b}) - ((({a} % {b}) != 0) & (({a} < 0) != ({b} < 0))).to({TL_DTYPES[dtype]})"


def _remainder(a: str, b: str, dtype: torch.dtype) -> str:
    r = f"({a} % {b})"
    return f"tl.where(({r} != 0) & (({r} < 0) != ({b} < 0)), {r} + {b}, {r})"


def _shift(op: str) -> Callable[[str, str, torch.dtype], str]:
    """ATen defines shifts by a negative amount or by at least the bit width (0 for <<, the sign
    for >>); LLVM does not, so a shift amount that is not a literal in range gets a select."""

    def emit(a: str, b: str, dtype: torch.dtype) -> str:
        bits = torch.iinfo(dtype).bits
        if b.lstrip("-").isdigit() and 0 <= int(b) < bits:
            return f"{a} {op} {b}"
        outside = "0" if op == "<<" else f"tl.where({a} < 0, -1, 0)"
        return f"tl.where(({b} >= 0) & ({b} < {bits}), {a} {op} {b}, {outside})"

    return emit


def _minmax(fn: str) -> Callable[[str, str, torch.dtype], str]:
    def emit(a: str, b: str, dtype: torch.dtype) -> str:
        if dtype.is_floating_point:
            return f"tl.{fn}({a}, {b}, tl.PropagateNan.ALL)"
        return f"tl.{fn}({a}, {b})"

    return emit


# Per-op emitters: IR op name -> source text. Arguments are already-printed operands; the
# last argument is the dtype of the result (the compute dtype).
TritonOverrides: dict[str, Callable[..., str]] = {
    "truncdiv": lambda a, b, t: f"{a} // {b}",
    "floordiv": _floordiv,
    "remainder": _remainder,
    "fmod": lambda a, b, t: f"{a} % {b}",
    "neg": lambda a, t: f"-{a}",
    "abs": lambda a, t: f"tl.abs({a})",
    "maximum": _minmax("maximum"),
    "minimum": _minmax("minimum"),
    "fmax": lambda a, b, t: f"tl.maximum({a}, {b})",
    "fmin": lambda a, b, t: f"tl.minimum({a}, {b})",
    "pow": lambda a, b, t: f"libdevice.pow({a}, {b})",
    "atan2": lambda a, b, t: f"libdevice.atan2({a}, {b})",
    "copysign": lambda a, b, t: f"libdevice.copysign({a}, {b})",
    "exp": lambda a, t: f"tl.exp({a})",
    "exp2": lambda a, t: f"tl.exp2({a})",
    "expm1": lambda a, t: f"libdevice.expm1({a})",
    "log": lambda a, t: f"tl.log({a})",
    "log2": lambda a, t: f"tl.log2({a})",
    "log10": lambda a, t: f"libdevice.log10({a})",
    "log1p": lambda a, t: f"libdevice.log1p({a})",
    # sqrt_rn takes float32 only; Triton's sqrt of a float64 is already IEEE (sqrt.rn.f64)
    "sqrt": lambda a, t: f"tl.sqrt_rn({a})" if t != torch.float64 else f"tl.sqrt({a})",
    "rsqrt": lambda a, t: f"libdevice.rsqrt({a})",
    "sin": lambda a, t: f"tl.sin({a})",
    "cos": lambda a, t: f"tl.cos({a})",
    "erf": lambda a, t: f"tl.erf({a})",
    "sigmoid": lambda a, t: f"tl.sigmoid({a})",
    "floor": lambda a, t: f"tl.floor({a})",
    "ceil": lambda a, t: f"tl.ceil({a})",
    "trunc": lambda a, t: f"libdevice.trunc({a})",
    "round": lambda a, t: f"libdevice.rint({a})",
    "frac": lambda a, t: f"{a} - libdevice.trunc({a})",
    "isnan": lambda a, t: f"{a} != {a}",
    "isinf": lambda a, t: f"tl.abs({a}) == float('inf')",
    "isfinite": lambda a, t: f"tl.abs({a}) < float('inf')",
    "signbit": lambda a, t: f"libdevice.signbit({a}) != 0",
    "logical_and": lambda a, b, t: f"{a} & {b}",
    "logical_or": lambda a, b, t: f"{a} | {b}",
    "logical_xor": lambda a, b, t: f"{a} ^ {b}",
    "logical_not": lambda a, t: f"{a} == 0",
    "bitwise_not": lambda a, t: f"~{a}",
    "lshift": _shift("<<"),
    "rshift": _shift(">>"),
    "where": lambda c, a, b, t: f"tl.where({c}, {a}, {b})",
}
for _name, _op in INFIX.items():
    TritonOverrides[_name] = lambda a, b, t, _op=_op: f"{a} {_op} {b}"
for _name in ("tan", "tanh", "sinh", "cosh", "asin", "acos", "atan", "asinh", "acosh", "atanh", "erfinv"):
    TritonOverrides[_name] = lambda a, t, _name=_name: f"libdevice.{_name}({a})"
# special functions: IR op -> libdevice function
LIBDEVICE_SPECIAL = {
    "erfc": "erfc",
    "erfcx": "erfcx",
    "lgamma": "lgamma",
    "ndtri": "normcdfinv",
    "hypot": "hypot",
    "nextafter": "nextafter",
    "bessel_i0": "cyl_bessel_i0",
    "bessel_i1": "cyl_bessel_i1",
    "bessel_j0": "j0",
    "bessel_j1": "j1",
    "bessel_y0": "y0",
    "bessel_y1": "y1",
}
for _name, _fn in LIBDEVICE_SPECIAL.items():
    TritonOverrides[_name] = lambda *args, _fn=_fn: f"libdevice.{_fn}({', '.join(args[:-1])})"
# float64 special functions libdevice lacks: hand-written helpers copied into the kernel's file
HELPER_OPS = {"digamma", "trigamma", "zeta", *POLYNOMIALS, *ir.BESSEL_OPS}
for _name in ir.BESSEL_OPS:  # float64 Chebyshev series (kernels/bessel.py)
    TritonOverrides[_name] = lambda a, t, _name=_name: f"_{_name}({a})"
for _name in POLYNOMIALS:  # (x, n, Hermite's cap, steps rounded to float32): kernels/polynomials.py
    TritonOverrides[_name] = lambda x, n, cap, narrow, t, _name=_name: f"_{_name}({x}, {n}, {cap}, {narrow})"
TritonOverrides["digamma"] = lambda a, t: f"_digamma({a})"
TritonOverrides["trigamma"] = lambda a, t: f"_trigamma({a})"
TritonOverrides["zeta"] = lambda a, b, t: f"_zeta({a}, {b})"


def to_dtype(a: str, src: torch.dtype, dst: torch.dtype) -> str:
    # ATen converts to and from the 16-bit floats through float32 (c10::Half and c10::BFloat16
    # convert from and to float), so int64 or float64 -> half rounds twice there: do the same.
    # It also avoids conversions Triton's interpreter gets wrong (bfloat16 <-> int, float64 ->
    # bfloat16).
    if src == torch.bfloat16 and not dst.is_floating_point:
        a, src = f"{a}.to(tl.float32)", torch.float32
    if dst == torch.bool:
        return f"({a} != 0)"
    if dst in (torch.float16, torch.bfloat16) and src not in (torch.float32, torch.float16, torch.bfloat16):
        return f"{a}.to(tl.float32).to({TL_DTYPES[dst]})"
    return f"{a}.to({TL_DTYPES[dst]})"


def literal(value, dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return repr(bool(value))
    if dtype.is_floating_point:
        v = float(value)
        text = repr(v) if math.isfinite(v) else f"float('{v}')"
        if dtype == torch.float64:
            return f"tl.full([1], {text}, tl.float64)"
        return text
    v = int(value)
    if -(2**31) <= v < 2**31:
        return str(v)
    return f"tl.full([1], {v}, {TL_DTYPES[dtype]})"


class KernelWriter(RegionPlan):
    """Prints one region's kernel in Triton: index setup, CSE'd expression lines, stores."""

    def __init__(
        self, region: Region, graph: ir.LoopGraph, hints: dict[sympy.Symbol, int], options: CompileOptions
    ):
        super().__init__(region, graph, hints, options)
        self.printer = TritonPrinter()
        self.base_masks = {"xmask"}  # masks under which a var-free offset is a plain scalar load
        self.block_zeros = "tl.zeros([XBLOCK], tl.int32)"
        self.debug_asserts = False  # bounds checks emitted: compile with debug=True
        self.helpers: set[str] = set()  # gjit/kernels/triton_helpers.py functions it calls
        self.sides: tuple[set, set] | None = None  # a 2-D tile's (y, x) kernel variables

    @property
    def decorator(self) -> str:
        return DEBUG_DECORATOR if self.debug_asserts else "@triton.jit"

    # -- expressions ----------------------------------------------------------------------------

    def index(self, expr: sympy.Expr, names: dict[sympy.Symbol, str] | None = None) -> str:
        """Print an index expression (in kernel variables), noting the size symbols it uses;
        `names` gives the tmp variables of indirect (data) symbols."""
        self.symbols |= sympy.sympify(expr).free_symbols - set(names or ())
        return TritonPrinter(names)(expr) if names else self.printer(expr)

    def assign(self, var: str, text: str, dtype=None) -> str:
        return f"{var} = {text}"

    def literal(self, value, dtype: torch.dtype) -> str:
        return literal(value, dtype)

    def folded(self, e: Expr) -> str | None:
        if isinstance(e, IndexValue) and sympy.sympify(e.expr).is_number:
            return literal(e.expr, e.dtype)
        if isinstance(e, Op) and e.name == "to_dtype" and constant(e.args[0]) is not None:
            return literal(constant(e.args[0]), e.params[0])  # a constant (size) under a cast
        return None

    def index_value(self, e: IndexValue) -> str:
        expr = self.subst(e.expr)
        if sympy.sympify(expr).is_number:  # e.g. the index of a size-1 dim
            return literal(expr, e.dtype)
        text = self.index(expr)
        if e.dtype == torch.bool:
            return self.tmp(("index", text, self.mask), f"{text}")
        if not sympy.sympify(expr).free_symbols & set(self.vars):
            # sizes only: Triton passes a size argument equal to 1 as the constant 1 (a Python
            # int, no .to()) when it compiles for a GPU; tl.cast takes either
            return self.tmp(("index", text, e.dtype), f"tl.cast({text}, {TL_DTYPES[e.dtype]})")
        return self.tmp(("index", text, e.dtype), f"({text}).to({TL_DTYPES[e.dtype]})")

    def op(self, e: Op, args: list[str]) -> str:
        if e.name == "to_dtype" and _number(args[0]) is not None:
            # a member that is a Python number here (a fill value, an index of a size-1 dim)
            # has no .to(): cast it now, rounding as ATen does
            value = torch.tensor(_number(args[0]), dtype=e.args[0].dtype).to(e.params[0]).item()
            return literal(value, e.params[0])
        if e.name == "to_dtype":
            text = to_dtype(args[0], e.args[0].dtype, e.params[0])
        elif e.name in ir.POLYNOMIAL_OPS:  # both operands blocks of the mask's shape, n 0 outside it
            x, n = args
            x = f"{x} + tl.zeros(({self.mask}).shape, {TL_DTYPES[e.dtype]})"
            text = TritonOverrides[e.name](x, f"tl.where({self.mask}, {n}, 0)", *e.params, e.dtype)
            self.helpers.add(e.name)
        else:
            text = TritonOverrides[e.name](*args, e.dtype)
            if e.name in HELPER_OPS:
                self.helpers.add(e.name)
        # a polynomial's text reads the mask (its degree is 0 outside it): not reused under another
        mask = self.mask if e.name in POLYNOMIALS else None
        return self.tmp(("op", e.name, *args, e.params, mask), text)

    def masked(self, e: Masked) -> str:
        """`body` under the mask (a narrower block mask for its loads), `other` elsewhere."""
        cond = self.index(self.subst(e.mask))
        mask = self.tmp(("mask", cond, self.mask), f"{self.mask} & ({cond})")
        outer, self.mask = self.mask, mask
        values = dict(self.values)
        body = self.emit(e.body)
        # a member's value first computed here holds garbage where the mask is off: not reused outside
        self.mask, self.values = outer, values
        other = literal(e.other, e.dtype)  # two maskings of one value may fill with different values
        return self.tmp(("masked", mask, body, other), f"tl.where({mask}, {body}, {other})")

    def read(self, r: Read) -> str:
        if self.in_registers(r):
            return self.node_value(r.name)
        names = self.indirect(r)
        self.note_load(r, bool(names))
        arg = self.in_args.setdefault(r.name, f"in_ptr{len(self.in_args)}")
        offset = self.subst(self.layout(r.name).offset_of(r.index))
        text = self.index(offset, names)
        used = offset.free_symbols & set(self.vars)
        mask = self.mask
        if used and self.whole_tile(used):
            mask = self.load_mask(used, r)
            load = f"tl.load({arg} + ({text}), {mask})"
        elif used:  # one side of a 2-D tile: broadcast to the tile
            load = f"tl.load({arg} + ({text}) + {self.block_zeros}, {self.mask})"
        elif self.mask in self.base_masks and not names:
            load = f"tl.load({arg} + ({text}))"
        elif names:  # indices loaded at a var-free offset may be scalars: broadcast to the mask
            mask = self.load_mask(used, r)  # the row's, if the indices are one a row
            load = f"tl.load({arg} + ({text}) + tl.zeros({mask}.shape, tl.int32), {mask})"
        else:
            load = f"tl.load({arg} + ({text}) + {self.block_zeros}, {self.mask})"
        return self.tmp(("load", arg, text, mask), load)

    def indirect(self, r: Read | ir.WriteAt, what: str = "", check: bool = False) -> dict[sympy.Symbol, str]:
        """Emit the data an indirect read (or write) indexes with; in debug mode (or `check`),
        assert it is in bounds."""
        what = what or f"reading {r.name}"
        names = {}
        for sym, value, size in r.indirect:
            names[sym] = var = self.emit(value)
            if self.options.debug or check:
                bound = self.index(self.subst(size))
                self.debug_asserts = True
                self.lines.append(
                    f"tl.device_assert(({var} >= 0) & ({var} < {bound}), "
                    f"'index out of bounds {what}', mask={self.mask})"
                )
        return names

    # -- the kernel -----------------------------------------------------------------------------

    def generate(self, name: str) -> KernelSource:
        numel, idx, plan, index_dtype = self.pointwise_space()
        split = self.tile_split(plan)
        if split is None:
            setup = self.index_setup(plan, index_dtype)
            sizes = {"xnumel": numel}
            blocks = {"XBLOCK": xblock_for(numel, self.hints, self.options.xblock)}
            extra, tile = {}, []
        else:
            setup, sizes, blocks, extra = self.tile_setup(plan, split, index_dtype)
            tile = [f"tile: {blocks['YBLOCK']} x {blocks['XBLOCK']} (a read runs down it, the stores across)"]
        for node in self.region.stores:
            value = self.node_value(node)
            arg = self.out_args.setdefault(node, f"out_ptr{len(self.out_args)}")
            offset_expr = self.subst(self.layout(node).offset_of(idx))
            offset, value = self.block_store(
                offset_expr, self.index(offset_expr), value, self.region.bodies[node]
            )
            self.lines.append(f"tl.store({arg} + ({offset}), {value}, xmask)")
        return self.kernel_source(
            name,
            header=comment(self.header(name, numel, tile)),
            body=setup + self.lines,
            sizes=sizes,
            blocks=blocks,
            index_dtype=index_dtype,
            helpers=[HELPERS[h] for h in sorted(self.helpers)],
            **extra,
        )

    def tile_setup(self, plan, split: int, index_dtype: str) -> tuple[list[str], dict, dict, dict]:
        """A 2-D tile's setup (codegen/plan.py `tile_split`): programs in one grid dim, each a
        [YBLOCK, XBLOCK] tile (y its row, x its column, `xmask` the tile's mask); (lines, sizes,
        blocks, the record's extra fields)."""
        ynumel, xnumel = sympy.Mul(*plan.sizes[: split + 1]), sympy.Mul(*plan.sizes[split + 1 :])
        self.sides = (set(plan.vars[: split + 1]), set(plan.vars[split + 1 :]))
        self.BLOCK = ("[YBLOCK, XBLOCK]", "xmask")
        self.block_zeros = "tl.zeros([YBLOCK, XBLOCK], tl.int32)"
        xhint = next_power_of_2(hint(xnumel, self.hints))
        yhint = next_power_of_2(hint(ynumel, self.hints))
        xblock = min(TILE_SIDE, xhint)
        yblock = min(yhint, TILE_2D // xblock)
        xblock = min(xhint, TILE_2D // yblock)
        pid = "tl.program_id(0)" if index_dtype == "int32" else "tl.program_id(0).to(tl.int64)"
        lines = [
            f"pid = {pid}",
            "xtiles = tl.cdiv(xnumel, XBLOCK)",
            "yindex = (pid // xtiles) * YBLOCK + tl.arange(0, YBLOCK)[:, None]",
            "xindex = (pid % xtiles) * XBLOCK + tl.arange(0, XBLOCK)[None, :]",
            "xmask = (yindex < ynumel) & (xindex < xnumel)",
        ]
        for var, expr in zip(plan.vars, tile_exprs(plan.sizes, split)):
            lines.append(f"{var.name} = {self.index(expr)}")
        extra = {"ynumel": ynumel, "num_warps": 8 if xblock * yblock >= TILE_2D else 4}
        if (xnumel * ynumel).free_symbols:  # sides that vary between calls: the tile sized at launch
            widest = f"min({TILE_SIDE}, next_power_of_2(xnumel))"
            extra["launch_blocks"] = {
                "YBLOCK": f"min(next_power_of_2(ynumel), {TILE_2D} // {widest})",
                "XBLOCK": f"min(next_power_of_2(xnumel), {TILE_2D} // YBLOCK)",
            }
        return lines, {"xnumel": xnumel, "ynumel": ynumel}, {"YBLOCK": yblock, "XBLOCK": xblock}, extra

    BLOCK = ("[XBLOCK]", "xmask")  # a store's block shape and mask

    def lanes_indexed(self, offset_expr: sympy.Expr) -> bool:
        """Does a store's offset vary across the whole block (else it is broadcast)?"""
        used = offset_expr.free_symbols & set(self.vars)
        return bool(used) and self.whole_tile(used)

    def load_mask(self, used: set, r: Read) -> str:
        """The mask of read `r`, whose offset uses the kernel variables `used` (the block's own
        here; a reduction narrows it to the rows for a load of one value a row)."""
        return self.mask

    def whole_tile(self, used: set) -> bool:
        """Do kernel variables `used` span the block: a 2-D tile's both sides, any 1-D block's?"""
        return self.sides is None or all(used & side for side in self.sides)

    def block_store(self, offset_expr: sympy.Expr, offset: str, value: str, body: Expr) -> tuple[str, str]:
        """A store's offset and value as blocks of the kernel's shape: an offset the lanes do not
        index (a 0-d store, one loaded index, a size-1 dim of a tile) and a value that does not
        depend on the index are broadcast."""
        shape, mask = self.BLOCK
        if not self.lanes_indexed(offset_expr):
            offset += f") + (tl.zeros({shape}, tl.int32)"
        if not self.depends_on_index(body):
            value = f"tl.where({mask}, {value}, {value})"
        return offset, value

    def kernel_source(
        self,
        name: str,
        header: list[str],
        body: list[str],
        sizes: dict[str, sympy.Expr],
        blocks: dict[str, int],
        index_dtype: str,
        helpers: list[str] = (),
        **extra,
    ) -> KernelSource:
        """Assemble the kernel: parameters (pointers, size symbols, numels, block sizes), source,
        Triton signature and the modeled traffic. `header`: comment lines; `helpers`: the
        hand-written functions it calls (gjit/kernels/triton_helpers.py)."""
        symbols = self.kernel_size_symbols()
        params = [*self.in_args.values(), *self.out_args.values(), *(s.name for s in symbols), *sizes]
        int_type = "i32" if index_dtype == "int32" else "i64"
        pointers = {**self.in_args, **self.out_args}
        signature = {arg: "*" + POINTER_TYPES[self.layout(n).dtype] for n, arg in pointers.items()}
        signature |= {p: int_type for p in params[len(signature) :]}
        signature |= {b: "constexpr" for b in blocks}
        constexprs = [f"{b}: tl.constexpr" for b in blocks]
        key = comment(
            [
                self.key_line(
                    signature,
                    blocks,
                    extra.get("launch_blocks", {}),
                    extra.get("num_warps", 4),
                    extra.get("num_stages"),
                )
            ]
        )
        source = "\n".join(
            [*header, *key, *helpers]
            + [self.decorator, f"def {name}({', '.join(params + constexprs)}):"]
            + [f"    {ln}" for ln in body]
        )
        return self.kernel_record(name, source, sizes, signature, blocks, index_dtype, **extra)

    def index_setup(self, plan, index_dtype: str) -> list[str]:
        pid = "tl.program_id(0)" if index_dtype == "int32" else "tl.program_id(0).to(tl.int64)"
        lines = [
            f"xoffset = {pid} * XBLOCK",
            "xindex = xoffset + tl.arange(0, XBLOCK)",
            "xmask = xindex < xnumel",
        ]
        for var, expr in zip(plan.vars, plan.var_exprs):
            lines.append(f"{var.name} = {self.index(expr)}")
        return lines


def comment(lines: list[str]) -> list[str]:
    return [f"# {ln}" for ln in lines]


KERNEL_PRELUDE = """import triton
import triton.language as tl
from triton.language.extra import libdevice

"""


def _number(text: str) -> bool | int | float | None:
    """The value of an emitted Python number literal (see `literal`), or None for anything else."""
    if text in ("True", "False"):
        return text == "True"
    special = re.fullmatch(r"float\('(-?inf|nan)'\)", text)
    if special:
        return float(special.group(1))
    for parse in (int, float):
        try:
            return parse(text)
        except ValueError:
            pass
    return None


def xblock_for(numel: sympy.Expr, hints: dict[sympy.Symbol, int], xblock: int) -> int:
    """Pointwise block size: `xblock`, smaller for small (example) sizes."""
    return max(16, min(xblock, next_power_of_2(hint(numel, hints))))
