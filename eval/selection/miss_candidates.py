"""What a decode step can attend to when its speculated token missed, without waiting for the host: the candidates of
issue 57, scored side by side on a real model's decode steps.

    python -m dual_cache.eval.selection.miss_candidates --prompts natural --tokens 2048 --seeds 0-3 --steps 48 \
        --out results/selection/miss-candidates-smollm2-natural-2k

The model decodes as the dual loop does, with dense attention (transformers' `DynamicCache`): each step feeds the real
token and the speculated one (`[x_t, x̂_{t+1}]`, the self speculator: the speculated slot's argmax, prompt lookup
after a miss) and keeps only the real token's K/V. Per step, full-attention layer (from `--skip-layers`) and KV head,
the reference is the real token's own exact top-`budget` by GQA-group attention mass over the candidates (positions
past the sink, before the local window): what today's synchronous miss repair attends to. Each candidate is scored
by its **recall**, the real query's mass on the entries it attends to over the mass of that reference:

- `spec`: the speculated token's top-k (no repair: the paper's method);
- `prev-real`: the previous real token's top-k (`speculator="none"`; the first step's selection is of this kind);
- `rerank-f`: the speculated query's top `f × budget`, re-ranked on the device by the real query to `budget`
  (candidate b of the issue; it copies `f ×` the entries); `rerank-f+next` adds the next position of each of the
  previous real token's top-`budget` entries (`fetch_next`: where a copy continues, its next entry);
- `all-f`: the speculated query's top `f × budget`, all attended (same copies as `rerank-f`; its recall can pass 1);
- `lookahead-d`: the top-k of an estimate of the real query computed `d` layers early, layer `l`'s input norm,
  query projection (and query norm) and rotary applied to the real token's input to layer `l - d` (InfiniGen's
  rehearsal, OSDI '24; layers below `d` from the token's embedding, exact at layer 0) — candidate a: the host gets
  `d` layers of compute to select;
- `heads-c`: only the KV heads whose real and speculated queries diverge (GQA-group cosine below `c`) re-selected with
  the real query, the others keep the speculated selection (candidate c; reported with the share of heads
  re-selected, each a host round trip).

Reported over miss steps (the speculated token differed from the real one; the first step counts as one) and, for
reference, over hit steps: mean and 10th-percentile recall, and the exact top-k's share of all candidate mass.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field

import torch

from ...cli.help_format import DefaultsHelpFormatter
from ...config import DualDecoderConfig
from ...model.chat import format_chat
from ...model.loading import model_display_name
from ...model.needle_prompt import make_needle_prompt
from ..outputs import default_out, write_rows_and_table
from ..quality.natural_text import natural_prompt_ids
from ..quality.needle_sweep import load_tool_model, parse_seeds, threads_arg
from .decode_steps import dual_steps, full_attention_layers, use_recorder
from .torch_exact import group_attention_mass


class LayerInputs:
    """Forward pre-hooks on every decoder layer keeping its input hidden states and rotary `(cos, sin)` of a call."""

    def __init__(self, model) -> None:
        self.layers = model.model.layers
        self.hidden: dict[int, torch.Tensor] = {}
        self.rotary: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._handles = [layer.register_forward_pre_hook(self._hook(i), with_kwargs=True)
                         for i, layer in enumerate(self.layers)]

    def _hook(self, index: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            self.hidden[index] = hidden.detach()
            if kwargs.get("position_embeddings") is not None:
                self.rotary[index] = kwargs["position_embeddings"]
        return hook

    def estimate_query(self, target: int, source: int, slot: int = 0) -> torch.Tensor:
        """Layer `target`'s query `(1, H_q, D)` float32 estimated from layer `source`'s input at `slot`: the target
        layer's input norm, query projection, query norm (where the model has one) and rotary."""
        import importlib

        layer = self.layers[target]
        attention = layer.self_attn
        hidden = self.hidden[source][:, slot : slot + 1]
        normed = layer.input_layernorm(hidden)
        query = attention.q_proj(normed).view(1, 1, -1, attention.head_dim).transpose(1, 2)
        if getattr(attention, "q_norm", None) is not None:
            query = attention.q_norm(query)
        cos, sin = self.rotary[target]
        rotate = importlib.import_module(type(attention).__module__).apply_rotary_pos_emb
        query, _ = rotate(query, query, cos[:, slot : slot + 1], sin[:, slot : slot + 1])
        return query[:, :, 0].float()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


@dataclass
class Scores:
    """Recalls of every candidate, split by whether the step's speculated token hit."""

    miss: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    hit: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    share: dict[str, list[torch.Tensor]] = field(default_factory=lambda: {"miss": [], "hit": []})
    steps: dict[str, int] = field(default_factory=lambda: {"miss": 0, "hit": 0})

    def add(self, kind: str, name: str, recall: torch.Tensor) -> None:
        getattr(self, kind).setdefault(name, []).append(recall.flatten())


