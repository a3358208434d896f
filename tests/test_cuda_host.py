"""Hand-written CUDA C kernels (CUDA_PRELUDE + one kernel, the CUDA backend's conventions) run on
the CPU through gjit/runtime/host_emulation.py and match eager; the same sources compile with NVRTC for
sm_90 without spills."""

import math
import os
import threading

import pytest
import torch

import gjit
from gjit.kernels.cuda_prelude import CUDA_PRELUDE
from gjit.runtime.host_emulation import HostCompileError, HostKernelError, host_kernel, host_kernels

SIN = """
extern "C" __global__ void __launch_bounds__(256) gjit_poi_fused_sin_add_0(const float* __restrict__ in_ptr0,
        float* __restrict__ out_ptr0, long long xnumel) {
    for (long long xindex = (long long)blockIdx.x * blockDim.x + threadIdx.x; xindex < xnumel;
         xindex += (long long)blockDim.x * gridDim.x) {
        float tmp0 = in_ptr0[xindex];
        float tmp1 = sinf(tmp0);
        out_ptr0[xindex] = tmp1 + tmp0;
    }
}
"""

# float -> half / bfloat16 and back, and half / bfloat16 loads computed in float and stored.
CONVERT = """
extern "C" __global__ void __launch_bounds__(256) gjit_poi_convert_0(const float* __restrict__ in_ptr0,
        const __half* __restrict__ in_ptr1, const __nv_bfloat16* __restrict__ in_ptr2,
        __half* __restrict__ out_ptr0, __nv_bfloat16* __restrict__ out_ptr1, float* __restrict__ out_ptr2,
        float* __restrict__ out_ptr3, __half* __restrict__ out_ptr4, __nv_bfloat16* __restrict__ out_ptr5,
        long long xnumel) {
    for (long long xindex = (long long)blockIdx.x * blockDim.x + threadIdx.x; xindex < xnumel;
         xindex += (long long)blockDim.x * gridDim.x) {
        float tmp0 = in_ptr0[xindex];
        out_ptr0[xindex] = __float2half_rn(tmp0);
        out_ptr1[xindex] = __float2bfloat16_rn(tmp0);
        float tmp1 = __half2float(in_ptr1[xindex]);
        float tmp2 = __bfloat162float(in_ptr2[xindex]);
        out_ptr2[xindex] = tmp1;
        out_ptr3[xindex] = tmp2;
        out_ptr4[xindex] = __float2half_rn(tmp1 * 2.5f + 0.25f);
        out_ptr5[xindex] = __float2bfloat16_rn(tmp2 * 2.5f + 0.25f);
    }
}
"""


def row_reduce(name: str, t: str, op: str, identity: str) -> str:
    """One block per row (grid-stride over rows); each thread folds 4 strided elements at a time."""
    return f"""
extern "C" __global__ void __launch_bounds__(1024) {name}(const {t}* __restrict__ in_ptr0,
        {t}* __restrict__ out_ptr0, long long rows, long long rnumel) {{
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {{
        {t} vals[4] = {{{identity}, {identity}, {identity}, {identity}}};
        for (long long r0 = threadIdx.x; r0 < rnumel; r0 += 4LL * blockDim.x) {{
            for (int k = 0; k < 4; ++k) {{
                long long r = r0 + (long long)k * blockDim.x;
                if (r < rnumel) vals[k] = {op}()(vals[k], in_ptr0[row * rnumel + r]);
            }}
        }}
        {t} acc = {op}()({op}()(vals[0], vals[1]), {op}()(vals[2], vals[3]));
        acc = gjit_block_reduce(acc, {op}(), ({t})({identity}));
        if (threadIdx.x == 0) out_ptr0[row] = acc;
    }}
}}
"""


