"""Guards of a compiled entry: which calls it may serve, and the sizes it binds for the wrapper.

Built from the export result: each user input's placeholder has sizes and strides as sympy
expressions over size symbols (the first plain-symbol occurrence binds the symbol, later ones
check their expression, e.g. `y.size(0) == s0 + 1`), export's range constraints, the shape
environment's own guards (a branch on a size), and the assumptions generated kernels made
(a persistent reduction row fits its block, int32 offsets). An int input export kept symbolic
binds its symbol like a size. Types, dtypes, devices and specialized Python scalars come from
the example call.

The checks compile into ONE generated function for the hot path, which returns the values of
the size symbols it bound (handed to the wrapper, so sizes are not read twice) or None on a
miss; `failures` re-runs the checks one by one to explain a miss with expected and actual
values.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from collections.abc import Callable, Collection, Sequence
from typing import Any

import sympy
import torch
from torch.utils._sympy.numbers import int_oo

from gjit.codegen.printer import pyexpr
from gjit.guards.state import held_guards, state_guards, tied_guards
from gjit.lowering.convolutions import CONV_LIBRARIES
from gjit.lowering.held_masks import Band


class GuardBuildError(RuntimeError):
    """A guard the entry needs cannot be expressed over the call's inputs."""


@dataclasses.dataclass
class Guard:
    code: str  # Python boolean expression, True when the call is admitted
    description: str  # the expected condition, as a user reads it
    actual: str  # Python expression whose value explains a failure
    input_index: int | None = None  # a failed type/rank check of this input hides its later ones
    kind: str = ""  # type | dtype | device | rank | size | stride | range | shape | scalar | kernel
    # where the check runs: "both" (the hot function and the slow path that explains a miss),
    # "hot" (only the first: one check that stands for the slow path's finer ones), "explain"
    where: str = "both"


@dataclasses.dataclass
class Bind:
    name: str
    code: str


@dataclasses.dataclass
class GuardSet:
    steps: list[Guard | Bind]
    symbols: list[sympy.Symbol]  # bound by the guard, in the order `check` returns their values
    symbol_sources: dict[sympy.Symbol, str]  # s0 -> "x.size(0)"
    source: str
    check: Callable[[Sequence[Any]], tuple | None]
    namespace: dict[str, Any]

    @property
    def guards(self) -> list[Guard]:
        """The checks as a user reads them (not the hot path's combined ones)."""
        return [s for s in self.steps if isinstance(s, Guard) and s.where != "hot"]

    def failures(self, flat_inputs: Sequence[Any]) -> list[str]:
        """Every failing guard with its expected condition and the actual value (the slow path)."""
        env = dict(self.namespace, inputs=flat_inputs)
        out, broken = [], set()
        for step in self.steps:
            if isinstance(step, Bind):
                try:
                    exec(f"{step.name} = {step.code}", env)  # noqa: S102 - our own generated guard text
                except Exception:
                    pass  # a check that needs this name fails and is reported below
                continue
            if step.where == "hot" or step.input_index in broken:
                continue
            try:
                ok = bool(eval(step.code, env))  # noqa: S307
            except Exception:
                ok = False
            if ok:
                continue
            try:
                actual = repr(eval(step.actual, env))  # noqa: S307
            except Exception as e:
                actual = f"<{type(e).__name__}>"
            out.append(f"{step.description}, got {actual}")
            if step.kind in ("type", "rank", "arity"):
                broken.add(step.input_index)
            if step.kind == "arity":
                break
        return out

    def format(self) -> str:
        """One readable line per guard (binds shown as `s0 := x.size(0)`)."""
        lines = []
        for step in self.steps:
            if isinstance(step, Bind):
                sym = next((s for s in self.symbols if s.name == step.name), None)
                if sym is not None:
                    lines.append(f"{sym.name} := {self.symbol_sources[sym]}")
            elif step.where != "hot":
                lines.append(f"{step.kind:6s} {step.description}")
        return "\n".join(lines)

    @property
    def dynamic_dims(self) -> list[str]:
        return [f"{self.symbol_sources[s]} = {s}" for s in self.symbols]


