"""Data-dependent sizes in the schedule: the extern that binds each unbacked symbol (`.item()`'s
value, nonzero's row count), and the symbols an extern's arguments use, so that what uses a symbol
runs after what binds it (gjit/fusion/regions.py orders by it, gjit/fusion/schedule.py reads it)."""

from __future__ import annotations

import sympy
import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from gjit.ir import ExternNode, LoopGraph

SYMBOLIC = (torch.SymInt, torch.SymBool, torch.SymFloat)


def data_dependent_symbols(graph: LoopGraph) -> dict[sympy.Symbol, str]:
    """Symbol -> the extern whose result binds it (`.item()`, nonzero's row count): a node
    using the symbol runs after that extern, so it never fuses into a kernel before it."""
    out: dict[sympy.Symbol, str] = {}
    for n in graph.nodes:
        if isinstance(n, ExternNode):
            val = n.fx_node.meta.get("val")
            sizes = [val] if isinstance(val, torch.SymInt) else list(getattr(val, "shape", ()))
            for s in sizes:
                if isinstance(s, torch.SymInt):
                    for sym in free_unbacked_symbols(s.node.expr):
                        out.setdefault(sym, n.name)
    return out


def extern_symbols(extern: ExternNode) -> set[sympy.Symbol]:
    """The unbacked symbols an extern's arguments use: a predicate or size computed from a
    `.item()` (torch.cond's, a `sort` of `y[:n]`'s view), in a value or in a tensor's sizes."""
    out: set[sympy.Symbol] = set()
    for arg in pytree.tree_leaves((extern.fx_node.args, extern.fx_node.kwargs)):
        val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else arg
        for v in pytree.tree_leaves(val):
            if isinstance(v, torch.Tensor):
                values = [*v.shape, *v.stride(), v.storage_offset()]
            else:
                values = [v]
            for s in values:
                if isinstance(s, SYMBOLIC):
                    out |= free_unbacked_symbols(s.node.expr)
    return out
