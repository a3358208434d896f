"""KV caches as inputs and outputs: transformers' cache objects, flattened for export, rebuilt after a call.

A decoding step takes a cache object (`DynamicCache`, `StaticCache`, `EncoderDecoderCache`, ...) and
returns it updated: the model mutates the object it was given (a `DynamicLayer` rebinds its keys to a
longer tensor, a `StaticLayer` writes into its buffers) and returns that same object. gjit compiles
such a step as a function of tensors:

- every cache class is a pytree node (`register`): tensors and ints of its state (and its layers')
  are leaves, everything else (layer classes, `is_initialized`, dtypes) is the tree's context, so an
  empty cache (prefill) and a filled one (decode) are different trees, hence different entries, as
  they are different programs;
- export records, while it traces, which returned cache is which input cache, and after a compiled
  call the input object takes the returned state and is itself returned (cache_aliases.py).
"""

from __future__ import annotations

import collections
import enum
import importlib
import json
import sys
import threading
import types
from typing import Any

import torch
import torch.utils._pytree as pytree

from gjit import logs

try:  # how export marks an int input dynamic (gjit.capture wraps the ints it exports as symbols)
    from torch.export.dynamic_shapes import _IntWrapper
except ImportError:

    class _IntWrapper:  # torch before 2.7: ints are not exported as symbols, nothing is wrapped
        pass


log = logs.logger("capture")

_REGISTERED: set[type] = set()
_REGISTERING = threading.Lock()  # torch refuses a class registered twice: two threads must not both try


def _cache_base() -> type | None:
    """transformers' `Cache`, when transformers is already imported (gjit never imports it itself)."""
    module = sys.modules.get("transformers.cache_utils")
    if module is None and "transformers" in sys.modules:
        try:
            import transformers.cache_utils as module
        except ImportError:
            return None
    return getattr(module, "Cache", None)


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


def is_cache(value: Any) -> bool:
    """A transformers `Cache`, or another cache class gjit registered."""
    if type(value) in _REGISTERED:
        return True
    base = _cache_base()
    return base is not None and isinstance(value, base)


def register(values: Any = (), model: Any = None) -> bool:
    """Make every transformers cache class (and any other cache class among `values`) a pytree node,
    once gjit compiles a call that carries a cache or a transformers model (which may build one
    and return it); nothing is registered for anything else.

    Idempotent and cheap when nothing is new; returns whether a class was registered now, so a caller
    that flattened a call before knows to flatten it again. A class already registered elsewhere
    (by the user, or by transformers' export helpers) keeps that registration."""
    base = _cache_base()
    if base is None:
        return False
    owner = getattr(model, "__self__", model)
    carried = [v for v in values if type(v).__name__.endswith("Cache")]
    if not carried and not type(owner).__module__.startswith("transformers."):
        return False
    return _register_classes(base, carried)


def register_all() -> bool:
    """Every transformers cache class (a loaded package whose calls carry caches)."""
    base = _cache_base()
    return base is not None and _register_classes(base, [])


def _register_classes(base: type, carried: list[Any]) -> bool:
    classes = [base, *_subclasses(base)]
    for value in carried:
        cls = type(value)
        if cls.__module__.startswith("transformers."):
            classes.append(cls)  # a model's own cache class that is not a `Cache` subclass
    if all(c in _REGISTERED or c in pytree.SUPPORTED_NODES for c in classes):
        return False
    with _REGISTERING:
        return _register_new(classes)


def _register_new(classes: list[type]) -> bool:
    new = [c for c in dict.fromkeys(classes) if c not in _REGISTERED and c not in pytree.SUPPORTED_NODES]
    for cls in new:
        pytree.register_pytree_node(
            cls,
            flatten_cache,
            unflatten_cache,
            serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
            flatten_with_keys_fn=_flatten_with_keys,
            to_dumpable_context=_dump_context,
            from_dumpable_context=_load_context,
        )
        _REGISTERED.add(cls)
    if new:
        log.debug("registered cache classes as pytree nodes: %s", ", ".join(c.__name__ for c in new))
    return bool(new)


# The flatten. transformers' own (exporters.exporter_dynamo.register_pytree_node) keeps Python ints in
# the context, so a sliding-window layer, whose `cumulative_length` int grows every step, would be a
# new tree (a new entry) every step. Here tensors and ints are leaves: an int the program needs is
# specialized by export and guarded like any int input, one it does not need stays free.


def flatten_cache(obj: Any) -> tuple[list, Any]:
    leaves: list = []
    return leaves, (type(obj), _values(vars(obj), leaves))


def _flatten_with_keys(obj: Any) -> tuple[list, Any]:
    leaves: list = []
    names: list = []
    context = (type(obj), _state(vars(obj), leaves, names, ""))
    return [(pytree.MappingKey(name), leaf) for name, leaf in zip(names, leaves)], context


