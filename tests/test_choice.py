"""Library or template, per region (gjit/choice/, GJIT_MATMUL "auto", the default): measured on
a GPU, each matmul and attention region runs its template or ATen's kernels plus generated
kernels for what the template fused, whichever is faster; where nothing is measured, the library
but where the table of kernels/template_wins.py says the template wins. Here the kernels run in
Triton's interpreter and each measurement returns what the test says (by what it measures:
tuning.bench's `what`), so the choices are known; the `gpu` tests measure for real."""

import dataclasses
import logging
import types
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import gjit
from gjit import driver, tuning
from gjit.ir import ExternNode
from gjit.kernels import template_wins
from helpers import assert_same, run_compiled

pytestmark = [pytest.mark.cpu]


@dataclasses.dataclass
class Timing:
    """What the measurements saw: each one's `what` in order; `rule(what)` is what it returns."""

    seen: list[str]
    rule: Callable[[str], float]

    def count(self, prefix: str) -> int:
        return sum(w.startswith(prefix) for w in self.seen)


@pytest.fixture
def timing(monkeypatch):
    """Tuning on for CPU graphs, taken as on a GPU, under the default setting ("auto"). A
    measurement's `what`: "template <products> <kernel> configuration <i>", "ATen <product>" (an
    extern call of the all-ATen program), "ATen-side kernel <kernel>" (one of its kernels)."""
    timing = Timing([], lambda what: 1.0)

    def bench(fn, what):
        fn()
        timing.seen.append(what)
        return timing.rule(what)

    monkeypatch.setattr(tuning, "bench", bench)
    monkeypatch.setattr(driver, "on_gpu", lambda gm: True)
    with gjit.config.scope(tune=True, matmul="auto", measure_all_templates=True):
        yield timing


def by_kind(template: dict[str, float], aten: dict[str, float], kernels: float) -> Callable[[str], float]:
    """Times by what is measured: a template by its products, an extern by its node, any kernel
    of the library's side `kernels`."""

    def rule(what: str) -> float:
        kind, name, *_ = what.split()
        if kind == "template":
            return template[name]
        return aten[name] if kind == "ATen" else kernels

    return rule


def lines(cm, *args) -> list[str]:
    return gjit.explain(cm, *args).matmuls


def mlp(x, w1, b1, w2, r):  # region A: addmm + GELU; region B: mm + residual
    h = F.gelu(F.linear(x, w1, b1))
    return h @ w2 + r


def mlp_args():
    return torch.randn(64, 48), torch.randn(80, 48), torch.randn(80), torch.randn(80, 40), torch.randn(64, 40)


def assert_mlp(out, args):
    assert_same(out, mlp(*args), mlp(*(a.double() for a in args)))


def test_each_region_runs_its_faster_side(timing, caplog):
    """A's template (the linear) beats addmm, B's (the GELU on load, the product, the residual)
    loses to mm and the GELU's and the residual's kernels: A is a template kernel, B an extern and
    the kernel that adds the residual. Beside B's extern the GELU joins A's epilogue, so A is
    measured again as it now fuses, against addmm and the GELU's kernel: still faster."""
    args = mlp_args()
    timing.rule = by_kind({"addmm": 0.3, "mm": 1.0}, {"addmm": 0.4, "mm": 0.6}, kernels=0.1)
    with caplog.at_level(logging.INFO, logger="gjit.tuning"):
        out, cm = run_compiled(mlp, *args)
    assert_mlp(out, args)
    program = cm.entries[0].program
    assert [k.name for k in program.kernels] == ["gjit_mm_fused_addmm_gelu_0", "gjit_poi_fused_add_1"]
    assert [e.op for e in gjit.explain(cm, *args).externs] == ["aten.mm.default"]
    matmuls = lines(cm, *args)
    a = next(m for m in matmuls if m.startswith("addmm_mm ("))
    assert "template kernel gjit_mm_fused_addmm_gelu_0, with addmm, gelu fused in" in a, a
    assert "chosen per region: template (measured, float32 without TF32: template 0.300 ms, ATen 0.500" in a
    assert "ATen: addmm 0.400 + gjit_poi_fused_gelu_0 0.100" in a, a
    b = next(m for m in matmuls if m.startswith("mm ("))
    assert "ATen extern" in b and "ATen (measured, float32 without TF32: template 1.000 ms, ATen 0.800" in b
    assert "ATen: mm 0.600 + gjit_poi_fused_gelu_0 0.100 + gjit_poi_fused_add_1 0.100" in b, b
    # GJIT_LOGS=tuning says what explain says
    logged = [r.getMessage() for r in caplog.records if r.name == "gjit.tuning"]
    shown = [m for m in matmuls if m.startswith(("tuned on the GPU: ", "tuning took"))]
    tuned = [m.removeprefix("tuned on the GPU: ") for m in shown]
    assert tuned and tuned == logged, (tuned, logged)
    # each piece of the library's side timed once, A's template in two forms
    assert timing.count("ATen mm") == timing.count("ATen addmm") == 1
    assert timing.count("ATen-side kernel") == 2
    assert len({w.split()[2] for w in timing.seen if w.startswith("template addmm")}) == 2


