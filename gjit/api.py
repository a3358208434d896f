"""Public entry points: gjit.compile, the compiled callable, gjit.explain."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import threading
import weakref
from typing import Any

import torch
import torch.utils._pytree as pytree

from gjit import locks, logs, progress, stats
from gjit.capture import kv_cache
from gjit.capture.calling import (
    GUARDABLE,
    bind_call,
    fast_arity,
    forward_signature,
    input_names,
    inputs_record,
    structure_change,
)
from gjit.capture.export import TOO_SLOW, CaptureError, DecompositionError, capture, readable
from gjit.choice.regions import card_of
from gjit.codegen.toolchain.compile_only import start_warm_up
from gjit.config import BACKENDS, CompileOptions, config
from gjit.debug import dump
from gjit.debug.report import Report, build_report
from gjit.driver import CompiledProgram, compile_program, run_program
from gjit.guards import GuardBuildError, GuardSet, MissHistory, build_guards, dynamic_dims
from gjit.guards.builder import tf32_setting
from gjit.guards.policy import MARKS, batch_dims, specialized_dims
from gjit.guards.state import held_sources
from gjit.heap import deferred_full_collections
from gjit.runtime import cuda_graphs, disk_cache
from gjit.stats import timed

log = logs.logger("capture")
recompiles_log = logs.logger("recompiles")
guards_log = logs.logger("guards")
cache_log = logs.logger("cache")
perf_log = logs.logger("perf_hints")


@dataclasses.dataclass
class Entry:
    """One compiled specialization of a callable: the guards that admit a call, and the program."""

    guards: GuardSet
    spec: pytree.TreeSpec
    program: CompiledProgram
    specialized: list[str] = dataclasses.field(default_factory=list)  # dims export made static, and why
    names: list[str] = dataclasses.field(default_factory=list)  # each flat input, as guards name it
    # what the guards read of the compiled call, per flat input (a package rebuilds them from it):
    # ["tensor", index of its first occurrence] | ["symint", None] | ["value", the specialized value]
    inputs: list = dataclasses.field(default_factory=list)
    graphs: cuda_graphs.CudaGraphs | None = None  # mode="reduce-overhead": its recorded CUDA graphs


@dataclasses.dataclass
class Package:
    """Where a loaded function's entries came from (gjit.load), and whether a miss may compile."""

    path: str
    name: str
    recompile: bool


class RecompileError(RuntimeError):
    """A call needed a recompile that gjit.config forbids (error_on_recompile, fail_on_recompile_limit)."""


def _mark_dynamic_hint(changing: list[tuple[str, int]], dynamic: bool | None) -> str:
    """The call that would have served the missed calls from one entry."""
    marks = "; ".join(f"gjit.mark_dynamic({name}, {dim})" for name, dim in changing)
    if marks:
        advice = f"call {marks} on the input(s) before the first call"
        return advice + (" (they are marked dynamic even with dynamic=False)" if dynamic is False else "")
    return "keep the inputs' types, dtypes, devices and specialized Python values fixed between calls"


LIVE: weakref.WeakSet = weakref.WeakSet()  # every CompiledFunction, so gjit.reset() reaches them
LIVE_LOCK = threading.Lock()  # a WeakSet iterated while another thread adds to it raises
_ONCE = threading.Lock()  # a callable's warnings said once, also when two threads hit them at once


def tf32_allowed(on_gpu: bool) -> bool | None:
    """Whether float32 products may run on TF32 tensor cores, as eager's cuBLAS calls do, for a
    call on a GPU: torch.backends.cuda.matmul.allow_tf32. None: not on a GPU."""
    return bool(torch.backends.cuda.matmul.allow_tf32) if on_gpu else None


