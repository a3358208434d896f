"""What a template region is, for the choice between it and the library: its products, the
nodes it computes, its sizes, the table's key for it and a roofline estimate of its time."""

from __future__ import annotations

import collections
import math
from typing import Any

import sympy
import torch

from gjit.codegen.common import KernelSource
from gjit.fusion.regions import Region, Step
from gjit.ir import AttentionNode, MatmulNode, dot_operands

aten = torch.ops.aten

PRODUCT_OPS = (
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten.baddbmm.default,
    aten.scaled_dot_product_attention.default,
)
# nominal figures of a current GPU: the order decisions are measured in, never a decision
NOMINAL_FLOPS = {"16-bit": 8e14, "tf32": 4e14, "float32": 5e13}
NOMINAL_BYTES_PER_S = 3e12


def card_of(flat: list[Any], aot_target: int | None) -> int | None:
    """The GPU a compile for these inputs is for (CompileOptions.target): the compute capability
    of the call's device (sm_90: 90), else gjit.aot's arch, else None."""
    device = next((v.device for v in flat if isinstance(v, torch.Tensor) and v.is_cuda), None)
    if device is None:
        return aot_target
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def template_regions(steps: list[Step]) -> list[Region]:
    return [s for s in steps if isinstance(s, Region) and s.matmul]


def products(region: Region) -> list[MatmulNode]:
    """The products a template region computes: its own (each of a group's parts), and those of
    a written-out attention its attention node stands for."""
    own = [n for n in region.nodes if isinstance(n, MatmulNode)]
    return own + [a for n in own for a in getattr(n, "absorbed", ()) if isinstance(a, MatmulNode)]


def product_names(region: Region) -> tuple[str, ...]:
    """The FX nodes the choice of `region` is for (what lowering keys templates on)."""
    return tuple(sorted({n.fx_node.name for n in products(region)}))


def members(region: Region) -> frozenset[str]:
    """Every node the region's kernel computes, products and what it fused."""
    return frozenset(n.name for n in region.fused_nodes())


def signature(region: Region) -> tuple[frozenset[str], frozenset[str]]:
    """What a region's kernel is, across compiles of one graph: what it computes and stores."""
    return members(region), frozenset(region.stores)


def hint(size: Any, hints: dict[sympy.Symbol, int]) -> int | None:
    """A size's example value (None: a data-dependent size)."""
    expr = size.node.expr if isinstance(size, torch.SymInt) else sympy.sympify(size)
    value = sympy.sympify(sympy.sympify(expr).xreplace(hints))
    return int(value) if value.is_Integer else None


def operand_dtype(region: Region) -> torch.dtype:
    """The dtype the region's dot multiplies in."""
    node = next(n for n in region.nodes if isinstance(n, MatmulNode))
    if isinstance(node, AttentionNode):
        return node.body.dtype
    return dot_operands(*region.bodies[node.name].args)[0]


def table_key(region: Region, hints: dict[sympy.Symbol, int], tf32: bool | None) -> tuple:
    """(kind, dtype, sizes, ops, causal, tf32): what kernels/template_wins.py's entries name."""
    node = next(n for n in region.nodes if isinstance(n, MatmulNode))
    dtype = operand_dtype(region)
    kind = "attention" if isinstance(node, AttentionNode) else "matmul"
    sizes = tuple(hint(s, hints) for s in node.full_size)
    ops = tuple(sorted(n.aten for n in region.fused_nodes()))
    causal = bool(getattr(node, "causal", False))
    return kind, dtype, sizes, ops, causal, (bool(tf32) if dtype == torch.float32 else None)


def modeled_ms(
    region: Region, kernel: KernelSource, hints: dict[sympy.Symbol, int], tf32: bool | None
) -> float:
    """A roofline estimate of the template kernel's time on a nominal GPU: the order in which a
    model's decisions are measured (a budget measures the heaviest first)."""
    flops = 0
    for node in products(region):
        sizes = [hint(s, hints) or 0 for s in node.full_size]
        if isinstance(node, AttentionNode):  # (batch..., L, Ev, S, D)
            *batch, length, dim_v, keys, dim = sizes
            flops += 2 * math.prod(batch) * length * keys * (dim + dim_v)
        elif not any(isinstance(n, AttentionNode) for n in region.nodes):
            flops += 2 * math.prod(sizes)
    dtype = operand_dtype(region)
    peak = NOMINAL_FLOPS["16-bit" if dtype != torch.float32 else "tf32" if tf32 else "float32"]
    moved = hint(kernel.bytes_read + kernel.bytes_written, hints) or 0
    return 1e3 * max(flops / peak, moved / NOMINAL_BYTES_PER_S)


def claims_of(regions: list[Region]) -> collections.Counter:
    """How many template regions fused each node (besides their products)."""
    return collections.Counter(n for r in regions for n in members(r) - {p.name for p in products(r)})