ARGMAX = """
extern "C" __global__ void __launch_bounds__(1024) gjit_red_argmax_0(const float* __restrict__ in_ptr0,
        long long* __restrict__ out_ptr0, long long rows, long long rnumel) {
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        float best = -GJIT_INFF;
        long long best_index = 0x7fffffffffffffffLL;
        for (long long r = threadIdx.x; r < rnumel; r += blockDim.x) {
            float v = in_ptr0[row * rnumel + r];
            if (gjit_arg_better(v, r, best, best_index, true)) { best = v; best_index = r; }
        }
        long long index = gjit_block_argreduce(best, best_index, true, -GJIT_INFF);
        if (threadIdx.x == 0) out_ptr0[row] = index;
    }
}
"""

MATH = """
extern "C" __global__ void __launch_bounds__(256) gjit_poi_erfinv_rsqrt_0(const float* __restrict__ in_ptr0,
        float* __restrict__ out_ptr0, float* __restrict__ out_ptr1, long long xnumel) {
    for (long long xindex = (long long)blockIdx.x * blockDim.x + threadIdx.x; xindex < xnumel;
         xindex += (long long)blockDim.x * gridDim.x) {
        float tmp0 = in_ptr0[xindex];
        out_ptr0[xindex] = erfinvf(tmp0);
        out_ptr1[xindex] = rsqrtf(fabsf(tmp0));
    }
}
"""

SHUFFLE = """
extern "C" __global__ void __launch_bounds__(128) gjit_test_shuffle_0(float* __restrict__ out_ptr0,
        long long* __restrict__ out_ptr1, double* __restrict__ out_ptr2) {
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const float v = (float)t;
    out_ptr0[3 * t + 0] = __shfl_down_sync(0xffffffffu, v, 1);
    out_ptr0[3 * t + 1] = __shfl_down_sync(0xffffffffu, v, 5);
    out_ptr0[3 * t + 2] = __shfl_down_sync(0xffffffffu, v, 16);
    out_ptr1[t] = __shfl_down_sync(0xffffffffu, t * 1000000007LL, 31);
    out_ptr2[t] = __shfl_down_sync(0xffffffffu, (double)t / 3.0, 2);
}
"""

POINTWISE = [("in_ptr0", "const float*"), ("out_ptr0", "float*"), ("xnumel", "long long")]
CONVERT_PARAMS = [
    ("in_ptr0", "const float*"),
    ("in_ptr1", "const __half*"),
    ("in_ptr2", "const __nv_bfloat16*"),
    ("out_ptr0", "__half*"),
    ("out_ptr1", "__nv_bfloat16*"),
    ("out_ptr2", "float*"),
    ("out_ptr3", "float*"),
    ("out_ptr4", "__half*"),
    ("out_ptr5", "__nv_bfloat16*"),
    ("xnumel", "long long"),
]


def reduce_params(t: str, out: str | None = None) -> list[tuple[str, str]]:
    return [
        ("in_ptr0", f"const {t}*"),
        ("out_ptr0", f"{out or t}*"),
        ("rows", "long long"),
        ("rnumel", "long long"),
    ]


ERFINV_PARAMS = [
    ("in_ptr0", "const float*"),
    ("out_ptr0", "float*"),
    ("out_ptr1", "float*"),
    ("xnumel", "long long"),
]
SHUFFLE_PARAMS = [("out_ptr0", "float*"), ("out_ptr1", "long long*"), ("out_ptr2", "double*")]

# name -> (kernel source after the prelude, params)
KERNELS = {
    "gjit_poi_fused_sin_add_0": (SIN, POINTWISE),
    "gjit_poi_convert_0": (CONVERT, CONVERT_PARAMS),
    "gjit_red_sum_f32_0": (
        row_reduce("gjit_red_sum_f32_0", "float", "GjitSum", "0.0f"),
        reduce_params("float"),
    ),
    "gjit_red_sum_i64_0": (
        row_reduce("gjit_red_sum_i64_0", "long long", "GjitSum", "0"),
        reduce_params("long long"),
    ),
    "gjit_red_max_f32_0": (
        row_reduce("gjit_red_max_f32_0", "float", "GjitMax", "-GJIT_INFF"),
        reduce_params("float"),
    ),
    "gjit_red_argmax_0": (ARGMAX, reduce_params("float", "long long")),
    "gjit_poi_erfinv_rsqrt_0": (MATH, ERFINV_PARAMS),
    "gjit_test_shuffle_0": (SHUFFLE, SHUFFLE_PARAMS),
}


