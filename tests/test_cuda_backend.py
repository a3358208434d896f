"""backend="cupy": the Triton backend's op, view, reduction and model tests, run again with every
region emitted as CUDA C, plus what only this backend has.

No GPU here: each kernel runs on the host emulation of gjit/runtime/host_emulation.py (the same source
compiled as C++, a block's threads as fibers meeting at __syncthreads and warp shuffles), and
every kernel the model tests generate is compiled for sm_90 with NVRTC (`compile_only`).
The imported test functions are collected here too; the autouse fixture switches the backend
for them. GPU-only tests are marked `gpu` and skip without CUDA.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.nn.functional as F
from test_scatters import (  # noqa: F401
    test_a_write_past_the_callers_cache_fails_as_in_eager,
    test_index_put_accumulate_negative_and_broadcast_indices,
    test_masked_put_of_bools_and_uint8_masks_as_eager,
    test_nan_already_in_the_tensor_wins_as_in_eager,
    test_non_contiguous_empty_and_zero_d,
    test_ops_that_decompose_to_index_put,
    test_out_of_bounds_index_is_an_error_in_debug_mode,
    test_scatter_add_duplicates_every_atomic_dtype,
    test_scatter_reduce,
    test_scatter_reduce_integers,
    test_scatter_reduce_nan_and_inf_as_eager,
    test_scatter_src_and_value,
    test_setitem_on_a_fresh_tensor_writes_in_place,
    test_writes_through_indices_side_by_side_share_a_kernel,
    test_zero_d_target_is_bounds_checked,
)

import gjit
from gjit.runtime import cuda as runtime_cuda
from helpers import check, run_compiled
from model_zoo import MODELS
from test_indexing import (  # noqa: F401
    test_cross_entropy_gathers_from_the_logits_not_a_written_log_softmax,
    test_gathered_nodes_that_use_their_index_are_written_first,
)
from test_models import check_model
from test_pointwise_ops import (  # noqa: F401
    test_activation,
    test_bessel_float64_is_accurate,
    test_binary,
    test_bitwise,
    test_bool_ops,
    test_cast,
    test_cast_float_nan_inf,
    test_cast_to_half_rounds_through_float32,
    test_clamp,
    test_comparisons_convert_operands_to_their_common_dtype,
    test_constants,
    test_digamma_polygamma_zeta_are_accurate,
    test_digamma_polygamma_zeta_special_values_as_eager,
    test_float64,
    test_integer_division_signs,
    test_layouts,
    test_layouts_low_precision,
    test_ldexp_is_a_times_two_to_the_n,
    test_orthogonal_polynomials_as_eager,
    test_round_half_to_even,
    test_scalar_overloads,
    test_shifts,
    test_type_promotion,
    test_unary,
    test_where,
    test_where_broadcast_and_nan,
)
from test_reductions import (  # noqa: F401
    test_adaptive_pooling_has_a_window_per_output_element,
    test_argmax_argmin_tie_break_and_nan_like_eager,
    test_group_norm_statistics_per_group_of_channels,
    test_looped_rows_fold_the_second_level_into_the_first_pass,
    test_low_precision_accumulates_in_float32,
    test_max_min_of_everything_and_reductions_of_a_0d_tensor,
    test_max_pool2d_with_its_indices_used_is_an_extern,
    test_nan_and_large_inputs,
    test_normalizations_are_one_kernel,
    test_odd_sizes,
    test_online_softmax_and_welford_at_edge_values,
    test_pooling_is_one_kernel_with_its_prologue,
    test_reduction,
    test_softmax_is_stable_for_large_inputs,
    test_vector_norm,
    test_welford_only_for_the_row_mean_and_without_overflow,
)
from test_scans import (  # noqa: F401
    test_cummax_cummin_values_and_latest_indices,
    test_scan,
    test_scan_dtypes_accumulate_as_eager,
    test_scan_layouts_and_edge_sizes,
    test_scan_nan_and_inf_as_eager,
    test_scan_sizes_are_dynamic,
)
from test_views import (  # noqa: F401
    test_cat,
    test_constant_pad_is_index_math,
    test_flip_reads_the_mirrored_index,
    test_nearest_upsampling_by_whole_factors_is_index_math,
    test_repeat_and_tile_read_the_input_modulo_its_size,
    test_view_chain,
    test_view_then_pointwise,
    test_writes_into_a_view_are_index_math,
)

pytestmark = [pytest.mark.cpu, pytest.mark.filterwarnings("ignore::RuntimeWarning")]


@pytest.fixture(autouse=True)
def cupy_backend():
    with gjit.config.scope(backend="cupy"):
        yield


@pytest.mark.compile_only
@pytest.mark.parametrize("name", list(MODELS))
def test_cuda_c_model_matches_eager_and_compiles_for_sm90_without_spills(name, record_property):
    """The model test of test_models.py on the host emulation, then every kernel of the same
    compiled model through NVRTC for sm_90: registers from ptxas, no spills."""
    cm, inputs = check_model(name, record_property)
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="the numerics passed; no NVRTC for sm_90")
    with torch.no_grad():
        report = gjit.aot(cm, *inputs, arch="sm_90")  # the entry the call made: nothing recompiles
    distinct = [k.name for k in cm.entries[0].program.kernels if k.code_of is None]  # layers share
    assert len(cm.entries) == 1 and [k.name for k in report.kernels] == distinct != []
    assert [k.name for k in report.kernels if k.spills] == []
    assert all(k.registers > 0 for k in report.kernels)


def cuda_kernels(cm: gjit.CompiledFunction) -> list:
    return [k for e in cm.entries for k in e.program.kernels]


# ----------------------------------------------------------------------------------------------
# What the CUDA C looks like
# ----------------------------------------------------------------------------------------------


def test_kernels_are_readable_cuda_c_with_the_triton_header():
    cm = check(lambda x, y: (x.sin() * y + 1).relu(), torch.randn(6, 10), torch.randn(10), kernels=1)
    (kernel,) = cuda_kernels(cm)
    assert kernel.backend == "cuda" and kernel.name == "gjit_poi_fused_sin_mul_add_relu_0"
    src = kernel.source
    assert src.startswith("// kernel: gjit_poi_fused_sin_mul_add_relu_0\n// fused ATen nodes:")
    assert "// user source:" in src and "test_cuda_backend.py" in src
    assert 'extern "C" __global__ void __launch_bounds__' in src
    assert "xindex += " in src and "gridDim.x" in src  # a grid-stride loop
    assert "sinf(" in src and "const float* __restrict__ in_ptr0" in src


def test_reduction_kernel_shapes_persistent_and_looped():
    x = torch.randn(5, 300)
    static = gjit.compile(lambda t: F.softmax(t, -1), dynamic=False)  # a row length known at compile time
    persistent = cuda_kernels(check(static, x, kernels=1))[0]
    assert persistent.persistent and "ld0[k]" in persistent.source
    assert persistent.source.count("gjit_block_reduce(") == 2  # the max, then the sum
    assert persistent.source.count("in_ptr0[") == 1  # the row is read once, kept in registers
    with gjit.config.scope(reduction="looped"):
        looped = cuda_kernels(check(gjit.compile(lambda t: F.softmax(t, -1), dynamic=False), x))[0]
    # one read per pass: the max and the sum (online softmax), then the output
    assert not looped.persistent and looped.source.count("in_ptr0[") == 2
    assert "gjit_online_sum_exp(" in looped.source
    # the byte model counts what the kernel reads from memory: the row once, or once per pass
    assert (persistent.bytes_read, looped.bytes_read) == (x.numel() * 4, 2 * x.numel() * 4)


def test_dynamic_rows_stay_persistent_until_the_guard_fails():
    cm = gjit.compile(lambda x: F.layer_norm(x, x.shape[-1:]) * 2)
    # rows shorter than a warp, between warps, one element per thread, several per thread
    for rows, cols in [(3, 40), (7, 40), (5, 90), (9, 700), (2, 1024), (4, 1)]:
        check(cm, torch.randn(rows, cols))
    assert len(cm.entries) == 2  # export specializes the row of 1
    kernel = cuda_kernels(cm)[0]
    assert "int rnumel" in kernel.source or "long long rnumel" in kernel.source
    # persistent for every row the guard admits: registers for the longest, threads sized at launch
    assert kernel.persistent and "ld0[4]" in kernel.source and "k * blockDim.x" in kernel.source
    assert "__launch_bounds__(256)" in kernel.source and "next_power_of_2(rnumel)" in str(
        kernel.launch_blocks
    )
    check(cm, torch.randn(3, 3000))  # past the registers: the guard fails, a looped kernel
    assert len(cm.entries) == 3 and not cm.entries[2].program.kernels[0].persistent


def test_a_programs_kernels_are_built_for_the_host_together(tmp_path):
    with gjit.config.scope(cache_dir=str(tmp_path)):
        # rows of the softmax (cos joins it), then columns: two kernels, one .so
        check(lambda t: (F.softmax(t, -1) * 2, t.sum(0), t.cos()), torch.randn(9, 40), kernels=2)
    so = [f for f in os.listdir(tmp_path / "cuda_host") if f.endswith(".so")]
    assert len(so) == 2, so  # the runtime and the program


def test_any_grid_is_correct(monkeypatch):
    """Kernels are grid-stride loops: a launch with fewer blocks than rows or elements is right."""
    x = torch.randn(37, 130)
    for grid in (1, 3, 64):
        monkeypatch.setattr(runtime_cuda, "HOST_GRID", grid)
        check(lambda t: (F.softmax(t, -1) + t.sin(), t.argmax(0)), x)


def test_masked_reads_of_cat_and_pad_stay_in_bounds():
    x, y = torch.randn(3, 5), torch.randn(3, 7)
    cm = check(lambda a, b: torch.cat([a.exp(), F.pad(b, (2, 1))], 1) * 2, x, y, kernels=1)
    assert "if (" in cuda_kernels(cm)[0].source


def test_negative_constants_under_unary_operators():
    """The fuzzer's find: abs / neg of a negative constant printed `--2LL`, which g++ rejects."""
    i, x = torch.randint(-5, 5, (4, 6)), torch.randn(4, 6)
    check(lambda t: (torch.full_like(t, -2).abs() + t, -torch.full_like(t, -3), ~torch.full_like(t, -4)), i)
    check(lambda t: (torch.sigmoid(torch.full_like(t, -1.5)) * t, -torch.full_like(t, float("-inf")) + t), x)


