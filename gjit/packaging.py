"""gjit.save / gjit.load: a compiled model as one package a fresh process serves calls from, with no
export, decomposition, lowering or codegen.

An entry of the package holds what serving needs: the decomposed program (torch.export's own
serializer, gjit/runtime/program_store.py: the eager fallback runs it on CPU, explain lowers it
again), the kernels and the wrapper, the call's pytree structure, and what rebuilds its guards
(export's placeholder values come back with the program; the shape guards export and
decomposition recorded, the specialized scalars and the input names are stored). The archive
format and its checks are gjit/runtime/package.py's.

Parameters and buffers come from the live model given to `load` (checked against the manifest)
or from the package's safetensors weights (`save(..., weights=True)`, then `load(path)`).
"""

from __future__ import annotations

import inspect
import json
from typing import Any

import sympy
import torch
import torch.utils._pytree as pytree

from gjit import logs, stats
from gjit.api import CompiledFunction, Entry, Package, RecompileError
from gjit.capture import kv_cache
from gjit.capture.cache_aliases import CacheAliases
from gjit.capture.export import CapturedProgram, Exported, captured_program, user_values
from gjit.capture.in_place import as_functional
from gjit.driver import CompiledProgram
from gjit.guards import build_guards
from gjit.guards.builder import shape_env_of, tf32_setting
from gjit.guards.state import held_sources
from gjit.heap import deferred_full_collections
from gjit.runtime import disk_cache, package, program_store, triton_binaries
from gjit.runtime.package import PackageError

log = logs.logger("cache")

_SCALARS = (type(None), bool, int, float, str)


def save(compiled: CompiledFunction, path: str, *, weights: bool = False, binaries: bool = False) -> None:
    """Write every entry of `compiled` (call it first: entries are made by calls) to one package at
    `path`. weights=True also stores the parameters and buffers the entries read (safetensors), so
    `gjit.load(path)` needs no model. binaries=True also stores the GPU binaries of the kernels
    whose first launches gjit's prebuild recorded (on a GPU: gjit/runtime/prebuild.py), which
    `load` puts in Triton's on-disk cache, so a new process on the same GPU builds none of them."""
    if not isinstance(compiled, CompiledFunction):
        raise TypeError(f"gjit.save expects what gjit.compile returned, got {type(compiled).__name__}")
    if not compiled.entries:
        raise PackageError(
            f"{compiled._name()} has no compiled entry to save: call it (with the inputs to serve) first"
        )
    records = [_entry_record(compiled, e, k) for k, e in enumerate(compiled.entries)]
    members = {f"entries/{k}.json": json.dumps(r, sort_keys=True).encode() for k, r in enumerate(records)}
    state = _state_of(compiled)
    manifest = {
        "model": _model_name(compiled.model),
        "name": compiled._name(),
        "entries": len(records),
        "state": {fqn: _describe_tensor(t) for fqn, t in state.items()},
        "tied": _tied(_model_state(compiled.model), state),
        "config": _config_of(compiled.model),
        "weights": weights,
        "signature": _signature_record(compiled.signature),
        # the GPU its kernels' tiles and templates-or-ATen were measured (or taken from the table)
        # on (gjit/tuning.py, gjit/choice/): a configuration chosen there may not fit another
        # card's shared memory
        "tuned_on": _tuned_on(compiled),
    }
    if weights:
        members["weights.safetensors"] = _weights_bytes(state, _tied(state, state))
    if binaries:
        kernels = _binaries_of(compiled)
        members |= {f"binaries/{name}.json": text.encode() for name, text in kernels.items()}
        manifest["binaries"] = len(kernels)
    package.write(path, manifest, members)
    log.info("saved %d entries of %s to %s", len(records), compiled._name(), path)


