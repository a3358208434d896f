"""Observability: GJIT_LOGS artifacts, the dump folder, explain/stats, GJIT_CHECK."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

import gjit
from gjit import logs
from gjit.codegen.triton.pointwise import TritonOverrides
from helpers import run_compiled
from model_zoo import gpt2

pytestmark = pytest.mark.cpu


@pytest.fixture(autouse=True)
def _logs_off():
    yield
    gjit.set_logs()


def branchy(x):
    if x.shape[0] > 2:  # a guard on a size, from this line
        return torch.softmax(x, -1) * 2
    return x.sum(0)


# ----------------------------------------------------------------------------------------------
# GJIT_LOGS / set_logs
# ----------------------------------------------------------------------------------------------


def test_parse_levels_all_and_unknown_names():
    assert logs.parse("recompiles,+dynamic,-fusion") == {
        "recompiles": logging.INFO,
        "dynamic": logging.DEBUG,
        "fusion": logging.WARNING,
    }
    assert set(logs.parse("+all")) == set(logs.ARTIFACTS)
    with pytest.raises(ValueError, match="(?s)unknown GJIT_LOGS artifact 'nope'.*recompiles"):
        logs.parse("recompiles,nope")


def test_help_lists_every_artifact_with_its_description(capsys):
    gjit.set_logs("help")
    err = capsys.readouterr().err
    for name, doc in logs.ARTIFACTS.items():
        assert name in err and doc.split()[0] in err


def test_env_var_enables_artifacts_with_a_prefixed_stderr_handler(monkeypatch, capsys):
    monkeypatch.setenv("GJIT_LOGS", "recompiles,+guards")
    logs.init_from_env()
    assert logging.getLogger("gjit.guards").level == logging.DEBUG
    run_compiled(gjit.compile(lambda x: x + 1), torch.randn(4))
    err = capsys.readouterr().err
    assert "[gjit.recompiles] " in err and "entry 0 compiled" in err
    assert "[gjit.guards] " in err and "x.dtype == torch.float32" in err
    assert "[gjit.fusion]" not in err


def test_keyword_form_like_torch_set_logs(capsys):
    gjit.set_logs(output_code=True, cache=logging.DEBUG)
    assert logging.getLogger("gjit.output_code").level == logging.INFO
    assert logging.getLogger("gjit.cache").level == logging.DEBUG
    with pytest.raises(ValueError):
        gjit.set_logs(bogus=True)


def test_nothing_is_printed_without_gjit_logs(capfd):
    run_compiled(gjit.compile(branchy), torch.randn(4, 3))
    err = capfd.readouterr().err
    assert "[gjit." not in err and "create_symbol" not in err, err


# ----------------------------------------------------------------------------------------------
# Each artifact's lines, for a program that triggers them
# ----------------------------------------------------------------------------------------------


def lines_of(caplog, artifact: str) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name == f"gjit.{artifact}")


def test_dynamic_artifact_shows_symbols_and_guards_with_the_user_line(caplog):
    with caplog.at_level(logging.INFO, logger="gjit.dynamic"):
        run_compiled(gjit.compile(branchy), torch.randn(4, 3))
    text = lines_of(caplog, "dynamic")
    assert "create_symbol s" in text and "for L['x'].size()[0] [2, int_oo]" in text
    assert "> 2 [guard added]" in text and "test_observability.py:28 in branchy" in text, text


def test_graph_guards_recompiles_and_output_code(caplog):
    cm = gjit.compile(branchy)
    with caplog.at_level(logging.INFO, logger="gjit"):
        run_compiled(cm, torch.randn(4, 3))
        run_compiled(cm, torch.randn(2, 3))  # the other branch: a recompile
    assert "f32[s" in lines_of(caplog, "graph")
    assert "guards of entry 0" in lines_of(caplog, "guards") and "shape  s" in lines_of(caplog, "guards")
    recompiles = lines_of(caplog, "recompiles")
    assert "missed all 1 entries; the nearest, entry 0" in recompiles
    assert "decision: compile entry 1" in recompiles
    output_code = lines_of(caplog, "output_code")
    assert "written to" in output_code and "@triton.jit" in output_code
    assert "in-memory cache miss" in lines_of(caplog, "cache") and "on-disk" in lines_of(caplog, "cache")


def test_fusion_refusals_and_externs_are_logged(caplog):
    def f(x, w):
        y = x.sin()
        return (y @ w).relu() + y.sum()

    with caplog.at_level(logging.INFO, logger="gjit"), gjit.config.scope(matmul="aten"):
        run_compiled(gjit.compile(f), torch.randn(4, 4), torch.randn(4, 4))
    assert "cannot fuse" in lines_of(caplog, "fusion"), lines_of(caplog, "fusion")
    assert "extern mm = aten.mm.default: lowering refused: matmul runs as an ATen extern" in lines_of(
        caplog, "lowering"
    )


def test_perf_hints_name_looped_reductions_and_externs_between_kernels(caplog):
    def f(x, w):
        return (torch.softmax(x, -1) @ w).relu()

    with caplog.at_level(logging.INFO, logger="gjit.perf_hints"), gjit.config.scope(matmul="aten"):
        run_compiled(gjit.compile(f), torch.randn(2, 1500), torch.randn(1500, 3))
    text = lines_of(caplog, "perf_hints")
    assert "looped reduction" in text and "runs between kernels" in text, text


def test_eager_fallback_is_logged_with_its_reason(caplog):
    def f(x):
        return torch.ones(int((x > 0).sum().item())) * 3

    with caplog.at_level(logging.INFO, logger="gjit"):
        gjit.compile(f)(torch.randn(8))
    assert "running it eagerly" in lines_of(caplog, "capture")


# ----------------------------------------------------------------------------------------------
# The dump folder
# ----------------------------------------------------------------------------------------------


def test_dump_folder_has_every_stage_and_names_the_kernels(tmp_path):
    def f(x, w):
        y = torch.nn.functional.layer_norm(x, (x.shape[-1],))
        return (y @ w).relu()

    cm = gjit.compile(f, dump_dir=str(tmp_path))
    x, w = torch.randn(4, 8), torch.randn(8, 5)
    with gjit.config.scope(matmul="aten"):  # a graph with an extern between kernels
        run_compiled(cm, x, w)
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    names = {p.name for p in folder.iterdir()}
    expected = {"00_exported.txt", "01_core_aten.txt", "02_loop_ir.txt", "03_regions.txt", "03_regions.dot"}
    assert expected | {"kernels", "wrapper.py", "guards.txt", "report.json"} <= names
    for stage in sorted(expected - {"03_regions.dot"}):
        assert (folder / stage).read_text().startswith("# produced by: "), stage
    assert " ms" in (folder / "00_exported.txt").read_text().splitlines()[0]
    kernels = [k.name for k in gjit.explain(cm, x, w).kernels]
    assert sorted(p.stem for p in (folder / "kernels").iterdir()) == sorted(kernels)
    report = json.loads((folder / "report.json").read_text())
    assert [k["name"] for k in report["kernels"]] == kernels
    assert report["externs"][0]["op"] == "aten.mm.default"
    assert report["modeled_bytes"]["gjit"] <= report["modeled_bytes"]["eager"]
    assert "export" in report["compile_seconds"] and "codegen" in report["compile_seconds"]
    regions = (folder / "03_regions.txt").read_text()
    assert all(f"kernel {k}" in regions for k in kernels) and "extern mm = aten.mm.default" in regions
    compile((folder / "wrapper.py").read_text(), "wrapper.py", "exec")
    assert "def guard(inputs):" in (folder / "guards.txt").read_text()
    pydot = pytest.importorskip("pydot")
    (graph,) = pydot.graph_from_dot_file(str(folder / "03_regions.dot"))
    labels = {sub.get_label().strip('"') for sub in graph.get_subgraphs()}
    assert labels == set(kernels)


def test_dump_dir_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("GJIT_DUMP_DIR", str(tmp_path))
    run_compiled(gjit.compile(lambda x: x.exp()), torch.randn(3))
    assert any((p / "03_regions.txt").exists() for p in tmp_path.iterdir())


# ----------------------------------------------------------------------------------------------
# explain and stats
# ----------------------------------------------------------------------------------------------


def test_explain_gpt2_lists_kernels_externs_dims_and_bytes():
    model, (ids,) = gpt2("sdpa")
    with torch.no_grad():
        report = gjit.explain(gjit.compile(model), ids)
    assert len(report.kernels) >= 5 and all(k.aten_nodes and k.source_lines for k in report.kernels)
    assert not report.externs, report  # matmuls and attention are template kernels
    assert any(k.name.startswith("gjit_mm_fused_") and "addmm" in k.name for k in report.kernels)
    assert any(k.name.startswith("gjit_attn_fused_") for k in report.kernels)
    assert any("attention kernel gjit_attn_" in line for line in report.matmuls)
    assert [d.split(" =")[0] for d in report.dynamic_dims] == ["input_ids.size(0)", "input_ids.size(1)"]
    assert report.traffic.gjit < report.traffic.eager
    text = str(report)
    assert "kernel gjit_" in text and "dynamic dims: input_ids.size(0)" in text


def test_explain_names_the_line_that_specialized_a_dim():
    def f(x):
        return x.view(x.shape[0], 2, 4) * 2  # x.size(1) must be 8

    report = gjit.explain(gjit.compile(f), torch.randn(3, 8))
    (spec,) = report.specialized_dims
    assert spec.startswith("x.size(1) = 8: s") and "== 8 at " in spec
    assert any("x.size(1) = 8" in h for h in report.perf_hints)


def test_stats_count_compiles_recompiles_reasons_hits_and_stages():
    cm = gjit.compile(lambda x: x * 2)
    run_compiled(cm, torch.randn(4))
    run_compiled(cm, torch.randn(5))
    run_compiled(cm, torch.randn(4).double())
    s = gjit.stats()
    assert (s["compiles"], s["recompiles"], s["cache_hits"]) == (2, 1, 1)
    assert any(k.startswith("recompile_reason:x.dtype == torch.float32") for k in s)
    assert {"export", "decompose", "lower", "fuse", "codegen", "guards"} <= set(s["compile_seconds"])
    gjit.reset()
    assert gjit.stats()["compiles"] == 0


# ----------------------------------------------------------------------------------------------
# GJIT_CHECK
# ----------------------------------------------------------------------------------------------


def two_kernels(x, w):
    y = (x.sin() + 1) * x  # kernel 1: the matmul template, y its prologue
    return torch.softmax(y @ w, -1)  # kernel 2: the softmax


def test_check_reports_every_kernel_within_tolerance(caplog):
    cm = gjit.compile(two_kernels, check=True)
    with caplog.at_level(logging.INFO, logger="gjit.check"):
        run_compiled(cm, torch.randn(4, 6), torch.randn(6, 5))
    rows = cm.entries[0].program.graph.last_check
    assert len(rows) == 2 and all(r.ok for r in rows)
    assert "all 2 checked values within tolerance" in caplog.text


def test_check_names_the_guilty_kernel(monkeypatch, caplog):
    monkeypatch.setitem(TritonOverrides, "sin", lambda a, t: f"tl.cos({a})")  # a planted codegen bug
    with gjit.config.scope(check=True), caplog.at_level(logging.WARNING, logger="gjit.check"):
        cm = gjit.compile(two_kernels)
        run_compiled(cm, torch.randn(4, 6), torch.randn(6, 5))
    rows = cm.entries[0].program.graph.last_check
    bad = [r for r in rows if not r.ok]
    assert len(bad) == 1 and bad[0].kernel.startswith("gjit_mm_fused_sin")  # sin is the matmul's prologue
    assert "first kernel past tolerance: gjit_mm_fused_sin" in caplog.text
    # the softmax kernel read the (wrong) values kernel 1 wrote, and is itself right
    assert next(r for r in rows if "softmax" in r.kernel).ok


def test_check_from_the_environment(monkeypatch):
    monkeypatch.setenv("GJIT_CHECK", "1")
    cm = gjit.compile(lambda x: x.exp() + 1)
    run_compiled(cm, torch.randn(5))
    assert cm.entries[0].program.graph.last_check


def test_dump_files_are_skipped_without_a_dump_dir(tmp_path):
    run_compiled(gjit.compile(lambda x: x + 2), torch.randn(3))
    assert not os.listdir(tmp_path)


def test_check_has_no_false_alarm_on_multi_output_nodes():
    def f(x, w):
        y = torch.nn.functional.layer_norm(x, (8,))  # native_layer_norm returns a tuple
        return (y @ w) + y

    cm = gjit.compile(f, check=True)
    run_compiled(cm, torch.randn(4, 8), torch.randn(8, 8))
    rows = cm.entries[0].program.graph.last_check
    assert rows and all(r.ok for r in rows), rows


def test_application_logging_at_info_does_not_turn_artifacts_on(caplog):
    with caplog.at_level(logging.INFO):  # the root logger at INFO, as basicConfig(level=INFO) does
        run_compiled(gjit.compile(branchy), torch.randn(4, 3))
    assert not [r for r in caplog.records if r.name.startswith("gjit.")]


def test_state_guards_name_parameters_by_their_qualified_name():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).eval()
    cm = gjit.compile(model)
    with torch.no_grad():
        run_compiled(cm, torch.randn(3, 4))
    text = cm.entries[0].guards.format()
    assert "0.weight keeps its shape" in text and "1.weight keeps its shape" in text
