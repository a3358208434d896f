"""The measurements of gjit/tuning.py: each template kernel's tile configuration, then (matmul
"auto", gjit/choice/) each region's template against ATen's kernels. On a GPU the times are
triton.testing.do_bench's; here the kernels run in Triton's interpreter (every configuration is
launched and its output compared with the first's) and the test says what each measurement
returns, so the decisions are known."""

import pytest
import sympy
import torch
import torch.nn.functional as F

import gjit
from gjit import driver, tuning
from gjit.kernels.attention import attention_configs
from gjit.kernels.matmul import matmul_configs
from helpers import assert_same, check_against_float64, run_compiled

pytestmark = [pytest.mark.cpu]


@pytest.fixture
def measured(monkeypatch):
    """Tuning on for CPU graphs, taken as on a GPU, under the default matmul setting ("auto");
    `times` is what each measurement returns, in order (each measured function still runs once,
    so every configuration and every piece of the library's side really executes)."""
    times: list[float] = []
    calls: list[float] = []

    def bench(fn, what):
        fn()
        calls.append(times.pop(0))
        return calls[-1]

    monkeypatch.setattr(tuning, "bench", bench)
    monkeypatch.setattr(driver, "on_gpu", lambda gm: True)
    with gjit.config.scope(tune=True, matmul="auto", measure_all_templates=True):
        yield times, calls


def linear_gelu(x, w, b):
    return F.gelu(F.linear(x, w, b))


def test_the_fastest_configuration_is_kept_and_computes_the_same(measured):
    times, calls = measured
    x, w, b = torch.randn(65, 40), torch.randn(130, 40), torch.randn(130)
    configs = matmul_configs(65, 130, 40, torch.float32)
    assert len(configs) > 2
    # the table's pick, then each candidate; the second candidate is the fastest; then the
    # library's side: the addmm extern (1.0) and the kernel that computes the GELU (2.0)
    times += [1.0, 0.9, 0.5] + [0.7] * (len(configs) - 3) + [1.0, 2.0]
    out, cm = run_compiled(linear_gelu, x, w, b)
    assert not times and len(calls) == len(configs) + 2
    assert_same(out, linear_gelu(x, w, b))
    (kernel,) = cm.entries[0].program.kernels
    assert kernel.name.startswith("gjit_mm_")
    chosen = configs[2]
    assert (kernel.blocks["BLOCK_M"], kernel.blocks["BLOCK_N"], kernel.blocks["BLOCK_K"]) == (
        chosen.m,
        chosen.n,
        chosen.k,
    )
    assert kernel.num_stages == chosen.stages and kernel.num_warps == chosen.warps
    report = gjit.explain(cm, x, w, b)
    tuned = [m for m in report.matmuls if m.startswith("tuned on the GPU")]
    assert len(tuned) == 2 and "chose configuration 2" in tuned[0], tuned
    assert "addmm: template (measured" in tuned[1] and "template 0.500 ms, ATen 3.000 ms" in tuned[1], tuned


def test_aten_wins_where_it_is_faster(measured):
    times, _ = measured
    x, w, b = torch.randn(65, 40), torch.randn(130, 40), torch.randn(130)
    n = len(matmul_configs(65, 130, 40, torch.float32))
    times += [1.0] * n + [0.4, 0.3]  # no configuration beats the first; addmm + the GELU kernel do
    out, cm = run_compiled(linear_gelu, x, w, b)
    assert_same(out, linear_gelu(x, w, b))
    report = gjit.explain(cm, x, w, b)
    assert [e.op for e in report.externs] == ["aten.addmm.default"]
    assert not any(k.name.startswith("gjit_mm_") for k in report.kernels)
    assert "addmm: ATen (measured" in report.matmuls[-2], report.matmuls
    assert report.matmuls[-1].startswith("tuning took"), report.matmuls  # and the budget's line
    assert report.matmuls[0].startswith("addmm (aten.addmm.default): ATen extern")


@pytest.mark.parametrize("norm", [False, True])
def test_layers_with_the_same_kernel_are_measured_once(measured, norm):
    times, calls = measured
    x, w, y, v = torch.randn(20, 40), torch.randn(40, 70), torch.randn(20, 40), torch.randn(40, 70)
    pre = (lambda t: F.layer_norm(t, (40,))) if norm else (lambda t: t)  # statistics in the prologue

    def two_layers(x, w, y, v):  # two kernels that differ in their comments' node names only
        return torch.relu(pre(x) @ w), torch.relu(pre(y) @ v)

    n = len(matmul_configs(20, 70, 40, torch.float32))
    # the configurations, then the library's side: mm, (the norm's kernel,) the ReLU's kernel
    library = [1.0, 3.0] + ([1.0] if norm else [])
    times += [1.0] * (n - 1) + [0.5] + library
    out, cm = run_compiled(two_layers, x, w, y, v)
    for a, e in zip(out, two_layers(x, w, y, v)):
        assert_same(a, e)
    kernels = [k for k in cm.entries[0].program.kernels if k.name.startswith("gjit_mm_")]
    assert len(kernels) == 2 and len(calls) == n + len(library), "the second layer's kernel is the first's"
    assert kernels[0].blocks == kernels[1].blocks and kernels[0].num_stages is not None