def unflatten_cache(values, context: Any) -> Any:
    cls, state = context
    obj = cls.__new__(cls)
    obj.__dict__.update(build_state(state, iter(values)))
    return obj


_LEAF = ("leaf",)
_LEAF_TYPES = (torch.Tensor, torch.SymInt, _IntWrapper)


def _state(value: Any, leaves: list, names: list | None = None, name: str = "") -> Any:
    """The context of one value of a cache's state; tensors and ints go to `leaves` (and, when
    `names` is given, their paths to `names`). Runs on every call: kept to plain type checks."""
    kind = type(value)
    if kind is int or isinstance(value, _LEAF_TYPES):
        leaves.append(value)
        if names is not None:
            names.append(name)
        return _LEAF
    if kind is list or kind is tuple:
        if names is None:
            return (kind, tuple([_state(v, leaves) for v in value]))
        return (kind, tuple([_state(v, leaves, names, f"{name}[{i}]") for i, v in enumerate(value)]))
    if kind is dict or kind is collections.OrderedDict:
        if names is None:
            return (kind, tuple([(k, _state(v, leaves)) for k, v in value.items()]))
        sep = "." if name else ""
        return (kind, tuple([(k, _state(v, leaves, names, f"{name}{sep}{k}")) for k, v in value.items()]))
    if isinstance(value, (list, tuple, dict)):  # a subclass (a namedtuple): rebuilt as its class
        return _container(value, leaves, names, name)
    if _plain_object(value):
        state = _values(vars(value), leaves) if names is None else _state(vars(value), leaves, names, name)
        return ("object", kind, state)
    return ("const", value)


def _container(value: Any, leaves: list, names: list | None, name: str) -> Any:
    """The context of a list, tuple or dict subclass (a namedtuple, a dict of named fields): its
    items as the base's, then its own attributes, if it has any (None where it has no `__dict__`).
    One whose class keeps more than items (a defaultdict's factory) or builds itself another way (a
    torch.Size) stays a constant of the context, the object itself: its rebuild from items would not
    be the same value, and the flatten runs in every call, where raising would fail the call."""
    kind = type(value)
    if isinstance(value, collections.defaultdict) or (isinstance(value, tuple) and not _rebuilds_tuple(kind)):
        return ("const", value)
    tag = "mapping" if isinstance(value, dict) else "sequence"
    base = dict(value) if tag == "mapping" else list(value)
    items = _state(base, leaves, names, name)[1]
    attrs = getattr(value, "__dict__", None)
    own = None if attrs is None else _state(dict(attrs), leaves, names, name)
    return (tag, kind, items, own)


def _rebuilds_tuple(kind: type) -> bool:
    """A tuple subclass built back from its items: a namedtuple (`_make`), or one that keeps
    tuple's own constructor."""
    return hasattr(kind, "_make") or kind.__new__ is tuple.__new__


# types whose values are constants of a context (what `_state` finds for them, sooner)
_CONSTANT_TYPES = (bool, float, str, type(None), torch.dtype, torch.device)


def _values(value: Any, leaves: list) -> Any:
    """`_state(value, leaves)`, on every call's path: a dict's (an object's vars) values that are
    plain tensors, ints or constants handled in its loop, without a call each."""
    kind = type(value)
    if kind is not dict:
        return _state(value, leaves)
    items = []
    for key, item in value.items():
        kind = type(item)
        if kind is torch.Tensor or kind is int:
            leaves.append(item)
            items.append((key, _LEAF))
        elif kind in _CONSTANT_TYPES:
            items.append((key, ("const", item)))
        elif kind is list:
            items.append((key, (list, tuple([_values(v, leaves) for v in item]))))
        else:
            items.append((key, _state(item, leaves)))
    return (dict, tuple(items))


def _plain_object(value: Any) -> bool:
    """A state-holding object (a cache layer) rebuilt by `cls.__new__` and its `__dict__`; a
    function, class, enum member or module stays a constant of the context."""
    return (
        hasattr(value, "__dict__")
        and not callable(value)
        and not isinstance(value, (type, enum.Enum, torch.nn.Module))
    )


def is_state_object(value: Any) -> bool:
    """Whether the flatten looks into `value`'s state (an "object" of the context: a cache layer, a
    nested cache), rather than keeping it as a leaf, a sequence, a mapping or a constant."""
    kind = type(value)
    return (
        kind not in (int, list, tuple, dict, collections.OrderedDict)
        and not isinstance(value, (*_LEAF_TYPES, list, tuple, dict))  # a subclass: its items are state
        and _plain_object(value)
    )


