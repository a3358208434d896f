"""Kernels whose time is their launch: small pointwise sinks of one size, one kernel.

A pointwise kernel of at most `ONE_LAUNCH` elements of static size is one program on a GPU; its
time is the launch (a few microseconds of host time, and the card's gap between kernels), not its
work. Such regions merge horizontally (gjit/fusion/regions.py) even where they read nothing in
common, when nothing in the program reads what they compute (their values are outputs, or written
into inputs) and what they read is small or an input: a static cache's per-layer counters
(`cumulative_length += 1`, one element each, stored into the caller's tensors) are one kernel a
step, not one a layer. A merge moves the earlier kernel to the later one's place; since no kernel
or extern waits for a sink, that delays nothing and makes no cycle, and only small values live
longer. At most `MAX_MERGED` regions a kernel (its arguments stay few). Where the program draws
random numbers nothing merges so (a kernel moved later moves the externs that read it, and eager's
draws are in program order).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import sympy

from gjit import ir
from gjit.fusion.writes import draws_in
from gjit.ir import Layout, ReduceNode, ScanNode, ScatterNode

if TYPE_CHECKING:
    from gjit.fusion.regions import Fusion

ONE_LAUNCH = 1024  # elements: the default pointwise block (gjit.config.xblock), so one program
OWN_KERNEL = (ReduceNode, ScanNode, ScatterNode)  # regions of their own kind: never a pointwise kernel
MAX_MERGED = 32  # regions a kernel: 12 counters of GPT-2 small, 32 of a Llama-7B, in one


def launch_bound(fusion: Fusion, groups: list[str]) -> dict[str, tuple[int, ...]]:
    """Group -> its static size, for the pointwise sinks of at most ONE_LAUNCH elements that read
    only inputs and values of at most ONE_LAUNCH elements."""
    if draws_in(fusion.graph.fx_graph):
        return {}
    consumers = fusion.consumers()
    out = {}
    for g in groups:
        members = [fusion.compute[m] for m in fusion.group_members(g)]  # `groups`: kernels' groups
        if consumers.get(g) or any(isinstance(n, OWN_KERNEL) for n in members):
            continue  # read by something, or a kernel of its own kind
        if _small(members[0].layout) and all(_small_or_input(fusion, m.name) for m in members):
            out[g] = tuple(int(s) for s in members[0].size)
    return out


def _small(layout: Layout) -> bool:
    return (
        all(isinstance(s, (int, sympy.Integer)) for s in layout.size)
        and sympy.prod(layout.size) <= ONE_LAUNCH
    )


def _small_or_input(fusion: Fusion, member: str) -> bool:
    """Whether each value `member` reads is a graph input or small (a merge keeps it longer)."""
    for r in ir.reads(fusion.bodies[member]):
        name = fusion.resolve(r.name)
        buffer = fusion.graph.buffers.get(name)
        if buffer is not None and buffer.kind == "input":
            continue
        layout = buffer.layout if buffer is not None else getattr(fusion.compute.get(name), "layout", None)
        if layout is None or not _small(layout):
            return False
    return True
