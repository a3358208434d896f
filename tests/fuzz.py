"""Random-program fuzzer: seeded programs over gjit's ops, compiled and compared with eager.

`generate(seed)` builds a `Program`: the Python source of `def program(x0, x1, ...)` over torch
ops (pointwise chains, special functions, scalar constants, broadcasts, views, slices sized
through math.ceil/floor/round of a size, reductions over random dims, max/min with indices,
scans, casts, indexing, cat, repeat/tile, writes into views, padding modes, interpolation,
adaptive pooling) and the specs of its inputs (shape, dtype, layout: contiguous, permuted, sliced
with a step, expanded) for two calls of the same ranks and other sizes, so that every program
also runs guards, cache hits and recompiles. Sizes include 0 and 1. `check(program)` compiles it
with gjit, runs both calls through the generated kernels (Triton's interpreter, debug poisoning;
every fourth seed with looped reductions) and eager, and returns the first `Failure`; `shrink`
minimises a failing program while it still fails the same way, and `Program.reproducer()` prints
it as a self-contained script.

Programs are well-conditioned by construction: each statement is run eagerly on both calls'
inputs while it is generated, and kept only if eager accepts it and its values are finite and
moderate. Ops that are discontinuous in their inputs (comparisons, rounding, float -> int/bool
casts, argmax, any/all) take only *exact* operands: values every correct implementation computes
bit for bit (inputs, views, casts, abs/neg/relu/maximum/minimum/where/clamp, amax/amin, integer
math). So rounding differences in fused float math can never flip a comparison, and a mismatch
is a bug. Floats compare with the tolerances of the least precise float type their computation
rounded to (a float32 sum of bfloat16 values is bfloat16-accurate), or failing that, by being
no farther from a float64 reference than about twice eager's own error.

    python tests/fuzz.py --programs 200 --seed 1000   # a run from the command line
    python tests/fuzz.py --show 17                    # print program 17 as a script
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import inspect
import linecache
import math
import random
import re
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

import gjit

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
I32, I64, BOOL = torch.int32, torch.int64, torch.bool
MAX_ABS = 1e4  # larger float values are rejected: keeps fp16 finite and tolerances meaningful
MAX_NUMEL = 2048


# ----------------------------------------------------------------------------------------------
# Inputs and comparison: their source is copied verbatim into every reproducer.
# ----------------------------------------------------------------------------------------------


def make(seed, shape, dtype, layout=("contiguous",), low=-4, high=5):
    """A seeded input: floats ~ N(0, 1), integers uniform in [low, high), bools fair coins.
    layout ("permute", p): a contiguous tensor of the shape permuted by p, viewed back to `shape`;
    ("step", d, k): every k-th element along dim d of a larger tensor (storage offset 1);
    ("expand", dims): those dims are size 1 in memory, expanded (stride 0)."""
    g = torch.Generator().manual_seed(seed)
    base = list(shape)
    if layout[0] == "permute":
        base = [shape[p] for p in layout[1]]
    elif layout[0] == "step":
        base[layout[1]] = shape[layout[1]] * layout[2] + 1
    elif layout[0] == "expand":
        for d in layout[1]:
            base[d] = 1
    if dtype.is_floating_point:
        t = torch.randn(base, generator=g).to(dtype)
    elif dtype == torch.bool:
        t = torch.rand(base, generator=g) < 0.5
    else:
        t = torch.randint(low, high, base, generator=g, dtype=dtype)
    if layout[0] == "permute":
        return t.permute([layout[1].index(d) for d in range(len(shape))])
    if layout[0] == "step":
        return t[(slice(None),) * layout[1] + (slice(1, None, layout[2]),)]
    if layout[0] == "expand":
        return t.expand(shape)
    return t


def compare(actual, expected, reference=None, precision=None):
    """Same dtype and shape; integers and bools equal; floats close with the tolerances of
    `precision` (the least precise float type the value was rounded to on its way, default its
    dtype) and NaN where eager has NaN, or else no farther from the float64 `reference` than
    about twice eager's own error."""
    assert isinstance(actual, torch.Tensor), f"expected a tensor, got {type(actual).__name__}"
    assert actual.dtype == expected.dtype, f"dtype {actual.dtype} != eager {expected.dtype}"
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != eager {tuple(expected.shape)}"
    if not expected.dtype.is_floating_point:
        assert torch.equal(actual, expected), f"values differ from eager:\n{actual}\n{expected}"
        return
    rtol, atol = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}.get(
        precision or expected.dtype, (1.3e-6, 1e-5)
    )
    assert torch.equal(actual.isnan(), expected.isnan()), f"NaN positions differ:\n{actual}\n{expected}"
    close = torch.isclose(actual.double(), expected.double(), rtol=rtol, atol=atol, equal_nan=True)
    if reference is not None and not close.all():
        ref = reference.double()
        err = (actual.double() - ref).abs().nan_to_num(0)
        err_eager = (expected.double() - ref).abs().nan_to_num(0)
        close |= err <= 2 * err_eager + atol + rtol * ref.abs().nan_to_num(0)
    if not close.all():
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True)
        raise AssertionError(f"values differ from eager:\n{actual}\n{expected}")


# ----------------------------------------------------------------------------------------------
# Programs
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Input:
    name: str
    dims: tuple[int | str, ...]  # a literal size, or a symbol whose size each call chooses
    dtype: torch.dtype
    layout: tuple = ("contiguous",)
    seed: int = 0
    bounds: tuple[tuple[int, int], ...] | None = None  # integer [low, high) per call (indices)

    def shape(self, sizes: dict[str, int]) -> tuple[int, ...]:
        return tuple(d if isinstance(d, int) else sizes[d] for d in self.dims)

    def make_args(self, sizes: dict[str, int], call: int) -> tuple:
        low, high = self.bounds[call] if self.bounds else (-4, 5)
        return (self.seed + call, self.shape(sizes), self.dtype, self.layout, low, high)


