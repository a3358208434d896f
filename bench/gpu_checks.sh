#!/usr/bin/env bash
# The checks that need a GPU, as one script for a short lease of a CUDA machine:
#   OUT=/some/folder bash bench/gpu_checks.sh [quick|full|kernels]
# (kernels: gjit.bench's slow kernel classes at device-filling sizes first, then the rest)
# Runs under the machine's own python3 (its torch, Triton and CuPy); gjit is installed editable
# without dependencies. First the real-size model benchmark (bench/models_gpu.py, 6 minutes at most),
# then the other steps in order of importance, each only if its time limit still fits in TOTAL_S
# (default 600 s: a 15-minute lease less the machine's start). Every step has a time limit and its
# log goes into $OUT/logs.tgz (kept small: a lease returns at most 8 files), so a slow or broken
# step leaves the others' results. The output ends with bench/models_gpu.py's tables (also
# $OUT/models_gpu.md, every figure in $OUT/models_gpu.json). Figures go to docs/bench.md by hand,
# with the device.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
MODE=${1:-quick}
TOTAL_S=${TOTAL_S:-600}
mkdir -p "$OUT"
LOGS=$(mktemp -d)
export PYTHONUNBUFFERED=1 GJIT_CACHE=0
PY=${PYTHON:-python3}

step() { echo; echo "== $1 (t+${SECONDS}s)"; }
pack() { tar czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null; }
# fits SECONDS: whether a step of that time limit ends within TOTAL_S; says so when it does not
fits() {
    if [ $((SECONDS + $1)) -le "$TOTAL_S" ]; then return 0; fi
    echo "skipped: its ${1} s limit would end past TOTAL_S=${TOTAL_S} s"
    return 1
}

step "device and versions"
nvidia-smi -L
$PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'
$PY -m pip install -q --no-deps --no-build-isolation -e . >"$LOGS/install.log" 2>&1 || { cat "$LOGS/install.log"; exit 1; }
# gjit under the image's torch and Triton (CI runs the runtime's tests under them: .ci/gpu_image.txt);
# a failed import ends the lease's script here, with its error, instead of failing every step
$PY -c 'import gjit' || exit 1

if [ "$MODE" = kernels ]; then  # the slow kernel classes first, at device-filling sizes
    step "kernel classes: gjit against eager and torch.compile (python -m gjit.bench --device-sizes --cases ...)"
    timeout "${KERNELS_S:-300}" $PY -m gjit.bench --device-sizes --cases sum_first sum_all mean_middle transpose_add \
        channels_last softmax_vocab layer_norm_wide cross_entropy softmax layer_norm cumsum_first cumsum_last \
        --json "$OUT/bench_kernels.json" --png "$OUT/bench_kernels.png" 2>"$LOGS/bench_kernels.err"
    tail -3 "$LOGS/bench_kernels.err"
    pack
fi

step "real-size models: eager, torch.compile and gjit, each in a fresh process (bench/models_gpu.py)"
if [ "$MODE" != kernels ] || fits "${MODELS_S:-390}"; then
    timeout -k 20 "${MODELS_S:-390}" $PY bench/models_gpu.py --budget "${MODELS_BUDGET_S:-360}" \
        --json "$OUT/models_gpu.json" --table "$OUT/models_gpu.md" --log-dir "$LOGS/models_gpu" \
        >"$LOGS/models_gpu.out" 2>&1
    echo "exit $?; $(grep -E '^Budget' "$LOGS/models_gpu.out")"
fi
pack

step "the copy out of a padded product: kernels/column_copy.py against ATen's strided copy (bench/column_copy.py)"
if fits "${COPY_S:-45}"; then
    timeout "${COPY_S:-45}" $PY bench/column_copy.py 2>"$LOGS/column_copy.err" | tee "$LOGS/column_copy.md"
    tail -3 "$LOGS/column_copy.err"
fi
pack

step "convolutions: channels-last (GJIT_CONV_LAYOUT=auto) and the model's layout (traced), next to eager and torch.compile"
for layout in auto traced; do
    if fits "${CONV_S:-80}"; then
        GJIT_CONV_LAYOUT=$layout timeout "${CONV_S:-80}" $PY -m gjit.bench --device-sizes \
            --cases conv_block conv_block_bf16 --json "$LOGS/conv_$layout.json" 2>"$LOGS/conv_$layout.err" | tail -6
        tail -2 "$LOGS/conv_$layout.err"
    fi
done
pack

