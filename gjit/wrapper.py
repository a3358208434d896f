"""Wrapper codegen: the schedule -> one straight-line Python `call(args)` function.

The wrapper binds size symbols from the inputs, runs externs through eager ATen, builds
views on the memory they view with eager's strides (one call from the traced layout where that
memory keeps it, else ATen's own view ops), allocates what kernels store
(poisoned in debug mode), launches kernels through Triton's launcher, and returns the
graph's flat outputs.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Iterable
from typing import Any

import sympy
import torch

from gjit import ir, memory_plan
from gjit.capture.in_place import WRITTEN_BACK
from gjit.codegen.common import KernelSource
from gjit.codegen.printer import pyexpr
from gjit.fusion.regions import Region, Step
from gjit.fusion.schedule import step_reads
from gjit.lowering.attention_library import ANY_LAYOUT, MASK_FILL, STANDS_FOR
from gjit.lowering.registry import meta_layout, to_sympy

# Two externs the wrapper calls otherwise on a GPU; the functions are gjit/runtime/padded_mm.py's and
# attention_masks.py's, whose docstrings hold the measurements. Tests add "cpu" to the devices.
ALIGN_BYTES = 16  # cuBLAS's fast kernels want each output row to start on this boundary
PAD_DTYPES = (torch.float16, torch.bfloat16)
PAD_LEAST_COLUMNS = 256  # narrower outputs are never padded (the copies are the larger part)
PAD_DEVICES = {"cuda"}
PADDED_PRODUCTS = {
    torch.ops.aten.mm.default: "gjit_padded_mm",
    torch.ops.aten.addmm.default: "gjit_padded_addmm",
}
COLUMN_COPY = "gjit_column_copy"  # kernels/column_copy.py's kernel, as padded products take it
WRITTEN_OUT = "gjit_written_out"  # attention_masks.py's call for attention written out
HIDDEN_ROWS = "gjit_hidden_rows"  # attention_masks.py's rows without keys of a mask built from a fill
MASK_DTYPES = (torch.float16, torch.bfloat16)  # the fused attention kernels'; float32 keeps eager's call
MASK_DEVICES = {"cuda"}
# externs whose result is always a new contiguous tensor (ATen's, and padded_mm's), so that a view
# of it is built from its traced strides (`WrapperWriter.reinterpret`)
FRESH_CONTIGUOUS = (
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
)


# ATen ops the wrapper calls through torch's own Python bindings: the same overload with the same
# arguments, which the binding's parser unpacks where an OpOverload's call boxes each one against the
# schema (on the development machine a small convolution's call took 11.2 us that way and 5.2 us
# through torch.convolution; addmm 3.5 -> 2.0, SDPA 9.0 -> 6.4, bmm 1.9 -> 1.1). Inductor's wrapper
# calls its extern kernels so. tests/test_extern_calls.py checks that each reaches its overload. (A
# TorchFunctionMode sees `torch.mm` where it saw `aten.mm.default`; dispatch modes see the same ops.)
BINDINGS = {
    torch.ops.aten.mm.default: "torch.mm",
    torch.ops.aten.addmm.default: "torch.addmm",
    torch.ops.aten.bmm.default: "torch.bmm",
    torch.ops.aten.baddbmm.default: "torch.baddbmm",
    torch.ops.aten.convolution.default: "torch.convolution",
    torch.ops.aten.scaled_dot_product_attention.default: "torch.nn.functional.scaled_dot_product_attention",
}


def binding(op: Any) -> Callable:
    """The function `BINDINGS` names for the ATen op `op`."""
    return functools.reduce(getattr, BINDINGS[op].split(".")[1:], torch)


def padded_columns(n: int, dtype: torch.dtype) -> int:
    """N rounded up so that rows of that many elements of `dtype` start 16 bytes apart."""
    per = max(ALIGN_BYTES // dtype.itemsize, 1)
    return (n + per - 1) // per * per


def pads_product(n: object, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a product's output of `n` columns (an int; a symbolic size: never) is padded."""
    return (
        device.type in PAD_DEVICES
        and isinstance(n, int)
        and dtype in PAD_DTYPES
        and n >= PAD_LEAST_COLUMNS
        and padded_columns(n, dtype) != n
    )


