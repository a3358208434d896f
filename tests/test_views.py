"""Views are index expressions inside the consuming kernel, never copies: each view (or chain of
views) feeding one pointwise op is exactly one kernel, and a view returned as an output is built
on the same memory, with eager's strides (by ATen's view ops, or in one call from its traced
layout where the memory it views keeps the traced one)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gjit
from helpers import check, run_compiled

pytestmark = pytest.mark.cpu


def inputs(shapes) -> list[torch.Tensor]:
    return [torch.randn(shape) for shape in shapes]


# name -> (fn, input shapes): one view (or a few) then one pointwise op
VIEW_THEN_POINTWISE = {
    # expand / broadcast
    "expand_col": (lambda x: x.expand(5, 7) + 1, [(5, 1)]),
    "expand_new_dims": (lambda x: x.expand(4, 6, 9).exp(), [(6, 1)]),
    "expand_minus_one": (lambda x: x.expand(4, -1, -1) - 1, [(1, 7)]),
    "expand_same_size": (lambda x: x.expand(5, 7) + 1, [(5, 7)]),
    "expand_as": (lambda x, y: x.expand_as(y) * y, [(5, 1), (5, 7)]),
    "broadcast_both": (lambda x, y: x * y, [(5, 1, 7), (4, 1)]),
    # view / reshape of contiguous data: merge, split, regroup, -1, size-1 dims, odd sizes
    "view_merge_leading": (lambda x: x.view(15, 7) + 1, [(3, 5, 7)]),
    "view_merge_trailing": (lambda x: x.view(3, 35) + 1, [(3, 5, 7)]),
    "view_flat_minus_one": (lambda x: x.view(-1) * 2, [(3, 5, 7)]),
    "view_regroup": (lambda x: x.view(7, 15) * 2, [(3, 5, 7)]),
    "view_regroup_odd": (lambda x: x.reshape(5, 21).cos(), [(3, 5, 7)]),
    "view_swap_sizes": (lambda x: x.view(5, 3, 7) * 2, [(3, 5, 7)]),
    "view_split_flat": (lambda x: x.view(5, 7, 1, 3).sin(), [(105,)]),
    "view_split_leading": (lambda x: x.view(3, 5, 7).sin(), [(15, 7)]),
    "view_split_minus_one": (lambda x: x.view(2, -1, 5).sin(), [(6, 10)]),
    "view_add_ones": (lambda x: x.view(1, 3, 1, 5, 7, 1).cos(), [(3, 5, 7)]),
    "view_0d_to_3d": (lambda x: x.view(1, 1, 1) + 1, [()]),
    "view_1_to_0d": (lambda x: x.view(()) + x.view(1, 1), [(1,)]),
    "reshape_4d": (lambda x: x.reshape(6, 20) - x.reshape(6, 20).exp(), [(2, 3, 4, 5)]),
    "flatten": (lambda x: x.flatten(1) + 1, [(3, 5, 7)]),
    "unflatten": (lambda x: x.unflatten(1, (5, 7)) + 1, [(3, 35)]),
    "view_sym_merge": (lambda x: x.view(x.shape[0], -1) + 1, [(3, 5, 7)]),
    "view_sym_merge_leading": (lambda x: x.reshape(-1, x.shape[2]) * 2, [(3, 5, 7)]),
    "view_sym_split": (lambda x: x.view(x.shape[0], x.shape[1] // 5, 5) + 1, [(3, 35)]),
    # reshape of non-contiguous data (a copy in eager, still one kernel here)
    "reshape_empty": (lambda x: x.reshape(-1) + 1, [(2, 0)]),  # was a division by zero
    "view_empty_regroup": (lambda x: x.view(3, 0, 2) + 1, [(0, 6)]),
    "reshape_transposed": (lambda x: x.t().reshape(-1) * 2, [(5, 7)]),
    "reshape_transposed_2d": (lambda x: x.t().reshape(35, 1) + 1, [(5, 7)]),
    "reshape_permuted": (lambda x: x.permute(1, 0, 2).reshape(5, 21) + 1, [(3, 5, 7)]),
    "contiguous_then_view": (lambda x: x.t().contiguous().view(-1) + 1, [(5, 7)]),
    # permute / transpose / t
    "permute": (lambda x: x.permute(2, 0, 1) + 1, [(3, 5, 7)]),
    "permute_negative_dims": (lambda x: x.permute(-1, 0, -2) + 1, [(3, 5, 7)]),
    "permute_4d": (lambda x: x.permute(0, 2, 1, 3) * 3, [(2, 3, 4, 5)]),
    "transpose": (lambda x: x.transpose(0, 2) + 1, [(3, 5, 7)]),
    "transpose_negative_dims": (lambda x: x.transpose(-1, -2) + 1, [(3, 5, 7)]),
    "t": (lambda x: x.t() + 1, [(6, 9)]),
    "t_1d": (lambda x: x.t() + 1, [(7,)]),
    "movedim": (lambda x: x.movedim(0, -1) + 1, [(3, 5, 7)]),
    # slice: positive, negative, stepped, clamped, empty
    "slice_start": (lambda x: x[1:] + 1, [(5, 7)]),
    "slice_negative_end": (lambda x: x[:-1] + 1, [(5, 7)]),
    "slice_middle": (lambda x: x[1:4] + 1, [(5, 7)]),
    "slice_step": (lambda x: x[::2] + 1, [(5, 7)]),
    "slice_start_step": (lambda x: x[1::3] + 1, [(5, 7)]),
    "slice_both_dims": (lambda x: x[1:, ::2] - 3, [(6, 9)]),
    "slice_negative_start": (lambda x: x[-3:] + 1, [(5, 7)]),
    "slice_negative_both": (lambda x: x[-4:-1, -4:-1] * x[-3:, :3], [(6, 9)]),
    "slice_negative_start_step": (lambda x: x[-4::2] + 1, [(5, 7)]),
    "slice_start_before_begin": (lambda x: x[-100:] + 1, [(5, 7)]),
    "slice_start_before_begin_step": (lambda x: x[:, -100::3] + 1, [(5, 7)]),
    "slice_end_past_end": (lambda x: x[:, 2:100] + 1, [(5, 7)]),
    "slice_last_dim_step": (lambda x: x[..., ::2] + 1, [(3, 5, 7)]),
    "slice_empty": (lambda x: x[4:2] + 1, [(5, 7)]),
    "slice_start_past_end": (lambda x: x[10:] + 1, [(5, 7)]),
    "slice_symbolic_start": (lambda x, y: x[x.shape[0] - y.shape[0] :] + 1, [(9, 5), (3,)]),
    "slice_symbolic_negative_start": (lambda x: x[-x.shape[1] :] + 1, [(9, 5)]),
    # a symbolic size export knows is 1 (x.shape[1] in [2, 3]) broadcasts (was read as size s//2)
    "slice_symbolic_size_one_broadcast": (lambda x: x[:, : x.shape[1] // 2] * x, [(5, 3)]),
    "slice_symbolic_size_one_expand": (lambda x: x[:, : x.shape[1] // 2].expand(-1, 4) + 1, [(5, 3)]),
    "slice_symbolic_size_one_squeeze": (lambda x: x[:, : x.shape[1] // 2].squeeze(1) + 1, [(5, 3)]),
    "narrow": (lambda x: x.narrow(1, 2, 3) + 1, [(5, 7)]),
    "narrow_symbolic_start": (lambda x: x.narrow(0, x.shape[1] - 2, 3) * 2, [(9, 5)]),
    "narrow_negative_start": (lambda x: x.narrow(0, -3, 2) + 1, [(5, 7)]),
    # select
    "select": (lambda x: x[2] + 1, [(5, 7)]),
    "select_negative": (lambda x: x[-1] + 1, [(5, 7)]),
    "select_dim1_negative": (lambda x: x[:, -2].relu(), [(6, 9)]),
    "select_last_dim": (lambda x: x[..., 0] + 1, [(3, 5, 7)]),
    "select_symbolic_negative": (lambda x: x[-x.shape[1]] + 1, [(9, 5)]),
    "select_two_dims": (lambda x: x[:, -1] * x[:, 0], [(3, 5, 7)]),
    "select_only_element": (lambda x: x[0] + 1, [(1,)]),
    "unbind": (lambda x: sum(x.unbind(1)), [(5, 3)]),
    # squeeze / unsqueeze
    "squeeze_dim": (lambda x: x.squeeze(1) + 1, [(5, 1, 7)]),
    "squeeze_all": (lambda x: x.squeeze() + 1, [(1, 5, 1, 7, 1)]),
    "squeeze_negative": (lambda x: x.squeeze(-2) + 1, [(5, 1, 7)]),
    "squeeze_not_size_one": (lambda x: x.squeeze(0) + 1, [(5, 7)]),
    "squeeze_dims": (lambda x: x.squeeze((0, 2)) + 1, [(1, 5, 1, 7)]),
    "unsqueeze_front": (lambda x: x.unsqueeze(0) + 1, [(5, 7)]),
    "unsqueeze_negative": (lambda x: x.unsqueeze(-1) + 1, [(5, 7)]),
    "squeeze_then_unsqueeze": (lambda x: x.squeeze(1).unsqueeze(0) + 1, [(6, 1, 9)]),
    "unsqueeze_outer_product": (lambda x: x.unsqueeze(1) * x.unsqueeze(0), [(5,)]),
}


@pytest.mark.parametrize("name", list(VIEW_THEN_POINTWISE), ids=list(VIEW_THEN_POINTWISE))
def test_view_then_pointwise(name):
    fn, shapes = VIEW_THEN_POINTWISE[name]
    check(fn, *inputs(shapes), kernels=1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int64, torch.int32], ids=str)
def test_views_of_other_dtypes(dtype):
    x = (torch.randn(6, 7) * 10).to(dtype)
    check(lambda a: (a.t()[1:] * 3, a.view(-1)[::3] - a[0, 0]), x, kernels=2)


def test_views_of_bools():
    check(lambda a: (a.t()[1:] & a[:6, :6], a.view(-1)[::3] ^ True), torch.randn(6, 7) > 0, kernels=2)


# ----------------------------------------------------------------------------------------------
# Chains of views, views of computed values, views reused
# ----------------------------------------------------------------------------------------------

CHAINS = {
    "slice_t_step_unsqueeze": (lambda x: x[1:].t()[::2].unsqueeze(0) * 2, [(6, 7)]),
    "view_t_slice": (lambda x: x.view(3, 35).t()[:, 1:].sin(), [(3, 5, 7)]),
    "permute_select_expand": (lambda x: x.permute(2, 0, 1)[1].unsqueeze(-1).expand(3, 5, 4) + 1, [(3, 5, 7)]),
    "flat_then_strided": (lambda x: x.view(-1)[::8] + 1, [(7, 7)]),
    "view_of_computed": (lambda x: (x + 1).view(-1).sin(), [(3, 5, 7)]),
    "transpose_of_computed": (lambda x, y: (x * 2).t() + y, [(5, 7), (7, 5)]),
    "long_chain_of_computed": (
        lambda x: (x.exp() + 1).permute(2, 0, 1).reshape(7, 15).t()[3:] * 2,
        [(3, 5, 7)],
    ),
    "same_view_twice": (lambda x: x.t() + x.t().sin(), [(5, 7)]),
    "two_views_of_one_input": (lambda x: x.t()[:, 1:] * x[1:].t(), [(6, 7)]),
    "squeeze_unsqueeze_roundtrip": (lambda x: x.unsqueeze(1).squeeze(1).t() + 1, [(5, 7)]),
}


@pytest.mark.parametrize("name", list(CHAINS), ids=list(CHAINS))
def test_view_chain(name):
    fn, shapes = CHAINS[name]
    check(fn, *inputs(shapes), kernels=1)


# ----------------------------------------------------------------------------------------------
# cat: one kernel with its consumer
# ----------------------------------------------------------------------------------------------

CAT = {
    "two_dim0": (lambda a, b: torch.cat([a, b]).sin(), [(2, 7), (3, 7)]),
    "two_dim1": (lambda a, b: torch.cat([a, b], 1).sin(), [(5, 2), (5, 3)]),
    "two_last_dim": (lambda a, b: torch.cat([a, b], -1).sin(), [(5, 2), (5, 3)]),
    "three_dim0": (lambda a, b, c: torch.cat([a, b, c], 0).sin(), [(2, 7), (1, 7), (3, 7)]),
    "three_last_dim": (lambda a, b, c: torch.cat([a, b, c], -1).sin(), [(5, 2), (5, 1), (5, 3)]),
    "zero_size_middle": (lambda a, b, c: torch.cat([a, b, c], 0) * 2, [(2, 7), (0, 7), (3, 7)]),
    "zero_size_first_last_dim": (lambda a, b: torch.cat([a, b], -1) * 2, [(5, 0), (5, 3)]),
    "zero_size_slice_part": (lambda x: torch.cat([x, x * 2, x[:, :0]], -1).sin(), [(4, 5)]),
    "same_input_twice": (lambda x: torch.cat([x, x + 1], 0).tanh(), [(4, 5)]),
    "legacy_empty_1d": (lambda a, b: torch.cat([a, b]) + 1, [(2, 7), (0,)]),
    "3d_middle_dim": (lambda a, b: torch.cat([a, b], 1).exp(), [(2, 3, 4), (2, 1, 4)]),
    "views_as_parts": (lambda a, b: torch.cat([a.t(), b[:, ::2]], 1) + 1, [(3, 5), (5, 8)]),
    "computed_parts": (lambda a, b: torch.cat([(a + 1).t(), b * 2], 0).sin(), [(7, 5), (2, 7)]),
    "then_transpose": (lambda a, b: torch.cat([a, b]).t() * 2, [(2, 7), (3, 7)]),
    "stack": (lambda a, b: torch.stack([a, b], 1) + 1, [(5, 7), (5, 7)]),
}


@pytest.mark.parametrize("name", list(CAT), ids=list(CAT))
def test_cat(name):
    fn, shapes = CAT[name]
    check(fn, *inputs(shapes), kernels=1)


def test_cat_promotes_dtypes():
    a, b, c = torch.randn(2, 7), torch.randint(0, 5, (3, 7)), torch.randn(1, 7).half()
    check(lambda x, y, z: torch.cat([x, y, z]) * 2, a, b, c, kernels=1)


def test_cat_output():
    check(lambda a, b: torch.cat([a, b], 1), *inputs([(5, 2), (5, 3)]), kernels=1)


# ----------------------------------------------------------------------------------------------
# Views as outputs: zero-copy, eager's strides
# ----------------------------------------------------------------------------------------------


def test_views_of_input_as_outputs():
    """Every output is a view of the input's memory, with eager's shape, strides and offset."""

    def fn(x):
        return (
            x.t(),
            x.view(-1),
            x[1:, ::2],
            x.unsqueeze(0).expand(2, 5, 7),
            x[-1],
            x[:, -3:],
            x.view(7, 5).permute(1, 0),
        )

    x = torch.randn(5, 7)
    check(fn, x, kernels=0)
    out, _ = run_compiled(gjit.compile(fn), x)
    for o, e in zip(out, fn(x)):
        assert o.untyped_storage().data_ptr() == x.untyped_storage().data_ptr(), "the view was copied"
        assert (o.shape, o.stride(), o.storage_offset()) == (e.shape, e.stride(), e.storage_offset())


def test_views_of_computed_values_as_outputs():
    """Views of a kernel's result alias that result, with eager's strides."""

    def fn(x):
        y = x * 2
        return y, y.t(), y.view(-1)[3:], (x + 1)[::2]

    x = torch.randn(5, 7)
    check(fn, x, kernels=1)
    out, _ = run_compiled(gjit.compile(fn), x)
    assert [o.stride() for o in out] == [e.stride() for e in fn(x)]
    assert out[1].untyped_storage().data_ptr() == out[0].untyped_storage().data_ptr()
    assert out[2].untyped_storage().data_ptr() == out[0].untyped_storage().data_ptr()


def test_split_and_chunk():
    """split/chunk pieces are slice views: each consumer reads its piece in place, no extern."""
    x = torch.randn(6, 7)
    cm = check(lambda a: tuple(c + 1 for c in a.chunk(3, 1)), x, kernels=2)  # two 3-wide pieces share one
    assert gjit.explain(cm, x).externs == []
    check(lambda a: tuple(c * 2 for c in a.split([2, 4], 0)), x, kernels=2)
    check(lambda a: a.split(2, 1)[1], x, kernels=0)  # a piece returned as is: a view, no kernel


def test_view_as_dtype():
    """Bit reinterpretation is an ATen extern; the pointwise op after it is one kernel."""
    check(lambda a: a.view(torch.int32) + 1, torch.randn(5, 7), kernels=1)


def test_flip_reads_the_mirrored_index():
    x = torch.randn(3, 4, 5)
    check(lambda t: t.flip(-1) * 2, x, kernels=1)
    check(lambda t: t.flip(0, 2) + t, x, kernels=1)
    check(lambda t: t.transpose(0, 2).flip(1), x, kernels=1)


def test_nearest_upsampling_by_whole_factors_is_index_math():
    """2-D whole factors read input element i // k (one kernel, fused with what follows); other
    2-D scales stay externs. 1-D and 3-D upsampling decompose into float index math: its
    SymFloat scale is printed for the extern mul that takes it, and a size computed through floats
    (int(1.5 * float(s))) makes its ops externs, never a kernel that cannot print it."""
    x = torch.randn(2, 3, 4, 5)
    check(lambda t: F.interpolate(t, scale_factor=2, mode="nearest") + 1, x, kernels=1)
    check(lambda t: F.interpolate(t, scale_factor=(2, 3), mode="nearest"), x, kernels=1)
    cm = check(lambda t: F.interpolate(t, scale_factor=1.5, mode="nearest"), x)
    assert [e.op for e in gjit.explain(cm, x).externs] == ["aten.upsample_nearest2d.vec"]
    for scale, t in [(3, torch.randn(2, 3, 5)), (2, torch.randn(2, 2, 2, 3, 4)), (1.5, torch.randn(2, 3, 5))]:
        cm = check(lambda t, scale=scale: F.interpolate(t, scale_factor=scale, mode="nearest"), t)
        report = gjit.explain(cm, t)
        assert gjit.stats()["eager_runs"] == 0 and "aten.mul.Tensor" in [e.op for e in report.externs]
        assert report.kernels if scale != 1.5 else not report.kernels


def test_repeat_and_tile_read_the_input_modulo_its_size():
    x = torch.randn(3, 4)
    check(lambda t: t.repeat(2, 1, 3) * 2, x, kernels=1)
    check(lambda t: (t.tile((2,)) + 1, t.tile((2, 1, 1))), x, kernels=2)  # two output shapes
    check(lambda t: t.t().repeat(2, 2), x, kernels=1)  # a non-contiguous input
    check(lambda t: t[:1].expand(5, 4).repeat(1, 3).sin(), x, kernels=1)  # a broadcast input
    check(lambda t: t.repeat(1, 0), x)  # an empty result
    check(lambda t: t[:1].repeat(3, 2) + 1, x, kernels=1)  # a size-1 dim repeated reads index 0
    cm = gjit.compile(lambda t: t.repeat(3, 2) - t.sum())
    check(cm, torch.randn(5, 7))
    check(cm, torch.randn(6, 2))  # the sizes are dynamic: no recompile
    assert len(cm.entries) == 1


def test_writes_into_a_view_are_index_math():
    """slice/select/diagonal_scatter (and what export makes of x[...] = y on a copy) read the
    source inside the view and the input elsewhere: one kernel with what follows."""
    x = torch.randn(6, 8)

    def assign(t, v):
        t = t.clone()
        t[:, 1:7:2] = v
        t[-2] = 0.5
        return t * 2

    check(assign, x, torch.randn(6, 3), kernels=1)
    check(lambda t: torch.slice_scatter(t, t[:, :3] + 1, 1, -3) - 1, x, kernels=1)
    check(lambda t: torch.slice_scatter(t, t[1:5:3] * 2, 0, 1, 5, 3), x, kernels=1)
    check(lambda t: torch.slice_scatter(t, t[:0], 0, 10, 20), x)  # an empty slice past the end
    check(lambda t: torch.select_scatter(t, t[0].exp(), 0, -1), x, kernels=1)
    check(lambda t: torch.select_scatter(t, t[:, 3].half(), 1, 3), x.half(), kernels=1)
    for offset in (0, 2, -3):
        src = torch.diagonal(x, offset).sin()
        check(lambda t, s, o=offset: torch.diagonal_scatter(t, s, o) + 1, x, src, kernels=1)
    x3 = torch.randn(3, 4, 5)
    check(lambda t: torch.diagonal_scatter(t, torch.diagonal(t, 1, 0, 2) * 0, 1, 0, 2), x3, kernels=1)
    # the source is computed in the kernel from a value that is also read outside the view: its
    # value under the view's mask is not reused outside it (Triton, fuzz seed 167)
    check(lambda t: (lambda v: torch.slice_scatter(v, v[:-1] * 2, 0, None, -1))(t.sigmoid()), x, kernels=1)
    cm = gjit.compile(lambda t, v: torch.slice_scatter(t, v, 1, 2, 2 + v.shape[1]))
    check(cm, torch.randn(4, 9), torch.randn(4, 3))
    check(cm, torch.randn(5, 11), torch.randn(5, 6))  # dynamic sizes: one entry
    assert len(cm.entries) == 1


PADS = {
    "last_dim": (lambda t: F.pad(t, (1, 2)) * 2, torch.randn(3, 4, 5)),
    "two_dims_value": (lambda t: F.pad(t, (1, 2, 0, 3), value=-1.5).sin(), torch.randn(3, 4, 5)),
    "crop_and_pad": (lambda t: F.pad(t, (-1, 2, 1, -2, 2, 0)), torch.randn(3, 4, 5)),
    "crop_only": (lambda t: F.pad(t, (-1, -2)) + 1, torch.randn(3, 4, 5)),
    "nan_value": (lambda t: F.pad(t, (1, 1), value=float("nan")), torch.randn(3, 4)),
    "int64": (lambda t: F.pad(t, (2, 1), value=7), torch.randint(0, 9, (3, 4))),
    "bool": (lambda t: F.pad(t, (2, 1), value=1), torch.rand(3, 4) > 0.5),
    "half": (lambda t: F.pad(t, (2, 1), value=0.5), torch.randn(3, 4).half()),
    "zero_size": (lambda t: F.pad(t, (1, 1)), torch.randn(3, 0)),
    "of_a_transpose": (lambda t: F.pad(t.t(), (1, 1, 2, 0)), torch.randn(4, 6)),
}


@pytest.mark.parametrize("name", list(PADS))
def test_constant_pad_is_index_math(name):
    """F.pad(mode="constant") reads x at i - before where that is inside x, else the value: one
    kernel with its consumers; negative pads crop."""
    fn, x = PADS[name]
    check(fn, x, kernels=1)


def test_flip_of_complex_is_an_extern():
    x = torch.randn(3, 4, dtype=torch.complex64)
    cm = check(lambda t: t.flip(-1), x)
    assert [e.op for e in gjit.explain(cm, x).externs] == ["aten.flip.default"]


def test_complex_pointwise_ops_are_externs():
    """Kernels have no complex type: an op on complex tensors runs in ATen, not a crashing kernel."""
    x = torch.randn(3, 4, dtype=torch.complex64)
    cm = check(lambda t: (t * 2 + 1).exp(), x)
    report = gjit.explain(cm, x)
    assert not report.kernels
    assert [e.op for e in report.externs] == ["aten.mul.Tensor", "aten.add.Tensor", "aten.exp.default"]


class AdaptivePool1d(torch.nn.Module):
    """Swin's pooler: adaptive_avg_pool1d decomposes to a mean and an as_strided restride of it."""

    def forward(self, x):
        return torch.flatten(F.adaptive_avg_pool1d((x * 2).transpose(1, 2), 1), 1) + 1


