"""Hand-off to and from `kvpress_runner.py` (kvpress presses, run in their own virtual environment).

`export_prompts` writes the harness's generation prompts (token ids, references, answer length, scoring spec);
`merge_kvpress` scores the runner's predictions with the same local metrics and appends them, in the harness's row
schema, to the results JSONL (skipping rows already there), so kvpress presses land in the same table and plots.
"""

from __future__ import annotations

import json
import os

from ...config import DualDecoderConfig
from ..quality.harness import RowWriter, read_rows, row_key, score_prediction


def export_prompts(items, path: str, model_name: str) -> None:
    """Write one JSON line per `harness.GenerationItem`: `dataset`, `task`, `length`, `sample`, `input_ids`,
    `references`, `max_new_tokens`, `generate_kwargs`, `metric`, `scoring`, `model`, and the dual cache's `n_sink`
    and `window` (`DualDecoderConfig`'s: the runner, which cannot import dual_cache, keeps that many entries besides
    each budget)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for item in items:
            handle.write(json.dumps({
                "dataset": item.dataset, "task": item.task, "length": item.length, "sample": item.sample,
                "input_ids": item.input_ids, "references": item.references, "max_new_tokens": item.max_new_tokens,
                "generate_kwargs": item.generate_kwargs,
                "metric": item.metric, "scoring": item.scoring, "model": model_name,
                "n_sink": DualDecoderConfig.n_sink, "window": DualDecoderConfig.window,
            }, ensure_ascii=False) + "\n")


def _read_jsonl(path: str) -> list[dict]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist.")
    return read_rows(path)


def merge_kvpress(prompts_path: str, kvpress_path: str, out_path: str) -> int:
    """Score the runner's rows against the exported prompts and append them to `out_path`; returns rows added.

    Raises:
        FileNotFoundError: a missing input; ValueError: invalid JSON, a runner row whose prompt is not in the
            prompts file, or a row missing `prediction` / `method` / `budget`.
    """
    prompts = {(p["dataset"], p["task"], p["length"], p["sample"]): p for p in _read_jsonl(prompts_path)}
    runs = _read_jsonl(kvpress_path)
    writer = RowWriter(out_path, resume=True)
    added = 0
    for number, run in enumerate(runs, start=1):
        missing = [k for k in ("dataset", "task", "length", "sample", "method", "budget", "prediction") if k not in run]
        if missing:
            raise ValueError(f"{kvpress_path}:{number}: missing {missing}.")
        key = (run["dataset"], run["task"], run["length"], run["sample"])
        prompt = prompts.get(key)
        if prompt is None:
            raise ValueError(f"{kvpress_path}:{number}: no exported prompt for {key} in {prompts_path}.")
        row = {
            "dataset": run["dataset"], "task": run["task"], "method": run["method"], "budget": run["budget"],
            "length": run["length"], "sample": run["sample"], "model": prompt["model"],
        }
        if writer.has(row_key(row)):
            continue
        row.update(
            score=score_prediction(prompt["scoring"], run["prediction"], prompt["references"]), metric=prompt["metric"],
            prediction=run["prediction"], reference=prompt["references"], device_bytes=run.get("device_bytes"),
            prompt_tokens=len(prompt["input_ids"]), new_tokens=run.get("new_tokens"), seconds=run.get("seconds"),
            cache_config=None, compression_ratio=run.get("compression_ratio"),
        )
        writer.write(row)
        added += 1
    return added
