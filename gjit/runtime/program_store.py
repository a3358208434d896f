"""A decomposed ExportedProgram as JSON, through torch.export's own serializer, without weights.

The on-disk cache and packages keep the graph gjit compiled, so a warm start or a package load
has it (the eager fallback on CPU runs it; explain and dump lower it again) without decomposing.
Parameters, buffers and the constants export lifted are not stored: they are read live from the
model's export (or from a package's own weights file). Constants decomposition made are stored in
safetensors' format, base64 in the JSON.

Nothing is unpickled: torch's `deserialize_torch_artifact` falls back to a full `torch.load` of
bytes it is given, so it is only ever given dicts. torch's deserializer builds size expressions
with `sympy.sympify`, which evaluates its text; every such text is first parsed here and must be
a tree of calls to sympy's and torch's size functions over literals, or the program is refused.
"""

from __future__ import annotations

import base64
import contextlib
import inspect
import json
import math
import operator
import threading
import types
from collections.abc import Collection, Iterator
from typing import Any

import sympy
import torch
import torch.utils._pytree as pytree
from torch._export.serde import serialize as serde
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    ConstantArgument,
    ExportGraphSignature,
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    TensorArgument,
)
from torch.utils._sympy.numbers import int_oo
from torch.utils._sympy.value_ranges import ValueRanges

from gjit import logs
from gjit.runtime.disk_cache import CacheError, expr_from_json, expr_to_json
from gjit.runtime.size_expressions import ExpressionError, check_expressions

log = logs.logger("cache")


class ProgramStoreError(Exception):
    """A program that cannot be stored, or a stored one that cannot be trusted."""


def dump_program(program: ExportedProgram, live: Collection[str] = ()) -> dict:
    """JSON-ready record of `program`: its graph, signature and ranges, and its lifted constants but
    those named in `live` (constants the loader passes in, read from the model's own export)."""
    custom = [s.target for s in program.graph_signature.input_specs if s.kind == InputKind.CUSTOM_OBJ]
    if custom:
        raise ProgramStoreError(f"the program holds script objects ({custom[0]}), which are not stored")
    try:
        with _SERIALIZING, _without_canonical_check(), _without_tensors() as skipped:
            artifact = serde.serialize(program, **skipped)
    except Exception as e:  # an op or value torch's serializer has no form for
        raise ProgramStoreError(f"torch.export cannot serialize the program: {type(e).__name__}: {e}") from e
    constants = {}
    for name, value in program.constants.items():
        if name in live:
            continue
        if not isinstance(value, torch.Tensor):
            raise ProgramStoreError(f"the constant {name} is a {type(value).__name__}, not a tensor")
        constants[name] = value
    record = {"graph": json.loads(artifact.exported_program), "constants": _tensors_text(constants)}
    try:
        record["served"] = served_record(program)
    except ProgramStoreError as e:  # served from torch's deserialized program instead (slower)
        log.info("no quick-load form of the program: %s", e)
    return record


_SERIALIZING = threading.Lock()  # one serialization at a time: the check below is module state
_CANONICALIZE = getattr(serde, "canonicalize", None)


@contextlib.contextmanager
def _without_canonical_check() -> Iterator[None]:
    """torch's serializer, after building the serialized program, canonicalizes a deep copy of it
    to test that the canonical form is well defined, and drops the copy: 60% of the time it takes
    (GPT-2 small's decomposed program: 1.3 of 2.1 s under Python's profiler), the same bytes out.
    Skipped while gjit serializes (under `_SERIALIZING`, which orders gjit's own calls; torch calls
    it nowhere else). What was installed is put back. A program whose canonical form torch would
    refuse is stored all the same: its record is torch's serialization, which loads."""
    if _CANONICALIZE is None:  # another torch: its serializer as it is
        yield
        return
    installed, serde.canonicalize = serde.canonicalize, _as_is
    try:
        yield
    finally:
        serde.canonicalize = installed


def _as_is(program: Any, constants: Any = None) -> Any:
    return program


_SKIPS_TENSORS = "serialize_state_dict" in inspect.signature(serde.serialize).parameters


