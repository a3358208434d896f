"""Decomposition to core ATen: node by node where the exported graph allows it, else torch's
`run_decompositions()` over the whole program.

`run_decompositions()` traces the whole program again, twice, through functionalization, and
every symbolic size of every op is worked out again: about 20 ms a node (T5-small: 20 s), more
than half of a cold compile. An exported graph that mutates nothing is already functional, so
most of that work is redone for nothing. Such a graph is decomposed here one node at a time: a
node whose op the table decomposes is traced alone with `make_fx` over its arguments' fake
values (in export's fake mode, so every size stays a symbol of export's shape environment and
every guard lands there), and the traced ops replace it; every other node is kept as it is.
Traces are shared between nodes (gjit/capture/traces.py), so the cost is the number of distinct ops.

A write in place into a value the graph made and nothing else sees (T5's
`relative_buckets += ...`: fresh memory, no view of it, no reader after) is decomposed node by
node too, as its functional op (`private_write_reason`). Anything else the node-by-node pass
cannot vouch for goes through `run_decompositions()` whole: a write into an input, a buffer or
a value something else may see (but `detach_`, which changes autograd's flag, not a value, and
is its input here: transformers' DynamicCache makes one with `torch.tensor([])`), a higher-order
op or submodule, a call of anything but an ATen op, a symbolic-size function or `getitem`, a
decomposition whose trace fails.
"""

from __future__ import annotations

import functools
import math
import operator
import re
from collections.abc import Callable
from typing import Any

