"""Dynamic shapes and guards: symbolic sizes from export, one guard function per entry,
automatic dynamic, mark_dynamic ranges, the recompile limit, data-dependent sizes, torch.cond."""

from __future__ import annotations

import logging
import signal
import threading
import time

import pytest
import sympy
import torch

import gjit
from gjit.guards import build_guards
from helpers import assert_same, run_compiled
from model_zoo import gpt2, max_rel_err

pytestmark = pytest.mark.cpu


def compiles() -> int:
    return gjit.stats()["compiles"]


def check_call(cm: gjit.CompiledFunction, *args, expect_eager: bool = False):
    out, _ = run_compiled(cm, *args, expect_eager=expect_eager)
    expected = cm.model(*args)
    for a, e in zip(
        out if isinstance(out, tuple) else (out,), expected if isinstance(expected, tuple) else (expected,)
    ):
        assert_same(a, e)
    return out


# ----------------------------------------------------------------------------------------------
# The torch.export documentation's examples
# ----------------------------------------------------------------------------------------------


class TwoBranches(torch.nn.Module):
    """torch.export docs: a batch dim shared by two inputs, two Linear+ReLU branches, a buffer."""

    def __init__(self):
        super().__init__()
        self.branch1 = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU())
        self.branch2 = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.ReLU())
        self.buffer = torch.nn.Buffer(torch.randn(32))

    def forward(self, x1, x2):
        return self.branch1(x1) + self.buffer, self.branch2(x2)


def test_export_docs_shared_batch_two_branches_and_buffer():
    cm = gjit.compile(TwoBranches().eval())
    with torch.no_grad():
        for batch in (32, 16, 64, 7):
            check_call(cm, torch.randn(batch, 64), torch.randn(batch, 128))
        assert compiles() == 1
        guards = cm.entries[0].guards
        # each input's batch is its own symbol (export does not tie sizes that merely happened to be
        # equal), the feature dims are specialized: they must match the weights
        s1, s2 = guards.symbols
        assert guards.dynamic_dims == [f"x1.size(0) = {s1}", f"x2.size(0) = {s2}"]
        assert "x1.size(1) == 64" in guards.format() and "x2.size(1) == 128" in guards.format()
        check_call(cm, torch.randn(8, 64), torch.randn(12, 128))
        assert compiles() == 1
        with pytest.raises(RuntimeError):  # wrong features: eager's error, not a wrong answer
            cm(torch.randn(8, 32), torch.randn(8, 128))


def test_export_docs_derived_dim_with_a_range():
    """x + y[1:] with dimy = dimx + 1 and dimx in [3, 6]: a size outside the range recompiles."""

    def f(x, y):
        return x + y[1:]

    cm = gjit.compile(f)
    x, y = torch.randn(5, 4), torch.randn(6, 4)
    gjit.mark_dynamic(x, 0, min=3, max=6)
    check_call(cm, x, y)
    text = cm.entries[0].guards.format()
    sym = cm.entries[0].guards.symbols[0]
    assert f"y.size(0) == {sym} + 1" in text and f"{sym} <= 6" in text and f"{sym} >= 3" in text, text
    for n in (3, 4, 6):
        check_call(cm, torch.randn(n, 4), torch.randn(n + 1, 4))
    assert compiles() == 1
    check_call(cm, torch.randn(8, 4), torch.randn(9, 4))  # outside [3, 6]
    assert compiles() == 2
    with pytest.raises(RuntimeError):  # eager raises on mismatched sizes; so does the compiled call
        cm(torch.randn(4, 4), torch.randn(4, 4))


def test_mark_dynamic_validates_its_arguments():
    x = torch.randn(4, 3)
    with pytest.raises(IndexError):
        gjit.mark_dynamic(x, 2)
    with pytest.raises(ValueError, match="outside the range"):
        gjit.mark_dynamic(x, 0, min=5)
    with pytest.raises(TypeError):
        gjit.mark_dynamic([1, 2], 0)


def test_error_on_recompile_raises_for_a_size_outside_the_range():
    cm = gjit.compile(lambda x: x * 2)
    x = torch.randn(4)
    gjit.mark_dynamic(x, 0, min=2, max=8)
    check_call(cm, x)
    with gjit.config.scope(error_on_recompile=True):
        with pytest.raises(gjit.RecompileError, match=r"<= 8"):
            cm(torch.randn(9))


# ----------------------------------------------------------------------------------------------
# Policy: automatic dynamic, dynamic=True/False, sizes 0 and 1
# ----------------------------------------------------------------------------------------------


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).eval()