def mass_of(query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, scaling: float) -> torch.Tensor:
    """`(H_kv, n)` GQA-group attention mass of `query` `(1, H_q, D)` over `keys` `(1, H_kv, n, D)` where `mask`."""
    return group_attention_mass(query, keys, mask[None], scaling)[0]


def top(mass: torch.Tensor, count: int) -> torch.Tensor:
    """`(H_kv, count)` positions of the largest entries of each row of `mass` `(H_kv, n)`."""
    return torch.topk(mass, min(count, mass.shape[1]), dim=-1).indices


def rerank(query: torch.Tensor, keys: torch.Tensor, chosen: torch.Tensor, mask: torch.Tensor, budget: int,
           scaling: float) -> torch.Tensor:
    """The `budget` of the `chosen` `(H_kv, m)` positions (duplicates allowed; candidates where `mask` `(n,)`) with
    the most group mass of `query`, each head's softmax taken over the chosen positions alone (what the device
    holds; `rerank.rerank_valid`)."""
    kv_heads, n = keys.shape[1], keys.shape[2]
    held = torch.zeros(kv_heads, n, dtype=torch.bool).scatter_(1, chosen, True) & mask[None]
    grouped = query[0].reshape(kv_heads, -1, query.shape[-1])
    logits = (grouped @ keys[0].transpose(1, 2) * scaling).masked_fill(~held[:, None, :], float("-inf"))
    mass = torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(1).masked_fill(~held, -1.0)
    return top(mass, budget)


