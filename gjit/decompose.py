"""Decomposition to core ATen: node by node where the exported graph allows it, else torch's
`run_decompositions()` over the whole program.

`run_decompositions()` traces the whole program again, twice, through functionalization, and
every symbolic size of every op is worked out again: on the tiny HF models that is more than
half of a cold compile. An exported graph that mutates nothing is already functional, so most
of that work is redone for nothing. Such a graph is decomposed here one node at a time: a node
whose op the table decomposes is traced alone with `make_fx` over its arguments' fake values
(in export's fake mode, so every size stays a symbol of export's shape environment and every
guard lands there), and the traced ops replace it; every other node is kept as it is.

Anything the node-by-node pass cannot vouch for goes through `run_decompositions()` whole: a
mutating or aliasing-write op (but `detach_`, which changes autograd's flag, not a value, and is
its input here: transformers' DynamicCache makes one with `torch.tensor([])`), a higher-order op
or submodule, a call of anything but an ATen op, a symbolic-size function or `getitem`, a
decomposition whose trace fails.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import re
from collections.abc import Callable
from typing import Any

import sympy
import torch
import torch.utils._pytree as pytree
from torch._dispatch.python import enable_python_dispatcher
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    ExportGraphSignature,
    OutputSpec,
    SymBoolArgument,
    SymFloatArgument,
    SymIntArgument,
    TensorArgument,
)
from torch.func import functionalize
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from gjit import logs, stats
from gjit.capture import DecompositionError, Exported, shape_env_of, size_oblivious
from gjit.stats import timed

try:  # run_decompositions()'s own rules: which CompositeImplicitAutograd op it may keep, how it
    # updates ranges and the module call graph (torch 2.13); a torch without them decomposes whole
    from torch._export.utils import _get_decomp_for_cia, _is_aten_op, _is_cia_op, _is_preservable_cia_op
    from torch.export.exported_program import _get_updated_module_call_graph, _get_updated_range_constraints
except ImportError:  # pragma: no cover
    _is_cia_op = None

log = logs.logger("capture")

# python functions an exported graph calls on sizes (and getitem of a multi-output op): pure ones
SIZE_FUNCTIONS = (
    frozenset(
        getattr(operator, name)
        for name in (
            "add sub mul truediv floordiv mod pow neg pos abs and_ or_ xor not_ invert lshift rshift "
            "eq ne lt le gt ge truth getitem"
        ).split()
    )
    | frozenset(f for f in vars(math).values() if callable(f))
    | {
        torch.sym_float,
        torch.sym_int,
        torch.sym_max,
        torch.sym_min,
        torch.sym_not,
        torch.sym_ite,
        torch.sym_sum,
    }
)

SYM_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)
# output specs that name the node producing the output
NAMED_ARGUMENTS = (TensorArgument, SymIntArgument, SymFloatArgument, SymBoolArgument)

# node meta kept from a decomposed node on the nodes that replace it (source lines, module path)
KEPT_META = ("stack_trace", "nn_module_stack", "source_fn_stack", "torch_fn", "from_node", "custom")


def decompose(
    exported: Exported,
    timings: dict[str, float],
    lowered: Callable[[torch.fx.Node], bool] | None = None,
) -> tuple[ExportedProgram, list[sympy.Basic]]:
    """Core ATen, SDPA kept whole (node by node, else `run_decompositions()`), timed as "decompose".
    Returns the decomposed program and the shape guards decomposition added to export's shape
    environment (a decomposition that branches on a size): a warm start, which does not
    decompose, gets them from the on-disk entry. `lowered` (the driver's: whether gjit lowers a
    node or keeps it an extern on purpose): any other is then decomposed with torch.compile's
    table where it has an entry."""
    env = shape_env_of(exported.user_vals)
    oblivious = bool(exported.from_one)
    before = len(env.guards) if env is not None else 0
    try:  # as export traced: size-obliviously when a dim was asked from 1
        with timed("decompose", timings), logs.quiet_torch_trace_errors(), size_oblivious(oblivious):
            decomposed, how = decompose_program(exported.program)
            if lowered is not None:
                decomposed = _decompose_unlowered(decomposed, lowered)
    except Exception as e:
        raise DecompositionError(f"run_decompositions failed: {type(e).__name__}: {e}") from e
    stats.count("decompositions")
    stats.count("decompositions_by_node" if how == "nodes" else "decompositions_whole")
    added = [g.expr for g in env.guards[before:]] if env is not None else []
    return decomposed, added


def _decompose_unlowered(program: ExportedProgram, lowered: Callable) -> ExportedProgram:
    try:
        decomposed, ops = decompose_unlowered(program, lowered)
    except Exception as e:  # noqa: BLE001 - the ops stay externs, as they were
        log.info("torch.compile's decompositions of ops without a lowering failed, kept whole: %s", e)
        return program
    if ops:
        log.info("decomposed for lack of a lowering (torch.compile's decompositions): %s", ", ".join(ops))
        stats.count("decomposed_for_lowering", len(ops))
    return decomposed


def _default_table():
    """torch.export's default table, SDPA kept whole: decomposing it breaks run_decompositions()
    on GPT-2 in torch 2.13 (a view of the decomposed output) and a fused attention extern beats
    its decomposition."""
    table = torch.export.default_decompositions()
    table.pop(torch.ops.aten.scaled_dot_product_attention.default, None)
    # a kernel of its own (gjit/lowering/scatters.py); the table's index_put of `source * alpha`
    # has the wrong dtype for a bool tensor
    table.pop(torch.ops.aten.index_add.default, None)
    return table


@functools.cache
def decomposition_table() -> dict:
    """Core ATen decompositions with every namespace's CompositeImplicitAutograd ops: what
    run_decompositions() takes. Materializing the other namespaces asks the dispatcher about
    every op it has (about 0.1 s), so it is built once per process, and only when needed."""
    return _default_table().materialize()


@functools.cache
def _aten_table() -> dict:
    """The table's ATen entries alone (what torch.export loads up front, without asking the
    dispatcher about other namespaces); a torch without that split gives the whole table."""
    table = _default_table()
    aten = getattr(table, "decomp_table", None)
    return dict(aten) if isinstance(aten, dict) and _is_cia_op is not None else table.materialize()


def node_table(program: ExportedProgram) -> dict:
    """The table node-by-node decomposition needs for `program`: the ATen entries, with the
    program's own CompositeImplicitAutograd ops of other namespaces (`with_program_ops`)."""
    return with_program_ops(_aten_table(), program)


