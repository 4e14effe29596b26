#!/bin/bash
# The 2026-11-29 H200 session (transformers 5.17, triton 3.6 on that machine; see ../h200-32k.md): from the repo
# root, with $OUT set: bash results/gpu/device_run/run.sh. Host retrieval alone, correctness checks, then 32K decode
# timing (the cell list in gpu_part.py; the first run's list is in its comment and in git history).
set -u
P=/tmp/p; rm -rf $P; mkdir -p $P
cp -r dual_cache $P/ && cp -r kernels $P/dual_cache/kernels && cp -r eval $P/dual_cache/eval && cp results/gpu/device_run/sitecustomize.py $P/
export PYTHONPATH=$P PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
echo "== 1. kernel tests skipped (triton 3.6)"
echo "== 2. host retrieval alone on this machine's CPU (exact vs shortlist, Llama-3.1-8B shape)"
timeout 120 python3 -m dual_cache.eval.bench_retrieval --contexts 32768 131072 --batches 1 8 --repeats 5 \
    --out $OUT/host-retrieval 2>&1 | tail -12
echo "== 3. correctness + 4. timing"; timeout 330 python3 results/gpu/device_run/gpu_part.py 2>&1 | grep -v Warn | tee $OUT/gpu_part.txt
