"""bench/models_gpu.py: its kernel-name classes, verdicts and profile summaries, the pacing of its
processes (with stand-in processes that fail in each way), and its dry run on the CPU."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)

import gpu_profile as gp  # noqa: E402
import models_gpu  # noqa: E402
import models_gpu_report  # noqa: E402

pytestmark = pytest.mark.cpu

KERNEL_NAMES = [
    (
        "sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off",
        "matmul",
    ),
    ("ampere_fp16_s16816gemm_fp16_128x128_ldg8_f2f_stages_32x5_tn", "matmul"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8>", "matmul"),
    ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTN", "matmul"),
    ("void gemv2T_kernel_val<int, int, __half, __half, float, float, 128, 16, 4, 4, false>", "matmul"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __half, float>", "matmul"),
    ("triton_tem_fused_mm_0", "matmul"),
    ("triton_tem_fused_addmm_gelu_3", "matmul"),
    ("gjit_mm_fused_addmm_gelu_3", "matmul"),
    (
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 64, 4>, true, false>",
        "attention",
    ),
    ("flash_fwd_kernel", "attention"),
    (
        "fmha_cutlassF_f16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::half_t>)",
        "attention",
    ),
    ("void cutlass::device_kernel<flash::FlashAttnFwdSm90<cutlass::bfloat16_t>>", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64_4x1x1", "attention"),
    ("gjit_attn_fused_scaled_dot_product_attention_2", "attention"),
    ("triton_poi_fused_add_0", "other"),
    ("triton_red_fused_native_layer_norm_1", "other"),
    ("triton_per_fused__softmax_2", "other"),
    ("triton_poi_fused__scaled_dot_product_efficient_attention_3", "other"),  # pads an SDPA operand
    ("gjit_poi_fused_add_gelu_0", "other"),
    ("gjit_red_fused_native_layer_norm_1", "other"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::Half>>", "other"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>", "other"),
    ("aten::addmm", "matmul"),
    ("aten::scaled_dot_product_attention", "attention"),
    ("aten::native_layer_norm", "other"),
]


@pytest.mark.parametrize("name, cls", KERNEL_NAMES, ids=[n[:40] for n, _ in KERNEL_NAMES])
def test_kernel_names_are_classified(name, cls):
    assert gp.classify(name) == cls


def test_the_verdict_compares_host_and_kernel_time():
    assert gp.verdict(2.0, 1.0) == "host-bound"
    assert gp.verdict(1.0, 1.0) == "host-bound"
    assert gp.verdict(0.5, 1.0) == "kernel-bound"
    assert gp.verdict(None, 1.0) == "?"


def test_a_profile_is_summarized_per_call():
    recs = [("launch", "cudaGraphLaunch", 5.0)] * 2 + [("copy", "Memset (Device)", 10.0)] * 2
    for _ in range(2):  # two calls
        recs += [("kernel", "triton_tem_fused_mm_0", 300.0), ("kernel", "flash_fwd_kernel", 200.0)]
        recs += [("kernel", "triton_poi_fused_add_0", 50.0)] * 3
    s = gp.summarize(recs, calls=2, slowest=2)
    assert s["kernels_per_call"] == 5 and s["copies_per_call"] == 1 and s["launches_per_call"] == 1
    assert s["graph_launches_per_call"] == 1
    assert s["ms_by_class"] == pytest.approx({"matmul": 0.3, "attention": 0.2, "other": 0.16})
    assert s["gpu_ms_per_call"] == pytest.approx(0.66)
    assert [k["name"] for k in s["slowest"]] == ["triton_tem_fused_mm_0", "flash_fwd_kernel"]
    assert s["slowest"][0] == {
        "name": "triton_tem_fused_mm_0",
        "ms_per_call": pytest.approx(0.3),
        "per_call": 1.0,
    }


def test_a_cpu_profile_counts_top_level_aten_ops():
    x, w = torch.randn(8, 16), torch.randn(32, 16)
    recs = gp.profile(lambda: torch.nn.functional.linear(x, w).relu(), 2, "cpu")
    s = gp.summarize(recs, calls=2)
    names = {k["name"] for k in s["slowest"]}
    assert {"aten::linear", "aten::relu"} <= names and "aten::addmm" not in names  # nested: not counted
    assert s["kernels_per_call"] == 2 and s["ms_by_class"]["matmul"] > 0


def test_tokens_and_near_ties():
    expected = torch.tensor([[1, 2, 3, 4]])
    assert gp.first_difference(expected.clone(), expected) is None
    assert gp.first_difference(torch.tensor([[1, 2, 5, 4]]), expected) == 2
    reference = torch.tensor([0.0, 1.0, 0.99])
    tie, gap, err = gp.near_tie(torch.tensor([0.0, 1.0, 0.995]), reference, chosen=2, expected=1)
    assert tie and gap == pytest.approx(0.005) and err == pytest.approx(0.005)
    assert not gp.near_tie(
        torch.tensor([0.0, 1.0, 0.5]), torch.tensor([0.0, 1.0, 0.5]), chosen=2, expected=1
    )[0]
    assert gp.output_ok(3e-3, 1e-3) and not gp.output_ok(5e-3, 1e-3) and gp.output_ok(5e-5, 0.0)


# A stand-in for bench/models_gpu_child.py: the same protocol, and each way a process can fail,
# chosen by its workload's name.
FAKE_CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    spec = json.loads(sys.argv[1])
    out = os.fdopen(int(sys.argv[2]), "w", buffering=1)
    how = spec["workload"]["name"]
    def send(**m):
        out.write(json.dumps(m) + "\\n")
    for stage in spec["stages"]:
        if stage != "setup" and sys.stdin.readline().split()[:1] != ["go"]:
            sys.exit(0)
        if how == "na":
            send(stage=stage, status="n/a", reason="not here")
            sys.exit(0)
        if stage == "compile" and how == "crash":
            sys.exit(3)
        if stage == "compile" and how == "hang":
            time.sleep(60)
        if stage == "compile" and how == "error":
            send(stage=stage, status="error", error="ValueError: no")
            sys.exit(1)
        if stage == "measure":
            time.sleep(float(spec["rounds"]) / 10)
        figures = {"stage": stage, "t": time.time()}
        if stage == "measure":
            figures |= {"ms": 1.0, "eager_ms": 2.0, "host_ms": 0.5}
            if how == "noprofile":
                figures["profile_error"] = "RuntimeError: the profiler saw no kernels"
        send(stage=stage, status="done", figures=figures)
    """
)


