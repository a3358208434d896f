"""Guards on what a program reads of its module besides the call's inputs: the parameters and
buffers it reads live (one that was replaced must still fit the kernels), and the buffers and
constants whose contents a mask's proof read (gjit/lowering/held_masks.py), which must still hold
them. Each adds one check to the hot function (guards/builder.py's `_Builder`) and finer ones that
explain a miss."""

from __future__ import annotations

import functools
import itertools
import operator
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gjit.capture.export import CapturedProgram, state_reader
from gjit.lowering.held_masks import Band, band_of, bands_from_record


def state_guards(b: Any, state: Sequence[tuple[Any, str, torch.Tensor, str]]) -> None:
    """Parameters and buffers are read live: one that was replaced must still fit the kernels.
    The hot path is one check of every identity and data pointer at once (C-level maps over the
    owners' dicts: a 12-layer model has some 150); a new tensor, or new memory under the same one
    (`param.data = ...` keeps the object and may change the strides), is checked once, then
    remembered. The slow path explains a miss parameter by parameter."""
    if not state:
        return
    ids = [id(getattr(owner, attr)) for owner, attr, _, _ in state]
    pointers = [getattr(owner, attr).data_ptr() for owner, attr, _, _ in state]
    b.namespace["state_ids"] = ids
    b.namespace["state_fits"] = functools.partial(_state_fits, ids, pointers, state)
    b.namespace["state_same"] = _same_state(ids, pointers, state)
    b.guard("state_same()", "the parameters and buffers fit", "None", None, "state", True)
    b.later[-1].where = "hot"
    for k, (owner, attr, _, fqn) in enumerate(state):
        b.namespace[f"owner{k}"] = owner
        b.namespace[f"read{k}"] = state_reader(owner, attr)
        code = f"id(read{k}(None)) == state_ids[{k}] or state_fits({k})"
        actual = f"(tuple(owner{k}.{attr}.shape), owner{k}.{attr}.stride(), owner{k}.{attr}.dtype)"
        b.guard(code, f"{fqn} keeps its shape, strides, dtype and device", actual, None, "state", True)
        b.later[-1].where = "explain"


def tied_guards(b: Any, module: torch.nn.Module | None, state: Sequence[tuple[Any, str, Any, str]]) -> None:
    """One tensor registered under several names (tied weights, a buffer two modules share): the
    program may read it through one of its inputs for all of them (export gives a shared buffer one
    placeholder in use), so each other name must still hold the first name's tensor; untied after
    the compile, the call would read the first for both. Found when the guards are built (the names
    in `state`, and the other names `module` registers it under); the hot path is one identity
    check each."""
    if not state:
        return
    first: dict[int, tuple[Any, str, str]] = {}
    ties = []
    for owner, attr, _, fqn in state:
        t = getattr(owner, attr)
        if id(t) in first:
            owner0, attr0, fqn0 = first[id(t)]
            ties.append((state_reader(owner, attr), state_reader(owner0, attr0), fqn, fqn0))
        else:
            first[id(t)] = (owner, attr, fqn)
    names = {fqn for *_, fqn in state}
    every = dict(remove_duplicate=False)
    tied = (
        ()
        if module is None
        else itertools.chain(module.named_parameters(**every), module.named_buffers(**every))
    )
    for name, t in tied:
        if name in names or id(t) not in first:
            continue
        owner0, attr0, fqn0 = first[id(t)]
        at, _, attr = name.rpartition(".")
        ties.append((state_reader(module.get_submodule(at), attr), state_reader(owner0, attr0), name, fqn0))
        names.add(name)
    if not ties:
        return
    pairs = [(tie, held) for tie, held, _, _ in ties]
    b.namespace["tied_same"] = lambda: all([tie(None) is held(None) for tie, held in pairs])
    b.guard("tied_same()", "tied parameters and buffers stay tied", "None", None, "state", True)
    b.later[-1].where = "hot"
    for k, (tie, held, name, fqn) in enumerate(ties):
        b.namespace[f"tie{k}"], b.namespace[f"tied_to{k}"] = tie, held
        code = f"tie{k}(None) is tied_to{k}(None)"
        b.guard(code, f"{name} is {fqn} (tied when compiled)", "'another tensor'", None, "state", True)
        b.later[-1].where = "explain"