def with_program_ops(table: dict, program: ExportedProgram) -> dict:
    """`table` plus, for each CompositeImplicitAutograd op of another namespace that the program
    calls and the table lacks, its CIA kernel, as torch.export's full table has it: an op
    registered after a table was built (a library loaded later) decomposes too. A torch without
    export's CIA helpers gets `table` as it is."""
    if _is_cia_op is None:
        return table
    custom = {
        n.target
        for n in program.graph.nodes
        if isinstance(n.target, torch._ops.OpOverload)
        and n.target not in table
        and not _is_aten_op(n.target)
        and _is_cia_op(n.target)
        and _is_preservable_cia_op(n.target)
    }
    return {**table, **{op: _get_decomp_for_cia(op) for op in custom}} if custom else table


def decompose_program(program: ExportedProgram) -> tuple[ExportedProgram, str]:
    """The program in core ATen, and how: "nodes" (node by node) or "whole" plus the reason."""
    reason = whole_program_reason(program) if _is_cia_op is not None else "an older torch"
    if reason is None:
        try:
            return decompose_nodes(program, node_table(program)), "nodes"
        except Exception as e:  # noqa: BLE001 - torch's own pass is the fallback, and it is exact
            reason = f"a node's decomposition failed alone ({type(e).__name__}: {e})"
    log.debug("run_decompositions() over the whole program: %s", reason)
    return program.run_decompositions(with_program_ops(decomposition_table(), program)), f"whole: {reason}"


