"""CUDA C codegen: one fused region -> one readable `extern "C" __global__` kernel.

The same region IR as the Triton backend, printed per element instead of per block: each thread
walks the iteration space with a grid-stride loop, so any grid is correct (the launcher caps
it), sizes are kernel arguments, and masked reads (cat, pad) become `if` blocks so nothing is
loaded out of bounds. fp16/bf16 are storage types; math runs in float, as in eager. The
analysis (index plan, int32/int64 offsets and their guards, modeled bytes, the header) is the
plan both backends share (codegen/plan.py): only the printing differs. Reductions are in
codegen/cuda/reduction.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import sympy
import torch

from gjit.codegen.common import INFIX, KernelSource, constant, hint, next_power_of_2
from gjit.codegen.plan import RegionPlan
from gjit.codegen.printer import ExprPrinter
from gjit.ir import BESSEL_OPS, Expr, IndexValue, Masked, Op, Read
from gjit.kernels.polynomials import POLYNOMIALS

C_TYPES = {
    torch.float32: "float",
    torch.float64: "double",
    torch.float16: "__half",
    torch.bfloat16: "__nv_bfloat16",
    torch.int64: "long long",
    torch.int32: "int",
    torch.int16: "short",
    torch.int8: "signed char",
    torch.uint8: "unsigned char",
    torch.bool: "bool",
}
HALF_TYPES = {  # storage type -> (to float, from float)
    torch.float16: ("__half2float", "__float2half_rn"),
    torch.bfloat16: ("__bfloat162float", "__float2bfloat16_rn"),
}
THREADS = 256  # threads per block, or per reduced row (fewer for small sizes, never below a warp)


class CPrinter(ExprPrinter):
    """Index math in CUDA C: non-negative, so `/` and `%` are floor division and modulo."""

    min_fn = "gjit_imin"
    max_fn = "gjit_imax"
    and_op = " && "
    or_op = " || "
    not_op = "!"

    def doprint(self, expr: sympy.Basic) -> str:
        if expr is sympy.true or expr is sympy.false:
            return "true" if expr is sympy.true else "false"
        if isinstance(expr, sympy.Integer) and not -(2**31) <= int(expr) < 2**31:
            return f"{int(expr)}LL"
        return super().doprint(expr).replace(" // ", " / ")


def literal(value, dtype: torch.dtype) -> str:
    """A C constant; a negative one in parentheses, so that an operator in front of it (`-`, `~`)
    never makes `--2LL`."""
    if dtype == torch.bool:
        return "true" if value else "false"
    if dtype.is_floating_point:
        v = float(value)
        suffix = "" if dtype == torch.float64 else "f"
        if math.isnan(v):
            text = "GJIT_NAN" + suffix.upper()
        elif math.isinf(v):
            text = ("-" if v < 0 else "") + "GJIT_INF" + suffix.upper()
        else:
            text = repr(v) + suffix
        text = f"({text})" if text.startswith("-") else text
        if dtype in HALF_TYPES:  # a half constant: the float rounded once to half
            return f"{HALF_TYPES[dtype][1]}({text})"
        return text
    v = int(value)
    if v == -(2**63):  # -9223372036854775808LL would negate a literal that does not fit
        return "(-9223372036854775807LL - 1)"
    if v == -(2**31) and dtype != torch.int64:  # -2147483648 is a long in C++
        return "(-2147483647 - 1)"
    text = f"{v}LL" if dtype == torch.int64 or not -(2**31) <= v < 2**31 else str(v)
    return f"({text})" if v < 0 else text


def _math(name: str) -> Callable[..., str]:
    """A CUDA math function: `sinf` for float, `sin` for double."""

    def emit(*args) -> str:
        *operands, dtype = args
        fn = name if dtype == torch.float64 else f"{name}f"
        return f"{fn}({', '.join(operands)})"

    return emit


def _floordiv(a: str, b: str, t: torch.dtype) -> str:
    if t.is_floating_point:
        return _math("floor")(f"{a} / {b}", t)
    return f"gjit_floordiv({a}, {b})"


def _remainder(a: str, b: str, t: torch.dtype) -> str:
    if t.is_floating_point:
        return f"gjit_fremainder({a}, {b})"
    return f"gjit_remainder({a}, {b})"


def _shift(op: str) -> Callable[[str, str, torch.dtype], str]:
    """ATen's shifts by a negative amount or by at least the bit width: 0 for <<, the sign for >>."""

    def emit(a: str, b: str, t: torch.dtype) -> str:
        bits = torch.iinfo(t).bits
        outside = "0" if op == "<<" else f"({a} < 0 ? -1 : 0)"
        return f"(({b}) >= 0 && ({b}) < {bits} ? ({a} {op} {b}) : {outside})"

    return emit


