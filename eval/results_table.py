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
    """The table's rows: `{measure, machine, baseline, dual, source}` (strings)."""
    p = lambda *parts: os.path.join(root, *parts)  # noqa: E731
    out = []
    smol = _jsonl(p("eval", "results.jsonl"))
    for length in (4096, 8192):
        d, n, d_mib = _ruler(smol, "dense", "niah_single_1", length)
        x, _, x_mib = _ruler(smol, "dual", "niah_single_1", length)
        out.append({"measure": f"RULER niah_single_1 at {length // 1024}K, SmolLM2-135M (n = {n}), budget 256",
                    "machine": "CPU", "baseline": f"dense {d:.0f}", "dual": f"{x:.0f}",
                    "source": "results/eval/results.jsonl"})
    out.append({"measure": "device KV per request at 8K, SmolLM2-135M fp32", "machine": "CPU",
                "baseline": f"dense {_mib(d_mib)}", "dual": _mib(x_mib), "source": "results/eval/results.jsonl"})
    gemma = _jsonl(p("eval", "gemma3-270m", "results.jsonl"))
    for length in (16384, 32768):
        d, n, d_mib = _ruler(gemma, "dense", "niah_single_1", length)
        x, _, x_mib = _ruler(gemma, "dual", "niah_single_1", length)
        out.append({"measure": f"RULER niah_single_1 at {length // 1024}K, Gemma-3-270M (n = {n}); device KV "
                               "per request", "machine": "CPU",
                    "baseline": f"dense {d:.0f}; {_mib(d_mib)}", "dual": f"{x:.0f}; {_mib(x_mib)}",
                    "source": "results/eval/gemma3-270m/results.jsonl"})
    out += ruler_averages(root, default=", @256 = issue 57's default (per-step slots)")
    for folder in RESIDENT_SET_GATES:
        out += ruler_averages(root, folder, ", @256 = today's default (the resident set)")
    cells = _jsonl(p("gpu", "h200-32k-cells.jsonl"))
    dense = next(c for c in cells if c["method"] == "dense" and c["batch"] == 1)
    dual = next(c for c in cells if c["method"].startswith("dual") and c["batch"] == 1)
    out.append({"measure": "device KV per request at 32K, Llama-3.1-8B shape bf16", "machine": "H200",
                "baseline": f"dense {_mib(dense['device_bytes_per_request'] / MIB)}",
                "dual": _mib(dual["device_bytes_per_request"] / MIB), "source": "results/gpu/h200-32k-cells.jsonl"})
    out.append({"measure": "decode tokens/s at 32K batch 1 (host selection of that run: torch exact)",
                "machine": "H200", "baseline": f"dense {dense['decode_tokens_per_s']:.1f}",
                "dual": f"{dual['decode_tokens_per_s']:.1f}", "source": "results/gpu/h200-32k-cells.jsonl"})
    engine = _json(p("bench", "host-retrieval-engine-32k.json"))
    engine = engine["rows"] if isinstance(engine, dict) else engine
    ms = {r["selector"]: r["ms_per_step"] for r in engine if r["batch"] == 1 and r["pool"] == 2}
    out.append({"measure": "host selection ms per step at 32K batch 1, Llama-3.1-8B shape (2 threads)",
                "machine": "CPU", "baseline": f"torch exact {ms['torch-exact']:.0f}",
                "dual": f"engine exact {ms['exact']:.0f}; lowbit {ms['lowbit']:.0f}",
                "source": "results/bench/host-retrieval-engine-32k.json"})
    serving = {r["system"]: r for r in _json(p("serving", "smollm2-1k-poisson.json"))["rows"]}
    out.append({"measure": "serving, 16 Poisson requests of 1K tokens: output tokens/s; peak device KV",
                "machine": "CPU", "baseline": f"static generate() {serving['static']['output_tokens_per_s']:.1f}; "
                                               f"dense rows {_mib(serving['dense']['peak_device_kv_bytes'] / MIB)}",
                "dual": f"{serving['dual']['output_tokens_per_s']:.1f}; "
                        f"{_mib(serving['dual']['peak_device_kv_bytes'] / MIB)}",
                "source": "results/serving/smollm2-1k-poisson.json"})
    serving = {r["system"]: r for r in _json(p("serving", "smollm2-256-long-outputs.json"))["rows"]}
    out.append({"measure": "serving, 32 Poisson requests of 256 tokens, 4-256 new: output tokens/s",
                "machine": "CPU", "baseline": f"static generate() {serving['static']['output_tokens_per_s']:.1f}; "
                                               f"dense rows {serving['dense']['output_tokens_per_s']:.1f}",
                "dual": f"{serving['dual']['output_tokens_per_s']:.1f}",
                "source": "results/serving/smollm2-256-long-outputs.json"})
    return out


RULER_TABLE = ("eval", "ruler-table")  # the RULER table's rows (eval/quality/ruler_table_run.sh) and ruler_table.md
RULER_NAMES = {"HuggingFaceTB/SmolLM2-135M-Instruct": "SmolLM2-135M", "google/gemma-3-270m": "Gemma-3-270M"}


RESIDENT_SET_GATES = (("eval", "ruler-4k-issue62"), ("eval", "gemma3-16k-issue62"))  # today's default's RULER rows


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
    """Bar chart (log scale) of device KV MiB per request, dense vs dual, at every measured point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = lambda *parts: os.path.join(root, *parts)  # noqa: E731
    points = []
    smol = _jsonl(p("eval", "results.jsonl"))
    for length in (4096, 8192):
        points.append((f"SmolLM2-135M\n{length // 1024}K", _ruler(smol, "dense", "niah_single_1", length)[2],
                       _ruler(smol, "dual", "niah_single_1", length)[2]))
    gemma = _jsonl(p("eval", "gemma3-270m", "results.jsonl"))
    for length in (16384, 32768):
        points.append((f"Gemma-3-270M\n{length // 1024}K", _ruler(gemma, "dense", "niah_single_1", length)[2],
                       _ruler(gemma, "dual", "niah_single_1", length)[2]))
    cells = _jsonl(p("gpu", "h200-32k-cells.jsonl"))
    dense = next(c for c in cells if c["method"] == "dense" and c["batch"] == 1)
    dual = next(c for c in cells if c["method"].startswith("dual") and c["batch"] == 1)
    points.append(("Llama-3.1-8B shape\n32K (H200)", dense["device_bytes_per_request"] / MIB,
                   dual["device_bytes_per_request"] / MIB))
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
