"""Run kvpress presses on the harness's exported prompts, in a separate virtual environment.

kvpress pins the transformers version it supports, which may differ from dual-cache's, so this script imports
neither `dual_cache` nor anything outside kvpress / transformers / torch. It reads the prompts written by
`dual-decoder eval export-prompts` and writes one prediction row per (prompt, press, budget); scoring and merging
into the main results happen back in the main environment with `dual-decoder eval merge-kvpress`.

    python -m venv .venv-kvpress && .venv-kvpress/bin/pip install kvpress gguf
    .venv-kvpress/bin/python eval/card/kvpress_runner.py --prompts prompts.jsonl --model PATH_OR_ID \\
        [--gguf-file SmolLM2-135M-Instruct.Q4_1.gguf] --presses snapkv streaming expected_attention \\
        --budgets 64 128 256 512 --out kvpress.jsonl

Budget mapping: a press keeps `n_sink + window + budget` entries per KV head of the prompt — the entries the
dual cache makes resident per step — i.e. `compression_ratio = 1 - (n_sink + window + budget) / prompt_tokens`
(0 when the prompt is shorter). `n_sink` and `window` are the dual cache's, as the prompts file carries them
(`DualDecoderConfig`'s defaults, written by `export-prompts`); `--n-sink` / `--window` override them. The whole
prompt, question included, is compressed at prefill through `with press(model): model.generate(...)` (kvpress's own
pipeline can keep the question uncompressed; including it favours question-aware presses such as SnapKV, so these
rows are an optimistic bound for eviction).
Output rows: `dataset`, `task`, `length`, `sample`, `method` (`kvpress-<press>`), `budget`, `prediction` (decoded
with the model's tokenizer, special tokens dropped, not stripped, as the main harness),
`device_bytes` (K/V bytes of the compressed cache after generation), `compression_ratio`, `new_tokens`, `seconds`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

PRESSES = {"snapkv": "SnapKVPress", "streaming": "StreamingLLMPress", "expected_attention": "ExpectedAttentionPress"}


def compression_ratio(prompt_tokens: int, budget: int, n_sink: int, window: int) -> float:
    """Fraction of the prompt's entries a press removes so that `n_sink + window + budget` remain (0 to < 1)."""
    keep = n_sink + window + budget
    return 0.0 if prompt_tokens <= keep else 1.0 - keep / prompt_tokens


def make_press(name: str, ratio: float, n_sink: int):
    """The kvpress press `name` (a key of `PRESSES`) at `compression_ratio=ratio`."""
    import kvpress

    cls = getattr(kvpress, PRESSES[name])
    if name == "streaming":
        return cls(compression_ratio=ratio, n_sink=n_sink)
    return cls(compression_ratio=ratio)


def cache_bytes(cache) -> int:
    """Sum of the K/V tensor bytes of a transformers cache (any version's `layers` or legacy tuples)."""
    total = 0
    layers = getattr(cache, "layers", None)
    if layers is not None:
        for layer in layers:
            for name in ("keys", "values"):
                tensor = getattr(layer, name, None)
                total += 0 if tensor is None else tensor.numel() * tensor.element_size()
        return total
    for key_cache in (getattr(cache, "key_cache", []), getattr(cache, "value_cache", [])):
        total += sum(t.numel() * t.element_size() for t in key_cache)
    return total


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", required=True, help="JSONL from `dual-decoder eval export-prompts`")
    parser.add_argument("--model", required=True, help="Hub id or folder (the same model as the main run)")
    parser.add_argument("--gguf-file", default=None, help="GGUF file inside --model, for GGUF checkpoints")
    parser.add_argument("--presses", nargs="+", default=list(PRESSES), choices=list(PRESSES))
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--n-sink", type=int, default=None,
                        help="sink entries a press keeps besides the budget (default: the prompts file's)")
    parser.add_argument("--window", type=int, default=None,
                        help="window entries a press keeps besides the budget (default: the prompts file's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if any(b < 0 for b in args.budgets):
        parser.error("--budgets must be >= 0")
    if not os.path.isfile(args.prompts):
        parser.error(f"{args.prompts} does not exist")

    with open(args.prompts, encoding="utf-8") as handle:
        prompts = [json.loads(line) for line in handle if line.strip()]
    for prompt in prompts:  # the dual cache's sink and window, as exported, unless given here
        for name, given in (("n_sink", args.n_sink), ("window", args.window)):
            if given is not None:
                prompt[name] = given
            elif name not in prompt:
                parser.error(f"{args.prompts} has no `{name}` (written before export-prompts recorded the dual "
                             f"cache's sink and window): give --n-sink and --window")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": args.gguf_file} if args.gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(args.model, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, **kwargs).to(args.device).eval()
    done = set()
    if os.path.exists(args.out):
        with open(args.out, encoding="utf-8") as handle:
            for line in handle:
                if line.strip():
                    r = json.loads(line)
                    done.add((r["dataset"], r["task"], r["length"], r["sample"], r["method"], r["budget"]))
    with open(args.out, "a", encoding="utf-8") as out:
        for prompt in prompts:
            ids = torch.tensor([prompt["input_ids"]], device=args.device)
            for name in args.presses:
                for budget in args.budgets:
                    method = f"kvpress-{name}"
                    key = (prompt["dataset"], prompt["task"], prompt["length"], prompt["sample"], method, budget)
                    if key in done:
                        continue
                    ratio = compression_ratio(ids.shape[1], budget, prompt["n_sink"], prompt["window"])
                    press = make_press(name, ratio, prompt["n_sink"])
                    start = time.perf_counter()
                    with torch.inference_mode(), press(model):
                        result = model.generate(
                            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                            max_new_tokens=prompt["max_new_tokens"], return_dict_in_generate=True,
                            **prompt.get("generate_kwargs", {}),
                        )
                    new = result.sequences[0, ids.shape[1]:].tolist()
                    cache = getattr(result, "past_key_values", None) or getattr(result, "cache", None)
                    row = {
                        "dataset": prompt["dataset"], "task": prompt["task"], "length": prompt["length"],
                        "sample": prompt["sample"], "method": method, "budget": budget,
                        "prediction": tokenizer.decode(new, skip_special_tokens=True),
                        "device_bytes": cache_bytes(cache) if cache is not None else None,
                        "compression_ratio": ratio, "new_tokens": len(new),
                        "seconds": round(time.perf_counter() - start, 3),
                    }
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    print(f"{method}@{budget} {prompt['task']}@{prompt['length']}#{prompt['sample']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
