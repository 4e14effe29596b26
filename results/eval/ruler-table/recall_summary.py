"""One table from `dual-decoder recall --ruler-task` outputs: per task, the default selector's recall of the exact
top-k attention mass and the share of the candidates' mass the exact top-k holds.

    python results/eval/ruler-table/recall_summary.py results/eval/ruler-table/recall/smollm2-135m-4k-*.json
"""
import json
import os
import sys

from dual_cache.eval.quality.ruler_table import TASK_ORDER


def task_of(path: str) -> str:
    """`.../smollm2-135m-4k-fwe.json` -> `fwe`."""
    return os.path.basename(path).removesuffix(".json").split("-4k-", 1)[1]


print("Per task, from `bash results/eval/ruler-table/run.sh recall` (the 4K table's prompts, samples 0-3; the last 8 "
      "prompt positions' queries; full-attention layers 2+ x KV heads): the default selector's (lowbit) recall of the "
      "exact top-256 attention mass, and the share of the candidates' mass (past the sink, before the window) that "
      "the exact top-256 holds.\n")
print("| task | lowbit recall mean | p10 | min | exact top-256 share of candidate mass |")
print("|---|---|---|---|---|")
for path in sorted(sys.argv[1:], key=lambda p: TASK_ORDER.index(task_of(p))):
    with open(path, encoding="utf-8") as handle:
        low = {row["selector"]: row for row in json.load(handle)}["lowbit"]
    print(f"| {task_of(path)} | {low['mean']:.4f} | {low['p10']:.4f} | {low['min']:.4f} | {low['topk_share']:.1%} |")