class CompiledFunction:
    """What `gjit.compile(model)` returns: call it like the model."""

    def __init__(
        self,
        model: Any,
        *,
        dynamic: bool | None = None,
        check: bool | None = None,
        dump_dir: str | None = None,
        backend: str | None = None,
        mode: str | None = None,
    ):
        self.mode = cuda_graphs.resolve_mode(mode)
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"gjit.compile: unknown backend {backend!r}, expected one of {BACKENDS}")
        self.model = model
        self.backend = backend  # None: gjit.config.backend
        self.dynamic = dynamic
        self.check = check  # None: gjit.config.check
        self.dump_dir = dump_dir  # None: gjit.config.dump_dir
        self.signature = forward_signature(model)
        self.entries: list[Entry] = []
        self.eager_reason: str | None = None
        self._warned_autograd = False
        self._warned_limit = False
        self.misses = MissHistory()
        self.narrowed: str | None = None  # "batch" or "static": an export ran past its budget
        self._tensor_tuple_specs: dict[int, pytree.TreeSpec] = {}
        self._fast_arity = fast_arity(self.signature)
        self._bind_plans: dict[tuple, tuple[list[str], list[str]]] = {}
        self.package: Package | None = None  # set by gjit.load
        self.target: int | None = None  # gjit.aot's arch (sm_90: 90): what CPU calls compile for
        self._packaged: list[Entry] = []
        kv_cache.register(model=model)  # a transformers model's caches flatten from the first call
        if callable(model) and not isinstance(model, torch.nn.Module):
            functools.update_wrapper(self, model, updated=())
        with LIVE_LOCK:
            LIVE.add(self)

    def set_signature(self, signature) -> None:
        """Bind calls with `signature` (a loaded package's, when no model was given)."""
        self.signature = signature
        self.__signature__ = signature  # what inspect.signature(self) reports (generate() reads it)
        self._fast_arity = fast_arity(signature)
        self._bind_plans.clear()

    def add_packaged(self, entry: Entry) -> None:
        """An entry loaded from a package (kept by reset())."""
        self._packaged.append(entry)
        self.entries.append(entry)
        entry.graphs = cuda_graphs.for_entry(self.mode, entry.program, f"{self._name()} packaged entry")

    def reset(self) -> None:
        """Forget compiled entries (not packaged ones), CUDA graphs and a recorded capture failure."""
        with locks.compiling():
            cuda_graphs.release(self.entries)
            self.entries[:] = self._packaged
            self.eager_reason = None
            self.misses = MissHistory()
            self._warned_limit = False

    def __repr__(self) -> str:
        return (
            f"gjit.CompiledFunction({getattr(self.model, '__name__', type(self.model).__name__)}, "
            f"entries={len(self.entries)})"
        )

    def _normalize(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        least, most = self._fast_arity
        if not kwargs and least <= len(args) <= most:
            return args, kwargs
        # a call shaped like an earlier one (same positional count, same keywords in the same
        # order: generate()'s every decode step) binds the same way; inspect's bind is slow
        key = (len(args), tuple(kwargs))
        plan = self._bind_plans.get(key)
        if plan is not None:
            moved, rest = plan
            return args + tuple([kwargs[n] for n in moved]), {n: kwargs[n] for n in rest}
        bound_args, bound_kwargs = bind_call(self.signature, args, kwargs, self._name())
        if self.signature is not None:
            params = list(self.signature.parameters.values())[len(args) : len(bound_args)]
            if all(p.kind == p.POSITIONAL_OR_KEYWORD and p.name in kwargs for p in params):
                self._bind_plans[key] = ([p.name for p in params], list(bound_kwargs))
        return bound_args, bound_kwargs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.eager_reason is not None:
            stats.count("eager_runs")
            return self._eager(args, kwargs)
        args, kwargs = self._normalize(args, kwargs)
        flat, spec = self._flatten(args, kwargs)
        if torch.is_grad_enabled() and self._needs_autograd(flat):
            stats.count("eager_runs")
            return self._eager(args, kwargs)
        for entry in reversed(self.entries):  # no lock: an entry is appended whole (gjit/locks.py)
            if entry.spec == spec:
                sizes = entry.guards.check(flat)
                if sizes is not None:
                    stats.count("cache_hits")
                    return self._run(entry, args, kwargs, flat, sizes)
        return self._miss(args, kwargs, flat, spec)

    @staticmethod
    def _run(entry: Entry, args: tuple, kwargs: dict, flat: list, sizes: tuple) -> Any:
        return run_program(entry.program, flat, sizes, entry.graphs, (args, kwargs))

    def _lookup(self, flat: list, spec: pytree.TreeSpec) -> tuple[Entry, tuple] | None:
        """The newest entry that admits the call, and the sizes its guard binds."""
        for entry in reversed(self.entries):
            sizes = entry.guards.check(flat) if entry.spec == spec else None
            if sizes is not None:
                return entry, sizes
        return None

    def _miss(self, args: tuple, kwargs: dict, flat: list, spec: pytree.TreeSpec) -> Any:
        """No entry admitted the call. Under the compile lock, look again (another thread may have
        compiled the entry this call needs while it waited), else compile a new entry, or say
        why it runs eagerly. The call runs after the lock is released."""
        with progress.compiling(self._name()):  # the compile and the first call (its kernel builds)
            with locks.compiling():
                # caches flatten as pytree nodes once registered (maybe by another thread meanwhile)
                kv_cache.register([*args, *kwargs.values()], self.model)
                flat, spec = self._flatten(args, kwargs)
                found = self._lookup(flat, spec)
                if found is not None:
                    stats.count("cache_hits")
                else:
                    found = self._new_entry(args, kwargs, flat, spec)
            if isinstance(found, tuple):
                progress.stage("first call")
                return self._run(found[0], args, kwargs, flat, found[1])
        if found is None:
            return self._eager(args, kwargs)
        return self._run_eager(args, kwargs, found)

    def _new_entry(
        self, args: tuple, kwargs: dict, flat: list, spec: pytree.TreeSpec
    ) -> tuple[Entry, tuple] | str | None:
        """Under the compile lock, for a call no entry admits: explain the miss, then compile a new
        entry (and the sizes its guard binds), or say why the call runs eagerly (None: counted and
        logged; a str: capture failed, why)."""
        names = input_names(args, kwargs, self.signature)
        if self.entries:
            index, failed = self._nearest(flat, spec)
            self.misses.record(flat, names, failed)
            explanation = (
                f"{self._name()} missed all {len(self.entries)} entries; the nearest, entry {index}, "
                f"failed {len(failed)} guard(s):\n" + "\n".join(f"    {f}" for f in failed)
            )
            if self.package is not None and not self.package.recompile:
                raise RecompileError(
                    f"{explanation}\nThe call is outside the entries of the package {self.package.path}: "
                    "save a package with an entry for it, or load with the model and recompile=True"
                )
            if config.error_on_recompile:
                raise RecompileError(f"{explanation}\n(gjit.config.error_on_recompile is set)")
            if len(self.entries) >= config.recompile_limit:
                return self._over_limit(explanation)
            stats.count("recompiles")
            for f in failed:
                stats.count(f"recompile_reason:{f.split(', got ')[0]}")
            recompiles_log.info("%s\n  decision: compile entry %d", explanation, len(self.entries))
        lazy = [n for t, n in zip(flat, names) if isinstance(t, torch.Tensor) and (t.is_neg() or t.is_conj())]
        if lazy:  # export would trace the bit away while kernels read the raw storage
            recompiles_log.info(
                "%s: %s carry a lazy neg/conj bit; this call runs eagerly", self._name(), lazy
            )
            stats.count("eager_runs")
            return None
        entry = self._compile(args, kwargs, flat, spec, names)
        if isinstance(entry, str):
            return entry
        sizes = entry.guards.check(flat)
        if sizes is None:  # a guard-building bug must not become a wrong answer
            log.warning(
                "gjit: the new entry of %s does not admit the call it was compiled for (%s); running eagerly",
                self._name(),
                "; ".join(entry.guards.failures(flat)),
            )
            stats.count("eager_runs")
            return None
        return entry, sizes

    def _nearest(self, flat: list, spec: pytree.TreeSpec) -> tuple[int, list[str]]:
        """The entry with the fewest failing guards, and those failures (expected vs actual)."""
        best: tuple[int, list[str]] | None = None
        for index, entry in enumerate(self.entries):
            if entry.spec != spec:
                params = list(self.signature.parameters) if self.signature is not None else []
                failed = [f"the inputs' structure changed: {structure_change(entry.spec, spec, params)}"]
            else:
                failed = entry.guards.failures(flat)
            if best is None or len(failed) < len(best[1]):
                best = (index, failed)
        return best

    def _over_limit(self, explanation: str) -> None:
        limit = config.recompile_limit
        worst = self.misses.worst_guard()
        hint = _mark_dynamic_hint(self.misses.changing_dims(), self.dynamic)
        message = (
            f"gjit: {self._name()} reached the recompile limit ({limit} entries, "
            "gjit.config.recompile_limit). "
            f"The guard that keeps failing: {worst}. Input signatures that missed every entry:\n"
            f"{self.misses.histogram()}\n{explanation}\n"
            f"To serve these calls from one entry, {hint}."
        )
        if config.fail_on_recompile_limit:
            raise RecompileError(message)
        if not self._warned_limit:  # (under the compile lock)
            self._warned_limit = True
            log.warning("%s Calls that miss from now on run eagerly.", message)
        recompiles_log.info("%s: recompile limit reached, running eagerly", self._name())
        stats.count("eager_runs")
        return None

    def _flatten(self, args: tuple, kwargs: dict) -> tuple[list, pytree.TreeSpec]:
        """pytree.tree_flatten((args, kwargs)), with a fast path for a plain tuple of tensors."""
        if not kwargs and all(type(a) is torch.Tensor for a in args):
            spec = self._tensor_tuple_specs.get(len(args))
            if spec is None:
                spec = self._tensor_tuple_specs[len(args)] = pytree.tree_flatten((args, {}))[1]
            return list(args), spec
        return pytree.tree_flatten((args, kwargs))

    def _needs_autograd(self, flat: list) -> bool:
        """Generated kernels record no autograd graph: a call that needs one runs eagerly."""
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        owner = getattr(self.model, "__self__", self.model)  # a bound method: its module's weights
        if isinstance(owner, torch.nn.Module):
            tensors += list(owner.parameters())
        if not any(t.requires_grad for t in tensors):
            return False
        if self._first_warning("_warned_autograd"):
            log.warning(
                "gjit compiles inference graphs: %s was called with tensors that require grad while grad "
                "mode is on, so it runs eagerly (outputs keep their gradients). Call it under "
                "torch.no_grad() or torch.inference_mode() to use the compiled kernels.",
                self._name(),
            )
        return True

    def entry_for(self, args: tuple, kwargs: dict) -> tuple[Entry, tuple]:
        """The entry that serves this call (compiling one if none does) and the sizes its guard
        binds for it; used by explain and aot. CaptureError when capture fails."""
        args, kwargs = self._normalize(args, kwargs)
        flat, spec = pytree.tree_flatten((args, kwargs))
        with locks.compiling():
            found = self._lookup(flat, spec)
            if found is not None:
                return found
            with progress.compiling(self._name()):
                entry = self._compile(args, kwargs, flat, spec, input_names(args, kwargs, self.signature))
        if isinstance(entry, str):
            raise CaptureError(f"gjit could not capture {self._name()}: {entry}")
        return entry, entry.guards.check(flat) or ()

    def _first_warning(self, flag: str) -> bool:
        """Whether this thread is the first to say the warning `flag` names (then it is set)."""
        if getattr(self, flag):
            return False
        with _ONCE:
            first = not getattr(self, flag)
            setattr(self, flag, True)
        return first

    @deferred_full_collections()  # a full collection mid-compile walks the whole heap
    def _compile(
        self, args: tuple, kwargs: dict, flat: list, spec: pytree.TreeSpec, names: list[str]
    ) -> Entry | str:
        """A new entry for the call, appended once whole; or why capture failed. Under the
        compile lock: an interrupted compile leaves no entry behind."""
        timings: dict[str, float] = {}
        dims = dynamic_dims(flat, self.dynamic)
        from_one: set[tuple[int, int]] = set()  # KV lengths, dynamic from 1 (kv_cache.dynamic_leaves)
        if self.dynamic is not False:
            for i, ranges in kv_cache.dynamic_leaves(args, kwargs).items():
                marked = getattr(flat[i], MARKS, None) or {}  # the user's own range wins
                free = {d: r for d, r in ranges.items() if d not in marked}
                dims[i] = {**dims.get(i, {}), **free}
                from_one |= {(i, d) for d, (lo, _) in free.items() if lo == 1}
        # what an earlier process learned: this model's export ran past the budget
        hint = None
        if dims and config.cache and config.dynamic_export_budget > 0:
            hint = disk_cache.hint_key(self.model, flat)
            record = disk_cache.read_hint(hint) if hint is not None and self.narrowed is None else None
            if record is not None and record.get("narrowed") in ("batch", "static"):
                self.narrowed = record["narrowed"]
                what = "only the batch dims dynamic" if self.narrowed == "batch" else "static shapes"
                log.warning("%s: %s earlier (on-disk hint); exporting %s", self._name(), TOO_SLOW, what)
        if self.narrowed is not None:  # static still keeps the user's marks and a KV cache's length
            dims = batch_dims(dims, flat, from_one, batch=self.narrowed == "batch")
            from_one = {(i, d) for i, d in from_one if d in dims.get(i, {})}
        cache_log.info("%s: no entry admits the call (in-memory cache miss); compiling", self._name())
        on_gpu = any(isinstance(v, torch.Tensor) and v.is_cuda for v in flat)
        tf32, target = tf32_allowed(on_gpu), card_of(flat, self.target)
        autotune = self.mode.startswith("max-autotune")  # torch's word for "tune it all"
        options = CompileOptions.from_config(
            backend=self.backend, check=self.check, tf32=tf32, target=target,
            tune_budget=math.inf if autotune else None, measure_all_templates=autotune or None,
        )  # fmt: skip
        if options.backend == "triton" and on_gpu:
            start_warm_up()  # Triton's first build in this process pays it: run it beside capture
        try:
            try:
                fallback = batch_dims(dims, flat, from_one)
                exported = capture(self.model, args, kwargs, dims, timings, frozenset(from_one), fallback)
                if exported.narrowed:
                    if hint is not None and exported.narrowed != self.narrowed:  # the next process
                        disk_cache.write_hint(hint, {"narrowed": exported.narrowed})  # starts there
                    self.narrowed = exported.narrowed
                    dims = fallback if exported.narrowed == "batch" else {}  # what export was asked
                program = compile_program(exported, timings, options, example=flat)
            except DecompositionError as e:
                if not dims:
                    raise
                # decomposition can fail with dynamic dims where static shapes work
                log.info("%s; retrying with static shapes", str(e).splitlines()[0])
                exported = capture(self.model, args, kwargs, {}, timings)
                program = compile_program(exported, timings, options, example=flat)
        except CaptureError as e:  # warned about in _run_eager, once the model ran fine eagerly
            return str(e)
        captured = program.captured
        if len(captured.user_vals) != len(flat):  # a leaf export bakes in (an nn.Module argument)
            kinds = sorted({type(v).__name__ for v in flat if not isinstance(v, GUARDABLE)})
            return (
                f"torch.export took {len(captured.user_vals)} of the call's {len(flat)} inputs as graph "
                f"inputs; gjit cannot guard the others ({', '.join(kinds) or 'unknown types'})"
            )
        try:
            with timed("guards", timings):
                guards = build_guards(
                    flat,
                    names,
                    captured.user_vals,
                    captured.program.range_constraints,
                    [a for k in program.kernels for a in k.assumptions],
                    captured.state_sources(),
                    [key for kind, key in captured.mutations.values() if kind == "user"],
                    from_one=captured.from_one,
                    shape_guards=program.shape_guards,
                    returns=program.symbols,
                    nondeterministic=any(k.nondeterministic for k in program.graph.all_kernels()),
                    tf32=tf32_setting(program.graph.all_kernels()),
                    conv_library=program.graph.conv_library,
                    held=held_sources(captured, program.graph.held),
                    module=captured.module,
                )
        except GuardBuildError as e:
            return f"cannot guard the exported program: {e}"
        stats.count("compiles")
        index = len(self.entries)
        recompiles_log.info(
            "%s: entry %d compiled; dynamic: %s",
            self._name(),
            index,
            ", ".join(guards.dynamic_dims) or "none (every dim static)",
        )
        guards_log.info("guards of entry %d of %s:\n%s", index, self._name(), guards.format())
        specialized = specialized_dims(dims, captured.user_vals, names)
        entry = Entry(guards, spec, program, specialized, names, inputs_record(flat, captured.user_vals))
        cuda_graphs.release(self.entries)  # the calls moved on: the older entries' graphs free their memory
        entry.graphs = cuda_graphs.for_entry(self.mode, program, f"{self._name()} entry {index}")
        self.entries.append(entry)
        if perf_log.isEnabledFor(logging.INFO) or self._dump_root():
            report = build_report(entry, guards.check(flat) or ())
            for hint in report.perf_hints:
                perf_log.info("%s entry %d: %s", self._name(), index, hint)
            if self._dump_root():
                self._dump(entry, index, report)
        return entry

    def _dump_root(self) -> str | None:
        return self.dump_dir if self.dump_dir is not None else config.dump_dir

    def _dump(self, entry: Entry, index: int, report: Report) -> None:
        """Write every compile stage of this entry under the dump folder (see gjit/debug/dump.py)."""
        program, captured, t = entry.program, entry.program.captured, entry.program.timings
        path = dump.folder_for(self._dump_root(), self._name(), index)
        files = {
            "01_core_aten.txt": dump.stage_header("run_decompositions (core ATen)", t.get("decompose"))
            + readable(captured.full_graph_module),
            **program.dumped(),
            "03_regions.dot": dump.regions_dot(captured.full_graph_module, program.steps),
            "guards.txt": dump.stage_header("guards (guards/builder.py)", t.get("guards"))
            + entry.guards.format()
            + "\n\n"
            + entry.guards.source,
            "report.json": dump.report_json(report),
        }
        if captured.exported is not None:
            files["00_exported.txt"] = dump.stage_header(
                "torch.export.export (non-strict)", t.get("export")
            ) + readable(captured.exported.graph_module)
        dump.write(path, files)
        logs.logger("output_code").info(
            "%s entry %d: compile stages written to %s", self._name(), index, path
        )

    def _run_eager(self, args: tuple, kwargs: dict, reason: str) -> Any:
        recompiles_log.info("%s: eager fallback from now on: %s", self._name(), reason)
        stats.count("eager_runs")
        result = self._eager(args, kwargs)  # a forward that raises raises its own error, unwarned
        log.warning("gjit could not capture %s, running it eagerly: %s", self._name(), reason.splitlines()[0])
        # the model ran fine eagerly, so capture itself is the problem: stop retrying it, unless
        # entries exist (then only this kind of call fails to export; the others keep their kernels)
        with locks.compiling():
            if not self.entries:
                self.eager_reason = reason
        return result

    def _eager(self, args: tuple, kwargs: dict) -> Any:
        if self.model is None:  # a package loaded with its own weights: there is no model to run
            raise RuntimeError(
                f"{self._name()} (loaded from {self.package.path} without its model) cannot run this call "
                "eagerly (it needs autograd, or no entry can run it); load the package with model=..."
            )
        return self.model(*args, **kwargs)

    def _name(self) -> str:
        if self.model is None and self.package is not None:
            return self.package.name
        if isinstance(self.model, torch.nn.Module):
            return f"{type(self.model).__qualname__}.forward"
        return getattr(self.model, "__qualname__", type(self.model).__name__)


# Dynamo must not trace into a compiled function (its guards, export on a miss): under an outer
# torch.compile, such as the one transformers' generate() puts around a model with a static cache
# on a GPU, the call is a graph break and gjit runs its own kernels (0.5 us a call)
CompiledFunction.__call__ = torch._dynamo.disable(CompiledFunction.__call__)


def compile(
    model: Any = None,
    *,
    dynamic: bool | None = None,
    check: bool | None = None,
    dump_dir: str | None = None,
    backend: str | None = None,
    mode: str | None = None,
) -> Any:
    """Compile `model` (nn.Module, function, ExportedProgram or .pt2 path); usable as a decorator.

    dynamic=None (and True): export decides from the first call which dims stay dynamic (sizes 0
    and 1 are specialized, so they get entries of their own); a call no entry admits compiles a
    new entry the same way. dynamic=True also exports Python int inputs (>= 2) as symbols, as
    torch.compile does. dynamic=False: every dim static, one entry per distinct shape.
    gjit.mark_dynamic(t, dim, min, max) makes a dim dynamic within a range.
    check=True (or GJIT_CHECK=1): compare every kernel with the eager fallback on each call (slow).
    dump_dir (or GJIT_DUMP_DIR): write every compile stage of each entry there.
    backend="triton" (default, or GJIT_BACKEND) or "cupy": CUDA C kernels compiled with NVRTC and
    launched through CuPy (on CPU tensors with gjit.config.interpret, a host emulation runs them).
    mode (torch.compile's; None: GJIT_MODE): "reduce-overhead" or "max-autotune" replay CUDA graphs,
    one per set of sizes (gjit/runtime/cuda_graphs.py: a size's second call records, later ones
    replay; outputs the caller holds are never overwritten); "default", "max-autotune-no-cudagraphs" not.
    """
    options = dict(dynamic=dynamic, check=check, dump_dir=dump_dir, backend=backend, mode=mode)
    if model is None:
        return lambda m: CompiledFunction(m, **options)
    return CompiledFunction(model, **options)


def explain(model: Any, *args: Any, **kwargs: Any) -> Report:
    """What gjit compiles for this call: kernels (with sources), externs and why, guards, dynamic
    and specialized dims, perf hints, modeled bytes at this call's sizes."""
    cm = model if isinstance(model, CompiledFunction) else CompiledFunction(model)
    if cm.eager_reason is not None:
        raise CaptureError(f"gjit could not capture {cm._name()}: {cm.eager_reason}")
    entry, sizes = cm.entry_for(args, kwargs)
    return build_report(entry, sizes)
