"""gjit.aot: every kernel built for sm_90 without a GPU, with its resource usage from the cubin."""

import multiprocessing
import os
import re

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


@pytest.mark.parametrize("cols", [4096, 4100])
def test_kernels_are_specialized_as_the_cards_launcher_would_for_the_call(tmp_path, cols):
    """A row length that is a kernel argument (a dynamic dim) is specialized as Triton's launcher
    does on a card for this call: a multiple of 16 gives 128-bit loads, any other length scalar
    ones (aot's figures are those of the kernel that would run)."""
    cm = gjit.compile(lambda x: torch.softmax(x, -1), dynamic=True)
    report = gjit.aot(cm, torch.randn(64, cols), out_dir=str(tmp_path), workers=1)
    (kernel,) = report.kernels
    if cols % 16 == 0:
        assert kernel.vector_loads >= 1 and kernel.scalar_loads == 0, kernel
    else:
        assert kernel.scalar_loads >= 1, kernel


def test_looped_welford_divides_once_a_chunk_not_once_an_element(tmp_path):
    """A layer norm over rows longer than a persistent block: its first pass keeps Welford's mean
    per lane, whose update divides by the lane's count, the same for every active lane of a chunk
    (kernels/triton_helpers.py): one division a chunk, where one an element (8 a thread here) made
    the pass ALU-bound on sm_90."""
    with gjit.config.scope(reduction="looped"):
        report = gjit.aot(
            lambda x, w, b: torch.nn.functional.layer_norm(x, (8192,), w, b),
            *(torch.randn(s) for s in ((64, 8192), (8192,), (8192,))),
            out_dir=str(tmp_path),
            workers=1,
        )
    (kernel,) = report.kernels
    ptx = open(kernel.ptx_path).read()
    assert ptx.count("ld.global.v4") >= 2 and not kernel.spills  # 8 elements a thread, two 128-bit loads
    divisions = len(re.findall(r"\b(?:div|rcp)\.\w+\.f32", ptx))
    assert divisions <= 2, divisions  # the chunk's reciprocal and the variance's division by n


def test_online_softmax_takes_one_exp_an_element_in_its_first_pass(tmp_path):
    """A looped softmax's first pass keeps each lane's running max and sum of exps (online
    softmax): one exp an element there (kernels/triton_helpers.py: the rescale when the max grows
    and the element's own term are the same exp), one an element for the output and one a lane to
    rescale the lanes' sums. Exps run on the SFU, an eighth of the FMA units' rate on sm_90."""
    with gjit.config.scope(reduction="looped"):
        report = gjit.aot(
            lambda x: torch.softmax(x, -1), torch.randn(64, 8192), out_dir=str(tmp_path), workers=1
        )
    (kernel,) = report.kernels
    ptx = open(kernel.ptx_path).read()
    per_thread = 8  # RBLOCK 2048 over 8 warps
    assert ptx.count("ld.global.v4") >= 2 and not kernel.spills
    assert ptx.count("ex2.approx") <= 3 * per_thread, ptx.count("ex2.approx")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_matmul_templates_use_tensor_cores_and_do_not_spill(tmp_path, dtype):
    """The matmul template (kernels/matmul.py) with an epilogue and an attention-style prologue:
    16-bit tiles multiply on Hopper's tensor cores (wgmma); float32 stays IEEE (no TF32)."""

    def f(a, b, c, q, k):
        p = (q @ k.transpose(-1, -2)).softmax(-1)
        return torch.nn.functional.gelu(a @ b + c), p @ k, p  # p returned: two products, no attention

    args = [torch.randn(s, dtype=dtype) for s in ((300, 256), (256, 384), (384,), (2, 40, 64), (2, 40, 64))]
    report = gjit.aot(f, *args, out_dir=str(tmp_path), workers=1)
    matmuls = [k for k in report.kernels if k.name.startswith("gjit_mm_")]
    assert len(matmuls) == 3, report
    for kernel in matmuls:
        assert not kernel.spills and 0 < kernel.registers <= 255, report
        ptx = open(kernel.ptx_path).read()
        tensor_cores = "wgmma.mma_async" in ptx or "mma.sync" in ptx
        assert tensor_cores == (dtype != torch.float32), kernel.name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim", [64, 128])
def test_attention_template_uses_tensor_cores_and_does_not_spill(tmp_path, dtype, dim):
    """The attention template (kernels/attention.py), sdpa with a causal mask and written out with
    an additive mask: both dots on tensor cores for 16-bit operands, no spills at head dims 64
    and 128 (Llama's)."""

    def f(q, k, v, mask):
        written = torch.matmul(q, k.transpose(-1, -2)) * 0.125 + mask
        written = torch.matmul(written.softmax(-1).to(q.dtype), v)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), written

    q, k, v = (torch.randn(2, 4, 200, dim, dtype=dtype) for _ in range(3))
    mask = torch.randn(2, 1, 200, 200, dtype=dtype)
    report = gjit.aot(f, q, k, v, mask, out_dir=str(tmp_path), workers=1)
    attention = [k for k in report.kernels if k.name.startswith("gjit_attn_")]
    assert len(attention) == 2, report
    for kernel in attention:
        assert not kernel.spills and 0 < kernel.registers <= 255, report
        ptx = open(kernel.ptx_path).read()
        tensor_cores = ptx.count("wgmma.mma_async") + ptx.count("mma.sync")
        assert (tensor_cores >= 2) == (dtype != torch.float32), kernel.name


def test_torch_cond_branch_kernels_are_built_too(tmp_path):
    report = gjit.aot(Cond(), torch.randn(4, 3), out_dir=str(tmp_path))
    assert len(report.kernels) == 3  # the predicate's reduction and one kernel per branch


def test_workers_build_the_same_binaries_as_one_process(tmp_path, monkeypatch):
    # Triton's own cache would hand the second build the first one's binaries: one cache each
    def f(x, w):
        h = torch.nn.functional.gelu(x @ w)
        return torch.softmax(h, -1), torch.nn.functional.layer_norm(h, (h.shape[-1],)), (h * 2).sum(0)

    x, w = torch.randn(16, 32), torch.randn(32, 48)
    reports = {}
    for workers in (1, 2):
        monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / f"triton{workers}"))
        out = tmp_path / f"out{workers}"
        reports[workers] = gjit.aot(gjit.compile(f), x, w, out_dir=str(out), workers=workers)
    serial, parallel = reports[1].kernels, reports[2].kernels
    assert len(serial) >= 2  # two processes build at once
    assert [k.name for k in parallel] == [k.name for k in serial]
    for a, b in zip(serial, parallel):
        assert open(a.cubin_path, "rb").read() == open(b.cubin_path, "rb").read()
        assert (a.registers, a.shared, a.spills) == (b.registers, b.shared, b.spills)


def test_compile_workers_knob_reads_the_environment(monkeypatch):
    monkeypatch.setenv("GJIT_COMPILE_WORKERS", "1")
    assert gjit.config.compile_workers == 1
    monkeypatch.delenv("GJIT_COMPILE_WORKERS")
    assert gjit.config.compile_workers == (os.cpu_count() or 1)


def test_cond_branches_with_kernels_of_one_name_get_a_file_each(tmp_path):
    def branches(x):
        return torch.cond(x.sum() > 0, lambda t: t * 2, lambda t: t * 3, (x,))

    report = gjit.aot(branches, torch.randn(8), out_dir=str(tmp_path), workers=2)
    cubins = [k.cubin_path for k in report.kernels]
    assert len(set(cubins)) == len(cubins) == 3
    assert all(os.path.getsize(p) > 0 for p in cubins)


def test_a_cond_branch_kernel_is_not_specialized_for_the_launch_of_its_namesake(tmp_path):
    """Review find: kernel names count per graph, so a torch.cond branch's multiply bears the name
    of the outer graph's, whose fake-run launch (one element) made the branch's size the constant 1
    in its build; a branch, which the fake run does not reach, is built for any size."""

    def f(x, w):
        return w * 2, torch.cond(x.sum() > 0, lambda t: t * 2, lambda t: t * 3, (x,))

    report = gjit.aot(f, torch.randn(40), torch.randn(1), out_dir=str(tmp_path), workers=1)
    outer, _, *branches = report.kernels
    assert len(branches) == 2 and all(k.name == outer.name for k in branches), report
    sizes = {k.ptx_path: open(k.ptx_path).read().count(".param .u32") for k in report.kernels}
    assert sizes[outer.ptx_path] == 0 and all(sizes[k.ptx_path] == 1 for k in branches), sizes


def _aot_in_daemon(out_dir, queue):
    try:
        f = lambda a: (torch.softmax(a, -1), (a * 2).sum(0))  # noqa: E731 - two kernels
        report = gjit.aot(f, torch.randn(8, 16), out_dir=out_dir, workers=2)
        queue.put(len(report.kernels))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        queue.put(f"{type(e).__name__}: {e}")


def test_a_daemonic_process_builds_in_process(tmp_path):
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_aot_in_daemon, args=(str(tmp_path), queue), daemon=True)
    child.start()
    result = queue.get(timeout=300)
    child.join(timeout=60)
    assert result == 2, result


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_norm_statistics_in_a_matmul_prologue_do_not_spill(tmp_path, dtype):
    """A layer norm's statistics computed in the next linear's prologue (gjit/fusion/statistics.py), at a
    GPT-2-small width: no spills, and the 16-bit product still on tensor cores."""
    from test_matmul import NormLinear

    model = NormLinear(768, 2304, "layer").eval().to(dtype)
    with torch.no_grad():
        report = gjit.aot(model, torch.randn(4, 100, 768, dtype=dtype), out_dir=str(tmp_path), workers=1)
    assert len(report.kernels) == 2, report  # the residual's matmul, the linear with the statistics
    for kernel in report.kernels:
        assert not kernel.spills and 0 < kernel.registers <= 255, report
        ptx = open(kernel.ptx_path).read()
        assert ("wgmma.mma_async" in ptx or "mma.sync" in ptx) == (dtype != torch.float32), kernel.name


def test_16_bit_and_counting_row_sums_build(tmp_path):
    """A 16-bit row sum before a linear, computed in the linear's prologue (accumulated in
    float32, rounded once), builds for sm_90 (Triton wants a loop's accumulator to keep its type);
    an integer count keeps its own kernel and builds too."""
    x, w = torch.randn(8, 256, dtype=torch.float16), torch.randn(64, 256, dtype=torch.float16)
    cases = {
        "sum": (lambda x, w: torch.nn.functional.linear(x * (1000 / x.sum(-1, keepdim=True)), w), 0),
        "count": (lambda x, w: torch.nn.functional.linear(x / (x > 0).sum(-1, keepdim=True), w), 1),
    }
    for name, (f, reductions) in cases.items():
        report = gjit.aot(f, x, w, out_dir=str(tmp_path / name), workers=1)
        assert sum(k.name.startswith("gjit_red_") for k in report.kernels) == reductions, report
        assert len(report.kernels) == 1 + reductions and all(not k.spills for k in report.kernels), report


def test_a_scan_down_the_first_dim_reads_vectors(tmp_path):
    """A cumsum over the first dim of a row-major tensor walks a tile across rows: its loads are
    128-bit along a row, where a program of one column loaded an element of each row at a time."""
    report = gjit.aot(lambda t: t.cumsum(0), torch.randn(64, 16384), out_dir=str(tmp_path), workers=1)
    (kernel,) = report.kernels
    assert kernel.vector_loads >= 1 and kernel.scalar_loads == 0, kernel
    assert "ld.global.v4" in open(kernel.ptx_path).read() and not kernel.spills
