"""`dual-decoder report`: the README's one results table and plot, computed from the files under `results/`.

    dual-decoder report                     # print the table
    dual-decoder report --write README.md   # replace the table between the README's report markers
    dual-decoder report --plot results/device-kv.png

Every number comes from a committed result file (the row names it), so the README cannot drift from the data:
`tests/test_readme.py` checks that the README holds exactly what this command prints.
"""

from __future__ import annotations

import json
import os
from statistics import mean

from ..cli.help_format import DefaultsHelpFormatter
from ..runtime.extras import require

BEGIN, END = "<!-- report:begin -->", "<!-- report:end -->"
MIB = 2 ** 20


def _jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _json(path: str) -> dict:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def _ruler(rows: list[dict], method: str, task: str, length: int) -> tuple[float, int, float]:
    """(mean score, samples, mean device MiB per request) of one method's RULER cell."""
    cell = [r for r in rows if r["dataset"] == "ruler" and r["task"] == task and r["method"] == method
            and r["length"] == length]
    if not cell:
        raise ValueError(f"no RULER rows for {method} {task} {length}")
    return mean(r["score"] for r in cell), len(cell), mean(r["device_bytes"] for r in cell) / MIB


def _mib(value: float) -> str:
    return f"{value / 1024:,.1f} GiB" if value >= 1024 else f"{value:,.1f} MiB"


def collect(root: str = "results") -> list[dict]:
    """The table's rows, today's default only (earlier defaults' rows: docs/benchmarks.md, "History"):
    `{measure, machine, baseline, dual, source}` (strings). A row whose result file is not there is left out."""
    out = ruler_averages(root, DEFAULT_GATE, ", budget 256")
    out += needle_rows(root) + device_rows(root) + host_rows(root) + throughput_rows(root)
    return out


DEFAULT_GATE = ("eval", "default-gate")  # today's default's RULER, fidelity rows beside dense's and the flat scan's
NEEDLES = (  # (label, dense's file, dual's file) under results/needle/
    ("16 word needles at 4K, SmolLM2-135M, budget 256: correct", "4k.jsonl", "4k-carried.jsonl"),
    ("4 word needles at 32K, Gemma-3-270M, budget 256: correct", "gemma3-270m-32k-carried.jsonl",
     "gemma3-270m-32k-carried.jsonl"),
)
HOST_BENCH = ("bench", "host-retrieval-carried", "llama8b-1thread")  # bench-retrieval, .json
THROUGHPUT = ("bench", "cpu-embedded-8k-b4-carried", "summary.json")  # dual-decoder bench


def needle_rows(root: str) -> list[dict]:
    """Word-needle counts, dense against the default (`dual`), from the needle sweeps' rows."""
    out = []
    for label, dense_file, dual_file in NEEDLES:
        paths = [os.path.join(root, "needle", name) for name in (dense_file, dual_file)]
        if not all(os.path.exists(path) for path in paths):
            continue
        dense, dual = (_jsonl(path) for path in paths)
        seeds = {r["seed"] for r in dual}
        dense = [r for r in dense if r["seed"] in seeds]
        out.append({"measure": label, "machine": "CPU",
                    "baseline": f"dense {sum(r['dense'] for r in dense)}/{len(dense)}",
                    "dual": f"{sum(r['dual'] for r in dual)}/{len(dual)}",
                    "source": "results/needle/" + (dual_file if dense_file == dual_file else
                                                   f"{{{dense_file},{dual_file}}}")})
    return out


def device_rows(root: str) -> list[dict]:
    """Device KV bytes per request, dense against the default, from the RULER gate's rows (each row records the
    bytes its request held on the device)."""
    out = []
    folder = os.path.join(root, *DEFAULT_GATE)
    for name, label in (("smollm2-135m-4k.jsonl", "SmolLM2-135M fp32 at 4K"),
                        ("gemma3-270m-16k.jsonl", "Gemma-3-270M fp32 at 16K")):
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            continue
        rows = _jsonl(path)
        dense = [r["device_bytes"] / MIB for r in rows if r["method"] == "dense"]
        dual = [r["device_bytes"] / MIB for r in rows if r["method"] == "dual"]
        if dense and dual:
            out.append({"measure": f"device KV per request, {label} (RULER prompts)", "machine": "CPU",
                        "baseline": f"dense {_mib(mean(dense))}", "dual": _mib(mean(dual)),
                        "source": "/".join(("results", *DEFAULT_GATE, name))})
    return out


