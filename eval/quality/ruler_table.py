"""The RULER table: every method's score per task and on average, its difference from dense, with n and 95% intervals.

Input: the harness's per-sample rows (`harness.py` documents the schema), kvpress rows merged among them. One table
per (model, length, decoding): greedy rows, and sampled rows of each setting (`sampling` field) apart. Per task and
method: the mean score over the samples, and the mean of the per-sample differences from dense on the same prompts
(paired by `sample`; sampled rows by (`sample`, `sample_seed`): the same prompt decoded from the same seed). The
average row is the mean over the tasks where dense scores at least `MIN_DENSE` (the model can do the task); tasks
below it are shown, marked, and left out of the average.

Intervals are 95% percentile bootstrap intervals (`INTERVAL_RESAMPLES` resamples, a fixed seed, so the table is
reproducible): a task's samples are resampled with replacement; the average resamples each task's samples
independently (a stratified bootstrap) and takes the mean of the task means. Sampled rows are resampled by prompt,
each prompt with all its seeds (its scores, and its paired differences, averaged over its seeds first): the seeds of
one prompt are not independent of each other. A cell whose samples all scored the same has an interval of zero
width: read n beside it (20 of 20 correct still allows a true rate near 84%).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from .sampling import settings_text

MIN_DENSE = 20.0  # tasks where dense scores below this are reported but left out of the averages
INTERVAL_RESAMPLES = 10_000
SEED = 0
TASK_ORDER = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
              "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2")
METHOD_ORDER = ("dense", "dual", "dual-sync-repair", "oracle", "quest", "streaming", "kvpress-snapkv",
                "kvpress-expected_attention", "kvpress-streaming")


@dataclass(frozen=True)
class Cell:
    """One method on one task (or the average): mean score, its interval, the mean paired difference from dense
    and its interval (None for dense itself or without dense rows), and n (samples, or for sampled rows (sample,
    sample seed) pairs; on the average row, summed over the averaged tasks)."""

    score: float
    low: float
    high: float
    n: int
    diff: float | None = None
    diff_low: float | None = None
    diff_high: float | None = None


def method_label(method: str, budget) -> str:
    """`dense`, `dual@256`, `streaming@256` (plain `streaming` at budget 0), `kvpress-snapkv@256`."""
    return method if budget is None or (method == "streaming" and not budget) else f"{method}@{budget}"


def _method_key(label: str) -> tuple:
    name, _, budget = label.partition("@")
    rank = METHOD_ORDER.index(name) if name in METHOD_ORDER else len(METHOD_ORDER)
    return rank, name, int(budget) if budget else -1


def _task_key(task: str) -> tuple:
    return (TASK_ORDER.index(task) if task in TASK_ORDER else len(TASK_ORDER), task)


def _bootstrap(groups: list[np.ndarray], rng: np.random.Generator) -> tuple[float, float]:
    """95% percentile interval of the mean of the groups' means, each group resampled independently."""
    means = np.zeros(INTERVAL_RESAMPLES)
    for values in groups:
        picks = rng.integers(0, len(values), size=(INTERVAL_RESAMPLES, len(values)))
        means += values[picks].mean(axis=1)
    means /= len(groups)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(low), float(high)


def _cell(scores: list[np.ndarray], diffs: list[np.ndarray] | None, rng: np.random.Generator, n: int) -> Cell:
    """A cell over one or several tasks' per-sample scores (and paired differences from dense), each sample's value
    the mean over its sample seeds; `n` is the cell's (sample, sample seed) count."""
    score = float(np.mean([s.mean() for s in scores]))
    low, high = _bootstrap(scores, rng)
    if diffs is None:
        return Cell(score, low, high, n)
    diff = float(np.mean([d.mean() for d in diffs]))
    diff_low, diff_high = _bootstrap(diffs, rng)
    return Cell(score, low, high, n, diff, diff_low, diff_high)


def _per_sample(units: dict[tuple, float]) -> np.ndarray:
    """`{(sample, sample seed): value}` → each sample's mean over its seeds, samples in the order they first appear
    (greedy: one unit per sample, the values themselves)."""
    grouped: dict = {}
    for (sample, _), value in units.items():
        grouped.setdefault(sample, []).append(value)
    return np.array([float(np.mean(v)) if len(v) > 1 else v[0] for v in grouped.values()])


def _paired(got: dict[tuple, float], dense: dict[tuple, float]) -> tuple[np.ndarray, int]:
    """Per-sample mean differences from dense over the (sample, sample seed) units both ran, in sample order, and
    the number of those units."""
    common = sorted(set(got) & set(dense))
    return _per_sample({u: got[u] - dense[u] for u in common}), len(common)