def test_a_region_that_fuses_otherwise_beside_the_library_is_measured_again(timing):
    """With A (the linear) in ATen, B's template reads the GELU on load from the extern's output:
    not the kernel that was measured. It is measured again as it now fuses, and kept."""
    args = mlp_args()
    timing.rule = by_kind({"addmm": 1.0, "mm": 0.5}, {"addmm": 0.3, "mm": 1.0}, kernels=0.2)
    out, cm = run_compiled(mlp, *args)
    assert_mlp(out, args)
    program = cm.entries[0].program
    (kernel,) = program.kernels
    assert kernel.name.startswith("gjit_mm_") and "gelu" in kernel.name
    assert [e.op for e in gjit.explain(cm, *args).externs] == ["aten.addmm.default"]
    tuned = [m for m in lines(cm, *args) if m.startswith("tuned on the GPU")]
    assert any("mm: fused otherwise beside the library's kernels: measured again" in m for m in tuned), tuned
    configurations = [w for w in timing.seen if w.startswith("template mm ") and w.endswith(" 0")]
    assert len(configurations) == 2 and configurations[0] != configurations[1], configurations


def test_layers_that_share_a_kernel_are_decided_once(timing):
    torch.manual_seed(0)
    w1, w2 = torch.randn(40, 40), torch.randn(40, 40)

    def stacked(x, w1, w2):  # one size symbol for both layers' rows: one kernel's code
        h = x + torch.relu(x @ w1)
        return h + torch.relu(h @ w2)

    x = torch.randn(20, 40)
    timing.rule = by_kind({"mm": 1.0, "mm_1": 1.0}, {"mm": 0.2, "mm_1": 0.2}, kernels=0.2)
    out, cm = run_compiled(stacked, x, w1, w2)
    assert_same(out, stacked(x, w1, w2))
    assert [e.op for e in gjit.explain(cm, x, w1, w2).externs] == ["aten.mm.default"] * 2
    assert timing.count("template mm ") == len(timing.seen) - 2, "one layer's configurations, measured"
    assert timing.count("template mm_1") == 0 and timing.count("ATen mm_1") == 0
    tuned = [m for m in lines(cm, x, w1, w2) if m.startswith("tuned on the GPU")]
    assert any(m.startswith("tuned on the GPU: mm (and 1 more alike): ATen (measured") for m in tuned), tuned


def test_a_qkv_group_is_weighed_against_every_product_and_the_norm_it_absorbed(timing):
    """q, k and v of one layer-normed input are one template kernel, the norm's statistics in its
    prologue: the library's side is three mm calls and the layer norm's kernel. Without the norm
    (0.75 ms) ATen would win; with it (1.25 ms) the template (1.0 ms) does."""

    def qkv(x, wq, wk, wv):
        h = F.layer_norm(x, (48,))
        return h @ wq, h @ wk, h @ wv

    args = (torch.randn(64, 48), *(torch.randn(48, 32) for _ in range(3)))
    timing.rule = by_kind({"mm,mm_1,mm_2": 1.0}, {"mm": 0.25, "mm_1": 0.25, "mm_2": 0.25}, kernels=0.5)
    out, cm = run_compiled(qkv, *args)
    for a, e in zip(out, qkv(*args)):
        assert_same(a, e)
    (kernel,) = cm.entries[0].program.kernels
    assert kernel.name.startswith("gjit_mm_fused_native_layer_norm")
    (line,) = [m for m in lines(cm, *args) if m.startswith("tuned on the GPU: mm, mm_1, mm_2:")]
    assert "template 1.000 ms, ATen 1.250 ms" in line, line
    assert "mm 0.250 + mm_1 0.250 + mm_2 0.250 + gjit_red_fused_native_layer_norm_0 0.500" in line, line