def host_rows(root: str) -> list[dict]:
    """Host core-ms per sequence-step of the selection at the Llama-3.1-8B shape, the flat scan against the default,
    from `dual-decoder bench-retrieval` (one engine thread)."""
    path = os.path.join(root, *HOST_BENCH) + ".json"
    if not os.path.exists(path):
        return []
    rows = _json(path)
    rows = rows["rows"] if isinstance(rows, dict) else rows
    out = []
    for context in sorted({r["context"] for r in rows}):
        cell = {r["selector"]: r for r in rows if r["context"] == context and r["batch"] == 1}
        if "lowbit" in cell and "carried" in cell:
            flat, new = cell["lowbit"]["core_ms_per_sequence_step"], cell["carried"]["core_ms_per_sequence_step"]
            out.append({"measure": f"host selection core-ms per sequence-step at {context // 1024}K, Llama-3.1-8B "
                                   "shape, 1 engine thread (random keys: scans by the interval only)",
                        "machine": "CPU", "baseline": f"flat scan (lowbit) {flat:.1f}",
                        "dual": f"{new:.1f} ({new / flat:.2f}×)", "source": "/".join(("results", *HOST_BENCH)) + ".md"})
    return out


def throughput_rows(root: str) -> list[dict]:
    """Decode tokens/s and host core-ms per sequence-step on this CPU, from `dual-decoder bench`'s summary."""
    path = os.path.join(root, *THROUGHPUT)
    if not os.path.exists(path):
        return []
    cells = _json(path)
    cells = cells["cells"] if isinstance(cells, dict) and "cells" in cells else cells
    by = {c["method"]: c for c in cells}
    if "dense" not in by or "dual-self" not in by:
        return []
    dense, dual = by["dense"]["decode_tokens_per_s"], by["dual-self"]["decode_tokens_per_s"]
    flat = by.get("dual-lowbit")
    text = f"{dual:.2f} ({dual / dense:.2f}×)"
    if flat:
        text += f"; flat scan {flat['decode_tokens_per_s']:.2f}"
    return [{"measure": "decode tokens/s, SmolLM2-135M fp32, natural text 8K, batch 4 (CPU: the KV is in host memory "
                        "either way)", "machine": "CPU", "baseline": f"dense {dense:.2f}", "dual": text,
             "source": "/".join(("results", *THROUGHPUT[:-1])) + "/"}]


RULER_TABLE = ("eval", "ruler-table")  # the RULER table's rows (eval/quality/ruler_table_run.sh) and ruler_table.md
RULER_NAMES = {"HuggingFaceTB/SmolLM2-135M-Instruct": "SmolLM2-135M", "google/gemma-3-270m": "Gemma-3-270M"}


def ruler_averages(root: str = "results", table_folder: tuple[str, ...] = RULER_TABLE, default: str = "") -> list[dict]:
    """One row per (model, length, decoding) of the RULER rows in `root/table_folder`: the average over the tasks
    dense can do, dense and the baselines against dual at each budget (difference from dense and its 95% interval at
    256); a sampled table's row says so, with its settings. `default` names which default `dual@B` rows ran."""
    from .quality.ruler_table import MIN_DENSE, build_tables, decoding_text

    folder = os.path.join(root, *table_folder)
    rows = [r for name in sorted(os.listdir(folder)) if name.endswith(".jsonl") and not name.startswith("shared-")
            for r in _jsonl(os.path.join(folder, name))] if os.path.isdir(folder) else []
    out = []
    for table in build_tables(rows):
        avg = table.average
        if "dense" not in avg:
            continue
        n = sorted({c.n for task in table.averaged for c in table.cells[task].values()})
        baselines = [f"dense {avg['dense'].score:.1f}"] + [
            f"{label.replace('kvpress-', '')} {avg[label].score:.1f}" for label in table.methods
            if label in avg and label != "dense" and not label.startswith("dual")]
        duals = []
        for label in table.methods:  # the default ("dual@B": "@B") and named configurations ("sync-repair@B")
            if label.startswith("dual") and "@" in label and label in avg:
                cell = avg[label]
                text = f"{label.removeprefix('dual').lstrip('-')} {cell.score:.1f}"
                if label.endswith("@256") and cell.diff is not None:
                    text += f" ({cell.diff:+.1f} [{cell.diff_low:+.1f}, {cell.diff_high:+.1f}])"
                duals.append(text)
        name = RULER_NAMES.get(table.model, table.model)
        n_text = str(n[0]) if len(n) == 1 else f"{n[0]}–{n[-1]}"
        source = "/".join(("results",) + table_folder)
        out.append({"measure": f"RULER at {table.length // 1024}K, {name}{decoding_text(table)}{default}: average "
                               f"of the {len(table.averaged)} of {len(table.tasks)} tasks where dense ≥ "
                               f"{MIN_DENSE:.0f} (n = {n_text} per task; [every task]({source}/ruler_table.md))",
                    "machine": "CPU", "baseline": "; ".join(baselines), "dual": "; ".join(duals),
                    "source": source + "/"})
    return out