@dataclasses.dataclass(frozen=True)
class Stmt:
    target: str
    expr: str
    operands: tuple[str, ...]
    needs_exact: bool = False  # discontinuous: float operands must be exact
    keeps_exact: bool = False  # the result is exact when every operand is


@dataclasses.dataclass
class Program:
    seed: int
    inputs: list[Input]
    stmts: list[Stmt]
    outputs: list[str]
    sizes: list[dict[str, int]]  # per call: symbol -> size

    def source(self) -> str:
        lines = [f"def program({', '.join(i.name for i in self.inputs)}):"]
        lines += [f"    {s.target} = {s.expr}" for s in self.stmts]
        lines.append(f"    return ({', '.join(self.outputs)},)")
        return "\n".join(lines) + "\n"

    def function(self) -> Callable:
        source = self.source()
        filename = f"<gjit-fuzz seed={self.seed} {hashlib.sha1(source.encode()).hexdigest()[:8]}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        namespace = {"torch": torch, "F": F, "math": math}
        exec(compile(source, filename, "exec"), namespace)
        return namespace["program"]

    def args(self, call: int) -> list[torch.Tensor]:
        return [make(*i.make_args(self.sizes[call], call)) for i in self.inputs]

    def reproducer(self, failure: Failure | None = None) -> str:
        calls = []
        for call, sizes in enumerate(self.sizes):
            made = ", ".join(f"make{i.make_args(sizes, call)}" for i in self.inputs)
            calls.append(f"    [{made}],")
        what = f", call {failure.call}: {failure.summary()}" if failure else ""
        rounded = evaluate(self) or {}
        precisions = ", ".join(str(rounded.get(o)) for o in self.outputs)
        backend = "" if gjit.config.backend == "triton" else f", backend={gjit.config.backend!r}"
        knobs = "".join(f", {k}={v!r}" for k, v in reduction_config(self.seed).items())
        return "\n".join(
            [
                f'"""gjit fuzz reproducer (seed {self.seed}{what})"""',
                "import math",
                "",
                "import torch",
                "import torch.nn.functional as F",
                "",
                "import gjit",
                "",
                "",
                inspect.getsource(make),
                inspect.getsource(compare),
                self.source(),
                "CALLS = [  # the same program at two sizes: a cache hit or a recompile",
                *calls,
                "]",
                f"PRECISIONS = [{precisions}]  # per output: the tolerances that apply (None: its dtype's)",
                f"compiled = gjit.compile(program{backend})",
                f"with gjit.config.scope(interpret=True, debug=True{knobs}):",
                "    for args in CALLS:",
                "        expected = program(*args)",
                "        reference = program(*[a.double() if a.is_floating_point() else a for a in args])",
                "        for out in zip(compiled(*args), expected, reference, PRECISIONS):",
                "            compare(*out)",
                'print("gjit matches eager")',
                "",
            ]
        )

    def pruned(self) -> Program:
        """Without statements the outputs do not need, inputs nothing reads, and unused symbols."""
        live = set(self.outputs)
        stmts = []
        for stmt in reversed(self.stmts):
            if stmt.target in live:
                stmts.append(stmt)
                live.update(stmt.operands)
        inputs = [i for i in self.inputs if i.name in live]
        used = {d for i in inputs for d in i.dims if isinstance(d, str)}
        sizes = [{k: v for k, v in s.items() if k in used} for s in self.sizes]
        return Program(self.seed, inputs, stmts[::-1], list(self.outputs), sizes)


# ----------------------------------------------------------------------------------------------
# Eager evaluation: the validity test of generated and shrunk programs
# ----------------------------------------------------------------------------------------------


class Invalid(Exception):
    """Eager rejects the statement, or its values are not well-conditioned."""


def least_precise(dtypes) -> torch.dtype:
    return min(dtypes, key=[BF16, F16, F32, torch.float64].index)


def run_stmt(stmt: Stmt, envs: list[dict], rounded: dict[str, torch.dtype | None]) -> None:
    """Evaluate `stmt` eagerly in every call's environment; record its values, and in `rounded`
    None if it is exact, else the least precise float type rounding went through (whose
    tolerances then apply to it: a float32 sum of rounded bfloat16 values is bfloat16-accurate)."""
    float_operands = [o for o in stmt.operands if envs[0][o].dtype.is_floating_point]
    inexact = [rounded[o] for o in float_operands if rounded[o] is not None]
    if stmt.needs_exact and inexact:
        raise Invalid(f"{stmt.target} needs exact operands")
    results = []
    for env in envs:
        try:
            with warnings.catch_warnings():  # e.g. var() with no degrees of freedom: NaN, as intended
                warnings.simplefilter("ignore")
                value = eval(stmt.expr, {"torch": torch, "F": F, "math": math}, env)
        except Exception as e:
            raise Invalid(f"eager: {e}") from e
        if not isinstance(value, torch.Tensor) or value.numel() > MAX_NUMEL:
            raise Invalid("not a tensor, or too large")
        if value.dtype.is_floating_point:
            if value.isinf().any() or value.nan_to_num(0).abs().gt(MAX_ABS).any():
                raise Invalid("ill-conditioned")
        elif value.dtype != BOOL and value.abs().gt(2**20).any():
            raise Invalid("integers too large")
        results.append(value)
    for env, value in zip(envs, results):
        env[stmt.target] = value
    dtype = results[0].dtype
    if not dtype.is_floating_point or (stmt.keeps_exact and not inexact):
        rounded[stmt.target] = None
    else:
        rounded[stmt.target] = least_precise([dtype, *inexact])


