#!/bin/bash
# The CUDA test machine's run (issues 15 and 14), in one call of at most ~8 minutes. From the repository root, with
# $OUT set and the wheels of `make device-wheels` in .wheels/ (carried: that machine has no package index):
#
#     bash eval/device_run.sh
#
# That machine has torch 2.11 + CUDA 13, transformers 5.17, triton 3.6, 16 host cores, 128 GiB of host memory. This
# installs the carried wheels (transformers 5.24, regex, setuptools) and dual-cache itself with --no-deps into
# /tmp/dual-site, then, most important first:
#   1. the Triton kernel's tests on CUDA (compiled kernel == torch reference), then kernel vs reference time per
#      layer call;
#   2. full budget == dense and pipelined == synchronous on CUDA with the default selector (eval/gpu_check.py);
#   3. max batch and decode throughput there under a 24 GiB device cap at 32K, then at 128K: dense, dual without
#      miss repair, Quest, offloaded, dual at the forced miss rate $MISS, dual with every step repaired;
#   5. issue 27: host selection alone at 32K on that host's cores (torch-exact, exact and lowbit through the native
#      engine, which the install step builds with g++);
#   4. issue 14: 32K decode at batch 1 and 8, dense vs dual (miss repair off and on): ms/step, overlap, wait s.
# Each stage gets its share of the time (later stages keep theirs even when an earlier one runs long) and writes
# its files as it goes, so a stage cut short keeps what it measured. What comes back (8 files at most):
# $OUT/log.txt, $OUT/gpu_check.json, and summary.json + table.md in $OUT/cap24-32k, $OUT/cap24-128k,
# $OUT/latency-32k. Knobs (environment): MISS (forced miss rate, default the embedded model's measured one),
# HOST_GIB (host memory for the KV, default 100), CAP_GIB (device cap, default 24), TOTAL_S (default 465), STAGES
# (which of 1a 1b 2 3a 3b 5 4 to run, default all: a second call can finish what a first one left).
#
# DRY_RUN=1 runs every stage's command line end to end on this machine's CPU with tiny shapes (the tiny random
# model, 256-512-token contexts, one-step repeats) in the current Python environment, without installing anything:
# the script cannot rot between the rare runs on the CUDA test machine (tests/test_device_run.py, a slow test). The
# Triton kernel's stages need CUDA: 1a's tests skip and 1b says so and exits 2.
set -u
MISS=${MISS:-0.26}
HOST_GIB=${HOST_GIB:-100}
CAP_GIB=${CAP_GIB:-24}
STAGES=" ${STAGES:-1a 1b 2 3a 3b 5 4} "
DEADLINE=$((SECONDS + ${TOTAL_S:-465}))
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
exec > >(tee -a "$OUT/log.txt") 2>&1

# seconds each stage is promised; a stage may also use what earlier stages left, never what later ones are promised
declare -A SHARE=([1a]=60 [1b]=20 [2]=30 [3a]=150 [3b]=80 [5]=40 [4]=70)
ORDER=(1a 1b 2 3a 3b 5 4)
stage() {  # stage ID NAME COMMAND...
    local id=$1 name=$2 reserve=0 later=0 other
    shift 2
    [[ $STAGES == *" $id "* ]] || return 0
    for other in "${ORDER[@]}"; do
        if [ "$later" = 1 ] && [[ $STAGES == *" $other "* ]]; then reserve=$((reserve + SHARE[$other])); fi
        [ "$other" = "$id" ] && later=1
    done
    local left=$((DEADLINE - SECONDS - reserve))
    if [ "$left" -lt 15 ]; then
        echo "== $id. $name: skipped, ${left}s left for it"
        return 0
    fi
    echo "== $id. $name (${left}s at most) @ ${SECONDS}s"
    timeout --kill-after=10 "$left" "$@"
    echo "== $id. $name: exit $? @ ${SECONDS}s"
}

