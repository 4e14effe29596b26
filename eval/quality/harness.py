"""The evaluation harness: every method on the same prompts in the same run, one JSONL row per sample.

Suites: `ruler` (`ruler.py`, generated offline), `longbench` (`longbench.py`, Hub or `--data-dir`), `fidelity`
(`fidelity.py`). For each prompt, every method runs back to back; rows are appended (and flushed) as they are
produced, so a run can be stopped and resumed: rows already in the output file are skipped (`resume=True`). The
generation suites prefill each prompt once and every method continues its own copy (`shared_prefill.py`; each
method generates the tokens of its stand-alone run), unless `shared_prefill=False`. Decoding is greedy unless a
`sampling.Sampling` is given: then each prompt is decoded once per sample seed by every method, each call seeded
from (prompt, sample seed) (`sampling.torch_seed`), so dense and dual rows pair by (prompt, sample seed).

Row schema (one JSON object per line; the model-card renderer `dual_cache.eval.card.hub_card` reads it):

| key | type | meaning |
|---|---|---|
| `dataset` | str | `"ruler"`, `"longbench"` or `"fidelity"` (or `"kvpress"` rows merged under the same datasets) |
| `task` | str | RULER task (`niah_single_2`, ...), LongBench task (`hotpotqa`, ...), or fidelity's `teacher_forced_top1` / `greedy_identical` |
| `method` | str | `dense`, `dual`, `dual-none`, `oracle`, `streaming`, `quest`, `kvpress-<press>` |
| `budget` | int or null | retrieval budget in tokens per KV head as configured (null for dense; 0 for streaming) |
| `length` | int | the length bucket in tokens: RULER / fidelity target length (prompt + answer fit in it); LongBench the model window (prompts truncated to LongBench's maximum length for it, `longbench.official_max_length`; `prompt_tokens` has each prompt's own length) |
| `sample` | int | sample index within (dataset, task, length) |
| `score` | float | 0–100: RULER string match, LongBench's official metric × 100, fidelity top-1 agreement % or identical-greedy % |
| `metric` | str | `string_match_all` or `string_match_part` (RULER QA), LongBench metric name (`qa_f1`, ...), `top1_agreement`, `identical_prefix` |
| `prediction` | str | the generated text, decoded without special tokens and not stripped (fidelity: the method's argmax over the greedy steps) |
| `reference` | list[str] | the reference answers (fidelity: dense's greedy continuation) |
| `device_bytes` | int or null | KV bytes on the compute device: dual `cache.stats()["device_bytes"]`, dense the `DynamicCache` K/V bytes |
| `model` | str | model name |
| `prompt_tokens`, `new_tokens`, `seconds` | int, int, float | prompt length, generated tokens, wall time of the method's call (with a shared prefill: its copy of the prefix, the last prompt token and the decode) |
| `speculation` | dict or null | dual rows: the cache's `spec_hits`, `spec_steps` (speculated tokens that equalled the real one / speculated), `repairs` ((step, layer) re-selections for misses and drift) and `drift_repairs`; null otherwise |
| `prefill_seconds` | float or null | wall time of the sample's shared prefill (`shared_prefill.py`), paid once for every method of the sample; null for a stand-alone run |
| `cache_config` | dict or null | the `cache_config` passed to `generate` (null for dense) |
| `kl`, `top1`, `identical_tokens`, `forced_tokens`, `greedy_tokens` | | fidelity rows only (KL in nats) |
| `sampling` | dict | sampled rows only: `{"temperature", "top_p", "top_k"}` as given to `generate` (top-p 1 and top-k 0: off); greedy rows have no such field |
| `sample_seed`, `torch_seed` | int, int | sampled rows only: the sample seed (0 … seeds - 1) and the `torch.manual_seed` set before the method's `generate()` (`sampling.torch_seed` of the prompt ids and the sample seed) |

Resume key: (dataset, task, method, budget, length, sample, model, cache_config), and for sampled rows also
(sampling, sample_seed): greedy and sampled rows, or rows of different settings, never stand for each other.
"""

