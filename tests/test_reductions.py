"""Reductions and normalizations: each one kernel, persistent and looped, against eager on
random data including negative, large-magnitude and NaN inputs, odd sizes and low precision."""

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F

import gjit
from gjit.codegen.toolchain.compile_only import compile_kernel
from helpers import check, check_against_float64

pytestmark = pytest.mark.cpu

MODES = ["persistent", "looped"]


def rms_norm(x, weight, eps=1e-6):  # as written in Llama
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps)).to(x.dtype)


REDUCTIONS = {
    "sum_last": lambda x: x.sum(-1),
    "sum_first": lambda x: x.sum(0),
    "sum_middle_keepdim": lambda x: x.sum(1, keepdim=True),
    "sum_several": lambda x: x.sum((0, 2)),
    "sum_all": lambda x: x.sum(),
    "mean_last": lambda x: x.mean(-1),
    "mean_first_keepdim": lambda x: x.mean(0, keepdim=True),
    "amax_middle": lambda x: x.amax(1),
    "amin_last_keepdim": lambda x: x.amin(-1, keepdim=True),
    "prod_last": lambda x: (x * 0.5).prod(-1),
    "var_last": lambda x: x.var(-1),
    "var_correction0_several": lambda x: x.var((0, 1), correction=0),
    "std_last": lambda x: x.std(-1),
    "var_mean": lambda x: torch.var_mean(x, -1, correction=2),
    "any": lambda x: (x > 1).any(-1),
    "all": lambda x: (x > -2).all(1),
    "logsumexp": lambda x: torch.logsumexp(x, -1),
    "center": lambda x: x - x.mean(-1, keepdim=True),
    "softmax_last": lambda x: F.softmax(x, -1),
    "softmax_first": lambda x: F.softmax(x, 0),
    "log_softmax_middle": lambda x: F.log_softmax(x, 1),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(REDUCTIONS), ids=list(REDUCTIONS))
def test_reduction(name, mode):
    fn = REDUCTIONS[name]
    x = torch.randn(3, 5, 7) * 4
    with gjit.config.scope(reduction=mode, rblock=4):
        check(fn, x)
        check(fn, x.transpose(0, 2))  # non-contiguous input


@pytest.mark.parametrize("mode", MODES)
def test_nan_and_large_inputs(mode):
    x = torch.randn(4, 9) * 1e4
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    x[3, :] = -float("inf")
    with gjit.config.scope(reduction=mode, rblock=4):
        for fn in (
            lambda t: t.sum(-1),
            lambda t: t.amax(-1),
            lambda t: t.amin(0),
            lambda t: F.softmax(t, -1),
            lambda t: F.log_softmax(t, -1),
            lambda t: t.mean(-1),
            lambda t: t.var(-1),
        ):
            check(fn, x)


def test_softmax_is_stable_for_large_inputs():
    x = torch.randn(4, 33) * 1e3 + 1e4
    check(lambda t: F.softmax(t, -1), x, kernels=1)