@contextlib.contextmanager
def _without_tensors() -> Iterator[dict[str, bool]]:
    """The serializer's arguments that skip pickling the weights, constants and example inputs
    (only the graph's JSON is kept). torch before 2.12 has no such arguments: there its pickler
    writes nothing for this thread while it serializes for gjit (`_QuietPickler`)."""
    if _SKIPS_TENSORS:
        yield dict(serialize_state_dict=False, serialize_constants=False, serialize_example_inputs=False)
        return
    if not isinstance(serde.serialize_torch_artifact, _QuietPickler):
        serde.serialize_torch_artifact = _QuietPickler(serde.serialize_torch_artifact)
    before, _QUIET.on = getattr(_QUIET, "on", False), True
    try:
        yield {}
    finally:
        _QUIET.on = before


_QUIET = threading.local()


class _QuietPickler:
    """torch's `serialize_torch_artifact` (installed once, under `_SERIALIZING`), which writes
    nothing in a thread that is serializing for gjit and pickles as torch's does in any other
    (another thread's `torch.export.save` keeps its weights and example inputs)."""

    def __init__(self, torchs: Any):
        self.torchs = torchs

    def __call__(self, artifact: Any, pickle_protocol: int = 2) -> bytes:
        if getattr(_QUIET, "on", False):
            return b""
        return self.torchs(artifact, pickle_protocol)


def load_program(
    record: dict, state: dict[str, torch.Tensor], constants: dict[str, Any] | None = None
) -> ExportedProgram:
    """The program of `dump_program`'s record. `state` holds (at least) its parameters and buffers
    by qualified name, `constants` the lifted constants it was not stored with."""
    try:
        graph = record["graph"]
        try:
            check_expressions(graph)
        except ExpressionError as e:
            raise ProgramStoreError(str(e)) from e
        serialized = serde._dict_to_dataclass(serde.ExportedProgram, graph)
        state_dict, lifted = {}, _tensors_from_text(record["constants"]) | dict(constants or {})
        for spec in serialized.graph_module.signature.input_specs:
            if spec.type == "parameter":
                value = state[spec.value.parameter_name]
                if not isinstance(value, torch.nn.Parameter):  # a package's weights file holds plain tensors
                    value = torch.nn.Parameter(value, requires_grad=False)
                state_dict[spec.value.parameter_name] = value
            elif spec.type == "buffer":  # a non-persistent buffer is one of the program's constants
                name = spec.value.buffer_name
                (state_dict if spec.value.persistent else lifted)[name] = lifted.get(name, state.get(name))
        return serde.ExportedProgramDeserializer().deserialize(serialized, state_dict, lifted, None)
    except ProgramStoreError:
        raise
    except KeyError as e:
        raise ProgramStoreError(f"the program reads {e.args[0]}, which the model does not have") from e
    except Exception as e:
        raise ProgramStoreError(f"the stored program does not load: {type(e).__name__}: {e}") from e


# ----------------------------------------------------------------------------------------------
# Tensors, without pickle
# ----------------------------------------------------------------------------------------------


def _tensors_text(tensors: dict[str, torch.Tensor]) -> str | None:
    if not tensors:
        return None
    from safetensors.torch import save

    plain = {name: t.detach().cpu().contiguous().clone() for name, t in tensors.items()}
    return base64.b64encode(save(plain)).decode("ascii")


def _tensors_from_text(text: str | None) -> dict[str, torch.Tensor]:
    if text is None:
        return {}
    from safetensors.torch import load

    return load(base64.b64decode(text.encode("ascii"), validate=True))


# ----------------------------------------------------------------------------------------------
# The served form: what running the program needs, quick to load
# ----------------------------------------------------------------------------------------------
#
# torch's deserializer rebuilds a fake tensor for every node, parsing every size expression with
# sympy's parser: about a second in a fresh process for a tiny GPT-2. Serving a call needs less:
# the ops and their arguments (the eager fallback runs them), the calling convention, the ranges,
# and the placeholders' values (guards and the state check read them). That is stored too, as
# plain JSON; torch's full program is deserialized only when explain, the dump or a report asks.