def converts_mask(mask: object, query: object, device: torch.device) -> bool:
    """Whether an attention extern with these example values gets its boolean mask as an additive one."""
    return (
        device.type in MASK_DEVICES
        and isinstance(mask, torch.Tensor)
        and mask.dtype == torch.bool
        and isinstance(query, torch.Tensor)
        and query.dtype in MASK_DTYPES
    )


class WrapperError(RuntimeError):
    pass


class WrapperWriter:
    """`WrapperWriter(...).generate()` is the wrapper's source. `input_symbols`: the size symbols
    the entry's guard binds and passes in as `sizes`; `check`: call gjit_check after each kernel
    (GJIT_CHECK); `guarded`: the guard checked the inputs' strides (a torch.cond branch's come
    from its parent's wrapper unchecked)."""

    def __init__(
        self,
        graph: ir.LoopGraph,
        steps: list[Step],
        kernels: dict[str, KernelSource],
        poison: bool,
        input_symbols: list[sympy.Symbol],
        check: bool = False,
        guarded: bool = True,
    ):
        self.input_symbols = input_symbols
        self.guarded = guarded  # the inputs' strides are the entry guard's (not a torch.cond branch's)
        self.check = check
        self.graph = graph
        self.steps = steps
        self.kernels = kernels
        self.poison = poison
        self.lines: list[str] = []
        self.bound: set[sympy.Symbol] = set()
        self.defined: set[str] = set()
        self.masks: dict[tuple[str, torch.dtype], tuple[str, str]] = {}  # (mask, dtype) -> converted
        self.hidden: dict[str, str] = {}  # a built mask -> its rows that keep no key
        self.allocs: dict[int, str] = {}  # line -> an allocation's arguments (gjit/memory_plan.py)
        self.fresh: set[int] = set()  # lines whose result is new memory
        self.computed = graph.compute_nodes()
        # values the call writes back into an input -> that input (gjit/capture/in_place.py)
        owner = graph.fx_graph.owning_module
        self.written_back: dict[str, str] = {} if owner is None else owner.meta.get(WRITTEN_BACK, {})

    def sym(self, expr: Any) -> str:
        expr = to_sympy(expr) if not isinstance(expr, sympy.Basic) else expr
        missing = expr.free_symbols - self.bound
        if missing:
            raise WrapperError(
                f"size symbol(s) {sorted(map(str, missing))} cannot be bound from the graph inputs"
            )
        return pyexpr(expr)

    def bind(self, symbol: sympy.Symbol, source: str) -> None:
        if symbol not in self.bound:
            self.lines.append(f"{symbol.name} = {source}")
            self.bound.add(symbol)

    def bind_from(self, name: str, val: torch.Tensor) -> None:
        for k, s in enumerate(val.shape):
            if isinstance(to_sympy(s), sympy.Symbol):
                self.bind(to_sympy(s), f"{name}.shape[{k}]")
        for k, s in enumerate(val.stride()):
            if isinstance(to_sympy(s), sympy.Symbol):
                self.bind(to_sympy(s), f"{name}.stride({k})")

    def arg(self, a: Any) -> str:
        """An FX argument as wrapper source."""
        if isinstance(a, torch.fx.Node):
            val = a.meta.get("val")
            if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)) and a.name not in self.defined:
                return self.sym(val.node.expr)
            name = self.graph.aliases.get(a.name, a.name)
            self.ensure(name)
            return name
        if isinstance(a, (list, tuple)):
            inner = ", ".join(self.arg(x) for x in a)
            return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
        if isinstance(a, torch.SymInt):
            return self.sym(to_sympy(a))
        if isinstance(a, float) and not math.isfinite(a):
            return f"float('{a}')"
        if isinstance(a, torch.device):
            return f"torch.device({str(a)!r})"
        if isinstance(a, (torch.dtype, torch.layout, torch.memory_format)):
            return str(a)
        return repr(a)

    def ensure(self, name: str) -> None:
        """Emit the view `name` (and its bases) if the wrapper has not built it yet."""
        if name in self.defined or name not in self.graph.views:
            return
        view = self.graph.views[name]
        if self.reinterpret(name):
            return
        self.ensure(view.base)
        if view.element is None:
            self.call_aten(view.fx_node)
            return
        if view.fx_node.name not in self.defined:
            self.call_aten(view.fx_node)
        self.lines.append(f"{name} = {view.fx_node.name}[{view.element}]")
        self.defined.add(name)

    def reinterpret(self, name: str) -> bool:
        """The view `name` as one call on the memory it views, from its traced size, strides and
        offset (Inductor's `reinterpret_tensor`: about 1 us, where each ATen view op of the chain
        costs 2-7 us from Python; it checks no bounds, so GJIT_DEBUG calls the checked as_strided
        instead), where that memory's layout at the call is the traced one: a
        graph input's (the guard checks its strides; its own storage offset is added), a buffer
        the wrapper allocates in the traced strides, a product extern's new contiguous result.
        Another extern's result (its library picks the strides: SDPA's kernels, by backend) or a
        torch.cond branch's operand is tested for its traced strides first, and where they differ
        the chain's ATen view ops run. False where the chain holds an op that is not a view of the
        same dtype (the ATen ops run)."""
        root, base_node = name, None
        while root in self.graph.views:
            view = self.graph.views[root]
            target = view.fx_node.target
            if not isinstance(target, torch._ops.OpOverload) or not target.is_view:
                return False
            base_node = view.fx_node.args[0]
            root = self.graph.aliases.get(view.base, view.base)
        view = self.graph.views[name]
        val = view.fx_node.meta.get("val")
        val = val if view.element is None else val[view.element]
        base = base_node.meta.get("val") if isinstance(base_node, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor) or not isinstance(base, torch.Tensor):
            return False
        if val.dtype != base.dtype or val.is_complex() or val.is_neg() or root not in self.defined:
            return False  # (a negative view's bit, as torch's _neg_view sets it, is not in the strides)
        holds = self.traced_layout_holds(root, base_node, base)
        if not holds and root not in self.graph.buffers:
            return False
        lay = meta_layout(val)
        try:
            size, stride = (", ".join(map(self.sym, dims)) for dims in (lay.size, lay.stride))
            offset = self.sym(lay.offset - meta_layout(base).offset)
            check = "" if holds else self.strides_check(root, base)
        except WrapperError:
            return False
        comma = "," if val.dim() == 1 else ""
        fn = "gjit_as_strided" if self.poison else "gjit_reinterpret"  # debug: bounds checked
        view = f"{fn}({root}, ({size}{comma}), ({stride}{comma}), {offset})"
        if check:
            view = f"{view} if {check} else {self.view_ops(name)}"
        self.lines.append(f"{name} = {view}")
        self.defined.add(name)
        return True

    def strides_check(self, root: str, traced: torch.Tensor) -> str:
        """A test that the extern result `root` has the strides export traced, as the library
        may return other strides (SDPA's kernels do, by backend). Size-1 dims too: their strides
        address nothing, but eager's views carry them."""
        strides = [self.sym(st) for st in traced.stride()]
        return f"{root}.stride() == ({', '.join(strides)}{',' if len(strides) == 1 else ''})"

    def view_ops(self, name: str) -> str:
        """The view `name` as ATen's view ops from its root (or a link already built), in one
        expression."""
        if name in self.defined or name not in self.graph.views:
            return name
        view = self.graph.views[name]
        node = view.fx_node
        args = [self.view_ops(self.graph.aliases.get(view.base, view.base)), *map(self.arg, node.args[1:])]
        args += [f"{k}={self.arg(v)}" for k, v in node.kwargs.items()]
        call = f"{_op_name(node.target)}({', '.join(args)})"
        return call if view.element is None else f"{call}[{view.element}]"

    def traced_layout_holds(self, root: str, node: torch.fx.Node, traced: torch.Tensor) -> bool:
        """Whether the value `root` (FX node `node`) is, at every call, in the strides export traced."""
        if node.op == "placeholder":
            return self.guarded
        if root in self.graph.buffers:  # an extern's result
            contiguous = traced.is_contiguous() and traced.storage_offset() == 0
            return node.target in FRESH_CONTIGUOUS and node.name == root and contiguous
        computed = self.computed.get(root)
        if computed is None or isinstance(computed, ir.ScatterNode):
            return False
        lay, seen = computed.layout, meta_layout(traced)  # what gjit_alloc makes, what export traced
        if lay.offset != 0 or seen.offset != 0 or len(lay.size) != len(seen.size):
            return False
        return all(map(ir.statically_known_equal, (*lay.size, *lay.stride), (*seen.size, *seen.stride)))

    def call_aten(self, node: torch.fx.Node) -> None:
        if node.target is torch.ops.aten.scaled_dot_product_attention.default and self.boolean_mask(node):
            return
        args = [self.arg(a) for a in node.args]
        args += [f"{k}={self.arg(v)}" for k, v in node.kwargs.items()]
        if returns_fresh(node.target):
            self.fresh.add(len(self.lines))
        callee = self.callee(node)
        if callee in PADDED_PRODUCTS.values():  # its copy out: a kernel the graph loads and prebuilds
            args.append(f"copy={COLUMN_COPY}")
        if node.meta.get(ANY_LAYOUT):  # gjit/runtime/attention_masks.py's written_out
            stride = ", ".join(self.sym(x) for x in node.meta["val"].stride())
            args += self.built_mask(node)
            self.lines.append(f"{node.name} = {WRITTEN_OUT}({callee}, ({stride},), {', '.join(args)})")
        else:
            self.lines.append(f"{node.name} = {callee}({', '.join(args)})")
        self.defined.add(node.name)

    def built_mask(self, node: torch.fx.Node) -> list[str]:
        """For an attention written out whose mask the compile built from a fill (0 and -inf or
        FAR: gjit/lowering/attention_library.py), the call's `dead`: its queries that keep no key,
        found once per call for the attentions that share the mask (under FAR, none: eager's
        softmax averages the values there, as SDPA's does)."""
        if not node.meta.get(STANDS_FOR):  # the program's own call: ATen's rows where no key is kept
            return ["dead=None"] if node.kwargs.get("attn_mask") is not None else []
        fill = node.meta.get(MASK_FILL)
        if fill is None:
            return []
        if fill != float("-inf"):
            return ["dead=None"]
        name = self.arg(node.kwargs["attn_mask"])
        if name not in self.hidden:  # a reserved name: no FX node's
            self.hidden[name] = f"gjit_hidden{len(self.hidden)}"
            self.lines.append(f"{self.hidden[name]} = {HIDDEN_ROWS}({name})")
        return [f"dead={self.hidden[name]}"]

    def boolean_mask(self, node: torch.fx.Node) -> bool:
        """An attention extern with a boolean mask, called with the mask made additive
        (gjit/runtime/attention_masks.py; once per mask), its fully masked rows zeroed; False
        where the call stays as it is."""
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        query = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        if not isinstance(mask, torch.fx.Node):
            return False
        if not converts_mask(mask.meta.get("val"), query, self.device):
            return False
        try:  # the traced output strides, in the sizes bound so far
            stride = ", ".join(self.sym(x) for x in node.meta["val"].stride())
        except WrapperError:
            return False
        name = self.arg(mask)
        if (name, query.dtype) not in self.masks:  # reserved names: no FX node's
            k = len(self.masks)
            self.masks[name, query.dtype] = (f"gjit_mask{k}", f"gjit_dead{k}")
            self.lines.append(f"gjit_mask{k}, gjit_dead{k} = gjit_additive_mask({name}, {query.dtype})")
        additive, dead = self.masks[name, query.dtype]
        args = [additive if a is mask else self.arg(a) for a in node.args]
        args += [f"{k}={additive if v is mask else self.arg(v)}" for k, v in node.kwargs.items()]
        self.fresh.add(len(self.lines))
        self.lines.append(f"{node.name} = {self.callee(node)}({', '.join(args)})")
        self.lines.append(f"{node.name} = gjit_traced_layout({node.name}, {dead}, ({stride},))")
        self.defined.add(node.name)
        return True

    def callee(self, node: torch.fx.Node) -> str:
        """The function an extern calls: the ATen op (through torch's binding of it where it has one:
        BINDINGS), or for a product whose output rows would be misaligned for the tensor cores,
        gjit/runtime/padded_mm.py's version of it."""
        val = node.meta.get("val")
        if (
            node.target in PADDED_PRODUCTS
            and isinstance(val, torch.Tensor)
            and pads_product(val.shape[-1], val.dtype, self.device)
        ):
            return PADDED_PRODUCTS[node.target]
        return BINDINGS.get(node.target) or _op_name(node.target)

    def extern(self, step: ir.ExternNode) -> None:
        node = step.fx_node
        if node.target is operator.getitem:
            self.lines.append(f"{node.name} = {node.args[0].name}[{node.args[1]}]")
            self.defined.add(node.name)
        elif node.target is torch.ops.higher_order.cond:
            pred, true_fn, false_fn, operands = node.args
            branch = f"({true_fn.target} if {self.arg(pred)} else {false_fn.target})"
            self.lines.append(f"{node.name} = {branch}({self.arg(operands)})")
            self.defined.add(node.name)
        else:
            self.call_aten(node)
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            self.bind_from(node.name, val)
        elif isinstance(val, torch.SymInt) and isinstance(to_sympy(val), sympy.Symbol):
            self.bind(to_sympy(val), node.name)  # a data-dependent size (.item(), nonzero)

    def region(self, region: Region) -> None:
        kernel = self.kernels[region.name]
        for name in region.stores:
            node = self.graph.compute_nodes()[name]
            if isinstance(node, ir.ScatterNode):  # it writes into its base's memory, in place
                self.lines.append(f"{name} = {node.base}")
                self.defined.add(name)
                continue
            target = self.stored_into(region, name)
            if target is not None:  # the input's new value: no copy into it after the call
                self.lines.append(f"{name} = {target}  # stored into the input it updates")
                self.defined.add(name)
                continue
            lay = node.layout
            size = ", ".join(self.sym(s) for s in lay.size)
            stride = ", ".join(self.sym(s) for s in lay.stride)
            fn = "gjit_alloc_poisoned" if self.poison else "gjit_alloc"
            comma = "," if len(lay.size) == 1 else ""
            self.allocs[len(self.lines)] = f"({size}{comma}), ({stride}{comma}), {lay.dtype}"
            self.lines.append(f"{name} = {fn}(({size}{comma}), ({stride}{comma}), {lay.dtype}, gjit_device)")
            self.defined.add(name)
        numel = self.sym(kernel.numel)
        args = [*kernel.in_args, *kernel.out_args, *(s.name for s in kernel.size_args)]
        for s in kernel.size_args:
            self.sym(s)
        for cond, why in kernel.assumptions:
            if not cond.free_symbols <= set(self.input_symbols):  # guards check the others
                self.lines.append(f"assert {self.sym(cond)}, {why!r}")
        self.lines.append(f"xnumel = {numel}")
        sizes = ["xnumel"]
        if kernel.rnumel is not None:
            self.lines.append(f"rnumel = {self.sym(kernel.rnumel)}")
            sizes.append("rnumel")
        if kernel.ynumel is not None:
            self.lines.append(f"ynumel = {self.sym(kernel.ynumel)}")
            sizes.append("ynumel")
        blocks = {k: str(v) for k, v in kernel.blocks.items()}
        for k, expr in kernel.launch_blocks.items():
            self.lines.append(f"{k} = {expr}")
            blocks[k] = k
        # integer math, not triton.cdiv: a call of it from Python costs microseconds each launch
        xblock = blocks["XBLOCK"]
        if kernel.ynumel is not None:  # a 2-D tile's programs, in one grid dim
            yblock = blocks["YBLOCK"]
            grid = f"((xnumel + {xblock} - 1) // {xblock} * ((ynumel + {yblock} - 1) // {yblock}),)"
        elif not xblock.isdigit():
            grid = f"((xnumel + {xblock} - 1) // {xblock},)"
        else:
            grid = "(xnumel,)" if xblock == "1" else f"((xnumel + {int(xblock) - 1}) // {xblock},)"
        options = kernel.launch_options()
        if options["num_warps"] == 4:  # Triton's default
            del options["num_warps"]
        blocks.update((k, str(v)) for k, v in options.items())
        launch = ", ".join(f"{k}={v}" for k, v in blocks.items())
        self.lines.append("if xnumel > 0 and ynumel > 0:" if kernel.ynumel is not None else "if xnumel > 0:")
        self.lines.append(f"    {kernel.name}[{grid}]({', '.join(args + sizes)}, {launch})")
        if self.check:
            self.lines.append(f"gjit_check({kernel.name!r}, locals())")

    def stored_into(self, region: Region, name: str) -> str | None:
        """The input the region's value `name` may be stored into, or None. `name` is that input's
        new value, which the call would otherwise copy into it after the wrapper returns
        (Inductor stores such a value in place the same way). Only where the stores are the
        input's own: its layout, strides the guard checked, and a pointwise kernel that reads the
        input only at the element it stores, in the body of `name` (each element read, then
        written, by the same thread); and only where no later step and no output reads the
        input's old value."""
        target = self.written_back.get(name)
        buffer = self.graph.buffers.get(target) if target is not None else None
        if buffer is None or buffer.kind != "input" or not self.guarded or self.check:
            return None
        if region.reduction is not None or region.scatter or region.matmul or region.parts:
            return None
        mine, theirs = self.computed[name].layout, buffer.layout
        if not (ir.same_layout(mine, theirs) and ir.statically_known_equal(mine.offset, 0)):
            return None
        at = tuple(ir.index_vars(len(mine.size)))
        for stored, body in region.bodies.items():
            for read in ir.reads(body):
                if ir.resolve(self.graph, read.name) != target:
                    continue
                if stored != name or read.name != target or tuple(read.index) != at or read.indirect:
                    return None
        later = self.steps[self.steps.index(region) + 1 :]
        if any(target in step_reads(step, self.graph, {}) for step in later):
            return None
        if any(out is not None and ir.resolve(self.graph, out) == target for out in self.graph.outputs):
            return None
        return target

    def flush_asserts(self) -> None:
        """export's runtime assertions on sizes (e.g. a data-dependent size is >= 0), emitted as soon
        as their symbols are bound, so no kernel runs with a size eager would have rejected."""
        for node in list(self.pending_asserts):
            cond = node.args[0]
            val = cond.meta.get("val") if isinstance(cond, torch.fx.Node) else cond
            expr = val.node.expr if isinstance(val, torch.SymBool) else sympy.sympify(bool(val))
            if not expr.free_symbols <= self.bound:
                continue
            self.pending_asserts.remove(node)
            if expr != sympy.true:
                message = node.args[1] if len(node.args) > 1 else "runtime assertion failed"
                self.lines.append(f"if not ({self.sym(expr)}):")
                self.lines.append(f"    raise RuntimeError({str(message)!r})")

    def generate(self) -> str:
        placeholders = [n for n in self.graph.fx_graph.nodes if n.op == "placeholder"]
        self.device = graph_device(placeholders)
        if self.input_symbols:
            names = ", ".join(s.name for s in self.input_symbols)
            self.lines.append(
                f"{names}{',' if len(self.input_symbols) == 1 else ''} = sizes  # bound by the guard"
            )
            self.bound.update(self.input_symbols)
        names = [n.name for n in placeholders]
        if names:
            self.lines.append(f"{', '.join(names)}{',' if len(names) == 1 else ''} = args")
        for n in placeholders:
            self.defined.add(n.name)
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor):
                self.bind_from(n.name, val)
            elif isinstance(val, torch.SymInt) and isinstance(to_sympy(val), sympy.Symbol):
                self.bind(to_sympy(val), n.name)
        self.pending_asserts = [
            n for n in self.graph.fx_graph.nodes if n.target is torch.ops.aten._assert_scalar.default
        ]
        self.flush_asserts()
        for step in self.steps:
            if isinstance(step, Region):
                self.region(step)
            else:
                self.extern(step)
                self.flush_asserts()
        output = next(n for n in self.graph.fx_graph.nodes if n.op == "output")
        outs = [self.arg(a) for a in output.args[0]]
        self.lines.append(f"return ({', '.join(outs)}{',' if len(outs) == 1 else ''})")
        if not self.check:  # (the checker reads the call's locals)
            inputs = {n.name for n in placeholders}
            reserved = {name for pair in self.masks.values() for name in pair} | set(self.hidden.values())
            tensors = (self.defined | reserved) - inputs
            self.lines = memory_plan.plan(self.lines, self.allocs, self.fresh, tensors, inputs, self.poison)
        kernel_names = ", ".join(k.name for k in self.kernels.values())
        header = [
            "# gjit wrapper: binds sizes, runs externs and views through ATen, launches kernels",
            f"# kernels: {kernel_names or '(none)'}",
            "import torch",
            "",
            "aten = torch.ops.aten",
            f"gjit_device = torch.device({str(self.device)!r})  # of every buffer the wrapper allocates",
            "",
            "",
            "def call(args, sizes):",
        ]
        return "\n".join(header + [f"    {ln}" for ln in self.lines]) + "\n"


