"""Constructs gjit cannot make kernels of become externs or run eagerly inside the compiled
program, never an error: sizes computed through torch's size functions (math.ceil, round on a
dynamic dim), higher-order ops other than torch.cond (map)."""

from __future__ import annotations

import math

import pytest
import sympy
import torch
import torch.nn.functional as F
from functorch.experimental import control_flow
from torch.utils._sympy.functions import (
    CeilToInt,
    FloatPow,
    FloorToInt,
    IntTrueDiv,
    RoundDecimal,
    RoundToInt,
    ToFloat,
)

import gjit
from gjit.codegen.printer import ExprPrinter, PythonPrinter, TritonPrinter
from gjit.lowering.registry import size_reason
from helpers import check, kernel_count

pytestmark = pytest.mark.cpu

s = sympy.Symbol("s0", integer=True, positive=True)
n = sympy.Symbol("n", integer=True)


def evaluate(text: str, **values) -> object:
    return eval(text, {"math": math, "torch": torch}, values)  # noqa: S307 - our printer's output


@pytest.mark.parametrize("value", [-7, -1, 0, 1, 2, 3, 10, 11, 12, 2**40 + 1])
def test_python_printer_writes_torch_size_functions_exactly(value):
    cases = {
        CeilToInt(IntTrueDiv(n, 3)): -(-value // 3),
        FloorToInt(IntTrueDiv(n, 3)): value // 3,
        RoundToInt(IntTrueDiv(n, 4)): round(value / 4),
        RoundDecimal(ToFloat(n) / 3, 2): round(value / 3, 2),
        FloatPow(ToFloat(n), sympy.Float(0.5)) if value >= 0 else ToFloat(n): (
            float(value) ** 0.5 if value >= 0 else float(value)
        ),
        CeilToInt(ToFloat(n) * sympy.Float(1.5)): math.ceil(value * 1.5),
    }
    for expr, expected in cases.items():
        assert evaluate(PythonPrinter()(expr), n=value) == expected, (expr, PythonPrinter()(expr))


def test_index_printers_write_integer_ceil_and_floor_and_refuse_rounding():
    for printer in (ExprPrinter(), TritonPrinter()):
        ceil, floor = printer(CeilToInt(IntTrueDiv(s, 3))), printer(FloorToInt(IntTrueDiv(s, 3)))
        for value in (1, 2, 3, 4, 9, 10):
            assert evaluate(ceil, s0=value) == -(-value // 3)
            assert evaluate(floor, s0=value) == value // 3
        with pytest.raises(ValueError, match="cannot print"):
            printer(RoundToInt(IntTrueDiv(s, 3)))
        with pytest.raises(ValueError):
            printer(CeilToInt(IntTrueDiv(s, s + 1)))  # not a positive literal divisor


def test_size_reason_names_what_kernels_cannot_print():
    def size(expr):
        env = torch.fx.experimental.symbolic_shapes.ShapeEnv()
        sym = env.create_symbol(10, torch._dynamo.source.ConstantSource("x"))
        symint = env.create_symintnode(expr.subs(s, sym), hint=None)
        with torch._subclasses.FakeTensorMode(shape_env=env):
            return torch.empty(symint, 4)

    assert size_reason(size(CeilToInt(IntTrueDiv(s, 3)))) is None
    assert "cannot print" in size_reason(size(RoundToInt(IntTrueDiv(s, 3))))


def first_third(x):
    return x[: math.ceil(x.shape[0] / 3)] * 2 + 1


def rounded_third(x):
    rows = round(x.shape[0] / 3)
    return torch.ones(rows, x.shape[1]) + x[:rows]


def test_ceil_of_a_dynamic_size_is_a_kernel():
    cm = gjit.compile(first_third, dynamic=True)
    for rows in (10, 14, 20):
        check(cm, torch.randn(rows, 4))
    assert len(cm.entries) == 1 and kernel_count(cm, torch.randn(10, 4)) == 1


def test_round_of_a_dynamic_size_runs_in_aten_inside_the_compiled_program():
    cm = gjit.compile(rounded_third, dynamic=True)
    for rows in (10, 14):
        check(cm, torch.randn(rows, 4))
    assert len(cm.entries) == 1
    report = gjit.explain(cm, torch.randn(10, 4))
    assert any("cannot print" in e.reason for e in report.externs), report


def test_an_op_reading_a_rounded_size_runs_in_aten():
    """A value whose size came through round() is read by a reduction (its index math uses the
    input's size): the op is an extern, not a kernel that cannot print that size (fuzz seed 154)."""

    def fn(x):
        v = x[:, :, : round(x.shape[2] / 3)]
        return F.adaptive_avg_pool1d(v, 2), v.sum(-1)

    cm = gjit.compile(fn, dynamic=True)
    for length in (9, 12):
        check(cm, torch.randn(2, 3, length))
    assert len(cm.entries) == 1


def mapped(xs, y):
    return control_flow.map(lambda x, y: torch.relu(x * y + 1), xs, y)


def test_map_runs_its_body_eagerly_inside_the_compiled_program(tmp_path):
    with gjit.config.scope(cache=True, cache_dir=str(tmp_path)):
        cm = check(mapped, torch.randn(4, 3), torch.randn(3))
    report = gjit.explain(cm, torch.randn(4, 3), torch.randn(3))
    assert [e.op for e in report.externs] == ["map_impl"], report
    gjit.reset()  # a new process would find the entry on disk: its served program holds the body
    with gjit.config.scope(cache=True, cache_dir=str(tmp_path)):
        warm = check(mapped, torch.randn(4, 3), torch.randn(3))
    assert gjit.stats().get("disk_cache_hits") == 1 and warm.entries


class FailsWithDynamicSizes(torch.nn.Module):
    """A model whose export fails only when a size is a symbol (as ceil-mode pooling once made
    sympy's inequality solver fail), and works with static shapes."""

    def forward(self, x):
        if isinstance(x.shape[0], torch.SymInt):
            raise NotImplementedError("The inequality cannot be solved (simulated)")
        return torch.relu(x) * 2


def test_an_export_that_fails_with_dynamic_dims_is_retried_static_and_leaves_inputs_as_they_were():
    x = torch.randn(6, 4)
    cm = check(FailsWithDynamicSizes(), x)  # compiled: the static retry worked
    assert len(cm.entries) == 1 and not cm.entries[0].guards.dynamic_dims
    assert not [name for name in x.__dict__ if name.startswith("_dynamo")], x.__dict__


def test_capture_keeps_a_users_torch_compile_dim_marks():
    x = torch.randn(6, 4)
    torch._dynamo.mark_dynamic(x, 0)
    marked = {k: v for k, v in x.__dict__.items() if k.startswith("_dynamo")}
    check(lambda t: t.sin() + 1, x)
    assert {k: v for k, v in x.__dict__.items() if k.startswith("_dynamo")} == marked


def test_reductions_of_a_0d_tensor_over_dim_0():
    check(lambda t: (t.mean(0), t.any(-1), t.sum(0, keepdim=True), t.amax(0)), torch.tensor(3.0))


def test_a_lowering_that_fails_makes_its_node_an_extern(monkeypatch):
    from gjit.lowering.registry import LOWERINGS

    def broken(*args, **kwargs):
        raise IndexError("a planted lowering bug")

    monkeypatch.setitem(LOWERINGS, torch.ops.aten.sin.default, broken)
    cm = check(lambda x: torch.sin(x) * 2, torch.randn(4, 5))
    (extern,) = gjit.explain(cm, torch.randn(4, 5)).externs
    assert extern.op == "aten.sin.default" and "lowering failed (IndexError" in extern.reason


def test_a_sparse_input_runs_eagerly_with_the_reason():
    a = torch.randn(4, 4).relu().to_sparse_csr()
    cm = gjit.compile(lambda s, d: s @ d)
    check(cm, a, torch.randn(4, 3), expect_eager=True)
    assert "layout torch.sparse_csr" in cm.eager_reason


def test_an_input_export_bakes_in_runs_eagerly_with_the_reason(tmp_path):
    def loss(a, b, distance):
        return distance(a, b).mean()

    # with the disk cache on: storing the program met the module in its calling convention first
    with gjit.config.scope(cache=True, cache_dir=str(tmp_path)):
        cm = gjit.compile(loss)
        check(cm, torch.randn(3, 4), torch.randn(3, 4), torch.nn.PairwiseDistance(), expect_eager=True)
    assert "cannot guard" in cm.eager_reason and "PairwiseDistance" in cm.eager_reason


SCALAR_OPERANDS = {
    "floor_negative": lambda x: x + math.floor((x.shape[0] - 20) / 3),
    "ceil_negative": lambda x: x + math.ceil((x.shape[0] - 20) / 3),
    "floordiv_negative": lambda x: x + (x.shape[0] - 20) // 3,
    # a negative divisor: a truncating // or % is not Python's
    "floordiv_by_negative": lambda x: x + x.shape[0] // -7,
    "mod_by_negative": lambda x: x + x.shape[0] % -7,
    "round": lambda x: x + round(x.shape[0] / 3),
    "roll_by_round": lambda x: torch.roll(x, round(x.shape[0] / 3), 0),
    "full_of_round": lambda x: torch.full((4,), round(x.shape[0] / 3)) + x[0, 0],
}


@pytest.mark.parametrize("name", sorted(SCALAR_OPERANDS))
def test_a_size_used_as_a_value_is_exact_or_an_extern(name):
    cm = gjit.compile(SCALAR_OPERANDS[name], dynamic=True)
    for rows in (10, 14, 29):
        check(cm, torch.randn(rows, 4))


def test_a_lowering_that_fails_midway_leaves_nothing_behind(monkeypatch):
    from gjit.lowering.registry import LOWERINGS

    real = LOWERINGS[torch.ops.aten.sin.default]

    def half_done(ctx, *args, **kwargs):
        real(ctx, *args, **kwargs)  # builds its node, then fails
        raise RuntimeError("a planted bug after the work")

    monkeypatch.setitem(LOWERINGS, torch.ops.aten.sin.default, half_done)
    cm = check(lambda x: torch.sin(x) * 2, torch.randn(4, 5))
    report = gjit.explain(cm, torch.randn(4, 5))
    assert [e.op for e in report.externs] == ["aten.sin.default"]
    assert all("sin" not in ", ".join(k.aten_nodes) for k in report.kernels), report


def test_the_python_printer_refuses_what_torch_prints_as_a_sympy_name():
    from torch.utils._sympy.functions import Where

    with pytest.raises(ValueError, match="undefined"):
        PythonPrinter()(Where(sympy.Gt(n, 0), n, -n))
