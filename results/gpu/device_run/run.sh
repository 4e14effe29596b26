#!/bin/bash
# The 2026-11-29 H200 session (transformers 5.17, triton 3.6 on that machine; see ../h200-32k.md): from the repo
# root, with $OUT set: bash results/gpu/device_run/run.sh. Correctness checks, then 32K decode timing.
set -u
P=/tmp/p; rm -rf $P; mkdir -p $P
cp -r dual_cache $P/ && cp -r kernels $P/dual_cache/kernels && cp -r eval $P/dual_cache/eval && cp results/gpu/device_run/sitecustomize.py $P/
export PYTHONPATH=$P PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
echo "== 1. kernel tests skipped (triton 3.6)"
echo "== 2. correctness + 3. timing"; timeout 330 python3 results/gpu/device_run/gpu_part.py 2>&1 | grep -v Warn | tee $OUT/gpu_part.txt