def run(name: str, grid: int, block: int, args: list) -> None:
    source, params = KERNELS[name]
    host_kernel(CUDA_PRELUDE + source, name, params)(grid, block, args)


# Rows x row length, grid, block: rows not a multiple of the grid, rows shorter than the block,
# long rows, and blocks of 32 / 128 / 1024 threads.
REDUCE_SHAPES = [(7, 1000, 3, 128), (5, 20, 5, 128), (3, 5000, 2, 1024), (33, 77, 10, 32), (4, 1, 4, 32)]
REDUCE_IDS = [f"{r}x{n}_grid{g}_block{b}" for r, n, g, b in REDUCE_SHAPES]


@pytest.mark.cpu
def test_shfl_down_returns_the_callers_value_past_the_warp():
    grid, block = 3, 128
    t = torch.arange(grid * block)
    out = [
        torch.empty(3 * t.numel()),
        torch.empty(t.numel(), dtype=torch.int64),
        torch.empty(t.numel(), dtype=torch.float64),
    ]
    run("gjit_test_shuffle_0", grid, block, out)

    def shfl_down(values: torch.Tensor, delta: int) -> torch.Tensor:
        source = torch.where(t % 32 + delta < 32, t + delta, t)
        return values[source]

    expected = torch.stack([shfl_down(t.float(), d) for d in (1, 5, 16)], 1).flatten()
    assert torch.equal(out[0], expected)
    assert torch.equal(out[1], shfl_down(t * 1000000007, 31))
    assert torch.equal(out[2], shfl_down(t.double() / 3.0, 2))


@pytest.mark.cpu
def test_pointwise_sin_grid_stride():
    x = torch.randn(10_000) * 10
    out = torch.full_like(x, float("nan"))
    run("gjit_poi_fused_sin_add_0", 7, 256, [x, out, x.numel()])  # 7 blocks: every thread strides
    torch.testing.assert_close(out, torch.sin(x) + x, rtol=1e-6, atol=1e-6)


def float_cases() -> torch.Tensor:
    """Every 16-bit float value, the midpoints between neighbours (ties), the overflow edge,
    specials and random float32 bit patterns (NaN payloads, subnormals)."""
    half_values = (
        torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16).double()
    )
    bf16_values = (
        torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).double()
    )
    ties = []
    for values in (half_values, bf16_values):
        finite = values[values.isfinite()].unique()
        ties.append(((finite[1:] + finite[:-1]) / 2).float())
    specials = torch.tensor(
        [0.0, -0.0, math.inf, -math.inf, math.nan, 65504.0, 65519.99, 65520.0, 65536.0, 2.0**-24, 2.0**-25,
         3 * 2.0**-26, 2.0**-14, 2.0**-149, 3.0e38, 3.4028235e38],
        dtype=torch.float64,
    ).float()  # fmt: skip
    random_bits = (
        torch.randint(-(2**31), 2**31, (200_000,), dtype=torch.int64).to(torch.int32).view(torch.float32)
    )
    cases = torch.cat([half_values.float(), bf16_values.float(), *ties, specials, -specials, random_bits])
    return cases


