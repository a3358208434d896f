"""Scans (cumsum, cumprod, logcumsumexp): one kernel each with its producers inlined, rows that
fit one block and rows carried across blocks, every dim, dtypes eager accumulates differently,
NaN/Inf, non-contiguous, broadcast, empty and 0-d inputs, dynamic sizes."""

import math

import pytest
import torch

import gjit
from helpers import check

pytestmark = [pytest.mark.cpu, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

MODES = ["persistent", "looped"]  # looped: rows of 16 per step, the running value carried
SCANS = {
    "cumsum_last": lambda x: x.cumsum(-1),
    "cumsum_first": lambda x: torch.cumsum(x, 0),
    "cumsum_middle": lambda x: x.cumsum(1),
    "cumprod_last": lambda x: (x * 0.5 + 1).cumprod(-1),
    "cumprod_middle": lambda x: torch.cumprod(x.tanh() + 1, 1),
    "logcumsumexp_last": lambda x: torch.logcumsumexp(x, -1),
    "logcumsumexp_first": lambda x: torch.logcumsumexp(x * 3, 0),
}


def scan_kernels(cm, *args) -> list:
    return [k for k in gjit.explain(cm, *args).kernels if k.name.startswith("gjit_scan_")]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(SCANS), ids=list(SCANS))
def test_scan(name, mode):
    x = torch.randn(3, 37, 5)
    with gjit.config.scope(reduction=mode, rblock=16):
        cm = check(SCANS[name], x, kernels=1)
    assert len(scan_kernels(cm, x)) == 1


@pytest.mark.parametrize("mode", MODES)
def test_scan_dtypes_accumulate_as_eager(mode):
    """16-bit floats accumulate in float32; integers and bools scan in int64 (cumsum's result);
    `dtype=` converts first."""
    x = torch.randn(4, 50)
    i = torch.randint(-3, 4, (4, 50), dtype=torch.int32)
    b = torch.rand(4, 50) > 0.5
    with gjit.config.scope(reduction=mode, rblock=16):
        check(lambda x: (x.half().cumsum(1), x.bfloat16().cumsum(0), torch.logcumsumexp(x.half(), 1)), x)
        check(lambda i, b: (i.cumsum(1), b.cumsum(-1), i.cumprod(0), i.cumsum(1, dtype=torch.float32)), i, b)
        check(lambda x: (x.double().cumsum(1), x.cumsum(0, dtype=torch.float64)), x)


@pytest.mark.parametrize("mode", MODES)
def test_scan_nan_and_inf_as_eager(mode):
    nan, inf = math.nan, math.inf
    rows = [
        [1.0, nan, 2.0, 3.0],
        [-inf, -inf, 1.0, 2.0],
        [inf, 1.0, inf, -inf],
        [-inf, inf, 1.0, nan],
        [1.0, 2.0, -inf, 0.0],
        [0.0, 5.0, -2.0, 1e30],
    ]
    x = torch.tensor(rows).repeat(1, 5)
    with gjit.config.scope(reduction=mode, rblock=8):
        check(lambda x: (x.cumsum(1), x.cumprod(1), torch.logcumsumexp(x, 1), torch.logcumsumexp(x, 0)), x)


@pytest.mark.parametrize("mode", MODES)
def test_cummax_cummin_values_and_latest_indices(mode):
    """Ties give the latest index, NaN wins once seen (its latest index), as in eager."""
    x = torch.randint(-3, 4, (4, 40)).float()
    x[1, 5], x[1, 17], x[2, 0], x[3, 9] = math.nan, math.nan, -math.inf, math.inf
    i = torch.randint(-5, 5, (3, 30), dtype=torch.int32)
    with gjit.config.scope(reduction=mode, rblock=8):
        check(lambda x: (torch.cummax(x, 1), torch.cummin(x, 0), torch.cummax(x.half(), -1)), x)
        check(lambda i: (torch.cummax(i, 1), torch.cummin(i.long(), 0)), i)
        check(lambda s: torch.cummin(s, 0), torch.tensor(1.5))


