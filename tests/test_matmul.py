"""Matmuls as template kernels (kernels/matmul.py): mm, bmm, addmm, baddbmm and what linear and
matmul decompose to, in float32, float16 and bfloat16 (fp32 accumulation), through Triton's
interpreter, compared with eager and a float64 reference. Odd sizes that are not multiples of the
tiles, transposed, sliced and broadcast operands, zero-size dims, NaN and inf; the epilogue (bias,
activation, residual, several outputs, through the output's view) and the prologue (the operands'
views and casts, the clone before bmm) fused in; the extern where the template does not apply."""

import copy

import pytest
import torch
import torch.nn.functional as F

import gjit
from helpers import assert_same, check_against_float64, run_compiled

pytestmark = [pytest.mark.cpu]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def check_matmul(fn, *args, kernels=None, externs=0, reference_fn=None):
    """Run `fn` compiled (every product in a template kernel), compare with eager and float64
    (`reference_fn`: `fn` in float64, for a module)."""
    cm, report = check_against_float64(fn, *args, reference_fn=reference_fn)
    assert len(report.externs) == externs, report
    assert any(k.name.startswith("gjit_mm_") for k in report.kernels) or externs, report
    if kernels is not None:
        assert len(report.kernels) == kernels, report
    return cm, report


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (3, 17, 5), (17, 3, 127), (127, 33, 17), (64, 64, 64)])
def test_mm_odd_sizes(dtype, m, k, n):
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    check_matmul(torch.mm, a, b, kernels=1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bmm_and_baddbmm(dtype):
    a, b = torch.randn(3, 17, 9, dtype=dtype), torch.randn(3, 9, 20, dtype=dtype)
    bias = torch.randn(20, dtype=dtype)
    check_matmul(torch.bmm, a, b, kernels=1)
    check_matmul(lambda a, b, c: torch.baddbmm(c, a, b, beta=0.5, alpha=2.0), a, b, bias, kernels=1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_addmm_beta_alpha(dtype):
    a, b, bias = (
        torch.randn(5, 7, dtype=dtype),
        torch.randn(7, 3, dtype=dtype),
        torch.randn(5, 3, dtype=dtype),
    )
    check_matmul(torch.addmm, bias, a, b, kernels=1)
    check_matmul(lambda c, a, b: torch.addmm(c, a, b, beta=0.25, alpha=-3.0), bias, a, b, kernels=1)
    check_matmul(lambda c, a, b: torch.addmm(c[0], a, b), bias, a, b, kernels=1)  # a broadcast row


def test_addmm_beta_zero_ignores_nan_bias():
    a, b = torch.randn(4, 6), torch.randn(6, 5)
    bias = torch.full((4, 5), float("nan"))
    cm, _ = check_matmul(lambda c, a, b: torch.addmm(c, a, b, beta=0), bias, a, b)
    assert not cm(bias, a, b).isnan().any()


def test_nan_and_inf_propagate_as_in_eager():
    a, b = torch.randn(9, 12), torch.randn(12, 7)
    a[2, 3], b[5, 1], a[4, 0] = float("nan"), float("inf"), float("-inf")
    check_matmul(torch.mm, a, b)


@pytest.mark.parametrize(
    "make",
    [
        lambda: (torch.randn(12, 7).t(), torch.randn(12, 5)),  # transposed left operand
        lambda: (torch.randn(7, 12), torch.randn(5, 12).t()),  # transposed right operand (linear's)
        lambda: (torch.randn(9, 30)[:, 3:15], torch.randn(24, 5)[::2]),  # sliced, strided
        lambda: (torch.randn(1, 12).expand(6, 12), torch.randn(12, 5)),  # broadcast rows
    ],
)
def test_operands_read_through_their_views(make):
    a, b = make()
    check_matmul(torch.mm, a, b, kernels=1)


def test_zero_size_dims():
    check_matmul(torch.mm, torch.randn(3, 0), torch.randn(0, 4))  # K = 0: zeros
    check_matmul(
        lambda c, a, b: torch.addmm(c, a, b), torch.randn(3, 4), torch.randn(3, 0), torch.randn(0, 4)
    )
    out, _ = run_compiled(torch.mm, torch.randn(0, 5), torch.randn(5, 4))
    assert out.shape == (0, 4)


class Block(torch.nn.Module):
    """A transformer MLP on [B, S, H]: the product is viewed back to 3-D before its epilogue."""

    def __init__(self, hidden=24, inner=40):
        super().__init__()
        self.up = torch.nn.Linear(hidden, inner)
        self.down = torch.nn.Linear(inner, hidden)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_epilogue_through_the_output_view(dtype):
    model = Block().to(dtype).eval()
    x = torch.randn(2, 7, 24, dtype=dtype)
    with torch.no_grad():
        cm, report = check_matmul(model, x, kernels=2, reference_fn=copy.deepcopy(model).double())
    # the down projection's kernel adds its bias and the residual: nothing else is stored
    down = report.kernels[-1]
    assert "add" in down.name and len(cm.entries[0].program.kernels[-1].out_args) == 1


def test_epilogue_with_several_outputs_and_the_product_unstored():
    def fn(a, b, c):
        p = a @ b
        return torch.relu(p + c), p.sum(-1, keepdim=True) * 0 + torch.sigmoid(p)

    a, b, c = torch.randn(10, 6), torch.randn(6, 9), torch.randn(9)
    cm, report = check_matmul(fn, a, b, c)
    (line,) = report.matmuls  # explain says which kernel computes it and what it fuses
    assert line.startswith("mm (aten.mm.default): template kernel gjit_mm_") and "relu" in line, line
    assert f"  matmul {line}" in str(report)
    mm_kernels = [k for k in cm.entries[0].program.kernels if k.name.startswith("gjit_mm_")]
    assert len(mm_kernels) == 1


def test_attention_written_out_reads_the_transposes_in_place():
    """Eager attention as HF models write it, returning its probabilities (so it stays two
    products, not an attention kernel): no clone kernel hands bmm a contiguous copy."""

    def attention(q, k, v):
        b, s, h, d = q.shape
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        probs = (torch.matmul(q, k.transpose(-1, -2)) * 0.25).softmax(-1)
        return torch.matmul(probs, v).transpose(1, 2).reshape(b, s, h * d), probs

    q, k, v = (torch.randn(2, 9, 3, 16) for _ in range(3))
    cm, report = check_matmul(attention, q, k, v)
    names = [k.name for k in report.kernels]
    assert not any("clone" in n and not n.startswith("gjit_mm_") for n in names), names
    assert sum(n.startswith("gjit_mm_") for n in names) == 2, names


def test_half_casts_in_the_prologue():
    a, b = torch.randn(8, 20, dtype=torch.float16), torch.randn(20, 6)
    check_matmul(lambda a, b: a.to(b.dtype) @ (b * 2), a, b, kernels=1)


def test_dynamic_rows_share_one_entry():
    model = Block().eval()
    cm = gjit.compile(model, dynamic=True)
    with torch.no_grad():
        reference = copy.deepcopy(model).double()
        for rows in (3, 11, 40):
            x = torch.randn(2, rows, 24)
            out, _ = run_compiled(cm, x)
            assert_same(out, model(x), reference(x.double()))
    assert len(cm.entries) == 1


def test_aten_setting_and_float64_stay_externs():
    a, b = torch.randn(5, 7), torch.randn(7, 3)
    with gjit.config.scope(matmul="aten"):
        out, cm = run_compiled(torch.mm, a, b)
        report = gjit.explain(cm, a, b)
    assert len(report.externs) == 1 and "aten" in report.externs[0].reason
    assert report.matmuls == [f"mm (aten.mm.default): ATen extern: {report.externs[0].reason}"]
    a64, b64 = a.double(), b.double()
    _, report = check_matmul(torch.mm, a64, b64, externs=1)
    assert "float16, bfloat16 or float32" in report.externs[0].reason
    # on the CPU: CUDA has no integer matmul (GJIT_TEST_DEVICE=cuda runs this test on a GPU)
    ints = torch.randint(-5, 5, (4, 6), device="cpu"), torch.randint(-5, 5, (6, 2), device="cpu")
    _, report = check_matmul(torch.mm, *ints, externs=1)


def test_a_size_one_row_or_column_read_through_a_view():
    """A decode step's linear on [1, 1, H], a value head's single column, attention with one
    query: the tile's stores broadcast an offset that has no row (or column) index."""
    w = torch.randn(8, 8)
    check_matmul(lambda x, w: F.linear(x, w) * 2, torch.randn(1, 1, 8), w)
    check_matmul(lambda x, w: F.linear(x, w[:1]).squeeze(-1) + 1, torch.randn(2, 5, 8), w)

    def attention(q, k, v):  # the probabilities returned: two products, not an attention kernel
        probs = torch.matmul(q, k.transpose(-1, -2)).mul(0.25).softmax(-1)
        return torch.matmul(probs, v), probs

    check_matmul(attention, torch.randn(2, 3, 1, 16), torch.randn(2, 3, 7, 16), torch.randn(2, 3, 7, 16))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_constant_16_bit_operand(dtype):
    check_matmul(lambda x: x @ torch.ones(5, 3, dtype=x.dtype), torch.randn(4, 5, dtype=dtype))
    check_matmul(lambda x: torch.full((6, 4), 0.5, dtype=x.dtype) @ x, torch.randn(4, 3, dtype=dtype))


def test_addmm_alpha_zero_does_not_read_the_product():
    a, b = torch.randn(4, 6), torch.full((6, 5), float("inf"))
    bias = torch.randn(4, 5)
    out, _ = run_compiled(lambda c, a, b: torch.addmm(c, a, b, beta=2, alpha=0), bias, a, b)
    assert torch.equal(out, 2 * bias)


def test_epilogue_chain_through_the_output_view_is_one_kernel():
    """gelu(linear(x)) + r on [B, S, H]: the add reads gelu's value (not the product) through the
    same view; both are on the tile, and nothing but the sum is stored."""
    args = torch.randn(2, 5, 16), torch.randn(2, 5, 24), torch.randn(24, 16), torch.randn(24)
    cm, report = check_matmul(lambda x, r, w, b: F.gelu(F.linear(x, w, b)) + r, *args, kernels=1)
    assert len(cm.entries[0].program.kernels[0].out_args) == 1


@pytest.mark.slow
def test_int64_offsets_reach_the_k_index():
    """A right operand whose k stride passes 2**31 elements (a 4 GB buffer): the kernel takes int64
    offsets, and the k index is int64 too (an int32 k times the stride would wrap)."""
    stride = 2**30 + 8
    base = torch.zeros(2 * stride + 64, dtype=torch.float16)
    rhs = base.as_strided((3, 4), (stride, 1))
    rhs.copy_(torch.arange(12.0).view(3, 4))
    lhs = torch.ones(2, 3, dtype=torch.float16)
    out, cm = run_compiled(torch.mm, lhs, rhs)
    assert torch.equal(out, lhs @ rhs)
    assert cm.entries[0].program.kernels[0].index_dtype == "int64"


class NormLinear(torch.nn.Module):
    """A residual from a matmul's epilogue, a norm, a linear: the norm's statistics are computed in
    the linear's prologue (gjit/fusion/statistics.py), so there is no statistics kernel."""

    def __init__(self, hidden, out, norm):
        super().__init__()
        self.a, self.b = torch.nn.Linear(hidden, hidden), torch.nn.Linear(hidden, out)
        self.norm = torch.nn.LayerNorm(hidden) if norm == "layer" else torch.nn.RMSNorm(hidden, eps=1e-6)
        with torch.no_grad():  # weights that are not the identity
            for p in self.norm.parameters():
                p.uniform_(0.5, 1.5)

    def forward(self, x):
        h = self.a(x) + x
        return self.b(self.norm(h)), h


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("rows,hidden", [(1, 8), (7, 40), (33, 64)])
def test_norm_statistics_in_the_matmul_prologue(dtype, norm, rows, hidden):
    model = NormLinear(hidden, 24, norm).eval().to(dtype)
    x = torch.randn(1, rows, hidden, dtype=dtype)
    with torch.no_grad():
        cm, report = check_matmul(model, x, kernels=2, reference_fn=copy.deepcopy(model).double())
    (kernel,) = [k for k in report.kernels if "row statistics" in k.source]
    assert any("norm" in n or "mean" in n for n in kernel.aten_nodes), kernel.aten_nodes


def test_statistics_read_elsewhere_keep_their_kernel():
    """The mean is also returned: the statistics kernel stays (and stores it)."""

    def fn(h, w):
        mean = h.mean(-1, keepdim=True)
        return F.linear(h - mean, w), mean

    _, report = check_matmul(fn, torch.randn(5, 16), torch.randn(8, 16), kernels=2)
    assert not any("row statistics" in k.source for k in report.kernels)


def _ln(h):
    mean = h.mean(-1, keepdim=True)
    return (h - mean) * torch.rsqrt((h - mean).pow(2).mean(-1, keepdim=True) + 1e-5)


def _rms(h):
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_row_statistics_edge_cases_compile_and_match():
    """Two norms feeding one linear (one statistics region per matmul, the other keeps its kernel),
    rows at gathered indices and rows under a pad/cat mask (not moved: the row loop would read
    past the ends), a norm of another tensor than the operand (its loads are in the offset
    guards)."""
    x, y, w = torch.randn(2, 5, 12), torch.randn(2, 5, 12), torch.randn(7, 12)
    idx = torch.tensor([4, 0, 2])
    cases = [
        (lambda x, y, w: F.linear(_ln(x) + _rms(y), w), (x, y, w)),
        (lambda x, y, w: F.linear(torch.cat([_ln(x), _rms(y)], -1), torch.cat([w, w], -1)), (x, y, w)),
        (lambda x, i, w: F.linear(_ln(x)[:, i], w), (x, idx, w)),
        (lambda x, w: F.linear(F.pad(_ln(x), (0, 0, 2, 1)), w), (x, w)),
        (lambda x, y, w: F.linear(torch.cat([_ln(x), y], 1), w), (x, y, w)),
    ]
    for fn, args in cases:
        _, report = check_matmul(fn, *args)
        masked = fn is cases[3][0] or fn is cases[4][0]
        assert not (masked and any("row statistics" in k.source for k in report.kernels)), report
    y = torch.randn(2, 5, 20)
    cm, report = check_matmul(
        lambda x, y, w: F.linear(x * torch.rsqrt(y.pow(2).mean(-1, keepdim=True)), w), x, y, w
    )
    (kernel,) = [k for k in cm.entries[0].program.kernels if "row statistics" in k.source]
    (y_dim,) = [d.split(" = ")[1] for d in report.dynamic_dims if d.startswith("y.size(2)")]
    assert any(y_dim in str(cond) for cond, _ in kernel.assumptions), kernel.assumptions


@pytest.mark.compile_only
def test_float32_products_follow_torchs_tf32_setting(monkeypatch):
    """On a GPU, eager's float32 matmuls use TF32 tensor cores when torch allows it
    (torch.set_float32_matmul_precision("high")); the template does the same, and its entry is
    guarded on the setting: changing it recompiles. No GPU here: the call is taken as on one (the
    interpreter multiplies in float32 either way), and the TF32 kernel is built for sm_90."""
    from gjit.codegen.toolchain.compile_only import compile_kernel

    # on the CPU also under GJIT_TEST_DEVICE=cuda: the first half is about a CPU compile
    a, b = torch.randn(64, 96, device="cpu"), torch.randn(96, 80, device="cpu")
    _, on_cpu = run_compiled(torch.mm, a, b)  # eager is IEEE on the CPU whatever the setting: no guard
    assert on_cpu.entries[0].program.kernels[0].tf32 is None
    assert "TF32" not in on_cpu.entries[0].guards.format()
    monkeypatch.setattr(gjit.api, "tf32_allowed", lambda on_gpu: torch.backends.cuda.matmul.allow_tf32)
    previous = torch.backends.cuda.matmul.allow_tf32
    cm = gjit.compile(torch.mm)
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        run_compiled(cm, a, b)
        torch.backends.cuda.matmul.allow_tf32 = True
        out, _ = run_compiled(cm, a, b)
        assert len(cm.entries) == 2, "turning TF32 on recompiles"
        torch.backends.cuda.matmul.allow_tf32 = False
        run_compiled(cm, a, b)
        assert len(cm.entries) == 2, "the first entry serves the call again"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    assert_same(out, a @ b)
    ieee, tf32 = (e.program.kernels[0] for e in cm.entries)
    assert (ieee.tf32, tf32.tf32) == (False, True)
    assert 'input_precision="ieee"' in ieee.source and 'input_precision="tf32"' in tf32.source
    assert "TF32: torch allows it" in tf32.source
    assert "TF32 allowed for float32 matmuls" in cm.entries[1].guards.format()
    assert "TF32 not allowed for float32 matmuls" in cm.entries[0].guards.format()
    path = cm.entries[1].program.graph.kernel_paths[tf32.name]
    ptx = compile_kernel(tf32, path).asm["ptx"]
    assert ".tf32" in ptx and ("wgmma.mma_async" in ptx or "mma.sync" in ptx)


@pytest.mark.gpu
def test_tf32_on_a_gpu_is_as_close_to_float64_as_eager():
    a, b = torch.randn(512, 768, device="cuda"), torch.randn(768, 640, device="cuda")
    reference = a.double() @ b.double()
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        cm = gjit.compile(torch.mm)
        out, expected = cm(a, b), a @ b
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    assert 'input_precision="tf32"' in cm.entries[0].program.kernels[0].source
    err, err_eager = ((t.double() - reference).abs().max().item() for t in (out, expected))
    assert err <= 3 * err_eager + 1e-6, (err, err_eager)
