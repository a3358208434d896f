"""What a region's kernel is, decided once for both kernel languages (the backend-neutral plan).

`RegionPlan` is the base of every kernel writer: the region's layouts and accesses, its
iteration space and index plan (`pointwise_space`), int32 or int64 offsets and the assumptions
that come with them, the modeled traffic, the header, the CSE'd temporaries and the
`KernelSource` record. `ReductionPlan` adds what a reduction region is: the reduction space,
each member's level (a softmax's max, then the sum that reads it), which members are full-row
values, persistent or looped (`row_shape`) and the sums folded into an earlier loop
(codegen/online.py). The printers (codegen/triton/, codegen/cuda/) subclass these and only print;
neither inherits from the other.
"""

from __future__ import annotations

import functools

import sympy

from gjit import ir
from gjit.codegen import online
from gjit.codegen.common import KernelSource, hint, source_line, unique
from gjit.codegen.indexing import XINDEX, YINDEX, coalesce, linear_coeffs
from gjit.config import CompileOptions
from gjit.fusion.regions import Region
from gjit.ir import Const, Expr, IndexValue, Masked, Op, Read, ReduceNode, ScatterNode


class RegionPlan:
    """One region's kernel, backend-neutral. The expression walk (`emit`) is here; printers
    spell its pieces (`literal`, `folded`, `index_value`, `op`, `read`, `masked`), print index
    expressions (`index`, noting the size symbols it uses) and the line that defines a temporary
    (`assign`)."""

    def __init__(
        self, region: Region, graph: ir.LoopGraph, hints: dict[sympy.Symbol, int], options: CompileOptions
    ):
        self.region = region
        self.graph = graph
        self.hints = hints
        self.options = options
        self.assumptions: list[tuple[sympy.Basic, str]] = []
        self.lines: list[str] = []
        self.cse: dict[tuple, str] = {}
        self.counter = 0
        self.in_args: dict[str, str] = {}
        self.out_args: dict[str, str] = {}
        self.values: dict[str, str] = {}  # region node -> its tmp variable
        self.symbols: set[sympy.Symbol] = set()  # size symbols the kernel body uses
        self.mask = "xmask"  # the mask the current expression is under (block printers)
        self.pass_id = 0  # which pass over memory a load belongs to (looped reductions make several)
        self.rvars: set[sympy.Symbol] = set()  # reduced index variables (reduction kernels)
        # (buffer, pass, indirect, per row): per row, a reduction kernel reads one element a row
        self.loaded: set[tuple[str, int, bool, bool]] = set()

    @functools.cached_property
    def compute_nodes(self) -> dict[str, ir.ComputeNode]:
        """The graph's compute nodes by name (codegen changes none of them)."""
        return self.graph.compute_nodes()

    # -- expressions: the walk is here, each printer spells the pieces ----------------------------

    def emit(self, e: Expr) -> str:
        """The value of IR expression `e` in the printer's language (a literal or a temporary)."""
        if isinstance(e, Const):
            return self.literal(e.value, e.dtype)
        if isinstance(e, Read):
            return self.read(e)
        if isinstance(e, Masked):
            return self.masked(e)
        folded = self.folded(e)
        if folded is not None:
            return folded
        if isinstance(e, IndexValue):
            return self.index_value(e)
        if isinstance(e, Op):
            return self.op(e, [self.emit(a) for a in e.args])
        raise TypeError(type(e))

    def literal(self, value, dtype) -> str:
        raise NotImplementedError

    def folded(self, e: Expr) -> str | None:
        """A constant expression the printer writes as a literal, or None."""
        raise NotImplementedError

    def index_value(self, e: IndexValue) -> str:
        raise NotImplementedError

    def op(self, e: Op, args: list[str]) -> str:
        raise NotImplementedError

    def read(self, r: Read) -> str:
        raise NotImplementedError

    def masked(self, e: Masked) -> str:
        raise NotImplementedError

    def index(self, expr: sympy.Expr, names: dict[sympy.Symbol, str] | None = None) -> str:
        raise NotImplementedError

    def assign(self, var: str, text: str, dtype) -> str:
        raise NotImplementedError

    def tmp(self, key: tuple, text: str, dtype=None) -> str:
        """A temporary holding `text`, one per `key` in the current scope (CSE)."""
        if key in self.cse:
            return self.cse[key]
        var = f"tmp{self.counter}"
        self.counter += 1
        self.cse[key] = var
        self.lines.append(self.assign(var, text, dtype))
        return var

    # -- layouts and accesses -----------------------------------------------------------------------

    def layout(self, name: str) -> ir.Layout:
        if name in self.graph.buffers:
            lay = self.graph.buffers[name].layout
            # kernels get data_ptr(), which already includes the storage offset
            return ir.Layout(lay.size, lay.stride, sympy.Integer(0), lay.dtype)
        node = self.compute_nodes[name]
        return ir.Layout(node.layout.size, node.layout.stride, sympy.Integer(0), node.layout.dtype)

    def in_registers(self, r: Read) -> bool:
        """Is this read of a region member at its own element (so the member's value is reused)?"""
        return r.name in self.region.bodies and r.index == ir.index_vars(len(self.region.size))

    def note_load(self, r: Read, indirect: bool) -> None:
        per_row = bool(self.rvars) and not ir.free_symbols(r) & self.rvars
        self.loaded.add((r.name, self.pass_id, indirect, per_row))

    def node_value(self, name: str) -> str:
        if name not in self.values:
            self.values[name] = self.emit(self.region.bodies[name])
        return self.values[name]

    def accesses(self) -> list[sympy.Expr]:
        out = []
        for body in self.region.bodies.values():
            for r in ir.reads(body):
                if not (r.name in self.region.bodies and r.index == ir.index_vars(len(r.index))):
                    out.append(self.layout(r.name).offset_of(r.index))
        idx = ir.index_vars(len(self.region.size))
        out += [self.layout(name).offset_of(idx) for name in self.region.stores]
        return out

    def pointwise_space(self) -> tuple[sympy.Expr, ir.Index, object, str]:
        """A pointwise region's (numel, logical index, index plan, index dtype); binds the plan's
        substitution and variables for the printer."""
        size = self.region.size
        numel = sympy.Mul(*size) if size else sympy.Integer(1)
        idx = ir.index_vars(len(size))
        primary = self.primary_access(idx)
        plan = coalesce(list(size), idx, self.accesses(), primary, self.hints)
        self.subst = plan.substitute
        self.vars = plan.vars
        return numel, idx, plan, self.pick_index_dtype(numel)

    def tile_split(self, plan) -> int | None:
        """Where a pointwise kernel's dims split into a 2-D tile's sides, or None (a 1-D block).
        A tile pays where a large read runs contiguous along another dim than the store (a
        transpose): its dims up to that one (inclusive) go down the tile, the rest (the store's
        contiguous dim last) across, so each of the two walks memory in runs of a tile's side."""
        if len(plan.sizes) < 2 or not self.region.stores:
            return None
        store = linear_coeffs(
            plan.substitute(self.primary_access(ir.index_vars(len(self.region.size)))), plan.vars
        )
        if store is None or store[1][-1] != 1:
            return None
        numel = hint(sympy.Mul(*plan.sizes), self.hints)
        best, split = 0, None
        for body in self.region.bodies.values():
            for r in ir.reads(body):
                if r.indirect or self.in_registers(r):
                    continue
                lay = self.layout(r.name)
                linear = linear_coeffs(plan.substitute(lay.offset_of(r.index)), plan.vars)
                if linear is None or linear[1][-1] in (0, 1) or 1 not in linear[1]:
                    continue
                elements = hint(sympy.Mul(*lay.size), self.hints)
                if 2 * elements >= numel and elements * lay.dtype.itemsize > best:
                    best, split = elements * lay.dtype.itemsize, linear[1].index(1)
        return split

    def primary_access(self, idx: ir.Index) -> sympy.Expr | None:
        """The access the iteration order follows (the first store's)."""
        return self.layout(self.region.stores[0]).offset_of(idx) if self.region.stores else None

    # -- what the kernel is -------------------------------------------------------------------------

    def kernel_size_symbols(self) -> list[sympy.Symbol]:
        """The size symbols the kernel takes as arguments, in parameter order."""
        return sorted(self.symbols - set(self.vars) - {XINDEX, YINDEX}, key=lambda s: s.name)

    def kernel_record(
        self,
        name: str,
        source: str,
        sizes: dict[str, sympy.Expr],
        signature: dict[str, str],
        blocks: dict[str, int],
        index_dtype: str,
        **extra,
    ) -> KernelSource:
        """An assembled kernel (of either language) with what it fuses, takes, moves and assumes."""
        nodes = self.region.fused_nodes()
        read, written = self.traffic(sympy.Mul(*sizes.values()), sizes["xnumel"])
        return KernelSource(
            name=name,
            source=source + "\n",
            in_args=list(self.in_args),
            out_args=list(self.out_args),
            size_args=self.kernel_size_symbols(),
            numel=sizes["xnumel"],
            index_dtype=index_dtype,
            aten_nodes=[f"{n.name}: {n.fx_node.target}" for n in nodes],
            source_lines=unique(source_line(n.fx_node) for n in nodes),
            signature=signature,
            blocks=blocks,
            bytes_read=read,
            bytes_written=written,
            assumptions=list(self.assumptions),
            **extra,
        )

    def traffic(self, elements: sympy.Expr, rows: sympy.Expr) -> tuple[sympy.Expr, sympy.Expr]:
        """Modeled bytes (read, written): each buffer once per pass over it, but never more
        elements than the kernel visits (a slice or a gather reads only what it uses; a per-row
        read of a reduction kernel, one element a row)."""

        def nbytes(name: str, limit: sympy.Expr | None = None) -> sympy.Expr:
            lay = self.layout(name)
            numel = sympy.Mul(*lay.size) if lay.size else sympy.Integer(1)
            return (numel if limit is None else sympy.Min(numel, limit)) * lay.dtype.itemsize

        full = {(n, p, ind) for n, p, ind, per_row in self.loaded if not per_row}
        read = sum(
            (
                nbytes(n, rows if per_row else elements)
                for n, p, ind, per_row in self.loaded
                if not (per_row and (n, p, ind) in full)  # the row's pass reads it anyway
            ),
            sympy.Integer(0),
        )
        written = sum((nbytes(n) for n in self.region.stores), sympy.Integer(0))
        return read, written

    def depends_on_index(self, body: Expr) -> bool:
        return any(isinstance(e, (Read, IndexValue)) for e in ir.walk(body))

    def pick_index_dtype(self, numel: sympy.Expr) -> str:
        """int32 unless some element offset of this kernel can reach 2**31 at the example sizes.

        With symbolic sizes int32 is an assumption: each span becomes a guard of the entry, so a
        call large enough to overflow recompiles (and gets int64 offsets) instead of wrapping.
        """
        spans = [numel]
        bodies = list(self.region.bodies.values())
        for part in self.region.parts or [self.region]:
            if part.row_statistics is not None:  # a matmul's prologue statistics load too
                bodies += list(part.row_statistics.bodies.values())
        reads = [r.name for b in bodies for r in ir.reads(b)]
        for name in dict.fromkeys([*self.in_args, *self.region.stores, *reads]):  # in a fixed order
            lay = self.layout(name)
            spans.append(sum(((s - 1) * st for s, st in zip(lay.size, lay.stride)), sympy.Integer(1)))
        spans = [sympy.expand(s) for s in spans]
        known = set(self.hints)
        worst = max(int(ir.at_values(s, self.hints)) if s.free_symbols <= known else 2**63 for s in spans)
        if worst >= 2**31:
            return "int64"
        for span in dict.fromkeys(s for s in spans if s.free_symbols):
            self.assumptions.append((sympy.Lt(span, 2**31), f"int32 offsets: {span} < 2**31"))
        return "int32"

    def key_line(
        self,
        signature: dict[str, str],
        blocks: dict[str, int],
        launch_blocks: dict,
        num_warps: int = 4,
        num_stages: int | None = None,
    ) -> str:
        """The last header line: what a compiled binary of this kernel is keyed on, its parameter
        types, block sizes and warps (Triton adds the 16-divisibility of pointers and ints at launch)."""
        params = ", ".join(f"{p}: {t}" for p, t in signature.items() if t != "constexpr")
        sizes = ", ".join(f"{b}={'at launch' if b in launch_blocks else v}" for b, v in blocks.items())
        warps = f", num_warps={num_warps}" if num_warps != 4 else ""
        warps += f", num_stages={num_stages}" if num_stages is not None else ""
        return f"cache key: ({params}; {sizes}{warps})"

    def header(self, name: str, numel: sympy.Expr, extra: list[str] = ()) -> list[str]:
        """The kernel's header as plain lines (each printer puts its comment marker in front):
        name, fused ATen nodes, user source lines, iteration space, what it assumes, `extra`
        (the reduction's shape), what it stores."""
        nodes = self.region.fused_nodes()
        out = [f"kernel: {name}", "fused ATen nodes:"]
        out += [f"  {n.name} = {n.fx_node.target}  {ir.dtype_str(n.dtype)}{list(n.size)}" for n in nodes]
        lines = unique(source_line(n.fx_node) for n in nodes)
        if lines:
            out.append("user source:")
            out += [f"  {ln}" for ln in lines]
        out.append(f"iteration space: {list(self.region.size)} (numel {numel})")
        if self.assumptions:  # guards of the entry: a call that breaks one recompiles
            out.append("assumes (guarded; a call that breaks one recompiles):")
            out += [f"  {why}" for _, why in self.assumptions]
        out += extra
        out.append(f"stores: {', '.join(self.region.stores)}")
        return out