def test_a_post_norm_in_the_epilogue_is_weighed_with_its_kernel(timing):
    """A norm after a linear runs in the template's epilogue (gjit/fusion/rows.py): the library's side
    is addmm and the kernel of the residual add and the norm."""

    def post(x, w, b, r):
        return F.layer_norm(F.linear(x, w, b) + r, (80,))

    args = torch.randn(64, 48), torch.randn(80, 48), torch.randn(80), torch.randn(64, 80)
    timing.rule = by_kind({"addmm": 1.0}, {"addmm": 0.6}, kernels=0.6)
    out, cm = run_compiled(post, *args)
    assert_same(out, post(*args))
    (kernel,) = cm.entries[0].program.kernels
    assert kernel.name.startswith("gjit_mm_") and "row epilogue" in kernel.source
    (line,) = [m for m in lines(cm, *args) if m.startswith("tuned on the GPU: addmm:")]
    assert "template (measured" in line and "ATen 1.200 ms" in line, line
    assert "gjit_red_fused_native_layer_norm_add_0 0.600" in line, line


def test_a_norm_two_templates_absorbed_is_split_between_them(timing):
    """Four products of one normed input: q, k, v in one kernel (at most three a kernel), the
    fourth in its own, each computing the norm's statistics: the norm's kernel counts half on
    each's library side. The group loses (0.9 ms against three mm calls and half the norm's kernel,
    0.8); then the norm's values are stored for its externs, the fourth no longer computes them,
    is measured again as it now fuses, and loses to mm alone."""

    def four(x, w1, w2, w3, w4):
        h = F.layer_norm(x, (48,))
        return h @ w1, h @ w2, h @ w3, h @ w4

    args = (torch.randn(64, 48), *(torch.randn(48, 32) for _ in range(4)))
    externs = dict.fromkeys(["mm", "mm_1", "mm_2", "mm_3"], 0.1)
    timing.rule = by_kind({"mm,mm_1,mm_2": 0.9, "mm_3": 0.55}, externs, kernels=1.0)
    out, cm = run_compiled(four, *args)
    for a, e in zip(out, four(*args)):
        assert_same(a, e)
    assert [e.op for e in gjit.explain(cm, *args).externs] == ["aten.mm.default"] * 4
    tuned = [m for m in lines(cm, *args) if m.startswith("tuned on the GPU")]
    group = next(m for m in tuned if m.startswith("tuned on the GPU: mm, mm_1, mm_2:"))
    assert "ATen (measured, float32 without TF32: template 0.900 ms, ATen 0.800 ms)" in group, group
    assert "gjit_red_fused_native_layer_norm_0 1.000 x 0.50" in group, group
    fourth = [m for m in tuned if m.startswith("tuned on the GPU: mm_3:")]
    assert "template 0.550 ms, ATen 0.600 ms" in fourth[0] and "x 0.50" in fourth[0], fourth
    assert any("mm_3: fused otherwise beside the library's kernels: measured again" in m for m in tuned)
    assert "ATen (measured, float32 without TF32: template 0.550 ms, ATen 0.100 ms)" in fourth[-1], fourth


@pytest.fixture
def tf32(monkeypatch):
    """The call taken as on a GPU for TF32 (the entry follows torch's setting, as in
    tests/test_matmul.py); yields a setter."""
    monkeypatch.setattr(gjit.api, "tf32_allowed", lambda on_gpu: torch.backends.cuda.matmul.allow_tf32)
    previous = torch.backends.cuda.matmul.allow_tf32
    yield lambda on: setattr(torch.backends.cuda.matmul, "allow_tf32", on)
    torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.mark.parametrize("allowed", [False, True])
