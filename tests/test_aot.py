"""gjit.aot: every kernel built for sm_90 without a GPU, with its resource usage from the cubin."""

import os

import pytest
import torch

import gjit
from test_dynamic import Cond

pytestmark = pytest.mark.compile_only


def test_contiguous_fp32_pointwise_uses_vector_loads_and_does_not_spill(tmp_path):
    x, y = torch.randn(64, 128), torch.randn(64, 128)
    report = gjit.aot(lambda a, b: (a * b + 1).relu(), x, y, out_dir=str(tmp_path))
    (kernel,) = report.kernels
    assert kernel.vector_loads >= 2 and kernel.scalar_loads == 0  # 128-bit ld.global.v4 only
    assert "ld.global.v4" in open(kernel.ptx_path).read()
    assert 0 < kernel.registers <= 255 and not kernel.spills
    assert os.path.getsize(kernel.cubin_path) > 0
    assert kernel.name in str(report) and "sm_90" in str(report)


def test_reductions_report_shared_memory_and_no_spills(tmp_path):
    def f(x):
        return torch.softmax(x, -1), torch.nn.functional.layer_norm(x, (x.shape[-1],))

    report = gjit.aot(f, torch.randn(16, 300), out_dir=str(tmp_path))
    assert report.kernels and all(not k.spills and k.registers > 0 for k in report.kernels)


def test_torch_cond_branch_kernels_are_built_too(tmp_path):
    report = gjit.aot(Cond(), torch.randn(4, 3), out_dir=str(tmp_path))
    assert len(report.kernels) == 3  # the predicate's reduction and one kernel per branch
