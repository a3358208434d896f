"""Kernels whose time is their launch: small pointwise regions of one size, one kernel.

A pointwise kernel of at most `ONE_LAUNCH` elements of static size is one program on a GPU; its
time is the launch (a few microseconds of host time, and the card's gap between kernels), not its
work. Such regions merge horizontally (gjit/fusion/regions.py) when they have one size, even where
they read nothing in common, wherever the merge makes no cycle: a static cache's per-layer counters
(`cumulative_length += 1`, one element each, written into the caller's tensors) are one kernel a
step, not one a layer. Where the program draws random numbers nothing merges so (a kernel moved
later moves the externs that read it, and eager's draws are in program order).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import sympy

from gjit.fusion.writes import draws_in
from gjit.ir import ReduceNode, ScanNode, ScatterNode

if TYPE_CHECKING:
    from gjit.fusion.regions import Fusion

ONE_LAUNCH = 1024  # elements: the default pointwise block (gjit.config.xblock), so one program


def launch_bound(fusion: Fusion, groups: list[str]) -> dict[str, tuple[int, ...]]:
    """Group -> its static size, for the pointwise groups of at most ONE_LAUNCH elements."""
    if draws_in(fusion.graph.fx_graph):
        return {}
    out = {}
    for g in groups:
        members = [fusion.compute[m] for m in fusion.group_members(g) if m in fusion.bodies]
        if not members or any(isinstance(n, (ReduceNode, ScanNode, ScatterNode)) for n in members):
            continue
        size = members[0].size
        if all(isinstance(s, (int, sympy.Integer)) for s in size) and sympy.prod(size) <= ONE_LAUNCH:
            out[g] = tuple(int(s) for s in size)
    return out
