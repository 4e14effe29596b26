"""Host-memory KV storage of one layer: every key and value of every sequence, appended in place."""

from __future__ import annotations

import torch


class HostKVStore:
    """Keys and values of one attention layer in host memory, shape `(B, H_kv, capacity, D)` each.

    Tokens are appended in place; capacity grows geometrically when exceeded (amortised O(1) per token) and is
    exact when the caller knows the final length up front (`capacity`). On machines with CUDA the storage is
    page-locked so host→device copies can run asynchronously.

    Args:
        batch_size: sequences B.
        kv_heads: key/value heads H_kv.
        head_dim: D.
        dtype: storage dtype (the model's K/V dtype).
        capacity: initial capacity in tokens.
        pin: allocate page-locked memory (only meaningful with CUDA available).

    Raises:
        ValueError: if a shape argument is not positive.
    """

    def __init__(
        self,
        batch_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        capacity: int,
        pin: bool = False,
    ) -> None:
        if min(batch_size, kv_heads, head_dim, capacity) <= 0:
            raise ValueError(
                f"HostKVStore needs positive sizes, got batch_size={batch_size}, kv_heads={kv_heads}, "
                f"head_dim={head_dim}, capacity={capacity}."
            )
        self.shape_prefix = (batch_size, kv_heads)
        self.head_dim = head_dim
        self.dtype = dtype
        self.pin = pin and torch.cuda.is_available()
        self.length = 0
        self.keys = self._alloc(capacity)
        self.values = self._alloc(capacity)

    def _alloc(self, capacity: int) -> torch.Tensor:
        return torch.empty(
            (*self.shape_prefix, capacity, self.head_dim), dtype=self.dtype, device="cpu", pin_memory=self.pin
        )

    @property
    def capacity(self) -> int:
        """Allocated tokens per (sequence, KV head)."""
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        """Allocated host bytes for keys and values together."""
        return self.keys.nbytes + self.values.nbytes

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append `keys`/`values` of shape `(B, H_kv, q, D)` (any device) at positions `[length, length + q)`."""
        q = keys.shape[2]
        if self.length + q > self.capacity:
            new_capacity = max(self.length + q, 2 * self.capacity)
            for name in ("keys", "values"):
                grown = self._alloc(new_capacity)
                grown[:, :, : self.length].copy_(getattr(self, name)[:, :, : self.length])
                setattr(self, name, grown)
        self.keys[:, :, self.length : self.length + q].copy_(keys)
        self.values[:, :, self.length : self.length + q].copy_(values)
        self.length += q

    def crop(self, n_tokens: int) -> None:
        """Forget the last `n_tokens` tokens (their memory is reused by the next append)."""
        if not 0 <= n_tokens <= self.length:
            raise ValueError(f"Cannot crop {n_tokens} tokens from a store holding {self.length}.")
        self.length -= n_tokens

    def gather(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at `indices` (B, H_kv, k) int64 positions → two `(B, H_kv, k, D)` host tensors."""
        index = indices.unsqueeze(-1).expand(*indices.shape, self.head_dim)
        return torch.gather(self.keys, 2, index), torch.gather(self.values, 2, index)
