"""The calling convention: a user's model and call as the module and arguments torch.export takes.

A function becomes a module with the function's signature; a call with **kwargs exports through
an explicit signature; inputs export has no pytree leaf for (a dtype, a device) travel as string
tokens the module maps back. `bind_call` normalizes a call to the model's signature; the flat
inputs' names, records and structure changes are what guards and miss messages say of a call.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram

from gjit.capture import kv_cache


def as_module(model: Any) -> torch.nn.Module:
    """A function becomes a module whose forward has the function's signature (export needs it)."""
    if isinstance(model, torch.nn.Module):
        return model
    owner = getattr(model, "__self__", None)
    if inspect.ismethod(model) and isinstance(owner, torch.nn.Module):
        # `m.forward = gjit.compile(m.forward)`: export the method on a module that owns `m`, so m's
        # parameters and buffers are the program's (read live), not constants copied into it; the
        # method itself is the forward (calling m would reach the compiled forward again)
        module = torch.nn.Module()
        module.add_module("model", owner)
        module.forward = model
        return module
    if not callable(model):
        raise TypeError(
            f"gjit.compile expects an nn.Module, a function, an ExportedProgram or a .pt2 path, "
            f"got {type(model).__name__}"
        )
    module = torch.nn.Module()
    try:
        inspect.signature(model)
    except (TypeError, ValueError):
        # a builtin such as torch.sin has no signature export can read: give it a plain one
        module.forward = lambda *args: model(*args)
        return module
    # The function itself is the forward (an instance attribute, so no wrapper frame hides the
    # user's source lines from export's stack traces).
    module.forward = model
    # export keeps only frames named `forward` in node stack traces; name this one too
    register_anchor = getattr(torch.fx.proxy, "_register_stack_trace_anchor", None)
    if register_anchor is not None:
        register_anchor(model)
    return module


def explicit_keywords(module: torch.nn.Module, args: tuple, kwargs: dict) -> torch.nn.Module:
    """A module whose forward names, as keyword-only parameters, the call's arguments that the model's
    forward takes through `**kwargs` (transformers' models take `return_dict`, `logits_to_keep`, ...
    that way); the module itself when there are none.

    torch.export cannot match dynamic shapes against a `**kwargs` bundle (torch 2.13 asserts "Must
    provide a tree_name"), so export sees the same call through a signature without one."""
    try:
        signature = inspect.signature(module.forward)
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return module
    var_kw = [p for p in signature.parameters.values() if p.kind == p.VAR_KEYWORD]
    extra = bound.arguments.get(var_kw[0].name, {}) if var_kw else {}
    if not extra:
        return module
    params = [p for p in signature.parameters.values() if p.kind != p.VAR_KEYWORD]
    params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY) for name in extra]
    wrapper = torch.nn.Module()
    if type(module) is torch.nn.Module:  # a plain module (as_module's): the same state, the new forward
        for table in ("_parameters", "_buffers", "_modules"):
            getattr(wrapper, table).update(getattr(module, table))
        target = module.forward
    else:  # the user's module, called as eager calls it (its forward hooks run)
        wrapper.add_module("model", module)
        target = module

    def call(*a, **kw):
        return target(*a, **kw)

    call.__signature__ = signature.replace(parameters=params)
    wrapper.forward = call
    return wrapper


# inputs export has no pytree leaf for: each is passed to export as a token string (export keeps a
# string input as a constant) that the module maps back; the entry's guards check the value itself
CONSTANT_TYPES = (torch.dtype, torch.memory_format, torch.layout, torch.device)


