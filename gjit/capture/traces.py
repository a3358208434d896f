"""One node's decomposition traced alone, and the traces one program's nodes share.

Node-by-node decomposition (gjit/capture/decompose.py) traces a node's op with `make_fx` over its
arguments' fake values, in export's fake mode. A trace costs about 10 ms however small the op
(make_fx's set-up and the symbolic metadata of every value), so what a program's decomposition
costs is the number of traces it makes. `Traces` makes as few as it can:

- a node whose op, constants and arguments' sizes, strides and dtypes equal an earlier one's
  takes that trace (a transformer's later layers);
- a node equal to an earlier one but for which size symbols it has (an encoder-decoder's two
  sequence lengths: T5's attention over s70 and over s28) takes that trace with the symbols
  renamed, when the shape environment cannot tell those symbols apart (same range, no guard
  or replacement naming either) and the earlier trace asked it nothing it could not answer
  statically (it added no guard): the decomposition then took the same path for both, and only
  the values' sizes differ. The renamed nodes' values are made from the renamed expressions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import sympy
import torch
import torch.utils._pytree as pytree
from torch._dispatch.python import enable_python_dispatcher
from torch.func import functionalize
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from gjit import stats

SYM_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)


@dataclasses.dataclass(frozen=True)
class Arg:
    """A node argument of a node being decomposed, with its fake value."""

    node: torch.fx.Node
    val: Any


@dataclasses.dataclass
class _Traced:
    graph: torch.fx.Graph
    symbols: tuple[sympy.Symbol, ...]  # the key's size symbols, in order of first appearance
    pure: bool  # the trace added nothing to the shape environment


class Traces:
    """One program's traced decompositions (`get`); gjit.stats() counts the traces made
    (`decomposition_traces`) and reused with other size symbols (`decomposition_traces_renamed`)."""

    def __init__(self) -> None:
        self.exact: dict[tuple, _Traced] = {}
        self.by_shape: dict[tuple, list[_Traced]] = {}  # the key with symbols numbered

    def get(
        self, node: torch.fx.Node, flat: list, spec: Any, table: dict, functional: bool = False
    ) -> torch.fx.Graph:
        """The graph of `node`'s op decomposed with `table` over `flat` (its flattened arguments,
        `Arg` for each node), traced or reused. `functional`: the node writes an argument in
        place; traced functionalized (its functional op, then a `copy_` into the argument)."""
        key = trace_key(node, flat, spec)
        if key is None:
            return self._trace(node, flat, spec, table, functional).graph
        found = self.exact.get(key)
        if found is not None:
            return found.graph
        shape, symbols = _numbered(key)
        for earlier in self.by_shape.get(shape, ()):
            renaming = dict(zip(earlier.symbols, symbols, strict=True))
            if not (earlier.pure and _interchangeable(_shape_env(flat, node), renaming)):
                continue
            try:
                found = _Traced(_renamed(earlier.graph, renaming, flat, node), symbols, True)
            except _NotRenamed:
                continue
            stats.count("decomposition_traces_renamed")
            break
        else:
            found = self._trace(node, flat, spec, table, functional)
            found.symbols = symbols
            self.by_shape.setdefault(shape, []).append(found)
        self.exact[key] = found
        return found.graph

    def _trace(self, node: torch.fx.Node, flat: list, spec: Any, table: dict, functional: bool) -> _Traced:
        env = _shape_env(flat, node)
        before = _facts_size(env) if env is not None else None
        graph = trace(node, flat, spec, table, functional).graph
        stats.count("decomposition_traces")
        return _Traced(graph, (), env is not None and _facts_size(env) == before)


def trace(
    node: torch.fx.Node, flat: list, spec: Any, table: dict, functional: bool = False
) -> torch.fx.GraphModule:
    """`node`'s op traced alone with `table` over its arguments' fake values, in export's fake mode."""
    op = node.target
    traced_at = [i for i, a in enumerate(flat) if isinstance(a, Arg)]

    def call(*values):
        leaves = list(flat)
        for i, value in zip(traced_at, values, strict=True):
            leaves[i] = value
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        return op(*args, **kwargs)

    values = [flat[i].val for i in traced_at]
    fake_mode = torch._guards.detect_fake_mode([*values, node.meta["val"]])  # export's
    if fake_mode is None:
        raise NotImplementedError(f"{op} has no fake tensor argument")
    # CIA decompositions written in Python, as in export; the traced module's Python code is never
    # run (its graph is copied), so it is not written (a third of a small trace's time)
    with fake_mode, enable_python_dispatcher(), _use_lazy_graph_module(True):
        if functional:  # a private write: its functional op, then a copy_ into the argument
            return make_fx(functionalize(call, remove="mutations"), decomposition_table=table)(*values)
        traced = make_fx(call, decomposition_table=table)(*values)
        if any(writes_in_place(n) for n in traced.graph.nodes):
            # a decomposition that restrides or fills its own fresh result in place
            # (adaptive_avg_pool1d's squeeze is an as_strided_): functionalized, as export's
            # whole-program pass would; a write to an argument stays a copy_ (the caller refuses it)
            traced = make_fx(functionalize(traced, remove="mutations"))(*values)
        return traced


