"""A norm after a linear in the linear's epilogue (gjit/fusion/rows.py): when one tile covers a whole
output row, the norm's sums run over the tile in registers and the norm needs no kernel. Numerics
against eager and float64 in three dtypes at odd sizes; what may not fold keeps its kernel (a row
wider than a tile, a norm that reads what a later kernel computes); NaN and inf stay in their row;
the kernel builds for sm_90 at BERT-base width."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gjit
from gjit.kernels.matmul import SHARED_MEMORY
from helpers import check, check_against_float64

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ROW_EPILOGUE = "row epilogue (gjit/fusion/rows.py)"


class PostNorm(nn.Module):
    """BERT's output block: LayerNorm(dense(x) + residual)."""

    def __init__(self, inner: int, hidden: int):
        super().__init__()
        self.dense = nn.Linear(inner, hidden)
        self.norm = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, x, residual):
        return self.norm(self.dense(x) + residual)


def folded(report) -> list:
    return [k for k in report.kernels if ROW_EPILOGUE in k.source]


def post_norm(dtype, rows: int, inner: int, hidden: int):
    """PostNorm compiled and checked against eager and float64 on [2, rows, inner] inputs: the
    explain report."""
    model = PostNorm(inner, hidden).eval().to(dtype)
    x, residual = torch.randn(2, rows, inner, dtype=dtype), torch.randn(2, rows, hidden, dtype=dtype)
    with torch.no_grad():
        _, report = check_against_float64(model, x, residual, reference_fn=copy.deepcopy(model).double())
    return report


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inner,hidden", [(1, 8, 8), (7, 24, 40), (33, 64, 64), (5, 16, 200)])
def test_post_norm_is_in_the_linears_epilogue(dtype, rows, inner, hidden):
    (kernel,) = post_norm(dtype, rows, inner, hidden).kernels
    assert ROW_EPILOGUE in kernel.source and "tl.sum(" in kernel.source, kernel.source
    assert kernel.source.count("tl.store(") == 1  # the normed rows only: the sum before it stays in registers


@pytest.mark.cpu
def test_a_norm_of_the_product_itself_read_through_its_view():
    """RMS norm written out on a linear's [B*S, N] product viewed as [B, S, N]."""

    def fn(x, w, g):
        h = F.linear(x, w)
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * g

    args = torch.randn(3, 5, 16), torch.randn(24, 16), torch.randn(24)
    cm, report = check_against_float64(fn, *args)
    assert len(report.kernels) == 1 and folded(report), report


@pytest.mark.cpu
def test_the_sum_before_the_norm_is_stored_when_returned():
    def fn(x, w, r):
        h = x @ w + r
        return F.layer_norm(h, (h.shape[-1],)), h

    cm, report = check_against_float64(fn, torch.randn(9, 12), torch.randn(12, 20), torch.randn(9, 20))
    (kernel,) = report.kernels
    assert ROW_EPILOGUE in kernel.source and kernel.source.count("tl.store(") == 2, kernel.source


@pytest.mark.cpu
@pytest.mark.parametrize(
    "dtype,hidden,folds",
    [(torch.float32, 1100, False), (torch.float32, 600, False), (torch.float16, 600, True)],
)
def test_a_row_wider_than_a_tile_keeps_the_norms_kernel(dtype, hidden, folds):
    """A tile covers 1024 columns of 16-bit products, 512 of float32 ones (FMA dots)."""
    report = post_norm(dtype, 3, 8, hidden)
    assert len(report.kernels) == (1 if folds else 2) and bool(folded(report)) == folds, report


@pytest.mark.cpu
def test_a_norm_that_reads_a_later_kernels_value_keeps_its_kernel():
    """The scale is a sum over another input computed after the product: the norm cannot run
    where the product does."""

    def fn(x, w, y):
        h = x @ w
        scale = y.sum()
        return F.layer_norm(h, (h.shape[-1],)) * scale

    cm, report = check_against_float64(fn, torch.randn(6, 10), torch.randn(10, 12), torch.randn(40))
    assert not folded(report), report  # the product, the sum, then the norm with its scale
    assert len([k for k in report.kernels if k.name.startswith("gjit_mm_")]) == 1, report


@pytest.mark.cpu
def test_nan_and_inf_stay_in_their_row():
    model = PostNorm(8, 16).eval()
    x, residual = torch.randn(1, 4, 8), torch.randn(1, 4, 16)
    x[0, 1, 3], residual[0, 2, 5] = float("nan"), float("inf")
    with torch.no_grad():
        out = check(model, x, residual)(x, residual)
    assert out[0, 1].isnan().all() and not out[0, 0].isnan().any() and not out[0, 3].isnan().any()


