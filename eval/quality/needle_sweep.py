"""Word-needle sweep on a real model (default: the embedded one): how many needles dense and each dual
configuration answer (issue 2's quality target: at 4K, budget 256, as many correct answers as dense).

    python -m dual_cache.eval.quality.needle_sweep --tokens 4096 --seeds 0-15 --budget 256 --out results/needle/4k
    python -m dual_cache.eval.quality.needle_sweep --model gemma3-270m --tokens 16384 --seeds 0-7 --out results/needle/gemma-16k

Writes `<out>.jsonl` (one row per seed: the answer and each method's text and correctness) and `<out>.md` (the
table and the counts). Prompts are `dual_cache.model.needle_prompt.make_needle_prompt` ("The special magic number
for <word> is: <7 digits>" inside a real document), greedy decoding, 24 new tokens; an answer is correct when it
contains the digits.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from ...cli.help_format import DefaultsHelpFormatter
from ...config import DualDecoderConfig
from ...model.chat import format_chat
from ...model.loading import model_display_name
from ...model.needle_prompt import make_needle_prompt
from ..outputs import default_out, write_rows_and_table
from .methods import cache_config

METHODS = ("dense", "dual", "dual-no-drift", "dual-no-repair", "dual-none", "dual-exact", "dual-lowbit",
           "oracle")  # names of eval/quality/methods.py's registry
NEW_TOKENS = 24  # greedy tokens decoded per prompt


def parse_seeds(text: str) -> list[int]:
    """`"0-15"` → 0..15, `"0,3,7"` → [0, 3, 7]; raises `ValueError` on anything else."""
    try:
        if "-" in text:
            first, last = (int(part) for part in text.split("-", 1))
            seeds = list(range(first, last + 1))
        else:
            seeds = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--seeds must look like 0-15 or 0,3,7; got {text!r}.") from None
    if not seeds:
        raise ValueError(f"--seeds range {text!r} is empty; write it low-high, e.g. 0-15.")
    if min(seeds) < 0:
        raise ValueError(f"--seeds must be >= 0; got {text!r}.")
    return seeds


def threads_arg(text: str) -> int:
    """`--threads` value: a positive int (torch intra-op threads); an argparse error otherwise."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}")
    return value


def json_object(text: str) -> dict:
    """`--options` value: a JSON object (other `DualDecoderConfig` fields); an argparse error otherwise (the
    fields themselves are checked by `DualDecoderConfig` before the model loads)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"must be a JSON object, e.g. '{{\"lowbit_factor\": 8}}' ({error})")
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def load_tool_model(threads: int | None, name: str | None = None):
    """`(model, tokenizer)` of `name` (see `dual_cache.load_model`: None is the embedded default model, or a named
    model such as `"gemma3-270m"`, a folder or a `.gguf` file), after setting torch's intra-op threads (None:
    unchanged)."""
    if threads is not None:
        torch.set_num_threads(threads)
    from ...model.loading import load_model

    return load_model(name)


def check_positions(model, tokens: int) -> None:
    """Raise `ValueError` (naming the largest usable `--tokens`) when a `tokens`-token prompt plus the `NEW_TOKENS`
    decoded ones would pass the model's `max_position_embeddings` (checked before any prefill)."""
    positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if positions is not None and tokens + NEW_TOKENS > positions:
        raise ValueError(f"--tokens {tokens} plus the {NEW_TOKENS} decoded tokens exceeds the model's {positions} "
                         f"positions; use --tokens {positions - NEW_TOKENS} or less.")


