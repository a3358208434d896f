"""Public entry points: gjit.compile, the compiled callable, gjit.explain."""

from __future__ import annotations

import dataclasses
import functools
import logging
import weakref
from typing import Any

import sympy
import torch
import torch.utils._pytree as pytree

from gjit import stats
from gjit.capture import CaptureError, bind_call, capture, forward_signature
from gjit.compiler import CompiledProgram, compile_program, run_program, size_hints, timed
from gjit.guards import GuardSet, build_guards
from gjit.ir import ExternNode
from gjit.perf_model import Traffic, traffic

log = logging.getLogger("gjit.capture")
recompiles_log = logging.getLogger("gjit.recompiles")
guards_log = logging.getLogger("gjit.guards")


@dataclasses.dataclass
class Entry:
    """One compiled specialization of a callable: the guards that admit a call, and the program."""

    guards: GuardSet
    spec: pytree.TreeSpec
    program: CompiledProgram


def _input_names(args: tuple, kwargs: dict, signature) -> list[str]:
    params = list(signature.parameters) if signature is not None else []
    names = []
    for path, _ in pytree.tree_flatten_with_path((args, kwargs))[0]:
        head, rest = path[0].idx, path[1:]
        if head == 0 and rest and hasattr(rest[0], "idx") and rest[0].idx < len(params):
            names.append(params[rest[0].idx] + pytree.keystr(rest[1:]))
        elif head == 1 and rest:
            names.append(pytree.keystr(rest).strip("[]'\""))
        else:
            names.append(("args" if head == 0 else "kwargs") + pytree.keystr(rest))
    return names


LIVE: weakref.WeakSet = weakref.WeakSet()  # every CompiledFunction, so gjit.reset() reaches them


