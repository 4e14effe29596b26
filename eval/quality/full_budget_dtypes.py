"""Full-budget dual cache vs the default cache (sdpa and eager), greedy, on six-layer tiny random-weight Llamas.

    python -m dual_cache.eval.quality.full_budget_dtypes --dtype float32 --seeds 20
    python -m dual_cache.eval.quality.full_budget_dtypes --dtype bfloat16 --seeds 10

Per seed s (0 to `--seeds` - 1): a random-weight Llama (6 full-attention layers, 4 query / 2 KV heads, head_dim 16,
vocabulary 96, weights from `torch.manual_seed(s)`) and a `--prompt`-token random prompt (seed 1000 + s); the
default cache decodes `--new` greedy tokens with sdpa and with eager attention, the dual cache at full budget
(`budget=4096, window=16`: every entry resident) with sdpa. Counts the prompts whose new tokens differ between two
paths and prints one markdown table row: `| dtype | sdpa-eager | dual-sdpa | dual-eager |`.
"""

from __future__ import annotations

import argparse
import sys

import torch

from ...cli.help_format import DefaultsHelpFormatter

PAIRS = ("sdpa-eager", "dual-sdpa", "dual-eager")


def random_llama(seed: int, layers: int = 6):
    """A random-weight LlamaForCausalLM (fp32, eval mode): `layers` full-attention layers, 4 query / 2 KV heads of 16
    channels, vocabulary 96, weights drawn after `torch.manual_seed(seed)`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
                         eos_token_id=None, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def count_differences(dtype: torch.dtype, seeds: int, prompt: int = 300, new: int = 40) -> dict[str, int]:
    """Per pair of paths (`PAIRS`), the number of the `seeds` prompts whose `new` greedy tokens differ."""
    import dual_cache  # noqa: F401  (registers cache_implementation="dual")

    differ = dict.fromkeys(PAIRS, 0)
    for seed in range(seeds):
        model = random_llama(seed).to(dtype)
        ids = torch.randint(3, 96, (1, prompt), generator=torch.Generator().manual_seed(1000 + seed))
        out = {}
        for impl in ("sdpa", "eager"):
            model.set_attn_implementation(impl)
            out[impl] = model.generate(ids, max_new_tokens=new, do_sample=False)
        model.set_attn_implementation("sdpa")
        out["dual"] = model.generate(ids, max_new_tokens=new, do_sample=False, cache_implementation="dual",
                                     cache_config={"budget": 4096, "window": 16})
        for pair in PAIRS:
            first, second = pair.split("-")
            differ[pair] += not torch.equal(out[first], out[second])
    return differ


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dual_cache.eval.quality.full_budget_dtypes",
                                     description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--seeds", type=int, default=20, help="prompts (and models): seeds 0 to N - 1")
    parser.add_argument("--prompt", type=int, default=300, help="prompt tokens")
    parser.add_argument("--new", type=int, default=40, help="new tokens")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.new < 1 or args.prompt < 1 or args.prompt + args.new > 4096:
        parser.error("--seeds, --prompt and --new must be >= 1, and --prompt + --new at most 4096 (the full budget)")
    differ = count_differences(getattr(torch, args.dtype), args.seeds, args.prompt, args.new)
    print(f"| {args.dtype} | " + " | ".join(f"{count}/{args.seeds}" for count in differ.values()) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
