"""What tensor parallelism means for one rank's dual cache: which KV heads its attention sees (`TensorShard`).

transformers splits a model over `torch.distributed` ranks with `from_pretrained(..., distributed_config=
DistributedConfig(tp_size=N))` (or `tp_plan="auto"`) under `torchrun` (docs/design.md §9). With the usual plan the
query, key and value projections are split column-wise by heads, so each rank's attention sees `H_kv / N` KV heads
and `H_q / N` query heads, and the rank's `DualDecoderCache` stores, indexes and selects for those heads only, from
its own host store: no cross-rank traffic for selection. This module reads the shard a rank holds from the loaded
model (its `tp_plan` and TP size), so the cache can size its host-memory check for the shard and refuse what cannot
work (a plan that would cut a head in two) before any work. It knows nothing of the cache.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from .layer_types import check_attention_model

KEY_PROJECTIONS = ("k_proj", "key", "qkv_proj", "query_key_value", "c_attn", "Wqkv")
QUERY_PROJECTIONS = ("q_proj", "query", "qkv_proj", "query_key_value", "c_attn", "Wqkv")
HEAD_SPLITTING = ("colwise",)  # styles that split a projection's output evenly over the ranks (by features)
UNIT_SPLITTING = ("unit_colwise",)  # styles that give each rank whole heads, replicating them when too few


@dataclass(frozen=True)
class TensorShard:
    """The part of a model's attention one rank holds.

    Attributes:
        rank: this process's rank in the tensor-parallel group (0 without tensor parallelism).
        size: ranks in the tensor-parallel group (1: no tensor parallelism).
        kv_heads: KV heads this rank's attention sees, hence its cache stores (heads).
        model_kv_heads: KV heads of the whole model (heads).
        ranks_per_host: processes of the group on this host, which share its cores and its memory (the host-memory
            allowance and the retrieval threads of each rank are this fraction of the host's).
        group: the `torch.distributed` process group of the tensor-parallel ranks (None without them); not part of
            equality.
    """

    rank: int = 0
    size: int = 1
    kv_heads: int = 1
    model_kv_heads: int = 1
    ranks_per_host: int = 1
    group: Any = field(default=None, compare=False, repr=False)

    @property
    def sharded(self) -> bool:
        """Whether the model is split over several ranks."""
        return self.size > 1

    def any_rank(self, flags: torch.Tensor) -> torch.Tensor:
        """`flags` True where it is True on any rank of the group (a MAX all-reduce; every rank must call it at
        the same point). Decisions a single process takes over all KV heads — "the query drifted in any KV head"
        — are taken over every rank's heads so, and stay the same as in one process.

        Args:
            flags: `(B,)` bool, on the model's device (gloo: CPU; NCCL: CUDA).

        Returns:
            `(B,)` bool on the same device; `flags` itself without tensor parallelism.
        """
        if not self.sharded or self.group is None:
            return flags
        values = flags.to(torch.int32)
        torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return values.bool()

    def __deepcopy__(self, memo: dict) -> "TensorShard":
        return self  # immutable; its process group cannot be copied

    def describe(self) -> str:
        """`"rank 1 of 2 (1 of 2 KV heads)"`, or `"one process (2 KV heads)"`."""
        if not self.sharded:
            return f"one process ({self.kv_heads} KV heads)"
        return f"rank {self.rank} of {self.size} ({self.kv_heads} of {self.model_kv_heads} KV heads)"


def _text_config(config: Any) -> Any:
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def model_heads(config: Any) -> tuple[int, int]:
    """`(query heads, KV heads)` of a model config (its text config for multimodal ones).

    Raises:
        ValueError: the refusal of a model the dual cache cannot serve (`layer_types.check_attention_model`).
    """
    text = _text_config(config)
    check_attention_model(text)
    q_heads = text.num_attention_heads
    return q_heads, getattr(text, "num_key_value_heads", None) or q_heads


def head_dim_of(text_config: Any) -> int:
    """A model's attention head dim (`head_dim`, else `hidden_size / num_attention_heads`) from its text config."""
    return getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads


def whole_model(config: Any) -> TensorShard:
    """The shard of a model that is not split: every KV head on the one process."""
    _, kv_heads = model_heads(config)
    return TensorShard(kv_heads=kv_heads, model_kv_heads=kv_heads)


def tp_size_of(model: torch.nn.Module) -> int:
    """The tensor-parallel degree transformers gave `model` (1 when it was loaded without one)."""
    size = getattr(model, "_tp_size", None)
    return int(size) if size else 1


def _tp_rank_and_group(model: torch.nn.Module) -> tuple[int, Any]:
    """This process's rank in the model's tensor-parallel mesh and that mesh's process group."""
    mesh = getattr(model, "_device_mesh", None) or getattr(model, "device_mesh", None)
    if mesh is not None:
        names = getattr(mesh, "mesh_dim_names", None)
        if names and "tp" in names:
            return int(mesh["tp"].get_local_rank()), mesh["tp"].get_group()
        if mesh.ndim == 1:
            return int(mesh.get_local_rank()), mesh.get_group()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.group.WORLD
    return 0, None


def ranks_per_host(size: int) -> int:
    """Processes of this job on this host: `LOCAL_WORLD_SIZE` (set by `torchrun`), else `size` (one host)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    try:
        return max(1, int(local)) if local else max(1, size)
    except ValueError:
        return max(1, size)


def _style(plan: dict, names: tuple[str, ...]) -> str | None:
    """The plan's style for the first projection named in `names` (rules end with `.<name>`), or None."""
    for key, style in plan.items():
        if key.rsplit(".", 1)[-1] in names:
            return style
    return None


def _heads_per_rank(heads: int, style: str | None, size: int, what: str, model_name: str) -> int:
    if style is None or style not in HEAD_SPLITTING + UNIT_SPLITTING:
        return heads  # not split (replicated on every rank), or a style whose split we cannot read: see check_shard
    if style in UNIT_SPLITTING:
        return heads // math.gcd(heads, size)
    if heads % size:
        raise ValueError(
            f"{model_name} has {heads} {what} heads, which {size} tensor-parallel ranks cannot split evenly: its "
            f"tp_plan shards the {what} projection column-wise ('{style}'), so some rank would hold part of a head "
            f"(transformers loads it and the first forward fails). Use a rank count that divides {heads}, or a "
            "tp_plan that gives each rank whole heads ('unit_colwise' replicates them)."
        )
    return heads // size


def shard_of(model: torch.nn.Module) -> TensorShard:
    """The KV heads this rank of `model` holds, read from its tensor-parallel plan.

    Args:
        model: a transformers model, loaded with or without tensor parallelism.

    Returns:
        `whole_model(model.config)` without tensor parallelism; otherwise this rank's shard: `H_kv / N` KV heads
        for a plan that splits the key projection column-wise, `H_kv / gcd(H_kv, N)` for `unit_colwise`, all of
        them when the plan leaves the key projection whole.

    Raises:
        ValueError: when the plan splits query or KV heads column-wise over a rank count that does not divide
            them (transformers allows it, and the first forward fails deep inside the attention).
    """
    size = tp_size_of(model)
    q_heads, kv_heads = model_heads(model.config)
    if size <= 1:
        return TensorShard(kv_heads=kv_heads, model_kv_heads=kv_heads)
    plan = dict(getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None) or {})
    name = type(model).__name__
    _heads_per_rank(q_heads, _style(plan, QUERY_PROJECTIONS), size, "query", name)
    per_rank = _heads_per_rank(kv_heads, _style(plan, KEY_PROJECTIONS), size, "KV", name)
    rank, group = _tp_rank_and_group(model)
    return TensorShard(rank=rank, size=size, kv_heads=per_rank, model_kv_heads=kv_heads,
                       ranks_per_host=ranks_per_host(size), group=group)