def _minmax(which: str) -> Callable[[str, str, torch.dtype], str]:
    def emit(a: str, b: str, t: torch.dtype) -> str:
        if t.is_floating_point:
            return f"gjit_{which}_nan({a}, {b})"
        return f"({a} {'>' if which == 'max' else '<'} {b} ? {a} : {b})"

    return emit


def _abs(a: str, t: torch.dtype) -> str:
    return _math("fabs")(a, t) if t.is_floating_point else f"({a} < 0 ? -{a} : {a})"


def _bitwise_not(a: str, t: torch.dtype) -> str:
    return f"(!{a})" if t == torch.bool else f"(~{a})"


# Per-op emitters: IR op name -> C expression. Arguments are printed operands; the last one is
# the dtype of the result (the compute dtype). The Triton table is codegen/triton/pointwise.py's.
CudaOverrides: dict[str, Callable[..., str]] = {
    "truncdiv": lambda a, b, t: f"({a} / {b})",
    "floordiv": _floordiv,
    "remainder": _remainder,
    "fmod": lambda a, b, t: _math("fmod")(a, b, t) if t.is_floating_point else f"({a} % {b})",
    "neg": lambda a, t: f"(-{a})",
    "abs": _abs,
    "maximum": _minmax("max"),
    "minimum": _minmax("min"),
    "fmax": _math("fmax"),
    "fmin": _math("fmin"),
    "pow": _math("pow"),
    "atan2": _math("atan2"),
    "copysign": _math("copysign"),
    "sqrt": _math("sqrt"),
    "rsqrt": _math("rsqrt"),
    "sigmoid": lambda a, t: f"(1 / (1 + {_math('exp')(f'-{a}', t)}))",
    "round": _math("rint"),
    "frac": lambda a, t: f"({a} - {_math('trunc')(a, t)})",
    "isnan": lambda a, t: f"({a} != {a})",
    "isinf": lambda a, t: f"isinf({a})",
    "isfinite": lambda a, t: f"isfinite({a})",
    "signbit": lambda a, t: f"signbit({a})",
    "logical_and": lambda a, b, t: f"(({a} != 0) && ({b} != 0))",
    "logical_or": lambda a, b, t: f"(({a} != 0) || ({b} != 0))",
    "logical_xor": lambda a, b, t: f"(({a} != 0) != ({b} != 0))",
    "logical_not": lambda a, t: f"({a} == 0)",
    "bitwise_not": _bitwise_not,
    "lshift": _shift("<<"),
    "rshift": _shift(">>"),
    "where": lambda c, a, b, t: f"({c} ? {a} : {b})",
}
for _name, _op in INFIX.items():
    CudaOverrides[_name] = lambda a, b, t, _op=_op: f"({a} {_op} {b})"
for _name in (
    "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sin", "cos", "tan", "tanh", "sinh", "cosh",
    "asin", "acos", "atan", "asinh", "acosh", "atanh", "erf", "erfinv", "floor", "ceil", "trunc",
    "erfc", "erfcx", "lgamma", "hypot", "nextafter",
):  # fmt: skip
    CudaOverrides[_name] = _math(_name)
CudaOverrides["digamma"] = lambda a, t: f"gjit_digamma({a})"  # double, in the prelude
CudaOverrides["trigamma"] = lambda a, t: f"gjit_trigamma({a})"
CudaOverrides["zeta"] = lambda a, b, t: f"gjit_zeta({a}, {b})"
for _name in BESSEL_OPS:
    CudaOverrides[_name] = lambda a, t, _name=_name: f"gjit_{_name}({a})"  # double: kernels/bessel.py
for _name in POLYNOMIALS:  # the prelude's (kernels/polynomials.py)
    CudaOverrides[_name] = lambda x, n, cap, narrow, t, _name=_name: (
        f"gjit_{_name}({x}, {n}, {cap}, {str(narrow).lower()})"
    )

# special functions named differently in CUDA's math library
for _name, _fn in {
    "ndtri": "normcdfinv",
    "bessel_i0": "cyl_bessel_i0",
    "bessel_i1": "cyl_bessel_i1",
    "bessel_j0": "j0",
    "bessel_j1": "j1",
    "bessel_y0": "y0",
    "bessel_y1": "y1",
}.items():
    CudaOverrides[_name] = _math(_fn)


def to_dtype(a: str, src: torch.dtype, dst: torch.dtype) -> str:
    """A C conversion with ATen's rounding: 16-bit floats convert through float (so int64 or
    double -> half rounds twice, as c10::Half does)."""
    if src == dst:
        return a
    if src in HALF_TYPES:
        a, src = f"{HALF_TYPES[src][0]}({a})", torch.float32
        if dst == torch.float32:
            return a
    if dst == torch.bool:
        return f"({a} != 0)"
    if dst in HALF_TYPES:
        return f"{HALF_TYPES[dst][1]}({a if src == torch.float32 else f'(float)({a})'})"
    return f"({C_TYPES[dst]})({a})"


