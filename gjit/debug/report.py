"""The report of what gjit compiled for a call (gjit.explain returns it): kernels, externs,
guards, dynamic and specialized dims, perf hints, modeled bytes, compile time per stage.

The same report feeds the dump folder's report.json and the `perf_hints` log artifact.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import sympy
import torch

from gjit.capture.decompose import DECOMPOSED_FROM
from gjit.capture.export import size_hints
from gjit.debug.byte_model import Traffic, traffic
from gjit.fusion.regions import Region
from gjit.ir import AttentionNode, ExternNode, MatmulNode, at_values
from gjit.runtime.graph import ROW_KERNEL

if TYPE_CHECKING:  # the driver makes the program a report describes
    from gjit.driver import CompiledProgram

UNBACKED_HINT = 8192  # a data-dependent size has no example value; the byte model assumes this


@dataclasses.dataclass
class KernelInfo:
    name: str
    source: str
    aten_nodes: list[str]
    source_lines: list[str]
    path: str
    bytes_read: int = 0  # modeled, at this call's sizes
    bytes_written: int = 0
    passes: int = 1  # looped reduction kernels: loops over each row, each reading it from memory
    code_of: str | None = None  # the earlier kernel whose code this region launches (codegen/share.py)


@dataclasses.dataclass
class ExternInfo:
    node: str
    op: str
    reason: str


@dataclasses.dataclass
class Report:
    kernels: list[KernelInfo]
    externs: list[ExternInfo]
    guards: str
    loop_ir: str
    timings: dict[str, float]
    traffic: Traffic  # modeled bytes: gjit vs eager vs ideal, at this call's sizes
    dynamic_dims: list[str] = dataclasses.field(default_factory=list)  # "x.size(0) = s0"
    specialized_dims: list[str] = dataclasses.field(default_factory=list)  # "x.size(1) = 64: <line>"
    perf_hints: list[str] = dataclasses.field(default_factory=list)
    # ops gjit has no lowering for that torch.compile's decompositions turned into ops it lowers
    decomposed: list[str] = dataclasses.field(default_factory=list)
    # per matmul of the graph: the template kernel that computes it, or the extern and why, with
    # the per-region choice and its figures (gjit/choice/); then tuning's lines
    matmuls: list[str] = dataclasses.field(default_factory=list)
    # whether calls replay CUDA graphs (mode="reduce-overhead"), how many are held, runs without one
    cuda_graphs: str = "off"
    # tuning's lines for the row kernels it timed looped and persistent (gjit/choice/row_kernels.py)
    row_kernels: list[str] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        shared = sum(k.code_of is not None for k in self.kernels)
        distinct = f" ({len(self.kernels) - shared} distinct)" if shared else ""
        out = [f"gjit: {len(self.kernels)} kernel(s){distinct}, {len(self.externs)} extern(s)"]
        for k in self.kernels:
            runs = f" (runs as {k.code_of})" if k.code_of else ""
            out.append(f"  kernel {k.name}{runs}: {', '.join(n.split(':')[0] for n in k.aten_nodes)}")
        for e in self.externs:
            out.append(f"  extern {e.node} = {e.op}: {e.reason}")
        for m in self.matmuls:
            out.append(f"  matmul {m}")
        for r in self.row_kernels:
            out.append(f"  {r}")
        if self.decomposed:
            out.append(
                f"  decomposed for lack of a lowering (torch.compile's table): {', '.join(self.decomposed)}"
            )
        out.append(f"  dynamic dims: {', '.join(self.dynamic_dims) or 'none'}")
        for s in self.specialized_dims:
            out.append(f"  specialized: {s}")
        for h in self.perf_hints:
            out.append(f"  perf hint: {h}")
        out.append(f"  CUDA graphs: {self.cuda_graphs}")
        out.append(f"  {self.traffic}")
        out.append("  compile time: " + ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in self.timings.items()))
        return "\n".join(out)


def hints_for(program: CompiledProgram, symbols: list[sympy.Symbol], sizes: tuple) -> dict:
    """Size symbol values for the byte model: this call's sizes, else export's example values,
    else UNBACKED_HINT for data-dependent sizes."""
    hints = size_hints(program.captured.full_graph_module)
    hints.update(zip(symbols, sizes))
    for node in program.captured.full_graph_module.graph.nodes:
        for size in getattr(node.meta.get("val"), "shape", ()):
            if isinstance(size, torch.SymInt):
                for sym in size.node.expr.free_symbols:
                    hints.setdefault(sym, UNBACKED_HINT)
    return hints


def build_report(entry: Any, sizes: tuple = ()) -> Report:
    program: CompiledProgram = entry.program
    hints = hints_for(program, entry.guards.symbols, sizes)
    kernels = [
        KernelInfo(
            k.name,
            k.source,
            k.aten_nodes,
            k.source_lines,
            program.graph.kernel_paths.get(k.name, ""),
            int(at_values(k.bytes_read, hints)),
            int(at_values(k.bytes_written, hints)),
            k.passes,
            k.code_of,
        )
        for k in program.kernels
    ]
    templates = program.graph.templates
    externs = [
        ExternInfo(s.name, str(s.fx_node.target), extern_reason(s, templates))
        for s in program.steps
        if isinstance(s, ExternNode) and s.reason != "element of an extern's result"
    ]
    by_name = {k.name: k for k in program.kernels}
    moved = traffic(program.loop_graph, program.steps, by_name, hints)
    rows = [t for t in program.graph.tuning if t.startswith(ROW_KERNEL)]  # gjit/choice/row_kernels.py
    tuned = [t for t in program.graph.tuning if not t.startswith(ROW_KERNEL)]
    return Report(
        kernels,
        externs,
        entry.guards.format(),
        program.loop_graph.format(),
        dict(program.timings),
        moved,
        entry.guards.dynamic_dims,
        list(entry.specialized),
        perf_hints(program, entry.specialized),
        decomposed_ops(program.captured.full_graph_module),
        matmul_lines(program.steps, templates) + tuning_lines(tuned),
        cuda_graphs_line(entry),
        tuning_lines(rows),
    )


def cuda_graphs_line(entry: Any) -> str:
    graphs = getattr(entry, "graphs", None)
    if graphs is None:
        return "off (the callable's mode records none: mode='reduce-overhead' does)"
    return graphs.describe()


def tuning_lines(lines: list[str]) -> list[str]:
    """The decisions' lines marked as measured, the budget's (gjit/choice/) as it is."""
    return [line if line.startswith("tuning took") else f"tuned on the GPU: {line}" for line in lines]


MATMUL_OPS = (
    *("aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default"),
    "aten.scaled_dot_product_attention.default",
)


def extern_reason(step: ExternNode, templates: Any) -> str:
    """Why an extern runs in ATen: its region's choice where one was made (the library measured
    faster, say: the entry's program may be the all-ATen one tuning compiled), else lowering's."""
    choice = templates.choice_of(step.name) if templates is not None else None
    if choice is not None and not choice.template:
        return f"matmul runs as an ATen extern (chosen per region: {choice.text()})"
    return step.reason


def matmul_lines(steps: list, templates: Any = None) -> list[str]:
    """Which way each matmul ran: in a template kernel (with what the kernel fused around it), or
    as an ATen extern with the reason; with the region's choice (template ms, ATen ms, or why
    it was not measured) where "auto" made one."""
    out = []
    for step in steps:
        if isinstance(step, ExternNode) and str(step.fx_node.target) in MATMUL_OPS:
            out.append(f"{step.name} ({step.fx_node.target}): ATen extern: {extern_reason(step, templates)}")
        elif isinstance(step, Region) and step.matmul:
            products = [next(n for n in p.nodes if isinstance(n, MatmulNode)) for p in step.parts or [step]]
            for part, node in zip(step.parts or [step], products):
                others = [n.name for n in part.inlined + part.nodes if n is not node]
                fused = f", with {', '.join(others)} fused in" if others else ""
                kind = "template kernel"
                if isinstance(node, AttentionNode):
                    kind = "attention kernel"
                    if node.absorbed:  # written out: name what the one node stands for
                        kind += f" (written out: {', '.join(n.name for n in node.absorbed)} and {node.name})"
                if len(products) > 1:
                    shared = ", ".join(n.name for n in products if n is not node)
                    fused += f"; launched with {shared}: they share the left operand"
                choice = templates.choice_of(node.fx_node.name) if templates is not None else None
                chosen = f"; chosen per region: {choice.text()}" if choice is not None else ""
                out.append(f"{node.name} ({node.fx_node.target}): {kind} {step.name}{fused}{chosen}")
    return out


def decomposed_ops(gm: torch.fx.GraphModule) -> list[str]:
    """The ops whose decomposition (for lack of a lowering) made some node of the graph."""
    found = {n.meta.get("custom", {}).get(DECOMPOSED_FROM) for n in gm.graph.nodes}
    return sorted(op for op in found if op)


def perf_hints(program: CompiledProgram, specialized: list[str]) -> list[str]:
    """What costs performance in this program, in the order a user would fix it."""
    hints = []
    steps = program.steps
    kernels = {k.name: k for k in program.kernels}
    for i, step in enumerate(steps):
        if isinstance(step, ExternNode) and step.reason != "element of an extern's result":
            before = any(isinstance(s, Region) for s in steps[:i])
            after = any(isinstance(s, Region) for s in steps[i + 1 :])
            if before and after and step.tensor_args:
                hints.append(
                    f"extern {step.name} ({step.fx_node.target}) runs between kernels: its inputs and "
                    f"outputs round-trip through memory ({extern_reason(step, program.graph.templates)})"
                )
    for name, k in kernels.items():
        if k.rnumel is not None and not k.persistent:
            hints.append(
                f"{name} is a looped reduction (rows of {k.rnumel}): "
                + (
                    "one pass over each row, in chunks"
                    if k.passes == 1
                    else f"{k.passes} passes over each row, each reading it from memory"
                )
            )
        if k.index_dtype == "int64":
            hints.append(f"{name} uses int64 offsets (sizes can reach 2**31, or a size is data-dependent)")
    for step in steps:
        if isinstance(step, Region):
            for n in step.nodes + step.inlined:
                for arg in n.fx_node.all_input_nodes:
                    val = arg.meta.get("val")
                    if arg.op == "placeholder" and isinstance(val, torch.Tensor) and val.dim() > 1:
                        if val.shape[-1] != 1 and val.stride()[-1] != 1:
                            hints.append(
                                f"{step.name} reads {arg.name} with stride {val.stride()[-1]} along its "
                                "last dim (uncoalesced loads)"
                            )
    hints += [f"{s} (a dim export could not keep dynamic)" for s in specialized]
    return list(dict.fromkeys(hints))
