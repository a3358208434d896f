"""Fusion: pointwise chains and DAGs are one kernel; externs split regions; nothing internal
is written to memory."""

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gjit
from helpers import check, kernel_count, run_compiled

pytestmark = pytest.mark.cpu


def ten_op_chain(x, y):
    a = x * 1.5
    b = a + y
    c = b.sigmoid()
    d = c - 0.25
    e = d.abs()
    f = e.sqrt()
    g = f * y
    h = g.tanh()
    i = h.exp()
    return i.clamp(max=2.0)


def test_ten_op_chain_is_one_kernel():
    cm = check(ten_op_chain, torch.randn(33, 17), torch.randn(17), kernels=1)
    kernel = gjit.explain(cm, torch.randn(33, 17), torch.randn(17)).kernels[0]
    # nothing but the chain's output is stored
    assert kernel.source.count("tl.store(") == 1
    assert len(kernel.aten_nodes) == 10


def test_dag_with_several_outputs_is_one_kernel():
    def f(x, y):
        s = x + y
        return s.sin(), s.cos() * x, (s * 2).relu()

    cm = check(f, torch.randn(8, 9), torch.randn(8, 9), kernels=1)
    source = gjit.explain(cm, torch.randn(8, 9), torch.randn(8, 9)).kernels[0].source
    assert source.count("tl.store(") == 3  # `s` stays in registers


def test_independent_outputs_of_one_input_share_a_kernel():
    def f(x):
        return x.sin(), x.cos()

    check(f, torch.randn(6, 10), kernels=1)


def test_broadcast_producer_is_recomputed_not_materialized():
    def f(row, m):
        scale = row.exp() + 1  # [N], read by every row of m
        return m * scale

    check(f, torch.randn(12), torch.randn(7, 12), kernels=1)


def test_output_that_is_also_consumed_is_stored_once():
    def f(x):
        a = x.relu()
        return a, a * 3

    cm = check(f, torch.randn(4, 5), kernels=1)
    assert gjit.explain(cm, torch.randn(4, 5)).kernels[0].source.count("tl.store(") == 2


def test_transposed_read_of_same_size_node_splits_safely():
    def f(x):
        a = x * 2  # [n, n]
        return a + a.t()  # reads `a` at a transposed index: not element-for-element

    check(f, torch.randn(6, 6))


class ResidualMLP(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        h = self.fc2(F.gelu(self.fc1(x)))
        return self.norm(h + x)


def test_residual_mlp_one_kernel_per_gap_between_externs():
    model = ResidualMLP().eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad(), gjit.config.scope(matmul="aten"):
        cm = check(model, x)
        rep = gjit.explain(cm, x)
    assert [e.op for e in rep.externs] == ["aten.addmm.default", "aten.addmm.default"]
    # gap 1: gelu between the matmuls; gap 2: the residual add fused into the layer norm
    assert len(rep.kernels) == 2, rep
    fused = [sorted({n.split(": ")[1] for n in k.aten_nodes}) for k in rep.kernels]
    assert fused == [["aten.gelu.default"], ["aten.add.Tensor", "aten.native_layer_norm.default"]]


def test_view_feeding_an_extern_is_passed_strided_not_copied():
    def f(x, w):
        return torch.mm(x, w.t()).relu()

    x, w = torch.randn(4, 6), torch.randn(5, 6)
    with gjit.config.scope(matmul="aten"):
        cm = check(f, x, w, kernels=1)
        rep = gjit.explain(cm, x, w)
    wrapper = open(cm.entries[0].program.graph.wrapper_path).read()
    # one call on w's memory, transposed: strides (1, w.size(1))
    assert re.search(r"permute = gjit_as_strided\(w, \((\w+), \w+\), \(1, \1\), 0\)", wrapper), wrapper
    assert [e.op for e in rep.externs] == ["aten.mm.default"]


def test_kernel_header_names_fused_ops_and_user_lines():
    cm = check(ten_op_chain, torch.randn(3, 4), torch.randn(4))
    kernel = gjit.explain(cm, torch.randn(3, 4), torch.randn(4)).kernels[0]
    assert kernel.name.startswith("gjit_poi_fused_mul_add_sigmoid")
    assert "# fused ATen nodes:" in kernel.source
    assert any("test_fusion.py" in line and "in ten_op_chain" in line for line in kernel.source_lines)
    assert "b = a + y" in kernel.source


def test_kernel_header_lists_the_assumptions_the_entry_guards():
    """A persistent softmax over a dynamic row assumes the row fits one block and that offsets fit
    int32: the header says so, the same lines the guards check."""
    x = torch.randn(6, 100)
    cm = check(lambda t: t.softmax(-1), x, kernels=1)
    (kernel,) = cm.entries[0].program.kernels
    header = kernel.source.split("@triton.jit")[0]
    assert "# assumes (guarded; a call that breaks one recompiles):" in header
    whys = [why for _, why in kernel.assumptions]
    assert any(w.startswith("persistent reduction: a row fits one block: ") for w in whys), whys
    assert any(w.startswith("int32 offsets: ") for w in whys), whys
    for why in whys:
        assert f"#   {why}\n" in header
    # the last line: what its binary is keyed on (parameter types, block sizes)
    key = header.strip().splitlines()[-1]
    assert key.startswith("# cache key: (in_ptr0: *fp32, out_ptr0: *fp32, ") and "RBLOCK=" in key, key


def test_sizes_are_kernel_arguments():
    def f(x, y):
        return x * 2 + y

    cm = check(f, torch.randn(6, 10), torch.randn(10))
    source = gjit.explain(cm, torch.randn(6, 10), torch.randn(10)).kernels[0].source
    header, body = source.split("@triton.jit")
    assert "10" not in body and "60" not in body, body  # no size is baked in


def test_kernel_count_of_extern_only_graph_is_zero():
    with gjit.config.scope(matmul="aten"):
        cm = gjit.compile(lambda a, b: torch.mm(a, b))
        assert kernel_count(cm, torch.randn(2, 3), torch.randn(3, 4)) == 0


def test_conv_batchnorm_relu_is_conv_extern_plus_one_kernel():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()).eval()
    model[1].running_mean.normal_()
    model[1].running_var.uniform_(0.5, 2.0)
    x = torch.randn(2, 3, 10, 10)
    with torch.no_grad():
        cm = check(model, x, kernels=1)
    assert [e.op for e in gjit.explain(cm, x).externs] == ["aten.convolution.default"]


