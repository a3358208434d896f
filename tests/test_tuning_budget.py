"""Tuning bounded and paid once (gjit/tuning.py's Budget, gjit/choice/, gjit/runtime/tuning_store.py):
a compile measures its heaviest template kernels first for at most a share of the cold compile
(GJIT_TUNE_BUDGET, 0.2), the rest keep the table's configuration and choice; mode="max-autotune"
lifts the limit; what was measured is kept on disk (and in the remote cache: tests/test_remote_cache.py)
by kernel code, size bucket, GPU and versions, so that a later compile of another program with
the same kernels measures nothing, and one that finds a record left short by a budget goes on
from where it stopped.

As in tests/test_choice.py the kernels run in Triton's interpreter and each measurement returns
what the test says; here each also takes one second of a fake clock, and the compile before tuning
took `Measuring.compiled` seconds, so what a budget allows is known."""

import collections
import dataclasses
import json
import logging
import os
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import gjit
from gjit import driver, tuning
from gjit.runtime import tuning_store
from helpers import assert_same, run_compiled

pytestmark = [pytest.mark.cpu]


@dataclasses.dataclass
class Measuring:
    seen: list[str]
    clock: list[float]
    compiled: float = 10.0  # the compile's seconds before tuning, as the budget sees them
    template: Callable[[str], float] = lambda what: 1.0  # a template configuration's ms

    def configurations(self, index: int | None = None) -> list[str]:
        """The template measurements (of configuration `index`)."""
        wanted = [w for w in self.seen if w.startswith("template ")]
        return wanted if index is None else [w for w in wanted if w.endswith(f"configuration {index}")]


@pytest.fixture
def measuring(monkeypatch):
    """Tuning on for CPU graphs, as on a GPU, under "auto": a template 1 ms, ATen's product 2 ms,
    a kernel of the library's side 0.5 ms (so the templates win); each measurement one second."""
    measuring = Measuring([], [0.0])

    def bench(fn, what):
        fn()
        measuring.seen.append(what)
        measuring.clock[0] += 1.0
        kind = what.split()[0]
        return measuring.template(what) if kind == "template" else 2.0 if kind == "ATen" else 0.5

    budget_init = tuning.Budget.__init__

    def budget(self, share, compiled):
        budget_init(self, share, measuring.compiled)

    monkeypatch.setattr(tuning, "bench", bench)
    monkeypatch.setattr(tuning, "clock", lambda: measuring.clock[0])
    monkeypatch.setattr(tuning.Budget, "__init__", budget)
    monkeypatch.setattr(driver, "on_gpu", lambda gm: True)
    with gjit.config.scope(tune=True, matmul="auto", tune_budget=0.2, measure_all_templates=True):
        yield measuring


def mlp(x, w1, b1, w2, r):  # two template kernels: addmm + GELU, mm + residual
    return F.gelu(F.linear(x, w1, b1)) @ w2 + r


def mlp_and_more(x, w1, b1, w2, r, z):  # another program, the same two template kernels
    return mlp(x, w1, b1, w2, r), z.sin()


def mlp_args():
    torch.manual_seed(0)
    return torch.randn(64, 48), torch.randn(80, 48), torch.randn(80), torch.randn(80, 40), torch.randn(64, 40)


def assert_close_to_float64(out, fn, *args):
    """`out` (float32) as close to fn's float64 result as eager's float32 result is, within 2x, by
    the largest error: these tests are about what is measured, and the float32 templates order
    their sums otherwise than eager (tests/test_matmul.py checks them element by element)."""
    ref = fn(*(a.double() for a in args))
    eager = fn(*args)
    assert out.dtype == eager.dtype and out.shape == eager.shape
    err, eager_err = (out.double() - ref).abs().max(), (eager.double() - ref).abs().max()
    assert err <= 2 * eager_err + 1e-6, (err, eager_err)


def tuned_lines(cm, *args) -> list[str]:
    return [m for m in gjit.explain(cm, *args).matmuls if m.startswith(("tuned on the GPU", "tuning took"))]


def configs_of(cm) -> int:
    """Every configuration of the program's template kernels (in the template program)."""
    return sum(k.configs for k in cm.entries[0].program.kernels if k.name.startswith("gjit_mm_"))


