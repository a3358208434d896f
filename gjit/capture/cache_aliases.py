"""Which returned caches are input caches, and the caller's cache objects updated after a call.

A decoding step returns the cache object it was given: export records, while it traces, which
output is which input cache (`CacheAliases.recording`); after a compiled call the input object takes
the returned state and is itself returned (`rebuild`), so the caller's object is updated in place
and `out.past_key_values is cache`, as in eager. The layer objects stay the caller's where they line
up (`adopt`): a static cache's layers keep their identities, their tensors rebound to the returned
ones (the same tensors, written in place).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree

from gjit import logs
from gjit.capture.kv_cache import (
    build_state,
    cache_paths,
    flatten_cache,
    is_state_object,
    lookup,
    unflatten_cache,
)

log = logs.logger("capture")


@dataclasses.dataclass
class CacheAliases:
    """Which returned caches are input caches: output key path -> input key path of (args, kwargs).

    Filled by the forward hook export's trace runs (`recording`); empty for a model without caches."""

    pairs: list[tuple[tuple, tuple]] = dataclasses.field(default_factory=list)
    # input caches the trace changed but did not return (their new state would be lost)
    unreturned: list[str] = dataclasses.field(default_factory=list)
    # id(output spec) -> (that spec, how `rebuild` builds its output, or None where it cannot)
    _plans: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def recording(self, module: torch.nn.Module):
        """Hooks on the module export traces: note the returned objects that are input caches, and
        the input caches whose state changed without being returned. Returns the hooks' handle."""
        before: dict[int, tuple] = {}

        def pre_hook(mod, args, kwargs):
            before.clear()
            for key, (path,) in cache_paths((args, kwargs)).items():
                cache = lookup((args, kwargs), path)
                leaves, context = flatten_cache(cache)
                before[key] = (path, [id(t) for t in leaves], context, type(cache).__name__)

        def hook(mod, args, kwargs, output):
            returned = cache_paths(output, every=True)
            self.pairs = [
                (path, before[key][0]) for key, paths in returned.items() if key in before for path in paths
            ]
            self.unreturned = []
            for key, (path, ids, context, name) in before.items():
                if key in returned:
                    continue
                leaves, now = flatten_cache(lookup((args, kwargs), path))
                if now != context or [id(t) for t in leaves] != ids:
                    self.unreturned.append(f"the {name} passed as {_call_name(path)}")

        handles = [
            module.register_forward_pre_hook(pre_hook, with_kwargs=True),
            module.register_forward_hook(hook, with_kwargs=True),
        ]
        return _Handles(handles)

    def restore(self, args: tuple, kwargs: dict, output: Any) -> Any:
        """Give each input cache the state of the returned one, and return the input cache in its place."""
        for out_path, in_path in self.pairs:
            mine, theirs = lookup((args, kwargs), in_path), lookup(output, out_path)
            adopt(mine, theirs)
            output = _replace(output, out_path, mine)
        return output

    def rebuild(self, args: tuple, kwargs: dict, leaves: list, spec: pytree.TreeSpec) -> Any:
        """`restore(args, kwargs, tree_unflatten(leaves, spec))` without building the returned caches:
        each input cache takes its returned state from the leaves and the context directly
        (`adopt_state`), and the rest of the output is built around it. About half the host time
        of the two for a 12-layer cache."""
        plan = self._plans.get(id(spec))
        if plan is None or plan[0] is not spec:
            try:
                made = _plan(self.pairs, spec)
            except Exception as e:  # noqa: BLE001 - an output type that will not take a skeleton
                log.debug("gjit: returned caches rebuilt after the output (%s: %s)", type(e).__name__, e)
                made = None
            plan = self._plans[id(spec)] = (spec, made)
        rebuilt = plan[1]
        if rebuilt is None:  # an output this does not cover: built, then restored
            return self.restore(args, kwargs, pytree.tree_unflatten(leaves, spec))
        outer = []
        for slot in rebuilt.slots:
            if type(slot) is int:
                outer.append(leaves[slot])
                continue
            mine = lookup((args, kwargs), slot.in_path)
            returned = iter(leaves[slot.first : slot.first + slot.count])
            cls, state = slot.context
            if type(mine) is cls:
                adopt_state(mine, state, returned)
            else:
                adopt(mine, unflatten_cache(returned, slot.context))
            outer.append(mine)
        return pytree.tree_unflatten(outer, rebuilt.spec)


def _call_name(path: tuple) -> str:
    """A key path into (args, kwargs) in the call's words: `past_key_values`, `argument 1`."""
    head, rest = path[0], path[1:]
    if (
        isinstance(head, pytree.SequenceKey)
        and head.idx == 1
        and rest
        and isinstance(rest[0], pytree.MappingKey)
    ):
        return f"{rest[0].key}{pytree.keystr(rest[1:])}"
    if isinstance(head, pytree.SequenceKey) and head.idx == 0 and rest:
        return f"argument {pytree.keystr(rest[:1]).strip('[]')}{pytree.keystr(rest[1:])}"
    return pytree.keystr(path)


