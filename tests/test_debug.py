"""The debug tooling itself: poisoned buffers must expose a kernel that skips an element."""

import pytest
import torch

from gjit.codegen.triton.pointwise import KernelWriter
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