def served_record(program: ExportedProgram) -> dict:
    sig = program.graph_signature
    hints: dict[str, int] = {}
    placeholders = {}
    for node in program.graph.nodes:
        if node.op == "placeholder":
            placeholders[node.name] = _value_record(node.meta.get("val"), hints)
    try:
        specs = [pytree.treespec_dumps(s) for s in (program.call_spec.in_spec, program.call_spec.out_spec)]
    except Exception as e:  # noqa: BLE001 - an input torch's pytree cannot write (a module argument)
        raise ProgramStoreError(f"the calling convention has no JSON form: {type(e).__name__}: {e}") from e
    return {
        "graph": _graph_record(program.graph_module),
        "inputs": [[s.kind.name, s.arg.name, s.target, s.persistent] for s in sig.input_specs],
        "outputs": [[s.kind.name, _arg_name(s.arg), s.target] for s in sig.output_specs],
        "in_spec": specs[0],
        "out_spec": specs[1],
        "ranges": [
            [expr_json(k), _bound(v.lower), _bound(v.upper)] for k, v in program.range_constraints.items()
        ],
        "placeholders": placeholders,
        "hints": hints,
    }


def self_contained(program: ServedProgram) -> dict:
    """A served program's record with every constant it reads in it: a warm start's record leaves
    out the constants export lifted (read live from the model's own export), which a package,
    loaded with no export, must hold."""
    record = dict(program.record)
    record["constants"] = _tensors_text(program.constants)
    return record


class ServedProgram:
    """The parts of a decomposed ExportedProgram that serving reads (the same attribute names);
    `full()` is torch's deserialized program, made on first use."""

    def __init__(self, record: dict, state: dict[str, torch.Tensor], constants: dict[str, Any] | None):
        served = record["served"]
        self.record, self._state, self._constants = record, state, constants
        self.graph_module, names = _graph_from_record(served["graph"])
        self.graph = self.graph_module.graph
        self.graph_signature = _signature(served, names)
        self.call_spec = types.SimpleNamespace(
            in_spec=pytree.treespec_loads(served["in_spec"]),
            out_spec=pytree.treespec_loads(served["out_spec"]),
        )
        self.range_constraints = {
            expr_from(k): ValueRanges(_unbound(lo, -int_oo), _unbound(hi, int_oo))
            for k, lo, hi in served["ranges"]
        }
        lifted = _tensors_from_text(record["constants"]) | dict(constants or {})
        self.constants, self.state_dict = {}, {}
        for spec in self.graph_signature.input_specs:
            if spec.kind == InputKind.PARAMETER:
                self.state_dict[spec.target] = state[spec.target]
            elif spec.kind == InputKind.BUFFER:
                table = self.state_dict if spec.persistent else self.constants
                table[spec.target] = lifted.get(spec.target, state.get(spec.target))
            elif spec.kind == InputKind.CONSTANT_TENSOR:
                self.constants[spec.target] = lifted[spec.target]
        placeholders = {names[k]: v for k, v in served["placeholders"].items()}
        _set_placeholder_values(self.graph_module, placeholders, served["hints"], self.range_constraints)
        self._full: ExportedProgram | None = None

    def full(self) -> ExportedProgram:
        if self._full is None:
            self._full = load_program(self.record, self._state, self._constants)
        return self._full


def load_served(
    record: dict, state: dict[str, torch.Tensor], constants: dict[str, Any] | None = None
) -> ExportedProgram | ServedProgram:
    """The quick form when the record has one, else torch's deserialized program."""
    if "served" not in record:
        return load_program(record, state, constants)
    try:
        return ServedProgram(record, state, constants)
    except ProgramStoreError:
        raise
    except KeyError as e:
        raise ProgramStoreError(f"the program reads {e.args[0]}, which the model does not have") from e
    except Exception as e:
        raise ProgramStoreError(f"the stored program does not load: {type(e).__name__}: {e}") from e


def _arg_name(arg: Any) -> str | None:
    return getattr(arg, "name", None)


def expr_json(expr: Any) -> Any:
    try:
        return expr_to_json(sympy.sympify(expr))
    except CacheError as e:
        raise ProgramStoreError(str(e)) from e


def expr_from(tree: Any) -> sympy.Basic:
    try:
        return expr_from_json(tree)
    except CacheError as e:
        raise ProgramStoreError(str(e)) from e


def _bound(value: Any) -> int | None:
    return None if value in (int_oo, -int_oo, sympy.oo, -sympy.oo) else int(value)


def _unbound(value: int | None, infinite: Any) -> Any:
    return infinite if value is None else sympy.Integer(value)


def _signature(served: dict, names: dict[str, str]) -> ExportGraphSignature:
    inputs = [
        InputSpec(InputKind[kind], TensorArgument(names[name]), target, persistent)
        for kind, name, target, persistent in served["inputs"]
    ]
    outputs = [
        OutputSpec(
            OutputKind[kind],
            TensorArgument(names.get(name, name)) if name else ConstantArgument("", None),
            target,
        )
        for kind, name, target in served["outputs"]
    ]
    return ExportGraphSignature(inputs, outputs)


