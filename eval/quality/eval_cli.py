"""`dual-decoder eval ...`: run the quality evaluation, render its report, export prompts for / merge kvpress rows.

    dual-decoder eval run --suites ruler fidelity --ruler-tasks niah_single_2 --lengths 4096 8192 \\
        --fidelity-lengths 8192 --samples 4 --budgets 64 128 256 512 --out results/eval/results.jsonl
    dual-decoder eval run --suites ruler --ruler-tasks niah_single_1 --methods dense dual@256 \
        --temperature 0.7 --top-p 0.9 --sampling-seeds 2 --out results/eval/sampled.jsonl   (sampled, paired seeds)
    dual-decoder eval report --results results/eval/results.jsonl --out-dir results/eval
    dual-decoder eval export-prompts ... --prompts-out prompts.jsonl   (then eval/card/kvpress_runner.py in its venv)
    dual-decoder eval merge-kvpress --prompts prompts.jsonl --kvpress kvpress.jsonl --out results/eval/results.jsonl
"""

from __future__ import annotations

import os
import sys
import time

from ...cli.help_format import DefaultsHelpFormatter
from ...config import DualDecoderConfig

SUITES = ("ruler", "longbench", "fidelity")


def add_parser(subparsers) -> None:
    """Add the `eval` command (with `run`, `report`, `export-prompts`, `merge-kvpress`) to `dual-decoder`."""
    from .methods import METHOD_NAMES

    ev = subparsers.add_parser("eval", help="quality evaluation: RULER, LongBench, fidelity to dense",
                               description="Quality evaluation (docs/benchmarks.md): `run` evaluates methods on "
                                           "RULER, LongBench and fidelity to dense, `report` renders its rows, "
                                           "`export-prompts` / `merge-kvpress` hand prompts to kvpress presses and "
                                           "score what they return.")
    formatter = DefaultsHelpFormatter
    sub = ev.add_subparsers(dest="eval_command", required=True, metavar="{run,report,export-prompts,merge-kvpress}")

    def suite_options(p):
        p.add_argument("--model", default=None, help="named model (gemma3-270m, smollm2-135m), Hub id, folder or .gguf "
                       "(default: the embedded SmolLM2-135M)")
        p.add_argument("--model-name", default=None, help="name written in the rows (default: derived from --model)")
        p.add_argument("--device", default="cpu", help="where the model runs (cuda for a GPU)")
        p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                       help="model parameter dtype (bfloat16 for an 8B model on a GPU)")
        p.add_argument("--suites", nargs="+", default=["ruler"], choices=SUITES, help="what to evaluate")
        p.add_argument("--ruler-tasks", nargs="+", default=["niah_single_2"], help="RULER task names (synthetic.yaml)")
        p.add_argument("--lengths", type=int, nargs="+", default=[4096], help="RULER target lengths (tokens)")
        p.add_argument("--ruler-template", default="ruler", choices=["ruler", "simple"],
                       help="NIAH wording: RULER's, or 'simple' (dual_cache/model/needle_prompt.py's, not RULER's; the 135M model answers it)")
        p.add_argument("--ruler-qa-dir", default=None,
                       help="folder with squad.json (SQuAD v2.0 dev) / hotpotqa.json (HotpotQA dev distractor) for qa_1 / qa_2")
        p.add_argument("--chat-template", default="auto", choices=["auto", "none"],
                       help="auto: one user turn of the tokenizer's chat template when it has one; none: plain text "
                       "(RULER's 'base'; LongBench for models outside build_chat)")
        p.add_argument("--system-prompt", default=None,
                       help="system turn text; 'template-default' keeps the template's own default (default: no "
                       "system turn, as RULER's and LongBench's wrappers)")
        p.add_argument("--samples", type=int, default=4, help="samples per task and length (RULER, fidelity)")
        p.add_argument("--longbench-tasks", nargs="+", default=["hotpotqa"], help="LongBench task names")
        p.add_argument("--data-dir", default=None, help="folder of LongBench's official <task>.jsonl (else the Hub)")
        p.add_argument("--max-length", type=int, default=None,
                       help="LongBench model window in tokens (default: the model's max_position_embeddings); prompts "
                       "are truncated to LongBench's maximum length for it (3500 for 4K, 7500 for 8K, 31500 for 32K)")
        p.add_argument("--fidelity-lengths", type=int, nargs="+", default=[8192],
                       help="fidelity: document lengths (tokens)")
        p.add_argument("--forced-tokens", type=int, default=64, help="fidelity: teacher-forced document tokens")
        p.add_argument("--greedy-tokens", type=int, default=32, help="fidelity: greedy steps compared with dense")
        p.add_argument("--limit", type=int, default=None, help="at most this many samples per task and length")
        p.add_argument("--max-new-tokens", type=int, default=None, help="cap the tasks' answer lengths (tokens)")
        p.add_argument("--seed", type=int, default=0, help="picks the generated prompts (RULER, fidelity)")

    run = sub.add_parser("run", help="evaluate every method on the same prompts; appends rows to --out (resumable)",
                         description="Evaluate every method on the same prompts, back to back per prompt; one JSONL "
                                     "row per (method, sample) appended to --out as it is produced, so a stopped run "
                                     "resumes where it was (row schema: eval/quality/harness.py).",
                         formatter_class=formatter)
    suite_options(run)
    run.add_argument("--methods", nargs="+", default=["standard"],
                     help=f"'standard' (all), or specs such as dense dual@128 oracle; names: {list(METHOD_NAMES)}")
    run.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256, 512, 1024], help="dual budgets (standard)")
    run.add_argument("--reference-budget", type=int, default=DualDecoderConfig.budget,
                     help="budget of dual-none / oracle / quest")
    run.add_argument("--out", default="eval-results/results.jsonl",
                     help="JSONL the rows are appended to (eval-results/ is git-ignored; the project's own record is "
                          "results/eval/, written with an explicit --out)")
    run.add_argument("--no-resume", action="store_true", help="start the output file afresh")
    run.add_argument("--report-dir", default=None, help="also write summary.md and plots here at the end")
    run.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    run.add_argument("--no-shared-prefill", action="store_true",
                     help="prefill each prompt once per method (default: once per prompt, every method continuing "
                          "its own copy; the same tokens)")
    sampled = run.add_argument_group(
        "sampled decoding", "Greedy unless --temperature is given. Sampled: every prompt is decoded once per sample "
        "seed s = 0 .. N-1 by every method, torch.manual_seed set before each generate() from (prompt, s), so "
        "dense and dual rows pair by (prompt, sample seed); rows record the settings and s (eval/quality/sampling.py)")
    sampled.add_argument("--temperature", type=float, default=None, help="sample at this temperature (> 0)")
    sampled.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (default 1: off)")
    sampled.add_argument("--top-k", type=int, default=None,
                         help="top-k sampling (default 0: off, not transformers' 50)")
    sampled.add_argument("--sampling-seeds", type=int, default=None,
                         help="N: sample seeds 0 .. N-1 per prompt (default 1)")
    run.set_defaults(func=cmd_run)

    report = sub.add_parser("report", help="summary.md and plots from a results JSONL", formatter_class=formatter,
                            description="Write summary.md (scores per method, task and length, device bytes) and "
                                        "matplotlib plots from the rows `eval run` wrote; with RULER rows also "
                                        "ruler_table.md / .png (every method per task and on average, its "
                                        "difference from dense, n and 95% intervals).")
    report.add_argument("--results", nargs="+", default=["eval-results/results.jsonl"],
                        help="rows written by `eval run` (several files: one report over all their rows)")
    report.add_argument("--out-dir", default="eval-results", help="where summary.md and the plots go")
    report.set_defaults(func=cmd_report)

    export = sub.add_parser("export-prompts", help="write the suites' prompts for eval/card/kvpress_runner.py",
                            description="Write the prompts `eval run` would use (same suites and options) to a "
                                        "JSONL that eval/card/kvpress_runner.py runs kvpress presses on, in its own "
                                        "virtual environment.", formatter_class=formatter)
    suite_options(export)
    export.add_argument("--prompts-out", required=True, help="JSONL file the prompts are written to")
    export.set_defaults(func=cmd_export)

    merge = sub.add_parser("merge-kvpress", help="score kvpress_runner.py predictions and append them to --out",
                           description="Score the predictions eval/card/kvpress_runner.py wrote for an "
                                       "export-prompts file with the harness's metrics, and append them to --out as "
                                       "`kvpress-<press>` rows beside the other methods.", formatter_class=formatter)
    merge.add_argument("--prompts", required=True, help="the export-prompts file given to the runner")
    merge.add_argument("--kvpress", required=True, help="the runner's predictions JSONL")
    merge.add_argument("--out", default="eval-results/results.jsonl", help="JSONL the scored rows are appended to")
    merge.set_defaults(func=cmd_merge)