# ----------------------------------------------------------------------------------------------
# Building
# ----------------------------------------------------------------------------------------------


def input_symbols(user_vals: Sequence[Any]) -> list[sympy.Symbol]:
    """The size symbols the guard binds from the user inputs, in binding order: every plain
    symbol among sizes and symbolic int inputs (input by input), then among strides."""
    seen: list[sympy.Symbol] = []
    for attr in ("shape", "stride"):
        for val in user_vals:
            if isinstance(val, torch.SymInt) and attr == "shape":
                values = [val]
            elif isinstance(val, torch.Tensor):
                values = val.shape if attr == "shape" else val.stride()
            else:
                continue
            for s in values:
                e = _expr(s)
                if isinstance(e, sympy.Symbol) and e not in seen:
                    seen.append(e)
    return seen


def _expr(value: Any) -> sympy.Expr:
    if isinstance(value, (torch.SymInt, torch.SymBool)):
        return value.node.expr
    return sympy.Integer(int(value))


def shape_env_of(user_vals: Sequence[Any]):
    for val in user_vals:
        if isinstance(val, torch.SymInt):
            return val.node.shape_env
        if isinstance(val, torch.Tensor):
            for s in (*val.shape, *val.stride()):
                if isinstance(s, torch.SymInt):
                    return s.node.shape_env
    return None


