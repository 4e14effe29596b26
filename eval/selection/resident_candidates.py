"""What a step copies and what it attends to when the device keeps a resident set of KV entries per (layer, KV head)
across steps (issue 62), side by side with today's per-step slots, replayed on a real model's decode steps.

    python -m dual_cache.eval.selection.resident_candidates --prompts natural --tokens 8192 --seeds 0-1 --steps 32 \
        --out results/selection/resident-candidates-smollm2-natural-8k
    python -m dual_cache.eval.selection.resident_candidates ... --capacities 2 3   # the default design's set size

The model decodes as the dual loop does, with dense attention (`decode_steps.dual_steps`, greedy or `--temperature`).
Per step, full-attention layer and KV head, a policy decides what the step **wants** resident — the speculated
query's top `f × budget` (chosen a step early, as the host does) and the next position of each entry the previous real
token attended (`fetch_next`) — and what it **attends**: every resident entry (`all`) or the real query's top `budget`
among them (`rerank`). Without a resident set (today: `slots`) every wanted entry is copied every step; with one of
`C` entries, only the wanted entries not yet resident are copied (the delta), into the slots of the least recently
wanted or attended entries (`lru`) or by a second-chance clock (`clock`). `reuse-c` keeps a KV head's last selection
(no host selection) while the speculated query's GQA-group cosine to the query that made it stays at or above `c`;
the real query's view of the resident set corrects it.

Reported per policy: **recall** (the real query's attention mass on what the step attends to, over the mass of its
own exact top-`budget`; above 1 when it attends more than the budget), its mean, 10th and 1st percentile over
(step, layer, KV head), on hit and miss steps; the **entries copied** per (layer, KV head) and step and the bytes per
sequence-step at this model's shape; the share of KV heads the host selects for (`selected`); the resident set's
device bytes per request.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field

import torch

from ...cli.help_format import DefaultsHelpFormatter
from ...config import DualDecoderConfig
from ...model.loading import model_display_name
from ..options import add_sampling_options
from ..outputs import default_out, write_rows_and_table
from ..quality.needle_sweep import load_tool_model, parse_seeds, threads_arg
from .decode_steps import dual_steps, full_attention_layers, use_recorder
from .miss_candidates import mass_of, prompt_ids, summary, top


@dataclass(frozen=True)
class Policy:
    """One candidate design.

    Attributes:
        capacity: resident entries per (layer, KV head) as a multiple of the layer's budget; None: no resident set
            (today's slots, refilled every step).
        fetch: the speculated query's top `fetch × budget` is wanted. follow: the next positions of what the real
            token attended are wanted too.
        attend: `"all"` resident (or fetched) entries, or `"rerank"`: the real query's top budget among them.
        evict: `"lru"` or `"clock"`. reuse: cosine threshold of per-head reuse (None: select every step).
    """

    name: str
    capacity: float | None
    fetch: int = 2
    follow: bool = True
    attend: str = "rerank"
    evict: str = "lru"
    reuse: float | None = None


TODAY = Policy("slots f2+next rerank (today)", None)  # the per-step slots: the "vs today" column's baseline


def default_policies() -> list[Policy]:
    """Today's slots and the candidates of issue 62."""
    out = [TODAY, Policy("slots f2+next all", None, attend="all")]
    for capacity in (3, 4, 6):
        for fetch in (1, 2):
            out.append(Policy(f"resident {capacity}x f{fetch}+next all lru", capacity, fetch, attend="all"))
    out.append(Policy("resident 4x f1+next rerank lru", 4, 1))
    out.append(Policy("resident 4x f1+next all clock", 4, 1, attend="all", evict="clock"))
    for cosine in (0.8, 0.9):
        out.append(Policy(f"resident 4x f1+next all lru reuse-{cosine}", 4, 1, attend="all", reuse=cosine))
    return out


def capacity_policies(capacities: list[float]) -> list[Policy]:
    """Today's slots (the baseline of the "vs today" column) and the default design (`f1+next`, attend all, LRU) at
    each resident capacity in `capacities` (multiples of the layer's budget)."""
    return [TODAY] + [
        Policy(f"resident {capacity:g}x f1+next all lru", capacity, 1, attend="all") for capacity in capacities]


@dataclass
class HeadState:
    """One policy's state at one (layer, KV head)."""

    resident: torch.Tensor  # (C,) int64 positions, -1 empty
    stamp: torch.Tensor  # (C,) int64: last step wanted or attended (lru); 0/1 reference bits (clock)
    hand: int = 0
    chooser: torch.Tensor | None = None  # the GQA-group query that made the last selection
    chosen: torch.Tensor | None = None  # its top positions
    attended: torch.Tensor | None = None  # the real token's top-budget positions at the last step


@dataclass
class Tally:
    recall: dict[str, list[torch.Tensor]] = field(default_factory=lambda: {"hit": [], "miss": []})
    copied: list[int] = field(default_factory=list)
    selected: list[int] = field(default_factory=list)


def _merge(resident: HeadState, wanted: torch.Tensor, step: int, evict: str) -> int:
    """Make every `wanted` position resident; returns the entries copied (those not resident yet)."""
    pos = resident.resident
    held = torch.isin(pos, wanted)
    missing = wanted[~torch.isin(wanted, pos)]
    if evict == "lru":
        resident.stamp[held] = step
        free = (~held).nonzero().flatten()
        order = free[torch.argsort(torch.where(pos[free] < 0, -1, resident.stamp[free]), stable=True)]
        slots = order[: missing.numel()]
        pos[slots] = missing
        resident.stamp[slots] = step
        return int(missing.numel())
    resident.stamp[held] = 1  # clock: referenced
    capacity = pos.numel()
    for position in missing.tolist():
        while True:
            slot = resident.hand
            resident.hand = (resident.hand + 1) % capacity
            if pos[slot] >= 0 and (resident.stamp[slot] == 1 or bool(torch.isin(pos[slot], wanted))):
                resident.stamp[slot] = 0
                continue
            pos[slot], resident.stamp[slot] = position, 1
            break
    return int(missing.numel())


def _top_of(query: torch.Tensor, keys: torch.Tensor, held: torch.Tensor, head: int, count: int,
            scaling: float) -> torch.Tensor:
    """The `count` positions of `held` `(m,)` with the most GQA-group mass of `query` at `head` (softmax over them)."""
    kv_heads = keys.shape[1]
    grouped = query[0].reshape(kv_heads, -1, query.shape[-1])[head]
    logits = grouped @ keys[0, head, held].T * scaling
    mass = torch.softmax(logits, dim=-1).sum(0)
    return held[torch.topk(mass, min(count, held.numel())).indices]


def replay(model, ids: list[int], args, policies: list[Policy], tallies: dict[str, Tally]) -> dict:
    """Decode after `ids` and score every policy at every step, layer and KV head; returns step counts."""
    config = DualDecoderConfig()
    layers = full_attention_layers(model)
    states: dict[tuple[str, int], list[HeadState]] = {}
    counts = {"hit": 0, "miss": 0}
    previous = None
    for record in dual_steps(model, ids, args.steps, args.temperature, args.sample_seed):
        if previous is None:
            previous = record
            continue
        kind = "hit" if record.hit else "miss"
        counts[kind] += 1
        for layer in layers:
            budget = config.budget_for_layer(layer)
            keys, scaling, position = record.keys[layer], record.scaling[layer], record.position
            end = position - args.window  # candidates: [n_sink, end)
            if end - args.n_sink <= budget:
                continue
            mask = torch.zeros(keys.shape[2], dtype=torch.bool)
            mask[args.n_sink : end] = True
            truth = mass_of(record.real[layer], keys, mask, scaling)  # (H_kv, n)
            best = truth.topk(budget, dim=-1).values.sum(-1)
            spec_mass = mass_of(previous.spec[layer], keys, mask, scaling)
            kv_heads = keys.shape[1]
            for policy in policies:
                heads = states.get((policy.name, layer))
                if heads is None:
                    capacity = 0 if policy.capacity is None else int(policy.capacity * budget)
                    heads = states[(policy.name, layer)] = [
                        HeadState(torch.full((capacity,), -1, dtype=torch.long), torch.zeros(capacity, dtype=torch.long))
                        for _ in range(kv_heads)]
                tally = tallies[policy.name]
                for head, state in enumerate(heads):
                    group = previous.spec[layer][0].reshape(kv_heads, -1)[head]
                    reused = False
                    if policy.reuse is not None and state.chooser is not None:
                        cosine = torch.nn.functional.cosine_similarity(group, state.chooser, dim=0)
                        reused = bool(cosine >= policy.reuse)
                    if not reused:
                        state.chooser = group
                        state.chosen = top(spec_mass[head : head + 1], policy.fetch * budget)[0]
                    tally.selected.append(0 if reused else 1)
                    wanted = state.chosen
                    if policy.follow and state.attended is not None:
                        following = state.attended + 1
                        following = following[(following < end) & (following >= args.n_sink)]
                        wanted = torch.unique(torch.cat([wanted, following]))
                    if policy.capacity is None:
                        held, copied = wanted, int(wanted.numel())
                    else:
                        copied = _merge(state, wanted, record.step, policy.evict)
                        held = state.resident[state.resident >= 0]
                    tally.copied.append(copied)
                    attended = held if policy.attend == "all" else _top_of(record.real[layer], keys, held, head,
                                                                          budget, scaling)
                    tally.recall[kind].append((truth[head, attended].sum() / best[head]).reshape(1))
                    state.attended = _top_of(record.real[layer], keys, attended, head, budget, scaling)
                    if policy.capacity is not None and policy.evict == "lru":  # attended entries count as used
                        state.stamp[torch.isin(state.resident, state.attended)] = record.step
        previous = record
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="resident_candidates", description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--prompts", choices=["natural", "needle"], default="natural")
    parser.add_argument("--tokens", type=int, default=8192, help="prompt length (tokens)")
    parser.add_argument("--seeds", default="0-1", help="prompts, e.g. 0-3")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per prompt")
    add_sampling_options(parser)
    parser.add_argument("--sample-seed", type=int, default=0, help="torch seed of the sampling")
    parser.add_argument("--n-sink", type=int, default=DualDecoderConfig.n_sink)
    parser.add_argument("--window", type=int, default=DualDecoderConfig.window)
    parser.add_argument("--threads", type=threads_arg, default=None)
    parser.add_argument("--model", default=None, help="named model (gemma3-270m), folder or .gguf (default: embedded)")
    parser.add_argument("--capacities", type=float, nargs="+", default=None,
                        help="only the default design (f1+next, attend all, LRU) at these resident capacities "
                             "(multiples of the budget, at least 2: what one step wants) beside today's slots "
                             "(default: every candidate of issue 62)")
    parser.add_argument("--out", default=None, help="output path without extension (.json, .md)")
    args = parser.parse_args(argv)
    if args.capacities is not None and min(args.capacities) < 2:
        parser.error(f"--capacities must be at least 2 (one step wants the budget chosen plus the budget next), got "
                     f"{min(args.capacities):g}")
    model, tokenizer = load_tool_model(args.threads, args.model)
    use_recorder(model)
    policies = default_policies() if args.capacities is None else capacity_policies(args.capacities)
    tallies = {policy.name: Tally() for policy in policies}
    steps = {"hit": 0, "miss": 0}
    for seed in parse_seeds(args.seeds):
        counts = replay(model, prompt_ids(args.prompts, tokenizer, args.tokens, seed), args, policies, tallies)
        steps = {k: steps[k] + counts[k] for k in steps}
        print(f"seed {seed}: {counts}", flush=True)
    text = model.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    entry = 2 * head_dim * model.dtype.itemsize + 8  # K, V and a position
    config = DualDecoderConfig()
    layers = full_attention_layers(model)
    rows = []
    for policy in policies:
        tally = tallies[policy.name]
        copied = torch.tensor(tally.copied, dtype=torch.float64)
        per_step = copied.sum().item() / max(1, steps["hit"] + steps["miss"])  # entries per sequence-step
        resident = 0 if policy.capacity is None else sum(int(policy.capacity * config.budget_for_layer(layer))
                                                         for layer in layers) * kv_heads * entry
        rows.append({"policy": policy.name, "hit": summary(tally.recall["hit"]), "miss": summary(tally.recall["miss"]),
                     "entries_copied_per_head_step": copied.mean().item() if copied.numel() else float("nan"),
                     "bytes_per_sequence_step": per_step * entry,
                     "selected_share": sum(tally.selected) / max(1, len(tally.selected)),
                     "resident_device_bytes": resident})
    meta = {"model": model_display_name(args.model), "prompts": args.prompts, "tokens": args.tokens,
            "seeds": args.seeds, "steps": steps, "temperature": args.temperature, "budget": config.budget,
            "early_layers": [config.early_layers, config.early_layer_budget], "entry_bytes": entry}
    base = rows[0]["bytes_per_sequence_step"]
    lines = [f"Resident-set candidates, {meta['model']}, {args.prompts} prompts of {args.tokens} tokens, seeds "
             f"{args.seeds}, {args.steps} steps each ({steps['hit']} hit / {steps['miss']} miss steps scored), "
             f"{'greedy' if not args.temperature else f'sampled at temperature {args.temperature}'}; budget "
             f"{config.budget} ({config.early_layer_budget} in the first {config.early_layers} layers), sink "
             f"{args.n_sink}, window {args.window}. Recall: the real query's mass on what the step attends / on its "
             "exact top-budget, over (step, layer, KV head). Copies: entries per (layer, KV head) and step; bytes "
             f"per sequence-step at {entry} B an entry ({model.dtype}).", "",
             "| policy | hit mean | hit p1 | miss mean | miss p10 | miss p1 | copies/head-step | MB/seq-step | vs "
             "today | host selects | resident MiB/request |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(
            f"| {row['policy']} | {row['hit']['mean']:.3f} | {row['hit']['p1']:.3f} | {row['miss']['mean']:.3f} | "
            f"{row['miss']['p10']:.3f} | {row['miss']['p1']:.3f} | {row['entries_copied_per_head_step']:.1f} | "
            f"{row['bytes_per_sequence_step'] / 1e6:.2f} | {row['bytes_per_sequence_step'] / base:.3f} | "
            f"{row['selected_share']:.0%} | {row['resident_device_bytes'] / 2**20:.1f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    paths = write_rows_and_table(args.out or default_out("resident-candidates"), [{"meta": meta}] + rows, table)
    print("wrote " + ", ".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