def test_a_budget_measures_the_heaviest_kernel_first_and_the_rest_keep_the_table(measuring):
    """A budget of 0.75 s (0.2 of a 3 s compile) is spent by the first measurement: the heavier
    template kernel is timed in its table's configuration and weighed against the library's side
    (a timed template without it would decide nothing), the lighter one is not measured and takes
    the table's choice: the library, the table having nothing for this card. Beside addmm's extern
    the heavier region fuses otherwise: past the budget that kernel is not measured either, and
    takes the library too."""
    args = mlp_args()
    measuring.compiled = 3.0
    out, cm = run_compiled(mlp, *args)
    assert_close_to_float64(out, mlp, *args)
    heavier, lighter = "gjit_mm_fused_addmm_gelu_mm_add_1", "gjit_mm_fused_addmm_0"  # the template program's
    assert measuring.configurations() == [f"template mm {heavier} configuration 0"], measuring.seen
    assert not any(w.startswith("template addmm") for w in measuring.seen)
    lines = tuned_lines(cm, *args)
    assert (
        f"tuned on the GPU: {heavier}: ms by tiles: [64x64x16 w8] 1.000, the rest not tried: over the "
        "tuning budget" in lines
    ), lines
    assert f"tuned on the GPU: {lighter}: not measured: over the tuning budget" in lines, lines
    assert any(m.startswith("tuned on the GPU: mm: template (measured") for m in lines), lines
    assert any(
        m.startswith("tuned on the GPU: addmm: ATen (not measured: over the tuning budget; the library")
        for m in lines
    ), lines
    assert (
        lines[-1].startswith("tuning took") and "of a budget of 0.75 s (20% of the cold compile)" in lines[-1]
    )
    assert "tuned on the GPU: gjit_mm_fused_gelu_mm_add_0: not measured: over the tuning budget" in lines
    assert [e.op for e in gjit.explain(cm, *args).externs] == ["aten.addmm.default", "aten.mm.default"]
    assert measuring.seen[1:] == [
        "ATen mm",
        "ATen-side kernel gjit_poi_fused_gelu_0",
        "ATen-side kernel gjit_poi_fused_add_1",
    ]
    assert gjit.stats()["tuning_over_budget"] == 2


def test_the_heaviest_kernels_get_the_budget_first(measuring):
    """2.5 s: both kernels timed in their first configuration, the library's side built, then one
    more configuration of the heavier kernel; the choice is measured for both."""
    args = mlp_args()
    out, cm = run_compiled(mlp, *args)
    assert_close_to_float64(out, mlp, *args)
    first, second, third = measuring.configurations()
    assert first.endswith("configuration 0") and second.endswith("configuration 0")
    assert third == first.replace("configuration 0", "configuration 1"), measuring.seen
    assert [e.op for e in gjit.explain(cm, *args).externs] == [], "both templates win, as measured"
    lines = tuned_lines(cm, *args)
    # the heavier kernel's two configurations tried, the other's first of three
    assert sum("the rest not tried: over the tuning budget" in m for m in lines) == 1, lines
    assert not gjit.stats().get("tuning_over_budget")


def test_max_autotune_tries_every_configuration(measuring):
    """Every template built and measured (as GJIT_MEASURE_ALL_TEMPLATES=1 asks in every mode), in
    every configuration, without a budget."""
    args = mlp_args()
    with gjit.config.scope(tune_budget=0.2, measure_all_templates=False):
        out, cm = run_compiled(gjit.compile(mlp, mode="max-autotune-no-cudagraphs"), *args)
    assert_close_to_float64(out, mlp, *args)
    assert len([k for k in cm.entries[0].program.kernels if k.name.startswith("gjit_mm_")]) == 2
    assert len(measuring.configurations()) == configs_of(cm)
    lines = tuned_lines(cm, *args)
    assert not any("over the tuning budget" in m for m in lines), lines
    assert lines[-1].startswith("tuning took") and "without a budget" in lines[-1], lines


def test_another_program_with_the_same_kernels_measures_nothing(measuring, tmp_path):
    """The records of the first compile are kept on disk; after gjit.reset() (memory forgotten) a
    different program whose template kernels are the same takes them: no template timed, no
    library side built or timed, the same choice."""
    args = mlp_args()
    z = torch.randn(7)
    with gjit.config.scope(cache=True, cache_dir=str(tmp_path), tune_budget=1.0):
        out, first = run_compiled(mlp, *args)
        measured = list(measuring.seen)
        assert measured and gjit.stats()["tuning_records_stored"] == 2
        assert len(os.listdir(tmp_path / "tuning")) >= 1
        assert [e.op for e in gjit.explain(first, *args).externs] == []
        gjit.reset()
        (out, sin), second = run_compiled(mlp_and_more, *args, z)
    assert measuring.seen == measured, "the second program measured nothing"
    assert_close_to_float64(out, mlp, *args)
    assert_same(sin, z.sin())
    assert gjit.stats()["tuning_records_reused"] == 2 and not gjit.stats().get("tuning_records_stored")
    lines = tuned_lines(second, *args, z)
    assert sum("(an earlier compile's measurements)" in m for m in lines) == 2, lines
    assert [e.op for e in gjit.explain(second, *args, z).externs] == []