def run(model, tokenizer, tokens: int, seeds: list[int], budget: int, methods: list[str], log=print,
        options: dict | None = None) -> list[dict]:
    """One row per seed: `seed`, `answer`, `prompt_tokens`, and per method `<m>` (bool) and `<m>_text`.
    `options`: other `DualDecoderConfig` fields for every dual method (e.g. `{"lowbit_factor": 8}`)."""
    rows = []
    for seed in seeds:
        prompt = make_needle_prompt(tokenizer, tokens, seed=seed)
        ids = torch.tensor([format_chat(tokenizer, prompt.text)])
        row = {"seed": seed, "answer": prompt.answer, "prompt_tokens": ids.shape[1]}
        for name in methods:
            config = cache_config(name, budget)
            kwargs = {} if config is None else {
                "cache_implementation": "dual", "cache_config": {"n_sink": 4, "window": 64, **config, **(options or {})}
            }
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 **kwargs)
            text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            row[name], row[f"{name}_text"] = prompt.answer in text, text
        rows.append(row)
        log(json.dumps(row))
    return rows


def markdown(rows: list[dict], methods: list[str], tokens: int, budget: int,
             model: str = "embedded SmolLM2-135M") -> str:
    """The per-seed table and the correct-answer counts (`model`: the name written in the caption)."""
    head = "| seed | answer | " + " | ".join(methods) + " |"
    lines = [f"Word needle at {tokens} tokens, budget {budget} (sink 4, window 64), greedy, {model}.", "",
             head, "|" + "---|" * (len(methods) + 2)]
    for row in rows:
        cells = [("✓ " if row[m] else "✗ ") + repr(row[f"{m}_text"].strip()[-24:]) for m in methods]
        lines.append(f"| {row['seed']} | {row['answer']} | " + " | ".join(cells) + " |")
    counts = ", ".join(f"{m} {sum(r[m] for r in rows)}/{len(rows)}" for m in methods)
    return "\n".join(lines + ["", f"Correct: {counts}."]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dual-decoder needle", description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096, help="prompt length (tokens)")
    parser.add_argument("--seeds", default="0-15", help="e.g. 0-15 or 0,3,7")
    parser.add_argument("--budget", type=int, default=DualDecoderConfig.budget,
                        help="dual budget (tokens per KV head per layer)")
    parser.add_argument("--methods", nargs="+", default=["dense", "dual", "dual-no-repair"], choices=list(METHODS),
                        help="eval methods to answer each prompt with (eval/quality/methods.py)")
    parser.add_argument("--threads", type=threads_arg, default=None, help="torch intra-op threads")
    parser.add_argument("--options", type=json_object, default={},
                        help="other DualDecoderConfig fields for every dual method, as JSON, e.g. "
                             "'{\"lowbit_factor\": 8}' (default: none)")
    parser.add_argument("--model", default=None, help="named model (gemma3-270m, smollm2-135m), folder or .gguf "
                        "(default: the embedded SmolLM2-135M)")
    parser.add_argument("--out", default=None,
                        help="output path without extension, writes .jsonl and .md (default: a new "
                             "eval-results/needle/<time>; results/ only when --out names it)")
    args = parser.parse_args(argv)
    try:
        seeds = parse_seeds(args.seeds)
        if args.tokens < 256 or args.budget < 1:
            raise ValueError("--tokens must be >= 256 and --budget >= 1.")
        for name in args.methods:  # every option checked before the model loads
            config = cache_config(name, args.budget)
            if config is not None:
                DualDecoderConfig(**{**config, **args.options})
    except TypeError as error:  # a field DualDecoderConfig does not have
        print(f"error: --options: {error}", file=sys.stderr)
        return 2
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    model, tokenizer = load_tool_model(args.threads, args.model)
    try:
        check_positions(model, args.tokens)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    rows = run(model, tokenizer, args.tokens, seeds, args.budget, args.methods, options=args.options)
    table = markdown(rows, args.methods, args.tokens, args.budget, model_display_name(args.model))
    if args.options:
        table = table.replace("\n", f" Dual options: `{json.dumps(args.options)}`.\n", 1)
    print(table)
    paths = write_rows_and_table(args.out or default_out("needle"), rows, table, jsonl=True)
    print("wrote " + ", ".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