from __future__ import annotations

from ...runtime.extras import require

require("eval", "`dual-decoder eval`")

import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from tqdm.auto import tqdm

from . import fidelity as fidelity_mod
from .chat_format import PLAIN, PromptFormat
from .generation import generate
from .methods import Method
from .sampling import Sampling, torch_seed
from .shared_prefill import SharedPrefill

ROW_KEYS = ("dataset", "task", "method", "budget", "length", "sample", "score", "prediction", "reference",
            "device_bytes", "model")
FIDELITY_TASKS = ("teacher_forced_top1", "greedy_identical")


def row_key(row: dict) -> tuple:
    """The resume key of a row: its prompt, method, configuration and model; a sampled row's key adds its sampling
    settings and sample seed (a greedy row's key is the same as before sampling existed)."""
    config = json.dumps(row.get("cache_config"), sort_keys=True)  # e.g. rows from before an option existed
    key = (row["dataset"], row["task"], row["method"], row.get("budget"), row["length"], row["sample"],
           row.get("model"), config)
    if row.get("sampling") is not None:
        key += (json.dumps(row["sampling"], sort_keys=True), row.get("sample_seed"))
    return key


def read_rows(path: str) -> list[dict]:
    """Rows of a results JSONL file ([] when it does not exist). Raises `ValueError` naming the bad line."""
    if not os.path.exists(path):
        return []
    rows = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path}:{number}: not valid JSON ({error.msg}).") from error
    return rows


def dedupe_rows(rows: list[dict]) -> list[dict]:
    """`rows` with only the first row of each resume key (two runs appending to one file can repeat a row)."""
    seen, out = set(), []
    for row in rows:
        key = row_key(row)
        if key not in seen:
            seen.add(key)
            out.append(row)
    return out


class RowWriter:
    """Appends rows to a JSONL file (flushed per row) and remembers which keys exist."""

    def __init__(self, path: str, resume: bool = True):
        self.path = path
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        if not resume and os.path.exists(path):
            os.remove(path)
        self.done = {row_key(r) for r in read_rows(path)}
        self.rows: list[dict] = []

    def has(self, key: tuple) -> bool:
        return key in self.done

    def write(self, row: dict) -> None:
        missing = [k for k in ROW_KEYS if k not in row]
        if missing:
            raise ValueError(f"row lacks {missing}: {row}")
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
        self.done.add(row_key(row))
        self.rows.append(row)


@dataclass
class GenerationItem:
    """One prompt of a generation suite (RULER or LongBench) with how to score its prediction; `extra` goes into
    its rows, `generate_kwargs` into `generate()` (e.g. samsum's newline stop)."""

    dataset: str
    task: str
    length: int
    sample: int
    input_ids: list[int]
    references: list[str]
    max_new_tokens: int
    metric: str
    scoring: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)
    generate_kwargs: dict[str, Any] = field(default_factory=dict)

    def score(self, prediction: str) -> float:
        """Score (0–100) of `prediction` against this item's references."""
        return score_prediction(self.scoring, prediction, self.references)


_METRICS: dict[str, Any] = {}


def score_prediction(scoring: dict[str, Any], prediction: str, references: list[str]) -> float:
    """Score (0–100) of one prediction with the local `evaluate` metric named in `scoring`.

    `scoring` is `{"metric": "ruler_string_match", "mode": "all" | "part"}` or
    `{"metric": "longbench_score", "task": ..., "all_classes": [...] | None}`.

    Raises:
        ValueError: unknown metric.
    """
    from .metrics import load_metric

    kwargs = dict(scoring)
    name = kwargs.pop("metric")
    if name not in _METRICS:
        _METRICS[name] = load_metric(name)
    return float(_METRICS[name].compute(predictions=[prediction], references=[references], **kwargs)["score"])