BATCHES = [3, 17, 2, 64, 5, 14, 33, 8, 100, 9, 4, 250, 6, 12, 7, 31, 10, 48, 11, 13]


# the default is dynamic from the first call (export keeps batch symbolic), like dynamic=True
@pytest.mark.parametrize("dynamic, expected", [(None, 1), (True, 1), (False, len(BATCHES))])
def test_mlp_over_20_batch_sizes(dynamic, expected):
    model = mlp()
    cm = gjit.compile(model, dynamic=dynamic)
    with torch.no_grad(), gjit.config.scope(recompile_limit=64):
        for b in BATCHES:
            check_call(cm, torch.randn(b, 16))
    assert compiles() == expected, [e.guards.format() for e in cm.entries]
    assert len(cm.entries) == compiles()


def test_sizes_zero_and_one_are_correct():
    model = mlp()
    cm = gjit.compile(model)
    with torch.no_grad():
        for b in (4, 1, 0, 1, 6, 0):
            check_call(cm, torch.randn(b, 16))
    # sizes >= 2 share an entry; export specializes sizes 0 and 1, so each gets its own
    assert compiles() == 3


@pytest.mark.slow  # CI's sweep step: most of a minute
def test_gpt2_sweep_over_sequence_and_batch_in_mixed_order():
    """seq 8..64 and batch 1..4 changing at different calls: two entries in total (GPT-2 branches
    on batch == 1, so batch 1 gets its own entry; torch.compile needs 4 on such a sweep)."""
    model, _ = gpt2("sdpa", positions=64)
    cm = gjit.compile(model)
    shapes = [(2, 8), (2, 24), (4, 8), (1, 16), (3, 64), (1, 40), (4, 33), (1, 8)]
    with torch.no_grad():
        for batch, seq in shapes:
            ids = torch.randint(0, 128, (batch, seq))
            with gjit.config.scope(interpret=True, debug=True):
                out = cm(ids)
            assert max_rel_err(out.logits, model(ids).logits) < 1e-5, (batch, seq)
    assert compiles() == 2, gjit.stats()


def test_transposed_and_sliced_inputs_after_a_contiguous_call():
    cm = gjit.compile(lambda x, y: x * y + 1)
    base = torch.randn(6, 8)
    check_call(cm, base, torch.randn(6, 8))
    check_call(cm, base[:, :6].t(), torch.randn(6, 6))  # strides change: guard fails, recompile
    check_call(cm, base[::2], torch.randn(3, 8))
    check_call(cm, torch.randn(5, 8), torch.randn(5, 8))  # a contiguous call hits the first entry
    assert gjit.stats()["cache_hits"] >= 1


def test_dtype_change_recompiles_and_device_change_fails_the_guard():
    cm = gjit.compile(lambda x: x.exp())
    check_call(cm, torch.randn(5))
    check_call(cm, torch.randn(5).double())
    assert compiles() == 2
    guards = cm.entries[0].guards
    meta = torch.empty(5, device="meta")
    assert guards.check([meta]) is None
    assert any("device == cpu" in f for f in guards.failures([meta])), guards.failures([meta])


def test_specialized_python_scalar_recompiles():
    cm = gjit.compile(lambda x, k: x * k)
    x = torch.randn(4)
    for k in (2.0, 2.0, 3.0):
        check_call(cm, x, k)
    assert compiles() == 2
    assert "k == 2.0 (specialized)" in cm.entries[0].guards.format()


def test_dynamic_true_exports_int_inputs_as_symbols():
    """dynamic=True (what torch.compile's backend passes for SymInt graph inputs) binds an int
    input >= 2 as a symbol; ints below 2, other types and the default mode specialize."""

    def f(x, n):
        return (x * n).sum(-1) + n

    cm = gjit.compile(f, dynamic=True)
    x = torch.randn(4, 6)
    for n in (3, 5, 3, 40):
        check_call(cm, x, n)
    assert compiles() == 1
    guards = cm.entries[0].guards
    assert "n is an int" in guards.format() and any(d.startswith("n = ") for d in guards.dynamic_dims)
    for n in (1, -7, 2.5, True):  # below 2 and other types: entries of their own
        check_call(cm, x, n)
    assert compiles() == 5
    gjit.reset()
    default = gjit.compile(f)
    for n in (3, 5):
        check_call(default, x, n)
    assert compiles() == 2