def test_a_short_float32_product_without_tf32_is_still_compared_with_the_library(timing, tf32, allowed):
    """A template under MIN_KERNEL_MS keeps its launch without ATen being tried, but a float32
    product without TF32 runs on the FMA units: the library unless measured faster."""
    tf32(allowed)
    a, b = torch.randn(64, 96), torch.randn(96, 80)
    timing.rule = by_kind({"mm": 0.005}, {"mm": 0.004}, kernels=0.0)
    out, cm = run_compiled(torch.mm, a, b)
    assert_same(out, a @ b)
    (line,) = [m for m in lines(cm, a, b) if m.startswith("tuned on the GPU: mm:")]
    if allowed:
        assert "mm: template (too short to matter: template 0.005 ms)" in line, line
        assert timing.count("ATen") == 0
    else:
        assert "mm: ATen (measured, float32 without TF32: template 0.005 ms, ATen 0.004 ms)" in line, line
        assert not cm.entries[0].program.kernels


def test_without_a_gpu_the_default_is_the_library():
    """No GPU, no card to compile for: nothing is measured, no table applies; the CPU runs the
    program eagerly anyway (or interpreted, where ATen's matmul is the fast one)."""
    x, w, b = torch.randn(16, 24), torch.randn(32, 24), torch.randn(32)
    with gjit.config.scope(matmul="auto", tune=True):
        out, cm = run_compiled(F.linear, x, w, b)
    assert_same(out, F.linear(x, w, b))
    report = gjit.explain(cm, x, w, b)
    assert [e.op for e in report.externs] == ["aten.addmm.default"]
    assert "the library: nothing measured (not on a GPU)" in report.externs[0].reason
    assert not cm.entries[0].program.graph.tuning


def bert_attention(q, k, v):  # bench/gpu_templates.py's "bert eager attention"
    scores = q @ k.transpose(-1, -2) * (1 / 8)
    return torch.softmax(scores, -1) @ v


def llama_down(x, w, b, r):  # bench/gpu_templates.py's "llama down (linear+residual)"
    return F.linear(x, w, b) + r


def bf16(*sizes):
    return [torch.randn(*size, dtype=torch.bfloat16) for size in sizes]


TABLE_CASES = {  # (fn, its arguments at a size, the size the table has)
    "bert attention": (bert_attention, lambda s: bf16(*[(32, 12, s, 64)] * 3), 128),
    "llama down": (llama_down, lambda s: bf16((s, 11008), (4096, 11008), (4096,), (s, 4096)), 2048),
}


def compiled_for(fn, args, target):
    """An entry compiled (nothing run) for a card of compute capability `target`."""
    cm = gjit.compile(fn)
    cm.target = target
    entry, _ = cm.entry_for(tuple(args), {})
    return entry.program


