"""The library's side of the choice: the program with every product an ATen extern, run once on
the example, its extern calls of products and its kernels kept, each piece timed once when a
region's choice needs it."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import sympy
import torch

from gjit import tuning
from gjit.choice.regions import PRODUCT_OPS, members, product_names, products
from gjit.fusion.regions import Region, Step
from gjit.ir import ExternNode
from gjit.runtime.graph import CompiledGraph

log = tuning.log  # GJIT_LOGS=tuning


@dataclasses.dataclass
class Call:
    """The example call the measurements run: the graph's inputs, the sizes the wrapper takes
    and every size symbol's value."""

    inputs: list[Any]
    sizes: tuple
    values: dict[sympy.Symbol, int]


class LibrarySide:
    """The program with every product an ATen extern, run once on the example: its extern calls
    of products and its kernels kept, each timed once when a region's choice needs it."""

    def __init__(self, steps: list[Step], graph: CompiledGraph, call: Call):
        self.kernels = {s.name: s for s in steps if isinstance(s, Region)}
        self.externs: dict[str, tuple] = {}  # FX name -> its call's key
        self.calls: dict[tuple, tuple] = {}  # call key -> (function, args, kwargs), the first such call
        self.times: dict[Any, float | None] = {}
        order: dict[Any, list[str]] = {}  # the wrapper calls each product's extern in schedule order
        for step in steps:
            if isinstance(step, ExternNode) and step.fx_node.target in PRODUCT_OPS:
                order.setdefault(step.fx_node.target, []).append(step.name)

        def seen(op: Any) -> Callable[[Callable, tuple, dict], None]:
            names = iter(order.get(op, []))

            def on_call(fn: Callable, args: tuple, kwargs: dict) -> None:
                key = call_key(op, args, kwargs)
                name = next(names, None)
                if name is not None:
                    self.externs[name] = key
                self.calls.setdefault(key, (fn, args, kwargs))  # fn: the op, or its padded call

            return on_call

        calls = {op: seen(op) for op in order}
        self.keys, self.launches = tuning.record(
            graph, set(self.kernels), call.inputs, call.sizes, call.values, calls
        )

    def extern_ms(self, name: str) -> float | None:
        key = self.externs.get(name)
        if key is None:
            return None
        if key not in self.times:
            op, args, kwargs = self.calls[key]
            self.times[key] = timed(lambda: op(*args, **kwargs), f"ATen {name}")
        return self.times[key]

    def kernel_ms(self, name: str) -> float | None:
        """A kernel's time; 0 when it never launched (empty), None when it could not be timed."""
        key = self.keys.get(name)
        if key is None:
            return 0.0
        if key not in self.times:
            launch = self.launches.get(key)
            if launch is None:  # it writes what it reads: not run again on kept arguments
                self.times[key] = None
            else:
                self.times[key] = timed(lambda: tuning.replay(launch), f"ATen-side kernel {name}")
        return self.times[key]

    def cost(self, region: Region, claims: collections.Counter) -> tuple[float, str] | None:
        """The library's time for what `region` computes, and its pieces; None when a piece could
        not be timed. `claims`: how many template regions fused each node."""
        total, pieces = 0.0, []
        for name in product_names(region):
            ms = self.extern_ms(name)
            if ms is None:
                return None
            total += ms
            pieces.append(f"{name} {ms:.3f}")
        fused = members(region) - {n.name for n in products(region)}
        for name, kernel in self.kernels.items():
            nodes = [n.name for n in kernel.fused_nodes()]
            share = sum(1 / claims[n] for n in nodes if n in fused) / max(len(nodes), 1)
            if share == 0:
                continue
            ms = self.kernel_ms(name)
            if ms is None:
                return None
            total += share * ms
            pieces.append(f"{name} {ms:.3f}" + ("" if share == 1 else f" x {share:.2f}"))
        return total, " + ".join(pieces)


def call_key(op: Any, args: tuple, kwargs: dict) -> tuple:
    """What two extern calls that cost alike share: the op, each tensor's sizes, strides and
    dtype, the other arguments."""

    def describe(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return ("tensor", tuple(a.shape), tuple(a.stride()), str(a.dtype))
        if isinstance(a, (list, tuple)):
            return tuple(describe(x) for x in a)
        return repr(a)

    return str(op), describe(args), tuple(sorted((k, describe(v)) for k, v in kwargs.items()))


def timed(fn: Callable[[], Any], what: str) -> float | None:
    try:
        return tuning.bench(fn, what)
    except Exception as e:  # not runnable again on its kept arguments: not measured
        log.info("%s: not timed (%s)", what, tuning.first_line(e))
        return None
