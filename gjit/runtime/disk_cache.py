"""The on-disk compile cache: a second process compiling the same graph skips decomposition,
lowering, fusion, codegen and kernel compilation (what remains is export and guards).

An entry is one JSON file named by its key, the sha256 of everything that changes generated
code: the exported graph, before decomposition (ops, arguments, every node's sizes, strides, dtype,
device and user source line), the example sizes codegen chooses by, export's ranges, the config knobs
that reach codegen, and the versions of gjit (a hash of its sources), torch, triton and Python.
A changed model, config or install is a different key, never a stale hit.

The entry holds the decomposed program (gjit/runtime/program_store.py), the shape guards
decomposition added, the wrapper and kernel sources and the kernels' launch metadata; sympy
expressions are stored as JSON trees rebuilt from a fixed table of classes; loading unpickles
nothing and evaluates only the program's size expressions, checked first to be calls of sympy's
functions over literals. The first line is the sha256 of the rest: a truncated or
edited entry is logged under `cache` and recompiled. Writes are atomic (temp file + rename),
so two processes compiling one model at once both succeed and agree. Kernel files stay
content-addressed (runtime.write_source): identical regions of two models or two entries
share one file, which Triton's own cache then compiles once. Behind the disk sits the fleet's
tier (gjit/runtime/remote_cache.py): a disk miss asks it, a store also goes there.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import json
import os
import re
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import sympy
import torch
import torch.utils._sympy.functions as torch_sympy
import triton

from gjit import logs, stats
from gjit.codegen.common import KernelSource, source_line
from gjit.codegen.toolchain.files import atomic_write
from gjit.config import CompileOptions, config
from gjit.lowering.convolutions import CONV_LIBRARIES
from gjit.lowering.held_masks import bands_from_record
from gjit.lowering.templates import TemplateChoice
from gjit.runtime import remote_cache
from gjit.runtime.graph import CompiledGraph
from gjit.wrapper import graph_device

cache_log = logs.logger("cache")

FORMAT = 3  # bump when the entry layout changes
T = TypeVar("T")


class CacheError(Exception):
    """An entry that cannot be trusted or cannot be stored; the caller recompiles."""


# ----------------------------------------------------------------------------------------------
# The key
# ----------------------------------------------------------------------------------------------


@functools.cache
def gjit_fingerprint() -> str:
    """sha256 of gjit's own sources: an edited gjit (a development checkout) is a new version."""
    return sources_digest(fingerprint_roots())


def fingerprint_roots() -> dict[str, str]:
    """The folders of gjit's top-level packages (each holds its sub-packages)."""
    packages = ("gjit", "gjit.codegen", "gjit.guards", "gjit.kernels")
    paths = {p: importlib.import_module(p).__path__ for p in packages}
    return {f"{p}:{k}": folder for p, folders in paths.items() for k, folder in enumerate(folders)}


def sources_digest(roots: dict[str, str]) -> str:
    """sha256 of every .py file under each root folder, sub-folders included, in a fixed order."""
    digest = hashlib.sha256()
    for label, root in sorted(roots.items()):
        for folder, _, files in sorted(os.walk(root)):
            for name in sorted(f for f in files if f.endswith(".py")):
                rel = os.path.relpath(os.path.join(folder, name), root)
                with open(os.path.join(folder, name), "rb") as f:
                    digest.update(f"{label}/{rel}\0".encode() + f.read())
    return digest.hexdigest()


