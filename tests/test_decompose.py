"""Decomposition node by node (gjit/capture/decompose.py), checked against torch's run_decompositions().

A program that mutates nothing is decomposed one node at a time; anything the node-by-node pass
cannot vouch for (a write in place, a higher-order op, a data-dependent size, a decomposition
that writes) goes through run_decompositions() whole. Both must compute what eager computes.
"""

from __future__ import annotations

import collections
import re

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

import gjit
import model_zoo
from gjit.capture import decompose
from helpers import check, run_compiled
from model_zoo import MODELS

pytestmark = pytest.mark.cpu

# run_decompositions() traces with the parameters requiring grad, so torch's matmul keeps a 3-d
# input's batch dims for autograd (expand + bmm); traced alone, as eager does under no_grad, it
# folds them into one mm (a contiguous copy of the input, then a view).
FOLDED_MATMUL = {
    "transformer_encoder_layer": {
        "aten.bmm.default": -1,
        "aten.expand.default": -2,
        "aten.mm.default": 1,
        "aten.clone.default": 1,
        "aten.view.default": -1,
    }
}


def aten_ops(program: torch.export.ExportedProgram) -> collections.Counter:
    """The ATen ops of a program, size queries left out (each traced node asks its own sizes)."""
    return collections.Counter(
        str(n.target)
        for n in program.graph.nodes
        if n.op == "call_function"
        and isinstance(n.target, torch._ops.OpOverload)
        and "sym_" not in str(n.target)
    )


def export(model, args, **kwargs) -> torch.export.ExportedProgram:
    with torch.no_grad():
        return torch.export.export(model, args, strict=False, **kwargs)


def counters() -> tuple[int, int]:
    stats = gjit.stats()
    return stats.get("decompositions_by_node", 0), stats.get("decompositions_whole", 0)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_node_by_node_gives_run_decompositions_ops_and_eager_results(name):
    model, args = MODELS[name]()
    program = export(model, args)
    assert decompose.whole_program_reason(program) is None
    table = decompose.decomposition_table()
    nodes = decompose.decompose_nodes(program, table)
    whole = program.run_decompositions(table)
    difference = aten_ops(nodes)
    difference.subtract(aten_ops(whole))
    assert {k: v for k, v in difference.items() if v} == FOLDED_MATMUL.get(name, {})
    assert not [n for n in nodes.graph.nodes if n.op == "call_function" and decompose.decomposes(n, table)]
    with torch.no_grad():
        got, want = nodes.module()(*args), model(*args)
    for a, e in zip(pytree.tree_leaves(got), pytree.tree_leaves(want), strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)


def test_a_compiled_model_is_decomposed_node_by_node_with_dynamic_sizes():
    model, args = MODELS["llama-sdpa"]()
    with torch.no_grad():
        check(model, *args)
    assert counters() == (1, 0)


class BufferWrite(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros(4))

    def forward(self, x):
        self.steps.add_(1)
        return F.layer_norm(x, (4,)) * self.steps


def test_a_program_that_writes_in_place_is_decomposed_whole():
    x = torch.randn(3, 4)
    assert "writes an argument in place" in decompose.whole_program_reason(export(BufferWrite(), (x,)))
    eager, compiled = BufferWrite(), BufferWrite()
    cm = gjit.compile(compiled)
    for _ in range(2):
        out, _ = run_compiled(cm, x)
        torch.testing.assert_close(out, eager(x))
    assert torch.equal(compiled.steps, torch.full((4,), 2.0))
    assert counters() == (0, 1)


def test_a_composite_op_that_writes_when_traced_is_decomposed_whole():
    # F.batch_norm in training mode is one CompositeImplicitAutograd node in the exported graph;
    # traced, it updates the running statistics in place: only functionalization handles that
    def fn(x, mean, var):
        return F.batch_norm(x, mean, var, training=True, momentum=0.5)

    x = torch.randn(4, 3, 5)
    mean, var = torch.randn(3), torch.rand(3) + 0.5
    eager_mean, eager_var = mean.clone(), var.clone()
    expected = fn(x, eager_mean, eager_var)
    with gjit.config.scope(interpret=True, debug=True):
        out = gjit.compile(fn)(x, mean, var)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close((mean, var), (eager_mean, eager_var))
    assert counters() == (0, 1)


