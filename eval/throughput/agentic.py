"""Agentic use on the embedded model: questions over one shared document, and a conversation on one cache.

    python -m dual_cache.eval.throughput.agentic --tokens 8192 --questions 8 --out results/agentic/embedded-8k

1. **Shared document.** A document of `--tokens` tokens (the Python reference,
   `dual_cache.model.needle_prompt.reference_document`) holds one word needle per question ("The special magic
   number for <word> is: <7 digits>."). Each question is asked as one user turn `document + question`.
   *Re-prefill*: one `generate()` per question, each with a fresh dual cache
   (the whole turn prefilled every time). *Shared*: the document's tokens (the turns' common token prefix) are
   prefilled once into a `DualDecoderCache`, then one `generate()` decodes every question as a batch that continues
   it (the document stored once on the host; each sequence selects its own entries). Reported: seconds end to end,
   host bytes, and the answers (identical across the two, and correct or not).
2. **Conversation.** Three turns on one cache (each turn: the previous sequences + a new question), against a fresh
   cache re-prefilling the whole conversation each turn: the answers, and the prefill tokens each did.

Budget 256, the library defaults otherwise; greedy; 24 new tokens per answer. Writes `<out>.json` and `<out>.md`.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch

from ...cache.cache import DualDecoderCache
from ...cli.help_format import DefaultsHelpFormatter
from ...config import DualDecoderConfig
from ...model.needle_prompt import NEEDLE_WORDS, reference_document
from ..outputs import default_out, write_rows_and_table
from ..quality.needle_sweep import load_tool_model, threads_arg

NEW_TOKENS = 24


def build_document(tokenizer, tokens: int, questions: int, seed: int) -> tuple[str, list[tuple[str, str]]]:
    """A document of about `tokens` tokens with one needle per question; returns it and `(key, answer)` pairs."""
    rng = random.Random(seed)
    keys = rng.sample(NEEDLE_WORDS, questions)
    answers = [str(rng.randrange(1_000_000, 10_000_000)) for _ in keys]
    words = reference_document().split(" ")
    count = int(tokens * 0.7)  # about 1.4 tokens per word in this text; trimmed below
    while True:
        body = words[:count]
        for index, (key, answer) in enumerate(zip(keys, answers)):
            body.insert(int(len(body) * (index + 0.5) / questions), f"The special magic number for {key} is: {answer}.")
        text = " ".join(body)
        if len(tokenizer(text)["input_ids"]) <= tokens - 64 or count < 100:
            return text, list(zip(keys, answers))
        count = int(count * 0.95)


def turn_ids(tokenizer, history: list[dict]) -> list[int]:
    """Token ids of a chat `history` with the generation prompt (plain text without a chat template)."""
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"])
    return tokenizer("\n".join(m["content"] for m in history))["input_ids"]


def next_turn(tokenizer, sequence: list[int], text: str) -> list[int]:
    """`sequence` (the conversation so far, ending with the model's answer) followed by the tokens that close the
    answer's turn and open a user turn with `text` and the generation prompt (rendered with a sentinel answer, so
    the answer's own tokens are kept exactly as generated)."""
    sentinel = "\u2063ANSWER\u2063"
    if not getattr(tokenizer, "chat_template", None):
        return sequence + tokenizer("\n" + text, add_special_tokens=False)["input_ids"]
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": sentinel}, {"role": "user", "content": text}],
        add_generation_prompt=True, tokenize=False)
    suffix = tokenizer(rendered.split(sentinel, 1)[1], add_special_tokens=False)["input_ids"]
    if sequence and suffix and sequence[-1] == suffix[0]:  # the answer ended with the end-of-turn token
        suffix = suffix[1:]
    return sequence + suffix


def question(key: str) -> str:
    return f"What is the special magic number for {key} mentioned in the text? Answer with the number only."


