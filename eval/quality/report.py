"""Summary markdown table and matplotlib plots from the harness's JSONL rows (`harness.py` documents the schema).

`write_report(rows, out_dir)` writes `summary.md` (scores per method and task × length with sample counts and
device bytes; a fidelity table with KL, top-1 agreement and identical greedy length), `score_vs_budget.png`
(one panel per task × length) and `fidelity_vs_budget.png`. Methods without a budget sweep (dense, streaming)
are drawn as horizontal reference lines. Sampled rows (`sampling` field) are shown apart from greedy ones, their
method named with the settings ("dense (sampled: temperature 0.7, top-p 0.9, top-k off)").
"""

from __future__ import annotations

import os
from collections import defaultdict
from statistics import mean

from ..outputs import mib
from .sampling import settings_text

METHOD_ORDER = ("dense", "dual", "dual-sync-repair", "dual-no-repair", "dual-none", "oracle", "quest", "streaming")


def _method_sort_key(key: tuple) -> tuple:
    name, budget = key
    base = _base_name(name)
    rank = METHOD_ORDER.index(base) if base in METHOD_ORDER else len(METHOD_ORDER)
    return (rank, base, -1 if budget is None else budget, name)


def _method_name(row: dict) -> str:
    """The row's method, with its sampling settings when it was sampled."""
    sampling = row.get("sampling")
    return row["method"] if sampling is None else f"{row['method']} (sampled: {settings_text(sampling)})"


def _base_name(name: str) -> str:
    """`dense` of `dense (sampled: ...)`."""
    return name.split(" (sampled", 1)[0]


def _label(name: str, budget) -> str:
    return name if budget is None or (name == "streaming" and not budget) else f"{name}@{budget}"