# what a node decomposed for lack of a lowering records in its meta "custom"
DECOMPOSED_FROM = "gjit_decomposed_from"
# ops never decomposed for lack of a lowering: heavy ops ATen runs best (matmul, convolution,
# attention), random ops (an extern keeps eager's random stream), in-place and backward ops
KEEP_WHOLE = re.compile(
    r"mm|mv|conv|attention|bernoulli|normal|rand|uniform|exponential|cauchy|geometric"
    r"|dropout|rrelu|noise|_foreach|backward|quantized"
    # round(decimals=) as round(x * 10^d) * 10^-d drifts from eager's x * 10^d, round, / 10^d by an
    # ulp in float32 and overflows float16 (10000 * 10 = inf): ATen's is exact
    r"|^round\."
)


@functools.cache
def fallback_table() -> dict:
    """torch.compile's own decompositions (Inductor's table), for ops gjit has no lowering for."""
    from torch._inductor.decomposition import select_decomp_table

    return {
        op: fn
        for op, fn in select_decomp_table().items()
        if isinstance(op, torch._ops.OpOverload)
        and not op._schema.is_mutable
        and torch.Tag.nondeterministic_seeded not in op.tags  # its decomposition draws differently
        and not KEEP_WHOLE.search(op.name().split("::")[-1])
    }


def decompose_unlowered(
    program: ExportedProgram, lowered: Callable[[torch.fx.Node], bool]
) -> tuple[ExportedProgram, list[str]]:
    """The core-ATen program with each node gjit cannot lower (`lowered` says) and torch.compile
    decomposes replaced by that decomposition, whose pieces gjit lowers: bilinear upsampling and
    grid_sample into index math and gathers. Returns the program and the
    ops decomposed. A program node-by-node decomposition cannot vouch for is left as it is."""
    unlowered = [
        n
        for n in program.graph.nodes
        if isinstance(n.target, torch._ops.OpOverload)  # what the table has entries for
        and isinstance(n.meta.get("val"), torch.Tensor | tuple | list)
        and not lowered(n)
    ]
    if not unlowered:  # the usual case: Inductor's table (an import of about 70 ms) is not needed
        return program, []
    table = fallback_table()
    picked = {n for n in unlowered if n.target in table}
    if not picked or whole_program_reason(program) is not None:
        return program, []
    targets = {n.target for n in picked}
    trace_table = {**node_table(program), **{op: table[op] for op in targets}}
    decomposed = decompose_nodes(program, trace_table, pick=picked.__contains__, tag=True)
    return decomposed, sorted(map(str, targets))


def whole_program_reason(program: ExportedProgram) -> str | None:
    """Why this program needs `run_decompositions()` whole (functionalization), or None."""
    signature = program.graph_signature
    if signature.buffers_to_mutate or signature.user_inputs_to_mutate or signature.backward_signature:
        return "it mutates a buffer or an input"
    for node in program.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if free_unbacked_symbols(node.meta.get("val")):  # the retrace often finds the size as an
            return f"{node.name}'s size is data-dependent"  # expression of the inputs' sizes
        if node.op != "call_function":
            return f"{node.op} {node.target}"
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            schema = target._schema
            if schema.is_mutable and target is not torch.ops.aten.detach_.default:
                return f"{target} writes an argument in place"
            continue
        if target not in SIZE_FUNCTIONS:
            return f"it calls {getattr(target, '__name__', target)}"
    return None


def decompose_nodes(
    program: ExportedProgram,
    table: dict,
    pick: Callable[[torch.fx.Node], bool] | None = None,
    tag: bool = False,
) -> ExportedProgram:
    """The program with every node `pick` chooses (default: those run_decompositions() would
    replace) replaced by its decomposition traced with `table`. `tag`: the new nodes' meta
    "custom" names the op they came from (explain lists it; torch's serializer keeps it)."""
    pick = pick or (lambda node: decomposes(node, table))
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, Any] = {}  # old node -> new node, or a tree of them for multi-output ops
    traces: dict[tuple, torch.fx.GraphModule] = {}
    for node in program.graph.nodes:
        if node.op == "call_function" and node.target is operator.getitem and node.args[0] in env:
            value = env[node.args[0]]
            if not isinstance(value, torch.fx.Node):  # an item of a decomposed multi-output op
                env[node] = value[node.args[1]]
                continue
        if node.target is torch.ops.aten.detach_.default:  # autograd's flag, not a value: its input
            env[node] = env[node.args[0]]
        elif node.op == "call_function" and pick(node):
            env[node] = _inline(graph, node, env, table, traces, tag)
        else:
            env[node] = graph.node_copy(node, lambda n: _one_node(env[n]))
            if node.op == "placeholder" and env[node].name != node.name:  # a builtin's name, as export
                env[node].name = env[node].target = node.name  # names inputs (the signature says so)
    graph.eliminate_dead_code()  # outputs of a decomposition nobody reads (a norm's saved stats)
    graph_module = torch.fx.GraphModule(program.graph_module, graph)
    graph_module.meta.update(program.graph_module.meta)
    signature = _renamed_outputs(program.graph_signature, program.graph, graph)
    return ExportedProgram(
        root=graph_module,
        graph=graph_module.graph,
        graph_signature=signature,
        state_dict=program.state_dict,
        # as run_decompositions() updates them: a decomposition's guard may have replaced a symbol
        range_constraints=_get_updated_range_constraints(graph_module, program.range_constraints),
        module_call_graph=_get_updated_module_call_graph(
            program.graph_module, program.graph_signature, graph_module, signature, program.module_call_graph
        ),
        example_inputs=program.example_inputs,
        constants=program.constants,
    )