def ruler_items(tokenizer, tasks: list[str], lengths: list[int], samples: int, seed: int = 0,
                max_new_tokens: int | None = None, fmt: PromptFormat = PLAIN, template: str = "ruler",
                qa_dir: str | None = None) -> list[GenerationItem]:
    """RULER prompts (`ruler.build_dataset` with the model wrapper `fmt`) as harness items scored with the local
    `ruler_string_match` metric. `max_new_tokens` caps RULER's per-task answer budget (the prompt length still
    follows RULER's); `template` picks the NIAH wording and `qa_dir` holds the QA files (see
    `ruler.generate_sample`)."""
    from . import ruler

    dataset = ruler.build_dataset(tokenizer, tasks, lengths, samples, seed=seed, fmt=fmt, template=template,
                                  qa_dir=qa_dir)
    items = []
    for row in dataset:
        items.append(GenerationItem(
            dataset="ruler", task=row["task"], length=row["length"], sample=row["sample"],
            input_ids=list(row["input_ids"]), references=list(row["outputs"]),
            max_new_tokens=min(row["max_new_tokens"], max_new_tokens or row["max_new_tokens"]),
            metric=f"string_match_{row['metric']}", scoring={"metric": "ruler_string_match", "mode": row["metric"]},
        ))
    return items


def longbench_items(tokenizer, tasks: list[str], window: int, data_dir: str | None = None, limit: int | None = None,
                    max_new_tokens: int | None = None, fmt: PromptFormat = PLAIN) -> list[GenerationItem]:
    """LongBench prompts for a model of `window` positions (`longbench.build_samples`, truncated to LongBench's
    `official_max_length(window)`, wrapped with `fmt`) scored with the local `longbench_score` metric; their
    `length` is `window`."""
    from . import longbench
    from .metrics.longbench_score import TASK_METRIC, base_task

    items = []
    for s in longbench.build_samples(tokenizer, tasks, longbench.official_max_length(window), data_dir=data_dir,
                                     limit=limit, fmt=fmt):
        items.append(GenerationItem(
            dataset="longbench", task=s["task"], length=window, sample=s["sample"], input_ids=s["input_ids"],
            references=s["references"], max_new_tokens=min(s["max_new_tokens"], max_new_tokens or s["max_new_tokens"]),
            metric=TASK_METRIC[base_task(s["task"])], extra={"_id": s["_id"]}, generate_kwargs=s["generate_kwargs"],
            scoring={"metric": "longbench_score", "task": s["task"], "all_classes": s["all_classes"]},
        ))
    return items


def fidelity_items(tokenizer, lengths: list[int], samples: int, forced_tokens: int = 64, greedy_tokens: int = 32,
                   seed: int = 0) -> list[fidelity_mod.FidelitySample]:
    """Natural-text fidelity samples (`fidelity.make_sample`) for every length."""
    return [fidelity_mod.make_sample(tokenizer, length, i, forced_tokens, greedy_tokens, seed)
            for length in lengths for i in range(samples)]


def _base_row(dataset, task, method: Method, length, sample, model_name, sampling: Sampling | None = None,
              sample_seed: int | None = None) -> dict:
    row = {"dataset": dataset, "task": task, "method": method.name, "budget": method.budget, "length": length,
           "sample": sample, "model": model_name, "cache_config": method.cache_config}
    if sampling is not None:
        row.update(sampling=sampling.settings(), sample_seed=sample_seed)
    return row