def evaluate(program: Program) -> dict[str, torch.dtype | None] | None:
    """Run `program` eagerly statement by statement: how each value is rounded (see run_stmt), or
    None if eager rejects it or it is ill-conditioned (or breaks the exact-operand rule)."""
    envs = [dict(zip([i.name for i in program.inputs], program.args(c))) for c in range(len(program.sizes))]
    rounded: dict[str, torch.dtype | None] = {i.name: None for i in program.inputs}
    try:
        for stmt in program.stmts:
            run_stmt(stmt, envs, rounded)
    except Invalid:
        return None
    return rounded if all(o in rounded for o in program.outputs) else None


# ----------------------------------------------------------------------------------------------
# Generation
# ----------------------------------------------------------------------------------------------

SMOOTH_UNARY = [
    "torch.exp({a})", "torch.tanh({a})", "torch.sigmoid({a})", "torch.sin({a})", "torch.cos({a})",
    "torch.sqrt({a}.abs())", "torch.log({a}.abs() + 0.5)", "torch.rsqrt({a}.abs() + 1)", "{a} * {a}",
    "F.gelu({a})", "F.silu({a})", "torch.erf({a})", "1 / ({a}.abs() + 0.5)", "torch.expm1({a})",
    "torch.log1p({a}.abs())", "F.softplus({a})", "torch.atan({a})", "torch.nan_to_num({a})",
    "torch.erfc({a})", "torch.lgamma({a}.abs() + 0.5)", "torch.digamma({a}.abs() + 0.5)", "torch.i0({a})",
    "torch.special.erfcx({a}.abs())", "torch.special.ndtri(torch.sigmoid({a}))", "torch.special.i1({a})",
    "torch.special.bessel_j0({a})", "torch.special.bessel_y1({a}.abs() + 0.5)",
    "torch.polygamma(1, {a}.abs() + 0.5)", "torch.special.zeta({a}.abs() + 1.5, 2.0)",
]  # fmt: skip
EXACT_UNARY = ["-{a}", "{a}.abs()", "torch.relu({a})", "{a}.clone()"]
STEP_UNARY = [
    "torch.floor({a})", "torch.round({a})", "torch.sign({a})", "torch.ceil({a})", "torch.trunc({a})",
    "torch.logical_not({a})", "~{a}", "{a}.isnan()", "torch.signbit({a})",
]  # fmt: skip
SMOOTH_BINARY = [
    "{a} + {b}",
    "{a} - {b}",
    "{a} * {b}",
    "{a} / ({b}.abs() + 0.5)",
    "torch.add({a}, {b}, alpha=2)",
    "torch.hypot({a}, {b})",
]
EXACT_BINARY = ["torch.maximum({a}, {b})", "torch.minimum({a}, {b})"]
STEP_BINARY = [
    "{a} > {b}", "{a} <= {b}", "{a} == {b}", "{a} != {b}", "torch.logical_and({a}, {b})",
    "torch.logical_or({a}, {b})", "{a} & {b}", "{a} | {b}", "{a} ^ {b}", "torch.where({a} > {b}, {a}, {b})",
]  # fmt: skip
INT_BINARY = [
    "torch.remainder({a}, {b}.abs() + 1)", "torch.div({a}, {b}.abs() + 1, rounding_mode='floor')",
    "torch.div({a}, {b}.abs() + 1, rounding_mode='trunc')", "{a} // ({b}.abs() + 1)",
]  # fmt: skip
CONSTANTS = [0.5, -1.5, 2.0, 3, -2, 0.1, 0.25, 1e-3, 7, 1]
SMOOTH_SCALAR = [
    "{a} + {k}",
    "{a} * {k}",
    "{k} - {a}",
    "{a} / {nz}",
    "{a} ** 2",
    "torch.pow({a}.abs() + 0.5, 0.5)",
]
EXACT_SCALAR = [
    "{a}.clamp({lo}, {hi})",
    "{a}.clamp(min={k})",
    "{a}.clamp(max={k})",
    "torch.full_like({a}, {k})",
]
STEP_SCALAR = [
    "{a} > {k}", "{a} <= {k}", "torch.where({a} > {k}, {a}, {k2})", "{a}.masked_fill({a} < {k}, {k2})",
    "torch.where({a} >= {k}, 1.0, {a})",
]  # fmt: skip
CASTS = [
    "{a}.to(torch.float16)", "{a}.to(torch.bfloat16)", "{a}.float()", "{a}.to(torch.int32)", "{a}.long()",
    "{a}.bool()",
]  # fmt: skip
SLICES = ["::2", "1:", ":-1", "1::2", "::3", "-2:", "2:5"]