if [ "$MODE" = kernels ]; then  # rows of 1025-8192: looped (the table) against persistent
    # (a static row, layer_norm_wide's, is timed both ways by tuning in either run: gjit/choice/row_kernels.py)
    step "rows of 2048-8192: looped (GJIT_PERSISTENT_MAX=1024, the table) against persistent (8192)"
    for pmax in 1024 8192; do
        if fits "${ROWS_S:-100}"; then
            GJIT_PERSISTENT_MAX=$pmax timeout "${ROWS_S:-100}" $PY -m gjit.bench --device-sizes \
                --cases softmax_2k rms_norm_4k layer_norm_wide --json "$LOGS/rows_$pmax.json" \
                2>"$LOGS/rows_$pmax.err" | tail -5
        fi
    done
    pack
fi

# after the rows step: in kernels mode its time must not cost the persistent side of that comparison
step "matmul structures against cuBLAS: pointer loads, TMA, TMA on a persistent grid (bench/matmul_probe.py)"
if fits "${PROBE_S:-90}"; then
    timeout "${PROBE_S:-90}" $PY bench/matmul_probe.py 2>"$LOGS/matmul_probe.err" | tee "$LOGS/matmul_probe.md"
    tail -3 "$LOGS/matmul_probe.err"
fi
pack

step "host time per kernel launch on the card: Triton's path against gjit's pre-bound launches"
if fits "${LAUNCH_S:-60}"; then
    GJIT_TUNE=0 timeout "${LAUNCH_S:-60}" $PY bench/launch_overhead.py --device cuda \
        --json "$OUT/launch_overhead.json" 2>"$LOGS/launch_overhead.err" | tail -6
fi
pack

step "the gpu tests"
if fits "${GPU_TESTS_S:-100}"; then
    # test_opinfo imports torch.testing._internal, which needs expecttest (not on the lease image)
    timeout "${GPU_TESTS_S:-100}" $PY -m pytest -q -p no:cacheprovider -m gpu --timeout 80 --ignore tests/test_opinfo.py tests >"$LOGS/gpu_tests.log" 2>&1
    tail -15 "$LOGS/gpu_tests.log"
fi
pack

step "the cpu tier's numerics on the GPU (GJIT_TEST_DEVICE=cuda: kernels compiled, not interpreted)"
if fits "${DEVICE_TESTS_S:-150}"; then
    GJIT_TEST_DEVICE=cuda timeout "${DEVICE_TESTS_S:-150}" $PY -m pytest -q -p no:cacheprovider -n 16 --timeout 120 \
        --tb=short ${DEVICE_TESTS:-tests/test_matmul.py tests/test_attention.py tests/test_models.py tests/test_llm.py tests/test_tuning.py} \
        >"$LOGS/device_tests.log" 2>&1
    grep -E "^(FAILED|ERROR)|passed|failed" "$LOGS/device_tests.log" | tail -40
fi
pack

step "templates against ATen per model shape (bench/gpu_templates.py)"
if fits "${TEMPLATES_S:-120}"; then
    timeout "${TEMPLATES_S:-120}" $PY bench/gpu_templates.py --json "$OUT/gpu_templates.json" 2>"$LOGS/gpu_templates.err"
    tail -3 "$LOGS/gpu_templates.err"
fi
pack

step "start-up on the GPU: cold (kernels built in workers, and in 1), warm, package, next to torch.compile"
if fits "${START_S:-200}"; then
    timeout "${START_S:-200}" $PY bench/warm_start.py --device cuda --json "$OUT/warm_start_cuda.json" \
        2>"$LOGS/warm_start_cuda.err" | head -8
    tail -3 "$LOGS/warm_start_cuda.err"
fi
pack

step "python -m gjit.bench ($MODE)"
if [ "$MODE" = full ]; then
    fits "${BENCH_S:-400}" && timeout "${BENCH_S:-400}" $PY -m gjit.bench --full --json "$OUT/bench.json" \
        --png "$OUT/bench.png" 2>"$LOGS/bench.err"
elif fits "${BENCH_S:-120}"; then
    timeout "${BENCH_S:-120}" $PY -m gjit.bench --cases softmax layer_norm gelu_mlp attention gpt2 bert llama \
        --json "$OUT/bench.json" --png "$OUT/bench.png" 2>"$LOGS/bench.err"
fi
tail -5 "$LOGS/bench.err" 2>/dev/null
pack

step "done; bench/models_gpu.py's tables follow ($OUT/models_gpu.md)"
cat "$OUT/models_gpu.md" 2>/dev/null || tail -40 "$LOGS/models_gpu.out"
rm -rf "$LOGS"
