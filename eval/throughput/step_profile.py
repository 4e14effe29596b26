"""Where a dual decode step's time goes, next to a dense step, on the demo's prompt (embedded model, CPU).

    python -m dual_cache.eval.throughput.step_profile --tokens 4096 --new 32 --out results/demo-step-profile
    python -m dual_cache.eval.throughput.step_profile --prompt random --tokens 8176 --batch 4 --new 16 --threads 2

`--prompt needle` (the default): the demo's word-needle prompt, the same for every sequence of the batch; `--prompt
random`: `--tokens` random token ids per sequence (seeded; clear of the special tokens at either end of a real
vocabulary).

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
import sys
import time

import torch

from ...cli.help_format import DefaultsHelpFormatter


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


def prompt_ids(tokenizer, vocab_size: int, tokens: int, batch: int, prompt: str, seed: int) -> torch.Tensor:
    """The profiled prompt: (batch, length) int64 token ids; `prompt` is "needle" (the demo's chat-formatted word
    needle, length a little over `tokens`, repeated per sequence) or "random" (`tokens` ids per sequence, drawn
    from [low, vocab_size - low) with low = min(100, vocab_size // 4); `tokenizer` unused)."""
    if prompt == "random":
        low = min(100, vocab_size // 4)  # clear of the special tokens at either end of a real vocabulary
        return torch.randint(low, vocab_size - low, (batch, tokens), generator=torch.Generator().manual_seed(seed))
    from ...model.chat import format_chat
    from ...model.needle_prompt import make_needle_prompt

    text = make_needle_prompt(tokenizer, tokens, seed=seed).text
    return torch.tensor([format_chat(tokenizer, text)]).expand(batch, -1).contiguous()


def profile(tokens: int, new: int, seed: int = 0, batch: int = 1, prompt: str = "needle") -> dict:
    """Profile the embedded model (`dual_cache.load_default_model`) on the prompt `prompt_ids` builds."""
    import dual_cache

    model, tokenizer = dual_cache.load_default_model()
    return profile_model(model, prompt_ids(tokenizer, model.config.vocab_size, tokens, batch, prompt, seed), new)


def profile_model(model, ids: torch.Tensor, new: int, budget: int = 256) -> dict:
    """Time `new` greedy tokens after `ids` ((batch, length) int64) with the default cache and with the dual cache
    (`budget` tokens per KV head, defaults otherwise); returns the row `table` prints (milliseconds per step)."""
    import dual_cache
    from transformers import DynamicCache

    dense = _StepTimes()
    mask = torch.ones_like(ids)
    model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, streamer=dense)
    # a dense forward of two tokens after the prompt, timed alone (the cache is cropped back each time)
    cache = DynamicCache()
    with torch.inference_mode():
        model(ids, past_key_values=cache, use_cache=True)
        two, one = [], []
        for _ in range(8):
            for width, out in ((2, two), (1, one)):
                start = time.perf_counter()
                model(ids[:, -width:], past_key_values=cache, use_cache=True,
                      position_ids=torch.arange(ids.shape[1], ids.shape[1] + width)[None].expand(len(ids), -1))
                out.append(time.perf_counter() - start)
                cache.crop(-width)
    dual = _StepTimes()
    cache = dual_cache.DualDecoderCache(model.config, budget=budget)
    try:
        model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, streamer=dual, cache=cache)
        stats = cache.stats()
    finally:
        cache.close()
    steps = max(stats["steps"], 1)
    per = lambda key: 1e3 * stats[key] / steps  # noqa: E731
    dual_ms = dual.step_ms()
    return {
        "prompt_tokens": int(ids.shape[1]), "batch": int(ids.shape[0]), "new_tokens": new,
        "dense_step_ms": dense.step_ms(), "dense_one_token_forward_ms": 1e3 * statistics.median(one),
        "dense_two_token_forward_ms": 1e3 * statistics.median(two), "dual_step_ms": dual_ms,
        "retrieval_ms_per_step (host threads)": per("retrieval_seconds"), "waited_ms_per_step": per("wait_seconds"),
        "repair_ms_per_step": per("repair_seconds"), "repaired_steps": int(stats["repaired_steps"]),
        "steps": int(stats["steps"]),
        "spec_hit_rate": stats["spec_hits"] / max(stats["spec_steps"], 1),
        "dual_minus_two_token_forward_ms": dual_ms - 1e3 * statistics.median(two),
    }


def table(row: dict) -> str:
    lines = [f"Decode step ({row['prompt_tokens']} prompt tokens, batch {row['batch']}, {row['new_tokens']} new, "
             "embedded SmolLM2-135M fp32, this CPU), median ms per step:", "", "| part | ms |", "|---|---|"]
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
    parser.add_argument("--batch", type=int, default=1, help="sequences")
    parser.add_argument("--prompt", choices=["needle", "random"], default="needle", help="prompt kind")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--out", default=None, help="output path without extension (.json and .md)")
    args = parser.parse_args(argv)
    if args.tokens < 128 or args.new < 6 or args.batch < 1 or (args.threads is not None and args.threads < 1):
        parser.error("--tokens must be >= 128, --new >= 6, --batch >= 1 and --threads >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    row = profile(args.tokens, args.new, args.seed, args.batch, args.prompt)
    text = table(row)
    print(text)
    if args.out:
        with open(args.out + ".json", "w", encoding="utf-8") as handle:
            json.dump(row, handle, indent=2)
        with open(args.out + ".md", "w", encoding="utf-8") as handle:
            handle.write(text + "\n`python -m dual_cache.eval.throughput.step_profile " + " ".join(argv or sys.argv[1:])
                         + "`\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
