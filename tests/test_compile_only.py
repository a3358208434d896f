"""Generated kernels are real GPU code: each compiles for sm_90 (PTX and cubin) without a GPU."""

import re

import pytest
import torch
import torch.nn.functional as F

import gjit
from gjit.codegen.toolchain.compile_only import compile_kernel
from helpers import check
from test_fusion import ResidualMLP, ten_op_chain

pytestmark = pytest.mark.compile_only


def kernels_of(cm, *args):
    program = cm.entries[-1].program
    return [(k, program.graph.kernel_paths[k.name]) for k in program.kernels]


CASES = {
    "ten_op_chain": (ten_op_chain, lambda: (torch.randn(33, 17), torch.randn(17))),
    "transpose_add": (lambda x: x.t() + 1, lambda: (torch.randn(8, 16),)),
    "cat_where": (
        lambda a, b: torch.where(torch.cat([a, b], 1) > 0, a.sum() * 0 + 1.0, F.gelu(torch.cat([a, b], 1))),
        lambda: (torch.randn(4, 3), torch.randn(4, 5)),
    ),
    "libdevice_math": (
        lambda x: torch.tanh(x) + torch.expm1(x) + torch.log1p(x.abs()) + x.pow(2.5).nan_to_num(),
        lambda: (torch.randn(64),),
    ),
    "special_functions": (
        lambda x: (
            torch.digamma(x)
            + torch.polygamma(1, x)
            + torch.polygamma(2, x)
            + torch.special.zeta(x.abs() + 1, 2.0),
            torch.special.bessel_j0(x) + torch.special.i1(x) + torch.special.erfcx(x) + torch.lgamma(x),
            torch.special.ndtri(x.sigmoid()) + torch.hypot(x, 2 * x) + torch.nextafter(x, x + 1),
        ),
        lambda: (torch.randn(64),),
    ),
    "bessel_series": (
        lambda x: (
            torch.special.i1e(x) * torch.special.modified_bessel_k0(x.abs())
            + torch.special.spherical_bessel_j0(x)
        ),
        lambda: (torch.randn(64) * 5,),
    ),
    "orthogonal_polynomials": (  # loops over the block's largest degree, float64 steps rounded
        lambda x, n: (
            torch.special.chebyshev_polynomial_w(x, n),
            torch.special.hermite_polynomial_h(x.double(), n),
            torch.special.shifted_chebyshev_polynomial_u(x, 3),
        ),
        lambda: (torch.rand(64), torch.randint(0, 12, (64,))),
    ),
    "casts_fp16_bf16_int": (
        lambda x, i: ((x.half() * 2).to(torch.bfloat16), (i // 3 + (i % 5)).float() + x),
        lambda: (torch.randn(40), torch.randint(-50, 50, (40,))),
    ),
    "residual_mlp": (ResidualMLP().eval(), lambda: (torch.randn(2, 5, 32),)),
    "writes_through_indices": (  # atomics of every dtype that has them, and plain stores
        lambda x, i, s: (
            x.scatter_add(0, i, s),
            x.double().scatter_reduce(0, i, s.double(), "amax", include_self=False),
            torch.index_put(x.long(), (i[:, 0],), s.long(), accumulate=True),
            x.int().scatter_reduce(0, i, s.int(), "amin"),
            x.half().scatter(0, i[:1], 2.0),
        ),
        lambda: (torch.randn(5, 4), torch.randint(0, 5, (9, 4)), torch.randn(9, 4)),
    ),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_kernels_compile_for_sm90(case):
    fn, make_args = CASES[case]
    args = make_args()
    with torch.no_grad():
        cm = check(fn, *args)
    compiled = kernels_of(cm, *args)
    assert compiled, "expected at least one kernel"
    for kernel, path in compiled:
        binary = compile_kernel(kernel, path)
        assert ".target sm_90" in binary.asm["ptx"], kernel.name
        assert binary.asm["cubin"], kernel.name


def test_contiguous_fp32_kernel_uses_vector_loads():
    x, y = torch.randn(64, 128), torch.randn(64, 128)
    cm = gjit.compile(lambda a, b: (a * b + 1).relu())
    with gjit.config.scope(interpret=True):
        cm(x, y)
    ((kernel, path),) = kernels_of(cm, x, y)
    ptx = compile_kernel(kernel, path).asm["ptx"]
    assert "ld.global.v4" in ptx, "expected 128-bit vector loads for contiguous fp32 data"
    scalar = compile_kernel(kernel, path, aligned=False).asm["ptx"]
    assert "ld.global.v4" not in scalar  # the 16-divisibility specialization is what enables them


def test_a_size_argument_equal_to_1_compiles_for_sm90():
    """On a GPU, Triton's launcher passes an integer argument equal to 1 as the constant 1 (a
    Python int inside the kernel, which has no .to()): a mean over a dynamic row of length 1."""
    fn = lambda x: x - x.mean(-1, keepdim=True)  # noqa: E731
    x = torch.randn(6, 5)
    cm = gjit.compile(fn, dynamic=True)
    check(cm, x)
    for kernel, path in kernels_of(cm, x):
        sizes = tuple(str(s) for s in kernel.size_args)
        assert sizes, kernel.name
        assert compile_kernel(kernel, path, ones=sizes).asm["cubin"], kernel.name


def test_a_debug_kernel_keeps_its_bounds_asserts_and_wraps_integers_as_eager():
    """gjit.config.debug builds kernels that gather with debug=True, for their bounds asserts.
    Triton's debug mode also checks every int32 add and multiply for overflow, and a product that
    wraps, as eager's does, would fail that assert on the card: a debug kernel is launched and
    built without the overflow checks (gjit.config.debug's bounds asserts kept)."""
    big = torch.full((37,), 2**30, dtype=torch.int32) + torch.arange(37, dtype=torch.int32)
    ids = torch.randint(0, 37, (37,))
    with gjit.config.scope(debug=True):
        cm = check(lambda x, i: x[i] * 3 + x, big, ids, kernels=1)
    ((kernel, path),) = kernels_of(cm, big, ids)
    assert kernel.debug and kernel.launch_options()["sanitize_overflow"] is False
    assert "sanitize_overflow=False" in cm.entries[-1].program.graph.wrapper_source
    ttir = compile_kernel(kernel, path).asm["ttir"]
    assert "index out of bounds" in ttir
    assert "overflow detected" not in ttir


def _loop_ops(kernel, path, divisible):
    """Op counts in the body of the kernel's (first) loop, in Triton's GPU IR for sm_90."""
    ttgir = compile_kernel(kernel, path, divisible=divisible).asm["ttgir"]
    loop = ttgir[ttgir.index("scf.for") :]
    loop = loop[: loop.index("scf.yield")]
    ops = ("ttg.local_load", "ttg.local_alloc", "async_copy_global_to_local", "warp_group_dot")
    return {op: loop.count(op) for op in ops}


@pytest.mark.parametrize("case", ["linear", "sdpa"])
def test_template_operands_go_straight_from_async_copies_to_the_dot(case):
    """A 16-bit operand tile that is a plain load takes zeros where it is masked (other=0.0):
    Triton copies it into shared memory asynchronously, pipelined, and wgmma reads it there. A
    tl.where on the loaded tile would cost a shared -> register -> shared round trip per step.
    Sizes are multiples of 16 here, as Triton's launcher sees most model dims on a GPU."""
    half = dict(dtype=torch.float16)
    if case == "linear":
        fn, args = F.linear, (torch.randn(64, 128, **half), torch.randn(256, 128, **half))
    else:
        fn = F.scaled_dot_product_attention
        args = tuple(torch.randn(2, 2, 64, 64, **half) for _ in range(3))
    cm = gjit.compile(fn)
    check(cm, *args)
    ((kernel, path),) = kernels_of(cm, *args)
    ops = _loop_ops(kernel, path, divisible=tuple(str(s) for s in kernel.size_args))
    assert ops["async_copy_global_to_local"] >= 2 and ops["warp_group_dot"] >= 1, ops
    assert ops["ttg.local_load"] == 0 and ops["ttg.local_alloc"] == 0, ops


TILED_REDUCTIONS = {  # the bench's slow classes at their sizes: a sum over the first dim, long rows
    "sum_first": (lambda x: x.sum(0), (512, 8192)),
    "softmax_vocab": (lambda x: F.softmax(x, -1), (64, 32000)),
    "layer_norm_wide": (lambda x: F.layer_norm(x, (8192,)), (64, 8192)),
}


@pytest.mark.parametrize("case", list(TILED_REDUCTIONS))
def test_reduction_tiles_load_whole_vectors_without_spills(case, tmp_path):
    """The tile table's reductions for sm_90 (codegen/triton/tiles.py): every global load a 128-bit
    vector (a sum over the first dim reads across rows, each row a sector), no register spills."""
    from gjit.aot import build

    fn, shape = TILED_REDUCTIONS[case]
    x = torch.randn(*shape)
    cm = gjit.compile(fn, dynamic=False)
    gjit.explain(cm, x)  # codegen only: nothing runs
    program = cm.entries[-1].program
    (kernel,) = program.kernels
    binary = build(kernel, program.graph.kernel_paths[kernel.name], 90, str(tmp_path))
    assert binary.vector_loads and not binary.scalar_loads, binary
    assert "ld.global.v4" in open(binary.ptx_path).read()
    assert not binary.spills, binary


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_transposes_load_and_store_whole_vectors(dtype):
    """A 2-D tile (codegen/plan.py `tile_split`) reads the transposed input down its columns and
    stores across its rows, each a 128-bit vector; the layouts meet in shared memory."""
    x = torch.randn(8, 512, 384).to(dtype)
    cm = gjit.compile(lambda x: x.transpose(1, 2).contiguous(), dynamic=False)
    gjit.explain(cm, x)  # codegen only: nothing runs
    program = cm.entries[-1].program
    (kernel,) = program.kernels
    binary = compile_kernel(kernel, program.graph.kernel_paths[kernel.name])
    ptx = binary.asm["ptx"]
    loads = re.findall(r"\bld\.global[\w.]*", ptx)
    stores = re.findall(r"\bst\.global[\w.]*", ptx)
    assert loads and all(".v4." in op for op in loads), loads
    assert stores and all(".v4." in op for op in stores), stores
    assert binary.metadata.shared > 0