def test_persistent_registers_are_per_read_not_per_printed_offset():
    """Two gathers through different masked (cat) indices: a register array keyed by the offset's
    text once served the second gather the first one's values (masked temps print alike)."""
    fn = lambda w, a, b: (w[torch.cat([a, b], -1)] + 2 * w[torch.cat([(a + 1) % 50, b], -1)]).sum(-1)  # noqa: E731
    cm = gjit.compile(fn)
    for n in (5, 7):
        check(cm, torch.randn(50), torch.randint(0, 50, (4, n)), torch.randint(0, 50, (4, 3)))
    (kernel,) = cuda_kernels(cm)
    assert kernel.persistent and kernel.source.count("in_ptr0[") == 2  # w, once per gather


def test_gather_embedding_and_index_select():
    w, ids = torch.randn(50, 16), torch.randint(0, 50, (4, 9))
    check(lambda w, i: w[i] * 2 + 1, w, ids)
    check(lambda w, i: torch.index_select(w, 0, i.flatten()).sum(-1), w, ids)
    check(lambda w, i: torch.gather(w, 1, i.remainder(16)), w, ids)


def test_half_and_bfloat16_storage_with_float_math():
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(6, 33).to(dtype)
        check(lambda t: (F.softmax(t, -1), (t * 3).sigmoid(), t.sum(0)), x)