# ----------------------------------------------------------------------------------------------
# Guards: binding, relations, export's guards, kernel assumptions, explaining a miss
# ----------------------------------------------------------------------------------------------


def test_guard_binds_sizes_and_hands_them_to_the_wrapper():
    cm = gjit.compile(lambda x, y: x + y.sum(1, keepdim=True))
    check_call(cm, torch.randn(5, 3), torch.randn(5, 7))
    entry = cm.entries[0]
    x, y = torch.randn(9, 3), torch.randn(9, 11)
    assert entry.guards.check([x, y]) == (9, 3, 11)
    wrapper = open(entry.program.graph.wrapper_path).read()
    assert "= sizes  # bound by the guard" in wrapper
    assert ".shape[" not in wrapper  # no size is read again


def test_branch_on_a_size_becomes_a_guard_with_its_source_line():
    def f(x):
        if x.shape[0] > 4:
            return x.relu()
        return x.sigmoid()

    cm = gjit.compile(f)
    check_call(cm, torch.randn(6, 3))
    text = cm.entries[0].guards.format()
    assert "test_dynamic.py" in text and "> 4" in text, text
    check_call(cm, torch.randn(9, 3))
    assert compiles() == 1
    check_call(cm, torch.randn(2, 3))  # the other branch: a new entry, never the wrong one
    assert compiles() == 2


def test_a_miss_is_explained_with_the_nearest_entry_and_every_failed_guard(caplog):
    cm = gjit.compile(lambda x, y: x + y)
    check_call(cm, torch.randn(4, 3), torch.randn(4, 3))
    with caplog.at_level(logging.INFO, logger="gjit.recompiles"):
        check_call(cm, torch.randn(4, 3).double(), torch.randn(4, 3).t().contiguous().t().double()[:, :3])
    text = caplog.text
    assert "nearest, entry 0" in text
    assert "x.dtype == torch.float32, got torch.float64" in text
    assert "y.dtype == torch.float32, got torch.float64" in text
    assert "decision: compile entry 1" in text


def test_int32_offsets_are_an_assumption_the_guard_checks():
    from torch._subclasses.fake_tensor import FakeTensorMode

    cm = gjit.compile(lambda x: x * 2)
    check_call(cm, torch.randn(8, 8))
    guards = cm.entries[0].guards
    assert any(g.kind == "kernel" and "int32" in g.description for g in guards.guards)
    with FakeTensorMode():  # a huge tensor without memory: its offsets overflow int32
        huge = torch.empty(2**16, 2**16)
    assert guards.check([huge]) is None
    assert any("int32 offsets" in f for f in guards.failures([huge]))


def test_persistent_reduction_with_a_dynamic_row_sizes_its_block_at_launch():
    cm = gjit.compile(lambda x: torch.softmax(x, -1))
    for n in (8, 100, 300, 1000):
        check_call(cm, torch.randn(3, n))
    assert compiles() == 1
    kernel = cm.entries[0].program.kernels[0]
    assert kernel.persistent and kernel.launch_blocks["RBLOCK"]
    check_call(cm, torch.randn(3, 3000))  # past persistent_max: the guard fails, a looped kernel
    assert compiles() == 2
    assert not cm.entries[1].program.kernels[0].persistent


def test_identical_kernels_are_shared_between_entries():
    from gjit.runtime import graph as runtime

    def f(x, mode):
        return x.sin() * 2 if mode == "a" else x.sin() * 2

    cm = gjit.compile(f)
    x = torch.randn(4, 9)
    check_call(cm, x, "a")
    check_call(cm, x, "b")  # a specialized string: a recompile; the kernel has the same source
    first, second = (e.program.graph for e in cm.entries)
    assert compiles() == 2
    assert list(first.kernel_paths.values()) == list(second.kernel_paths.values())
    assert first.call_fn(True).__closure__ is not None
    path = next(iter(first.kernel_paths.values()))
    assert sum(key[0] == path for key in runtime._KERNELS) == 1


# ----------------------------------------------------------------------------------------------
# The recompile limit
# ----------------------------------------------------------------------------------------------


def test_recompile_limit_warns_once_then_runs_eagerly(caplog):
    cm = gjit.compile(lambda x: x.cos() + 1, dynamic=False)
    with gjit.config.scope(recompile_limit=3), caplog.at_level(logging.WARNING, logger="gjit"):
        for k, n in enumerate((2, 3, 4, 5, 6, 5, 7)):
            check_call(cm, torch.randn(n), expect_eager=k >= 3)  # past the limit: eager
    assert compiles() == 3
    warnings = [r for r in caplog.records if "recompile limit" in r.getMessage()]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "x.shape == " in message  # the guard that keeps failing
    assert "1 x x: float32[4]" in message and "1 x x: float32[5]" in message  # shapes that missed
    assert "gjit.mark_dynamic(x, 0)" in message
    assert gjit.stats()["eager_runs"] == 4


