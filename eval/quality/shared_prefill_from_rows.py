"""What one more decode-time method costs in the RULER table's own runs, from the rows' timings.

    python -m dual_cache.eval.quality.shared_prefill_from_rows results/eval/ruler-table/smollm2-135m-4k.jsonl \
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

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict

import numpy as np

from ...cli.help_format import DefaultsHelpFormatter
from .ruler_table import method_label


def method_timings(paths: list[str], since: int = 0) -> dict[str, list[tuple[float, float, int]]]:
    """Per method label, `(seconds, prefill_seconds, new_tokens)` of every row from row `since` on of each JSONL file
    (seconds: wall time); rows without `prefill_seconds` (not from a shared-prefill run) are skipped."""
    groups = defaultdict(list)
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            for index, line in enumerate(handle):
                row = json.loads(line)
                if index < since or row.get("prefill_seconds") is None:
                    continue
                groups[method_label(row["method"], row.get("budget"))].append(
                    (row["seconds"], row["prefill_seconds"], row["new_tokens"]))
    return dict(groups)


def table(paths: list[str], since: int = 0) -> str:
    """The markdown table: per method, rows, medians (seconds), added / stand-alone cost (median and mean, shares)
    and the least-squares `fixed` (seconds) and `s per new token`; a method needs rows of two token counts."""
    lines = [f"Rows: {', '.join(paths)} (from row {since}); seconds are wall time on this CPU, one run.\n",
             "| method | rows | median prefill s | median method s | added / stand-alone, median | mean | fixed s "
             "| s per new token |", "|---|---|---|---|---|---|---|---|"]
    for label, values in sorted(method_timings(paths, since).items()):
        seconds, prefill, tokens = (np.array(v, dtype=float) for v in zip(*values))
        ratio = seconds / (prefill + seconds)
        slope, fixed = np.polyfit(tokens, seconds, 1)
        lines.append(f"| {label} | {len(values)} | {statistics.median(prefill):.1f} | "
                     f"{statistics.median(seconds):.2f} | {statistics.median(ratio):.0%} | {ratio.mean():.0%} | "
                     f"{fixed:.2f} | {slope:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dual_cache.eval.quality.shared_prefill_from_rows",
                                     description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("paths", nargs="+", help="JSONL rows of shared-prefill `dual-decoder eval run` runs")
    parser.add_argument("--since", type=int, default=0, help="skip each file's first N rows")
    args = parser.parse_args(argv)
    if args.since < 0:
        parser.error("--since must be >= 0")
    print(table(args.paths, args.since), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