def orchestrate(tmp_path, names, compiler="gjit", **opts):
    script = tmp_path / "fake_child.py"
    script.write_text(FAKE_CHILD)
    stages = ("setup", "measure") if compiler == "eager" else ("setup", "before", "compile", "measure")
    procs = [
        models_gpu.Proc(
            models_gpu.Workload(name, name, "gpt2", "float32", 1, 1),
            compiler,
            stages,
            str(tmp_path / f"{i}.log"),
        )
        for i, name in enumerate(names)
    ]
    defaults = dict(
        budget=60.0, timeout=3.0, compile_jobs=0, small=True, device="cpu", rounds=1, torch_backend="eager"
    )
    orch = models_gpu.Orchestrator(procs, argparse.Namespace(**(defaults | opts)), str(tmp_path))
    orch.script = str(script)
    try:
        orch.run()
    finally:
        orch.close()
    return procs, orch


def test_each_failure_is_a_row_and_the_others_are_measured(tmp_path):
    start = time.monotonic()
    procs, orch = orchestrate(tmp_path, ["ok", "crash", "hang", "error", "na", "noprofile"])
    status = {p.workload.name: (p.status, p.error) for p in procs}
    assert [p.status for p in procs] == ["finished", "error", "error", "error", "n/a", "finished"]
    assert "compile: the process ended (exit 3) without reporting" in status["crash"][1]
    assert status["hang"][1].startswith("compile: not done within")
    assert status["error"][1] == "compile: ValueError: no"
    assert status["na"][1] == "not here"
    ok = procs[0].figures
    assert [ok[s]["stage"] for s in ("setup", "before", "compile", "measure")] == [
        "setup",
        "before",
        "compile",
        "measure",
    ]
    # no two processes measured at once, and nothing was measured while a process compiled
    measured = sorted((procs[i].figures["measure"]["t"], i) for i in (0, 5))
    assert measured[1][0] - measured[0][0] >= 0.09
    assert all(p.popen.poll() is not None for p in procs)  # the hung one was killed
    assert time.monotonic() - start < 20
    data = models_gpu.results(procs, orch, orch.opts, str(tmp_path))
    text = models_gpu_report.tables(data)
    assert "| ok | gjit | 1.00 | 2.00 | - | - | 0.50 | - | - | - -> 2.00 | - |" in text
    assert "| noprofile | gjit | 1.00 | 2.00 | - | - | 0.50 | - | - | - -> 2.00 | -; profile: Runtime" in text
    assert "| crash | gjit | - |" in text and "| na | gjit | - |" in text and "n/a: not here" in text