def test_recompile_limit_can_raise():
    cm = gjit.compile(lambda x: x + 1, dynamic=False)
    with gjit.config.scope(recompile_limit=1, fail_on_recompile_limit=True):
        check_call(cm, torch.randn(2))
        with pytest.raises(gjit.RecompileError, match="recompile limit"):
            cm(torch.randn(3))


# ----------------------------------------------------------------------------------------------
# Data-dependent sizes and torch.cond
# ----------------------------------------------------------------------------------------------

DATA_DEPENDENT = {
    "boolean_mask": lambda x: (x[x > 0] * 2).sum() + x.sin(),
    "nonzero": lambda x: torch.nonzero(x > 0).float() + 1,
    "item_scalar": lambda x: x * (x > 0).sum().item(),
    "unique": lambda x: torch.unique(x.round()) * 2,
    "mask_rows": lambda x: x[x[:, 0] > 0].relu() + 1,
}


@pytest.mark.parametrize("name", list(DATA_DEPENDENT))
def test_data_dependent_sizes_run_as_externs_and_continue_with_the_runtime_size(name):
    fn = DATA_DEPENDENT[name]
    cm = gjit.compile(fn)
    for rows in (6, 9, 6):
        check_call(cm, torch.randn(rows, 4))
    assert compiles() == 1 and gjit.stats()["eager_runs"] == 0
    assert gjit.explain(cm, torch.randn(6, 4)).externs  # the data-dependent op is an extern


def test_a_size_export_cannot_trace_runs_eagerly_with_the_reason(caplog):
    def f(x):
        return torch.ones(int((x > 0).sum().item())) * 3

    cm = gjit.compile(f)
    with caplog.at_level(logging.WARNING, logger="gjit"):
        x = torch.randn(10)
        torch.testing.assert_close(cm(x), f(x))
    assert "data-dependent" in cm.eager_reason and "running it eagerly" in caplog.text


class Cond(torch.nn.Module):
    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda x: (x.sin() + 1).relu(), lambda x: x.cos() * 2, (x,))


def test_torch_cond_compiles_both_branches_and_picks_one_at_run_time():
    cm = gjit.compile(Cond())
    for x in (torch.randn(4, 3).abs(), -torch.randn(4, 3).abs(), torch.randn(7, 5).abs() + 0.1):
        check_call(cm, x)
    assert compiles() == 1
    graph = cm.entries[0].program.graph
    assert set(graph.subgraphs) == {"true_graph_0", "false_graph_0"}
    assert all(len(sub.kernels) == 1 for sub in graph.subgraphs.values())


def test_guard_set_of_a_static_entry_is_exact():
    x = torch.randn(3, 4)
    guards = build_guards([x, 2], ["x", "n"])
    assert guards.check([torch.randn(3, 4), 2]) == ()
    assert guards.check([torch.randn(3, 5), 2]) is None
    assert guards.check([torch.randn(3, 4), 3]) is None
    assert guards.failures([torch.randn(3, 5), 3]) == [
        "x.shape == (3, 4), got (3, 5)",
        "n == 2 (specialized), got 3",
        "x.stride() == (4, 1), got (5, 1)",
    ]


# ----------------------------------------------------------------------------------------------
# Soundness: what export assumed about the example must hold for every call an entry serves
# ----------------------------------------------------------------------------------------------


def test_one_tensor_passed_twice_then_two_tensors():
    cm = gjit.compile(lambda x, y: x * y)
    t = torch.randn(4, 3)
    check_call(cm, t, t)  # export sees one input used twice
    check_call(cm, torch.randn(4, 3), t)
    assert compiles() == 2
    assert "y is x" in cm.entries[0].guards.format()