def build_state(context: Any, leaves) -> Any:
    tag = context[0]
    if tag == "leaf":
        return next(leaves)
    if tag == "const":
        return context[1]
    if tag == "object":
        obj = context[1].__new__(context[1])
        obj.__dict__.update(build_state(context[2], leaves))
        return obj
    if tag == "sequence" or tag == "mapping":
        return _build_container(context, leaves)
    if tag is dict or tag is collections.OrderedDict:
        return tag((k, build_state(v, leaves)) for k, v in context[1])
    return tag(build_state(v, leaves) for v in context[1])


def _build_container(context: Any, leaves) -> Any:
    """A list, tuple or dict subclass from its `_container` context."""
    tag, kind, items, own = context
    if tag == "mapping":
        obj = kind.__new__(kind)
        base = collections.OrderedDict if isinstance(obj, collections.OrderedDict) else dict
        base.update(obj, ((k, build_state(v, leaves)) for k, v in items))
    elif issubclass(kind, tuple):
        values = [build_state(v, leaves) for v in items]
        obj = kind._make(values) if hasattr(kind, "_make") else tuple.__new__(kind, values)
    else:
        obj = kind.__new__(kind)
        list.extend(obj, (build_state(v, leaves) for v in items))
    if own is not None:
        obj.__dict__.update(build_state(own, leaves))
    return obj


# A context as JSON (torch.export.save of a program that takes a cache): classes by import path,
# dtypes and devices by name, plain constants as they are.


def _dump_context(context: Any) -> str:
    cls, state = context
    return json.dumps({"cls": _path(cls), "state": _dump(state)})


def _load_context(text: str) -> Any:
    data = json.loads(text)
    return (_import(data["cls"]), _load(data["state"]))


def _dump(context: Any) -> Any:
    tag = context[0]
    if tag == "leaf":
        return ["leaf"]
    if tag == "object":
        return ["object", _path(context[1]), _dump(context[2])]
    if tag == "sequence" or tag == "mapping":
        _, kind, items, own = context
        dumped = [[k, _dump(v)] for k, v in items] if tag == "mapping" else [_dump(v) for v in items]
        return [tag, _path(kind), dumped, None if own is None else _dump(own)]
    if tag == "const":
        value = context[1]
        if isinstance(value, torch.dtype):
            return ["dtype", str(value).removeprefix("torch.")]
        if isinstance(value, torch.device):
            return ["device", str(value)]
        if isinstance(value, type):
            return ["class", _path(value)]
        # a member by its class and name, a function by its import path: where one can import
        # them again (not a local class or function, not a lambda)
        if isinstance(value, enum.Enum) and "<" not in type(value).__qualname__:
            return ["enum", _path(type(value)), value.name]
        if isinstance(value, types.FunctionType) and "<" not in value.__qualname__:
            return ["function", _path(value)]
        if value is None or isinstance(value, (bool, int, float, str)):
            return ["const", value]
        raise TypeError(f"cannot write a {type(value).__name__} of a cache's state as JSON")
    if tag is dict or tag is collections.OrderedDict:
        return [tag.__name__, [[k, _dump(v)] for k, v in context[1]]]
    return [tag.__name__, [_dump(v) for v in context[1]]]


def _load(data: Any) -> Any:
    tag = data[0]
    if tag == "leaf":
        return _LEAF
    if tag == "object":
        return ("object", _import(data[1]), _load(data[2]))
    if tag == "sequence" or tag == "mapping":
        _, path, items, own = data
        loaded = (
            tuple((k, _load(v)) for k, v in items) if tag == "mapping" else tuple(_load(v) for v in items)
        )
        return (tag, _import(path), loaded, None if own is None else _load(own))
    if tag == "dtype":
        return ("const", getattr(torch, data[1]))
    if tag == "device":
        return ("const", torch.device(data[1]))
    if tag == "class" or tag == "function":
        return ("const", _import(data[1]))
    if tag == "enum":
        return ("const", getattr(_import(data[1]), data[2]))
    if tag == "const":
        return ("const", data[1])
    kind = {"dict": dict, "OrderedDict": collections.OrderedDict, "list": list, "tuple": tuple}[tag]
    if kind in (dict, collections.OrderedDict):
        return (kind, tuple((k, _load(v)) for k, v in data[1]))
    return (kind, tuple(_load(v) for v in data[1]))


def _path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _import(path: str) -> type:
    module, _, qualname = path.partition(":")
    value: Any = importlib.import_module(module)
    for part in qualname.split("."):
        value = getattr(value, part)
    return value