def test_residual_mlp_with_matmul_templates():
    """The same block with matmul templates: fc1 with its bias, fc2 with gelu on its operand's
    load (prologue) and its bias, the residual add and the norm on its tile (epilogue: one tile
    covers a row, gjit/fusion/rows.py)."""
    model = ResidualMLP().eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        cm = check(model, x)
        rep = gjit.explain(cm, x)
    assert rep.externs == []
    names = [k.name for k in rep.kernels]
    assert len(names) == 2 and names[0].startswith("gjit_mm_") and names[1].startswith("gjit_mm_"), names
    fused = [sorted({n.split(": ")[1] for n in k.aten_nodes}) for k in rep.kernels]
    assert {"aten.gelu.default", "aten.add.Tensor", "aten.native_layer_norm.default"} <= set(fused[1]), fused


# -- kernels whose time is their launch (gjit/fusion/launches.py) ----------------------------------


def test_small_pointwise_kernels_of_one_size_are_one_launch():
    """Pointwise work on separate inputs of one small static size reads nothing in common; on a GPU
    each would be one program whose time is its launch, so it is one kernel."""

    def f(a, b, c):
        return a + 1, b * 2, c.sin()

    cm = check(gjit.compile(f, dynamic=False), *(torch.randn(4, 8) for _ in range(3)), kernels=1)
    source = gjit.explain(cm, *(torch.randn(4, 8) for _ in range(3))).kernels[0].source
    assert source.count("tl.store(") == 3


@pytest.mark.parametrize(
    "shapes, kernels",
    [
        (((4, 8), (8, 4), (4, 8)), 2),  # two sizes: a kernel each
        (((64, 32), (64, 32)), 2),  # 2048 elements each: more than one block's work
    ],
    ids=["two_sizes", "past_one_block"],
)
def test_pointwise_kernels_of_other_sizes_or_larger_stay_apart(shapes, kernels):
    def f(*xs):
        return tuple(x * (k + 2) for k, x in enumerate(xs))

    check(gjit.compile(f, dynamic=False), *(torch.randn(s) for s in shapes), kernels=kernels)


def test_small_kernels_with_an_extern_between_them_stay_in_order():
    """The second reads the product of the first's output: one kernel would be a cycle."""

    def f(a, w, b):
        x = a + 1
        return (x @ w) * 2 + b, x

    with gjit.config.scope(matmul="aten"):
        check(gjit.compile(f, dynamic=False), *(torch.randn(4, 4) for _ in range(3)), kernels=2)


def test_small_kernels_of_a_dynamic_size_stay_apart():
    """A dynamic size may be any size: their work is not known to be a launch's."""

    def f(a, b):
        return a + 1, b * 2

    cm = gjit.compile(f, dynamic=True)
    check(cm, torch.randn(4, 8), torch.randn(4, 8), kernels=2)