# ----------------------------------------------------------------------------------------------
# Debugging tools show CUDA C
# ----------------------------------------------------------------------------------------------


def test_explain_dump_and_logs_show_cuda_sources(tmp_path, caplog):
    fn = lambda x: F.gelu(x) + x.mean(-1, keepdim=True)  # noqa: E731
    x = torch.randn(4, 24)
    with caplog.at_level(logging.INFO, logger="gjit.output_code"):
        cm = gjit.compile(fn, dump_dir=str(tmp_path))
        check(cm, x)
    report = gjit.explain(cm, x)
    assert report.kernels and all("__global__" in k.source for k in report.kernels)
    assert all(k.path.endswith(".cu") for k in report.kernels)
    dumped = sorted(p.name for p in tmp_path.rglob("kernels/*"))
    assert dumped and all(name.endswith(".cu") for name in dumped)
    assert any("__global__" in r.getMessage() for r in caplog.records)


def test_backend_is_part_of_the_cache_key(tmp_path):
    x = torch.randn(5, 6)

    def fn(t):
        return t.cos() * 3

    with gjit.config.scope(cache=True, cache_dir=str(tmp_path)):
        check(fn, x)
        with gjit.config.scope(backend="triton"):
            check(fn, x)
        check(fn, x)
    assert gjit.stats()["disk_cache_misses"] == 2 and gjit.stats()["disk_cache_hits"] == 1


def test_unknown_backend_is_an_error():
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        gjit.compile(lambda x: x, backend="cuda")


# ----------------------------------------------------------------------------------------------
# sm_90 with NVRTC (no GPU), and a real GPU when there is one
# ----------------------------------------------------------------------------------------------


@pytest.mark.compile_only
def test_dynamic_row_kernels_compile_for_sm90_without_spills():
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    fn = gjit.compile(lambda x: (F.softmax(x, -1), F.layer_norm(x, x.shape[-1:]), x.argmax(-1)))
    report = gjit.aot(fn, torch.randn(6, 300), arch="sm_90")
    (kernel,) = fn.entries[0].program.kernels  # the three read one row: one kernel
    assert kernel.persistent and kernel.launch_blocks and len(report.kernels) == 1
    assert [k.name for k in report.kernels if k.spills] == []