AS_STRIDED = {
    # a computed row-major value: an index function, no extern (static sizes: with dynamic ones a
    # fixed window of a value of any size is not provably inside it, and stays ATen's)
    "overlapping_windows": (lambda x: (x * 2).as_strided((3, 4), (1, 2), 1).exp(), (4, 6), True),
    "default_offset": (lambda x: (x + 1).as_strided((2, 5), (5, 1)) * 3, (4, 6), True),
    "reaching_the_last_element": (lambda x: (x * 2).as_strided((4, 6), (6, 1), 0).exp(), (4, 6), True),
    # storage the graph does not own or lay out row-major: ATen's as_strided on eager's layout
    "of_an_input": (lambda x: x.as_strided((3, 4), (1, 2), 1) * 2, (4, 6), False),
    "of_a_view": (lambda x: x[1:].as_strided((3, 4), (1, 2), 1) * 2, (4, 6), False),
    "of_a_transposed_value": (lambda x: (x.t() * 2).as_strided((3, 4), (1, 2), 1) + 1, (4, 6), False),
}


@pytest.mark.parametrize("name", sorted(AS_STRIDED))
def test_as_strided(name):
    fn, shape, lowered = AS_STRIDED[name]
    x = torch.randn(shape)
    cm = check(gjit.compile(fn, dynamic=False), x)
    externs = [e.op for e in gjit.explain(cm, x).externs]
    assert ("aten.as_strided.default" not in externs) == lowered, externs