PY=${PYTHON:-python3}
if [ -n "${DRY_RUN:-}" ]; then
    echo "== dry run on $(nproc) CPU cores with tiny shapes (no install)"
    DEVICE=(--device cpu --model tiny); CHECK=(--device cpu --tiny)
    CTX32=256; CTX128=512; CHUNK=128; NEW=4; WARM=1; CELL_S=20
    RETRIEVAL=(--contexts 2048 --batches 1 --pools 1 --repeats 1 --layers 2 --distinct-layers 1 --heads 4 --kv-heads 2
               --head-dim 64)
    KERNEL=(--budgets 256 --batches 1 --rep-ms 1)
else
    nvidia-smi -L
    free -g | head -2
    echo "== install (.wheels + dual-cache, --no-deps)"
    ls .wheels/*.whl || { echo "no .wheels/: run 'make device-wheels' and carry .wheels"; exit 2; }
    SITE=/tmp/dual-site
    rm -rf "$SITE"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --find-links .wheels --target "$SITE" \
        .wheels/transformers-*.whl .wheels/regex-*.whl . || exit 2
    export PYTHONPATH=$SITE
    DEVICE=(--device cuda --model llama8b); CHECK=()
    CTX32=32768; CTX128=131072; CHUNK=4096; NEW=6; WARM=2; CELL_S=60
    RETRIEVAL=(--contexts 32768 --batches 1 8 --pools 1 16 --repeats 5)
    KERNEL=(--budgets 256 1024 --batches 1 8 32 --rep-ms 25)
fi
$PY -c "import torch, transformers, triton, dual_cache
print('torch', torch.__version__, '| transformers', transformers.__version__, '| triton', triton.__version__,
      '| default selector', dual_cache.DualDecoderConfig().selector, '| host cores', __import__('os').cpu_count())" \
    || exit 2
echo "== native selection engine (g++)"
$PY -m dual_cache.engine

# one run per cell (--repeats 1): the stages' time shares were sized for it; bench's default is 3
LLAMA=($PY -m dual_cache.eval.throughput.bench "${DEVICE[@]}" --budgets 256 --no-plots --no-cells-jsonl --keep-going
       --repeats 1)
CAPPED=("${LLAMA[@]}" --device-budget-gib "$CAP_GIB" --host-budget-gib "$HOST_GIB" --batches 1 --new-tokens "$NEW"
        --warmup-steps "$WARM" --forced-miss-rate "$MISS"
        --methods dense dual-no-repair quest offloaded dual-forced-miss dual-self)

stage 1a "kernel tests on CUDA" $PY -m pytest -q -p no:cacheprovider tests/test_kernel_triton.py \
    -k "cuda and not without_a_gpu"
stage 1b "kernel vs reference, us per layer call" $PY -m dual_cache.kernels.bench_kernel --dtype bf16 "${KERNEL[@]}"
stage 2 "correctness on CUDA" $PY -m dual_cache.eval.gpu_check "${CHECK[@]}" --out "$OUT"
stage 3a "max batch at ${CAP_GIB} GiB, 32K" "${CAPPED[@]}" --contexts "$CTX32" --prefill-chunk-size "$CHUNK" \
    --max-cell-seconds "$CELL_S" --out "$OUT/cap24-32k"
stage 3b "max batch at ${CAP_GIB} GiB, 128K" "${CAPPED[@]}" --contexts "$CTX128" --prefill-chunk-size "$((2 * CHUNK))" \
    --max-cell-seconds "$((CELL_S * 3 / 4))" --out "$OUT/cap24-128k"
stage 5 "host selection alone at 32K: torch-exact, exact and lowbit through the engine" \
    $PY -m dual_cache.eval.selection.bench_retrieval "${RETRIEVAL[@]}" \
    --selectors torch-exact exact lowbit --out "$OUT/host-retrieval-32k"
stage 4 "issue 14: 32K decode, batch 1 and 8" "${LLAMA[@]}" --contexts "$CTX32" --batches 1 8 \
    --new-tokens $((2 * NEW)) \
    --warmup-steps $((WARM + 1)) --methods dense dual-no-repair dual-self --out "$OUT/latency-32k"
echo "== done @ ${SECONDS}s"
