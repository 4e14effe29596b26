"""Model cards with dual-cache evaluation results, rendered through `huggingface_hub`'s card classes.

Input: the evaluation harness's per-sample JSONL (one row per sample: `dataset`, `task`, `method`, `budget`,
`length`, `sample`, `score` 0–100, `prediction`, `reference`, `device_bytes`, `model`), or a summary file holding
already-aggregated rows (a JSON list, a JSON object with a `rows`/`results`/`summary` list, or JSONL rows without
`sample` and with an optional `samples`/`n` weight).

Rows are aggregated to the mean score per (dataset, task, length, method, budget) and become
`huggingface_hub.EvalResult`s: task type `text-generation`; dataset name such as `"RULER NIAH-single-1 4K"`,
dataset config `"<task>-<length>"` (the Hub groups `model-index` results by task/dataset type/config/split, so
each length gets its own entry); one metric per method and budget, e.g. type `accuracy`, name
`"accuracy (dual, budget 256)"`, value the mean score, args `{method, budget, samples}`.

Validation offline: `ModelCard.validate()` posts the card to the Hub's `/api/validate-yaml`, so it needs the network.
`validate_card_offline` instead re-parses the rendered text exactly as the Hub client does when it loads a card
(`ModelCard(text)`: YAML front matter through `yaml.safe_load`, then `ModelCardData`, whose constructor parses
`model-index` with `model_index_to_eval_results` and rejects eval results without a model name), checks the
`model-index` shape the Hub's schema requires (name, results with task.type, dataset.type/name, metrics with
type/value), checks that a second `ModelCardData` round trip is stable, and that every expected result is present.
`push_card` additionally runs the Hub's own `ModelCard.validate` right before uploading.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from ...config import DualDecoderConfig

SECTION_BEGIN = "<!-- dual-cache:begin -->"
SECTION_END = "<!-- dual-cache:end -->"
TASK_TYPE = "text-generation"
CARD_TAGS = ["dual-cache", "long-context", "kv-cache", "custom_generate"]

# dataset key in the results -> (display name, model-index dataset type)
DATASETS = {
    "ruler": ("RULER", "ruler"),
    "longbench": ("LongBench", "THUDM/LongBench"),
    "fidelity": ("Fidelity vs dense", "fidelity"),
}
# LongBench tasks scored with something other than F1 (official metric per task); everything else is F1.
_LONGBENCH_METRICS = {
    "gov_report": "rouge", "qmsum": "rouge", "multi_news": "rouge", "vcsum": "rouge", "samsum": "rouge",
    "trec": "accuracy", "lsht": "accuracy", "passage_count": "accuracy", "passage_retrieval_en": "accuracy",
    "passage_retrieval_zh": "accuracy", "lcc": "edit_similarity", "repobench-p": "edit_similarity",
}
_ACRONYMS = {"niah": "NIAH", "qa": "QA", "vt": "VT", "cwe": "CWE", "fwe": "FWE"}
_REQUIRED = ("dataset", "task", "method", "length", "score")


class ResultsError(ValueError):
    """A results file that cannot be read or aggregated; the message names the file, the line and the fix."""


@dataclass(frozen=True)
class AggregatedResult:
    """Mean score of one (dataset, task, length, method, budget) cell over its samples."""

    dataset: str
    task: str
    length: int
    method: str
    budget: int | None
    metric: str
    score: float
    samples: int
    device_bytes: float | None = None

    @property
    def dataset_name(self) -> str:
        """Readable dataset name, e.g. `"RULER NIAH-single-1 4K"`."""
        return f"{DATASETS.get(self.dataset, (self.dataset, None))[0]} {display_task(self.dataset, self.task)} " \
            f"{length_label(self.length)}"

    @property
    def dataset_type(self) -> str:
        """`model-index` dataset type (a Hub dataset id where one exists)."""
        return DATASETS.get(self.dataset, (None, self.dataset))[1]

    @property
    def dataset_config(self) -> str:
        """`model-index` dataset config: `<task>-<length>`, unique per task and length."""
        return f"{self.task}-{self.length}"

    @property
    def metric_name(self) -> str:
        """Readable metric name naming the method and budget, e.g. `"accuracy (dual, budget 256)"`."""
        budget = f", budget {self.budget}" if self.budget is not None else ""
        return f"{self.metric} ({self.method}{budget})"

    def to_eval_result(self) -> EvalResult:
        """This cell as a `huggingface_hub.EvalResult`."""
        args = {"method": self.method, "samples": self.samples}
        if self.budget is not None:
            args["budget"] = self.budget
        return EvalResult(
            task_type=TASK_TYPE, task_name="Text Generation", dataset_type=self.dataset_type,
            dataset_name=self.dataset_name, dataset_config=self.dataset_config, dataset_split="test",
            dataset_args={"context_length": self.length}, metric_type=self.metric, metric_name=self.metric_name,
            metric_value=round(self.score, 2), metric_args=args,
        )


def display_task(dataset: str, task: str) -> str:
    """RULER task ids made readable (`"niah_single_1"` -> `"NIAH-single-1"`); other tasks keep their official id."""
    if dataset != "ruler":
        return task
    return "-".join(_ACRONYMS.get(p, p) for p in task.replace("_", "-").split("-"))


def length_label(tokens: int) -> str:
    """`4096` -> `"4K"`, `131072` -> `"128K"`, `3000` -> `"3000"`."""
    return f"{tokens // 1024}K" if tokens >= 1024 and tokens % 1024 == 0 else str(tokens)


def default_metric(dataset: str, task: str) -> str:
    """Metric type of a (dataset, task) when the rows do not name one: RULER accuracy, LongBench's official metric."""
    if dataset == "longbench":
        return _LONGBENCH_METRICS.get(task, "f1")
    if dataset == "fidelity":
        return "fidelity"
    return "accuracy"