class _Builder:
    def __init__(self, names: list[str]):
        self.names = names
        self.steps: list[Guard | Bind] = []
        self.late_binds: list[Bind] = []  # stride reads and symbols, after every size is bound
        self.later: list[Guard] = []  # checks that may use symbols bound by later inputs or strides
        self.bound: dict[sympy.Symbol, str] = {}  # symbol -> user-readable source
        self.namespace: dict[str, Any] = {"torch": torch, "Tensor": torch.Tensor, "math": math}

    def guard(self, code: str, description: str, actual: str, i: int | None, kind: str, later=False) -> None:
        (self.later if later else self.steps).append(Guard(code, description, actual, i, kind))

    def tensor(self, i: int, value: torch.Tensor, val: torch.Tensor | None) -> None:
        v, name = f"in{i}", self.names[i]
        val = value if val is None else val
        self.guard(f"isinstance({v}, Tensor)", f"{name} is a Tensor", f"type({v}).__name__", i, "type")
        dtype = str(val.dtype).replace(".", "_")  # a namespace constant: no attribute lookup per call
        self.namespace[dtype] = val.dtype
        self.guard(f"{v}.dtype is {dtype}", f"{name}.dtype == {val.dtype}", f"{v}.dtype", i, "dtype")
        # a lazily negated (or, for complex, conjugated) view reads raw storage kernels would not fix up
        if val.dtype.is_complex:
            code, bits = f"not ({v}.is_neg() or {v}.is_conj())", f"({v}.is_neg(), {v}.is_conj())"
            self.guard(code, f"{name} has no neg/conj bit", bits, i, "dtype")
        else:
            self.guard(f"not {v}.is_neg()", f"{name} has no neg bit", f"{v}.is_neg()", i, "dtype")
        self.guard(
            _device_check(v, value.device), f"{name}.device == {value.device}", f"{v}.device", i, "device"
        )
        size = f"{v}_size"
        self.steps.append(Bind(size, f"{v}.shape"))
        sizes = [_expr(s) for s in val.shape]
        self.guard(f"len({size}) == {len(sizes)}", f"{name}.dim() == {len(sizes)}", f"{v}.dim()", i, "rank")
        if all(s.is_number for s in sizes):
            shape = tuple(int(s) for s in sizes)
            self.guard(f"{size} == {shape}", f"{name}.shape == {shape}", f"tuple({size})", i, "size")
        else:
            for d, s in enumerate(sizes):
                here = f"{size}[{d}]"
                if s.is_number:
                    self.guard(f"{here} == {int(s)}", f"{name}.size({d}) == {int(s)}", here, i, "size")
                elif isinstance(s, sympy.Symbol) and s not in self.bound:
                    self.steps.append(Bind(s.name, here))
                    self.bound[s] = f"{name}.size({d})"
                else:
                    self.guard(
                        f"{here} == {pyexpr(s)}", f"{name}.size({d}) == {s}", here, i, "size", later=True
                    )
        self.strides(i, v, name, sizes, [_expr(s) for s in val.stride()])

    def strides(self, i: int, v: str, name: str, sizes: list[sympy.Expr], strides: list[sympy.Expr]) -> None:
        """The stride pattern kernels index with; a dim of size 1 may have any stride."""
        stride = f"{v}_stride"
        self.late_binds.append(Bind(stride, f"{v}.stride()"))
        if all(s.is_number for s in (*sizes, *strides)) and all(int(s) != 1 for s in sizes):
            expected = tuple(int(s) for s in strides)
            self.guard(f"{stride} == {expected}", f"{name}.stride() == {expected}", stride, i, "stride", True)
            return
        for d, (size, st) in enumerate(zip(sizes, strides)):
            here = f"{stride}[{d}]"
            if size == 1 and not (isinstance(st, sympy.Symbol) and st not in self.bound):
                continue  # any stride will do (a symbol export gave one is still bound, below)
            if isinstance(st, sympy.Symbol) and st not in self.bound:
                self.late_binds.append(Bind(st.name, here))
                self.bound[st] = f"{name}.stride({d})"
                continue
            code = f"{here} == {pyexpr(st)}"
            if not size.is_number:
                code = f"{v}_size[{d}] == 1 or {code}"
            self.guard(code, f"{name}.stride({d}) == {st}", here, i, "stride", True)

    def symint(self, i: int, val: torch.SymInt) -> None:
        """An int input export kept symbolic: its first occurrence binds the symbol, like a size."""
        v, name = f"in{i}", self.names[i]
        self.guard(f"type({v}) is int", f"{name} is an int", f"type({v}).__name__", i, "type")
        e = _expr(val)
        if e.is_number:
            self.guard(f"{v} == {int(e)}", f"{name} == {int(e)} (specialized)", v, i, "scalar")
        elif isinstance(e, sympy.Symbol) and e not in self.bound:
            self.steps.append(Bind(e.name, v))
            self.bound[e] = name
        else:
            self.guard(f"{v} == {pyexpr(e)}", f"{name} == {e}", v, i, "scalar", later=True)

    def scalar(self, i: int, value: Any) -> None:
        v, name = f"in{i}", self.names[i]
        if value is None:
            self.guard(f"{v} is None", f"{name} is None", v, i, "type")
            return
        kind = type(value)
        self.namespace[f"type{i}"] = kind
        self.guard(f"type({v}) is type{i}", f"{name} is a {kind.__name__}", f"type({v}).__name__", i, "type")
        if isinstance(value, float) and math.isnan(value):
            self.guard(f"{v} != {v}", f"{name} is nan (specialized)", v, i, "scalar")
        elif isinstance(value, float) and value == 0.0:  # 0.0 == -0.0, but 1 / -0.0 is -inf
            sign = math.copysign(1.0, value)
            code = f"{v} == 0.0 and math.copysign(1.0, {v}) == {sign}"
            self.guard(code, f"{name} == {value!r} (specialized)", v, i, "scalar")
        elif isinstance(value, (bool, int, float, str)) and not (
            isinstance(value, float) and math.isinf(value)
        ):
            self.guard(f"{v} == {value!r}", f"{name} == {value!r} (specialized)", v, i, "scalar")
        else:
            self.namespace[f"const{i}"] = value
            self.guard(f"{v} == const{i}", f"{name} == {value!r} (specialized)", v, i, "scalar")

    def condition(self, cond: sympy.Basic, description: str, kind: str, code: str | None = None) -> None:
        """A check over bound symbols; `code` overrides printing `cond` (sympy folds `s0 >= 1` to
        True because size symbols are declared positive, but the check must still run)."""
        if code is None and cond == sympy.true:
            return
        missing = cond.free_symbols - set(self.bound)
        if missing:
            raise GuardBuildError(
                f"guard {cond} uses size symbols {sorted(map(str, missing))} no input binds"
            )
        names = ", ".join(f"{s}: {self.bound[s]}" for s in sorted(cond.free_symbols, key=str))
        actual = "(" + ", ".join(s.name for s in sorted(cond.free_symbols, key=str)) + ",)"
        if code is None:
            try:
                code = pyexpr(cond)
            except ValueError as e:  # a condition the printer has no form for: no entry, never a crash
                raise GuardBuildError(f"cannot write guard {cond} as Python: {e}") from e
        self.guard(code, f"{description}   [{names}]", actual, None, kind, later=True)


