"""How much of the cluster index's recall loss comes from ranking clusters by their summaries, on real keys.

    python -m dual_cache.eval.cluster_ranking --model gemma3-270m --tokens 16384 --seeds 0 --factors 8 16 \
        --out results/selection/gemma3-270m-16k-cluster-ranking

The index (`selector="clusters"`) shortlists the members of the `cluster_factor × budget / cluster_size` clusters
whose summary score (mean logit + 2σ, `selectors/clusters.py`) is highest, then picks the budget by exact attention
mass among them. This tool keeps the same clusters and the same exact stage and changes only the ranking: `summary`
(the index's own score: its selections equal `ClusterSelector.select`) against `max` (each cluster ranked by the
largest logit among its members, per query head, combined over the GQA group as the index combines its scores — an
oracle that reads every key) and `codes` (the same largest logit, computed from 2-bit codes of each member's offset
from its cluster mean, scaled by the cluster's per-channel standard deviation: what a per-member stage storing
`D / 4` bytes per key could rank by; `two_bit_keys`). Recall is as in `selection_recall`: the selected entries'
attention mass over the exact top-`budget`'s, per (layer ≥ `--skip-layers`, KV head, query of the last `--queries`
prompt positions).

One run gives the ceiling of any summary score with these clusters: if `max` is near 1.0, the partition holds the
top keys together and a better cluster score (or cheap per-member scoring) is what recall needs; `codes` says how
much of that ceiling a 2-bit per-member stage keeps.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from ..config import DualDecoderConfig
from ..host_store import HostKVStore
from ..models import model_display_name
from ..retrieval import group_attention_mass
from ..selectors import Candidates
from ..selectors.base import select_in_shortlist
from ..selectors.clusters import ClusterSelector
from .outputs import write_rows_and_table
from .selection_recall import add_recording_arguments, check_recording_arguments, recall_summary, recorded_layers

RANKINGS = ("summary", "max", "codes")
# Lloyd-Max quantizer of a unit Gaussian with 4 levels (Max, 1960): ±inner below the threshold (the midpoint of the
# two levels), ±outer above it
TWO_BIT_THRESHOLD, TWO_BIT_LEVELS = 0.9816, (0.4528, 1.5104)


def two_bit_keys(keys: torch.Tensor, means: torch.Tensor, variances: torch.Tensor) -> torch.Tensor:
    """Member keys as a 2-bit per-member stage would see them: each channel of `(k - μ) / σ` (its cluster's mean and
    per-channel standard deviation) rounded to the nearest of the 4 Lloyd-Max levels of a unit Gaussian, then
    `μ + level·σ`.

    Args:
        keys: `(..., clusters, size, D)` float32 member keys; means, variances: `(..., clusters, D)` their clusters'
            summaries (as the index stores them).

    Returns:
        `(..., clusters, size, D)` float32 reconstructed keys (2 bits per channel of information beyond the summary).
    """
    mean = means.float()[..., None, :]
    spread = variances.float().clamp(min=0).sqrt()[..., None, :]
    z = (keys - mean) / spread.clamp_min(1e-12)
    inner, outer = TWO_BIT_LEVELS
    level = torch.where(z.abs() > TWO_BIT_THRESHOLD, outer, inner) * torch.sign(z)
    return mean + level * spread


def ranking_recalls(queries: torch.Tensor, keys: torch.Tensor, scaling: float, budget: int, factors: list[int],
                    n_sink: int = 4, window: int = 64, **options) -> dict[tuple[str, int], torch.Tensor]:
    """Recall of each (ranking, cluster_factor) for one layer.

    Args:
        queries: `(1, H_q, Q, D)` float32, the last `Q` positions' queries; keys: `(1, H_kv, n, D)` float32.
        scaling: softmax scale; budget: entries per KV head (tokens); factors: `cluster_factor` values.
        n_sink, window: positions `< n_sink` and the `window` positions before each query are not candidates.
        options: other `DualDecoderConfig` cluster fields (`cluster_size`, `cluster_segment`).

    Returns:
        `{(ranking, factor): (Q·H_kv,) float32 recall}`.
    """
    n, count = keys.shape[2], queries.shape[2]
    kv_heads, dim = keys.shape[1], keys.shape[3]
    store = HostKVStore(1, kv_heads, dim, torch.float32, chunk_tokens=4096)
    store.reserve(n)
    store.append(keys, keys)
    config = DualDecoderConfig(selector="clusters", cluster_min_context=0, **options)
    index = ClusterSelector(config, budget, store, "cpu")
    index.extend(n, torch.zeros(1, dtype=torch.long))
    size, per_segment = config.cluster_size, config.cluster_segment // config.cluster_size
    group = queries.shape[1] // kv_heads
    out: dict[tuple[str, int], list[torch.Tensor]] = {(r, f): [] for r in RANKINGS for f in factors}
    try:
        for j in range(count):
            hi = n - count + j - window
            mask = torch.arange(hi)[None, :] >= n_sink
            query = queries[:, :, j]
            mass = group_attention_mass(query, store.key_chunks(hi), mask, scaling)  # (1, H_kv, hi)
            best = torch.topk(mass, min(budget, hi), dim=-1).values.sum(-1)
            clusters = min(hi // config.cluster_segment, int(index.segments[0])) * per_segment
            members = index.parts["members"][:, :, :clusters].long()  # (1, H_kv, clusters, size)
            tail = torch.arange(clusters * size, hi)
            scaled = query.reshape(1, kv_heads, group, dim) * scaling
            exists = torch.ones(1, kv_heads, clusters, dtype=torch.bool)
            member_keys = torch.gather(keys[:, :, :hi], 2, members.flatten(2)[..., None].expand(-1, -1, -1, dim))
            member_keys = member_keys.view(1, kv_heads, clusters, size, dim)
            means, variances = index.parts["means"][:, :, :clusters], index.parts["variances"][:, :, :clusters]
            scores = {"summary": index._combined_scores(scaled, [(means, variances)], exists),
                      "max": _largest_logit_scores(scaled, member_keys),
                      "codes": _largest_logit_scores(scaled, two_bit_keys(member_keys, means, variances))}
            for ranking, score in scores.items():
                for factor in factors:
                    keep = min(clusters, max(1, factor * budget // size))
                    top = torch.topk(score, keep, dim=-1).indices
                    picked = torch.gather(members, 2, top[..., None].expand(-1, -1, -1, size)).flatten(2)
                    positions = torch.cat([picked, tail.expand(1, kv_heads, -1)], dim=-1)
                    usable = torch.gather(mask[:, None, :].expand(1, kv_heads, hi), 2, positions)
                    indices, valid = select_in_shortlist(store, query, positions, usable, 0, budget, scaling)
                    out[ranking, factor].append(((torch.gather(mass, 2, indices) * valid).sum(-1) / best)[0])
    finally:
        index.free()
        store.free()
    return {key: torch.cat(values) for key, values in out.items()}


def _largest_logit_scores(scaled: torch.Tensor, member_keys: torch.Tensor) -> torch.Tensor:
    """`(1, H_kv, clusters)` score of each cluster: its members' largest logit per query head `scaled` `(1, H_kv, G,
    D)`, normalised by its log-sum-exp over the clusters and combined over the GQA group by log-sum-exp (as the index
    combines its summary scores); `member_keys` `(1, H_kv, clusters, size, D)` float32."""
    peak = torch.einsum("bhgd,bhcsd->bhgcs", scaled, member_keys).amax(-1)
    return torch.logsumexp(peak - torch.logsumexp(peak, dim=-1, keepdim=True), dim=2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_recording_arguments(parser, seeds="0")
    parser.add_argument("--factors", type=int, nargs="+", default=[8], help="cluster_factor values")
    parser.add_argument("--options", type=json.loads, default={},
                        help='cluster options as JSON, e.g. \'{"cluster_size": 8}\'')
    args = parser.parse_args(argv)
    try:
        seeds = check_recording_arguments(args)
        if min(args.factors) < 1:
            raise ValueError("--factors must be >= 1.")
        if not isinstance(args.options, dict) or set(args.options) - {"cluster_size", "cluster_segment"}:
            raise ValueError("--options takes a JSON object with cluster_size and/or cluster_segment.")
        try:
            DualDecoderConfig(selector="clusters", **args.options)
        except (TypeError, ValueError) as error:
            raise ValueError(f"--options: {error}") from None
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    results: dict[tuple[str, int], list[torch.Tensor]] = {}
    for _, queries, keys, scaling in recorded_layers(args, seeds):
        for key, recall in ranking_recalls(queries, keys, scaling, args.budget, args.factors, **args.options).items():
            results.setdefault(key, []).append(recall)
    rows = []
    for (ranking, factor), parts in results.items():
        recall = torch.cat(parts)
        rows.append({"ranking": ranking, "cluster_factor": factor, "options": args.options, **recall_summary(recall)})
    lines = [f"Recall of the exact top-{args.budget} attention mass by cluster ranking; {model_display_name(args.model)}, "
             f"word-needle prompts of {args.tokens} tokens, seeds {args.seeds}, the last {args.queries} prompt "
             f"positions' queries, full-attention layers {args.skip_layers}+ × KV heads; cluster options "
             f"{json.dumps(args.options) if args.options else 'default'}. `summary`: the index's own score; `max`: "
             "each cluster's largest member logit (an oracle reading every key); `codes`: that logit from 2-bit codes "
             "of each member's offset from its cluster mean (`two_bit_keys`).", "",
             "| ranking | cluster_factor | mean | p10 | min |", "|---|---|---|---|---|"]
    lines += [f"| {r['ranking']} | {r['cluster_factor']} | {r['mean']:.4f} | {r['p10']:.4f} | {r['min']:.4f} |"
              for r in rows]
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        write_rows_and_table(args.out, rows, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