def test_a_program_that_draws_keeps_its_small_kernels_apart():
    """Random numbers are drawn in program order: no kernel moves past a draw's extern."""

    def f(a, b, p):
        return a + 1, F.dropout(b, p=0.5, training=True) + p

    cm = gjit.compile(f, dynamic=False)
    args = (torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8))
    torch.manual_seed(1)
    expected = f(*args)
    torch.manual_seed(1)
    got, _ = run_compiled(cm, *args)  # fails if the call ran eagerly
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
    assert kernel_count(cm, *args) == 2


def _two_layer_step(q, k, v, keys0, values0, length0, keys1, values1, length1):
    """Two layers of a static cache's decode step, each with its own counter (transformers'
    per-layer `cumulative_length`): the position it holds, the counter advanced, the writes."""
    out = q
    for keys, values, length in ((keys0, values0, length0), (keys1, values1, length1)):
        position = length + torch.arange(k.shape[2])
        length.add_(k.shape[2])
        keys.index_copy_(2, position, k)
        values.index_copy_(2, position, v)
        out = F.scaled_dot_product_attention(out, keys, values)
    return out


def test_a_static_caches_counters_advance_in_one_kernel():
    """Each layer's counter is one element: their `+= 1`s are one kernel after both layers' writes,
    stored into each counter in place. Three steps against eager's."""
    torch.manual_seed(0)
    caches = [torch.randn(2, 3, 10, 8) for _ in range(4)]
    lengths = [torch.tensor([4]), torch.tensor([4])]
    mine = [caches[0], caches[1], lengths[0], caches[2], caches[3], lengths[1]]
    eager = [t.clone() for t in mine]
    cm = gjit.compile(_two_layer_step)
    for _ in range(3):
        q, k, v = (torch.randn(2, 3, 1, 8) for _ in range(3))
        want = _two_layer_step(q, k, v, *eager)
        got, _ = run_compiled(cm, q, k, v, *mine)
        torch.testing.assert_close(got, want)
        for a, b in zip(mine, eager):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert lengths[0].item() == lengths[1].item() == 7
    wrapper = cm.entries[0].program.graph.wrapper_source
    assert wrapper.count("# stored into the input it updates") == 2, wrapper
    counters = [line for line in wrapper.splitlines() if "](length0, length1," in line]
    assert len(counters) == 1, wrapper  # one launch advances both
    assert wrapper.index("index_put_3 = values1") < wrapper.index(counters[0]), wrapper


def test_an_extern_using_an_items_value_runs_after_the_item():
    """`sort(y[:n])` reads only an input, but its view's length is `.item()`'s value: it waits for
    the extern that binds it, however the kernels before it merge (here `a + 1` and `t + a` read a
    common input)."""

    def f(a, b, y):
        x = a + 1
        n = x[0].item()
        torch._check(n >= 0)
        torch._check(n <= 8)
        return x, torch.sort(y[:n]).values, torch.sort(b).values + a

    args = torch.tensor([2, 0, 0, 0]), torch.randint(0, 9, (4,)), torch.randn(8)
    check(gjit.compile(f, dynamic=False), *args)


def test_a_small_kernel_something_reads_is_not_moved():
    """`a + 1` is read by an extern: merging it with the later `b * 2` would hold the extern (and
    what it frees) back, so the two stay apart."""

    def f(a, b):
        return torch.searchsorted(a + 1, b), b * 2

    check(gjit.compile(f, dynamic=False), torch.arange(8.0), torch.randn(8), kernels=2)


def test_a_counter_read_before_its_advance_is_still_stored_in_place():
    def f(c, q_in):
        e = torch.searchsorted(q_in + 1, c)  # reads the counter's old value
        c.add_(1)
        return e

    c, eager_c = torch.tensor([0.5]), torch.tensor([0.5])
    cm = gjit.compile(f, dynamic=False)
    for _ in range(2):
        q = torch.tensor([0.0])
        got, _ = run_compiled(cm, c, q)
        assert torch.equal(got, f(eager_c, q)) and torch.equal(c, eager_c)
    assert "c  # stored into the input it updates" in cm.entries[0].program.graph.wrapper_source


def test_a_small_output_merged_with_a_region_something_reads_merges_no_further():
    """`x * 2` (an output) shares its read of x with `x + 1`, which a sort reads: once one kernel,
    it is read, so the small output computed after another extern does not join it."""

    def f(x, z, w):
        s, n = x * 2, x + 1
        t = torch.sort(z).values + 3
        return s, torch.sort(n).values * w.sum(), t

    check(gjit.compile(f, dynamic=False), torch.randn(4), torch.randn(4), torch.randn(4), kernels=3)