class CudaEmitter(RegionPlan):
    """The per-element printing both CUDA writers share (the plan: codegen/plan.py). Values are
    typed C locals; a masked read is an `if` block."""

    def index(self, expr: sympy.Expr, names: dict[sympy.Symbol, str] | None = None) -> str:
        self.symbols |= sympy.sympify(expr).free_symbols - set(names or ())
        return CPrinter(names)(expr)

    def assign(self, var: str, text: str, dtype: torch.dtype) -> str:
        return f"{C_TYPES[dtype]} {var} = {text};"

    def literal(self, value, dtype: torch.dtype) -> str:
        return literal(value, dtype)

    def folded(self, e: Expr) -> str | None:
        if isinstance(e, Op) and e.name == "to_dtype" and constant(e.args[0]) is not None:
            # a constant (a size, a fill value) under a cast: cast it now, rounding as ATen does
            value = torch.tensor(constant(e.args[0]), dtype=e.args[0].dtype).to(e.params[0]).item()
            return literal(value, e.params[0])
        return None

    def index_value(self, e: IndexValue) -> str:
        expr = self.subst(e.expr)
        if sympy.sympify(expr).is_number:
            return literal(expr, e.dtype)
        text = self.index(expr)
        value = to_dtype(f"({text})", torch.int64, e.dtype)
        return self.tmp(("index", text, e.dtype), value, e.dtype)

    def op(self, e: Op, args: list[str]) -> str:
        if e.name == "to_dtype":
            text = to_dtype(args[0], e.args[0].dtype, e.params[0])
        elif e.name in POLYNOMIALS:  # with Hermite's cap and the float32 rounding: IR params
            text = CudaOverrides[e.name](*args, *e.params, e.dtype)
        else:
            text = CudaOverrides[e.name](*args, e.dtype)
        return self.tmp(("op", e.name, *args, e.params), text, e.dtype)

    def masked(self, e: Masked) -> str:
        """`body` only where the mask holds (its reads may be out of bounds elsewhere)."""
        key = ("masked", e)
        if key in self.cse:
            return self.cse[key]
        cond = self.index(self.subst(e.mask))
        var = self.tmp(key, literal(e.other, e.dtype), e.dtype)
        outer = (self.lines, self.cse, self.values)
        self.lines, self.cse, self.values = [], dict(self.cse), dict(self.values)
        body = self.emit(e.body)
        inner = self.lines
        self.lines, self.cse, self.values = outer
        self.lines.append(f"if ({cond}) {{")
        self.lines += [f"    {ln}" for ln in inner] + [f"    {var} = {body};", "}"]
        return var

    def read(self, r: Read) -> str:
        if self.in_registers(r):
            return self.node_value(r.name)
        names = {sym: self.emit(value) for sym, value, _ in r.indirect}
        self.note_load(r, bool(names))
        arg = self.in_args.setdefault(r.name, f"in_ptr{len(self.in_args)}")
        text = self.index(self.subst(self.layout(r.name).offset_of(r.index)), names)
        return self.load(arg, text, self.layout(r.name).dtype)

    def load(self, arg: str, offset: str, dtype: torch.dtype) -> str:
        return self.tmp(("load", arg, offset), f"{arg}[{offset}]", dtype)

    def store_line(self, arg: str, offset: str, value: str, src: torch.dtype, dst: torch.dtype) -> str:
        return f"{arg}[{offset}] = {to_dtype(value, src, dst)};"

    def params(self, index_type: str, sizes: list[str]) -> tuple[list[str], dict[str, str]]:
        """The kernel's parameter declarations and its signature (parameter -> C type)."""
        signature = {arg: f"const {C_TYPES[self.layout(n).dtype]}*" for n, arg in self.in_args.items()}
        signature |= {arg: f"{C_TYPES[self.layout(n).dtype]}*" for n, arg in self.out_args.items()}
        decls = [f"{t} __restrict__ {p}" for p, t in signature.items()]
        for p in [s.name for s in self.kernel_size_symbols()] + sizes:
            signature[p] = index_type
            decls.append(f"{index_type} {p}")
        return decls, signature

    def cuda_source(
        self,
        name: str,
        header: list[str],
        body: list[str],
        sizes: dict[str, sympy.Expr],
        threads: int,
        index_dtype: str,
        blocks: dict[str, int],
        **extra,
    ) -> KernelSource:
        index_type = "int" if index_dtype == "int32" else "long long"
        decls, signature = self.params(index_type, list(sizes))
        key = self.key_line(signature, blocks, extra.get("launch_blocks", {}))
        lines = [f"// {ln}" for ln in [*header, key]]
        lines.append(f'extern "C" __global__ void __launch_bounds__({threads}) {name}(')
        lines.append("    " + ",\n    ".join(decls) + ") {")
        lines += [f"    {ln}" for ln in body] + ["}"]
        extra["backend"] = "cuda"
        return self.kernel_record(name, "\n".join(lines), sizes, signature, blocks, index_dtype, **extra)


