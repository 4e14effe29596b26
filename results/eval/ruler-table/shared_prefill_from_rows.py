"""What one more decode-time method costs in the RULER table's own runs, from the rows' timings.

    python results/eval/ruler-table/shared_prefill_from_rows.py results/eval/ruler-table/smollm2-135m-4k.jsonl \
        --since 495 > results/eval/ruler-table/shared-prefill-from-rows.md

Every row of a shared-prefill run holds `prefill_seconds` (the sample's one prefill, shared by its methods) and
`seconds` (this method alone: its cache built from the shared prefill, the last prompt token, the decode). A method
run on its own costs about `prefill_seconds + seconds`, so `seconds / (prefill_seconds + seconds)` is what adding the
method costs relative to running it alone (`eval/quality/shared_prefill_cost.py` measures that ratio directly on
a few prompts). A least-squares line `seconds = fixed + per_token × new_tokens` per method separates what the
shared prefill can still save (`fixed`: building the method's cache from the prefill, the last prompt token) from
the method's own decode. `--since N` skips the file's first N rows (rows written by an earlier run, under a
different machine load); the timings are comparable only within one run.
"""
import argparse
import json
import statistics
from collections import defaultdict

import numpy as np

from dual_cache.eval.quality.ruler_table import method_label

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("paths", nargs="+")
parser.add_argument("--since", type=int, default=0, help="skip each file's first N rows")
args = parser.parse_args()
groups = defaultdict(list)
for path in args.paths:
    with open(path, encoding="utf-8") as handle:
        for i, line in enumerate(handle):
            row = json.loads(line)
            if i < args.since or row.get("prefill_seconds") is None:
                continue
            label = method_label(row["method"], row.get("budget"))
            groups[label].append((row["seconds"], row["prefill_seconds"], row["new_tokens"]))
print(f"Rows: {', '.join(args.paths)} (from row {args.since}); seconds are wall time on this CPU, one run.\n")
print("| method | rows | median prefill s | median method s | added / stand-alone, median | mean | fixed s "
      "| s per new token |")
print("|---|---|---|---|---|---|---|---|")
for label, values in sorted(groups.items()):
    seconds, prefill, tokens = (np.array(v, dtype=float) for v in zip(*values))
    ratio = seconds / (prefill + seconds)
    slope, fixed = np.polyfit(tokens, seconds, 1)
    print(f"| {label} | {len(values)} | {statistics.median(prefill):.1f} | {statistics.median(seconds):.2f} | "
          f"{statistics.median(ratio):.0%} | {ratio.mean():.0%} | {fixed:.2f} | {slope:.3f} |")