# Graph nodes: ops and arguments, no metadata ------------------------------------------------

# the plain Python functions an ATen graph calls (size arithmetic, getitem): nothing else is loaded
_FUNCTIONS = {
    **{
        f"operator.{n}": getattr(operator, n)
        for n in (
            "getitem",
            "add",
            "sub",
            "mul",
            "truediv",
            "floordiv",
            "mod",
            "pow",
            "neg",
            "pos",
            "abs",
            "eq",
            "ne",
            "lt",
            "le",
            "gt",
            "ge",
            "and_",
            "or_",
            "xor",
            "not_",
            "invert",
            "lshift",
            "rshift",
        )
    },
    **{
        f"math.{n}": getattr(math, n)
        for n in (
            "sqrt",
            "floor",
            "ceil",
            "trunc",
            "exp",
            "log",
            "log2",
            "log10",
            "sin",
            "cos",
            "tan",
            "tanh",
            "asin",
            "acos",
            "atan",
            "sinh",
            "cosh",
            "asinh",
            "acosh",
            "atanh",
            "pow",
            "fabs",
            "gcd",
        )
    },
    **{
        f"torch.{n}": getattr(torch, n)
        for n in dir(torch)
        if n.startswith("sym_") and callable(getattr(torch, n))
    },
}
_NAMES = {id(f): name for name, f in _FUNCTIONS.items()}


def _graph_record(gm: torch.fx.GraphModule) -> dict:
    nodes, subgraphs = [], {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            attr = getattr(gm, node.target)
            if not isinstance(attr, torch.fx.GraphModule):
                raise ProgramStoreError(f"get_attr of a {type(attr).__name__} ({node.target})")
            subgraphs[node.target] = _graph_record(attr)
        elif node.op not in ("placeholder", "output", "call_function"):
            raise ProgramStoreError(f"a {node.op} node ({node.name})")
        target = _target_record(node.target) if node.op == "call_function" else node.target
        nodes.append([node.op, node.name, target, _arg_record(node.args), _arg_record(node.kwargs)])
    return {"nodes": nodes, "subgraphs": subgraphs}


def _graph_from_record(record: dict) -> tuple[torch.fx.GraphModule, dict[str, str]]:
    """The graph, and each stored node name -> its name in the graph."""
    root = torch.nn.Module()
    for name, sub in record["subgraphs"].items():
        setattr(root, name, _graph_from_record(sub)[0])
    graph = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}
    for op, name, target, args, kwargs in record["nodes"]:
        if op == "call_function":
            target = _target_from(target)
        elif not isinstance(target, str):
            raise ProgramStoreError(f"a {op} node with target {target!r}")
        node = graph.create_node(op, target, _arg_from(args, env), _arg_from(kwargs, env), name=name)
        env[name] = node  # fx may rename a node (`input` shadows a builtin): the signature follows
    return torch.fx.GraphModule(root, graph), {name: node.name for name, node in env.items()}


def _target_record(target: Any) -> list:
    if isinstance(target, torch._ops.OpOverload):
        return ["op", target._schema.name, target._overloadname]
    if isinstance(target, torch._ops.HigherOrderOperator):
        return ["hop", target.name()]
    if id(target) in _NAMES and _FUNCTIONS[_NAMES[id(target)]] is target:
        return ["fn", _NAMES[id(target)]]
    raise ProgramStoreError(f"the call target {target!r}")


def _target_from(record: list) -> Any:
    kind, *rest = record
    found: Any = None
    if kind == "op" and len(rest) == 2:
        namespace, _, op = str(rest[0]).partition("::")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        found = getattr(packet, str(rest[1]), None)
        found = found if isinstance(found, torch._ops.OpOverload) else None
    elif kind == "hop" and len(rest) == 1:
        found = getattr(torch.ops.higher_order, str(rest[0]), None)
        found = found if isinstance(found, torch._ops.HigherOrderOperator) else None
    elif kind == "fn" and len(rest) == 1:
        found = _FUNCTIONS.get(rest[0])
    if found is None:
        raise ProgramStoreError(f"an unknown call target {record!r}")
    return found


