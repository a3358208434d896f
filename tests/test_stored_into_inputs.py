"""A call's new value of an input it mutates (a counter's `+= 1`, a cache's length) stored by its
kernel into the input itself (gjit/wrapper.py `stored_into`), so no copy into the input follows the
call; only where that kernel reads the input at the element it stores and nothing after it reads the
input's old value. Results compared with eager over several calls."""

import copy

import pytest
import torch

import gjit
from gjit.capture import export
from gjit.wrapper import WrapperWriter
from helpers import run_compiled

pytestmark = pytest.mark.cpu

STORED = "# stored into the input it updates"


class Counter(torch.nn.Module):
    """A step counter buffer, and a running sum of the inputs."""

    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros(()))
        self.register_buffer("total", torch.zeros(8))

    def forward(self, x):
        self.steps += 1
        self.total.add_(x.sum(0))
        return x * self.steps + self.total


def wrapper_of(compiled) -> str:
    return compiled.entries[-1].program.graph.wrapper_source


def no_copy_back(monkeypatch) -> list:
    """The copies into mutated inputs after each call (gjit's `finish`): recorded."""
    copies = []
    finish = export.CapturedProgram.finish

    def spy(self, flat_user, flat_out, graph_inputs, call=None):
        for out_index, (kind, key) in self.mutations.items():
            target = flat_user[key] if kind == "user" else graph_inputs[self.input_sources.index((kind, key))]
            copies.append(flat_out[out_index] is not target)
        return finish(self, flat_user, flat_out, graph_inputs, call)

    monkeypatch.setattr(export.CapturedProgram, "finish", spy)
    return copies


def test_buffers_a_kernel_updates_are_stored_into_and_not_copied_back(monkeypatch):
    model, eager = Counter(), Counter()
    copies = no_copy_back(monkeypatch)
    compiled = gjit.compile(model)
    buffers = (model.steps, model.total)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 8)
            out, _ = run_compiled(compiled, x)
            torch.testing.assert_close(out, eager(x))
    torch.testing.assert_close(model.total, eager.total)
    assert int(model.steps) == 3 and (model.steps, model.total) == buffers
    # the counter in place; the sum's kernel (a reduction) stores the new total apart, copied after
    assert wrapper_of(compiled).count(STORED) == 1
    assert sorted(copies) == [False] * 3 + [True] * 3


def test_an_input_the_caller_mutates_is_stored_into(monkeypatch):
    def step(x, n):
        n.add_(1)
        return x + n

    copies = no_copy_back(monkeypatch)
    compiled = gjit.compile(step)
    n, eager_n = torch.zeros(3), torch.zeros(3)
    for _ in range(3):
        x = torch.randn(2, 3)
        out, _ = run_compiled(compiled, x, n)
        torch.testing.assert_close(out, step(x, eager_n))
    torch.testing.assert_close(n, eager_n)
    assert STORED in wrapper_of(compiled) and copies == [False] * 3


def read_old_in_the_same_kernel(x, n):
    y = n * 2  # the old value, read in the kernel that computes the new one
    n.add_(1)
    return y + n + x


def broadcast_old(x, n):
    n.copy_(n + n[:1])  # each new element reads the old first row
    return x * n


def transposed(x, n):
    n.copy_(n + n.t())  # the new [i, j] reads the old [j, i]
    return x + n


@pytest.mark.parametrize("fn", [read_old_in_the_same_kernel, broadcast_old, transposed])
def test_a_kernel_that_reads_other_elements_of_the_old_value_keeps_a_copy(fn):
    compiled = gjit.compile(fn)
    n = torch.randn(4, 4)
    eager_n = n.clone()
    for _ in range(2):
        x = torch.randn(4, 4)
        out, _ = run_compiled(compiled, x, n)
        torch.testing.assert_close(out, fn(x, eager_n))
        torch.testing.assert_close(n, eager_n)
    assert STORED not in wrapper_of(compiled)


def test_no_value_is_stored_into_an_input_a_later_step_still_reads():
    """The same program's schedule with a reader of the old value moved after the kernel that
    computes the new one: the value is then stored into memory of its own."""

    def f(x, n):
        y = torch.mm(x, n)  # reads the old n
        n.add_(1)
        return y * n

    compiled = gjit.compile(f)
    n = torch.randn(4, 4)
    with gjit.config.scope(matmul="aten"):  # the product an extern before the kernel
        run_compiled(compiled, torch.randn(4, 4), n.clone())
    program = compiled.entries[-1].program
    loop_graph, steps = program.loop_graph, program.steps
    assert STORED in program.graph.wrapper_source

    def writer(order):
        symbols = program.symbols
        return WrapperWriter(loop_graph, order, {k.name: k for k in program.graph.kernels}, False, symbols)

    (added,) = [s for s in steps if getattr(s, "stores", None) and writer(steps).stored_into(s, s.stores[0])]
    reader = steps[0]
    assert reader is not added
    moved = [s for s in steps if s is not reader]
    moved.insert(moved.index(added) + 1, reader)
    assert writer(moved).stored_into(added, added.stores[0]) is None
    assert writer(steps).stored_into(added, added.stores[0]) is not None


def test_a_model_copy_keeps_its_own_buffers():
    """Two compiled copies of one model: each one's counter moves by its own calls only."""
    model = Counter()
    other = copy.deepcopy(model)
    a, b = gjit.compile(model), gjit.compile(other)
    with torch.no_grad():
        run_compiled(a, torch.randn(4, 8))
        run_compiled(a, torch.randn(4, 8))
        run_compiled(b, torch.randn(4, 8))
    assert (int(model.steps), int(other.steps)) == (2, 1)