def test_stacked_layers_tuned_alike_still_launch_one_kernel(measured):
    times, calls = measured
    x, w1, w2 = torch.randn(20, 40), torch.randn(40, 40), torch.randn(40, 40)

    def stacked(x, w1, w2):  # one size symbol for both layers' rows: the same code
        h = x + torch.relu(x @ w1)
        return h + torch.relu(h @ w2)

    n = len(matmul_configs(20, 40, 40, torch.float32))
    times += [1.0] * (n - 1) + [0.5] + [1.0, 3.0]
    out, cm = run_compiled(stacked, x, w1, w2)
    assert_same(out, stacked(x, w1, w2))
    first, second = cm.entries[0].program.kernels
    assert len(calls) == n + 2 and first.num_stages is not None, "measured once, the last configuration kept"
    assert second.code_of == first.name and second.blocks == first.blocks


def test_a_configuration_that_computes_something_else_is_not_used(measured, monkeypatch):
    times, _ = measured
    x, w, b = torch.randn(65, 40), torch.randn(130, 40), torch.randn(130)
    n = len(matmul_configs(65, 130, 40, torch.float32))
    real = tuning.run_kernel
    count = []

    def broken_second(kernel, launch, fn):  # the candidate after the first writes garbage
        real(kernel, launch, fn)
        count.append(1)
        if len(count) == 2:  # 1: the first configuration's measurement, 2: the second's check
            launch.outputs[0].add_(1.0)

    monkeypatch.setattr(tuning, "run_kernel", broken_second)
    # the first configuration, then (the broken one is never timed) the rest, then end to end
    times += [1.0] + [2.0] * (n - 2) + [1.0, 2.0]
    out, cm = run_compiled(linear_gelu, x, w, b)
    assert_same(out, linear_gelu(x, w, b))
    tuned = gjit.explain(cm, x, w, b).matmuls
    assert "computes something else" in tuned[1] and "chose configuration 0" in tuned[1]


def test_tuning_off_measures_nothing(measured):
    x, w, b = torch.randn(65, 40), torch.randn(130, 40), torch.randn(130)
    with gjit.config.scope(tune=False):
        out, cm = run_compiled(linear_gelu, x, w, b)
        with gjit.config.scope(matmul="template"):
            out_template, cm_template = run_compiled(linear_gelu, x, w, b)
    assert not measured[1]
    assert_same(out, linear_gelu(x, w, b))
    assert_same(out_template, linear_gelu(x, w, b))
    report = gjit.explain(cm, x, w, b)
    assert [e.op for e in report.externs] == ["aten.addmm.default"]  # "auto": the library
    assert "nothing measured (tuning off, GJIT_TUNE=0)" in report.externs[0].reason
    assert cm_template.entries[0].program.kernels[0].num_stages is None  # the table's tiles
    assert not any(m.startswith("tuned") for m in report.matmuls)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_on_a_gpu_the_choice_is_measured_and_exact(dtype):
    """A product long enough that both choices are measured (over tuning.MIN_KERNEL_MS even at
    cuBLAS's speed: 0.2 ms and more on an H100 or H200): the configurations and ATen are timed
    for real, and whichever runs computes what eager does."""
    n = 4096 if dtype == torch.float16 else 2048
    x = torch.randn(n, n, device="cuda", dtype=dtype)
    w = torch.randn(n, n, device="cuda", dtype=dtype) / n**0.5
    b = torch.randn(n, device="cuda", dtype=dtype)
    cm = gjit.compile(linear_gelu)
    with gjit.config.scope(tune=True, matmul="auto", measure_all_templates=True):
        out = cm(x, w, b)
    expected, reference = linear_gelu(x, w, b), linear_gelu(x.double(), w.double(), b.double())
    assert_same(out, expected, reference)
    tuned = [m for m in gjit.explain(cm, x, w, b).matmuls if m.startswith("tuned on the GPU")]
    assert len(tuned) == 2, tuned
    assert "ms by tiles" in tuned[0] and tuned[1].startswith("tuned on the GPU: addmm: "), tuned
    assert "(measured" in tuned[1] and "ATen: addmm" in tuned[1], tuned