def test_scan_layouts_and_edge_sizes():
    x = torch.randn(6, 9)
    check(lambda x: x.t().cumsum(1), x, kernels=1)  # a transposed input
    check(lambda x: x[:1].expand(4, 9).cumsum(0), x, kernels=1)  # a broadcast input
    check(lambda x: x[:, ::2].cumprod(1), x, kernels=1)  # a strided input
    check(lambda x: x.cumsum(1), torch.randn(0, 5))  # no rows
    check(lambda x: x.cumsum(1), torch.randn(5, 0))  # empty rows
    check(lambda x: (x.cumsum(0), torch.logcumsumexp(x, -1)), torch.randn(1, 7))  # a size-1 dim
    check(lambda s: (s.cumsum(0), s.cumprod(-1), torch.logcumsumexp(s, 0)), torch.tensor(2.5))  # 0-d


def test_scan_inlines_its_producers_and_is_read_by_its_consumers():
    """A cumsum of a pointwise value computes it in the scan kernel; what reads the cumsum is a
    kernel after it (here top-p style: probabilities, their running sum, a mask)."""
    x = torch.randn(4, 100)

    def fn(logits):
        probs = torch.softmax(logits, -1)
        return (probs.cumsum(-1) < 0.9) & (probs > 0.01)

    cm = check(fn, x)
    scans = scan_kernels(cm, x)
    assert len(scans) == 1 and "softmax" not in scans[0].name  # reads the stored softmax


def test_scan_sizes_are_dynamic():
    cm = gjit.compile(lambda x: torch.cumsum(x * 2, 1))
    for shape in [(3, 40), (5, 7), (2, 300)]:
        check(cm, torch.randn(shape))
    assert len(cm.entries) == 1


def test_rows_past_persistent_max_scan_in_chunks_with_default_knobs():
    """GJIT_RBLOCK's default (0: the writers choose) gives a looped scan its own chunk (review: it
    once divided by zero at codegen). Integer-valued floats: exact running sums, as in eager."""
    x = torch.randint(-8, 8, (2, 2100)).float()  # past persistent_max, a chunk and a tail
    check(lambda t: t.cumsum(-1), x)


def test_scans_down_contiguous_rows_read_along_memory(monkeypatch):
    """A scan over a dim whose kept dims are contiguous (the first of [T, C], the middle of [B, L,
    D]), with rows enough for the card (here: any), takes a tile wide across rows and short along
    the scan (the default knobs), carried over many steps: every load runs along memory.
    Integer-valued floats: exact running sums."""
    from gjit.codegen.triton import scan

    monkeypatch.setattr(scan, "OUTER_SCAN_PROGRAMS", 1)
    x = torch.randint(-8, 8, (70, 37)).float()
    y = torch.randn(2, 40, 20)
    cm = check(lambda x: (x.cumsum(0), torch.cummax(x, 0), torch.cumprod(x * 0.01 + 1, 0)), x)
    for k in scan_kernels(cm, x):
        assert "kept dims contiguous" in k.source and "XBLOCK=16, RBLOCK=32" in k.source, k.source
    cm = check(lambda y: (torch.logcumsumexp(y, 1), y.bfloat16().cumsum(1)), y)
    assert all("kept dims contiguous" in k.source for k in scan_kernels(cm, y))
    cm = gjit.compile(lambda x: torch.cumsum(x, 0))
    for shape in [(70, 37), (5, 130), (40, 3)]:
        check(cm, torch.randint(-8, 8, shape).float())
    assert len(cm.entries) == 1


def test_scans_down_few_contiguous_rows_keep_a_program_a_row():
    """With fewer rows than fill the card in wide tiles, a program a row: its steps run one after
    another, so few wide programs would leave most of the card idle."""
    x = torch.randint(-8, 8, (300, 37)).float()
    cm = check(lambda x: x.cumsum(0), x)
    (kernel,) = scan_kernels(cm, x)
    assert "kept dims contiguous" not in kernel.source and "RBLOCK=512" in kernel.source, kernel.source