def test_adaptive_avg_pool1d_restride_is_a_view_at_dynamic_sizes():
    cm = gjit.compile(AdaptivePool1d())
    for shape in ((2, 5, 3), (3, 4, 6)):
        x = torch.randn(shape)
        check(cm, x)
        assert not gjit.explain(cm, x).externs
    assert len(cm.entries) == 1


def test_as_strided_past_the_values_elements_is_never_a_kernel_read():
    # eager refuses it (out of the storage's bounds); export does not check, and a kernel would
    # read past the buffer: gjit leaves it to ATen, which raises as eager does
    def past_the_end(x):
        return (x * 2).as_strided((5, 6), (6, 1), 0) + 1

    x = torch.randn(4, 6)
    with pytest.raises(RuntimeError, match="out of bounds"):
        past_the_end(x)
    cm = gjit.compile(past_the_end, dynamic=False)
    with pytest.raises(RuntimeError, match="out of bounds"), gjit.config.scope(interpret=True):
        cm(x)
    assert [e.op for e in gjit.explain(cm, x).externs] == ["aten.as_strided.default"]


TRANSPOSED = {  # a read contiguous along another dim than the store: 2-D tiles (codegen/plan.py)
    "t_add": (lambda x, y: x.t() + y, ((70, 130), (130, 70))),
    "t_contiguous": (lambda x: x.t().contiguous(), ((70, 130),)),
    "nchw_to_nhwc": (lambda x: x.permute(0, 2, 3, 1).contiguous() * 2, ((2, 40, 9, 11),)),
    "three_channels": (lambda x: x.permute(0, 2, 3, 1).contiguous(), ((2, 3, 9, 11),)),
    "swap_middle": (lambda x: x.transpose(1, 2).contiguous().sin(), ((3, 50, 70),)),
    "one_side_reads": (
        lambda y, x, b, c: y + x.t() * b + c + torch.arange(y.shape[1]),
        ((33, 65), (65, 33), (65,), (33, 1)),
    ),
}