def test_aliased_inputs_of_a_mutating_program():
    def f(x, y):
        x.add_(1)
        return y * 2

    cm = gjit.compile(f)
    a, b = torch.ones(4, 3), torch.ones(4, 3)
    out, _ = run_compiled(cm, a, b)
    assert torch.equal(out, torch.full((4, 3), 2.0)) and torch.equal(a, torch.full((4, 3), 2.0))
    t = torch.ones(4, 3)
    # x and y are one tensor, so y*2 sees the update: gjit runs this call eagerly, as eager does
    out, _ = run_compiled(cm, t, t, expect_eager=True)
    assert torch.equal(out, torch.full((4, 3), 4.0))
    base = torch.ones(12)
    x, y = base[:8], base[2:10]
    expected_base = base.clone()
    expected = f(expected_base[:8], expected_base[2:10])
    out, _ = run_compiled(cm, x, y, expect_eager=True)  # overlapping views: eager too
    assert torch.equal(out, expected) and torch.equal(base, expected_base)
    guards, base = cm.entries[0].guards, torch.ones(24)
    x, y = base[:12].view(4, 3), base[3:15].view(4, 3)
    assert guards.check([x, y]) is None  # the hot path: one storage read per tensor
    assert guards.failures([x, y]) == [f"x (written) shares no memory with y, got {base.data_ptr()}"]
    assert guards.check([torch.ones(4, 3), y]) is not None  # a view is fine where nothing aliases it


@pytest.mark.parametrize("first", [(4, 3), (1, 3)])
def test_squeeze_of_a_dim_that_becomes_1(first):
    cm = gjit.compile(lambda x: x.squeeze(0) * 2)
    for shape in (first, (1, 3), (4, 3), (5, 1)):
        check_call(cm, torch.randn(shape))


@pytest.mark.parametrize("dynamic", [None, True, False])
def test_broadcast_of_a_size_1_dim(dynamic):
    cm = gjit.compile(lambda x, y: x.expand_as(y) * 1 + y, dynamic=dynamic)
    check_call(cm, torch.randn(4, 1), torch.randn(4, 3))
    check_call(cm, torch.randn(4, 3), torch.randn(4, 3))
    check_call(cm, torch.randn(6, 1), torch.randn(6, 5))


def test_negative_zero_is_a_different_specialization():
    import math

    cm = gjit.compile(lambda x, a: x + math.copysign(1.0, a))
    x = torch.randn(3)
    check_call(cm, x, 0.0)
    check_call(cm, x, -0.0)
    assert compiles() == 2


def test_lazily_negated_views_are_never_read_raw():
    cm = gjit.compile(lambda x: x + 1)
    check_call(cm, torch.randn(4))
    check_call(cm, torch._neg_view(torch.randn(4)), expect_eager=True)  # export would drop the bit
    check_call(cm, torch._neg_view(torch.randn(5)), expect_eager=True)


def test_replaced_parameters_are_guarded():
    model = torch.nn.Linear(4, 3).eval()
    cm = gjit.compile(model)
    x = torch.randn(2, 4)
    with torch.no_grad():
        check_call(cm, x)
        model.weight = torch.nn.Parameter(torch.randn(4, 3).t())  # same shape, transposed strides
        check_call(cm, x)
        model.weight = torch.nn.Parameter(torch.randn(3, 4))  # fits: served by an entry
        check_call(cm, x)
        model.weight = torch.nn.Parameter(torch.randn(3, 4, dtype=torch.float64))
        model.bias = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))
        check_call(cm, x.double())
    assert any(g.description.startswith("weight keeps its shape") for g in cm.entries[0].guards.guards)


class SharedBuffer(torch.nn.Module):
    """One buffer registered in two modules, or one weight tied to another (`tie`): the program
    may read one input for both names."""

    def __init__(self, tie="buffer"):
        super().__init__()
        self.a, self.b = torch.nn.Module(), torch.nn.Module()
        if tie == "buffer":
            shared = torch.randn(4)
            self.a.register_buffer("w", shared)
            self.b.register_buffer("w", shared)
        else:
            self.a.w = torch.nn.Parameter(torch.randn(4), requires_grad=False)
            self.b.w = self.a.w

    def forward(self, x):
        return x * self.a.w + self.b.w


@pytest.mark.parametrize("tie", ["buffer", "parameter"])
def test_names_tied_when_compiled_are_guarded_to_stay_tied(tie):
    """Untied after the compile (`b.w` given a tensor of its own), the call must read each name's
    tensor: the guard says the names are no longer tied, and the recompile reads both."""
    model = SharedBuffer(tie)
    cm = gjit.compile(model)
    x = torch.randn(3, 4)
    with torch.no_grad():
        check_call(cm, x)
        if tie == "buffer":
            model.b.w = torch.randn(4)
        else:
            model.b.w = torch.nn.Parameter(torch.randn(4), requires_grad=False)
        why = cm.entries[0].guards.failures([x])
        assert any(w.startswith("b.w is a.w (tied when compiled)") for w in why), why
        check_call(cm, x)
    assert len(cm.entries) == 2