def group_cosine(a: torch.Tensor, b: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """`(H_kv,)` cosine of two `(1, H_q, D)` queries, each GQA group flattened to one vector."""
    return torch.nn.functional.cosine_similarity(a.reshape(kv_heads, -1), b.reshape(kv_heads, -1), dim=-1)


def score_layer(scores: Scores, kind: str, args, keys, scaling, position, real, spec, prev, estimates) -> None:
    """Score every candidate for one layer of one step (`real`, `spec`, `prev`: `(1, H_q, D)` queries)."""
    n_candidates = position - args.window
    if n_candidates <= args.n_sink + args.budget:  # every candidate fits the budget: nothing to choose
        return
    mask = torch.zeros(position + 2, dtype=torch.bool)
    mask[args.n_sink : n_candidates] = True
    keys = keys[:, :, : position + 2]
    truth = mass_of(real, keys, mask, scaling)  # (H_kv, n)
    best = truth.topk(args.budget, dim=-1).values.sum(-1)
    scores.share[kind].append(best / truth.sum(-1))

    def recall(chosen: torch.Tensor) -> torch.Tensor:
        return torch.gather(truth, 1, chosen).sum(-1) / best

    spec_mass = mass_of(spec, keys, mask, scaling)
    scores.add(kind, "spec", recall(top(spec_mass, args.budget)))
    prev_mass = mass_of(prev, keys, mask, scaling)
    scores.add(kind, "prev-real", recall(top(prev_mass, args.budget)))
    following = (top(prev_mass, args.budget) + 1).clamp_(max=n_candidates - 1)  # next positions of prev's top-k
    for factor in args.factors:
        wide = top(spec_mass, factor * args.budget)
        scores.add(kind, f"rerank-{factor}", recall(rerank(real, keys, wide, mask, args.budget, scaling)))
        scores.add(kind, f"rerank-{factor}+next", recall(rerank(real, keys, torch.cat([wide, following], 1), mask,
                                                                args.budget, scaling)))
        scores.add(kind, f"all-{factor}", recall(wide))
    for lead, estimate in estimates.items():
        scores.add(kind, f"lookahead-{lead}", recall(top(mass_of(estimate, keys, mask, scaling), args.budget)))
    kv_heads = keys.shape[1]
    cosine = group_cosine(real, spec, kv_heads)
    oracle = top(truth, args.budget)
    for threshold in args.cosines:
        redo = cosine < threshold
        chosen = torch.where(redo[:, None], oracle, top(spec_mass, args.budget))
        scores.add(kind, f"heads-{threshold}", recall(chosen))
        scores.add(kind, f"heads-{threshold} share re-selected", redo.float())


def decode_and_score(model, ids: list[int], args, scores: Scores) -> None:
    """Decode `args.steps` greedy tokens after `ids` the way the dual loop does (dense attention,
    `decode_steps.dual_steps`) and score every candidate at every step and layer."""
    inputs = LayerInputs(model)
    full = [i for i in full_attention_layers(model) if i >= args.skip_layers]
    spec_queries = prev_queries = None
    try:
        for record in dual_steps(model, ids, args.steps):
            kind = "miss" if not record.hit else "hit"
            if spec_queries is not None:
                scores.steps[kind] += 1
                for layer in full:
                    estimates = {lead: inputs.estimate_query(layer, max(0, layer - lead)) for lead in args.leads}
                    score_layer(scores, kind, args, record.keys[layer], record.scaling[layer], record.position,
                                record.real[layer], spec_queries[layer], prev_queries[layer], estimates)
            spec_queries, prev_queries = record.spec, record.real
    finally:
        inputs.close()


def summary(values: list[torch.Tensor]) -> dict:
    """`{"mean", "p10", "p1", "samples"}` of concatenated recalls (p1: the worst (layer, KV head) selections, where
    a copy head misses the one entry it needs)."""
    joined = torch.cat(values).float()
    if not joined.numel():
        return {"mean": float("nan"), "p10": float("nan"), "p1": float("nan"), "samples": 0}
    return {"mean": joined.mean().item(), "p10": joined.quantile(0.1).item(), "p1": joined.quantile(0.01).item(),
            "samples": joined.numel()}


def prompt_ids(kind: str, tokenizer, tokens: int, seed: int) -> list[int]:
    """Token ids of prompt `seed`: a natural-text continuation (`natural_text`) or a word-needle question."""
    if kind == "natural":
        return natural_prompt_ids(tokenizer, tokens, seed)
    return format_chat(tokenizer, make_needle_prompt(tokenizer, tokens, seed=seed).text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="miss_candidates", description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--prompts", choices=["natural", "needle"], default="natural")
    parser.add_argument("--tokens", type=int, default=2048, help="prompt length (tokens)")
    parser.add_argument("--seeds", default="0-3", help="prompts, e.g. 0-3")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per prompt")
    parser.add_argument("--budget", type=int, default=DualDecoderConfig.budget)
    parser.add_argument("--n-sink", type=int, default=DualDecoderConfig.n_sink)
    parser.add_argument("--window", type=int, default=DualDecoderConfig.window)
    parser.add_argument("--skip-layers", type=int, default=DualDecoderConfig.early_layers,
                        help="leave out the first layers (larger budget)")
    parser.add_argument("--factors", type=int, nargs="+", default=[2, 4], help="over-fetch factors f")
    parser.add_argument("--leads", type=int, nargs="+", default=[1, 2, 4], help="look-ahead layers d")
    parser.add_argument("--cosines", type=float, nargs="+", default=[0.9, 0.95], help="per-head thresholds c")
    parser.add_argument("--threads", type=threads_arg, default=None)
    parser.add_argument("--model", default=None, help="named model (gemma3-270m), folder or .gguf (default: embedded)")
    parser.add_argument("--out", default=None, help="output path without extension (.json, .md)")
    args = parser.parse_args(argv)
    seeds = parse_seeds(args.seeds)
    model, tokenizer = load_tool_model(args.threads, args.model)
    use_recorder(model)
    scores = Scores()
    for seed in seeds:
        decode_and_score(model, prompt_ids(args.prompts, tokenizer, args.tokens, seed), args, scores)
        print(f"seed {seed}: {scores.steps}", flush=True)
    names = list(scores.miss)
    rows = [{"candidate": name, "miss": summary(scores.miss[name]),
             "hit": summary(scores.hit[name]) if name in scores.hit else None} for name in names]
    meta = {"model": model_display_name(args.model), "prompts": args.prompts, "tokens": args.tokens,
            "seeds": args.seeds, "steps": scores.steps, "budget": args.budget,
            "topk_share": {k: torch.cat(v).mean().item() for k, v in scores.share.items() if v}}
    lines = [f"Miss-handling candidates, {meta['model']}, {args.prompts} prompts of {args.tokens} tokens, seeds "
             f"{args.seeds}, {args.steps} greedy steps each ({scores.steps['miss']} miss steps incl. the first, "
             f"{scores.steps['hit']} hit steps), budget {args.budget}, layers {args.skip_layers}+ × KV heads. Recall = "
             "the real query's mass on what is attended / on its own exact top-k. Exact top-k share of all "
             f"candidate mass: {json.dumps({k: round(v, 3) for k, v in meta['topk_share'].items()})}.", "",
             "| candidate | miss mean | miss p10 | miss p1 | hit mean | hit p10 | hit p1 |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        hit = row["hit"] or summary([])
        lines.append(f"| {row['candidate']} | {row['miss']['mean']:.3f} | {row['miss']['p10']:.3f} | "
                     f"{row['miss']['p1']:.3f} | {hit['mean']:.3f} | {hit['p10']:.3f} | {hit['p1']:.3f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    paths = write_rows_and_table(args.out or default_out("miss-candidates"), [{"meta": meta}] + rows, table)
    print("wrote " + ", ".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