def run(model, tokenizer, methods: list[Method], out_path: str, model_name: str,
        generation_items: Iterable[GenerationItem] = (), fidelity: Iterable[fidelity_mod.FidelitySample] = (),
        resume: bool = True, progress: bool = True, log=print, shared_prefill: bool = True,
        sampling: Sampling | None = None) -> list[dict]:
    """Run every method on every item, appending rows to `out_path`; returns the rows written in this call.

    `sampling`: None decodes greedily; a `Sampling` decodes each generation item once per sample seed with every
    method, `torch.manual_seed(torch_seed(item's prompt ids, sample seed))` set before each `generate()` call.

    Methods with a `skip_reason` are skipped with a printed reason; a method that raises on a prompt is logged
    and skipped (no row, so a rerun retries it). Fidelity needs `dense` among the methods (it is the reference)
    and runs it first on each sample. With `shared_prefill`, a generation item's prompt (but its last token) is
    prefilled once for the methods (and sample seeds) that still lack their rows (`shared_prefill.SharedPrefill`);
    a prefill that fails is logged and those methods run stand-alone.

    Raises:
        ValueError: no methods, duplicate method labels, fidelity items without a dense method, or fidelity items
            with `sampling` (fidelity compares greedy decoding).
    """
    methods = list(methods)
    if not methods:
        raise ValueError("no methods to evaluate.")
    labels = [m.label for m in methods]
    if len(set(labels)) != len(labels):
        raise ValueError(f"duplicate methods: {labels}.")
    generation_items, fidelity = list(generation_items), list(fidelity)
    if fidelity and not any(m.name == "dense" for m in methods):
        raise ValueError("the fidelity suite compares against dense: include the 'dense' method.")
    if fidelity and sampling is not None:
        raise ValueError("the fidelity suite compares teacher-forced and greedy decoding: run it without sampling.")
    for method in methods:
        if method.skip_reason:
            log(f"skipping {method.label}: {method.skip_reason}")
    runnable = [m for m in methods if not m.skip_reason]
    writer = RowWriter(out_path, resume=resume)
    seeds = 1 if sampling is None else sampling.seeds
    total = (len(generation_items) * seeds + len(fidelity)) * len(runnable)
    bar = tqdm(total=total, desc="eval", unit="run", disable=not progress, file=sys.stderr)
    failures: list[tuple] = []
    try:
        for item in generation_items:
            _run_item(model, tokenizer, runnable, item, writer, model_name, bar, log, failures, shared_prefill,
                      sampling)
        for item in fidelity:
            _run_fidelity(model, tokenizer, runnable, item, writer, model_name, bar, log, failures)
    finally:
        bar.close()
    if failures:
        log(f"{len(failures)} run(s) failed (no rows written for them; rerun to retry): {failures}")
    return writer.rows


def _run_item(model, tokenizer, methods: list[Method], item: GenerationItem, writer: RowWriter, model_name: str, bar,
              log, failures: list, shared_prefill: bool, sampling: Sampling | None) -> None:
    """Every (sample seed, method) that lacks its row on one generation item, after one shared prefill of its
    prompt; under sampling each call is seeded from (prompt, sample seed), the same seed for every method."""
    seeds = [None] if sampling is None else list(range(sampling.seeds))
    rows = [(m, s, _base_row(item.dataset, item.task, m, item.length, item.sample, model_name, sampling, s))
            for s in seeds for m in methods]
    pending = [(m, s, row) for m, s, row in rows if not writer.has(row_key(row))]
    bar.update(len(rows) - len(pending))
    if not pending:
        return
    where = f"{item.task}@{item.length}#{item.sample}"
    shared = None
    if shared_prefill and len(item.input_ids) >= 2:
        bar.set_postfix_str(f"{where} prefill")
        try:
            shared = SharedPrefill(model, item.input_ids, item.max_new_tokens)
        except Exception as error:  # the methods can still run on their own
            log(f"shared prefill FAILED on {where} ({type(error).__name__}: {error}); running each method alone")
    try:
        for method, sample_seed, row in pending:
            run = method.label if sample_seed is None else f"{method.label} seed {sample_seed}"
            seed = None if sample_seed is None else torch_seed(item.input_ids, sample_seed)
            bar.set_postfix_str(f"{where} {run}")
            try:
                start = time.perf_counter()
                cache = None if shared is None else shared.cache_for(method)
                result = generate(model, tokenizer, item.input_ids, method, item.max_new_tokens, cache=cache,
                                  sampling=sampling, seed=seed, **item.generate_kwargs)
                seconds = time.perf_counter() - start
            except Exception as error:  # one failing method must not end a long run; rerun to retry
                log(f"FAILED {run} on {where}: {type(error).__name__}: {error}")
                failures.append((run, item.task, item.length, item.sample, repr(error)))
                bar.update(1)
                continue
            if seed is not None:
                row["torch_seed"] = seed
            row.update(
                score=float(item.score(result.text)), metric=item.metric, prediction=result.text,
                reference=item.references, device_bytes=result.device_bytes,
                prompt_tokens=len(item.input_ids), new_tokens=len(result.new_ids),
                seconds=round(seconds, 3), prefill_seconds=None if shared is None else round(shared.seconds, 3),
                cache_config=method.cache_config, speculation=result.speculation, **item.extra,
            )
            writer.write(row)
            bar.update(1)
    finally:
        if shared is not None:
            shared.close()