def constants_as_tokens(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
    """(module, args, kwargs) with every CONSTANT_TYPES input (softmax(x, dtype=torch.float16))
    replaced by a token the returned module turns back into it: the same call, exportable."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    table = {f"gjit.constant.{i}": v for i, v in enumerate(leaves) if isinstance(v, CONSTANT_TYPES)}
    if not table:
        return module, args, kwargs
    args, kwargs = pytree.tree_unflatten([f"gjit.constant.{i}" if f"gjit.constant.{i}" in table else v
                                          for i, v in enumerate(leaves)], spec)  # fmt: skip
    wrapper = torch.nn.Module()
    wrapper.add_module("model", module)

    def call(*a, **kw):
        a, kw = pytree.tree_map_only(str, lambda v: table.get(v, v), (a, kw))
        return module(*a, **kw)

    call.__signature__ = inspect.signature(module.forward)  # export binds the call as eager does
    wrapper.forward = call
    return wrapper, args, kwargs


def bind_call(
    signature: inspect.Signature | None, args: tuple, kwargs: dict, name: str = "forward"
) -> tuple[tuple, dict]:
    """Normalize a call to the model's signature; a bad call raises a TypeError, as Python would."""
    if signature is None:
        return args, kwargs
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{name}(): {e}") from None
    return bound.args, bound.kwargs


def forward_signature(model: Any) -> inspect.Signature | None:
    target: Callable | None = None
    if isinstance(model, torch.nn.Module):
        target = model.forward
    elif callable(model) and not isinstance(model, ExportedProgram):
        target = model
    if target is None:
        return None
    try:
        return inspect.signature(target)
    except (TypeError, ValueError):
        return None


def inputs_record(flat: list, user_vals: list) -> list:
    """What an entry's guards read of each flat input (gjit/api.py's Entry.inputs)."""
    first: dict[int, int] = {}
    out: list = []
    for i, (value, val) in enumerate(zip(flat, user_vals)):
        if isinstance(value, torch.Tensor):
            out.append(["tensor", first.setdefault(id(value), i)])
        elif isinstance(val, torch.SymInt):
            out.append(["symint", None])
        else:
            out.append(["value", value])
    return out


# the input leaves gjit guards: tensors, and values export takes as (or specializes to) constants
GUARDABLE = (torch.Tensor, int, float, bool, str, complex, type(None), torch.dtype, torch.device)


def input_names(args: tuple, kwargs: dict, signature) -> list[str]:
    """Each flat input of a call, named as guards and messages name it (`x`, `past_key_values[0]`)."""
    params = list(signature.parameters) if signature is not None else []
    names = []
    for path, _ in pytree.tree_flatten_with_path((args, kwargs))[0]:
        head, rest = path[0].idx, path[1:]
        if head == 0 and rest and hasattr(rest[0], "idx") and rest[0].idx < len(params):
            names.append(params[rest[0].idx] + pytree.keystr(rest[1:]))
        elif head == 1 and rest:
            key = rest[0].key if isinstance(rest[0], pytree.MappingKey) else pytree.keystr(rest[:1])
            names.append(f"{key}{pytree.keystr(rest[1:])}")
        else:
            names.append(("args" if head == 0 else "kwargs") + pytree.keystr(rest))
    return names


def structure_change(old: pytree.TreeSpec, new: pytree.TreeSpec, params: list[str], path: str = "") -> str:
    """Where two calls' pytree structures first differ, in the call's own names (the forward's
    parameter names, then keys and indices, a cache's `layers[0].keys`)."""
    if old.is_leaf() or new.is_leaf() or old.type is not new.type:
        return f"{path or 'the call'}: expected {spec_kind(old)}, got {spec_kind(new)}"
    if old.context != new.context:
        detail = kv_cache.describe_change(old.context, new.context)
        if detail is None:
            detail = f"{old.context!r:.80} -> {new.context!r:.80}"
        return f"{path or 'the call'} ({old.type.__name__}): {detail}"
    if old.num_children != new.num_children:
        return f"{path or 'the call'}: {old.num_children} -> {new.num_children} entries"
    children = (lambda s: s.children()) if hasattr(old, "children") else (lambda s: s.children_specs)
    for i, (a, b) in enumerate(zip(children(old), children(new))):
        if a == b:
            continue
        if not path and old.type is tuple and old.num_children == 2:  # the root: (args, kwargs)
            child = "args" if i == 0 else ""
        elif path == "args" and i < len(params):
            child = params[i]
        elif old.type is dict:
            child = f"{path}.{old.context[i]}" if path else str(old.context[i])
        else:
            child = f"{path}[{i}]"
        return structure_change(a, b, params, child)
    return f"{path or 'the call'} changed"


def spec_kind(spec: pytree.TreeSpec) -> str:
    return "a leaf (tensor or value)" if spec.is_leaf() else f"a {spec.type.__name__}"


def fast_arity(signature) -> tuple[int, int]:
    """(least, most) positional arguments of a call that needs no binding: bind() would return
    the same args and no kwargs. (1, 0): always bind."""
    if signature is None:
        return 1, 0
    params = list(signature.parameters.values())
    if len(params) == 1 and params[0].kind == params[0].VAR_POSITIONAL:
        return 0, 2**31
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    rest = params[len(positional) :]
    if any(p.kind != p.VAR_KEYWORD and (p.kind != p.KEYWORD_ONLY or p.default is p.empty) for p in rest):
        return 1, 0
    required = [p.default is p.empty for p in positional]
    least = required.index(False) if False in required else len(required)
    if any(required[least:]):  # a required parameter after an optional one
        return 1, 0
    return least, len(positional)
