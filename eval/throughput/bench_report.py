"""Tables and plots of a benchmark run (`bench_result.BenchResult`): markdown with ratios measured in the same run, and
matplotlib figures (Agg backend, PNG): throughput vs batch per method, device bytes per request vs context."""

from __future__ import annotations

import math
import os
from typing import Callable

from ...runtime.extras import require
from ..outputs import mib
from ..spread import load_warning, with_range
from .bench_grid import RATIO_BASELINES, decoding_text, method_label

MIB = 1024 ** 2
GIB = 1024 ** 3


def _num(value, fmt: str = "{:.2f}") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    return fmt.format(value)


def _idle(row: dict) -> str:
    """` (copy / host)`: the device's idle shares of its step time, where a device clock measured them."""
    copy, host = row.get("idle_copy_fraction"), row.get("idle_host_fraction")
    if copy is None or not math.isfinite(copy):
        return ""
    return f" ({_num(copy)} / {_num(host)})"


def _ratio(a, b) -> float:
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)) or b == 0:
        return float("nan")
    return a / b


def _baseline(cells: list[dict], method: str, context: int, batch: int) -> dict | None:
    for row in cells:
        if (row["method"], row["context"], row["batch"]) == (method, context, batch) and row["error"] is None:
            return row
    return None


def label(row: dict) -> str:
    """`method` for baselines, `method k=budget` for budgeted methods (with the forced miss rate where set)."""
    return method_label(row["method"], row.get("budget"), row.get("forced_miss_rate"))


def _worst(row: dict) -> str:
    """` (w%)`: the worst sequence's own speculation hit rate, where the cell has one."""
    worst = row.get("spec_row_hit_rate_min", math.nan)
    return "" if worst is None or math.isnan(worst) else f" ({worst:.0%})"