def threads_for(numel: int) -> int:
    return max(32, min(THREADS, next_power_of_2(numel)))


class CudaKernelWriter(CudaEmitter):
    """A pointwise region: a grid-stride loop over its (coalesced) iteration space.

    A kernel that walks float32 buffers contiguously (one flat index) also gets a vector path:
    when the size is a multiple of 4 and those pointers are 16-byte aligned (checked in the
    kernel), each thread moves 4 elements with one 128-bit load or store per buffer."""

    lane: str | None = None  # x / y / z / w while the vector path's lanes are emitted

    def generate(self, name: str) -> KernelSource:
        numel, idx, plan, index_dtype = self.pointwise_space()
        it = "int" if index_dtype == "int32" else "long long"
        self.store_all(idx)
        setup = [f"{it} {v.name} = {self.index(e)};" for v, e in zip(plan.vars, plan.var_exprs)]
        loop = (
            f"for ({it} xindex = ({it})blockIdx.x * blockDim.x + threadIdx.x; "
            f"xindex < xnumel; xindex += ({it})blockDim.x * gridDim.x) {{"
        )
        body = [loop] + [f"    {ln}" for ln in setup + self.lines] + ["}"]
        vector = self.vector_path(plan.vars, idx, it) if len(plan.vars) == 1 else []
        threads = threads_for(hint(numel, self.hints))
        return self.cuda_source(
            name,
            header=self.header(name, numel),
            body=vector + body,
            sizes={"xnumel": numel},
            threads=threads,
            index_dtype=index_dtype,
            blocks={"XBLOCK": threads},
        )

    def store_all(self, idx: tuple, vector: set[str] = frozenset()) -> None:
        """Store every region output; those in `vector` go to this lane of their float4."""
        for node in self.region.stores:
            value = self.node_value(node)
            arg = self.out_args.setdefault(node, f"out_ptr{len(self.out_args)}")
            offset = self.index(self.subst(self.layout(node).offset_of(idx)))
            src, dst = self.region.bodies[node].dtype, self.layout(node).dtype
            if node in vector:
                self.lines.append(f"v_{arg}.{self.lane} = {to_dtype(value, src, dst)};")
            else:
                self.lines.append(self.store_line(arg, offset, value, src, dst))

    def load(self, arg: str, offset: str, dtype: torch.dtype) -> str:
        if self.lane is not None and offset == self.flat and dtype == torch.float32:
            self.vector_loads.setdefault(arg, None)
            return f"v_{arg}.{self.lane}"
        return super().load(arg, offset, dtype)

    def vector_path(self, plan_vars: list, idx: tuple, it: str) -> list[str]:
        """The 4-wide path, or [] when no float32 output is stored at the flat index."""
        self.flat = plan_vars[0].name
        vector = {
            n
            for n in self.region.stores
            if self.layout(n).dtype == torch.float32
            and self.index(self.subst(self.layout(n).offset_of(idx))) == self.flat
        }
        if not vector:
            return []
        self.vector_loads: dict[str, None] = {}
        lanes = []
        for k, self.lane in enumerate("xyzw"):
            self.lines, self.cse, self.values = [], {}, {}
            self.store_all(idx, vector)
            lane = [f"{it} {self.flat} = 4 * xvec + {k};", *self.lines]
            lanes += ["{", *(f"    {ln}" for ln in lane), "}"]
        self.lane = None
        outs = [self.out_args[n] for n in self.region.stores if n in vector]
        pointers = " | ".join(f"(unsigned long long){p}" for p in [*self.vector_loads, *outs])
        loop = (
            f"for ({it} xvec = ({it})blockIdx.x * blockDim.x + threadIdx.x; "
            f"xvec < xnumel / 4; xvec += ({it})blockDim.x * gridDim.x) {{"
        )
        body = [
            f"const float4 v_{a} = reinterpret_cast<const float4*>({a})[xvec];" for a in self.vector_loads
        ]
        body += [f"float4 v_{a};" for a in outs] + lanes
        body += [f"reinterpret_cast<float4*>({a})[xvec] = v_{a};" for a in outs]
        return (
            ["// 4 elements per thread, 128-bit loads and stores, when sizes and pointers allow",
             f"if (xnumel % 4 == 0 && (({pointers}) & 15) == 0) {{", f"    {loop}"]
            + [f"        {ln}" for ln in body]
            + ["    }", "    return;", "}"]
        )  # fmt: skip