@pytest.mark.parametrize("name", list(TRANSPOSED), ids=list(TRANSPOSED))
def test_transposed_reads_in_two_dimensional_tiles(name):
    """A [YBLOCK, XBLOCK] tile: the transposed read runs down it, the stores across; tails of
    both sides masked; reads of one side broadcast over the tile; other dtypes; sizes that change."""
    fn, shapes = TRANSPOSED[name]
    args = inputs(shapes)
    cm = check(fn, *args, kernels=1)
    assert "tile:" in gjit.explain(cm, *args).kernels[0].source
    check(fn, *[a.half() for a in args])
    check(fn, *[(a * 10).int() for a in args])
    dynamic = gjit.compile(fn, dynamic=True)
    check(dynamic, *args)
    assert "at launch" in gjit.explain(dynamic, *args).kernels[0].source  # the tile follows the sizes
    for scale in (1, 2):
        check(dynamic, *inputs([[s * scale + 1 if s > 1 else 1 for s in shape] for shape in shapes]))
    if len(shapes) == 1:  # a side of one row
        check(dynamic, *inputs([[1, *shapes[0][1:]]]))


def test_a_read_along_the_store_keeps_one_dimensional_blocks():
    """Eager keeps a transposed input's layout in a pointwise result: nothing to tile."""
    x = torch.randn(64, 33)
    cm = check(lambda x, b: x.t() * b, x, torch.randn(64), kernels=1)
    assert "tile:" not in gjit.explain(cm, x, torch.randn(64)).kernels[0].source