def cell_table(cells: list[dict]) -> str:
    """Markdown table, one line per cell; timings are the median of the cell's runs with their min–max in
    parentheses; `×dense` / `×offl` are this row's median decode tokens/s over the dense / offloaded row's at the
    same context and batch, `dev/dense` its device bytes per request over dense's; `sync/step` and `blocked ms/step`
    the launch thread's synchronization points and blocked milliseconds per decode step (`launch_thread.py`)."""
    head = ("| method | context | batch | TTFT s | decode tok/s | ms/step | device MiB/req | CUDA peak MiB/req all / decode | "
            "host MiB/req | copied MiB/step | copied MB/seq-step | host core-ms/seq-step | resident share | "
            "overlap (GPU idle: copy / host) | wait s | sync/step | blocked ms/step | "
            "hit rate (worst row) | repaired | ×dense tok/s | ×offl tok/s | dev/dense bytes |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in cells:
        if row["error"] is not None:
            lines.append(f"| {label(row)} | {row['context']} | {row['batch']} | error: {row['error']} |" + " |" * 18)
            continue
        dense = _baseline(cells, "dense", row["context"], row["batch"])
        offl = _baseline(cells, "offloaded", row["context"], row["batch"])
        is_base = row["method"] in ("dense", "offloaded")
        dense_bytes = dense["device_bytes_per_request"] if dense else row["dense_equivalent_bytes_per_request"]
        lines.append(
            f"| {label(row)} | {row['context']} | {row['batch']} | {with_range(row, 'prefill_s')} | "
            f"{with_range(row, 'decode_tokens_per_s')} | {with_range(row, 'ms_per_step', '{:.1f}')} | "
            f"{mib(row['device_bytes_per_request'])} | {mib(row['cuda_peak_bytes_per_request'])} / "
            f"{mib(row['cuda_decode_peak_bytes_per_request'])} | "
            f"{mib(row['host_bytes_per_request'])} | {mib(row['bytes_copied_per_step'])} | "
            f"{_num(row.get('bytes_copied_per_sequence_step', math.nan) / 1e6, '{:.2f}')} | "
            f"{_num(row.get('host_core_ms_per_sequence_step', math.nan), '{:.2f}')} | "
            f"{_num(row.get('resident_share', math.nan), '{:.0%}')} | "
            f"{_num(row['overlap_ratio'])}{_idle(row)} | {_num(row['wait_seconds'])} | "
            f"{with_range(row, 'sync_points_per_step', '{:.1f}')} | {with_range(row, 'blocked_ms_per_step', '{:.1f}')} | "
            f"{_num(row['spec_hit_rate'], '{:.0%}')}{_worst(row)} | "
            f"{_num(row.get('repaired_fraction', math.nan), '{:.0%}')} | "
            f"{'—' if is_base or not dense else _num(_ratio(row['decode_tokens_per_s'], dense['decode_tokens_per_s']))} | "
            f"{'—' if is_base or not offl else _num(_ratio(row['decode_tokens_per_s'], offl['decode_tokens_per_s']))} | "
            f"{_num(_ratio(row['device_bytes_per_request'], dense_bytes), '{:.2%}')} |"
        )
    return "\n".join(lines)


def max_batch_table(rows: list[dict]) -> str:
    """Markdown table of each method's max batch and its throughput there; `×best baseline` is its decode tokens/s
    over the best of dense, offloaded and Quest at theirs (same context), each at its own max batch."""
    if not rows:
        return ""
    head = ("| method | context | max batch | limited by | device / host limit (fit) | decode-only device limit | "
            "decode tok/s at max batch | how | ms/step | TTFT s | device MiB/req | host MiB/req | ×best baseline |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def bound(value) -> str:
        if value is None:
            return "—"
        return "none" if isinstance(value, float) and math.isinf(value) else str(int(value))

    for row in rows:
        bases = [r["decode_tokens_per_s"] for r in rows if r["context"] == row["context"]
                 and r["method"] in RATIO_BASELINES and r["decode_tokens_per_s"] is not None
                 and math.isfinite(r["decode_tokens_per_s"])]
        best = max(bases) if bases else float("nan")
        predicted = row.get("predicted") or {}
        lines.append(
            f"| {label(row)} | {row['context']} | {row['max_batch']} | {row['limited_by']} | "
            f"{bound(predicted.get('device'))} / {bound(predicted.get('host'))} | "
            f"{bound(predicted.get('device_decode'))} | {_num(row['decode_tokens_per_s'])} | {row['how']} | "
            f"{_num(row['ms_per_step'], '{:.1f}')} | {_num(row['prefill_s'])} | "
            f"{mib(row['device_bytes_per_request'])} | {mib(row['host_bytes_per_request'])} | "
            f"{_num(_ratio(row['decode_tokens_per_s'], best))} |"
        )
    return "\n".join(lines)


def limits_line(meta: dict) -> str:
    """One sentence on the max-batch search's limits."""
    limits = meta.get("limits") or {}
    device = limits.get("device_bytes")
    parts = [f"device cap {device / GIB:.1f} GiB" if device is not None else "no device cap",
             f"host memory {limits.get('host_bytes', 0) / GIB:.1f} GiB"
             + (" shared by weights, device tiers and host stores (the device is the host)" if limits.get("shared")
                else " for the KV's host copies")]
    seconds = meta.get("max_cell_seconds")
    if seconds:
        parts.append(f"runs predicted past {seconds:.0f} s extrapolated")
    return "Max batch within " + ", ".join(parts) + ":"


def render_markdown(result) -> str:
    """The run's markdown report: a header line, the per-cell table and (when measured) the concurrency table."""
    meta = result.meta
    parts = [
        f"Model {meta.get('model')} on {meta.get('cuda_device', meta.get('device'))} ({meta.get('dtype')}, "
        f"{meta.get('threads')} threads), {meta.get('grid', {}).get('new_tokens')} new tokens, "
        f"{meta.get('grid', {}).get('warmup_steps')} warm-up steps"
        + f"; {meta.get('grid', {}).get('prompts', 'needle')} prompts; {decoding_text(meta.get('grid', {}))}"
        + ("; every method's few-row linears as W·xᵀ (`--cpu-linear gemm`, eval/throughput/cpu_linear.py)"
           if meta.get("grid", {}).get("cpu_linear") == "gemm" else "")
        + (f"; dual options {meta['grid']['dual_options']}" if meta.get("grid", {}).get("dual_options") else "")
        + f"; timings: median (min–max) of {meta.get('repeats', 1)} interleaved run(s) per cell.",
        "",
        cell_table(result.cells),
    ]
    warning = load_warning(meta.get("load_average_max", math.nan), meta.get("cores"))
    if warning:
        parts[1:1] = ["", warning]
    for method, reason in (meta.get("skipped") or {}).items():
        parts.append(f"\nSkipped {method}: {reason}.")
    if result.max_batch:
        parts += ["", limits_line(meta), "", max_batch_table(result.max_batch)]
    return "\n".join(parts) + "\n"


def plot_all(result, out_dir: str, log: Callable[[str], None] = print) -> dict[str, str]:
    """Write `throughput_vs_batch.png` and `device_bytes_vs_context.png`; `{name: path}` (empty without matplotlib)."""
    try:
        require("eval", "the plots")
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:  # MissingExtraError names the extra
        log(f"plots skipped: {error}")
        return {}
    cells = [r for r in result.cells if r["error"] is None]
    paths = {}
    contexts = sorted({r["context"] for r in cells})
    series = sorted({label(r) for r in cells})
    if contexts:
        fig, axes = plt.subplots(1, len(contexts), figsize=(5 * len(contexts), 4), squeeze=False)
        for ax, context in zip(axes[0], contexts):
            for name in series:
                rows = sorted((r for r in cells if r["context"] == context and label(r) == name), key=lambda r: r["batch"])
                if rows:
                    ax.plot([r["batch"] for r in rows], [r["decode_tokens_per_s"] for r in rows], marker="o", label=name)
            batches = sorted({r["batch"] for r in cells})
            if len(batches) > 1:
                ax.set_xscale("log", base=2)
                ax.set_xticks(batches, [str(b) for b in batches])
            ax.set_title(f"context {context}")
            ax.set_xlabel("batch (sequences)")
            ax.set_ylabel("decode tokens/s (summed over batch)")
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize="small")
        fig.tight_layout()
        paths["throughput_plot"] = os.path.join(out_dir, "throughput_vs_batch.png")
        fig.savefig(paths["throughput_plot"], dpi=120)
        plt.close(fig)

        fig, ax = plt.subplots(figsize=(6, 4))
        smallest = min(r["batch"] for r in cells)
        for name in series:
            rows = sorted((r for r in cells if r["batch"] == smallest and label(r) == name), key=lambda r: r["context"])
            if rows:
                ax.plot([r["context"] for r in rows], [r["device_bytes_per_request"] / MIB for r in rows], marker="o",
                        label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [str(c) for c in contexts])
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("device KV MiB per request")
        ax.set_title(f"device bytes per request (batch {smallest})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        paths["memory_plot"] = os.path.join(out_dir, "device_bytes_vs_context.png")
        fig.savefig(paths["memory_plot"], dpi=120)
        plt.close(fig)
    return paths


def main(argv: list[str] | None = None) -> int:
    """`python -m dual_cache.eval.throughput.bench_report SUMMARY.json ...`: print the markdown report of each
    `summary.json` a benchmark wrote (e.g. of a run cut short, which printed no table)."""
    import argparse
    import json

    from .bench_result import BenchResult

    parser = argparse.ArgumentParser(prog="python -m dual_cache.eval.throughput.bench_report",
                                     description=main.__doc__.split(": ", 1)[1])
    parser.add_argument("summaries", nargs="+", help="summary.json files written by the benchmark")
    for path in parser.parse_args(argv).summaries:
        with open(path, encoding="utf-8") as handle:
            print(f"{path}:\n\n{render_markdown(BenchResult(**json.load(handle)))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
