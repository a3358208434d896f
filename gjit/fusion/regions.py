"""Fusion: group the loop graph's compute nodes into regions, one generated kernel each.

Rules, in order:
  1. inline: a node that need not be in memory and that no consumer reads element-for-
     element (same size, identity index) is recomputed inside each consumer (broadcasts,
     reshapes and transposes of cheap pointwise values cost no kernel and no memory; a gather
     of a few reads' value reads those at the gathered indices); a matmul's operand is inlined
     into its prologue only when the matmul is its one reader;
  2. vertical: a node joins its producer's region when both have the same iteration space
     and every read between them is element-for-element;
  3. horizontal: regions of the same iteration space that read a common buffer merge, so
     a DAG over shared inputs is one kernel; so do small pointwise regions of one static size
     that nothing reads, whose time is their launch (gjit/fusion/launches.py);
  4. reductions: a ReduceNode's region iterates its input's full space split into outer (kept)
     and reduced dims; pointwise nodes over the full space or over the outer space join it
     when every read between members lines up in those coordinates (softmax, layer_norm,
     rms_norm, mean/var are one kernel each). Producers read only by reductions are inlined.
     A ScanNode (cumsum, ...) is a region of its own over (rows x the scanned dim), its
     producers inlined the same way; what reads it reads the stored scan. So is a ScatterNode
     (a write through indices), over its source's elements, after the region that stores
     the memory it writes into.
  a merge that would create a cycle through a third region or an extern is refused.
Every refusal is logged to `GJIT_LOGS=fusion` as "cannot fuse A with B: reason".
A region stores exactly the nodes that something outside it needs.
"""

from __future__ import annotations

import dataclasses
import logging

import sympy

from gjit import ir
from gjit.fusion.launches import MAX_MERGED, launch_bound
from gjit.fusion.spaces import ReductionSpace
from gjit.fusion.symbols import data_dependent_symbols, extern_symbols
from gjit.fusion.writes import waits_for_readers, why_not_side_by_side
from gjit.ir import (
    AttentionNode,
    ComputeNode,
    Expr,
    ExternNode,
    LoopGraph,
    MatmulNode,
    Read,
    ReduceNode,
    ScanNode,
    ScatterNode,
)

OWN_KERNEL = (ReduceNode, ScanNode, ScatterNode)  # never inlined: what reads them reads memory

log = logging.getLogger("gjit.fusion")


@dataclasses.dataclass
class Region:
    nodes: list[ComputeNode]  # the stored or shared nodes, in program order
    bodies: dict[str, Expr]  # each node's body with inlined producers substituted
    stores: list[str]  # nodes whose values leave the region
    inlined: list[ComputeNode]  # nodes recomputed inside this region
    name: str = ""  # the kernel name, given by codegen
    config: int = 0  # what codegen emits: a template's tiles, a row kernel's loop (gjit/tuning.py)
    reduction: ReductionSpace | None = None  # None: a pointwise region
    # a matmul's: the region of per-row statistics its prologue computes (gjit/fusion/statistics.py)
    row_statistics: Region | None = None
    # a matmul's: the row reductions of its output (a post-norm) its epilogue computes (gjit/fusion/rows.py)
    row_epilogue: Region | None = None
    # matmul regions sharing their left operand that this one launches together (gjit/fusion/products.py)
    parts: list[Region] = dataclasses.field(default_factory=list)

    @property
    def size(self) -> ir.Index:
        """The iteration space (a scatter's: its source's elements; products launched together:
        their outputs side by side)."""
        if self.parts:
            first = self.parts[0].size
            return (*first[:-1], sympy.Add(*(p.size[-1] for p in self.parts)))
        return self.nodes[0].space if self.scatter else self.nodes[0].size

    @property
    def scan(self) -> bool:
        """A scan's region: its one node, over (rows x the scanned dim) in `reduction`."""
        return isinstance(self.nodes[0], ScanNode)

    @property
    def scatter(self) -> bool:
        """A write through indices: its one node, over its source's elements."""
        return isinstance(self.nodes[0], ScatterNode)

    @property
    def matmul(self) -> bool:
        """A matmul template's region: one MatmulNode and the pointwise nodes over its output."""
        return any(isinstance(n, MatmulNode) for n in self.nodes)

    @property
    def attention(self) -> bool:
        """An attention template's region: one AttentionNode and the pointwise nodes over its output."""
        return any(isinstance(n, AttentionNode) for n in self.nodes)

    @property
    def lone_product(self) -> MatmulNode | None:
        """The product of a matmul template region that computes one and nothing besides (no
        attention, no products launched with it, no row epilogue): what gjit/fusion/rows.py and
        gjit/fusion/products.py may still extend; else None."""
        if self.attention or self.parts or self.row_epilogue is not None:
            return None
        return next((n for n in self.nodes if isinstance(n, MatmulNode)), None)

    def fused_nodes(self) -> list[ComputeNode]:
        """Every node the kernel computes: inlined, absorbed into an attention node, its own."""
        if self.parts:
            nodes = {n.name: n for p in self.parts for n in p.fused_nodes()}  # statistics once
            return list(nodes.values())
        absorbed = [a for n in self.nodes for a in getattr(n, "absorbed", ())]
        statistics = self.row_statistics.fused_nodes() if self.row_statistics else []
        return statistics + self.inlined + absorbed + self.nodes

    def aten_ops(self) -> list[str]:
        seen: list[str] = []
        for n in self.fused_nodes():
            if n.aten not in seen:
                seen.append(n.aten)
        return seen