@pytest.mark.cpu
def test_dynamic_rows_share_one_entry():
    model = PostNorm(8, 24).eval()
    cm = gjit.compile(model, dynamic=True)
    with torch.no_grad():
        for rows in (3, 17, 6):
            check(cm, torch.randn(2, rows, 8), torch.randn(2, rows, 24))
    assert len(cm.entries) == 1


@pytest.mark.compile_only
@pytest.mark.parametrize(
    "dtype,width", [(torch.float16, 768), (torch.bfloat16, 1024), (torch.float32, 512), (torch.float32, 300)]
)
@pytest.mark.parametrize("static", [True, False])
def test_wide_rows_build_for_sm90_without_spills(tmp_path, dtype, width, static):
    """BERT-base's output block (3072 -> 768, LayerNorm) and the widest rows a tile takes: 16
    rows of a 1024-wide tile in 16-bit, 512 in float32 (all in registers: FMA dots); static
    widths (a module's) and dynamic ones (the weights passed in: N a size argument)."""
    if static:
        model = PostNorm(3072, width).eval().to(dtype)
    else:
        model = lambda x, r, w, b: F.layer_norm(F.linear(x, w, b) + r, (w.shape[0],), eps=1e-12)  # noqa: E731
    args = torch.randn(4, 128, 3072, dtype=dtype), torch.randn(4, 128, width, dtype=dtype)
    args += () if static else (torch.randn(width, 3072, dtype=dtype), torch.randn(width, dtype=dtype))
    with torch.no_grad():
        report = gjit.aot(model, *args, out_dir=str(tmp_path), workers=1)
    (kernel,) = report.kernels
    assert not kernel.spills and 0 < kernel.registers <= 255, report
    assert kernel.shared <= SHARED_MEMORY, report  # a 1024-wide right operand tile a k step
    ptx = open(kernel.ptx_path).read()
    assert ("wgmma.mma_async" in ptx or "mma.sync" in ptx) == (dtype != torch.float32), kernel.name


@pytest.mark.cpu
def test_a_dynamic_row_width_is_guarded_to_its_tile():
    """N is a size argument here (the weight is an input): the kernel assumes N <= its tile, and a
    wider call recompiles (without the row epilogue past ROW_TILE)."""

    def fn(x, w, r):
        return F.layer_norm(x @ w + r, (w.shape[-1],))

    cm = gjit.compile(fn)
    narrow = torch.randn(5, 8), torch.randn(8, 24), torch.randn(5, 24)
    report = gjit.explain(check(cm, *narrow), *narrow)
    (kernel,) = folded(report)
    assert "<= 32 (one tile a row)" in kernel.source, kernel.source
    check(cm, torch.randn(5, 8), torch.randn(8, 30), torch.randn(5, 30))  # the same tile
    assert len(cm.entries) == 1
    wide = torch.randn(5, 8), torch.randn(8, 1500), torch.randn(5, 1500)
    check(cm, *wide)
    assert len(cm.entries) == 2 and not folded(gjit.explain(cm, *wide))


@pytest.mark.cpu
@pytest.mark.parametrize("keepdim", [False, True])
def test_a_row_value_that_is_returned_is_stored_at_its_row(keepdim):
    """The mean of the product's rows, also returned: stored once per row, at the row's address
    (a store at the tile's columns would write past the [rows] buffer)."""

    def fn(x, w):
        h = x @ w
        return F.layer_norm(h, (h.shape[-1],)), h.mean(-1, keepdim=keepdim)

    cm, report = check_against_float64(fn, torch.randn(7, 12), torch.randn(12, 20))
    (kernel,) = folded(report)
    stores = [ln for ln in kernel.source.splitlines() if "tl.store(" in ln]
    assert len(stores) == 2 and sum("c1" in ln.split(",")[0] for ln in stores) == 1, stores  # c1: the column


@pytest.mark.cpu
def test_post_norm_residual_and_the_next_norms_sum_in_one_epilogue():
    """Gemma 2's layer: residual + RMSNorm(o_proj(a)), then the next RMS norm of that sum before
    the next linear: both norms' sums in the o-projection's epilogue, the second one's stored per
    row for the next linear to read."""

    def rms(t, g):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + g)

    def fn(a, w, residual, g1, g2, w2):
        h = residual + rms(F.linear(a, w), g1)
        return F.linear(rms(h, g2), w2), h

    args = (torch.randn(2, 5, 16), torch.randn(24, 16), torch.randn(2, 5, 24))
    args += (torch.randn(24), torch.randn(24), torch.randn(8, 24))
    cm, report = check_against_float64(fn, *args)
    (kernel,) = folded(report)
    stores = [ln for ln in kernel.source.splitlines() if "tl.store(" in ln]
    assert len(stores) == 2 and sum("c1" in ln.split(",")[0] for ln in stores) == 1, stores  # c1: the column
