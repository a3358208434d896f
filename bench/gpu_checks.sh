#!/usr/bin/env bash
# The checks that need a GPU, as one script for a short lease of a CUDA machine:
#   OUT=/some/folder bash bench/gpu_checks.sh [quick|full]
# Runs under the machine's own python3 (its torch, Triton and CuPy); gjit is installed editable
# without dependencies. Every step has a time limit and writes its log under $OUT, so a slow or
# broken step leaves the others' results. Figures go to docs/bench.md by hand, with the device.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
MODE=${1:-quick}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 GJIT_CACHE=0
PY=${PYTHON:-python3}

step() { echo; echo "== $1 (t+${SECONDS}s)"; }

step "device and versions"
nvidia-smi -L
$PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'
$PY -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }

step "the gpu tests"
timeout 150 $PY -m pytest -q -p no:cacheprovider -m gpu --timeout 100 tests 2>&1 | tail -15

step "templates against ATen per model shape (bench/gpu_templates.py)"
timeout "${TEMPLATES_S:-150}" $PY bench/gpu_templates.py --json "$OUT/gpu_templates.json" 2>"$OUT/gpu_templates.err"
tail -3 "$OUT/gpu_templates.err"

step "the cpu tier's numerics on the GPU (GJIT_TEST_DEVICE=cuda: kernels compiled, not interpreted)"
GJIT_TEST_DEVICE=cuda timeout "${DEVICE_TESTS_S:-200}" $PY -m pytest -q -p no:cacheprovider -n 16 --timeout 120 \
    --tb=short ${DEVICE_TESTS:-tests/test_matmul.py tests/test_attention.py tests/test_models.py tests/test_llm.py tests/test_tuning.py} \
    >"$OUT/device_tests.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/device_tests.log" | tail -40

step "start-up on the GPU: cold (kernels built in workers, and in 1), warm, package, next to torch.compile"
timeout "${START_S:-300}" $PY bench/warm_start.py --device cuda --json "$OUT/warm_start_cuda.json" \
    2>"$OUT/warm_start_cuda.err" | head -8
tail -3 "$OUT/warm_start_cuda.err"

step "python -m gjit.bench ($MODE)"
if [ "$MODE" = full ]; then
    timeout "${BENCH_S:-400}" $PY -m gjit.bench --full --json "$OUT/bench.json" --png "$OUT/bench.png" 2>"$OUT/bench.err"
else
    timeout "${BENCH_S:-150}" $PY -m gjit.bench --cases softmax layer_norm gelu_mlp attention gpt2 bert llama \
        --json "$OUT/bench.json" --png "$OUT/bench.png" 2>"$OUT/bench.err"
fi
tail -5 "$OUT/bench.err"
step "done"