Step = Region | ExternNode


def _identity(read: Read, size: ir.Index) -> bool:
    return read.index == ir.index_vars(len(size))


def _a_load(body: Expr) -> bool:
    """Is `body` one read, or a cast of one?"""
    if isinstance(body, ir.Op) and body.name == "to_dtype":
        body = body.args[0]
    return isinstance(body, Read) and not body.indirect


def _gatherable(node: ComputeNode) -> bool:
    """Can a gather of `node` recompute it at the gathered indices instead of reading it from
    memory (cross_entropy's gather of log_softmax then reads the logits, not a written
    log_softmax)? Its reads must be few (each is repeated per gathered element), and it must not
    use its index as data or in a mask: only reads can index with gathered data."""
    body = node.body
    if any(isinstance(e, (ir.IndexValue, ir.Masked)) for e in ir.walk(body)):
        return False
    return len({r.name for r in ir.reads(body)}) <= 4


class Fusion:
    def __init__(self, graph: LoopGraph):
        self.graph = graph
        self.compute = graph.compute_nodes()
        self.order = {n.name: k for k, n in enumerate(graph.nodes)}
        self.expanded: dict[Read, Expr] = {}
        self.memory_readers: dict[str, bool] = {}  # reads_memory, per node

    def run(self) -> list[Step]:
        inline = self.choose_inlined()
        bodies = {
            name: self.expand(node.body, inline) for name, node in self.compute.items() if name not in inline
        }
        self.bodies = bodies
        # group id per materialized node and per extern (externs never merge)
        self.group = {name: name for name in bodies}
        self.group.update({n.name: n.name for n in self.graph.nodes if isinstance(n, ExternNode)})
        self.members = {gid: [gid] for gid in self.group}
        self.symbol_producers = data_dependent_symbols(self.graph)
        self.deps = {name: self.node_deps(name) for name in self.group}
        self._consumers: dict[str, set[str]] | None = None
        self.fuse_vertical()
        self.fuse_horizontal()
        return self.schedule(inline)

    # -- 1. inlining ---------------------------------------------------------------------------

    def choose_inlined(self) -> set[str]:
        # consumers come after producers, so walking backwards decides every consumer first
        inline: set[str] = set()
        identity_consumers: dict[str, int] = {name: 0 for name in self.compute}
        # read at data-dependent indices (gather, embedding), directly or through inlined nodes
        indirect = {r.name for n in self.compute.values() for r in ir.reads(n.body) if r.indirect}
        shared_operands = self.shared_matmul_operands()
        for name in reversed(list(self.compute)):
            node = self.compute[name]
            reduction = isinstance(node, OWN_KERNEL)
            gatherable = _gatherable(node) and self.reads_memory(name)
            kept = name in self.graph.needed_in_memory or (name in indirect and not gatherable)
            kept = kept or name in shared_operands
            if not reduction and not kept and identity_consumers[name] == 0:
                inline.add(name)
                if name in indirect:  # its reads follow the gathered index: treat them all as gathered
                    indirect |= {r.name for r in ir.reads(node.body)}
                    log.debug("inline %s into its consumers: recomputed at the gathered indices", name)
                else:
                    log.debug("inline %s into its consumers: no consumer reads it element-for-element", name)
                continue
            if reduction:
                continue  # a producer read only by reductions (scans, scatters) is inlined into their bodies
            for r in ir.reads(node.body):
                producer = self.compute.get(r.name)
                if producer is not None and producer.size == node.size and _identity(r, node.size):
                    identity_consumers[r.name] += 1
        return inline

    def shared_matmul_operands(self) -> set[str]:
        """Nodes a matmul reads (directly or through pointwise nodes) that have other readers too:
        they are stored. Inlined, each reader would recompute them and everything they read,
        and a residual stream, read by every layer's norm and next add, would be recomputed in
        every later layer's matmul prologue."""
        readers: dict[str, set[str]] = {}
        for n in self.compute.values():
            for r in ir.reads(n.body):
                readers.setdefault(r.name, set()).add(n.name)
        feeds: set[str] = set()  # a matmul reads it, itself or through pointwise readers
        for name in reversed(list(self.compute)):
            for reader in readers.get(name, ()):
                node = self.compute[reader]
                if isinstance(node, MatmulNode) or (not isinstance(node, OWN_KERNEL) and reader in feeds):
                    feeds.add(name)
                    break
        # what only reductions read, directly or through pointwise nodes (a norm's squares), is
        # inlined into them and not recomputed by anything else: it does not count as a reader
        # of a load or a cast of one (a 16-bit norm's float32 input), which costs nothing to
        # read again (anything dearer, a gated norm's y * silu(z), stays stored once)
        reduced_only: set[str] = set()
        for name in reversed(list(self.compute)):
            node = self.compute[name]
            if isinstance(node, OWN_KERNEL) or name in self.graph.needed_in_memory or not readers.get(name):
                continue
            if all(type(self.compute[r]) is ReduceNode or r in reduced_only for r in readers[name]):
                reduced_only.add(name)
        lhs_groups = self.shared_left_operands()
        # matmuls that share their left operand launch as one kernel (gjit/fusion/products.py): they
        # count as one reader of it
        keys = {
            name: {
                lhs_groups.get((r, name), r)
                for r in readers[name]
                if r not in reduced_only or not _a_load(self.compute[name].body)
            }
            for name in feeds
        }
        return {name for name in feeds if len(keys[name]) > 1}

    def shared_left_operands(self) -> dict[tuple[str, str], tuple]:
        """(matmul, name) -> a key shared by the matmuls whose left operand is the same expression
        over the same (batch..., M, K) and reads `name` (their right operands do not), when two
        or more do: gjit/fusion/products.py puts them in one kernel, so an operand they alone read
        (a norm's output before q, k and v) is inlined into that kernel's prologue, not stored."""
        by_lhs: dict[tuple, list[MatmulNode]] = {}
        for node in self.compute.values():
            if type(node) is MatmulNode:
                lhs, _ = node.body.args
                key = (*node.full_size[:-2], node.full_size[-1], lhs)
                by_lhs.setdefault(key, []).append(node)
        out = {}
        for key, nodes in by_lhs.items():
            if len(nodes) > 1:
                for node in nodes:
                    lhs, rhs = node.body.args
                    for name in {r.name for r in ir.reads(lhs)} - {r.name for r in ir.reads(rhs)}:
                        out[node.name, name] = key
        return out

    def reads_memory(self, name: str) -> bool:
        """Does `name`'s value read a buffer or a reduction, itself or through its producers?
        Those are never inlined: a gather that recomputes it keeps a read to check the gathered
        index against (a gather of a value made of constants is written first)."""
        if name not in self.compute or isinstance(self.compute[name], OWN_KERNEL):
            return True
        if name not in self.memory_readers:
            reads = {r.name for r in ir.reads(self.compute[name].body)}
            self.memory_readers[name] = any(self.reads_memory(r) for r in reads)
        return self.memory_readers[name]

    def expand(self, body: Expr, inline: set[str]) -> Expr:
        """Substitute inlined producers (recursively) into `body`."""

        def on_read(r: Read) -> Expr:
            if r.name not in inline:
                return r
            if r not in self.expanded:  # shared producers (diamonds) expand once
                producer = self.compute[r.name]
                mapping = dict(zip(ir.index_vars(len(producer.size)), r.index))
                inner = ir.substitute(producer.body, lambda rr: rr, lambda e: e.xreplace(mapping))
                # read at gathered indices, the producer's own reads index with the same data
                self.expanded[r] = self.expand(ir.bind(inner, r.indirect), inline)
            return self.expanded[r]

        return ir.substitute(body, on_read, lambda e: e)

    # -- dependency bookkeeping ------------------------------------------------------------------

    def resolve(self, name: str) -> str:
        """A view name -> the buffer or node it views."""
        while name in self.graph.views:
            name = self.graph.views[name].base
        return name

    def node_deps(self, name: str) -> set[str]:
        if name in self.bodies:
            names = {r.name for r in ir.reads(self.bodies[name])}
            node = self.compute[name]
            used = ir.free_symbols(self.bodies[name])
            for s in (*node.layout.size, *getattr(node, "full_size", ()), *getattr(node, "space", ())):
                used |= sympy.sympify(s).free_symbols
            names |= {self.symbol_producers[s] for s in used if s in self.symbol_producers}
            if isinstance(node, ScatterNode):
                names.add(node.base)  # it writes into the base's stored memory
        else:
            extern = self.graph.node(name)
            names = {self.resolve(a) for a in extern.tensor_args}
            names |= {self.symbol_producers[s] for s in extern_symbols(extern) if s in self.symbol_producers}
        return {n for n in names if n in self.group and n != name}

    def group_members(self, gid: str) -> list[str]:
        return self.members[gid]

    def group_deps(self, gid: str) -> set[str]:
        out = set()
        for member in self.group_members(gid):
            out |= {self.group[d] for d in self.deps[member]}
        out.discard(gid)
        return out

    def consumers(self) -> dict[str, set[str]]:
        """Each group's consuming groups, kept until the next merge."""
        if self._consumers is None:
            self._consumers = {}
            for gid in self.members:
                for d in self.group_deps(gid):
                    self._consumers.setdefault(d, set()).add(gid)
        return self._consumers

    def reaches(self, src: set[str], dst: set[str]) -> bool:
        """Is some group in `dst` reachable from a group in `src` through a group outside both?"""
        consumers = self.consumers()
        frontier = [c for s in src for c in consumers.get(s, ()) if c not in src and c not in dst]
        seen = set(frontier)
        while frontier:
            g = frontier.pop()
            for c in consumers.get(g, ()):
                if c in dst:
                    return True
                if c not in seen and c not in src:
                    seen.add(c)
                    frontier.append(c)
        return False

    def space(self, gid: str) -> ReductionSpace | None:
        for m in self.group_members(gid):
            node = self.compute[m]
            if isinstance(node, ReduceNode):
                matmul = node.name if isinstance(node, MatmulNode) else ""
                return ReductionSpace(tuple(node.full_size), tuple(node.reduced), matmul)
            if isinstance(node, ScanNode):
                return ReductionSpace(tuple(node.size), (node.dim,))
        return None

    def why_not(self, a: str, b: str) -> str | None:
        """None if groups a and b may merge, else the reason they may not."""
        ma, mb = self.group_members(a), self.group_members(b)
        if any(m not in self.bodies for m in ma + mb):
            return "an extern never fuses"
        if any(isinstance(self.compute[m], ScanNode) for m in ma + mb):
            return "a scan is a kernel of its own"
        if any(isinstance(self.compute[m], ScatterNode) for m in ma + mb):
            reason = why_not_side_by_side([self.compute[m] for m in ma + mb], self.bodies, self.resolve)
            if reason is None and (self.reaches({a}, {b}) or self.reaches({b}, {a})):
                reason = "fusing would create a cycle through another kernel or extern"
            return reason
        members = set(ma) | set(mb)
        reason = self.why_not_matmul(members)
        if reason is not None:
            return reason
        space_a, space_b = self.space(a), self.space(b)
        if space_a is not None and space_b is not None and space_a != space_b:
            return "reductions over different spaces"
        space = space_a or space_b
        if space is None:
            reason = self.why_not_pointwise(ma, mb, members)
        else:
            reason = self.why_not_reduction(space, members)
        if reason is not None:
            return reason
        if self.reaches({a}, {b}) or self.reaches({b}, {a}):
            return "fusing would create a cycle through another kernel or extern"
        return None

    def why_not_matmul(self, members: set[str]) -> str | None:
        """A matmul template computes one product and, on its output tile, pointwise work: no
        other reduction, nothing over the product's k dim."""
        products = [m for m in members if isinstance(self.compute[m], MatmulNode)]
        if not products:
            return None
        if len(products) > 1:
            return "a matmul template computes one product"
        node = self.compute[products[0]]
        for m in members - {node.name}:
            other = self.compute[m]
            if isinstance(other, ReduceNode):
                return f"a matmul template holds no other reduction ({m})"
            if tuple(other.size) == tuple(node.full_size):
                return f"{m} is over the product's k dim: a matmul's epilogue works on its output tile"
        return None

    def why_not_pointwise(self, ma: list[str], mb: list[str], members: set[str]) -> str | None:
        size_a, size_b = self.compute[ma[0]].size, self.compute[mb[0]].size
        if size_a != size_b:
            return f"different iteration spaces {list(size_a)} vs {list(size_b)}"
        for m in members:
            for r in ir.reads(self.bodies[m]):
                if r.name in members and not _identity(r, size_a):
                    return f"{m} reads {r.name} at [{', '.join(map(str, r.index))}], not element-for-element"
        return None

    def why_not_reduction(self, space: ReductionSpace, members: set[str]) -> str | None:
        placements = {}
        for m in sorted(members, key=self.order.get):  # a member's producers first (reshape_placement)
            placements[m] = space.placement(self.compute[m], self.bodies[m])
            if placements[m] is None:
                return f"{m} {list(self.compute[m].size)} is not in the reduction space {list(space.full)}"
        for m in members:
            for r in ir.reads(self.bodies[m]):
                if r.name not in members:
                    continue
                at = tuple(sympy.sympify(i).xreplace(placements[m]) for i in r.index)
                if at != space.value_index(self.compute[r.name]):
                    return f"{m} reads {r.name} at [{', '.join(map(str, r.index))}], which is not its own row"
        return None

    def merge(self, a: str, b: str) -> None:
        self._consumers = None
        for name in self.members.pop(b):
            self.group[name] = a
            self.members[a].append(name)

    # -- 2./3. merging ---------------------------------------------------------------------------

    def fuse_vertical(self) -> None:
        for name in sorted(self.bodies, key=self.order.get):
            for dep in sorted(self.deps[name], key=self.order.get):
                a, b = self.group[dep], self.group[name]
                if a == b or dep not in self.bodies:
                    continue
                reason = self.why_not(a, b)
                if reason is None:
                    self.merge(a, b)
                else:
                    log.info("cannot fuse %s with %s: %s", dep, name, reason)

    def fuse_horizontal(self) -> None:
        groups = sorted({self.group[n] for n in self.bodies}, key=self.order.get)
        reads = {  # what each group reads, kept up to date as groups merge
            g: {r.name for m in self.group_members(g) for r in ir.reads(self.bodies[m])} for g in groups
        }
        small = launch_bound(self, groups)  # gjit/fusion/launches.py
        for i, a in enumerate(groups):
            for b in groups[i + 1 :]:
                if a not in self.members or b not in self.members:
                    continue
                one_launch = a in small and small[a] == small.get(b)
                one_launch = one_launch and len(self.members[a]) + len(self.members[b]) <= MAX_MERGED
                if not reads[a] & reads[b] and not one_launch:
                    continue
                reason = self.why_not(a, b)
                if reason is None:
                    why = f"they read {sorted(reads[a] & reads[b])}" if reads[a] & reads[b] else "one launch"
                    log.info("fuse %s with %s horizontally: %s", a, b, why)
                    self.merge(a, b)
                    reads[a] |= reads.pop(b)
                    if b not in small:  # merged with a region something reads: no longer a sink
                        small.pop(a, None)
                else:
                    log.info("cannot fuse %s with %s: %s", a, b, reason)

    # -- ordering --------------------------------------------------------------------------------

    def schedule(self, inline: set[str]) -> list[Step]:
        gids = sorted(self.members, key=lambda g: min(self.order[m] for m in self.group_members(g)))
        deps = {g: self.group_deps(g) for g in gids}
        later = waits_for_readers(self)  # gjit/fusion/writes.py
        done: set[str] = set()
        steps: list[Step] = []
        needed_outside = self.needed_outside()
        while len(done) < len(gids):
            ready = [g for g in gids if g not in done and deps[g] <= done]
            if not ready:
                raise AssertionError("fusion produced a cyclic schedule")
            g = next((g for g in ready if later.get(g, set()) <= done), ready[0])
            step = self.make_step(g, inline, needed_outside)
            if isinstance(step, Region) and not step.stores:  # cummax's unused indices
                log.info("drop %s: nothing reads what it computes", [n.name for n in step.nodes])
            else:
                steps.append(step)
            done.add(g)
        return steps

    def needed_outside(self) -> set[str]:
        needed = {self.resolve(n) for n in self.graph.needed_in_memory}
        for name, deps in self.deps.items():
            for d in deps:
                if self.group[d] != self.group[name]:
                    needed.add(d)
        return needed

    def make_step(self, gid: str, inline: set[str], needed_outside: set[str]) -> Step:
        members = sorted(self.group_members(gid), key=self.order.get)
        if gid not in self.bodies:
            return self.graph.node(gid)
        used = set()
        for m in members:
            used |= _inlined_reads(self.compute[m].body, self.compute, inline)
        return Region(
            nodes=[self.compute[m] for m in members],
            bodies={m: self.bodies[m] for m in members},
            stores=[m for m in members if m in needed_outside],
            inlined=[self.compute[n] for n in sorted(used, key=self.order.get)],
            reduction=self.space(gid),
        )


