"""Indexing as indirect loads inside kernels; out-of-range indices are a clear error in debug mode."""

import pytest
import torch
import torch.nn.functional as F

import gjit
from helpers import check, run_compiled

pytestmark = pytest.mark.cpu

X = torch.randn(4, 6, 10)
CASES = {
    "embedding": (lambda w, i: F.embedding(i, w) * 2, (torch.randn(10, 8), torch.randint(0, 10, (3, 5)))),
    "embedding_then_layer_norm": (
        lambda w, i: F.layer_norm(F.embedding(i, w), (8,)),
        (torch.randn(10, 8), torch.randint(0, 10, (2, 7))),
    ),
    "index_select": (lambda x, i: x.index_select(1, i).sin(), (X, torch.tensor([0, 5, 2, 2]))),
    "index_select_transposed": (lambda x, i: x.transpose(0, 2).index_select(0, i), (X, torch.tensor([9, 0]))),
    "gather": (lambda x, i: x.gather(2, i) + 1, (X, torch.randint(0, 10, (4, 6, 3)))),
    "advanced_two_tensors": (
        lambda x, i, j: x[i, :, j] * 3,
        (X, torch.tensor([0, -1, 2]), torch.tensor([[1], [9]])),
    ),
    "advanced_one_tensor": (lambda x, i: x[:, i], (X, torch.tensor([[0, 5], [3, -2]]))),
    "advanced_int32": (lambda x, i: x[i], (X, torch.tensor([3, 0], dtype=torch.int32))),
    "where_with_mask": (lambda x: torch.where(x > 0, x, torch.zeros_like(x)), (X,)),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_indexing_is_one_kernel(case):
    fn, args = CASES[case]
    cm = check(fn, *args, kernels=1)
    assert gjit.explain(cm, *args).externs == []


def test_one_element_index_fused_with_a_reduction():
    """An index read at a constant offset is a scalar: the indexed load is broadcast to the mask
    (was "Mask argument cannot be block type if pointer argument is not a block")."""
    x, i = torch.randn(5), torch.tensor([3])
    check(lambda x, i: (torch.gather(x, 0, i), x[i] * 2, x.sum(0)), x, i)
    check(lambda x, i: torch.gather(x, 0, i), x, i, kernels=1)


@pytest.mark.parametrize("mode", ["persistent", "looped"])
def test_cross_entropy_gathers_from_the_logits_not_a_written_log_softmax(mode):
    """nll_loss gathers log_softmax at the labels: the gather recomputes log_softmax there from the
    logits and the row's max and sum, so the full log_softmax is never written and the logits are
    read once (a looped kernel folds the sum into the max's pass)."""
    x, y = torch.randn(8, 40) * 3, torch.randint(0, 40, (8,))
    y[3] = -100  # ignored: the gather must not read at -100
    with gjit.config.scope(reduction=mode, rblock=16):
        # mean: the row statistics, then the mean over rows; past the ideal, per row, the max
        # and sum written and read and the gathered logit. none: one kernel; the gathered logit
        for reduction, kernels, extra_per_row in (("mean", 2, 5), ("none", 1, 1)):
            fn = lambda x, y, r=reduction: F.cross_entropy(x, y, reduction=r)
            cm = check(fn, x, y, kernels=kernels)
            traffic = gjit.explain(cm, x, y).traffic
            assert traffic.gjit == traffic.ideal + 8 * 4 * extra_per_row, traffic


def test_gathered_nodes_that_use_their_index_are_written_first():
    """A masked (cat) or index-valued (arange) node cannot be recomputed at gathered indices: it
    is written, then gathered."""
    x, i = torch.randn(4, 6), torch.randint(0, 12, (4, 3))
    check(lambda x, i: torch.gather(torch.cat([x, x.cos()], 1) * 2, 1, i), x, i, kernels=2)
    check(lambda x, i: torch.gather(x + torch.arange(6.0), 1, i % 6), x, i, kernels=2)
    check(lambda w, i: F.embedding(i, w.exp() * 2), torch.randn(10, 8), i, kernels=1)  # recomputed


def test_out_of_range_index_is_a_clear_error_in_debug_mode():
    w = torch.randn(10, 8)
    cm = gjit.compile(lambda w, i: F.embedding(i, w) * 2)
    run_compiled(cm, w, torch.tensor([1, 2]))
    with pytest.raises(Exception, match="index out of bounds reading w"):
        run_compiled(cm, w, torch.tensor([1, 12]))
    with pytest.raises(Exception, match="index out of bounds"):
        run_compiled(cm, w, torch.tensor([-1, 3]))
    # a gathered broadcast value is recomputed from a read that does not use the index: the check
    # goes with that read; a value made only of constants is written first, then gathered
    c, i = torch.randn(6, 1), torch.tensor([[0, 20]] * 6)
    for fn in (lambda c, i: torch.gather(c.expand(6, 9) * 2, 1, i), lambda c, i: torch.gather(
            torch.ones(6, 9) * 2, 1, i)):  # fmt: skip
        run_compiled(fn, c, i.clamp(max=8))
        with pytest.raises(Exception, match="index out of bounds"):
            run_compiled(fn, c, i)


def test_boolean_mask_indexing_is_an_extern_and_correct():
    """A boolean mask gives a data-dependent size: the indexing is an extern, the rest a kernel."""
    x = torch.randn(5, 4)
    cm = check(lambda x, m: x[m] * 2, x, x > 0, kernels=1)
    assert [e.reason for e in gjit.explain(cm, x, x > 0).externs] == [
        "lowering refused: boolean mask indexing has a data-dependent size"
    ]


def test_writes_through_indices_are_kernels():
    """index_put: a copy, a scatter kernel into it, the add after (tests/test_scatters.py has the rest)."""

    def f(x, i, v):
        return x.index_put([i], v) + 1

    args = (torch.randn(6, 3), torch.tensor([0, 4]), torch.randn(2, 3))
    cm = check(f, *args, kernels=3)
    report = gjit.explain(cm, *args)
    assert not report.externs and sum(k.name.startswith("gjit_scatter_") for k in report.kernels) == 1


def test_indexing_kernels_compile_for_sm90():
    from gjit.codegen.toolchain.compile_only import compile_kernel

    for case in ("embedding_then_layer_norm", "gather", "advanced_two_tensors"):
        fn, args = CASES[case]
        cm = check(fn, *args)  # debug mode: the kernels carry device-side bounds asserts
        program = cm.entries[-1].program
        for kernel in program.kernels:
            binary = compile_kernel(kernel, program.graph.kernel_paths[kernel.name])
            assert ".target sm_90" in binary.asm["ptx"], kernel.name