def _same_state(
    ids: list[int], pointers: list[int], state: Sequence[tuple[Any, str, torch.Tensor, str]]
) -> Callable[[], bool]:
    """Whether every parameter and buffer is the tensor last admitted (its id) on the memory
    last admitted (its data pointer), or fits."""
    tables = [_table(owner, attr) for owner, attr, _, _ in state]
    attrs = [attr for _, attr, _, _ in state]
    getitem, data_ptr = operator.getitem, torch.Tensor.data_ptr

    def same() -> bool:
        try:
            held = list(map(getitem, tables, attrs))
            if list(map(id, held)) == ids and list(map(data_ptr, held)) == pointers:
                return True
        except (KeyError, TypeError, RuntimeError):  # not in its module's dict now; not a tensor
            pass
        return all([_state_fits(ids, pointers, state, k) for k in range(len(state))])

    return same


def held_guards(b: Any, held: Sequence[tuple[Callable[[], Any], Band, str]]) -> None:
    """A mask's proof read these tensors' contents (gjit/lowering/held_masks.py): each must still
    hold its band. The hot path compares each one with the last it admitted: the same tensor (a
    weak reference: an id may be reused), memory, strides and version counter (an in-place write
    bumps it), and reads the contents again only where one differs. Writes the version counter does
    not see (through `.data`, NumPy or DLPack) are not seen here either (GJIT_HELD_MASKS=0: no
    proof reads contents)."""
    if not held:
        return
    admitted: list[tuple | None] = [None] * len(held)

    def same() -> bool:
        for k, (read, band, _) in enumerate(held):
            t = read()
            try:
                stamp = (t.data_ptr(), t._version, t.stride(), t.storage_offset())
            except (AttributeError, RuntimeError, TypeError):  # not a tensor now; an inference tensor
                return False
            last = admitted[k]
            if last is None or last[0]() is not t or last[1:5] != stamp:
                if not band.holds(t):
                    return False
                admitted[k] = (weakref.ref(t), *stamp, t.untyped_storage())  # (kept: no reuse of its address)
        return True

    b.namespace["held_same"], b.namespace["held_now"] = same, _held_now
    b.guard("held_same()", "the masks held in buffers keep their contents", "None", None, "state", True)
    b.later[-1].where = "hot"
    for k, (read, band, name) in enumerate(held):
        b.namespace[f"held{k}"], b.namespace[f"band{k}"] = read, band
        code, actual = f"band{k}.holds(held{k}())", f"held_now(held{k}())"
        b.guard(code, f"{name} holds {band} (a mask's proof read it)", actual, None, "state", True)
        b.later[-1].where = "explain"


def _held_now(t: Any) -> str:
    """What a held tensor holds now, for a miss's explanation."""
    if not isinstance(t, torch.Tensor):
        return f"a {type(t).__name__}"
    try:
        t._version  # noqa: B018
    except RuntimeError:
        return "an inference tensor (no version counter: a write could not be seen)"
    return str(band_of(t) or f"another pattern ({t.dtype}, {list(t.shape)})")


def held_sources(captured: CapturedProgram, record: list) -> list[tuple[Callable[[], Any], Band, str]]:
    """(reader, band, name) of each buffer or constant in a compiled graph's `held` record: a live
    buffer read from its module's dict, as the call reads it."""
    out = []
    for (kind, name), band in bands_from_record(record).items():
        if kind == "buffer" and captured.module is not None:
            owner, _, attr = name.rpartition(".")
            read = functools.partial(state_reader(captured.module.get_submodule(owner), attr), None)
        else:
            read = functools.partial(captured.state_tensor, kind, name)
        out.append((read, band, name))
    return out


def _table(owner: torch.nn.Module, attr: str) -> dict:
    """The dict of `owner` that holds `attr` (its parameters' or buffers'); else an empty one,
    whose lookup fails over to the slow path."""
    for table in (owner._parameters, owner._buffers):
        if attr in table:
            return table
    return {}


def _state_fits(
    ids: list[int], pointers: list[int], state: Sequence[tuple[Any, str, torch.Tensor, str]], k: int
) -> bool:
    owner, attr, val, _ = state[k]
    t = getattr(owner, attr)
    ok = (
        isinstance(t, torch.Tensor)
        and t.dtype == val.dtype
        and t.device == val.device
        and tuple(t.shape) == tuple(int(s) for s in val.shape)
        and all(n == 1 or st == int(e) for n, st, e in zip(t.shape, t.stride(), val.stride()))
        and not (t.is_neg() or t.is_conj())
    )
    if ok:
        ids[k], pointers[k] = id(t), t.data_ptr()
    return ok