import sympy
import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    ExportGraphSignature,
    OutputSpec,
    SymBoolArgument,
    SymFloatArgument,
    SymIntArgument,
    TensorArgument,
)
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from gjit import logs, stats
from gjit.capture.attention_sizes import guard_attention_sizes
from gjit.capture.export import DecompositionError, Exported, shape_env_of, size_oblivious
from gjit.capture.traces import Arg, Traces, writes_in_place
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
    environment (a decomposition that branches on a size; the sizes SDPA needs equal,
    gjit/capture/attention_sizes.py): a warm start, which does not decompose, gets them from
    the on-disk entry. `lowered` (the driver's: whether gjit lowers a
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
    guard_attention_sizes(decomposed.graph_module)  # its guards are the entry's shape guards too
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
    position: dict[torch.fx.Node, int] = {}  # each node's place in the graph, when a write asks
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
            if writes_in_place(node) and target is not torch.ops.aten.detach_.default:
                position = position or {n: i for i, n in enumerate(program.graph.nodes)}
                reason = private_write_reason(node, position)
                if reason is not None:
                    return reason
            continue
        if target not in SIZE_FUNCTIONS:
            return f"it calls {getattr(target, '__name__', target)}"
    return None


def private_write_reason(node: torch.fx.Node, position: dict[torch.fx.Node, int]) -> str | None:
    """Why `node`'s write in place needs functionalization of the whole program, or None: it
    writes one argument, a value the graph made in fresh memory (its op returns no alias, or it
    is such a write itself), that no view shares and nothing reads after the write. Then only
    the node's own result shows what it wrote, and its functional op computes the same value
    (T5's relative position buckets: `relative_buckets += ...` on a tensor it made)."""
    written = _written_argument(node)
    why = f"{node.target} writes an argument in place"
    if written is None:
        return why
    if written.op == "placeholder":
        return f"{why} (the program's input {written.name})"
    chained = _written_argument(written) is not None  # x += a; x *= b: a private write itself
    if not (_makes_fresh_memory(written) or (chained and private_write_reason(written, position) is None)):
        return f"{why} ({written.name}, which may share memory with another value)"
    for user in written.users:
        if user is node:
            continue
        if position[user] > position[node]:
            return f"{why} ({written.name}, which {user.name} reads after)"
        if not _makes_fresh_memory(user):
            return f"{why} ({written.name}, which {user.name} may alias)"
    return None


def _written_argument(node: torch.fx.Node) -> torch.fx.Node | None:
    """The one argument `node`'s op writes in place and returns (add_'s self, an out= tensor),
    or None (a write of several arguments, or of one it does not return)."""
    if not writes_in_place(node):
        return None
    schema = node.target._schema
    written = [
        (i, a) for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write
    ]
    if len(written) != 1 or len(schema.returns) != 1 or schema.returns[0].alias_info is None:
        return None
    index, argument = written[0]
    if schema.returns[0].alias_info.before_set != argument.alias_info.before_set:
        return None
    value = (
        node.kwargs.get(argument.name) if argument.kwarg_only or index >= len(node.args) else node.args[index]
    )
    return value if isinstance(value, torch.fx.Node) else None


def _makes_fresh_memory(node: torch.fx.Node) -> bool:
    """Whether `node` is an ATen op whose results alias none of its arguments."""
    return (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and all(r.alias_info is None for r in node.target._schema.returns)
    )


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
    traces = Traces()
    for node in program.graph.nodes:
        if node.op == "call_function" and node.target is operator.getitem and node.args[0] in env:
            value = env[node.args[0]]
            if not isinstance(value, torch.fx.Node):  # an item of a decomposed multi-output op
                env[node] = value[node.args[1]]
                continue
        if node.target is torch.ops.aten.detach_.default:  # autograd's flag, not a value: its input
            env[node] = env[node.args[0]]
        elif node.op == "call_function" and writes_in_place(node):  # a private write (whole_program_reason)
            env[node] = _inline(graph, node, env, table, traces, tag, written=_written_argument(node))
        elif node.op == "call_function" and pick(node):
            env[node] = _inline(graph, node, env, table, traces, tag)
        else:
            env[node] = graph.node_copy(node, lambda n: _one_node(env[n]))
            if node.op == "placeholder" and env[node].name != node.name:  # a builtin's name, as export
                env[node].name = env[node].target = node.name  # names inputs (the signature says so)
    graph.eliminate_dead_code()  # outputs of a decomposition nobody reads (a norm's saved stats)
    with _use_lazy_graph_module(True):  # the program's module writes its code: this one need not
        graph_module = _make_graph_module(program.graph_module, graph)
    signature = _renamed_outputs(program.graph_signature, program.graph, graph)
    return ExportedProgram(
        root=program.graph_module,  # its attributes and meta
        graph=graph,
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
    graph: torch.fx.Graph,
    node: torch.fx.Node,
    env: dict,
    table: dict,
    traces: Traces,
    tag: bool = False,
    written: torch.fx.Node | None = None,
) -> Any:
    """Trace `node`'s op alone over its arguments' fake values and copy the traced ops into
    `graph`; returns what replaces the node (a node, or a tuple of them). `traces` (one
    program's, gjit/capture/traces.py) reuses a trace for a node of the same op over arguments of the
    same sizes, strides and dtypes, up to size symbols the shape environment cannot tell apart.
    `written`: the node writes this argument in place, privately (`private_write_reason`): it is
    traced functionalized, and the trace's copy of the new value into that argument is dropped
    (nothing reads the argument after)."""
    args = pytree.tree_map_only(torch.fx.Node, lambda n: Arg(n, n.meta["val"]), (node.args, node.kwargs))
    flat, spec = pytree.tree_flatten(args, is_leaf=lambda a: isinstance(a, Arg))
    traced = traces.get(node, flat, spec, table, functional=written is not None)
    inputs = iter(env[a.node] for a in flat if isinstance(a, Arg))
    mapping: dict[torch.fx.Node, Any] = {}
    result = None
    for sub in traced.nodes:
        if sub.op == "placeholder":
            mapping[sub] = next(inputs)
        elif sub.op == "output":
            result = pytree.tree_map_only(torch.fx.Node, mapping.__getitem__, sub.args[0])
        elif sub.op == "call_function":
            if written is not None and _copies_into(sub, mapping, env[written]):
                continue
            if writes_in_place(sub):
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


def _copies_into(sub: torch.fx.Node, mapping: dict, target: torch.fx.Node) -> bool:
    """Whether a traced node is functionalization's copy of a new value into `target`."""
    return sub.target is torch.ops.aten.copy_.default and mapping.get(sub.args[0]) is target


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