def load_results(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read result rows from a JSONL file (one JSON object per line) or a JSON summary file.

    A `.json` file may hold a list of rows or an object with a `rows`, `results` or `summary` list; anything
    else is read as JSONL. Rows are checked (required keys, numeric score in [0, 100], integer length and budget)
    before anything is rendered.

    Raises:
        ResultsError: missing/empty file, invalid JSON (with the line number), or an invalid row.
    """
    path = Path(path)
    if not path.is_file():
        raise ResultsError(f"results file {path} does not exist or is not a file (pass the evaluation JSONL).")
    text = path.read_text(encoding="utf-8")
    rows: list[tuple[str, Any]] = []
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ResultsError(f"{path}: not valid JSON ({error}).") from error
        if isinstance(data, dict):
            data = next((data[k] for k in ("rows", "results", "summary") if isinstance(data.get(k), list)), None)
        if not isinstance(data, list):
            raise ResultsError(f"{path}: expected a list of rows or an object with a 'rows'/'results'/'summary' list.")
        rows = [(f"{path} row {i}", row) for i, row in enumerate(data)]
    else:
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append((f"{path}:{number}", json.loads(line)))
            except json.JSONDecodeError as error:
                raise ResultsError(f"{path}:{number}: not valid JSON ({error.msg}).") from error
    if not rows:
        raise ResultsError(f"{path} holds no result rows.")
    return [_check_row(where, row) for where, row in rows]


def _check_row(where: str, row: Any) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise ResultsError(f"{where}: a row must be a JSON object, got {type(row).__name__}.")
    missing = [k for k in _REQUIRED if k not in row]
    if missing:
        raise ResultsError(f"{where}: missing key(s) {missing}; every row needs {list(_REQUIRED)}.")
    for key in ("dataset", "task", "method"):
        if not isinstance(row[key], str) or not row[key]:
            raise ResultsError(f"{where}: '{key}' must be a non-empty string, got {row[key]!r}.")
    score = row["score"]
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score) or not 0 <= score <= 100:
        raise ResultsError(f"{where}: 'score' must be a number from 0 to 100, got {score!r}.")
    for key, optional in (("length", False), ("budget", True)):
        value = row.get(key)
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ResultsError(f"{where}: '{key}' must be a non-negative integer{' or null' if optional else ''}, "
                               f"got {value!r}.")
    return row


def aggregate(rows: Iterable[Mapping[str, Any]], model: str | None = None) -> list[AggregatedResult]:
    """Mean score per (dataset, task, length, method, budget), sorted for display.

    Per-sample rows weigh 1; summary rows (no `sample` key) weigh their `samples` or `n` count (default 1).

    Args:
        rows: rows from `load_results`.
        model: keep only rows whose `model` equals this; required when the rows hold several models.

    Raises:
        ResultsError: rows from several models and no `model` filter, or no row left after filtering.
    """
    rows = list(rows)
    models = sorted({str(r["model"]) for r in rows if r.get("model") is not None})
    if model is not None:
        rows = [r for r in rows if r.get("model") == model]
        if not rows:
            raise ResultsError(f"no result row has model {model!r}; the rows hold {models}.")
    elif len(models) > 1:
        raise ResultsError(f"the results hold several models {models}; pick one with --results-model.")
    cells: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])  # weight, score sum, bytes sum, bytes weight
    metrics: dict[tuple, str] = {}
    for row in rows:
        key = (row["dataset"], row["task"], row["length"], row["method"], row.get("budget"))
        weight = 1 if "sample" in row else int(row.get("samples", row.get("n", 1)))
        cell = cells[key]
        cell[0] += weight
        cell[1] += weight * float(row["score"])
        if isinstance(row.get("device_bytes"), (int, float)):
            cell[2] += weight * float(row["device_bytes"])
            cell[3] += weight
        metric = row.get("metric") or default_metric(row["dataset"], row["task"])
        if metrics.setdefault(key, metric) != metric:
            raise ResultsError(f"rows of {key} name different metrics ({metrics[key]!r} and {metric!r}).")
    results = [
        AggregatedResult(
            dataset=k[0], task=k[1], length=k[2], method=k[3], budget=k[4], metric=metrics[k],
            score=c[1] / c[0], samples=int(c[0]), device_bytes=c[2] / c[3] if c[3] else None,
        )
        for k, c in cells.items()
    ]
    return sorted(results, key=lambda r: (r.dataset, r.task, r.length, r.method, -1 if r.budget is None else r.budget))


def parse_cache_config(value: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """A `cache_config` from a dict, a JSON string or a JSON file path, validated by `DualDecoderConfig`.

    Raises:
        ValueError: unreadable JSON, not an object, or an invalid dual cache option.
    """
    if value is None:
        return {}
    if isinstance(value, Mapping):
        config = dict(value)
    else:
        source = Path(value).read_text(encoding="utf-8") if Path(value).is_file() else value
        try:
            config = json.loads(source)
        except json.JSONDecodeError as error:
            hint = (f" (no file named {value!r} exists)" if value.strip()[:1] not in "{[\"" else "")
            raise ValueError(f"--cache-config must be a JSON object or a JSON file{hint}: {error}") from error
        if not isinstance(config, dict):
            raise ValueError("--cache-config must be a JSON object, e.g. '{\"budget\": 256}'.")
    DualDecoderConfig.from_dict(config)  # raises ValueError naming the bad option
    return config


def cache_config_from_rows(rows: Iterable[Mapping[str, Any]], model: str | None = None) -> dict[str, Any]:
    """The `cache_config` the harness recorded on its `dual` rows (the most common one), without `budget` when the
    rows sweep several budgets; `{}` when no row records one.

    Raises:
        ResultsError: the recorded configuration is not a valid `DualDecoderConfig` (pass --cache-config instead).
    """
    configs = [dict(r["cache_config"]) for r in rows
               if r.get("method") == "dual" and isinstance(r.get("cache_config"), Mapping)
               and (model is None or r.get("model") == model)]
    if not configs:
        return {}
    budgets = {c.get("budget") for c in configs}
    if len(budgets) > 1:
        for c in configs:
            c.pop("budget", None)
    counts: dict[str, int] = defaultdict(int)
    for c in configs:
        counts[json.dumps(c, sort_keys=True)] += 1
    chosen = json.loads(max(counts, key=counts.get))
    try:
        DualDecoderConfig.from_dict(chosen)
    except (ValueError, TypeError) as error:
        raise ResultsError(f"the results' cache_config {chosen} is not valid here ({error}); pass --cache-config.") from error
    return chosen


def _human_bytes(nbytes: float | None) -> str:
    if nbytes is None:
        return "–"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} GiB"


def _config_section(cache_config: Mapping[str, Any], budgets: Sequence[int]) -> str:
    config = DualDecoderConfig.from_dict(cache_config)
    lines = ["| option | value |", "|---|---|"]
    for f in dataclasses.fields(config):
        if f.name == "prefill_progress":
            continue
        value = getattr(config, f.name)
        shown = f"`{value}`"
        if f.name == "budget" and "budget" not in cache_config and budgets:
            shown = "per row (see the table)" if len(budgets) > 1 else f"`{budgets[0]}`"
        lines.append(f"| `{f.name}` | {shown} |")
    return "\n".join(lines)


def _usage_snippet(model_name: str, repo_id: str, cache_config: Mapping[str, Any], budgets: Sequence[int]) -> str:
    example = {"budget": budgets[-1] if budgets else 256, "n_sink": 4, "window": 64}
    shown = dict(cache_config) if cache_config else example
    config = "{" + ", ".join(f"{json.dumps(str(k))}: {json.dumps(v) if isinstance(v, str) else repr(v)}" for k, v in shown.items()) + "}"  # a Python literal
    return f"""```python
import dual_cache  # pip install dual-cache; registers cache_implementation="dual" with transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("{model_name}")
model = AutoModelForCausalLM.from_pretrained("{model_name}")
messages = [{{"role": "user", "content": long_document + "\\n\\n" + question}}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
out = model.generate(**inputs, max_new_tokens=64, cache_implementation="dual",
                     cache_config={config})
print(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
```

Where the repository `{repo_id}` holds the `custom_generate/` folder (`dual-decoder export-generate`), the import is
not needed (the package must still be installed):

```python
out = model.generate(**inputs, max_new_tokens=64, custom_generate="{repo_id}", trust_remote_code=True,
                     cache_config={config})
```"""


def _results_table(results: Sequence[AggregatedResult]) -> str:
    lines = ["| dataset | task | length | method | budget | metric | score | samples | device KV |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(
            f"| {DATASETS.get(r.dataset, (r.dataset,))[0]} | {display_task(r.dataset, r.task)} | {length_label(r.length)} | "
            f"{r.method} | {'–' if r.budget is None else r.budget} | {r.metric} | {r.score:.2f} | {r.samples} | "
            f"{_human_bytes(r.device_bytes)} |"
        )
    return "\n".join(lines)


def render_section(results: Sequence[AggregatedResult], model_name: str, cache_config: Mapping[str, Any],
                   repo_id: str | None = None, extra: str | None = None) -> str:
    """The markdown section (between `SECTION_BEGIN`/`SECTION_END` markers): usage, configuration, results, then
    `extra` markdown (the RULER table, `ruler_table.markdown`) when given."""
    budgets = sorted({r.budget for r in results if r.method.startswith("dual") and r.budget is not None})
    return "\n".join([
        SECTION_BEGIN,
        "## Long-context decoding with dual-cache",
        "",
        "[dual-cache](https://pypi.org/project/dual-cache/) keeps the KV cache in host memory and brings to the "
        "accelerator only the entries each decode step needs (sink, local window and a top-k selection chosen one "
        "step early from a speculated token), so device memory per request does not grow with the context.",
        "",
        "### Usage",
        "",
        _usage_snippet(model_name, repo_id or model_name, cache_config, budgets),
        "",
        "### Configuration used",
        "",
        _config_section(cache_config, budgets),
        "",
        "### Evaluation results",
        "",
        f"Model `{model_name}`. Scores are 0–100, the mean over the samples of each row; `dense` is the default "
        "cache, `dual` the dual cache; `device KV` is the mean device memory held for the KV cache.",
        "",
        _results_table(results),
        *(["", extra.strip()] if extra and extra.strip() else []),
        SECTION_END,
    ])


def _result_key(result: EvalResult) -> tuple:
    return (result.task_type, result.dataset_type, result.dataset_config, result.metric_type, result.metric_name)


def render_card(results: Sequence[AggregatedResult], model_name: str, cache_config: Mapping[str, Any] | None = None,
                repo_id: str | None = None, existing: str | None = None, license: str | None = None,
                extra: str | None = None) -> ModelCard:
    """Render (or update) a model card with the dual-cache section and `model-index` evaluation results.

    Args:
        results: aggregated rows (`aggregate`); at least one.
        model_name: the evaluated model (Hub id); the `model-index` name and the name in the usage snippet.
        cache_config: the dual cache options used (validated); missing ones are the defaults.
        repo_id: repository named in the custom_generate snippet (default `model_name`).
        existing: text of an existing card to update: its metadata and text are kept, our tags added, results
            with the same dataset/config/metric replaced, and the section between the markers replaced (or
            appended).
        license: card license, when the card has none.
        extra: markdown appended to the section after the results table (`dual-decoder card` passes the RULER
            table of the rows: every method per task and on average, with its difference from dense).

    Returns:
        The `ModelCard`, already validated with `validate_card_offline`.

    Raises:
        ValueError: no results, an invalid `cache_config`, or an existing card whose metadata cannot be parsed.
    """
    if not results:
        raise ValueError("no results to put on the card.")
    cache_config = parse_cache_config(cache_config)
    evals = [r.to_eval_result() for r in results]
    section = render_section(results, model_name, cache_config, repo_id, extra)
    body = f"\n# {model_name}\n\n{section}\n"
    data = ModelCardData(model_name=model_name, eval_results=evals, library_name="transformers",
                         pipeline_tag="text-generation", tags=list(CARD_TAGS), license=license)
    if existing is not None and existing.strip():
        old = ModelCard(existing)  # raises ValueError on unparsable metadata
        merged = old.data.to_dict()
        for key in ("model-index", "model_name", "eval_results"):
            merged.pop(key, None)
        keys = {_result_key(e) for e in evals}
        kept = [e for e in (old.data.eval_results or []) if _result_key(e) not in keys]
        merged["tags"] = list(dict.fromkeys(list(merged.get("tags") or []) + CARD_TAGS))
        merged.setdefault("library_name", "transformers")
        merged.setdefault("pipeline_tag", "text-generation")
        if license and not merged.get("license"):
            merged["license"] = license
        data = ModelCardData(model_name=model_name, eval_results=kept + evals, **merged)
        text = old.text
        if SECTION_BEGIN in text and SECTION_END in text and text.index(SECTION_BEGIN) < text.index(SECTION_END):
            start, end = text.index(SECTION_BEGIN), text.index(SECTION_END) + len(SECTION_END)
            body = text[:start] + section + text[end:]
        else:
            body = text.rstrip("\n") + "\n\n" + section + "\n"
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n{body}")
    validate_card_offline(str(card), expected=evals)
    return card


_REQUIRED_RESULT_FIELDS = (("task", "type"), ("dataset", "type"), ("dataset", "name"))


def validate_card_offline(text: str, expected: Sequence[EvalResult] | None = None) -> ModelCard:
    """Validate a card's metadata without the network (see the module docstring for what is checked).

    Args:
        text: the full card text (YAML front matter + markdown).
        expected: eval results that must all be present in the parsed `model-index` (by every field).

    Returns:
        The parsed `ModelCard`.

    Raises:
        ValueError: the metadata does not parse, the `model-index` is malformed, the round trip is unstable, or
            an expected result is missing.
    """
    card = ModelCard(text)  # yaml.safe_load + ModelCardData(**metadata): model-index parsed and checked
    metadata = card.data.to_dict()
    if not text.startswith("---\n") or not metadata:
        raise ValueError("the card has no YAML metadata block.")
    index = metadata.get("model-index")
    if index is not None:
        if not isinstance(index, list) or len(index) != 1 or not isinstance(index[0].get("name"), str):
            raise ValueError("model-index must be a list with one entry holding a string 'name'.")
        results = index[0].get("results")
        if not isinstance(results, list) or not results:
            raise ValueError("model-index entry has no 'results' list.")
        for i, result in enumerate(results):
            for outer, inner in _REQUIRED_RESULT_FIELDS:
                if not isinstance((result.get(outer) or {}).get(inner), str):
                    raise ValueError(f"model-index result {i}: '{outer}.{inner}' must be a string.")
            metrics = result.get("metrics")
            if not isinstance(metrics, list) or not metrics:
                raise ValueError(f"model-index result {i}: 'metrics' must be a non-empty list.")
            for metric in metrics:
                if not isinstance(metric.get("type"), str):
                    raise ValueError(f"model-index result {i}: every metric needs a string 'type'.")
                value = metric.get("value")
                if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                    raise ValueError(f"model-index result {i}: metric value {value!r} is not a number or string.")
    if ModelCardData(**metadata).to_dict() != metadata:
        raise ValueError("card metadata does not round-trip through ModelCardData.")
    if expected is not None:
        found = card.data.eval_results or []
        missing = [e for e in expected if e not in found]
        if missing:
            raise ValueError(f"{len(missing)} result(s) missing from the card metadata, e.g. {missing[0]}.")
    return card


def write_card_atomic(card: ModelCard | str, path: str | os.PathLike) -> None:
    """Write the card to `path` through a temporary file in the same folder and `os.replace` (never half-written).

    Raises:
        OSError: the folder does not exist or is not writable.
    """
    path = Path(path)
    if not path.parent.is_dir():
        raise OSError(f"folder {path.parent} does not exist.")
    if path.exists():
        mode = path.stat().st_mode & 0o777
    else:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(str(card))
        os.chmod(tmp, mode)  # mkstemp creates 0600; keep the existing file's mode or the usual default
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class PushError(RuntimeError):
    """The card could not be pushed to the Hub; nothing was uploaded."""


def check_push_possible(repo_id: str, token: str | None = None) -> str:
    """Check, without the network, that a push can be attempted: valid repo id, online mode, a token.

    Returns:
        The token to use.

    Raises:
        PushError: invalid repo id, `HF_HUB_OFFLINE` set, or no token (`hf auth login` / `HF_TOKEN`).
    """
    import huggingface_hub
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise PushError(f"--push {repo_id!r} is not a valid Hub repo id (expected 'owner/name'): {error}") from error
    offline = getattr(huggingface_hub, "is_offline_mode", None)
    if offline() if offline is not None else huggingface_hub.constants.HF_HUB_OFFLINE:
        raise PushError("cannot push: the Hugging Face Hub is in offline mode (HF_HUB_OFFLINE is set); unset it.")
    token = token or huggingface_hub.get_token()
    if not token:
        raise PushError("cannot push: not logged in to the Hugging Face Hub. Run `hf auth login` or set HF_TOKEN.")
    return token


def fetch_existing_card(repo_id: str, token: str) -> str | None:
    """The text of `repo_id`'s README.md on the Hub, or None when the repo has none.

    Raises:
        PushError: the repo does not exist or is not readable, or the Hub cannot be reached.
    """
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return str(ModelCard.load(repo_id, token=token))
    except LocalEntryNotFoundError as error:  # the Hub was not reached (subclass of EntryNotFoundError)
        raise PushError(f"cannot push: could not reach the Hugging Face Hub to read {repo_id}'s card "
                        f"({error}).") from error
    except EntryNotFoundError:  # reached the Hub: the repo has no README.md yet
        return None
    except RepositoryNotFoundError as error:
        raise PushError(f"cannot push: repository {repo_id} does not exist or is not accessible with this "
                        "token (create it first: `hf repo create`).") from error
    except Exception as error:  # connection errors come from httpx/requests/OS depending on the version
        raise PushError(f"cannot push: could not reach the Hugging Face Hub to read {repo_id}'s card "
                        f"({type(error).__name__}: {error}).") from error


def push_card(card: ModelCard, repo_id: str, token: str, commit_message: str = "Update dual-cache results") -> str:
    """Validate the card with the Hub (`ModelCard.validate`) and upload it as README.md in a single commit.

    Returns:
        The commit URL.

    Raises:
        PushError: validation refused, authentication failed, or the Hub cannot be reached; the upload is one
            commit, so either the whole card is on the Hub or nothing changed.
    """
    try:
        return str(card.push_to_hub(repo_id, token=token, commit_message=commit_message))
    except ValueError as error:
        raise PushError(f"the Hub refused the card's metadata: {error}") from error
    except Exception as error:
        raise PushError(f"push to {repo_id} failed, nothing was uploaded ({type(error).__name__}: {error}).") from error
