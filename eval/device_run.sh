#!/bin/bash
# The CUDA test machine's run (issues 15, 14 and 54), in one call. From the repository root, with $OUT set and the
# wheels of `make device-wheels` in .wheels/ (carried: that machine has no package index):
#
#     bash eval/device_run.sh          (the device tool: carry [".wheels"], timeout_s 480)
#
# That machine has torch 2.11 + CUDA 13, transformers 5.17, triton 3.6, Python 3.12, 16 host cores, 128 GiB of host
# memory, and the session holds it 15 minutes in all, start-up included (a few minutes): about 10 minutes of work,
# for this call and one rerun. So this call takes about 6 minutes: set-up (~1 minute, untimed: the stages' clock
# starts after it), then stages sharing TOTAL_S = 300 s, most important first. A stage gets its share plus what
# earlier stages left, never what later stages are promised, and is killed at its limit (what it wrote stays):
#
#   stage  share  what it must show
#   2       40 s  correctness on CUDA with the default selector (eval/gpu_check.py): four PASS lines (full budget ==
#                 dense, pipelined == synchronous, first-step selections == CPU, no host sync in a steady step)
#   3a     120 s  max batch under a 24 GiB device cap at 32K: dense, offloaded, Quest, dual (the library defaults:
#                 misses re-ranked on the device, issue 57), dual without repair or re-rank (the paper's method):
#                 each one's max batch, the limit that bound, tokens/s, x best baseline, and dual's GPU idle per step
#                 (waiting for copies + starved by host selection)
#   1a      50 s  the Triton kernel's CUDA tests (compiled kernel == torch reference): one PASSED line per test
#   4       50 s  issues 14, 57 and 62: 32K decode at batch 1 and 8, dense vs dual (the defaults): ms/step, overlap,
#                 idle parts, host syncs per step, host->device bytes and host core-ms per sequence-step, the share
#                 of a step's selection already resident (the ceilings of docs/design.md against the GPU's own step)
#   5       20 s  issue 27: host selection alone at 32K on this host's cores (lowbit and exact through the engine)
#   1b      20 s  kernel vs torch reference, us per layer call
#   3b       0 s  max batch at 128K: only with time left over; else the rerun (STAGES=3b TOTAL_S=200)
#
# The rerun: STAGES="..." names the stages to run again (a stage that failed, or 3b), TOTAL_S their time.
#
# Set-up, untimed: installs the carried wheels (transformers 5.24, regex; setuptools builds dual-cache) and
# dual-cache itself with --no-deps into a target folder (no editable install), then runs every stage from an empty
# folder ($RUN_DIR), never from the repository root: `python -m` puts the current folder first on sys.path, where
# ./dual_cache (the source tree) has no `eval` subpackage (installed as dual_cache.eval from ./eval through
# pyproject's package-dir) and would shadow the installed package. A preflight imports every stage's module from
# there and fails the set-up (exit 2) unless `dual_cache` is the installed copy; then the native selection engine is
# built in the variant the run uses (and the scalar one, which asks the CPU for its features).
#
# What comes back (7 files; 8 at most come back): $OUT/log.txt (every table and every verdict, as it comes),
# $OUT/gpu_check.json (rewritten after each check), summary.json in $OUT/cap24-32k, $OUT/cap24-128k and
# $OUT/latency-32k (rewritten after each cell; the log prints the table of a stage cut short), and
# $OUT/host-retrieval-32k.json + .md (rewritten after each cell). Knobs (environment): HOST_GIB (host memory for the KV, default 100), CAP_GIB (device cap,
# default 24), TOTAL_S (seconds the stages share, default 300), STAGES (which of 2 3a 1a 4 5 1b 3b, default all),
# RUN_DIR (the folder the stages run in; default a new empty one).
#
# DRY_RUN=1 runs the same set-up and every stage's command line on this machine's CPU with tiny shapes (the tiny
# random model, 256-512-token contexts, one-step repeats), in the CUDA machine's layout: the same clean copy of the
# tree installed with --no-deps into a temporary target, the stages run from $RUN_DIR with that target first on the
# path, and the test environment's packages ($PYTHON's) beside it through a fresh virtual environment that does not
# run their .pth hooks (so an editable install of dual-cache there cannot stand in for the target). The script
# cannot rot between the rare runs on the CUDA machine (tests/test_device_run.py). The Triton kernel's stages need
# CUDA: 1a's tests skip and 1b says so and exits 2.
set -u
: "${OUT:?set OUT to the folder the results go to}"
[ -f eval/device_run.sh ] || { echo "run from the repository root: bash eval/device_run.sh"; exit 2; }
ROOT=$(pwd)
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
HOST_GIB=${HOST_GIB:-100}
CAP_GIB=${CAP_GIB:-24}
ORDER=(2 3a 1a 4 5 1b 3b)
STAGES=" ${STAGES:-${ORDER[*]}} "
declare -A SHARE=([2]=40 [3a]=120 [1a]=50 [4]=50 [5]=20 [1b]=20 [3b]=0)  # seconds each stage is promised
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
exec > >(tee -a "$OUT/log.txt") 2>&1

