"""Issue 27's frontier table: per lowbit configuration (channel share, shortlist factor), the key bytes a step reads
and the step time beside exact selection (`bench-retrieval` JSON rows, one file per configuration, exact and lowbit
timed in the same run) joined with the recall measured on real keys (`selection_recall` JSON rows).

    python -m dual_cache.eval.selection.lowbit_frontier results/bench/lowbit-frontier/bench-c*-f*.json \
        --recall "SmolLM2 8K=results/selection/smollm2-135m-8k-lowbit-channels.json" \
        "Gemma 16K=results/selection/gemma3-270m-16k-lowbit-channels.json" \
        "Gemma 32K=results/selection/gemma3-270m-32k-lowbit-channels.json" \
        --out results/bench/lowbit-frontier/frontier.md

A recall cell is `-` where that file has no row with the configuration's options.
"""

from __future__ import annotations

import argparse
import json
import sys

from ...cli.help_format import DefaultsHelpFormatter

HEADER = ("# lowbit frontier: bytes, time and recall per configuration (issue 27)\n\n"
          "Step time: `bench-retrieval` (random keys, Llama-3.1-8B shape: 32 layers, 8 KV heads x 128, bf16, budget "
          "256, batch 1, two retrieval threads, one layer each), exact selection through the engine timed beside "
          "each configuration in the same run. Recall: mean / p10 of the exact top-256 group attention "
          "mass on real keys (`results/selection/*-lowbit-channels.md`). Default: channels 0.25, factor 8.")


def config_key(options: dict) -> tuple[float, int]:
    """A lowbit configuration as `(lowbit_channels, lowbit_factor)`, from a row's `options`."""
    return float(options["lowbit_channels"]), int(options["lowbit_factor"])


def frontier_table(bench: list[list[dict]], recall: dict[str, list[dict]]) -> str:
    """The markdown table: one row per (bench file, context). `bench`: per configuration, its `bench-retrieval` rows
    (each context one `exact` and one `lowbit` row; milliseconds, MiB). `recall`: label -> `selection_recall` rows
    (`options`, `mean`, `p10`: shares of the exact top-k mass). Raises KeyError when a context lacks either
    selector's row."""
    by_config = {name: {config_key(r["options"]): r for r in rows if r.get("options")} for name, rows in recall.items()}
    lines = [HEADER, "", "| channels | factor | context | key MiB / step (vs exact) | exact ms / step "
             "| lowbit ms / step | exact / lowbit | " + " | ".join(f"recall {name}" for name in recall) + " |",
             "|---|---|---|---|---|---|---|" + "---|" * len(recall)]
    for rows in bench:
        for context in sorted({r["context"] for r in rows}):
            cell = {r["selector"]: r for r in rows if r["context"] == context}
            exact, lowbit = cell["exact"], cell["lowbit"]
            key = config_key(lowbit["options"])
            cells = [f"{found[key]['mean']:.4f} / {found[key]['p10']:.4f}" if key in found else "-"
                     for found in by_config.values()]
            share = lowbit["key_mib_read_per_step"] / exact["key_mib_read_per_step"]
            lines.append(f"| {key[0]} | {key[1]} | {context} | {lowbit['key_mib_read_per_step']:,.0f} ({share:.1%}) | "
                         f"{exact['ms_per_step']:.0f} | {lowbit['ms_per_step']:.1f} | "
                         f"{exact['ms_per_step'] / lowbit['ms_per_step']:.1f}x | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _rows(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        rows = json.load(handle)
    return rows if isinstance(rows, list) else rows["rows"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dual_cache.eval.selection.lowbit_frontier",
                                     description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("bench", nargs="+", help="bench-retrieval JSON files, one per lowbit configuration")
    parser.add_argument("--recall", nargs="*", default=[], metavar="LABEL=PATH",
                        help="selection_recall JSON files, each with its column label")
    parser.add_argument("--out", default=None, help="markdown file to write (default: print only)")
    args = parser.parse_args(argv)
    if any("=" not in item for item in args.recall):
        parser.error("each --recall value must be LABEL=PATH")
    recall = {label: _rows(path) for label, path in (item.split("=", 1) for item in args.recall)}
    table = frontier_table([_rows(path) for path in sorted(args.bench)], recall)
    print(table, end="")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