def test_two_maskings_of_one_value_keep_their_fill_values():
    """Two pads of one tensor mask the same loads but fill with different values."""
    two_pads = lambda x: F.pad(x, (1, 1), value=0.0) + F.pad(x, (1, 1), value=1.0) * 3  # noqa: E731
    check(two_pads, torch.randn(8, 5), kernels=1)


def wrapper_of(cm) -> str:
    return cm.entries[0].program.graph.wrapper_source


def layout(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.storage_offset()


def test_views_of_an_input_are_built_on_its_memory_at_any_offset():
    """A view chain of an input is one call on the input's memory (gjit_reinterpret, no ATen view
    op), from the traced strides and the offset past the input's own start: an input at another
    storage offset than the one compiled for gets eager's offsets too."""

    def fn(x):
        return (
            x.t(),
            x.view(-1)[5:],
            x[1:, ::2],
            x.view(7, 5).permute(1, 0)[2],
            x.unsqueeze(0).expand(2, 5, 7),
        )

    for debug, fn_name in ((True, "gjit_as_strided"), (False, "gjit_reinterpret")):  # checked or not
        cm = gjit.compile(fn)
        for start in (3, 10):  # the second call: the same entry, the input further into its storage
            x = torch.randn(60)[start : start + 35].view(5, 7)
            eager_runs = gjit.stats()["eager_runs"]
            with gjit.config.scope(interpret=True, debug=debug):
                out = cm(x)
            assert gjit.stats()["eager_runs"] == eager_runs, "the call ran eagerly"
            for o, e in zip(out, fn(x)):
                assert o.untyped_storage().data_ptr() == x.untyped_storage().data_ptr(), "the view was copied"
                assert layout(o) == layout(e) and torch.equal(o, e)
        assert len(cm.entries) == 1
        source = wrapper_of(cm)
        assert source.count(f"{fn_name}(x,") == 5 and "aten." not in source, source


def test_views_of_a_products_result_are_built_from_its_traced_strides():
    """A product extern's result is new and contiguous: the views of it are one call each."""

    def fn(a, b):
        y = a @ b
        return y.view(-1)[2:], y.t().unsqueeze(0), y.split(3, 1)[1]

    a, b = torch.randn(5, 4), torch.randn(4, 6)
    with gjit.config.scope(matmul="aten"):
        check(fn, a, b, kernels=0)
        out, cm = run_compiled(gjit.compile(fn), a, b)
    assert [(o.stride(), o.storage_offset()) for o in out] == [
        (e.stride(), e.storage_offset()) for e in fn(a, b)
    ]
    source = wrapper_of(cm)
    assert source.count("gjit_as_strided(mm,") == 3, source
    assert "aten.view" not in source and "aten.split" not in source, source


def test_views_that_change_the_dtype_stay_atens_and_an_attentions_result_is_checked_first():
    """A chain with a view to another dtype runs ATen's view ops; one of a result whose layout the
    library decides (an attention extern's) is one call behind a test of its strides."""
    x = torch.randn(5, 8)
    cm = check(lambda a: a.view(torch.int32).t(), x, kernels=0)
    assert "gjit_as_strided(a," not in wrapper_of(cm) and "view = aten.view.dtype(a" in wrapper_of(cm)
    q, k, v = (torch.randn(2, 3, 4, 8) for _ in range(3))
    with gjit.config.scope(matmul="aten"):
        cm = check(lambda q, k, v: F.scaled_dot_product_attention(q, k, v).transpose(1, 2), q, k, v)
    source = wrapper_of(cm)
    assert "= gjit_as_strided(scaled_dot_product_attention," in source, source
    assert " if scaled_dot_product_attention.stride() == " in source, source
    assert "else aten.permute.default(scaled_dot_product_attention, [0, 2, 1, 3])" in source, source


def test_views_of_computed_values_are_built_on_the_buffer_the_wrapper_allocates():
    def fn(x):
        y = x * 2
        return y.t(), y.view(-1)[3:], y[1:].unsqueeze(1)

    x = torch.randn(5, 7)
    check(fn, x, kernels=1)
    out, cm = run_compiled(gjit.compile(fn), x)
    assert [(o.stride(), o.storage_offset()) for o in out] == [
        (e.stride(), e.storage_offset()) for e in fn(x)
    ]
    assert len({o.untyped_storage().data_ptr() for o in out}) == 1
    assert wrapper_of(cm).count("gjit_as_strided(mul,") == 3, wrapper_of(cm)


def test_a_torch_cond_branch_checks_the_strides_of_its_operands_before_a_view_in_one_call():
    """No guard checks what a torch.cond branch is handed (its parent's wrapper passes it on): a
    view of a branch operand is one call where the operand's strides are the traced ones, ATen's
    view op where not; a view of the graph's input one call."""

    def fn(x, w):
        def then(x, w):
            return x @ w.t()

        def other(x, w):
            return x @ w.t() * 2

        return torch.cond(x.sum() > 0, then, other, (x, w)), w.t()

    x, w = torch.randn(4, 6), torch.randn(5, 6)
    with gjit.config.scope(matmul="aten"):
        cm = check(fn, x, w)
    graph = cm.entries[0].program.graph
    assert "gjit_as_strided(w," in graph.wrapper_source, graph.wrapper_source
    branches = [sub.wrapper_source for sub in graph.subgraphs.values()]
    assert len(branches) == 2
    for source in branches:
        assert "= gjit_as_strided(w, (s21, s15), (1, s21), 0) if w.stride() == (s21, 1) else " in source, (
            source
        )
        assert "aten.permute.default(w, [1, 0])" in source, source


@torch.library.custom_op("gjit_test::column_major_copy", mutates_args=())
def column_major_copy(x: torch.Tensor) -> torch.Tensor:
    return x.t().contiguous().t()  # x's values in column-major strides


@column_major_copy.register_fake
def _(x):
    return torch.empty_like(x, memory_format=torch.contiguous_format)  # what export traces: row-major


@pytest.mark.parametrize("strides_as_traced", [True, False])
def test_views_of_an_extern_check_its_strides(strides_as_traced):
    """A library's result may come in other strides than export traced (SDPA's, by backend): its
    view chains are one call where the strides are the traced ones and ATen's view ops where not,
    each as eager's view."""

    def f(x):
        q = x.view(1, 1, *x.shape)
        y = F.scaled_dot_product_attention(q, q, q)[0, 0] if strides_as_traced else column_major_copy(x)
        return y.t()[1:].unsqueeze(0), y[2:].t()

    cm, x = gjit.compile(f), torch.randn(5, 5)
    with gjit.config.scope(matmul="aten"):  # attention as ATen's SDPA
        run_compiled(cm, torch.randn(5, 5))
        out, _ = run_compiled(cm, x)
    for got, want in zip(out, f(x)):
        torch.testing.assert_close(got, want)
        assert got.stride() == want.stride() and got.storage_offset() == want.storage_offset()
    root = "scaled_dot_product_attention" if strides_as_traced else "column_major_copy"
    assert f" if {root}.stride(" in cm.entries[0].program.graph.wrapper_source


@torch.library.custom_op("gjit_test::odd_unit_stride", mutates_args=())
def odd_unit_stride(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_strided((4, 1, 6), (6, 1, 1))
    return out.copy_(x.view(4, 1, 6))


@odd_unit_stride.register_fake
def _(x):
    return x.new_empty((4, 1, 6))  # traced strides (6, 6, 1)


def test_views_of_an_extern_keep_eagers_strides_on_size_1_dims():
    def f(x):
        return odd_unit_stride(x * 2).transpose(0, 1)

    with gjit.config.scope(matmul="aten"):
        x = torch.randn(4, 6)
        out, _ = run_compiled(gjit.compile(f, dynamic=False), x)
    torch.testing.assert_close(out, f(x))
    assert out.stride() == f(x).stride()