def test_a_launch_bound_kernel_is_not_tuned_and_aten_not_tried(measured):
    """16-bit: a float32 product without TF32 is compared with ATen however short
    (tests/test_choice.py)."""
    times, calls = measured
    x, w, b = (t.half() for t in (torch.randn(65, 40), torch.randn(130, 40), torch.randn(130)))
    times += [0.005]  # the first configuration: below tuning.MIN_KERNEL_MS
    out, cm = run_compiled(linear_gelu, x, w, b)
    assert_same(out, linear_gelu(x, w, b))
    assert len(calls) == 1
    tiles, choice = [m for m in gjit.explain(cm, x, w, b).matmuls if m.startswith("tuned")]
    assert "too short to tune" in tiles
    assert "addmm: template (too short to matter: template 0.005 ms)" in choice, choice
    assert cm.entries[0].program.kernels[0].name.startswith("gjit_mm_")


def test_attention_configurations_are_measured_too(measured):
    """The attention template's grid counts batch and head programs the kernel takes no size
    argument for: the launch is rebuilt from the call's sizes."""
    times, calls = measured
    q, k, v = (torch.randn(2, 3, 40, 16) for _ in range(3))
    fn = F.scaled_dot_product_attention
    cm = gjit.compile(fn, dynamic=True)
    configs = len(attention_configs(40, 40, 16, 16, torch.float32))
    times += [1.0] * configs + [2.0]  # each configuration, then the library's side: SDPA alone
    out, _ = run_compiled(cm, q, k, v)
    assert_same(out, fn(q, k, v))
    (kernel,) = cm.entries[0].program.kernels
    assert kernel.name.startswith("gjit_attn_") and kernel.configs == configs > 1
    assert len(calls) == kernel.configs + 1 and not times, calls
    line = next(m for m in gjit.explain(cm, q, k, v).matmuls if "ms by tiles" in m)
    assert "not tuned" not in line and "does not build" not in line, line


def test_what_is_timed_is_the_launch_alone(measured, monkeypatch):
    """A measured call evaluates no size expression: on a GPU the host's sympy work inside the
    timed call (0.1-0.4 ms) was counted as the kernel's time, and short templates lost to ATen
    for it. Each timed call here launches its kernel (the interpreter runs it) and counts the
    sympy substitutions it makes: none."""
    times, calls = measured
    substitutions: list[int] = []
    real_subs = sympy.Basic.subs

    def counted(self, *args, **kwargs):
        substitutions[-1] += 1
        return real_subs(self, *args, **kwargs)

    fake = tuning.bench

    def bench(fn, what):
        substitutions.append(0)
        monkeypatch.setattr(sympy.Basic, "subs", counted)
        try:
            return fake(fn, what)
        finally:
            monkeypatch.setattr(sympy.Basic, "subs", real_subs)

    monkeypatch.setattr(tuning, "bench", bench)
    q, k, v = (torch.randn(2, 3, 40, 16) for _ in range(3))
    fn = F.scaled_dot_product_attention
    cm = gjit.compile(fn, dynamic=True)
    configs = len(attention_configs(40, 40, 16, 16, torch.float32))
    times += [1.0] * configs + [2.0]
    out, _ = run_compiled(cm, q, k, v)
    assert_same(out, fn(q, k, v))
    assert len(calls) == configs + 1 and not times
    assert substitutions == [0] * (configs + 1), substitutions


def test_measuring_runs_leave_an_input_written_in_place_as_one_call_does(measured):
    """Tuning runs the program on the call's own inputs (no copies of the weights): the index
    writes gjit makes in place write the same values each run, so the cache after the call is
    eager's, and so is a cache updated by adding to it (that write stays functional)."""
    times, calls = measured
    times += [1.0] * 16

    def step(cache, total, pos, x, w):
        cache.index_copy_(0, pos, torch.relu(x @ w))
        total.add_(cache.sum(0))
        return cache.sum()

    x, w = torch.randn(3, 40), torch.randn(40, 70)
    pos = torch.tensor([1, 4, 2])
    cache, total = torch.randn(6, 70), torch.randn(70)
    mine, theirs = (cache.clone(), total.clone()), (cache.clone(), total.clone())
    expected = step(*theirs, pos, x, w)
    out, cm = run_compiled(step, *mine, pos, x, w)
    assert calls, "tuning ran"
    assert_same(out, expected)
    assert_same(mine[0], theirs[0])
    assert_same(mine[1], theirs[1])


