"""The module tree torch.export traces: a copy of the user's, so that other threads may call the model
while gjit exports it.

Non-strict torch.export changes the module it traces while it traces: it swaps its parameters and
buffers for fake tensors (`torch.nn.utils.stateless._reparametrize_module`), puts proxies in place
of its submodules, and sends every call of one of its modules, from any thread, through its
tracer. Another thread calling the model then (a cached call reading its weights, an eager run,
`generate()` calling the model) would read fakes or corrupt the trace. gjit exports a copy instead:
each module of the tree (through its registered submodules) is a new object of the same class with
its own tables of parameters, buffers, submodules and hooks, sharing the tensors and everything
else. The names are the same, so the program reads its weights from the user's tree by name.

A module reached other than through registered submodules (a plain list of modules, a method
bound to a submodule) is redirected to its copy where it is a direct attribute, in a list, tuple
or dict, a bound method or a functools.partial; one hidden deeper would be traced as the user's,
with its real weights, which export lifts as constants. `shares_state` finds that in the exported
program, and the capture exports the user's tree itself then, as without the copy.
"""

from __future__ import annotations

import copy
import functools
import types
from typing import Any

import torch
from torch.export import ExportedProgram

# what nn.Module.__init__ keeps per module in containers: each copy gets its own
_TABLES = tuple(k for k, v in vars(torch.nn.Module()).items() if isinstance(v, (dict, set)))


def private_tree(model: Any) -> Any:
    """`model` with its module tree copied: an nn.Module, or a method bound to one (the method
    bound to the copy); anything else, or a tree that cannot be copied, as it is."""
    owner = getattr(model, "__self__", None)
    try:
        if isinstance(model, torch.nn.Module):
            return _copy_tree(model)
        if isinstance(model, types.MethodType) and isinstance(owner, torch.nn.Module):
            return types.MethodType(model.__func__, _copy_tree(owner))
    except Exception:  # noqa: BLE001 - an odd module (a ScriptModule): exported as it is
        return model
    return model


def _copy_tree(root: torch.nn.Module) -> torch.nn.Module:
    copies: dict[int, torch.nn.Module] = {}  # id of a module of the user's tree (all alive) -> its copy

    def copy_module(module: torch.nn.Module) -> torch.nn.Module:
        if id(module) in copies:  # a module registered twice (shared) stays one module
            return copies[id(module)]
        new = object.__new__(type(module))
        copies[id(module)] = new
        state = dict(module.__dict__)
        for name in _TABLES:
            if name in state:
                state[name] = copy.copy(state[name])
        state["_modules"] = {k: None if m is None else copy_module(m) for k, m in module._modules.items()}
        new.__dict__.update(state)
        return new

    new_root = copy_module(root)
    for new in copies.values():
        state = new.__dict__
        for name, value in list(state.items()):
            if name not in _TABLES:
                state[name] = _redirected(value, copies)
    return new_root


def _redirected(value: Any, copies: dict[int, torch.nn.Module]) -> Any:
    """`value` with the tree's modules in it replaced by their copies (one level deep)."""

    def swap(v: Any) -> Any:
        if isinstance(v, torch.nn.Module):
            return copies.get(id(v), v)
        if isinstance(v, types.MethodType) and isinstance(v.__self__, torch.nn.Module):
            owner = copies.get(id(v.__self__))
            return v if owner is None else types.MethodType(v.__func__, owner)
        return v

    if isinstance(value, functools.partial):
        func, args = swap(value.func), [swap(a) for a in value.args]
        keywords = {k: swap(v) for k, v in value.keywords.items()}
        if _same([func, *args, *keywords.values()], [value.func, *value.args, *value.keywords.values()]):
            return value
        return functools.update_wrapper(functools.partial(func, *args, **keywords), value)
    if type(value) in (list, tuple):
        items = [swap(v) for v in value]
        return value if _same(items, value) else type(value)(items)
    if type(value) is dict:
        items = {k: swap(v) for k, v in value.items()}
        return value if _same(items.values(), value.values()) else items
    return swap(value)


def _same(a: Any, b: Any) -> bool:
    return all(x is y for x, y in zip(a, b))


def shares_state(program: ExportedProgram, module: torch.nn.Module) -> bool:
    """Whether a constant of `program` is the memory of one of `module`'s parameters or buffers:
    the copy's trace reached the user's module and lifted its weights (see the module docstring)."""
    if not program.constants:
        return False
    storages = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}
    storages.discard(0)  # empty tensors
    return any(
        isinstance(c, torch.Tensor) and c.untyped_storage().data_ptr() in storages
        for c in program.constants.values()
    )