def test_a_decomposition_that_restrides_its_own_result_is_functionalized_node_by_node():
    # adaptive_avg_pool1d of a transposed input decomposes into a mean and an as_strided_ of that
    # fresh mean (eager's strides): a write, but to nothing the program had; functionalized alone,
    # it is an as_strided view (Swin's pooler: the whole dynamic program was decomposed again)
    class Pool(torch.nn.Module):
        def forward(self, x):
            return F.adaptive_avg_pool1d(x.transpose(1, 2), 1) * 2

    fn = Pool()
    x = torch.randn(2, 5, 3)
    program = export(fn, (x,))
    decomposed, how = decompose.decompose_program(program)
    assert how == "nodes"
    targets = {str(n.target) for n in decomposed.graph.nodes}
    assert "aten.as_strided.default" in targets and "aten.as_strided_.default" not in targets
    cm = gjit.compile(fn)
    out, _ = run_compiled(cm, x)
    torch.testing.assert_close(out, fn(x))
    assert counters() == (1, 0)
    assert not gjit.explain(cm, x).externs


def test_a_grad_mode_region_is_decomposed_whole():
    class NoGradInside(torch.nn.Module):
        def forward(self, x):
            with torch.no_grad():
                y = F.silu(x) * 2
            return y.reshape(-1)

    x = torch.randn(4, 8)  # with grad enabled outside, export keeps the region as a higher-order op
    assert "get_attr" in decompose.whole_program_reason(torch.export.export(NoGradInside(), (x,)))
    check(NoGradInside(), x)
    assert counters() == (0, 1)


def test_a_data_dependent_size_is_decomposed_whole():
    def fn(x):
        return torch.nonzero(x > 0).reshape(-1)

    assert "data-dependent" in decompose.whole_program_reason(_export_fn(fn, torch.randn(6, 5)))


def _export_fn(fn, *args) -> torch.export.ExportedProgram:
    class Wrap(torch.nn.Module):
        def forward(self, *a):
            return fn(*a)

    return export(Wrap(), args)


def test_multi_output_ops_and_outputs_replaced_by_their_decomposition():
    def fn(input):  # an input named like a builtin keeps its name (the signature names it)
        var, mean = torch.var_mean(input.reshape(4, -1), -1)
        normed = F.layer_norm(input, (8,))
        return var, mean, normed.to(torch.float32), input.t().reshape(-1)

    x = torch.randn(4, 8)
    program = _export_fn(fn, x)
    nodes = decompose.decompose_nodes(program, decompose.decomposition_table())
    assert [s.arg.name for s in nodes.graph_signature.input_specs] == [
        s.arg.name for s in program.graph_signature.input_specs
    ]
    outputs = [n.name for n in nodes.graph.output_node().args[0]]
    assert [s.arg.name for s in nodes.graph_signature.output_specs] == outputs
    for a, e in zip(nodes.module()(x), fn(x), strict=True):
        torch.testing.assert_close(a, e)
    check(fn, x)
    check(fn, torch.randn(8, 4).t())  # non-contiguous: reshape copies
    assert counters() == (2, 0)


def test_a_decomposition_that_changes_the_dtype_is_cast_back():
    """torch's select_scatter decomposition of a bool tensor with an int64 source returns int64;
    eager returns bool (fuzz seed 22): the decomposed value is cast to the node's dtype."""
    x = torch.tensor([False, True, False])
    cm = check(lambda x: torch.select_scatter(x, x.select(-1, 0) + 1, -1, -1), x)
    assert cm(x).dtype == torch.bool


