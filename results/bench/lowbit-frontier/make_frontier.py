"""Issue 27's frontier table: per lowbit configuration, the key bytes a step reads, the step time beside exact
selection (bench-c*-f*.json, written by run.sh), and the recall measured on real keys (results/selection/*-lowbit-
channels.json). Writes frontier.md beside this file.

Run: .venv/bin/python results/bench/lowbit-frontier/make_frontier.py
"""
import json
from pathlib import Path

HERE = Path(__file__).parent
SELECTION = HERE.parents[1] / "selection"
RECALL = {"SmolLM2 8K": "smollm2-135m-8k-lowbit-channels.json", "Gemma 16K": "gemma3-270m-16k-lowbit-channels.json",
          "Gemma 32K": "gemma3-270m-32k-lowbit-channels.json"}


def key(options):
    return (float(options["lowbit_channels"]), int(options["lowbit_factor"]))


recall = {name: {key(r["options"]): r for r in json.loads((SELECTION / f).read_text()) if r["options"]}
          for name, f in RECALL.items()}
lines = ["# lowbit frontier: bytes, time and recall per configuration (issue 27)", "",
         "Step time: `bench-retrieval` (random keys, Llama-3.1-8B shape: 32 layers, 8 KV heads x 128, bf16, budget "
         "256, batch 1, two retrieval threads, one layer each), exact selection through the engine timed beside "
         "each configuration in the same run (`run.sh`). Recall: mean / p10 of the exact top-256 group attention "
         "mass on real keys (`results/selection/*-lowbit-channels.md`). Default: channels 0.25, factor 8.", "",
         "| channels | factor | context | key MiB / step (vs exact) | exact ms / step | lowbit ms / step | exact / lowbit "
         "| " + " | ".join(f"recall {n}" for n in RECALL) + " |",
         "|---|---|---|---|---|---|---|" + "---|" * len(RECALL)]
for path in sorted(HERE.glob("bench-c*-f*.json")):
    rows = json.loads(path.read_text())
    rows = rows if isinstance(rows, list) else rows["rows"]
    for context in sorted({r["context"] for r in rows}):
        cell = {r["selector"]: r for r in rows if r["context"] == context}
        ex, lb = cell["exact"], cell["lowbit"]
        k = key(lb["options"])
        rec = [f"{recall[n][k]['mean']:.4f} / {recall[n][k]['p10']:.4f}" if k in recall[n] else "-" for n in RECALL]
        lines.append(f"| {k[0]} | {k[1]} | {context} | {lb['key_mib_read_per_step']:,.0f} "
                     f"({lb['key_mib_read_per_step'] / ex['key_mib_read_per_step']:.1%}) | {ex['ms_per_step']:.0f} | "
                     f"{lb['ms_per_step']:.1f} | {ex['ms_per_step'] / lb['ms_per_step']:.1f}x | " + " | ".join(rec) + " |")
(HERE / "frontier.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