@dataclass
class Table:
    """The RULER table of one (model, length, decoding): `cells[task][method label]`, `average[method label]` over
    `averaged` (the tasks where dense scores at least `MIN_DENSE`; every task when no dense rows exist),
    `excluded` (the others); `speculation[task][method label]`: the dual rows' summed `(spec_hits, spec_steps,
    repairs, rows)` (rows whose `speculation` field is set; older rows lack it); `sampling`: the rows' sampling
    settings (None: greedy) and `seeds` their sample seeds ([] for greedy)."""

    model: str
    length: int
    tasks: list[str]
    methods: list[str]
    cells: dict[str, dict[str, Cell]]
    average: dict[str, Cell]
    averaged: list[str]
    excluded: list[str]
    speculation: dict[str, dict[str, tuple[int, int, int, int]]]
    sampling: dict | None = None
    seeds: list[int] = field(default_factory=list)


def build_tables(rows: list[dict]) -> list[Table]:
    """One `Table` per (model, length, decoding) of the RULER rows (other datasets are ignored), sorted by model,
    length, then greedy before each sampled setting.

    A method's difference from dense uses the samples (sampled: the (sample, sample seed) pairs) both ran; the
    average row holds a method only when it has rows on every averaged task.
    """
    from .harness import dedupe_rows

    rows = dedupe_rows([r for r in rows if r.get("dataset") == "ruler"])
    groups: dict = defaultdict(list)
    for r in rows:
        sampling = r.get("sampling")
        decoding = (sampling is not None, json.dumps(sampling, sort_keys=True))
        groups[(str(r.get("model")), r["length"], decoding)].append(r)
    tables = []
    for (model, length, (_, sampling)), group in sorted(groups.items()):
        scores: dict = defaultdict(dict)  # task -> label -> {(sample, sample seed): score}
        speculation: dict = defaultdict(dict)  # task -> label -> (hits, steps, repairs, rows)
        for r in group:
            label = method_label(r["method"], r.get("budget"))
            unit = (r["sample"], r.get("sample_seed") or 0)
            scores[r["task"]].setdefault(label, {})[unit] = float(r["score"])
            spec = r.get("speculation")
            if spec:
                old = speculation[r["task"]].get(label, (0, 0, 0, 0))
                speculation[r["task"]][label] = (old[0] + spec["spec_hits"], old[1] + spec["spec_steps"],
                                                 old[2] + spec["repairs"], old[3] + 1)
        tasks = sorted(scores, key=_task_key)
        methods = sorted({m for t in tasks for m in scores[t]}, key=_method_key)
        rng = np.random.default_rng(SEED)
        cells: dict = {}
        for task in tasks:
            dense = scores[task].get("dense")
            cells[task] = {}
            for label in methods:
                got = scores[task].get(label)
                if not got:
                    continue
                paired = None
                if dense is not None and label != "dense":
                    diffs, common = _paired(got, dense)
                    paired = [diffs] if common else None
                cells[task][label] = _cell([_per_sample(got)], paired, rng, len(got))
        has_dense = all("dense" in cells[t] for t in tasks)
        averaged = [t for t in tasks if not has_dense or cells[t]["dense"].score >= MIN_DENSE]
        average = {}
        for label in methods:
            if not averaged or any(label not in scores[t] for t in averaged):
                continue
            values = [_per_sample(scores[t][label]) for t in averaged]
            diffs = None
            if has_dense and label != "dense":
                diffs = [_paired(scores[t][label], scores[t]["dense"])[0] for t in averaged]
                diffs = None if any(len(d) == 0 for d in diffs) else diffs
            average[label] = _cell(values, diffs, rng, sum(len(scores[t][label]) for t in averaged))
        seeds = sorted({r.get("sample_seed") for r in group} - {None})
        tables.append(Table(model, length, tasks, methods, cells, average, averaged,
                            [t for t in tasks if t not in averaged], dict(speculation), json.loads(sampling), seeds))
    return tables