def _one_node(value: Any) -> torch.fx.Node:
    if not isinstance(value, torch.fx.Node):  # a multi-output op read other than by getitem
        raise NotImplementedError("a decomposed multi-output op is read whole")
    return value


def decomposes(node: torch.fx.Node, table: dict) -> bool:
    """Whether run_decompositions() would replace this node: its op is in the table, or it is a
    CompositeImplicitAutograd op export never keeps (one that may alias, like reshape or `to`).
    A size query (sym_size) stays."""
    op = node.target
    if not isinstance(op, torch._ops.OpOverload) or not isinstance(
        node.meta.get("val"), torch.Tensor | tuple | list
    ):
        return False
    return op in table or (_is_cia_op(op) and not _is_preservable_cia_op(op))


def _inline(
    graph: torch.fx.Graph, node: torch.fx.Node, env: dict, table: dict, traces: dict, tag: bool = False
) -> Any:
    """Trace `node`'s op alone over its arguments' fake values and copy the traced ops into
    `graph`; returns what replaces the node (a node, or a tuple of them). A trace is reused for
    a node of the same op over arguments of the same sizes, strides and dtypes (`traces`, one
    program's: the 15 projections of a tiny Llama are traced 3 times)."""
    args = pytree.tree_map_only(torch.fx.Node, lambda n: _Arg(n, n.meta["val"]), (node.args, node.kwargs))
    flat, spec = pytree.tree_flatten(args, is_leaf=lambda a: isinstance(a, _Arg))
    traced_at = [i for i, a in enumerate(flat) if isinstance(a, _Arg)]
    key = _trace_key(node, flat, spec)
    traced = traces.get(key) if key is not None else None
    if traced is None:
        traced = _trace(node, flat, spec, traced_at, table)
        if key is not None:
            traces[key] = traced
    inputs = iter(env[flat[i].node] for i in traced_at)
    mapping: dict[torch.fx.Node, Any] = {}
    result = None
    for sub in traced.graph.nodes:
        if sub.op == "placeholder":
            mapping[sub] = next(inputs)
        elif sub.op == "output":
            result = pytree.tree_map_only(torch.fx.Node, mapping.__getitem__, sub.args[0])
        elif sub.op == "call_function":
            if _writes_in_place(sub):
                raise NotImplementedError(
                    f"{node.target} decomposes into {sub.target}, which writes in place"
                )
            new = graph.node_copy(sub, lambda n: mapping[n])
            for name in KEPT_META:
                if name in node.meta:
                    new.meta[name] = node.meta[name]
            if tag:
                new.meta["custom"] = {**node.meta.get("custom", {}), DECOMPOSED_FROM: str(node.target)}
            mapping[sub] = new
        else:  # a constant tensor the decomposition made (get_attr): not inlined here
            raise NotImplementedError(f"the decomposition of {node.target} holds a {sub.op} ({sub.target})")
    if (
        isinstance(result, (list, tuple))
        and len(result) == 1
        and not isinstance(node.meta["val"], (list, tuple))
    ):
        result = result[0]
    if isinstance(result, torch.fx.Node):
        result = _as_dtype_of(graph, node, result)
    return result