def test_a_record_left_short_by_a_budget_is_continued(measuring, tmp_path):
    """The first compile's budget (2.5 s) leaves configurations untried; a later one with no
    limit tries only those, takes the library's time from the record, and stores the record
    again, whole: a third measures nothing."""
    args = mlp_args()
    z = torch.randn(7)

    def configurations(seen: list[str]) -> list[tuple[str, int]]:  # (products, index) of each
        return [(w.split()[1], int(w.split()[-1])) for w in seen if w.startswith("template ")]

    with gjit.config.scope(cache=True, cache_dir=str(tmp_path)):
        run_compiled(mlp, *args)
        first = list(measuring.seen)
        gjit.reset()
        with gjit.config.scope(tune_budget=1.0):
            _, cm = run_compiled(mlp_and_more, *args, z)
            every = configs_of(cm)
        continued = measuring.seen[len(first) :]
        gjit.reset()
        with gjit.config.scope(tune_budget=1.0):
            (out, _), _ = run_compiled(lambda *a: (mlp(*a[:5]), a[5].cos()), *args, z)
    assert_close_to_float64(out, mlp, *args)
    assert len(measuring.seen) == len(first) + len(continued), "the third compile measured nothing"
    assert continued and not any(w.startswith("ATen") for w in continued), "the library's time: the record's"
    tried = collections.Counter(products for products, _ in configurations(first))
    for products, index in configurations(continued):  # from where the first compile stopped
        assert index >= tried[products], (products, index, first)
    assert len(configurations(first)) + len(configurations(continued)) == every, (first, continued)


def test_a_record_is_keyed_by_size_bucket_and_checked():
    code, device = "kernel code", "NVIDIA H200"
    key = tuning_store.record_key(code, [60, 1], device)
    assert key == tuning_store.record_key(code, [64, 1], device)
    assert key != tuning_store.record_key(code, [65, 1], device)
    assert key != tuning_store.record_key(code, [64, 1], "NVIDIA H100 80GB HBM3")
    assert key != tuning_store.record_key(code + " ", [64, 1], device)
    tuned = tuning_store.Tuned(2, 0.5, 4, 6, "line", 0.7, "mm 0.7")
    assert tuning_store.decoded(tuning_store.encoded(key, tuned), key) == tuned
    with pytest.raises(ValueError):
        tuning_store.decoded(tuning_store.encoded(key, tuned), "another key")
    bad = json.loads(tuning_store.encoded(key, tuned)) | {"config": 6}
    with pytest.raises(ValueError):
        tuning_store.decoded(json.dumps(bad), key)


def test_a_damaged_record_is_measured_again(measuring, tmp_path, caplog):
    args = mlp_args()
    with gjit.config.scope(cache=True, cache_dir=str(tmp_path), tune_budget=1.0):
        run_compiled(mlp, *args)
        measured = len(measuring.seen)
        for folder, _, files in os.walk(tmp_path / "tuning"):
            for f in files:
                with open(os.path.join(folder, f), "w") as out:
                    out.write('{"format": 1, "key": "')
        gjit.reset()
        with caplog.at_level(logging.INFO, logger="gjit.tuning"):
            out, _ = run_compiled(mlp_and_more, *args, torch.randn(3))
    assert len(measuring.seen) == 2 * measured, "measured again"
    assert "not used" in caplog.text
    assert_close_to_float64(out[0], mlp, *args)


def test_a_second_machine_of_a_fleet_tunes_nothing_the_first_tuned(measuring, tmp_path):
    """Two machines (each its own disk cache) share a real redis-server: the second compiles
    another program with the first's template kernels and measures nothing, its records from the
    server (and now on its disk)."""
    from test_remote_cache import Server, flush, stored_keys  # skips without the redis client library

    server = Server()
    try:
        args, z = mlp_args(), torch.randn(5)
        with gjit.config.scope(cache=True, remote_cache=server.url(), tune_budget=1.0):
            with gjit.config.scope(cache_dir=str(tmp_path / "a")):
                run_compiled(mlp, *args)
            measured = list(measuring.seen)
            flush(server.url())
            assert sum(k.startswith(b"gjit:tuning-") for k in stored_keys(server)) == 2
            gjit.reset()
            with gjit.config.scope(cache_dir=str(tmp_path / "b")):
                (out, _), second = run_compiled(mlp_and_more, *args, z)
                lines = tuned_lines(second, *args, z)
    finally:
        server.kill()
    assert measured and measuring.seen == measured, "the second machine measured nothing"
    assert gjit.stats()["remote_tuning_hits"] == 2 and gjit.stats()["tuning_records_reused"] == 2
    assert sum("(an earlier compile's measurements)" in m for m in lines) == 2, lines
    assert len(os.listdir(tmp_path / "b" / "tuning")) >= 1, "kept on the second machine's disk"
    assert_close_to_float64(out, mlp, *args)