def _binaries_of(compiled: CompiledFunction) -> dict[str, str]:
    """Triton's cache entries (name -> value, gjit/runtime/triton_binaries.py) of the kernels the
    entries' first calls prebuilt, once their builds are done."""
    out: dict[str, str] = {}
    for entry in compiled.entries:
        for graph in entry.program.graph.all_graphs():
            built = graph.prebuild_result
            if built is None:
                continue
            built.wait()
            for b in built.builds:
                try:
                    text = triton_binaries.pack(*b.entry) if b.entry is not None else None
                except Exception as e:  # noqa: BLE001 - an unreadable or odd cache entry: left out
                    log.info("gjit.save: the binary of %s is left out (%s)", b.name, e)
                    continue
                if text is not None:
                    out[b.entry[0]] = text
    if not out:
        log.info(
            "gjit.save(binaries=True): no kernel binary recorded (entries that ran on CPU, or first calls "
            "that built their kernels in process): the package holds none"
        )
    return out


def _install_binaries(members: dict[str, bytes]) -> None:
    """The package's kernel binaries into Triton's on-disk cache: each checked first (a member that
    is not one entry's metadata and binary refuses the package), then those built for this GPU
    that Triton's cache lacks are installed. Without a GPU, or on another kind, none are."""
    names = [m for m in members if m.startswith("binaries/")]
    if not names:
        return
    binaries = {}
    for member in names:
        name = member[len("binaries/") : -len(".json")]
        try:
            binaries[name] = triton_binaries.unpack(members[member].decode("utf-8"), name)
        except ValueError as e:
            raise PackageError(f"its kernel binary {member} is damaged: {e}") from e
    try:
        here = triton_binaries.this_target()
    except Exception as e:  # noqa: BLE001 - no GPU driver: nothing to launch the binaries on
        log.info("gjit.load: no GPU here (%s): the package's kernel binaries are not installed", e)
        return
    for name, binary in binaries.items():
        if binary.target != here:
            log.info(
                "gjit.load: kernel binary %s is for %s, not this GPU's %s: not installed",
                name,
                binary.target,
                here,
            )
            continue
        try:
            if triton_binaries.is_cached(name, binary.metadata):
                continue
            triton_binaries.install(name, binary)
        except OSError as e:  # an unwritable Triton cache: Triton builds the kernel at its launch
            log.info("gjit.load: kernel binary %s not installed (%s)", name, e)
            continue
        stats.count("package_binaries_installed")


def _tuned_on(compiled: CompiledFunction) -> str:
    """The GPU an entry of `compiled` was tuned on, or took templates for from the table measured
    on its kind of card (kernels/template_wins.py, in the tiles that ran there); "" if none was."""
    for entry in compiled.entries:
        graph = entry.program.graph
        table = graph.templates is not None and any(r.why == "table" for r in graph.templates.regions)
        if (graph.tuning or table) and graph.on_cuda:
            return torch.cuda.get_device_name()
    return ""


def load(path: str, model: Any = None, *, recompile: bool = False) -> CompiledFunction:
    """A callable serving the package's entries. `model`: the live module whose parameters and
    buffers the entries read (checked against the manifest); without it, the package's own weights.
    A call no entry admits raises gjit.RecompileError naming the guard that failed, or, with
    `recompile=True` and a model, compiles a new entry as gjit.compile would.

    A package holds code (the generated wrapper and kernels, which loading imports): load only
    packages you trust, as with torch.load(weights_only=False). The checks find damage and
    mismatches, not tampering."""
    if recompile and model is None:
        raise ValueError("gjit.load(recompile=True) needs the model, to export it")
    timings: dict[str, float] = {}
    with stats.timed("package_read", timings):
        manifest, members = package.read(path)
    try:
        with deferred_full_collections():
            return _load(path, manifest, members, model, recompile, timings)
    except (PackageError, RecompileError):
        raise
    except Exception as e:  # a package that passed the archive checks but does not load: refuse it
        raise PackageError(f"{path} cannot be loaded: {type(e).__name__}: {e}") from e