def shared_document(model, tokenizer, tokens: int, count: int, budget: int, seed: int) -> dict:
    """Part 1: re-prefill per question vs one shared prefill and a batch of continuations."""
    document, needles = build_document(tokenizer, tokens, count, seed)
    turns = [turn_ids(tokenizer, [{"role": "user", "content": f"{document}\n\n{question(key)}"}]) for key, _ in needles]
    common = 0
    while all(len(t) > common and t[common] == turns[0][common] for t in turns):
        common += 1
    options = {"budget": budget}
    texts = {"reprefill": [], "shared": []}
    start = time.perf_counter()
    for ids in turns:
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             cache=DualDecoderCache(model.config, **options))
        texts["reprefill"].append(tokenizer.decode(out[0, len(ids):], skip_special_tokens=True))
    reprefill_seconds = time.perf_counter() - start

    start = time.perf_counter()
    with DualDecoderCache(model.config, **options) as cache:
        model.generate(torch.tensor([turns[0][:common]]), max_new_tokens=1, do_sample=False, cache=cache)
        prefix_host_bytes = cache.stats()["host_bytes"]
        width = max(len(t) for t in turns) - common
        ids = torch.full((len(turns), common + width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, t in enumerate(turns):  # the document, then each question padded on its left
            ids[row, :common], mask[row, :common] = torch.tensor(t[:common]), 1
            ids[row, common + width - (len(t) - common):] = torch.tensor(t[common:])
            mask[row, common + width - (len(t) - common):] = 1
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, cache=cache)
        batch_host_bytes = cache.stats()["host_bytes"]
    shared_seconds = time.perf_counter() - start
    texts["shared"] = [tokenizer.decode(row[ids.shape[1]:], skip_special_tokens=True) for row in out]
    correct = {name: sum(answer in text for (_, answer), text in zip(needles, values))
               for name, values in texts.items()}
    return {
        "part": "shared document", "document_tokens": common, "questions": count,
        "reprefill_seconds": reprefill_seconds, "shared_seconds": shared_seconds,
        "speedup": reprefill_seconds / shared_seconds,
        "prefix_host_bytes": prefix_host_bytes, "batch_host_bytes": batch_host_bytes,
        "host_ratio": batch_host_bytes / prefix_host_bytes, "correct": correct,
        "same_answers": texts["shared"] == texts["reprefill"], "answers": [a for _, a in needles], "texts": texts,
    }


def conversation(model, tokenizer, tokens: int, budget: int, seed: int, turns: int = 3) -> dict:
    """Part 2: three turns on one cache vs a fresh cache re-prefilling the conversation each turn."""
    document, needles = build_document(tokenizer, tokens, turns, seed + 1)
    texts = {"continued": [], "reprefilled": []}
    prefilled = {"continued": 0, "reprefilled": 0}
    with DualDecoderCache(model.config, budget=budget) as cache:
        sequences = None
        for index, (key, _) in enumerate(needles):
            if sequences is None:
                ids = turn_ids(tokenizer, [{"role": "user", "content": f"{document}\n\n{question(key)}"}])
            else:
                ids = next_turn(tokenizer, sequences[0].tolist(), question(key))
            prefilled["continued"] += len(ids) - cache.get_seq_length()
            sequences = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, cache=cache)
            reference = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                       cache=DualDecoderCache(model.config, budget=budget))
            prefilled["reprefilled"] += len(ids)
            for name, out in (("continued", sequences), ("reprefilled", reference)):
                texts[name].append(tokenizer.decode(out[0, len(ids):], skip_special_tokens=True))
    return {
        "part": "conversation", "turns": turns, "same_answers": texts["continued"] == texts["reprefilled"],
        "correct": {name: sum(a in t for (_, a), t in zip(needles, v)) for name, v in texts.items()},
        "prefilled_tokens": prefilled, "answers": [a for _, a in needles], "texts": texts,
    }


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    shared, talk = rows
    return "\n".join([
        f"Agentic use on the embedded SmolLM2-135M, this CPU, budget {args.budget}, greedy, {NEW_TOKENS} new tokens "
        f"(`python -m dual_cache.eval.throughput.agentic --tokens {args.tokens} --questions {args.questions}`).", "",
        f"**{args.questions} questions over one {shared['document_tokens']}-token document**", "",
        "| | seconds | host bytes | correct |", "|---|---|---|---|",
        f"| re-prefill per question | {shared['reprefill_seconds']:.1f} | — | "
        f"{shared['correct']['reprefill']}/{args.questions} |",
        f"| shared prefix, one batch | {shared['shared_seconds']:.1f} | {shared['batch_host_bytes']:,} "
        f"({shared['host_ratio']:.2f}× one prefix, {shared['prefix_host_bytes']:,}) | "
        f"{shared['correct']['shared']}/{args.questions} |", "",
        f"Shared prefix: {shared['speedup']:.1f}× faster end to end; answers identical to re-prefill: "
        f"{shared['same_answers']}.", "",
        f"**A {talk['turns']}-turn conversation on one cache** (one needle question per turn): answers identical to "
        f"re-prefilling the conversation each turn: {talk['same_answers']}; correct "
        f"{talk['correct']['continued']}/{talk['turns']} (re-prefilled {talk['correct']['reprefilled']}/{talk['turns']}); "
        f"prompt tokens prefilled {talk['prefilled_tokens']['continued']:,} vs "
        f"{talk['prefilled_tokens']['reprefilled']:,}.", "",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dual-decoder agentic", formatter_class=DefaultsHelpFormatter,
        description="Agentic use of one dual cache (default: the embedded model): questions over one shared "
                    "document, asked as one batch that continues the stored document vs one re-prefilled request "
                    "each; and a three-turn conversation on one cache vs re-prefilling it every turn. Reports "
                    "seconds, host bytes, prefilled tokens and the answers.")
    parser.add_argument("--tokens", type=int, default=8192, help="document length (tokens)")
    parser.add_argument("--questions", type=int, default=8, help=f"questions over the document (1..{len(NEEDLE_WORDS)})")
    parser.add_argument("--budget", type=int, default=DualDecoderConfig.budget, help="tokens per KV head")
    parser.add_argument("--seed", type=int, default=0, help="picks the document, the needles and their numbers")
    parser.add_argument("--model", default=None, help="named model, folder or .gguf (default: the embedded smollm2-135m)")
    parser.add_argument("--threads", type=threads_arg, default=None, help="torch intra-op threads")
    parser.add_argument("--out", default=None,
                        help="output path without extension, writes .json and .md (default: a new "
                             "eval-results/agentic/<time>; results/ only when --out names it)")
    args = parser.parse_args(argv)
    if not 1 <= args.questions <= len(NEEDLE_WORDS) or args.tokens < 1024 or args.budget < 1:
        print(f"error: --questions must be in 1..{len(NEEDLE_WORDS)}, --tokens >= 1024, --budget >= 1.",
              file=sys.stderr)
        return 2
    model, tokenizer = load_tool_model(args.threads, args.model)
    rows = [shared_document(model, tokenizer, args.tokens, args.questions, args.budget, args.seed),
            conversation(model, tokenizer, args.tokens, args.budget, args.seed)]
    for row in rows:
        print(json.dumps({k: v for k, v in row.items() if k != "texts"}), flush=True)
    table = markdown(rows, args)
    print(table)
    paths = write_rows_and_table(args.out or default_out("agentic"), rows, table)
    print("wrote " + ", ".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