def test_parameters_given_new_memory_in_place_are_guarded():
    """`param.data = ...` keeps the Parameter object (its id) and may change its strides: the
    kernels, and the wrapper's views of it (gjit_reinterpret from the traced strides), would read
    the new memory in the old layout. A weight read by a kernel, and one viewed for ATen's addmm."""

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.p = torch.nn.Parameter(torch.randn(5, 6))

        def forward(self, x):
            return x + self.p * 2

    cases = ((Scaled(), torch.randn(5, 6), "auto"), (torch.nn.Linear(8, 6), torch.randn(5, 8), "aten"))
    for model, x, matmul in cases:
        with gjit.config.scope(matmul=matmul), torch.no_grad():
            cm = gjit.compile(model)
            check_call(cm, x)
            param = next(model.parameters())
            param.data = param.data.t().contiguous().t()  # the same values, column-major
            check_call(cm, x)
            param.data = param.data.contiguous()  # back: the first entry serves it
            check_call(cm, x)
        assert len(cm.entries) == 2


def test_torch_cond_on_a_size():
    def f(x):
        return torch.cond(x.shape[0] > 4, lambda x: x * 2, lambda x: x - 1, (x,))

    cm = gjit.compile(f)
    for n in (6, 3, 9, 2):
        check_call(cm, torch.randn(n, 3))


def test_stepped_input_with_a_size_1_dim_binds_its_stride_symbol():
    # export gives the size-1 dim's stride a symbol (here 6 for rows 1::2 of a 3x3); the guard binds
    # it though any stride is fine there, so the entry is built and reused for other such slices
    cm = gjit.compile(lambda x: x + 1)
    for x in (torch.randn(3, 3)[1::2], torch.randn(3, 5)[1::2], torch.randn(4, 7)[2::3]):
        check_call(cm, x)
    assert compiles() == 1


def test_mark_dynamic_at_size_one_is_admitted_by_its_entry():
    """A dim marked dynamic whose example size is 1: export specializes it, and the entry still
    admits the call it was compiled for (no eager run, no compile on every call)."""
    x = torch.randn(1, 8)
    gjit.mark_dynamic(x, 0)
    cm = gjit.compile(lambda t: t.sin() * 2)
    for _ in range(3):
        out, _ = run_compiled(cm, x)
        assert_same(out, x.sin() * 2)
    assert gjit.stats()["compiles"] == 1


def test_mark_dynamic_from_zero_gives_size_zero_its_own_entry():
    """min=0 asks for sizes from 0, but export traced the program for sizes of at least 2: a size-0
    call gets an entry of its own (specialized), never the symbolic one."""
    cm = gjit.compile(lambda t: torch.softmax(t, dim=-1) + 1)
    x = torch.randn(4, 6)
    gjit.mark_dynamic(x, 0, min=0)
    run_compiled(cm, x)
    empty = torch.randn(0, 6)
    out, _ = run_compiled(cm, empty)
    assert_same(out, torch.softmax(empty, dim=-1) + 1)
    assert gjit.stats()["compiles"] == 2


