"""What one more method costs when the methods share each prompt's prefill (issue 45), measured on RULER prompts.

For each prompt, every method runs stand-alone (`generate()` with its own cache: prefill + decode) and then from one
shared prefill (`shared_prefill.SharedPrefill`: the prompt but its last token prefilled once, each method continuing
its own copy); the order of the two alternates from prompt to prompt. Each method's tokens must be the same both
ways (the run fails otherwise). Reported per method: the stand-alone seconds, the seconds the method adds to a shared
run (its copy of the prefix, the last prompt token, its decode) and their ratio; and the shared prefill's seconds.

    python -m dual_cache.eval.quality.shared_prefill_cost --tasks niah_single_1 niah_multivalue vt cwe \\
        --length 4096 --samples 2 --methods dense dual@256 quest@256 streaming@256 oracle@256 --threads 1 \\
        --out results/eval/ruler-table/shared-prefill-cost
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from statistics import mean

from ...cli.help_format import DefaultsHelpFormatter


def measure(model, tokenizer, items, methods, log=print) -> list[dict]:
    """One row per (item, method): `stand_alone_seconds`, `added_seconds`, `prefill_seconds`, `new_tokens`.

    Raises:
        AssertionError: a method's tokens differ between its stand-alone and its shared-prefill run.
    """
    from .generation import generate
    from .shared_prefill import SharedPrefill

    rows = []
    for index, item in enumerate(items):
        alone, added = {}, {}

        def run_alone():
            for method in methods:
                alone[method.label] = generate(model, tokenizer, item.input_ids, method, item.max_new_tokens)

        def run_shared():
            with SharedPrefill(model, item.input_ids, item.max_new_tokens) as shared:
                for method in methods:
                    start = time.perf_counter()
                    result = generate(model, tokenizer, item.input_ids, method, item.max_new_tokens,
                                      cache=shared.cache_for(method))
                    added[method.label] = (result, time.perf_counter() - start)
                return shared.seconds

        if index % 2:
            prefill = run_shared()
            run_alone()
        else:
            run_alone()
            prefill = run_shared()
        for method in methods:
            a, (s, seconds) = alone[method.label], added[method.label]
            assert a.new_ids == s.new_ids, f"{method.label} on {item.task}#{item.sample}: {a.text!r} vs {s.text!r}"
            rows.append({"task": item.task, "length": item.length, "sample": item.sample, "method": method.label,
                         "new_tokens": len(a.new_ids), "stand_alone_seconds": round(a.seconds, 3),
                         "added_seconds": round(seconds, 3), "prefill_seconds": round(prefill, 3)})
            log(f"{item.task}#{item.sample} {method.label}: alone {a.seconds:.1f} s, added {seconds:.1f} s "
                f"(prefill {prefill:.1f} s), {len(a.new_ids)} tokens")
    return rows


def summary(rows: list[dict]) -> str:
    """Markdown: per method the mean stand-alone seconds, the mean seconds it adds to a shared run and their ratio;
    then the whole grid both ways."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    prompts = {(r["task"], r["sample"]): r["prefill_seconds"] for r in rows}
    lines = ["| method | stand-alone s | added to a shared run, s | added / stand-alone | new tokens |",
             "|---|---|---|---|---|"]
    for m in methods:
        rs = [r for r in rows if r["method"] == m]
        alone, added = mean(r["stand_alone_seconds"] for r in rs), mean(r["added_seconds"] for r in rs)
        lines.append(f"| {m} | {alone:.1f} | {added:.1f} | {added / alone:.0%} | "
                     f"{mean(r['new_tokens'] for r in rs):.0f} |")
    total_alone = sum(r["stand_alone_seconds"] for r in rows)
    total_shared = sum(prompts.values()) + sum(r["added_seconds"] for r in rows)
    lines += ["", f"{len(prompts)} prompts × {len(methods)} methods: stand-alone {total_alone:.0f} s, shared "
                  f"{total_shared:.0f} s (of it the shared prefills {sum(prompts.values()):.0f} s, "
                  f"{mean(prompts.values()):.1f} s a prompt). Every method's tokens equal its stand-alone run's."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--model", default=None, help="named model, Hub id, folder or .gguf (default: embedded)")
    parser.add_argument("--tasks", nargs="+", default=["niah_single_1", "niah_multivalue", "vt", "cwe"])
    parser.add_argument("--length", type=int, default=4096, help="RULER length (tokens)")
    parser.add_argument("--samples", type=int, default=1, help="samples per task")
    parser.add_argument("--methods", nargs="+",
                        default=["dense", "dual@256", "quest@256", "streaming@256", "oracle@256"])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--out", required=True, help="writes OUT.jsonl (rows) and OUT.md (summary)")
    args = parser.parse_args(argv)

    import torch

    from ...model.loading import load_model
    from . import harness
    from .chat_format import prompt_format
    from .methods import parse_method

    methods = [parse_method(spec, 256) for spec in args.methods]
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    items = harness.ruler_items(tokenizer, args.tasks, [args.length], args.samples, fmt=prompt_format(tokenizer))
    rows = measure(model, tokenizer, sorted(items, key=lambda item: item.sample), methods)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".jsonl", "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in rows)
    text = summary(rows)
    arguments = sys.argv[1:] if argv is None else argv
    command = "python -m dual_cache.eval.quality.shared_prefill_cost " + " ".join(arguments)
    with open(args.out + ".md", "w", encoding="utf-8") as handle:
        handle.write(f"# Shared prefill: what one more method costs\n\n`{command}`\n\n{text}")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