def _load(
    path: str, manifest: dict, members: dict, model: Any, recompile: bool, timings: dict
) -> CompiledFunction:
    tuned_on = manifest.get("tuned_on", "")
    here = torch.cuda.get_device_name() if tuned_on and torch.cuda.is_available() else ""
    if tuned_on and here != tuned_on:
        raise PackageError(
            f"{path} was tuned on a {tuned_on} (its kernels' tile configurations were measured there), "
            f"not {'a ' + here if here else 'this machine'}: compile the model again here, or save the "
            "package from a compile with GJIT_TUNE=0 and GJIT_MATMUL=template or aten"
        )
    if model is None and not manifest["weights"]:
        raise PackageError(
            f"{path} was saved without weights: pass the model (gjit.load(path, model=...)), or save "
            "the package with gjit.save(compiled, path, weights=True)"
        )
    if model is not None:
        _check_model(path, manifest, model)
        state = _model_state(model)
    else:
        state = _weights_from_bytes(members["weights.safetensors"], manifest["state"])
    records = [json.loads(members[f"entries/{k}.json"]) for k in range(manifest["entries"])]
    _install_binaries(members)
    if model is not None:
        kv_cache.register(model=model)
    if any("transformers." in r["spec"] for r in records):
        kv_cache.register_all()
    compiled = CompiledFunction(model)
    if model is None:
        compiled.set_signature(_signature_from_record(manifest["signature"]))
    compiled.package = Package(str(path), manifest["name"], recompile)
    for record in records:
        compiled.add_packaged(_entry_from_record(record, model, state, dict(timings)))
    stats.count("package_loads")
    log.info("loaded %d entries of %s from %s", len(records), manifest["name"], path)
    return compiled


# ----------------------------------------------------------------------------------------------
# Entries <-> records
# ----------------------------------------------------------------------------------------------


def _entry_record(compiled: CompiledFunction, entry: Entry, index: int) -> dict:
    program, captured = entry.program, entry.program.captured
    if isinstance(captured.program, program_store.ServedProgram):  # a warm start's or a package's
        stored = program_store.self_contained(captured.program)
    else:
        with as_functional(captured.program):
            try:
                stored = program_store.dump_program(captured.program)
            except program_store.ProgramStoreError as e:
                raise PackageError(f"entry {index} cannot be packaged: {e}") from e
    env = shape_env_of(captured.user_vals)
    shape_guards = [env.simplify(g.expr) for g in env.guards] if env is not None else []
    renames = _stored_sizes(captured)
    shape_guards = [g.xreplace(renames) for g in [*shape_guards, *program.shape_guards]]
    shape_guards = [g for g in shape_guards if g != sympy.true]
    try:
        spec = pytree.treespec_dumps(entry.spec)
    except Exception as e:  # a type in the call without a serialized name
        raise PackageError(f"entry {index} cannot be packaged: its call's structure: {e}") from e
    try:
        guards = disk_cache._encode(shape_guards)
        symbols = disk_cache._encode(program.symbols)
    except disk_cache.CacheError as e:
        raise PackageError(f"entry {index} cannot be packaged: {e}") from e
    return {
        "program": stored,
        "symbols": symbols,
        "graph": disk_cache.graph_record(program.graph),
        "spec": spec,
        "names": entry.names,
        "inputs": _inputs_record(entry, index),
        "state_prefix": _state_prefix(compiled, captured),
        "shape_guards": guards,
        "from_one": sorted(list(p) for p in captured.from_one),
        "cache_aliases": [[_path_record(a), _path_record(b)] for a, b in captured.aliases.pairs],
    }


