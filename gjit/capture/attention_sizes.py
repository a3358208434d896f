"""The sizes ATen's scaled_dot_product_attention needs equal, made one symbol.

SDPA reads keys and values of one length S (and one head dim E for queries and keys), under a
mask that broadcasts to the scores [..., L, S]. Eager raises for most other calls (a mask of
another length, another head dim); keys and values of different lengths are outside its contract
(the CPU's kernel returns values read over the keys' length). Its meta function checks none of
it, so torch.export gives each input its own symbols: with transformers' dynamic cache, every
layer's values a length of their own, apart from the keys' (GPT-2 decode: 13 size symbols where
one is meant). Then every kernel over a layer's keys and values sees two sizes it cannot tell
equal: the two concatenations that append a step's key and value to the cache are two kernels
(one a layer with one symbol, both reading the projection once), and every length is bound,
guarded and passed on its own.

`guard_attention_sizes` adds the equalities to export's shape environment as guards (torch's
`guard_bool`): the environment replaces one symbol by the other in every value the program holds
(a symbolic size's expression is read through its replacements), the guard checks the inputs'
sizes agree (a call whose sizes differ recompiles: its entry keeps them apart), and decompose
records the guards with the shape guards of a stored entry (a package written after a warm start
renames them to the stored program's symbols: gjit/packaging.py). Only sizes equal in the traced
call are made one, and a mask's dim only where the call did not broadcast it (a size of 1 there
stays apart).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.fx.experimental.symbolic_shapes import guard_bool

from gjit import logs

log = logs.logger("dynamic")

SDPA = torch.ops.aten.scaled_dot_product_attention.default


def guard_attention_sizes(gm: torch.fx.GraphModule) -> int:
    """Make the sizes every SDPA call of `gm` needs equal one symbol (see the module's doc); the
    number of equalities added."""
    added = 0
    for node in gm.graph.find_nodes(op="call_function", target=SDPA):
        for a, b in _equal_by_contract(node):
            if not _symbolic_and_equal(a, b):
                continue
            try:
                with _recording((a if isinstance(a, torch.SymInt) else b).node.shape_env):
                    equal = guard_bool(a == b)
            except Exception as e:  # noqa: BLE001 - an optimization: the sizes stay apart
                log.debug("%s: %s == %s not added: %s", node.name, a, b, e)
                continue
            if equal:
                log.debug("%s: %s == %s (SDPA's contract)", node.name, a, b)
                added += 1
    return added


@contextlib.contextmanager
def _recording(env) -> Iterator[None]:
    """Guards kept: non-strict export freezes its shape environment once it has produced its own
    guards, and a frozen one logs a new guard as ignored (torch 2.13 still records it; the
    replacement is made either way, and an entry whose guard did not check it would run kernels
    over sizes they take for equal). gjit builds its guards from the environment's."""
    frozen, env.frozen = env.frozen, False
    try:
        yield
    finally:
        env.frozen = frozen


def _equal_by_contract(node: torch.fx.Node) -> Iterator[tuple]:
    """Pairs of sizes of `node`'s arguments (SymInts or ints) that its call needs equal."""
    vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in node.args[:4]]
    q, k, v = vals[:3]
    mask = node.kwargs.get("attn_mask", vals[3] if len(vals) > 3 else None)
    if isinstance(mask, torch.fx.Node):
        mask = mask.meta.get("val")
    if not all(isinstance(t, torch.Tensor) and t.dim() >= 2 for t in (q, k, v)):
        return
    yield k.shape[-2], v.shape[-2]  # S
    yield q.shape[-1], k.shape[-1]  # E
    if isinstance(mask, torch.Tensor) and mask.dim() >= 2:
        # a mask's dim of the traced size 1 broadcasts; another one is the scores' dim
        for theirs, ours in ((mask.shape[-1], k.shape[-2]), (mask.shape[-2], q.shape[-2])):
            if _hint(theirs) != 1:
                yield theirs, ours


def _hint(size) -> int | None:
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        return int(hint) if isinstance(hint, int) else None
    return int(size)


def _symbolic_and_equal(a, b) -> bool:
    """Whether either size is a symbol not known equal to the other, both equal in the traced
    call (a size without an example value, unbacked, is left alone)."""
    if not (isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt)):
        return False
    ha, hb = _hint(a), _hint(b)
    if ha is None or hb is None or ha != hb:
        return False
    ea = a.node.expr if isinstance(a, torch.SymInt) else a
    eb = b.node.expr if isinstance(b, torch.SymInt) else b
    return ea != eb