class ReductionPlan(RegionPlan):
    """A reduction region's kernel, backend-neutral: rows (the kept dims) by elements reduced per
    row; each member at a level (a reduction one level above what it reads); full-row members
    (computed per element of the row) and per-row ones. Mixed in before a printer's pointwise
    writer: `class ReductionWriter(ReductionPlan, KernelWriter)`."""

    INT_DIV = "//"  # how the printer spells floor division of (non-negative) row indices

    def __init__(
        self, region: Region, graph: ir.LoopGraph, hints: dict[sympy.Symbol, int], options: CompileOptions
    ):
        super().__init__(region, graph, hints, options)
        space = region.reduction
        self.space = space
        self.kept = [k for k in range(len(space.full)) if k not in space.reduced]
        c = space.vars
        self.vars = list(c)
        self.subst = lambda e: e
        self.bodies = {}
        self.nodes = {n.name: n for n in region.nodes}
        for name, body in region.bodies.items():
            mapping = space.placement(self.nodes[name])
            self.bodies[name] = ir.substitute(
                body, lambda r: r, lambda e, m=mapping: sympy.sympify(e).xreplace(m)
            )
        self.rvars = {c[k] for k in space.reduced}
        self.level = {}
        for name in sorted(self.bodies, key=lambda n: [m.name for m in region.nodes].index(n)):
            self.level[name] = self.node_level(name)
        self.scopes: list[tuple[list[str], dict, dict, str]] = []
        self.online: dict[str, online.Online] = {}  # sums folded into an earlier loop

    def row_shape(self) -> tuple[sympy.Expr, sympy.Expr, int, bool]:
        """(rows, elements per row, the example row length, persistent?): a persistent kernel
        keeps a whole row in registers (one read of memory), a looped one walks it in chunks."""
        space = self.space
        xnumel = sympy.Mul(*[space.full[k] for k in self.kept]) if self.kept else sympy.Integer(1)
        rnumel = sympy.Mul(*[space.full[k] for k in space.reduced]) if space.reduced else sympy.Integer(1)
        rhint = hint(rnumel, self.hints)
        mode = self.options.reduction
        persistent = mode == "persistent" or (mode == "auto" and rhint <= self.options.persistent_max)
        return xnumel, rnumel, rhint, persistent

    def walk(self) -> str:
        """How memory runs along the kernel's rows: "inner" where consecutive reduced elements are
        adjacent (a softmax's row), "outer" where the kept dims are and consecutive reduced elements
        lie a stride apart (a sum over the first dim: a tile then spans many rows, few elements of
        each). Every full-row read and store votes with its bytes."""
        space = self.space
        kept = [k for k in self.kept if space.full[k] != 1]
        reduced = [k for k in space.reduced if space.full[k] != 1]
        if not kept or not reduced:
            return "inner"
        x, r = space.vars[kept[-1]], space.vars[reduced[-1]]
        votes = {"inner": 0, "outer": 0}
        for name, index in self.memory_accesses():
            lay = self.layout(name)
            linear = linear_coeffs(lay.offset_of(index), [x, r])
            if linear is None:
                continue
            along_x, along_r = linear[1]
            if along_r == 0:  # one element a row
                continue
            walk = "inner" if along_r == 1 else "outer" if along_x == 1 else None
            if walk is not None:
                votes[walk] += hint(sympy.Mul(*lay.size), self.hints) * lay.dtype.itemsize
        return "outer" if votes["outer"] > votes["inner"] else "inner"

    def narrowest(self) -> int:
        """Bytes of the narrowest element the kernel reads or stores along its rows."""
        return min((self.layout(name).dtype.itemsize for name, _ in self.memory_accesses()), default=4)

    def memory_accesses(self) -> list[tuple[str, ir.Index]]:
        """(buffer, index) of each read from memory and each full-row store, in canonical coordinates."""
        reads = [a for b in self.bodies.values() for a in ir.reads(b) if not self.in_registers(a)]
        stores = [(s, self.space.value_index(self.nodes[s])) for s in self.region.stores if self.is_full(s)]
        return [(a.name, a.index) for a in reads] + stores

    @functools.cached_property
    def reductions(self) -> list[str]:
        """The region's reductions by name, in the region's order."""
        return [n.name for n in self.region.nodes if isinstance(n, ReduceNode)]

    def acc(self, name: str, kind: str = "acc") -> str:
        """The running value (`kind`: acc, idx, or Welford's half_first, mean, m2) of reduction
        `name` in a kernel's text: named by its place among the region's reductions, not by its
        node, so that the same layer of another block is the same code (codegen/share.py)."""
        return f"{kind}_{self.reductions.index(name)}"

    def running_values_header(self) -> str:
        """The header line that says which reduction each running value's index names."""
        names = ", ".join(f"{k} {n}" for k, n in enumerate(self.reductions))
        return f"running values (acc_<k>, ...): {names}"

    def reductions_by_level(self) -> list[list[ReduceNode]]:
        """The region's reductions, one list per level, innermost level first."""
        levels = sorted({self.level[n] for n in self.reductions})
        return [[self.nodes[n] for n in self.reductions if self.level[n] == level] for level in levels]

    def node_level(self, name: str) -> int:
        deps = [r.name for r in ir.reads(self.bodies[name]) if r.name in self.bodies]
        base = max((self.level[d] for d in deps), default=0)
        return base + 1 if isinstance(self.nodes[name], ReduceNode) else base

    def is_full(self, name: str) -> bool:
        if isinstance(self.nodes[name], ReduceNode):
            return False
        return any(
            sympy.sympify(i).free_symbols & self.rvars for i in self.space.value_index(self.nodes[name])
        )

    def in_registers(self, r: Read) -> bool:
        return r.name in self.bodies and r.index == self.space.value_index(self.nodes[r.name])

    def node_value(self, name: str) -> str:
        if name in self.values:
            return self.values[name]
        if isinstance(self.nodes[name], ReduceNode):
            raise AssertionError(f"reduction {name} read before its loop finished")
        if self.is_full(name):
            self.values[name] = self.emit(self.bodies[name])
            return self.values[name]
        if not self.scopes:
            # persistent: an outer value is one per row, [XBLOCK, 1], whatever lanes read it
            # (under xrmask its loads would be [XBLOCK, RBLOCK], which its store cannot take)
            full_mask, self.mask = self.mask, "xmask" if self.mask == "xrmask" else self.mask
            self.values[name] = self.emit(self.bodies[name])
            self.mask = full_mask
            return self.values[name]
        # an outer value needed inside a loop is computed before the loop, once per row
        inner = (self.lines, self.cse, self.mask)
        self.lines, self.cse, _, self.mask = self.scopes[-1]
        value = self.emit(self.bodies[name])
        outer_values = self.scopes[-1][2]
        outer_values[name] = value
        self.lines, self.cse, self.mask = inner
        self.values[name] = value
        return value

    def var_lines(self, index: str, dims: list[int]) -> list[str]:
        sizes = [self.space.full[k] for k in dims]
        out = []
        for j, k in enumerate(dims):
            inner = sympy.Mul(*sizes[j + 1 :]) if j + 1 < len(sizes) else sympy.Integer(1)
            expr = f"{index} {self.INT_DIV} ({self.index(inner)})" if inner != 1 else index
            if j > 0:
                expr = f"({expr}) % ({self.index(sizes[j])})"
            out.append(self.index_line(f"c{k}", expr))
        return out

    def index_line(self, name: str, expr: str) -> str:
        return f"{name} = {expr}"

    def online_header(self) -> list[str]:
        what = {"softmax": "online softmax, rescaled to", "welford": "Welford, around"}
        return [
            f"{n}: in the pass before ({what[f.kind]} {ir.format_expr(f.shift)})"
            for n, f in self.online.items()
        ]