def test_the_budget_is_checked():
    with gjit.config.scope(tune_budget=-0.5), pytest.raises(ValueError, match="a share of the cold compile"):
        gjit.compile(torch.mm)(torch.randn(4, 4), torch.randn(4, 4))


def test_a_short_record_on_disk_gives_way_to_the_fleets_complete_one(measuring, tmp_path):
    """Machine a's budget leaves its records short (on its disk and the server); machine b goes on
    from them and replaces the server's; back on a, another program finds a's short record on disk,
    takes the server's complete one instead and measures nothing."""
    from test_remote_cache import Server, flush  # skips without the redis client library

    server = Server()
    try:
        args, z = mlp_args(), torch.randn(5)
        with gjit.config.scope(cache=True, remote_cache=server.url()):
            with gjit.config.scope(cache_dir=str(tmp_path / "a")):
                run_compiled(mlp, *args)
            flush(server.url())
            gjit.reset()
            with gjit.config.scope(cache_dir=str(tmp_path / "b"), tune_budget=1.0):
                run_compiled(mlp_and_more, *args, z)
            flush(server.url())
            measured = list(measuring.seen)
            gjit.reset()
            with gjit.config.scope(cache_dir=str(tmp_path / "a"), tune_budget=1.0):
                (out, _), _ = run_compiled(lambda *a: (mlp(*a[:5]), a[5].cos()), *args, z)
    finally:
        server.kill()
    assert measuring.seen == measured, "the third compile measured nothing"
    assert_close_to_float64(out, mlp, *args)


def test_a_records_configuration_that_computes_otherwise_is_measured_again(measuring, tmp_path, monkeypatch):
    """A record's configuration (not the table's) is run once on this call's kept launch before it
    is taken: where it does not write what the emitted one did, the kernel is measured again."""
    args = mlp_args()
    measuring.template = lambda what: 0.5 if what.endswith("configuration 1") else 1.0
    with gjit.config.scope(cache=True, cache_dir=str(tmp_path), tune_budget=1.0):
        _, first = run_compiled(mlp, *args)
        assert all("chose configuration 1" in m for m in tuned_lines(first, *args) if "ms by tiles" in m)
        measured = len(measuring.seen)
        gjit.reset()
        _, taken = run_compiled(mlp_and_more, *args, torch.randn(3))
        assert len(measuring.seen) == measured, "checked, not measured"
        assert gjit.stats()["tuning_records_reused"] == 2
        monkeypatch.setattr(tuning, "mismatch", lambda launch: "computes something else")
        gjit.reset()
        out, _ = run_compiled(lambda *a: (mlp(*a[:5]), a[5].cos()), *args, torch.randn(3))
    assert len(measuring.seen) > measured and not gjit.stats().get("tuning_records_reused")
    assert_close_to_float64(out[0], mlp, *args)


def test_the_budget_is_a_share_of_the_compile_and_the_first_run_is_not_tuning(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(tuning, "clock", lambda: now[0])
    budget = tuning.Budget(0.2, 8.0)  # a fifth of the whole: a quarter of the 8 s before tuning
    assert budget.seconds == 2.0 and budget.left()
    with budget.not_tuning():  # the program's first run: 4 s the call pays anyway
        now[0] += 4.0
    assert budget.spent() == 0.0 and budget.seconds == 3.0
    now[0] += 2.9
    assert budget.left()
    now[0] += 0.2
    assert not budget.left() and budget.text() == "3.10 s of a budget of 3.00 s (20% of the cold compile)"
    assert tuning.Budget(1.0, 8.0).seconds == float("inf") and tuning.Budget(0.0, 8.0).seconds == 0.0


def test_the_driver_gives_the_budget_the_compiles_seconds_so_far(monkeypatch):
    seen = []
    init = tuning.Budget.__init__

    def budget(self, share, compiled):
        seen.append((share, compiled))
        init(self, share, compiled)

    monkeypatch.setattr(tuning.Budget, "__init__", budget)
    monkeypatch.setattr(driver, "on_gpu", lambda gm: True)
    monkeypatch.setattr(tuning, "bench", lambda fn, what: 1.0)
    with gjit.config.scope(tune=True, matmul="auto", tune_budget=0.2, measure_all_templates=True):
        _, cm = run_compiled(mlp, *mlp_args())
    timings = cm.entries[0].program.timings
    ((share, compiled),) = seen
    assert share == 0.2 and 0 < compiled <= sum(v for k, v in timings.items() if k != "tune")