def _check_args(args) -> None:
    """Validate numbers and names before any model is loaded (raises ValueError)."""
    from . import ruler
    from .metrics.longbench_score import base_task

    for name in ("samples", "forced_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1.")
    if args.greedy_tokens < 0:
        raise ValueError("--greedy-tokens must be >= 0.")
    for name in ("limit", "max_new_tokens", "max_length"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1.")
    if "ruler" in args.suites:
        for task in args.ruler_tasks:
            if ruler.task_family(task) == "qa" and args.ruler_qa_dir is None:
                raise ValueError(f"{task} needs --ruler-qa-dir: a folder with {ruler.QA_FILES[task]} "
                                 f"({ruler.QA_SOURCES[task]}).")
        if args.ruler_qa_dir is not None and not os.path.isdir(args.ruler_qa_dir):
            raise ValueError(f"--ruler-qa-dir {args.ruler_qa_dir} is not a folder.")
        for length in args.lengths:
            if length < 256:
                raise ValueError(f"RULER length {length} is too short (>= 256 tokens).")
    if "longbench" in args.suites:
        for task in args.longbench_tasks:
            base_task(task)
        if args.data_dir is not None and not os.path.isdir(args.data_dir):
            raise ValueError(f"--data-dir {args.data_dir} is not a folder.")
        if args.max_length is not None and args.max_length < 2048:
            raise ValueError("--max-length (the LongBench window) must be >= 2048 tokens.")
    if "fidelity" in args.suites:
        for length in args.fidelity_lengths:
            if length < args.forced_tokens + args.greedy_tokens + 64:
                raise ValueError(f"fidelity length {length} is too short for the forced + greedy tokens.")


def _sampling(args):
    """The run's `Sampling`, or None for greedy decoding (raises ValueError for sampling options without
    --temperature, values out of range, or the fidelity suite under sampling)."""
    from .sampling import Sampling

    given = [f"--{name.replace('_', '-')}" for name in ("top_p", "top_k", "sampling_seeds")
             if getattr(args, name) is not None]
    if args.temperature is None:
        if given:
            raise ValueError(f"{' '.join(given)} apply to sampled decoding: add --temperature (greedy is the default).")
        return None
    if "fidelity" in args.suites:
        raise ValueError("the fidelity suite compares teacher-forced and greedy decoding: run it without --temperature.")
    return Sampling(args.temperature, 1.0 if args.top_p is None else args.top_p, args.top_k or 0,
                    1 if args.sampling_seeds is None else args.sampling_seeds)


def _methods(args):
    from .methods import parse_method, standard_methods

    if args.methods == ["standard"]:
        return standard_methods(args.budgets, args.reference_budget)
    return [parse_method(spec, args.reference_budget) for spec in args.methods]


def _load(args):
    import torch

    from ...model.loading import load_model, model_display_name

    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, dtype=getattr(torch, getattr(args, "dtype", "float32")),
                                  device=getattr(args, "device", "cpu"))
    name = args.model_name or model_display_name(args.model)
    return model, tokenizer, name