def _device_check(v: str, device: torch.device) -> str:
    if device.type == "cpu":
        return f"{v}.is_cpu"
    if device.type == "cuda":
        return f"{v}.is_cuda and {v}.get_device() == {device.index or 0}"
    return f"{v}.device == torch.device({str(device)!r})"


def build_guards(
    flat_inputs: Sequence[Any],
    names: list[str],
    user_vals: Sequence[Any] | None = None,
    range_constraints: dict | None = None,
    assumptions: Sequence[tuple[sympy.Basic, str]] = (),
    state: Sequence[tuple[Any, str, torch.Tensor, str]] = (),
    mutated: Sequence[int] = (),
    from_one: Collection[tuple[int, int]] = (),
    shape_guards: Sequence[sympy.Basic] = (),
    returns: Sequence[sympy.Symbol] | None = None,
    nondeterministic: bool = False,
    tf32: bool | None = None,
    conv_library: tuple[str, bool] | None = None,
    held: Sequence[tuple[Callable[[], Any], Band, str]] = (),
    module: torch.nn.Module | None = None,
) -> GuardSet:
    """The guard set of one entry. `user_vals`: export's placeholder value per flat input (None:
    static, from the example); `assumptions`: (condition, why) the kernels rely on;
    `state`: (owner module, attribute, export's value, qualified name) of each parameter /
    buffer the program reads live; `mutated`: flat indices of user inputs the program writes to;
    `from_one`: (flat input, dim) pairs export traced size-obliviously from 1 (a KV cache's
    length): their symbols are admitted from 1, every other symbol from 2; `shape_guards`: guards
    decomposition added to export's shape environment, when this one lacks them (a warm start);
    `returns`: the symbols the wrapper takes, in its order (default: every bound symbol);
    `nondeterministic`: a kernel sums with float atomics, so the entry admits a call only while
    torch's deterministic algorithms are off (else the recompile makes those writes externs);
    `tf32`: the TF32 setting a kernel's float32 products were compiled under (None: none has
    one), which the entry then requires, as eager's products follow it call by call; `conv_library`: the
    library flag the program's convolutions ran under at compile time and its value (cuDNN or
    oneDNN on or off: which kernels run them decides the layout of their outputs, which the
    kernels after them read), which the entry then requires; `held`:
    (reader, band, name) of each buffer or constant whose contents a mask's proof read; `module`:
    the live module `state` is read from (its tied names are guarded to stay tied)."""
    n = len(flat_inputs)
    user_vals = list(user_vals) if user_vals is not None else [None] * n
    b = _Builder(names)
    b.guard(f"len(inputs) == {n}", f"{n} flattened inputs", "len(inputs)", None, "arity")
    if n:
        b.steps.append(Bind(", ".join(f"in{i}" for i in range(n)) + ("," if n == 1 else ""), "inputs"))
    for i, value in enumerate(flat_inputs):
        if isinstance(value, torch.Tensor):
            b.tensor(i, value, user_vals[i] if isinstance(user_vals[i], torch.Tensor) else None)
        elif isinstance(user_vals[i], torch.SymInt):
            b.symint(i, user_vals[i])
        else:
            b.scalar(i, value)
    symbols = input_symbols(user_vals)
    assert set(symbols) == set(b.bound), (symbols, list(b.bound))
    _aliasing(b, flat_inputs, set(mutated))
    state_guards(b, state)
    tied_guards(b, module, state)
    held_guards(b, held)
    ones = {_expr(user_vals[i].shape[d]) for i, d in from_one if isinstance(user_vals[i], torch.Tensor)}
    _ranges(b, range_constraints or {}, {s for s in ones if isinstance(s, sympy.Symbol)})
    env = shape_env_of(user_vals)
    if env is not None:
        _shape_env_guards(b, env, shape_guards)
    for cond, why in _strongest(assumptions):
        b.condition(cond, why, "kernel")
    if nondeterministic:
        b.guard(
            "not torch.are_deterministic_algorithms_enabled()",
            "deterministic algorithms off (float atomics)",
            "torch.are_deterministic_algorithms_enabled()",
            None,
            "state",
        )
    if tf32 is not None:
        b.guard(
            f"torch.backends.cuda.matmul.allow_tf32 == {tf32}",
            f"TF32 {'allowed' if tf32 else 'not allowed'} for float32 matmuls (as when compiled)",
            "torch.backends.cuda.matmul.allow_tf32",
            None,
            "state",
        )
    if conv_library is not None:
        name, value = conv_library
        expression = CONV_LIBRARIES[name][0]
        b.guard(
            f"bool({expression}) == {value}",
            f"{name} {'on' if value else 'off'} for convolutions (their output layouts, as when compiled)",
            expression,
            None,
            "state",
        )
    steps = b.steps + b.late_binds + b.later
    if returns is not None:
        missing = set(returns) - set(b.bound)
        if missing:
            names = sorted(map(str, missing))
            raise GuardBuildError(f"the wrapper takes size symbols {names} no input binds")
        symbols = list(returns)
    returned = ", ".join(s.name for s in symbols) + ("," if len(symbols) == 1 else "")
    source = _function_source(steps, f"({returned})")
    exec(compile(source, "<gjit-guard>", "exec"), b.namespace)  # noqa: S102 - generated guard source
    return GuardSet(steps, symbols, dict(b.bound), source, b.namespace["guard"], b.namespace)