def test_measuring_leaves_the_random_generators_as_they_were(measured):
    """The measuring runs draw random numbers (a training-mode rrelu runs as ATen does): the
    call after them draws what eager draws from the same seed."""
    times, calls = measured
    times += [1.0] * 16

    def fn(x, w):
        return F.rrelu(x @ w, training=True)

    x, w = torch.randn(40, 40), torch.randn(40, 70)
    torch.manual_seed(5)
    expected = fn(x, w)
    torch.manual_seed(5)
    out, _ = run_compiled(fn, x, w)
    assert calls, "tuning ran"
    assert_same(out, expected)


def test_a_product_written_into_later_is_compared_with_what_the_kernel_wrote(measured, caplog):
    """The reference a configuration is checked against is a copy: a later in-place write into
    the product does not make every configuration look wrong."""
    times, _ = measured
    times += [1.0, 0.5] + [2.0] * 14

    def fn(x, w, idx, v):
        y = x @ w
        y[idx] = v
        return y

    x, w, idx, v = torch.randn(65, 40), torch.randn(40, 130), torch.tensor([3, 7]), torch.randn(130)
    out, cm = run_compiled(fn, x, w, idx, v)
    assert_same(out, fn(x, w, idx, v))
    assert "computes something else" not in caplog.text
    assert "chose configuration 1" in gjit.explain(cm, x, w, idx, v).matmuls[-3]


def test_deterministic_algorithms_turn_tuning_off(measured):
    """Tiles set the order of a product's sums: a choice made by timing is not reproducible."""
    _, calls = measured
    x, w, b = torch.randn(65, 40), torch.randn(130, 40), torch.randn(130)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        out, _ = run_compiled(linear_gelu, x, w, b)
    finally:
        torch.use_deterministic_algorithms(previous)
    assert_same(out, linear_gelu(x, w, b))
    assert not calls


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", ["linear", "sdpa_causal"])
def test_every_configuration_computes_what_the_first_does(measured, caplog, monkeypatch, dtype, case):
    """Each tile configuration a GPU may choose runs here in the interpreter, is checked against
    the table's (tuning's own check), and the last, made the fastest, against eager and float64:
    odd sizes, so every configuration masks partial tiles."""
    times, calls = measured
    if case == "linear":
        fn, args = linear_gelu, (torch.randn(65, 40), torch.randn(130, 40), torch.randn(130))
    else:
        fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        args = tuple(torch.randn(2, 3, 70, 16) for _ in range(3))
    args = tuple(a.to(dtype) for a in args)
    times += [1.0 - 0.1 * i for i in range(8)]  # each configuration faster than the one before
    with gjit.config.scope(matmul="template"):  # the templates stay: no library side measured
        cm, report = check_against_float64(fn, *args)
    (kernel,) = [k for k in cm.entries[0].program.kernels if k.configs > 1]
    assert kernel.configs >= 3, kernel.configs
    (line,) = [m for m in report.matmuls if "ms by tiles" in m]
    assert "computes something else" not in line and "does not build" not in line, line
    assert f"chose configuration {kernel.configs - 1}" in line, line
    assert "computes something else" not in caplog.text


def test_layers_sharing_a_kernel_at_other_sizes_are_each_measured(measured):
    times, calls = measured
    torch.manual_seed(0)
    proj = torch.nn.Linear(40, 70, bias=False)

    def two(x, y):  # one kernel's code for both (rows are size arguments), measured at each's rows
        return torch.relu(proj(x)), torch.relu(proj(y))

    x, y = torch.randn(48, 40), torch.randn(200, 40)
    na, nb = len(matmul_configs(48, 70, 40, torch.float32)), len(matmul_configs(200, 70, 40, torch.float32))
    # the heavier (y's 200 rows) first; then each one's library side: its mm, its ReLU kernel
    times += [1.0] * (nb - 1) + [0.4] + [1.0] * na + [1.0, 3.0] * 2
    with torch.no_grad():
        out, cm = run_compiled(two, x, y)
        for a, e in zip(out, two(x, y)):
            assert_same(a, e)
    first, second = cm.entries[0].program.kernels
    assert len(calls) == na + nb + 4, "each region's launch is measured at its own sizes"
    tuned = cm.entries[0].program.graph.tuning
    assert any(first.name in line for line in tuned) and any(second.name in line for line in tuned)
    assert second.code_of is None and second.blocks != first.blocks, "different choices: their own code"


def test_tuning_reports_its_progress(measured, monkeypatch):
    from gjit import progress

    reported = []
    monkeypatch.setattr(progress, "tuning", lambda done, total: reported.append((done, total)))
    times, _ = measured
    x, w, b = torch.randn(65, 40), torch.randn(130, 40), torch.randn(130)
    times += [1.0] * (len(matmul_configs(65, 130, 40, torch.float32)) + 2)
    run_compiled(linear_gelu, x, w, b)
    assert reported == [(0, 1), (1, 1)]  # the progress line's "tuned 0/1", then "tuned 1/1"
