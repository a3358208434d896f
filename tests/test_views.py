"""Views are index expressions inside the consuming kernel: never a copy, one kernel."""

import pytest
import torch

from helpers import check

pytestmark = pytest.mark.cpu

CASES = {
    "transpose": (lambda x: x.t() + 1, (6, 9)),
    "permute_3d": (lambda x: x.permute(2, 0, 1) * 2, (3, 5, 7)),
    "flatten": (lambda x: x.view(-1) * 2, (3, 5, 7)),
    "split_dims": (lambda x: x.reshape(3, 5, 7).sin(), (15, 7)),
    "merge_odd": (lambda x: x.reshape(5, 21).cos(), (3, 5, 7)),
    "reshape_after_permute": (lambda x: x.permute(1, 0, 2).reshape(5, 21) + 1, (3, 5, 7)),
    "expand": (lambda x: x.expand(4, 6, 9).exp(), (6, 1)),
    "slice_step": (lambda x: x[1:, ::2] - 3, (6, 9)),
    "slice_negative": (lambda x: x[-4:-1] * x[-4:-1], (6, 9)),
    "select_negative": (lambda x: x[:, -2].relu(), (6, 9)),
    "squeeze_unsqueeze": (lambda x: x.squeeze(1).unsqueeze(0) + 1, (6, 1, 9)),
    "cat_last_dim": (lambda x: torch.cat([x, x * 2, x[:, :0]], -1).sin(), (4, 5)),
    "cat_dim0": (lambda x: torch.cat([x, x.flip(0) if False else x + 1], 0).tanh(), (4, 5)),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_view_then_pointwise_is_one_kernel(case):
    fn, shape = CASES[case]
    check(fn, torch.randn(shape), kernels=1)


def test_view_output_aliases_the_kernel_result():
    def f(x):
        y = x * 2
        return y, y.view(-1)

    check(f, torch.randn(3, 4), kernels=1)