@pytest.mark.compile_only
def test_a_write_into_the_callers_cache_asserts_its_index_for_sm90():
    """The device assert of a write into a graph input builds with NVRTC: the prelude's GJIT_ASSERT
    is CUDA's `assert`, whose PTX calls __assertfail (a device-side assert at run time, as eager's
    index_copy_ raises)."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from test_scatters import _cache_step

    fn = gjit.compile(_cache_step)
    report = gjit.aot(fn, torch.ones(1, 3), torch.zeros(4, 3), torch.tensor([0]), arch="sm_90")
    (kernel,) = [k for k in fn.entries[0].program.kernels if k.name.startswith("gjit_scatter_")]
    assert "GJIT_ASSERT(" in kernel.source and "index out of bounds writing" in kernel.source
    (built,) = [k for k in report.kernels if k.name == kernel.name]
    assert "__assertfail" in open(built.ptx_path).read() and not built.spills, built


@pytest.mark.compile_only
def test_looped_row_kernels_compile_for_sm90_without_spills():
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    fn = gjit.compile(lambda x: (F.softmax(x, -1), F.layer_norm(x, x.shape[-1:])), dynamic=False)
    report = gjit.aot(fn, torch.randn(6, 3000), arch="sm_90")
    (kernel,) = fn.entries[0].program.kernels
    assert not kernel.persistent and "gjit_online_sum_exp(" in kernel.source
    assert "gjit_welford_add(" in kernel.source
    assert [k.name for k in report.kernels if k.spills] == []


@pytest.mark.compile_only
def test_special_function_kernels_compile_for_sm90():
    """digamma, trigamma and zeta are the prelude's (kernels/special_math.py); the rest CUDA's."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from test_compile_only import CASES

    fn, make_args = CASES["special_functions"]
    cm = gjit.compile(fn)
    report = gjit.aot(cm, *make_args(), arch="sm_90")
    sources = "".join(k.source for k in cm.entries[0].program.kernels)
    for call in ("gjit_digamma(", "gjit_trigamma(", "gjit_zeta(", "j0f(", "normcdfinvf(", "erfcxf("):
        assert call in sources, call
    # no register spills (local memory); the stack frame is CUDA's double sin/tan argument
    # reduction (40 bytes, as in eager's own digamma and trigamma kernels)
    assert report.kernels and [k.name for k in report.kernels if k.local] == []


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["transformer_encoder_layer", "gpt2-sdpa"])
def test_models_on_a_gpu(name):
    model, inputs = MODELS[name]()
    model, inputs = model.cuda(), tuple(t.cuda() for t in inputs)
    with torch.no_grad():
        out = gjit.compile(model, backend="cupy")(*inputs)
        expected = model(*inputs)
    out, expected = (getattr(o, "logits", getattr(o, "last_hidden_state", o)) for o in (out, expected))
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_pointwise_and_softmax_on_a_gpu():
    x = torch.randn(1000, 513, device="cuda")
    fn = lambda t: (F.softmax(t, -1), (t * 2).sin())  # noqa: E731
    out, _ = run_compiled(fn, x)
    for a, e in zip(out, fn(x)):
        torch.testing.assert_close(a, e)


def test_scatter_combines_with_the_prelude_atomics():
    x, index, src = torch.randn(5, 4), torch.randint(0, 5, (9, 4)), torch.randn(9, 4)
    cm = check(lambda x, i, s: (x.scatter_add(0, i, s), x.scatter_reduce(0, i, s, "amin")), x, index, src)
    kernels = gjit.explain(cm, x, index, src).kernels
    sources = [k.source for k in kernels if k.name.startswith("gjit_scatter_")]
    assert any("gjit_atomic_add(&out_ptr" in s for s in sources)
    assert any("gjit_atomic_min(&out_ptr" in s for s in sources)
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="the numerics passed; no NVRTC for sm_90")
    report = gjit.aot(cm, x, index, src, arch="sm_90")  # the prelude's atomics build for a GPU too
    assert len(report.kernels) == len(kernels) and not any(k.spills for k in report.kernels)


def test_bessel_functions_come_with_the_kernels_that_call_them():
    """Not in the prelude every kernel carries (their coefficients are computed on first use):
    the .cu text of a kernel that calls one has them, and NVRTC builds it for sm_90."""
    x = torch.randn(64) * 5
    cm = check(lambda x: torch.special.i0e(x) * torch.special.scaled_modified_bessel_k1(x.abs()), x)
    (kernel,) = gjit.explain(cm, x).kernels
    text = runtime_cuda.kernel_file_text(kernel)
    assert "gjit_bessel_i0e(double x)" in text and "gjit_bessel_i0e" not in runtime_cuda.CUDA_PRELUDE
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="the numerics passed; no NVRTC for sm_90")
    report = gjit.aot(cm, x, arch="sm_90")
    assert len(report.kernels) == 1 and not report.kernels[0].spills
