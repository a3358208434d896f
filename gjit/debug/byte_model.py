"""The byte model: memory-bound kernels cost what they move.

For a compiled program, at its example sizes: bytes the generated kernels and externs move
(each kernel reads each buffer once per pass and writes each stored result once; an extern
reads its inputs and writes its outputs), the same for eager (one kernel per ATen op that
is not a view), and the ideal (graph inputs read once, outputs written once).
"""

from __future__ import annotations

import dataclasses
import operator

import torch

from gjit.fusion.regions import Region, Step
from gjit.ir import ExternNode, LoopGraph, at_values

NO_TRAFFIC = {operator.getitem}


def _nbytes(val, hints: dict) -> int:
    if isinstance(val, torch.Tensor):
        numel = val.numel()
        if isinstance(numel, torch.SymInt):
            numel = int(at_values(numel.node.expr, hints))
        return int(numel) * val.dtype.itemsize
    if isinstance(val, (list, tuple)):
        return sum(_nbytes(v, hints) for v in val)
    return 0


def _node_bytes(node: torch.fx.Node, hints: dict) -> int:
    inputs = sum(_nbytes(a.meta.get("val"), hints) for a in node.all_input_nodes)
    return inputs + _nbytes(node.meta.get("val"), hints)


@dataclasses.dataclass
class Traffic:
    gjit: int
    eager: int
    ideal: int
    eager_kernels: int  # ATen ops eager launches (views excluded)

    def __str__(self) -> str:
        ratio = self.gjit / self.ideal if self.ideal else float("nan")
        return (
            f"modeled bytes: gjit {self.gjit}, eager {self.eager} ({self.eager_kernels} ops), "
            f"ideal {self.ideal}; gjit/ideal {ratio:.2f}"
        )


def traffic(graph: LoopGraph, steps: list[Step], kernels: dict, hints: dict) -> Traffic:
    moved = 0
    for step in steps:
        if isinstance(step, Region):
            k = kernels[step.name]
            moved += int(at_values(k.bytes_read + k.bytes_written, hints))
        elif isinstance(step, ExternNode) and step.fx_node.target not in NO_TRAFFIC:
            moved += _node_bytes(step.fx_node, hints)
    eager = 0
    eager_ops = 0
    for node in graph.fx_graph.nodes:
        if node.op != "call_function" or node.name in graph.views or node.target in NO_TRAFFIC:
            continue
        if not isinstance(node.meta.get("val"), (torch.Tensor, list, tuple)):
            continue  # size arithmetic and asserts
        eager += _node_bytes(node, hints)
        eager_ops += 1
    ideal = sum(_nbytes(n.meta.get("val"), hints) for n in graph.fx_graph.nodes if n.op == "placeholder")
    output = next(n for n in graph.fx_graph.nodes if n.op == "output")
    ideal += sum(_nbytes(a.meta.get("val"), hints) for a in output.all_input_nodes)
    return Traffic(moved, eager, ideal, eager_ops)
