"""Where a dual decode step's time goes, next to a dense step, on the demo's prompt (embedded model, CPU).

    python -m dual_cache.eval.throughput.step_profile --tokens 4096 --new 32 --out results/demo-step-profile

Rows (milliseconds per decode step, medians of the timed steps): the dense step (one token); a dense forward of two
tokens over the same prompt (what the second row of a two-token forward costs without any of the cache's work); the
dual step and its difference to the two-token forward; and, from the dual cache's own counters
(`DualDecoderCache.stats()`), host retrieval (select + gather, on the retrieval threads), the time the forward waited
for it, and synchronous miss / drift repairs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ...help_format import DefaultsHelpFormatter


class _StepTimes:
    """A streamer recording when each generated token arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def step_ms(self) -> float:
        gaps = [b - a for a, b in zip(self.times[2:], self.times[3:])]  # after the prompt and the first token
        return 1e3 * statistics.median(gaps)


def profile(tokens: int, new: int, seed: int = 0) -> dict:
    import dual_cache
    from transformers import DynamicCache

    from ..quality.needle import make_needle_prompt, format_chat

    model, tokenizer = dual_cache.load_default_model()
    prompt = make_needle_prompt(tokenizer, tokens, seed=seed)
    ids = torch.tensor([format_chat(tokenizer, prompt.text)])
    dense = _StepTimes()
    model.generate(ids, max_new_tokens=new, do_sample=False, streamer=dense)
    # a dense forward of two tokens after the prompt, timed alone (the cache is cropped back each time)
    cache = DynamicCache()
    with torch.inference_mode():
        model(ids, past_key_values=cache, use_cache=True)
        two, one = [], []
        for _ in range(8):
            for width, out in ((2, two), (1, one)):
                start = time.perf_counter()
                model(ids[:, -width:], past_key_values=cache, use_cache=True,
                      position_ids=torch.arange(ids.shape[1], ids.shape[1] + width)[None])
                out.append(time.perf_counter() - start)
                cache.crop(-width)
    dual = _StepTimes()
    cache = dual_cache.DualDecoderCache(model.config, budget=256)
    model.generate(ids, max_new_tokens=new, do_sample=False, streamer=dual, cache=cache)
    stats = cache.stats()
    cache.close()
    steps = max(stats["steps"], 1)
    per = lambda key: 1e3 * stats[key] / steps  # noqa: E731
    dual_ms = dual.step_ms()
    return {
        "prompt_tokens": int(ids.shape[1]), "new_tokens": new,
        "dense_step_ms": dense.step_ms(), "dense_one_token_forward_ms": 1e3 * statistics.median(one),
        "dense_two_token_forward_ms": 1e3 * statistics.median(two), "dual_step_ms": dual_ms,
        "retrieval_ms_per_step (host threads)": per("retrieval_seconds"), "waited_ms_per_step": per("wait_seconds"),
        "repair_ms_per_step": per("repair_seconds"), "repaired_steps": int(stats["repaired_steps"]), "steps": int(stats["steps"]),
        "spec_hit_rate": stats["spec_hits"] / max(stats["spec_steps"], 1),
        "dual_minus_two_token_forward_ms": dual_ms - 1e3 * statistics.median(two),
    }


def table(row: dict) -> str:
    lines = [f"Decode step on the demo's prompt ({row['prompt_tokens']} tokens, {row['new_tokens']} new, embedded "
             "SmolLM2-135M fp32, this CPU), median ms per step:", "", "| part | ms |", "|---|---|"]
    for key in ("dense_step_ms", "dense_one_token_forward_ms", "dense_two_token_forward_ms", "dual_step_ms",
                "retrieval_ms_per_step (host threads)", "waited_ms_per_step", "repair_ms_per_step",
                "dual_minus_two_token_forward_ms"):
        lines.append(f"| {key.replace('_', ' ')} | {row[key]:.1f} |")
    lines += ["", f"Repaired steps {row['repaired_steps']} of {row['steps']}; speculation hit rate "
              f"{row['spec_hit_rate']:.0%}. The two-token forward includes dense attention over the whole prompt, "
              "which the dual step replaces by attention over sink + selection + window; waiting for retrieval and "
              "repairs are the dual cache's own work on top."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dual_cache.eval.throughput.step_profile",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096, help="prompt tokens")
    parser.add_argument("--new", type=int, default=32, help="new tokens (timed steps: new - 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="output path without extension (.json and .md)")
    args = parser.parse_args(argv)
    if args.tokens < 128 or args.new < 6:
        parser.error("--tokens must be >= 128 and --new >= 6")
    row = profile(args.tokens, args.new, args.seed)
    text = table(row)
    print(text)
    if args.out:
        with open(args.out + ".json", "w", encoding="utf-8") as handle:
            json.dump(row, handle, indent=2)
        with open(args.out + ".md", "w", encoding="utf-8") as handle:
            handle.write(text + f"\n`python -m dual_cache.eval.throughput.step_profile --tokens {args.tokens} --new {args.new}`\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