def _stored_sizes(captured: CapturedProgram) -> dict[sympy.Symbol, sympy.Expr]:
    """A warm start's guards are in its own export's size symbols, and the stored program it
    serves (which the package keeps, and binds its symbols from) may name an input's size
    otherwise: decompose made some sizes one symbol (gjit/capture/attention_sizes.py) before the
    program was stored. Each symbol that is an input's size in this export -> the stored program's
    size there (none for a program compiled in this process: the same export)."""
    program = captured.program
    if not isinstance(program, program_store.ServedProgram):
        return {}
    renames: dict[sympy.Symbol, sympy.Expr] = {}
    for live, kept in zip(captured.user_vals, user_values(program)):
        if isinstance(live, torch.Tensor) and isinstance(kept, torch.Tensor) and live.dim() == kept.dim():
            pairs = zip(live.shape, kept.shape)
        elif isinstance(live, torch.SymInt):
            pairs = [(live, kept)]
        else:
            continue
        for a, b in pairs:
            if isinstance(a, torch.SymInt) and isinstance(a.node.expr, sympy.Symbol):
                renames.setdefault(
                    a.node.expr, b.node.expr if isinstance(b, torch.SymInt) else sympy.Integer(b)
                )
    return renames


def _state_prefix(compiled: CompiledFunction, captured: CapturedProgram) -> str:
    """How the program names the model's state: "" (the model itself was exported) or "model."
    (a module gjit made to hold it: a bound method, or a call with keywords the forward takes
    through **kwargs)."""
    owner = getattr(compiled.model, "__self__", compiled.model)
    if captured.module is None or captured.module is owner:
        return ""
    if getattr(captured.module, "_modules", {}).get("model") is owner:
        return "model."
    return ""


def _holder(model: Any, prefix: str) -> torch.nn.Module | None:
    """The module a loaded entry reads live state from, named as its program names it."""
    owner = getattr(model, "__self__", model)
    if not isinstance(owner, torch.nn.Module):
        return None
    if not prefix:
        return owner
    holder = torch.nn.Module()
    holder.add_module(prefix.rstrip("."), owner)
    return holder


def _inputs_record(entry: Entry, index: int) -> list:
    """Per flat input: ["tensor", first index of the same tensor] | ["symint"] | ["value", v]."""
    out = []
    for i, (kind, value) in enumerate(entry.inputs):
        if kind == "value" and not isinstance(value, _SCALARS):
            raise PackageError(
                f"entry {index} is specialized on input {entry.names[i]} = {value!r} "
                f"({type(value).__name__}), which a package cannot store"
            )
        out.append([kind, value])
    return out


def _entry_from_record(
    record: dict, model: Any, state: dict[str, torch.Tensor], timings: dict[str, float]
) -> Entry:
    prefix = record["state_prefix"]
    with stats.timed("program", timings):
        decomposed = program_store.load_served(record["program"], {prefix + k: v for k, v in state.items()})
        from_one = frozenset(tuple(p) for p in record["from_one"])
        exported = Exported(decomposed, _holder(model, prefix), CacheAliases(), from_one)
        captured = captured_program(exported, decomposed)
        captured.exported = None
        captured.aliases.pairs = [(_path_from(a), _path_from(b)) for a, b in record["cache_aliases"]]
        graph = disk_cache.graph_from_entry(record, captured.graph_module)
    symbols = disk_cache._decode(record["symbols"])
    program = CompiledProgram(captured, graph, timings, symbols=symbols)
    with stats.timed("guards", timings):
        flat = _stand_ins(record["inputs"], captured.user_vals)
        guards = build_guards(
            flat,
            record["names"],
            captured.user_vals,
            decomposed.range_constraints,
            [a for k in graph.kernels for a in k.assumptions],
            captured.state_sources(),
            [key for kind, key in captured.mutations.values() if kind == "user"],
            from_one=from_one,
            shape_guards=disk_cache._decode(record["shape_guards"]),
            returns=symbols,
            nondeterministic=any(k.nondeterministic for k in graph.all_kernels()),
            tf32=tf32_setting(graph.all_kernels()),
            conv_library=graph.conv_library,
            held=held_sources(captured, graph.held),
            module=captured.module,
        )
    spec = pytree.treespec_loads(record["spec"])
    return Entry(guards, spec, program, names=record["names"], inputs=record["inputs"])