class _Handles:
    def __init__(self, handles: list):
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def adopt(target: Any, source: Any) -> None:
    """Give `target` the state of `source` (same class), keeping nested objects' identities where
    they line up (a cache's layer objects stay the caller's layer objects)."""
    state = vars(target)
    for name, value in vars(source).items():
        old = state.get(name)
        if _same_shape_object(old, value):
            adopt(old, value)
        elif type(old) is list and type(value) is list and len(old) == len(value):  # a subclass: replaced
            for i, (o, v) in enumerate(zip(old, value)):
                if _same_shape_object(o, v):
                    adopt(o, v)
                else:
                    old[i] = v
        else:
            state[name] = value
    for name in [n for n in state if n not in vars(source)]:
        del state[name]


def _same_shape_object(old: Any, new: Any) -> bool:
    """Whether `old` takes `new`'s state in place: two objects of one class whose state the flatten
    looks into (a cache layer). A constant of the context (an enum member, a function) or a mapping
    is a value, replaced whole: adopting it would rewrite a process-wide object."""
    return old is not None and type(old) is type(new) and is_state_object(old)


def _replace(tree: Any, path: tuple, value: Any) -> Any:
    """`tree` with the node at `path` replaced: in place in a fresh dict, ModelOutput or list; a tuple
    (or another node) is rebuilt through its pytree registration."""
    if not path:
        return value
    key, rest = path[0], path[1:]
    if isinstance(key, pytree.MappingKey) and isinstance(tree, dict):
        tree[key.key] = _replace(tree[key.key], rest, value)  # ModelOutput.__setitem__ sets the field too
        return tree
    if isinstance(key, pytree.SequenceKey) and isinstance(tree, list):
        tree[key.idx] = _replace(tree[key.idx], rest, value)
        return tree
    node = pytree.SUPPORTED_NODES[type(tree)]
    children_with_keys, context = node.flatten_with_keys_fn(tree)
    children = [_replace(c, rest, value) if k == key else c for k, c in children_with_keys]
    return node.unflatten_fn(children, context)


@dataclasses.dataclass(frozen=True)
class _Cache:
    """A returned input cache in an output: where the caller passed it, its returned context, and
    the range of its leaves among the output's."""

    in_path: tuple
    context: Any
    first: int
    count: int


@dataclasses.dataclass(frozen=True)
class _Rebuilt:
    """An output with each returned input cache one leaf: its spec, and per leaf the index of an
    output leaf or the cache that goes there."""

    spec: pytree.TreeSpec
    slots: list[int | _Cache]


def _plan(pairs: list[tuple[tuple, tuple]], spec: pytree.TreeSpec) -> _Rebuilt | None:
    """How `CacheAliases.rebuild` builds an output of `spec`, from a skeleton of it whose leaves are
    their own indices; None where a returned cache is not one of gjit's cache nodes with its leaves
    in one run, or two overlap."""
    skeleton = pytree.tree_unflatten(list(range(spec.num_leaves)), spec)
    taken: set[int] = set()
    for out_path, in_path in pairs:
        node = lookup(skeleton, out_path)
        indices, node_spec = pytree.tree_flatten(node)
        registered = pytree.SUPPORTED_NODES.get(type(node))
        if registered is None or registered.unflatten_fn is not unflatten_cache or not indices:
            return None
        if indices != list(range(indices[0], indices[0] + len(indices))) or taken & set(indices):
            return None
        taken |= set(indices)
        cache = _Cache(in_path, node_spec.context, indices[0], len(indices))
        skeleton = _replace(skeleton, out_path, cache)
    slots, outer = pytree.tree_flatten(skeleton)
    return _Rebuilt(outer, slots)


def adopt_state(target: Any, state: Any, leaves: Iterator) -> None:
    """`adopt(target, source)` for a source whose `vars` are `state` (a cache context's, over
    `leaves`), without building the source: each value takes the caller's object in place where
    `adopt` would, the new value where it would not."""
    mine = vars(target)
    items = state[1]
    for name, context in items:
        old = mine.get(name)
        if context[0] is list and type(old) is list and len(old) == len(context[1]):
            for i, item in enumerate(context[1]):
                old[i] = _taken(old[i], item, leaves)
        else:
            mine[name] = _taken(old, context, leaves)
    if len(mine) != len(items):  # every returned name is set: the others are gone from the source
        names = {name for name, _ in items}
        for name in [n for n in mine if n not in names]:
            del mine[name]


def _taken(old: Any, context: Any, leaves: Iterator) -> Any:
    """What `old` becomes given its new value's `context`: itself, adopted, or the new value."""
    tag = context[0]
    if tag == "leaf":
        value = next(leaves)
        if type(value) is torch.Tensor or type(value) is int:  # (most leaves) nothing adopts them
            return value
    elif tag == "object" and _same_class_object(old, context[1]):
        adopt_state(old, context[2], leaves)
        return old
    else:
        value = build_state(context, leaves)
    if _same_shape_object(old, value):
        adopt(old, value)
        return old
    return value


def _same_class_object(old: Any, cls: type) -> bool:
    """`_same_shape_object(old, new)` for a new object of class `cls`."""
    return type(old) is cls and is_state_object(old)