def writes_in_place(node: torch.fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable


def trace_key(node: torch.fx.Node, flat: list, spec: Any) -> tuple | None:
    """What a node's traced decomposition depends on: the op, the arguments' structure and
    constants, each tensor's sizes, strides, offset and dtype (as export's expressions), which
    arguments are the same node. None when a value is not one to key on."""
    if free_unbacked_symbols(node.meta.get("val")):
        return None
    first: dict[torch.fx.Node, int] = {}
    parts: list[Any] = [node.target, str(spec)]
    for i, leaf in enumerate(flat):
        if not isinstance(leaf, Arg):  # 1, 1.0 and True are equal keys, and so are 0.0 and -0.0:
            parts.append((type(leaf).__name__, repr(leaf)))  # the type and the spelling tell them apart
            continue
        val = leaf.val
        if isinstance(val, torch.Tensor):
            desc = (
                _exprs(val.shape),
                _exprs(val.stride()),
                _exprs([val.storage_offset()]),
                val.dtype,
                val.device,
            )
        elif isinstance(val, SYM_TYPES):
            desc = (type(val).__name__, _exprs([val]))
        else:
            return None
        parts.append((desc, first.setdefault(leaf.node, i)))
    key = tuple(parts)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _exprs(values: Any) -> tuple:
    """Sizes, strides or symbols as export's expressions (sympy's, hashed: printing them costs a
    tenth of a decomposition)."""
    return tuple(v.node.expr if isinstance(v, SYM_TYPES) else v for v in values)


def _numbered(key: tuple) -> tuple[tuple, tuple[sympy.Symbol, ...]]:
    """The key with its size symbols numbered in order of first appearance, and the symbols."""
    symbols: dict[sympy.Symbol, sympy.Symbol] = {}

    def walk(part: Any) -> Any:
        if isinstance(part, tuple):
            return tuple(walk(p) for p in part)
        if isinstance(part, sympy.Basic) and part.free_symbols:
            for s in sorted(part.free_symbols, key=str):
                symbols.setdefault(s, sympy.Symbol(f"gjit_trace_{len(symbols)}", integer=True))
            return part.xreplace(symbols)
        return part

    return walk(key), tuple(symbols)


def _shape_env(flat: list, node: torch.fx.Node):
    fake_mode = torch._guards.detect_fake_mode(
        [*(a.val for a in flat if isinstance(a, Arg)), node.meta["val"]]
    )
    return fake_mode.shape_env if fake_mode is not None else None


def _facts_size(env) -> tuple:
    """How much the shape environment knows: a trace that changes none of it asked nothing it could
    not answer from symbols' ranges."""
    asserts = sum(len(v) for v in env.deferred_runtime_asserts.values())
    return (
        len(env.guards),
        len(env.replacements),
        len(env.axioms),
        len(env.divisible),
        asserts,
        dict(env.var_to_range),
    )


def _interchangeable(env, renaming: dict[sympy.Symbol, sympy.Symbol]) -> bool:
    """Whether the shape environment answers every question about the renamed symbols as about
    the symbols they replace: both backed, of the same range and kind, named by no guard,
    replacement, axiom or runtime assert."""
    moved = {(a, b) for a, b in renaming.items() if a != b}
    if not moved:
        return True
    if env is None:
        return False
    named: set[sympy.Symbol] = set()
    facts = [g.expr for g in env.guards] + list(env.axioms) + list(env.divisible)
    facts += [*env.replacements, *env.replacements.values()]
    facts += [r.expr for asserts in env.deferred_runtime_asserts.values() for r in asserts]
    for fact in facts:
        named |= getattr(fact, "free_symbols", set())
    return all(
        a in _hints(env)
        and b in _hints(env)
        and a not in named
        and b not in named
        and env.var_to_range.get(a) == env.var_to_range.get(b)
        and (a in env.size_like) == (b in env.size_like)
        for a, b in moved
    )


def _hints(env) -> dict:
    """The backed symbols' example values (torch 2.13's name, and the older one)."""
    return getattr(env, "backed_var_to_val", None) or env.var_to_val


def _renamed(graph: torch.fx.Graph, renaming: dict, flat: list, node: torch.fx.Node) -> torch.fx.Graph:
    """A copy of `graph` whose values have `renaming`'s symbols in place of the earlier ones."""
    fake_mode = torch._guards.detect_fake_mode(
        [*(a.val for a in flat if isinstance(a, Arg)), node.meta["val"]]
    )
    env = fake_mode.shape_env
    new = torch.fx.Graph()
    mapping: dict[torch.fx.Node, torch.fx.Node] = {}
    rename = _value_renamer(renaming, env, fake_mode)
    for sub in graph.nodes:
        copy = new.node_copy(sub, mapping.__getitem__)
        copy.meta = {k: v for k, v in sub.meta.items() if k != "tensor_meta"}
        if "val" in sub.meta:
            copy.meta["val"] = rename(sub.meta["val"])
        mapping[sub] = copy
    return new


def _value_renamer(renaming: dict, env, fake_mode) -> Callable[[Any], Any]:
    def size(value: Any) -> Any:
        if not isinstance(value, torch.SymInt):
            return value
        expr = value.node.expr.xreplace(renaming)
        if expr.is_number:
            return int(expr)
        return env.create_symintnode(expr, hint=int(expr.xreplace(_hints(env))))

    def rename(value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return type(value)(rename(v) for v in value)
        if isinstance(value, torch.SymInt):
            return size(value)
        if isinstance(value, torch.Tensor):
            offset = value.storage_offset()  # (a symbolic one is not compared: that would guard)
            if value.layout != torch.strided or isinstance(offset, torch.SymInt) or offset != 0:
                raise _NotRenamed("a value at an offset into its storage")  # rare: traced again
            sizes, strides = [size(d) for d in value.shape], [size(d) for d in value.stride()]
            # a meta tensor made fake, as torch's converter makes one (no dispatch through fake mode)
            meta = torch.empty_strided(sizes, strides, dtype=value.dtype, device="meta")
            fake = fake_mode.fake_tensor_converter.from_meta_and_device(fake_mode, meta, value.device)
            return fake.requires_grad_(value.requires_grad)
        if isinstance(value, SYM_TYPES) or not isinstance(value, (int, float, bool, type(None))):
            raise _NotRenamed(f"a {type(value).__name__} value")
        return value

    return rename


class _NotRenamed(Exception):
    """A traced value this module does not rebuild with other symbols: the node is traced."""
