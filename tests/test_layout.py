"""The shape of the code: imports flow down the pipeline with no cycle, modules stay small, and
every IR op has an emitter in both kernel languages.

    python tests/test_layout.py     # print the import graph between gjit's modules, by layer

Imports are read from the source (every `import`, also inside functions, except under
`if TYPE_CHECKING:`), so a cycle hidden in a function body counts.
"""

from __future__ import annotations

import ast
import os
import re
import sys

import pytest
import torch

from gjit import ir
from gjit.codegen.cuda.pointwise import CudaOverrides
from gjit.codegen.triton.pointwise import TritonOverrides

pytestmark = pytest.mark.cpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# source folder -> the package it installs as (pyproject.toml's package-dir)
PACKAGES = {"gjit": "gjit", "codegen": "gjit.codegen", "kernels": "gjit.kernels", "guards": "gjit.guards"}
MAX_LINES = 600

# The pipeline, top to bottom: a module imports only from its own layer or the layers above it.
# A prefix names a module and everything under it, the longest matching prefix decides;
# "name=" names that module alone (the package `gjit` itself, not everything in it).
LAYERS = [
    (
        "base",
        ["gjit.compat", "gjit.config", "gjit.progress", "gjit.logs", "gjit.stats", "gjit.heap", "gjit.locks"],
    ),
    ("capture", ["gjit.capture"]),
    ("ir", ["gjit.ir"]),
    ("lowering", ["gjit.lowering"]),
    ("fusion", ["gjit.fusion"]),
    ("kernels", ["gjit.kernels"]),
    ("codegen", ["gjit.codegen"]),
    ("toolchain", ["gjit.codegen.toolchain"]),
    ("wrapper", ["gjit.wrapper", "gjit.memory_plan"]),
    ("runtime", ["gjit.runtime"]),
    ("guards", ["gjit.guards"]),
    ("debug", ["gjit.debug"]),
    ("driver", ["gjit.tuning", "gjit.choice", "gjit.driver"]),
    ("api", ["gjit.api", "gjit.backend", "gjit.aot", "gjit.packaging", "gjit="]),
    ("tools", ["gjit.demo", "gjit.demo_llm", "gjit.bench"]),
]


def modules() -> dict[str, str]:
    """Every module of the package: dotted name -> file."""
    out = {}
    for folder, package in PACKAGES.items():
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, f), os.path.join(ROOT, folder))
                parts = rel[: -len(".py")].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                out[".".join([package, *parts])] = os.path.join(dirpath, f)
    return out


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(name: str, path: str, known: dict[str, str]) -> set[str]:
    """The package's modules that `name` imports at run time."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + [base]
                ).strip(".")
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.add(sub if sub in known else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in found if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in sorted(known.items())}


def layer_of(module: str) -> int:
    best, rank = -1, None
    for k, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            matches = module == p[:-1] if p.endswith("=") else module == p or module.startswith(p + ".")
            if matches and len(p) > best:
                best, rank = len(p), k
    assert rank is not None, f"{module} is in no layer of tests/test_layout.py's LAYERS"
    return rank


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in graph:
        if v not in index:
            connect(v)
    return groups


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
        for a, targets in graph.items()
        for b in sorted(targets)
        if layer_of(b) > layer_of(a)
    ]


def test_imports_flow_down_the_pipeline():
    assert upward_imports(import_graph()) == []


def test_every_module_is_in_a_layer_and_every_package_is_installed():
    """A new module must be placed in LAYERS (no catch-all), and a new sub-package must be in
    pyproject.toml's packages, or a wheel install would lack it."""
    known = modules()
    for name in known:
        layer_of(name)
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        text = f.read()
    listed = set(re.findall(r'"(gjit(?:\.[a-z_]+)*)"', text.split("packages = [", 1)[1].split("]", 1)[0]))
    packages = {name for name, path in known.items() if path.endswith("__init__.py")}
    assert packages == listed


def test_the_two_printers_do_not_import_each_other():
    """codegen/triton/ and codegen/cuda/ both print the plan of codegen/plan.py; neither builds on
    the other (a CUDA fix must not hide in a Triton writer, nor the reverse)."""
    graph = import_graph()
    for a, b in (("gjit.codegen.cuda", "gjit.codegen.triton"), ("gjit.codegen.triton", "gjit.codegen.cuda")):
        crossing = {m: sorted(t for t in graph[m] if t.startswith(b)) for m in graph if m.startswith(a)}
        assert not any(crossing.values()), crossing


def test_modules_are_small():
    long = {}
    for name, path in modules().items():
        with open(path, encoding="utf-8") as f:
            n = sum(1 for _ in f)
        if n > MAX_LINES:
            long[name] = n
    assert long == {}, f"modules over {MAX_LINES} lines (STYLE.md): {long}"


def test_every_ir_op_has_an_emitter_in_both_backends():
    """`to_dtype` is printed by each writer's own cast rules; every other op by the tables."""
    assert ir.OPS - {"to_dtype"} == set(TritonOverrides)
    assert ir.OPS - {"to_dtype"} == set(CudaOverrides)


def test_every_polynomial_op_has_a_spec():
    from gjit.kernels.polynomials import POLYNOMIALS

    assert set(ir.POLYNOMIAL_OPS) == set(POLYNOMIALS)


def test_an_unknown_ir_op_is_refused_where_it_is_made():
    with pytest.raises(ValueError, match="not an IR op"):
        ir.Op(torch.float32, "no_such_op", ())


def test_the_checker_sees_cycles_and_upward_imports():
    """The two checks above can fail: a planted cycle and a planted upward import are found."""
    graph = import_graph()
    graph["gjit.ir"] = graph["gjit.ir"] | {"gjit.driver"}
    assert any("gjit.ir" in group and "gjit.driver" in group for group in cycles(graph))
    assert upward_imports(graph) == ["gjit.ir (ir) imports gjit.driver (driver)"]
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of("gjit.somewhere_new")


def main() -> None:
    graph = import_graph()
    for k, (layer, _) in enumerate(LAYERS):
        members = [m for m in graph if layer_of(m) == k]
        if not members:
            continue
        print(f"[{layer}]")
        for m in members:
            print(f"  {m} -> {', '.join(sorted(graph[m])) or '(nothing of gjit)'}")


if __name__ == "__main__":
    main()
