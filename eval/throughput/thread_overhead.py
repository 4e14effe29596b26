"""What running torch on a second thread costs on a CPU, with and without `release_openmp_pool` (docs/serving.md,
"The loop thread and OpenMP"): a few small operators, one decode-sized linear, and a dual-cache decode step of the
embedded model, each timed on the thread that ran torch first, then on a new thread while that thread's OpenMP pool
is alive, then on a new thread after it was released; `--rounds` rounds of the three in turn, so that a drift of
the machine's speed during the run reaches all three. Medians over the rounds, ratios against the first thread.

    python -m dual_cache.eval.throughput.thread_overhead --out results/serving/thread-overhead
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import torch

from dual_cache.cli.help_format import DefaultsHelpFormatter
from dual_cache.serving.openmp_pool import release_openmp_pool


def _time(fn, repeats: int) -> float:
    """Median of `repeats` timings of `fn()` (seconds; the seconds `fn` returns, if it returns any), after one
    untimed call."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        measured = fn()
        samples.append(time.perf_counter() - start if measured is None else measured)
    return sorted(samples)[len(samples) // 2]


def _on_thread(fn, repeats: int) -> float:
    out = {}
    worker = threading.Thread(target=lambda: out.update(t=_time(fn, repeats)))
    worker.start()
    worker.join()
    return out["t"]


def cases(batch: int, prompt: int, steps: int):
    """(name, function, repeats): the workloads timed on each thread."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, 9, 2, 300, generator=gen)
    x, weight = torch.randn(2 * batch, 576, generator=gen), torch.randn(1536, 576, generator=gen)

    def small_ops():
        for _ in range(100):
            torch.cat([logits.masked_fill(logits > 0, 0.0), logits], dim=-1)

    def linear():
        for _ in range(100):
            torch.nn.functional.linear(x, weight)

    from dual_cache.model.loading import load_model

    model, _ = load_model(None)
    ids = torch.randint(1000, 20000, (batch, prompt), generator=gen)

    class Clock:  # transformers' streamer contract: `put` gets the prompt, then each new token
        def __init__(self):
            self.stamps = []

        def put(self, value):
            self.stamps.append(time.perf_counter())

        def end(self):
            pass

    def decode():  # seconds of `steps` dual decode steps of `batch` rows (after the prefill's first token)
        clock = Clock()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps + 1, do_sample=False,
                       cache_implementation="dual", pad_token_id=0, streamer=clock)
        return clock.stamps[-1] - clock.stamps[1]

    return [(f"100 × (masked_fill + cat) of ({batch}, 9, 2, 300) fp32", small_ops, 20),
            (f"100 × linear ({2 * batch}, 576) × (576, 1536) fp32", linear, 20),
            (f"{steps} decode steps of generate(): {batch} rows, {prompt}-token prompts, dual cache", decode, 2)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--batch", type=int, default=8, help="rows of the decode-sized workloads")
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens per row of the generate() case")
    parser.add_argument("--steps", type=int, default=32, help="new tokens of the generate() case")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three timings per case")
    parser.add_argument("--out", default=None, help="output path without extension (.json and .md)")
    args = parser.parse_args(argv)
    rows = []
    median = lambda values: sorted(values)[len(values) // 2]  # noqa: E731
    for name, fn, repeats in cases(args.batch, args.prompt, args.steps):
        first, alive, freed = [], [], []
        for _ in range(args.rounds):
            first.append(_time(fn, repeats))  # this thread: it builds (or keeps) its OpenMP pool
            alive.append(_on_thread(fn, repeats))  # a second thread while this thread's pool is alive
            release_openmp_pool()
            freed.append(_on_thread(fn, repeats))  # a second thread after this thread's pool was freed
        rows.append({"case": name, "first_thread_s": median(first), "second_thread_s": median(alive),
                     "second_thread_after_release_s": median(freed),
                     "rounds": {"first": first, "second": alive, "second_after_release": freed}})
    lines = [f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads; median seconds over "
             f"{args.rounds} rounds; ratio to the first thread.", "",
             "| case | first thread | second thread | second thread, pool released |",
             "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['first_thread_s']:.4f} | {r['second_thread_s']:.4f} "
                     f"({r['second_thread_s'] / r['first_thread_s']:.2f}×) | "
                     f"{r['second_thread_after_release_s']:.4f} "
                     f"({r['second_thread_after_release_s'] / r['first_thread_s']:.2f}×) |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out + ".json", "w", encoding="utf-8") as handle:
            json.dump({"args": vars(args), "torch": torch.__version__, "threads": torch.get_num_threads(),
                       "rows": rows}, handle, indent=2)
        with open(args.out + ".md", "w", encoding="utf-8") as handle:
            handle.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