def test_rows_past_the_budget_are_skipped_not_started(tmp_path):
    procs, _ = orchestrate(tmp_path, ["ok"] * 10, compiler="eager", budget=3.0, rounds=5)
    statuses = [p.status for p in procs]
    assert statuses[0] == "finished" and statuses[-1] == "skipped", statuses
    assert set(statuses) == {"finished", "skipped"}
    assert all("skipped" in p.error for p in procs if p.status == "skipped")


@pytest.mark.slow  # about a minute of processes: CI's sweep step runs it, the default run stays in 15 min
def test_the_dry_run_on_cpu(tmp_path):
    """--small: the same processes, phases, profiles and tables as on a GPU, with tiny models;
    gjit's GPT-2 runs its kernels in Triton's interpreter. torch.compile runs Dynamo with the eager
    backend: Inductor's C++ compiles take about a minute a model on 2 cores."""
    out = tmp_path / "out.json"
    argv = [sys.executable, os.path.join(BENCH, "models_gpu.py"), "--small", "--torch-backend", "eager"]
    argv += ["--models", "gpt2", "generate-static", "--json", str(out), "--log-dir", str(tmp_path / "logs")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {(r["workload"], r["compiler"]): r for r in data["rows"]}
    assert set(rows) == {
        (w, c) for w in ("gpt2", "generate-static") for c in ("eager", "torch.compile", "gjit")
    }
    for key, row in rows.items():
        assert row["status"] == "finished", (key, row["error"], row["log_tail"])
        m = row["measure"]
        assert m["ms"] > 0 and m["eager_ms"] > 0 and m["host_ms"] > 0, key
        assert m["profile"]["kernels_per_call"] > 0 and m["profile"]["gpu_ms_per_call"] > 0, key
        assert m["verdict"] in ("host-bound", "kernel-bound")
        if key[1] != "eager":
            c = row["compile"]
            assert c["ok"] and c["check"].startswith("OK"), c["check"]
            assert c["cold_s"] > 0 and c["compiles"] >= 1 and m["compiles_after"] == c["compiles"]
            assert row["before"]["eager_ms"] > 0
            functions = [f["function"] for f in m["host_profile"]]  # where the call's host time goes
            assert functions and all(f["own_ms"] >= 0 and f["calls"] > 0 for f in m["host_profile"]), key
        if key[1] == "gjit":
            assert c["compile_seconds"]["export"] > 0 and c["gjit"]["eager_runs"] == 0
    assert rows["gpt2", "gjit"]["compile"]["interpret"]  # its kernels ran, in Triton's interpreter
    assert os.path.exists(rows["gpt2", "gjit"]["log"])
    table = proc.stdout.strip().splitlines()
    assert any(line.startswith("| workload | gjit function | own ms | calls |") for line in table)
    assert table[-8].startswith("| workload | compiler | ms |")  # the main table is printed last
    assert sum("| OK" in line for line in table[-6:]) == 4