# --- set-up (untimed) ----------------------------------------------------------------------------------------------
WORK=$(mktemp -d /tmp/dual-device.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
RUN_DIR=${RUN_DIR:-$WORK/run}
SITE=$WORK/site
mkdir -p "$RUN_DIR" "$WORK/src"
cp -r dual_cache eval pyproject.toml README.md "$WORK/src/"  # what setuptools reads; no build/ left in the tree
PIP_TARGET=(-q --no-deps --no-compile --no-cache-dir --target "$SITE")
if [ -n "${DRY_RUN:-}" ]; then
    echo "== dry run on $(nproc) CPU cores with tiny shapes, in the CUDA machine's layout"
    PYTHON=${PYTHON:-python3}
    # the test environment's packages without their .pth hooks: a fresh venv whose one .pth names their folders
    "$PYTHON" -m venv --without-pip "$WORK/env" || exit 2
    PY=$WORK/env/bin/python
    "$PYTHON" -c "import site, sysconfig
print('\n'.join(dict.fromkeys([sysconfig.get_paths()['purelib'], sysconfig.get_paths()['platlib'],
                               *site.getsitepackages()])))" > "$($PY -c "import sysconfig
print(sysconfig.get_paths()['purelib'])")/dual-test-env.pth" || exit 2
    "$PYTHON" -m pip install "${PIP_TARGET[@]}" --no-build-isolation "$WORK/src" || exit 2
    DEVICE=(--device cpu --model tiny); CHECK=(--device cpu --tiny)
    CTX32=256; CTX128=512; CHUNK=128; NEW=4; WARM=1; CELL_S=20
    RETRIEVAL=(--contexts 2048 --batches 1 --pools 1 --repeats 1 --layers 2 --distinct-layers 1 --heads 4 --kv-heads 2
               --head-dim 64)
    KERNEL=(--budgets 256 --batches 1 --rep-ms 1)
    TOTAL_S=${TOTAL_S:-900}
else
    nvidia-smi -L
    free -g | head -2
    PY=${PYTHON:-python3}
    echo "== install (.wheels + dual-cache, --no-deps)"
    ls .wheels/*.whl || { echo "no .wheels/: run 'make device-wheels' and carry .wheels"; exit 2; }
    $PY -m pip install "${PIP_TARGET[@]}" --no-index --find-links .wheels .wheels/transformers-*.whl \
        .wheels/regex-*.whl "$WORK/src" || exit 2
    DEVICE=(--device cuda --model llama8b); CHECK=()
    CTX32=32768; CTX128=131072; CHUNK=4096; NEW=6; WARM=2; CELL_S=60
    RETRIEVAL=(--contexts 32768 --batches 1 8 --pools 16 --repeats 3)
    KERNEL=(--budgets 256 1024 --batches 1 8 32 --rep-ms 25)
    TOTAL_S=${TOTAL_S:-300}
fi
export PYTHONPATH=$SITE
cd "$RUN_DIR" || exit 2
echo "== preflight from $RUN_DIR: the installed dual_cache and every stage's module"
$PY -c "import importlib, os, sys
for name in ('dual_cache.eval.gpu_check', 'dual_cache.eval.throughput.bench', 'dual_cache.eval.throughput.bench_report',
             'dual_cache.eval.selection.bench_retrieval', 'dual_cache.eval.throughput.bench_kernel'):
    importlib.import_module(name)
import torch, transformers, triton, dual_cache
where = os.path.dirname(dual_cache.__file__)
if os.path.realpath(where) != os.path.realpath(os.path.join(sys.argv[1], 'dual_cache')):
    sys.exit(f'dual_cache is imported from {where}, not from the install in {sys.argv[1]}')
print('torch', torch.__version__, '| transformers', transformers.__version__, '| triton', triton.__version__,
      '| python', sys.version.split()[0], '| default selector', dual_cache.DualDecoderConfig().selector,
      '| host cores', os.cpu_count())" "$SITE" || { echo "== preflight failed: the stages cannot run"; exit 2; }
echo "== native selection engine (g++), the variant this run uses"
$PY -c "from dual_cache.engine import native
print('native selection engine:', native.active_variant(), 'in', native.build_dir())"

# --- stages (timed) ------------------------------------------------------------------------------------------------
DEADLINE=$((SECONDS + TOTAL_S))
echo "== set-up done @ ${SECONDS}s; the stages share ${TOTAL_S}s"
stage() {  # stage ID NAME COMMAND...
    local id=$1 name=$2 reserve=0 later=0 other code
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
    code=$?
    echo "== $id. $name: exit $code @ ${SECONDS}s"
    if [ "$code" -ge 124 ] && [ -n "$SUMMARY" ] && [ -f "$SUMMARY" ]; then  # a benchmark cut short: its table
        $PY -m dual_cache.eval.throughput.bench_report "$SUMMARY"
    fi
}
SUMMARY=
bench_stage() {  # bench_stage ID NAME FOLDER BENCH-OPTIONS...: the benchmark, its summary in $OUT/FOLDER
    local id=$1 name=$2 folder=$3
    shift 3
    SUMMARY=$OUT/$folder/summary.json
    stage "$id" "$name" $PY -m dual_cache.eval.throughput.bench "${DEVICE[@]}" --budgets 256 --summary-only \
        --keep-going --repeats 1 --out "$OUT/$folder" "$@"
    SUMMARY=
}

# one run per cell (--repeats 1): the stages' shares were sized for it; bench's default is 3
CAPPED=(--device-budget-gib "$CAP_GIB" --host-budget-gib "$HOST_GIB" --batches 1 --new-tokens "$NEW"
        --warmup-steps "$WARM" --max-cell-seconds "$CELL_S"
        --methods dense dual-self quest offloaded dual-no-repair)

stage 2 "correctness on CUDA" $PY -m dual_cache.eval.gpu_check "${CHECK[@]}" --out "$OUT"
bench_stage 3a "max batch at ${CAP_GIB} GiB, 32K" cap24-32k "${CAPPED[@]}" --contexts "$CTX32" \
    --prefill-chunk-size "$CHUNK"
stage 1a "kernel tests on CUDA" $PY -m pytest -v -p no:cacheprovider "$ROOT/tests/test_kernel_triton.py" \
    -k "cuda and not without_a_gpu"
bench_stage 4 "issues 14 and 57: 32K decode, batch 1 and 8" latency-32k --contexts "$CTX32" --batches 1 8 \
    --new-tokens $((2 * NEW)) --warmup-steps $((WARM + 1)) --methods dense dual-self \
    --host-budget-gib "$HOST_GIB" --no-max-batch --prefill-chunk-size "$CHUNK"
stage 5 "host selection alone at 32K: lowbit and exact through the engine" \
    $PY -m dual_cache.eval.selection.bench_retrieval "${RETRIEVAL[@]}" --selectors lowbit exact \
    --out "$OUT/host-retrieval-32k"
stage 1b "kernel vs reference, us per layer call" $PY -m dual_cache.eval.throughput.bench_kernel --dtype bf16 "${KERNEL[@]}"
bench_stage 3b "max batch at ${CAP_GIB} GiB, 128K" cap24-128k "${CAPPED[@]}" --contexts "$CTX128" \
    --prefill-chunk-size "$((2 * CHUNK))"
echo "== done @ ${SECONDS}s"