def capture_hint(values: list) -> str | None:
    """The cache class a failed capture is about, and the fix, when the call carried a cache."""
    unknown = [
        type(v)
        for v in values
        if type(v).__name__.endswith("Cache") and type(v) not in pytree.SUPPORTED_NODES
    ]
    if unknown:
        name = unknown[0].__qualname__
        return (
            f"the call passes a {name}, a cache class torch.export cannot flatten: gjit flattens "
            "transformers' cache classes (DynamicCache, StaticCache, EncoderDecoderCache, ...) itself; "
            f"register {name} with torch.utils._pytree.register_pytree_node (its tensors as leaves), "
            "or pass a DynamicCache"
        )
    foreign = [type(v) for v in values if is_cache(v) and type(v) not in _REGISTERED]
    if foreign:
        name = foreign[0].__qualname__
        return (
            f"{name} was registered as a pytree node before gjit could (by transformers' export "
            "helpers such as register_dynamic_cache_export_support, or by your code), and export failed "
            "with that flatten; gjit's own flatten of transformers' caches is used when nothing registers "
            "the class first"
        )
    return None


def cache_paths(tree: Any, every: bool = False) -> dict[int, list[tuple]]:
    """id of every cache object in a pytree -> its key path (`every`: all its paths, where one
    object appears more than once); caches are not looked into."""
    found: dict[int, list[tuple]] = {}
    if _cache_base() is None:
        return found

    def visit(path: tuple, value: Any) -> None:
        if is_cache(value):
            paths = found.setdefault(id(value), [])
            if every or not paths:
                paths.append(path)
            return
        node = pytree.SUPPORTED_NODES.get(type(value))
        if node is None or node.flatten_with_keys_fn is None:
            return
        children, _ = node.flatten_with_keys_fn(value)
        for key, child in children:
            visit((*path, key), child)

    visit((), tree)
    return found


def dynamic_leaves(args: tuple, kwargs: dict) -> dict[int, dict[int, tuple[int, None]]]:
    """The dims gjit keeps dynamic inside caches, as flat index -> {dim: (min, max)}: every KV tensor's
    length (transformers' cache layers hold [batch, heads, length, head_dim]) from a length of 1 up,
    so the first decode step of an encoder-decoder model, or after a one-token prompt, shares the
    decode entry; and every int of 2 or more (a sliding window's running length) as a symbol ({})."""
    caches = [paths[0] for paths in cache_paths((args, kwargs)).values()]
    out: dict[int, dict] = {}
    if not caches:
        return out
    for i, (path, leaf) in enumerate(pytree.tree_flatten_with_path((args, kwargs))[0]):
        if not any(path[: len(c)] == c for c in caches):
            continue
        if isinstance(leaf, torch.Tensor) and leaf.dim() == 4:
            out[i] = {2: (1, None)}
        elif type(leaf) is int and leaf >= 2:
            out[i] = {}
    return out


def lookup(tree: Any, path: tuple) -> Any:
    for key in path:
        if isinstance(key, pytree.SequenceKey):
            tree = tree[key.idx]
        elif isinstance(key, pytree.MappingKey):
            tree = tree[key.key]
        elif isinstance(key, pytree.GetAttrKey):
            tree = getattr(tree, key.name)
        else:  # a node's own key kind: look it up through its flatten
            children, _ = pytree.SUPPORTED_NODES[type(tree)].flatten_with_keys_fn(tree)
            tree = dict(children)[key]
    return tree


def describe_change(old: Any, new: Any) -> str | None:
    """What differs between two of gjit's cache contexts, e.g. `layers[0].keys: None -> a tensor`
    (an empty cache, then a filled one); None for contexts that are not gjit's."""
    if not (isinstance(old, tuple) and isinstance(new, tuple) and len(old) == len(new) == 2):
        return None
    if old[0] is not new[0]:
        return f"{old[0].__name__} -> {new[0].__name__}"
    return _diff(old[1], new[1], "")


def _diff(a: Any, b: Any, name: str) -> str | None:
    if a == b:
        return None
    where = name or "state"
    if a[0] != b[0] or a[0] in ("leaf", "const"):
        return f"{where}: {_show(a)} -> {_show(b)}"
    if a[0] == "object":
        if a[1] is not b[1]:
            return f"{where}: {a[1].__name__} -> {b[1].__name__}"
        return _diff(a[2], b[2], name)
    if a[0] is dict or a[0] is collections.OrderedDict:
        old, new = dict(a[1]), dict(b[1])
        for key in [k for k in old if k in new]:
            found = _diff(old[key], new[key], f"{name}.{key}" if name else str(key))
            if found:
                return found
        return f"{where}: fields {list(old)} -> {list(new)}"
    if len(a[1]) != len(b[1]):
        return f"{where}: {len(a[1])} -> {len(b[1])} entries"
    for i, (x, y) in enumerate(zip(a[1], b[1])):
        found = _diff(x, y, f"{name}[{i}]")
        if found:
            return found
    return f"{where} changed"


def _show(context: Any) -> str:
    if context[0] == "leaf":
        return "a tensor or int"
    if context[0] == "const":
        return repr(context[1])[:60]
    if context[0] == "object":
        return f"a {context[1].__name__}"
    return f"a {getattr(context[0], '__name__', context[0])}"