def _aliasing(b: _Builder, flat: Sequence[Any], mutated: set[int]) -> None:
    """Export traced the example's aliasing: one tensor passed twice became one graph input, and
    inputs the program writes were assumed not to share memory with any other input. The hot
    path reads each tensor's storage once (`_apart`: a static-cache decode step writes 24 inputs
    of 100); the slow path explains a miss pair by pair."""
    first: dict[int, int] = {}
    tensors = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor)]
    for i in tensors:
        j = first.setdefault(id(flat[i]), i)
        if j != i:
            b.guard(f"in{i} is in{j}", f"{b.names[i]} is {b.names[j]}", f"in{i} is in{j}", i, "alias", True)
    distinct = [j for j in tensors if first[id(flat[j])] == j]
    written = [distinct.index(i) for i in sorted(mutated) if i in distinct]
    if not written or len(distinct) < 2:
        return
    b.namespace["written_apart"] = functools.partial(_apart, written)
    code = f"written_apart({', '.join(f'in{j}' for j in distinct)})"
    b.guard(code, "the written inputs share no memory with the others", "None", None, "alias", True)
    b.later[-1].where = "hot"
    for i in (distinct[k] for k in written):
        for j in distinct:
            if j != i:
                code = f"in{i}.untyped_storage().data_ptr() != in{j}.untyped_storage().data_ptr()"
                desc = f"{b.names[i]} (written) shares no memory with {b.names[j]}"
                b.guard(code, desc, f"in{i}.untyped_storage().data_ptr()", None, "alias", True)
                b.later[-1].where = "explain"


def _apart(written: list[int], *tensors: torch.Tensor) -> bool:
    """Whether no tensor at a `written` position shares its storage with another of `tensors`."""
    storages = [s.data_ptr() for s in map(torch.Tensor.untyped_storage, tensors)]
    if len(set(storages)) == len(storages):
        return True
    return all(storages.count(storages[k]) == 1 for k in written)