@pytest.mark.parametrize("size", [1, 3, 127, 1000, 4097], ids=str)
def test_odd_sizes(size):
    x = torch.randn(2, size)
    check(lambda t: (t.sum(-1), t.amax(-1), F.softmax(t, -1)), x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_low_precision_accumulates_in_float32(dtype, mode):
    x = (torch.randn(4, 300) * 3).to(dtype)
    with gjit.config.scope(reduction=mode):
        check(lambda t: (t.sum(-1), t.mean(-1), F.softmax(t, -1), F.layer_norm(t, (300,))), x)


@pytest.mark.parametrize("mode", MODES)
def test_normalizations_are_one_kernel(mode):
    x, w, b = torch.randn(2, 6, 40), torch.randn(40), torch.randn(40)
    with gjit.config.scope(reduction=mode, rblock=16):
        check(lambda t: F.softmax(t, -1), x, kernels=1)
        check(lambda t: F.log_softmax(t, -1), x, kernels=1)
        check(lambda t, w, b: F.layer_norm(t, (40,), w, b), x, w, b, kernels=1)
        check(rms_norm, x, w, kernels=1)
        check(lambda t, r, w, b: F.gelu(F.layer_norm(t + r, (40,), w, b)), x, x.flip(0), w, b, kernels=1)
        check(lambda t: t - t.mean(-1, keepdim=True), x, kernels=1)


def test_mean_and_variance_share_one_kernel():
    x = torch.randn(5, 64)
    cm = check(lambda t: torch.var_mean(t, -1), x, kernels=1)
    source = gjit.explain(cm, x).kernels[0].source
    assert source.count("tl.load(") == 1  # persistent: the row is read once for both moments


def test_layer_norm_mean_and_rstd_outputs():
    x, w, b = torch.randn(3, 4, 16), torch.randn(16), torch.randn(16)
    check(lambda t, w, b: torch.ops.aten.native_layer_norm.default(t, [16], w, b, 1e-5), x, w, b, kernels=1)


def test_reduction_kernels_compile_for_sm90():
    x = torch.randn(4, 300)
    for mode in MODES:
        with gjit.config.scope(reduction=mode):
            cm = check(lambda t: (F.softmax(t, -1), t.amax(-1), t.var(-1), (t > 0).any(-1)), x)
        program = cm.entries[-1].program
        for kernel in program.kernels:
            binary = compile_kernel(kernel, program.graph.kernel_paths[kernel.name])
            assert ".target sm_90" in binary.asm["ptx"]


ONE_PASS_LESS = {  # name -> (fn, whether a full row is written: a last pass over the row)
    "softmax": (lambda x: F.softmax(x, -1), True),
    "log_softmax": (lambda x: F.log_softmax(x, -1), True),
    "softmax_by_hand": (lambda x: (x - x.amax(-1, keepdim=True)).exp().sum(-1), False),
    "var": (lambda x: x.var(-1), False),
    "variance_by_hand": (lambda x: ((x - x.mean(-1, keepdim=True)) ** 2).mean(-1), False),
    "layer_norm": (lambda x: F.layer_norm(x, x.shape[-1:]), True),
}


@pytest.mark.parametrize("name", list(ONE_PASS_LESS))
def test_looped_rows_fold_the_second_level_into_the_first_pass(name):
    """Softmax's sum (online softmax) and a variance's sum of squares (Welford) are accumulated
    in the pass that computes the max or the sum, so a looped kernel reads the row once for both."""
    fn, writes_rows = ONE_PASS_LESS[name]
    x = torch.randn(5, 37) * 3 + 50
    with gjit.config.scope(reduction="looped", rblock=8):
        cm = check(fn, x, kernels=1)
        report = gjit.explain(cm, x)
    assert "in the pass before" in report.kernels[0].source
    passes = 2 if writes_rows else 1
    assert report.kernels[0].passes == passes
    assert report.traffic.gjit == report.traffic.ideal + (passes - 1) * x.numel() * 4, report.traffic


def edge_rows(cols: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(8, cols, dtype=dtype) * 5
    x[0, : cols // 2 + 1] = -float("inf")  # lanes see only -inf in the first chunks, then finite values
    x[1, -1] = 60.0  # the row's max in the last chunk: every lane's sum is rescaled to it
    x[2] = -float("inf")  # only -inf: NaN, as exp(x - max) is in eager
    x[3, 4] = float("inf")
    x[4, cols // 2] = float("nan")
    x[5, ::2] = -float("inf")
    x[6] = 2.0 ** (100 if dtype == torch.float32 else 600)  # constant, its square overflows: variance 0
    x[7] += 1e4  # a large mean: each lane's Welford mean is kept small, relative to its first element
    return x, torch.ones(cols, cols, dtype=torch.bool).triu(1)[:8]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_online_softmax_and_welford_at_edge_values(dtype):
    """Each lane's running max starts at -inf and grows chunk by chunk; NaN, inf and all -inf rows
    give what eager's two passes give."""
    # lanes with several elements; lanes with none; long rows (CUDA C: several per thread)
    for cols, rblock in ((19, 4), (19, 32), (1000, 64)):
        x, causal = edge_rows(cols, dtype)
        with gjit.config.scope(reduction="looped", rblock=rblock):
            check(
                lambda t, m: (
                    F.softmax(t, -1),
                    F.log_softmax(t, -1),
                    F.softmax(t.masked_fill(m, -float("inf")), -1),
                    (t - t.amax(-1, keepdim=True)).exp().sum(-1),
                    t.var(-1),
                    # not rows 6 (eager squares it: NaN) and 7 (x - mean is off by the mean's ulp)
                    F.layer_norm(t[:6], t.shape[-1:]),
                ),
                x,
                causal,
            )


def test_welford_only_for_the_row_mean_and_without_overflow():
    """Review finds: a sum of squares around another per-row value (the max) is not folded (an inf
    element would make Welford's lane NaN where eager's square is inf), and two finite values whose
    difference overflows give eager's inf variance, not NaN."""
    x = torch.randn(2, 13)
    x[0, 2] = -float("inf")
    big = torch.zeros(2, 40)
    big[:, 0], big[:, 20] = 2e38, -2e38
    with gjit.config.scope(reduction="looped", rblock=4):
        check(lambda t: ((t - t.amax(-1, keepdim=True)) ** 2).sum(-1), x)
        check(lambda t: t.var(-1), big)  # (eager's layer_norm of it is NaN: not compared)


def test_float64_std_and_norm_build():
    """Review find: sqrt was Triton's sqrt_rn, which takes float32 only: a float64 std or norm did
    not build (tests/test_pointwise_ops.py builds a float64 sqrt for sm_90)."""
    x = torch.rand(5, 7, dtype=torch.float64)
    with gjit.config.scope(reduction="looped", rblock=4):
        check(lambda t: (t.std(-1), torch.linalg.vector_norm(t, dim=-1), t.sqrt()), x)


ARG = {
    "argmax_last": lambda x: x.argmax(-1),
    "argmin_middle": lambda x: x.argmin(1),
    "argmax_all": lambda x: x.argmax(),
    "argmax_first_keepdim": lambda x: x.argmax(0, keepdim=True),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(ARG), ids=list(ARG))
def test_argmax_argmin_tie_break_and_nan_like_eager(name, mode):
    x = torch.randint(-3, 3, (4, 6, 10)).float()  # many ties: the first index wins
    x[1, 2, 3] = float("nan")  # NaN counts as the max (and the min)
    with gjit.config.scope(reduction=mode, rblock=4):
        check(ARG[name], x, kernels=1)
        check(ARG[name], torch.randint(-3, 3, (4, 6, 10)))  # integers


MAX_DIM = {
    "max_last": lambda x: torch.max(x, -1),
    "min_middle_keepdim": lambda x: torch.min(x, 1, keepdim=True),
    "max_first_values_and_indices_used": lambda x: (x.max(0).values * 2, x.max(0).indices + 1),
    "max_of_half": lambda x: torch.max(x.half(), 2),
    "min_transposed": lambda x: torch.min(x.transpose(0, 2), 0),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(MAX_DIM), ids=list(MAX_DIM))
def test_max_min_with_a_dim_are_one_kernel_for_values_and_indices(name, mode):
    x = torch.randint(-3, 3, (4, 6, 10)).float()  # many ties: the first index wins
    x[1, 2, 3] = float("nan")  # NaN is the max and the min, at its own index
    with gjit.config.scope(reduction=mode, rblock=4):
        check(MAX_DIM[name], x, kernels=1)
        check(MAX_DIM[name], torch.randint(-3, 3, (4, 6, 10)))  # integers


@pytest.mark.parametrize("mode", MODES)
def test_bool_and_integer_max_min(mode):
    """amax/amin of bools (identities False/True, was a torch.iinfo(bool) error), and integer
    math on an integer max: rows past xnumel hold no INT_MIN to overflow in debug mode."""
    b = torch.rand(3, 5, 7) > 0.5
    i = torch.randint(-4, 5, (2, 3, 5), dtype=torch.int32)
    with gjit.config.scope(reduction=mode, rblock=4):
        check(lambda b: (b.amax(-1), b.amin(0, keepdim=True), torch.max(b, 1).values), b)
        check(lambda i: ((i - i.amax(0, keepdim=True)).exp(), i - i.amin(-1, keepdim=True)), i)


@pytest.mark.parametrize("mode", MODES)
def test_max_min_of_everything_and_reductions_of_a_0d_tensor(mode):
    """max()/min() without a dim are one reduction over every element (NaN wins, as in eager);
    a 0-d tensor is its own sum, max, ... along dim 0 or -1, and its argmax is 0."""
    x = torch.randn(6, 300)
    x[2, 7] = float("nan")
    b = torch.rand(4, 5) > 0.5
    i = torch.randint(-9, 9, (3, 70), dtype=torch.int32)
    s = torch.tensor(-1.5)
    with gjit.config.scope(reduction=mode, rblock=32):
        check(lambda x: (x.max(), x.min(), x[:, :5].max() * 2), x)
        check(lambda b, i: (b.max(), b.min(), i.max(), i.min()), b, i)
        check(
            lambda s: (
                s.sum(),
                s.amax(0),
                s.prod(-1, keepdim=True),
                s.argmax(),
                s.argmin(0),
                torch.max(s, 0),
                s.max(),
                s.sum(dtype=torch.float64),
                (s > 0).sum(0),
            ),
            s,
        )


@pytest.mark.parametrize("mode", MODES)
def test_any_all_of_nothing(mode):
    """any() over an empty dim is False, all() is True (an empty row's max, INT_MIN, read as True)."""
    x = torch.randn(3, 0)
    with gjit.config.scope(reduction=mode):
        check(lambda x: (x.any(-1), x.all(-1), x.any(), x.all(), (x > 0).all(1, keepdim=True)), x)


@pytest.mark.parametrize("mode", MODES)
def test_reduction_of_an_empty_reshape(mode):
    """The digits of a reshape of an empty tensor keep depending on the index, so the load stays
    masked (a constant offset was an unmasked read of an empty buffer: a segfault)."""
    with gjit.config.scope(reduction=mode):
        check(lambda x: (x.flatten(0).sum(0), x.reshape(-1).mean(0, keepdim=True)), torch.randn(2, 0))


@pytest.mark.parametrize("mode", MODES)
def test_reduction_over_nothing_of_an_expanded_input(mode):
    """A stride-0 input has a constant offset: with no element to reduce no lane is active, so
    its load stays masked (an unmasked read of the empty input was a segfault)."""
    x, y = torch.randn(0), torch.randn(1).expand(0)
    with gjit.config.scope(reduction=mode):
        check(lambda x, y: ((x - y.abs()).sum(0), (x * y).std(0, keepdim=True)), x, y)


def test_per_row_value_of_a_reduction_region_is_stored_per_row():
    """`eq` is stored and also read by the sum through a stride-0 expand: its value is [XBLOCK, 1]
    (was computed under the row-and-lane mask as [XBLOCK, RBLOCK], which its store rejected)."""

    def fn(x, y):
        eq = (x == y).expand(2, 1, 1)
        return eq.sum(0, keepdim=True), eq

    check(fn, torch.randn(1, 1), torch.randn(()))


def test_modeled_bytes_of_persistent_normalizations_are_ideal():
    x, w, b = torch.randn(16, 128), torch.randn(128), torch.randn(128)
    for fn, args in (
        (lambda t: F.softmax(t, -1), (x,)),
        (lambda t, w, b: F.layer_norm(t, (128,), w, b), (x, w, b)),
        (rms_norm, (x, w)),
    ):
        traffic = gjit.explain(fn, *args).traffic
        assert traffic.gjit == traffic.ideal, traffic
        assert traffic.gjit <= traffic.eager, traffic


POOLS = {
    "3x3_stride2_pad1": lambda x: F.max_pool2d(x, 3, 2, 1),
    "2x2_after_relu": lambda x: F.max_pool2d(x.relu() * 2, 2),
    "ceil_mode": lambda x: F.max_pool2d(x, 3, 2, 1, ceil_mode=True),
    "rect_dilated": lambda x: F.max_pool2d(x, (2, 3), (1, 2), (1, 0), dilation=(2, 1)),
    "avg_3x3_stride2_pad1": lambda x: F.avg_pool2d(x, 3, 2, 1),
    "avg_ceil_without_pad": lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False),
    "avg_ceil_with_pad": lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True),
    "avg_rect_divisor": lambda x: F.avg_pool2d(x.relu(), (2, 3), (1, 2), (1, 0), divisor_override=5),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pool", list(POOLS))
def test_pooling_is_one_kernel_with_its_prologue(pool, mode):
    """A window reduction over (kh, kw): max reads -inf in the padding, average divides by eager's
    count (the window clipped to the padded input or to the input); NaN propagates; one kernel
    at several sizes (one entry), 3-D and channels-last inputs, half precision."""
    fn = POOLS[pool]
    with gjit.config.scope(reduction=mode):
        cm = gjit.compile(fn)
        for shape in [(2, 3, 9, 11), (3, 4, 10, 7)]:
            x = torch.randn(shape) * 3
            x.view(-1)[5] = float("nan")
            check(cm, x, kernels=1)
        assert len(cm.entries) == 1
        check(fn, torch.randn(3, 9, 11), kernels=1)
        check(fn, torch.randn(2, 3, 9, 11).to(memory_format=torch.channels_last), kernels=1)
        check(fn, torch.randn(2, 3, 9, 11, dtype=torch.float16), kernels=1)


# the persistent mode (14 s) in CI's sweep step
@pytest.mark.parametrize("mode", [pytest.param("persistent", marks=pytest.mark.slow), "looped"])
def test_3d_pooling_is_a_window_reduction_too(mode):
    """max_pool3d and avg_pool3d: the same window reduction over (kd, kh, kw); ceil mode,
    padding, dilation, count_include_pad, NaN, dynamic sizes in one entry."""
    fns = [
        lambda x: F.max_pool3d(x, 3, 2, 1),
        lambda x: F.max_pool3d(x, (2, 3, 2), (1, 2, 2), (1, 0, 1), dilation=(2, 1, 1), ceil_mode=True),
        lambda x: F.avg_pool3d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False),
        lambda x: F.avg_pool3d(x.relu(), (2, 3, 2), (1, 2, 1), (1, 1, 0), divisor_override=7),
    ]
    with gjit.config.scope(reduction=mode, rblock=4):
        for fn in fns:
            cm = gjit.compile(fn)
            for shape in [(2, 3, 6, 7, 5), (3, 2, 8, 9, 7)]:  # ceil mode guards the parity
                x = torch.randn(shape)
                x.view(-1)[7] = float("nan")
                check(cm, x, kernels=1)
            assert len(cm.entries) == 1
            check(fn, torch.randn(3, 6, 7, 5, dtype=torch.float64), kernels=1)  # no 3-D half pools on CPU


@pytest.mark.parametrize("mode", MODES)
def test_adaptive_pooling_has_a_window_per_output_element(mode):
    """Adaptive average and max pooling (and area interpolation) in 1-D, 2-D and 3-D: uneven
    splits give overlapping windows of two lengths; NaN propagates through the max."""
    x = torch.randn(2, 3, 7, 10)
    x[0, 1, 3, 4] = float("nan")
    z = torch.randn(1, 2, 5, 6, 7)
    with gjit.config.scope(reduction=mode, rblock=4):
        for fn, arg in [
            (lambda x: (F.adaptive_avg_pool2d(x, (3, 4)), F.adaptive_max_pool2d(x, 3)), x),
            (lambda x: F.interpolate(x, size=(4, 6), mode="area") * 2, x),
            (lambda x: (F.adaptive_avg_pool1d(x[0], 4), F.adaptive_max_pool1d(x[0], 6)), x),
            (lambda z: (F.adaptive_avg_pool3d(z, (2, 3, 4)), F.adaptive_max_pool3d(z, 2)), z),
            (lambda x: F.adaptive_avg_pool2d(x.half(), (7, 1)) + 1, x),
        ]:
            cm = check(fn, arg)
            assert not gjit.explain(cm, arg).externs
        cm = gjit.compile(lambda x: (F.adaptive_avg_pool2d(x, (3, 4)), F.adaptive_max_pool2d(x, 3)))
        for shape in [(2, 3, 7, 10), (3, 2, 9, 4), (2, 2, 3, 5)]:  # dynamic sizes: one entry
            check(cm, torch.randn(shape))
        assert len(cm.entries) == 1


def test_a_cached_max_pool_with_unused_indices_explains_itself(tmp_path):
    """A program served from the disk cache keeps a getitem of the pool's indices that nothing
    reads: lowering it again (explain, the dump) must still see them unused."""
    x = torch.randn(2, 3, 8, 9)
    fn = lambda x: (F.max_pool2d(x, 2), F.adaptive_max_pool2d(x, 3))  # noqa: E731
    with gjit.config.scope(cache=True, cache_dir=str(tmp_path)):
        for served in (False, True):  # compiled, then served from the disk cache
            gjit.reset()
            cm = check(fn, x)
            assert ("codegen" not in cm.entries[0].program.timings) == served
            report = gjit.explain(cm, x)
            assert len(report.kernels) == 2 and not report.externs


def test_max_pool2d_with_its_indices_used_is_an_extern():
    """eager's indices pick the last NaN of a window, an argmax the first: not lowered."""
    x = torch.randn(2, 3, 8, 8)
    cm = check(lambda t: F.max_pool2d(t, 2, return_indices=True), x)
    assert [e.op for e in gjit.explain(cm, x).externs] == ["aten.max_pool2d_with_indices.default"]


@pytest.mark.parametrize("mode", MODES)
def test_group_norm_statistics_per_group_of_channels(mode):
    """native_group_norm's three outputs (normalized, mean, rstd) with and without affine
    parameters, 3-D and 4-D, NaN in one group, half precision, one entry over two sizes."""
    gn = torch.ops.aten.native_group_norm.default

    def full(x, w, b, groups):
        n, c = x.shape[:2]
        return gn(x, w, b, n, c, x[0, 0].numel(), groups, 1e-5)

    with gjit.config.scope(reduction=mode):
        cm = gjit.compile(lambda x, w, b: full(x, w, b, 2))
        for shape in [(2, 4, 5, 6), (3, 4, 7, 3)]:
            x = torch.randn(shape) * 2 + 1
            x[1, 3, 0, 0] = float("nan")
            check(cm, x, torch.randn(4), torch.randn(4))
        assert len(cm.entries) == 1
        check(lambda x: F.silu(F.group_norm(x, 3)), torch.randn(2, 6, 10), kernels=2)
        check(lambda x: F.group_norm(x, 4), torch.randn(2, 8, 3, 3, dtype=torch.float16))


@pytest.mark.parametrize("ord", [2, 1, float("inf"), float("-inf")])
def test_vector_norm(ord):
    x = torch.randn(4, 5, 6)
    check(lambda t: torch.linalg.vector_norm(t, ord, dim=(-1, -2)), x, kernels=1)
    check(lambda t: torch.linalg.vector_norm(t, ord, dim=1, keepdim=True), x.half(), kernels=1)
    check(lambda t: F.normalize(t, p=ord, dim=-1), x, kernels=1)  # the norm and the division: one kernel
    x[0, 0, 0] = float("nan")
    check(lambda t: torch.linalg.vector_norm(t, ord), x, kernels=1)


@pytest.mark.parametrize("ord", [0, 3, 0.5, -1])
def test_vector_norm_of_other_orders_and_0d(ord):
    """ord 0 counts nonzeros; any other p is (sum |x|**p)**(1/p), as eager; a 0-d tensor is one
    element. Complex norms stay externs."""
    x = torch.randn(4, 5)
    x[1, 2] = 0.0
    check(lambda t: torch.linalg.vector_norm(t, ord, -1), x, kernels=1)
    check(lambda t: torch.linalg.vector_norm(t, ord), torch.tensor(-1.5), kernels=1)
    check(lambda t: torch.linalg.vector_norm(t, ord, dim=0, keepdim=True), x.half(), kernels=1)
    z = torch.randn(4, 5, dtype=torch.complex64)
    cm = check(torch.linalg.vector_norm, z)
    assert [e.op for e in gjit.explain(cm, z).externs] == ["aten.linalg_vector_norm.default"]


TABLE_TILES = {  # shape, fn: the table's tiles (no chunk forced), several chunks and masked tails
    "sum_first_outer": ((301, 45), lambda x: x.sum(0)),
    "mean_middle_outer": ((3, 130, 20), lambda x: x.mean(1)),
    "softmax_first_outer": ((70, 33), lambda x: F.softmax(x, 0)),
    "var_first_outer": ((90, 17), lambda x: x.var(0)),
    "argmax_first_outer": ((77, 19), lambda x: x.argmax(0)),
    "softmax_long_rows": ((3, 4100), lambda x: F.softmax(x, -1)),
    "layer_norm_long_rows": ((2, 2500), lambda x: F.layer_norm(x, (2500,))),
    "sum_all_long": ((5000,), lambda x: x.sum()),
}


@pytest.mark.parametrize("name", list(TABLE_TILES), ids=list(TABLE_TILES))
def test_reductions_in_the_tile_tables_shapes(name):
    """The tile table's kernels (codegen/triton/tiles.py): outer tiles across rows over the kept
    dims, long rows one a program in chunks of 2048; contiguous and transposed inputs, NaN, fp16."""
    shape, fn = TABLE_TILES[name]
    x = torch.randn(*shape) * 3
    x.view(-1)[7] = float("nan")
    cm = check(fn, x)
    walk = "tiles span rows" if "outer" in name else "rows contiguous"
    assert walk in gjit.explain(cm, x).kernels[0].source
    check(fn, x.half())
    if x.dim() == 2:
        check(fn, x.t().contiguous().t())  # the other walk over the same values


def test_tile_table():
    from gjit.codegen.triton.tiles import RowTiles, reduction_tiles
    from gjit.config import CompileOptions

    auto = CompileOptions.from_config(reduction="auto", rblock=0, persistent_max=1024)
    forced = dataclasses.replace(auto, rblock=4)
    persistent = dataclasses.replace(auto, reduction="persistent")
    # outer: wide over the kept dims where there are programs enough, a 32-byte sector at least
    assert reduction_tiles("outer", 2**19, 512, True, True, 4, auto) == RowTiles(128, 4, False, walk="outer")
    assert reduction_tiles("outer", 768, 4096, False, True, 4, auto) == RowTiles(16, 32, False, walk="outer")
    assert reduction_tiles("outer", 768, 4096, False, True, 2, auto) == RowTiles(32, 16, False, walk="outer")
    # a short row in registers: the whole tile across rows (was 16 x 4: half the threads idle)
    assert reduction_tiles("outer", 8192, 4, True, True, 4, auto) == RowTiles(128, 4, True, walk="outer")
    assert reduction_tiles("outer", 2**19, 3, True, True, 4, auto) == RowTiles(128, 4, True, walk="outer")
    assert not reduction_tiles("outer", 2**19, 3, True, False, 4, auto).persistent  # a dynamic row
    assert reduction_tiles("outer", 2**19, 512, True, True, 4, forced).rblock == 4
    forced_persistent = reduction_tiles("outer", 64, 512, True, True, 4, persistent)
    assert forced_persistent == RowTiles(2, 512, True, walk="outer")
    # inner: a row in registers up to persistent_max, then one row a program in 2048-element chunks
    assert reduction_tiles("inner", 4096, 768, True, True, 2, auto) == RowTiles(1, 1024, True)
    assert reduction_tiles("inner", 4096, 100, True, True, 4, auto) == RowTiles(8, 128, True)
    assert reduction_tiles("inner", 4096, 32000, False, True, 4, auto) == RowTiles(1, 2048, False, 8)
    assert reduction_tiles("inner", 4096, 32000, False, True, 4, forced) == RowTiles(256, 4, False)


def swept(cases: dict, slow: set) -> list:
    """The cases' names, those in `slow` (the longest, 10-16 s each) run in CI's sweep step only."""
    return [pytest.param(n, marks=pytest.mark.slow) if n in slow else n for n in cases]


SPLIT = {  # few rows of many elements: partial results of chunks, then their reduction (two kernels)
    "sum_all": ((40000,), lambda x: x.sum()),
    "sum_all_2d": ((200, 300), lambda x: x.sum()),
    "mean_all_3d": ((3, 7, 2000), lambda x: x.mean()),
    "sum_first_tall": ((17000, 8), lambda x: x.sum(0)),
    "amax_several_keepdim": ((60, 3, 300), lambda x: x.amax((0, 2), keepdim=True)),
    "amin_all": ((17000,), lambda x: x.amin()),
    "any": ((40000,), lambda x: (x > 3.5).any()),
    "prod": ((20000,), lambda x: (2.0 ** ((x > 1.4).float() - (x < 0.6).float())).prod()),  # exact
    "int_sum": ((40000,), lambda x: (x * 100).long().sum()),
    "vector_norm": ((40000,), lambda x: torch.linalg.vector_norm(x)),
}


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("name", swept(SPLIT, {"amax_several_keepdim"}), ids=list(SPLIT))
def test_few_long_rows_reduce_in_two_levels(name, dynamic):
    """gjit/lowering/split.py: each chunk's lanes past the row hold the identity; NaN and inf
    propagate through the partials as through one reduction; float64 is the judge of sums (of
    positive elements: a long float32 sum near zero is off by its elements' rounding, not its own)."""
    shape, fn = SPLIT[name]
    x = torch.rand(*shape) + 0.5
    x.view(-1)[x.numel() // 3] = 30.0
    cm, report = check_against_float64(gjit.compile(fn, dynamic=dynamic), x, reference_fn=fn)
    assert len(report.kernels) == 2, report
    assert any("_split" in k.source for k in report.kernels)
    check(fn, x.half())
    y = x.clone()
    y.view(-1)[-1] = float("nan")
    check(fn, y)


def test_a_split_reduction_is_exact_at_other_sizes():
    """The chunk count is fixed at the example size; the chunks' length follows a dynamic row."""
    cm = gjit.compile(lambda x: (x.sum(), x.amax()), dynamic=True)
    for n in (40000, 17, 100003, 16 * 1024 + 1):
        check_against_float64(cm, torch.randn(n), reference_fn=cm.model)


def test_long_rows_split_only_where_there_are_few():
    from gjit.lowering.split import parts

    check(lambda x: F.softmax(x, -1), torch.randn(20, 16500), kernels=1)  # rows enough for levels
    sums = lambda x: x.sum(-1)  # noqa: E731
    _, report = check_against_float64(sums, torch.rand(20, 16500) + 0.5, reference_fn=sums)
    assert len(report.kernels) == 2  # too few rows for one level
    check(lambda x: x.sum(), torch.randn(16000), kernels=1)  # a short row: one program
    check(lambda x: x.argmax(), torch.randn(40000), kernels=1)  # an argmax stays whole
    assert parts(1, 2**24, False) == 1024  # a sum of everything: 1024 chunks of 16384
    assert parts(1, 40000, False) == 16  # chunks of 2048 elements at least
    assert parts(64, 2**16, True) == 32  # a tall sum over the first dim: 4 programs, then 128
    assert parts(256, 2**20, False) == 1  # programs enough for a sum
    assert parts(255, 2**20, False) == 8
    assert parts(16, 2**20, False, one_level=False) == 1  # enough for a softmax's levels
    assert parts(15, 2**20, False, one_level=False) == 128  # 1920 programs: 15 x 64 is under 1024
    assert parts(1, 16383, False) == 1


MIXED = {  # several split reductions of one input in one partial kernel, each with its own identity
    "aminmax": lambda x: torch.aminmax(x),
    "sum_and_amax": lambda x: (x.sum(), x.amax()),
    "amin_and_prod": lambda x: (x.amin(), (x * 0).prod()),
    "min_max_scaling": lambda x: (x - x.min()) / (x.max() - x.min()),
}


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("name", swept(MIXED, {"min_max_scaling"}), ids=list(MIXED))
def test_split_reductions_of_one_input_keep_their_own_identities(name, dynamic):
    """Lanes past the row hold each reduction's own identity (review: a masked value's CSE once
    ignored its fill value, so max took sum's 0 past the row, min took max's -inf); all-negative
    and all-positive data, a row that is no multiple of its chunks."""
    fn = gjit.compile(MIXED[name], dynamic=dynamic)
    for x in (-torch.rand(17001) - 1, torch.rand(17001) + 0.5):
        check(fn, x)


@pytest.mark.parametrize("mode", ["persistent", "looped"])
def test_a_per_row_read_loads_once_a_row(mode):
    """A read inside a row's elements that does not vary along the row (an embedding's token id,
    a gathered row's index) loads [XBLOCK, 1] under the rows' mask: once a row, and the row it
    gathers stays contiguous along the reduced dim. Rows of the last block masked off, a row's id
    reused by another row, and a padded id (0) all as eager."""
    emb, w = torch.randn(50, 40), torch.randn(40)
    ids = torch.randint(0, 50, (7, 5))
    ids[0, 0] = ids[3, 2]
    with gjit.config.scope(reduction=mode, rblock=16 if mode == "looped" else 0):
        cm = check(lambda i, e, g: F.layer_norm(e[i] * 2 + 1, (40,), g), ids, emb, w, kernels=1)
        (kernel,) = gjit.explain(cm, ids, emb, w).kernels
    loads = [ln for ln in kernel.source.splitlines() if "tl.load(" in ln]
    per_row = [ln for ln in loads if ln.rstrip().endswith(", xmask)")]
    # the id, by the row's index alone (a looped kernel's each pass loads it)
    assert len(per_row) == (1 if mode == "persistent" else 2) and all("c2" not in ln for ln in per_row), loads


@pytest.mark.parametrize("mode", ["persistent", "looped"])
def test_an_id_gathered_by_a_per_row_id_loads_once_a_row_too(mode):
    """BERT's token types, `types[positions[j]]`, then their embedding's row: an indirect load at
    an offset of no kernel variable, whose index is one value a row, loads [XBLOCK, 1] under the
    rows' mask like the id it is indexed by (the embedding + layer norm kernel built for sm_90:
    10 scalar loads a thread to 3); ids out of order, repeated, and rows of the last block masked
    off, as eager."""
    table, types, positions = torch.randn(3, 24), torch.randint(0, 3, (40,)), torch.randperm(40)[:11]
    positions[4] = positions[9]

    def fn(p, t, e):
        return F.layer_norm(e[torch.gather(t[None], 1, p[None])[0]] + 1, (24,))

    with gjit.config.scope(reduction=mode, rblock=8 if mode == "looped" else 0):
        cm = check(fn, positions, types, table, kernels=1)
        (kernel,) = gjit.explain(cm, positions, types, table).kernels
    loads = [ln.strip() for ln in kernel.source.splitlines() if "tl.load(" in ln]
    by_index = [ln for ln in loads if re.search(r"tl\.load\(in_ptr\d \+ \(tmp\d+\) ", ln)]
    assert by_index and all(ln.endswith("tl.zeros(xmask.shape, tl.int32), xmask)") for ln in by_index), loads


@pytest.mark.parametrize("mode", ["persistent", "looped"])
def test_a_gather_whose_index_varies_along_the_row_stays_under_the_lanes_mask(mode):
    """Review find (8f93f67): a gather's offset without a reduced variable (x[row, idx[row, j]],
    x[row, arange]) is not one value a row: its index varies along the row, and a lane past the
    row's end holds a masked load's undefined index (or an arange's index past the row). Loaded
    under the rows' mask alone it read that address (another row, or past the buffer: an illegal
    address on the card). The gather stays under xrmask; a per-row index (an embedding's id)
    still narrows to the rows' mask."""
    x, idx = torch.randn(6, 9), torch.randint(0, 9, (6, 5))
    ids, emb = torch.randint(0, 30, (6,)), torch.randn(30, 9)
    programs = {
        "index": (lambda t, i: torch.gather(t, 1, i).sum(-1), (x, idx)),
        "arange": (lambda t: torch.gather(t, 1, (torch.arange(7) + 2).expand(6, 7)).softmax(-1), (x,)),
        "per_row": (lambda i, e: F.layer_norm(e[i], (9,)), (ids, emb)),
    }
    with gjit.config.scope(reduction=mode, rblock=4 if mode == "looped" else 0):
        for name, (fn, args) in programs.items():
            cm = check(fn, *args)
            loads = [ln.strip() for k in gjit.explain(cm, *args).kernels for ln in k.source.splitlines()]
            loads = [ln for ln in loads if "tl.load(" in ln]
            gathers = [ln for ln in loads if re.search(r"tl\.load\(in_ptr\d \+ \([^)]*tmp", ln)]
            assert gathers and all(ln.endswith(", xrmask)") for ln in gathers), loads
            assert any(ln.endswith(", xmask)") for ln in loads) == (name == "per_row"), loads
