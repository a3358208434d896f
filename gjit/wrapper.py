"""Wrapper codegen: the schedule -> one straight-line Python `call(args)` function.

The wrapper binds size symbols from the inputs, runs externs through eager ATen, builds
views with ATen's own view ops (zero-copy, eager's strides), allocates what kernels store
(poisoned in debug mode), launches kernels through Triton's launcher, and returns the
graph's flat outputs.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import sympy
import torch

from gjit import ir
from gjit.codegen.printer import pyexpr
from gjit.codegen.triton import KernelSource
from gjit.fusion import Region, Step
from gjit.lowering import to_sympy


class WrapperError(RuntimeError):
    pass


class WrapperWriter:
    def __init__(
        self, graph: ir.LoopGraph, steps: list[Step], kernels: dict[str, KernelSource], poison: bool
    ):
        self.graph = graph
        self.steps = steps
        self.kernels = kernels
        self.poison = poison
        self.lines: list[str] = []
        self.bound: set[sympy.Symbol] = set()
        self.defined: set[str] = set()

    def sym(self, expr: Any) -> str:
        expr = to_sympy(expr) if not isinstance(expr, sympy.Basic) else expr
        missing = expr.free_symbols - self.bound
        if missing:
            raise WrapperError(
                f"size symbol(s) {sorted(map(str, missing))} cannot be bound from the graph inputs"
            )
        return pyexpr(expr)

    def bind(self, symbol: sympy.Symbol, source: str) -> None:
        if symbol not in self.bound:
            self.lines.append(f"{symbol.name} = {source}")
            self.bound.add(symbol)

    def bind_from(self, name: str, val: torch.Tensor) -> None:
        for k, s in enumerate(val.shape):
            if isinstance(to_sympy(s), sympy.Symbol):
                self.bind(to_sympy(s), f"{name}.shape[{k}]")
        for k, s in enumerate(val.stride()):
            if isinstance(to_sympy(s), sympy.Symbol):
                self.bind(to_sympy(s), f"{name}.stride({k})")

    def arg(self, a: Any) -> str:
        """An FX argument as wrapper source."""
        if isinstance(a, torch.fx.Node):
            val = a.meta.get("val")
            if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)) and a.name not in self.defined:
                return self.sym(to_sympy(val))
            name = self.graph.aliases.get(a.name, a.name)
            self.ensure(name)
            return name
        if isinstance(a, (list, tuple)):
            inner = ", ".join(self.arg(x) for x in a)
            return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
        if isinstance(a, torch.SymInt):
            return self.sym(to_sympy(a))
        if isinstance(a, float) and not math.isfinite(a):
            return f"float('{a}')"
        if isinstance(a, torch.device):
            return f"torch.device({str(a)!r})"
        if isinstance(a, (torch.dtype, torch.layout, torch.memory_format)):
            return str(a)
        return repr(a)

    def ensure(self, name: str) -> None:
        """Emit the view `name` (and its bases) if the wrapper has not built it yet."""
        if name in self.defined or name not in self.graph.views:
            return
        view = self.graph.views[name]
        self.ensure(view.base)
        if view.element is None:
            self.call_aten(view.fx_node)
            return
        if view.fx_node.name not in self.defined:
            self.call_aten(view.fx_node)
        self.lines.append(f"{name} = {view.fx_node.name}[{view.element}]")
        self.defined.add(name)

    def call_aten(self, node: torch.fx.Node) -> None:
        args = [self.arg(a) for a in node.args]
        args += [f"{k}={self.arg(v)}" for k, v in node.kwargs.items()]
        self.lines.append(f"{node.name} = {_op_name(node.target)}({', '.join(args)})")
        self.defined.add(node.name)

    def extern(self, step: ir.ExternNode) -> None:
        node = step.fx_node
        if node.target is operator.getitem:
            self.lines.append(f"{node.name} = {node.args[0].name}[{node.args[1]}]")
            self.defined.add(node.name)
        else:
            self.call_aten(node)
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            self.bind_from(node.name, val)
        elif isinstance(val, torch.SymInt) and isinstance(to_sympy(val), sympy.Symbol):
            self.bind(to_sympy(val), node.name)  # a data-dependent size (.item(), nonzero)

    def region(self, region: Region) -> None:
        kernel = self.kernels[region.name]
        for name in region.stores:
            lay = self.graph.compute_nodes()[name].layout
            size = ", ".join(self.sym(s) for s in lay.size)
            stride = ", ".join(self.sym(s) for s in lay.stride)
            fn = "gjit_alloc_poisoned" if self.poison else "gjit_alloc"
            comma = "," if len(lay.size) == 1 else ""
            device = f"torch.device({str(self.device)!r})"
            self.lines.append(f"{name} = {fn}(({size}{comma}), ({stride}{comma}), {lay.dtype}, {device})")
            self.defined.add(name)
        numel = self.sym(kernel.numel)
        args = [*kernel.in_args, *kernel.out_args, *(s.name for s in kernel.size_args)]
        for s in kernel.size_args:
            self.sym(s)
        self.lines.append(f"xnumel = {numel}")
        sizes = ["xnumel"]
        if kernel.rnumel is not None:
            self.lines.append(f"rnumel = {self.sym(kernel.rnumel)}")
            sizes.append("rnumel")
            if kernel.persistent:  # a persistent kernel holds a whole row in one block
                self.lines.append(
                    f"assert rnumel <= {kernel.blocks['RBLOCK']}, 'persistent reduction row too long'"
                )
        blocks = ", ".join(f"{k}={v}" for k, v in kernel.blocks.items())
        grid = f"(triton.cdiv(xnumel, {kernel.blocks['XBLOCK']}),)"
        self.lines.append("if xnumel > 0:")
        self.lines.append(f"    {kernel.name}[{grid}]({', '.join(args + sizes)}, {blocks})")

    def generate(self) -> str:
        placeholders = [n for n in self.graph.fx_graph.nodes if n.op == "placeholder"]
        self.device = _graph_device(placeholders)
        names = [n.name for n in placeholders]
        if names:
            self.lines.append(f"{', '.join(names)}{',' if len(names) == 1 else ''} = args")
        for n in placeholders:
            self.defined.add(n.name)
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor):
                self.bind_from(n.name, val)
            elif isinstance(val, torch.SymInt) and isinstance(to_sympy(val), sympy.Symbol):
                self.bind(to_sympy(val), n.name)
        for step in self.steps:
            if isinstance(step, Region):
                self.region(step)
            else:
                self.extern(step)
        output = next(n for n in self.graph.fx_graph.nodes if n.op == "output")
        outs = [self.arg(a) for a in output.args[0]]
        self.lines.append(f"return ({', '.join(outs)}{',' if len(outs) == 1 else ''})")
        kernel_names = ", ".join(k.name for k in self.kernels.values())
        header = [
            "# gjit wrapper: binds sizes, runs externs and views through ATen, launches kernels",
            f"# kernels: {kernel_names or '(none)'}",
            "import torch",
            "import triton",
            "",
            "aten = torch.ops.aten",
            "",
            "",
            "def call(args):",
        ]
        return "\n".join(header + [f"    {ln}" for ln in self.lines]) + "\n"


def _op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        packet = target._schema.name.split("::")
        return (
            f"torch.ops.{packet[0]}.{target.__name__}" if packet[0] != "aten" else f"aten.{target.__name__}"
        )
    if target is operator.getitem:
        return "operator.getitem"
    raise WrapperError(f"cannot call {target} from the wrapper")


def _graph_device(placeholders: list[torch.fx.Node]) -> torch.device:
    for n in placeholders:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.device
    return torch.device("cpu")


def generate_wrapper(
    graph: ir.LoopGraph, steps: list[Step], kernels: dict[str, KernelSource], poison: bool
) -> str:
    return WrapperWriter(graph, steps, kernels, poison).generate()