@pytest.mark.parametrize("case", list(TABLE_CASES))
def test_with_tuning_off_the_library_runs_but_where_the_table_says_the_template_wins(case):
    """The table's entries, measured on an H200 (sm_90), at their sizes: templates in the tiles
    that ran there; other sizes, other cards, or no card: ATen."""
    fn, make, size = TABLE_CASES[case]
    with gjit.config.scope(matmul="auto", tune=False), torch.no_grad():
        table = compiled_for(fn, make(size), 90)
        other_size = compiled_for(fn, make(size // 2), 90)
        other_card = compiled_for(fn, make(size), 80)
    (template,) = [k for k in table.kernels if k.name.startswith(("gjit_mm_", "gjit_attn_"))]
    (region,) = table.graph.templates.regions
    assert region.why == "table" and region.template and region.template_ms < region.aten_ms
    if case == "llama down":
        tiles = tuple(template.blocks[b] for b in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
        assert tiles == (128, 256, 64)
        assert (template.num_warps, template.num_stages) == (8, 3)  # "128 x 256 x 64, 8 warps, 3 stages"
    for program in (other_size, other_card):
        assert not any(k.name.startswith(("gjit_mm_", "gjit_attn_")) for k in program.kernels)
        assert not program.graph.templates.regions
    externs = [s.reason for s in other_card.steps if isinstance(s, ExternNode)]
    why = "nothing measured (tuning off, GJIT_TUNE=0), and kernels/template_wins.py has no such region for "
    why += "sm_80"
    assert externs and all(why in r for r in externs), externs


def test_the_table_cites_measurements():
    for win in template_wins.WINS:
        assert win.template_ms < win.aten_ms and win.capability == 90 and "docs/bench.md" in win.source


def test_explain_shows_why_a_region_was_not_measured(timing, caplog):
    """Too short to matter, the table, tuning off: each region's line says which."""
    x, w = torch.randn(32, 48, dtype=torch.float16), torch.randn(48, 64, dtype=torch.float16)
    timing.rule = lambda what: 0.001
    _, cm = run_compiled(torch.mm, x, w)
    (line,) = [m for m in lines(cm, x, w) if m.startswith("mm (")]
    assert "chosen per region: template (too short to matter: template 0.001 ms)" in line, line
    with gjit.config.scope(tune=False), caplog.at_level(logging.INFO, logger="gjit.tuning"):
        _, cm = run_compiled(torch.mm, x, w)
    (line,) = [m for m in lines(cm, x, w) if m.startswith("mm (")]
    assert "ATen extern" in line and "nothing measured (tuning off, GJIT_TUNE=0)" in line, line
    assert "mm: ATen (the library: nothing measured (tuning off, GJIT_TUNE=0))" in caplog.text


def test_a_warm_start_and_a_package_keep_the_choice_without_measuring(timing, tmp_path):
    class Mlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(48, 80), torch.nn.Linear(80, 40, bias=False)

        def forward(self, x, r):
            return self.down(F.gelu(self.up(x))) + r

    torch.manual_seed(0)
    model, x, r = Mlp().eval(), torch.randn(64, 48), torch.randn(64, 40)
    timing.rule = by_kind({"addmm": 0.5, "mm": 1.0}, {"addmm": 0.4, "mm": 0.6}, kernels=0.3)
    with torch.no_grad(), gjit.config.scope(cache=True, cache_dir=str(tmp_path / "cache")):
        _, cold = run_compiled(model, x, r)
        measured = len(timing.seen)
        assert measured
        out, warm = run_compiled(gjit.compile(model), x, r)
        assert gjit.stats()["disk_cache_hits"] == 1
        assert len(timing.seen) == measured, "a warm start measures nothing"
        assert_same(out, model(x, r))
        gjit.save(cold, str(tmp_path / "mlp.gjit"))
        out, loaded = run_compiled(gjit.load(str(tmp_path / "mlp.gjit"), model=model), x, r)
        assert len(timing.seen) == measured, "a package measures nothing"
        assert_same(out, model(x, r))
    expected = lines(cold, x, r)
    # the GELU runs on load in down's template (as in the template program): up's template was
    # weighed against addmm alone, and lost
    assert [e.op for e in gjit.explain(cold, x, r).externs] == ["aten.addmm.default"]
    for other in (warm, loaded):
        program = other.entries[0].program
        assert [k.name for k in program.kernels] == [k.name for k in cold.entries[0].program.kernels]
        assert lines(other, x, r) == expected  # the choices, their figures and tuning's lines
    assert len(timing.seen) == measured


def test_the_matmul_setting_is_checked():
    with gjit.config.scope(matmul="fastest"), pytest.raises(ValueError, match="'auto', 'template', 'aten'"):
        gjit.compile(torch.mm)(torch.randn(4, 4), torch.randn(4, 4))


def attention_and_linear(q, k, v, w):  # a written-out attention, then a product of its output
    return bert_attention(q, k, v) @ w


def masked_attention_and_linear(q, k, v, w):
    """A written-out attention whose scores get a bias before the scale (on a GPU the written-out
    form stays: gjit/lowering/attention_library.py), then a product of its output."""
    rows, keys = q.shape[-2], k.shape[-2]
    bias = -(torch.arange(keys)[None, :] - torch.arange(rows)[:, None]).abs().float()
    scores = (q @ k.transpose(-1, -2) + bias) * (1 / 8)
    return torch.softmax(scores, -1) @ v @ w


def attention_and_linear_args():
    torch.manual_seed(0)
    return torch.randn(2, 3, 16, 8), torch.randn(2, 3, 24, 8), torch.randn(2, 3, 24, 8), torch.randn(8, 12)


def test_mode_default_runs_products_in_the_library_without_building_their_templates(timing):
    """Mode "default" (gjit.config.measure_all_templates off): a product with a prologue or an
    epilogue runs ATen's kernel, its template neither built nor timed; nothing is measured."""
    args = mlp_args()
    timing.rule = by_kind({"addmm": 0.1, "mm": 0.1}, {"addmm": 1.0, "mm": 1.0}, kernels=1.0)  # templates win
    with gjit.config.scope(measure_all_templates=False):
        out, cm = run_compiled(mlp, *args)
    assert_mlp(out, args)
    assert not timing.seen
    program = cm.entries[0].program
    assert not [k for k in program.kernels if k.name.startswith(("gjit_mm_", "gjit_attn_"))]
    report = gjit.explain(cm, *args)
    assert [e.op for e in report.externs] == ["aten.addmm.default", "aten.mm.default"]
    for extern in report.externs:
        assert "mode default measures templates only where they fuse a written-out attention" in extern.reason


def test_mode_default_measures_a_written_out_attention_and_no_product(timing):
    """Mode "default": the template of a written-out attention is built and weighed against the
    library (it keeps the score matrix on chip), the product after it is the library's unmeasured."""
    args = attention_and_linear_args()
    timing.rule = lambda what: 0.1 if what.startswith("template") else 1.0
    with gjit.config.scope(measure_all_templates=False):
        out, cm = run_compiled(masked_attention_and_linear, *args)
    expected = masked_attention_and_linear(*args)
    assert_same(out, expected, masked_attention_and_linear(*(a.double() for a in args)))
    measured = [w for w in timing.seen if w.startswith("template")]
    assert measured and all(w.split()[2].startswith("gjit_attn_") for w in measured), timing.seen
    assert timing.count("ATen bmm") == 2 and timing.count("ATen mm") == 0, timing.seen
    program = cm.entries[0].program
    names = [k.name for k in program.kernels if k.name.startswith(("gjit_mm_", "gjit_attn_"))]
    assert len(names) == 1 and names[0].startswith("gjit_attn_fused_"), names
    report = gjit.explain(cm, *args)
    assert [e.op for e in report.externs] == ["aten.mm.default"]
    assert "mode default measures templates only" in report.externs[0].reason
    (region,) = program.graph.templates.regions
    assert region.template and region.why == "measured, float32 without TF32", region


@pytest.mark.parametrize("faster", ["template", "ATen"])
def test_on_a_gpu_an_attention_only_scaled_weighs_the_template_against_atens_sdpa(
    timing, faster, monkeypatch
):
    """On a GPU a written-out attention whose score is only scaled is ATen's SDPA call
    (gjit/lowering/attention_library.py): mode "default" weighs the template against that call, as
    it weighed it against the written-out form; the product after it is the library's unmeasured.
    The library's time is the wrapper's whole call (its output's layout copy, eager's rows)."""
    from gjit.runtime import attention_masks

    args = attention_and_linear_args()
    calls, layouts = [], []
    traced_layout = attention_masks.traced_layout
    monkeypatch.setattr(attention_masks, "traced_layout", lambda *a: layouts.append(1) or traced_layout(*a))

    def rule(what):
        if what.startswith("ATen scaled_dot_product_attention"):
            calls.append(len(layouts))  # layouts made by the timed call, before the rule is asked
        return 0.1 if what.startswith(faster) else 1.0

    timing.rule = rule
    with gjit.config.scope(measure_all_templates=False):
        out, cm = run_compiled(attention_and_linear, *args)
    assert calls and calls[0] >= 2, (calls, layouts)  # the run that recorded it, then the timed call
    assert_same(out, attention_and_linear(*args), attention_and_linear(*(a.double() for a in args)))
    assert timing.count("ATen scaled_dot_product_attention") == 1 and timing.count("ATen mm") == 0, (
        timing.seen
    )
    (region,) = cm.entries[0].program.graph.templates.regions
    assert region.template == (faster == "template") and region.why.startswith("measured"), region
    externs = [e.op for e in gjit.explain(cm, *args).externs]
    sdpa = ["aten.scaled_dot_product_attention.default"] if faster == "ATen" else []
    assert externs == [*sdpa, "aten.mm.default"], externs


@pytest.mark.compile_only
def test_gjit_aot_builds_what_the_card_runs_without_measuring(sm90):
    """gjit.aot for sm_90 compiles the call for that card: the table's entries there as templates,
    the rest ATen's."""
    args = TABLE_CASES["bert attention"][1](128)
    with gjit.config.scope(matmul="auto"), torch.no_grad():
        report = gjit.aot(bert_attention, *args, arch="sm_90")
    assert [k.name for k in report.kernels] == ["gjit_attn_fused_bmm_mul__softmax_0"]


@pytest.mark.gpu
def test_on_a_gpu_each_region_is_measured_and_runs_what_it_chose():
    """Real sizes, real timings: whatever each region chose, the program computes what eager
    does, each choice names both times, and the program holds a template kernel exactly for the
    regions that chose the template."""
    torch.manual_seed(0)
    dims = dict(device="cuda", dtype=torch.float16)
    x, w1, b1 = torch.randn(4096, 768, **dims), torch.randn(3072, 768, **dims) / 28, torch.randn(3072, **dims)
    w2, r = torch.randn(3072, 768, **dims) / 55, torch.randn(4096, 768, **dims)
    with gjit.config.scope(matmul="auto", tune=True, measure_all_templates=True), torch.no_grad():
        cm = gjit.compile(mlp)
        out = cm(x, w1, b1, w2, r)
    expected, reference = mlp(x, w1, b1, w2, r), mlp(*(t.double() for t in (x, w1, b1, w2, r)))
    assert_same(out, expected, reference)
    templates = cm.entries[0].program.graph.templates
    assert {c.nodes for c in templates.regions} == {("addmm",), ("mm",)}
    kernels = [k.name for k in cm.entries[0].program.kernels]
    for region in templates.regions:
        assert region.why in ("measured", "too short to matter"), region
        if region.why == "measured":
            assert region.template_ms is not None and region.aten_ms is not None
        op = "addmm" if region.nodes == ("addmm",) else "mm"
        assert any(k.startswith(f"gjit_mm_fused_{op}") for k in kernels) == region.template, (region, kernels)


@pytest.mark.gpu
def test_on_a_gpu_without_tuning_the_library_runs():
    dims = dict(device="cuda", dtype=torch.float16)
    x, w = torch.randn(512, 768, **dims), torch.randn(768, 768, **dims)
    with gjit.config.scope(matmul="auto", tune=False):
        cm = gjit.compile(torch.mm)
        out = cm(x, w)
    assert_same(out, x @ w)
    assert not cm.entries[0].program.kernels
    default = cm.entries[0].program.graph.templates.default
    assert default.startswith("the library: nothing measured (tuning off"), default


def test_a_package_with_the_tables_templates_names_its_card(monkeypatch):
    """Tiles the table took from an H200 may not fit another card's shared memory: a package of
    such an entry loads only on that GPU, as a tuned one does (gjit/packaging.py)."""
    from gjit import packaging
    from gjit.lowering.templates import RegionChoice, TemplateChoice

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")

    def compiled(*regions):
        ns = types.SimpleNamespace
        graph = ns(tuning=[], on_cuda=True, templates=TemplateChoice(None, regions=regions))
        return ns(entries=[ns(program=ns(graph=graph))])

    table = RegionChoice(("addmm",), True, "table", 0.242, 0.258, "NVIDIA H200, ...", 2)
    library = RegionChoice(("mm",), False, "not measured: ...")
    assert packaging._tuned_on(compiled(table)) == "NVIDIA H200"
    assert packaging._tuned_on(compiled(library)) == ""