def test_floor_division_of_a_size_its_range_keeps_nonnegative_is_kernel_math():
    """(s0 - 20) // 3 with s0 >= 20 (the entry's range, which its guard checks): the truncating
    division kernels print is exact there, so the add is a kernel, not an extern; a negative
    numerator (tests/test_never_crash.py SCALAR_OPERANDS) stays an extern."""
    cm = gjit.compile(lambda x: x + (x.shape[0] - 20) // 3)
    for rows in (20, 23, 41):
        x = torch.randn(rows, 4)
        gjit.mark_dynamic(x, 0, min=20)
        out, _ = run_compiled(cm, x)
        assert_same(out, x + (rows - 20) // 3)
        assert not gjit.explain(cm, x).externs
    assert len(cm.entries) == 1


class ConvGroupNorm(torch.nn.Module):
    """A convolution's output size ((h - 3) // 2 + 1) * ((w - 3) // 2 + 1) as group_norm's HxW
    operand and as the sizes of a flattening view."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, stride=2)
        self.norm = torch.nn.GroupNorm(2, 8)

    def forward(self, x):
        y = self.norm(self.conv(x))
        return y.flatten(2).transpose(1, 2).softmax(-1)


def test_a_convolutions_dynamic_output_size_does_not_make_an_extern():
    torch.manual_seed(0)
    model = ConvGroupNorm().eval()
    cm = gjit.compile(model)
    for h, w in ((16, 16), (21, 13), (9, 30)):
        x = torch.randn(2, 3, h, w)
        with torch.no_grad():
            out, _ = run_compiled(cm, x)
            assert max_rel_err(out, model(x)) < 1e-5
        externs = [e.op for e in gjit.explain(cm, x).externs]
        assert externs == ["aten.convolution.default"], externs
    assert len(cm.entries) == 1


@torch.library.custom_op("gjit_test::slow_when_dynamic", mutates_args=())
def slow_when_dynamic(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    return x * 2


@slow_when_dynamic.register_fake
def _(x, dim=1):
    """Symbolic size reasoning gone slow (as Swin's window views): seconds of sympy while `dim`
    is dynamic."""
    if isinstance(x.shape[dim], torch.SymInt):
        n, k = x.shape[dim].node.expr, 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            k += 1
            sympy.expand((n + k) ** 12)  # a new expression each time: sympy's cache does not answer
    return torch.empty_like(x)


def test_an_export_past_its_budget_exports_the_batch_dims_only(caplog):
    from gjit.capture.export_budget import mode_stacks

    stacks, alarm = mode_stacks(), signal.getsignal(signal.SIGALRM)
    cm = gjit.compile(lambda x: slow_when_dynamic(x.sin()) + 1)
    start = time.monotonic()
    with gjit.config.scope(dynamic_export_budget=1.0), caplog.at_level(logging.WARNING, "gjit.capture"):
        for shape in ((4, 6), (5, 6), (3, 7)):
            x = torch.randn(shape)
            out, _ = run_compiled(cm, x)
            assert_same(out, x.sin() * 2 + 1)
    assert time.monotonic() - start < 20  # the 30 s export was cut short
    warnings = [r.getMessage() for r in caplog.records if "dynamic_export_budget" in r.getMessage()]
    assert len(warnings) == 1 and "only the batch dims (dim 0) dynamic" in warnings[0], warnings
    assert gjit.stats()["dynamic_exports_abandoned"] == 1
    # (4, 6) and (5, 6) share the batch-dynamic entry; (3, 7) gets one of its own, static in dim 1
    assert len(cm.entries) == 2
    assert [[d.split(" = ")[0] for d in e.guards.dynamic_dims] for e in cm.entries] == [["x.size(0)"]] * 2
    assert mode_stacks() == stacks  # nothing left on torch's mode stacks
    # the process's SIGALRM handler back, and no timer left running
    assert signal.getsignal(signal.SIGALRM) is alarm and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_an_export_slow_in_its_batch_dim_too_is_static_from_then_on(caplog):
    cm = gjit.compile(lambda x: slow_when_dynamic(x.sin(), 0) + 1)
    with gjit.config.scope(dynamic_export_budget=1.0), caplog.at_level(logging.WARNING, "gjit.capture"):
        for shape in ((4, 6), (5, 6), (6, 7)):
            x = torch.randn(shape)
            out, _ = run_compiled(cm, x)
            assert_same(out, x.sin() * 2 + 1)
    # one abandonment: the batch-dynamic export ran past the budget too, and later compiles are
    # static without trying either again
    assert gjit.stats()["dynamic_exports_abandoned"] == 1
    assert sum("ran past" in r.getMessage() for r in caplog.records) == 2, caplog.text
    assert cm.narrowed == "static" and len(cm.entries) == 3
    assert all(not e.guards.dynamic_dims for e in cm.entries)


def test_a_static_callable_keeps_the_dims_the_user_marked():
    cm = gjit.compile(lambda x: slow_when_dynamic(x.sin(), 0) + 1)
    with gjit.config.scope(dynamic_export_budget=1.0):
        for cols in (6, 7, 8):
            x = torch.randn(4, cols)
            gjit.mark_dynamic(x, 1)
            out, _ = run_compiled(cm, x)
            assert_same(out, x.sin() * 2 + 1)
    # the first entry is static (its export ran past the budget twice); the next keeps the mark
    assert cm.narrowed == "static" and len(cm.entries) == 2
    assert [[d.split(" = ")[0] for d in e.guards.dynamic_dims] for e in cm.entries] == [[], ["x.size(1)"]]


@torch.library.custom_op("gjit_test::slow_then_wrapped", mutates_args=())
def slow_then_wrapped(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@slow_then_wrapped.register_fake
def _(x):
    """Slow symbolic reasoning inside code that turns any exception into its own."""
    try:
        slow_when_dynamic(x, 1)
    except BaseException as e:
        raise RuntimeError("a failure of its own") from e
    return torch.empty_like(x)


def test_an_interruption_another_exception_carries_still_narrows():
    cm = gjit.compile(lambda x: slow_then_wrapped(x.sin()) + 1)
    with gjit.config.scope(dynamic_export_budget=1.0):
        for rows in (4, 5):
            x = torch.randn(rows, 6)
            out, _ = run_compiled(cm, x)
            assert_same(out, x.sin() * 2 + 1)
    assert cm.narrowed == "batch" and len(cm.entries) == 1
    assert gjit.stats()["dynamic_exports_abandoned"] == 1


def test_batch_dims_keep_marks_kv_lengths_and_int_inputs():
    from gjit.guards.policy import batch_dims

    marked, cache = torch.randn(2, 3, 4), torch.randn(2, 4, 5, 8)
    gjit.mark_dynamic(marked, 2)
    flat = [marked, 7, cache]
    free = (None, None)
    dims = {0: {0: free, 1: free, 2: (2, None)}, 1: {}, 2: {0: free, 1: free, 2: (1, None)}}
    expected = {0: {0: free, 2: (2, None)}, 1: {}, 2: {0: free, 2: (1, None)}}
    assert batch_dims(dims, flat, keep={(2, 2)}) == expected


def slow_program(x):
    return slow_when_dynamic(x.sin()) + 1


def test_an_export_past_its_budget_leaves_a_hint_for_the_next_process(tmp_path, caplog):
    with gjit.config.scope(cache=True, cache_dir=str(tmp_path), dynamic_export_budget=1.0):
        run_compiled(gjit.compile(slow_program), torch.randn(4, 6))
        assert gjit.stats()["dynamic_exports_abandoned"] == 1
        # a new callable of the same function, as a new process makes: the on-disk hint says to
        # export the batch dims only, so no export runs into the budget again
        second = gjit.compile(slow_program)
        with caplog.at_level(logging.WARNING, "gjit.capture"):
            x = torch.randn(5, 6)
            out, _ = run_compiled(second, x)
    assert_same(out, x.sin() * 2 + 1)
    assert gjit.stats()["dynamic_exports_abandoned"] == 1
    assert "on-disk hint" in caplog.text
    assert [d.split(" = ")[0] for d in second.entries[0].guards.dynamic_dims] == ["x.size(0)"]


def test_an_interrupted_exports_modes_are_taken_off_torchs_stacks():
    from torch.overrides import TorchFunctionMode

    from gjit.capture.export_budget import mode_stacks, restore_mode_stacks

    before = mode_stacks()
    TorchFunctionMode().__enter__()  # an __exit__ the interruption skipped
    assert mode_stacks() != before
    restore_mode_stacks(before)
    assert mode_stacks() == before
    assert torch.ones(2).sum().item() == 2


def test_an_export_budget_times_with_the_main_threads_own_signal_and_puts_it_back(caplog):
    """The budget reads the exporting thread's own stack from a SIGALRM handler (a thread that
    walks another's frames can crash CPython 3.11). The handler and the timer are the process's
    again after an export, and where the process has its own, or the export runs in another
    thread, there is no budget: said once, nothing of the process's touched."""
    from gjit.capture import export_budget

    alarm = signal.getsignal(signal.SIGALRM)
    with export_budget.export_budget(1.0):
        assert signal.getsignal(signal.SIGALRM) is not alarm
        assert signal.getitimer(signal.ITIMER_REAL)[1] == export_budget.POLL
    assert signal.getsignal(signal.SIGALRM) is alarm and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)

    def own(signum, frame):
        raise AssertionError("the process's own handler ran")

    export_budget._told.clear()
    with caplog.at_level(logging.INFO, "gjit.capture"):
        signal.signal(signal.SIGALRM, own)
        try:
            for _ in range(2):
                with export_budget.export_budget(1.0):
                    assert signal.getsignal(signal.SIGALRM) is own
                    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
        finally:
            signal.signal(signal.SIGALRM, alarm)
        seen = []
        thread = threading.Thread(target=lambda: seen.append(export_budget.no_timer()))
        thread.start()
        thread.join()
    assert seen and "main thread" in seen[0]
    told = [r.getMessage() for r in caplog.records if "no time budget" in r.getMessage()]
    assert len(told) == 1 and "SIGALRM handler of its own" in told[0], told