def _ranges(b: _Builder, ranges: dict, from_one: set[sympy.Symbol]) -> None:
    for expr, vr in ranges.items():
        expr = sympy.sympify(expr)
        if not expr.free_symbols or not expr.free_symbols <= set(b.bound):
            continue
        lower = int(vr.lower) if vr.lower not in (-int_oo, -sympy.oo) else None
        if isinstance(expr, sympy.Symbol):
            # export traced the program assuming the size is at least 2 (a user range may say
            # less): sizes 0 and 1 get entries of their own, where export specializes them
            # (gjit.guards.policy exports only int inputs >= 2 as symbols, so the same holds);
            # a KV length traced size-obliviously from 1 is admitted from 1, never 0
            lower = max(lower or 0, 1 if expr in from_one else 2)
        if lower is not None and lower > 0:
            b.condition(expr, f"{expr} >= {lower}", "range", code=f"{pyexpr(expr)} >= {lower}")
        if vr.upper not in (int_oo, sympy.oo):
            upper = int(vr.upper)
            b.condition(expr, f"{expr} <= {upper}", "range", code=f"{pyexpr(expr)} <= {upper}")


def _shape_env_guards(b: _Builder, env, more: Sequence[sympy.Basic] = ()) -> None:
    """Export's own guards (a branch on a size, a 0/1 split), in the entry's symbols; `more` are
    decomposition's, from the on-disk entry."""
    seen = set()
    stored = [types.SimpleNamespace(expr=e, sloc="run_decompositions") for e in more]
    for g in [*env.guards, *stored]:
        cond = env.simplify(g.expr)
        if cond == sympy.true or cond in seen:
            continue
        if cond == sympy.false:
            raise GuardBuildError(f"export recorded an unsatisfiable guard {g.expr}")
        seen.add(cond)
        b.condition(cond, f"{cond} (from {where(g.sloc)})", "shape")


def _strongest(assumptions: Sequence[tuple[sympy.Basic, str]]) -> list[tuple[sympy.Basic, str]]:
    """Kernel assumptions without repeats: of `c * m < bound` over one monomial m, only the
    largest c is kept (it implies the others)."""
    best: dict[tuple, tuple[sympy.Integer, sympy.Basic, str]] = {}
    for cond, why in assumptions:
        cond = sympy.sympify(cond)
        key: tuple = (cond,)
        coeff = sympy.Integer(1)
        if isinstance(cond, (sympy.StrictLessThan, sympy.LessThan)) and cond.rhs.is_number:
            coeff, monomial = sympy.expand(cond.lhs).as_coeff_Mul()
            key = (type(cond), monomial, cond.rhs)
        if key not in best or coeff > best[key][0]:
            best[key] = (coeff, cond, why)
    return [(cond, why) for _, cond, why in best.values()]


def where(sloc: Any) -> str:
    """A shape guard's source location: the user's line when torch found one, else torch's frame."""
    user = getattr(sloc, "maybe_user_loc", None)
    return user if user else str(sloc).strip("()")


def _function_source(steps: list[Guard | Bind], returned: str) -> str:
    """Consecutive checks share one `if not (a and b and ...)`: fewer statements on the hot path."""
    lines = ["def guard(inputs):"]
    pending: list[str] = []

    def flush() -> None:
        if pending:
            joined = " and\n            ".join(f"({code})" for code in pending)
            lines.append(f"    if not (\n            {joined}\n    ):")
            lines.append("        return None")
            pending.clear()

    for step in steps:
        if isinstance(step, Bind):
            flush()
            lines.append(f"    {step.name} = {step.code}")
        elif step.where != "explain":
            pending.append(step.code)
    flush()
    lines.append(f"    return {returned}")
    return "\n".join(lines) + "\n"


def tf32_setting(kernels: Sequence[Any]) -> bool | None:
    """The TF32 setting the kernels' float32 products were compiled under (None: they have none)."""
    return next((k.tf32 for k in kernels if getattr(k, "tf32", None) is not None), None)