class Generator:
    """Builds one program statement by statement, running each eagerly on both calls' inputs."""

    def __init__(self, seed: int, attempt: int = 0):
        self.seed = seed
        self.rng = random.Random(f"gjit-fuzz {seed} {attempt}")
        self.sizes: list[dict[str, int]] = [{}, {}]
        self.inputs: list[Input] = []
        self.stmts: list[Stmt] = []
        self.envs: list[dict[str, torch.Tensor]] = [{}, {}]
        self.rounded: dict[str, torch.dtype | None] = {}  # see run_stmt
        self.order: list[str] = []
        self.small = False  # may sizes be 0 or 1 (see base_shape)

    # sizes and inputs ---------------------------------------------------------------------------

    def size(self, small: bool) -> int:
        if small:  # sizes export specializes: the second call recompiles
            return self.rng.choices([0, 1, 2, 3, 4, 5, 6, 7, 9], [3, 12, 12, 12, 10, 10, 8, 8, 6])[0]
        return self.rng.choices([2, 3, 4, 5, 6, 7, 9, 12], [12, 12, 10, 10, 8, 8, 6, 4])[0]

    def base_shape(self) -> list[str]:
        """Symbolic sizes shared by the inputs. Most programs keep every size >= 2 in both calls
        (a dynamic entry serves both); a quarter see 0 or 1 too (a specialized entry each)."""
        rank = self.rng.choice([1, 2, 2, 3, 3, 3, 4])
        self.small = self.rng.random() < 0.25
        first = [self.size(self.small) for _ in range(rank)]
        second = [self.size(self.small) if self.rng.random() < 0.7 else v for v in first]
        if second == first:
            second[-1] = first[-1] + self.rng.choice([1, 2, 3]) if first[-1] < 8 else 3
        for values in (first, second):
            while math.prod(values) > 256:
                values[values.index(max(values))] //= 2
        names = []
        for v1, v2 in zip(first, second):
            names.append(self.symbol(v1, v2, "s"))
        return names

    def symbol(self, v1: int, v2: int, prefix: str) -> str:
        name = f"{prefix}{sum(k.startswith(prefix) for k in self.sizes[0])}"
        self.sizes[0][name], self.sizes[1][name] = v1, v2
        return name

    def add_input(self, dims: tuple, dtype: torch.dtype, layout=("contiguous",), bounds=None) -> str:
        spec = Input(
            f"x{len(self.inputs)}", dims, dtype, layout, self.seed * 1000 + 10 * len(self.inputs), bounds
        )
        self.inputs.append(spec)
        for call, env in enumerate(self.envs):
            env[spec.name] = make(*spec.make_args(self.sizes[call], call))
        self.rounded[spec.name] = None
        self.order.append(spec.name)
        return spec.name

    def data_input(self, base: list[str]) -> str:
        rng = self.rng
        rank = rng.choice([0] + [len(base)] * 6 + list(range(1, len(base))))
        dims = tuple(1 if rng.random() < 0.15 else d for d in base[len(base) - rank :])
        dtype = rng.choices([F32, F16, BF16, I32, I64, BOOL], [55, 12, 10, 8, 8, 7])[0]
        layout: tuple = ("contiguous",)
        kind = rng.random()
        if kind < 0.25 and rank >= 2:
            perm = list(range(rank))
            while perm == sorted(perm):
                rng.shuffle(perm)
            layout = ("permute", tuple(perm))
        elif kind < 0.4 and rank >= 1:
            layout = ("step", rng.randrange(rank), rng.choice([2, 3]))
        elif kind < 0.5 and any(isinstance(d, str) for d in dims):
            layout = (
                "expand",
                tuple(d for d in range(rank) if isinstance(dims[d], str) and rng.random() < 0.6),
            )
        return self.add_input(dims, dtype, layout)

    def index_input(self, extents: list[int], shapes: list[tuple[int, ...]], negative: bool) -> str:
        """An integer index input of the given shape per call, into a dim of `extents[call]`."""
        dims = tuple(self.symbol(a, b, "k") for a, b in zip(*shapes))
        bounds = tuple((-n if negative else 0, max(n, 1)) for n in extents)
        dtype = I32 if negative and self.rng.random() < 0.3 else I64
        return self.add_input(dims, dtype, bounds=bounds)

    # statements ---------------------------------------------------------------------------------

    def values(self, name: str) -> list[torch.Tensor]:
        return [env[name] for env in self.envs]

    def is_exact(self, name: str) -> bool:
        return self.rounded[name] is None

    def pick(self, pred: Callable[[torch.Tensor], bool] = lambda t: True, exact: bool = False) -> str | None:
        names = [n for n in self.order if pred(self.envs[0][n]) and (self.is_exact(n) or not exact)]
        if not names:
            return None
        return self.rng.choices(names, [(k + 1) ** 2 for k in range(len(names))])[0]

    def partner(self, a: str, exact: bool = False) -> str | None:
        """A value that broadcasts with `a` in both calls (`a` itself when nothing else does)."""
        names = [
            n for n in self.order if n != a and (self.is_exact(n) or not exact) and self.broadcasts(a, n)
        ]
        if not names or self.rng.random() < 0.1:
            return a
        return self.rng.choices(names, [(k + 1) ** 2 for k in range(len(names))])[0]

    def broadcasts(self, a: str, b: str) -> bool:
        try:
            for ta, tb in zip(self.values(a), self.values(b)):
                torch.broadcast_shapes(ta.shape, tb.shape)
        except RuntimeError:
            return False
        return True

    def dim(self, t: torch.Tensor) -> int:
        d = self.rng.randrange(t.dim())
        return d - t.dim() if self.rng.random() < 0.3 else d

    def unary(self):
        rng, r = self.rng, self.rng.random()
        if r < 0.55:
            a = self.pick()
            return rng.choice(SMOOTH_UNARY).format(a=a), (a,), False, False
        if r < 0.8:
            a = self.pick()
            return rng.choice(EXACT_UNARY).format(a=a), (a,), False, True
        a = self.pick(exact=True)
        return rng.choice(STEP_UNARY).format(a=a), (a,), True, True

    def binary(self):
        rng, r = self.rng, self.rng.random()
        if r < 0.5:
            a = self.pick()
            b = self.partner(a)
            return rng.choice(SMOOTH_BINARY).format(a=a, b=b), (a, b), False, False
        if r < 0.65:
            a = self.pick()
            b = self.partner(a)
            c = self.pick(lambda t: t.dtype == BOOL)
            if c is not None and self.broadcasts(a, c) and self.broadcasts(b, c):
                return f"torch.where({c}, {a}, {b})", (c, a, b), False, True
            return rng.choice(EXACT_BINARY).format(a=a, b=b), (a, b), False, True
        if r < 0.75:
            a = self.pick(lambda t: not t.dtype.is_floating_point and t.dtype != BOOL)
            b = self.partner(a) if a else None
            if a is None or self.envs[0][b].dtype in (BOOL, F32, F16, BF16):
                return None
            return rng.choice(INT_BINARY).format(a=a, b=b), (a, b), True, True
        a = self.pick(exact=True)
        b = self.partner(a, exact=True)
        return rng.choice(STEP_BINARY).format(a=a, b=b), (a, b), True, True

    def scalar(self):
        rng, r = self.rng, self.rng.random()
        a = self.pick(exact=r >= 0.75)
        k, k2 = rng.choice(CONSTANTS), rng.choice(CONSTANTS)
        lo, hi = sorted(rng.sample([-1.5, -1, -0.25, 0, 0.1, 0.5, 1, 2], 2))
        fill = dict(a=a, k=k, k2=k2, nz=rng.choice([2, -4, 0.3, 3.0]), lo=lo, hi=hi)
        if r < 0.5:
            return rng.choice(SMOOTH_SCALAR).format(**fill), (a,), False, False
        if r < 0.75:
            return rng.choice(EXACT_SCALAR).format(**fill), (a,), False, True
        return rng.choice(STEP_SCALAR).format(**fill), (a,), True, True

    def cast(self):
        a = self.pick()
        expr = self.rng.choice(CASTS).format(a=a)
        return expr, (a,), self.envs[0][a].dtype.is_floating_point and "float" not in expr, True

    def view(self):
        rng = self.rng
        a = self.pick(lambda t: t.dim() >= 1)
        if a is None:
            a = self.pick()
            return (
                rng.choice(["{a}.unsqueeze(0)", "{a}.view(1, 1)", "{a}.reshape(-1)"]).format(a=a),
                (a,),
                False,
                True,
            )
        t = self.envs[0][a]
        n = t.dim()
        d = self.dim(t)
        perm = list(range(n))
        rng.shuffle(perm)
        lead = ", ".join([":"] * (d % n))
        ones = [k for k in range(n) if t.shape[k] == 1]
        expand = ", ".join(str(rng.choice([2, 3])) if k in ones else "-1" for k in range(n))
        choices = [
            f"{a}.transpose({d}, {self.dim(t)})",
            f"{a}.permute({', '.join(map(str, perm))})",
            f"{a}.reshape(-1)",
            f"{a}.view(-1)",
            f"{a}.flatten({min(d % n, n - 1)})",
            f"{a}.reshape({a}.shape[0], -1)",
            f"{a}.unflatten({d}, ({rng.choice([2, 3])}, -1))",
            f"{a}[{lead + ', ' if lead else ''}{rng.choice(SLICES)}]",
            f"{a}[{lead + ', ' if lead else ''}:{a}.shape[{d}] // 2]",
            # sizes through the shape environment's functions: CeilToInt, FloorToInt, RoundToInt
            f"{a}[{lead + ', ' if lead else ''}:math.ceil({a}.shape[{d}] / 2)]",
            f"{a}[{lead + ', ' if lead else ''}math.floor({a}.shape[{d}] / 3):]",
            f"{a}[{lead + ', ' if lead else ''}:round({a}.shape[{d}] / 3)]",
            f"{a}.select({d}, {rng.choice([0, -1, 1])})",
            f"{a}.narrow({d}, 1, 1)",
            f"{a}.unsqueeze({rng.randrange(-n - 1, n + 1)})",
            f"{a}.squeeze({d})",
            f"{a}.squeeze()",
            f"{a}.expand({rng.choice([2, 3])}, *{a}.shape)",
            f"{a}.movedim(0, -1)",
            f"{a}.contiguous()",
        ]
        if n <= 2:
            choices.append(f"{a}.t()")
        if ones:
            choices += [f"{a}.expand({expand})"] * 3
        return rng.choice(choices), (a,), False, True

    def reduction(self):
        rng = self.rng
        a = self.pick(lambda t: t.dim() >= 1)
        if a is None:
            return None
        t = self.envs[0][a]
        d = self.dim(t)
        dims = str(d)
        if t.dim() >= 2 and rng.random() < 0.25:
            dims = str(tuple(sorted(rng.sample(range(t.dim()), 2))))
        kd = ", keepdim=True" if rng.random() < 0.4 else ""
        smooth = [
            f"{a}.sum({dims}{kd})", f"{a}.sum()", f"{a}.mean({dims}{kd})", f"{a}.var({d}{kd})",
            f"{a}.var({dims}, correction=0{kd})", f"{a}.std({d}{kd})", f"torch.softmax({a}, {d})",
            f"F.log_softmax({a}, {d})", f"torch.logsumexp({a}, {d}{kd})", f"({a} * 0.5).prod({d}{kd})",
            f"{a} - {a}.mean({d}, keepdim=True)", f"({a} - {a}.amax({d}, keepdim=True)).exp()",
            f"{a}.sum({dims}, dtype=torch.float32)", f"{a}.cumsum({d})", f"torch.logcumsumexp({a}, {d})",
            f"(torch.tanh({a}) * 0.5 + 1).cumprod({d})", f"({a} * 2).cumsum({d}) - {a}",
        ]  # fmt: skip
        exact = [
            f"{a}.amax({dims}{kd})",
            f"{a}.amin({dims}{kd})",
            f"{a}.amax()",
            f"torch.max({a}, {d}).values",
            f"{a}.max()",
            f"{a}.min()",
            f"torch.min({a}, {d}{kd}).values",
            f"torch.cummax({a}, {d}).values",
            f"torch.cummin({a}, {d}).values",
        ]
        step = [
            f"{a}.argmax({d}{kd})", f"{a}.argmin({d})", f"{a}.any({d}{kd})", f"{a}.all({d})",
            f"torch.max({a}, {d}{kd}).indices", f"torch.cummax({a}, {d}).indices",
            f"torch.cummin({a}, {d}).indices",
        ]  # fmt: skip
        if t.dim() >= 2 and t.dtype in (F32, F16, BF16) and rng.random() < 0.25:
            products = [  # matmul templates: operands through views, prologues, epilogues
                f"{a} @ {a}.transpose(-1, -2)",
                f"{a}.transpose(-1, -2) @ {a}",
                f"torch.matmul({a} * 0.5, {a}.mT) + {a}.sum(-1, keepdim=True)",
                f"torch.relu({a}.mT.contiguous() @ ({a} - 1))",
                # attention templates: sdpa (causal, a mask), and written out (bmm, softmax, bmm)
                f"F.scaled_dot_product_attention({a}, {a} * 0.5, {a} + 1, is_causal=True)",
                f"F.scaled_dot_product_attention({a}, {a}.flip(-2), {a}, attn_mask={a} @ {a}.mT > 0)",
                f"torch.matmul(torch.softmax(torch.matmul({a}, {a}.mT) * 0.3 - {a}[..., :1], -1), {a}.exp())",
            ]
            return rng.choice(products), (a,), False, False
        r = rng.random()
        if r < 0.6:
            return rng.choice(smooth), (a,), False, False
        if r < 0.85 or not self.is_exact(a):
            return rng.choice(exact), (a,), False, True
        return rng.choice(step), (a,), True, True

    def indexing(self):
        rng = self.rng
        a = self.pick(lambda t: t.dim() >= 1)
        if a is None:
            return None
        ts = self.values(a)
        d = rng.randrange(ts[0].dim())
        kind = rng.choice(["index_select", "getitem", "getitem_dim1", "gather", "embedding", "scatter_add",
                           "scatter_reduce", "index_add", "index_put"])  # fmt: skip
        if kind in ("getitem", "index_put"):
            d = 0
        if kind == "getitem_dim1":
            if ts[0].dim() < 2 or ts[1].dim() < 2:
                return None
            d = 1
        if kind == "embedding":
            if ts[0].dim() != 2 or ts[1].dim() != 2:
                return None
            d = 0
        if any(t.dim() <= d for t in ts):
            return None
        extents = [t.shape[d] for t in ts]
        lengths = [
            rng.choice([0, 1, 2, 3, 4, 5] if self.small else [2, 3, 4, 5]) if n else 0 for n in extents
        ]
        if kind in ("gather", "scatter_add", "scatter_reduce"):
            shapes = [tuple(k if j == d else s for j, s in enumerate(t.shape)) for t, k in zip(ts, lengths)]
            i = self.index_input(extents, shapes, negative=False)
            # writes through indices: the source is a gather of the same index (its shape);
            # duplicate indices combine (a plain scatter's winner would be unspecified)
            src = f"torch.gather({a}, {d}, {i})"
            if kind == "scatter_add":
                return f"{a}.scatter_add({d}, {i}, {src} * 1.5)", (a, i), False, False
            if kind == "scatter_reduce":
                how, include = rng.choice(["amax", "amin", "sum", "mean"]), rng.random() < 0.5
                expr = f"{a}.scatter_reduce({d}, {i}, {src} - 1, {how!r}, include_self={include})"
                return expr, (a, i), False, how in ("amax", "amin")
            return src, (a, i), False, True
        if kind in ("index_add", "index_put"):
            i = self.index_input(extents, [(k,) for k in lengths], negative=kind == "index_put")
            if kind == "index_put":  # accumulate: x[i] += v along dim 0, negative indices too
                return f"{a}.index_put(({i},), {a}[{i}] * 0.5, accumulate=True)", (a, i), False, False
            return f"{a}.index_add({d}, {i}, {a}.index_select({d}, {i}), alpha=-2)", (a, i), False, False
        two_d = kind in ("getitem", "embedding") and rng.random() < 0.3
        shapes = [((2, k) if two_d else (k,)) for k in lengths]
        i = self.index_input(extents, shapes, negative=kind.startswith("getitem"))
        expr = {
            "index_select": f"{a}.index_select({d}, {i})",
            "getitem": f"{a}[{i}]",
            "getitem_dim1": f"{a}[:, {i}]",
            "embedding": f"F.embedding({i}, {a})",
        }[kind]
        return expr, (a, i), False, True

    def combine(self):
        rng = self.rng
        a = self.pick(lambda t: t.dim() >= 1)
        if a is None:
            return None
        t = self.envs[0][a]
        d = self.dim(t)
        b = self.pick(lambda u: u.dim() == t.dim())
        lead = "".join([":, "] * (d % t.dim()))
        # slice_scatter writes the slice start:end:step of dim d (its source is that slice, changed)
        start, end, step = rng.choice(
            [(None, None, 2), (1, None, 1), (None, -1, 1), (-2, None, 1), (2, 5, 1)]
        )
        part = f"{'' if start is None else start}:{'' if end is None else end}:{step}"
        pad_mode = rng.choice(["reflect", "replicate", "circular"])
        interp = rng.choice(["nearest", "linear", "bilinear"])
        # interpolation and padding modes want (N, C, spatial...): lift a low-rank value into that
        rank = 4 if interp == "bilinear" else 3
        lifted = a + ".unsqueeze(0)" * max(0, rank - t.dim())
        choices = [
            (f"torch.cat([{a}, {b}], {d})", (a, b), True),
            (f"torch.cat([{a}, {a} * 2], {d})", (a,), False),
            (f"torch.stack([{a}, {b}], {rng.randrange(t.dim() + 1)})", (a, b), True),
            (f"{a} + torch.arange({a}.shape[-1])", (a,), False),
            (f"torch.arange({a}.shape[{d}], dtype=torch.float32) * 0.5", (a,), True),
            (f"torch.zeros_like({a}) + {a}.mean()", (a,), False),
            (f"torch.ones({a}.shape[-1], dtype={a}.dtype)", (a,), True),
            (f"F.pad({a}, ({rng.randint(-1, 2)}, {rng.randint(-1, 2)}), value=2)", (a,), True),
            (f"{a}.repeat({', '.join(str(rng.choice([1, 2, 3])) for _ in range(t.dim()))})", (a,), True),
            (f"{a}.tile(({rng.choice([2, 3])},))", (a,), True),
            (
                f"torch.slice_scatter({a}, {a}[{lead}{part}] * 2, {d % t.dim()}, {start}, {end}, {step})",
                (a,),
                False,
            ),
            (f"torch.select_scatter({a}, {a}.select({d}, 0) + 1, {d}, -1)", (a,), False),
            (f"F.pad({a}, ({rng.randint(0, 2)}, {rng.randint(0, 2)}), mode='{pad_mode}')", (a,), True),
            (f"F.interpolate({lifted}, scale_factor={rng.choice([2, 0.5, 1.5])}, mode='{interp}')", (a,), 0),
            (f"F.pad({lifted}, ({rng.randint(0, 2)}, {rng.randint(0, 2)}), mode='{pad_mode}')", (a,), True),
            (f"F.adaptive_avg_pool1d({a}, {rng.choice([1, 2, 3, 5])})", (a,), False),
            (f"F.adaptive_max_pool2d({a}, {rng.choice([1, 2, 3])})", (a,), True),
        ]
        expr, operands, keeps = rng.choice(choices)
        return expr, operands, False, keeps

    CATEGORIES = {
        "unary": 20, "binary": 22, "scalar": 12, "cast": 8, "view": 18, "reduction": 14, "indexing": 9,
        "combine": 9,
    }  # fmt: skip

    def statement(self) -> bool:
        name = self.rng.choices(list(self.CATEGORIES), list(self.CATEGORIES.values()))[0]
        made = getattr(self, name)()
        if made is None or any(o is None for o in made[1]):
            return False
        expr, operands, needs_exact, keeps_exact = made
        stmt = Stmt(f"v{len(self.stmts)}", expr, tuple(dict.fromkeys(operands)), needs_exact, keeps_exact)
        try:
            run_stmt(stmt, self.envs, self.rounded)
        except Invalid:
            return False
        self.stmts.append(stmt)
        self.order.append(stmt.target)
        return True

    def program(self) -> Program:
        base = self.base_shape()
        for _ in range(self.rng.choice([1, 2, 2, 3])):
            self.data_input(base)
        wanted = self.rng.randint(1, 6)
        for _ in range(60):
            if len(self.stmts) >= wanted:
                break
            inputs_before = list(self.inputs)
            if not self.statement():  # an index input of a rejected statement goes too
                for spec in self.inputs[len(inputs_before) :]:
                    self.order.remove(spec.name)
                self.inputs = inputs_before
        if not self.stmts:
            a = self.order[-1]
            self.stmts.append(Stmt("v0", f"{a} + 1", (a,)))
        used = {o for s in self.stmts for o in s.operands}
        dangling = [s.target for s in self.stmts[:-1] if s.target not in used]
        outputs = [self.stmts[-1].target] + self.rng.sample(dangling, min(len(dangling), 2))
        return Program(self.seed, self.inputs, self.stmts, outputs, self.sizes).pruned()