def _stand_ins(inputs: list, user_vals: list[Any]) -> list[Any]:
    """What build_guards reads of the example call: export's values for tensors (one object for a
    tensor passed twice) and symbolic ints, the stored specialized values for the rest."""
    flat: list[Any] = []
    for i, (kind, value) in enumerate(inputs):
        if kind == "tensor":
            flat.append(flat[value] if value != i else user_vals[i])
        elif kind == "symint":
            flat.append(user_vals[i])
        else:
            flat.append(value)
    return flat


def _path_record(path: tuple) -> list:
    out = []
    for key in path:
        if isinstance(key, pytree.SequenceKey):
            out.append(["seq", key.idx])
        elif isinstance(key, pytree.MappingKey):
            out.append(["map", key.key])
        elif isinstance(key, pytree.GetAttrKey):
            out.append(["attr", key.name])
        else:
            raise PackageError(f"cannot store the key path entry {key!r}")
    return out


def _path_from(record: list) -> tuple:
    kinds = {"seq": pytree.SequenceKey, "map": pytree.MappingKey, "attr": pytree.GetAttrKey}
    return tuple(kinds[kind](value) for kind, value in record)


# ----------------------------------------------------------------------------------------------
# State: the manifest's description, the model check, weights
# ----------------------------------------------------------------------------------------------


def _state_of(compiled: CompiledFunction) -> dict[str, torch.Tensor]:
    """Every parameter and buffer the entries read, by its name in the user's model."""
    state: dict[str, torch.Tensor] = {}
    for entry in compiled.entries:
        captured = entry.program.captured
        prefix = _state_prefix(compiled, captured)
        for kind, fqn in captured.input_sources:
            if kind in ("param", "buffer"):
                state[fqn.removeprefix(prefix)] = captured.state_tensor(kind, fqn)
    return state


def _model_state(model: Any) -> dict[str, torch.Tensor]:
    owner = getattr(model, "__self__", model)
    if not isinstance(owner, torch.nn.Module):
        return {}
    return {
        **dict(owner.named_parameters(remove_duplicate=False)),
        **dict(owner.named_buffers(remove_duplicate=False)),
    }


def _describe_tensor(t: torch.Tensor) -> dict:
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}


def _check_model(path: str, manifest: dict, model: Any) -> None:
    name = _model_name(model)
    if name != manifest["model"]:
        raise PackageError(f"{path} was built for a {manifest['model']}, not a {name}")
    state = _model_state(model)
    have = {fqn: _describe_tensor(t) for fqn, t in state.items()}
    differ = []
    for fqn, want in manifest["state"].items():
        if fqn not in have:
            differ.append(f"{fqn} is missing")
        elif have[fqn] != want:
            differ.append(f"{fqn} is {_text(have[fqn])}, the package's is {_text(want)}")
    config, saved = _config_of(model), manifest["config"]
    for key in sorted(set(config or {}) | set(saved or {})):
        if (config or {}).get(key) != (saved or {}).get(key):
            differ.append(
                f"config.{key} is {(config or {}).get(key)!r}, the package's is {(saved or {}).get(key)!r}"
            )
    tied = _tied(state, manifest["state"])
    if tied != manifest["tied"]:
        differ.append(f"its tied parameters are {tied}, the package's are {manifest['tied']}")
    if differ:
        more = f" (and {len(differ) - 5} more)" if len(differ) > 5 else ""
        raise PackageError(f"the model does not match {path}: " + "; ".join(differ[:5]) + more)


def _config_of(model: Any) -> dict | None:
    """A transformers model's config as JSON (what shapes cannot show: heads, eps, rope, ...)."""
    owner = getattr(model, "__self__", model)
    config = getattr(owner, "config", None)
    to_dict = getattr(config, "to_dict", None)
    if not callable(to_dict):
        return None
    values = json.loads(json.dumps(to_dict(), default=repr, sort_keys=True))
    for volatile in ("transformers_version", "_name_or_path", "_commit_hash"):
        values.pop(volatile, None)
    return values