def test_a_reused_trace_keeps_each_node_source_line():
    class TwoProjections(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            first = self.a(x)
            return self.b(first)

    program = export(TwoProjections(), (torch.randn(3, 8),))
    nodes = decompose.decompose_nodes(program, decompose.decomposition_table())
    addmms = [n for n in nodes.graph.nodes if n.target == torch.ops.aten.addmm.default]
    assert len(addmms) == 2
    lines = [re.findall(r"line (\d+)", n.meta["stack_trace"]) for n in addmms]
    assert lines[0] != lines[1]
    assert [n.meta["nn_module_stack"] for n in addmms] != [addmms[0].meta["nn_module_stack"]] * 2


def test_a_trace_is_not_reused_across_constants_that_compare_equal():
    # 1 == 1.0 == True and 0.0 == -0.0 in Python: a reused trace would keep the first one's
    # constant (an int result for 1.0 - x, +0.0 for -0.0 - x)
    def fn(x):
        y = x.float()
        return 1 - x, 1.0 - x, torch.arange(5), torch.arange(5.0), 0.0 - y, -0.0 - y

    x = torch.arange(6)
    program = _export_fn(fn, x)
    for got, want in zip(
        decompose.decompose_nodes(program, decompose.decomposition_table()).module()(x), fn(x)
    ):
        assert got.dtype == want.dtype and torch.equal(got, want)
        assert torch.equal(torch.signbit(got.float()), torch.signbit(want.float()))
    check(fn, x)
    assert counters() == (1, 0)


def test_a_returned_size_keeps_its_output_spec():
    class ChunkAndSize(torch.nn.Module):
        def forward(self, x, y):
            return x.chunk(2, 0)[0], y.shape[0] + 1, y.reshape(-1)

    auto = torch.export.Dim.AUTO
    args = (torch.randn(4, 3), torch.randn(5, 2))
    program = torch.export.export(ChunkAndSize(), args, dynamic_shapes=({0: auto}, {0: auto}), strict=False)
    decomposed, how = decompose.decompose_program(program)
    assert how == "nodes"
    got = decomposed.module()(*args)
    assert got[1] == 6 and torch.equal(got[0], args[0][:2]) and torch.equal(got[2], args[1].reshape(-1))


# name -> (function, the op decomposed, whether every piece is a kernel)
UNLOWERED = {
    "bilinear": (
        lambda a: F.interpolate(a, scale_factor=2, mode="bilinear"),
        "aten.upsample_bilinear2d.vec",
        True,
    ),
    # the scale (in - 1) / (out - 1) of a dynamic size is a SymFloat: the multiply by it stays an extern
    "bilinear_aligned": (
        lambda a: F.interpolate(a, size=(5, 11), mode="bilinear", align_corners=True),
        "aten.upsample_bilinear2d.vec",
        False,
    ),
}


@pytest.mark.parametrize("name", sorted(UNLOWERED))
def test_an_op_without_a_lowering_is_decomposed_with_torch_compiles_table(name, tmp_path):
    fn, op, all_kernels = UNLOWERED[name]
    x = torch.randn(2, 3, 8, 8)
    with gjit.config.scope(cache=True, cache_dir=str(tmp_path)):
        cm = check(fn, x)
    report = gjit.explain(cm, x)
    assert report.decomposed == [op] and report.kernels, report
    assert not [e for e in report.externs if e.op == op] and (not report.externs or not all_kernels), report
    assert "decomposed for lack of a lowering" in str(report)
    gjit.reset()  # from the on-disk entry, explain still says what was decomposed
    with gjit.config.scope(cache=True, cache_dir=str(tmp_path)):
        warm = check(fn, x)
    assert gjit.stats()["disk_cache_hits"] == 1 and gjit.explain(warm, x).decomposed == [op]


def test_grid_sample_is_one_kernel_and_exact_out_of_bounds():
    def fn(a, grid):
        return F.grid_sample(a, grid, align_corners=False)

    grid = torch.rand(2, 4, 4, 2) * 2.4 - 1.2  # some points outside [-1, 1]: zeros padding
    cm = check(fn, torch.randn(2, 3, 8, 8), grid)
    assert len(gjit.explain(cm, torch.randn(2, 3, 8, 8), grid).kernels) == 1


def test_heavy_and_random_ops_are_never_decomposed_for_lack_of_a_lowering():
    table = decompose.fallback_table()
    aten = torch.ops.aten
    assert aten.upsample_bilinear2d.vec in table and aten.grid_sampler_2d.default in table
    for op in (
        aten.mm.default,
        aten.bmm.default,
        aten.addmm.default,
        aten.rand_like.default,
        aten.rrelu_with_noise_functional.default,
        aten.round.decimals,
    ):
        assert op not in table, op
    assert not [op for op in table if op._schema.is_mutable]


def test_round_with_decimals_stays_exact_in_half_precision():
    # torch.compile's decomposition multiplies by 10^d in float16: 10000 * 10 overflows
    x = torch.tensor([10000.0, 86.125, -12736.0, 0.33], dtype=torch.float16)
    for decimals in (1, 2, -2):
        cm = check(lambda t, d=decimals: torch.round(t, decimals=d), x)
        assert gjit.explain(cm, x).decomposed == []
    check(lambda t: torch.round(t, decimals=-2), x.bfloat16())


def test_a_random_op_is_not_decomposed_so_it_draws_as_eager():
    x = torch.randn(64)
    torch.manual_seed(0)
    expected = F.rrelu(x, 0.1, 0.3, training=True)
    cm = gjit.compile(lambda t: F.rrelu(t, 0.1, 0.3, training=True))
    torch.manual_seed(0)
    got, _ = run_compiled(cm, x)
    assert torch.equal(got, expected)


def test_a_result_with_float_sizes_is_not_decomposed_into_many_externs():
    cm = gjit.compile(lambda a: F.interpolate(a, scale_factor=2.5, mode="bilinear"), dynamic=True)
    x = torch.randn(2, 3, 8, 8)
    check(cm, x)
    report = gjit.explain(cm, x)
    assert report.decomposed == [] and len(report.externs) == 1, report


def test_a_custom_composite_op_is_decomposed_node_by_node_as_the_full_table_would():
    # export keeps a CompositeImplicitAutograd op of another namespace; node by node, the table is
    # the ATen one plus that op's CIA kernel (no asking the dispatcher about every namespace), and
    # the op is decomposed as run_decompositions() with the full table decomposes it
    decompose.decomposition_table()  # built before the library exists, as in a long-lived process
    lib = torch.library.Library("gjit_test_cia", "DEF")
    lib.define("scaled_tanh(Tensor x, float scale) -> Tensor")
    lib.impl("scaled_tanh", lambda x, scale: torch.tanh(x) * scale, "CompositeImplicitAutograd")
    op = torch.ops.gjit_test_cia.scaled_tanh.default

    class Model(torch.nn.Module):
        def forward(self, x):
            return op(x + 1, 3.0) - x

    x = torch.randn(6, 5)
    program = export(Model(), (x,))
    assert op in {n.target for n in program.graph.nodes}
    assert op not in decompose._aten_table() and op in decompose.node_table(program)
    by_node, _ = decompose.decompose_program(program)
    assert aten_ops(by_node) == aten_ops(program.run_decompositions(torch.export.default_decompositions()))
    with torch.no_grad():
        cm = check(Model(), x)
    assert counters() == (1, 0)
    report = gjit.explain(cm, x)
    assert report.externs == [] and len(report.kernels) == 1, report

    class Counting(Model):  # a buffer written in place: run_decompositions() whole
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x):
            self.calls.add_(1)
            return super().forward(x)

    with torch.no_grad():
        cm = check(Counting(), x)
    assert counters() == (1, 1)
    report = gjit.explain(cm, x)
    assert not any("scaled_tanh" in e.op for e in report.externs), report


def test_detach_in_place_is_its_input_and_keeps_decomposition_node_by_node():
    # transformers' DynamicCache makes its empty keys with torch.tensor([]): export records a
    # lift_fresh_copy and a detach_ of it, which changes autograd's flag, not a value; it used to
    # send the whole program (every default-config HF decoder) through run_decompositions()
    class Fresh(torch.nn.Module):
        def forward(self, x):
            t = torch.tensor([1.0, 2.0, 3.0])
            t.detach_()
            return F.gelu(x) + t

    x = torch.randn(4, 3)
    program = export(Fresh(), (x,))
    assert torch.ops.aten.detach_.default in {n.target for n in program.graph.nodes}
    assert decompose.whole_program_reason(program) is None
    with torch.no_grad():
        check(Fresh(), x)
    assert counters() == (1, 0)


def test_a_default_config_hf_decoder_returning_its_cache_decomposes_node_by_node():
    model, args = model_zoo.gpt2("sdpa", use_cache=True)  # DynamicCache, returned with the logits
    with torch.no_grad():
        check(model, *args)
    assert counters() == (1, 0)