def generate(seed: int) -> Program:
    """Program `seed`: the first of a few draws whose two calls differ in some size."""
    for attempt in range(8):
        program = Generator(seed, attempt).program()
        shapes = [[i.shape(sizes) for i in program.inputs] for sizes in program.sizes]
        if shapes[0] != shapes[1]:
            break
    return program


# ----------------------------------------------------------------------------------------------
# Checking and shrinking
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Failure:
    call: int
    kind: str  # "exception" (gjit raised where eager did not), "mismatch" or "capture" (ran eagerly)
    message: str
    detail: str = ""  # the traceback of an exception

    def summary(self) -> str:
        return f"{self.kind}: {self.message.strip().splitlines()[0][:200]}"

    def same_as(self, other: Failure) -> bool:
        if self.kind != other.kind:
            return False
        return self.kind == "mismatch" or self.message.split(":")[0] == other.message.split(":")[0]


def _reference(fn: Callable, args: list[torch.Tensor]) -> tuple | None:
    try:
        return fn(*[a.double() if a.is_floating_point() else a for a in args])
    except Exception:
        return None


def check(program: Program, counts: Counter | None = None) -> Failure | None:
    """Compile `program` with gjit, run each call through the generated kernels and eagerly; the
    first difference or gjit exception, or None."""
    counts = Counter() if counts is None else counts
    fn = program.function()
    rounded = evaluate(program)
    precisions = [rounded[o] for o in program.outputs] if rounded else [None] * len(program.outputs)
    compiled = gjit.compile(fn)
    before = gjit.stats()
    with gjit.config.scope(interpret=True, debug=True, recompile_limit=8, fail_on_recompile_limit=True):
        for call in range(len(program.sizes)):
            args = program.args(call)
            expected = fn(*args)
            try:
                actual = compiled(*args)
            except Exception as e:
                return Failure(call, "exception", f"{type(e).__name__}: {e}", traceback.format_exc(limit=-8))
            if not isinstance(actual, tuple) or len(actual) != len(expected):
                return Failure(call, "mismatch", f"gjit returned {type(actual).__name__}, eager a tuple")
            reference = None
            for k, (a, e) in enumerate(zip(actual, expected)):
                try:
                    compare(a, e, None, precisions[k])
                except AssertionError:
                    reference = reference or _reference(fn, args)
                    try:
                        compare(a, e, reference[k] if reference else None, precisions[k])
                    except AssertionError as error:
                        return Failure(call, "mismatch", f"output {k} ({program.outputs[k]}): {error}")
    if compiled.eager_reason is not None:  # eager runs these ops, so export should capture them
        return Failure(0, "capture", f"gjit ran the program eagerly: {compiled.eager_reason}")
    after = gjit.stats()
    for key in ("compiles", "cache_hits", "eager_runs", "kernels"):
        counts[key] += after.get(key, 0) - before.get(key, 0)
    counts["programs"] += 1
    return None


