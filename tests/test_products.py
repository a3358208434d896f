"""Products that share their left operand in one kernel (gjit/fusion/products.py): q, k and v of one
input (grouped-query widths: k and v narrower than q), a gated MLP's gate and up, batched
products of one operand. Each program computes one tile of one product; a norm before them has
its statistics in that kernel's prologue (no norm kernel). Numerics against eager and float64 in
three dtypes at odd sizes; what may not share a launch (a product that reads another's output)
keeps its own; the kernel builds for sm_90 on tensor cores without spills."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gjit
from gjit.kernels.matmul import SHARED_MEMORY
from helpers import check, check_against_float64

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHARED = "products of one left operand"  # the kernel header's words for a shared launch


class Projections(nn.Module):
    """An optional RMS norm, then q, k and v of its output (k and v narrower, as with GQA)."""

    def __init__(self, hidden: int, q: int, kv: int, bias: bool, norm: bool):
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=1e-6) if norm else nn.Identity()
        self.q, self.k, self.v = (nn.Linear(hidden, n, bias=bias) for n in (q, kv, kv))

    def forward(self, x):
        h = self.norm(x)
        return self.q(h) * 0.5, self.k(h), F.relu(self.v(h))


class GatedMLP(nn.Module):
    """Llama's MLP after an RMS norm, with the residual: down(silu(gate(h)) * up(h)) + x."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=1e-6)
        self.gate, self.up = nn.Linear(hidden, inner, bias=False), nn.Linear(hidden, inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return self.down(F.silu(self.gate(h)) * self.up(h)) + x


def compiled(model, x):
    with torch.no_grad():
        return check_against_float64(model, x, reference_fn=copy.deepcopy(model).double())


def shared_kernels(report):
    return [k for k in report.kernels if SHARED in k.source]


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden,q,kv", [(1, 8, 16, 8), (17, 40, 48, 16), (70, 64, 64, 64)])
@pytest.mark.parametrize("norm", [False, True])
def test_q_k_v_of_one_input_are_one_kernel(dtype, rows, hidden, q, kv, norm):
    model = Projections(hidden, q, kv, bias=not norm, norm=norm).eval().to(dtype)
    cm, report = compiled(model, torch.randn(2, rows, hidden, dtype=dtype))
    assert not report.externs, report
    (kernel,) = report.kernels  # the norm's statistics too, in the prologue
    assert SHARED in kernel.source and kernel.source.count("tl.dot(") == 3, kernel.source
    assert ("row statistics" in kernel.source) == norm


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gate_and_up_are_one_kernel_and_down_reads_them(dtype):
    model = GatedMLP(24, 40).eval().to(dtype)
    cm, report = compiled(model, torch.randn(3, 7, 24, dtype=dtype))
    assert len(report.kernels) == 2 and not report.externs, report
    assert len(shared_kernels(report)) == 1, report


@pytest.mark.cpu
def test_batched_products_of_one_operand_and_size_edges():
    """bmm of one left operand with two right ones (widths 20 and 1); zero rows; one row."""

    def fn(a, b, c):
        return torch.bmm(a, b) + 1, torch.bmm(a, c)

    for m in (9, 1, 0):
        a, b, c = torch.randn(3, m, 5), torch.randn(3, 5, 20), torch.randn(3, 5, 1)
        cm, report = check_against_float64(fn, a, b, c)
        assert len(report.kernels) == 1 and len(shared_kernels(report)) == 1, report


@pytest.mark.cpu
def test_non_contiguous_and_broadcast_operands_share_a_kernel():
    def fn(x, w1, w2, bias):
        return x @ w1 + bias, torch.tanh(x @ w2)

    x = torch.randn(40, 13)[::2].t()  # [13, 20], strided
    w1, w2 = torch.randn(33, 20).t(), torch.randn(1, 20).t().expand(20, 6)
    bias = torch.randn(33)
    cm, report = check_against_float64(fn, x, w1, w2, bias)
    assert len(report.kernels) == 1 and len(shared_kernels(report)) == 1, report


@pytest.mark.cpu
def test_nan_and_inf_stay_in_their_product():
    def fn(x, w1, w2):
        return x @ w1, x @ w2

    x, w1, w2 = torch.randn(6, 8), torch.randn(8, 5), torch.randn(8, 3)
    w1[2, 1], x[3, 4] = float("nan"), float("inf")
    cm, report = check_against_float64(fn, x, w1, w2)
    assert len(shared_kernels(report)) == 1, report


@pytest.mark.cpu
def test_a_product_that_reads_anothers_output_keeps_its_own_kernel():
    """The second right operand is computed from the first product: it cannot launch with it."""

    def fn(x, w):
        first = x @ w
        return first, x @ (w * first.sum())

    cm, report = check_against_float64(fn, torch.randn(5, 7), torch.randn(7, 4))
    assert not shared_kernels(report), report
    assert len([k for k in report.kernels if k.name.startswith("gjit_mm_")]) == 2, report


@pytest.mark.cpu
def test_different_left_operands_or_dot_dtypes_do_not_share():
    """x @ w and x @ v share; y @ w does not (another left operand); h @ u multiplies in float32
    and h @ v16 in float16 (a cast of 16-bit operands is left to the dot): separate tables."""

    def fn(x, y, w, v, h16, u):
        h = h16.to(u.dtype)  # float32 (float64 in the reference run)
        return x @ w, y @ w, x @ v, h @ u, h @ v.to(h16.dtype).to(u.dtype)

    args = torch.randn(5, 7), torch.randn(5, 7), torch.randn(7, 4), torch.randn(7, 3)
    args += torch.randn(5, 7).half(), torch.randn(7, 3)
    report = gjit.explain(check(fn, *args), *args)
    (kernel,) = shared_kernels(report)  # x @ w and x @ v
    assert kernel.source.count("tl.dot(") == 2, kernel.source
    assert len([k for k in report.kernels if k.name.startswith("gjit_mm_")]) == 4, report


@pytest.mark.cpu
def test_explain_names_each_product_and_the_shared_kernel():
    model = Projections(16, 16, 8, bias=True, norm=False).eval()
    cm, report = compiled(model, torch.randn(1, 5, 16))
    (kernel,) = report.kernels
    assert len([line for line in report.matmuls if kernel.name in line]) == 3, report.matmuls


@pytest.mark.compile_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_shared_launch_builds_for_sm90_on_tensor_cores_without_spills(tmp_path, dtype):
    """Llama-8B-like widths (q 4096, k and v 1024 of a 4096 input): each product's k loop in its
    branch, 16-bit ones on tensor cores."""
    model = Projections(4096, 4096, 1024, bias=False, norm=True).eval().to(dtype)
    with torch.no_grad():
        report = gjit.aot(model, torch.randn(1, 64, 4096, dtype=dtype), out_dir=str(tmp_path), workers=1)
    (kernel,) = report.kernels
    assert not kernel.spills and 0 < kernel.registers <= 255, report
    assert kernel.shared <= SHARED_MEMORY, report  # each branch's loop buffers its own tiles
    ptx = open(kernel.ptx_path).read()
    assert ("wgmma.mma_async" in ptx or "mma.sync" in ptx) == (dtype != torch.float32), kernel.name


@pytest.mark.cpu
def test_at_most_three_products_share_a_kernel():
    """Six heads' q, k and v of one norm's output (18 products): groups of three, each kernel's
    loops within the shared memory budget; the norm's statistics in each."""

    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(16)
            self.heads = nn.ModuleList(nn.Linear(16, 8, bias=False) for _ in range(18))

        def forward(self, x):
            h = self.norm(x)
            return torch.cat([head(h) for head in self.heads], -1)

    cm, report = compiled(Heads().eval(), torch.randn(2, 5, 16))
    grouped = shared_kernels(report)
    assert len(grouped) == 6 and all(k.source.count("tl.dot(") == 3 for k in grouped), report


@pytest.mark.cpu
def test_a_product_sized_by_item_runs_after_the_item():
    """The second product's width comes from .item(): it cannot launch before that extern."""

    def fn(x, w1, w2, n):
        a = x @ w1
        k = n.item()
        torch._check(k >= 1)
        torch._check(k <= w2.shape[1])
        return a, x @ w2[:, :k]

    args = torch.randn(6, 8), torch.randn(8, 5), torch.randn(8, 7), torch.tensor(3)
    cm = check(fn, *args)
    assert not shared_kernels(gjit.explain(cm, *args))


@pytest.mark.compile_only
def test_each_products_loop_goes_straight_from_async_copies_to_the_dot():
    """Every branch's k loop is pipelined as a lone template's is (tests/test_compile_only.py):
    16-bit tiles copied asynchronously into shared memory and read there by wgmma."""
    from gjit.codegen.toolchain.compile_only import compile_kernel

    model = Projections(128, 128, 64, bias=True, norm=False).eval().half()
    x = torch.randn(2, 32, 128, dtype=torch.float16)
    cm, _ = compiled(model, x)
    program = cm.entries[-1].program
    (kernel,) = program.kernels
    divisible = tuple(str(s) for s in kernel.size_args)
    ttgir = compile_kernel(kernel, program.graph.kernel_paths[kernel.name], divisible=divisible).asm["ttgir"]
    loops = [body[: body.index("scf.yield")] for body in ttgir.split("scf.for")[1:]]
    assert len(loops) == 3, ttgir
    for loop in loops:
        assert loop.count("async_copy_global_to_local") >= 2 and "warp_group_dot" in loop
        assert "ttg.local_load" not in loop and "ttg.local_alloc" not in loop