def versions() -> dict[str, str]:
    return {
        "format": str(FORMAT),
        "gjit": gjit_fingerprint(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }


def _describe(val: Any) -> str:
    """A node's example value as text: what lowering reads of it."""
    if isinstance(val, torch.Tensor):
        size = ", ".join(map(str, val.shape))
        stride = ", ".join(map(str, val.stride()))
        return f"{val.dtype} {val.device} [{size}] stride [{stride}] offset {val.storage_offset()}"
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"{type(val).__name__}({val.node.expr})"
    if isinstance(val, (list, tuple)):
        return "(" + ", ".join(_describe(v) for v in val) + ")"
    return repr(val) if isinstance(val, (int, float, bool, str, type(None))) else type(val).__name__


def _target_name(target: Any) -> str:
    if isinstance(target, (str, torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
        return str(target)
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', target)}"


def graph_text(gm: torch.fx.GraphModule) -> list[str]:
    """One line per node (subgraphs of torch.cond nested), from which the key is hashed."""
    lines = []
    for node in gm.graph.nodes:
        target = _target_name(node.target)
        meta = _describe(node.meta.get("val"))
        trace = source_line(node) or ""  # what kernel headers show of the user's code
        lines.append(f"{node.op} {node.name} = {target}{node.args!r} {node.kwargs!r} :: {meta} :: {trace}")
        if node.op == "get_attr":
            attr = getattr(gm, node.target)
            if isinstance(attr, torch.fx.GraphModule):
                lines += [f"  {ln}" for ln in graph_text(attr)]
            elif isinstance(attr, torch.Tensor):  # its values could reach generated code
                data = attr.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
                lines.append(f"  value sha256 {hashlib.sha256(data).hexdigest()}")
    return lines


def graph_key(
    gm: torch.fx.GraphModule,
    symbols: list[sympy.Symbol],
    hints: dict,
    range_constraints: dict,
    options: CompileOptions,
    program: Any = None,
    shape_guards: list[str] = (),
    held: list = (),
) -> str:
    """`symbols`: the sizes the guard binds for the wrapper; `hints`: example sizes codegen chose by;
    `options`: what the compile was asked for (backend, debug, block sizes...); `program`: the
    ExportedProgram (its calling convention: input and output structure, the signature);
    `shape_guards`: export's own guards (decomposition simplifies with them); `held`: the bands
    the program's buffers and constants hold, which a mask's proof may read
    (gjit/lowering/held_masks.py)."""
    # nothing measured: neither the budget nor what is measured changes anything
    untuned = () if _tuned_on(gm) else ("tune_budget", "measure_all_templates")
    parts = {
        "graph": graph_text(gm),
        "call": _call_text(program),
        "shape_guards": sorted(shape_guards),
        "held": list(held),
        "symbols": [s.name for s in symbols],
        "hints": sorted((str(k), int(v)) for k, v in hints.items()),
        "ranges": sorted(f"{k}: {v}" for k, v in range_constraints.items()),
        "options": {k: repr(v) for k, v in dataclasses.asdict(options).items() if k not in untuned},
        # lowering keeps float atomics out when torch asks for deterministic algorithms
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        # the libraries convolutions run under (their output layouts: gjit/lowering/convolutions.py)
        "conv_libraries": {name: now() for name, (_, now) in CONV_LIBRARIES.items()},
        "versions": versions(),
        # on a GPU the kernels' configurations and templates-or-ATen were measured there (gjit/tuning.py)
        "tuned_on": _tuned_on(gm),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _tuned_on(gm: torch.fx.GraphModule) -> str:
    """The GPU a graph on CUDA is tuned on (gjit/tuning.py), "" otherwise (CUDA not touched)."""
    device = graph_device(gm.graph.nodes)
    return torch.cuda.get_device_name(device) if config.tune and device.type == "cuda" else ""


def _call_text(program: Any) -> list[str]:
    """The program's calling convention: the call's and the output's pytree structure (types, keys,
    a ModelOutput's class) and every input and output spec (kind, name, target, persistence)."""
    if program is None:
        return []
    spec = program.call_spec
    sig = program.graph_signature
    return [str(spec.in_spec), str(spec.out_spec), *map(str, sig.input_specs), *map(str, sig.output_specs)]


# ----------------------------------------------------------------------------------------------
# sympy <-> JSON, from a fixed table of classes
# ----------------------------------------------------------------------------------------------


def _sympy_classes() -> dict[str, type]:
    modules = [torch_sympy, sympy.core.add, sympy.core.mul, sympy.core.power, sympy.core.relational]
    modules += [sympy.logic.boolalg, sympy.core.mod, sympy.functions.elementary.integers]
    modules += [sympy.functions.elementary.miscellaneous, sympy.functions.elementary.piecewise]
    table = {}
    for module in modules:
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, sympy.Basic):
                table[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return table


_CLASSES = _sympy_classes()
_SYMBOL_NAME = re.compile(r"[a-z][a-z0-9_]*")  # s0, s77, u3, ...
_SINGLETONS = {
    "oo": sympy.oo,
    "-oo": -sympy.oo,
    "nan": sympy.nan,
    "zoo": sympy.zoo,
    "true": sympy.true,
    "false": sympy.false,
}


def expr_to_json(e: sympy.Basic) -> Any:
    if isinstance(e, sympy.Integer):
        return int(e)
    if isinstance(e, sympy.Rational):
        return {"rational": [int(e.p), int(e.q)]}
    if isinstance(e, sympy.Float):
        return {"float": str(e)}
    if isinstance(e, sympy.Symbol):
        return {"symbol": e.name, "assumptions": {k: v for k, v in e.assumptions0.items() if v is not None}}
    for name, value in _SINGLETONS.items():
        if e is value:
            return {"singleton": name}
    name = f"{e.func.__module__}.{e.func.__qualname__}"
    if _CLASSES.get(name) is not e.func:
        raise CacheError(f"cannot store the sympy class {name}")
    return {"func": name, "args": [expr_to_json(a) for a in e.args]}


def expr_from_json(tree: Any) -> sympy.Basic:
    if isinstance(tree, bool) or not isinstance(tree, (int, dict)):
        raise CacheError(f"not a stored expression: {tree!r}")
    if isinstance(tree, int):
        return sympy.Integer(tree)
    if "rational" in tree:
        return sympy.Rational(*map(int, tree["rational"]))
    if "float" in tree:
        return sympy.Float(str(tree["float"]))
    if "symbol" in tree:
        name = tree["symbol"]
        if not isinstance(name, str) or not _SYMBOL_NAME.fullmatch(name):
            raise CacheError(f"not a size symbol's name: {name!r}")
        assumptions = {str(k): bool(v) for k, v in tree["assumptions"].items()}
        return sympy.Symbol(name, **assumptions)
    if "singleton" in tree:
        return _SINGLETONS[tree["singleton"]]
    cls = _CLASSES.get(tree["func"])
    if cls is None:
        raise CacheError(f"unknown sympy class {tree['func']!r}")
    return cls(*(expr_from_json(a) for a in tree["args"]))


# ----------------------------------------------------------------------------------------------
# Compiled graphs <-> records
# ----------------------------------------------------------------------------------------------


def _encode(value: Any) -> Any:
    if isinstance(value, sympy.Basic):
        return {"sympy": expr_to_json(value)}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise CacheError(f"cannot store a {type(value).__name__}")


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"sympy"}:
            return expr_from_json(value["sympy"])
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def graph_record(graph: CompiledGraph) -> dict:
    kernels = [{f.name: _encode(getattr(k, f.name)) for f in dataclasses.fields(k)} for k in graph.kernels]
    subgraphs = {name: graph_record(sub) for name, sub in graph.subgraphs.items()}
    return {
        "wrapper": graph.wrapper_source,
        "kernels": kernels,
        "subgraphs": subgraphs,
        "tuning": graph.tuning,
        # which products are templates (gjit/choice/): a warm start lowers by it, measuring nothing
        "templates": graph.templates.record() if graph.templates is not None else None,
        "held": graph.held,  # what the guard checks of the buffers a proof read
        "grouped_kv": graph.grouped_kv,
        "conv_layout": graph.conv_layout,
        "conv_library": list(graph.conv_library) if graph.conv_library is not None else None,
    }


def graph_from_record(record: dict, gm: torch.fx.GraphModule) -> CompiledGraph:
    kernels = []
    for fields in record["kernels"]:
        values = {k: _decode(v) for k, v in fields.items()}
        values["assumptions"] = [tuple(a) for a in values.get("assumptions", [])]
        kernels.append(KernelSource(**values))
    graph = CompiledGraph(gm, kernels, str(record["wrapper"]), tuning=list(record.get("tuning", [])))
    graph.held = list(record.get("held", []))
    graph.grouped_kv = bool(record.get("grouped_kv", False))
    graph.conv_layout = str(record.get("conv_layout", "traced"))  # (an older entry's: none)
    library = record.get("conv_library")
    if library is not None:
        if not (isinstance(library, list) and len(library) == 2 and library[0] in CONV_LIBRARIES):
            raise CacheError(f"the entry's convolution library {library!r} is not one gjit knows")
        graph.conv_library = (library[0], bool(library[1]))
    try:
        bands_from_record(graph.held)
    except (TypeError, ValueError, AttributeError) as e:
        raise CacheError(f"the entry's held masks do not parse ({e})") from e
    if record.get("templates") is not None:
        try:
            graph.templates = TemplateChoice.from_record(record["templates"])
        except (KeyError, TypeError, ValueError) as e:
            raise CacheError(f"the entry's choice of templates does not parse ({e})") from e
    for name, sub in record["subgraphs"].items():
        branch = graph_from_record(sub, getattr(gm, name))
        # a branch's placeholders may carry no values (a served program): it runs where its parent does
        branch.on_cuda = graph.on_cuda
        graph.subgraphs[name] = branch
    return graph


# ----------------------------------------------------------------------------------------------
# Entries on disk
# ----------------------------------------------------------------------------------------------


def entry_path(key: str) -> str:
    return os.path.join(config.cache_dir, "graphs", key[:2], f"{key}.json")


def verified(text: str, key: str) -> dict:
    """The record of an entry's text: its checksum, key and format checked (CacheError if not)."""
    checksum, _, body = text.partition("\n")
    if hashlib.sha256(body.encode()).hexdigest() != checksum:
        raise CacheError("checksum mismatch (truncated or modified)")
    try:
        record = json.loads(body)
    except ValueError as e:
        raise CacheError(f"not JSON ({e})") from e
    if not isinstance(record, dict) or record.get("key") != key or record.get("format") != FORMAT:
        raise CacheError("the entry is for another key or format")
    return record


_unwritable: set[str] = set()  # cache folders a remote entry could not be written to (warned once)


def from_remote(key: str, path: str) -> str | None:
    """On a disk miss, the remote cache's entry (gjit/runtime/remote_cache.py), verified as a disk
    entry is, and written to `path` for the next process (a disk that refuses it is warned about
    once; the entry still serves this call); None when there is none that checks out."""
    remote = remote_cache.current()
    text = remote.get(key, lambda text: verified(text, key)) if remote is not None else None
    if text is not None:
        try:
            atomic_write(path, text)
        except OSError as e:
            if config.cache_dir not in _unwritable:
                _unwritable.add(config.cache_dir)
                cache_log.warning("gjit: could not write the remote cache's entries to %s (%s)", path, e)
    return text


def load(key: str, build: Callable[[dict], T]) -> T | None:
    """`build(record)` of the cached entry (its checksum and key verified), from the disk or else the
    remote cache; None on a miss or on an entry that cannot be trusted or does not build (logged,
    then recompiled and overwritten)."""
    path = entry_path(key)
    where = "on-disk"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (FileNotFoundError, NotADirectoryError):
        cache_log.info("on-disk miss: no compiled graph %s", path)
        stats.count("disk_cache_misses")
        text, where = from_remote(key, path), "remote"
        if text is None:
            return None
    except (OSError, UnicodeDecodeError) as e:
        text, where = f"unreadable: {e}", "on-disk"
    try:
        result = build(verified(text, key))
    except Exception as e:  # any damage means recompile, never a crash or a wrong answer
        cache_log.warning("gjit: ignoring the damaged cache entry %s (%s: %s); recompiling", path, where, e)
        stats.count("disk_cache_errors" if where == "on-disk" else "remote_cache_errors")
        return None
    if where == "on-disk":
        cache_log.info("on-disk hit: compiled graph %s", path)
        stats.count("disk_cache_hits")
    return result


def graph_from_entry(record: dict, gm: torch.fx.GraphModule) -> CompiledGraph:
    """The entry's kernels and wrapper over `gm`, their files rewritten where missing or damaged."""
    graph = graph_from_record(record["graph"], gm)
    write_graph(graph)
    return graph


def write_graph(graph: CompiledGraph) -> None:
    graph.write()
    for sub in graph.subgraphs.values():
        write_graph(sub)


def store(key: str, graph: CompiledGraph, extra: dict | None = None) -> None:
    """Write the entry atomically: the graph's record and `extra` (JSON, sympy values encoded);
    a failure is logged and costs only the next warm start."""
    path = entry_path(key)
    try:
        record = {"format": FORMAT, "key": key, "graph": graph_record(graph)}
        record |= {name: _encode(value) for name, value in (extra or {}).items()}
        body = json.dumps(record, sort_keys=True)
        text = hashlib.sha256(body.encode()).hexdigest() + "\n" + body
    except (CacheError, OSError) as e:
        cache_log.warning("gjit: could not store the cache entry %s (%s)", path, e)
        return
    remote = remote_cache.current()
    if remote is not None:
        remote.put(key, text)  # in the background, set if absent (or over a value that was damaged)
    try:
        atomic_write(path, text)
    except OSError as e:
        cache_log.warning("gjit: could not write the cache entry %s (%s)", path, e)
        return
    cache_log.info("on-disk store: compiled graph written to %s", path)


def decoded(record: dict, name: str) -> Any:
    """A field `store` wrote from `extra`, sympy values rebuilt."""
    return _decode(record[name])


# ----------------------------------------------------------------------------------------------
# Capture hints: what an earlier process learned about capturing a model
# ----------------------------------------------------------------------------------------------


def hint_key(model: Any, flat: list[Any]) -> str | None:
    """A model and a call's input kinds, before export: the model's class (a function's module,
    name and place; a method's owner's class) with its parameters' names and shapes, each input's
    dtype and rank. None for a model without a stable name (a functools.partial, an object whose
    parameters have no shape yet). A hint only chooses which dims to export dynamic, so a key two
    models share costs dynamism, never correctness."""
    try:
        owner = getattr(model, "__self__", None)
        module = model if isinstance(model, torch.nn.Module) else owner
        kind = type(module) if isinstance(module, torch.nn.Module) else getattr(model, "__func__", model)
        name = getattr(kind, "__qualname__", None)
        if not isinstance(name, str):
            return None
        code = getattr(kind, "__code__", None)
        where = [code.co_filename, code.co_firstlineno] if code is not None else []
        params = []
        if isinstance(module, torch.nn.Module):
            params = [(n, list(p.shape)) for n, p in module.named_parameters()]
        ident = [getattr(kind, "__module__", ""), name, getattr(model, "__name__", ""), where, params]
        inputs = [f"{t.dtype}:{t.dim()}" if isinstance(t, torch.Tensor) else type(t).__name__ for t in flat]
        text = json.dumps([versions(), ident, inputs], sort_keys=True, default=str)
    except Exception as e:  # noqa: BLE001 - no hint is the answer for what cannot be named
        cache_log.info("no capture hint for %s (%s: %s)", type(model).__name__, type(e).__name__, e)
        return None
    return hashlib.sha256(text.encode()).hexdigest()


def hint_path(key: str) -> str:
    return os.path.join(config.cache_dir, "hints", key[:2], f"{key}.json")


def read_hint(key: str) -> dict | None:
    """The hint stored under `key` (its checksum and key verified), or None."""
    if not config.cache:
        return None
    try:
        with open(hint_path(key), encoding="utf-8") as f:
            record = verified(f.read(), key)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, UnicodeDecodeError, CacheError) as e:
        cache_log.info("ignoring the capture hint %s (%s)", hint_path(key), e)
        return None
    cache_log.info("capture hint %s: %s", hint_path(key), record)
    return record


def write_hint(key: str, hint: dict) -> None:
    if not config.cache:
        return
    body = json.dumps({"format": FORMAT, "key": key, **hint}, sort_keys=True)
    try:
        atomic_write(hint_path(key), hashlib.sha256(body.encode()).hexdigest() + "\n" + body)
    except OSError as e:
        cache_log.warning("gjit: could not write the capture hint %s (%s)", hint_path(key), e)