def assert_same_bits(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Bit-identical, except that any NaN matches any NaN (CUDA's canonical NaN is 0x7fff)."""
    assert torch.equal(ours.isnan(), theirs.isnan())
    keep = ~theirs.isnan()
    bits = torch.int16 if ours.element_size() == 2 else torch.int32
    mismatch = (ours[keep].view(bits) != theirs[keep].view(bits)).nonzero()
    assert mismatch.numel() == 0, (
        f"{mismatch.numel()} mismatches, first at {theirs[keep][mismatch[0]].item()}"
    )


@pytest.mark.cpu
def test_half_and_bfloat16_conversions_match_torch_bit_for_bit():
    x = float_cases()
    n = x.numel()
    h = torch.randint(-(2**15), 2**15, (n,), dtype=torch.int32).to(torch.int16).view(torch.float16)
    b = torch.randint(-(2**15), 2**15, (n,), dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    h[: 2**16] = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    b[: 2**16] = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    outs = [torch.empty(n, dtype=d) for d in (torch.float16, torch.bfloat16, torch.float32, torch.float32)]
    outs += [torch.empty(n, dtype=torch.float16), torch.empty(n, dtype=torch.bfloat16)]
    run("gjit_poi_convert_0", 64, 256, [x, h, b, *outs, n])
    assert_same_bits(outs[0], x.half())
    assert_same_bits(outs[1], x.bfloat16())
    assert_same_bits(outs[2], h.float())
    assert_same_bits(outs[3], b.float())
    assert_same_bits(outs[4], (h.float() * 2.5 + 0.25).half())
    assert_same_bits(outs[5], (b.float() * 2.5 + 0.25).bfloat16())


@pytest.mark.cpu
@pytest.mark.parametrize("rows, rnumel, grid, block", REDUCE_SHAPES, ids=REDUCE_IDS)
def test_row_sum_float_and_int64(rows, rnumel, grid, block):
    x = torch.randn(rows, rnumel)
    out = torch.full((rows,), float("nan"))
    run("gjit_red_sum_f32_0", grid, block, [x, out, rows, rnumel])
    torch.testing.assert_close(out, x.double().sum(1).float(), rtol=1e-5, atol=1e-4)
    i = torch.randint(-(2**40), 2**40, (rows, rnumel))
    out_i = torch.zeros(rows, dtype=torch.int64)
    run("gjit_red_sum_i64_0", grid, block, [i, out_i, rows, rnumel])
    assert torch.equal(out_i, i.sum(1))


@pytest.mark.cpu
@pytest.mark.parametrize("rows, rnumel, grid, block", REDUCE_SHAPES, ids=REDUCE_IDS)
def test_row_max_and_argmax_propagate_nan_and_take_the_first_tie(rows, rnumel, grid, block):
    x = torch.randint(-5, 6, (rows, rnumel)).float()  # many ties
    x[0, -1] = math.nan
    x[rows // 2, rnumel // 2] = math.nan
    x[rows // 2, rnumel - 1] = math.nan
    x[-1] = -math.inf
    out = torch.zeros(rows)
    run("gjit_red_max_f32_0", grid, block, [x, out, rows, rnumel])
    torch.testing.assert_close(out, x.amax(1), equal_nan=True, rtol=0, atol=0)
    index = torch.full((rows,), -1, dtype=torch.int64)
    run("gjit_red_argmax_0", grid, block, [x, index, rows, rnumel])
    assert torch.equal(index, x.argmax(1))


@pytest.mark.cpu
def test_erfinvf_and_rsqrtf_are_as_close_to_float64_as_torch():
    y = torch.cat(
        [torch.rand(20_000) * 2 - 1, torch.tensor([0.0, -0.0, 1.0, -1.0, 1.5, math.nan, 1e-30, 2e-45])]
    )
    y = torch.cat([y, 1 - torch.rand(2000) * 1e-6, torch.tensor([1 - 2.0**-24, -1 + 2.0**-24])])
    out_erfinv, out_rsqrt = torch.empty_like(y), torch.empty_like(y)
    run("gjit_poi_erfinv_rsqrt_0", 16, 256, [y, out_erfinv, out_rsqrt, y.numel()])
    for ours, theirs, exact in [
        (out_erfinv, torch.erfinv(y), torch.erfinv(y.double())),
        (out_rsqrt, torch.rsqrt(y.abs()), torch.rsqrt(y.abs().double())),
    ]:
        assert torch.equal(ours.isnan(), theirs.isnan())
        assert torch.equal(ours.isinf(), theirs.isinf())
        finite = theirs.isfinite()
        error = ((ours[finite].double() - exact[finite]) / exact[finite].abs().clamp_min(1e-30)).abs()
        torch_error = ((theirs[finite].double() - exact[finite]) / exact[finite].abs().clamp_min(1e-30)).abs()
        assert error.max() <= max(torch_error.max().item(), 2**-24)


@pytest.mark.cpu
def test_many_blocks_finish_quickly():
    rows, rnumel = 2000, 100
    x = torch.randn(rows, rnumel)
    out = torch.empty(rows)
    run("gjit_red_sum_f32_0", rows, 128, [x, out, rows, rnumel])
    torch.testing.assert_close(out, x.double().sum(1).float(), rtol=1e-5, atol=1e-4)


MISUSE = """
extern "C" __global__ void gjit_test_misuse_0(float* __restrict__ out_ptr0, int mode) {
    if (mode == 0) {
        if (threadIdx.x >= 40) return;  // warps 1.. leave before the shuffles and barrier of the others
        float v = gjit_block_reduce(1.0f, GjitSum(), 0.0f);
        if (threadIdx.x == 0) out_ptr0[blockIdx.x] = v;
    } else if (mode == 1) {
        if (threadIdx.x & 1) __syncthreads();
        else out_ptr0[0] = __shfl_down_sync(0xffffffffu, 1.0f, 1);
    } else if (mode == 2) {
        if (threadIdx.x < 32) __syncthreads();
        else __syncthreads();
    } else {
        out_ptr0[0] = __shfl_down_sync(0xffffu, 1.0f, 1);
    }
}
"""


@pytest.mark.cpu
def test_misuse_of_barriers_and_shuffles_raises():
    kernel = host_kernel(
        CUDA_PRELUDE + MISUSE, "gjit_test_misuse_0", [("out_ptr0", "float*"), ("mode", "int")]
    )
    messages = [
        r"divergent __shfl_\*_sync: 24 of 32 threads returned",
        r"deadlock: 32 of 64 threads wait at __syncthreads \(line \d+\); 16 of 32 threads wait at __shfl",
        r"__syncthreads at line \d+ while other threads wait at line \d+",
        r"partial mask",
    ]
    for mode, message in enumerate(messages):
        with pytest.raises(HostKernelError, match=message):
            kernel(2, 64, [torch.zeros(2), mode])


ASSERTS = """
extern "C" __global__ void gjit_test_assert_0(float* __restrict__ out_ptr0, int bad) {
    GJIT_ASSERT(threadIdx.x != bad && "thread says no");
    __syncthreads();  // the threads before the failing one wait here when it fails
    out_ptr0[blockIdx.x * blockDim.x + threadIdx.x] = 1.0f;
}
"""


@pytest.mark.cpu
def test_a_failed_device_assert_fails_the_launch_and_the_next_one_runs():
    """GJIT_ASSERT (the prelude's device assert) stops the launch with its text, the threads
    waiting at a barrier included; the next launch of the kernel runs whole."""
    kernel = host_kernel(
        CUDA_PRELUDE + ASSERTS, "gjit_test_assert_0", [("out_ptr0", "float*"), ("bad", "int")]
    )
    out = torch.zeros(2 * 64)
    with pytest.raises(HostKernelError, match='thread 40: .*threadIdx.x != bad && "thread says no"'):
        kernel(2, 64, [out, 40])
    out.zero_()
    kernel(2, 64, [out, -1])
    assert out.eq(1).all()


@pytest.mark.cpu
def test_host_compile_error_and_wrong_params_raise():
    source = CUDA_PRELUDE + SIN.replace("tmp1 + tmp0", "tmp1 + tmp2")
    with pytest.raises(HostCompileError, match="tmp2") as error:
        host_kernel(source, "gjit_poi_fused_sin_add_0", POINTWISE)
    line = next(n for n, text in enumerate(source.splitlines(), 1) if "tmp2" in text)
    assert f"gjit_poi_fused_sin_add_0.cu:{line}:" in str(error.value) and f"{line:4d}  " in str(error.value)
    with pytest.raises(HostCompileError, match="parameters differ"):
        host_kernel(CUDA_PRELUDE + SIN, "gjit_poi_fused_sin_add_0", [*POINTWISE[:2], ("xnumel", "int")])
    kernel = host_kernel(CUDA_PRELUDE + SIN, "gjit_poi_fused_sin_add_0", POINTWISE)
    with pytest.raises(TypeError, match="torch.float32"):
        kernel(1, 32, [torch.zeros(4, dtype=torch.float64), torch.zeros(4), 4])


SHARED_OVER_LIMIT = """
extern "C" __global__ void gjit_test_shared_0(float* __restrict__ out_ptr0) {
    GJIT_SHARED(float, gjit_small, 10000);
    GJIT_SHARED(float, gjit_large, 4000);  // 56000 bytes in all
    gjit_small[threadIdx.x] = 1.0f;
    gjit_large[threadIdx.x] = 2.0f;
    __syncthreads();
    out_ptr0[threadIdx.x] = gjit_small[threadIdx.x] + gjit_large[threadIdx.x];
}
"""


@pytest.mark.cpu
def test_shared_memory_over_48k_raises_at_every_launch():
    kernel = host_kernel(CUDA_PRELUDE + SHARED_OVER_LIMIT, "gjit_test_shared_0", [("out_ptr0", "float*")])
    for _ in range(2):
        with pytest.raises(HostKernelError, match="shared memory over 49152 bytes at gjit_large"):
            kernel(2, 32, [torch.zeros(32)])


@pytest.mark.cpu
def test_call_to_an_undefined_function_fails_at_compile_time():
    source = CUDA_PRELUDE + "float gjit_nowhere(float);\n" + SIN.replace("sinf(tmp0)", "gjit_nowhere(tmp0)")
    with pytest.raises(HostCompileError, match="undefined reference to `gjit_nowhere"):
        host_kernel(source, "gjit_poi_fused_sin_add_0", POINTWISE)


@pytest.mark.cpu
def test_kernels_of_a_cache_dir_share_one_runtime_and_header(tmp_path):
    kernels = {}
    with gjit.config.scope(cache_dir=str(tmp_path)):
        for name in ("gjit_poi_fused_sin_add_0", "gjit_red_sum_f32_0"):
            source = CUDA_PRELUDE + f"// {tmp_path}\n" + KERNELS[name][0]  # not compiled before
            kernels[name] = host_kernel(source, name, KERNELS[name][1])
    x = torch.randn(3, 500)
    out = torch.empty(3)
    kernels["gjit_red_sum_f32_0"](2, 64, [x, out, 3, 500])
    torch.testing.assert_close(out, x.double().sum(1).float(), rtol=1e-5, atol=1e-4)
    files = sorted(os.listdir(tmp_path / "cuda_host"))
    assert len([f for f in files if f.startswith("gjit_host_runtime-")]) == 1, files
    assert len([f for f in files if f.endswith(".so")]) == 3, files  # the runtime and two kernels
    (header,) = [f for f in files if f.startswith("header-")]
    assert sorted(os.listdir(tmp_path / "cuda_host" / header)) == ["gjit_host.h", "gjit_host.h.gch"]


@pytest.mark.cpu
def test_kernels_built_together_are_one_shared_object(tmp_path):
    """A program's kernels are one g++ run: the prelude's include guard keeps one copy, every
    kernel keeps its own launcher, and an error shows the source of the kernel it is in."""
    names = ["gjit_poi_fused_sin_add_0", "gjit_red_sum_f32_0", "gjit_red_argmax_0"]
    specs = [(CUDA_PRELUDE + f"// {tmp_path}\n" + KERNELS[n][0], n, KERNELS[n][1]) for n in names]
    with gjit.config.scope(cache_dir=str(tmp_path)):
        sin, total, argmax = host_kernels(specs)
        broken = [specs[0], (specs[1][0].replace("GjitSum()", "GjitSun()"), *specs[1][1:])]
        with pytest.raises(HostCompileError, match="GjitSun") as error:
            host_kernels(broken)
    so = [f for f in os.listdir(tmp_path / "cuda_host") if f.endswith(".so")]
    assert len(so) == 2, so  # the runtime and the three kernels
    assert "gjit_red_sum_f32_0.cu:" in str(error.value) and "gjit_poi_fused_sin_add_0.cu:" not in str(
        error.value
    )
    x = torch.randn(6, 300)
    out, sums, index = torch.full_like(x, float("nan")), torch.empty(6), torch.empty(6, dtype=torch.int64)
    sin(3, 64, [x, out, x.numel()])
    total(2, 64, [x, sums, 6, 300])
    argmax(2, 128, [x, index, 6, 300])
    torch.testing.assert_close(out, torch.sin(x) + x)
    torch.testing.assert_close(sums, x.double().sum(1).float(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(index, x.argmax(1))


@pytest.mark.cpu
def test_launches_at_once_from_two_threads_are_independent():
    misuse = host_kernel(
        CUDA_PRELUDE + MISUSE, "gjit_test_misuse_0", [("out_ptr0", "float*"), ("mode", "int")]
    )
    x = torch.randn(3, 2000)
    outs = [torch.empty(3) for _ in range(4)]
    errors = []

    def fail() -> None:
        for _ in range(4):
            with pytest.raises(HostKernelError, match="partial mask"):
                misuse(4, 64, [torch.zeros(4), 3])

    def reduce(out: torch.Tensor) -> None:
        try:
            run("gjit_red_sum_f32_0", 3, 256, [x, out, 3, 2000])
        except Exception as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=reduce, args=(out,)) for out in outs]
    for t in threads:
        t.start()
    fail()
    for t in threads:
        t.join()
    assert errors == []
    for out in outs:
        torch.testing.assert_close(out, x.double().sum(1).float(), rtol=1e-5, atol=1e-4)


@pytest.mark.compile_only
@pytest.mark.parametrize("name", list(KERNELS), ids=list(KERNELS))
def test_kernels_compile_with_nvrtc_without_spills(name):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from gjit.codegen.toolchain.nvrtc import compile_cuda, resource_usage

    binary = compile_cuda(CUDA_PRELUDE + KERNELS[name][0], name, arch=90)
    assert ".target sm_90" in binary.ptx and f".entry {name}(" in binary.ptx
    assert binary.cubin[:4] == b"\x7fELF"
    usage = resource_usage(binary)
    assert usage["spill_stores"] == 0 and usage["spill_loads"] == 0 and usage["stack"] == 0, usage
    assert 0 < usage["registers"] <= 255


@pytest.mark.compile_only
def test_nvrtc_error_has_log_and_numbered_source():
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from gjit.codegen.toolchain.nvrtc import CudaCompileError, compile_cuda

    source = CUDA_PRELUDE + SIN.replace("float tmp1 = sinf(tmp0);", "float tmp1 = sinf(tmp0)")
    with pytest.raises(CudaCompileError) as error:
        compile_cuda(source, "gjit_poi_fused_sin_add_0")
    message = str(error.value)
    line = next(n for n, text in enumerate(source.splitlines(), 1) if "sinf(tmp0)" in text)
    assert 'error: expected a ";"' in message
    assert f"{line:4d}          float tmp1 = sinf(tmp0)" in message
