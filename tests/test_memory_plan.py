"""The wrapper's memory plan (gjit/memory_plan.py): a local is deleted after its last use, and an
allocation takes a dead buffer of the same size, strides and dtype, never one that an input, an
output or a live view still holds. Models run in debug mode, where a reused buffer is poisoned
again, so a buffer taken too early shows in the result."""

from __future__ import annotations

import inspect
import weakref

import pytest
import torch

import gjit
from gjit import memory_plan
from helpers import check, first_graph_call, run_compiled

pytestmark = pytest.mark.cpu


def plan(lines: list[str], inputs=("x",), poison=False) -> list[str]:
    """memory_plan.plan over hand-written wrapper lines: `a = gjit_alloc(K)` allocates with key K,
    a line ending in `# fresh` calls an op whose result is new memory."""
    allocs = {
        k: line.split("gjit_alloc(")[1].rstrip(")") for k, line in enumerate(lines) if "gjit_alloc(" in line
    }
    fresh = {k for k, line in enumerate(lines) if line.endswith("# fresh")}
    defined = {line.split(" = ")[0] for line in lines if " = " in line and not line.startswith(" ")}
    return memory_plan.plan(lines, allocs, fresh, defined - set(inputs), set(inputs), poison)


def test_a_dead_buffer_is_taken_by_the_next_allocation_of_its_key():
    lines = [
        "x, = args",
        "a = gjit_alloc(K)",
        "if xnumel > 0:",
        "    kernel_0[(1,)](x, a)",
        "b = gjit_alloc(K)",
        "if xnumel > 0:",
        "    kernel_1[(1,)](a, b)",
        "c = gjit_alloc(K)",
        "if xnumel > 0:",
        "    kernel_2[(1,)](b, c)",
        "return (c,)",
    ]
    assert plan(lines) == [
        "x, = args",
        "a = gjit_alloc(K)",
        "if xnumel > 0:",
        "    kernel_0[(1,)](x, a)",
        "b = gjit_alloc(K)",  # a is read by the launch that writes b
        "if xnumel > 0:",
        "    kernel_1[(1,)](a, b)",
        "c = a",
        "del a  # reused",
        "if xnumel > 0:",
        "    kernel_2[(1,)](b, c)",
        "del b",
        "return (c,)",
    ]
    assert "c = gjit_repoison(a)" in plan(lines, poison=True)


def test_no_reuse_of_another_key_an_input_an_output_or_a_buffer_a_view_still_holds():
    lines = [
        "x, = args",
        "a = gjit_alloc(K)",
        "kernel_0[(1,)](x, a)",
        "v = gjit_reinterpret(a, (4,), (1,), 0)",  # a view: a lives while v does
        "b = gjit_alloc(K)",
        "kernel_1[(1,)](a, b)",
        "c = gjit_alloc(L)",  # another key
        "kernel_2[(1,)](b, c)",
        "d = gjit_alloc(K)",  # v is still read below: a's memory is not free
        "kernel_3[(1,)](v, c, d)",
        "e = aten.index_put_.default(x, [d], c)",  # may alias x (an input), d and c
        "f = aten.mm.default(b, b)  # fresh",
        "g = gjit_alloc(K)",
        "kernel_4[(1,)](f, g)",
        "return (e, g)",
    ]
    out = plan(lines)
    assert not any("# reused" in line for line in out[: out.index("kernel_3[(1,)](v, c, d)")])
    # a and v die after kernel_3 (a unused since), b after f (fresh: no alias of b); c and d may
    # alias the input x through index_put_, so they are only deleted
    assert out[out.index("f = aten.mm.default(b, b)  # fresh") :][:3] == [
        "f = aten.mm.default(b, b)  # fresh",
        "g = b",
        "del b  # reused",
    ]
    assert out[out.index("kernel_3[(1,)](v, c, d)") + 1] == "del v, a"
    assert "del c, d" in out


def test_a_name_is_deleted_after_an_indented_block_not_inside_it():
    lines = [
        "x, = args",
        "a = aten.exp.default(x)  # fresh",
        "if xnumel > 0:",
        "    k[(1,)](a)",
        "return (x,)",
    ]
    assert plan(lines)[-2:] == ["del a", "return (x,)"]


