"""The debug tooling itself: poisoned buffers must expose a kernel that skips an element, and the IR
checks between passes (GJIT_DEBUG) must refuse a broken IR or schedule."""

import dataclasses

import pytest
import torch

from conftest import POISONED, TEST_DEVICE
from gjit import driver, ir
from gjit.codegen.triton.pointwise import KernelWriter
from gjit.fusion.regions import fuse, verify_schedule
from gjit.lowering.graph import lower_graph
from gjit.runtime.graph import gjit_alloc_poisoned
from helpers import check

pytestmark = pytest.mark.cpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.int32], ids=str)
def test_poisoned_allocation_is_never_a_plausible_value(dtype):
    buf = gjit_alloc_poisoned((3, 4), (4, 1), dtype, torch.device("cpu"))
    if dtype.is_floating_point:
        assert buf.isnan().all()
    else:
        assert (buf == torch.iinfo(dtype).min + 7).all()


@pytest.mark.skipif(bool(TEST_DEVICE), reason="kernels run compiled on the device, not interpreted")
def test_masked_off_lanes_of_a_load_hold_garbage_as_on_a_gpu():
    """The tests' interpreter leaves what a GPU leaves undefined poisoned (tests/masked_lanes.py):
    a kernel that sums a load's masked-off lanes gets NaN, not the interpreter's 0."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    from gjit.runtime.interpret import stdlib_interpreted

    def sum_without_where(x, out, n, BLOCK: tl.constexpr):
        lanes = tl.arange(0, BLOCK)
        tl.store(out, tl.sum(tl.load(x + lanes, lanes < n), 0))

    out = torch.zeros(1)
    with stdlib_interpreted():
        InterpretedFunction(sum_without_where)[(1,)](torch.ones(3), out, 3, BLOCK=4)
    assert POISONED and out.isnan().all()


def test_planted_bug_unwritten_last_element_is_caught(monkeypatch):
    original = KernelWriter.index_setup

    def skip_last_element(self, plan, index_dtype):
        lines = original(self, plan, index_dtype)
        return [ln.replace("xmask = xindex < xnumel", "xmask = xindex < xnumel - 1") for ln in lines]

    monkeypatch.setattr(KernelWriter, "index_setup", skip_last_element)
    with pytest.raises(AssertionError):
        check(lambda x: x * 2 + 1, torch.randn(10))
    with pytest.raises(AssertionError):
        check(lambda i: i * 2 + 1, torch.randint(0, 9, (10,)))


# ----------------------------------------------------------------------------------------------
# The IR checks between passes (GJIT_DEBUG)
# ----------------------------------------------------------------------------------------------


def _lowered(fn, *args):
    gm = torch.export.export(fn, args).run_decompositions().graph_module
    graph = lower_graph(gm)
    return graph, fuse(graph)


class _Softmax(torch.nn.Module):
    """Three steps: the softmax kernel, the matmul extern, the relu kernel."""

    def forward(self, x):
        return ((x * 2).softmax(-1) @ x.T).relu()


def test_ir_and_schedule_checks_pass_on_what_the_passes_make():
    graph, steps = _lowered(_Softmax(), torch.randn(4, 6))
    ir.verify(graph)
    verify_schedule(steps, graph)


def test_ir_check_refuses_a_read_of_nothing_and_a_wrong_rank():
    graph, _ = _lowered(_Softmax(), torch.randn(4, 6))
    node = next(n for n in graph.nodes if isinstance(n, ir.ComputeNode))
    read = ir.reads(node.body)[0]
    ghost = dataclasses.replace(node, body=dataclasses.replace(read, name="ghost"))
    graph.nodes[graph.nodes.index(node)] = ghost
    with pytest.raises(ir.IRError, match="reads ghost"):
        ir.verify(graph)
    ranked = dataclasses.replace(node, body=dataclasses.replace(read, index=read.index[:1]))
    graph.nodes[graph.nodes.index(ghost)] = ranked
    with pytest.raises(ir.IRError, match="with 1 indices"):
        ir.verify(graph)


def test_ir_check_refuses_a_read_of_an_extern_result_before_the_extern():
    graph, _ = _lowered(_Softmax(), torch.randn(4, 6))
    extern = next(n for n in graph.nodes if isinstance(n, ir.ExternNode))
    graph.nodes.remove(extern)
    graph.nodes.append(extern)  # the matmul now runs after the relu that reads it
    with pytest.raises(ir.IRError, match="reads mm"):
        ir.verify(graph)


def test_schedule_check_refuses_a_read_before_the_store_and_a_lost_output():
    graph, steps = _lowered(_Softmax(), torch.randn(4, 6))
    assert len(steps) == 3, steps
    with pytest.raises(ir.IRError, match="before any step stores it"):
        verify_schedule(steps[::-1], graph)
    with pytest.raises(ir.IRError, match="stores the outputs"):
        verify_schedule(steps[:1], graph)


def test_debug_compiles_run_the_checks_between_passes(monkeypatch):
    """A planted fusion bug (the schedule reversed) fails the compile under GJIT_DEBUG, naming
    the check, instead of running wrong kernels."""
    monkeypatch.setattr(driver, "fuse", lambda graph: fuse(graph)[::-1])
    with pytest.raises(ir.IRError, match="gjit schedule"):
        check(_Softmax(), torch.randn(4, 6))