def _length_label(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens >= 1024 and tokens % 1024 == 0 else str(tokens)


def _format(cell: Cell | None, is_dense: bool) -> str:
    if cell is None:
        return "–"
    text = f"{cell.score:.1f} [{cell.low:.0f}, {cell.high:.0f}]"
    if not is_dense and cell.diff is not None:
        text += f"<br>{cell.diff:+.1f} [{cell.diff_low:+.0f}, {cell.diff_high:+.0f}]"
    return text


def _n(cells: dict[str, Cell]) -> str:
    counts = sorted({c.n for c in cells.values()})
    return str(counts[0]) if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"


def _seeds_text(seeds: list[int]) -> str:
    if len(seeds) == 1:
        return f"sample seed {seeds[0]}"
    if seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"sample seeds {seeds[0]}–{seeds[-1]}"
    return "sample seeds " + ", ".join(map(str, seeds))


def decoding_text(table: Table) -> str:
    """`""` for a greedy table; `", sampled (temperature 0.7, top-p 0.9, top-k off; sample seed 0)"` otherwise."""
    if table.sampling is None:
        return ""
    return f", sampled ({settings_text(table.sampling)}; {_seeds_text(table.seeds)})"


def table_markdown(table: Table, level: int = 3) -> str:
    """The markdown of one table under a heading of `level` (saying whether its rows were sampled, and how): a row
    per task and the average row, a column per method."""
    lines = [f"{'#' * level} {table.model}, RULER {_length_label(table.length)}{decoding_text(table)}", ""]
    if table.sampling is None:
        lines.append(f"Each cell: mean score [95% interval]; under it the mean difference from dense on the same "
                     "prompts [95% interval].")
    else:
        lines.append("Sampled: every method decoded each prompt once per sample seed, seeded from (prompt, seed), "
                     "so dense and each method drew from the same seed. Each cell: mean score over the (prompt, "
                     "seed) pairs [95% interval]; under it the mean difference from dense on the same prompt and "
                     "seed [95% interval, prompts resampled with all their seeds]; n: (prompt, seed) pairs.")
    lines[-1] += (f" Average: the mean over the {len(table.averaged)} tasks where dense scores at least "
                  f"{MIN_DENSE:.0f}" + (f" (left out: {', '.join(table.excluded)})." if table.excluded else "."))
    lines.append("")
    header = ["task", "n"] + table.methods
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for task in table.tasks:
        mark = " (dense < 20: not averaged)" if task in table.excluded else ""
        row = [f"{task}{mark}", _n(table.cells[task])]
        row += [_format(table.cells[task].get(m), m == "dense") for m in table.methods]
        lines.append("| " + " | ".join(row) + " |")
    if table.average:
        row = [f"**average** ({len(table.averaged)} tasks)", _n(table.average)]
        row += [_format(table.average.get(m), m == "dense") for m in table.methods]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    lines += _speculation_markdown(table)
    return "\n".join(lines)


def _speculation_markdown(table: Table) -> list[str]:
    """The dual columns' speculation per task: the share of speculated tokens equal to the real one (a miss means
    the step's selection came from the wrong query, then miss repair re-selects), and repaired (step, layer)
    selections per speculated step. Empty without rows that carry `speculation`."""
    labels = sorted({m for t in table.tasks for m, v in table.speculation.get(t, {}).items() if v[1]},
                    key=_method_key)  # methods that speculated (quest and streaming rows record zero steps)
    if not labels:
        return []
    lines = ["Speculation, per task: speculated tokens equal to the real one (%) · repaired (step, layer) selections "
             "per speculated step · rows that recorded it (an oracle selects with the real token's query, so its "
             "misses cost nothing; its hit rate is the same decoder's).", "",
             "| task | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for task in table.tasks:
        cells = []
        for label in labels:
            hits, steps, repairs, count = table.speculation.get(task, {}).get(label, (0, 0, 0, 0))
            cells.append(f"{100 * hits / steps:.0f}% · {repairs / steps:.2f} · {count}" if steps else "–")
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def markdown(rows: list[dict], level: int = 2) -> str:
    """Every table of the rows under a heading of `level`, one sub-section each (empty string without RULER rows)."""
    tables = build_tables(rows)
    if not tables:
        return ""
    intro = (f"{'#' * level} RULER, method by method\n\nScores 0–100 (RULER's string match). Intervals: 95% "
             f"percentile bootstrap over the samples ({INTERVAL_RESAMPLES} resamples; the average resamples each task "
             "on its own). Budgets are tokens per KV head; `streaming@b` keeps sink + a window as large as dual's "
             "resident entries at budget b; kvpress presses keep sink + window + b entries per KV head of the "
             "prompt.\n")
    return "\n".join([intro] + [table_markdown(t, level + 1) for t in tables])


def plot(rows: list[dict], path: str) -> str | None:
    """A bar chart per (model, length): each task's score per method and the average with its 95% interval.
    Returns `path`, or None without RULER rows."""
    tables = build_tables(rows)
    if not tables:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(tables), 1, figsize=(14, 3.8 * len(tables)), squeeze=False)
    for ax, table in zip(axes[:, 0], tables):
        columns = table.tasks + (["average"] if table.average else [])
        width = 0.8 / len(table.methods)
        colors = plt.get_cmap("tab10")
        for i, label in enumerate(table.methods):
            cells = [table.cells[t].get(label) for t in table.tasks]
            cells += [table.average.get(label)] if table.average else []
            xs = [j + (i - (len(table.methods) - 1) / 2) * width for j, c in enumerate(cells) if c is not None]
            got = [c for c in cells if c is not None]
            errors = np.array([[c.score - c.low for c in got], [c.high - c.score for c in got]])
            ax.bar(xs, [c.score for c in got], width, yerr=errors, capsize=1.5, label=label, color=colors(i % 10),
                   error_kw={"linewidth": 0.6})
        ax.set_xticks(range(len(columns)))
        ax.set_xticklabels([c + ("*" if c in table.excluded else "") for c in columns], rotation=20, fontsize=8)
        ax.set_ylim(0, 105)
        ax.set_ylabel("score (0–100)")
        ax.set_title(f"{table.model}, RULER {_length_label(table.length)}{decoding_text(table)} (* dense < "
                     f"{MIN_DENSE:.0f}: not averaged; bars: 95% intervals)", fontsize=9)
        ax.legend(fontsize=7, ncol=len(table.methods), loc="upper right")
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
