#!/usr/bin/env bash
# The RULER quality table (issue 45): every RULER task that needs no downloaded corpus, every method side by side,
# each sample's prompt prefilled once and every method decoding its own copy (eval/quality/shared_prefill.py).
# Resumable: rerun the same line and it continues where it stopped. Run from the repository root with the venv's
# dual-decoder on PATH (`source .venv/bin/activate`); --threads 1: on the shared 2-core machine two intra-op threads
# ran decode ~7x slower than one while other processes held the cores.
#   bash eval/quality/ruler_table_run.sh smollm2-4k | smollm2-4k-sampled | gemma3-16k | recall
set -euo pipefail
OUT=results/eval/ruler-table
TASKS="niah_single_1 niah_single_2 niah_single_3 niah_multikey_1 niah_multikey_2 niah_multikey_3 niah_multivalue
       niah_multiquery vt cwe fwe"
case "${1:-}" in
  smollm2-4k)  # embedded SmolLM2-135M-Instruct at 4K, n = 20 per task
    dual-decoder eval run --suites ruler --ruler-tasks $TASKS --lengths 4096 --samples 20 --threads 1 \
        --methods dense dual@128 dual@256 dual@512 quest@256 streaming@256 oracle@256 \
        --out $OUT/smollm2-135m-4k.jsonl ;;
  smollm2-4k-sampled)  # issue 57's sampled gate: the 4 tasks the 4K table averages (dense >= 20), n = 20, sampled
                       # at temperature 0.7, top-p 0.9, sample seed 0 for both methods (paired by prompt and seed)
    dual-decoder eval run --suites ruler --ruler-tasks niah_single_1 niah_single_2 niah_multikey_1 fwe --lengths 4096 \
        --samples 20 --threads 1 --methods dense dual@256 --temperature 0.7 --top-p 0.9 --sampling-seeds 1 \
        --out $OUT/smollm2-135m-4k-sampled.jsonl ;;
  gemma3-16k)  # Gemma-3-270M at 16K (`make install-gemma`); N samples per task
    dual-decoder eval run --model gemma3-270m --suites ruler --ruler-tasks $TASKS --lengths 16384 \
        --samples "${N:-10}" --threads 1 --methods dense dual@256 quest@256 oracle@256 \
        --out $OUT/gemma3-270m-16k.jsonl ;;
  recall)  # why a task loses points: the default selector's recall of the exact top-256 and how much of the
           # attention mass a top-256 can hold, on the 4K table's prompts (samples 0-3), per task
    mkdir -p $OUT/recall
    for task in $TASKS; do
      dual-decoder recall --ruler-task $task --tokens 4096 --seeds 0-3 --budget 256 --queries 8 --threads 1 \
          --configs exact lowbit --out $OUT/recall/smollm2-135m-4k-$task
    done
    python -m dual_cache.eval.quality.ruler_recall_summary $OUT/recall/smollm2-135m-4k-*.json > $OUT/recall/summary.md ;;
  *) echo "usage: $0 smollm2-4k | smollm2-4k-sampled | gemma3-16k | recall" >&2; exit 2 ;;
esac
