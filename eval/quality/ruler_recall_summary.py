"""One table from `dual-decoder recall --ruler-task` outputs: per task, the default selector's recall of the exact
top-k attention mass and the share of the candidates' mass the exact top-k holds.

    python -m dual_cache.eval.quality.ruler_recall_summary results/eval/ruler-table/recall/smollm2-135m-4k-*.json \
        > results/eval/ruler-table/recall/summary.md

Each file is named `<model>-4k-<task>.json` (as `bash eval/quality/ruler_table_run.sh recall` writes them) and holds
the recall rows of the `exact` and `lowbit` selectors; the table follows the RULER table's task order.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ...cli.help_format import DefaultsHelpFormatter
from .ruler_table import TASK_ORDER

INTRO = ("Per task, from `bash eval/quality/ruler_table_run.sh recall` (the 4K table's prompts, samples 0-3; the last "
         "8 prompt positions' queries; full-attention layers 2+ x KV heads): the default selector's (lowbit) recall "
         "of the exact top-256 attention mass, and the share of the candidates' mass (past the sink, before the "
         "window) that the exact top-256 holds.\n")


def task_of(path: str) -> str:
    """`.../smollm2-135m-4k-fwe.json` -> `fwe`."""
    return os.path.basename(path).removesuffix(".json").split("-4k-", 1)[1]


def summary(paths: list[str]) -> str:
    """The markdown table (recall and shares as fractions of the exact top-k mass); raises KeyError for a file
    without a `lowbit` row and ValueError for a task outside the RULER table."""
    lines = [INTRO, "| task | lowbit recall mean | p10 | min | exact top-256 share of candidate mass |",
             "|---|---|---|---|---|"]
    for path in sorted(paths, key=lambda p: TASK_ORDER.index(task_of(p))):
        with open(path, encoding="utf-8") as handle:
            low = {row["selector"]: row for row in json.load(handle)}["lowbit"]
        lines.append(f"| {task_of(path)} | {low['mean']:.4f} | {low['p10']:.4f} | {low['min']:.4f} | "
                     f"{low['topk_share']:.1%} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dual_cache.eval.quality.ruler_recall_summary",
                                     description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("paths", nargs="+", help="recall JSON files, `<model>-4k-<task>.json`")
    args = parser.parse_args(argv)
    bad = [path for path in args.paths if "-4k-" not in os.path.basename(path)
           or task_of(path) not in TASK_ORDER]
    if bad:
        parser.error(f"not named <model>-4k-<RULER task>.json: {', '.join(bad)}")
    print(summary(args.paths), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