class CompiledFunction:
    """What `gjit.compile(model)` returns: call it like the model."""

    def __init__(self, model: Any, *, dynamic: bool | None = None):
        self.model = model
        self.dynamic = dynamic
        self.signature = forward_signature(model)
        self.entries: list[Entry] = []
        self.eager_reason: str | None = None
        self._warned_autograd = False
        self._tensor_tuple_specs: dict[int, pytree.TreeSpec] = {}
        if self.signature is not None:
            positional = [
                p
                for p in self.signature.parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            ]
            self._fast_arity = len(positional) if all(p.default is p.empty for p in positional) else -1
        else:
            self._fast_arity = -1
        if callable(model) and not isinstance(model, torch.nn.Module):
            functools.update_wrapper(self, model, updated=())
        LIVE.add(self)

    def reset(self) -> None:
        """Forget compiled entries and a recorded capture failure."""
        self.entries.clear()
        self.eager_reason = None

    def __repr__(self) -> str:
        return (
            f"gjit.CompiledFunction({getattr(self.model, '__name__', type(self.model).__name__)}, "
            f"entries={len(self.entries)})"
        )

    def _normalize(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not kwargs and len(args) == self._fast_arity:
            return args, kwargs
        return bind_call(self.signature, args, kwargs, self._name())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.eager_reason is not None:
            stats.COUNTERS["eager_runs"] += 1
            return self.model(*args, **kwargs)
        args, kwargs = self._normalize(args, kwargs)
        flat, spec = self._flatten(args, kwargs)
        if torch.is_grad_enabled() and self._needs_autograd(flat):
            stats.COUNTERS["eager_runs"] += 1
            return self.model(*args, **kwargs)
        for entry in reversed(self.entries):
            if entry.spec == spec and entry.guards.check(flat):
                stats.COUNTERS["cache_hits"] += 1
                return run_program(entry.program, flat)
        entry = self._compile(args, kwargs, flat, spec)
        if entry is None:
            return self._run_eager(args, kwargs)
        return run_program(entry.program, flat)

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
        if isinstance(self.model, torch.nn.Module):
            tensors += list(self.model.parameters())
        if not any(t.requires_grad for t in tensors):
            return False
        if not self._warned_autograd:
            self._warned_autograd = True
            log.warning(
                "gjit compiles inference graphs: %s was called with tensors that require grad while grad "
                "mode is on, so it runs eagerly (outputs keep their gradients). Call it under "
                "torch.no_grad() or torch.inference_mode() to use the compiled kernels.",
                self._name(),
            )
        return True

    def entry_for(self, args: tuple, kwargs: dict) -> Entry | None:
        """The entry that serves this call, compiling one if none does (used by explain)."""
        args, kwargs = self._normalize(args, kwargs)
        flat, spec = pytree.tree_flatten((args, kwargs))
        for entry in reversed(self.entries):
            if entry.spec == spec and entry.guards.check(flat):
                return entry
        return self._compile(args, kwargs, flat, spec)

    def _compile(self, args: tuple, kwargs: dict, flat: list, spec: pytree.TreeSpec) -> Entry | None:
        if self.entries:
            stats.COUNTERS["recompiles"] += 1
            newest = self.entries[-1]
            why = newest.guards.failures(flat) if newest.spec == spec else ["the inputs' structure changed"]
            recompiles_log.info("recompiling %s: %s", self._name(), "; ".join(why))
        timings: dict[str, float] = {}
        try:
            with timed("capture", timings):
                captured = capture(self.model, args, kwargs, dynamic=self.dynamic is not False)
        except CaptureError as e:
            self._capture_failed = str(e)
            log.warning(
                "gjit could not capture %s, running it eagerly: %s", self._name(), str(e).splitlines()[0]
            )
            return None
        program = compile_program(captured, timings)
        stats.COUNTERS["compiles"] += 1
        names = _input_names(args, kwargs, self.signature)
        guards = build_guards(flat, names)
        guards_log.debug("guards of entry %d of %s:\n%s", len(self.entries), self._name(), guards.format())
        entry = Entry(guards, spec, program)
        self.entries.append(entry)
        return entry

    def _run_eager(self, args: tuple, kwargs: dict) -> Any:
        stats.COUNTERS["eager_runs"] += 1
        result = self.model(*args, **kwargs)
        # the model ran fine eagerly, so capture itself is the problem: stop retrying it
        self.eager_reason = getattr(self, "_capture_failed", "capture failed")
        return result

    def _name(self) -> str:
        if isinstance(self.model, torch.nn.Module):
            return f"{type(self.model).__qualname__}.forward"
        return getattr(self.model, "__qualname__", type(self.model).__name__)


def compile(model: Any = None, *, dynamic: bool | None = None) -> Any:
    """Compile `model` (nn.Module, function, ExportedProgram or .pt2 path); usable as a decorator.

    dynamic=None: export decides which dims can be dynamic (kernels take sizes as arguments);
    dynamic=False: static export. Guards in this version admit exactly the example's shapes.
    """
    if model is None:
        return lambda m: CompiledFunction(m, dynamic=dynamic)
    return CompiledFunction(model, dynamic=dynamic)


# ----------------------------------------------------------------------------------------------
# explain
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class KernelInfo:
    name: str
    source: str
    aten_nodes: list[str]
    source_lines: list[str]
    path: str
    bytes_read: int = 0  # modeled, at the example sizes
    bytes_written: int = 0


@dataclasses.dataclass
class ExternInfo:
    node: str
    op: str
    reason: str


@dataclasses.dataclass
class Report:
    kernels: list[KernelInfo]
    externs: list[ExternInfo]
    guards: str
    loop_ir: str
    timings: dict[str, float]
    traffic: Traffic  # modeled bytes: gjit vs eager vs ideal, at the example sizes

    def __str__(self) -> str:
        out = [f"gjit: {len(self.kernels)} kernel(s), {len(self.externs)} extern(s)"]
        for k in self.kernels:
            out.append(f"  kernel {k.name}: {', '.join(n.split(':')[0] for n in k.aten_nodes)}")
        for e in self.externs:
            out.append(f"  extern {e.node} = {e.op}: {e.reason}")
        out.append(f"  {self.traffic}")
        out.append("  compile time: " + ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in self.timings.items()))
        return "\n".join(out)


def explain(model: Any, *args: Any, **kwargs: Any) -> Report:
    """What gjit compiles for this call: kernels (with sources), externs and why, guards."""
    cm = model if isinstance(model, CompiledFunction) else CompiledFunction(model)
    if cm.eager_reason is not None:
        raise CaptureError(f"gjit could not capture {cm._name()}: {cm.eager_reason}")
    entry = cm.entry_for(args, kwargs)
    if entry is None:
        raise CaptureError(f"gjit could not capture {cm._name()}: {getattr(cm, '_capture_failed', '')}")
    program = entry.program
    hints = size_hints(program.captured.graph_module)
    kernels = [
        KernelInfo(
            k.name,
            k.source,
            k.aten_nodes,
            k.source_lines,
            program.graph.kernel_paths.get(k.name, ""),
            int(sympy.sympify(k.bytes_read).subs(hints)),
            int(sympy.sympify(k.bytes_written).subs(hints)),
        )
        for k in program.kernels
    ]
    externs = [
        ExternInfo(s.name, str(s.fx_node.target), s.reason)
        for s in program.steps
        if isinstance(s, ExternNode) and s.reason != "element of an extern's result"
    ]
    by_name = {k.name: k for k in program.kernels}
    moved = traffic(program.loop_graph, program.steps, by_name, hints)
    return Report(
        kernels, externs, entry.guards.format(), program.loop_graph.format(), dict(program.timings), moved
    )
