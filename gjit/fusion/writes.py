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

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from gjit import ir
from gjit.capture.in_place import WRITTEN_BACK
from gjit.ir import ComputeNode, Expr, ExternNode, ScatterNode

if TYPE_CHECKING:
    from gjit.fusion.regions import Fusion


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


def waits_for_readers(fusion: Fusion) -> dict[str, set[str]]:
    """Group -> the groups it waits for where another is ready: a kernel that computes an input's
    new value (the graph module's WRITTEN_BACK) waits for the other groups that read the input
    but those that need it first; none in a program with random ops."""
    graph = fusion.graph
    owner = graph.fx_graph.owning_module
    written = {} if owner is None else owner.meta.get(WRITTEN_BACK, {})
    if not written or draws_in(graph.fx_graph):
        return {}  # random ops draw in program order: nothing moves past one
    reads = [(name, r.name) for name, body in fusion.bodies.items() for r in ir.reads(body)]
    reads += [(n.name, a) for n in graph.nodes if isinstance(n, ExternNode) for a in n.tensor_args]
    readers: dict[str, set[str]] = {}
    for name, read in reads:
        readers.setdefault(fusion.resolve(read), set()).add(fusion.group[name])
    consumers = fusion.consumers()
    waits: dict[str, set[str]] = {}
    for value, target in written.items():
        if value not in fusion.bodies:  # a kernel's (an extern stays where it is)
            continue
        g = fusion.group[value]
        for r in readers.get(target, ()):
            if r != g and r not in consumers.get(g, ()) and not fusion.reaches({g}, {r}):
                waits.setdefault(g, set()).add(r)
    return waits


def draws_in(fx_graph: torch.fx.Graph) -> bool:
    """Whether a graph, or a torch.cond branch in it, draws random numbers (its draws follow the
    program's order)."""
    owner = fx_graph.owning_module
    for node in fx_graph.nodes:
        if draws(node):
            return True
        branch = getattr(owner, node.target, None) if node.op == "get_attr" else None
        if isinstance(branch, torch.fx.GraphModule) and draws_in(branch.graph):
            return True
    return False


def draws(node: torch.fx.Node) -> bool:
    """Whether an FX node draws random numbers: a random op, but not with a dropout probability of
    0 (SDPA's dropout_p in inference) or outside training (native_dropout's train=False)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    arguments = target._schema.arguments
    given = {a.name: a.default_value for a in arguments if a.has_default_value()}
    given |= dict(zip((a.name for a in arguments), node.args)) | dict(node.kwargs)
    if given.get("train", True) is False:
        return False
    return not any(given.get(name, 1) == 0 for name in ("dropout_p", "p"))
