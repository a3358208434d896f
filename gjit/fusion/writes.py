"""Writes in the schedule (gjit/fusion/regions.py asks): writes through indices that share one
kernel, and a value written back into an input that waits for the input's readers.

- **Side by side.** Writes through indices over the same elements (a static KV cache's keys and
  values, written at the same positions from one projection) are one kernel where each writes
  memory of its own and none reads what another writes: each program stores its elements of
  each, and values they share (the position, the projection's element) are loaded once. A write
  into the memory another writes, or reading it, stays a kernel of its own: programs run in no
  order.
- **After the readers.** A kernel that computes an input's new value (a counter's `+= 1`) is
  scheduled, where something else is ready, after the other kernels that read the input: the
  wrapper then stores the value into the input itself (gjit/wrapper.py `stored_into`), not into a
  buffer copied into the input after the call. Not in a program with random ops (a kernel moved
  later moves the externs that read it, and eager's draws are in program order), and never an
  extern.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from gjit import ir
from gjit.ir import ComputeNode, Expr, ScatterNode


def why_not_side_by_side(nodes: list[ComputeNode], bodies: dict[str, Expr], resolve: Callable) -> str | None:
    """None if the writes through indices `nodes` (two groups' members) may be one kernel."""
    if not all(isinstance(n, ScatterNode) for n in nodes):
        return "a write through indices is a kernel of its own"
    if len({tuple(n.space) for n in nodes}) > 1:
        return "writes through indices over different elements"
    names, bases = {n.name for n in nodes}, [resolve(n.base) for n in nodes]
    if len(set(bases)) < len(nodes) or set(bases) & names:
        return "writes through indices into the same memory"
    written = set(bases) | names
    for n in nodes:
        read = {resolve(r.name) for r in ir.reads(bodies[n.name])}
        if read & written:
            return f"{n.name} reads memory a write through indices writes"
    return None


def waits_for_readers(
    fx_graph: torch.fx.Graph,
    written_back: dict[str, str],
    reads: Iterable[tuple[str, str]],
    group: dict[str, str],
    bodies: dict[str, Expr],
    resolve: Callable,
) -> dict[str, set[str]]:
    """Group -> the groups it waits for: a kernel that computes an input's new value (`written_back`:
    value -> input; `bodies`: the kernels' nodes) waits for the others that read the input
    (`reads`: (node, what it reads)); none in a program with random ops (`fx_graph`'s)."""
    if any(draws(n) for n in fx_graph.nodes):
        return {}  # random ops draw in program order: nothing moves past one
    readers: dict[str, set[str]] = {}
    for name, read in reads:
        readers.setdefault(resolve(read), set()).add(group[name])
    waits: dict[str, set[str]] = {}
    for value, target in written_back.items():
        if value in bodies:  # a kernel's (an extern stays where it is)
            g = group[value]
            waits.setdefault(g, set()).update(readers.get(target, set()) - {g})
    return waits


def draws(node: torch.fx.Node) -> bool:
    """Whether an FX node is a random op (its draws follow the program's order)."""
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags
