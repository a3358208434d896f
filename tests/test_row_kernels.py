"""Looped or persistent, per row kernel, measured (gjit/choice/row_kernels.py): a reduction over
static rows of 1025-8192 elements is emitted looped (the table's) and persistent, tuning times
both on the card and keeps the faster. Here, as in tests/test_tuning.py, the kernels run in
Triton's interpreter (each configuration launched and its output compared with the first's) and
each measurement returns what the test says; the compiled result is compared with eager."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import gjit
from gjit import driver, tuning
from gjit.codegen.triton.tiles import MEASURED_PERSISTENT
from gjit.runtime import tuning_store
from helpers import assert_same, run_compiled

pytestmark = [pytest.mark.cpu]


@pytest.fixture
def measured(monkeypatch):
    """Tuning on for CPU graphs, taken as on a GPU; `times`: what each measurement returns, in
    order; `seen`: what each measured (each measured function still runs once)."""
    times: list[float] = []
    seen: list[str] = []

    def bench(fn, what):
        fn()
        seen.append(what)
        return times.pop(0)

    monkeypatch.setattr(tuning, "bench", bench)
    monkeypatch.setattr(driver, "on_gpu", lambda gm: True)
    tuning_store.forget()
    with gjit.config.scope(tune=True, matmul="auto"):
        yield times, seen


class Norm(torch.nn.Module):
    """A layer norm and a ReLU over rows as long as its weight (a parameter: a static length)."""

    def __init__(self, n=2048):
        super().__init__()
        self.norm = torch.nn.LayerNorm(n)
        torch.nn.init.normal_(self.norm.weight)
        torch.nn.init.normal_(self.norm.bias)
        self.requires_grad_(False)  # inference: gjit runs a call that needs autograd eagerly

    def forward(self, x):
        return self.norm(x).relu()


def norm_args(rows=16, n=2048):
    torch.manual_seed(0)
    return Norm(n), torch.randn(rows, n) * 3 + 1


def row_lines(cm, *args):
    lines = gjit.explain(cm, *args).row_kernels
    assert all(line.startswith("tuned on the GPU: row kernel ") for line in lines), lines
    return lines


def row_kernel(cm):
    (kernel,) = cm.entries[0].program.kernels
    assert kernel.name.startswith("gjit_red_") and kernel.configs == 2
    return kernel


@pytest.mark.parametrize("persistent_wins", [True, False])
def test_the_faster_of_looped_and_persistent_is_kept(measured, persistent_wins):
    times, seen = measured
    norm, x = norm_args()
    times += [1.0, 0.5] if persistent_wins else [0.5, 1.0]  # looped (the table's), then persistent
    out, cm = run_compiled(norm, x)
    assert_same(out, norm(x))
    assert not times and seen[0].endswith("configuration 0") and seen[1].endswith("configuration 1")
    kernel = row_kernel(cm)
    assert kernel.persistent is persistent_wins
    chosen = 1 if persistent_wins else 0
    header = f"# configuration {chosen}: looped (0, the table's) or persistent (1), timed on a GPU"
    assert header in kernel.source
    (line,) = row_lines(cm, x)
    assert f"[looped 1x2048 w8] {1.0 if persistent_wins else 0.5:.3f}" in line, line
    assert "[persistent 1x2048 w4]" in line and f"chose configuration {chosen}" in line, line
    # the chosen kernel is what runs: the second call through it computes eager's values too
    with gjit.config.scope(interpret=True, debug=True):
        assert_same(cm(x), norm(x))


def test_layers_sharing_a_row_kernel_are_measured_once_and_run_alike(measured):
    times, seen = measured
    first, x = norm_args()
    two = torch.nn.Sequential(first, torch.nn.Linear(2048, 2048, bias=False), Norm()).requires_grad_(False)

    times += [1.0, 0.5]
    out, cm = run_compiled(two, x)
    assert_same(out, two(x))
    assert len(seen) == 2
    kernels = [k for k in cm.entries[0].program.kernels if k.configs == 2]
    assert len(kernels) == 2 and all(k.persistent for k in kernels)
    (line,) = row_lines(cm, x)
    assert line.endswith("(and 1 more alike)"), line


def test_a_record_is_kept_per_row_count(measured, tmp_path):
    """Rows the kernel's code does not name (static ones) are part of its record's key: the same
    norm over 64 rows and over 16 is measured for each."""
    times, seen = measured
    first, x = norm_args(64)
    second = Norm()
    y = torch.randn(16, 2048)

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = first, second

        def forward(self, x, y):
            return self.a(x), self.b(y)

    two = Two().requires_grad_(False)
    times += [1.0, 0.5, 0.3, 0.7]  # the 64 rows go persistent, the 16 stay looped
    with gjit.config.scope(cache=True, cache_dir=str(tmp_path)):
        out, cm = run_compiled(gjit.compile(two, dynamic=False), x, y)
    for a, e in zip(out, two(x, y)):
        assert_same(a, e)
    assert not times and len(seen) == 4
    by_rows = {k.name: k.persistent for k in cm.entries[0].program.kernels if k.configs == 2}
    assert sorted(by_rows.values()) == [False, True], by_rows


def test_a_failure_in_measuring_row_kernels_keeps_them_looped(measured, monkeypatch, caplog):
    from gjit.choice import row_kernels

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (a test's)")

    monkeypatch.setattr(row_kernels, "_decide", broken)
    norm, x = norm_args()
    out, cm = run_compiled(norm, x)
    assert_same(out, norm(x))
    assert not row_kernel(cm).persistent
    (line,) = row_lines(cm, x)
    assert "tuning failed (CUDA out of memory (a test's)): every row kernel looped" in line, line


def test_row_kernels_are_measured_whatever_the_matmul_setting(measured):
    times, seen = measured
    norm, x = norm_args()
    times += [1.0, 0.5]
    with gjit.config.scope(matmul="aten"):
        out, cm = run_compiled(norm, x)
    assert_same(out, norm(x))
    assert len(seen) == 2 and row_kernel(cm).persistent


def test_a_launch_bound_row_kernel_stays_looped(measured):
    times, seen = measured
    norm, x = norm_args()
    times += [0.005]  # under tuning.MIN_KERNEL_MS: its loop hardly matters
    out, cm = run_compiled(norm, x)
    assert_same(out, norm(x))
    assert len(seen) == 1 and not row_kernel(cm).persistent
    (line,) = row_lines(cm, x)
    assert "too short to tune" in line


def test_a_later_compile_takes_the_record(measured, tmp_path):
    times, seen = measured
    norm, x = norm_args()
    times += [1.0, 0.5]
    other = torch.nn.Sequential(norm, torch.nn.Linear(2048, 16)).requires_grad_(False)  # the same row kernel
    # records are kept with the disk cache (tests turn it off), in a folder of the test's own
    with gjit.config.scope(cache=True, cache_dir=str(tmp_path)):
        run_compiled(norm, x)
        gjit.reset()  # the in-memory tiers go; the disk keeps the record
        out, cm = run_compiled(other, x)
    assert_same(out, other(x))
    assert len(seen) == 2, "nothing measured again"
    (kernel,) = [k for k in cm.entries[0].program.kernels if k.configs == 2]
    assert kernel.persistent
    lines = row_lines(cm, x)
    assert "(an earlier compile's measurements)" in lines[0], lines
    assert lines[0].startswith(f"tuned on the GPU: row kernel {kernel.name}: "), lines  # its own name


def test_persistent_configuration_computes_eagers_values():
    """Configuration 1 as codegen emits it, run in the interpreter on the usual row kernels: a
    softmax, a log-softmax, a layer norm, an RMS norm, a sum, with NaN and inf in the rows."""
    torch.manual_seed(0)
    x = torch.randn(6, 4096)
    x[1, 7], x[2, 100], x[3, 5] = float("nan"), float("inf"), float("-inf")
    w = torch.randn(4096)

    def rows(x, w):
        rms = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
        return x.softmax(-1), x.log_softmax(-1), F.layer_norm(x, (4096,), w), rms, x.sum(-1)

    real = driver.generate_kernel
    for config in (0, 1):

        def emitted(region, *a, config=config, **k):
            region.config = config
            return real(region, *a, **k)

        with pytest.MonkeyPatch.context() as m:
            m.setattr(driver, "generate_kernel", emitted)
            out, cm = run_compiled(gjit.compile(rows, dynamic=False), x, w)
        kernels = [k for k in cm.entries[0].program.kernels if k.configs == 2]
        assert kernels and all(k.persistent is bool(config) for k in kernels)
        for a, e in zip(out, rows(x, w)):
            assert_same(a, e)


@pytest.mark.parametrize("case", ["short", "long", "dynamic", "outer"])
def test_which_row_kernels_have_both(case):
    """Only static inner rows past persistent_max and up to MEASURED_PERSISTENT are emitted in
    two configurations (a long row's kernel, or the partial sums of a split one, are not)."""
    n = {"short": 1024, "long": 2 * MEASURED_PERSISTENT, "dynamic": 2048, "outer": 2048}[case]
    x = torch.randn(64 if case == "long" else 8, n)  # 64 long rows: not split into partial sums
    if case == "outer":
        fn, arg = (lambda x: x.sum(0)), x.t().contiguous()  # reduced over the first dim
    else:
        fn, arg = (lambda x: x.softmax(-1)), x
    out, cm = run_compiled(gjit.compile(fn, dynamic=None if case == "dynamic" else False), arg)
    assert_same(out, fn(arg))
    rows = [k for k in cm.entries[0].program.kernels if k.rnumel is not None]
    if case == "long":
        rows = [k for k in rows if k.rnumel == n]
    assert rows and all(k.configs == 1 for k in rows)


@pytest.mark.gpu
def test_on_a_gpu_looped_and_persistent_are_measured_and_exact():
    """A float32 layer norm over 4096 rows of 8192 (long enough to tune on an H100 or H200: about
    0.1 ms): both configurations timed for real, and whichever runs computes eager's values."""
    norm = Norm(8192).cuda()
    x = torch.randn(4096, 8192, device="cuda") * 3 + 1
    cm = gjit.compile(norm)
    with gjit.config.scope(tune=True, tune_budget=1.0):  # no budget: both are timed however short the compile
        out = cm(x)
    assert_same(out, norm(x))
    lines = row_lines(cm, x)
    assert len(lines) == 1 and "[looped 1x2048 w8]" in lines[0] and "[persistent 1x8192 w16]" in lines[0], (
        lines
    )
    assert "chose configuration" in lines[0], lines


def test_a_warm_start_runs_the_kernel_chosen(measured, tmp_path):
    """The chosen configuration is in the kernels the entry stores: a warm start from the disk cache
    runs the persistent kernel without measuring, and explaining it (lowering and fusion again)
    finds the same kernels."""
    times, seen = measured
    norm, x = norm_args()
    times += [1.0, 0.5]
    with gjit.config.scope(cache=True, cache_dir=str(tmp_path)):
        run_compiled(norm, x)
        gjit.reset()
        out, cm = run_compiled(norm, x)
        assert_same(out, norm(x))
        assert len(seen) == 2 and gjit.stats()["disk_cache_hits"] == 1
        assert row_kernel(cm).persistent
        report = gjit.explain(cm, x)
    assert [k.name for k in report.kernels] == [row_kernel(cm).name]


def test_a_configuration_taking_other_arguments_is_not_launched(measured, monkeypatch):
    """The kept launch passes config 0's pointers in config 0's order: a configuration whose
    kernel takes others (persistent code orders its pointers by its own loads) is not run."""
    times, seen = measured
    real = driver.generate_kernel

    def reordered(region, *args, **kwargs):
        kernel = real(region, *args, **kwargs)
        if region.config == 1:
            kernel = dataclasses.replace(kernel, in_args=kernel.in_args[::-1])
        return kernel

    monkeypatch.setattr(driver, "generate_kernel", reordered)
    norm, x = norm_args()
    times += [1.0]  # config 0 alone is timed
    out, cm = run_compiled(norm, x)
    assert_same(out, norm(x))
    assert seen == [f"row kernel {row_kernel(cm).name} configuration 0"] and not row_kernel(cm).persistent
    (line,) = row_lines(cm, x)
    assert "takes other arguments" in line and "chose configuration 0" in line, line


def test_a_failed_rebuild_leaves_no_line_of_a_choice_not_made(measured, monkeypatch):
    times, seen = measured
    real, builds = driver.generate_kernels, []

    def second_fails(*args, **kwargs):
        builds.append(1)
        if len(builds) == 2:  # the program built again with the persistent kernel
            raise RuntimeError("out of memory (a test's)")
        return real(*args, **kwargs)

    monkeypatch.setattr(driver, "generate_kernels", second_fails)
    norm, x = norm_args()
    times += [1.0, 0.5]
    out, cm = run_compiled(norm, x)
    assert_same(out, norm(x))
    assert len(builds) == 2 and not row_kernel(cm).persistent
    (line,) = row_lines(cm, x)
    assert "tuning failed (out of memory (a test's)): every row kernel looped" in line, line