def _as_dtype_of(graph: torch.fx.Graph, node: torch.fx.Node, result: torch.fx.Node) -> torch.fx.Node:
    """`result` in `node`'s dtype: some of torch's decompositions return another one
    (select_scatter of a bool tensor with an int64 source gives int64, eager bool)."""
    want, got = node.meta["val"], result.meta.get("val")
    if not (isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor)) or want.dtype == got.dtype:
        return result
    log.debug("the decomposition of %s gives %s, eager %s: cast back", node.target, got.dtype, want.dtype)
    cast = graph.call_function(torch.ops.aten._to_copy.default, (result,), {"dtype": want.dtype})
    cast.meta.update({name: node.meta[name] for name in KEPT_META if name in node.meta})
    cast.meta["val"] = got.to(want.dtype)
    return cast


@dataclasses.dataclass(frozen=True)
class _Arg:
    """A node argument of a node being decomposed, with its fake value."""

    node: torch.fx.Node
    val: Any


def _trace(
    node: torch.fx.Node, flat: list, spec: Any, traced_at: list[int], table: dict
) -> torch.fx.GraphModule:
    op = node.target

    def call(*values):
        leaves = list(flat)
        for i, value in zip(traced_at, values, strict=True):
            leaves[i] = value
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        return op(*args, **kwargs)

    values = [flat[i].val for i in traced_at]
    fake_mode = torch._guards.detect_fake_mode([*values, node.meta["val"]])  # export's
    if fake_mode is None:
        raise NotImplementedError(f"{op} has no fake tensor argument")
    with fake_mode, enable_python_dispatcher():  # CIA decompositions written in Python, as in export
        traced = make_fx(call, decomposition_table=table)(*values)
        if any(_writes_in_place(n) for n in traced.graph.nodes):
            # a decomposition that restrides or fills its own fresh result in place
            # (adaptive_avg_pool1d's squeeze is an as_strided_): functionalized, as export's
            # whole-program pass would; a write to an argument stays a copy_ (_inline refuses it)
            traced = make_fx(functionalize(traced, remove="mutations"))(*values)
        return traced


def _writes_in_place(node: torch.fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable


def _trace_key(node: torch.fx.Node, flat: list, spec: Any) -> tuple | None:
    """What a node's traced decomposition depends on: the op, the arguments' structure and
    constants, each tensor's sizes, strides, offset and dtype (as export's expressions), which
    arguments are the same node. None when a value is not one to key on."""
    if free_unbacked_symbols(node.meta.get("val")):
        return None
    first: dict[torch.fx.Node, int] = {}
    parts: list[Any] = [node.target, str(spec)]
    for i, leaf in enumerate(flat):
        if not isinstance(leaf, _Arg):  # 1, 1.0 and True are equal keys, and so are 0.0 and -0.0:
            parts.append((type(leaf).__name__, repr(leaf)))  # the type and the spelling tell them apart
            continue
        val = leaf.val
        if isinstance(val, torch.Tensor):
            desc = (str(val.shape), str(val.stride()), str(val.storage_offset()), val.dtype, str(val.device))
        elif isinstance(val, SYM_TYPES):
            desc = (type(val).__name__, str(val))
        else:
            return None
        parts.append((desc, first.setdefault(leaf.node, i)))
    key = tuple(parts)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _renamed_outputs(
    signature: ExportGraphSignature, old: torch.fx.Graph, new: torch.fx.Graph
) -> ExportGraphSignature:
    """The signature with each output spec naming the node that now produces that output."""
    old_outputs = pytree.tree_leaves(old.output_node().args[0])
    new_outputs = pytree.tree_leaves(new.output_node().args[0])
    specs = []
    for spec, before, after in zip(signature.output_specs, old_outputs, new_outputs, strict=True):
        renamed = isinstance(after, torch.fx.Node) and after.name != before.name
        if renamed and isinstance(spec.arg, NAMED_ARGUMENTS):
            spec = OutputSpec(kind=spec.kind, arg=type(spec.arg)(name=after.name), target=spec.target)
        specs.append(spec)
    return ExportGraphSignature(input_specs=list(signature.input_specs), output_specs=specs)