def shard_of_model_or_config(model_or_config: Any) -> TensorShard:
    """`shard_of(model)` for a model, `whole_model(config)` for a config (which knows nothing of ranks)."""
    if isinstance(model_or_config, torch.nn.Module) and hasattr(model_or_config, "config"):
        return shard_of(model_or_config)
    return whole_model(model_or_config)


def adopt_shard(current: TensorShard, shard: TensorShard, stored: int, host_memory: Any) -> TensorShard:
    """The shard a cache holds after adopting `shard` (a tensor-parallel rank's, `shard_of`) in place of `current`,
    having stored `stored` tokens; sets `host_memory.ranks_per_host` (a `host.memory.HostMemory`, the cache's
    allowance) to the new shard's, so host-memory checks become this rank's.

    Raises:
        ValueError: when the cache already stores tokens of another number of KV heads.
    """
    if shard == current:
        return current
    if stored and shard.kv_heads != current.kv_heads:
        raise ValueError(
            f"This DualDecoderCache stores {current.kv_heads} KV heads per layer ({current.describe()}); the model "
            f"here is {shard.describe()}. Continue a cache on the rank (and tensor-parallel plan) that filled it."
        )
    host_memory.ranks_per_host = shard.ranks_per_host
    return shard


def load_kwargs(tp_size: int) -> dict[str, Any]:
    """Keyword arguments for `from_pretrained` that split a model over `tp_size` ranks with its own tensor-parallel
    plan (`DistributedConfig(tp_size=N)` where transformers has it, else the older `tp_plan="auto"`); `{}` for 1.

    Call it in every rank of a `torchrun` (or otherwise `torch.distributed`-initialised) job; transformers then
    initialises the process group (gloo on CPU, NCCL on CUDA) and binds each rank to its local device.

    Raises:
        ValueError: `tp_size` < 1.
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be an integer >= 1, got {tp_size!r}.")
    if tp_size == 1:
        return {}
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:  # older transformers
        return {"tp_plan": "auto", "tp_size": tp_size}
    return {"distributed_config": DistributedConfig(tp_size=tp_size)}