def _run_fidelity(model, tokenizer, methods: list[Method], item, writer: RowWriter, model_name: str, bar, log,
                  failures: list) -> None:
    forced_n, greedy_n = len(item.continuation), item.greedy_tokens
    dense_method = next(m for m in methods if m.name == "dense")
    ordered = [dense_method] + [m for m in methods if m is not dense_method]

    def keys(method):
        return [row_key(_base_row("fidelity", t, method, item.length, item.sample, model_name)) for t in FIDELITY_TASKS]

    pending = [m for m in ordered if not all(writer.has(k) for k in keys(m))]
    if not pending:
        bar.update(len(methods))
        return
    bar.set_postfix_str(f"fidelity@{item.length}#{item.sample} dense")
    dense = fidelity_mod.forced_run(model, tokenizer, item, dense_method, item.continuation)
    reference_ids = dense.tokens[forced_n:]
    reference_text = tokenizer.decode(reference_ids, skip_special_tokens=True)
    for method in ordered:
        if method not in pending:
            bar.update(1)
            continue
        bar.set_postfix_str(f"fidelity@{item.length}#{item.sample} {method.label}")
        try:
            run = dense if method is dense_method else fidelity_mod.forced_run(
                model, tokenizer, item, method, item.continuation + reference_ids)
        except Exception as error:  # keep going with the other methods; rerun to retry
            log(f"FAILED {method.label} on fidelity@{item.length}#{item.sample}: {type(error).__name__}: {error}")
            failures.append((method.label, "fidelity", item.length, item.sample, repr(error)))
            bar.update(1)
            continue
        cmp = fidelity_mod.compare(dense, run, forced_n)
        common = {
            "prediction": tokenizer.decode(cmp["greedy_argmax"], skip_special_tokens=True),
            "reference": [reference_text], "device_bytes": run.device_bytes, "prompt_tokens": len(item.prompt_ids),
            "new_tokens": forced_n + greedy_n, "seconds": round(run.seconds, 3), "cache_config": method.cache_config,
            "kl": cmp["kl"], "top1": cmp["top1"], "identical_tokens": cmp["identical_tokens"],
            "forced_tokens": forced_n, "greedy_tokens": greedy_n,
        }
        scores = {
            "teacher_forced_top1": (100.0 * cmp["top1"], "top1_agreement"),
            "greedy_identical": (100.0 * cmp["identical_tokens"] / max(greedy_n, 1), "identical_prefix"),
        }
        for task in FIDELITY_TASKS:
            row = _base_row("fidelity", task, method, item.length, item.sample, model_name)
            if not writer.has(row_key(row)):
                score, metric = scores[task]
                row.update(score=score, metric=metric, **common)
                writer.write(row)
        bar.update(1)