def _tied(state: dict[str, torch.Tensor], read: Any) -> list[list[str]]:
    """Groups of names that are one tensor (tied embeddings) among `state`, those with a name in
    `read` (the entries read one name of a group for all of them), each sorted, in a fixed order."""
    groups: dict[tuple, list[str]] = {}
    for fqn, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        groups.setdefault(key, []).append(fqn)
    return sorted(sorted(g) for g in groups.values() if len(g) > 1 and any(f in read for f in g))


def _text(desc: dict) -> str:
    return f"{desc['dtype']}{desc['shape']}"


def _weights_bytes(state: dict[str, torch.Tensor], tied: list[list[str]]) -> bytes:
    """safetensors of the state (a tied group stored once, under its first name); a tensor that is
    not contiguous is stored contiguous and its strides kept in the metadata."""
    from safetensors.torch import save

    skip = {fqn for group in tied for fqn in group[1:]}
    tensors, strides = {}, {}
    for fqn, t in state.items():
        if fqn in skip:
            continue
        if not t.is_contiguous():
            if any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride())):
                raise PackageError(f"{fqn} is an expanded view (a stride of 0); store it materialized")
            strides[fqn] = list(t.stride())
        tensors[fqn] = t.detach().cpu().contiguous()
    metadata = {"gjit_strides": json.dumps(strides), "gjit_tied": json.dumps(tied)}
    return save(tensors, metadata=metadata)


def _weights_from_bytes(data: bytes, described: dict) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    tensors = load(data)
    strides = json.loads(_safetensors_metadata(data).get("gjit_strides", "{}"))
    for fqn, stride in strides.items():
        t = tensors[fqn]
        tensors[fqn] = torch.empty_strided(t.shape, stride, dtype=t.dtype).copy_(t)
    for group in json.loads(_safetensors_metadata(data).get("gjit_tied", "[]")):
        for fqn in group[1:]:
            tensors[fqn] = tensors[group[0]]
    for fqn, desc in described.items():
        if fqn not in tensors or _describe_tensor(tensors[fqn]) != desc:
            raise PackageError(f"the package's weights do not hold {fqn} as {_text(desc)}")
    return tensors


def _safetensors_metadata(data: bytes) -> dict:
    """The `__metadata__` of a safetensors buffer (its header: a little-endian u64 length, then JSON)."""
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + length]).get("__metadata__") or {}


# ----------------------------------------------------------------------------------------------
# The forward's signature (a package loaded without its model binds calls with it)
# ----------------------------------------------------------------------------------------------


def _signature_record(signature: inspect.Signature | None) -> list | None:
    if signature is None:
        return None
    params = []
    for p in signature.parameters.values():
        default = p.default
        if default is not inspect.Parameter.empty and not isinstance(default, _SCALARS):
            default = {"unstored": type(default).__name__}
        elif default is inspect.Parameter.empty:
            default = {"required": True}
        params.append([p.name, p.kind.name, default])
    return params


def _signature_from_record(record: list | None) -> inspect.Signature | None:
    if record is None:
        return None
    params = []
    for name, kind, default in record:
        if isinstance(default, dict):
            default = inspect.Parameter.empty if "required" in default else _Unstored(default["unstored"])
        params.append(inspect.Parameter(name, getattr(inspect.Parameter, kind), default=default))
    return inspect.Signature(params)


class _Unstored:
    """A default value the package could not store: a call that relies on it misses every entry."""

    def __init__(self, type_name: str):
        self.type_name = type_name

    def __repr__(self) -> str:
        return f"<a {self.type_name} default the package does not store>"


def _model_name(model: Any) -> str:
    owner = getattr(model, "__self__", model)
    cls = type(owner) if isinstance(owner, torch.nn.Module) else None
    if cls is None:
        return getattr(model, "__qualname__", type(model).__name__)
    return f"{cls.__module__}.{cls.__qualname__}"
