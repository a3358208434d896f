"""What every kernel printer shares: the record of a generated kernel (`KernelSource`), kernel
names, the user source line of an FX node, and small helpers over sizes and constants.

Both printers (codegen/triton/, codegen/cuda/) and everything after codegen (wrapper, runtime,
disk cache, debug) read kernels through `KernelSource`, so it lives here, below them all.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import sympy
import torch

from gjit.fusion.regions import Region
from gjit.ir import Const, Expr, IndexValue, at_values

# Ops both kernel languages spell as one infix operator with the same meaning.
INFIX = {
    "add": "+",
    "sub": "-",
    "mul": "*",
    "truediv": "/",
    "eq": "==",
    "ne": "!=",
    "lt": "<",
    "le": "<=",
    "gt": ">",
    "ge": ">=",
    "bitwise_and": "&",
    "bitwise_or": "|",
    "bitwise_xor": "^",
}


DEBUG_DECORATOR = "@triton.jit(debug=True)"


@dataclasses.dataclass
class KernelSource:
    """A generated kernel and how the wrapper calls it."""

    name: str
    source: str
    in_args: list[str]  # buffer / node names read, in pointer-argument order
    out_args: list[str]  # node names stored
    size_args: list[sympy.Symbol]  # symbols passed by value
    numel: sympy.Expr  # xnumel: the number of programs' elements along x (a 2-D tile's columns)
    index_dtype: str  # "int32" | "int64": the width of element offsets (each printer spells it)
    aten_nodes: list[str]  # "name: aten.op" per fused node
    source_lines: list[str]
    signature: dict[str, str]  # parameter -> Triton type ("*fp32", "i32", "constexpr")
    blocks: dict[str, int] = dataclasses.field(default_factory=dict)  # constexpr block sizes at launch
    bytes_read: sympy.Expr = sympy.Integer(0)  # modeled: each buffer once per pass over it
    bytes_written: sympy.Expr = sympy.Integer(0)
    rnumel: sympy.Expr | None = None  # reduction kernels: elements reduced per output element
    ynumel: sympy.Expr | None = None  # 2-D tiled kernels: the tile's other side (its rows)
    persistent: bool = False  # reduction kernels: the whole row in one block (needs rnumel <= RBLOCK)
    passes: int = 1  # looped reduction kernels: loops over each row, each reading it from memory
    # block sizes the wrapper computes at launch (Python over xnumel / rnumel), overriding `blocks`
    launch_blocks: dict[str, str] = dataclasses.field(default_factory=dict)
    # (condition over size symbols, why): what this kernel relies on beyond its example sizes;
    # the entry's guards check them (a call that breaks one recompiles)
    assumptions: list[tuple[sympy.Basic, str]] = dataclasses.field(default_factory=list)
    backend: str = "triton"  # or "cuda": CUDA C for NVRTC / CuPy (codegen/cuda/pointwise.py)
    # float atomics (a scatter's sums): the order of additions, so the last bits, vary between
    # runs; the entry is guarded on torch's deterministic-algorithms setting being off
    nondeterministic: bool = False
    num_warps: int = 4  # Triton's default; a template whose tiles need more threads asks for more
    num_stages: int | None = None  # a template's pipelined loop steps (None: Triton's default)
    # a float32 product's precision depends on torch's TF32 setting: the value it was compiled
    # under (guarded: gjit/guards/builder.py); None: no float32 product
    tf32: bool | None = None
    configs: int = 1  # a template's tile configurations (kernels/): gjit/tuning.py measures them on a GPU
    # the earlier kernel of the graph whose code this region launches (the runtime binds this
    # kernel's name to that kernel's function): the same code but for the name and comments
    # (codegen/share.py); None: its own
    code_of: str | None = None

    @property
    def cache_key(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()[:16]

    @property
    def debug(self) -> bool:
        """Built with Triton's debug=True, for its bounds asserts (gjit.config.debug): the decorator's
        own line (a header comment quoting user source is never it)."""
        return f"\n{DEBUG_DECORATOR}\n" in self.source

    def launch_options(self) -> dict[str, Any]:
        """Triton's options for a launch or a build: the warps and stages a template asks for, and
        for a debug kernel no integer overflow checks, which debug=True turns on (an int32 add or
        multiply that wraps, as eager's wraps, would fail a device assert)."""
        options: dict[str, Any] = {"num_warps": self.num_warps}
        if self.num_stages is not None:
            options["num_stages"] = self.num_stages
        if self.debug:
            options["sanitize_overflow"] = False
        return options


def source_line(node: torch.fx.Node) -> str | None:
    """'file.py:12 in forward: code' from the node's user stack trace: its innermost frame in a real
    file (a torch.cond branch's trace ends in FX-generated code)."""
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    lines = [ln for ln in trace.strip().splitlines() if ln.strip()]
    for k in range(len(lines) - 1, -1, -1):
        ln = lines[k].strip()
        if ln.startswith("File "):
            parts = ln.split(",")
            path = parts[0][len("File ") :].strip().strip('"')
            if path.startswith("<"):  # FX-generated code (<eval_with_key>.N): not the user's line
                continue
            lineno = parts[1].strip().removeprefix("line ").strip() if len(parts) > 1 else "?"
            func = parts[2].strip().removeprefix("in ").strip() if len(parts) > 2 else "?"
            code = lines[k + 1].strip() if k + 1 < len(lines) else ""
            return f"{path.rsplit('/', 1)[-1]}:{lineno} in {func}: {code}"
    return None


def kernel_name(region: Region, index: int) -> str:
    ops = "_".join(region.aten_ops()[:6]) or "copy"
    kind = "scatter" if region.scatter else "scan" if region.scan else None
    if region.matmul:
        kind = "attn" if region.attention else "mm"
    kind = kind or ("red" if region.reduction else "poi")
    return f"gjit_{kind}_fused_{ops}_{index}"


def hint(expr: sympy.Expr, hints: dict[sympy.Symbol, int]) -> int:
    value = at_values(expr, hints)
    return int(value) if value.is_number else 2**31


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 2 ** (n - 1).bit_length()


def constant(e: Expr):
    """The Python number `e` always is, or None."""
    if isinstance(e, Const):
        return e.value
    if isinstance(e, IndexValue) and sympy.sympify(e.expr).is_number:
        return int(e.expr) if e.dtype != torch.bool else bool(e.expr)
    return None


def unique(items) -> list[str]:
    out: list[str] = []
    for it in items:
        if it and it not in out:
            out.append(it)
    return out


def numbered(source: str) -> str:
    """`source` with line numbers, for compile errors that point into it."""
    return "\n".join(f"{n:4d}  {line}" for n, line in enumerate(source.splitlines(), 1))
