"""How much of the lowbit scan a bound could skip (issue 62, candidate (a)), replayed on a real model's decode steps.

    python -m dual_cache.eval.selection.scan_bounds --prompts natural --tokens 8192 --seeds 0-1 --steps 16 \
        --out results/selection/scan-bounds-smollm2-natural-8k

The lowbit scan (`engine/reference.py`) ranks each candidate position by the largest over its GQA group's heads of
the approximate log-probability `s · (q_h · k) − LZ_h`, and shortlists the `lowbit_factor × budget` best. A scan that
skips a 64-position group needs a bound on that score over the group: per channel, the group's key range
`[min_c, max_c]` (exactly the range a 2-bit code of the group spans, `engine/codes.py`) and the query's sign give
`U_h = s · Σ_c max(q_hc · min_c, q_hc · max_c) ≥ s · q_h · k` for every key of the group. A group can be skipped
when `max_h (U_h − LZ_h)` is below the shortlist's threshold. This tool measures the most any such scan can skip:
with exact keys and the exact final threshold known before the scan starts (the true threshold of the step), the
share of groups whose bound falls below it; a real scan only knows a running threshold, so it skips less. `LZ_h`
here is the exact log-sum-exp over the candidates (the engine samples it; the difference shifts every score of a
head alike and does not change which groups fall below).

Reported per full-attention layer and over all: the share of groups skippable at the shortlist threshold
(`lowbit_factor × budget`), and, for reference, at the budget's own threshold (`budget`) — what a scan that
shortlisted only the budget could skip.
"""

from __future__ import annotations

import argparse
import sys

import torch

from ...cli.help_format import DefaultsHelpFormatter
from ...config import DualDecoderConfig
from ...engine.codes import GROUP
from ...model.loading import model_display_name
from ..options import add_sampling_options
from ..outputs import default_out, write_rows_and_table
from ..quality.needle_sweep import load_tool_model, parse_seeds, threads_arg
from .decode_steps import dual_steps, full_attention_layers, use_recorder
from .miss_candidates import prompt_ids


def skippable(query: torch.Tensor, keys: torch.Tensor, first: int, end: int, scaling: float,
              shortlists: list[int]) -> list[tuple[int, int]]:
    """Per shortlist size, `(groups skippable, groups)` over the KV heads of one step and layer.

    Args:
        query: `(1, H_q, D)` float32 the step's selecting query; keys: `(1, H_kv, n, D)` float32 every key so far.
        first, end: the candidates `[first, end)`; complete groups of `GROUP` from `first` are the scanned ones.
    """
    kv_heads, dim = keys.shape[1], keys.shape[3]
    groups = (end - first) // GROUP
    q = query[0].view(kv_heads, -1, dim)  # (H_kv, G, D)
    k = keys[0, :, first : first + groups * GROUP].view(kv_heads, groups, GROUP, dim)
    logits = scaling * torch.einsum("hgd,hnsd->hgns", q, k)  # (H_kv, G, groups, GROUP)
    lz = torch.logsumexp(logits.flatten(2), dim=-1)  # (H_kv, G)
    score = (logits - lz[..., None, None]).amax(1).flatten(1)  # (H_kv, groups · GROUP): max over the group's heads
    low, high = k.amin(2), k.amax(2)  # (H_kv, groups, D): the group's per-channel range
    # Σ_c max(q_c · min_c, q_c · max_c): a positive channel of the query takes the group's maximum, a negative one its minimum
    upper = scaling * (torch.einsum("hgd,hnd->hgn", q.clamp(min=0), high) + torch.einsum("hgd,hnd->hgn", q.clamp(max=0), low))
    bound = (upper - lz[..., None]).amax(1)  # (H_kv, groups)
    out = []
    for shortlist in shortlists:
        threshold = score.topk(min(shortlist, score.shape[1]), dim=-1).values[:, -1:]  # (H_kv, 1)
        out.append((int((bound < threshold).sum()), kv_heads * groups))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scan_bounds", description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--prompts", choices=["natural", "needle"], default="natural")
    parser.add_argument("--tokens", type=int, default=8192, help="prompt length (tokens)")
    parser.add_argument("--seeds", default="0-1", help="prompts, e.g. 0-3")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per prompt")
    add_sampling_options(parser)
    parser.add_argument("--threads", type=threads_arg, default=None)
    parser.add_argument("--model", default=None, help="named model (gemma3-270m), folder or .gguf (default: embedded)")
    parser.add_argument("--out", default=None, help="output path without extension (.json, .md)")
    args = parser.parse_args(argv)
    config = DualDecoderConfig()
    model, tokenizer = load_tool_model(args.threads, args.model)
    use_recorder(model)
    layers = full_attention_layers(model)
    tally: dict[int, list[list[int]]] = {layer: [[0, 0], [0, 0]] for layer in layers}
    for seed in parse_seeds(args.seeds):
        ids = prompt_ids(args.prompts, tokenizer, args.tokens, seed)
        previous = None
        for record in dual_steps(model, ids, args.steps, args.temperature, 0):
            if previous is not None:  # the speculated query of the step before selects for this step
                end = record.position - config.window
                for layer in layers:
                    budget = config.budget_for_layer(layer)
                    shortlists = [config.lowbit_factor * budget, budget]
                    counts = skippable(previous.spec[layer], record.keys[layer], config.n_sink, end,
                                       record.scaling[layer], shortlists)
                    for cell, (skip, total) in zip(tally[layer], counts):
                        cell[0] += skip
                        cell[1] += total
            previous = record
        print(f"seed {seed} done", flush=True)
    rows = [{"layer": layer, "skippable_at_shortlist": cells[0][0] / max(1, cells[0][1]),
             "skippable_at_budget": cells[1][0] / max(1, cells[1][1]), "groups": cells[0][1]}
            for layer, cells in tally.items()]
    overall = {"layer": "all", "skippable_at_shortlist": sum(t[0][0] for t in tally.values()) /
               max(1, sum(t[0][1] for t in tally.values())),
               "skippable_at_budget": sum(t[1][0] for t in tally.values()) / max(1, sum(t[1][1] for t in tally.values())),
               "groups": sum(t[0][1] for t in tally.values())}
    meta = {"model": model_display_name(args.model), "prompts": args.prompts, "tokens": args.tokens,
            "seeds": args.seeds, "steps": args.steps, "temperature": args.temperature,
            "lowbit_factor": config.lowbit_factor, "budget": config.budget}
    lines = [f"Groups of {GROUP} positions a bound-pruned lowbit scan could skip at most (exact keys, the step's exact "
             f"threshold known in advance), {meta['model']}, {args.prompts} prompts of {args.tokens} tokens, seeds "
             f"{args.seeds}, {args.steps} steps, "
             f"{'greedy' if not args.temperature else f'sampled at temperature {args.temperature}'}.", "",
             f"| layer | skippable at the shortlist ({config.lowbit_factor} × budget) | skippable at the budget | "
             "groups scored |", "|---|---|---|---|"]
    for row in rows + [overall]:
        lines.append(f"| {row['layer']} | {row['skippable_at_shortlist']:.1%} | {row['skippable_at_budget']:.1%} | "
                     f"{row['groups']} |")
    table = "\n".join(lines) + "\n"
    print(table)
    write_rows_and_table(args.out or default_out("scan-bounds"), [{"meta": meta}] + rows + [overall], table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
