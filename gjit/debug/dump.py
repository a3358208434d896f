"""The dump folder: every compile stage of an entry as files a person can follow.

    GJIT_DUMP_DIR=gjit_dump python model.py      # or gjit.compile(model, dump_dir=...)

One sub-folder per compile (`<n>_<function>_entry<k>/`) holds:

    00_exported.txt      torch.export's graph, before decomposition
    01_core_aten.txt     after run_decompositions() (the graph gjit lowers)
    02_loop_ir.txt       the loop IR (buffers, pointwise bodies, reductions, externs)
    03_regions.txt       the schedule: each kernel with the nodes it fuses, each extern with its reason
    03_regions.dot       the graph with one cluster per kernel, externs marked (`dot -Tpng`)
    kernels/<name>.py    generated Triton kernels
    wrapper.py           the generated wrapper
    guards.txt           the entry's guards and the generated guard function
    report.json          kernels, externs, modeled bytes, compile time per stage

Each text stage starts with the pass that produced it and how long that pass took.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from typing import Any

import torch

from gjit.fusion.regions import Region, Step
from gjit.ir import ExternNode

_COUNTER = itertools.count()


def stage_header(name: str, seconds: float | None) -> str:
    took = f", {seconds * 1000:.1f} ms" if seconds is not None else ""
    return f"# produced by: {name}{took}\n"


def regions_text(steps: list[Step]) -> str:
    """The schedule in order: kernels with their nodes and stores, externs with their reasons."""
    lines = []
    for step in steps:
        if isinstance(step, Region):
            kind = "reduction" if step.reduction is not None else "pointwise"
            lines.append(f"kernel {step.name} ({kind}, iteration space {list(step.size)})")
            for n in step.inlined:
                lines.append(f"    inlined  {n.name} = {n.aten}")
            for n in step.nodes:
                stored = "stored " if n.name in step.stores else "fused  "
                lines.append(f"    {stored}  {n.name} = {n.aten}")
        else:
            lines.append(f"extern {step.name} = {step.fx_node.target}: {step.reason}")
    return "\n".join(lines) + "\n"


def regions_dot(gm: torch.fx.GraphModule, steps: list[Step]) -> str:
    """Graphviz: FX nodes as boxes, one cluster per kernel, externs filled, inputs as ovals."""
    owner: dict[str, str] = {}
    clusters = []
    for k, step in enumerate(steps):
        if isinstance(step, Region):
            members = list(dict.fromkeys(n.fx_node.name for n in step.inlined + step.nodes))
            owner.update({m: step.name for m in members})
            body = "\n".join(f'    "{m}";' for m in members)
            clusters.append(
                f'  subgraph cluster_{k} {{\n    label="{step.name}";\n    style=rounded;\n{body}\n  }}'
            )
    lines = ["digraph gjit {", "  rankdir=TB;", '  node [shape=box, fontname="monospace"];']
    externs = {s.name for s in steps if isinstance(s, ExternNode)}
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        label = f"{node.name}\\n{_short(node.target)}" if node.op == "call_function" else node.name
        attrs = [f'label="{label}"']
        if node.op == "placeholder":
            attrs.append("shape=oval")
        elif node.name in externs:
            attrs += ["style=filled", 'fillcolor="#f4c7c3"']
        elif node.name not in owner:
            attrs.append("style=dashed")  # a view or size computation: no kernel of its own
        lines.append(f'  "{node.name}" [{", ".join(attrs)}];')
    lines += clusters
    for node in gm.graph.nodes:
        for arg in node.all_input_nodes:
            if node.op != "output":
                lines.append(f'  "{arg.name}" -> "{node.name}";')
    lines.append("}")
    return "\n".join(lines) + "\n"


def _short(target: Any) -> str:
    return re.sub(r"^aten\.", "", str(target)).replace('"', "'")


def folder_for(root: str, name: str, entry: int) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:60]
    path = os.path.join(root, f"{next(_COUNTER):03d}_{safe}_entry{entry}")
    os.makedirs(os.path.join(path, "kernels"), exist_ok=True)
    return path


def write(path: str, files: dict[str, str]) -> None:
    for rel, text in files.items():
        full = os.path.join(path, rel)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as f:
            f.write(text)


def report_json(report: Any) -> str:
    data = {
        "kernels": [
            {
                "name": k.name,
                "code_of": k.code_of,
                "aten_nodes": k.aten_nodes,
                "source_lines": k.source_lines,
                "bytes_read": k.bytes_read,
                "bytes_written": k.bytes_written,
            }
            for k in report.kernels
        ],
        "externs": [{"node": e.node, "op": e.op, "reason": e.reason} for e in report.externs],
        "dynamic_dims": report.dynamic_dims,
        "specialized_dims": report.specialized_dims,
        "modeled_bytes": {
            "gjit": report.traffic.gjit,
            "eager": report.traffic.eager,
            "ideal": report.traffic.ideal,
        },
        "compile_seconds": report.timings,
    }
    return json.dumps(data, indent=1) + "\n"
