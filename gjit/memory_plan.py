"""The wrapper's memory plan: each local is dropped after its last use, and an allocation takes
the memory of a dead buffer of the same size, strides and dtype (Inductor's buffer reuse).

Python frees a function's locals when it returns. Without a plan, every intermediate of a
wrapper's call lives until the call ends (its peak memory is the sum of them), and every buffer
is a new allocator call from Python (2-5 us each; a GPT-2 decode step allocates 85). The writer
(gjit/wrapper.py) hands over its lines, which of them allocate (with the allocation's arguments
as text: the same text is the same size, strides and dtype within one call, since a size symbol
is bound once) and which call an extern whose result is new memory. The plan then reads every
statement's names and:

1. groups the names that may share memory: a statement that is neither an allocation nor a
   call the writer knows returns new memory (a product's, attention's) may alias what it defines
   with every name it mentions (a view, `index_put_`, a getitem, a branch's call, an op that
   returns its argument though its schema says otherwise); a kernel launch defines nothing;
2. a group dies after the last statement that mentions one of its names. A group whose memory is
   one allocation of the wrapper, with no graph input and no output in it, goes to a pool keyed
   by that allocation's arguments; a later allocation of the same key takes it
   (`buf5 = buf2` then `del buf2`; in debug mode `gjit_repoison(buf2)`, so a read of the dead
   value shows);
3. every other local is deleted after its last mention (`del`), so ATen's results and unreused
   buffers go back to the allocator as soon as nothing needs them.

Kernels and externs run in order on one stream, so memory taken from a dead group is written
only after every launch that read it was issued. Names are read as identifiers of the text: a
word in a message or a keyword's name counts as a mention, which only keeps a name longer.
"""

from __future__ import annotations

import dataclasses
import re

_NAME = re.compile(r"(?<![.\w])[A-Za-z_]\w*")  # not an attribute's (aten.permute.default)
_ASSIGN = re.compile(r"^([A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)*),?\s*=(?!=)")


@dataclasses.dataclass
class _Statement:
    lines: list[str]
    defines: list[str]
    mentions: set[str]
    fresh: bool  # what it defines is new memory: no alias of what it reads
    alloc: str | None  # an allocation: its arguments, the key of the memory it could take


def plan(
    lines: list[str],
    allocs: dict[int, str],
    fresh: set[int],
    tensors: set[str],
    inputs: set[str],
    poison: bool,
) -> list[str]:
    """The wrapper body `lines` with dead locals deleted and allocations reusing dead buffers.
    `allocs`: line index -> the allocation's arguments; `fresh`: lines whose result is new memory;
    `tensors`: the wrapper's local values (FX values, views, buffers); `inputs`: the graph's inputs."""
    statements = _statements(lines, allocs, fresh)
    known = tensors | inputs
    group = _groups(statements, known)
    last: dict[str, int] = {}
    for i, s in enumerate(statements):
        for name in s.mentions & known:
            last[name] = i
    death: dict[str, int] = {}
    members: dict[str, list[str]] = {}
    for name, i in last.items():
        root = group(name)
        death[root] = max(death.get(root, -1), i)
        members.setdefault(root, []).append(name)
    end = len(statements) - 1
    defined = {name for s in statements for name in s.defines}
    roots = {s.defines[0]: s.alloc for s in statements if s.alloc is not None}

    def reusable(name: str) -> bool:
        """A buffer the wrapper allocated whose group holds no input, no output and no other buffer."""
        mine = members[group(name)]
        return (
            death[group(name)] < end
            and not any(m in inputs for m in mine)
            and sum(m in roots for m in mine) == 1
        )

    pooled = {name for name in roots if reusable(name)}
    dies: dict[int, list[str]] = {}  # statement index -> the pooled buffers whose group dies there
    for name in roots:  # in the order of their allocations
        if name in pooled:
            dies.setdefault(death[group(name)], []).append(name)
    taken = _reuses(statements, roots, dies)  # statement index -> the dead buffer it takes
    given = set(taken.values())
    out: list[str] = []
    for i, s in enumerate(statements):
        if i in taken:
            name, dead = s.defines[0], taken[i]
            out.append(f"{name} = gjit_repoison({dead})" if poison else f"{name} = {dead}")
            out.append(f"del {dead}  # reused")
        else:
            out.extend(s.lines)
        gone = []
        for name in sorted(n for n in s.mentions & defined if last.get(n) == i and n not in inputs):
            if name not in pooled:  # a pooled one goes with its group (below), or when taken
                gone.append(name)
        gone += sorted(name for name in dies.get(i, []) if name not in given)
        if gone and i < end:
            out.append(f"del {', '.join(gone)}")
    return out


def _statements(lines: list[str], allocs: dict[int, str], fresh: set[int]) -> list[_Statement]:
    """The lines as statements: a line at the wrapper's level with the indented lines under it."""
    statements: list[_Statement] = []
    for k, line in enumerate(lines):
        if line.startswith(" ") and statements:
            statements[-1].lines.append(line)
            statements[-1].mentions.update(_NAME.findall(line))
            continue
        match = _ASSIGN.match(line)
        defines = [n.strip() for n in match.group(1).split(",")] if match else []
        alloc = allocs.get(k) if len(defines) == 1 else None
        mentions = set(_NAME.findall(line))
        statements.append(_Statement([line], defines, mentions, k in fresh or alloc is not None, alloc))
    return statements


def _groups(statements: list[_Statement], known: set[str]):
    """Union-find over the names that may share memory; returns the find."""
    parent: dict[str, str] = {}

    def find(name: str) -> str:
        parent.setdefault(name, name)
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    for s in statements:
        if s.fresh or not s.defines:
            continue
        names = sorted((set(s.defines) | s.mentions) & known)
        for other in names[1:]:
            parent[find(other)] = find(names[0])
    return find


def _reuses(
    statements: list[_Statement], roots: dict[str, str], dies: dict[int, list[str]]
) -> dict[int, str]:
    """Statement index of an allocation -> the dead buffer whose memory it takes."""
    pool: dict[str, list[str]] = {}
    taken: dict[int, str] = {}
    for i, s in enumerate(statements):
        if s.alloc is not None and pool.get(s.alloc):
            taken[i] = pool[s.alloc].pop()
        for name in dies.get(i, []):
            pool.setdefault(roots[name], []).append(name)
    return taken