class ScatterPlan(RegionPlan):
    """Writes through indices (`ScatterNode`s over the same elements, into memory of their own:
    gjit/fusion/writes.py): a pointwise kernel over the source's elements whose stores, one per
    write, go to the elements the bodies' `WriteAt`s name. The printers mask out writes whose
    index is out of bounds (eager raises; `asserts` says where the kernel asserts)."""

    def writes(self) -> list[tuple[ScatterNode, ir.WriteAt]]:
        return [(n, self.region.bodies[n.name]) for n in self.region.nodes]

    def asserts(self, node: ScatterNode) -> bool:
        """Whether `node`'s indices are asserted in bounds: in debug mode, and where it writes into a
        graph input (the caller's memory, a KV cache: out of bounds fails, as eager's write does,
        rather than leave the caller's tensor stale)."""
        return self.options.debug or getattr(self.graph.buffers.get(node.base), "kind", None) == "input"

    def accesses(self) -> list[sympy.Expr]:
        out = []
        for node, write in self.writes():
            out += [self.layout(r.name).offset_of(r.index) for r in ir.reads(write)]
            out.append(self.layout(node.name).offset_of(write.index))
        return out

    def primary_access(self, idx: ir.Index) -> sympy.Expr | None:
        reads = ir.reads(self.writes()[0][1].value)
        return self.layout(reads[0].name).offset_of(reads[0].index) if reads else None

    def nondeterministic(self) -> bool:
        """Float atomics: the order of additions, so the last bits, vary between runs."""
        return any(
            n.reduce == "sum" and self.layout(n.name).dtype.is_floating_point for n, _ in self.writes()
        )

    def scatter_header(self) -> list[str]:
        out = []
        for node, write in self.writes():
            target = ", ".join(map(str, write.index))
            how = {"store": "stores", "sum": "adds (atomic)", "max": "takes the max (atomic)",
                   "min": "takes the min (atomic)", "nan": "stores the NaN values"}[node.reduce]  # fmt: skip
            out.append(
                f"writes into {node.base}'s memory: {how} at [{target}], out-of-bounds indices skipped"
            )
        return out
