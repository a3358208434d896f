"""~10 s smoke test for pre-commit: one fused pointwise graph end to end."""

import pytest
import torch

from helpers import check

pytestmark = pytest.mark.cpu


def test_pointwise_chain_one_kernel():
    def f(x, y):
        return ((x * 2 + y).relu().sin() - 1).exp()

    check(f, torch.randn(5, 7), torch.randn(7), kernels=1)