def _arg_record(value: Any) -> Any:
    if isinstance(value, torch.fx.Node):
        return {"node": value.name}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return {"float": repr(value)}
    if isinstance(value, list):
        return [_arg_record(v) for v in value]
    if isinstance(value, tuple):
        return {"tuple": [_arg_record(v) for v in value]}
    if isinstance(value, dict):
        return {"dict": {str(k): _arg_record(v) for k, v in value.items()}}
    for kind, cls in _TORCH_VALUES.items():
        if isinstance(value, cls):
            return {kind: str(value).removeprefix("torch.")}
    raise ProgramStoreError(f"an argument of type {type(value).__name__}: {value!r}")


_TORCH_VALUES = {
    "dtype": torch.dtype,
    "device": torch.device,
    "layout": torch.layout,
    "memory_format": torch.memory_format,
}


def _arg_from(value: Any, env: dict[str, torch.fx.Node]) -> Any:
    if isinstance(value, list):
        return [_arg_from(v, env) for v in value]
    if not isinstance(value, dict):
        return value
    ((kind, body),) = value.items()
    if kind == "node":
        return env[body]
    if kind == "float":
        return float(body)
    if kind == "tuple":
        return tuple(_arg_from(v, env) for v in body)
    if kind == "dict":
        return {k: _arg_from(v, env) for k, v in body.items()}
    if kind == "device":
        return torch.device(body)
    if kind in _TORCH_VALUES:
        found = getattr(torch, body, None)
        if isinstance(found, _TORCH_VALUES[kind]):
            return found
    raise ProgramStoreError(f"an unknown argument {value!r}")


# Placeholder values: fake tensors over one shape environment ----------------------------------


def _value_record(val: Any, hints: dict[str, int]) -> Any:
    if isinstance(val, torch.Tensor):
        sizes = [_size_json(s, hints) for s in val.shape]
        strides = [_size_json(s, hints) for s in val.stride()]
        return {"tensor": [str(val.dtype).removeprefix("torch."), str(val.device), sizes, strides]}
    if isinstance(val, torch.SymInt):
        return {"symint": _size_json(val, hints)}
    if val is None or isinstance(val, (bool, int, float, str)):
        return {"value": val}
    raise ProgramStoreError(f"a placeholder value of type {type(val).__name__}")


def _size_json(size: Any, hints: dict[str, int]) -> Any:
    if not isinstance(size, torch.SymInt):
        return int(size)
    expr = size.node.expr
    env = size.node.shape_env
    values = getattr(env, "backed_var_to_val", None) or env.var_to_val
    for sym in expr.free_symbols:
        if sym not in values:
            raise ProgramStoreError(f"the size {expr} has no example value")
        hints[sym.name] = int(values[sym])
    return expr_json(expr)


def _set_placeholder_values(
    gm: torch.fx.GraphModule,
    placeholders: dict,
    hints: dict[str, int],
    ranges: dict[sympy.Basic, ValueRanges],
) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    symbols: dict[sympy.Symbol, Any] = {}

    def size(tree: Any) -> Any:
        expr = expr_from(tree)
        if expr.is_number:
            return int(expr)
        for sym in expr.free_symbols:
            if sym not in symbols:
                # the range as export gave it (constrain_symbol_range would import half of torch
                # to name a source line for its log)
                env.var_to_range[sym] = ranges.get(sym, ValueRanges(0, int_oo))
                env.add_backed_var_to_val(sym, hints[sym.name])
                symbols[sym] = env.create_symintnode(sym, hint=hints[sym.name])
        if isinstance(expr, sympy.Symbol):
            return symbols[expr]
        return env.create_symintnode(expr, hint=int(expr.subs({s: hints[s.name] for s in expr.free_symbols})))

    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        ((kind, body),) = placeholders[node.name].items()
        if kind == "tensor":
            dtype, device, sizes, strides = body
            dtype = getattr(torch, str(dtype), None)
            if not isinstance(dtype, torch.dtype):
                raise ProgramStoreError(f"a placeholder of an unknown dtype {body[0]!r}")
            with mode, env.suppress_guards():  # making a value decides nothing about the call
                val = torch.empty_strided(
                    [size(s) for s in sizes],
                    [size(s) for s in strides],
                    dtype=dtype,
                    device=torch.device(device),
                )
        elif kind == "symint":
            val = size(body)
        else:
            val = body
        node.meta["val"] = val