def _inlined_reads(body: Expr, compute: dict[str, ComputeNode], inline: set[str]) -> set[str]:
    out = set()
    for r in ir.reads(body):
        if r.name in inline and r.name not in out:
            out.add(r.name)
            out |= _inlined_reads(compute[r.name].body, compute, inline)
    return out


def fuse(graph: LoopGraph) -> list[Step]:
    return Fusion(graph).run()


def verify_schedule(steps: list[Step], graph: LoopGraph) -> None:
    """The schedule is well formed (GJIT_DEBUG runs this after fusion): no node is computed by two
    steps (a node inlined into others is recomputed, not owned), a region stores only its own
    nodes, everything a step reads is an input, its own member, or stored by an earlier step (a
    view or alias once what it stands for is), and every output is stored. (Nodes nothing needs,
    like layer_norm's unused mean, are dropped.)"""
    owner: set[str] = set()
    available = {name for name, b in graph.buffers.items() if b.kind == "input"}

    def fail(message: str) -> None:
        raise ir.IRError(f"gjit schedule: {message}")

    for step in steps:
        if isinstance(step, ExternNode):
            if step.name in owner:
                fail(f"extern {step.name} runs twice")
            late = [a for a in step.tensor_args if ir.resolve(graph, a) not in available]
            if late:
                fail(f"extern {step.name} reads {late} before any step stores it")
            owner.add(step.name)
            available.add(step.name)
            continue
        members = {n.name for n in step.nodes}
        twice = members & owner
        if twice:
            fail(f"{sorted(twice)} computed by two steps")
        owner |= members
        if not set(step.stores) <= members:
            fail(f"{step.name} stores {step.stores}: not its own")
        inlined = {n.name for n in step.inlined}
        bodies = list(step.bodies.values())
        for part in step.parts or [step]:
            if part.row_statistics is not None:  # computed in the prologue from what it reads
                inlined |= {n.name for n in part.row_statistics.fused_nodes()}
                bodies += list(part.row_statistics.bodies.values())
        for body in bodies:
            for r in ir.reads(body):
                if not (ir.resolve(graph, r.name) in available or r.name in members or r.name in inlined):
                    fail(f"{step.name or 'a region'} reads {r.name} before any step stores it")
        available |= set(step.stores)
    missing = [o for o in graph.outputs if o is not None and ir.resolve(graph, o) not in available]
    if missing:
        fail(f"no step stores the outputs {missing}")
