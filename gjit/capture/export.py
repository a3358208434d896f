"""The export: a model (module, function, ExportedProgram or .pt2 path) -> torch.export's program.

The captured program remembers how to rebuild the graph's flat inputs from a user call:
parameters and buffers are read live from the module on every call (new weights give new
results), lifted constants come from the program, user inputs come from the flattened
call. Mutations export recorded (module buffers, user inputs) are applied after the call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
import os
from typing import Any

import sympy
import torch
import torch.utils._pytree as pytree
from torch.autograd.graph import increment_version
from torch.export import Dim, ExportedProgram, ShapesCollection
from torch.export.graph_signature import InputKind, OutputKind

try:  # how export marks an int input dynamic (ShapesCollection's docstring); absent before torch 2.7
    from torch.export.dynamic_shapes import _IntWrapper
except ImportError:
    _IntWrapper = None

from gjit import locks, logs, stats
from gjit.capture import kv_cache
from gjit.capture.cache_aliases import CacheAliases
from gjit.capture.calling import as_module, constants_as_tokens, explicit_keywords
from gjit.capture.export_budget import ExportTooSlow, export_budget
from gjit.capture.in_place import (
    SHARED,
    WRITTEN_BACK,
    as_mutated_inputs,
    write_in_place,
    written_back,
    written_shared,
)
from gjit.capture.module_copy import private_tree, shares_state
from gjit.config import config
from gjit.stats import timed

log = logs.logger("capture")
graph_log = logs.logger("graph")


class CaptureError(RuntimeError):
    """torch.export could not capture the model; the caller runs it eagerly instead."""


class DecompositionError(CaptureError):
    """run_decompositions() failed on the exported program (the caller may retry static shapes)."""


def load_program(model: Any) -> ExportedProgram | None:
    if isinstance(model, ExportedProgram):
        return model
    if isinstance(model, (str, os.PathLike)):
        return torch.export.load(os.fspath(model))
    return None


# flat input -> dim -> (min, max); an int input that maps to {} is exported as a symbol
DimRanges = dict[int, dict[int, tuple[int | None, int | None]]]


def export_model(
    module: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    dims: DimRanges,
    timings: dict[str, float],
    aliases: CacheAliases,
    from_one: frozenset[tuple[int, int]] = frozenset(),
    live: torch.nn.Module | None = None,
) -> tuple[ExportedProgram, bool]:
    """torch.export with the chosen dims as Dim.AUTO (export specializes what it must), the rest static.

    `module` is the copy of `live` (the user's tree) that export traces (gjit/capture/module_copy.py); if
    the copy's trace reached the user's weights, `live` itself is exported (as without a copy).

    Not size-oblivious by default: export assumes a dynamic size is at least 2 (its range says so)
    and specializes an example size of 0 or 1, so a program that treats 1 specially (squeeze,
    broadcasting) is never reused for it; a call with size 1 gets its own entry. `from_one` holds
    the (flat input, dim) pairs gjit keeps dynamic from 1 (a KV cache's length,
    `kv_cache.dynamic_leaves`): when one is asked, the trace is size-oblivious, those dims get a
    floor of 1, every other dynamic dim keeps a floor of 2 (and one at an example size below 2
    stays static). Returns (exported, whether the trace was size-oblivious).
    """
    call = (args, kwargs)
    shapes = None
    oblivious = any((i, d) in from_one for i, ranges in dims.items() for d in ranges)
    if dims:
        shapes = ShapesCollection()
        leaves, spec = pytree.tree_flatten((args, kwargs))
        for i, ranges in dims.items():
            leaf = leaves[i]
            if isinstance(leaf, int):  # a wrapper export unwraps; without it the int stays specialized
                if _IntWrapper is not None:
                    leaves[i] = _IntWrapper(leaf)
                    shapes[leaves[i]] = Dim.AUTO(min=2)  # the policy exports only ints >= 2
            elif id(leaf) not in shapes._shapes:
                spec_dims = {}
                for d, (lo, hi) in ranges.items():
                    if not oblivious:
                        spec_dims[d] = Dim.AUTO(min=lo, max=hi)
                    elif (i, d) in from_one:
                        spec_dims[d] = Dim.AUTO(min=1, max=hi)
                    elif leaf.shape[d] >= 2:
                        spec_dims[d] = Dim.AUTO(min=max(lo or 2, 2), max=hi)
                if spec_dims:
                    shapes[leaf] = spec_dims
        args, kwargs = pytree.tree_unflatten(leaves, spec)
    # one export at a time in the process: torch's settings patched below, export's own state and
    # its tracer's hooks are process-wide (gjit/locks.py)
    with (
        locks.compiling(),
        logs.quiet_torch_trace_errors(),
        size_oblivious(oblivious),
        _kept_dim_markers(args, kwargs),
    ):
        budget = config.dynamic_export_budget if shapes is not None else 0.0
        with timed("export", timings), logs.torch_dynamic_logs(), _no_fake_tensor_cache():
            hook = aliases.recording(module)
            try:
                with export_budget(budget):
                    exported = torch.export.export(module, args, kwargs, dynamic_shapes=shapes, strict=False)
            finally:
                hook.remove()
    stats.count("exports")
    if live is not None and live is not module and shares_state(exported, live):
        log.info("the copy of the module tree reached the model's own weights; exporting the model itself")
        return export_model(live, *call, dims, timings, aliases, from_one)
    return exported, oblivious


def shape_guard_texts(vals: list[Any]) -> list[str]:
    """The guards in the shape environment of these placeholder values, as text."""
    env = shape_env_of(vals)
    return [str(env.simplify(g.expr)) for g in env.guards] if env is not None else []


def shape_env_of(vals: list[Any]):
    """The shape environment of export's placeholder values (None: all static)."""
    mode = torch._guards.detect_fake_mode(vals)
    return mode.shape_env if mode is not None else None


# the attributes torch.export (and torch._dynamo.mark_dynamic) keep on an input tensor about its dims
DIM_MARKERS = (
    "_dynamo_weak_dynamic_indices",
    "_dynamo_dynamic_indices",
    "_dynamo_dynamic_range",
    "_dynamo_static_indices",
    "_dynamo_unbacked_indices",
    "_dynamo_propagated_dynamic_indices",
    "_has_dynamo_dim_marking",
)


@contextlib.contextmanager
def _kept_dim_markers(args: tuple, kwargs: dict):
    """Capture never changes a user's tensor: torch.export overwrites the dim markers of every
    input tensor (a user's mark_dynamic for torch.compile included), deletes them when it
    succeeds and leaves its own when it fails, which would make the static retry fail the same
    way. Whatever the tensors had before is put back."""
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    saved = [{name: t.__dict__[name] for name in DIM_MARKERS if name in t.__dict__} for t in tensors]
    try:
        yield
    finally:
        for t, markers in zip(tensors, saved):
            for name in DIM_MARKERS:
                if name in markers:
                    setattr(t, name, markers[name])
                elif name in t.__dict__:
                    delattr(t, name)


def _no_fake_tensor_cache():
    """Export without FakeTensorMode's dispatch cache: one trace hits it too rarely to pay for
    rebuilding each hit's symbolic sizes (a tiny Llama's export: 1.4 s with it, 0.9 s without, in
    a fresh process). The cache only memoizes; the graph is the same either way."""
    return torch._dynamo.config.patch(fake_tensor_cache_enabled=False)


def size_oblivious(on: bool):
    """Trace with backed sizes treated size-obliviously (no 0/1 specialization) while `on`."""
    if not on:
        return contextlib.nullcontext()
    return torch.fx.experimental._config.patch(backed_size_oblivious=True)


@dataclasses.dataclass
class CapturedProgram:
    """A decomposed ExportedProgram plus how to feed it and how to apply its side effects."""

    program: ExportedProgram
    module: torch.nn.Module | None  # live parameters/buffers come from here (None: from program)
    # one entry per graph placeholder: ("param"|"buffer"|"constant", fqn) or ("user", flat index)
    input_sources: list[tuple[str, Any]]
    # flat output index -> ("buffer", fqn) | ("user", flat user input index): copy back after a call
    mutations: dict[int, tuple[str, Any]]
    user_output_indices: list[int]
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    user_vals: list[Any]  # export's placeholder value per flat user input (FakeTensor with SymInt sizes)
    exported: ExportedProgram | None = None  # before decomposition (for the dump folder and logs)
    aliases: CacheAliases = dataclasses.field(default_factory=CacheAliases)  # returned caches that are inputs
    # (flat input, dim) traced size-obliviously with a floor of 1 (export's range holds for them)
    from_one: frozenset[tuple[int, int]] = frozenset()
    _feed: _Feed | None = None  # gathers a call's graph inputs (built at the first call)

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        """The graph calls run (its placeholders carry values; other nodes may not, when the
        program came from a package or the on-disk cache in its quick form)."""
        return self.program.graph_module

    @property
    def full_graph_module(self) -> torch.fx.GraphModule:
        """The graph with every node's value (lowering, explain and the dump read them)."""
        full = getattr(self.program, "full", None)
        if full is None:
            return self.program.graph_module
        program = full()
        if not getattr(program, "_gjit_in_place", False):  # as the served graph was
            write_in_place(program)
            program._gjit_in_place = True
        return program.graph_module

    def state_tensor(self, kind: str, fqn: str) -> torch.Tensor:
        if kind == "constant":
            return self.program.constants[fqn]
        if self.module is None:  # a non-persistent buffer is one of the program's constants
            table = self.program.state_dict if fqn in self.program.state_dict else self.program.constants
            return table[fqn]
        owner, _, attr = fqn.rpartition(".")
        return getattr(self.module.get_submodule(owner), attr)

    def graph_inputs(self, flat_user: list[Any]) -> list[Any]:
        if self._feed is None:
            self._feed = _Feed(self)
        return self._feed(flat_user)

    def state_sources(self) -> list[tuple[torch.nn.Module, str, Any, str]]:
        """(owning module, attribute, export's value, qualified name) of every parameter and buffer read live:
        the entry's guards check that what is there now still fits the kernels."""
        if self.module is None:
            return []
        vals = [n.meta.get("val") for n in self.graph_module.graph.nodes if n.op == "placeholder"]
        out = []
        for (kind, key), val in zip(self.input_sources, vals):
            if kind in ("param", "buffer") and isinstance(val, torch.Tensor):
                owner_name, _, attr = key.rpartition(".")
                out.append((self.module.get_submodule(owner_name), attr, val, key))
        return out

    def finish(
        self, flat_user: list[Any], flat_out: list[Any], graph_inputs: list[Any], call: tuple | None = None
    ) -> Any:
        """Apply recorded mutations, then rebuild the user's output pytree. An output that is (a
        view of) the new value of a mutated input is returned as (that view of) the input, as in
        eager, where `x.add_(1); return x` returns x itself. A mutated buffer is the one the call
        read (`graph_inputs`), whatever the module holds by now. With the call's `(args, kwargs)`,
        a returned input cache is the caller's object, given the returned state (cache_aliases.py)."""
        mutated, written = [], []
        for out_index, (kind, key) in self.mutations.items():
            if kind == "user":
                target = flat_user[key]
            else:
                target = graph_inputs[self.input_sources.index(("buffer", key))]
            if flat_out[out_index] is not target:
                with torch.no_grad():
                    target.copy_(flat_out[out_index])
            else:  # written in place, maybe by a kernel: its version moves on, as a copy_'s would
                written.append(target)
            if kind == "user":
                mutated.append((flat_out[out_index], target))
        if written:  # (what reads a tensor's version sees the write: a held mask's proof)
            increment_version(written)
        outs = [flat_out[i] for i in self.user_output_indices]
        if mutated:
            outs = as_mutated_inputs(outs, mutated)
        if call is not None and self.aliases.pairs:
            return self.aliases.rebuild(*call, outs, self.out_spec)
        return pytree.tree_unflatten(outs, self.out_spec)


class _Feed:
    """A call's graph inputs: the parameters and buffers read live from their owning modules' dicts
    on every call (so new weights are seen) in one C-level pass, the constants, the user's inputs,
    put in the graph's order. A parameter gone from its module's dict (a plain attribute now) is
    read through getattr."""

    def __init__(self, program: CapturedProgram):
        live, fixed, users = [], [], []
        for position, (kind, key) in enumerate(program.input_sources):
            if kind == "user":
                users.append((position, key))
            elif kind == "constant" or program.module is None:
                fixed.append((position, program.state_tensor(kind, key)))
            else:
                owner_name, _, attr = key.rpartition(".")
                owner = program.module.get_submodule(owner_name)
                table = next((t for t in (owner._parameters, owner._buffers) if attr in t), {})
                live.append((position, owner, attr, table))
        self.owners = [owner for _, owner, _, _ in live]
        self.attrs = [attr for _, _, attr, _ in live]
        self.tables = [table for _, _, _, table in live]
        self.fixed = [value for _, value in fixed]
        self.users = [key for _, key in users]
        positions = [p for p, *_ in live] + [p for p, _ in fixed] + [p for p, _ in users]
        perm = sorted(range(len(positions)), key=positions.__getitem__)  # graph order -> values index
        self.order = None if perm == list(range(len(perm))) else perm

    def __call__(self, flat_user: list[Any]) -> list[Any]:
        try:
            live = list(map(operator.getitem, self.tables, self.attrs))
        except KeyError:
            where = zip(self.tables, self.attrs, self.owners)
            live = [t[a] if a in t else getattr(o, a) for t, a, o in where]
        values = live + self.fixed + [flat_user[i] for i in self.users]
        return values if self.order is None else [values[i] for i in self.order]


def state_reader(owner: torch.nn.Module, attr: str):
    """Read a parameter or buffer from its module's own dict (nn.Module.__getattr__ is slow on the
    hot path); anything else, e.g. a plain tensor attribute, through getattr."""
    for table in (owner._parameters, owner._buffers):
        if attr in table:
            return lambda flat: table[attr] if attr in table else getattr(owner, attr)
    return lambda flat: getattr(owner, attr)


@dataclasses.dataclass
class Exported:
    """One call as torch.export gave it, before decomposition. The on-disk cache's key is hashed
    from it, so a warm start goes from here to the cached entry without decomposing."""

    program: ExportedProgram
    module: torch.nn.Module | None  # live parameters/buffers come from here (None: from program)
    aliases: CacheAliases = dataclasses.field(default_factory=CacheAliases)  # returned caches that are inputs
    # (flat input, dim) traced size-obliviously with a floor of 1 (export's range holds for them)
    from_one: frozenset[tuple[int, int]] = frozenset()
    # the dynamic export ran past its budget: "batch" (the batch dims exported dynamic) or "static"
    narrowed: str | None = None

    @property
    def user_vals(self) -> list[Any]:
        """export's placeholder value per flat user input (FakeTensors with SymInt sizes)."""
        return user_values(self.program)


def capture(
    model: Any,
    args: tuple,
    kwargs: dict,
    dims: DimRanges,
    timings: dict[str, float] | None = None,
    from_one: frozenset[tuple[int, int]] = frozenset(),
    fallback: DimRanges | None = None,
) -> Exported:
    """Export the call (unless given a program); `decompose` and `captured_program` follow.

    `dims`: which input dims to export as dynamic; if export fails with them, gjit retries with
    static shapes (a failure about types is not retried). If its symbolic size reasoning runs
    past gjit.config.dynamic_export_budget, gjit exports with the `fallback` dims (the batch),
    then static, and the result says so (`narrowed`). `timings` gets "export".
    """
    timings = {} if timings is None else timings
    program = load_program(model)
    if program is not None:
        return Exported(program, None)
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.layout != torch.strided:
            raise CaptureError(f"an input has layout {leaf.layout}: gjit compiles strided tensors only")
    kv_cache.register([*args, *kwargs.values()], model)
    # calls read their weights from `module`; export traces a copy of it, so that other threads
    # may call the model meanwhile (gjit/capture/module_copy.py)
    traced = _exported_module(private_tree(model), args, kwargs)[0]
    module, args, kwargs = _exported_module(model, args, kwargs)
    aliases = CacheAliases()
    too_slow = False
    try:
        exported, oblivious = export_model(traced, args, kwargs, dims, timings, aliases, from_one, module)
    except ExportTooSlow:
        too_slow = True  # exported again below, once this traceback (the whole trace) is gone
    except Exception as e:
        if not dims or _not_about_shapes(e):
            raise CaptureError(_explain_failure(e, args, kwargs)) from e
        # export can fail with dynamic dims where static shapes work
        log.info(
            "capture with dynamic dims failed (%s: %s); retrying with static shapes",
            type(e).__name__,
            str(e).splitlines()[0] if str(e) else "",
        )
        try:
            exported, oblivious = export_model(traced, args, kwargs, {}, timings, aliases, live=module)
        except Exception as e2:
            raise CaptureError(_explain_failure(e2, args, kwargs)) from e2
    narrowed = None
    if too_slow:
        name = getattr(model, "__name__", type(model).__name__)
        narrower = fallback if fallback and fallback != dims else {}
        exported, oblivious, narrowed = _export_narrower(
            (traced, module), args, kwargs, narrower, timings, aliases, from_one, name
        )
    log.info(
        "exported %s: %d ATen nodes",
        type(model).__name__
        if isinstance(model, torch.nn.Module)
        else getattr(model, "__name__", "function"),
        len(exported.graph.nodes),
    )
    if aliases.unreturned:
        raise CaptureError(
            f"the model changes {aliases.unreturned[0]} without returning it (past_key_values given "
            "with use_cache=False?); a compiled call can only update a cache the model returns, so "
            "this call runs eagerly: pass use_cache=True, or no cache"
        )
    return Exported(exported, module, aliases, from_one if oblivious else frozenset(), narrowed)


def _exported_module(model: Any, args: tuple, kwargs: dict) -> tuple[torch.nn.Module, tuple, dict]:
    """The module export takes for a call of `model`, and the call as it takes it."""
    return constants_as_tokens(explicit_keywords(as_module(model), args, kwargs), args, kwargs)


def captured_program(exported: Exported, decomposed: ExportedProgram) -> CapturedProgram:
    """The decomposed program with its calling convention. Guards read export's placeholder values
    (`exported.user_vals`): their shape environment holds export's own guards, also when the
    decomposed program comes from the on-disk cache (a new shape environment without them)."""
    captured = describe(decomposed, exported.module, exported.program)
    captured.in_spec = exported.program.call_spec.in_spec  # the live export's, as the key covers
    captured.out_spec = exported.program.call_spec.out_spec
    captured.user_vals = exported.user_vals
    captured.aliases = exported.aliases
    captured.from_one = exported.from_one
    return _logged(captured)


def _logged(captured: CapturedProgram) -> CapturedProgram:
    if graph_log.isEnabledFor(logging.DEBUG) and captured.exported is not None:
        graph_log.debug("exported graph, before decomposition:\n%s", readable(captured.exported.graph_module))
    if graph_log.isEnabledFor(logging.INFO):
        graph_log.info("ATen graph gjit compiles (core ATen):\n%s", readable(captured.graph_module))
    return captured


def readable(gm: torch.fx.GraphModule) -> str:
    """The graph as code with shapes (`f32[s0, 64]`) and the user line of every node."""
    return gm.print_readable(print_output=False, include_stride=False, colored=False)


# why an export was narrowed, for the warning and the on-disk hint
TOO_SLOW = (
    "torch.export's symbolic size reasoning with dynamic dims ran past gjit.config.dynamic_export_budget"
)


def _export_narrower(
    modules: tuple[torch.nn.Module, torch.nn.Module],
    args: tuple,
    kwargs: dict,
    narrower: DimRanges,
    timings: dict[str, float],
    aliases: CacheAliases,
    from_one: frozenset[tuple[int, int]],
    name: str,
) -> tuple[ExportedProgram, bool, str]:
    """An export with dynamic dims ran past its budget: export with the `narrower` dims (the
    batch, under the budget too), else with static shapes; returns what it exported ("batch" or
    "static"). Warns once, with what the callable exports from now on. `modules`: the copy
    export traces and the user's tree (export_model)."""
    traced, module = modules
    budget = f"{TOO_SLOW} ({config.dynamic_export_budget:g} s of slow ops)"
    stats.count("dynamic_exports_abandoned")
    too_slow = False
    if narrower:
        log.warning("%s: %s; exporting only the batch dims (dim 0) dynamic from now on", name, budget)
        try:
            exported, oblivious = export_model(
                traced, args, kwargs, narrower, timings, aliases, from_one, module
            )
            return exported, oblivious, "batch"
        except ExportTooSlow:
            too_slow = True
        except Exception as e:  # a failure of its own: this entry static, the next tries again
            log.info("%s: the export with the batch dims dynamic failed (%s); static shapes", name, e)
        if too_slow:
            log.warning("%s: the batch-dynamic export ran past it too; static from now on", name)
    else:
        log.warning("%s: %s; exporting static shapes from now on", name, budget)
    try:
        exported, oblivious = export_model(traced, args, kwargs, {}, timings, aliases, live=module)
    except Exception as e:
        raise CaptureError(_explain_failure(e, args, kwargs)) from e
    return exported, oblivious, "static" if too_slow or not narrower else "batch"


def _not_about_shapes(e: Exception) -> bool:
    """Failures a static retry cannot fix (types export cannot flatten)."""
    return "not a known type" in str(e) or "register a pytree" in str(e)


def _explain_failure(e: Exception, args: tuple, kwargs: dict) -> str:
    """export's error, and for a call carrying a cache object, what about it and how to fix it."""
    text = f"torch.export failed: {type(e).__name__}: {e}"
    hint = kv_cache.capture_hint([*args, *kwargs.values()])
    return f"{hint} ({text})" if hint else text


def describe(
    program: ExportedProgram, module: torch.nn.Module | None, exported: ExportedProgram | None = None
) -> CapturedProgram:
    sig = program.graph_signature
    user_names = [s.arg.name for s in sig.input_specs if s.kind == InputKind.USER_INPUT]
    sources: list[tuple[str, Any]] = []
    user_pos = 0
    for spec in sig.input_specs:
        if spec.kind == InputKind.PARAMETER:
            sources.append(("param", spec.target))
        elif spec.kind == InputKind.BUFFER:
            sources.append(("buffer", spec.target))
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            sources.append(("constant", spec.target))
        elif spec.kind == InputKind.USER_INPUT:
            sources.append(("user", user_pos))
            user_pos += 1
        else:
            raise CaptureError(f"unsupported exported input kind {spec.kind} ({spec.arg})")
    mutations: dict[int, tuple[str, Any]] = {}
    user_outputs = []
    for i, spec in enumerate(sig.output_specs):
        if spec.kind == OutputKind.BUFFER_MUTATION:
            mutations[i] = ("buffer", spec.target)
        elif spec.kind == OutputKind.USER_INPUT_MUTATION:
            mutations[i] = ("user", user_names.index(spec.target))
        elif spec.kind == OutputKind.USER_OUTPUT:
            user_outputs.append(i)
        else:
            raise CaptureError(
                f"unsupported exported output kind {spec.kind} ({spec.arg}): gjit compiles inference graphs"
            )
    if (shared := written_shared(program, sources, mutations)) is not None:
        raise CaptureError(f"the program writes into {shared}, whose elements share memory: {SHARED}")
    write_in_place(program)
    program.graph_module.meta[WRITTEN_BACK] = written_back(program, sources, mutations)
    return CapturedProgram(
        program=program,
        module=module,
        input_sources=sources,
        mutations=mutations,
        user_output_indices=user_outputs,
        in_spec=program.call_spec.in_spec,
        out_spec=program.call_spec.out_spec,
        user_vals=user_values(program),
        exported=exported,
    )


def user_values(program: Any) -> list[Any]:
    """The placeholder value of each flat user input of `program` (an ExportedProgram, or a stored
    one served: FakeTensors with SymInt sizes), in the calling convention's order."""
    vals = {n.name: n.meta.get("val") for n in program.graph.nodes if n.op == "placeholder"}
    return [
        vals.get(s.arg.name) for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT
    ]


def size_hints(gm: torch.fx.GraphModule) -> dict[sympy.Symbol, int]:
    """The example value of every size symbol (used only for choices, never baked in)."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        sizes = list(val.shape) if isinstance(val, torch.Tensor) else [val]
        for s in sizes:
            if isinstance(s, torch.SymInt):
                env = s.node.shape_env
                values = getattr(env, "backed_var_to_val", None) or env.var_to_val
                return {k: int(v) for k, v in values.items()}
    return {}
