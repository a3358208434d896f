"""More architectures end to end: ViT, ResNet, ConvNeXt, T5, Qwen2, Mistral, Gemma, GPT-NeoX,
DistilBERT, RoBERTa, the Whisper encoder, PoolFormer, SegFormer and Swin (tests/model_zoo.py
MORE_MODELS, tiny configs, random weights), on Triton, and two of them on CUDA C too.

Where tests/test_models.py pins per-model extern and kernel counts for the five models of
docs/models.md, this file checks what holds for any model: outputs match eager (the kernels run
in Triton's interpreter, or as CUDA C on the host emulation, with poisoned buffers), nothing runs
eagerly, only heavy ops (matmuls, convolutions, attention) and the tolerated ones stay externs,
and gjit launches fewer kernels and moves fewer modeled bytes than eager.
"""

from __future__ import annotations

import collections

import pytest

import gjit
from model_zoo import MORE_MODELS
from test_models import HEAVY_OPS, TOLERANCE, TOLERATED_EXTERNS, compile_against_eager, short

pytestmark = pytest.mark.cpu


# every model on Triton; on CUDA C (slower to build on this machine) two with ops the CUDA C model
# tests lack: convolutions with pooling, and relative position buckets with an encoder-decoder
CUDA_C = {"resnet", "t5"}
CASES = [(n, "triton") for n in MORE_MODELS] + [(n, "cupy") for n in MORE_MODELS if n in CUDA_C]
# the longest (about 10-25 s each) run in CI's sweep step; t5 is in tests/test_llm.py's default run too
SWEPT = {("swin", "triton"), ("t5", "triton"), ("t5", "cupy")}


@pytest.mark.parametrize(
    "name, backend", [pytest.param(*c, marks=pytest.mark.slow) if c in SWEPT else c for c in CASES]
)
def test_architecture_matches_eager(name, backend):
    model, inputs = MORE_MODELS[name]()
    with gjit.config.scope(backend=backend):
        cm, report, errors = compile_against_eager(name, model, inputs)
    assert max(errors) < TOLERANCE, f"max |gjit - eager| / max |eager| = {max(errors):.2e}"

    externs = collections.Counter(short(e.op) for e in report.externs)
    unexpected = set(externs) - HEAVY_OPS - TOLERATED_EXTERNS
    assert not unexpected, f"ops that should be lowered ran as externs: {unexpected}\n{report}"
    # the heavy ops are there: matmul template kernels (Triton), or externs (CUDA C, convolutions)
    templates = [k for k in report.kernels if k.name.startswith("gjit_mm_")]
    assert templates or {"mm", "addmm", "convolution"} & set(externs), report
    traffic = report.traffic
    assert 0 < len(report.kernels) + sum(externs.values()) < traffic.eager_kernels, report
    assert traffic.gjit < traffic.eager, report
    language = "cuda" if backend == "cupy" else "triton"
    assert all(k.backend == language for e in cm.entries for k in e.program.kernels)