def mlp(depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.LayerNorm(32)]
    return torch.nn.Sequential(*layers).eval()


def test_a_deep_model_reuses_its_buffers_and_matches_eager():
    model = mlp(6)
    with torch.no_grad():
        cm = check(model, torch.randn(5, 32))
    source = cm.entries[0].program.graph.wrapper_source
    assert source.count("gjit_repoison(") >= 4, source  # six layers in two buffers
    assert source.count("gjit_alloc_poisoned(") <= 2, source


class Residuals(torch.nn.Module):
    """Buffers that live long: an early value read at the end, a view of an intermediate read
    after the intermediate, a view of an intermediate returned."""

    def forward(self, x):
        first = x * 3
        flat = (x + 1).view(-1)
        y = x
        for k in range(5):
            y = torch.tanh(y * (k + 2)) + k
        late = y + first
        return late, flat.sin(), (late * 2).t()


@pytest.mark.parametrize("dynamic", [False, None])
def test_long_lived_buffers_views_and_returned_views(dynamic):
    cm = gjit.compile(Residuals(), dynamic=dynamic)
    out, _ = run_compiled(cm, torch.randn(6, 4))
    for shape in ((6, 4), (3, 7)):
        x = torch.randn(shape)
        out, _ = run_compiled(cm, x)
        for got, want in zip(out, Residuals()(x)):
            torch.testing.assert_close(got, want)
            assert got.stride() == want.stride()


def test_intermediates_are_freed_before_the_call_returns():
    """At most a few of a 12-layer model's buffers are alive at once (without the plan, every one
    of them until the call returns)."""
    model, x = mlp(12), torch.randn(5, 32)
    with torch.no_grad():
        compiled, graph, inputs, sizes = first_graph_call(model, x)
        call = graph.call_fn(interpret=True)
        namespace = inspect.unwrap(call).__globals__
        real = namespace["gjit_alloc"]
        alive: set[int] = set()
        counts = [0, 0]  # buffers allocated, the most alive at once

        def alloc(*args):
            out = real(*args)
            alive.add(id(out))
            weakref.finalize(out, alive.discard, id(out))
            counts[0] += 1
            counts[1] = max(counts[1], len(alive))
            return out

        namespace["gjit_alloc"] = alloc
        try:
            out = call(inputs, sizes)
        finally:
            namespace["gjit_alloc"] = real
        torch.testing.assert_close(out[0], model(x))
    assert graph.wrapper_source.count("gjit_alloc(") >= counts[0] >= 1
    assert counts[1] <= 3, counts


def test_a_view_read_by_a_later_extern_keeps_its_buffer():
    """`v` views `a`'s buffer and is read by two products (ATen's, so the view is the wrapper's):
    `a` itself is not mentioned after the view, yet its memory must outlive `v`."""

    def f(x, w):
        v = (x * 2).t()
        b = torch.tanh(v @ w) * 3
        return v @ b + 1

    with gjit.config.scope(matmul="aten"):
        cm = check(gjit.compile(f, dynamic=False), torch.randn(8, 8), torch.randn(8, 8))
    lines = [line.strip() for line in cm.entries[0].program.graph.wrapper_source.splitlines()]
    view = lines.index("permute = gjit_as_strided(mul, (8, 8), (1, 8), 0)")
    last = next(k for k, line in enumerate(lines) if line.startswith("mm_1 = torch.mm(permute"))
    assert "gjit_repoison(mul)" not in "\n".join(lines[view:last]), lines
    assert "del permute, mul" in lines[last + 1], lines


def test_an_extern_that_returns_its_argument_keeps_the_argument_alive():
    """Some ATen ops return their argument itself though their schema promises new memory
    (dequantize of a float tensor): only known products and attention count as new memory."""

    def f(x, w):
        a = torch.relu(x)
        b = torch.dequantize(a)
        c = torch.exp(x + b.mean())
        return c @ w + b

    with gjit.config.scope(matmul="aten"):
        check(gjit.compile(f, dynamic=False), torch.randn(8, 8), torch.randn(8, 8))
