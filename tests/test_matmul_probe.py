"""bench/matmul_probe.py, the probe of the matmul template's next structure (TMA loads, a persistent
grid): its kernels compute the linear layer (interpreted), and they build for sm_90 as meant."""

import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "bench")


@pytest.mark.cpu
@pytest.mark.slow  # (CI's sweep step: 9 s in Triton's interpreter)
def test_probe_kernels_compute_the_linear_layer():
    """Every variant, on a tile-aligned and a ragged shape, against torch (in the script: a wrong
    output or a variant that does not run prints instead of a time)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run(
        [sys.executable, os.path.join(BENCH, "matmul_probe.py"), "--device", "cpu"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [ln for ln in run.stdout.splitlines() if ln.startswith("| small") or ln.startswith("| ragged")]
    assert len(rows) == 2, run.stdout
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")][4:]  # the variants' cells
        assert len(cells) == 3 and all(c.startswith("nan [") for c in cells), row  # ran, right, untimed


@pytest.mark.compile_only
def test_probe_tma_variants_build_for_sm_90_with_tensor_memory_copies():
    import re

    import triton
    from triton.backends.compiler import GPUTarget

    sys.path.insert(0, BENCH)
    import matmul_probe

    operands = {p: "*fp16" for p in ("x", "w", "bias", "out")} | {p: "i32" for p in "MNK"}
    blocks = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}
    for fn, extra in (
        (matmul_probe.linear_tma, {}),
        (matmul_probe.linear_tma_persistent, {"programs": "i32"}),
    ):
        signature = operands | {c: "constexpr" for c in blocks} | extra
        attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(operands))}
        source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=blocks, attrs=attrs)
        kernel = triton.compile(
            source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 4}
        )
        ptx = kernel.asm["ptx"]
        assert ptx.count("cp.async.bulk.tensor") >= 2 and "wgmma.mma_async" in ptx, fn.__name__
        assert not re.search(r"\bld\.local|\bst\.local", ptx), fn.__name__  # no spills