def _items(args, tokenizer, model):
    from . import harness
    from .chat_format import prompt_format

    samples = args.samples if args.limit is None else min(args.samples, args.limit)
    fmt = prompt_format(tokenizer, args.chat_template, args.system_prompt)
    generation, fidelity = [], []
    if "ruler" in args.suites:
        ruler_items = harness.ruler_items(tokenizer, args.ruler_tasks, args.lengths, samples, args.seed,
                                          args.max_new_tokens, fmt=fmt, template=args.ruler_template,
                                          qa_dir=args.ruler_qa_dir)
        # sample 0 of every task and length, then sample 1, ...: a run stopped early holds every task at about the
        # same number of samples
        generation += sorted(ruler_items, key=lambda item: item.sample)
    if "longbench" in args.suites:
        window = args.max_length or getattr(model.config, "max_position_embeddings", None) or 8192
        generation += harness.longbench_items(tokenizer, args.longbench_tasks, window, args.data_dir, args.limit,
                                              args.max_new_tokens, fmt=fmt)
    if "fidelity" in args.suites:
        fidelity = harness.fidelity_items(tokenizer, args.fidelity_lengths, samples, args.forced_tokens,
                                          args.greedy_tokens, args.seed)
    return generation, fidelity


def cmd_run(args) -> int:
    from . import harness

    try:
        _check_args(args)
        sampling = _sampling(args)
        methods = _methods(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    start = time.time()
    model, tokenizer, name = _load(args)
    try:
        generation, fidelity = _items(args, tokenizer, model)
    except (ValueError, FileNotFoundError) as error:  # the wrapper needs the tokenizer, data files are read here
        print(f"error: {error}", file=sys.stderr)
        return 2
    from .sampling import settings_text

    decoding = settings_text(None if sampling is None else sampling.settings())
    if sampling is not None:
        decoding = f"sampled ({decoding}), {sampling.seeds} seed(s) per prompt"
    print(f"{len(generation)} generation prompts, {len(fidelity)} fidelity samples, methods "
          f"{[m.label for m in methods]}, {decoding}; rows -> {args.out}", flush=True)
    rows = harness.run(model, tokenizer, methods, args.out, name, generation, fidelity, resume=not args.no_resume,
                       shared_prefill=not args.no_shared_prefill, sampling=sampling)
    print(f"wrote {len(rows)} rows in {time.time() - start:.0f} s", flush=True)
    if args.report_dir:
        from .report import write_report

        for path in write_report(harness.read_rows(args.out), args.report_dir):
            print(f"wrote {path}")
    return 0


def cmd_report(args) -> int:
    from .harness import read_rows
    from .report import write_report

    rows = [row for path in args.results for row in read_rows(path)]
    if not rows:
        print(f"error: no rows in {' '.join(args.results)}", file=sys.stderr)
        return 2
    for path in write_report(rows, args.out_dir):
        print(f"wrote {path}")
    return 0


def cmd_export(args) -> int:
    from ..card.kvpress_merge import export_prompts

    try:
        _check_args(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    model, tokenizer, name = _load(args)
    try:
        generation, _ = _items(args, tokenizer, model)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    export_prompts(generation, args.prompts_out, name)
    print(f"wrote {len(generation)} prompts to {args.prompts_out}")
    return 0


def cmd_merge(args) -> int:
    from ..card.kvpress_merge import merge_kvpress

    try:
        n = merge_kvpress(args.prompts, args.kvpress, args.out)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"appended {n} kvpress rows to {args.out}")
    return 0