# externs whose results are new memory (the memory plan's): not every op whose schema says so,
# since some return their argument itself (aten.dequantize.self of a float tensor, _unsafe_view)
FRESH_RESULTS = (
    *FRESH_CONTIGUOUS,
    torch.ops.aten.scaled_dot_product_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten.convolution.default,
)


def returns_fresh(target: Any) -> bool:
    """Whether an extern's results are new memory: one of FRESH_RESULTS, an op whose schema
    also returns no alias of an argument."""
    if target not in FRESH_RESULTS:
        return False
    return all(r.alias_info is None for r in target._schema.returns)


def _op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        packet = target._schema.name.split("::")
        return (
            f"torch.ops.{packet[0]}.{target.__name__}" if packet[0] != "aten" else f"aten.{target.__name__}"
        )
    if target is operator.getitem:
        return "operator.getitem"
    if isinstance(target, torch._ops.HigherOrderOperator):  # its subgraphs run eagerly (map, scan, ...)
        return f"torch.ops.higher_order.{target.name()}"
    raise WrapperError(f"cannot call {target} from the wrapper")


def graph_device(nodes: Iterable[torch.fx.Node]) -> torch.device:
    """A graph's device: its first tensor input's, from export's example (guards keep an entry on it)."""
    for n in nodes:
        val = n.meta.get("val") if n.op == "placeholder" else None
        if isinstance(val, torch.Tensor):
            return val.device
    return torch.device("cpu")