def render(root: str = "results") -> str:
    """The markdown table (no markers)."""
    lines = ["| measure | machine | baseline | dual-cache | source |", "|---|---|---|---|---|"]
    for row in collect(root):
        lines.append(f"| {row['measure']} | {row['machine']} | {row['baseline']} | {row['dual']} | "
                     f"`{row['source']}` |")
    return "\n".join(lines)


def write_into(path: str, table: str) -> None:
    """Replace the text between `BEGIN` and `END` in `path` with `table`.

    Raises:
        ValueError: the file lacks the markers.
    """
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{path} has no {BEGIN} ... {END} markers to write the table between.")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(f"{head}{BEGIN}\n{table}\n{END}{tail}")


def plot(path: str, root: str = "results") -> None:
    """Bar chart (log scale) of device KV MiB per request, dense vs the default, from the RULER gate's rows and the
    CPU throughput cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = []
    folder = os.path.join(root, *DEFAULT_GATE)
    for name, label in (("smollm2-135m-4k.jsonl", "SmolLM2-135M\n4K"), ("gemma3-270m-16k.jsonl", "Gemma-3-270M\n16K")):
        source = os.path.join(folder, name)
        if os.path.exists(source):
            rows = _jsonl(source)
            points.append((label, mean(r["device_bytes"] for r in rows if r["method"] == "dense") / MIB,
                           mean(r["device_bytes"] for r in rows if r["method"] == "dual") / MIB))
    bench = os.path.join(root, *THROUGHPUT)
    if os.path.exists(bench):
        by = {c["method"]: c for c in _json(bench)["cells"]}
        if "dense" in by and "dual-self" in by:
            points.append(("SmolLM2-135M\n8K (bench)", by["dense"]["device_bytes_per_request"] / MIB,
                           by["dual-self"]["device_bytes_per_request"] / MIB))
    figure, axis = plt.subplots(figsize=(8, 3.6))
    x = range(len(points))
    axis.bar([i - 0.2 for i in x], [d for _, d, _ in points], 0.4, label="dense (DynamicCache)")
    axis.bar([i + 0.2 for i in x], [v for _, _, v in points], 0.4, label="dual (budget 256)")
    axis.set_yscale("log")
    axis.set_xticks(list(x), [name for name, _, _ in points], fontsize=8)
    axis.set_ylabel("device KV per request (MiB)")
    axis.set_title("KV bytes the accelerator holds per request", fontsize=10)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def add_parser(sub) -> None:
    report = sub.add_parser("report", help="the README's results table (and plot) from results/",
                            description=__doc__.split("\n\n")[0],
                            formatter_class=DefaultsHelpFormatter)
    report.add_argument("--results", default="results", help="results folder")
    report.add_argument("--write", default=None, help="file whose report markers receive the table")
    report.add_argument("--plot", default=None, help="also write the device-KV bar chart (.png)")
    report.set_defaults(func=cmd_report)


def cmd_report(args) -> int:
    if args.plot:
        require("eval", "`dual-decoder report --plot` (matplotlib)")
    table = render(args.results)
    if args.write:
        write_into(args.write, table)
    else:
        print(table)
    if args.plot:
        plot(args.plot, args.results)
    return 0