def _length_label(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens >= 1024 and tokens % 1024 == 0 else str(tokens)


def _mib(values: list) -> str:
    """The mean of `values` (bytes) in MiB."""
    values = [v for v in values if isinstance(v, (int, float))]
    return mib(mean(values) if values else None)


def summary_markdown(rows: list[dict]) -> str:
    """Markdown: a score table for the generation suites and a fidelity table (empty sections are left out)."""
    lines = []
    models = sorted({str(r.get("model")) for r in rows})
    lines.append(f"# Quality evaluation\n\nModel: {', '.join(models)}. Scores are 0–100 means over samples "
                 "(n = samples per cell); device MiB = mean KV bytes on the compute device per request, over every "
                 "task at that length.\n")
    gen = [r for r in rows if r["dataset"] != "fidelity"]
    if gen:
        columns = sorted({(r["dataset"], r["task"], r["length"]) for r in gen})
        methods = sorted({(_method_name(r), r.get("budget")) for r in gen}, key=_method_sort_key)
        lengths = sorted({r["length"] for r in gen})
        cells: dict = defaultdict(list)
        device: dict = defaultdict(list)
        for r in gen:
            cells[(_method_name(r), r.get("budget"), r["dataset"], r["task"], r["length"])].append(r["score"])
            device[(_method_name(r), r.get("budget"), r["length"])].append(r.get("device_bytes"))
        header = ["method", "budget"] + [f"{d} {t} {_length_label(n)}" for d, t, n in columns] + [
            f"device MiB {_length_label(n)}" for n in lengths]
        lines += ["## Task scores\n", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for name, budget in methods:
            row = [name, "–" if budget is None else str(budget)]
            for d, t, n in columns:
                scores = cells.get((name, budget, d, t, n))
                row.append(f"{mean(scores):.1f} (n={len(scores)})" if scores else "–")
            row += [_mib(device.get((name, budget, n), [])) for n in lengths]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    fid = [r for r in rows if r["dataset"] == "fidelity" and r["task"] == "teacher_forced_top1"]
    if fid:
        groups: dict = defaultdict(list)
        for r in fid:
            groups[(r["method"], r.get("budget"), r["length"])].append(r)
        lines += ["## Fidelity to dense (teacher-forced on natural text)\n",
                  "KL(dense ‖ method) in nats and top-1 agreement over the teacher-forced document tokens; identical = "
                  "greedy tokens equal to dense's before the first difference (of `greedy_tokens`).\n",
                  "| method | budget | length | KL (nats) | top-1 % | identical greedy tokens | n | device MiB |",
                  "|---|---|---|---|---|---|---|---|"]
        for (name, budget, length), rs in sorted(groups.items(), key=lambda kv: (kv[0][2], _method_sort_key(kv[0][:2]))):
            lines.append(
                f"| {name} | {'–' if budget is None else budget} | {_length_label(length)} | "
                f"{mean(r['kl'] for r in rs):.4f} | {mean(100 * r['top1'] for r in rs):.1f} | "
                f"{mean(r['identical_tokens'] for r in rs):.1f} / {rs[0]['greedy_tokens']} | {len(rs)} | "
                f"{_mib([r.get('device_bytes') for r in rs])} |")
        lines.append("")
    return "\n".join(lines)


def _series(rows: list[dict], value) -> dict:
    """{(method, budget): mean value} over `rows` (sampled rows: the method named with its settings)."""
    groups: dict = defaultdict(list)
    for r in rows:
        groups[(_method_name(r), r.get("budget"))].append(value(r))
    return {k: mean(v) for k, v in groups.items()}


def _draw(ax, series: dict, ylabel: str, title: str) -> None:
    by_method: dict = defaultdict(list)
    for (name, budget), v in series.items():
        by_method[name].append((budget, v))
    styles = iter(["--", ":", "-."])
    markers = iter(["o", "s", "^", "D", "v", "P", "X", "*"])
    for name in sorted(by_method, key=lambda n: _method_sort_key((n, 0))):
        points = sorted(by_method[name], key=lambda p: -1 if p[0] is None else p[0])
        swept = [(b, v) for b, v in points if b]
        if _base_name(name) in ("dense", "streaming") or not swept:
            for b, v in points:
                ax.axhline(v, linestyle=next(styles, "--"), color="gray" if _base_name(name) == "dense" else "black",
                           label=_label(name, b), linewidth=1)
            continue
        ax.plot([b for b, _ in swept], [v for _, v in swept], marker=next(markers, "o"), label=name,
                markersize=7 if len(swept) == 1 else 5, linestyle="-" if len(swept) > 1 else "none")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("budget (tokens per KV head)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)


def _save(fig, path: str) -> str:
    """Lay out, write `fig` as a PNG to `path`, close it; returns `path`."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(rows: list[dict], out_dir: str) -> list[str]:
    """`score_vs_budget.png` and `fidelity_vs_budget.png` in `out_dir` (each only when it has data)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    gen = [r for r in rows if r["dataset"] != "fidelity"]
    if gen:
        columns = sorted({(r["dataset"], r["task"], r["length"]) for r in gen})
        wide = min(len(columns), 6)  # panels per line
        high = -(-len(columns) // wide)
        fig, axes = plt.subplots(high, wide, figsize=(4.5 * wide, 3.6 * high), squeeze=False)
        for ax, (d, t, n) in zip(axes.flat, columns):
            subset = [r for r in gen if (r["dataset"], r["task"], r["length"]) == (d, t, n)]
            _draw(ax, _series(subset, lambda r: r["score"]), "score (0–100)", f"{d} {t} {_length_label(n)}")
            ax.set_ylim(-5, 105)
        for ax in list(axes.flat)[len(columns):]:
            ax.set_visible(False)
        list(axes.flat)[len(columns) - 1].legend(fontsize=7, loc="best")
        written.append(_save(fig, os.path.join(out_dir, "score_vs_budget.png")))
    fid = [r for r in rows if r["dataset"] == "fidelity" and r["task"] == "teacher_forced_top1"]
    if fid:
        lengths = sorted({r["length"] for r in fid})
        fig, axes = plt.subplots(len(lengths), 3, figsize=(13, 3.6 * len(lengths)), squeeze=False)
        for row_axes, n in zip(axes, lengths):
            subset = [r for r in fid if r["length"] == n]
            _draw(row_axes[0], _series(subset, lambda r: r["kl"]), "KL(dense ‖ method), nats", f"KL {_length_label(n)}")
            row_axes[0].set_yscale("symlog", linthresh=1e-3)
            row_axes[0].set_ylim(bottom=0)
            _draw(row_axes[1], _series(subset, lambda r: 100 * r["top1"]), "top-1 agreement %", f"top-1 {_length_label(n)}")
            _draw(row_axes[2], _series(subset, lambda r: r["identical_tokens"]), "identical greedy tokens",
                  f"identical greedy continuation {_length_label(n)}")
        axes[0][-1].legend(fontsize=7, loc="best")
        written.append(_save(fig, os.path.join(out_dir, "fidelity_vs_budget.png")))
    return written


def write_report(rows: list[dict], out_dir: str) -> list[str]:
    """Write `summary.md` and the plots into `out_dir`, and with RULER rows the RULER table (`ruler_table.md`,
    `ruler_table.png`: `ruler_table.py`); returns the paths written.

    Raises:
        ValueError: when `rows` is empty.
    """
    from .harness import dedupe_rows

    if not rows:
        raise ValueError("no result rows to report.")
    rows = dedupe_rows(rows)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "summary.md")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(summary_markdown(rows))
    written = [path] + write_plots(rows, out_dir)
    from . import ruler_table

    if ruler_table.build_tables(rows):
        table_path = os.path.join(out_dir, "ruler_table.md")
        with open(table_path, "w", encoding="utf-8") as handle:
            handle.write(ruler_table.markdown(rows, level=1))
        written += [table_path, ruler_table.plot(rows, os.path.join(out_dir, "ruler_table.png"))]
    return written