def _replace(text: str, old: str, new: str) -> str:
    return re.sub(rf"\b{old}\b", new, text)


def _candidates(p: Program, failure: Failure) -> Iterator[Program]:
    """Smaller variants of `p`, the biggest cuts first."""
    if len(p.sizes) > 1:
        yield dataclasses.replace(p, sizes=[p.sizes[failure.call]])
        if failure.call == 1:
            yield dataclasses.replace(p, sizes=[p.sizes[0]])
    if len(p.outputs) > 1:
        for o in p.outputs:
            yield dataclasses.replace(p, outputs=[o]).pruned()
        for o in p.outputs:
            yield dataclasses.replace(p, outputs=[x for x in p.outputs if x != o]).pruned()
    for k in reversed(range(len(p.stmts))):
        stmt = p.stmts[k]
        for operand in stmt.operands:
            rest = p.stmts[:k] + [
                dataclasses.replace(
                    s,
                    expr=_replace(s.expr, stmt.target, operand),
                    operands=tuple(dict.fromkeys(operand if o == stmt.target else o for o in s.operands)),
                )
                for s in p.stmts[k + 1 :]
            ]
            outputs = list(dict.fromkeys(operand if o == stmt.target else o for o in p.outputs))
            if all(o.startswith("v") for o in outputs):
                yield dataclasses.replace(p, stmts=rest, outputs=outputs).pruned()
    for k, spec in enumerate(p.inputs):
        simpler = []
        if spec.layout != ("contiguous",):
            simpler.append(dataclasses.replace(spec, layout=("contiguous",)))
        if spec.dtype in (F16, BF16):
            simpler.append(dataclasses.replace(spec, dtype=F32))
        for s in simpler:
            yield dataclasses.replace(p, inputs=p.inputs[:k] + [s] + p.inputs[k + 1 :])
    for call, sizes in enumerate(p.sizes):
        for name, value in sizes.items():
            for smaller in sorted({1, 2, value // 2, value - 1}):
                if 0 < smaller < value:
                    new = [dict(s) for s in p.sizes]
                    new[call][name] = smaller
                    yield dataclasses.replace(p, sizes=new)


def shrink(program: Program, failure: Failure, budget_s: float = 90.0) -> tuple[Program, Failure]:
    """Greedily apply the first smaller variant that is still valid and still fails the same way."""
    deadline = time.monotonic() + budget_s
    progress = True
    while progress and time.monotonic() < deadline:
        progress = False
        for candidate in _candidates(program, failure):
            if time.monotonic() > deadline:
                break
            if evaluate(candidate) is None:
                continue
            found = check(candidate)
            if found is not None and found.same_as(failure):
                program, failure, progress = candidate, found, True
                break
    return program, failure


def reduction_config(seed: int) -> dict:
    """Every fourth program compiles its reductions as looped kernels of 4-element chunks (the
    programs' rows are short: under `auto` they would all be persistent)."""
    return {"reduction": "looped", "rblock": 4} if seed % 4 == 3 else {}


def check_seed(seed: int, backend: str = "triton") -> tuple[int, Failure | None, Counter]:
    """Worker entry point: (seed, its failure or None, counters), its kernels in `backend`."""
    counts: Counter = Counter()
    with gjit.config.scope(backend=backend, **reduction_config(seed)):
        return seed, check(generate(seed), counts), counts


def init_worker(cache_dir: str) -> None:
    """A worker process: the parent's cache folder, one thread (the workers share the cores)."""
    gjit.config.cache_dir = cache_dir
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")


def report(seed: int, failure: Failure, shrink_budget_s: float = 90.0) -> str:
    """The message for a failing program: what failed, and the shrunk reproducer with its error."""
    program = generate(seed)
    with gjit.config.scope(**reduction_config(seed)):  # shrink as the program was checked
        small, small_failure = (
            shrink(program, failure, shrink_budget_s) if shrink_budget_s > 0 else (program, failure)
        )
    return (
        f"fuzz program {seed} fails (call {failure.call}, {failure.summary()}).\n"
        f"Minimal reproducer:\n\n{small.reproducer(small_failure)}\n"
        f"Error of the reproducer (call {small_failure.call}):\n"
        + (small_failure.detail or small_failure.message)
    )


def fuzz_one(seed: int, counts: Counter | None = None, shrink_budget_s: float = 90.0) -> str | None:
    """Generate, compile and compare program `seed`: None, or the report of its failure."""
    with gjit.config.scope(**reduction_config(seed)):
        failure = check(generate(seed), counts)
    return None if failure is None else report(seed, failure, shrink_budget_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="first program seed")
    parser.add_argument("--programs", type=int, default=100)
    parser.add_argument("--show", type=int, help="print the program of this seed as a script and exit")
    parser.add_argument("--no-shrink", action="store_true")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each seed before it runs")
    options = parser.parse_args()
    warnings.simplefilter("ignore")
    if options.show is not None:
        print(generate(options.show).reproducer())
        return 0
    counts: Counter = Counter()
    failed = 0
    start = time.monotonic()
    for seed in range(options.seed, options.seed + options.programs):
        if options.verbose:
            print(f"program {seed}", flush=True)
        report = fuzz_one(seed, counts, 0 if options.no_shrink else 90.0)
        if report is not None:
            failed += 1
            print(report, flush=True)
    print(f"{options.programs} programs, {failed} failing, {time.monotonic() - start:.1f} s; {dict(counts)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
