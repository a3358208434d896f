"""Writes through indices run in place, as in eager, where that is safe.

A static KV cache's `index_copy_` is functionalized by export into `index_put` plus a copy of the
whole cache back into the input; `write_in_place` turns it back into `index_put_` on the caller's
buffer when nothing else reads the old value. `as_functional` undoes that for the span of a
`torch.export` serialization (the serializer stores the program as decomposition left it).
`written_back` names the other values a call writes back into its inputs (a counter's `+= 1`),
which the wrapper stores into the input itself where that is safe (gjit/wrapper.py).
`written_shared` finds an input the program writes whose elements share memory (an expanded
view), which capture refuses; `as_mutated_inputs` hands a call's outputs that are a written
input's new value (or a view of it) out as that input.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind
from torch.fx.experimental.symbolic_shapes import statically_known_true

from gjit import logs
from gjit.compat import optimization_hint

log = logs.logger("capture")


# functional write through indices -> the in-place op that writes only the indexed positions
_IN_PLACE = {
    torch.ops.aten.index_put.default: torch.ops.aten.index_put_.default,
    torch.ops.aten.index_copy.default: torch.ops.aten.index_copy_.default,
}


_METADATA_ONLY = (
    torch.ops.aten.sym_size.int,
    torch.ops.aten.sym_stride.int,
    torch.ops.aten.sym_numel.default,
)


def write_in_place(program: ExportedProgram) -> None:
    """A write through indices (a static KV cache's `index_copy_`, functionalized by export into
    `index_put`) runs in place, as in eager, when nothing else reads the tensor it writes into and
    that tensor is either a mutated input whose new value it is, or a fresh tensor of the program
    (the cache's zeros, allocated in the prefill). The extern then writes only the new positions,
    where the functional form copies the whole tensor (and, for an input, copies it back: `finish`
    skips a copy-back whose source is the target itself)."""
    returned = list(program.graph.output_node().args[0])
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    by_target = {s.target: s.arg.name for s in program.graph_signature.input_specs if s.target is not None}
    updates: dict[torch.fx.Node, torch.fx.Node] = {}  # new value -> the input placeholder it replaces
    for spec, value in zip(program.graph_signature.output_specs, returned):
        if spec.kind == OutputKind.USER_INPUT_MUTATION:
            updates[value] = placeholders.get(spec.target)
        elif spec.kind == OutputKind.BUFFER_MUTATION:
            updates[value] = placeholders.get(by_target.get(spec.target))
    for node in list(program.graph.nodes):
        if node.op != "call_function" or node.target not in _IN_PLACE:
            continue
        accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
        if node.target is torch.ops.aten.index_put.default and accumulate:
            continue  # accumulate=True: running it twice (the GJIT_CHECK replay) would add twice
        base = node.args[0]
        if any(u is not node and u.target not in _METADATA_ONLY for u in base.users):
            continue  # another reader of the old value would see the new one
        if base in pytree.tree_leaves((node.args[1:], node.kwargs)):
            continue  # the write reads the tensor it writes (its values or indices)
        if not _same_layout(base.meta.get("val"), node.meta.get("val")):
            continue  # what reads the result reads it in the traced layout, not the base's (a slice)
        if base.op == "placeholder" and updates.get(node) is base:
            kind = "its input"
        elif _fresh(base):
            kind = "the new tensor"
        else:
            continue  # an input the program does not mutate, or a view of something else
        node.target = _IN_PLACE[node.target]
        log.debug("%s writes into %s %s in place", node.name, kind, base.name)
    program.graph_module.recompile()


@contextlib.contextmanager
def as_functional(program: ExportedProgram):
    """Within the block, the writes `write_in_place` made in place are functional again: the
    program as decomposition left it (what torch.export's serializer stores)."""
    functional = {v: k for k, v in _IN_PLACE.items()}
    changed = [n for n in program.graph.nodes if n.op == "call_function" and n.target in functional]
    for node in changed:
        node.target = functional[node.target]
    try:
        yield program
    finally:
        for node in changed:
            node.target = _IN_PLACE[node.target]


def _same_layout(a: Any, b: Any) -> bool:
    """Whether two traced tensors have the same sizes, strides and offset for every size (the
    shape environment's ranges too: `32 * Max(1, s0)` is `32 * s0` where s0 >= 2)."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.dim() != b.dim():
        return False
    sides = [(*t.shape, *t.stride(), t.storage_offset()) for t in (a, b)]
    return all(statically_known_true(x == y) for x, y in zip(*sides))


SHARED = "an expanded or overlapping view (gjit writes only tensors whose elements are apart)"


def written_shared(
    program: ExportedProgram, sources: list[tuple[str, Any]], mutations: dict[int, tuple[str, Any]]
) -> str | None:
    """The name of an input the program writes (`mutations`' sources, as `sources` names each
    placeholder's) whose elements may share memory (`overlaps_itself`), or None."""
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    for source in mutations.values():
        node = placeholders[sources.index(source)]
        if overlaps_itself(node.meta.get("val")):
            return node.name
    return None


def overlaps_itself(value: Any) -> bool:
    """Whether two elements of a traced tensor may share memory (at its example's sizes): its dims
    of more than one element, by stride, each step past what the smaller ones span. Where its
    strides are symbols, that they stay apart is guarded (a later call whose strides overlap
    compiles anew, and is refused there)."""
    if not isinstance(value, torch.Tensor):
        return False
    dims = [(st, n) for n, st in zip(value.shape, value.stride()) if _hint(n) > 1]
    dims.sort(key=lambda d: _hint(d[0]))
    span: Any = 0
    for stride, size in dims:
        if _hint(stride) <= _hint(span):
            return True
        if isinstance(stride, torch.SymInt) or isinstance(span, torch.SymInt):
            bool(stride > span)  # a guard in the shape environment, unless it always holds
        span = span + stride * (size - 1)
    return False


def _hint(size: Any) -> int:
    return optimization_hint(size) if isinstance(size, torch.SymInt) else int(size)


def _fresh(node: torch.fx.Node) -> bool:
    """An op's result that aliases none of its arguments (a factory, an arithmetic op, a copy) and
    that gjit does not lower as a view (`lift_fresh_copy` reads its constant in place)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if target in (torch.ops.aten.lift_fresh_copy.default, torch.ops.aten.alias.default):
        return False
    return not any(r.alias_info is not None for r in target._schema.returns)


# the graph module's meta key of `written_back`'s result
WRITTEN_BACK = "gjit_written_back"


def written_back(
    program: ExportedProgram, sources: list[tuple[str, Any]], mutations: dict[int, tuple[str, Any]]
) -> dict[str, str]:
    """Each output node whose value a call writes back into an input (`mutations`: output index ->
    a buffer's or user input's source, as `sources` names each placeholder's) -> that placeholder."""
    nodes = list(program.graph.nodes)
    placeholders = dict(zip(sources, (n.name for n in nodes if n.op == "placeholder")))
    outputs = next(n for n in reversed(nodes) if n.op == "output").args[0]
    return {
        outputs[i].name: placeholders[source]
        for i, source in mutations.items()
        if isinstance(outputs[i], torch.fx.Node) and source in placeholders
    }


def as_mutated_inputs(outs: list[Any], mutated: list[tuple[torch.Tensor, torch.Tensor]]) -> list[Any]:
    """Each output that is a mutated input's new value as that input; one that is a view of it as
    the same view of the input. Identity first (a static cache's every layer is one), storages
    read once per call."""
    targets = {id(new): target for new, target in reversed(mutated)}  # the first pair wins
    storages: list[int] | None = None
    found = []
    for out in outs:
        target = targets.get(id(out))
        if target is None and isinstance(out, torch.Tensor):
            if storages is None:
                storages = [new.untyped_storage().data_ptr() for new, _ in mutated]
            target = _as_view_of_target(out, mutated, storages)
        found.append(out if target is None else target)
    return found


def _as_view_of_target(
    out: torch.Tensor, mutated: list[tuple[torch.Tensor, torch.Tensor]], storages: list[int]
) -> torch.Tensor | None:
    memory = out.untyped_storage().data_ptr()
    for (new, target), storage in zip(mutated, storages):
        if storage == memory and new.stride() == target.stride() and out.dtype == target.dtype:
            offset = target.storage_offset() + out.storage_offset() - new.storage_offset()
            return target.as_strided(out.shape, out.stride(), offset)
    return None
