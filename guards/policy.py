"""Recompile policy: which dims a compile asks export to keep dynamic, and when to stop compiling.

gjit's default lets export decide from the first call: every dim of every tensor input is
`Dim.AUTO`, so export keeps a dim symbolic unless the program needs its value (a branch on it,
a match with a weight). A later call that misses every entry recompiles the same way with its
own sizes, so the new entry is again as general as export allows. Export specializes example
sizes 0 and 1 and assumes dynamic sizes are at least 2, so sizes 0 and 1 get entries of their
own: a program that treats 1 specially (squeeze, broadcasting) is never reused for it.
`dynamic=True` is the same for tensors (gjit's default is already dynamic from the first call)
and, as in torch.compile, also exports Python int inputs as symbols (`Dim.AUTO`: export may
still specialize one the program needs); ints below 2 stay specialized, like sizes 0 and 1.
torch.compile(backend="gjit") passes it for graphs whose int inputs Dynamo made SymInts.
`dynamic=False` exports every dim static, one entry per shape. `mark_dynamic` adds a range and
makes a dim dynamic in any mode.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Collection
from typing import Any

import sympy
import torch

from gjit.guards.builder import where

MARKS = "_gjit_dynamic_dims"  # tensor attribute: {dim: (min, max)} set by mark_dynamic


def mark_dynamic(
    t: torch.Tensor, dim: int | list[int], min: int | None = None, max: int | None = None
) -> None:
    """Make dim(s) of `t` dynamic in the next compile that sees `t`, with an optional size range.

    A later call whose size falls outside [min, max] misses the entry and recompiles (or raises,
    with gjit.config.error_on_recompile).
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"gjit.mark_dynamic expects a Tensor, got {type(t).__name__}")
    for d in [dim] if isinstance(dim, int) else list(dim):
        if not -t.dim() <= d < t.dim():
            raise IndexError(f"gjit.mark_dynamic: dim {d} out of range for a tensor of rank {t.dim()}")
        d = d % t.dim()
        if min is not None and max is not None and min > max:
            raise ValueError(f"gjit.mark_dynamic: min={min} > max={max}")
        size = t.shape[d]
        if (min is not None and size < min) or (max is not None and size > max):
            raise ValueError(
                f"gjit.mark_dynamic: dim {d} has size {size}, "
                f"outside the range [{min}, {max}] it is marked with"
            )
        marks = dict(getattr(t, MARKS, None) or {})
        marks[d] = (min, max)
        setattr(t, MARKS, marks)


def dynamic_dims(
    flat: list[Any], dynamic: bool | None
) -> dict[int, dict[int, tuple[int | None, int | None]]]:
    """flat input index -> {dim: (min, max)} to export as Dim.AUTO; every other dim is static.
    With dynamic=True a Python int input of at least 2 maps to {} (export it as a symbol)."""
    out: dict[int, dict[int, tuple[int | None, int | None]]] = {}
    for i, t in enumerate(flat):
        if not isinstance(t, torch.Tensor):
            if dynamic is True and type(t) is int and t >= 2:
                out[i] = {}
            continue
        marks = getattr(t, MARKS, None) or {}
        dims = {}
        for d in range(t.dim()):
            if d in marks:
                dims[d] = marks[d]
            elif dynamic is False or t.shape[d] <= 1:
                continue  # static; export would specialize an example size of 0 or 1 anyway
            else:
                dims[d] = (None, None)
        if dims:
            out[i] = dims
    return out


def batch_dims(
    dims: dict[int, dict[int, tuple[int | None, int | None]]],
    flat: list[Any],
    keep: Collection[tuple[int, int]] = (),
    batch: bool = True,
) -> dict:
    """`dims` narrowed to dim 0 of each tensor input (the batch, which size arithmetic through
    floor division and modulo rarely involves; `batch=False`: not even that), the dims the user
    marked, the `keep` pairs (a KV cache's length) and int inputs: what gjit exports dynamic once
    an export with `dims` ran past gjit.config.dynamic_export_budget."""
    out = {}
    for i, ranges in dims.items():
        if not isinstance(flat[i], torch.Tensor):
            out[i] = ranges  # an int input exported as a symbol
            continue
        marks = getattr(flat[i], MARKS, None) or {}
        kept = {d: r for d, r in ranges.items() if (batch and d == 0) or d in marks or (i, d) in keep}
        if kept:
            out[i] = kept
    return out


@dataclasses.dataclass
class MissHistory:
    """What a compiled callable has seen missing its cache: shapes and the guards that failed."""

    shapes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    failed: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    sizes: dict[tuple[str, int], set[int]] = dataclasses.field(default_factory=dict)  # (input, dim) -> seen

    def record(self, flat: list[Any], names: list[str], failed: list[str]) -> None:
        self.shapes[signature(flat, names)] += 1
        for f in failed:
            self.failed[f.split(", got ")[0]] += 1
        for value, name in zip(flat, names):
            if isinstance(value, torch.Tensor):
                for d, size in enumerate(value.shape):
                    self.sizes.setdefault((name, d), set()).add(size)

    def changing_dims(self) -> list[tuple[str, int]]:
        """(input, dim) pairs that took more than one size among the calls that missed."""
        return [key for key, seen in self.sizes.items() if len(seen) > 1]

    def histogram(self, top: int = 6) -> str:
        lines = [f"    {count:4d} x {sig}" for sig, count in self.shapes.most_common(top)]
        more = len(self.shapes) - top
        if more > 0:
            lines.append(f"    ... and {more} other input signature(s)")
        return "\n".join(lines)

    def worst_guard(self) -> str:
        return self.failed.most_common(1)[0][0] if self.failed else "(none recorded)"


def signature(flat: list[Any], names: list[str]) -> str:
    parts = []
    for value, name in zip(flat, names):
        if isinstance(value, torch.Tensor):
            dtype = str(value.dtype).removeprefix("torch.")
            parts.append(f"{name}: {dtype}{list(value.shape)}")
        else:
            parts.append(f"{name}={value!r}")
    return ", ".join(parts)


def specialized_dims(dims: dict[int, dict], user_vals: list[Any], names: list[str]) -> list[str]:
    """Dims the policy asked export to keep dynamic that export made static, each with the guard
    and source line that forced it (from the shape environment), e.g.
    "x.size(1) = 64: Eq(s27, 64) at model.py:12 in forward"."""
    env = next((v.fake_mode.shape_env for v in user_vals if hasattr(v, "fake_mode")), None)
    reasons: dict[str, str] = {}
    # what pinned a symbol to a number: the replacement export made (with its line), else the
    # first equality guard that mentions it
    for sym, value in getattr(env, "replacements", {}).items():
        sloc = env.replacements_slocs.get(sym)
        if value.is_number and sloc is not None:
            for source in env.var_to_sources.get(sym, []):
                reasons.setdefault(source.name, f"{sym} == {value} at {where(sloc)}")
    for g in getattr(env, "guards", ()):
        if isinstance(g.expr, sympy.Eq):
            for sym in g.expr.free_symbols:
                for source in env.var_to_sources.get(sym, []):
                    reasons.setdefault(source.name, f"{g.expr} at {where(g.sloc)}")
    out = []
    for i, ranges in dims.items():
        val = user_vals[i] if i < len(user_vals) else None
        if not isinstance(val, torch.Tensor):
            continue
        for d in ranges:
            size = val.shape[d]
            if not isinstance(size, torch.SymInt) or size.node.expr.is_number:
                why = reasons.get(f"L['{names[i]}'].size()[{d}]", "export specialized it")
                out.append(f"{names[i]}.size({d}) = {int(size)}: {why}")
    return out
